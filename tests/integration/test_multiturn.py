"""Multi-turn chats (``workload.shares_output``) on vLLM 0.33.0, judged exactly.

The next turn copies its source's prompt and answer; the oracle owes it the
blocks the source completed while decoding (``differential/oracle/core.py``
``writer_extent``, ``differential/oracle/state.py`` ``decode_states``).
Exact hits from real runs, in manager mode and through vLLM's
``Scheduler``, with the dense cross-check; the hand-worked counterparts
are in ``tests/unit/test_multiturn_oracle.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from differential.compare import compare_variants, in_mode
from differential.corpus import load_entry
from differential.exports.manager_test import export_test
from differential.findings import Finding, FindingKind
from differential.oracle import drafter_model, references
from differential.scenario import (
    Drafter,
    DrafterKind,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
    Workload,
)
from differential.variants import parse_variants
from tests.factories import CORPORA, python_module

pytestmark = pytest.mark.vllm

UNFIXED = parse_variants("unfixed")
MODES = (DriveMode.MANAGER, DriveMode.SCHEDULER)


def chat(
    groups: tuple[KVCacheGroup, ...],
    prompt: int,
    decode_steps: int,
    copied: int,
    own: int,
    **options: object,
) -> Scenario:
    """Turn 1 (``prompt`` tokens, ``decode_steps + 1`` sampled), turn 2 (its
    first ``copied`` tokens of turn 1's prompt and answer, ``own`` more)."""
    return Scenario(
        kv_cache_groups=groups,
        requests=(RequestSpec(0, prompt), RequestSpec(copied, own, shares_with=0)),
        shared_prefix_tokens=0,
        decode_steps=decode_steps,
        workload=Workload(shares_output=True),
        **options,  # type: ignore[arg-type]
    )


def judged(scenario: Scenario, mode: DriveMode) -> tuple[tuple[int, ...], list[int], list[str]]:
    """(hits, dense references, findings) of ``scenario`` on stock vLLM in ``mode``."""
    result = compare_variants(in_mode(scenario, mode), UNFIXED)
    (variant,) = result.results
    return (
        variant.run.hits,
        [r.dense_tokens for r in variant.references],
        [f.summary() for f in result.findings],
    )


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_corpus_chat_reuses_the_decoded_block(mode: DriveMode) -> None:
    # An 80-token prompt and 40 decode steps: 120 tokens computed, blocks of
    # 32, so turn 2 reuses [0, 96), the third block decoded.
    scenario = load_entry(CORPORA / "cases" / "multi-turn-decoded-blocks.json").scenario
    assert judged(scenario, mode) == ((0, 96), [0, 96], [])


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize(
    ("drafter", "lookahead", "hit"),
    [
        (Drafter(), True, 48),
        (Drafter(DrafterKind.EAGLE, 1), True, 48),
        (Drafter(DrafterKind.MULTI_MODULE_MTP, 2), True, 32),
        (Drafter(DrafterKind.EAGLE, 1), False, 32),
    ],
    ids=["no-drafter", "eagle-lookahead-1", "mtp2-lookahead-2", "eagle-drop"],
)
def test_the_last_decoded_block_waits_for_its_lookahead_tokens(
    mode: DriveMode, drafter: Drafter, lookahead: bool, hit: int
) -> None:
    # A 40-token prompt, 8 decode steps, all 49 tokens copied by turn 2: the
    # block [32, 48) is completed while decoding; its hash needs token 48 (one
    # lookahead token: the last sampled one, appended before the free) or 49
    # (two: never sampled); the drop recomputes it as the peek block.
    scenario = chat(
        (KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
        40,
        8,
        49,
        10,
        drafter=drafter,
        disable_lookahead_block_hashes=not lookahead,
        prefill_chunk_tokens=64,
    )
    assert judged(scenario, mode) == ((0, hit), [0, hit], [])


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_sparse_retention_keeps_the_prompts_replay_boundary_for_the_next_turn(
    mode: DriveMode,
) -> None:
    # FA 8 + SWA 4 (window 16), retention 0: the next turn is owed the
    # source's replay boundary 96; the dense cross-check run reuses all 120
    # tokens the source computed (prompt 100 + 20 decoded).
    scenario = chat(
        (
            KVCacheGroup(GroupKind.FULL_ATTENTION, 8),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 16),
        ),
        100,
        20,
        121,
        10,
        retention_interval_tokens=0,
        prefill_chunk_tokens=128,
    )
    result = compare_variants(in_mode(scenario, mode), UNFIXED)
    (variant,) = result.results
    assert variant.run.hits == (0, 96)
    assert [(r.dense_tokens, r.expected_tokens) for r in variant.references] == [
        (0, 0),
        (120, 96),
    ]
    assert variant.dense_run is not None and variant.dense_run.hits == (0, 120)
    assert result.findings == ()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_mamba_state_kept_while_decoding(mode: DriveMode) -> None:
    # FA 16 + Mamba 16: the source's 17 decode steps pass 48, whose state
    # block is kept; three-module MTP loses it (its hash needs token 51).
    scenario = chat(
        (KVCacheGroup(GroupKind.FULL_ATTENTION, 16), KVCacheGroup(GroupKind.MAMBA, 16)),
        40,
        17,
        58,
        5,
        prefill_chunk_tokens=64,
    )
    assert judged(scenario, mode) == ((0, 48), [0, 48], [])
    mtp3 = dataclasses.replace(scenario, drafter=Drafter(DrafterKind.MULTI_MODULE_MTP, 3))
    assert judged(mtp3, DriveMode.MANAGER) == ((0, 32), [0, 32], [])


@pytest.mark.parametrize(
    "name", ["multi-turn-decoded-blocks", "multi-turn-decoded-blocks--two-lookahead-tokens"]
)
def test_the_exported_manager_test_replays_the_chat(tmp_path: Path, name: str) -> None:
    # The manager-mode export builds turn 2 from turn 1's prompt and answer
    # and appends the answer as the driver does, so on stock vLLM it hits
    # exactly what the oracle owes.
    scenario = load_entry(CORPORA / "cases" / f"{name}.json").scenario
    owed = references(scenario, drafter_model(scenario), [0, 0])[1]
    finding = Finding(
        FindingKind.FALLBACK, "v", 1, "", expected_tokens=owed.expected_tokens, hit_tokens=0
    )
    source = export_test(
        scenario, finding, owed, signature="s", name="chat", fixed_hit_tokens=owed.expected_tokens
    )
    assert f"assert hits[1] == {owed.expected_tokens}" in source
    test_file = tmp_path / "test_exported_chat.py"
    test_file.write_text(source)
    stock = python_module("pytest", "-q", "-p", "no:cacheprovider", str(test_file), cwd=tmp_path)
    assert stock.returncode == 0, stock.stdout[-1500:]

"""The block-level check (``wrong-kv``) in scheduler mode, on vLLM 0.33.0's real ``Scheduler``.

The check has teeth there: a calibration mutant handing out the null block
inside the window, an in-process patch that corrupts a running request's
block table, and one that hands a block another running request holds to a
second request (its reference count left at 1), are each caught with the
exact finding; and every scheduler-mode
case of the corpus, and every seed through the Scheduler, stays clean.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from differential.compare import compare_variants, in_mode
from differential.corpus import load_entry
from differential.findings import FindingKind
from differential.scenario import DriveMode
from differential.variants import parse_variants
from tests.factories import CORPORA
from tests.integration.test_scheduler_mode import _concurrent

pytestmark = pytest.mark.vllm

SCHEDULER_CASES = sorted(
    p
    for p in (CORPORA / "cases").glob("*.json")
    if load_entry(p).scenario.workload.mode is DriveMode.SCHEDULER
)
SEEDS = sorted((CORPORA / "seeds").glob("*.json"))


def _wrong_kv(result: Any) -> list[tuple[str, int | None, str]]:
    return [
        (f.variant, f.request, f.detail) for f in result.findings if f.kind is FindingKind.WRONG_KV
    ]


def test_null_in_window_mutant_is_wrong_kv_on_a_concurrent_workload() -> None:
    # Four two-turn sessions, two in flight at a time, EAGLE drafts accepted
    # 1, 0, 2, ...: each second turn hits 40 or 48 tokens (FA block 8, SWA
    # block 4, window 8). The mutant hands out the null block for the SWA
    # block just below the hit, inside the window the hit's attention reads.
    scenario = _concurrent(200, 5, (0, 0, 1, 1, 6, 6, 7, 7), 4)
    result = compare_variants(scenario, parse_variants("fixed,mutant-null-in-window"))
    fixed, mutant = result.results
    assert fixed.run.blocks_recorded and mutant.run.blocks_recorded
    assert fixed.run.hits == mutant.run.hits == (0, 0, 0, 0, 40, 40, 48, 48)
    assert not [f for f in fixed.findings if f.kind is FindingKind.WRONG_KV]
    window = "is the null block, inside the tokens"
    assert _wrong_kv(result) == [
        ("mutant-null-in-window", 4, f"group 1 block index 9 {window} 32..40 attention reads"),
        ("mutant-null-in-window", 5, f"group 1 block index 9 {window} 32..40 attention reads"),
        ("mutant-null-in-window", 6, f"group 1 block index 11 {window} 40..48 attention reads"),
        ("mutant-null-in-window", 7, f"group 1 block index 11 {window} 40..48 attention reads"),
    ]
    by_request = {f.request: f for f in mutant.findings if f.kind is FindingKind.WRONG_KV}
    # The finding carries the lookup's block ids per group: the null block
    # (None) where block index 9 of the SWA group should be real.
    assert by_request[4].blocks_per_group[1][8:] == (15, None)


def _after_request_5s_first_step(
    monkeypatch: pytest.MonkeyPatch, change: Callable[[Any], int]
) -> list[int]:
    """Patch ``KVCacheManager.allocate_slots`` so that right after request 5's
    first successful step ``change(manager)`` alters the block tables (once);
    the returned list receives the block id ``change`` returns."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    real = KVCacheManager.allocate_slots
    changed: list[int] = []

    @functools.wraps(real)
    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, request, *args, **kwargs)
        if request.request_id == "req-5" and out is not None and not changed:
            changed.append(change(self))
        return out

    monkeypatch.setattr(KVCacheManager, "allocate_slots", allocate_slots)
    return changed


@pytest.fixture
def corrupted_block_table(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """``KVCacheManager.allocate_slots`` that, on request 5's first step, puts
    vLLM's null block at block index 5 of its full-attention block table,
    where that step writes (a block table another bookkeeping bug left
    wrong). Yields the replaced block ids."""

    def corrupt(manager: Any) -> int:
        table = manager.coordinator.single_type_managers[0].req_to_blocks["req-5"]
        replaced: int = table[5].block_id
        table[5] = manager.block_pool.null_block
        return replaced

    yield _after_request_5s_first_step(monkeypatch, corrupt)


def test_a_write_into_the_null_block_is_wrong_kv(corrupted_block_table: list[int]) -> None:
    scenario = _concurrent(200, 5, (0, 0, 1, 1, 6, 6, 7, 7), 4)
    result = compare_variants(scenario, parse_variants("unfixed"))
    assert len(corrupted_block_table) == 1
    assert result.results[0].run.hits == (0, 0, 0, 0, 40, 40, 48, 48)
    # Request 5 (session 1's second turn, hit 40) writes tokens 40.. into
    # block index 5 at its first step and at the next one.
    assert _wrong_kv(result) == [
        (
            "unfixed",
            5,
            "the step at 40 tokens writes group 0 block index 5 (block 0), "
            "the null block (+1 more)",
        )
    ]


@pytest.fixture
def doubly_allocated_block(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """``KVCacheManager.allocate_slots`` that, on request 5's first step, puts
    request 4's last full-attention block (the one request 4 is still
    writing) at block index 5 of request 5's table, leaving the reference
    count at 1 (a block handed out twice by a bookkeeping bug). Yields the
    block id."""

    def double(manager: Any) -> int:
        tables = manager.coordinator.single_type_managers[0].req_to_blocks
        block = tables["req-4"][-1]
        tables["req-5"][5] = block
        shared: int = block.block_id
        return shared

    yield _after_request_5s_first_step(monkeypatch, double)


def test_a_write_into_a_block_another_request_holds_is_wrong_kv(
    doubly_allocated_block: list[int],
) -> None:
    # Requests 4 and 5 (the second turns of sessions 0 and 1) run together;
    # request 5 hits 40 and its first step writes tokens 40.. into request 4's
    # block index 6 (tokens 48..56 of request 4, which is still decoding into
    # it). The reference count stays 1, so only the block tables show it: both
    # requests' writes into the block are flagged.
    scenario = _concurrent(200, 5, (0, 0, 1, 1, 6, 6, 7, 7), 4)
    result = compare_variants(scenario, parse_variants("unfixed"))
    (block,) = doubly_allocated_block
    assert result.results[0].run.hits == (0, 0, 0, 0, 40, 40, 48, 48)
    assert _wrong_kv(result) == [
        (
            "unfixed",
            4,
            f"the step at 54 tokens writes group 0 block index 6 (block {block}), "
            "which request 5's block table holds (ref_cnt 1) (+1 more)",
        ),
        (
            "unfixed",
            5,
            f"the step at 40 tokens writes group 0 block index 5 (block {block}), "
            "which request 4's block table holds (ref_cnt 1) (+1 more)",
        ),
    ]


@pytest.mark.parametrize("path", SCHEDULER_CASES, ids=lambda p: p.name)
def test_scheduler_mode_cases_are_clean_block_by_block(path: Path) -> None:
    scenario = load_entry(path).scenario
    result = compare_variants(scenario, parse_variants("unfixed,fixed,candidate"))
    for vr in result.results:
        assert vr.run.blocks_recorded, vr.variant.name
        assert all(len(r.lookup_blocks) == len(scenario.kv_cache_groups) for r in vr.run.requests)
    assert _wrong_kv(result) == []


def test_seeds_through_the_scheduler_are_clean_block_by_block() -> None:
    for path in SEEDS:
        scenario = in_mode(load_entry(path).scenario, DriveMode.SCHEDULER)
        result = compare_variants(scenario, parse_variants("unfixed,fixed"))
        assert all(vr.run.blocks_recorded for vr in result.results), path.name
        assert _wrong_kv(result) == [], path.name


# Six requests of two sessions, all arriving at step 0 (four in flight), on
# FA 16 + SWA 8 (window 32) + Mamba 16 with 8-token hash blocks: fine-grained
# hits that end inside a full-attention block get a copy-on-write block, here
# a block another request had used and freed earlier in the run.
COPY_ON_WRITE_CASE = {
    "format": "kvfuzz.scenario",
    "version": 1,
    "name": "cow-copy-into-a-reused-block",
    "kv_cache_groups": [
        {"kind": "full_attention", "block_size_tokens": 16},
        {"kind": "sliding_window", "block_size_tokens": 8, "sliding_window_tokens": 32},
        {"kind": "mamba", "block_size_tokens": 16},
    ],
    "hash_block_size_tokens": 8,
    "retention_interval_tokens": None,
    "drafter": {"kind": "none", "num_speculative_tokens": 0},
    "disable_lookahead_block_hashes": True,
    "prefill_chunk_tokens": 16,
    "decode_steps": 0,
    "shared_prefix_tokens": 8,
    "requests": [
        {"name": "s0t1", "divergence_tokens": 0, "suffix_tokens": 36},
        {"name": "s1t1", "divergence_tokens": 0, "suffix_tokens": 31},
        {"name": "s0t2", "shares_with": 0, "divergence_tokens": 36, "suffix_tokens": 8},
        {"name": "s1t2", "shares_with": 1, "divergence_tokens": 31, "suffix_tokens": 16},
        {"name": "s0t3", "shares_with": 2, "divergence_tokens": 44, "suffix_tokens": 9},
        {"name": "s1t3", "shares_with": 3, "divergence_tokens": 47, "suffix_tokens": 16},
    ],
    "workload": {
        "mode": "scheduler",
        "pool_blocks": 70,
        "arrival_steps": [0, 0, 0, 0, 0, 0],
        "max_num_seqs": 4,
        "max_num_batched_tokens": 32,
    },
}


def test_a_copy_on_write_block_that_was_reused_holds_the_hit_tokens(tmp_path: Path) -> None:
    # Regression: the ledger took the copy-on-write block of request 3's
    # 24-token hit (block index 1 of full attention) for a fresh block holding
    # only the 8 tokens request 3 then wrote, because that block id had held
    # another request's KV before; request 5 then hit it (40 tokens) and got a
    # false wrong-kv ("8 token(s) written; a hit needs 16").
    path = tmp_path / "case.json"
    path.write_text(json.dumps(COPY_ON_WRITE_CASE))
    result = compare_variants(load_entry(path).scenario, parse_variants("unfixed"))
    run = result.results[0].run
    assert run.hits == (0, 0, 32, 24, 40, 40)
    assert run.blocks_recorded
    assert _wrong_kv(result) == []

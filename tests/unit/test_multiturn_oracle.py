"""The oracle on multi-turn chats (``workload.shares_output``), hand-worked (no vLLM).

A later turn copies its source's prompt and the ``decode_steps + 1`` tokens
the source sampled; the source cached its prompt's blocks and the blocks it
completed while decoding, up to ``L + decode_steps`` computed tokens and
hashes over ``L + decode_steps + 1 - k`` tokens (``k`` lookahead tokens).
The real runs behind these numbers are in
``tests/integration/test_multiturn.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from differential.corpus import finding_tag
from differential.exports.manager_test import export_test
from differential.findings import Finding, FindingKind, Policy
from differential.observation import ManagerSettings, RequestObservation, RunObservation
from differential.oracle import (
    cross_check_dense,
    dense_hit,
    divergence_points,
    drafter_model,
    judge_run,
    references,
    writer_extent,
)
from differential.oracle.prefix import shared_prefixes, written_contents
from differential.oracle.state import decode_states, state_positions
from differential.scenario import (
    Drafter,
    DrafterKind,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
    Workload,
)

CHAT = Workload(shares_output=True)


def chat(
    groups: tuple[KVCacheGroup, ...],
    prompt: int,
    decode_steps: int,
    copied: int,
    own: int,
    *,
    drafter: Drafter | None = None,
    lookahead: bool = True,
    retention: int | None = None,
    prefill_chunk: int = 2048,
) -> Scenario:
    """Turn 1: a ``prompt``-token prompt answered in ``decode_steps + 1``
    tokens; turn 2: its first ``copied`` tokens of turn 1's prompt and
    answer, then ``own`` tokens of its own."""
    return Scenario(
        kv_cache_groups=groups,
        requests=(RequestSpec(0, prompt), RequestSpec(copied, own, shares_with=0)),
        shared_prefix_tokens=0,
        drafter=drafter or Drafter(),
        disable_lookahead_block_hashes=not lookahead,
        decode_steps=decode_steps,
        retention_interval_tokens=retention,
        prefill_chunk_tokens=prefill_chunk,
        workload=CHAT,
    )


def observed(hits: list[int], settings: ManagerSettings) -> RunObservation:
    return RunObservation(
        variant="v",
        vllm_version="test",
        settings=settings,
        requests=tuple(RequestObservation(i, 0, h, 0, (h,), (0,)) for i, h in enumerate(hits)),
    )


FA16 = (KVCacheGroup(GroupKind.FULL_ATTENTION, 16),)
FA32 = (KVCacheGroup(GroupKind.FULL_ATTENTION, 32),)
PLAIN32 = ManagerSettings(False, 0, 0, 0, 32)


def test_the_next_turn_shares_the_prompt_and_the_answer() -> None:
    # Turn 1: 80 tokens, 40 decode steps, so 41 sampled tokens; turn 2 copies
    # all 121 and adds 16 (corpora/cases/multi-turn-decoded-blocks.json).
    scenario = chat(FA32, 80, 40, 121, 16)
    assert written_contents(scenario)[0] == scenario.prompts[0] + scenario.sampled_tokens(0)
    assert scenario.prompts[1][:121] == written_contents(scenario)[0]
    assert shared_prefixes(scenario) == [[], [121]]
    assert divergence_points(scenario) == (0, 121)
    # Without shares_output the same shapes share the prompt only, 80 tokens.
    plain = dataclasses.replace(
        scenario,
        requests=(scenario.requests[0], RequestSpec(80, 16, shares_with=0)),
        workload=Workload(),
    )
    assert shared_prefixes(plain) == [[], [80]]


def test_the_source_cached_its_decoded_blocks_up_to_its_computed_tokens() -> None:
    # Computed: the prompt and 40 of the 41 sampled tokens (the last one's KV
    # is never computed), 120; hashed: all 121 tokens. Blocks of 32: the
    # third block [64, 96) was completed while decoding, [96, 128) was not.
    scenario = chat(FA32, 80, 40, 121, 16)
    model = drafter_model(scenario)
    assert writer_extent(scenario, model, 0) == (120, 120, 121)
    assert dense_hit(scenario, model, 1, 0, 121) == 96
    refs, findings = judge_run(scenario, observed([0, 96], PLAIN32))
    assert [(r.divergence_tokens, r.dense_tokens, r.expected_tokens) for r in refs] == [
        (0, 0, 0),
        (121, 96, 96),
    ]
    assert findings == ()
    # Reusing one decoded block less is a fallback; one more, an over-hit
    # (block [96, 128) holds the uncomputed 121st token and the turn's own).
    _, short = judge_run(scenario, observed([0, 64], PLAIN32))
    assert [finding_tag(f) for f in short] == ["fallback@1"]
    assert (short[0].expected_tokens, short[0].hit_tokens) == (96, 64)
    _, over = judge_run(scenario, observed([0, 128], PLAIN32))
    assert "over-hit@1" in [finding_tag(f) for f in over]
    # The dense cross-check judges such runs too.
    assert cross_check_dense(scenario, observed([0, 96], PLAIN32)) == ()
    (mismatch,) = cross_check_dense(scenario, observed([0, 64], PLAIN32))
    assert mismatch.kind is FindingKind.DENSE_MISMATCH and mismatch.expected_tokens == 96


@pytest.mark.parametrize(
    ("drafter", "lookahead", "owed"),
    [
        # No drafter: 48 computed, block [32, 48) completed at the 8th step.
        (Drafter(), True, 48),
        # EAGLE, one lookahead token: block [32, 48)'s hash reads token 48,
        # the last sampled one, appended before the source is freed.
        (Drafter(DrafterKind.EAGLE, 1), True, 48),
        # Two-module MTP, two lookahead tokens: [32, 48) waits for token 49,
        # which is never sampled; its draft KV is final at 47 only.
        (Drafter(DrafterKind.MULTI_MODULE_MTP, 2), True, 32),
        # EAGLE with the drop: [32, 48) is cached, and dropped as the peek block.
        (Drafter(DrafterKind.EAGLE, 1), False, 32),
    ],
)
def test_lookahead_and_the_drop_on_decoded_blocks(
    drafter: Drafter, lookahead: bool, owed: int
) -> None:
    # A 40-token prompt, 8 decode steps (9 sampled tokens: 49 in all), all
    # copied by turn 2 with 10 tokens of its own.
    scenario = chat(FA16, 40, 8, 49, 10, drafter=drafter, lookahead=lookahead)
    refs = references(scenario, drafter_model(scenario), [0, owed])
    assert (refs[1].dense_tokens, refs[1].expected_tokens) == (owed, owed)


def test_a_turn_that_copies_part_of_the_answer() -> None:
    # Turn 2 copies the prompt and 4 sampled tokens (44), then its own: its
    # last shared block is [16, 32); [32, 48) holds tokens it does not share.
    scenario = chat(FA16, 40, 8, 44, 10)
    assert divergence_points(scenario) == (0, 44)
    assert references(scenario, drafter_model(scenario), [0, 32])[1].dense_tokens == 32


def test_sparse_retention_owes_the_sources_replay_boundary_not_its_answer() -> None:
    # FA 8 + SWA 4 (window 16), retention 0, no drafter. The source's 100
    # prompt tokens and 20 decoded ones are all cached in full attention, but
    # the sliding window keeps its tail only at the prompt's replay boundary
    # (vLLM replay_boundaries(num_prompt_tokens): 99 -> 96), so the next turn
    # is owed 96 (the one-unit rule also promises 88) of a dense 120.
    groups = (
        KVCacheGroup(GroupKind.FULL_ATTENTION, 8),
        KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 16),
    )
    scenario = chat(groups, 100, 20, 121, 10, retention=0)
    refs = references(scenario, drafter_model(scenario), [0, 96])
    assert (refs[1].dense_tokens, refs[1].expected_tokens) == (120, 96)
    assert refs[1].checkpoints == (0, 88, 96)
    settings = ManagerSettings(False, 0, 0, 0, 8)
    assert judge_run(scenario, observed([0, 96], settings))[1] == ()
    _, gap = judge_run(scenario, observed([0, 96], settings), Policy.IDEAL)
    assert [finding_tag(f) for f in gap] == ["design-gap@1"]


def test_mamba_states_kept_while_decoding() -> None:
    # FA 16 + Mamba 16, a 40-token prompt in one chunk of 64 (vLLM's
    # scheduler ends it at 32 and 40), 17 decode steps: the running state
    # passes 48 and its block keeps it (56 is not on the grid, 64 is past
    # the 57 computed tokens).
    groups = (KVCacheGroup(GroupKind.FULL_ATTENTION, 16), KVCacheGroup(GroupKind.MAMBA, 16))
    scenario = chat(groups, 40, 17, 58, 5, prefill_chunk=64)
    model = drafter_model(scenario)
    assert decode_states(scenario, 0, 0, 0) == (48,)
    assert state_positions(scenario, 0, 0, 0, False, 0, 0) == (32, 48)
    refs = references(scenario, model, [0, 48])
    assert (refs[1].dense_tokens, refs[1].expected_tokens) == (48, 48)
    # Three-module MTP (three lookahead tokens, a two-token re-prefill tail):
    # the hash of the block ending at 48 needs token 51, two steps after
    # the step that completes it, and the next step but one frees that
    # state block first (MambaManager.remove_skipped_blocks): lost.
    mtp3 = dataclasses.replace(scenario, drafter=Drafter(DrafterKind.MULTI_MODULE_MTP, 3))
    assert decode_states(mtp3, 0, 3, 2) == ()
    assert references(mtp3, drafter_model(mtp3), [0, 32])[1].dense_tokens == 32
    # The source's last computed position keeps its state only when nothing
    # is held back: 8 decode steps end at 48, kept without a drafter, lost
    # with two lookahead tokens.
    short = dataclasses.replace(
        scenario, decode_steps=8, requests=(scenario.requests[0], RequestSpec(49, 5, shares_with=0))
    )
    assert decode_states(short, 0, 0, 0) == (48,)
    assert decode_states(short, 0, 2, 1) == ()


def test_the_manager_export_builds_later_turns_with_the_answer() -> None:
    scenario = chat(FA32, 80, 40, 121, 16)
    ref = references(scenario, drafter_model(scenario), [0, 0])[1]
    finding = Finding(FindingKind.FALLBACK, "v", 1, "", expected_tokens=96, hit_tokens=64)
    source = export_test(scenario, finding, ref, signature="s", name="chat", fixed_hit_tokens=96)
    assert "base = prefix if source is None else prompts[source] + answers[source]" in source
    # The answer is kvfuzz's sampled stream, the last token appended too.
    assert scenario.output_token(0, 0) == 1_500_000
    assert "[1_500_000 + 1_000_000 * index + k for k in range(41)]" in source
    assert "request.append_output_token_ids(answers[index][40])" in source
    assert "assert hits[1] == 96" in source

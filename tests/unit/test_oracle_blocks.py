"""The block-level check on hand-worked cases (no vLLM).

Geometry for all cases: full attention block 8, sliding window 16 with block
4, a 64-token shared prefix, request 0 writes it and request 1 shares 48
tokens then diverges. Request 1's hit is 48 tokens: 6 full-attention blocks
(indices 0..5) and 12 SWA blocks (indices 0..11), of which the window
``[48 - 16 + 1, 48) = [33, 48)`` reads indices 8..11.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from differential.findings import SEVERITY, Finding, FindingKind
from differential.observation import (
    BlockRecord,
    BlockWrite,
    ManagerSettings,
    RequestObservation,
    RunObservation,
    StepTable,
)
from differential.oracle import judge_run
from differential.oracle.blocks import (
    TokenView,
    ViolationKind,
    check_blocks,
    render_blocks,
    request_violations,
    state_group_violations,
    table_violations,
)
from differential.scenario import DrafterKind, GroupKind, KVCacheGroup, RequestSpec, Scenario
from tests.factories import hybrid

SCENARIO = hybrid(
    8,
    4,
    16,
    prefix=64,
    requests=(RequestSpec(64, 8), RequestSpec(48, 8)),
    retention=None,
    drafter=DrafterKind.NONE,
    chunk=64,
    decode_steps=2,
)
HIT = 48


def written(group: int, index: int, block_id: int, size: int, writer: int = 0) -> BlockRecord:
    return BlockRecord(block_id, group, writer, index, size)


def good_lookup() -> tuple[tuple[BlockRecord | None, ...], ...]:
    full = tuple(written(0, k, 100 + k, 8) for k in range(6))
    swa = tuple(None if k < 8 else written(1, k, 200 + k, 4) for k in range(12))
    return (full, swa)


def run_with(lookup, writes=()) -> RunObservation:
    return RunObservation(
        variant="v",
        vllm_version="test",
        settings=ManagerSettings(False, 0, 0, 0, 8),
        requests=(
            RequestObservation(0, 72, 0, 0, (0, 0), (9, 18), lookup_blocks=((), ())),
            RequestObservation(
                1, 56, HIT, 0, (HIT, HIT), (0, 0), lookup_blocks=lookup, unsafe_writes=writes
            ),
        ),
        blocks_recorded=True,
    )


def kinds(lookup, writes=()) -> list[tuple[ViolationKind, int, int]]:
    obs = run_with(lookup, writes).requests[1]
    return [
        (v.kind, v.group, v.block_index)
        for v in request_violations(SCENARIO, obs, TokenView(SCENARIO))
    ]


def test_right_blocks_are_clean() -> None:
    assert kinds(good_lookup()) == []
    _, findings = judge_run(SCENARIO, run_with(good_lookup()))
    assert findings == ()


def test_null_block_inside_the_window() -> None:
    full, swa = good_lookup()
    # Index 7 (tokens 28..32) lies below the window: a null block there is fine.
    assert kinds((full, (*swa[:7], None, *swa[8:]))) == []
    # Index 8 (tokens 32..36) is read by the next token's attention (from 33 on).
    assert kinds((full, (*swa[:8], None, *swa[9:]))) == [(ViolationKind.NULL_IN_WINDOW, 1, 8)]
    assert kinds((full, (*swa[:11], None))) == [(ViolationKind.NULL_IN_WINDOW, 1, 11)]
    # Full attention reads everything.
    assert kinds(((None, *full[1:]), swa)) == [(ViolationKind.NULL_IN_WINDOW, 0, 0)]


def test_blocks_below_the_window_are_not_read() -> None:
    full, swa = good_lookup()
    # A real block below the window holding other tokens is never attended.
    below = (*swa[:3], written(1, 9, 203, 4), *swa[4:])
    assert kinds((full, below)) == []
    # The same block inside the window is foreign.
    inside = (*swa[:9], written(1, 8, 209, 4), *swa[10:])
    assert kinds((full, inside)) == [(ViolationKind.FOREIGN, 1, 9)]


def test_extra_block_past_the_hit() -> None:
    full, swa = good_lookup()
    extra = (*full, written(0, 6, 106, 8))
    assert kinds((extra, swa)) == [(ViolationKind.COUNT, 0, 6)]
    assert kinds((full[:5], swa)) == [(ViolationKind.COUNT, 0, 5)]


def test_block_holding_other_tokens() -> None:
    full, swa = good_lookup()
    # Request 0's block 6 holds its tokens 48..56, not tokens 40..48.
    moved = ((*full[:5], written(0, 6, 106, 8)), swa)
    assert kinds(moved) == [(ViolationKind.FOREIGN, 0, 5)]
    # A block written for the SWA group handed out in the full-attention group.
    other_group = ((*full[:5], written(1, 5, 106, 8)), swa)
    assert kinds(other_group) == [(ViolationKind.FOREIGN, 0, 5)]
    # Written by the sibling itself (a later request): not an earlier writer's KV.
    own = ((*full[:5], written(0, 5, 105, 8, writer=1)), swa)
    assert kinds(own) == [(ViolationKind.FOREIGN, 0, 5)]
    half = ((*full[:5], written(0, 5, 105, 5)), swa)
    assert kinds(half) == [(ViolationKind.UNWRITTEN, 0, 5)]
    never = ((*full[:5], BlockRecord(105, None, None, None, 0)), swa)
    assert kinds(never) == [(ViolationKind.UNWRITTEN, 0, 5)]


def test_request_own_suffix_differs_from_writer() -> None:
    # Request 1 shares 48 tokens with request 0's prompt; its tokens 48..56
    # are its own, so a block holding request 0's tokens there is foreign.
    scenario = SCENARIO
    tokens = TokenView(scenario)
    assert tokens.agreed_tokens(0, 1) == 48
    assert tokens.written(0)[64:] == (
        (*scenario.prompts[0][64:], scenario.output_token(0, 0), scenario.output_token(0, 1))
    )


def test_unsafe_write() -> None:
    write = BlockWrite(48, 0, 6, 77, 2, cached=True, null=False)
    assert kinds(good_lookup(), (write,)) == [(ViolationKind.UNSAFE_WRITE, 0, 6)]


def test_wrong_kv_finding_is_most_severe_and_round_trips() -> None:
    full, swa = good_lookup()
    _, findings = judge_run(SCENARIO, run_with((full, (*swa[:11], None))))
    assert [f.kind for f in findings] == [FindingKind.WRONG_KV]
    finding = findings[0]
    assert finding.request == 1
    assert finding.detail == (
        "group 1 block index 11 is the null block, inside the tokens 32..48 attention reads"
    )
    assert finding.blocks_per_group == (
        (100, 101, 102, 103, 104, 105),
        (None,) * 8 + (208, 209, 210, None),
    )
    assert Finding.from_dict(json.loads(json.dumps(finding.to_dict()))) == finding
    # Only the engine's wrong-output (outputs that differ from a cache-off
    # run) ranks above wrong-kv.
    assert min(SEVERITY, key=SEVERITY.__getitem__) is FindingKind.WRONG_OUTPUT
    assert SEVERITY[FindingKind.WRONG_OUTPUT] < SEVERITY[FindingKind.WRONG_KV]
    assert SEVERITY[FindingKind.WRONG_KV] < SEVERITY[FindingKind.OVER_HIT]


def test_observation_round_trip_and_old_files() -> None:
    run = run_with(good_lookup(), (BlockWrite(48, 0, 6, 77, 2, cached=True, null=False),))
    data = json.loads(json.dumps(run.to_dict()))
    assert RunObservation.from_dict(data) == run
    # A file written before block recording: no block fields, nothing checked.
    old = {k: v for k, v in data.items() if k != "blocks_recorded"}
    for request in old["requests"]:
        request.pop("lookup_blocks")
        request.pop("unsafe_writes", None)
    loaded = RunObservation.from_dict(old)
    assert not loaded.blocks_recorded
    assert check_blocks(SCENARIO, loaded) == ()


def test_not_recorded_means_not_checked() -> None:
    full, swa = good_lookup()
    run = run_with((full, (*swa[:11], None)))
    assert check_blocks(SCENARIO, run) != ()
    unrecorded = RunObservation(run.variant, run.vllm_version, run.settings, run.requests)
    assert check_blocks(SCENARIO, unrecorded) == ()


@pytest.mark.parametrize(
    ("blocks", "expected"),
    [
        # The state at the hit (index 5 for 48 tokens of block 8), nulls below.
        ((None,) * 5 + ("state",), []),
        ((None,) * 5 + ("state", "past"), [(ViolationKind.STATE_PAST_HIT, 6)]),
        ((None,) * 6, [(ViolationKind.NULL_IN_WINDOW, 5)]),
        ((None,) * 4 + ("state",), [(ViolationKind.COUNT, 5)]),
    ],
)
def test_state_group(blocks: tuple[str | None, ...], expected: list) -> None:
    group = KVCacheGroup(GroupKind.FULL_ATTENTION, 8)
    records = tuple(None if b is None else written(0, k, 300 + k, 8) for k, b in enumerate(blocks))
    got = state_group_violations(group, 0, HIT, records, 1, TokenView(SCENARIO))
    assert [(v.kind, v.block_index) for v in got] == expected


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        # Request 0 (looked up first, same first 48 tokens): its state after 48.
        (BlockRecord(305, 0, 0, 5, 0, 48), []),
        # The state after 40 or 56 tokens, or another group's state: foreign.
        (BlockRecord(305, 0, 0, 4, 0, 40), [ViolationKind.FOREIGN]),
        (BlockRecord(305, 0, 0, 6, 0, 56), [ViolationKind.FOREIGN]),
        (BlockRecord(305, 1, 0, 5, 0, 48), [ViolationKind.FOREIGN]),
        # The sibling's own state: it cannot have written it before its lookup.
        (BlockRecord(305, 0, 1, 5, 0, 48), [ViolationKind.FOREIGN]),
        # Never written in the run; written at a position the driver does not follow.
        (BlockRecord(305, None, None, None, 0), [ViolationKind.UNWRITTEN]),
        (BlockRecord(305, 0, 0, 5, 0, None), []),
        # Another group's last write: attention KV, or a state not followed.
        (BlockRecord(305, 1, 0, 5, 8), [ViolationKind.FOREIGN]),
        (BlockRecord(305, 1, 0, 5, 0, None), [ViolationKind.FOREIGN]),
        # Request 0's step in the lookup's own scheduler step writes it: what
        # the block held before is what the lookup reads.
        (BlockRecord(305, None, None, None, 0, None, 0), [ViolationKind.UNWRITTEN]),
        (BlockRecord(305, 0, 0, 4, 0, 40, 0), [ViolationKind.FOREIGN]),
        (BlockRecord(305, 0, 0, 5, 0, 48, 0), []),
    ],
)
def test_state_group_contents(record: BlockRecord, expected: list[ViolationKind]) -> None:
    group = KVCacheGroup(GroupKind.MAMBA, 8)
    records = (None,) * 5 + (record,)
    got = state_group_violations(group, 0, HIT, records, 1, TokenView(SCENARIO))
    assert [v.kind for v in got] == expected
    assert all(v.block_index == 5 for v in got)


def test_state_record_round_trips() -> None:
    state = BlockRecord(7, 1, 0, 5, 0, 48)
    assert state.to_list() == [7, 1, 0, 5, 0, 48]
    assert BlockRecord.from_list(state.to_list()) == state
    attention = BlockRecord(7, 0, 0, 5, 8)
    assert attention.to_list() == [7, 0, 0, 5, 8]
    assert BlockRecord.from_list(attention.to_list()) == attention
    unrun = BlockRecord(7, None, None, None, 0, None, 2)
    assert unrun.to_list() == [7, None, None, None, 0, None, 2]
    assert BlockRecord.from_list(unrun.to_list()) == unrun


def test_a_state_the_same_step_writes_says_so() -> None:
    group = KVCacheGroup(GroupKind.MAMBA, 8)
    records = (None,) * 5 + (BlockRecord(305, None, None, None, 0, None, 0),)
    (got,) = state_group_violations(group, 1, HIT, records, 1, TokenView(SCENARIO))
    assert got.detail == (
        "group 1 block index 5 is block 305, never written in this run (request 0's step in "
        "the same scheduler step writes its state: that forward runs with the one reading it, "
        "so the lookup reads the block as it was before); a hit of 48 tokens needs the state "
        "after them"
    )


def test_render_blocks() -> None:
    assert render_blocks([None, 3, 4]) == "[null, 3, 4]"
    assert render_blocks(list(range(20)), edge=2) == "[0, 1, …(16 more)…, 18, 19]"


# Rule 5, the tables after each step. After the step at 48 processed tokens
# the window of the next token starts at 48 - 16 + 1 = 33: SWA blocks 0..7
# (tokens 0..32) are due back to the pool, and the step attends to tokens
# 33..48, SWA block indices 8..11.


def table_kinds(*tables: StepTable, extra: int = 0) -> list[tuple[ViolationKind, int, int]]:
    freed, kept = table_violations(SCENARIO, tables, extra)
    return [(v.kind, v.group, v.block_index) for v in freed + kept]


def test_tables_freed_below_the_window_are_clean() -> None:
    full = StepTable(48, 48, 0, 7, 0, 0)
    swa = StepTable(48, 48, 1, 13, 8, 8)
    assert table_kinds(full, swa) == []


def test_table_keeps_a_skipped_block() -> None:
    # Block 0 still real, 1..7 null: what a range that stops short of index 0 leaves.
    swa = StepTable(48, 48, 1, 13, 0, 8)
    assert table_kinds(swa) == [(ViolationKind.KEPT_SKIPPED, 1, 0)]
    # Nothing freed at all is kept too.
    assert table_kinds(StepTable(48, 48, 1, 13, 0, 0)) == [(ViolationKind.KEPT_SKIPPED, 1, 0)]


def test_table_extra_retained_tokens_stay() -> None:
    # A multi-module MTP re-prefill keeps 2 more tokens below the window:
    # 33 - 2 = 31 skipped, so only blocks 0..6 are due.
    swa = StepTable(48, 48, 1, 13, 7, 7)
    assert table_kinds(swa) == [(ViolationKind.KEPT_SKIPPED, 1, 7)]
    assert table_kinds(swa, extra=2) == []


def test_table_frees_a_block_the_step_attends_to() -> None:
    swa = StepTable(48, 48, 1, 13, 9, 9)
    assert table_kinds(swa) == [(ViolationKind.NULL_IN_WINDOW, 1, 8)]
    # Full attention attends to every block.
    assert table_kinds(StepTable(48, 48, 0, 7, 0, 3)) == [(ViolationKind.NULL_IN_WINDOW, 0, 2)]


def test_table_chunked_local_attention() -> None:
    chunked = Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
            KVCacheGroup(GroupKind.CHUNKED_LOCAL_ATTENTION, 4, attention_chunk_size_tokens=32),
        ),
        requests=(RequestSpec(64, 8),),
        shared_prefix_tokens=64,
    )
    # 40 processed tokens: the chunk 32..64 is read, blocks 0..7 are due.
    freed, kept = table_violations(chunked, (StepTable(40, 40, 1, 11, 8, 8),), 0)
    assert freed == kept == []
    freed, kept = table_violations(chunked, (StepTable(40, 40, 1, 11, 0, 8),), 0)
    assert [(v.kind, v.block_index) for v in kept] == [(ViolationKind.KEPT_SKIPPED, 0)]
    assert kept[0].detail == (
        "after the step at 40 processed tokens group 1 still holds a real block at block "
        "index 0 (tokens 0..4); no later step attends below token 32, so blocks 0..7 are "
        "due back to the pool"
    )


MAMBA = Scenario(
    kv_cache_groups=(
        KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
        KVCacheGroup(GroupKind.MAMBA, 4),
    ),
    requests=(RequestSpec(0, 40),),
    shared_prefix_tokens=0,
    retention_interval_tokens=16,
)


def test_table_mamba_states_below_the_one_read_are_due_uncached() -> None:
    # After the step at 24 processed tokens the next step reads the state
    # after 24 tokens, block index (24 - 1) // 4 = 5; a state below it that
    # holds no cache entry is due back to the pool.
    def kept(table: StepTable) -> list[tuple[ViolationKind, int, int]]:
        freed, kept = table_violations(MAMBA, (table,), 0)
        assert freed == []  # a state group owes no real block where the step "attends"
        return [(v.kind, v.group, v.block_index) for v in kept]

    assert kept(StepTable(24, 32, 1, 9, 5, 7, 5)) == []
    assert kept(StepTable(24, 32, 1, 9, 1, 7, 1)) == [(ViolationKind.KEPT_SKIPPED, 1, 1)]
    # A state below that holds a cache entry (the retention checkpoint after
    # 16 tokens, index 3) is not judged (vLLM PR #57253 would keep it).
    assert kept(StepTable(24, 32, 1, 9, 3, 7, 5)) == []
    # Before anything is processed no state is due: nulls where the
    # attention rule would owe real blocks are no finding either.
    assert kept(StepTable(0, 8, 1, 4, 3, 3, 3)) == []
    # An attention group's table of the same shape is judged by the window.
    assert table_violations(MAMBA, (StepTable(24, 32, 0, 9, 1, 1),), 0)[0] != []


def test_step_table_round_trips_with_and_without_the_state_field() -> None:
    state = StepTable(24, 32, 1, 9, 5, 7, 5)
    attention = StepTable(24, 32, 0, 9, 0, 0)
    assert state.to_list() == [24, 32, 1, 9, 5, 7, 5]
    assert attention.to_list() == [24, 32, 0, 9, 0, 0]
    assert StepTable.from_list(state.to_list()) == state
    assert StepTable.from_list(attention.to_list()) == attention


def test_kept_skipped_block_finding_round_trips() -> None:
    base = run_with(good_lookup())
    tables = (StepTable(48, 48, 0, 7, 0, 0), StepTable(48, 48, 1, 13, 0, 8))
    run = RunObservation(
        base.variant,
        base.vllm_version,
        base.settings,
        (base.requests[0], replace(base.requests[1], step_tables=tables)),
        blocks_recorded=True,
    )
    _, findings = judge_run(SCENARIO, run)
    assert [(f.kind, f.request) for f in findings] == [(FindingKind.KEPT_SKIPPED_BLOCK, 1)]
    assert RunObservation.from_dict(json.loads(json.dumps(run.to_dict()))) == run
    assert SEVERITY[FindingKind.WRONG_KV] < SEVERITY[FindingKind.KEPT_SKIPPED_BLOCK]

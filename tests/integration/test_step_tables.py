"""The tables rule of the block-level check on vLLM 0.33.0's real managers.

After every ``allocate_slots`` step the driver records where each attention
group's block table holds the null block (``RequestObservation.step_tables``);
the oracle (``differential.oracle.blocks.table_violations``) owes the null
block below what no later step attends to and a real block where the step
attends. Stock vLLM keeps the rule in both modes; a
``SingleTypeKVCacheManager._remove_blocks_in_range`` that stops one block
short of the range's start (a refactor's off-by-one) keeps block 0 of every
window table, which vLLM PR #14097's freeing promises back to the pool, and
is caught as ``kept-skipped-block``. A Mamba group's table (align mode)
owes back its states below the one the next step reads; a retirement that
skips a block keeps one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.findings import FindingKind
from differential.variants import parse_variants
from tests.factories import CORPORA
from tests.integration.test_scheduler_mode import _concurrent

pytestmark = pytest.mark.vllm

CHUNKED = CORPORA / "cases" / "llama4-chunked-local.json"


def _kept(result: Any) -> list[tuple[str, int | None, str]]:
    return [
        (f.variant, f.request, f.detail)
        for f in result.findings
        if f.kind is FindingKind.KEPT_SKIPPED_BLOCK
    ]


def test_chunked_local_tables_are_recorded_and_clean() -> None:
    result = compare_variants(load_entry(CHUNKED).scenario, parse_variants("unfixed"))
    run = result.results[0].run
    # Request 0 (264 tokens, chunk 64, block 16) in 64-token steps: the
    # chunked group's table drops the previous chunk's 4 blocks at each step
    # (null blocks 0..4k-1), full attention holds every block.
    assert [t.to_list() for t in run.requests[0].step_tables] == [
        [0, 0, 0, 5, 0, 0],
        [0, 0, 1, 5, 0, 0],
        [64, 64, 0, 9, 0, 0],
        [64, 64, 1, 9, 4, 4],
        [128, 128, 0, 13, 0, 0],
        [128, 128, 1, 13, 8, 8],
        [192, 192, 0, 17, 0, 0],
        [192, 192, 1, 17, 12, 12],
        [256, 256, 0, 17, 0, 0],
        [256, 256, 1, 17, 16, 16],
    ]
    # Request 1's hit of 240 tokens pads the chunk's skipped 12 blocks.
    assert [t.to_list() for t in run.requests[1].step_tables] == [
        [240, 240, 0, 17, 0, 0],
        [240, 240, 1, 17, 12, 12],
    ]
    assert _kept(result) == []


@pytest.fixture
def short_range(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``_remove_blocks_in_range`` that frees ``[first_block + 1, last_block)``:
    block 0 of every window table stays held until the request finishes."""
    real = SingleTypeKVCacheManager._remove_blocks_in_range

    def remove(self: Any, request_id: str, first_block: int, last_block: int) -> None:
        real(self, request_id, first_block + 1, last_block)

    monkeypatch.setattr(SingleTypeKVCacheManager, "_remove_blocks_in_range", remove)
    yield


def test_a_skipped_block_kept_is_a_finding_in_manager_mode(short_range: None) -> None:
    result = compare_variants(load_entry(CHUNKED).scenario, parse_variants("unfixed"))
    assert result.results[0].run.hits == (0, 240, 192, 96)
    assert _kept(result) == [
        (
            "unfixed",
            0,
            "after the step at 64 processed tokens group 1 still holds a real block at "
            "block index 0 (tokens 0..16); no later step attends below token 64, so "
            "blocks 0..3 are due back to the pool",
        )
    ]


def test_scheduler_mode_tables_are_clean_and_catch_a_kept_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Four two-turn sessions, two in flight, EAGLE drafts: SWA window 8, block 4.
    scenario = _concurrent(200, 5, (0, 0, 1, 1, 6, 6, 7, 7), 4)
    clean = compare_variants(scenario, parse_variants("unfixed"))
    assert all(r.step_tables for r in clean.results[0].run.requests)
    assert _kept(clean) == []
    real = SingleTypeKVCacheManager._remove_blocks_in_range

    def remove(self: Any, request_id: str, first_block: int, last_block: int) -> None:
        real(self, request_id, first_block + 1, last_block)

    monkeypatch.setattr(SingleTypeKVCacheManager, "_remove_blocks_in_range", remove)
    kept = compare_variants(scenario, parse_variants("unfixed"))
    assert kept.results[0].run.hits == clean.results[0].run.hits
    # The first turns (requests 0..3) keep their block 0; a second turn's hit
    # enters its table with the skipped head already null
    # (add_local_computed_blocks), so the short range has nothing left there.
    assert [(v, r) for v, r, _ in _kept(kept)] == [("unfixed", i) for i in range(4)]


MAMBA_ASYNC = CORPORA / "cases" / "mamba-async-chunks-retire-states.json"


def test_mamba_state_tables_are_recorded_and_clean() -> None:
    result = compare_variants(load_entry(MAMBA_ASYNC).scenario, parse_variants("unfixed"))
    run = result.results[0].run
    assert run.hits == (0, 36)
    # Request 0's Mamba table (group 1, block 4) after each step, async and in
    # 8-token chunks: [processed, start, group, blocks, first real, null end,
    # first real holding no cache entry]. After the step at 16 processed tokens
    # the state after 16 (index 3, a retention checkpoint) is kept and the
    # state after 24 (index 5) is in flight; after the step at 24 the states
    # below index (24 - 1) // 4 = 5 are retired, across the null gaps.
    assert [t.to_list() for t in run.requests[0].step_tables if t.group == 1][:6] == [
        [0, 0, 1, 2, 1, 1, 1],
        [0, 8, 1, 4, 1, 3, 1],
        [8, 16, 1, 6, 1, 5, 1],
        [16, 24, 1, 8, 3, 7, 5],
        [24, 32, 1, 9, 5, 7, 5],
        [32, 36, 1, 10, 7, 7, 9],
    ]
    assert _kept(result) == []


def test_a_mamba_state_left_unretired_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MambaManager._remove_blocks_in_range`` that skips its range's first
    block (what the mutant ``first_block | 1`` for ``first_block - 1`` does at
    an odd start): the state it leaves in request 0's table is a finding."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    real = MambaManager._remove_blocks_in_range

    def remove(self: Any, request_id: str, first_block: int, last_block: int) -> None:
        retired = self._num_retired_blocks.get(request_id, 0)
        real(self, request_id, max(first_block, retired) + 1, last_block)

    monkeypatch.setattr(MambaManager, "_remove_blocks_in_range", remove)
    result = compare_variants(load_entry(MAMBA_ASYNC).scenario, parse_variants("unfixed"))
    assert result.results[0].run.hits == (0, 36)
    # The range [5, 7) at 32 processed tokens keeps its first block, the
    # state after 24 tokens, which no retention checkpoint caches.
    assert _kept(result) == [
        (
            "unfixed",
            0,
            "after the step at 32 processed tokens Mamba group 1 still holds a state block "
            "with no cache entry at block index 5 (tokens 20..24); the next step reads only "
            "the state at block index 7, so the states below it are due back to the pool",
        )
    ]

"""A bounded KV connector store on its own grid through vLLM's real
Scheduler, its store vLLM's ``CPUOffloadingManager`` with the LRU policy:
exact hits from real runs, and the oracle's LRU replay against the
manager's own evictions."""

from __future__ import annotations

import dataclasses

import pytest

from differential.corpus import load_entry
from differential.driver.scheduler_mode import run_scheduler_scenario
from differential.observation import RunObservation
from differential.oracle.connector import connector_findings
from differential.oracle.offload_lru import LRUReplay
from differential.scenario import Scenario
from tests.factories import ROOT

pytestmark = pytest.mark.vllm

CASES = ROOT / "corpora" / "cases"


def _case(name: str, **store: object) -> Scenario:
    """A corpus case, its store's fields replaced by ``store``."""
    s = load_entry(CASES / f"{name}.json").scenario
    assert s.workload.connector is not None
    connector = dataclasses.replace(s.workload.connector, **store)  # type: ignore[arg-type]
    return dataclasses.replace(s, workload=dataclasses.replace(s.workload, connector=connector))


def _reader(run: RunObservation) -> tuple[int, int, int]:
    """The last request's (store held, answered, adopted external), in tokens."""
    c = run.requests[-1].connector
    assert run.error is None and c is not None
    return c.store_tokens, c.matched_tokens, c.external_tokens


@pytest.mark.parametrize(
    ("store", "reader"),
    [
        # The default grid (a key per 16-token block), unbounded: 90 // 16 * 16.
        ({"capacity_chunks": None, "chunk_tokens": None}, (80, 80, 80)),
        # A 32-token grid floors the restored prefix to 64.
        ({"capacity_chunks": None}, (64, 64, 64)),
        # 4 chunks of 32: the unrelated request's third chunk evicts the
        # writer's tail (64), so 32 is left.
        ({}, (32, 32, 32)),
        # 4 chunks of 16: the writer's 5-chunk offer is more than the store
        # can ever make room for, so prepare_store stores nothing.
        ({"chunk_tokens": None}, (0, 0, 0)),
    ],
)
def test_eviction_and_the_grid_shorten_the_readers_hit(
    store: dict[str, object], reader: tuple[int, int, int]
) -> None:
    s = _case("connector-bounded-lru-evicts-writer-tail", **store)
    run = run_scheduler_scenario(s, "unfixed")
    assert _reader(run) == reader
    assert connector_findings(s, run) == []


def test_the_lru_replay_evicts_what_vllms_manager_evicts() -> None:
    s = _case("connector-bounded-lru-evicts-writer-tail")
    run = run_scheduler_scenario(s, "unfixed")
    assert s.workload.connector is not None and s.workload.connector.capacity_chunks == 4
    replay = LRUReplay(4)
    evictions = []
    for call in run.store_calls:
        if call.op == "store":
            evicted, stored = replay.store(call)
            assert (evicted, stored) == (list(call.evicted), not call.refused)
            evictions.append(evicted)
        elif call.op != "lookup":
            replay.replay(call)
    # The writer's two chunks, then the other request's three, evicting the
    # writer's tail; the reader re-stores it (its own copy) and its own chunk
    # at 96, evicting the other request's tail chunks.
    assert [len(e) for e in evictions if e] == [1, 2]
    lookups = [c for c in run.store_calls if c.op == "lookup"]
    assert [(c.request, c.held_tokens) for c in lookups] == [(0, 0), (1, 0), (2, 32)]


def test_a_chunk_coarser_than_the_load_past_the_shown_hit_is_not_loaded() -> None:
    # FA 16 + Mamba 64, divergent hybrid hits: the reader's full-attention
    # hit 368 is shown as 320; the store holds 384 on a 128-token grid,
    # 64 past 320, less than a chunk, so nothing is answered
    # (_lookup_complete_chunks) and vLLM reconciles to the hit every group
    # holds, 0.
    s = _case("connector-divergent-hybrid-hit-truncated", chunk_tokens=128)
    run = run_scheduler_scenario(s, "unfixed")
    c = run.requests[-1].connector
    assert c is not None
    assert (c.local_hit_tokens, c.presented_tokens, c.store_tokens, c.matched_tokens) == (
        368,
        320,
        384,
        0,
    )
    assert c.computed_tokens == 0 and c.diverged
    assert connector_findings(s, run) == []

"""A bounded KV connector store (``workload.connector.capacity_chunks``,
``chunk_tokens``): the scenario fields, the LRU replay the oracle owes
(:mod:`differential.oracle.offload_lru`) worked by hand, the shrinker and
the coverage table."""

from __future__ import annotations

import dataclasses
import json

import pytest

from differential.errors import ScenarioError
from differential.findings import FindingKind
from differential.observation import RunObservation, StoreCall
from differential.oracle.offload_lru import LRUReplay, lru_findings, owed_answer
from differential.scenario import (
    ConnectorStore,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
    Workload,
)
from fuzz.minimize import _connector_store
from fuzz.signature import coverage_keys

FA16 = KVCacheGroup(GroupKind.FULL_ATTENTION, 16)
MAMBA64 = KVCacheGroup(GroupKind.MAMBA, 64)


def _scenario(store: ConnectorStore, groups: tuple[KVCacheGroup, ...] = (FA16,)) -> Scenario:
    """A 90-token writer, an unrelated 96-token request, the writer's prompt + 30."""
    return Scenario(
        kv_cache_groups=groups,
        requests=(RequestSpec(90, 0), RequestSpec(0, 96), RequestSpec(90, 30, 0)),
        shared_prefix_tokens=90,
        kv_connector=True,
        workload=Workload(mode=DriveMode.SCHEDULER, connector=store),
    )


# ------------------------------------------------------------------ scenario


def test_bounds_are_written_only_when_set_and_round_trip() -> None:
    assert _scenario(ConnectorStore()).to_dict()["workload"]["connector"] == {}
    s = _scenario(ConnectorStore(capacity_chunks=4, chunk_tokens=32))
    assert s.to_dict()["workload"]["connector"] == {"capacity_chunks": 4, "chunk_tokens": 32}
    assert Scenario.from_json(s.to_json()) == s
    assert s.workload.connector is not None and s.workload.connector.bounded


def test_a_grid_off_the_scheduler_block_is_refused_naming_the_field() -> None:
    with pytest.raises(ScenarioError) as raised:
        _scenario(ConnectorStore(chunk_tokens=24))
    assert raised.value.field == "workload.connector.chunk_tokens"
    assert "a positive multiple of the scheduler block size (16 tokens" in str(raised.value)
    # FA 16 + Mamba 64: the scheduler block is 64.
    with pytest.raises(ScenarioError, match=r"scheduler block size \(64 tokens"):
        _scenario(ConnectorStore(chunk_tokens=32), (FA16, MAMBA64))


@pytest.mark.parametrize("field", ["capacity_chunks", "chunk_tokens"])
def test_a_bound_below_one_is_refused_naming_the_field(field: str) -> None:
    data = _scenario(ConnectorStore()).to_dict()
    data["workload"]["connector"] = {field: 0}
    with pytest.raises(ScenarioError) as raised:
        Scenario.from_json(json.dumps(data))
    assert f"workload.connector.{field}" in str(raised.value)
    assert "\n" not in str(raised.value)


# ---------------------------------------------------------------- the replay


def _keys(*pairs: tuple[int, int]) -> tuple[tuple[int, int, int], ...]:
    """``(key id, end position)`` pairs of group 0."""
    return tuple((k, 0, p) for k, p in pairs)


def _store(request: int, *pairs: tuple[int, int]) -> StoreCall:
    return StoreCall("store", request, _keys(*pairs))


def _filled(capacity: int) -> LRUReplay:
    """Request 0 stored and finished keys 0, 1, 2 at 16, 32, 48."""
    replay = LRUReplay(capacity)
    assert replay.store(_store(0, (0, 16), (1, 32), (2, 48))) == ([], True)
    replay.replay(StoreCall("stored", 0, _keys((0, 16), (1, 32), (2, 48))))
    replay.finish(0)
    return replay


def test_lru_evicts_the_least_recent_request_tail_first() -> None:
    replay = _filled(4)
    # Two new keys, one chunk free: the tail (48) goes, the head stays.
    assert replay.store(_store(1, (10, 16), (11, 32))) == ([2], True)
    replay.replay(StoreCall("stored", 1, _keys((10, 16), (11, 32))))
    replay.finish(1)
    # A third request reuses key 0 (offered again): it becomes its own; the
    # next eviction takes request 0's key 1, then request 1's tail.
    assert replay.store(_store(2, (0, 16), (20, 32), (21, 48))) == ([1, 11], True)


def test_pinned_and_write_pending_chunks_are_not_evicted() -> None:
    replay = _filled(3)
    replay.replay(StoreCall("load", 1, _keys((1, 32), (2, 48))))
    # Key 0 is the only evictable chunk.
    assert replay.store(_store(1, (10, 64))) == ([0], True)
    # Key 10 is write-pending, keys 1 and 2 pinned: nothing can go.
    assert replay.store(_store(2, (20, 16))) == ([], False)
    replay.replay(StoreCall("loaded", 1, _keys((1, 32), (2, 48))))
    assert replay.store(_store(2, (20, 16))) == ([2], True)


def test_an_offer_larger_than_the_room_stores_nothing() -> None:
    replay = LRUReplay(2)
    assert replay.store(_store(0, (0, 16), (1, 32), (2, 48))) == ([], False)
    assert replay.held == {}


def test_the_longest_prefix_needs_every_full_attention_chunk_and_the_point_keys() -> None:
    replay = _filled(3)
    lookup = StoreCall(
        "lookup", 1, _keys((0, 16), (1, 32), (2, 48)), needs=((), (), (7,)), unit_tokens=16
    )
    # Key 7 (say a Mamba state at 48) is not held: the prefix ends at 32.
    assert replay.longest_prefix(lookup) == 32
    assert owed_answer(32, 16, 16) == 16
    # 16 past a local hit of 16 is less than a 32-token chunk: not loaded.
    assert owed_answer(32, 16, 32) == 0


def _run(calls: tuple[StoreCall, ...]) -> RunObservation:
    return RunObservation("unfixed", "0.33.0", None, (), mode="scheduler", store_calls=calls)


def test_a_store_answering_less_than_lru_keeps_is_a_fallback() -> None:
    s = _scenario(ConnectorStore(capacity_chunks=3))
    calls = (
        _store(0, (0, 16), (1, 32), (2, 48)),
        StoreCall("stored", 0, _keys((0, 16), (1, 32), (2, 48))),
        StoreCall("finish", 0),
    )
    lookup = StoreCall(
        "lookup", 2, _keys((0, 16), (1, 32), (2, 48)), needs=((), (), ()), unit_tokens=16
    )
    owed = dataclasses.replace(lookup, held_tokens=48, matched_tokens=48)
    assert lru_findings(s, _run((*calls, owed))) == []
    short = dataclasses.replace(lookup, held_tokens=32, matched_tokens=32)
    (finding,) = lru_findings(s, _run((*calls, short)))
    assert finding.kind is FindingKind.FALLBACK and finding.request == 2
    assert (finding.expected_tokens, finding.hit_tokens) == (48, 32)
    # An unbounded store is not replayed.
    assert lru_findings(_scenario(ConnectorStore()), _run((*calls, short))) == []


# ----------------------------------------------------- shrinker and coverage


def test_the_shrinker_unbounds_the_store_and_restores_the_grid() -> None:
    s = _scenario(ConnectorStore(capacity_chunks=4, chunk_tokens=32))
    steps = dict(_connector_store(s))
    assert list(steps)[-2:] == ["an unbounded store", "the store on the default grid"]
    unbounded = steps["an unbounded store"]
    assert unbounded is not None and unbounded.workload.connector is not None
    assert unbounded.workload.connector == ConnectorStore(chunk_tokens=32)


def test_coverage_counts_bounded_stores() -> None:
    def store_class(store: ConnectorStore) -> str:
        (key,) = [k for k in coverage_keys(_scenario(store)) if k.startswith("connector-store:")]
        return key

    assert store_class(ConnectorStore()) == "connector-store:unbounded"
    assert store_class(ConnectorStore(capacity_chunks=4)) == "connector-store:bounded"
    assert (
        store_class(ConnectorStore(capacity_chunks=4, chunk_tokens=32))
        == "connector-store:bounded+grid"
    )

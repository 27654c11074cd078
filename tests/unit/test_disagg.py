"""Disaggregated prefill and decode (``workload.connector.kv_role``): the
scenario field and its rules, the generator, the shrinker and the coverage
table (no vLLM)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from differential.errors import ScenarioError
from differential.scenario import (
    ConnectorLoad,
    ConnectorStore,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    KVRole,
    RequestSpec,
    Scenario,
    Workload,
)
from fuzz.minimize import _connector_store
from fuzz.signature import coverage_keys
from fuzz.strategies import _disaggregation

FA16 = KVCacheGroup(GroupKind.FULL_ATTENTION, 16)


def _scenario(store: ConnectorStore) -> Scenario:
    return Scenario(
        kv_cache_groups=(FA16,),
        requests=(RequestSpec(90, 0), RequestSpec(90, 30, 0)),
        shared_prefix_tokens=90,
        kv_connector=True,
        workload=Workload(mode=DriveMode.SCHEDULER, connector=store),
    )


CONSUMER = ConnectorStore(load=ConnectorLoad.ASYNC, kv_role=KVRole.KV_CONSUMER)


def test_kv_role_is_written_only_when_not_kv_both() -> None:
    plain = json.loads(_scenario(ConnectorStore()).to_json())
    assert "kv_role" not in plain["workload"]["connector"]
    data = json.loads(_scenario(CONSUMER).to_json())
    assert data["workload"]["connector"]["kv_role"] == "kv_consumer"
    again = Scenario.from_json(json.dumps(data))
    assert again.workload.connector == CONSUMER
    assert again.workload.connector is not None and again.workload.connector.disaggregated


def test_a_shared_store_is_unbounded() -> None:
    store = ConnectorStore(kv_role=KVRole.KV_CONSUMER, capacity_chunks=8)
    with pytest.raises(ScenarioError, match=r"workload\.connector\.capacity_chunks"):
        _scenario(store)


def test_the_shrinker_tries_one_engine() -> None:
    steps = dict(_connector_store(_scenario(CONSUMER)))
    one = steps["one engine (no prefill instance)"]
    assert one is not None and one.workload.connector is not None
    assert one.workload.connector.kv_role is KVRole.KV_BOTH
    assert "one engine (no prefill instance)" not in dict(
        _connector_store(_scenario(ConnectorStore()))
    )


def test_coverage_counts_disaggregated_stores() -> None:
    keys = [k for k in coverage_keys(_scenario(CONSUMER)) if k.startswith("connector-store:")]
    assert keys == ["connector-store:unbounded+disagg"]
    sync = ConnectorStore(load=ConnectorLoad.SYNC, kv_role=KVRole.KV_CONSUMER)
    keys = [k for k in coverage_keys(_scenario(sync)) if k.startswith("connector-store:")]
    assert keys == ["connector-store:unbounded+disagg+sync"]


@st.composite
def _disaggregated(draw: st.DrawFn, s: Scenario) -> Scenario:
    return _disaggregation(draw, s)


@settings(max_examples=30, suppress_health_check=list(HealthCheck), deadline=None)
@given(bounded=_disaggregated(_scenario(ConnectorStore(capacity_chunks=8))))
def test_the_generator_leaves_a_bounded_store_to_one_engine(bounded: Scenario) -> None:
    assert bounded.workload.connector == ConnectorStore(capacity_chunks=8)


@settings(max_examples=30, suppress_health_check=list(HealthCheck), deadline=None)
@given(drawn=_disaggregated(_scenario(ConnectorStore())))
def test_the_generator_loads_a_decode_instance_either_way(drawn: Scenario) -> None:
    # Asynchronously as vLLM's P/D connectors do, or synchronously.
    store = drawn.workload.connector
    sync = ConnectorStore(load=ConnectorLoad.SYNC, kv_role=KVRole.KV_CONSUMER)
    assert store in (ConnectorStore(), CONSUMER, sync)


FAILING = ConnectorStore(load=ConnectorLoad.ASYNC, failed_loads=(0,))


@settings(max_examples=30, suppress_health_check=list(HealthCheck), deadline=None)
@given(drawn=_disaggregated(_scenario(FAILING)))
def test_a_decode_instance_with_failed_loads_loads_asynchronously(drawn: Scenario) -> None:
    # A failed load is an asynchronous load's (failed_recving).
    store = drawn.workload.connector
    assert store in (
        FAILING,
        ConnectorStore(load=ConnectorLoad.ASYNC, failed_loads=(0,), kv_role=KVRole.KV_CONSUMER),
    )

"""Async scheduling (``workload.async_scheduling``): the scenario field, the
oracle's rules (:mod:`differential.oracle.scheduling`), the generator, the
coverage keys and the shrinker (no vLLM)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings

from differential.errors import ScenarioError
from differential.findings import FindingKind, Policy
from differential.observation import RequestObservation, RunObservation
from differential.oracle.known import label_known
from differential.oracle.scheduling import (
    async_cross_checkable,
    cross_check_scheduling,
    free_order_findings,
    immediate_free_order,
)
from differential.scenario import (
    DrafterKind,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
    Workload,
)
from fuzz.minimize import _workload
from fuzz.signature import coverage_keys
from fuzz.strategies import engine_scenarios
from tests.factories import reach

FA16 = KVCacheGroup(GroupKind.FULL_ATTENTION, 16)
FA32 = KVCacheGroup(GroupKind.FULL_ATTENTION, 32)


def _scenario(groups: tuple[KVCacheGroup, ...] = (FA16,), **workload: object) -> Scenario:
    """A 64-token writer and a reader of its prompt + 16, in scheduler mode."""
    return Scenario(
        kv_cache_groups=groups,
        requests=(RequestSpec(64, 0), RequestSpec(64, 16, 0)),
        shared_prefix_tokens=64,
        workload=Workload(mode=DriveMode.SCHEDULER, **workload),  # type: ignore[arg-type]
    )


def _run(
    hits: tuple[int, ...],
    *,
    evicted: int = 0,
    deferred: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...] = (),
) -> RunObservation:
    return RunObservation(
        variant="unfixed",
        vllm_version="0.33.0",
        settings=None,
        requests=tuple(
            RequestObservation(
                index=i,
                prompt_tokens=64,
                hit_tokens=h,
                shared_prefix_boundary_tokens=0,
                per_group_hit_tokens=(h,),
                retained_blocks_per_group=(0,),
            )
            for i, h in enumerate(hits)
        ),
        evicted_blocks=evicted,
        mode="scheduler",
        deferred_frees=deferred,
    )


# ------------------------------------------------------------------ scenario


def test_the_field_is_written_only_when_true_and_round_trips() -> None:
    plain = _scenario()
    assert "async_scheduling" not in plain.to_dict()["workload"]
    on = _scenario(async_scheduling=True)
    assert on.to_dict()["workload"]["async_scheduling"] is True
    assert Scenario.from_json(on.to_json()) == on


def test_manager_mode_refuses_async_scheduling_naming_the_field() -> None:
    with pytest.raises(ScenarioError) as raised:
        dataclasses.replace(
            _scenario(), workload=Workload(mode=DriveMode.MANAGER, async_scheduling=True)
        )
    assert raised.value.field == "workload.async_scheduling"
    assert str(raised.value).startswith(
        "workload.async_scheduling = True is invalid: allowed false in manager mode"
    )
    assert "\n" not in str(raised.value)


def test_a_non_boolean_is_refused_naming_the_field() -> None:
    raw = json.loads(_scenario().to_json())
    raw["workload"]["async_scheduling"] = "yes"
    with pytest.raises(ScenarioError) as raised:
        Scenario.from_dict(raw)
    assert raised.value.field == "workload.async_scheduling"


def test_engine_mode_and_export_refuse_async_scheduling() -> None:
    from differential.driver.engine_mode import EngineUnsupported, engine_plan
    from differential.exports.scheduler_test import check_exportable

    s = _scenario((KVCacheGroup(GroupKind.FULL_ATTENTION, 32),), async_scheduling=True)
    with pytest.raises(EngineUnsupported, match=r"^workload.async_scheduling: "):
        engine_plan(s)
    with pytest.raises(ScenarioError) as raised:
        check_exportable(s)
    assert raised.value.field == "workload.async_scheduling"


# --------------------------------------------------------- async against sync


def test_one_at_a_time_arrivals_owe_the_synchronous_hits() -> None:
    s = _scenario(async_scheduling=True)
    assert async_cross_checkable(s)
    (finding,) = cross_check_scheduling(s, _run((0, 48)), _run((0, 64)))
    assert finding.kind is FindingKind.ASYNC_MISMATCH and finding.request == 1
    assert (finding.hit_tokens, finding.expected_tokens) == (48, 64)
    assert "hits [0, 48] (async) vs [0, 64] (sync)" in finding.detail
    assert cross_check_scheduling(s, _run((0, 64)), _run((0, 64))) == ()


def test_evictions_arrivals_and_aborts_lift_the_async_rule() -> None:
    s = _scenario(async_scheduling=True)
    assert cross_check_scheduling(s, _run((0, 48), evicted=2), _run((0, 64))) == ()
    assert cross_check_scheduling(s, _run((0, 48)), _run((0, 64), evicted=1)) == ()
    assert not async_cross_checkable(_scenario(async_scheduling=True, arrival_steps=(0, 3)))
    assert not async_cross_checkable(_scenario(async_scheduling=True, abort_steps=(2, None)))
    assert not async_cross_checkable(_scenario())


# --------------------------------------------------------- deferred-free order


def test_the_immediate_order_is_group_by_group_each_tail_first() -> None:
    popped = ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1))
    flattened = tuple(reversed(popped))  # vLLM 0.33.0's _drain_deferred_frees
    assert immediate_free_order(flattened) == ((0, 2), (0, 1), (0, 0), (1, 1), (1, 0))


def test_a_flattened_deferred_free_is_a_free_order_finding_under_the_vllm_policy() -> None:
    s = _scenario((FA16, FA32), async_scheduling=True)
    flattened = ((1, 1), (1, 0), (0, 2), (0, 1), (0, 0))
    run = _run((0, 0), deferred=((0, 3, flattened),))
    (finding,) = free_order_findings(s, run, Policy.VLLM)
    assert finding.kind is FindingKind.FREE_ORDER and finding.request == 0
    assert finding.detail == (
        "step 3: the deferred free of its 5 blocks in 2 KV cache groups handed block 1 to "
        "the free queue as group 1's block 1, where the immediate free hands group 0's "
        "block 2 (group by group, each tail first): groups freed in the order [1, 0] "
        "instead of [0, 1]"
    )
    (labelled,) = label_known(s, [finding])
    assert labelled.known_issue == "deferred-free-flattens-group-order"
    assert free_order_findings(s, run, Policy.IDEAL)
    # The named policy: `retained` accepts vLLM 0.33.0's flattened order.
    assert free_order_findings(s, run, Policy.RETAINED) == []


def test_a_deferred_free_in_the_immediate_order_is_no_finding() -> None:
    s = _scenario((FA16, FA32), async_scheduling=True)
    ordered = ((0, 2), (0, 1), (0, 0), (1, 1), (1, 0))
    one_group = ((0, 2), (0, 1), (0, 0))
    run = _run((0, 0), deferred=((0, 3, ordered), (1, 5, one_group)))
    assert free_order_findings(s, run, Policy.VLLM) == []


def test_deferred_frees_round_trip_in_the_observation() -> None:
    run = _run((0, 0), deferred=((0, 3, ((1, 1), (0, 0))),))
    data = run.to_dict()
    assert data["deferred_frees"] == [[0, 3, [[1, 1], [0, 0]]]]
    assert RunObservation.from_dict(data).deferred_frees == run.deferred_frees
    assert "deferred_frees" not in _run((0,)).to_dict()


# ------------------------------------------- generator, coverage and shrinker


def test_the_generator_draws_async_scheduling_never_with_an_ngram_drafter() -> None:
    drawn = reach(lambda s: s.workload.async_scheduling, engine_scenarios())
    assert drawn.workload.mode is DriveMode.SCHEDULER


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(engine_scenarios())
def test_no_generated_async_workload_has_an_ngram_drafter(s: Scenario) -> None:
    assert not (s.workload.async_scheduling and s.drafter.kind is DrafterKind.NGRAM)


def test_coverage_counts_the_scheduling_in_scheduler_mode_only() -> None:
    assert coverage_keys(_scenario(async_scheduling=True))[-1] == "scheduling:async"
    assert coverage_keys(_scenario())[-1] == "scheduling:sync"
    manager = dataclasses.replace(_scenario(), workload=Workload())
    assert not [k for k in coverage_keys(manager) if k.startswith("scheduling:")]


def test_the_shrinker_tries_synchronous_scheduling() -> None:
    steps = dict(_workload(_scenario(async_scheduling=True)))
    plain = steps["synchronous scheduling"]
    assert plain is not None and not plain.workload.async_scheduling
    assert "synchronous scheduling" not in dict(_workload(_scenario()))

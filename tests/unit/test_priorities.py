"""vLLM's priority scheduling policy (``workload.priorities``): the JSON
form, the one-line errors, the generator and the shrinker (no vLLM). The
real Scheduler under it is pinned by ``tests/integration/test_priorities.py``."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from differential.errors import ScenarioError
from differential.scenario import (
    DriveMode,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
    Workload,
)
from fuzz.minimize import _drop_requests, _workload
from fuzz.strategies import engine_scenarios


def _scenario(mode: DriveMode = DriveMode.SCHEDULER, **workload: object) -> Scenario:
    """A 64-token writer, a reader of its prompt + 16, an unrelated 32."""
    return Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
        requests=(RequestSpec(64, 0), RequestSpec(64, 16, 0), RequestSpec(0, 32)),
        shared_prefix_tokens=64,
        workload=Workload(mode=mode, **workload),  # type: ignore[arg-type]
    )


def test_priorities_round_trip_and_are_written_only_when_set() -> None:
    ranked = _scenario(arrival_steps=(0, 0, 1), priorities=(2, 0, -1))
    assert ranked.to_dict()["workload"]["priorities"] == [2, 0, -1]
    assert Scenario.from_dict(ranked.to_dict()) == ranked
    assert "priorities" not in _scenario().to_dict()["workload"]


@pytest.mark.parametrize(
    ("mode", "priorities", "allowed"),
    [
        (DriveMode.SCHEDULER, (0, 1), "null or a list of 3 integers (one per request)"),
        (DriveMode.MANAGER, (0, 1, 2), "null in manager mode"),
    ],
)
def test_priorities_vllm_would_not_take_are_one_line_naming_the_field(
    mode: DriveMode, priorities: tuple[int, ...], allowed: str
) -> None:
    with pytest.raises(ScenarioError) as caught:
        _scenario(mode, priorities=priorities)
    assert caught.value.field == "workload.priorities"
    assert allowed in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_priority_that_is_not_an_integer_is_refused_by_the_json_form() -> None:
    data = _scenario(priorities=(0, 1, 2)).to_dict()
    data["workload"]["priorities"] = [0, 1.5, 2]
    with pytest.raises(ScenarioError) as caught:
        Scenario.from_dict(data)
    assert caught.value.field.startswith("workload.priorities")


def test_the_shrinker_tries_fcfs_and_drops_a_request_with_its_priority() -> None:
    ranked = _scenario(arrival_steps=(0, 0, 1), priorities=(2, 0, 1))
    fcfs = dict(_workload(ranked))["first come, first served"]
    assert fcfs is not None and fcfs.workload.priorities is None
    assert "first come, first served" not in dict(_workload(_scenario()))
    dropped = dict(_drop_requests(ranked))["drop request 2"]
    assert dropped is not None and dropped.workload.priorities == (2, 0)


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(engine_scenarios())
def test_generated_priorities_are_one_per_request_of_concurrent_workloads(s: Scenario) -> None:
    priorities = s.workload.priorities
    if priorities is None:
        return
    assert s.workload.arrival_steps is not None
    assert len(priorities) == len(s.requests) and set(priorities) <= {0, 1, 2, 3}
    assert Scenario.from_dict(s.to_dict()) == s


def test_the_generator_draws_priorities() -> None:
    seen: list[tuple[int, ...]] = []

    @settings(
        max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(engine_scenarios())
    def collect(s: Scenario) -> None:
        if s.workload.priorities is not None:
            seen.append(s.workload.priorities)

    collect()
    assert seen and any(len(set(p)) > 1 for p in seen)

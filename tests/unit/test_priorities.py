"""vLLM's priority scheduling policy (``workload.priorities``): the JSON
form, the one-line errors, the generator and the shrinker (no vLLM). The
real Scheduler under it is pinned by ``tests/integration/test_priorities.py``."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from differential.errors import ScenarioError
from differential.findings import Finding, FindingKind
from differential.oracle.known import in_lookup_order, label_known
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
    assert s.workload.arrival_steps is not None and not s.workload.shares_output
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


def _ranked_sessions() -> Scenario:
    """FA 4 + a 2-token sliding window in blocks of 1, retention 12: three
    requests sharing a 4-token prefix (4, 11 and 5 tokens), all arriving at
    step 0 with priorities 3, 0, 2 and one running at a time, so vLLM looks
    them up in the order 1, 2, 0."""
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 1, 2),
        ),
        requests=(RequestSpec(4, 0), RequestSpec(4, 7), RequestSpec(4, 1)),
        shared_prefix_tokens=4,
        retention_interval_tokens=12,
        prefill_chunk_tokens=8,
        disable_lookahead_block_hashes=True,
        workload=Workload(
            mode=DriveMode.SCHEDULER,
            arrival_steps=(0, 0, 0),
            max_num_seqs=1,
            max_num_batched_tokens=16,
            priorities=(3, 0, 2),
        ),
    )


def test_requests_in_lookup_order_are_a_first_come_first_served_scenario() -> None:
    ranked = _ranked_sessions()
    reordered = in_lookup_order(ranked, (1, 2))  # request 0 never looked up: last
    assert reordered is not None
    scenario, position = reordered
    assert position == {1: 0, 2: 1, 0: 2}
    assert [r.prompt_tokens for r in scenario.requests] == [11, 5, 4]
    assert scenario.workload.priorities is None
    assert in_lookup_order(ranked, (0, 1, 2)) is None  # the scenario's own order
    assert in_lookup_order(_scenario(arrival_steps=(0, 0, 1)), (1, 0, 2)) is None  # no priorities
    # Request 1 copies from request 0: looked up before it, it cannot be reordered.
    copying = _scenario(arrival_steps=(0, 0, 1), priorities=(1, 0, 0))
    assert in_lookup_order(copying, (1, 0, 2)) is None


def test_a_known_issue_is_matched_in_the_order_vllm_looked_the_requests_up() -> None:
    # vLLM looked up 1, 2, 0: request 2 is owed request 1's checkpoint at 4
    # and falls back to 0, vLLM issue #57610's mechanism; the matcher, which
    # reasons about writers in request order, sees it only in the run's order.
    finding = Finding(FindingKind.FALLBACK, "unfixed", 2, "", expected_tokens=4, hit_tokens=0)
    ranked = _ranked_sessions()
    (plain,) = label_known(ranked, [finding], hits=(0, 0, 0))
    assert plain.known_issue is None
    (labelled,) = label_known(ranked, [finding], hits=(0, 0, 0), order=(1, 2, 0))
    assert labelled.known_issue == "unit-below-retained-boundary-falls-back"

"""The Scheduler's prefill policy as scenario fields
(``workload.long_prefill_token_threshold``, its adaptive floor,
``prefill_schedule_interval``): the JSON form, the one-line errors, the
generator and the shrinker (no vLLM)."""

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
from fuzz.minimize import _workload
from fuzz.strategies import engine_scenarios


def _scenario(mode: DriveMode = DriveMode.SCHEDULER, **workload: object) -> Scenario:
    """A 64-token writer and a reader of its prompt + 16."""
    return Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
        requests=(RequestSpec(64, 0), RequestSpec(64, 16, 0)),
        shared_prefix_tokens=64,
        workload=Workload(mode=mode, **workload),  # type: ignore[arg-type]
    )


def test_the_policy_round_trips_and_vllms_defaults_are_not_written() -> None:
    policy = _scenario(
        long_prefill_token_threshold=24,
        long_prefill_token_threshold_adaptive=True,
        prefill_schedule_interval=4,
    )
    written = policy.to_dict()["workload"]
    assert written["long_prefill_token_threshold"] == 24
    assert written["long_prefill_token_threshold_adaptive"] is True
    assert written["prefill_schedule_interval"] == 4
    assert Scenario.from_dict(policy.to_dict()) == policy
    plain = _scenario().to_dict()["workload"]
    assert not {
        "long_prefill_token_threshold",
        "long_prefill_token_threshold_adaptive",
        "prefill_schedule_interval",
    } & set(plain)


@pytest.mark.parametrize(
    ("workload", "field", "allowed"),
    [
        (
            {"mode": DriveMode.MANAGER, "long_prefill_token_threshold": 16},
            "workload.long_prefill_token_threshold",
            "0 in manager mode",
        ),
        (
            {"mode": DriveMode.MANAGER, "prefill_schedule_interval": 2},
            "workload.prefill_schedule_interval",
            "1 in manager mode",
        ),
        (
            {"long_prefill_token_threshold": 81},
            "workload.long_prefill_token_threshold",
            "0 to the longest prompt (80 tokens",
        ),
        (
            {"long_prefill_token_threshold_adaptive": True},
            "workload.long_prefill_token_threshold_adaptive",
            "false when long_prefill_token_threshold is 0",
        ),
    ],
)
def test_a_policy_vllm_would_not_run_is_one_line_naming_the_field(
    workload: dict[str, object], field: str, allowed: str
) -> None:
    with pytest.raises(ScenarioError) as caught:
        _scenario(**workload)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert allowed in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_cadence_below_one_step_is_refused_by_the_json_form() -> None:
    data = _scenario().to_dict()
    data["workload"]["prefill_schedule_interval"] = 0
    with pytest.raises(ScenarioError) as caught:
        Scenario.from_dict(data)
    assert caught.value.field == "workload.prefill_schedule_interval"


def test_the_shrinker_tries_vllms_default_policy_then_a_fixed_cap() -> None:
    steps = dict(
        _workload(
            _scenario(
                long_prefill_token_threshold=16,
                long_prefill_token_threshold_adaptive=True,
                prefill_schedule_interval=8,
            )
        )
    )
    default = steps["vLLM's default prefill policy"]
    assert default is not None
    assert (
        default.workload.long_prefill_token_threshold,
        default.workload.long_prefill_token_threshold_adaptive,
        default.workload.prefill_schedule_interval,
    ) == (0, False, 1)
    fixed = steps["a fixed long-prefill cap"]
    assert fixed is not None and fixed.workload.long_prefill_token_threshold == 16
    assert not fixed.workload.long_prefill_token_threshold_adaptive
    assert "vLLM's default prefill policy" not in dict(_workload(_scenario()))


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(engine_scenarios())
def test_generated_policies_are_valid(s: Scenario) -> None:
    w = s.workload
    longest = max(r.prompt_tokens for r in s.requests)
    assert 0 <= w.long_prefill_token_threshold <= longest
    assert w.prefill_schedule_interval in (1, 2, 4, 8)
    assert not w.long_prefill_token_threshold_adaptive or w.long_prefill_token_threshold
    assert Scenario.from_dict(s.to_dict()) == s


def test_the_generator_draws_every_part_of_the_policy() -> None:
    seen: set[str] = set()

    @settings(
        max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(engine_scenarios())
    def collect(s: Scenario) -> None:
        w = s.workload
        if w.long_prefill_token_threshold:
            seen.add("cap")
        if w.long_prefill_token_threshold_adaptive:
            seen.add("adaptive")
        if w.prefill_schedule_interval > 1:
            seen.add("cadence")
        policy = (
            w.long_prefill_token_threshold,
            w.long_prefill_token_threshold_adaptive,
            w.prefill_schedule_interval,
        )
        if policy == (0, False, 1):
            seen.add("default")

    collect()
    assert seen == {"cap", "adaptive", "cadence", "default"}

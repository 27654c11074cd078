"""A model length the requests reach (``workload.max_model_len_tokens``):
the JSON form, the one-line errors, the generator and the shrinker (no
vLLM). The real Scheduler's behaviour at it is pinned by
``tests/integration/test_model_length.py``."""

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
    """A 64-token writer and a reader of its prompt + 16 (80 tokens), 2 decode steps."""
    return Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
        requests=(RequestSpec(64, 0), RequestSpec(64, 16, 0)),
        shared_prefix_tokens=64,
        decode_steps=2,
        workload=Workload(mode=mode, **workload),  # type: ignore[arg-type]
    )


def test_the_length_round_trips_and_is_written_only_when_set() -> None:
    tight = _scenario(max_model_len_tokens=83)
    assert tight.to_dict()["workload"]["max_model_len_tokens"] == 83
    assert Scenario.from_dict(tight.to_dict()) == tight
    assert "max_model_len_tokens" not in _scenario().to_dict()["workload"]


@pytest.mark.parametrize(
    ("mode", "length", "allowed"),
    [
        # The longest prompt (80) and decode_steps + 1 (3) sampled tokens.
        (DriveMode.SCHEDULER, 82, "null or at least 83 tokens"),
        (DriveMode.MANAGER, 83, "null in manager mode"),
    ],
)
def test_a_length_that_would_cut_a_request_short_is_one_line_naming_the_field(
    mode: DriveMode, length: int, allowed: str
) -> None:
    with pytest.raises(ScenarioError) as caught:
        _scenario(mode, max_model_len_tokens=length)
    assert caught.value.field == "workload.max_model_len_tokens"
    assert allowed in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_length_below_one_token_is_refused_by_the_json_form() -> None:
    data = _scenario().to_dict()
    data["workload"]["max_model_len_tokens"] = 0
    with pytest.raises(ScenarioError) as caught:
        Scenario.from_dict(data)
    assert caught.value.field == "workload.max_model_len_tokens"


def test_the_shrinker_tries_the_default_length() -> None:
    steps = dict(_workload(_scenario(max_model_len_tokens=83)))
    default = steps["the default model length"]
    assert default is not None and default.workload.max_model_len_tokens is None
    assert "the default model length" not in dict(_workload(_scenario()))


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(engine_scenarios())
def test_generated_lengths_leave_every_request_its_end(s: Scenario) -> None:
    length = s.workload.max_model_len_tokens
    if length is None:
        return
    need = max(r.prompt_tokens for r in s.requests) + s.decode_steps + 1
    assert need <= length <= need + s.drafter.num_speculative_tokens
    assert Scenario.from_dict(s.to_dict()) == s


def test_the_generator_draws_a_length_for_speculative_scenarios_only() -> None:
    seen: list[int] = []

    @settings(
        max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(engine_scenarios())
    def collect(s: Scenario) -> None:
        if s.workload.max_model_len_tokens is not None:
            seen.append(s.drafter.num_speculative_tokens)

    collect()
    assert seen and all(spec > 0 for spec in seen)

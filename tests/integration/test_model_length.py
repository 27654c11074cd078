"""A model length the requests reach (``workload.max_model_len_tokens``)
through vLLM's real Scheduler: the spec-decode pad's room check binds."""

from __future__ import annotations

import dataclasses

import pytest

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.driver.scheduler_mode import run_scheduler_scenario
from differential.variants import parse_variants
from tests.factories import ROOT

pytestmark = pytest.mark.vllm

CASE = ROOT / "corpora" / "cases" / "spec-decode-pad-past-max-model-len--scheduler.json"


def test_a_one_token_admission_at_the_model_length_is_not_padded() -> None:
    # Request 1 hits 2 of its 3 tokens: a one-token admission. Padded to
    # 1 + 2 speculative tokens it would need 2 + 3 + 1 = 6 > 4 tokens of
    # model length, so vLLM schedules the one token; with kvfuzz's default
    # length (3 + 0 + 0 + 2 + 2 = 7) it pads.
    scenario = load_entry(CASE).scenario
    assert scenario.workload.max_model_len_tokens == 4
    run = run_scheduler_scenario(scenario, "unfixed", record_cache_map=True)
    assert run.error is None and [r.hit_tokens for r in run.requests] == [0, 2]
    assert (
        run.timeline[1] == "step 1: arrive req-1; admit req-1 (hit 2); run req-1 +1; finish req-1"
    )
    assert run.uncovered_steps == ()
    roomy = dataclasses.replace(
        scenario, workload=dataclasses.replace(scenario.workload, max_model_len_tokens=None)
    )
    padded = run_scheduler_scenario(roomy, "unfixed", record_cache_map=True)
    assert padded.timeline[1] == (
        "step 1: arrive req-1; admit req-1 (hit 2); run req-1 +3 (0/2 drafts accepted); "
        "finish req-1"
    )


def test_the_case_is_clean_on_every_variant() -> None:
    result = compare_variants(load_entry(CASE).scenario, parse_variants("unfixed,fixed,candidate"))
    assert [vr.run.hits for vr in result.results] == [(0, 2)] * 3
    assert not result.findings

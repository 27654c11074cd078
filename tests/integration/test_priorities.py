"""vLLM's priority scheduling policy (``workload.priorities``) through the
real Scheduler: admissions by priority, the victim of a preemption, and the
budget a scheduled victim gives back."""

from __future__ import annotations

import pytest

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.driver.scheduler_mode import run_scheduler_scenario
from differential.scenario import (
    DriveMode,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
    Workload,
)
from differential.variants import parse_variants
from tests.factories import ROOT

pytestmark = pytest.mark.vllm

CASE = (
    ROOT / "corpora" / "cases" / "priority-preempted-victim-restores-its-draft-slot--scheduler.json"
)


def test_the_low_priority_request_is_preempted_and_its_budget_given_back() -> None:
    # Step 6: req-0 (priority 9) was scheduled first, then preempted for
    # req-3's blocks; its 4 tokens and its drafting slot go back to the
    # budget, so req-3 gets 5 tokens: (4 + 1) + (4 + 1) + (5 + 1) = 16.
    run = run_scheduler_scenario(load_entry(CASE).scenario, "unfixed", record_cache_map=True)
    assert run.error is None and run.preemptions == 2
    assert run.timeline[6] == (
        "step 6: run req-1 +4 (0/3 drafts accepted), req-2 +4 (0/3 drafts accepted), "
        "req-3 +5 (prefill); preempt req-0"
    )
    # Request 6 (priority 5) is admitted at step 22, before request 5
    # (priority 9, arrived at step 12) at step 27.
    order = {r.index: (r.scheduled_step, r.lookup_order) for r in run.requests}
    assert order[6] == (22, 5) and order[5] == (27, 6)
    assert [r.hit_tokens for r in run.requests] == [0, 0, 0, 0, 0, 16, 0]


def test_the_case_is_clean_on_every_variant() -> None:
    result = compare_variants(load_entry(CASE).scenario, parse_variants("unfixed,fixed,candidate"))
    assert [vr.run.hits for vr in result.results] == [(0, 0, 0, 0, 0, 16, 0)] * 3
    assert not result.findings


def test_lookups_in_one_step_are_judged_in_the_order_vllm_made_them() -> None:
    # Three requests sharing a 64-token prefix arrive at step 0 with
    # priorities 9, 5, 0: vLLM looks up req-2 first and caches its blocks at
    # allocate_slots, so req-1 and req-0 hit them in the same step. The
    # lookup order the oracle reads is vLLM's, not the requests' indices; in
    # index order req-1's hit would be an over-hit and its blocks foreign.
    scenario = Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
        requests=(RequestSpec(64, 0), RequestSpec(64, 16, 0), RequestSpec(64, 8, 0)),
        shared_prefix_tokens=64,
        workload=Workload(mode=DriveMode.SCHEDULER, arrival_steps=(0, 0, 0), priorities=(9, 5, 0)),
    )
    run = run_scheduler_scenario(scenario, "unfixed")
    assert [(r.index, r.lookup_order, r.hit_tokens) for r in run.requests] == [
        (0, 2, 48),
        (1, 1, 64),
        (2, 0, 0),
    ]
    assert not compare_variants(scenario, parse_variants("unfixed")).findings

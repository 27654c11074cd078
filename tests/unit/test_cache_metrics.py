"""The cache-metrics rules (differential.oracle.metrics) on hand-worked runs:
prefix-cache statistics, KV cache usage and reset_prefix_cache."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from differential.findings import FindingKind
from differential.observation import (
    CacheMetrics,
    ConnectorLookup,
    PrefixCacheCounts,
    RequestObservation,
    ResetCall,
    ResumedLookup,
    RunObservation,
)
from differential.oracle.metrics import (
    expected_connector_counts,
    expected_counts,
    metrics_findings,
)
from differential.scenario import ConnectorStore, Scenario

SCENARIO = Scenario.from_dict(
    {
        "kv_cache_groups": [{"kind": "full_attention", "block_size_tokens": 16}],
        "shared_prefix_tokens": 64,
        "requests": [
            {"divergence_tokens": 64, "suffix_tokens": 10},
            {"divergence_tokens": 64, "suffix_tokens": 20},
        ],
        "workload": {"mode": "scheduler"},
    }
)

# Request 1 is preempted once and taken up again at 90 known tokens, hitting 80.
RESUMED = ResumedLookup(
    step=7,
    hit_tokens=80,
    known_tokens=90,
    preempted_computed_tokens=84,
    freed_queue_blocks=None,
    freed_queue_removals=None,
    lookup_queue_removals=None,
)
REQUESTS = (
    RequestObservation(0, 74, 0, 0, (0,), (4,), scheduled_step=0),
    RequestObservation(1, 84, 64, 0, (64,), (1,), scheduled_step=3, resumed=(RESUMED,)),
)
CLEAN = CacheMetrics(
    stats=PrefixCacheCounts(2, 158, 64, 1, 90, 80),
    usage_min=0.0,
    usage_max=0.75,
    usage_end=0.0,
    resets=(ResetCall(0, 1, False, 0, False), ResetCall(None, 0, True, 0, True)),
)


def run_with(metrics: CacheMetrics, **changes: Any) -> RunObservation:
    run = RunObservation(
        variant="unfixed",
        vllm_version="0.33.0",
        settings=None,
        requests=REQUESTS,
        mode="scheduler",
        metrics=metrics,
    )
    return dataclasses.replace(run, **changes)


def details(run: RunObservation) -> list[str]:
    found = metrics_findings(SCENARIO, run)
    assert all(f.kind is FindingKind.CACHE_METRICS and f.request is None for f in found)
    return [f.detail for f in found]


def test_the_owed_statistics_count_each_admission_once() -> None:
    # 74 + 84 prompt tokens queried, 0 + 64 hit; the resumed lookup apart.
    assert expected_counts(run_with(CLEAN)) == PrefixCacheCounts(2, 158, 64, 1, 90, 80)
    assert details(run_with(CLEAN)) == []


def test_a_request_counted_on_every_scheduling_attempt_is_a_finding() -> None:
    # Issue #43736: a request retried once more is counted twice.
    doubled = dataclasses.replace(CLEAN, stats=PrefixCacheCounts(3, 242, 128, 1, 90, 80))
    assert details(run_with(doubled)) == [
        "prefix-cache statistics summed over the run: requests 3 (owed 2), "
        "queries 242 (owed 158), hits 128 (owed 64)"
    ]


def test_preempted_lookups_counted_with_new_requests_is_a_finding() -> None:
    # PR #25787: a preempted request's lookup is counted apart.
    merged = dataclasses.replace(CLEAN, stats=PrefixCacheCounts(3, 248, 144, 0, 0, 0))
    assert len(details(run_with(merged))) == 1


def test_a_request_aborted_before_admission_is_owed_no_count() -> None:
    aborted = RequestObservation(2, 50, 0, 0, (0,), (0,), scheduled_step=None)
    assert expected_counts(run_with(CLEAN, requests=(*REQUESTS, aborted))).requests == 2


@pytest.mark.parametrize(
    ("usage", "says"),
    [
        ((0.0, 1.5, 0.0), "KV cache usage read 0 to 1.5, outside 0.0 to 1.0"),
        ((0.0, 0.5, 0.25), "KV cache usage 0.25 once every request had finished (owed 0.0)"),
    ],
)
def test_usage_outside_a_share_or_left_after_the_run_is_a_finding(
    usage: tuple[float, float, float], says: str
) -> None:
    low, high, end = usage
    metrics = dataclasses.replace(CLEAN, usage_min=low, usage_max=high, usage_end=end)
    assert details(run_with(metrics)) == [says]


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (
            ResetCall(0, 1, True, 0, True),
            "reset_prefix_cache() after step 0 succeeded while 1 request(s) held KV blocks "
            "(owed a refusal)",
        ),
        (
            ResetCall(None, 0, False, 12, False),
            "reset_prefix_cache() after the run refused with no request holding KV blocks "
            "(12 cached blocks kept)",
        ),
        (
            ResetCall(None, 0, True, 3, True),
            "reset_prefix_cache() after the run returned true and left 3 cached blocks (owed none)",
        ),
        (
            ResetCall(None, 0, True, 0, False),
            "reset_prefix_cache() after the run returned true, but the prefix-cache "
            "statistics read next do not carry the reset flag",
        ),
        (
            ResetCall(None, 0, True, 0, True, False, 0),
            "reset_prefix_cache(reset_connector=True) after the run returned true, but the KV "
            "connector's prefix-cache statistics read next do not carry the reset flag",
        ),
        (
            ResetCall(None, 0, True, 0, True, True, 96),
            "reset_prefix_cache(reset_connector=True) after the run returned true and the KV "
            "connector's store still holds 96 tokens (owed none)",
        ),
    ],
)
def test_a_wrong_reset_is_a_finding(call: ResetCall, says: str) -> None:
    assert details(run_with(dataclasses.replace(CLEAN, resets=(call,)))) == [says]


def test_a_run_that_did_not_finish_or_recorded_nothing_is_not_judged() -> None:
    broken = dataclasses.replace(CLEAN, usage_end=0.5)
    assert details(run_with(broken, error="step 3: schedule: RuntimeError: x")) == []
    assert details(run_with(broken, timed_out=True)) == []
    assert details(dataclasses.replace(run_with(broken), metrics=None)) == []


def test_the_metrics_round_trip_through_json() -> None:
    run = run_with(CLEAN)
    assert RunObservation.from_dict(run.to_dict()).metrics == CLEAN
    connector = dataclasses.replace(CLEAN, resets=(ResetCall(None, 0, True, 0, True, True, 0),))
    assert RunObservation.from_dict(run_with(connector).to_dict()).metrics == connector


def test_the_connector_statistics_count_what_lies_past_the_local_hit() -> None:
    # Request 0 adopts 0 local and 32 external tokens of 74; request 1 all 84
    # locally (nothing asked of the store).
    lookups = (
        ConnectorLookup(0, 0, 32, 32, 0, 32),
        ConnectorLookup(84, 84, 0, 84, 84, 0),
    )
    requests = tuple(
        dataclasses.replace(r, connector=c, resumed=())
        for r, c in zip(REQUESTS, lookups, strict=True)
    )
    run = run_with(CLEAN, requests=requests)
    assert expected_connector_counts(run) == PrefixCacheCounts(1, 74, 32)
    # The local statistics count the locally adopted tokens.
    assert expected_counts(run) == PrefixCacheCounts(2, 158, 84)
    store = dataclasses.replace(
        SCENARIO,
        kv_connector=True,
        workload=dataclasses.replace(SCENARIO.workload, connector=ConnectorStore()),
    )
    right = dataclasses.replace(
        CLEAN,
        stats=PrefixCacheCounts(2, 158, 84),
        connector_stats=PrefixCacheCounts(1, 74, 32),
    )
    assert metrics_findings(store, dataclasses.replace(run, metrics=right)) == []
    # Request 1, all local, counted as a store query of 84 XOR 84 = 0 tokens.
    wrong = dataclasses.replace(right, connector_stats=PrefixCacheCounts(2, 74 + (84 ^ 84), 32))
    assert [f.detail for f in metrics_findings(store, dataclasses.replace(run, metrics=wrong))] == [
        "KV connector prefix-cache statistics summed over the run: requests 2 (owed 1)"
    ]


# Request 1, preempted and taken up again hitting 80, still reports its first
# admission's 64 (Scheduler.schedule: "Track first scheduled prefill").
REPORTED = dataclasses.replace(CLEAN, prefill_reports=((0, 74, 0, 0), (1, 84, 64, 0)))


def test_each_request_reports_its_first_admission_once() -> None:
    assert details(run_with(REPORTED)) == []
    # Not read (manager mode, an older record): not judged.
    assert details(run_with(CLEAN)) == []


@pytest.mark.parametrize(
    ("reports", "detail"),
    [
        (
            ((0, 74, 0, 0), (1, 84, 80, 0)),
            "request 1 reported prompt 84, cached 80 local + 0 external (owed prompt 84, "
            "cached 64 local + 0 external)",
        ),
        (
            ((0, 74, 0, 0),),
            "request 1 reported none (owed prompt 84, cached 64 local + 0 external)",
        ),
        (
            ((0, 74, 0, 0), (1, 84, 64, 0), (1, 84, 64, 0)),
            "request 1 reported prompt 84, cached 64 local + 0 external; prompt 84, cached "
            "64 local + 0 external (owed prompt 84, cached 64 local + 0 external)",
        ),
    ],
)
def test_a_wrong_missing_or_repeated_usage_report_is_caught(
    reports: tuple[tuple[int, int, int, int], ...], detail: str
) -> None:
    metrics = dataclasses.replace(CLEAN, prefill_reports=reports)
    assert details(run_with(metrics)) == [
        f"usage reports (EngineCoreOutput.prefill_stats): {detail}"
    ]


def test_the_reports_round_trip() -> None:
    assert CacheMetrics.from_dict(REPORTED.to_dict()) == REPORTED
    assert "prefill" not in CLEAN.to_dict()

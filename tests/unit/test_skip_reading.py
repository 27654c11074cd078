"""Requests that skip reading the prefix cache (vLLM's
``skip_reading_prefix_cache``, set for ``prompt_logprobs`` requests: PRs
#28194, #57269), hand-worked (no vLLM): owed no hit and no store answer,
not counted in the statistics, and still writers for later requests."""

from __future__ import annotations

import dataclasses

from differential.findings import FindingKind
from differential.observation import ConnectorLookup, RequestObservation
from differential.oracle import drafter_model, references
from differential.oracle.connector import connector_findings
from differential.oracle.metrics import expected_counts
from differential.scenario import (
    ConnectorStore,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
    Workload,
)
from tests.factories import scheduler_run

FULL = KVCacheGroup(GroupKind.FULL_ATTENTION, 16)
REQUESTS = (
    RequestSpec(128, 20),
    RequestSpec(128, 60, skip_reading_prefix_cache=True),
    RequestSpec(180, 10, shares_with=1),
)


def scenario(**kwargs: object) -> Scenario:
    return Scenario(
        kv_cache_groups=(FULL,),
        requests=REQUESTS,
        shared_prefix_tokens=128,
        prefill_chunk_tokens=64,
        **kwargs,  # type: ignore[arg-type]
    )


def test_the_field_round_trips_and_is_written_only_when_true() -> None:
    s = scenario()
    assert Scenario.from_json(s.to_json()) == s
    written = s.to_dict()["requests"]
    assert written[1]["skip_reading_prefix_cache"] is True
    assert "skip_reading_prefix_cache" not in written[0]
    assert [s.reads_prefix_cache(i) for i in range(3)] == [True, False, True]


def test_a_request_skipping_the_cache_is_owed_nothing_but_still_writes() -> None:
    s = scenario()
    refs = references(s, drafter_model(s), [0, 0, 176])
    # Request 1 shares 128 tokens with the writer, yet is owed 0; request 2
    # is owed 176 (11 blocks of its 180 shared tokens) from request 1's own
    # blocks.
    assert [(r.expected_tokens, r.dense_tokens, r.writer) for r in refs] == [
        (0, 0, None),
        (0, 0, None),
        (176, 176, 1),
    ]
    # The same under a timeline's writers.
    timed = references(
        s, drafter_model(s), [0, 0, 176], writers=[frozenset(), frozenset({0}), frozenset({0, 1})]
    )
    assert [r.expected_tokens for r in timed] == [0, 0, 176]


def observed(index: int, prompt: int, hit: int, **kwargs: object) -> RequestObservation:
    return RequestObservation(
        index,
        prompt,
        hit,
        0,
        (hit,),
        (0,),
        scheduled_step=index,
        **kwargs,  # type: ignore[arg-type]
    )


def test_its_lookup_is_not_counted_in_the_statistics() -> None:
    s = scenario(workload=Workload(mode=DriveMode.SCHEDULER))
    run = scheduler_run(observed(0, 148, 0), observed(1, 188, 0), observed(2, 190, 176))
    # "Don't count a request that skipped the cache lookup"
    # (KVCacheManager.record_prefix_cache_stats): 2 requests, 148 + 190 tokens.
    counts = expected_counts(run, s)
    assert (counts.requests, counts.queries, counts.hits) == (2, 338, 176)


def test_a_store_answer_it_adopts_is_an_over_hit() -> None:
    s = scenario(
        kv_connector=True,
        workload=Workload(mode=DriveMode.SCHEDULER, connector=ConnectorStore()),
    )
    answered = ConnectorLookup(
        local_hit_tokens=0,
        presented_tokens=0,
        matched_tokens=128,
        store_tokens=128,
        local_tokens=0,
        external_tokens=0,
    )
    clean = scheduler_run(observed(1, 188, 0, connector=answered))
    assert connector_findings(s, clean) == []
    adopted = dataclasses.replace(answered, external_tokens=128)
    (finding,) = connector_findings(s, scheduler_run(observed(1, 188, 0, connector=adopted)))
    assert (finding.kind, finding.request, finding.expected_tokens) == (FindingKind.OVER_HIT, 1, 0)

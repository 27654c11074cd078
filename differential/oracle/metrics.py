"""What vLLM reports about its cache: hit-rate statistics, usage, resets.

Operators read vLLM's prefix-cache hit rate (``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``) and KV cache usage off the statistics
``Scheduler.make_stats`` builds (``PrefixCacheStats``,
vllm/v1/metrics/stats.py), and RLHF loops call ``reset_prefix_cache`` after
each weight update so that no request hits KV computed with the old
weights. The driver records all three (:class:`~differential.observation.CacheMetrics`,
:mod:`differential.driver.cache_metrics`); the rules, judged on runs that
finished (nothing here imports vLLM):

``stats``
    Every admission's lookup is counted once, with its own tokens and hit
    (issue #43736; "A request that takes N attempts to schedule is counted N
    times", PR #45202's account of it; fixed by recording at admission:
    ``Scheduler.schedule``'s ``record_prefix_cache_stats``), and a preempted request's lookup apart
    from the others (issue #25780, PR #25787: "Do not count preempted tokens
    in prefix cache hit rate"). So, summed over the run: ``requests`` is the
    number of requests admitted, ``queries`` their prompt tokens and
    ``hits`` their hits (tokens; a request that skips reading the prefix
    cache is not counted, vLLM PR #17251; in scheduler mode a hit no longer
    than a bounded-replay window is not adopted, so it counts none: vLLM PR
    #56227); ``preempted_requests`` the lookups that
    took a preempted request up again, ``preempted_queries`` their tokens
    (``ResumedLookup.known_tokens``) and ``preempted_hits`` their hits.
    With a KV connector the hits are the tokens adopted from the local
    cache, and the connector's own statistics
    (``connector_prefix_cache_stats``, kept since vLLM PR #26245's external
    prefix-cache metrics) count, per admission that asks the store about
    tokens past its local hit, those tokens and what the store supplied
    (not judged once a request is preempted, nor are ``preempted_hits``
    then: the driver does not observe what a resumed admission adopted from
    the local cache beside the store's answer). Judged with prefix caching
    on and no failed load (a failed load reschedules its request from
    scratch: one more lookup), and not when a client abort meets
    asynchronous loads (a request aborted while its load is in flight was
    admitted, its lookup counted, but never scheduled, so the driver
    observes no admission for it).
``usage``
    ``KVCacheManager.usage`` is a share, 0.0 to 1.0 (``BlockPool.get_usage``:
    "The KV cache usage (between 0.0 and 1.0)"), and 0.0 once every request
    has finished: a cached block no request holds is free (evictable), so
    it is not in use ("The KV cache utilization measurement includes only
    KVs with active requests running", a maintainer in vLLM issue #5176).
``reset``
    ``Scheduler.reset_prefix_cache()`` resets the prefix cache "only ... when
    there is no running requests taking KV cache" (its docstring,
    vllm/v1/core/sched/scheduler.py; ``BlockPool.reset_prefix_cache``:
    "Failed to reset prefix cache because some blocks ... are not freed
    yet"). Called while requests hold blocks it returns false and leaves
    the cache as it was; called after the run it returns true, leaves no
    cached block (so that, after a weight update, nothing is hit) and sets
    the statistics' ``reset`` flag. Manager mode calls
    ``KVCacheManager.reset_prefix_cache()`` the same way, the first request
    still holding its blocks, then after the run. With a KV connector the
    call after the run is ``reset_prefix_cache(reset_connector=True)``,
    which resets "both the local (GPU) and external (connector) prefix
    caches" (vLLM PR #27170, ``Scheduler.reset_connector_cache``): returning
    true, it leaves the connector's store holding nothing of any request
    (kvfuzz's store is vLLM's ``CPUOffloadingManager``, reset as the
    ``OffloadingConnector`` resets it; vLLM issue #57727 is a connector
    whose tier kept serving) and sets the ``reset`` flag of the connector's
    statistics too.
``usage report``
    (scheduler mode) Each request's first output carries the prefill
    statistics its usage reports (``EngineCoreOutput.prefill_stats``,
    ``RequestOutput.num_cached_tokens``: the OpenAI API's
    ``prompt_tokens_details.cached_tokens`` since vLLM PR #18149, split into
    the tokens from the local prefix cache and those a KV connector loaded
    since vLLM PR #33290): its prompt tokens, the local hit it adopted and
    the external tokens of its *first* admission ("Track first scheduled
    prefill, not post-preemption repeat prefills", ``Scheduler.schedule``;
    vLLM PR #17519's review named the refresh on resumption a caveat). So
    every admitted request a client did not abort is reported exactly once,
    with the tokens the ``stats`` rule counts for it and the tokens its
    connector loaded. A request vLLM finished with an error (a failed KV
    load under ``kv_load_failure_policy`` ``fail``) is owed no report: its
    output is the error; whether it should have erred is the connector's
    finish rule (:func:`differential.oracle.connector.finish_findings`).
"""

from __future__ import annotations

import dataclasses

from differential.findings import Finding, FindingKind, Policy
from differential.observation import (
    ConnectorLookup,
    PrefixCacheCounts,
    RequestObservation,
    RunObservation,
)
from differential.oracle.replay import adopted_hit_tokens
from differential.scenario import ConnectorLoad, Scenario

__all__ = ["expected_connector_counts", "expected_counts", "metrics_findings"]

_NAMES = (
    "requests",
    "queries",
    "hits",
    "preempted_requests",
    "preempted_queries",
    "preempted_hits",
)


def _admitted(run: RunObservation) -> list[RequestObservation]:
    # Scheduler mode observes a request aborted before its admission too.
    return [r for r in run.requests if run.mode != "scheduler" or r.scheduled_step is not None]


def expected_counts(run: RunObservation, scenario: Scenario | None = None) -> PrefixCacheCounts:
    """The prefix-cache statistics a run owes (rule ``stats``): one count
    per admission, prompt tokens and local hit (tokens; with a KV connector
    the tokens adopted from the local cache) per first admission, known
    tokens and hit per resumed one. Given the ``scenario`` of a
    scheduler-mode run, a hit its bounded replay does not adopt counts none
    (:func:`differential.oracle.replay.adopted_hit_tokens`)."""
    # A request skipping the prefix cache is not counted ("Don't count a
    # request that skipped the cache lookup", KVCacheManager.record_prefix_cache_stats).
    admitted = [
        r for r in _admitted(run) if scenario is None or scenario.reads_prefix_cache(r.index)
    ]
    resumed = [r for request in admitted for r in request.resumed]
    return PrefixCacheCounts(
        requests=len(admitted),
        queries=sum(r.prompt_tokens for r in admitted),
        hits=sum(_local_hit(run, scenario, r) for r in admitted),
        preempted_requests=len(resumed),
        preempted_queries=sum(r.known_tokens for r in resumed),
        preempted_hits=sum(_adopted(run, scenario, r.hit_tokens) for r in resumed),
    )


def _adopted(run: RunObservation, scenario: Scenario | None, hit_tokens: int) -> int:
    """The tokens of a hit the run adopts: in scheduler mode, none of a hit
    no longer than a bounded-replay window (:func:`adopted_hit_tokens`)."""
    if scenario is None or run.mode != "scheduler":
        return hit_tokens
    return adopted_hit_tokens(scenario, hit_tokens)


def _local_hit(run: RunObservation, scenario: Scenario | None, r: RequestObservation) -> int:
    """The local hit request ``r``'s first admission adopted, in tokens: with
    a KV connector the tokens taken from the local cache."""
    if r.connector is not None:
        return r.connector.local_tokens
    return _adopted(run, scenario, r.hit_tokens)


def _queried_local(connector: ConnectorLookup, scenario: Scenario | None) -> int:
    """The local tokens the store was asked past, in tokens: those adopted,
    or, for a hit the bounded replay then drops (nothing adopted, vLLM PR
    #56227), the local part it had: vLLM counts the connector's query
    before it drops the hit (``Scheduler.schedule``)."""
    if scenario is None or not scenario.prefix_replay_tokens or connector.computed_tokens:
        return connector.local_tokens
    block = scenario.scheduler_block_size_tokens
    matched = connector.matched_tokens - connector.matched_tokens % block
    tail = connector.local_hit_tokens % block
    return connector.local_hit_tokens - (tail if tail and matched > tail else 0)


def expected_connector_counts(
    run: RunObservation, scenario: Scenario | None = None
) -> PrefixCacheCounts:
    """The KV connector's prefix-cache statistics a run owes (rule
    ``connector-stats``): per admission that asked the store about tokens
    past its local hit, one count, those tokens (prompt minus local, in
    tokens) and the tokens the store supplied. Given the ``scenario``, a hit
    its bounded replay drops is counted as asked (:func:`_queried_local`)."""
    asked = [
        (r.prompt_tokens - local, r.connector.external_tokens)
        for r in _admitted(run)
        if r.connector is not None
        and r.prompt_tokens > (local := _queried_local(r.connector, scenario))
    ]
    return PrefixCacheCounts(
        requests=len(asked),
        queries=sum(q for q, _ in asked),
        hits=sum(h for _, h in asked),
    )


def _finding(run: RunObservation, detail: str, policy: Policy) -> Finding:
    return Finding(FindingKind.CACHE_METRICS, run.variant, None, detail, policy=policy)


def _counts_finding(
    run: RunObservation, what: str, got: PrefixCacheCounts, owed: PrefixCacheCounts, policy: Policy
) -> list[Finding]:
    wrong = [
        f"{name} {g} (owed {w})"
        for name, g, w in zip(_NAMES, got.as_tuple(), owed.as_tuple(), strict=True)
        if g != w
    ]
    if not wrong:
        return []
    return [_finding(run, f"{what} summed over the run: " + ", ".join(wrong), policy)]


def _stats_findings(scenario: Scenario, run: RunObservation, policy: Policy) -> list[Finding]:
    metrics = run.metrics
    assert metrics is not None
    store = scenario.workload.connector
    if not scenario.prefix_caching or (store is not None and store.failed_loads):
        # A failed load reschedules the request from scratch: one more lookup.
        return []
    aborted = any(step is not None for step in scenario.workload.abort_steps or ())
    if store is not None and store.load is ConnectorLoad.ASYNC and aborted:
        # A request aborted while its load is in flight was admitted (its
        # lookup counted at admission) but never scheduled: the driver
        # observes no admission for it.
        return []
    expected = expected_counts(run, scenario)
    preempted = any(r.resumed for r in run.requests)
    if store is not None and preempted:
        # What a resumed admission adopts from the local cache beside the
        # store's answer (num_new_local_computed_tokens) is not observed.
        expected = dataclasses.replace(expected, preempted_hits=metrics.stats.preempted_hits)
    findings = _counts_finding(run, "prefix-cache statistics", metrics.stats, expected, policy)
    if store is not None and metrics.connector_stats is not None and not preempted:
        findings += _counts_finding(
            run,
            "KV connector prefix-cache statistics",
            metrics.connector_stats,
            expected_connector_counts(run, scenario),
            policy,
        )
    return findings


def _usage_findings(run: RunObservation, policy: Policy) -> list[Finding]:
    metrics = run.metrics
    assert metrics is not None
    problems = []
    if metrics.usage_min < 0.0 or metrics.usage_max > 1.0:
        problems.append(
            f"KV cache usage read {metrics.usage_min:g} to {metrics.usage_max:g}, "
            "outside 0.0 to 1.0"
        )
    if metrics.usage_end is not None and metrics.usage_end != 0.0:
        problems.append(
            f"KV cache usage {metrics.usage_end:g} once every request had finished (owed 0.0)"
        )
    return [_finding(run, problem, policy) for problem in problems]


def _reset_findings(run: RunObservation, policy: Policy) -> list[Finding]:
    metrics = run.metrics
    assert metrics is not None
    problems = []
    for call in metrics.resets:
        when = "after the run" if call.step is None else f"after step {call.step}"
        if call.holding and call.returned:
            problems.append(
                f"reset_prefix_cache() {when} succeeded while {call.holding} "
                "request(s) held KV blocks (owed a refusal)"
            )
        elif not call.holding and not call.returned:
            problems.append(
                f"reset_prefix_cache() {when} refused with no request holding "
                f"KV blocks ({call.cached_after} cached blocks kept)"
            )
        elif call.returned and call.cached_after:
            problems.append(
                f"reset_prefix_cache() {when} returned true and left "
                f"{call.cached_after} cached blocks (owed none)"
            )
        elif call.returned and call.flagged is False:
            problems.append(
                f"reset_prefix_cache() {when} returned true, but the prefix-cache "
                "statistics read next do not carry the reset flag"
            )
        if call.returned and call.connector_flagged is False:
            problems.append(
                f"reset_prefix_cache(reset_connector=True) {when} returned true, but the KV "
                "connector's prefix-cache statistics read next do not carry the reset flag"
            )
        if call.returned and call.store_held_after:
            problems.append(
                f"reset_prefix_cache(reset_connector=True) {when} returned true and the KV "
                f"connector's store still holds {call.store_held_after} tokens (owed none)"
            )
    return [_finding(run, problem, policy) for problem in problems]


def _owed_report(scenario: Scenario, run: RunObservation, r: RequestObservation) -> tuple[int, ...]:
    """``(prompt, local cached, external cached)`` tokens request ``r``'s
    usage owes: its first admission's, the local hit as the ``stats`` rule
    counts it (:func:`_local_hit`)."""
    external = 0 if r.connector is None else r.connector.external_tokens
    local = _local_hit(run, scenario, r) if scenario.reads_prefix_cache(r.index) else 0
    return (r.prompt_tokens, local, external)


def _report_findings(scenario: Scenario, run: RunObservation, policy: Policy) -> list[Finding]:
    metrics = run.metrics
    assert metrics is not None
    if metrics.prefill_reports is None:
        return []
    reported: dict[int, list[tuple[int, ...]]] = {}
    for index, *counts in metrics.prefill_reports:
        reported.setdefault(index, []).append(tuple(counts))
    aborts = scenario.workload.abort_steps or ()
    erred = {i for i, _ in run.errored or ()}
    wrong = []
    for r in _admitted(run):
        if r.index < len(aborts) and aborts[r.index] is not None:
            continue  # aborted: its output, if any, may never come
        if r.index in erred:
            continue  # finished with an error: judged by the connector's finish rule
        owed = _owed_report(scenario, run, r)
        got = reported.get(r.index, [])
        if got != [owed]:
            shown = "none" if not got else "; ".join(_report_text(g) for g in got)
            wrong.append(f"request {r.index} reported {shown} (owed {_report_text(owed)})")
    if not wrong:
        return []
    more = f" (+{len(wrong) - 1} more request(s))" if len(wrong) > 1 else ""
    return [
        _finding(run, f"usage reports (EngineCoreOutput.prefill_stats): {wrong[0]}{more}", policy)
    ]


def _report_text(counts: tuple[int, ...]) -> str:
    prompt, local, external = counts
    return f"prompt {prompt}, cached {local} local + {external} external"


def metrics_findings(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM
) -> list[Finding]:
    """``cache-metrics`` findings of a run (see the module docstring); none
    for a run that did not finish (vLLM raised, or it timed out) or recorded
    no metrics (engine mode, a release without ``log_stats``).

    Args:
        scenario: the scenario (its connector and prefix caching).
        run: the run (its ``metrics``, requests and mode).
        policy: the policy recorded on the findings (the rules hold under all).
    """
    if run.metrics is None or run.error is not None or run.timed_out:
        return []
    return (
        _stats_findings(scenario, run, policy)
        + _usage_findings(run, policy)
        + _reset_findings(run, policy)
        + _report_findings(scenario, run, policy)
    )

"""The oracle for runs through vLLM's ``Scheduler`` (scheduler mode).

Three rules on top of the per-lookup invariants of
:mod:`differential.oracle.core`:

* **Per lookup, as scheduled.** A sequential run without evictions is judged
  exactly as manager mode judges it (:func:`~differential.oracle.core.judge_run`).
  Otherwise (requests in flight together, drafts, evictions) a request's hit
  is judged against what could have been cached when it was *scheduled*
  (admitted), not when it arrived: it may not exceed, in tokens, the longest
  common prefix of its prompt with the tokens (prompt + sampled tokens) of a
  request admitted before it (or aborted before its admission was recorded,
  having arrived by then: :func:`_unobserved_before`), less the
  drafter-dependent tokens, nor
  ``L - 1``; and it must be a multiple of the hit alignment.
* **Owed at every lookup, from the timeline** (:func:`timeline_writers`).
  A request is owed what the writers that had *finished* before its lookup
  promise (a turn copying an earlier answer, ``workload.shares_output``,
  the blocks its source completed while decoding too), under the same policies as a
  sequential run: a request still in flight promises nothing (it may serve
  more, bounded above), and a writer counts only when its own lookup saw no
  request in flight that shared a prefix with it, so the junction it pinned
  is the one the policy models. A shortfall is a ``fallback``; the run's
  ``needless-drop`` is reported as in a sequential run. Under eviction a
  writer counts only where the **LRU reference** (:func:`lru_survived`)
  proves that none of its blocks can have been evicted by the lookup:
  vLLM's free block queue
  (vllm/v1/core/block_pool.py ``BlockPool.free_blocks``, ``get_new_blocks``,
  ``touch``; vllm/v1/core/kv_cache_utils.py ``FreeKVCacheBlockQueue``)
  appends freed cached blocks and evicts from the front, so a writer's
  blocks outlive as many removals from the queue as it held blocks when the
  writer was first freed. With preemptions this holds on layouts of full
  attention and MLA only; elsewhere preemptions may still lower hits freely
  (state groups are judged sequentially only).
* **Resumed lookups** (:func:`resumed_findings`). A preempted request
  looks up again when rescheduled; on layouts of full attention and MLA
  only it is owed its own prefix, the blocks it had cached when preempted
  that the same queue argument proves still cached
  (:func:`resumed_owed_tokens`); a shortfall is a ``fallback`` naming the
  resumed lookup.
* **Block-level check** (:func:`~differential.oracle.blocks.check_blocks`,
  ``wrong-kv``): every admitting lookup's blocks and every step's writes, as
  in manager mode, evictions included; a block may come from any request
  admitted before the one looking up, finished or still in flight.
* **Mode cross-check** (:func:`cross_check_modes`): a sequential scenario
  gives the same hits through the scheduler as through the manager-level
  driver, else ``mode-mismatch`` naming the first differing call.
* **KV connector's remote store** (:func:`~differential.oracle.connector.connector_findings`,
  ``workload.connector``): each request starts computed at the larger of its
  local hit and what the store holds past the block-aligned local hit, and
  on layouts of full attention and MLA at least what the store provably
  held; with prefix caching off no lookup is owed a local hit.
* **Disaggregated prefill and decode** (:mod:`differential.oracle.disagg`,
  ``workload.connector.kv_role`` ``kv_consumer``): the decode instance is
  owed what the prefill instance computed and saved, and its local cache
  owes later requests what it loaded.
* **Async scheduling** (:mod:`differential.oracle.scheduling`): a run
  under vLLM's ``AsyncScheduler`` is judged on its own timeline by the
  rules above (a step's output is applied one step later, so a writer
  finishes a step later); one-at-a-time arrivals owe the synchronous run's
  hits (``async-mismatch``, made with the synchronous control run in
  :mod:`differential.compare`), and a deferred free the immediate free's
  order (``free-order``, vLLM issue #48489, a named policy).
* **Eviction collapse** (:func:`eviction_collapse`): with dense retention
  every repeated prompt (a later turn of a session, or any prompt that
  repeats an earlier request's tokens for at least one hit alignment:
  :func:`repeated_requests`) hits 0 while retention 0 at the same pool keeps
  hitting (vLLM issue #48435).

Nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Any

from differential.findings import Finding, FindingKind, Policy
from differential.observation import RequestObservation, ResumedLookup, RunObservation
from differential.oracle.blocks import check_blocks, uncovered_findings
from differential.oracle.connector import connector_findings
from differential.oracle.core import (
    DrafterModel,
    SiblingReference,
    drafter_model,
    fallback_finding,
    judge_run,
    needless_drop_finding,
    promise_policy,
    references,
)
from differential.oracle.disagg import disagg_findings
from differential.oracle.kv_events import kv_event_findings
from differential.oracle.metrics import metrics_findings
from differential.oracle.per_group import per_group_findings
from differential.oracle.prefix import common_prefix_tokens, written_contents
from differential.oracle.replay import replay_findings
from differential.oracle.scheduling import free_order_findings
from differential.oracle.watermark import watermark_findings
from differential.scenario import MambaPrefill, Scenario

__all__ = [
    "collapse_applies",
    "cross_check_modes",
    "eviction_collapse",
    "judge_engine_run",
    "judge_observed_run",
    "lru_survived",
    "mode_cross_checkable",
    "repeated_requests",
    "resumed_findings",
    "resumed_owed_tokens",
    "sequentially_judgeable",
    "session_hits",
    "session_of",
    "timeline_writers",
]


def sequentially_judgeable(scenario: Scenario, run: RunObservation) -> bool:
    """Whether the manager-mode judgement applies exactly: one request at a
    time, no drafts and nothing evicted. A later turn that copies an earlier
    request's answer (``workload.shares_output``) is judged so too: the
    references count the blocks its source completed while decoding
    (:func:`~differential.oracle.core.writer_extent`)."""
    w = scenario.workload
    return w.sequential and not run.evicted_blocks


def lru_survived(writer: RequestObservation, reader: RequestObservation) -> bool:
    """Whether the LRU reference proves that no block ``writer`` freed can
    have been evicted by ``reader``'s admitting lookup.

    vLLM's ``BlockPool`` (vllm/v1/core/block_pool.py) keeps its free blocks
    in a ``FreeKVCacheBlockQueue`` (vllm/v1/core/kv_cache_utils.py):
    ``free_blocks`` appends a freed cached block at the back ("FIFO reuse of
    cached blocks for LRU eviction behavior") and prepends an uncached one,
    ``get_new_blocks`` pops from the front (``popleft_n``), evicting a cached
    block it pops, and ``touch`` takes a block a hit adopts out of the queue
    (``remove``). Let ``Q`` be the queue's length just before the first
    ``free_blocks`` call made on the writer's behalf since it was last
    scheduled from the waiting queue (``writer.freed_queue_blocks``), in
    blocks. Every block the writer frees
    from then on is appended behind each of those ``Q`` blocks still queued
    (a block re-freed after a hit adopted it, too), and a block leaves only
    from the front or by ``remove``; so before one of the writer's blocks is
    popped, each of the ``Q`` has been removed, and the pop is one removal
    more. The writer's blocks therefore all survive while at most ``Q``
    blocks have been removed since (``reader.lookup_queue_removals -
    writer.freed_queue_removals``, in blocks; counting removals of any block
    only over-counts). ``False`` when either count was not recorded.
    """
    if (
        writer.freed_queue_blocks is None
        or writer.freed_queue_removals is None
        or reader.lookup_queue_removals is None
    ):
        return False
    return reader.lookup_queue_removals - writer.freed_queue_removals <= writer.freed_queue_blocks


def timeline_writers(scenario: Scenario, run: RunObservation) -> list[frozenset[int]] | None:
    """Per request, the earlier requests whose cached blocks it is owed at its
    lookup (see the module docstring); ``None`` when the run's timeline does
    not support an exact promise (state groups, a failed or partial run, no
    timeline recorded, preemptions outside layouts of full attention and MLA
    only or with a KV connector, a KV connector's store outside those
    layouts, or evictions without the free queue's counters: manager mode,
    older files). A request whose prefix the store loaded holds only the
    blocks a sliding-window group reads at its end
    (``SingleTypeKVCacheManager.allocate_external_computed_blocks`` skips the
    rest), so it does not cache what a writer that computed them would.

    A writer ``i`` counts for request ``j`` when ``i < j``, ``i`` finished
    (``finished_step``, by itself: an aborted request promises nothing,
    :func:`_aborted`) before the step that admitted ``j``
    (``scheduled_step``), and no request admitted before ``i`` and unfinished
    at ``i``'s admission shares a prefix with ``i`` (with ``i``'s prompt
    continuing its content, its answer included in a multi-turn chat:
    :func:`~differential.oracle.prefix.written_contents`). A writer promises
    the blocks it completed while decoding as well as its prompt's
    (:func:`~differential.oracle.core.writer_extent`); with accepted drafts
    it may have computed more (a step's accepted drafts past its last
    token), which it may serve, never less.

    A preempted writer is judged like any other on full attention and MLA:
    those groups cache every full block it computed whatever its lookups
    found, its block table holds its whole prefix when it finishes, and its
    counters are those of the first free after it resumed (its finish: full
    attention frees nothing earlier), which is all the LRU rule below needs.
    In a run that evicted cached blocks, ``i`` counts for ``j`` only when
    :func:`lru_survived` proves ``i``'s blocks were all still cached at
    ``j``'s lookup (units: blocks of vLLM's free queue). Outside layouts of
    full attention and MLA only, ``i``'s promise also rests on blocks it
    found cached and did not hold itself (a sliding window or a chunked
    local group hands out the null block below its window, vLLM
    ``SlidingWindowManager.find_longest_cache_hit``), and the junction it
    pinned depends on what its own lookup found: there ``i`` counts only
    when every request that finished before ``i``'s admission and shares a
    prefix with ``i`` (prompt, or prompt and answer) survived to ``j``'s
    lookup as well.
    """
    if not _timeline_promises(scenario, run):
        return None
    requests = run.requests
    prompts = scenario.contents
    written = written_contents(scenario)

    def finished_before(r: RequestObservation) -> list[RequestObservation]:
        return [
            q
            for q in requests
            if q.finished_step is not None
            and not _aborted(scenario, q)
            and r.scheduled_step is not None
            and q.finished_step < r.scheduled_step
        ]

    def in_flight_sharers(r: RequestObservation) -> bool:
        done = {q.index for q in finished_before(r)}
        return any(
            q.index not in done and common_prefix_tokens(written[q.index], prompts[r.index])
            for q in requests
            if q.lookup_order is not None
            and r.lookup_order is not None
            and q.lookup_order < r.lookup_order
        )

    clean = {r.index for r in requests if not in_flight_sharers(r)}
    writers = [
        frozenset(q.index for q in finished_before(r) if q.index in clean and q.index < r.index)
        for r in requests
    ]
    if not run.evicted_blocks:
        return writers
    if _full_attention_only(scenario):
        ancestors = [frozenset[int]() for _ in requests]
    else:
        tokens = [p + scenario.sampled_contents(i) for i, p in enumerate(prompts)]
        ancestors = [
            frozenset(
                q.index
                for q in finished_before(r)
                if common_prefix_tokens(prompts[r.index], tokens[q.index])
            )
            for r in requests
        ]
    return [
        frozenset(
            i
            for i in writers[r.index]
            if all(lru_survived(requests[k], r) for k in ancestors[i] | {i})
        )
        for r in requests
    ]


def _aborted(scenario: Scenario, request: RequestObservation) -> bool:
    """Whether ``request``'s client aborted it before it finished by itself
    (:meth:`~differential.observation.RequestObservation.aborted_by_client`):
    it promises nothing (:func:`timeline_writers`), under either scheduler."""
    return request.aborted_by_client(scenario.workload.abort_steps)


def _timeline_promises(scenario: Scenario, run: RunObservation) -> bool:
    """Whether the run's timeline supports an exact promise at every lookup
    (:func:`timeline_writers`): no state groups, a complete run that did not
    fail, every request's admitting step and lookup order recorded, a KV
    connector's store only on layouts of full attention and MLA, preemptions
    only there and without a KV connector, and evictions only with the free
    queue's counters."""
    requests = run.requests
    if (
        (scenario.workload.connector is not None and not _full_attention_only(scenario))
        or (run.preemptions and (not _full_attention_only(scenario) or scenario.kv_connector))
        or run.error is not None
        or scenario.mamba_groups
        or [r.index for r in requests] != list(range(len(scenario.requests)))
        or any(r.scheduled_step is None or r.lookup_order is None for r in requests)
    ):
        return False
    return not (run.evicted_blocks and any(r.lookup_queue_removals is None for r in requests))


def _full_attention_only(scenario: Scenario) -> bool:
    """Every group is driven by vLLM's ``FullAttentionManager`` (full
    attention, MLA): a request's block table holds every block of its
    prefix, and no retention mask or junction decides what it caches."""
    return all(g.kind.full_attention_family for g in scenario.kv_cache_groups)


def resumed_owed_tokens(scenario: Scenario, model: DrafterModel, lookup: ResumedLookup) -> int:
    """What a preempted request's resumed lookup is owed of its own prefix, in tokens.

    Full-attention and MLA groups only (:func:`resumed_findings` says when
    it applies). When vLLM preempted the request (vllm/v1/core/sched/scheduler.py
    ``Scheduler._preempt_request``), every full block of its
    ``C = preempted_computed_tokens`` computed tokens was cached
    (``KVCacheManager.allocate_slots`` caches ``min(computed + new,
    num_tokens)`` tokens, ``update_from_output`` the accepted drafts),
    except the last ``k`` tokens' blocks under lookahead hashes (a block's
    hash needs ``k`` tokens past it): ``c_g = min(C, T_p - k) // B_g`` blocks
    in a group of block size ``B_g``, ``T_p`` the tokens known at the
    preemption (``preempted_known_tokens``; under async scheduling the token
    a step still in flight samples is appended after the free, so its
    block's hash did not exist when the blocks were cached; ``known_tokens``
    where not recorded). Under async scheduling a step still in flight
    also computes tokens that were output placeholders when it was
    scheduled; their blocks are cached only when its output is applied,
    which the preemption prevents, so ``C`` is read as the tokens cached
    (:func:`_resumed_cached_tokens`). ``KVCacheManager.free``
    hands them to vLLM's free queue tail block first
    (vllm/v1/core/block_pool.py ``BlockPool.free_blocks``; vllm/v1/core/kv_cache_utils.py
    ``FreeKVCacheBlockQueue``), behind the ``Q`` blocks queued; a request
    holding block ``j`` holds every block before it (full attention keeps
    its whole prefix), so block ``j`` is never queued ahead of a later one
    of the same prefix. Block ``j`` can therefore be evicted only after the
    ``Q`` and the ``c_g - 1 - j`` later blocks have all left the queue: with
    ``R`` blocks removed between the free and the lookup, the first
    ``min(c_g, max(0, Q + c_g - R))`` blocks are still cached. The owed hit
    is then the dense reference on that prefix
    (:func:`differential.oracle.core.dense_hit`'s rule): within ``T - 1``,
    one block less in a group that takes the EAGLE drop, a multiple of the
    hit alignment ``A``. 0 when the counters were not recorded.
    """
    if (
        lookup.freed_queue_blocks is None
        or lookup.freed_queue_removals is None
        or lookup.lookup_queue_removals is None
    ):
        return 0
    queued = lookup.freed_queue_blocks
    removed = lookup.lookup_queue_removals - lookup.freed_queue_removals
    known = lookup.known_tokens
    computed = _resumed_cached_tokens(lookup, model.hash_lookahead_tokens)
    drops = scenario.drop_group_indices if model.drop else frozenset()
    limit = known - 1
    for index, group in enumerate(scenario.kv_cache_groups):
        block = group.block_size_tokens
        cached = max(0, computed) // block
        surviving = min(cached, max(0, queued + cached - removed))
        limit = min(limit, surviving * block - (block if index in drops else 0))
    alignment = scenario.effective_hit_alignment_tokens
    return max(0, limit) // alignment * alignment


def _resumed_cached_tokens(lookup: ResumedLookup, lookahead: int) -> int:
    """The tokens of a preempted request whose blocks vLLM had cached when
    ``Scheduler._preempt_request`` freed them (vllm/v1/core/sched/scheduler.py),
    in tokens (:func:`resumed_owed_tokens`), ``lookahead`` the hash lookahead
    in tokens (a block's hash needs that many tokens past it).

    Two calls cache a running request's blocks, each within the block
    hashes its known tokens make: ``KVCacheManager.allocate_slots``
    (vllm/v1/core/kv_cache_manager.py) when a step is scheduled, up to
    ``min(computed + new, request.num_tokens)``, "only 'finalized' tokens",
    never an output placeholder; and, under async scheduling or with
    drafts, ``Scheduler.update_from_output`` when a step's output is
    applied, up to ``num_computed_tokens - num_in_flight_tokens``: the
    tokens of the steps processed. A token that a step still in flight at
    the preemption computes, and that was a placeholder when that step was
    scheduled, is cached by neither: the preemption makes the step's output
    stale, and stale output caches nothing. With ``C`` computed tokens,
    ``F`` of them in flight, ``T_p`` tokens known at the free and ``T_s``
    when ``allocate_slots`` last scheduled the request, the cached tokens
    are ``max(min(C - F, T_p - k), min(C, T_s - k))``; where ``F`` and
    ``T_s`` were not recorded, ``min(C, T_p - k)`` (``T_p`` the tokens at
    the lookup where that was not recorded either).
    """
    computed = lookup.preempted_computed_tokens
    at_free = (
        lookup.known_tokens
        if lookup.preempted_known_tokens is None
        else lookup.preempted_known_tokens
    )
    if lookup.preempted_in_flight_tokens is None or lookup.scheduled_known_tokens is None:
        return min(computed, at_free - lookahead)
    processed = min(computed - lookup.preempted_in_flight_tokens, at_free - lookahead)
    return max(processed, min(computed, lookup.scheduled_known_tokens - lookahead))


def resumed_findings(scenario: Scenario, run: RunObservation, policy: Policy) -> list[Finding]:
    """``fallback`` per resumed lookup (:class:`~differential.observation.ResumedLookup`)
    that hit less than its own surviving prefix (:func:`resumed_owed_tokens`).

    Judged on layouts of full attention and MLA only, without a KV connector
    (its loads change what a lookup counts as computed) and for drafters
    whose writer leaves no re-prefillable tail (multi-module MTP does); a
    resumed lookup is owed only its own prefix, not what other writers
    cached, and is bounded above by nothing more than the admitting lookup's
    rules already say.
    """
    model = drafter_model(scenario)
    if (
        not _full_attention_only(scenario)
        or scenario.kv_connector
        or scenario.mamba_groups
        or model.reprefillable_tokens
    ):
        return []
    findings: list[Finding] = []
    for r in run.requests:
        if not scenario.reads_prefix_cache(r.index):
            continue  # it recomputes every token, after a preemption too
        for k, lookup in enumerate(r.resumed):
            owed = resumed_owed_tokens(scenario, model, lookup)
            if lookup.hit_tokens >= owed:
                continue
            findings.append(
                Finding(
                    FindingKind.FALLBACK,
                    run.variant,
                    r.index,
                    f"resumed lookup {k + 1} (step {lookup.step}, after a preemption): hit "
                    f"{lookup.hit_tokens}, owed {owed} of its own prefix: "
                    f"{lookup.preempted_computed_tokens} tokens computed when preempted, "
                    f"{lookup.freed_queue_blocks} blocks queued at the free, "
                    f"{(lookup.lookup_queue_removals or 0) - (lookup.freed_queue_removals or 0)} "
                    "removed from the free queue by the lookup",
                    divergence_tokens=lookup.known_tokens,
                    expected_tokens=owed,
                    hit_tokens=lookup.hit_tokens,
                    policy=policy,
                )
            )
    return findings


def _timeline_findings(scenario: Scenario, run: RunObservation, policy: Policy) -> list[Finding]:
    """``fallback`` per lookup owed by its finished writers, and the run's
    ``needless-drop`` (empty when :func:`timeline_writers` gives ``None``)."""
    writers = timeline_writers(scenario, run)
    if writers is None:
        return []
    model = drafter_model(scenario)
    findings: list[Finding] = []
    needless = needless_drop_finding(scenario, run, model, policy)
    if needless is not None:
        findings.append(needless)
    hits = run.hits
    vrefs = references(scenario, model, hits, promise_policy(policy), writers=writers)
    for vref, hit in zip(vrefs, hits, strict=True):
        if vref.writer is not None and hit < vref.expected_tokens:
            common: dict[str, Any] = {
                "divergence_tokens": vref.divergence_tokens,
                "hit_tokens": hit,
                "policy": policy,
            }
            findings.append(fallback_finding(run.variant, vref, hit, common))
    return findings


def mode_cross_checkable(scenario: Scenario) -> bool:
    """Whether both modes must give the same hits: a sequential workload,
    synchronous scheduling (an async run is compared with the synchronous
    Scheduler's instead: :func:`differential.oracle.scheduling.cross_check_scheduling`)
    and vLLM's own prefill chunking, with or without internal checkpoints (a
    block-carved Mamba prefill, ``mamba_prefill: block``, is not what the
    scheduler does)."""
    return (
        scenario.workload.sequential
        and not scenario.workload.async_scheduling
        and scenario.mamba_prefill is not MambaPrefill.BLOCK
    )


def session_of(scenario: Scenario, index: int) -> int:
    """The first turn (request index) of request ``index``'s session: the root
    of its ``shares_with`` chain."""
    while (source := scenario.requests[index].shares_with) is not None:
        index = source
    return index


def session_hits(scenario: Scenario, run: RunObservation) -> dict[int, list[int]]:
    """Per session (its first request's index), the hits of its turns in
    request order, in tokens."""
    out: dict[int, list[int]] = {}
    for r in run.requests:
        out.setdefault(session_of(scenario, r.index), []).append(r.hit_tokens)
    return out


def judge_observed_run(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM
) -> tuple[tuple[SiblingReference, ...], tuple[Finding, ...]]:
    """Judge one run on its own, as every command judges it.

    A scheduler-mode run (``run.mode == "scheduler"``) and a chat
    (``workload.shares_output``: a turn copies its source's answer, in either
    mode) are judged by :func:`judge_engine_run`, which judges a sequential
    run without evictions by :func:`differential.oracle.judge_run` and any
    other on its own timeline; a manager-mode run of prompts alone by
    :func:`differential.oracle.judge_run`. The one place that choice is
    made, so that a verdict re-judged elsewhere (triage judging a run with
    the protection it used, ``confirm`` judging a release's run) is the
    verdict the run was first given.

    Returns:
        The references and the findings, as :func:`judge_engine_run`.
    """
    if run.mode == "scheduler" or scenario.workload.shares_output:
        return judge_engine_run(scenario, run, policy)
    return judge_run(scenario, run, policy)


def _unobserved_before(scenario: Scenario, run: RunObservation, r: RequestObservation) -> list[int]:
    """The requests with no observation in ``run`` (a client aborted them
    before their admission was recorded, ``workload.abort_steps``) that may
    have written before ``r``'s lookup: those that arrived by ``r``'s
    admitting step (``arrival_steps``; one at a time: those before ``r``).
    Such a request may have been looked up all the same: an asynchronous
    KV connector load is scheduled whatever else holds its prefill back
    (``Scheduler.schedule``'s ``load_kv_async`` branch), and the blocks it
    loaded are cached when the load completes
    (``Scheduler._update_waiting_for_remote_kv``), so a later request may
    hit them. The bound on a hit counts them; nothing is owed from them."""
    observed = {q.index for q in run.requests}
    arrivals = scenario.workload.arrival_steps
    return [
        k
        for k in range(len(scenario.requests))
        if k not in observed
        and (
            k < r.index
            if arrivals is None or r.scheduled_step is None
            else arrivals[k] <= r.scheduled_step
        )
    ]


def judge_engine_run(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM
) -> tuple[tuple[SiblingReference, ...], tuple[Finding, ...]]:
    """Judge a scheduler-mode run (see the module docstring).

    Returns:
        The references (only when judged sequentially) and the findings.
    """
    if run.unsupported is not None:
        return (), ()
    if sequentially_judgeable(scenario, run):
        return judge_run(scenario, run, policy)
    findings: list[Finding] = []
    if run.error is not None:
        findings.append(
            Finding(FindingKind.CRASH, run.variant, len(run.requests), run.error, policy=policy)
        )
    model = drafter_model(scenario)
    alignment = scenario.effective_hit_alignment_tokens
    prompts = scenario.contents
    tokens = [p + scenario.sampled_contents(i) for i, p in enumerate(prompts)]
    order = {
        r.index: (r.lookup_order if r.lookup_order is not None else r.index) for r in run.requests
    }
    for r in run.requests:
        earlier = [k for k, rank in order.items() if rank < order[r.index]]
        earlier += _unobserved_before(scenario, run, r)
        shared = max(
            (common_prefix_tokens(prompts[r.index], tokens[k]) for k in earlier), default=0
        )
        length = scenario.requests[r.index].prompt_tokens
        ceiling = min(length - 1, max(0, shared - model.dependency_tokens))
        common: dict[str, Any] = {
            "divergence_tokens": shared,
            "hit_tokens": r.hit_tokens,
            "policy": policy,
        }
        if not scenario.reads_prefix_cache(r.index) and r.hit_tokens:
            findings.append(
                Finding(
                    FindingKind.OVER_HIT,
                    run.variant,
                    r.index,
                    f"hit {r.hit_tokens}, but the request skips reading the prefix cache "
                    "(skip_reading_prefix_cache, vLLM PR #28194): it computes every prompt "
                    "token",
                    expected_tokens=0,
                    **common,
                )
            )
        elif r.hit_tokens > ceiling:
            findings.append(
                Finding(
                    FindingKind.OVER_HIT,
                    run.variant,
                    r.index,
                    f"hit {r.hit_tokens} exceeds what requests admitted before it (step "
                    f"{r.scheduled_step}) could have cached: {shared} shared tokens"
                    + (
                        f" minus {model.dependency_tokens} drafter-dependent token(s)"
                        if model.dependency_tokens
                        else ""
                    ),
                    expected_tokens=ceiling,
                    **common,
                )
            )
        if r.hit_tokens % alignment:
            findings.append(
                Finding(
                    FindingKind.MISALIGNED,
                    run.variant,
                    r.index,
                    f"hit {r.hit_tokens} is not a multiple of the hit alignment {alignment}",
                    expected_tokens=r.hit_tokens // alignment * alignment,
                    **common,
                )
            )
    if scenario.prefix_caching:  # else no lookup may hit: nothing is owed locally
        findings += _timeline_findings(scenario, run, policy)
        findings += resumed_findings(scenario, run, policy)
        findings += per_group_findings(scenario, run, policy)
    findings += kv_event_findings(scenario, run, policy)
    findings += watermark_findings(scenario, run, policy)
    findings += replay_findings(scenario, run, policy)
    findings += metrics_findings(scenario, run, policy)
    findings += connector_findings(scenario, run, policy)
    findings += disagg_findings(scenario, run, policy)
    findings += free_order_findings(scenario, run, policy)
    findings += check_blocks(scenario, run, policy)
    findings += uncovered_findings(scenario, run, policy)
    return (), tuple(findings)


def cross_check_modes(
    scenario: Scenario, scheduler_run: RunObservation, manager_run: RunObservation
) -> tuple[Finding, ...]:
    """``mode-mismatch`` if a sequential scenario's hits differ between modes.

    The finding names the first request whose hit differs and, within its
    lookup, the first differing call: a single-type manager
    ``find_longest_cache_hit`` (group, length cap, result) when the traces
    differ there, else ``KVCacheManager.get_computed_blocks``.

    Runs where either driver evicted a cached block are not compared: which
    block the pool evicts follows the order blocks were allocated and freed,
    and only vLLM's ``Scheduler`` (vllm/v1/core/sched/scheduler.py) has the
    engine's order; the manager-level driver allocates each request's
    prefill, sampled tokens and lookahead slots in its own order, so under
    eviction the two can keep different blocks without either being wrong.
    A scheduler run that crashed is not compared either: its ``crash`` is
    the finding.
    """
    if not mode_cross_checkable(scenario):
        return ()
    if scheduler_run.unsupported is not None or manager_run.unsupported is not None:
        return ()
    if scheduler_run.evicted_blocks or manager_run.evicted_blocks:
        return ()
    if scheduler_run.error is not None:
        return ()  # the Scheduler's own crash is the finding; the replica adds nothing
    variant = scheduler_run.variant
    for s, m in zip(scheduler_run.requests, manager_run.requests, strict=False):
        if s.hit_tokens == m.hit_tokens:
            continue
        call = f"KVCacheManager.get_computed_blocks of request {s.index}"
        for k, (a, b) in enumerate(zip(s.lookup, m.lookup, strict=False)):
            if a != b:
                call = (
                    f"single-type find_longest_cache_hit #{k} of request {s.index} "
                    f"(group {a.group}, max_length {a.max_length_tokens} vs "
                    f"{b.max_length_tokens}, hit {a.hit_tokens} vs {b.hit_tokens})"
                )
                break
        return (
            Finding(
                FindingKind.MODE_MISMATCH,
                variant,
                s.index,
                f"hit {s.hit_tokens} through vLLM's Scheduler, {m.hit_tokens} through the "
                f"manager-level driver; first differing call: {call}; hits "
                f"{list(scheduler_run.hits)} (scheduler) vs {list(manager_run.hits)} (manager)",
                expected_tokens=m.hit_tokens,
                hit_tokens=s.hit_tokens,
            ),
        )
    if len(scheduler_run.requests) != len(manager_run.requests) or (
        (scheduler_run.error is None) != (manager_run.error is None)
    ):
        return (
            Finding(
                FindingKind.MODE_MISMATCH,
                variant,
                None,
                f"{len(scheduler_run.requests)} requests completed through the Scheduler "
                f"(error: {scheduler_run.error}), {len(manager_run.requests)} through the "
                f"manager-level driver (error: {manager_run.error})",
            ),
        )
    return ()


def repeated_requests(scenario: Scenario) -> frozenset[int]:
    """The requests whose prompt repeats an earlier request's tokens (its
    prompt, or its prompt and answer) for at least one hit alignment
    (``Scenario.effective_hit_alignment_tokens``), whether written as a later
    turn (``shares_with``) or as plain token content: what a prefix cache is
    for, and so what an eviction collapse loses."""
    prompts = scenario.contents
    tokens = [p + scenario.sampled_contents(i) for i, p in enumerate(prompts)]
    unit = scenario.effective_hit_alignment_tokens
    return frozenset(
        j
        for j in range(1, len(prompts))
        if max(common_prefix_tokens(prompts[j], tokens[i]) for i in range(j)) >= unit
    )


def collapse_applies(scenario: Scenario) -> bool:
    """Whether :func:`eviction_collapse` applies (and so its retention-0 control
    run is owed): dense retention, a pool size, a group that retention thins
    (sliding window or Mamba), a repeated prompt (:func:`repeated_requests`)
    and a prefix cache (without one nothing is retained or hit)."""
    return (
        scenario.prefix_caching
        and scenario.retention_interval_tokens is None
        and scenario.workload.pool_blocks is not None
        and bool(scenario.sliding_window_groups or scenario.mamba_groups)
        and bool(repeated_requests(scenario))
    )


def eviction_collapse(
    scenario: Scenario, dense_run: RunObservation, retention0_run: RunObservation
) -> Finding | None:
    """``eviction-collapse`` when dense retention loses every cross-request hit
    that retention 0 at the same pool size keeps (vLLM issue #48435).

    Only repeated prompts count (:func:`repeated_requests`); the rule needs
    at least one. ``None`` when the pattern is absent or a run failed.
    """
    repeated = repeated_requests(scenario)
    later = [r for r in dense_run.requests if r.index in repeated]
    if not later or dense_run.error is not None or retention0_run.error is not None:
        return None
    if any(r.hit_tokens for r in later):
        return None
    kept = [r for r in retention0_run.requests if r.index in repeated and r.hit_tokens]
    if not kept:
        return None
    dense_hits = session_hits(scenario, dense_run)
    r0_hits = session_hits(scenario, retention0_run)
    return Finding(
        FindingKind.EVICTION_COLLAPSE,
        dense_run.variant,
        None,
        f"pool {dense_run.pool_blocks} blocks: dense retention hits per session "
        f"{list(dense_hits.values())}, retention 0 {list(r0_hits.values())}; dense "
        f"retention evicted {dense_run.evicted_blocks} cached blocks, "
        f"{dense_run.unreachable_cached_blocks} cached blocks left unreachable",
    )

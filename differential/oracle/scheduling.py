"""Async scheduling: what a run under vLLM's ``AsyncScheduler`` owes.

Under async scheduling (``SchedulerConfig.async_scheduling``; vLLM's
``EngineCore.step_with_batch_queue``, vllm/v1/engine/core.py) the scheduler
plans step ``n + 1`` before step ``n``'s model output is applied. Caching is
not allowed to depend on that: the prefix cache is keyed by token content
(vllm/v1/core/kv_cache_utils.py ``hash_block_tokens``), and vLLM's code
changes only *when* a block is cached or freed, in two places:

* a block whose tokens are still in flight is not cached yet. Prefill
  blocks are cached when a step is scheduled, as without async scheduling
  (``KVCacheManager.allocate_slots`` caches ``min(computed + new,
  request.num_tokens)``: the prompt and applied outputs, never a
  placeholder), and decoded blocks when their step's output is applied
  (``Scheduler.update_from_output`` caches ``num_computed_tokens -
  num_in_flight_tokens``, "under async scheduling, num_output_placeholders"
  counting the tokens not yet sampled; vllm/v1/core/sched/scheduler.py). A
  request in flight promises nothing to a later lookup in either mode, so
  the scheduler-mode timeline rules
  (:func:`differential.oracle.engine.timeline_writers`) judge an async run
  on its own timeline: a writer counts once the step that applied its last
  output is over;
* with a KV consumer connector and more than one batch in flight, a freed
  request's blocks stay allocated until the steps that may still write them
  are processed (``Scheduler.defer_block_free``, ``_free_request_blocks``,
  ``_drain_deferred_frees``; vLLM PR #45357: "defers the actual return of
  freed KV blocks to the block pool until the newest in-flight scheduled
  step has finished"), which moves evictions under pool pressure.

Two rules follow.

* **Async against sync** (:func:`cross_check_scheduling`, ``async-mismatch``):
  a workload whose requests arrive one at a time (``arrival_steps`` null)
  and are never aborted has one timeline whatever the scheduler: each
  request is looked up after every earlier one finished, so the async run
  must give every request the hit the synchronous run of the same scenario
  gives it, wherever neither run evicted a cached block (deferred frees and
  the extra step that applies each last output move evictions) and both
  completed.
* **Deferred-free order** (:func:`free_order_findings`, ``free-order``): a
  deferred free is the immediate free, later. The immediate path
  (``KVCacheCoordinator.free``, vllm/v1/core/kv_cache_coordinator.py) frees
  group by group, each group's blocks tail first
  (``SingleTypeKVCacheManager.free``: "so that the tail blocks are freed
  first"); vLLM 0.33.0's deferred path concatenates the groups' blocks
  (``KVCacheCoordinator.pop_blocks_for_free``) and reverses the whole list
  once, so on a model of several KV cache groups the last group's blocks go
  back to the free queue first and the eviction order changes (vLLM issue
  #48489, open; PR #48532, open, restores the per-group order). Upstream has
  not settled it, so the order owed is a named policy
  (:data:`FREE_ORDER_POLICIES`): ``per-group`` (the immediate path's order,
  what the deferral was merged as) under the ``vllm`` and ``ideal``
  policies, ``flattened`` (0.33.0's code, whose docstring asks the caller to
  free the concatenated list "in reverse order") under ``retained``, which
  accepts what the release does.

Nothing here imports vLLM.
"""

from __future__ import annotations

from differential.findings import Finding, FindingKind, Policy
from differential.observation import RunObservation
from differential.scenario import Scenario

__all__ = [
    "FREE_ORDER_POLICIES",
    "async_cross_checkable",
    "cross_check_scheduling",
    "free_order_findings",
    "immediate_free_order",
]

#: The deferred-free order owed under each checkpoint policy (see the
#: module docstring): ``per-group`` or ``flattened``.
FREE_ORDER_POLICIES: dict[Policy, str] = {
    Policy.VLLM: "per-group",
    Policy.IDEAL: "per-group",
    Policy.RETAINED: "flattened",
}


def async_cross_checkable(scenario: Scenario) -> bool:
    """Whether an async run must give the synchronous run's hits: async
    scheduling, requests arriving one at a time (``arrival_steps`` null),
    none aborted (an abort step is a point in the run's own timeline)."""
    w = scenario.workload
    return w.async_scheduling and w.arrival_steps is None and w.abort_steps is None


def cross_check_scheduling(
    scenario: Scenario,
    async_run: RunObservation,
    sync_run: RunObservation,
    policy: Policy = Policy.VLLM,
) -> tuple[Finding, ...]:
    """``async-mismatch`` when a workload of one request at a time
    (:func:`async_cross_checkable`) gives a request another hit under vLLM's
    ``AsyncScheduler`` (``async_run``) than under its synchronous
    ``Scheduler`` (``sync_run``, the same scenario with
    ``workload.async_scheduling`` off), in tokens; nothing when either run
    evicted a cached block, failed or was unsupported (its own finding
    says so). The finding names the first request whose hit differs and
    both hit lists."""
    if not async_cross_checkable(scenario):
        return ()
    runs = (async_run, sync_run)
    if any(r.unsupported is not None or r.error is not None or r.evicted_blocks for r in runs):
        return ()
    for a, s in zip(async_run.requests, sync_run.requests, strict=False):
        if a.hit_tokens == s.hit_tokens:
            continue
        return (
            Finding(
                FindingKind.ASYNC_MISMATCH,
                async_run.variant,
                a.index,
                f"hit {a.hit_tokens} under vLLM's AsyncScheduler, {s.hit_tokens} under its "
                f"synchronous Scheduler for the same one-at-a-time arrivals, nothing evicted; "
                f"hits {list(async_run.hits)} (async) vs {list(sync_run.hits)} (sync)",
                expected_tokens=s.hit_tokens,
                hit_tokens=a.hit_tokens,
                policy=policy,
            ),
        )
    return ()


def immediate_free_order(blocks: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The order the immediate path frees ``blocks`` in (``(KV cache group,
    index in its block table)`` pairs): group by group in group order
    (``KVCacheCoordinator.free``), each group's blocks from its last to its
    first (``SingleTypeKVCacheManager.free`` reverses the table)."""
    return tuple(sorted(blocks, key=lambda b: (b[0], -b[1])))


def free_order_findings(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM
) -> list[Finding]:
    """One ``free-order`` finding per request whose deferred free
    (``RunObservation.deferred_frees``) handed its blocks to the block pool
    in another order than the immediate path (:func:`immediate_free_order`),
    under the ``per-group`` order policy (:data:`FREE_ORDER_POLICIES`); the
    first block out of place is named. Nothing under ``flattened``."""
    if FREE_ORDER_POLICIES[policy] != "per-group":
        return []
    findings: list[Finding] = []
    flagged: set[int] = set()
    for request, step, blocks in run.deferred_frees:
        owed = immediate_free_order(blocks)
        if blocks == owed or request in flagged:
            continue
        flagged.add(request)
        k = next(k for k, (got, due) in enumerate(zip(blocks, owed, strict=True)) if got != due)
        groups = sorted({g for g, _ in blocks})
        findings.append(
            Finding(
                FindingKind.FREE_ORDER,
                run.variant,
                request,
                f"step {step}: the deferred free of its {len(blocks)} blocks in "
                f"{len(groups)} KV cache groups handed block {k + 1} to the free queue as "
                f"group {blocks[k][0]}'s block {blocks[k][1]}, where the immediate free "
                f"hands group {owed[k][0]}'s block {owed[k][1]} (group by group, each "
                f"tail first): groups freed in the order "
                f"{_group_runs(blocks)} instead of {_group_runs(owed)}",
                policy=policy,
            )
        )
    return findings


def _group_runs(blocks: tuple[tuple[int, int], ...]) -> list[int]:
    """The groups in the order their blocks come, each run of one group once."""
    runs: list[int] = []
    for group, _ in blocks:
        if not runs or runs[-1] != group:
            runs.append(group)
    return runs

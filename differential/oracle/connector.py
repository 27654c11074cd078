"""What a KV connector's remote store is owed (scheduler mode, ``workload.connector``).

Its rules (the first three per admitted request with a
:class:`~differential.observation.ConnectorLookup`):

* **Adoption** (:func:`adoption_owed`, any layout). vLLM's ``Scheduler.schedule``
  (vllm/v1/core/sched/scheduler.py, the waiting loop) shows the connector its
  local hit ``h`` rounded down to the scheduler block ``B`` (``a = h - h % B``)
  and the connector answers the tokens ``m`` it holds beyond ``a``
  (``get_num_new_matched_tokens``: "the number of new tokens that can be
  loaded from the external KV cache beyond the num_computed_tokens",
  vllm/distributed/kv_transfer/kv_connector/v1/base.py). The request then
  starts computed at ``max(h, a + m)``: a sub-block local tail is kept unless
  the remote hit strictly exceeds it, in which case the tail is dropped and
  the load covers it (``truncate_computed_blocks``, vLLM PR #49502, whose
  caller "present[s] a block-aligned local hit to the connector so a
  strictly longer remote hit can supersede a local sub-block tail"), and
  otherwise local and external add up (vLLM PR #15960, the connector API:
  computed = local + external). One trim is vLLM's documented policy and is
  not judged: a Mamba hybrid whose connector declares
  ``supports_divergent_local_hybrid_hits`` is shown the full-attention hit
  even where a Mamba group hit less; when the connector adds nothing the
  scheduler reconciles to the hit every group holds, without asking the
  connector again (vLLM PR #50344, "an external miss ... uses a locally
  consistent boundary", after issue #46453 and PR #48425). With a
  bounded-replay group (DeepSeek-V4.1's SWA bounded replay, vLLM PR
  #56227: ``prefix_replay_tokens``, the window ``W``) the store's answer is
  taken in whole blocks, since a store of prefix-cache blocks restores no
  window ("Hits end on a block boundary"), and a computed count of at most
  ``W`` is not adopted at all (:mod:`differential.oracle.replay`). A request
  that skips reading the prefix cache (``skip_reading_prefix_cache``) is owed
  nothing from either: vLLM PR #57269, "Honor skip_reading_prefix_cache for
  KV connector hits", made it mean "compute every prompt token in this
  request". Fewer tokens is a ``fallback``, more an ``over-hit`` (KV nobody
  holds).
* **The store** (:func:`store_owed`, layouts of full attention and MLA only).
  The store keeps the KV of every token a request computed
  (:class:`differential.driver.connector.RemoteStoreConnector`) and, without
  a capacity, never evicts, so at a request's lookup it provably holds, of the request's
  prompt, the longest common prefix with the tokens of any request that had
  *finished* before that lookup (its prompt, and its sampled tokens but the
  last, which is never computed; the prompt alone with drafts), in whole
  hash blocks; a request is owed that prefix in multiples of the hit
  alignment, within ``L - 1`` (one token is left to compute, as vLLM PR
  #43494 keeps full hits: "rounding the full hit down to ``(num_tokens - 1)
  // block_size * block_size``"), whatever the local cache still holds.
  Falling short is a ``fallback``. A request still in flight promises
  nothing (it may have saved more), nor one its client aborted (it saved
  only part of its prompt, even when async scheduling applies its last
  step's output after the abort). On other layouts what the store holds
  rests on vLLM's hand-offs (Mamba boundary states, the sliding-window
  blocks its reachability mask keeps), judged through the adoption rule and
  the comparison of variants only. On the store's own grid
  (``workload.connector.chunk_tokens``) the prefix is whole chunks, and
  nothing is owed past the shown hit when that is less than a chunk
  (vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py
  ``_lookup_complete_chunks``: "We can only load less than a chunk, so
  skip.").
* **A bounded store** (``capacity_chunks``, any layout): owed exactly what
  LRU over its capacity keeps (:mod:`differential.oracle.offload_lru`); the
  store rule's promise of finished writers is not made for it.
* **Load targets** (any layout). The blocks vLLM names for a load
  (``KVCacheBlocks.get_unhashed_block_ids_all_groups``, which pulling
  connectors hand their transfers: "Get unhashed blocks to pull from
  remote", vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py)
  are the request's own blocks past its local hit: never the null block
  ("Skip padding blocks", its docstring) and never a cached block, whose
  KV other requests read (a block holding a prefix-cache entry is the
  local hit's, already computed). A load into either is a ``wrong-kv``
  naming the group and block.
* **Synchronous loads** (any layout, a vLLM with
  ``SchedulerOutput.has_sync_kv_loads``). A synchronous load is consumed by
  the forward of the step that schedules it, and the worker starts a step's
  loads before its forward only when that flag is set: "whenever the step
  has no synchronous KV loads" the loads start after the forward launch
  (vLLM PR #53333, which aggregates each request's ``load_async=False`` into
  the flag). A step that loads a request synchronously without the flag
  reads KV not loaded yet: a ``wrong-kv`` naming the request and the step.
  The flag set on a step with no synchronous load only costs the overlap
  the PR buys (host time on the forward's path) and is not judged.
* **Load failures** (:func:`finish_findings`, any layout). A load kvfuzz's
  model runner reports failed (``workload.connector.failed_loads``) is
  handled by ``KVTransferConfig.kv_load_failure_policy`` (vLLM PR #26813,
  "KV Load Failure Recovery/Abort Configuration": "'recompute': reschedule
  the request to recompute failed blocks; 'fail': immediately fail the
  request with an error finish reason (default)"). Under ``fail`` the
  request whose load failed is owed ``FINISHED_ERROR`` (unless its client
  aborted it), and under either policy no other request may finish with an
  error: ``Scheduler._update_requests_with_invalid_blocks`` affects only the
  requests whose computed blocks include a failed one, and
  ``_handle_failed_recving`` only those the worker names. Either departure
  is a ``wrong-finish``: a client sees a request fail that should not, or
  gets an answer the policy says it must not.

Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from differential.findings import Finding, FindingKind, Policy
from differential.observation import ConnectorLookup, RunObservation
from differential.oracle.offload_lru import lru_findings, owed_answer
from differential.oracle.prefix import common_prefix_tokens
from differential.scenario import LoadFailurePolicy, Scenario

__all__ = [
    "StoreOwed",
    "adoption_owed",
    "connector_findings",
    "finish_findings",
    "store_grid_tokens",
    "store_owed",
]


def adoption_owed(
    connector: ConnectorLookup, block_tokens: int, replay_tokens: int = 0
) -> int | None:
    """The computed tokens, local and external, vLLM owes a request for the
    store's answer (see the module docstring); ``None`` where the policy's
    divergent-hit reconcile applies (not judged).

    Args:
        connector: what the connector was asked and answered.
        block_tokens: the scheduler block ``B``, in tokens.
        replay_tokens: the bounded-replay window ``W``, in tokens (0:
            none). A store of prefix-cache blocks restores no window, so
            vLLM takes its answer in whole blocks ("Hits end on a block
            boundary") and adopts no hit of at most ``W`` tokens ("hits no
            longer than the window are not adopted", vLLM PR #56227).
    """
    h = connector.local_hit_tokens
    m = connector.matched_tokens
    if connector.diverged and connector.external_tokens == 0:
        return None
    if replay_tokens:
        m -= m % block_tokens
    tail = h % block_tokens
    if tail and m > tail:
        total = h - tail + m
    elif tail:
        total = h
    else:
        total = h + m
    return 0 if 0 < total <= replay_tokens else total


@dataclass(frozen=True)
class StoreOwed:
    """What the store provably held of one request at its lookup.

    Attributes:
        tokens: the prefix owed, in tokens (a multiple of the hit alignment).
        writer: the finished request whose tokens the prefix is, or ``None``
            when nothing is owed.
        shared_tokens: tokens the writer's saved tokens share with the
            request's prompt, in tokens.
    """

    tokens: int
    writer: int | None
    shared_tokens: int


def store_owed(scenario: Scenario, run: RunObservation) -> dict[int, StoreOwed]:
    """Per request index (those with a connector lookup and a recorded step),
    what the store provably held of it at its lookup (see the module
    docstring); empty unless every group is full attention or MLA, and for a
    bounded store (what it still holds is :mod:`differential.oracle.offload_lru`'s)."""
    store = scenario.workload.connector
    if store is not None and store.bounded:
        return {}
    if not all(g.kind.full_attention_family for g in scenario.kv_cache_groups):
        return {}
    prompts = scenario.prompts
    drafts = bool(scenario.workload.accepted_drafts)
    saved = [
        p if drafts else p + scenario.sampled_tokens(i)[: scenario.decode_steps]
        for i, p in enumerate(prompts)
    ]
    hash_block = scenario.effective_hash_block_size_tokens
    alignment = store_grid_tokens(scenario)
    out: dict[int, StoreOwed] = {}
    for r in run.requests:
        if r.connector is None or r.scheduled_step is None:
            continue
        best = StoreOwed(0, None, 0)
        for q in run.requests:
            if (
                q.index == r.index
                or q.finished_step is None
                or q.finished_step >= r.scheduled_step
                or q.aborted_by_client(scenario.workload.abort_steps)
            ):
                continue
            shared = common_prefix_tokens(prompts[r.index], saved[q.index])
            if shared > best.shared_tokens:
                best = StoreOwed(0, q.index, shared)
        limit = min(best.shared_tokens // hash_block * hash_block, len(prompts[r.index]) - 1)
        tokens = max(0, limit) // alignment * alignment
        out[r.index] = StoreOwed(tokens, best.writer if tokens else None, best.shared_tokens)
    return out


def store_grid_tokens(scenario: Scenario) -> int:
    """The store's lookup grid, in tokens: its own chunk
    (``workload.connector.chunk_tokens``), else the hit alignment."""
    store = scenario.workload.connector
    if store is not None and store.chunk_tokens is not None:
        return store.chunk_tokens
    return scenario.effective_hit_alignment_tokens


def _load_target_findings(
    run: RunObservation, index: int, c: ConnectorLookup, policy: Policy
) -> list[Finding]:
    """``wrong-kv`` per KV cache group whose load targets name the null block
    or a cached block (the rule *load targets* above)."""
    findings = []
    for group, targets in enumerate(c.load_targets or ()):
        bad = [
            f"block {block_id} ({'the null block' if null else 'a cached block'})"
            for block_id, null, cached in targets
            if null or cached
        ]
        if bad:
            named = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            findings.append(
                Finding(
                    FindingKind.WRONG_KV,
                    run.variant,
                    index,
                    f"connector: group {group}: the store's {c.external_tokens} tokens are "
                    f"loaded into {named} (get_unhashed_block_ids_all_groups names only "
                    "the request's own uncached blocks)",
                    policy=policy,
                )
            )
    return findings


def _sync_load_findings(run: RunObservation, policy: Policy) -> list[Finding]:
    """``wrong-kv`` per request loaded synchronously in a step whose
    ``has_sync_kv_loads`` is not set (the rule *synchronous loads* above)."""
    return [
        Finding(
            FindingKind.WRONG_KV,
            run.variant,
            index,
            f"connector: step {step} loads request {index}'s KV synchronously (into that step's "
            "forward) but SchedulerOutput.has_sync_kv_loads is false, so the worker starts the "
            "load after the forward (vLLM PR #53333)",
            policy=policy,
        )
        for step, flag, loaded in run.sync_kv_load_steps
        if not flag
        for index in loaded
    ]


def finish_findings(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM
) -> list[Finding]:
    """``wrong-finish`` per request that finished otherwise than its loads
    owe (the rule *load failures* above): with an error though it is owed
    none, or, under ``kv_load_failure_policy`` ``fail``, without one though
    its load failed and its client did not abort it.

    Judged on a run that completed and recorded which loads failed and which
    requests erred (``RunObservation.failed_load_requests``, ``errored``);
    ``[]`` otherwise.
    """
    store = scenario.workload.connector
    lost, errored = run.failed_load_requests, run.errored
    if store is None or lost is None or errored is None or run.error is not None:
        return []
    fail = store.kv_load_failure_policy is LoadFailurePolicy.FAIL
    erred = dict(errored)
    finished = {r.index: r.finished_step for r in run.requests if r.finished_step is not None}
    aborts = scenario.workload.abort_steps
    findings = []
    for i in range(len(scenario.requests)):
        owed = fail and i in lost
        if i in erred and not owed:
            why = (
                "none of its loads failed"
                if i not in lost
                else "kv_load_failure_policy 'recompute' owes its failed load a recompute"
            )
            detail = f"vLLM finished it with an error after step {erred[i]}, but {why}"
        elif owed and i not in erred and (aborts is None or aborts[i] is None):
            how = (
                f"it finished by itself after step {finished[i]}"
                if i in finished
                else "it never finished"
            )
            detail = (
                "its load failed under kv_load_failure_policy 'fail', which owes it an error "
                f"finish (FINISHED_ERROR), but {how}"
            )
        else:
            continue
        findings.append(
            Finding(
                FindingKind.WRONG_FINISH,
                run.variant,
                i,
                f"connector: {detail} (vLLM PR #26813)",
                policy=policy,
            )
        )
    return findings


def connector_findings(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM
) -> list[Finding]:
    """``fallback`` / ``over-hit`` per request whose computed tokens at
    admission (local and external) break the adoption rule or fall short of
    what the store provably held, ``wrong-kv`` for a load into the wrong
    blocks or a synchronous load the step does not flag, ``wrong-finish``
    for a request finished otherwise than its loads owe (see the module
    docstring)."""
    if scenario.workload.connector is None or run.unsupported is not None:
        return []
    block = scenario.scheduler_block_size_tokens
    grid = store_grid_tokens(scenario)
    owed_by_store = store_owed(scenario, run)
    findings: list[Finding] = lru_findings(scenario, run, policy)
    findings += _sync_load_findings(run, policy)
    findings += finish_findings(scenario, run, policy)
    for r in run.requests:
        c = r.connector
        if c is None:
            continue
        findings += _load_target_findings(run, r.index, c, policy)
        computed = c.computed_tokens
        adopted = adoption_owed(c, block, scenario.prefix_replay_tokens)
        stored = owed_by_store.get(r.index, StoreOwed(0, None, 0))
        if not scenario.reads_prefix_cache(r.index):
            # It reads neither the local cache nor the store (vLLM PR #57269).
            adopted, stored = 0, StoreOwed(0, None, stored.shared_tokens)
        if 0 < stored.tokens <= scenario.prefix_replay_tokens:
            # A hit no longer than the bounded-replay window is not adopted.
            stored = StoreOwed(0, None, stored.shared_tokens)
        if not owed_answer(stored.tokens, c.presented_tokens, grid):
            # Less than a chunk past the shown hit is not loaded (owed_answer).
            stored = StoreOwed(0, None, stored.shared_tokens)
        common: dict[str, Any] = {
            "divergence_tokens": stored.shared_tokens,
            "hit_tokens": computed,
            "policy": policy,
        }
        answer = (
            f"local hit {c.local_hit_tokens}, shown {c.presented_tokens} to the connector, "
            f"which held {c.store_tokens} and answered {c.matched_tokens} more; adopted "
            f"{c.local_tokens} local + {c.external_tokens} external"
        )
        if adopted is not None and computed > adopted:
            findings.append(
                Finding(
                    FindingKind.OVER_HIT,
                    run.variant,
                    r.index,
                    f"connector: starts with {computed} computed tokens, more than the "
                    f"{adopted} its local hit and the store's answer hold ({answer})",
                    expected_tokens=adopted,
                    **common,
                )
            )
            continue
        if adopted is not None and computed < adopted:
            findings.append(
                Finding(
                    FindingKind.FALLBACK,
                    run.variant,
                    r.index,
                    f"connector: starts with {computed} computed tokens, owed {adopted}: "
                    f"the larger of its local hit and what the store holds past the "
                    f"block-aligned hit ({answer})",
                    expected_tokens=adopted,
                    **common,
                )
            )
            continue
        if computed < stored.tokens:
            findings.append(
                Finding(
                    FindingKind.FALLBACK,
                    run.variant,
                    r.index,
                    f"connector: starts with {computed} computed tokens, owed {stored.tokens} "
                    f"the store holds since request {stored.writer} finished "
                    f"({stored.shared_tokens} tokens in common; {answer})",
                    expected_tokens=stored.tokens,
                    **common,
                )
            )
    return findings

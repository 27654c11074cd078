"""Known vLLM issues: findings kvfuzz has explained and reported already.

A known issue is recognised from first principles (no vLLM), so a campaign can
label its findings instead of rediscovering them, and property tests on the
``fixed`` variant can tell "the seed fix is incomplete in a way we already
documented" from a new problem. A known finding is still a finding: it is
reported, with the issue's name.

It sits with the oracle, not with triage, because every floor that makes a
finding labels it (the comparison, engine mode): the labels read only the
scenario, the findings and the hits, as the oracle's rules do.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from differential.errors import ScenarioError
from differential.findings import (
    RESERVED_WITHOUT_BLOCKS,
    STALL_WORDS,
    UNRESERVED_PARTIAL_TAIL_COPY,
    Finding,
    FindingKind,
    Policy,
)
from differential.oracle import (
    checkpoints,
    dense_hit,
    drafter_model,
    layout,
    references,
    replay_boundaries,
    state,
)
from differential.oracle.disagg import EQUAL_TAIL_DROPPED, LOCAL_SHORTFALL
from differential.oracle.prefix import shared_prefixes
from differential.scenario import (
    ConnectorLoad,
    ConnectorStore,
    DraftGroups,
    DriveMode,
    GroupKind,
    KVEvents,
    MambaPrefill,
    Scenario,
)
from differential.variant import FixScope

__all__ = [
    "KNOWN_FIX_COSTS",
    "KNOWN_ISSUES",
    "KnownIssue",
    "in_lookup_order",
    "label_fix_cost",
    "label_known",
]


def _short_groups(scenario: Scenario, level_tokens: int) -> int:
    """SWA groups (block < A) whose run up to ``level_tokens`` plus the peek
    block is shorter than the window needs (the no-full-window path)."""
    alignment = scenario.effective_hit_alignment_tokens
    count = 0
    for group in scenario.sliding_window_groups:
        block = group.block_size_tokens
        if block >= alignment or group.sliding_window_tokens is None:
            continue
        need = -(-(group.sliding_window_tokens - 1) // block) + 1  # blocks incl. the peek
        if level_tokens + block < need * block:
            count += 1
    return count


def _shortfall_under_drop(scenario: Scenario, finding: Finding) -> bool:
    """A ``fallback`` or ``dense-mismatch`` that hit fewer tokens than owed,
    a fallback only where the drafter asks for the EAGLE drop (the dense
    cross-check judges with the protection the run used)."""
    if finding.kind not in (FindingKind.FALLBACK, FindingKind.DENSE_MISMATCH):
        return False
    if finding.expected_tokens is None or finding.hit_tokens is None:
        return False
    if finding.hit_tokens >= finding.expected_tokens:
        return False
    return finding.kind is not FindingKind.FALLBACK or drafter_model(scenario).drop


def _short_run_applies(scenario: Scenario, finding: Finding) -> bool:
    expected = finding.expected_tokens
    if expected is None or not _shortfall_under_drop(scenario, finding):
        return False
    return _short_groups(scenario, expected) > 0


def _short_swa_run_drop(scenario: Scenario, finding: Finding) -> bool:
    """The SWA lookup aligns before the EAGLE drop when the run is shorter
    than the window, losing one alignment unit per such SWA group and lookup
    pass. With one sliding-window group that is at most one unit per short
    group; with several, the hybrid coordinator's fixed-point loop repeats
    the loss on every pass, down to 0 (one mechanism, whatever the group
    count). A multi-unit loss one unit below a periodic checkpoint whose kept
    tail misses the run's first blocks is the seed PR's class instead (its
    short-prefix form, :func:`_seed_tail_missing`), not this one."""
    if not _short_run_applies(scenario, finding):
        return False
    expected, hit = finding.expected_tokens or 0, finding.hit_tokens or 0
    alignment = scenario.effective_hit_alignment_tokens
    if expected - hit <= _short_groups(scenario, hit) * alignment:
        return True
    if len(scenario.sliding_window_groups) < 2:
        return False
    return not _seed_tail_missing(scenario, expected)


def _seed_tail_missing(scenario: Scenario, expected_tokens: int) -> bool:
    """Whether ``expected_tokens`` is one unit below a periodic checkpoint ``c``
    whose kept SWA tail (the window plus the peek block) starts above token 0
    in some short-run group: the run from block 0 to ``c - A`` then misses
    blocks below the tail, the seed PR's mechanism. Where every tail reaches
    token 0 the whole run is retained, and a loss there is the short-run
    lookup's own."""
    retention = scenario.retention_interval_tokens
    alignment = scenario.effective_hit_alignment_tokens
    boundary = expected_tokens + alignment
    if not retention or boundary % retention:
        return False
    for group in scenario.sliding_window_groups:
        block = group.block_size_tokens
        if block >= alignment or group.sliding_window_tokens is None:
            continue
        need = -(-(group.sliding_window_tokens - 1) // block) + 1
        if expected_tokens + block < need * block < boundary:
            return True
    return False


def _unit_below_retained_boundary(
    scenario: Scenario, finding: Finding, hits: Sequence[int] | None = None
) -> bool:
    """A fallback to a checkpoint ``e`` that vLLM 0.33.0 does not retain while
    it retains ``e + A`` (a periodic checkpoint without the drop, a replay
    boundary, a junction): the sibling diverged inside the last alignment unit
    before a retained boundary, and the kept tail starts ``A / B_swa`` blocks
    too high for it (vLLM issue #57610)."""
    if finding.kind is not FindingKind.FALLBACK or finding.request is None:
        return False
    if scenario.mamba_groups:  # a state group keeps no tail; see the Mamba issue
        return False
    expected, hit = finding.expected_tokens, finding.hit_tokens
    if expected is None or hit is None or hit >= expected:
        return False
    model = drafter_model(scenario)
    alignment = scenario.effective_hit_alignment_tokens
    retention = scenario.retention_interval_tokens
    if model.drop and retention and (expected + alignment) % retention == 0:
        # One unit below a periodic checkpoint under the drop: the seed PR's
        # class, whichever groups drop (annotating the drafter's group keeps
        # the sliding-window groups from dropping, not the mechanism).
        return False
    index = finding.request
    # Junctions depend on earlier hits: a request pins its longest
    # single-group hit when its own hit fell short of it. Without the run's
    # hits, any earlier request may have, so both the pinned and the unpinned
    # writer count.
    refs = references(scenario, model, [0] * index)
    shared_row = shared_prefixes(scenario)[index]
    literal: set[int] = set()
    for writer in range(index):
        shared = shared_row[writer]
        if dense_hit(scenario, model, index, writer, shared) < expected:
            continue  # this writer's data cannot serve the sibling there at all
        pinned_at = refs[writer].junction_tokens
        pinned = hits is None or hits[writer] < pinned_at
        junctions = {0, pinned_at} if scenario.pins_junctions and pinned else {0}
        # A writer keeps its own boundaries only where it computed blocks,
        # at or above its own hit (unknown without the run: 0).
        writer_hit = 0 if hits is None else hits[writer]
        for junction in junctions:
            literal.update(
                checkpoints(
                    scenario,
                    model,
                    writer,
                    junction,
                    expected + alignment,
                    writer_hit,
                    Policy.RETAINED,
                )
            )
    return expected not in literal and expected + alignment in literal


def _seed_fix_limit_marked_draft_group(scenario: Scenario, finding: Finding) -> bool:
    """The seed class (a fallback from ``c - A`` under the EAGLE drop, ``c`` a
    periodic checkpoint ``k * R``) on a layout whose drafter's groups are
    marked ``is_eagle_group``, beside a sliding-window group that does not
    take the drop (not in :attr:`Scenario.drop_group_indices`) and whose tail
    kept for ``c`` starts above token 0 (``ceil((window - 1) / B) * B < c``,
    in tokens): vLLM calls that group's ``reachable_block_mask`` with
    ``use_eagle`` false, so it keeps the tail ending on ``c`` and nothing
    below it, and the seed PR, which widens only where ``use_eagle`` holds,
    leaves it so."""
    if finding.kind is not FindingKind.FALLBACK or finding.request is None:
        return False
    expected, hit = finding.expected_tokens, finding.hit_tokens
    if expected is None or hit is None or hit >= expected:
        return False
    if scenario.draft_groups is not DraftGroups.ANNOTATED or not drafter_model(scenario).drop:
        return False
    retention = scenario.retention_interval_tokens
    boundary = expected + scenario.effective_hit_alignment_tokens
    if not retention or boundary % retention:
        return False
    for index, group in enumerate(scenario.kv_cache_groups):
        window = group.sliding_window_tokens
        if not group.kind.sliding_window_family or window is None:
            continue
        if index in scenario.drop_group_indices:
            continue
        block = group.block_size_tokens
        if -(-(window - 1) // block) * block < boundary:
            return True
    return False


_LOOKUP_FINDERS = (
    "SlidingWindowManager.find_longest_cache_hit",
    "MambaManager.find_longest_cache_hit",
    # A group whose block is larger than the hash block reads the hashes
    # through this view (vllm/v1/core/kv_cache_utils.py), so the raise names it.
    "BlockHashListWithBlockSize._get_value_at",
)


def _lookahead_index_error_without_full_attention(scenario: Scenario, finding: Finding) -> bool:
    """vLLM raised IndexError in a sliding-window or Mamba group's
    ``find_longest_cache_hit`` on a layout with no full-attention group,
    under lookahead hashes of two or more tokens: nothing capped the lookup
    at the hashed blocks (one group alone, or sliding-window and Mamba
    groups only). The crash's ``raised in`` part names the function (or the
    block-hash view it indexes through); an error without it is matched on
    the lookup phase."""
    if finding.kind is not FindingKind.CRASH or "IndexError" not in finding.detail:
        return False
    if any(g.kind.full_attention_family for g in scenario.kv_cache_groups):
        return False
    if drafter_model(scenario).hash_lookahead_tokens < 2:
        return False
    if "[raised in " in finding.detail:
        return any(f"[raised in {name}" in finding.detail for name in _LOOKUP_FINDERS)
    return "get_computed_blocks" in finding.detail


def _sink_manager_rejects_an_argument(scenario: Scenario, finding: Finding) -> bool:
    """vLLM raised TypeError building ``SinkFullAttentionManager``: its
    ``__init__`` names its parameters and takes no ``**kwargs``, and
    ``KVCacheCoordinator.__init__`` passes one it lacks
    (``needs_kv_cache_zeroing=`` on vLLM 0.31.0 to 0.33.0), on any layout
    with a sink full attention group."""
    return (
        finding.kind is FindingKind.CRASH
        and "TypeError: SinkFullAttentionManager.__init__() got an unexpected keyword argument"
        in finding.detail
        and any(g.kind is GroupKind.SINK_FULL_ATTENTION for g in scenario.kv_cache_groups)
    )


def _in_a_lookup(detail: str) -> bool:
    """A crash's detail names a lookup: ``get_computed_blocks`` called by the
    manager-level driver, or ``Scheduler.schedule``, which makes the lookup
    in scheduler mode (a crash there names the call, not the lookup)."""
    return "get_computed_blocks" in detail or "Scheduler.schedule" in detail


def _full_report_partial_hit(scenario: Scenario, finding: Finding) -> bool:
    """vLLM raised IndexError in a lookup with KV cache events in 'full' report
    mode on a layout serving fine-grained hits (a hit can end inside a block),
    where the re-announcement indexes a block hash the request lacks."""
    return (
        finding.kind is FindingKind.CRASH
        and "IndexError" in finding.detail
        and _in_a_lookup(finding.detail)
        and scenario.workload.kv_events is KVEvents.FULL
        and scenario.partial_hash_hits
    )


def _full_report_dcp_block_size(scenario: Scenario, finding: Finding) -> bool:
    """Under decode context parallelism with KV cache events in 'full' report
    mode, a lookup's re-announcement of reused blocks at the spec's per-rank
    block size: an AssertionError raised in ``resolve_block_hashes`` inside
    ``get_computed_blocks`` (the per-rank block smaller than the hash block),
    or a ``kv-events`` lookup finding (the stream announcing per-rank blocks)."""
    if scenario.dcp_world_size == 1 or scenario.workload.kv_events is not KVEvents.FULL:
        return False
    if finding.kind is FindingKind.CRASH:
        return (
            "AssertionError" in finding.detail
            and _in_a_lookup(finding.detail)
            and "resolve_block_hashes" in finding.detail
        )
    return finding.kind is FindingKind.KV_EVENTS and "the lookup of request" in finding.detail


def _padded_draft_above_step_budget(scenario: Scenario, finding: Finding) -> bool:
    """vLLM's Scheduler scheduled nothing for good (kvfuzz's stall crash) where
    a request's last token, padded to ``1 + num_speculative_tokens``, cannot
    fit the step budget (``max_num_batched_tokens``, in tokens): the padding
    in ``Scheduler.schedule`` (vllm/v1/core/sched/scheduler.py) refuses to
    schedule it un-padded, and ``VllmConfig`` accepted the budget because it
    checks ``num_lookahead_tokens`` (0 for n-gram), not the padded draft."""
    if finding.kind is not FindingKind.CRASH or STALL_WORDS not in finding.detail:
        return False
    spec = scenario.drafter.num_speculative_tokens
    return spec > 0 and 1 + spec > scenario.step_budget_tokens


def _async_store_stall(scenario: Scenario, finding: Finding) -> ConnectorStore | None:
    """The scenario's KV connector store when ``finding`` is kvfuzz's stall
    crash (vLLM's Scheduler scheduled nothing for good) and the store loads
    asynchronously; ``None`` otherwise."""
    store = scenario.workload.connector
    if finding.kind is not FindingKind.CRASH or STALL_WORDS not in finding.detail:
        return None
    return store if store is not None and store.load is ConnectorLoad.ASYNC else None


def _async_load_reservation_caps_window(scenario: Scenario, finding: Finding) -> bool:
    """vLLM's Scheduler scheduled nothing for good (kvfuzz's stall crash) with
    a KV connector loading asynchronously, no load failing, on a layout with
    a sliding-window group: an in-flight prefill's reservation
    (``Scheduler._request_remaining_blocks``, ``apply_admission_cap=True``)
    caps the window group at its window's blocks, while the request's own
    allocation once its load has arrived needs the blocks below the window it
    still holds (no step has freed them), so a second load admitted against
    that reservation leaves the first too few blocks; neither can be
    preempted (vllm/v1/core/sched/scheduler.py). Two requests at least wait
    when the stall is named (the one that cannot fit and one behind it)."""
    store = _async_store_stall(scenario, finding)
    waiting = re.search(r"with (\d+) request\(s\) waiting", finding.detail)
    return (
        store is not None
        and waiting is not None
        and int(waiting.group(1)) >= 2
        and not store.failed_loads
        and bool(scenario.sliding_window_groups)
    )


def _async_load_reservation_misses_partial_tail(scenario: Scenario, finding: Finding) -> bool:
    """vLLM's Scheduler scheduled nothing for good (kvfuzz's stall crash) with
    a KV connector loading asynchronously on a Mamba hybrid, with a loaded
    request owing a Mamba partial-tail copy (the stall names it:
    ``UNRESERVED_PARTIAL_TAIL_COPY``) and no in-flight prefill holding no
    blocks (``RESERVED_WITHOUT_BLOCKS``: a failed load's own stall, another
    issue; a failed load of some other request does not matter): caching the arrived load
    (``Scheduler._update_waiting_for_remote_kv``) keyed the prompt's
    checkpoint inside a Mamba block (``MambaManager._cache_partial_tail_block``),
    so its allocation asks one block more per Mamba group for the
    copy-on-write, which the in-flight reservation
    (``Scheduler._request_remaining_blocks``) did not count while the load
    was in flight; a second load admitted against that reservation leaves the
    first too few blocks, and neither can be preempted."""
    store = _async_store_stall(scenario, finding)
    return (
        store is not None
        and bool(scenario.mamba_groups)
        and UNRESERVED_PARTIAL_TAIL_COPY in finding.detail
        and RESERVED_WITHOUT_BLOCKS not in finding.detail
    )


def _divergent_hit_drops_equal_remote_tail(scenario: Scenario, finding: Finding) -> bool:
    """A disaggregated decode request short of what the prefill instance
    saved (:mod:`differential.oracle.disagg`'s store rule) because vLLM
    dropped the store's answer to a diverged lookup that ended exactly at the
    local hit (the finding names it: ``EQUAL_TAIL_DROPPED``):
    ``Scheduler.schedule`` keeps a local sub-block tail unless the remote hit
    strictly exceeds it, then reconciles the diverged hit (no external
    tokens) to what every group holds, though the store held the lagging
    Mamba group's state at the hit (vllm/v1/core/sched/scheduler.py)."""
    store = scenario.workload.connector
    return (
        finding.kind is FindingKind.FALLBACK
        and finding.detail.startswith("disaggregated: ")
        and EQUAL_TAIL_DROPPED in finding.detail
        and store is not None
        and store.divergent_hybrid_hits
        and bool(scenario.mamba_groups)
    )


def _sync_load_mamba_tail_not_cached(scenario: Scenario, finding: Finding) -> bool:
    """A disaggregated decode request's local hit short of what an earlier
    synchronous load brought in (:mod:`differential.oracle.disagg`'s local
    rule), on a Mamba hybrid whose loaded end lies off the Mamba block grid:
    the state there is a partial tail, which
    ``MambaManager._cache_partial_tail_block``
    (vllm/v1/core/single_type_kv_cache_manager.py) keys only when
    ``cache_blocks`` is called with exactly that many tokens; an
    asynchronous load is cached at its end
    (``Scheduler._update_waiting_for_remote_kv``), a synchronous one only
    with the step's token after it (``KVCacheManager.allocate_slots``), so
    the loaded state is never keyed."""
    store = scenario.workload.connector
    owed = finding.expected_tokens or 0
    return (
        finding.kind is FindingKind.FALLBACK
        and finding.detail.startswith(f"{LOCAL_SHORTFALL} ")
        and store is not None
        and store.load is ConnectorLoad.SYNC
        and bool(scenario.mamba_groups)
        and any(owed % g.block_size_tokens for g in scenario.mamba_groups)
    )


def _failed_load_reserves_itself(scenario: Scenario, finding: Finding) -> bool:
    """vLLM's Scheduler scheduled nothing for good (kvfuzz's stall crash) after
    a KV connector's asynchronous load failed and kept no token, with a
    waiting request still reserved as an in-flight prefill while holding no
    blocks (the stall names it: ``RESERVED_WITHOUT_BLOCKS``). With several
    KV cache groups the failure is ``failed_recving`` (the whole load lost);
    with one it is the last loaded block in ``invalid_block_ids``, which
    keeps no token where the load was that one block. Either way
    ``Scheduler._update_waiting_for_remote_kv`` frees the request's blocks
    but leaves it in ``Scheduler._inflight_prefills``, so its next async
    admission reserves its own remaining blocks besides allocating them
    (``_inflight_prefill_reserved_blocks``, vllm/v1/core/sched/scheduler.py)."""
    store = _async_store_stall(scenario, finding)
    return (
        store is not None and bool(store.failed_loads) and RESERVED_WITHOUT_BLOCKS in finding.detail
    )


def _divergent_hit_truncates_lagging_window(scenario: Scenario, finding: Finding) -> bool:
    """An ``AssertionError`` in ``KVCacheManager.truncate_computed_blocks``
    inside ``Scheduler.schedule`` with a KV connector that declares divergent
    hybrid hits on a Mamba hybrid with a sliding-window group:
    ``get_computed_blocks_for_connector`` reports the full-attention hit as
    diverged when *any* group lags it, but the truncation a longer remote
    hit triggers lets only a Mamba group end short ("Other groups must cover
    it", vllm/v1/core/kv_cache_manager.py)."""
    if finding.kind is not FindingKind.CRASH or "truncate_computed_blocks" not in finding.detail:
        return False
    store = scenario.workload.connector
    return (
        store is not None
        and store.divergent_hybrid_hits
        and bool(scenario.sliding_window_groups)
        and bool(scenario.mamba_groups)
    )


def _external_mamba_block_uncounted(scenario: Scenario, finding: Finding) -> bool:
    """``BlockPool.get_new_blocks`` raised inside ``Scheduler.schedule`` on a
    Mamba hybrid with a KV connector's store:
    ``MambaManager.get_num_blocks_to_allocate`` caps a new request's blocks
    at its running state block and its speculative blocks (none without a
    drafter), and ``SingleTypeKVCacheManager.allocate_external_computed_blocks``
    gives the Mamba group one more for the external tokens
    (vllm/v1/core/single_type_kv_cache_manager.py), so
    ``KVCacheManager.allocate_slots`` admits it a block short per Mamba group."""
    return (
        finding.kind is FindingKind.CRASH
        and "free blocks from the pool" in finding.detail
        and "[raised in BlockPool.get_new_blocks" in finding.detail
        and scenario.workload.connector is not None
        and bool(scenario.mamba_groups)
    )


def _failed_block_recompute_reads_freed_window(scenario: Scenario, finding: Finding) -> bool:
    """The null block where a step attends (the block-level check's step-table
    ``wrong-kv``) on a request whose asynchronous KV connector load failed, on
    a model of one sliding-window KV cache group: the load's failure is
    block-level there (``invalid_block_ids``), and
    ``Scheduler._update_requests_with_invalid_blocks``
    (vllm/v1/core/sched/scheduler.py) rewinds the request to the failed
    block's first token, below blocks its table already holds as null
    (skipped for the computed tokens before the rewind:
    ``add_local_computed_blocks``, ``remove_skipped_blocks``), so the
    recomputed tokens attend to the null block."""
    store = scenario.workload.connector
    return (
        finding.kind is FindingKind.WRONG_KV
        and finding.detail.startswith("after the step at ")
        and "is the null block" in finding.detail
        and store is not None
        and store.load is ConnectorLoad.ASYNC
        and finding.request in store.failed_loads
        and len(scenario.kv_cache_groups) == 1
        and scenario.kv_cache_groups[0].kind.sliding_window_family
    )


def _writer_states(
    scenario: Scenario, request: int, hits: Sequence[int] | None
) -> list[tuple[int, int, tuple[int, ...]]]:
    """Per earlier writer of ``request`` and junction it may have pinned:
    ``(writer, junction, states)``, positions in tokens
    (:func:`differential.oracle.state.state_positions`).

    A writer pins its attention proof as a junction when its own hit fell
    short of it, on layouts where vLLM reports an uncached common prefix
    (:attr:`Scenario.pins_junctions`). Without the run's hits
    (``None``) both the pinned and the unpinned writer are listed, and every
    writer is taken to have computed its prompt from 0.
    """
    model = drafter_model(scenario)
    prefill_lookahead = model.reprefillable_tokens + 1
    proofs = state.attention_proofs(
        scenario, model.drop, model.hash_lookahead_tokens, model.reprefillable_tokens, request
    )
    out = []
    for writer in range(request):
        writer_hit = 0 if hits is None else hits[writer]
        pinned = scenario.pins_junctions and (hits is None or writer_hit < proofs[writer])
        for junction in {0, proofs[writer]} if pinned else {0}:
            states = state.state_positions(
                scenario,
                writer,
                writer_hit,
                junction,
                model.drop,
                model.hash_lookahead_tokens,
                model.reprefillable_tokens,
                prefill_lookahead,
            )
            out.append((writer, junction, states))
    return out


def _mamba_fallback(scenario: Scenario, finding: Finding) -> bool:
    """A fallback below what was owed on a model with Mamba groups under sparse
    retention."""
    return (
        finding.kind is FindingKind.FALLBACK
        and finding.request is not None
        and bool(scenario.mamba_groups)
        and scenario.retention_interval_tokens is not None
        and finding.expected_tokens is not None
        and finding.hit_tokens is not None
        and finding.hit_tokens < finding.expected_tokens
    )


def _fine_grained_replay_state_discarded(
    scenario: Scenario, finding: Finding, hits: Sequence[int] | None = None
) -> bool:
    """A fallback on a Mamba hybrid with fine-grained hits and the EAGLE drop
    to below a position between a writer's replay boundaries as vLLM computes
    them (on the scheduler block, ``kv_cache_coordinator.replay_boundaries``)
    and as the hit alignment places them: the state (or the SWA tail) a
    resend resumes at was materialized but not retained, because vLLM computes
    the boundaries one whole scheduler block below the prompt's aligned
    length (vLLM PR #57444)."""
    if not _mamba_fallback(scenario, finding) or finding.request is None:
        return False
    model = drafter_model(scenario)
    if not (scenario.partial_hash_hits and model.drop):
        return False
    expected = finding.expected_tokens or 0
    block = scenario.scheduler_block_size_tokens
    for writer in range(finding.request):
        length = scenario.requests[writer].prompt_tokens
        on_block = {
            max((length - 1) // block * block - block, 0),
            max(length // block * block - block, 0),
        }
        on_alignment = replay_boundaries(scenario, model, writer)
        if max(on_block) < expected <= max(on_alignment):
            return True
    return False


def _unit_below_retained_state(
    scenario: Scenario, finding: Finding, hits: Sequence[int] | None = None
) -> bool:
    """A fallback on a Mamba model under sparse retention from the state owed
    one alignment unit under a boundary ``b`` vLLM retains: the writer
    materialized the highest state at or below ``b - A`` and vLLM kept the
    state at ``b`` but not that one, so a sibling that diverged inside the
    last unit before ``b`` misses it (the state-group form of vLLM issue
    #57610; local-inference-lab/vllm PR #556 keeps a state below each
    boundary under EAGLE). ``b`` is a periodic checkpoint, a replay boundary
    or a pinned junction of the writer (a periodic ``b`` may lie past the
    writer's prompt, and past its last state: ``b - A`` is owed all the same
    wherever the sibling reaches it, and the state owed is the highest at or
    below it, a decoded one in a chat), and the owed position is no retained
    boundary itself; the states are the writer's own
    (:func:`_writer_states`)."""
    if not _mamba_fallback(scenario, finding) or finding.request is None:
        return False
    model = drafter_model(scenario)
    alignment = scenario.effective_hit_alignment_tokens
    retention = scenario.retention_interval_tokens or 0
    expected = finding.expected_tokens or 0
    for writer, junction, states in _writer_states(scenario, finding.request, hits):
        writer_hit = 0 if hits is None else hits[writer]
        # The boundaries themselves (not the units below them): where vLLM
        # keeps a state. A writer keeps its own only where it computed.
        own = {*replay_boundaries(scenario, model, writer), junction}
        boundaries = {b for b in own if b >= writer_hit and b > 0}
        if retention > 0:
            # The oracle's periodic boundaries reach one unit past what the
            # sibling shares (differential.oracle.core.checkpoints).
            reach = max(max(states, default=0), finding.divergence_tokens or 0)
            boundaries.update(range(retention, reach + alignment + 1, retention))
        if expected in boundaries:
            continue  # owed a retained boundary itself: some other mechanism
        if any(
            state.floor_state(states, b - alignment) == expected
            for b in boundaries
            if b - alignment >= expected
        ):
            return True
    return False


def _checkpoint_step_skips_junction_state(
    scenario: Scenario, finding: Finding, hits: Sequence[int] | None = None
) -> bool:
    """A fallback (or the dense run's mismatch) below a state an earlier
    writer materialized at the shared-prefix junction it pinned, the state
    the request is owed, on Mamba layers that export prefill checkpoints
    (``mamba_prefill: checkpoint``) with the shared-prefix checkpoint option
    under dense or periodic retention, where every prefill step publishes a
    checkpoint: ``MambaManager._cache_partial_tail_block`` handles the step's
    checkpoint and returns before keying the junction's state (a dense-run
    mismatch under any retention: the dense cross-check run is dense)."""
    if finding.kind not in (FindingKind.FALLBACK, FindingKind.DENSE_MISMATCH):
        return False
    if (
        finding.request is None
        or scenario.mamba_prefill is not MambaPrefill.CHECKPOINT
        or not scenario.enable_mamba_shared_prefix_checkpoint
    ):
        return False
    if finding.kind is FindingKind.FALLBACK and scenario.retention_interval_tokens == 0:
        return False  # retention 0: only the final step publishes (the dense run is dense)
    expected, hit = finding.expected_tokens, finding.hit_tokens
    if expected is None or hit is None or hit >= expected:
        return False
    return any(
        junction == expected and junction in states
        for _, junction, states in _writer_states(scenario, finding.request, hits)
    )


def _checkpoint_retention_ignores_replay_boundaries(
    scenario: Scenario, finding: Finding, hits: Sequence[int] | None = None
) -> bool:
    """A fallback below a state an earlier writer materialized at one of its
    replay boundaries, off the retention grid, on Mamba layers that export
    prefill checkpoints (``mamba_prefill: checkpoint``) under periodic
    retention: a step's checkpoint is kept only if the retention test of
    ``MambaManager._cache_partial_tail_block`` keeps it, and that test
    (``reachable_block_mask`` over the checkpoint's block) is given no
    reachable boundaries."""
    if finding.kind is not FindingKind.FALLBACK or finding.request is None:
        return False
    retention = scenario.retention_interval_tokens
    if scenario.mamba_prefill is not MambaPrefill.CHECKPOINT or not retention:
        return False
    expected, hit = finding.expected_tokens, finding.hit_tokens
    if expected is None or hit is None or hit >= expected or expected % retention == 0:
        return False
    model = drafter_model(scenario)
    return any(
        expected in states and expected in replay_boundaries(scenario, model, writer)
        for writer, _, states in _writer_states(scenario, finding.request, hits)
    )


def _checkpoint_step_keys_start_state(
    scenario: Scenario, finding: Finding, hits: Sequence[int] | None = None
) -> bool:
    """An over-hit (or the dense run's mismatch) to a Mamba block boundary
    ``h`` on checkpoint-exporting Mamba layers (``mamba_prefill:
    checkpoint``), where an earlier writer started a prefill step strictly
    inside the block ending at ``h``: after a step that ended at its pinned
    junction there, or at its own fine-grained hit there. The step, split as
    one that exports its checkpoint from inside, runs past ``h`` without
    stopping there, so the block holds the state the step started from, yet
    it is keyed as the state at ``h`` (the step exports nothing when a later
    stop, its junction, makes it no longer the prompt's final step)."""
    if finding.kind not in (FindingKind.OVER_HIT, FindingKind.DENSE_MISMATCH):
        return False
    if finding.request is None or scenario.mamba_prefill is not MambaPrefill.CHECKPOINT:
        return False
    hit = finding.hit_tokens
    block = scenario.mamba_groups[0].block_size_tokens
    if hit is None or hit <= 0 or hit % block or (finding.expected_tokens or 0) >= hit:
        return False
    return any(
        (hit - block < junction < hit and junction in states)
        or (hits is not None and hit - block < hits[writer] < hit)
        for writer, junction, states in _writer_states(scenario, finding.request, hits)
    )


def _mamba_finder_ignores_drop(scenario: Scenario, finding: Finding) -> bool:
    """An over-hit on a model whose only group is Mamba, under the EAGLE drop:
    no attention group bounds the hit, and ``MambaManager.find_longest_cache_hit``
    ignores ``drop_eagle_block``, so a state at the divergence point itself is
    hit (vLLM PR #57128)."""
    return (
        finding.kind is FindingKind.OVER_HIT
        and len(scenario.kv_cache_groups) == 1
        and bool(scenario.mamba_groups)
        and drafter_model(scenario).drop
        and finding.hit_tokens is not None
        and finding.divergence_tokens is not None
        and finding.hit_tokens <= finding.divergence_tokens
    )


def _single_group_drop_after_cap(scenario: Scenario, finding: Finding) -> bool:
    """A single-group model under the EAGLE drop that loses one block more
    than the drop: the match was capped at ``L - 1`` tokens before the peek
    block was dropped."""
    if len(scenario.kv_cache_groups) != 1 or finding.request is None:
        return False
    if finding.kind not in (FindingKind.FALLBACK, FindingKind.DENSE_MISMATCH):
        return False
    if finding.expected_tokens is None or finding.hit_tokens is None:
        return False
    # A fallback needs the drop the drafter asks for; the dense cross-check
    # judges with the protection the run used (a needless drop included).
    if finding.kind is FindingKind.FALLBACK and not drafter_model(scenario).drop:
        return False
    block = scenario.kv_cache_groups[0].block_size_tokens
    capped = (scenario.requests[finding.request].prompt_tokens - 1) // block * block
    # Owed the capped length itself, which needs the block past L - 1 as the
    # peek block: the lookup reaches one block lower at best, and under sparse
    # retention falls from there to whatever is retained below it.
    if finding.expected_tokens != capped:
        return False
    retention = scenario.retention_interval_tokens
    if retention is None or retention == scenario.effective_hit_alignment_tokens:
        return finding.hit_tokens == capped - block
    return finding.hit_tokens <= capped - block


def _window_one_spiral(scenario: Scenario, finding: Finding) -> bool:
    """Two or more sliding-window groups, one of a 1-token window, under the
    drop: the window-1 group needs only the peek block and drops it, and the
    hybrid coordinator's fixed-point loop takes the other groups down with
    it, pass after pass (with or without a full-attention group)."""
    if not _shortfall_under_drop(scenario, finding):
        return False
    windows = [g.sliding_window_tokens for g in scenario.sliding_window_groups]
    return len(windows) >= 2 and 1 in windows


def _state_cached_one_token_short(scenario: Scenario, finding: Finding) -> bool:
    """A fallback on a Mamba hybrid with fine-grained hits, the EAGLE drop and
    a re-prefillable tail (multi-module MTP) from a state off the Mamba
    block grid that the writer's prefill step ended at: vLLM caches the
    blocks up to the step's end minus the tail
    (``HybridKVCacheCoordinator.get_num_cacheable_tokens``), so
    ``MambaManager.cache_blocks`` never sees the step's end and the state
    there is lost when the next step overwrites it (a dense-retention run's
    cross-check shows the same loss)."""
    if finding.kind not in (FindingKind.FALLBACK, FindingKind.DENSE_MISMATCH):
        return False
    if not scenario.mamba_groups:
        return False
    expected, hit = finding.expected_tokens, finding.hit_tokens
    if expected is None or hit is None or hit >= expected:
        return False
    model = drafter_model(scenario)
    if not (model.drop and model.reprefillable_tokens and scenario.partial_hash_hits):
        return False
    return any(expected % g.block_size_tokens for g in scenario.mamba_groups)


def _chunk_split_on_attention_grid(scenario: Scenario, finding: Finding) -> bool:
    """A Mamba hybrid driven through vLLM's ``Scheduler`` (scheduler mode)
    whose smallest group block (tokens) is below the Mamba block: the engine
    sets ``CacheConfig.block_size`` to that smallest block
    (``EngineCore._initialize_kv_caches``) and
    ``Scheduler._mamba_block_aligned_split`` aligns prefill chunks to it, so
    a step ends off the Mamba block grid and the Mamba block whose state the
    oracle owes is never materialized: a hit below the owed one (``fallback``,
    the dense cross-check's ``dense-mismatch``) or one that the manager-level
    driver, chunking on the Mamba grid, does not share (``mode-mismatch``);
    or a hit of the right length handed a state cached under the next
    boundary's hash (``wrong-kv``: a state block holding the state after
    other tokens than the hit's). vLLM PR #54076 (open) aligns to the Mamba
    group's block instead."""
    if scenario.workload.mode is not DriveMode.SCHEDULER or not scenario.mamba_groups:
        return False
    mamba_block = min(g.block_size_tokens for g in scenario.mamba_groups)
    if min(g.block_size_tokens for g in scenario.kv_cache_groups) >= mamba_block:
        return False
    if finding.kind is FindingKind.MODE_MISMATCH:
        return True
    if finding.kind is FindingKind.WRONG_KV:
        return "state after" in finding.detail and "not the state after" in finding.detail
    if finding.kind not in (FindingKind.FALLBACK, FindingKind.DENSE_MISMATCH):
        return False
    expected, hit = finding.expected_tokens, finding.hit_tokens
    return expected is not None and hit is not None and hit < expected


def _alignment_blowup(scenario: Scenario, finding: Finding) -> bool:
    """The layout's hit alignment exceeds every group block size."""
    return finding.kind is FindingKind.ALIGNMENT_BLOWUP


def _swmla_merge_mixes_blocks(scenario: Scenario, finding: Finding) -> bool:
    """A KV cache plan whose first differing group is sliding-window MLA, on
    a model whose sliding-window MLA layers of one window differ in block or
    head size (``SlidingWindowMLASpec.merge`` buckets them together)."""
    return (
        finding.kind is FindingKind.KV_CACHE_PLAN
        and scenario.model is not None
        and ": SlidingWindowMLASpec block" in finding.detail
        and layout.merges_unequal_layers(scenario.model)
    )


def _draft_drop_shorter_than_lookahead(scenario: Scenario, finding: Finding) -> bool:
    """An over-hit under multi-module MTP with the drafter's groups marked
    ``is_eagle_group``, every dropping group's block smaller than the
    drafter's reach: the one dropped block does not cover the positions whose
    draft KV read tokens past the divergence point."""
    if finding.kind is not FindingKind.OVER_HIT:
        return False
    if scenario.draft_groups.value != "annotated":
        return False
    model = drafter_model(scenario)
    if not model.drop:
        return False
    groups = scenario.kv_cache_groups
    return all(
        groups[i].block_size_tokens < model.dependency_tokens for i in scenario.drop_group_indices
    )


@dataclass(frozen=True)
class KnownIssue:
    """A documented vLLM behaviour that kvfuzz reports as a finding.

    Attributes:
        name: short identifier, used in finding signatures and reports.
        summary: one paragraph: what happens and why.
        vllm_source: the vLLM file and function responsible.
        example: a corpus file that reproduces it, relative to the kvfuzz
            root (for a fix's known cost: where the cost is documented).
        matches: predicate on a scenario and one of its findings.
        uses_hits: ``matches`` also takes the run's hits per request, in
            tokens (a third argument; ``None`` when unknown).
        fix_scope: for a known cost of one of kvfuzz's fixes
            (:data:`KNOWN_FIX_COSTS`), the scope of the fix it belongs to: it
            labels only comparisons of a variant of that scope with a
            baseline (:func:`label_fix_cost`); ``None`` for a vLLM issue.
    """

    name: str
    summary: str
    vllm_source: str
    example: str
    matches: Callable[..., bool]
    uses_hits: bool = False
    fix_scope: FixScope | None = None


KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        name="mamba-chunk-split-on-attention-block-grid",
        summary=(
            "A Mamba hybrid (align mode) with a group whose block is smaller than the "
            "Mamba block (a drafter's own group: vLLM's "
            "vllm/v1/worker/gpu/model_states/mamba_hybrid.py names DFlash): "
            "EngineCore._initialize_kv_caches sets CacheConfig.block_size to the "
            "smallest prefix-cacheable block and Scheduler._mamba_block_aligned_split "
            "aligns prefill chunks to it, not to the Mamba block. A step then ends off "
            "the Mamba grid: the state at a Mamba boundary the step crosses is never "
            "materialized (its block stays null), and the state at the step's end is "
            "later cached under the next boundary's hash. Full attention 16 + Mamba "
            "64, hash block 16, steps of 80 tokens, a 200-token writer: a request "
            "sharing 100 tokens hits 0 where 64 is owed, and one sharing 150 hits "
            "128 holding the state after 80 tokens (same hit length, wrong state). "
            "Also on vLLM 0.32.0. vLLM PR #54076 (open) aligns to the Mamba group's "
            "block."
        ),
        vllm_source="vllm/v1/core/sched/scheduler.py Scheduler._mamba_block_aligned_split "
        "(block_size = self.cache_config.block_size) with vllm/v1/engine/core.py "
        "EngineCore._initialize_kv_caches",
        example="known-issues/mamba-chunk-split-on-attention-block-grid.json",
        matches=_chunk_split_on_attention_grid,
    ),
    KnownIssue(
        name="alignment-lcm-blowup",
        summary=(
            "Group block sizes that do not divide one another make the hit "
            "alignment, their LCM, exceed every block, so every hit is rounded "
            "down to it: a drafter KV block of 3456 tokens beside a target block "
            "of 1536 aligns hits to 13824 tokens, about 7K tokens lost per request "
            "(vLLM PR #52804). Likewise an alignment that is one group's block far "
            "above the full-attention block: a scheduler block of 4096 tokens beside "
            "a full-attention block of 128 gives every prompt shorter than 4096 "
            "tokens 0 (vllm-ascend issue #16270). A property of the block sizes "
            "vLLM's planner chose, not of the managers."
        ),
        vllm_source="vllm/v1/core/kv_cache_utils.py resolve_kv_cache_block_sizes with "
        "vllm/v1/core/kv_cache_coordinator.py HybridKVCacheCoordinator._cache_hit_alignment_tokens",
        example="known-issues/alignment-blowup-1536-3456.json",
        matches=_alignment_blowup,
    ),
    KnownIssue(
        name="swmla-merge-mixes-block-sizes",
        summary=(
            "Sliding-window MLA layers of one window whose pages differ (head 256 "
            "beside head 128, bf16) get blocks of 16 and 32 tokens once "
            "unify_kv_cache_spec_page_size evens their pages, yet "
            "_get_kv_cache_groups_uniform_page_size fills its buckets first-fit "
            "with SlidingWindowMLASpec.merge, which compares the dtype, window, "
            "tokens per state and replay policy but takes the block and head sizes "
            "from its first spec. Two layers of each make one bucket of four, split "
            "into groups [2, 4] and [3, 5]: each pairs a 16-token layer with a "
            "32-token one under one 16-token spec (the scheduler block is 16 where "
            "32 is owed), against the planner's own assumption that layers of a "
            "group share the block size and create_kv_cache_group_specs' that they "
            "share the spec. Found by kvfuzz; not run on an engine (vLLM's CPU build "
            "turns the prefix cache off for MLA models)."
        ),
        vllm_source="vllm/v1/kv_cache_interface.py SlidingWindowMLASpec.merge with "
        "vllm/v1/core/kv_cache_planning.py _get_kv_cache_groups_uniform_page_size",
        example="known-issues/swmla-merge-mixes-block-sizes.json",
        matches=_swmla_merge_mixes_blocks,
    ),
    KnownIssue(
        name="draft-group-drop-shorter-than-lookahead",
        summary=(
            "Multi-module MTP reads num_speculative_tokens ahead, and "
            "KVCacheCoordinator.__init__ only checks scheduler_block_size >= "
            "num_speculative_tokens, assuming a whole scheduler block is dropped. "
            "With the drafter's layers in their own group, marked is_eagle_group, "
            "only that group drops, one of its blocks: when that block is smaller "
            "than the drafter's reach, the hit keeps draft KV that read tokens "
            "past the divergence point (full 4 + sliding window 2 + a draft group "
            "of 2-token blocks, 4 speculative tokens: a sibling sharing 10 tokens "
            "hits 8 where at most 6 may be reused). Found by kvfuzz; under the "
            "fallback (no group marked) the 4-token full-attention block drops and "
            "the hit is 4."
        ),
        vllm_source="vllm/v1/core/kv_cache_coordinator.py KVCacheCoordinator.__init__ "
        "(eagle_group_ids) with HybridKVCacheCoordinator.find_longest_cache_hit",
        example="known-issues/draft-group-multi-module-mtp-small-draft-block.json",
        matches=_draft_drop_shorter_than_lookahead,
    ),
    KnownIssue(
        name="fine-grained-replay-state-discarded",
        summary=(
            "On a Mamba hybrid with fine-grained hits (hash block finer than the "
            "Mamba block), the EAGLE drop and sparse retention, vLLM 0.33.0 computes "
            "the replay boundaries every group retains on the scheduler block, "
            "one whole block below the prompt's aligned length, so a state (or an "
            "SWA tail) the writer materialized where the sibling resumes is "
            "discarded and the "
            "sibling misses: FA 64 + Mamba 64, hash block 16, a block-carved "
            "prefill of a 100-token prompt resent gets 0 where 64 is due (95 and "
            "128 tokens still get 64). vLLM PR #57444 (open) computes them on the "
            "hit alignment."
        ),
        vllm_source="vllm/v1/core/kv_cache_coordinator.py replay_boundaries with "
        "vllm/v1/core/single_type_kv_cache_manager.py MambaManager.reachable_block_mask",
        example="known-issues/fine-grained-replay-state-discarded-L100.json",
        matches=_fine_grained_replay_state_discarded,
        uses_hits=True,
    ),
    KnownIssue(
        name="unit-below-retained-state-discarded",
        summary=(
            "On a Mamba model under sparse retention, a sibling that diverges "
            "inside the last alignment unit before a boundary vLLM retains (a "
            "replay boundary, a periodic checkpoint, a pinned junction) is owed "
            "the highest state the writer materialized at "
            "or below b - A under the one-unit rule, but vLLM keeps only the state "
            "at b, so the sibling falls back, often to 0 (Mamba 4 alone, retention "
            "0, a 32-token writer: a sibling sharing 24 tokens gets 0 where the "
            "state at 24 was materialized). The state-group form of vLLM issue "
            "#57610; local-inference-lab/vllm PR #556 keeps a state below each "
            "boundary under EAGLE."
        ),
        vllm_source="vllm/v1/core/single_type_kv_cache_manager.py "
        "MambaManager.reachable_block_mask",
        example="known-issues/unit-below-retained-state-discarded.json",
        matches=_unit_below_retained_state,
        uses_hits=True,
    ),
    KnownIssue(
        name="mamba-finder-ignores-eagle-drop",
        summary=(
            "A model whose only KV cache group is Mamba, with an EAGLE-style "
            "drafter under the drop: UnitaryKVCacheCoordinator passes "
            "drop_eagle_block to MambaManager.find_longest_cache_hit, which "
            "ignores it, so a sibling hits the state at its divergence point and "
            "the drafter reuses KV that depends on the next token (Mamba 4 alone, "
            "a 32-token writer, a sibling sharing 28 tokens: 28 where at most "
            "D - 1 = 27 may be reused). vLLM PR #57128 (open)."
        ),
        vllm_source="vllm/v1/core/single_type_kv_cache_manager.py "
        "MambaManager.find_longest_cache_hit",
        example="known-issues/mamba-finder-ignores-eagle-drop.json",
        matches=_mamba_finder_ignores_drop,
    ),
    KnownIssue(
        name="swa-short-run-align-before-drop",
        summary=(
            "Under the EAGLE drop, when a sibling's shared prefix is shorter than "
            "the sliding window needs (no full-window run exists), "
            "SlidingWindowManager.find_longest_cache_hit rounds the run down to the "
            "hit alignment *before* dropping the peek block, then drops a real "
            "block and rounds down again: with SWA blocks smaller than the "
            "alignment the sibling loses one extra alignment unit (96 instead of "
            "128 for full block 32, SWA block 16, window 512). With several "
            "sliding-window groups HybridKVCacheCoordinator.find_longest_cache_hit "
            "re-runs every group whenever one shrinks the candidate, clears its "
            "record of verified EAGLE drops, and the short-run group loses another "
            "unit on each pass, down to 0 (112 -> 0 for full block 16, SWA blocks 8 "
            "with windows 128 and 64): the same loss repeated, not another cause. "
            "The seed PR does not touch this path."
        ),
        vllm_source="vllm/v1/core/single_type_kv_cache_manager.py "
        "SlidingWindowManager.find_longest_cache_hit (the `not match_found` branch), "
        "repeated by vllm/v1/core/kv_cache_coordinator.py "
        "HybridKVCacheCoordinator.find_longest_cache_hit",
        example="known-issues/swa-short-run-align-before-drop.json",
        matches=_short_swa_run_drop,
    ),
    KnownIssue(
        name="window-one-multi-group-spiral",
        summary=(
            "With two or more sliding-window groups, one of them a window of "
            "a single token, and the EAGLE drop on, the hybrid lookup's "
            "fixed-point loop shrinks the sibling's hit to 0 (the window-1 "
            "group needs only the peek block, drops it, and the other groups "
            "follow it down): FA 4 + SWA 2 (window 2) + SWA 2 (window 1), or SWA 4 "
            "(window 4) + SWA 2 (window 1) alone, a sibling sharing 14 tokens of a "
            "16-token writer gets 0 where 8 is due. A single sliding-window "
            "group beside full attention does not spiral. Degenerate geometry: "
            "no known model has a 1-token window, and kvfuzz's generator draws none."
        ),
        vllm_source="vllm/v1/core/kv_cache_coordinator.py "
        "HybridKVCacheCoordinator.find_longest_cache_hit",
        example="known-issues/window-one-multi-group-spiral.json",
        matches=_window_one_spiral,
    ),
    KnownIssue(
        name="seed-fix-limit-marked-draft-group",
        summary=(
            "The seed class on the layout vLLM's planner builds for EAGLE-3 and MTP "
            "drafters with layers of their own: the drafter's KV cache group is "
            "marked is_eagle_group (get_global_kv_cache_groups, vLLM PR #41640), so "
            "only it and groups of equal spec take the EAGLE drop, and a "
            "sliding-window group that does not drop keeps only the tail ending on "
            "each periodic checkpoint c: a sibling diverging inside the last "
            "alignment unit before c is owed c - A and falls back (FA 2 marked + "
            "SWA 1 with window 2, R = 4: 4 where 6 is owed; FA 8 + SWA 4 with "
            "window 16 + a marked FA 4 draft group, R = 64: 64 where 120 is owed). "
            "A limit of the seed fix (the seed PR, for vLLM issue #64808): it "
            "widens the periodic tails of the groups that drop only, so the fixed "
            "variant keeps this fallback; kvfuzz's candidate widens every retained "
            "tail and is clean."
        ),
        vllm_source="vllm/v1/core/single_type_kv_cache_manager.py "
        "SingleTypeKVCacheManager.cache_blocks (reachable_block_mask with the group's "
        "own use_eagle, set from eagle_group_ids by vllm/v1/core/kv_cache_coordinator.py "
        "HybridKVCacheCoordinator.verify_and_split_kv_cache_groups)",
        example="corpora/cases/seed-shrunk-draft-group-marked.json",
        matches=_seed_fix_limit_marked_draft_group,
    ),
    KnownIssue(
        name="single-group-drop-after-length-cap",
        summary=(
            "With a single KV cache group and the EAGLE drop, "
            "UnitaryKVCacheCoordinator.find_longest_cache_hit passes "
            "max_cache_hit_length = L - 1 to the group's lookup, which stops "
            "matching at the last whole block below L - 1 and then drops it: a "
            "resend of a block-aligned prompt loses a block more than the drop "
            "(FA block 16, a 64-token prompt resent: 32 where 48 is provable; "
            "the hybrid coordinator peeks one block past the cap and gives 48, "
            "and so does a 65-token prompt)."
        ),
        vllm_source="vllm/v1/core/kv_cache_coordinator.py "
        "UnitaryKVCacheCoordinator.find_longest_cache_hit with "
        "FullAttentionManager.find_longest_cache_hit",
        example="known-issues/single-group-drop-after-length-cap.json",
        matches=_single_group_drop_after_cap,
    ),
    KnownIssue(
        name="unit-below-retained-boundary-falls-back",
        summary=(
            "Under sparse retention a sibling that diverges inside the last "
            "alignment unit before a boundary vLLM retains (the writer's replay "
            "boundary, a junction, or a periodic checkpoint without the EAGLE "
            "drop) is owed that boundary minus A, but the kept SWA tail ends on "
            "the boundary and starts A / B_swa blocks too high, so the lookup "
            "falls back to the previous checkpoint, often 0 (FA 8 + SWA 4 with "
            "window 16, retention 0, a 100-token writer: a sibling sharing 94 "
            "tokens gets 0 where 88 is due). vLLM issue #57610, fix PR #57613 "
            "(replay boundary only, open); the seed PR covers periodic "
            "checkpoints under the drop only; kvfuzz's candidate variant widens "
            "every retained tail."
        ),
        vllm_source="vllm/v1/core/single_type_kv_cache_manager.py "
        "SlidingWindowManager.reachable_block_mask (the reachable-boundary tails)",
        example="known-issues/unit-below-replay-boundary-toy.json",
        matches=_unit_below_retained_boundary,
        uses_hits=True,
    ),
    KnownIssue(
        name="lookahead-hashes-index-error-without-full-attention",
        summary=(
            "A layout with no full-attention group (one sliding-window or Mamba "
            "group alone, or sliding-window and Mamba groups only) and lookahead "
            "block hashes of two or more tokens (multi-module MTP) crashes in "
            "get_computed_blocks: nothing caps the lookup at the hashed blocks "
            "(UnitaryKVCacheCoordinator passes max_cache_hit_length = L - 1, and "
            "HybridKVCacheCoordinator caps it only by a full-attention group's "
            "match), and SlidingWindowManager.find_longest_cache_hit (and "
            "MambaManager's) index block_hashes[i] for every block below it, "
            "but lookahead hashes stop num_hash_lookahead_tokens before the end "
            "(IndexError: SWA block 2 alone, window 2, a 19-token prompt; two SWA "
            "groups of block 4, windows 4 and 8, a 5-token prompt; both with two "
            "speculative tokens; with SWA blocks 8 and 4 the 8-token group raises "
            "inside BlockHashListWithBlockSize, its view of the 4-token hashes). "
            "Full attention uses islice and caps the others. "
            "Found by kvfuzz."
        ),
        vllm_source="vllm/v1/core/kv_cache_coordinator.py "
        "UnitaryKVCacheCoordinator.find_longest_cache_hit and "
        "HybridKVCacheCoordinator.find_longest_cache_hit with "
        "vllm/v1/core/single_type_kv_cache_manager.py "
        "SlidingWindowManager.find_longest_cache_hit, MambaManager.find_longest_cache_hit",
        example="known-issues/single-swa-group-lookahead-hashes-index-error.json",
        matches=_lookahead_index_error_without_full_attention,
    ),
    KnownIssue(
        name="sink-full-attention-manager-rejects-needs-kv-cache-zeroing",
        summary=(
            "Every model with static sink attention (openPangu with param_sink_number > 0: "
            "StaticSinkAttention, SinkFullAttentionSpec) crashes while the scheduler's "
            "KVCacheManager is built: KVCacheCoordinator.__init__ passes "
            "needs_kv_cache_zeroing= to every single-type manager through "
            "get_manager_for_kv_cache_spec, and SinkFullAttentionManager.__init__ names "
            "its parameters with no **kwargs (TypeError: unexpected keyword argument "
            "'needs_kv_cache_zeroing'; one sink_full_attention group of block 16 with a "
            "32-token sink is enough). Also on vLLM 0.31.0 and 0.32.0. The same drift "
            "with scheduler_block_size= was vLLM PR #44951, closed once PR #46384 added "
            "that one argument without its **kwargs guard; vLLM PR #53696 (merged after "
            "0.33.0) forwards needs_kv_cache_zeroing and tracks the sink's reserved "
            "blocks. Once it builds, the manager takes no sink block off the free list "
            "(the popleft_n of vLLM PR #28775 is gone) while "
            "vllm/model_executor/layers/attention/static_sink_attention.py still "
            "writes the sink into physical blocks 1 to sink_len / block_size."
        ),
        vllm_source="vllm/v1/core/single_type_kv_cache_manager.py "
        "SinkFullAttentionManager.__init__ with vllm/v1/core/kv_cache_coordinator.py "
        "KVCacheCoordinator.__init__",
        example="known-issues/sink-full-attention-manager-rejects-needs-kv-cache-zeroing.json",
        matches=_sink_manager_rejects_an_argument,
    ),
    KnownIssue(
        name="scheduler-stall-padded-draft-above-budget",
        summary=(
            "With speculative decoding whose draft needs no lookahead slots "
            "(n-gram: num_lookahead_tokens is 0) and a step budget "
            "(max_num_batched_tokens) below 1 + num_speculative_tokens, a request "
            "left with one token to compute after its prefix hit is padded to "
            "1 + num_speculative_tokens tokens, which never fits: Scheduler.schedule "
            "prefers not to schedule it un-padded, so it is never scheduled and "
            "the engine stalls. VllmConfig._set_max_num_scheduled_tokens accepts "
            "the budget because it compares it with num_lookahead_tokens only "
            "(n-gram, 1 speculative token, budget 1, a second request hitting 1 of "
            "its 2 tokens). Found by kvfuzz."
        ),
        vllm_source="vllm/v1/core/sched/scheduler.py Scheduler.schedule (the padding of "
        "new decode requests to the spec decoding size) with vllm/config/vllm.py "
        "VllmConfig._set_max_num_scheduled_tokens",
        example="known-issues/ngram-padded-draft-above-step-budget-stalls.json",
        matches=_padded_draft_above_step_budget,
    ),
    KnownIssue(
        name="scheduler-stall-failed-load-reserves-itself",
        summary=(
            "With a KV connector loading asynchronously, a load that fails and "
            "keeps no token (with several KV cache groups: failed_recving, the "
            "recompute policy; with one: its only block in invalid_block_ids) "
            "frees the request's blocks but leaves the request among the "
            "scheduler's in-flight prefills. Looked up again, its next "
            "asynchronous load must leave the blocks every in-flight prefill still "
            "needs free, its own among them, besides allocating them: under a pool "
            "of less than twice what it needs it never fits, and the requests "
            "behind it never run: the engine stalls (full attention 4 + a sliding "
            "window of 8 in blocks of 4, prefix caching off, a 23-token prompt "
            "resent, pool 16: it takes 7 blocks and reserves its own 12, of 15 "
            "free; one sliding window of 2 in blocks of 2, a load of one block "
            "failing, pool 13). Found by kvfuzz."
        ),
        vllm_source="vllm/v1/core/sched/scheduler.py Scheduler._update_waiting_for_remote_kv "
        "(a failed load's free) with Scheduler._inflight_prefill_reserved_blocks",
        example="known-issues/connector-failed-load-reserves-itself-stalls.json",
        matches=_failed_load_reserves_itself,
    ),
    KnownIssue(
        name="async-load-reservation-caps-the-window",
        summary=(
            "With a KV connector loading asynchronously, vLLM admits a second load "
            "only if it fits beside what the in-flight prefills still need "
            "(Scheduler._inflight_prefill_reserved_blocks: 'to avoid deadlock'). "
            "That need, Scheduler._request_remaining_blocks, applies the admission "
            "cap, which counts a sliding-window group at its window's blocks on the "
            "promise that remove_skipped_blocks frees the blocks below it; but a "
            "request whose load has just arrived has run no step, still holds those "
            "blocks, and its allocate_slots (the full sequence must fit) needs "
            "blocks for them. The first load's request then never fits, it heads "
            "the queue of requests holding KV, the second waits behind it, neither "
            "can be preempted, and the engine stalls: full attention 4 + a sliding "
            "window of 7 in blocks of 4, MTP 1, a 26-block pool, two requests of 40 "
            "and 35 tokens loading 32 each: the first is reserved 3 more blocks, "
            "needs 6, and finds 5 free. Also on vLLM 0.31.0 and 0.32.0. Found by kvfuzz "
            "(seed 63)."
        ),
        vllm_source="vllm/v1/core/sched/scheduler.py Scheduler._request_remaining_blocks "
        "(apply_admission_cap=True) with Scheduler.schedule's async-load admission and "
        "vllm/v1/core/single_type_kv_cache_manager.py "
        "SlidingWindowManager.get_num_blocks_to_allocate",
        example="known-issues/connector-async-load-reservation-caps-the-window-stalls.json",
        matches=_async_load_reservation_caps_window,
    ),
    KnownIssue(
        name="async-load-reservation-misses-mamba-partial-tail",
        summary=(
            "With a KV connector loading asynchronously on a Mamba hybrid (align "
            "mode), vLLM admits a second load only if it fits beside what the "
            "in-flight prefills still need (Scheduler._inflight_prefill_reserved_blocks: "
            "'to avoid deadlock'). While a load is in flight its request holds every "
            "block its prompt needs, so Scheduler._request_remaining_blocks counts 0; "
            "but when the load arrives, Scheduler._update_waiting_for_remote_kv caches "
            "it, and MambaManager._cache_partial_tail_block keys the prompt's "
            "checkpoint inside a Mamba block (a hash block smaller than the Mamba "
            "block) and records the request in _partial_hit_reqs: the next step "
            "overwrites that state, so MambaManager.get_num_blocks_to_allocate now "
            "asks one more block per Mamba group for its copy-on-write. A second load "
            "admitted against the 0 reservation can take the blocks that copy needs; "
            "the first request then never fits (allocate_slots, the full sequence "
            "must fit), it heads the queue of requests holding KV, the second waits "
            "behind it with its load arrived, neither can be preempted, and the "
            "engine stalls (full attention 16 + Mamba 16, hash block 2, two 3-token "
            "prompts each loading 2 tokens, pool 5: each load takes 2 of the 4 free "
            "blocks, then the first needs 1 and finds 0). Disaggregated decode "
            "instances load every request this way. Also on vLLM 0.31.0 and 0.32.0. Found by "
            "kvfuzz (seed 91)."
        ),
        vllm_source="vllm/v1/core/sched/scheduler.py Scheduler._request_remaining_blocks "
        "and Scheduler._update_waiting_for_remote_kv with "
        "vllm/v1/core/single_type_kv_cache_manager.py "
        "MambaManager._cache_partial_tail_block and MambaManager.get_num_blocks_to_allocate",
        example="known-issues/connector-async-load-reservation-misses-mamba-partial-tail-stalls.json",
        matches=_async_load_reservation_misses_partial_tail,
    ),
    KnownIssue(
        name="divergent-hit-drops-equal-remote-tail",
        summary=(
            "A KV connector declaring supports_divergent_local_hybrid_hits on a Mamba "
            "hybrid: KVCacheManager.get_computed_blocks_for_connector reports the "
            "full-attention hit past a lagging Mamba group ('Such a hit only has a "
            "valid Mamba state at its boundary if the connector supplies it'), and "
            "Scheduler.schedule shows the connector that hit rounded down to the "
            "block. When the connector's answer ends exactly at the hit (equal to "
            "the sub-block tail), Scheduler.schedule keeps the local tail and "
            "loads nothing ('Remote does not exceed the full local hit'), and then, "
            "the hit diverged with no external tokens, reconciles it to what every "
            "group holds: the request recomputes tokens whose KV and Mamba state the "
            "store held (a disaggregated decode instance, full attention 16 + Mamba "
            "16, hash block 4: local hit 44 with the Mamba group at 16, the store "
            "answers 12 past 32, the request starts at 16 of the 44 the prefill "
            "instance saved; 0.31.0 reconciles to 20). Also on vLLM 0.31.0 and 0.32.0. Found "
            "by kvfuzz (seed 91)."
        ),
        vllm_source="vllm/v1/core/sched/scheduler.py Scheduler.schedule (the partial-tail "
        "branch after get_num_new_matched_tokens, then the hit_diverged reconcile) with "
        "vllm/v1/core/kv_cache_manager.py KVCacheManager.get_computed_blocks_for_connector",
        example="known-issues/connector-divergent-hit-drops-equal-remote-tail.json",
        matches=_divergent_hit_drops_equal_remote_tail,
    ),
    KnownIssue(
        name="sync-load-mamba-tail-not-cached",
        summary=(
            "A disaggregated decode instance (kv_consumer) whose KV connector loads "
            "synchronously, on a Mamba hybrid (align mode) with hash blocks finer than "
            "the Mamba block: a load ending off the Mamba block grid brings the state "
            "at its end as a partial tail, which MambaManager._cache_partial_tail_block "
            "keys only when cache_blocks is called with exactly the loaded length. "
            "An asynchronous load is cached there (Scheduler._update_waiting_for_remote_kv); "
            "a synchronous one is cached by KVCacheManager.allocate_slots together with "
            "the step's next token, one past it, so the loaded state is never keyed and a "
            "later request sharing the prefix finds no local Mamba hit and loads it "
            "again (full attention 8 + Mamba 8, hash block 4: a 13-token prompt loads "
            "12, its resend hits 0 locally where an asynchronous load gives 12; a "
            "17-token prompt's load of 16, on the grid, hits 16). The local-cache "
            "promise of vLLM PR #44243. Also on vLLM 0.31.0 and 0.32.0. Found by kvfuzz."
        ),
        vllm_source="vllm/v1/core/single_type_kv_cache_manager.py "
        "MambaManager._cache_partial_tail_block, reached from "
        "vllm/v1/core/kv_cache_manager.py KVCacheManager.allocate_slots",
        example="known-issues/connector-sync-load-mamba-tail-not-cached.json",
        matches=_sync_load_mamba_tail_not_cached,
    ),
    KnownIssue(
        name="checkpoint-step-skips-junction-state",
        summary=(
            "Mamba layers that export prefill checkpoints (one prefill checkpoint "
            "block: vLLM 0.33.0's MambaMixer2, so every Mamba2 model, and the GDN "
            "layers on the prefix-cache grid) with enable_mamba_shared_prefix_checkpoint "
            "under dense or periodic retention: a prefill step that ends at a request's "
            "shared-prefix junction also publishes the checkpoint just below its end "
            "(under those retentions every step does: "
            "KVCacheCoordinator.get_num_blocks_to_allocate), and "
            "MambaManager._cache_partial_tail_block, handling that checkpoint first, "
            "discards it (neither the prompt's checkpoint nor retained nor the junction) "
            "and returns before its junction branch, so the state at the junction, which "
            "the step computed, is never keyed and a later request sharing the prefix "
            "falls back (FA 32 + Mamba 32, hash block 4, EAGLE, dense retention: a "
            "97-token request pins its junction at 60, and the next request sharing 92 "
            "tokens with it hits 0 where the scheduler's split prefill, or retention 0, "
            "gives 60). vLLM 0.32.0 has it too; 0.31.0 hits 60. Found by kvfuzz."
        ),
        vllm_source="vllm/v1/core/single_type_kv_cache_manager.py "
        "MambaManager._cache_partial_tail_block",
        example="known-issues/mamba-checkpoint-step-skips-junction-state.json",
        matches=_checkpoint_step_skips_junction_state,
        uses_hits=True,
    ),
    KnownIssue(
        name="checkpoint-retention-ignores-replay-boundaries",
        summary=(
            "Mamba layers that export prefill checkpoints (vLLM 0.33.0's MambaMixer2, "
            "so every Mamba2 model) under periodic retention: a prefill step's "
            "checkpoint, the state just below its end, is kept only if the retention "
            "test of MambaManager._cache_partial_tail_block keeps it (or it is the "
            "prompt's own checkpoint), and that test, reachable_block_mask over the "
            "checkpoint's one block, is given no reachable boundaries, so a checkpoint "
            "at one of the request's replay boundaries is discarded unless it ends a "
            "retention segment (FA 4 + Mamba 4, MTP with the drop, 8-token chunks, "
            "retention 8: the 28-token writer's step 16..24 exports the state at 20, "
            "its replay boundary one unit below 24; a sibling sharing 24 tokens is "
            "owed 20 and hits 16, where dense retention gives 20). The scheduler's "
            "split prefill makes no state at 20. Also on vLLM 0.31.0 and 0.32.0. "
            "Found by kvfuzz."
        ),
        vllm_source="vllm/v1/core/single_type_kv_cache_manager.py "
        "MambaManager._cache_partial_tail_block (reachable_block_mask without "
        "reachable_boundaries)",
        example="known-issues/mamba-checkpoint-retention-ignores-replay-boundaries.json",
        matches=_checkpoint_retention_ignores_replay_boundaries,
        uses_hits=True,
    ),
    KnownIssue(
        name="checkpoint-step-keys-start-state",
        summary=(
            "Mamba layers that export prefill checkpoints (vLLM's MambaMixer2, so "
            "every Mamba2 model): a request whose prefill step ended mid-block (at its "
            "shared-prefix junction, with enable_mamba_shared_prefix_checkpoint), or "
            "whose fine-grained hit did, runs its next step past the block boundary "
            "when the rest of the prompt can export the prompt's checkpoint: "
            "Scheduler._mamba_block_aligned_split drops the stop at the "
            'next block boundary ("a chunk starting mid-block stops at the boundary") '
            "for an internal checkpoint, but the worker writes only that checkpoint and "
            "the step's end (compute_mamba_prefill_checkpoints, one per row). The block "
            "ending at the boundary keeps the state at the junction and is keyed as the "
            "state at the boundary (a replay boundary there), so a later request hits "
            "it: one token's state missing, served silently (FA 4 + sliding window 1 + "
            "two Mamba 4 groups, MTP, retention 0: a 17-token request stops at its "
            "junction 11 and runs 11..17; the block of tokens 8..12 is hit as the state "
            "after 12 by a request owed 11; the scheduler's split prefill writes the "
            "state at 12 first). A step cut short by a later stop (the junction) is no "
            "longer the final one and exports nothing: FA 64 + Mamba 64, hash block 16, "
            "MTP, retention 64, a request hitting 16 runs 16..80 and its block of "
            "tokens 0..64, still the state at 16, is hit as the state after 64. vLLM "
            "0.31.0 and 0.32.0 too. Found by kvfuzz."
        ),
        vllm_source="vllm/v1/core/sched/scheduler.py Scheduler._mamba_block_aligned_split "
        "(next_block_boundary dropped for use_internal_checkpoint) with "
        "vllm/model_executor/layers/mamba/checkpoint.py compute_mamba_prefill_checkpoints",
        example="known-issues/mamba-checkpoint-step-keys-start-state.json",
        matches=_checkpoint_step_keys_start_state,
        uses_hits=True,
    ),
    KnownIssue(
        name="divergent-hit-truncates-lagging-window",
        summary=(
            "A KV connector declaring supports_divergent_local_hybrid_hits on a Mamba "
            "hybrid that also has a sliding-window group: "
            "KVCacheManager.get_computed_blocks_for_connector reports the "
            "full-attention hit, flagged diverged whenever any group's own hit is "
            "shorter, the sliding-window group's included; when the connector's hit "
            "strictly exceeds the local sub-block tail, Scheduler.schedule truncates "
            "the lookup to the block-aligned hit with truncate_computed_blocks, which "
            "lets only a Mamba group end short ('Other groups must cover it') and "
            "asserts every other group covers it: the sliding-window group's shorter "
            "hit raises AssertionError and the engine crashes (full attention 8 + "
            "sliding window 12 in blocks of 4 + Mamba 8, hash block 4, MTP, nine "
            "requests in three waves: step 34). Also on vLLM 0.31.0 and 0.32.0. "
            "Found by kvfuzz."
        ),
        vllm_source="vllm/v1/core/kv_cache_manager.py "
        "KVCacheManager.get_computed_blocks_for_connector with "
        "KVCacheManager.truncate_computed_blocks (called from "
        "vllm/v1/core/sched/scheduler.py Scheduler.schedule)",
        example="known-issues/connector-divergent-hit-truncates-lagging-window.json",
        matches=_divergent_hit_truncates_lagging_window,
    ),
    KnownIssue(
        name="mamba-external-block-uncounted",
        summary=(
            "A KV connector's external tokens on a Mamba hybrid (align mode): "
            "KVCacheManager.allocate_slots counts a new request's Mamba blocks as "
            "its running state block and its speculative blocks (capped so in "
            "MambaManager.get_num_blocks_to_allocate), but "
            "allocate_external_computed_blocks gives the Mamba group one more block "
            "for the external tokens, so with exactly the counted blocks free "
            "BlockPool.get_new_blocks raises ValueError and the engine crashes "
            "(full attention 16 + Mamba 16, hash block 4, MTP with 2 speculative "
            "tokens, 16 external tokens, pool 12: 5 blocks counted, 5 free, 6 "
            "taken; without a drafter, a 31-token request with 16 external tokens: "
            "3 counted, 3 free, 4 taken). Also on vLLM 0.31.0 and 0.32.0. Found by "
            "kvfuzz."
        ),
        vllm_source="vllm/v1/core/single_type_kv_cache_manager.py "
        "MambaManager.get_num_blocks_to_allocate with "
        "SingleTypeKVCacheManager.allocate_external_computed_blocks",
        example="known-issues/connector-external-mamba-block-uncounted.json",
        matches=_external_mamba_block_uncounted,
    ),
    KnownIssue(
        name="failed-block-recompute-reads-freed-window",
        summary=(
            "A KV connector's asynchronous load on a model of one sliding-window "
            "KV cache group, with the recompute policy: the request's block table "
            "holds the null block below the window of everything it will have "
            "computed, the hit and the load together (add_local_computed_blocks "
            "pads the skipped tokens), and when the connector reports a block of "
            "the load failed (invalid_block_ids) "
            "Scheduler._update_requests_with_invalid_blocks rewinds the request "
            "to that block's first token, whose window reaches back into blocks "
            "already null: the recomputed tokens read KV never loaded (sliding "
            "window 32 in blocks of 16, prefix caching off, a 96-token load whose "
            "last block fails: recomputed from 80, attending from 49, and block 3, "
            "tokens 48..64, is the null block). A whole-request failure "
            "(failed_recving, several groups) rewinds to 0. vLLM PR #51731 "
            "(closed) named the mechanism for hybrid models (rewinding a "
            "sliding-window group 'may expose null blocks that were already "
            "released'); PR #42461 (open) would drop block-level recovery for a "
            "rewind to 0. Also on vLLM 0.31.0 and 0.32.0. Found by kvfuzz."
        ),
        vllm_source="vllm/v1/core/sched/scheduler.py "
        "Scheduler._update_requests_with_invalid_blocks with "
        "vllm/v1/core/single_type_kv_cache_manager.py "
        "SingleTypeKVCacheManager.add_local_computed_blocks",
        example="known-issues/connector-failed-block-recompute-reads-freed-window.json",
        matches=_failed_block_recompute_reads_freed_window,
    ),
    KnownIssue(
        name="mamba-state-cached-one-token-short",
        summary=(
            "On a Mamba hybrid with fine-grained hits, the EAGLE drop and "
            "multi-module MTP (a re-prefillable tail of num_speculative_tokens - 1 "
            "tokens), vLLM's Scheduler ends a prefill step at the EAGLE resume "
            "position, off the Mamba block grid, but the coordinator caches only up "
            "to the step's end minus the tail, so MambaManager.cache_blocks is "
            "called with 55 where the step ended at 56, the state at 56 is never "
            "cached and the next step overwrites it: FA 4 + Mamba 16, hash block 4, "
            "MTP with 2 modules, dense retention, a 61-token prompt prefilled in "
            "chunks of 16 and resent gets 48 where 56 is owed (single-module MTP "
            "gets 56). Also on vLLM 0.31.0 and 0.32.0. Found by kvfuzz."
        ),
        vllm_source="vllm/v1/core/kv_cache_coordinator.py "
        "HybridKVCacheCoordinator.get_num_cacheable_tokens with "
        "vllm/v1/core/single_type_kv_cache_manager.py MambaManager.cache_blocks",
        example="known-issues/mamba-state-cached-one-token-short.json",
        matches=_state_cached_one_token_short,
    ),
    KnownIssue(
        name="dense-retention-eviction-collapse",
        summary=(
            "With dense retention (prefix_cache_retention_interval None) a hybrid "
            "sliding-window model keeps every sliding-window block of every "
            "request, so interleaved chat sessions crowd a pool of a few times the "
            "working set and each session's blocks are evicted before its next "
            "turn: FA 4 + SWA 4 (window 8), 4 sessions round robin, pool 130 "
            "blocks: every later turn hits 0, where retention 0 keeps 96 and 100. "
            "vLLM issue #48435, closed by making retention 0 the default; dense "
            "retention still collapses."
        ),
        vllm_source="vllm/v1/core/single_type_kv_cache_manager.py "
        "SlidingWindowManager (blocks kept cached under dense retention) with "
        "vllm/v1/core/block_pool.py BlockPool (LRU eviction)",
        example="known-issues/eviction-collapse-48435-pool130-dense.json",
        matches=lambda scenario, finding: finding.kind is FindingKind.EVICTION_COLLAPSE,
    ),
    KnownIssue(
        name="kv-events-full-report-partial-hit",
        summary=(
            "With KV cache events on and a request's kv_cache_report_mode 'full', "
            "KVCacheManager.get_computed_blocks re-announces the reused blocks by "
            "count: BlockPool.emit_cached_block_events takes the first "
            "len(group blocks) hashes at the group's block size. A fine-grained hit "
            "(a Mamba hybrid whose hash block is smaller than its blocks) that ends "
            "inside a block returns one block more than the request has hashes of "
            "that size, and the lookup raises IndexError: FA 64 + Mamba 64, hash "
            "block 16, the same 100-token prompt twice, the second hitting 96. "
            "In 'incremental' mode the same requests run. vLLM PR #57358 (open) "
            "re-announces the real hit blocks instead."
        ),
        vllm_source="vllm/v1/core/kv_cache_manager.py KVCacheManager.get_computed_blocks "
        "with vllm/v1/core/block_pool.py BlockPool.emit_cached_block_events",
        example="known-issues/kv-events-full-report-partial-hit-index-error.json",
        matches=_full_report_partial_hit,
    ),
    KnownIssue(
        name="kv-events-full-report-dcp-block-size",
        summary=(
            "With KV cache events on, a request's kv_cache_report_mode 'full' and "
            "decode context parallelism, KVCacheManager.get_computed_blocks "
            "re-announces the reused blocks at the spec's per-rank block size "
            "(the coordinator's emit_cached_block_events passes "
            "kv_cache_spec.block_size), while the blocks and their hashes span "
            "block_size * dcp_world_size tokens: one MLA group at DCP 8 (per-rank "
            "block 64) crashes on the resend's hit with an AssertionError in "
            "resolve_block_hashes; full attention at DCP 4 beside Mamba (per-rank "
            "block equal to the hash block) announces 16-token blocks the cache "
            "never held. vLLM PR #50118 (open) re-announces at the manager's block "
            "size."
        ),
        vllm_source="vllm/v1/core/kv_cache_coordinator.py "
        "KVCacheCoordinator.emit_cached_block_events with vllm/v1/core/block_pool.py "
        "BlockPool.emit_cached_block_events",
        example="known-issues/kv-events-full-report-dcp-block-size-assertion.json",
        matches=_full_report_dcp_block_size,
    ),
    KnownIssue(
        name="deferred-free-flattens-group-order",
        summary=(
            "With async scheduling (or pipeline parallelism) and a KV consumer "
            "connector, vLLM defers the return of a finished, aborted or preempted "
            "request's blocks until the steps in flight are processed "
            "(Scheduler.defer_block_free, vLLM PR #45357), then frees the "
            "concatenation of its groups' blocks reversed once, so on a model of "
            "several KV cache groups the last group's blocks go back to the free "
            "queue first, where the immediate free hands them back group by group, "
            "each tail first, and other blocks are evicted: FA 16 + FA 32, a writer "
            "aborted while its step is in flight, a filler that evicts 10 blocks, "
            "and the reader of the writer's prompt hits 0 where the synchronous run "
            "keeps 64. vLLM issue #48489 (open); PR #48532 (open) frees each group "
            "in its own call."
        ),
        vllm_source="vllm/v1/core/sched/scheduler.py Scheduler._drain_deferred_frees with "
        "vllm/v1/core/kv_cache_coordinator.py KVCacheCoordinator.pop_blocks_for_free",
        example="known-issues/async-deferred-free-flattens-group-order.json",
        matches=lambda scenario, finding: finding.kind is FindingKind.FREE_ORDER,
    ),
    KnownIssue(
        name="kv-events-removed-per-copy",
        summary=(
            "vLLM publishes a BlockRemoved for every physical block it evicts "
            "(BlockPool._maybe_evict_cached_block), also for one of two blocks "
            "that hold the same hash: an identical block-aligned prompt recomputes "
            "its last block and caches a second copy. A KV-cache-aware router that "
            "reads BlockRemoved as 'no longer cached here' then drops a prefix the "
            "engine still serves from the other copy: two identical 64-token "
            "prompts (FA 16), a third request that evicts the first copy only, "
            "and from that step on the router's set lacks the hash the pool still "
            "holds. Judged under the router view only (workload.kv_events_view "
            "'router'); vLLM 0.33.0's per-copy stream replays exactly by counts. "
            "vLLM PR #55092 (open) emits the removal only with the last copy."
        ),
        vllm_source="vllm/v1/core/block_pool.py BlockPool._maybe_evict_cached_block "
        "with BlockPool._emit_block_removed_events",
        example="known-issues/kv-events-router-drops-a-cached-duplicate.json",
        matches=lambda scenario, finding: (
            finding.kind is FindingKind.KV_EVENTS
            and finding.detail.startswith("router: ")
            and "while the pool still caches it" in finding.detail
        ),
    ),
)


KNOWN_FIX_COSTS: tuple[KnownIssue, ...] = (
    KnownIssue(
        name="candidate-pool-cost",
        summary=(
            "The documented price of kvfuzz's candidate fix: under sparse retention "
            "it keeps, beside every tail vLLM keeps for a retained boundary b, the "
            "tail a hit at b - A reads (A / B_swa sliding-window blocks more per "
            "boundary), so under pool pressure the blocks another request would "
            "have hit are evicted first and the candidate hits fewer tokens in all "
            "than the baseline at the same pool: four answer-reusing chat sessions "
            "(FA 16 + SWA 8 with window 7, EAGLE under lookahead hashes, retention "
            "0) at pool 36 blocks: 224 tokens on unfixed, 80 on the candidate; at "
            "pool 60 every variant serves every hit. Not a vLLM issue: size the "
            "pool for the cost lines before adopting the fix."
        ),
        vllm_source="differential/driver/candidate.py (the wider "
        "SlidingWindowManager.reachable_block_mask of "
        "vllm/v1/core/single_type_kv_cache_manager.py) with vllm/v1/core/block_pool.py "
        "BlockPool (LRU eviction)",
        example="docs/variants.md#the-candidate-fix",
        matches=lambda scenario, finding: finding.kind is FindingKind.POOL_REGRESSION,
        fix_scope=FixScope.ONE_UNIT,
    ),
)
"""Known costs of the fixes kvfuzz runs: findings that compare a variant
carrying a fix with a baseline and show the price the fix documents, not
something new about vLLM (``docs/triage.md``, "Known costs of kvfuzz's
fixes")."""


def label_fix_cost(
    scenario: Scenario, findings: Sequence[Finding], scope: FixScope
) -> tuple[Finding, ...]:
    """Return ``findings`` (comparisons of a variant whose fix has ``scope``
    with a baseline) with ``known_issue`` set where a known cost of that fix
    (:data:`KNOWN_FIX_COSTS`) explains it."""
    return label_known(scenario, findings, [c for c in KNOWN_FIX_COSTS if c.fix_scope is scope])


def label_known(
    scenario: Scenario,
    findings: Sequence[Finding],
    issues: Sequence[KnownIssue] = KNOWN_ISSUES,
    *,
    hits: Sequence[int] | None = None,
    order: Sequence[int] | None = None,
) -> tuple[Finding, ...]:
    """Return ``findings`` with ``known_issue`` set where a known issue explains it.

    ``hits``: the run's hit per request, in tokens, when the findings come from
    one run (it tells which earlier requests pinned a junction). ``order``:
    that run's requests in the order vLLM looked them up
    (``RequestObservation.lookup_order``). The matchers reason about writers
    in request order; under the priority policy (``workload.priorities``)
    the run's order is another, so a finding no matcher explains as run is
    matched again on the scenario with its requests in the run's order
    (:func:`in_lookup_order`), where that is a scenario.
    """

    def explains(target: Scenario, issue: KnownIssue, finding: Finding, h: Any) -> bool:
        if issue.uses_hits:
            return bool(issue.matches(target, finding, h))
        return bool(issue.matches(target, finding))

    reordered = in_lookup_order(scenario, order) if order is not None else None
    out = []
    for finding in findings:
        issue = next((i for i in issues if explains(scenario, i, finding, hits)), None)
        if issue is None and reordered is not None and finding.request is not None:
            target, position = reordered
            moved = dataclasses.replace(finding, request=position[finding.request])
            moved_hits = None if hits is None else _hits_in_order(hits, position)
            issue = next((i for i in issues if explains(target, i, moved, moved_hits)), None)
        out.append(
            dataclasses.replace(finding, known_issue=issue.name) if issue is not None else finding
        )
    return tuple(out)


def _hits_in_order(hits: Sequence[int], position: dict[int, int]) -> list[int] | None:
    """A run's hits (per request, in tokens) at the requests' new indices;
    ``None`` when they are not one per request."""
    if len(hits) != len(position):
        return None
    moved = [0] * len(hits)
    for old, new in position.items():
        moved[new] = hits[old]
    return moved


def in_lookup_order(
    scenario: Scenario, order: Sequence[int]
) -> tuple[Scenario, dict[int, int]] | None:
    """``scenario`` with its requests in ``order`` (request indices, each at
    most once; those missing, never looked up, follow in index order) under
    first come, first served, and each request's new index; ``None`` when
    the scenario has no priorities, ``order`` names an index it has no
    request at or is its own order, or the reordered scenario is not one (a
    request would copy from one after it). Arrival and abort steps and failed loads follow their
    requests (arrivals sorted, so that they never decrease)."""
    w = scenario.workload
    count = len(scenario.requests)
    named = set(order)
    if w.priorities is None or not named <= set(range(count)):
        return None
    order = [*order, *(k for k in range(count) if k not in named)]
    if list(order) == list(range(count)):
        return None
    position = {old: new for new, old in enumerate(order)}
    sources = [scenario.requests[old].shares_with for old in order]
    requests = tuple(
        dataclasses.replace(
            scenario.requests[old], shares_with=None if source is None else position[source]
        )
        for old, source in zip(order, sources, strict=True)
    )
    store = w.connector
    workload = dataclasses.replace(
        w,
        priorities=None,
        arrival_steps=None if w.arrival_steps is None else tuple(sorted(w.arrival_steps)),
        abort_steps=None if w.abort_steps is None else tuple(w.abort_steps[k] for k in order),
        connector=None
        if store is None
        else dataclasses.replace(
            store, failed_loads=tuple(sorted(position[k] for k in store.failed_loads))
        ),
    )
    try:
        return dataclasses.replace(scenario, requests=requests, workload=workload), position
    except ScenarioError:
        return None

"""The oracle's core: what each sibling is owed, from first principles, and the verdicts.

Nothing here imports vLLM or calls into it. The invariants are those of the
design note (``semantics.md``, "Invariants"):

1. **Dense reference** ``h_dense``: the hit a cache keeping every block gives,
   computed token by token (:func:`dense_hit`), cross-checked against vLLM's
   own run with retention ``None`` (:func:`cross_check_dense`).
2. **Intended checkpoints** per writer (:func:`checkpoints`), the one-unit
   rule: every boundary ``b`` the writer retains (periodic ``k*R``, its replay
   boundaries, the junction it pinned) and ``b - A`` below it, whatever the
   drafter (the seed PR for periodic checkpoints under the EAGLE drop; vLLM
   PR #57613 / issue #57610 for the replay boundary). Dense retention makes
   every multiple of ``A`` one. The ``retained`` policy keeps vLLM 0.33.0's
   literal promise, ``ideal`` the dense reference (:class:`Policy`).
3. **No fallback**: the hit reaches the highest intended checkpoint at or
   below ``h_dense``.
4. **No over-hit**: ``hit <= h_dense`` and ``hit <= D - dependency``. A run
   that protected a drafter needing no protection (Gemma-4 MTP on stock
   vLLM: the drop, or lookahead hashes) is also judged with the protection
   it used (:func:`needless_protection_model`): its junctions and states
   are made of that protection, and a hit either model allows reuses
   nothing stale.
5. **Alignment**: every hit is a multiple of ``A``.
6. **Right blocks**: every block a hit hands out is the right one
   (:mod:`differential.oracle.blocks`, ``wrong-kv``).

State groups (Mamba) follow their own rules, in
:mod:`differential.oracle.state`; :func:`references` dispatches to them by
group kind.

How a drafter's KV depends on later tokens is stated here, independently of
vLLM's config code (:func:`drafter_model`): EAGLE, EAGLE3 and single-module
MTP read the next token; multi-module MTP reads ``num_speculative_tokens``
ahead; Gemma-4 MTP writes no draft KV; DFlash and DSpark build draft KV from
the target's hidden states alone; draft models and n-gram need nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from operator import indexOf, itemgetter
from typing import Any

from differential.findings import Finding, FindingKind, Policy
from differential.observation import ManagerSettings, RunObservation
from differential.oracle.blocks import check_blocks, uncovered_findings
from differential.oracle.kv_events import kv_event_findings
from differential.oracle.metrics import metrics_findings
from differential.oracle.per_group import per_group_findings
from differential.oracle.prefix import (
    common_prefix_tokens,
    scenario_memo,
    shared_prefixes,
)
from differential.oracle.replay import replay_findings
from differential.oracle.state import state_references
from differential.scenario import DrafterKind, GroupKind, Scenario

__all__ = [
    "DrafterModel",
    "SiblingReference",
    "checkpoints",
    "common_prefix_tokens",
    "cross_check_dense",
    "dense_hit",
    "divergence_points",
    "drafter_model",
    "judge_run",
    "model_from_settings",
    "needless_protection_model",
    "promise_policy",
    "references",
    "replay_boundaries",
    "writer_extent",
]

# Tokens past a position that the drafter's KV at that position reads.
_READS_NEXT = frozenset({DrafterKind.EAGLE, DrafterKind.EAGLE3, DrafterKind.MTP})


@dataclass(frozen=True)
class DrafterModel:
    """How the cache must protect a drafter, in the oracle's own terms.

    Attributes:
        drop: a hit must prove one extra block per group past it (the EAGLE
            block drop).
        hash_lookahead_tokens: each block hash also covers this many later
            tokens, in tokens (lookahead block hashes).
        reprefillable_tokens: the writer's last tokens whose draft KV is not
            final and so is not cached, in tokens.
        dependency_tokens: tokens past a position that its draft KV reads when
            the cache protects it (0 if it needs no protection or the user
            turned the drop off); bounds every hit below the divergence point.
    """

    drop: bool
    hash_lookahead_tokens: int
    reprefillable_tokens: int
    dependency_tokens: int


def drafter_model(scenario: Scenario) -> DrafterModel:
    """The protection the scenario's drafter needs, from first principles.

    ``disable_eagle_block_drop`` opts out of all protection. Otherwise
    lookahead hashes protect when the drafter reads ahead, they are not
    disabled and no KV connector is configured, and the EAGLE drop protects
    when they do not.
    """
    drafter = scenario.drafter
    if drafter.kind in _READS_NEXT:
        reads_ahead = 1
    elif drafter.kind is DrafterKind.MULTI_MODULE_MTP:
        reads_ahead = drafter.num_speculative_tokens
    else:
        reads_ahead = 0
    reprefillable = max(0, reads_ahead - 1)
    if reads_ahead == 0:
        return DrafterModel(False, 0, 0, 0)
    if scenario.disable_eagle_block_drop:
        # The user opted out of protection: no drop, and no lookahead hashes
        # either (they replace the drop, so they are only on where it is).
        return DrafterModel(False, 0, reprefillable, 0)
    if not scenario.disable_lookahead_block_hashes and not scenario.kv_connector:
        return DrafterModel(False, reads_ahead, reprefillable, reads_ahead)
    return DrafterModel(True, 0, reprefillable, reads_ahead)


def model_from_settings(settings: ManagerSettings, num_groups: int) -> DrafterModel:
    """The protection a run actually used, read off vLLM's resolved settings.

    The writer's re-prefillable tail (multi-module MTP) is left uncached by a
    single-group coordinator always, by the hybrid one only for groups that
    drop (``HybridKVCacheCoordinator.get_num_cacheable_tokens``).
    """
    reprefillable = max(0, settings.num_prefill_lookahead_tokens - 1)
    if num_groups > 1 and not settings.use_eagle_block_drop:
        reprefillable = 0
    return DrafterModel(
        drop=settings.use_eagle_block_drop,
        hash_lookahead_tokens=settings.num_hash_lookahead_tokens,
        reprefillable_tokens=reprefillable,
        dependency_tokens=0,
    )


def needless_protection_model(
    model: DrafterModel, settings: ManagerSettings | None
) -> DrafterModel | None:
    """``model`` with the protection a run used where it exceeds ``model``'s.

    vLLM 0.33.0 protects Gemma-4 MTP (``SpeculativeConfig.needs_eagle_block_drop``)
    with the EAGLE drop or, when lookahead hashes are on
    (``VllmConfig.num_hash_lookahead_tokens``), with lookahead block hashes,
    although its drafter writes no draft KV. Such a run's hits are judged for
    reuse with the protection it used (what its junctions and states are
    made of) as well as with the drafter's own.

    Returns:
        ``model`` with ``drop`` and ``hash_lookahead_tokens`` (in tokens) as
        the run used them, or ``None`` when the run used no protection beyond
        ``model``'s (or its settings are unknown).
    """
    if settings is None:
        return None
    drop = settings.use_eagle_block_drop and not model.drop
    lookahead = settings.num_hash_lookahead_tokens > model.hash_lookahead_tokens
    if not (drop or lookahead):
        return None
    return dataclasses.replace(
        model,
        drop=model.drop or settings.use_eagle_block_drop,
        hash_lookahead_tokens=max(model.hash_lookahead_tokens, settings.num_hash_lookahead_tokens),
    )


def divergence_points(scenario: Scenario) -> tuple[int, ...]:
    """Per request, ``D``: the longest common prefix with any earlier request, in tokens."""
    return tuple(max(row, default=0) for row in shared_prefixes(scenario))


def _dense_rows(scenario: Scenario, model: DrafterModel) -> list[list[int]]:
    """Row ``j``: :func:`dense_hit` of request ``j`` on each earlier writer
    ``i``, computed once per scenario and model. :func:`dense_hit` reads the
    two requests only through their prompt lengths, so equal (lengths, shared
    prefix) share one evaluation."""
    memo = scenario_memo(scenario)
    rows: list[list[int]] | None = memo.get(("dense_rows", model))
    if rows is not None:
        return rows
    rows = _hit_rows(scenario, model, _dense_plan(scenario, model, None))
    memo[("dense_rows", model)] = rows
    return rows


def _hit_rows(
    scenario: Scenario,
    model: DrafterModel,
    plan: tuple[int, tuple[tuple[int, int | None, bool, bool], ...]],
) -> list[list[int]]:
    """Row ``j``: :func:`_planned_dense_hit` of ``plan`` for request ``j`` on
    each earlier writer ``i``, in tokens.

    Without chunked-local groups the hit splits into three bounds, each
    aligned down to ``A``: the sibling's ``L - 1``, one read of the shared
    tokens alone and one of the writer's extent alone (each group's proven
    prefix is a minimum, and rounding down to a block or to ``A`` keeps
    minima: :func:`_writer_bound`, :class:`_SharedBound`), so a pair costs a
    dict lookup and a minimum, both in C. With a chunked-local group each
    distinct (lengths, shared prefix) is evaluated once
    (:func:`_planned_dense_hit` reads the two requests only through their
    prompt lengths).
    """
    lengths = [r.prompt_tokens for r in scenario.requests]
    # writer_extent reads the writer through its prompt length alone.
    extents = {n: writer_extent(scenario, model, i) for i, n in enumerate(lengths)}
    lookahead = model.hash_lookahead_tokens
    rows: list[list[int]] = []
    alignment, groups = plan
    if all(chunk is None for _, chunk, _, _ in groups):
        by_shared = _SharedBound(plan, lookahead)
        writer_bounds = [_writer_bound(plan, extents[n]) for n in lengths]
        for j, shared_row in enumerate(shared_prefixes(scenario)):
            sibling = max(0, lengths[j] - 1) // alignment * alignment
            rows.append(
                list(
                    map(
                        min,
                        repeat(sibling),
                        map(by_shared.__getitem__, shared_row),
                        writer_bounds,
                    )
                )
            )
        return rows
    by_sibling: dict[int, _HitsByWriter] = {}
    for j, shared_row in enumerate(shared_prefixes(scenario)):
        hits = by_sibling.get(lengths[j])
        if hits is None:
            hits = by_sibling[lengths[j]] = _HitsByWriter(plan, extents, lookahead, lengths[j] - 1)
        rows.append(list(map(hits.__getitem__, zip(lengths, shared_row, strict=False))))
    return rows


def _writer_bound(
    plan: tuple[int, tuple[tuple[int, int | None, bool, bool], ...]],
    extent: tuple[int, int, int],
) -> int:
    """The part of :func:`_planned_dense_hit` read from the writer's
    :func:`writer_extent` alone (a plan without chunked-local groups), in
    tokens, aligned down to ``A``: each group's cached and hashed tokens as
    whole blocks, less the dropped block."""
    alignment, groups = plan
    cached, computed, hashed = extent
    bound = min(
        max(0, min(computed if keeps_tail else cached, hashed)) // block * block
        - (block if drops else 0)
        for block, _, drops, keeps_tail in groups
    )
    return max(0, bound) // alignment * alignment


class _SharedBound(dict[int, int]):
    """The part of :func:`_planned_dense_hit` read from the shared tokens
    alone (a plan without chunked-local groups), in tokens, aligned down to
    ``A``, per shared-token count, evaluated on first use: each group's
    proven prefix (less the lookahead tokens) as whole blocks, less the
    dropped block."""

    def __init__(
        self, plan: tuple[int, tuple[tuple[int, int | None, bool, bool], ...]], lookahead: int
    ) -> None:
        super().__init__()
        self._plan, self._lookahead = plan, lookahead

    def __missing__(self, shared: int) -> int:
        alignment, groups = self._plan
        bound = min(
            max(0, shared - self._lookahead) // block * block - (block if drops else 0)
            for block, _, drops, _ in groups
        )
        value = self[shared] = max(0, bound) // alignment * alignment
        return value


class _HitsByWriter(dict[tuple[int, int], int]):
    """One sibling length's :func:`_planned_dense_hit` per ``(writer prompt
    length, shared tokens)``, evaluated on first use (so that a row is
    looked up in C)."""

    def __init__(
        self,
        plan: tuple[int, tuple[tuple[int, int | None, bool, bool], ...]],
        extents: dict[int, tuple[int, int, int]],
        lookahead: int,
        limit: int,
    ) -> None:
        super().__init__()
        self._args = plan, extents, lookahead, limit

    def __missing__(self, key: tuple[int, int]) -> int:
        plan, extents, lookahead, limit = self._args
        length, shared = key
        hit = self[key] = _planned_dense_hit(plan, extents[length], lookahead, limit, shared)
        return hit


def _junction_rows(scenario: Scenario, model: DrafterModel) -> list[list[int]] | None:
    """Row ``j``: the hit, in tokens, that the first full-attention-family
    group alone gives request ``j`` on each earlier writer ``i`` (``None``
    for a layout without one), computed once per scenario and model.

    It is where vLLM pins a request's shared-prefix junction:
    ``HybridKVCacheCoordinator.find_longest_cache_hit`` puts full attention
    first (``verify_and_split_kv_cache_groups`` sorts it there), so the
    longest hit it records is that group's own, and
    ``KVCacheManager.get_computed_blocks`` returns ``shared_prefix_boundary
    = hit + num_uncached = longest hit`` (vllm/v1/core/kv_cache_coordinator.py,
    vllm/v1/core/kv_cache_manager.py). Full attention keeps every block, so
    its hit on a dense cache is its hit on the real one. A group needing a
    block past the divergence (a sliding-window block larger than full
    attention's, under the drop) makes the combined dense hit lower than the
    junction."""
    # Its index among the prefix-cacheable groups, the ones a plan holds.
    first = next(
        (i for i, g in enumerate(scenario.cacheable_groups) if g.kind.full_attention_family),
        None,
    )
    if first is None:
        return None
    memo = scenario_memo(scenario)
    rows: list[list[int]] | None = memo.get(("junction_rows", model))
    if rows is not None:
        return rows
    alignment, groups = _dense_plan(scenario, model, None)
    rows = _hit_rows(scenario, model, (alignment, (groups[first],)))
    memo[("junction_rows", model)] = rows
    return rows


def writer_extent(scenario: Scenario, model: DrafterModel, writer: int) -> tuple[int, int, int]:
    """``(cached, computed, hashed)``, in tokens: how far ``writer``'s blocks
    reach when it is freed, from first principles.

    * ``computed = L + decode_steps``: the KV of the prompt and of every
      sampled token but the last (a sampled token's KV is computed by the
      next step, and the request finishes on its last one; vLLM
      ``KVCacheManager.allocate_slots`` caches at most ``request.num_tokens``
      tokens, the step's own).
    * ``hashed = L + decode_steps + 1 - k``: a block's hash needs the ``k``
      lookahead tokens after it, and the request ends with ``L +
      decode_steps + 1`` tokens (vllm/v1/core/kv_cache_utils.py
      ``request_block_hasher``); the last sampled token reaches the cache as
      a lookahead token through ``cache_blocks`` after it is appended
      (``Scheduler.update_from_output`` under speculative decoding, which
      every drafter with lookahead hashes runs).
    * ``cached = computed - reprefillable``: the drafter's last tokens whose
      draft KV is not final are never cached
      (``KVCacheCoordinator.get_num_cacheable_tokens``).

    A group caches its full blocks within ``min(cached, hashed)`` (within
    ``min(computed, hashed)`` for a hybrid's groups that skip the drop,
    ``HybridKVCacheCoordinator.get_num_cacheable_tokens``). Only a later
    turn that copies the writer's answer (``workload.shares_output``) can
    share tokens past its prompt, so for every other sibling only the
    prompt's blocks matter.
    """
    computed = scenario.requests[writer].prompt_tokens + scenario.decode_steps
    hashed = computed + 1 - model.hash_lookahead_tokens
    return computed - model.reprefillable_tokens, computed, hashed


def _dense_plan(
    scenario: Scenario, model: DrafterModel, alignment_tokens: int | None
) -> tuple[int, tuple[tuple[int, int | None, bool, bool], ...]]:
    """What :func:`dense_hit` reads of the layout, once per scenario, model and
    alignment: ``A`` in tokens and, per KV cache group, ``(block size in
    tokens, chunk in tokens or None, takes the drop, caches the
    re-prefillable tail)``."""
    memo = scenario_memo(scenario)
    key = ("dense_plan", model, alignment_tokens)
    plan: tuple[int, tuple[tuple[int, int | None, bool, bool], ...]] | None = memo.get(key)
    if plan is None:
        drops = scenario.drop_group_indices if model.drop else frozenset()
        hybrid = len(scenario.kv_cache_groups) > 1
        plan = memo[key] = (
            alignment_tokens or scenario.effective_hit_alignment_tokens,
            tuple(
                (
                    g.block_size_tokens,
                    g.attention_chunk_size_tokens,
                    index in drops,
                    model.drop and hybrid and index not in drops,
                )
                for index, g in enumerate(scenario.kv_cache_groups)
                # A circular buffer or a bounded-replay group bounds no hit:
                # HybridKVCacheCoordinator looks none up (KVCacheSpec.prefix_cacheable).
                if g.prefix_cacheable
            ),
        )
    return plan


def dense_hit(
    scenario: Scenario,
    model: DrafterModel,
    sibling: int,
    writer: int,
    shared_tokens: int,
    alignment_tokens: int | None = None,
) -> int:
    """Hit, in tokens, that a cache keeping every block of ``writer`` gives ``sibling``.

    The largest multiple of ``A`` that is at most ``L - 1`` (the last prompt
    token is always recomputed) such that, in every KV cache group of block
    size ``B``, the blocks up to the hit (plus one more under the drop) are
    full blocks the writer cached (its prompt's and, in a multi-turn chat,
    those it completed while decoding: :func:`writer_extent`) and whose
    hashes, including any lookahead tokens, match: ``shared_tokens`` is the
    common prefix of the sibling's prompt and the writer's written content
    (:func:`~differential.oracle.prefix.shared_prefixes`).

    Per group kind: full attention and MLA (``FullAttentionManager``),
    sliding window and sliding-window MLA (``SlidingWindowManager``) need
    their proven prefix as above (a dense cache keeps every window). Only the
    groups that take the EAGLE drop (:attr:`Scenario.drop_group_indices`:
    the ``is_eagle_group`` groups, or every group under
    ``KVCacheCoordinator.__init__``'s fallback) need the extra block, and
    only they leave the re-prefillable tail uncached in a hybrid
    (``HybridKVCacheCoordinator.get_num_cacheable_tokens``). A chunked-local
    group of chunk ``C`` needs only the blocks of the chunk the hit ends in
    (``ChunkedLocalAttentionManager.find_longest_cache_hit`` pads earlier
    chunks with null blocks): it accepts a hit within its proven prefix or on
    a chunk boundary, and the hit is the largest multiple of ``A`` every
    group accepts. ``alignment_tokens`` replaces ``A`` (to price a layout's
    alignment, :mod:`differential.oracle.layout`).
    """
    return _planned_dense_hit(
        _dense_plan(scenario, model, alignment_tokens),
        writer_extent(scenario, model, writer),
        model.hash_lookahead_tokens,
        scenario.requests[sibling].prompt_tokens - 1,
        shared_tokens,
    )


def _planned_dense_hit(
    plan: tuple[int, tuple[tuple[int, int | None, bool, bool], ...]],
    extent: tuple[int, int, int],
    lookahead: int,
    limit: int,
    shared_tokens: int,
) -> int:
    """:func:`dense_hit` from its :func:`_dense_plan`, the writer's
    :func:`writer_extent`, the lookahead tokens and the sibling's ``L - 1``."""
    alignment, groups = plan
    cached, computed, hashed = extent
    chunked: list[tuple[int, int]] = []  # (proven tokens, chunk tokens)
    for block, chunk, drops, keeps_tail in groups:
        group_cached = computed if keeps_tail else cached
        proven = min(shared_tokens - lookahead, group_cached, hashed)
        proven = max(0, proven) // block * block
        if chunk is not None:
            chunked.append((proven, chunk))
            continue
        limit = min(limit, proven - (block if drops else 0))
    hit = max(0, limit) // alignment * alignment
    for proven, chunk in chunked:
        if hit > proven:
            hit = max(proven // alignment * alignment, hit // chunk * chunk)
    return hit


def replay_boundaries(scenario: Scenario, model: DrafterModel, writer: int) -> tuple[int, ...]:
    """Positions, in tokens, a resend or extension of ``writer`` resumes at.

    As ``vllm/v1/core/kv_cache_coordinator.py`` ``replay_boundaries`` defines
    them (the ``vllm`` policy's promise): without the drop, ``L - 1`` rounded
    down to ``A``; with it, one unit below both the resend's and the
    extension's aligned length.
    """
    alignment = scenario.effective_hit_alignment_tokens
    length = scenario.requests[writer].prompt_tokens
    resend = (length - 1) // alignment * alignment
    if not model.drop:
        return (resend,)
    extension = length // alignment * alignment
    return tuple(sorted({max(resend - alignment, 0), max(extension - alignment, 0)}))


def promise_policy(policy: Policy) -> Policy:
    """The policy whose checkpoints decide ``fallback``: ``ideal`` judges
    fallbacks by the ``vllm`` promise and reports the rest as design gaps."""
    return Policy.VLLM if policy is Policy.IDEAL else policy


def checkpoints(
    scenario: Scenario,
    model: DrafterModel,
    writer: int,
    junction_tokens: int,
    up_to_tokens: int,
    writer_hit_tokens: int = 0,
    policy: Policy = Policy.VLLM,
) -> tuple[int, ...]:
    """Intended checkpoints of ``writer`` at or below ``up_to_tokens``, in tokens.

    Retained boundaries: periodic ``k*R`` (absolute positions, so every writer
    of the same prefix keeps them), the writer's replay boundaries
    (:func:`replay_boundaries`) and the junction it pinned
    (``junction_tokens``, 0 for none). Replay boundaries and the junction
    belong to the writer: it keeps their SWA tails only where it computed
    blocks itself, i.e. at or above its own hit ``writer_hit_tokens`` (vLLM
    ``SingleTypeKVCacheManager.cache_blocks`` masks newly cached blocks only).

    Under ``policy`` ``vllm`` (the one-unit rule) every retained boundary
    ``b`` also promises ``b - A``, for every drafter and protection. Under
    ``retained`` only what vLLM 0.33.0 keeps: ``b - A`` below periodic
    checkpoints (the seed PR) and junctions
    (``SingleTypeKVCacheManager.cache_blocks``) under the EAGLE drop only,
    and only when a sliding-window or Mamba group takes it (with the
    drafter's groups marked ``is_eagle_group`` they may not).
    Dense retention (``R`` ``None`` or ``A``) makes every multiple of ``A``
    one. Returns sorted positions; 0 is always included.
    """
    alignment = scenario.effective_hit_alignment_tokens
    retention = scenario.retention_interval_tokens
    one_unit = promise_policy(policy) is Policy.VLLM
    # vLLM keeps the tail below a periodic checkpoint or a junction in the
    # groups that drop (SlidingWindowManager.use_eagle): with the drafter's
    # groups marked is_eagle_group, sliding-window groups may not drop at all.
    tails = [
        i
        for i, g in enumerate(scenario.kv_cache_groups)
        if (g.kind.sliding_window_family and g.prefix_cacheable) or g.kind is GroupKind.MAMBA
    ]
    drops = scenario.drop_group_indices
    tail_drop = model.drop and all(i in drops for i in tails)
    points: set[int] = {0}
    if retention is None or retention == alignment:
        points.update(range(0, up_to_tokens + 1, alignment))
        return tuple(sorted(points))
    if retention > 0:
        for c in range(retention, up_to_tokens + alignment + 1, retention):
            points.add(c)
            if tail_drop or one_unit:
                points.add(c - alignment)
    own = set(replay_boundaries(scenario, model, writer))
    if one_unit:
        own.update(max(b - alignment, 0) for b in tuple(own))
    if junction_tokens:
        own.add(junction_tokens)
        if tail_drop or one_unit:
            own.add(junction_tokens - alignment)
    points.update(p for p in own if p >= writer_hit_tokens)
    return tuple(sorted(p for p in points if p <= up_to_tokens))


@dataclass(frozen=True)
class SiblingReference:
    """What one request is owed.

    Attributes:
        index: the request index.
        divergence_tokens: ``D``, the longest common prefix with any earlier
            request, in tokens (0 for the first request).
        dense_tokens: ``h_dense``, the dense-reference hit, in tokens.
        expected_tokens: the highest checkpoint the policy promises at or
            below ``h_dense``, in tokens.
        writer: the earlier request that gives ``expected_tokens`` (``None``
            when nothing is owed).
        checkpoints: the promised checkpoints at or below ``h_dense`` across
            all writers, in tokens, sorted.
        junction_tokens: where the request pins its shared-prefix junction
            when its own hit falls short of it, in tokens: the longest
            single-group hit (:func:`_junction_rows`), at least ``h_dense``;
            0 where not modelled (state groups, judged by
            :mod:`differential.oracle.state`).
    """

    index: int
    divergence_tokens: int
    dense_tokens: int
    expected_tokens: int
    writer: int | None
    checkpoints: tuple[int, ...]
    junction_tokens: int = 0


class _Promised(dict[tuple[int, int, int, int], tuple[int, ...]]):
    """:func:`checkpoints` per writer key ``(prompt length, junction, dense
    hit, own hit)``, all in tokens, evaluated on first use: it reads its
    writer only through the writer's prompt length, so the first request of
    that length stands for every writer with the key."""

    def __init__(
        self, scenario: Scenario, model: DrafterModel, policy: Policy, lengths: Sequence[int]
    ) -> None:
        super().__init__()
        self._args = scenario, model, policy
        self._writer_of_length: dict[int, int] = {}
        for i, n in enumerate(lengths):
            self._writer_of_length.setdefault(n, i)

    def __missing__(self, key: tuple[int, int, int, int]) -> tuple[int, ...]:
        scenario, model, policy = self._args
        length, junction, dense, hit = key
        points = self[key] = checkpoints(
            scenario, model, self._writer_of_length[length], junction, dense, hit, policy
        )
        return points


def _reading_writers(
    scenario: Scenario, writers: Sequence[frozenset[int]] | None, count: int
) -> Sequence[frozenset[int]] | None:
    """``writers`` (``None``: every earlier request) with none for a request
    that skips reading the prefix cache (``skip_reading_prefix_cache``): it
    takes nothing from any writer."""
    if all(scenario.reads_prefix_cache(j) for j in range(count)):
        return writers
    return [
        frozenset()
        if not scenario.reads_prefix_cache(j)
        else frozenset(range(j))
        if writers is None
        else writers[j]
        for j in range(count)
    ]


def references(
    scenario: Scenario,
    model: DrafterModel,
    observed_hits: Sequence[int],
    policy: Policy = Policy.VLLM,
    writers: Sequence[frozenset[int]] | None = None,
) -> tuple[SiblingReference, ...]:
    """Reference values for every request whose hit was observed.

    ``observed_hits`` decides which writers pinned a junction: a request pins
    one where its first full-attention group alone hits (its dense hit on a
    layout without one) when its own hit fell short of that (vLLM
    ``KVCacheManager.get_computed_blocks``, :func:`_junction_rows`). ``writers`` (per request, the
    earlier requests that had finished and been freed when it looked up;
    default: every earlier one, a sequential run) limits whose cached blocks
    a request is owed. A scenario with state groups (Mamba) is judged by
    :func:`differential.oracle.state.state_references` (sequential only).
    A request that skips reading the prefix cache (``skip_reading_prefix_cache``,
    vLLM PR #28194) has no writer: it is owed nothing and pins no junction,
    while its own blocks serve later requests.
    """
    if scenario.mamba_groups:
        assert writers is None, "state groups are judged for sequential runs only"
        return _state_group_references(scenario, model, observed_hits, policy)
    writers = _reading_writers(scenario, writers, len(observed_hits))
    # Scenario-only quantities come from the per-scenario memo; checkpoints()
    # reads its writer only through the writer's prompt length, so writers
    # alike in (length, junction, dense hit, own hit) share one evaluation
    # (_Promised), and within one sibling a writer alike an earlier one
    # changes nothing (the first writer owed the most is kept). A row's
    # writers are reduced to their distinct keys, the keys to their
    # checkpoints and the checkpoints to their union, each in C
    # (dict.fromkeys keeps first occurrences in order).
    shared_rows = shared_prefixes(scenario)
    dense_rows = _dense_rows(scenario, model)
    junction_rows = _junction_rows(scenario, model)
    lengths = [r.prompt_tokens for r in scenario.requests]
    pins_junctions = scenario.pins_junctions
    promised = _Promised(scenario, model, policy, lengths)
    ideal = policy is Policy.IDEAL
    junctions: list[int] = []
    dense_by_request: list[int] = []
    out: list[SiblingReference] = []
    for j in range(len(observed_hits)):
        shared_row, dense_row = shared_rows[j], dense_rows[j]
        junction_row = junction_rows[j] if junction_rows is not None else None
        chosen: Sequence[int]
        keys: Callable[[], Iterable[tuple[int, int, int, int]]]
        if writers is None:
            chosen = range(j)
            shared_c, dense_c, junction_c = shared_row, dense_row, junction_row
            # zip hands out a fresh tuple only where the last one was kept:
            # the keys cost one tuple per distinct key.
            keys = partial(zip, lengths, junctions, dense_row, observed_hits)
        else:
            chosen = sorted(w for w in writers[j] if w < j)
            shared_c = [shared_row[i] for i in chosen]
            dense_c = [dense_row[i] for i in chosen]
            junction_c = None if junction_row is None else [junction_row[i] for i in chosen]
            chosen_keys = [
                (lengths[i], junctions[i], dense_row[i], observed_hits[i]) for i in chosen
            ]
            keys = partial(iter, chosen_keys)
        divergence = max(shared_c, default=0)
        best_dense = max(dense_c, default=0)
        distinct = list(dict.fromkeys(keys()))
        promises = list(map(promised.__getitem__, distinct))
        points = set().union((0,), *promises)
        best_expected, best_writer = 0, None
        if distinct:
            # What each writer is owed: its dense hit (ideal) or its highest
            # checkpoint; the first writer owed the most gives the reference.
            owed = list(map(itemgetter(2), distinct) if ideal else map(itemgetter(-1), promises))
            best_expected = max(owed)
            best_writer = chosen[indexOf(keys(), distinct[owed.index(best_expected)])]
        dense_by_request.append(best_dense)
        # A request pins a junction when its own hit fell short of the
        # longest single-group hit, on layouts where vLLM reports an
        # uncached common prefix (Scenario.pins_junctions: not a single group
        # or a single attention type, UnitaryKVCacheCoordinator reports
        # nothing): full attention's own hit (_junction_rows), else the
        # dense hit.
        junction = best_dense
        if junction_c is not None:
            junction = max(junction, max(junction_c, default=0))
        pins = pins_junctions and observed_hits[j] < junction
        junctions.append(junction if pins else 0)
        out.append(
            SiblingReference(
                index=j,
                divergence_tokens=divergence,
                dense_tokens=best_dense,
                expected_tokens=best_expected,
                writer=best_writer,
                checkpoints=tuple(sorted(points)),
                junction_tokens=junction,
            )
        )
    return tuple(out)


def _state_group_references(
    scenario: Scenario,
    model: DrafterModel,
    observed_hits: Sequence[int],
    policy: Policy,
) -> tuple[SiblingReference, ...]:
    """:func:`references` for a scenario with state groups: the attention
    proof, the writer's states and the one-unit rule mapped onto states
    (:mod:`differential.oracle.state`)."""

    def promised(writer: int, junction: int, up_to: int, writer_hit: int) -> tuple[int, ...]:
        return checkpoints(scenario, model, writer, junction, up_to, writer_hit, policy)

    rows = state_references(
        scenario,
        model.drop,
        model.hash_lookahead_tokens,
        model.reprefillable_tokens,
        model.reprefillable_tokens + 1,
        observed_hits,
        promised,
        policy,
    )
    return tuple(
        SiblingReference(
            index=j,
            divergence_tokens=divergence,
            dense_tokens=dense,
            expected_tokens=expected,
            writer=writer,
            checkpoints=points,
        )
        for j, (divergence, dense, expected, writer, points) in enumerate(rows)
    )


def needless_drop_finding(
    scenario: Scenario, run: RunObservation, model: DrafterModel, policy: Policy
) -> Finding | None:
    """``needless-drop`` when the run's manager took the EAGLE block drop
    (``use_eagle_block_drop``) for a drafter whose draft KV does not depend on
    the next token under the scenario's settings (``model.drop`` false)."""
    if run.settings is None or not run.settings.use_eagle_block_drop or model.drop:
        return None
    return Finding(
        FindingKind.NEEDLESS_DROP,
        run.variant,
        None,
        f"the manager drops the last matched block for drafter "
        f"{scenario.drafter.kind.value!r}, whose draft KV does not depend "
        f"on the next token under these settings",
        policy=policy,
    )


def fallback_finding(
    variant: str, vref: SiblingReference, hit: int, common: dict[str, Any]
) -> Finding:
    """``fallback``: ``hit`` (tokens) fell short of the checkpoint ``vref``
    promises; says which promised checkpoint it landed on, if any.
    ``common`` holds the finding's divergence, hit and policy fields."""
    landed = max(p for p in vref.checkpoints if p <= hit)
    return Finding(
        FindingKind.FALLBACK,
        variant,
        vref.index,
        f"expected checkpoint {vref.expected_tokens}, hit {hit}: "
        + (
            f"fell back to checkpoint {landed}"
            if landed == hit
            else f"not a promised checkpoint (the highest below it is {landed})"
        ),
        expected_tokens=vref.expected_tokens,
        fallback_checkpoint_tokens=landed,
        **common,
    )


def _unjudged_run_findings(run: RunObservation, policy: Policy) -> tuple[list[Finding], bool]:
    """What a run's failures say before any hit is judged: a ``timeout``, a
    ``crash`` (the requests it completed are still judged), evicted cached
    blocks (``eviction``); and whether the run's hits are judged at all (not
    for an unsupported, timed-out or evicting run)."""
    findings: list[Finding] = []
    name = run.variant
    if run.unsupported is not None:
        return findings, False
    if run.timed_out:
        findings.append(
            Finding(FindingKind.TIMEOUT, name, len(run.requests), run.error or "", policy=policy)
        )
        return findings, False
    if run.error is not None:
        findings.append(
            Finding(FindingKind.CRASH, name, len(run.requests), run.error, policy=policy)
        )
    if run.evicted_blocks:
        findings.append(
            Finding(
                FindingKind.EVICTION,
                name,
                None,
                f"{run.evicted_blocks} cached blocks were evicted; hits are not judged",
                policy=policy,
            )
        )
        return findings, False
    return findings, True


_SKIPPED_READ = (
    "hit {hit}, but the request skips reading the prefix cache "
    "(skip_reading_prefix_cache, vLLM PR #28194): it computes every prompt token"
)


def _over_hit_ceilings(
    scenario: Scenario,
    run: RunObservation,
    model: DrafterModel,
    refs: tuple[SiblingReference, ...],
    hits: Sequence[int],
) -> list[int]:
    """Per sibling, the dense reference (tokens) a hit may not exceed: the
    drafter's own (``refs``), without its re-prefillable tail when the user
    opted out of protection, and at least the dense reference under the
    needless protection the run used (:func:`needless_protection_model`)."""
    # Without protection (the user opted out of the drop) the writer's
    # re-prefillable tail may be cached: forbid only what lies beyond it.
    liberal = model
    if model.dependency_tokens == 0 and model.reprefillable_tokens:
        liberal = dataclasses.replace(model, reprefillable_tokens=0)
    ceilings = (
        [r.dense_tokens for r in refs]
        if liberal is model
        else [r.dense_tokens for r in references(scenario, liberal, hits)]
    )
    as_run = needless_protection_model(liberal, run.settings)
    if as_run is not None:
        # Needless protection (a drop, or lookahead hashes, the drafter's KV
        # does not need) moves where the run's junctions and prefill steps
        # ended (lookahead hashes pin a junction one proof lower; the
        # scheduler stops at the drop's resume positions), so states exist
        # there that the drafter's own model never makes; a state is the
        # exact recurrent state wherever it was taken, and the protection
        # only makes the attention proof stricter: such a hit reuses nothing
        # stale. Judge the ceiling with the protection the run used as well.
        ceilings = [
            max(c, r.dense_tokens)
            for c, r in zip(ceilings, references(scenario, as_run, hits), strict=True)
        ]
    return ceilings


def _design_gap_finding(
    scenario: Scenario,
    model: DrafterModel,
    variant: str,
    ref: SiblingReference,
    vref: SiblingReference,
    hit: int,
    common: dict[str, Any],
) -> Finding:
    """``design-gap`` (the ``ideal`` policy): ``hit`` (tokens) reaches what
    vLLM's policy promises (``vref``) but not the dense reference ``ref``;
    says how many SWA blocks per group keeping one more SWA tail costs."""
    # Closing the gap means keeping one more SWA tail (the window plus
    # the peek block under the drop) at the dense hit, per SWA group.
    tails = [
        -(-((g.sliding_window_tokens or 1) - 1) // g.block_size_tokens) + (1 if model.drop else 0)
        for g in scenario.sliding_window_groups
    ]
    cost = f"; closing it costs up to {tails} SWA blocks per group" if tails else ""
    return Finding(
        FindingKind.DESIGN_GAP,
        variant,
        ref.index,
        f"dense reference {ref.expected_tokens}, hit {hit}: the writer's "
        f"data could serve it but vLLM's policy promises only {vref.expected_tokens}"
        f"{cost}",
        expected_tokens=ref.expected_tokens,
        **common,
    )


def judge_run(
    scenario: Scenario,
    run: RunObservation,
    policy: Policy = Policy.VLLM,
) -> tuple[tuple[SiblingReference, ...], tuple[Finding, ...]]:
    """Judge one run of one variant against the invariants.

    Fallbacks are judged against what the drafter's own protection
    (:func:`drafter_model`) owes; the over-hit ceiling is the larger of that
    model's dense reference and, when the run protected more than the drafter
    needs (a needless drop or needless lookahead hashes, read off
    ``run.settings``), the dense reference under the protection it used.

    Returns:
        The references for the requests the run completed, and the findings
        (empty when the run is clean).
    """
    findings, judged = _unjudged_run_findings(run, policy)
    if not judged:
        return (), tuple(findings)
    name = run.variant
    model = drafter_model(scenario)
    needless = needless_drop_finding(scenario, run, model, policy)
    if needless is not None:
        findings.append(needless)
    hits = run.hits
    alignment = scenario.effective_hit_alignment_tokens
    refs = references(scenario, model, hits, policy)
    promised = promise_policy(policy)
    vllm_refs = refs if policy is promised else references(scenario, model, hits, promised)
    ceilings = _over_hit_ceilings(scenario, run, model, refs, hits)
    for ref, vref, hit, dense in zip(refs, vllm_refs, hits, ceilings, strict=True):
        common: dict[str, Any] = {
            "divergence_tokens": ref.divergence_tokens,
            "hit_tokens": hit,
            "policy": policy,
        }
        ceiling = min(dense, max(0, ref.divergence_tokens - model.dependency_tokens))
        if ref.index == 0:
            ceiling = 0
        if hit > ceiling:
            findings.append(
                Finding(
                    FindingKind.OVER_HIT,
                    name,
                    ref.index,
                    (
                        f"hit {hit} exceeds what may be reused: dense reference "
                        f"{dense}, divergence point {ref.divergence_tokens}"
                        + (
                            f" minus {model.dependency_tokens} drafter-dependent token(s)"
                            if model.dependency_tokens
                            else ""
                        )
                    )
                    if scenario.reads_prefix_cache(ref.index)
                    else _SKIPPED_READ.format(hit=hit),
                    expected_tokens=ceiling,
                    **common,
                )
            )
        if hit % alignment:
            findings.append(
                Finding(
                    FindingKind.MISALIGNED,
                    name,
                    ref.index,
                    f"hit {hit} is not a multiple of the hit alignment {alignment}",
                    expected_tokens=hit // alignment * alignment,
                    **common,
                )
            )
        if hit < vref.expected_tokens:
            findings.append(fallback_finding(name, vref, hit, common))
        elif policy is Policy.IDEAL and hit < ref.expected_tokens:
            findings.append(_design_gap_finding(scenario, model, name, ref, vref, hit, common))
    findings += per_group_findings(scenario, run, policy)
    findings += kv_event_findings(scenario, run, policy)
    findings += metrics_findings(scenario, run, policy)
    findings += replay_findings(scenario, run, policy)
    findings += check_blocks(scenario, run, policy)
    findings += uncovered_findings(scenario, run, policy)
    return refs, tuple(findings)


def cross_check_dense(scenario: Scenario, dense_run: RunObservation) -> tuple[Finding, ...]:
    """Compare vLLM's dense-retention run with the oracle's dense reference.

    The reference is computed with the protection the run actually used
    (:func:`model_from_settings`), so this checks the oracle's arithmetic and
    vLLM's dense path, not the drafter policy. A mismatch is a finding.
    """
    if (
        dense_run.error is not None
        or dense_run.settings is None
        or dense_run.evicted_blocks
        or dense_run.unsupported is not None
    ):
        return ()
    model = model_from_settings(dense_run.settings, len(scenario.kv_cache_groups))
    refs = references(scenario, model, dense_run.hits)
    findings = []
    for ref, hit in zip(refs, dense_run.hits, strict=True):
        if hit != ref.dense_tokens:
            findings.append(
                Finding(
                    FindingKind.DENSE_MISMATCH,
                    dense_run.variant,
                    ref.index,
                    f"vLLM's dense-retention run hit {hit}, the oracle's dense "
                    f"reference is {ref.dense_tokens}",
                    divergence_tokens=ref.divergence_tokens,
                    expected_tokens=ref.dense_tokens,
                    hit_tokens=hit,
                )
            )
    if scenario.retention_interval_tokens is not None:  # else judge_run checked this run
        label = "dense cross-check run: "
        findings += per_group_findings(scenario, dense_run, label=label)
        findings += kv_event_findings(scenario, dense_run, label=label)
        findings += check_blocks(scenario, dense_run, label=label)
    return tuple(findings)

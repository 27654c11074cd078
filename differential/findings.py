"""Findings: what the oracle and the comparison report, as data.

A :class:`Finding` is never raised; it is a value with everything needed to
read it (the request, its divergence point, the expected checkpoint, the hit
and the checkpoint it fell back to) and a :meth:`Finding.signature` for
deduplication.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "FIX_COMPARISONS",
    "RESERVED_WITHOUT_BLOCKS",
    "SEVERITY",
    "STALL_WORDS",
    "UNRESERVED_PARTIAL_TAIL_COPY",
    "Finding",
    "FindingKind",
    "Policy",
]

#: What a stall's crash detail says, in every driving mode and on the engine:
#: vLLM's Scheduler scheduled no token for many steps with requests unfinished
#: (differential/driver/scheduler_mode.py, differential/driver/engine_worker.py).
STALL_WORDS = "scheduled nothing for"

#: What a scheduler-mode stall's detail adds when waiting requests are still
#: reserved as vLLM's in-flight prefills while holding no blocks
#: (differential/driver/scheduler_mode.py).
RESERVED_WITHOUT_BLOCKS = "in-flight prefill(s) holding no blocks"

#: What a scheduler-mode stall's detail adds when waiting requests whose
#: asynchronous load has arrived owe a Mamba group a copy-on-write block for
#: the partial tail that caching the load keyed, a block the in-flight
#: reservation did not count (differential/driver/scheduler_mode.py).
UNRESERVED_PARTIAL_TAIL_COPY = "loaded request(s) owing a Mamba partial-tail copy"


class Policy(StrEnum):
    """Which promise a retention setting makes to a later request.

    * ``vllm`` (the default): the one-unit rule. Every boundary ``b`` a writer
      retains (periodic ``k*R``, its replay boundaries as
      ``vllm/v1/core/kv_cache_coordinator.py`` ``replay_boundaries`` defines
      them, its pinned shared-prefix junction) is a checkpoint, and so is
      ``b - A``, whatever the drafter and protection. vLLM's maintainers state
      this rule piecewise: the seed PR for periodic checkpoints under the
      EAGLE drop, vLLM PR #57613 (issue #57610) for the replay boundary
      without a drafter. A finding under this policy is a bug by the
      maintainers' own standard.
    * ``retained``: only what vLLM 0.33.0 literally retains: the boundaries
      above, with ``b - A`` only below periodic checkpoints and junctions
      under the EAGLE drop. For users who want regressions against one
      release's own behaviour and nothing else.
    * ``ideal``: every request is owed its dense-reference hit whenever the
      writer's retained data could serve it. Shortfalls that ``vllm`` accepts
      are reported as ``design-gap``, not as ``fallback``.
    """

    VLLM = "vllm"
    RETAINED = "retained"
    IDEAL = "ideal"


class FindingKind(StrEnum):
    """Kinds of finding, most severe first (see :data:`SEVERITY`)."""

    WRONG_OUTPUT = "wrong-output"
    """(engine mode) a request sampled other tokens, or logprobs beyond the
    stated tolerance, with the prefix cache on than with it off (same dummy
    weights, greedy): the cache served KV or states that change what the
    model computes (:mod:`differential.driver.engine_mode`)."""
    WRONG_KV = "wrong-kv"
    """A lookup handed out the wrong blocks (too many or too few for the hit,
    the null block where attention reads, a block holding other tokens), or a
    step wrote into a block another request reads: silently wrong outputs
    whatever the hit length (:mod:`differential.oracle.blocks`)."""
    OVER_HIT = "over-hit"
    """A hit past the dense reference or reusing KV that depends on a token
    past the divergence point: silently wrong outputs."""
    CRASH = "crash"
    """vLLM raised while serving the scenario (or its worker process died)."""
    WRONG_FINISH = "wrong-finish"
    """(scheduler mode, a KV connector's store) a request finished otherwise
    than its KV loads owe: with an error though none of its loads failed, or,
    under ``kv_load_failure_policy`` ``fail``, not with an error though its
    load failed (vLLM PR #26813): a client sees a request fail that should
    not, or gets an answer computed over KV that never arrived
    (:func:`differential.oracle.connector.finish_findings`)."""
    TIMEOUT = "timeout"
    """A tree variant's worker did not answer within the per-scenario timeout."""
    MISALIGNED = "misaligned"
    """A hit that is not a multiple of the hit alignment."""
    FALLBACK = "fallback"
    """A hit below the highest checkpoint the policy promises."""
    PER_GROUP_HIT = "per-group-hit"
    """A KV cache group looked up alone
    (``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``, the local
    hit a KV connector builds on) hits less than the reconciled hit every
    group holds, or off the hit alignment (:mod:`differential.oracle.per_group`)."""
    KEPT_SKIPPED_BLOCK = "kept-skipped-block"
    """After an ``allocate_slots`` step a sliding-window or chunked-local
    group's block table still holds a real block that no later step attends
    to: vLLM's ``remove_skipped_blocks`` frees such blocks at the step (vLLM
    PR #14097), and admission caps a request at its window's blocks
    (``max_admission_blocks_per_request``) on that promise, so the pool is
    over-committed (:func:`differential.oracle.blocks.table_violations`).
    Likewise an R-SWA group's decode gap, and a Mamba group's state block
    holding no cache entry below the state the next step reads (align mode
    keeps only the last computed token's state, vLLM PR #30877)."""
    KV_EVENTS = "kv-events"
    """The KV cache event stream (``BlockStored``, ``BlockRemoved``,
    ``AllBlocksCleared``) disagrees with the prefix cache it describes:
    replaying it does not give the pool's cached blocks per group after every
    step, an event misdescribes its blocks (parent hash, token ids, block
    size, group, spec kind), removes a block never stored, or a lookup
    re-announces reused blocks other than the report mode says
    (:mod:`differential.oracle.kv_events`). A router rebuilding the cache
    from the stream misroutes requests."""
    KV_CACHE_PLAN = "kv-cache-plan"
    """(a scenario with a model) the ``KVCacheConfig`` the variant's vLLM
    planned for the model departs from what the layers' page sizes owe: a
    group's block size after page-size unification, which layers share a
    group, the scheduler or hash block size, the pool's blocks, or a KV cache
    tensor's size, layers or strides: the engine would allocate, or index,
    other memory than the layers need
    (:func:`differential.oracle.layout.kv_cache_plan_findings`). Between two
    variants neither labelled fixed (no request): their vLLMs planned the
    model otherwise (:func:`differential.compare.compare_unlabelled`)."""
    VARIANT_REGRESSION = "variant-regression"
    """A variant carrying the fix hits less than one without it."""
    POOL_REGRESSION = "pool-regression"
    """(scheduler mode) under pool pressure (evictions or preemptions on
    either side) a variant carrying a fix hits fewer tokens in all than one
    without it on the same workload and pool: the blocks the fix keeps crowd
    out the hits it was meant to serve."""
    VARIANT_DRIFT = "variant-drift"
    """Two variants differ outside the fix's domain, or the fix keeps more
    blocks than it claims."""
    DISAGREEMENT = "disagreement"
    """Two variants, neither labelled fixed, give a sibling different hits."""
    COST_CHANGE = "cost-change"
    """Two variants, neither labelled fixed, give the same hits but keep a
    different number of blocks."""
    NEEDLESS_DROP = "needless-drop"
    """The manager drops the last matched block for a drafter whose KV does
    not depend on the next token."""
    DENSE_MISMATCH = "dense-mismatch"
    """vLLM's dense-retention run disagrees with the oracle's dense reference."""
    MODE_MISMATCH = "mode-mismatch"
    """(scheduler mode) a sequential scenario gave different hits through
    vLLM's ``Scheduler`` than through the manager-level driver: the driver's
    reconstruction of the scheduler's calls is wrong (or the scheduler
    changed); the finding names the first differing call."""
    ASYNC_MISMATCH = "async-mismatch"
    """(scheduler mode, async scheduling) requests arriving one at a time got
    other hits under vLLM's ``AsyncScheduler`` than under its synchronous
    ``Scheduler``, neither run evicting: caching depended on a batch being in
    flight (:func:`differential.oracle.scheduling.cross_check_scheduling`)."""
    DRIVER_MISMATCH = "driver-mismatch"
    """(engine mode) kvfuzz's manager or scheduler driver on the engine's
    vLLM release gave other hits than vLLM's real engine: both hit lists and
    the first request where they part."""
    WATERMARK = "watermark"
    """(scheduler mode) a waiting or preempted request was admitted while
    others were scheduled and left fewer free blocks than the KV cache
    watermark (``SchedulerConfig.watermark``, vLLM PR #44594) keeps
    (:mod:`differential.oracle.watermark`)."""
    REPLAY = "replay"
    """(scheduler mode, a bounded-replay group) a request was first
    scheduled with other computed tokens or another ``replay_start`` than
    its hit owes: the hit's last window recomputed, a hit no longer than the
    window not adopted (DeepSeek-V4.1's SWA bounded replay, vLLM PR #56227;
    :mod:`differential.oracle.replay`)."""
    CACHE_METRICS = "cache-metrics"
    """What vLLM reports about its cache is wrong: the prefix-cache
    statistics of a hit-rate dashboard (issues #43736, #25780), the KV cache
    usage, or ``reset_prefix_cache`` (refused with nothing running, granted
    while requests hold blocks, or leaving cached blocks behind)
    (:mod:`differential.oracle.metrics`)."""
    FREE_ORDER = "free-order"
    """(scheduler mode, async scheduling with a KV consumer connector) a
    request's deferred free (``Scheduler._drain_deferred_frees``) returned
    its blocks to the free queue in another order than the immediate free
    (group by group, each tail first), so other blocks are evicted first
    (vLLM issue #48489; a named policy:
    :data:`differential.oracle.scheduling.FREE_ORDER_POLICIES`)."""
    EVICTION_COLLAPSE = "eviction-collapse"
    """(scheduler mode) with dense retention every later turn of every
    session hit nothing, while retention 0 at the same pool size keeps
    hitting (vLLM issue #48435): dense retention's cached blocks crowd the
    pool so that each session's blocks are evicted before its next turn."""
    DESIGN_GAP = "design-gap"
    """(``ideal`` policy only) a hit below the dense reference that ``vllm``
    accepts."""
    ALIGNMENT_BLOWUP = "alignment-blowup"
    """The layout costs hits by construction: the hit alignment (the LCM of
    block sizes that do not divide one another) exceeds the largest group
    block size (vLLM PR #52804). Reported once per scenario, as variant
    ``layout`` (:mod:`differential.oracle.layout`)."""
    EVICTION = "eviction"
    """Cached blocks were evicted, so the run cannot be judged."""


SEVERITY: dict[FindingKind, int] = {kind: rank for rank, kind in enumerate(FindingKind)}

FIX_COMPARISONS: frozenset[FindingKind] = frozenset(
    {FindingKind.VARIANT_REGRESSION, FindingKind.POOL_REGRESSION, FindingKind.VARIANT_DRIFT}
)
"""The kinds that compare a variant carrying a fix with a baseline (``"fixed
vs unfixed"``): a known label on one names a cost of the fix, not a vLLM issue."""


@dataclass(frozen=True)
class Finding:
    """One thing the oracle or the comparison found.

    Attributes:
        kind: the finding kind.
        variant: the variant it was found on (``"a vs b"`` for comparisons).
        request: request index, or ``None`` for a whole-run finding.
        divergence_tokens: the request's divergence point ``D`` (longest common
            prefix with any earlier request), in tokens.
        expected_tokens: the checkpoint (or reference hit) that was due, in tokens.
        hit_tokens: the hit observed, in tokens.
        fallback_checkpoint_tokens: the highest promised checkpoint at or below
            the hit, in tokens (fallbacks only).
        policy: the policy that judged it.
        detail: one readable sentence.
        known_issue: the name of the known vLLM issue that explains it
            (:mod:`differential.oracle.known`), or, for a comparison of a
            fix with a baseline, of the fix's known cost; ``None`` otherwise.
        blocks_per_group: (``wrong-kv`` only) the block ids the request's
            lookup returned, per KV cache group (``None``: the null block).
    """

    kind: FindingKind
    variant: str
    request: int | None
    detail: str
    divergence_tokens: int | None = None
    expected_tokens: int | None = None
    hit_tokens: int | None = None
    fallback_checkpoint_tokens: int | None = None
    policy: Policy = Policy.VLLM
    known_issue: str | None = None
    blocks_per_group: tuple[tuple[int | None, ...], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``blocks_per_group`` only when set)."""
        out = self._base_dict()
        if self.blocks_per_group:
            out["blocks_per_group"] = [list(g) for g in self.blocks_per_group]
        return out

    def _base_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "variant": self.variant,
            "request": self.request,
            "divergence_tokens": self.divergence_tokens,
            "expected_tokens": self.expected_tokens,
            "hit_tokens": self.hit_tokens,
            "fallback_checkpoint_tokens": self.fallback_checkpoint_tokens,
            "policy": self.policy.value,
            "detail": self.detail,
            "known_issue": self.known_issue,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        """Inverse of :meth:`to_dict`."""
        return cls(
            kind=FindingKind(data["kind"]),
            variant=data["variant"],
            request=data["request"],
            detail=data["detail"],
            divergence_tokens=data.get("divergence_tokens"),
            expected_tokens=data.get("expected_tokens"),
            hit_tokens=data.get("hit_tokens"),
            fallback_checkpoint_tokens=data.get("fallback_checkpoint_tokens"),
            policy=Policy(data.get("policy", Policy.VLLM.value)),
            known_issue=data.get("known_issue"),
            blocks_per_group=tuple(tuple(g) for g in data.get("blocks_per_group", ())),
        )

    @property
    def owner(self) -> str:
        """The variant the finding belongs to (the fixed side of ``"a vs b"``)."""
        return self.variant.split(" vs ")[0]

    @property
    def known_kind(self) -> str | None:
        """What kind of known thing :attr:`known_issue` names, for reports:
        ``known vLLM issue``, or ``known cost of the fix`` on a comparison of
        a fix with a baseline (:data:`FIX_COMPARISONS`: what explains it is
        the fix's own price, not vLLM); ``None`` when nothing known explains it."""
        if not self.known_issue:
            return None
        return "known cost of the fix" if self.kind in FIX_COMPARISONS else "known vLLM issue"

    def summary(self) -> str:
        """One line: kind, variant, request and detail."""
        where = "run" if self.request is None else f"request {self.request}"
        known = f" [{self.known_kind}: {self.known_issue}]" if self.known_issue else ""
        return f"{self.kind.value} on {self.variant}, {where}: {self.detail}{known}"

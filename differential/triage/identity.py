"""Triage: one root cause per finding, facets and consequences, no vLLM.

A root cause is kvfuzz's analogue of a crash's stack: *where in vLLM* a
sibling's hit came up short. For a shortfall (``fallback``, ``dense-mismatch``,
``design-gap``, a real ``variant-regression``) it is read off the lookup the
driver traced (:class:`~differential.observation.GroupLookup`, recorded around
``KVCacheManager.get_computed_blocks``):

* the **vLLM function** that lost the hit: the single-type
  ``find_longest_cache_hit`` of the binding group (the first call that
  returned the final hit: ``vllm/v1/core/kv_cache_coordinator.py``
  ``HybridKVCacheCoordinator.find_longest_cache_hit`` takes the minimum),
  named by its manager (``vllm/v1/core/single_type_kv_cache_manager.py``:
  ``FullAttentionManager`` for full attention and MLA,
  ``SlidingWindowManager`` for sliding windows and sliding-window MLA,
  ``ChunkedLocalAttentionManager``, ``MambaManager``);
* the **branch**, where one names a mechanism: for full attention
  ``prefix stopped`` (an uncached block) or ``prefix capped`` (the length
  cap). A sliding window's ``match_found`` and ``not match_found`` paths are
  not told apart: which one serves a sibling depends only on whether the
  owed checkpoint lies within one window of token 0, a matter of scale, and
  the ``not match_found`` path's own loss is a known issue
  (``swa-short-run-align-before-drop``);
* the **missing retained run**: the checkpoint that was owed
  (``Finding.expected_tokens``), by the boundary that makes it one
  (``periodic`` ``k*R``, ``junction``, ``replay``, ``dense``, ``start``) and
  how many hit-alignment units ``A`` it sits below that boundary.

None of these depend on the drafter, the retention interval's size, the
number of groups or the geometry's scale, so the Triton seed (block 16/32,
R = 8192), its shrunk reproducer, its short-prefix form and the FlashInfer
geometry (block 64/128) share one identity, ``shortfall |
SlidingWindowManager.find_longest_cache_hit | missing periodic - 1A`` (the
same class beside a drafter's group marked ``is_eagle_group``, which the seed
fix does not widen, is the known issue ``seed-fix-limit-marked-draft-group``).
An ``over-hit`` is named after the group whose lookup over-reached (a state
or window group before full attention, which only matches hashes); a
``crash`` after the vLLM function that raised and the exception type
(``crash | lookup | SlidingWindowManager.find_longest_cache_hit: IndexError``).

A finding a known vLLM issue explains (:mod:`differential.oracle.known`) takes the
issue as its root cause. A run that protects a drafter needing no protection
(``needless-drop``, or lookahead hashes for it) is the root cause of the
shortfalls that protection brings (``needless-protection``: what the fix
removes); a shortfall the run would show even judged with the protection it
used has a cause of its own, triaged on the scenario as the run protected it
(:func:`protected_as_run`). Whole-run and comparison findings of other kinds
get a root cause per kind.

**Facets**: the findings of one variant on one sibling (``fallback`` and
``dense-mismatch``, say) are one finding; the most severe gives the root
cause, the others are its facets, and a ``variant-regression`` on the same
sibling of a variant that itself has a finding there is a facet of that.

**Consequences**: a ``variant-regression`` whose two variants' earlier
requests left different caches (different hits or junctions) follows from the
earliest earlier request where they part, and takes the root cause of a
finding there; only the same history with fewer hits on the fixed side is a
regression of its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from differential.compare import ScenarioResult, VariantResult
from differential.errors import ScenarioError
from differential.findings import SEVERITY, Finding, FindingKind, Policy
from differential.observation import GroupLookup, RequestObservation, RunObservation
from differential.oracle import (
    DrafterModel,
    cross_check_dense,
    drafter_model,
    replay_boundaries,
)
from differential.oracle.engine import judge_observed_run
from differential.oracle.known import label_known
from differential.oracle.kv_events import kv_event_rule
from differential.oracle.per_group import wrong_per_group_hit
from differential.scenario import Drafter, DrafterKind, GroupKind, Scenario

__all__ = [
    "MANAGER_FUNCTION",
    "Boundary",
    "Role",
    "RootCause",
    "Triaged",
    "binding_lookup",
    "manager_family",
    "missing_checkpoint",
    "needless_protection",
    "over_reaching_lookup",
    "protected_as_run",
    "root_causes",
    "triage",
]

_SHORTFALL = frozenset(
    {
        FindingKind.FALLBACK,
        FindingKind.DENSE_MISMATCH,
        FindingKind.DESIGN_GAP,
        FindingKind.VARIANT_REGRESSION,
    }
)
# Shortfalls judged against the oracle's drafter model: a needless drop or
# lookahead hash explains them. The dense cross-check judges with the
# protection the run used, so a dense mismatch is never one of them.
_NEEDLESS_FACETS = frozenset(
    {FindingKind.FALLBACK, FindingKind.DESIGN_GAP, FindingKind.DENSE_MISMATCH}
)


MANAGER_FUNCTION: dict[str, str] = {
    GroupKind.FULL_ATTENTION.value: "FullAttentionManager.find_longest_cache_hit",
    GroupKind.SLIDING_WINDOW.value: "SlidingWindowManager.find_longest_cache_hit",
    GroupKind.CHUNKED_LOCAL_ATTENTION.value: "ChunkedLocalAttentionManager.find_longest_cache_hit",
    GroupKind.MAMBA.value: "MambaManager.find_longest_cache_hit",
    GroupKind.CIRCULAR_BUFFER.value: "CircularBufferManager.find_longest_cache_hit",
    # SinkFullAttentionManager inherits the full-attention lookup.
    GroupKind.SINK_FULL_ATTENTION.value: "FullAttentionManager.find_longest_cache_hit",
    GroupKind.RSWA.value: "RSWAManager.find_longest_cache_hit",
}
"""Manager family -> the vLLM function a root cause names
(``vllm/v1/core/single_type_kv_cache_manager.py``)."""

# Which group over-reached when several returned an over-hit: the ones whose
# lookup judges more than hashes first.
_OVER_REACH_ORDER = (
    GroupKind.MAMBA,
    GroupKind.SLIDING_WINDOW,
    GroupKind.CHUNKED_LOCAL_ATTENTION,
    GroupKind.FULL_ATTENTION,
)


def manager_family(kind: GroupKind) -> GroupKind:
    """The single-type manager a group kind runs on: MLA on the full-attention
    one, sliding-window MLA on the sliding-window one."""
    if kind.full_attention_family:
        return GroupKind.FULL_ATTENTION
    if kind.sliding_window_family:
        return GroupKind.SLIDING_WINDOW
    return kind


class Boundary(StrEnum):
    """Why a position is a checkpoint: the retained boundary it belongs to."""

    PERIODIC = "periodic"
    """``k * R``, the retention interval's checkpoints."""
    JUNCTION = "junction"
    """A shared-prefix junction an earlier request pinned."""
    REPLAY = "replay"
    """A replay boundary of an earlier request (``replay_boundaries``)."""
    DENSE = "dense"
    """Dense retention: every multiple of ``A`` (and the dense cross-check)."""
    START = "start"
    """Position 0."""
    OTHER = "other"
    """None of the above (a policy promise kvfuzz cannot name)."""


class Role(StrEnum):
    """How a finding relates to its root cause."""

    PRIMARY = "primary"
    """The most severe finding of its variant on its sibling."""
    FACET = "facet"
    """Another finding of the same sibling and cause."""
    CONSEQUENCE = "consequence"
    """A difference that follows from an earlier finding's different history."""


@dataclass(frozen=True, order=True)
class RootCause:
    """The identity of a finding's cause, stable across drafter, retention and scale.

    Attributes:
        family: ``shortfall``, ``variant-regression``, ``needless-drop``,
            ``over-hit``, ``crash``, ... (the cause's class).
        known_issue: the known vLLM issue that explains it, or ``""``.
        group_kind: the binding KV cache group's manager family
            (``full_attention``, ``sliding_window``, ``mamba``,
            ``chunked_local_attention``; ``untraced``), or ``""``; the text
            names its manager's ``find_longest_cache_hit``
            (:data:`MANAGER_FUNCTION`).
        branch: where that group's lookup stopped, for full attention
            (``prefix stopped``, ``prefix capped``); ``""`` otherwise.
        boundary: the boundary of the missing retained run (:class:`Boundary`).
        units_below: how many hit-alignment units ``A`` the owed checkpoint
            sits below that boundary (0 or 1 for every promise kvfuzz knows).
        detail: for other families, the distinguishing words (drafter class,
            exception type, ...).
    """

    family: str
    known_issue: str = ""
    group_kind: str = ""
    branch: str = ""
    boundary: str = ""
    units_below: int = 0
    detail: str = ""

    @property
    def text(self) -> str:
        """One line, e.g. ``shortfall |
        SlidingWindowManager.find_longest_cache_hit | missing periodic - 1A``
        (a known issue: ``shortfall | known:NAME``).
        """
        if self.known_issue:
            return f"{self.family} | known:{self.known_issue}"
        parts = [self.family]
        if self.group_kind:
            function = MANAGER_FUNCTION.get(self.group_kind, self.group_kind)
            parts.append(f"{function}: {self.branch}" if self.branch else function)
        if self.boundary:
            below = f" - {self.units_below}A" if self.units_below else ""
            parts.append(f"missing {self.boundary}{below}")
        if self.detail:
            parts.append(self.detail)
        return " | ".join(parts)

    @property
    def slug(self) -> str:
        """A file-name-safe, stable name: readable prefix plus a short hash."""
        readable = re.sub(r"[^a-z0-9]+", "-", self.family.lower()).strip("-")
        digest = hashlib.sha256(self.text.encode()).hexdigest()[:10]
        return f"{readable}-{digest}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (plus ``text``)."""
        return {
            "text": self.text,
            "family": self.family,
            "known_issue": self.known_issue,
            "group_kind": self.group_kind,
            "branch": self.branch,
            "boundary": self.boundary,
            "units_below": self.units_below,
            "detail": self.detail,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RootCause:
        """Inverse of :meth:`to_dict` (``text`` is ignored)."""
        return cls(
            family=data["family"],
            known_issue=data.get("known_issue", ""),
            group_kind=data.get("group_kind", ""),
            branch=data.get("branch", ""),
            boundary=data.get("boundary", ""),
            units_below=data.get("units_below", 0),
            detail=data.get("detail", ""),
        )


@dataclass(frozen=True)
class Triaged:
    """One finding with its root cause.

    Attributes:
        finding: the finding.
        root_cause: its root cause.
        role: primary, facet or consequence (:class:`Role`).
        owner: the variant it belongs to (the fixed side of a comparison).
        passes: how many times the binding group was looked up (the hybrid
            coordinator's fixed-point loop), 0 if not traced.
        divergence_units: ``ceil((D - expected) / A)``: how far below the
            divergence point the owed checkpoint sits, in hit-alignment units
            (``None`` when not a shortfall).
        cause_request: for a consequence, the earlier request it follows from.
    """

    finding: Finding
    root_cause: RootCause
    role: Role
    owner: str
    passes: int = 0
    divergence_units: int | None = None
    cause_request: int | None = None


def binding_lookup(
    request: RequestObservation,
) -> tuple[GroupLookup | None, int]:
    """The lookup call that bound ``request``'s hit, and how often its group was called.

    The first call (in call order) that returned the final hit: the
    coordinator's hit is the minimum over groups, and a later call that
    returns the same hit only confirms it.

    Returns:
        ``(call, passes)``; ``(None, 0)`` when no lookup was traced.
    """
    for call in request.lookup:
        if call.hit_tokens == request.hit_tokens:
            passes = sum(1 for c in request.lookup if c.group == call.group)
            return call, passes
    if request.lookup:
        # The coordinator trimmed below every group's own answer.
        lowest = min(request.lookup, key=lambda c: c.hit_tokens)
        return lowest, sum(1 for c in request.lookup if c.group == lowest.group)
    return None, 0


def over_reaching_lookup(scenario: Scenario, request: RequestObservation) -> GroupLookup | None:
    """The lookup whose group over-reached on an over-hit ``request``.

    Every group's last call accepted the final hit (the coordinator takes the
    minimum); of those, the group whose manager judges more than matching
    hashes (a state group, then a sliding window, then chunked local
    attention) is the one that let it through; full attention only when it
    alone returned the hit.

    Returns:
        The call, or ``None`` when no lookup was traced.
    """
    accepted = [
        c
        for c in request.lookup
        if c.hit_tokens == request.hit_tokens and c.group < len(scenario.kv_cache_groups)
    ]
    if not accepted:
        return binding_lookup(request)[0]

    def rank(call: GroupLookup) -> int:
        return _OVER_REACH_ORDER.index(manager_family(scenario.kv_cache_groups[call.group].kind))

    return min(accepted, key=rank)


def _branch(scenario: Scenario, call: GroupLookup) -> str:
    """The branch of a full-attention lookup (``FullAttentionManager.find_longest_cache_hit``):
    the prefix either ``stopped`` at an uncached block or was ``capped`` by the
    length; ``""`` for every other manager (see the module docstring)."""
    group = scenario.kv_cache_groups[call.group]
    if not group.kind.full_attention_family:
        return ""
    block = group.block_size_tokens
    drop = 1 if call.drop_eagle_block else 0
    alignment = scenario.effective_hit_alignment_tokens
    capped = max(0, call.max_length_tokens - drop * block) // alignment * alignment
    return "prefix capped" if call.hit_tokens >= capped else "prefix stopped"


def missing_checkpoint(
    scenario: Scenario,
    model: DrafterModel,
    run: RunObservation,
    request: int,
    expected_tokens: int,
    *,
    dense: bool = False,
) -> tuple[Boundary, int]:
    """Classify an owed checkpoint by the retained boundary that makes it one.

    Args:
        scenario: the scenario.
        model: the drafter's protection (for the writers' replay boundaries).
        run: the run the sibling was served in (its earlier junctions).
        request: the sibling's index.
        expected_tokens: the owed checkpoint, in tokens.
        dense: the owed hit comes from the dense reference.

    Returns:
        ``(boundary, units_below)``: periodic first, then junction, then
        replay, so a position that is several at once is named the same way
        at every scale.
    """
    alignment = scenario.effective_hit_alignment_tokens
    retention = scenario.retention_interval_tokens
    if dense or retention is None or retention == alignment:
        return Boundary.DENSE, 0
    if expected_tokens == 0:
        return Boundary.START, 0
    for units in (0, 1):
        b = expected_tokens + units * alignment
        if retention and b % retention == 0:
            return Boundary.PERIODIC, units
    junctions = {r.shared_prefix_boundary_tokens for r in run.requests[:request]} - {0}
    for units in (0, 1):
        if expected_tokens + units * alignment in junctions:
            return Boundary.JUNCTION, units
    replay: set[int] = set()
    for writer in range(min(request, len(scenario.requests))):
        replay.update(replay_boundaries(scenario, model, writer))
    for units in (0, 1):
        if expected_tokens + units * alignment in replay:
            return Boundary.REPLAY, units
    return Boundary.OTHER, 0


def _shortfall(
    scenario: Scenario,
    run: RunObservation | None,
    finding: Finding,
    *,
    family: str = "shortfall",
) -> tuple[RootCause, int, int | None]:
    """Root cause, passes and divergence units of a shortfall on ``run``."""
    if finding.known_issue:
        return RootCause(family, known_issue=finding.known_issue), 0, None
    request = finding.request
    alignment = scenario.effective_hit_alignment_tokens
    units: int | None = None
    if finding.expected_tokens is not None and finding.divergence_tokens is not None:
        units = -(-(finding.divergence_tokens - finding.expected_tokens) // alignment)
    if run is None or request is None or request >= len(run.requests):
        return RootCause(family, detail=finding.kind.value), 0, units
    call, passes = binding_lookup(run.requests[request])
    group_kind = branch = ""
    if call is not None and call.group < len(scenario.kv_cache_groups):
        # One root cause per manager code path: MLA runs on the full-attention
        # manager, sliding-window MLA on the sliding-window one.
        group_kind = manager_family(scenario.kv_cache_groups[call.group].kind).value
        branch = _branch(scenario, call)
    else:
        group_kind, branch = "untraced", ""
    boundary, below = (
        missing_checkpoint(
            scenario,
            drafter_model(scenario),
            run,
            request,
            finding.expected_tokens,
            dense=finding.kind is FindingKind.DENSE_MISMATCH,
        )
        if finding.expected_tokens is not None
        else (Boundary.OTHER, 0)
    )
    cause = RootCause(family, "", group_kind, branch, boundary.value, below)
    return cause, passes, units


def _history(run: RunObservation, upto: int) -> list[tuple[int, int]]:
    return [(r.hit_tokens, r.shared_prefix_boundary_tokens) for r in run.requests[:upto]]


def _crash_detail(finding: Finding) -> str:
    """The phase kind, the vLLM function that raised and the exception type
    of a crash, without numbers: ``lookup | SlidingWindowManager.find_longest_cache_hit:
    IndexError``. The driver's error reads ``request N: PHASE: CALL: TYPE:
    message [raised in FUNCTION (FILE)]``
    (:class:`differential.driver.features.VllmCallError`); without the
    ``raised in`` part the called function stands in."""
    text = finding.detail
    raised = re.search(r"\[raised in ([\w.<>]+)", text)
    text = re.sub(r" \[raised in [^\]]*\]$", "", text)
    text = re.sub(r"^request \d+: ", "", text)
    phase, _, rest = text.partition(": ")
    call, _, rest = rest.partition(": ")
    exc = rest.partition(":")[0].strip()
    if not exc:  # no call named: "PHASE: TYPE: message"
        call, exc = "", call
    where = raised.group(1) if raised else call
    phase = re.sub(r"\d+", "N", phase)
    return " | ".join(p for p in (phase, f"{where}: {exc}" if where else exc) if p)


def needless_protection(scenario: Scenario, run: RunObservation) -> bool:
    """Whether ``run`` protected a drafter whose KV needs no protection.

    True when vLLM's resolved settings drop the EAGLE block or use lookahead
    block hashes while the oracle's drafter model
    (:func:`differential.oracle.drafter_model`) needs neither (Gemma-4 MTP on
    stock 0.33.0: ``SpeculativeConfig.needs_eagle_block_drop``). Every
    shortfall on such a run follows from that protection.
    """
    settings = run.settings
    if settings is None:
        return False
    model = drafter_model(scenario)
    if model.drop or model.hash_lookahead_tokens:
        return False
    return settings.use_eagle_block_drop or settings.num_hash_lookahead_tokens > 0


def protected_as_run(scenario: Scenario, run: RunObservation) -> Scenario | None:
    """``scenario`` with a drafter the oracle protects as ``run`` protected it.

    A run that protects a drafter needing no protection (Gemma-4 MTP on stock
    vLLM 0.33.0) is judged by the oracle as if the drafter's KV needed the
    protection it got: single-module MTP with the drop (lookahead hashes
    off) when the run dropped, with one-token lookahead hashes when it used
    them (multi-module MTP for wider ones). Its shortfalls are then those of
    the run's own mechanism, not of the needless protection.

    Returns:
        The scenario so protected, or ``None`` when ``run`` protects no more
        than the drafter needs (or the scenario cannot be so described).
    """
    if not needless_protection(scenario, run) or run.settings is None:
        return None
    settings = run.settings
    tokens = max(1, scenario.drafter.num_speculative_tokens)
    if settings.use_eagle_block_drop:
        drafter = Drafter(DrafterKind.MTP, tokens)
        protection: dict[str, bool] = {"disable_lookahead_block_hashes": True}
    else:
        lookahead = settings.num_hash_lookahead_tokens
        drafter = (
            Drafter(DrafterKind.MTP, tokens)
            if lookahead == 1
            else Drafter(DrafterKind.MULTI_MODULE_MTP, lookahead)
        )
        protection = {"disable_lookahead_block_hashes": False, "kv_connector": False}
    try:
        as_run = dataclasses.replace(scenario, drafter=drafter, **protection)  # type: ignore[arg-type]
    except ScenarioError:
        return None
    model = drafter_model(as_run)
    if model.drop != settings.use_eagle_block_drop or (
        model.hash_lookahead_tokens != settings.num_hash_lookahead_tokens
    ):
        return None
    return as_run


def _own_shortfalls(
    scenario: Scenario, vr: VariantResult, policy: Policy
) -> tuple[Scenario | None, dict[tuple[FindingKind, int | None], Finding]]:
    """The shortfalls ``vr``'s run shows judged with the protection it used
    (:func:`protected_as_run`), labelled with known issues, by kind and request.

    Judged as the run was first judged
    (:func:`differential.oracle.engine.judge_observed_run`): a scheduler-mode
    run or a chat on its own timeline, where a turn that arrived while its
    source still ran is owed only what was cached when it looked up. The
    dense cross-check is made again as :func:`differential.compare.judge_variant`
    makes it (on the dense run, or on the run itself under dense retention),
    so a ``dense-mismatch`` the protection explains is its facet too.
    """
    as_run = protected_as_run(scenario, vr.run)
    if as_run is None or vr.run.error is not None:
        return None, {}
    _, findings = judge_observed_run(as_run, vr.run, policy)
    dense = _dense_run(as_run, vr)
    if dense is not None:
        findings += cross_check_dense(as_run, dense)
    labelled = label_known(as_run, findings, hits=vr.run.hits, order=vr.run.lookup_sequence)
    return as_run, {(f.kind, f.request): f for f in labelled if f.kind in _NEEDLESS_FACETS}


def _dense_run(scenario: Scenario, vr: VariantResult) -> RunObservation | None:
    """The run a ``dense-mismatch`` of ``vr`` was found on: its dense
    cross-check run, or, under dense retention, the run itself (sequential
    workloads only, as :func:`differential.compare.judge_variant`)."""
    if not scenario.workload.sequential:
        return None
    if vr.dense_run is not None:
        return vr.dense_run
    return vr.run if scenario.retention_interval_tokens is None else None


def _needless_cause(scenario: Scenario) -> RootCause:
    return RootCause("needless-protection", detail=f"drafter {scenario.drafter.kind.value}")


def _other_cause(scenario: Scenario, vr: VariantResult, finding: Finding) -> RootCause:
    """The root cause of a finding that is not a shortfall."""
    request = finding.request
    if finding.known_issue:
        return RootCause(finding.kind.value, known_issue=finding.known_issue)
    if finding.kind is FindingKind.CRASH:
        return RootCause("crash", detail=_crash_detail(finding))
    if finding.kind is FindingKind.PER_GROUP_HIT and request is not None:
        # One cause per manager family whose own lookup came up short, in the
        # judged run or else the dense cross-check run (whichever has it).
        wrong = None
        for run in (vr.run, vr.dense_run):
            if wrong is None and run is not None and request < len(run.requests):
                wrong = wrong_per_group_hit(
                    run.requests[request], scenario.effective_hit_alignment_tokens
                )
        if wrong is None:
            return RootCause("per-group-hit", group_kind="untraced")
        kind = manager_family(scenario.kv_cache_groups[wrong[0]].kind).value
        return RootCause("per-group-hit", group_kind=kind)
    if finding.kind is FindingKind.KV_EVENTS:
        # One cause per rule of the stream's contract the run breaks.
        return RootCause("kv-events", detail=kv_event_rule(finding))
    if finding.kind is FindingKind.OVER_HIT and request is not None:
        call = None
        if request < len(vr.run.requests):
            call = over_reaching_lookup(scenario, vr.run.requests[request])
        if call is None:
            return RootCause("over-hit", group_kind="untraced")
        kind = manager_family(scenario.kv_cache_groups[call.group].kind).value
        return RootCause("over-hit", group_kind=kind, branch=_branch(scenario, call))
    return RootCause(finding.kind.value)


def _variant_triage(scenario: Scenario, vr: VariantResult) -> list[Triaged]:
    """One variant's findings with their root causes, most severe first per sibling."""
    name = vr.variant.name
    # The needless drop first: it is the cause of the shortfalls it brings.
    findings = sorted(
        vr.findings, key=lambda f: (f.kind is not FindingKind.NEEDLESS_DROP, SEVERITY[f.kind])
    )
    needless = needless_protection(scenario, vr.run) or any(
        f.kind is FindingKind.NEEDLESS_DROP for f in findings
    )
    as_run, own = (
        _own_shortfalls(scenario, vr, findings[0].policy) if needless and findings else (None, {})
    )
    out: list[Triaged] = []
    primary_by_request: dict[int | None, RootCause] = {}
    for finding in findings:
        request = finding.request
        mine = own.get((finding.kind, request))
        if (
            as_run is not None
            and mine is not None
            and finding.kind in _NEEDLESS_FACETS
            and not finding.known_issue
            and request not in primary_by_request
        ):
            # Short even with the protection the run used: a cause of its own.
            judged_on = vr.run
            if finding.kind is FindingKind.DENSE_MISMATCH:
                judged_on = _dense_run(as_run, vr) or vr.run
            cause, passes, units = _shortfall(as_run, judged_on, mine)
            primary_by_request[request] = cause
            out.append(Triaged(finding, cause, Role.PRIMARY, name, passes, units))
            continue
        if finding.kind is FindingKind.NEEDLESS_DROP or (
            needless and finding.kind in _NEEDLESS_FACETS and not finding.known_issue
        ):
            cause = _needless_cause(scenario)
            role = Role.FACET if None in primary_by_request else Role.PRIMARY
            primary_by_request.setdefault(None, cause)
            primary_by_request.setdefault(request, cause)
            out.append(Triaged(finding, cause, role, name))
            continue
        seen = primary_by_request.get(request)
        if seen is not None and (
            finding.kind in _SHORTFALL or finding.kind is FindingKind.MISALIGNED
        ):
            out.append(Triaged(finding, seen, Role.FACET, name))
            continue
        if finding.kind in _SHORTFALL:
            run = vr.run
            if finding.kind is FindingKind.DENSE_MISMATCH:
                run = _dense_run(scenario, vr) or vr.run
            cause, passes, units = _shortfall(scenario, run, finding)
            primary_by_request[request] = cause
            out.append(Triaged(finding, cause, Role.PRIMARY, name, passes, units))
            continue
        cause = _other_cause(scenario, vr, finding)
        primary_by_request.setdefault(request, cause)
        out.append(Triaged(finding, cause, Role.PRIMARY, name))
    return out


def _parting_request(fixed: RunObservation, base: RunObservation, upto: int) -> int | None:
    """The first request before ``upto`` whose hit or junction differs, if any."""
    for k, (a, b) in enumerate(zip(_history(fixed, upto), _history(base, upto), strict=False)):
        if a != b:
            return k
    return None


def triage(result: ScenarioResult) -> tuple[Triaged, ...]:
    """Every finding of ``result`` with its root cause, role and owner.

    Per-variant findings first (each variant's, most severe first per
    sibling), then the comparison findings: a comparison finding whose
    variants' earlier requests parted (different hits or junctions) is a
    consequence of the finding at or before the parting request; one whose
    variants differ in protection because one protects needlessly is a
    consequence of that; one on a sibling the fixed variant has a finding on
    is a facet of it; the rest are root causes of their own.
    """
    scenario = result.scenario
    by_name = {vr.variant.name: vr for vr in result.results}
    out: list[Triaged] = []
    primaries: dict[tuple[str, int | None], RootCause] = {}
    for vr in result.results:
        for t in _variant_triage(scenario, vr):
            out.append(t)
            primaries.setdefault((vr.variant.name, t.finding.request), t.root_cause)
            if t.root_cause.family == "needless-protection":
                primaries.setdefault((vr.variant.name, None), t.root_cause)
        if needless_protection(scenario, vr.run):
            primaries.setdefault((vr.variant.name, None), _needless_cause(scenario))
    for finding in result.comparison_findings:
        fixed_name, _, base_name = finding.variant.partition(" vs ")
        owner = fixed_name
        request = finding.request
        fixed, base = by_name.get(fixed_name), by_name.get(base_name)
        if finding.known_issue:
            cause = RootCause(finding.kind.value, known_issue=finding.known_issue)
            out.append(Triaged(finding, cause, Role.PRIMARY, owner))
            continue
        if request is not None and fixed is not None and base is not None:
            part = _parting_request(fixed.run, base.run, request)
            if part is not None:
                earlier = [
                    (k, primaries[(n, k)])
                    for k in [*range(part, -1, -1), None]
                    for n in (base_name, fixed_name)
                    if (n, k) in primaries
                ]
                if earlier:
                    k, cause = earlier[0]
                    out.append(Triaged(finding, cause, Role.CONSEQUENCE, owner, cause_request=k))
                    continue
                cause = RootCause(finding.kind.value, detail="earlier histories differ")
                out.append(Triaged(finding, cause, Role.PRIMARY, owner, cause_request=part))
                continue
            own = primaries.get((fixed_name, request))
            if own is not None and finding.kind is FindingKind.VARIANT_REGRESSION:
                out.append(Triaged(finding, own, Role.FACET, owner))
                continue
            needless = primaries.get((base_name, None)) or primaries.get((fixed_name, None))
            if needless is not None and needless.family == "needless-protection":
                out.append(Triaged(finding, needless, Role.CONSEQUENCE, owner))
                continue
        if finding.kind is FindingKind.VARIANT_REGRESSION and fixed is not None:
            cause, passes, units = _shortfall(
                scenario, fixed.run, finding, family="variant-regression"
            )
            out.append(Triaged(finding, cause, Role.PRIMARY, owner, passes, units))
            continue
        detail = ""
        if finding.kind is FindingKind.VARIANT_DRIFT:
            detail = (
                "extra SWA blocks" if "extra SWA blocks" in finding.detail else "outside domain"
            )
        out.append(
            Triaged(finding, RootCause(finding.kind.value, detail=detail), Role.PRIMARY, owner)
        )
    return tuple(out)


def root_causes(results: Sequence[ScenarioResult]) -> dict[RootCause, list[Triaged]]:
    """Group the triaged findings of ``results`` by root cause, in first-seen order."""
    grouped: dict[RootCause, list[Triaged]] = {}
    for result in results:
        for t in triage(result):
            grouped.setdefault(t.root_cause, []).append(t)
    return grouped

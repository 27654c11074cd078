"""Run a scenario on several variants side by side and compare them.

For each variant: the scenario run, vLLM's own dense-retention run of the same
scenario (the oracle's cross-check), the oracle's verdicts. Across variants:
a variant carrying the fix must never hit less than one without it, must
agree exactly outside the fix's domain, and inside it may keep at most
``A / B_swa`` extra SWA blocks per retained boundary it widens (periodic
checkpoints for the seed PR; also replay boundaries and junctions for the
candidate). Each fixed-role variant's cost against each baseline is reported
(:class:`FixCost`).

The driver (and so vLLM) is imported on first use, not at import time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from differential.errors import ScenarioError
from differential.findings import Finding, FindingKind, Policy
from differential.observation import RequestObservation, RunObservation
from differential.oracle import (
    SiblingReference,
    cross_check_dense,
    divergence_points,
    model_from_settings,
    replay_boundaries,
)
from differential.oracle.engine import (
    collapse_applies,
    cross_check_modes,
    eviction_collapse,
    judge_observed_run,
    mode_cross_checkable,
    sequentially_judgeable,
)
from differential.oracle.known import label_fix_cost, label_known
from differential.oracle.layout import alignment_blowup, kv_cache_plan_findings
from differential.oracle.scheduling import async_cross_checkable, cross_check_scheduling
from differential.scenario import DrafterKind, DriveMode, GroupKind, Scenario
from differential.variants import FixScope, Variant, VariantRole

__all__ = [
    "FixCost",
    "ScenarioResult",
    "VariantResult",
    "compare_pair",
    "compare_results",
    "compare_variants",
    "in_fix_domain",
    "in_mode",
    "judge_variant",
    "synchronous",
]


@dataclass(frozen=True)
class VariantResult:
    """One variant's run of one scenario, judged.

    Attributes:
        variant: the variant.
        run: the run with the scenario's retention interval.
        dense_run: vLLM's run with retention ``None`` (the cross-check), or
            ``None`` when the scenario is already dense.
        references: what each request was owed.
        findings: the oracle's findings for this variant.
        elapsed_s: wall time of its runs (and the cross-check), in seconds.
        manager_run: (scheduler mode, sequential scenarios) the same scenario
            through the manager-level driver, for the mode cross-check.
        retention0_run: (scheduler mode, dense retention with a pool size
            and later turns) the same scenario with retention 0, for the
            eviction-collapse rule.
        sync_run: (scheduler mode, async scheduling with one-at-a-time
            arrivals) the same scenario with ``workload.async_scheduling``
            off, for the ``async-mismatch`` rule.
    """

    variant: Variant
    run: RunObservation
    dense_run: RunObservation | None
    references: tuple[SiblingReference, ...]
    findings: tuple[Finding, ...]
    elapsed_s: float = 0.0
    manager_run: RunObservation | None = None
    retention0_run: RunObservation | None = None
    sync_run: RunObservation | None = None


def _signed(values: Sequence[float]) -> str:
    """``+4``, ``-2``, ``0``, ``+0.33``; several joined by commas (none: ``0``)."""
    return ", ".join(f"{v:+g}" if v else "0" for v in values) or "0"


@dataclass(frozen=True)
class FixCost:
    """What a fixed-role variant keeps beyond a baseline, on one scenario.

    Counted over the requests where both hit the same (elsewhere the computed
    ranges differ and blocks are not comparable).

    Attributes:
        variant: the fixed-role variant.
        baseline: the baseline variant.
        extra_swa_blocks: extra SWA blocks kept, in blocks, one entry per
            sliding-window group (scenario order).
        retained_boundaries: retained boundaries (periodic checkpoint tails,
            replay boundaries, junctions) over the same requests.
    """

    variant: str
    baseline: str
    extra_swa_blocks: tuple[int, ...]
    retained_boundaries: int

    @property
    def per_boundary(self) -> tuple[float, ...]:
        """Extra SWA blocks per retained boundary, per SWA group, in blocks."""
        n = max(1, self.retained_boundaries)
        return tuple(round(x / n, 2) for x in self.extra_swa_blocks)

    def summary(self) -> str:
        """One line: ``fixed vs unfixed: +4 SWA blocks over 12 retained
        boundaries (+0.33 per boundary)``; signed (``-2``: the variant keeps
        fewer), one figure per SWA group (``+4, 0``) when there are several."""
        groups = len(self.extra_swa_blocks)
        each = " per SWA group" if groups > 1 else ""
        return (
            f"{self.variant} vs {self.baseline}: {_signed(self.extra_swa_blocks)} SWA blocks"
            f"{each} over {self.retained_boundaries} retained boundaries "
            f"({_signed(self.per_boundary)} per boundary)"
        )

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "variant": self.variant,
            "baseline": self.baseline,
            "extra_swa_blocks_per_group": list(self.extra_swa_blocks),
            "retained_boundaries": self.retained_boundaries,
            "extra_swa_blocks_per_boundary": list(self.per_boundary),
        }


@dataclass(frozen=True)
class ScenarioResult:
    """Everything kvfuzz learned about one scenario.

    Attributes:
        scenario: the scenario.
        source: the file it came from, if any.
        policy: the checkpoint policy that judged it.
        results: one per variant, in the order requested.
        comparison_findings: findings from comparing variants.
        notices: things the user should know that are not findings.
        costs: each fixed-role variant's extra SWA blocks against each baseline.
    """

    scenario: Scenario
    source: str | None
    policy: Policy
    results: tuple[VariantResult, ...]
    comparison_findings: tuple[Finding, ...] = ()
    notices: tuple[str, ...] = field(default=())
    costs: tuple[FixCost, ...] = field(default=())

    @property
    def findings(self) -> tuple[Finding, ...]:
        """Every finding, per-variant first, then comparisons."""
        return tuple(f for r in self.results for f in r.findings) + self.comparison_findings


def in_fix_domain(
    scenario: Scenario, unfixed: RunObservation, scope: FixScope = FixScope.SEED_PR
) -> bool:
    """Whether a fix of ``scope`` may change this scenario's behaviour.

    ``seed-pr``: true for the Gemma-4 MTP drafter (the fix stops its drop,
    which also changes whether lookahead hashes are used), and when the
    unfixed manager drops the last matched block with sparse periodic
    retention (positive and not equal to the hit alignment). ``one-unit``:
    also whenever retention is sparse (0, or positive and not the hit
    alignment) and the model has a sliding-window group, whatever the drafter.
    """
    if scenario.drafter.kind is DrafterKind.GEMMA4_MTP:
        return True  # the fix changes its drop, hence also its lookahead hashes
    retention = scenario.retention_interval_tokens
    alignment = scenario.effective_hit_alignment_tokens
    if scope is FixScope.ONE_UNIT:
        return (
            retention is not None
            and retention != alignment
            and bool(scenario.sliding_window_groups)
        )
    settings = unfixed.settings
    if settings is None or not settings.use_eagle_block_drop:
        return False
    return bool(retention) and retention != alignment


def _retained_boundaries(
    scenario: Scenario, base: RunObservation, fixed: RunObservation, request: int, window: int
) -> int:
    """Retained boundaries whose SWA tail ``request`` may have kept, for the cost bound.

    Periodic checkpoint tails overlapping the request's tokens
    (:func:`_periodic_tails`), plus, for the one-unit scope, its replay
    boundaries and the junction it pinned (two positions under the drop).
    """
    block = next(g.block_size_tokens for g in scenario.sliding_window_groups)
    tails = _periodic_tails(scenario, request, block, window)
    if base.settings is None:
        return tails
    model = model_from_settings(base.settings, len(scenario.kv_cache_groups))
    own = len(replay_boundaries(scenario, model, request))
    if fixed.requests[request].shared_prefix_boundary_tokens:
        own += 2 if model.drop else 1
    return tails + own


def _periodic_tails(scenario: Scenario, request: int, block: int, window: int) -> int:
    """Periodic checkpoints whose widened SWA tail overlaps the request's tokens.

    The tail for checkpoint ``c = k*R`` ends on the peek block past ``c`` and
    spans ``ceil((window - 1) / block) + 1 + A / block`` blocks under the fix.
    """
    retention = scenario.retention_interval_tokens or 0
    if retention <= 0:
        return 0
    alignment = scenario.effective_hit_alignment_tokens
    extent = scenario.requests[request].prompt_tokens + scenario.decode_steps
    tail_blocks = -(-(window - 1) // block) + 1 + alignment // block
    # Checkpoints c = k*R, k >= 1, with c + block - tail_blocks * block < extent,
    # counted in closed form (a window of 10^15 tokens must not loop 10^15 times).
    reach = extent - block + tail_blocks * block
    return max(0, (reach - 1) // retention)


def _widened_tail_fills_a_segment(scenario: Scenario, block: int, window: int) -> bool:
    """Whether a widened periodic tail spans a whole retention segment.

    The widened tail is ``ceil((window - 1) / block) + 1 + A / block``
    blocks; when that reaches ``R / block``, vLLM's own
    ``SlidingWindowManager.reachable_block_mask`` for the wider window
    returns ``None`` (every block reachable: keep them all), so the fix keeps
    every block of the group, including the one below the first tail that
    the EAGLE shift leaves out, and the per-tail bound does not apply.
    """
    retention = scenario.retention_interval_tokens or 0
    if retention <= 0:
        return False
    alignment = scenario.effective_hit_alignment_tokens
    tail_blocks = -(-(window - 1) // block) + 1 + alignment // block
    return tail_blocks >= retention // block


def pool_regression(base: RunObservation, fixed: RunObservation) -> Finding | None:
    """``pool-regression`` when, under pool pressure (evictions or preemptions
    in either run), ``fixed`` (a variant carrying a fix) hits fewer tokens over
    the whole workload than ``base`` at the same pool size.

    Totals are compared, not single requests: under concurrency a hit that
    comes earlier on one side moves the timing of every later lookup. The
    summary names the requests that lost, the pool and both variants' blocks
    cached per group over the run
    (:attr:`~differential.observation.RunObservation.newly_cached_blocks_per_group`;
    older observations: the per-request kept blocks, summed) and evictions.
    """
    if base.error is not None or fixed.error is not None:
        return None
    if not (base.evicted_blocks or fixed.evicted_blocks or base.preemptions or fixed.preemptions):
        return None
    total_b, total_f = sum(base.hits), sum(fixed.hits)
    if total_f >= total_b:
        return None
    lost = [
        b.index
        for b, f in zip(base.requests, fixed.requests, strict=False)
        if f.hit_tokens < b.hit_tokens
    ]

    def kept(run: RunObservation) -> list[int]:
        if run.newly_cached_blocks_per_group:
            return list(run.newly_cached_blocks_per_group)
        return [
            sum(col)
            for col in zip(*(r.retained_blocks_per_group for r in run.requests), strict=True)
        ]

    return Finding(
        FindingKind.POOL_REGRESSION,
        f"{fixed.variant} vs {base.variant}",
        None,
        f"pool {base.pool_blocks} blocks: {fixed.variant} hit {total_f} tokens in all, "
        f"{base.variant} {total_b}; lower on requests {lost}: hits {list(fixed.hits)} vs "
        f"{list(base.hits)}; blocks cached per group {kept(fixed)} vs {kept(base)}, evicted "
        f"{fixed.evicted_blocks} vs {base.evicted_blocks}",
        expected_tokens=total_b,
        hit_tokens=total_f,
    )


def compare_pair(
    scenario: Scenario,
    base: RunObservation,
    fixed: RunObservation,
    scope: FixScope = FixScope.SEED_PR,
) -> list[Finding]:
    """Compare a run of a variant carrying a fix of ``scope`` with a run of one without it.

    Returns ``variant-regression`` findings where ``fixed`` hits less than
    ``base``, and ``variant-drift`` findings where, outside the fix's domain
    (:func:`in_fix_domain`), hits or retained blocks differ, or where, inside
    it, ``fixed`` keeps more than ``A / B_swa`` extra SWA blocks per boundary
    it widens (periodic checkpoint tails for ``seed-pr``; also the request's
    replay boundaries and junction for ``one-unit``).
    """
    pair = f"{fixed.variant} vs {base.variant}"
    findings: list[Finding] = []
    domain = in_fix_domain(scenario, base, scope)
    alignment = scenario.effective_hit_alignment_tokens
    swa = [
        (gi, g.block_size_tokens, g.sliding_window_tokens or 0)
        for gi, g in enumerate(scenario.kv_cache_groups)
        if g.kind.sliding_window_family
    ]
    divergence = divergence_points(scenario)
    for b, f in zip(base.requests, fixed.requests, strict=False):
        if f.hit_tokens < b.hit_tokens:
            history = ""
            pinned_b = [r.shared_prefix_boundary_tokens for r in base.requests[: b.index]]
            pinned_f = [r.shared_prefix_boundary_tokens for r in fixed.requests[: b.index]]
            if pinned_b != pinned_f:
                history = (
                    f"; the histories differ: earlier requests pinned junctions "
                    f"{pinned_b} on {base.variant} and {pinned_f} on {fixed.variant}"
                )
            findings.append(
                Finding(
                    FindingKind.VARIANT_REGRESSION,
                    pair,
                    b.index,
                    f"{fixed.variant} hit {f.hit_tokens} < {base.variant} "
                    f"hit {b.hit_tokens}{history}",
                    divergence_tokens=divergence[b.index],
                    expected_tokens=b.hit_tokens,
                    hit_tokens=f.hit_tokens,
                )
            )
        if not domain:
            if (f.hit_tokens, f.retained_blocks_per_group) != (
                b.hit_tokens,
                b.retained_blocks_per_group,
            ):
                findings.append(
                    Finding(
                        FindingKind.VARIANT_DRIFT,
                        pair,
                        b.index,
                        f"outside the fix's domain the variants must agree: hits "
                        f"{f.hit_tokens} vs {b.hit_tokens}, retained blocks per group "
                        f"{list(f.retained_blocks_per_group)} vs "
                        f"{list(b.retained_blocks_per_group)}",
                        divergence_tokens=divergence[b.index],
                        expected_tokens=b.hit_tokens,
                        hit_tokens=f.hit_tokens,
                    )
                )
            continue
        if scenario.drafter.kind is DrafterKind.GEMMA4_MTP or f.hit_tokens != b.hit_tokens:
            continue  # different computed ranges: no per-request cost bound
        for gi, block, window in swa:
            if scope is FixScope.ONE_UNIT:
                tails = _retained_boundaries(scenario, base, fixed, b.index, window)
                what = "retained boundary"
            else:
                tails = _periodic_tails(scenario, b.index, block, window)
                what = "periodic checkpoint tail"
            extra = f.retained_blocks_per_group[gi] - b.retained_blocks_per_group[gi]
            allowed = alignment // block * tails
            if _widened_tail_fills_a_segment(scenario, block, window):
                continue  # vLLM's own mask keeps every block of the group
            if extra > allowed:
                findings.append(
                    Finding(
                        FindingKind.VARIANT_DRIFT,
                        pair,
                        b.index,
                        f"group {gi} keeps {extra} extra SWA blocks; the fix claims at "
                        f"most {alignment // block} per {what} x {tails} = {allowed}",
                        divergence_tokens=divergence[b.index],
                    )
                )
    return findings


def fix_cost(scenario: Scenario, base: RunObservation, fixed: RunObservation) -> FixCost:
    """Extra SWA blocks ``fixed`` kept beyond ``base``, per SWA group, and the
    retained boundaries they were spread over (requests with equal hits only)."""
    swa = [
        (gi, g.sliding_window_tokens or 0)
        for gi, g in enumerate(scenario.kv_cache_groups)
        if g.kind.sliding_window_family
    ]
    extra = [0] * len(swa)
    boundaries = 0
    for b, f in zip(base.requests, fixed.requests, strict=False):
        if b.hit_tokens != f.hit_tokens:
            continue
        for k, (gi, _window) in enumerate(swa):
            extra[k] += f.retained_blocks_per_group[gi] - b.retained_blocks_per_group[gi]
        if swa:
            boundaries += _retained_boundaries(scenario, base, fixed, b.index, swa[0][1])
    return FixCost(fixed.variant, base.variant, tuple(extra), boundaries)


def run_any(
    scenario: Scenario, variant: Variant, *, dense: bool = False, record_cache_map: bool = False
) -> RunObservation:
    """Run ``variant``: in this process, or in its tree's worker process.

    Both drive the scenario's own mode (``workload.mode``: vLLM's
    ``KVCacheManager`` or its ``Scheduler``) with the same driver code, so an
    unmutated tree of the installed vLLM observes exactly what the in-process
    ``unfixed`` variant does.
    """
    if variant.tree is not None:
        from differential.variants.tree import run_tree

        return run_tree(
            variant.name,
            Path(variant.tree),
            scenario,
            dense=dense,
            record_cache_map=record_cache_map,
            timeout_s=variant.timeout_s,
        )
    from differential.driver import run_variant

    return run_variant(scenario, variant, dense=dense, record_cache_map=record_cache_map)


class StockRuns:
    """Runs the installed vLLM makes exactly as some variant of a comparison
    does, made once per comparison, and their dense cross-checks, judged once.

    ``runs``: ``(dense cross-check?, scenario)`` -> the run.
    """

    def __init__(self) -> None:
        self.runs: dict[tuple[bool, Scenario], RunObservation] = {}
        # scenario -> the cross-check's findings of its stock dense run
        self._dense_findings: dict[Scenario, tuple[Finding, ...]] = {}

    def cross_check_dense(
        self, judged: Scenario, scenario: Scenario, dense_run: RunObservation
    ) -> tuple[Finding, ...]:
        """:func:`~differential.oracle.cross_check_dense` of ``dense_run`` on
        ``judged``. Where ``dense_run`` is the stock dense run of ``scenario``
        (under any variant's name) it is judged once: every finding names
        the run's variant and nothing else does (its rules read the run's
        hits, blocks and events), so another variant's findings are the same
        under its name."""
        stock = self.runs.get((True, scenario))
        if stock is None or judged is not scenario or dense_run.requests is not stock.requests:
            return cross_check_dense(judged, dense_run)
        findings = self._dense_findings.get(scenario)
        if findings is None:
            findings = self._dense_findings[scenario] = cross_check_dense(judged, stock)
        if stock.variant == dense_run.variant:
            return findings
        return tuple(dataclasses.replace(f, variant=dense_run.variant) for f in findings)


def _run_shared(
    scenario: Scenario, variant: Variant, stock_runs: StockRuns | None, *, dense: bool = False
) -> RunObservation:
    """:func:`run_any`, or, where ``variant`` runs ``scenario`` exactly as the
    installed vLLM does (:func:`differential.driver.runs_as_stock`: ``fixed``'s
    dense cross-check of a drafter other than Gemma-4 MTP, or its run of a
    scenario vLLM gives no EAGLE drop, for example), the
    stock run another variant of the same comparison already made, under
    this variant's name."""
    from differential.driver import runs_as_stock

    if stock_runs is None or not runs_as_stock(scenario, variant, dense=dense):
        return run_any(scenario, variant, dense=dense)
    key = (dense, scenario)
    run = stock_runs.runs.get(key)
    if run is None:
        run = stock_runs.runs[key] = run_any(scenario, variant, dense=dense)
    return run if run.variant == variant.name else dataclasses.replace(run, variant=variant.name)


def compare_unlabelled(scenario: Scenario, a: VariantResult, b: VariantResult) -> list[Finding]:
    """Compare two variants neither of which is labelled fixed.

    Every sibling where the hits differ is a ``disagreement`` saying which
    side the oracle supports (the one without findings on that request); so
    is one whose hits agree but whose KV connector store started it with
    other local and external tokens, or held another prefix of it
    (:func:`_connector_difference`); where the hits agree but the blocks kept
    differ, a ``cost-change``. Both give the
    blocks each side kept per group and per periodic checkpoint tail. For a
    scenario with a model, a ``kv-cache-plan`` (no request) when the two
    vLLMs planned its ``KVCacheConfig`` otherwise
    (:meth:`~differential.observation.KVCachePlan.difference`): the groups,
    block sizes, ``num_blocks`` or tensors of
    vllm/v1/core/kv_cache_planning.py's ``get_kv_cache_configs``, which the
    oracle judges from first principles only for layer-outer layouts.
    """
    pair = f"{a.variant.name} vs {b.variant.name}"
    divergence = divergence_points(scenario)
    flagged = {
        name: {f.request for f in r.findings if f.request is not None}
        for name, r in ((a.variant.name, a), (b.variant.name, b))
    }
    findings: list[Finding] = []
    for ra, rb in zip(a.run.requests, b.run.requests, strict=False):
        j = ra.index
        tails = max(
            1,
            max(
                (
                    _periodic_tails(scenario, j, g.block_size_tokens, g.sliding_window_tokens or 0)
                    for g in scenario.sliding_window_groups
                ),
                default=1,
            ),
        )
        per_tail = [
            (x - y) / tails
            for x, y in zip(ra.retained_blocks_per_group, rb.retained_blocks_per_group, strict=True)
        ]
        cost = (
            f"blocks kept per group {list(ra.retained_blocks_per_group)} on {a.variant.name}, "
            f"{list(rb.retained_blocks_per_group)} on {b.variant.name} "
            f"(difference per periodic checkpoint tail: {per_tail})"
        )
        if ra.hit_tokens != rb.hit_tokens:
            bad_a = j in flagged[a.variant.name]
            bad_b = j in flagged[b.variant.name]
            if bad_a == bad_b:
                blame = "the oracle flags both" if bad_a else "the oracle accepts both"
            else:
                good, bad = (b, a) if bad_a else (a, b)
                blame = f"the oracle supports {good.variant.name} and blames {bad.variant.name}"
            findings.append(
                Finding(
                    FindingKind.DISAGREEMENT,
                    pair,
                    j,
                    f"hits {ra.hit_tokens} on {a.variant.name} vs {rb.hit_tokens} on "
                    f"{b.variant.name}; {blame}; {cost}",
                    divergence_tokens=divergence[j],
                    expected_tokens=ra.hit_tokens,
                    hit_tokens=rb.hit_tokens,
                )
            )
        elif (store := _connector_difference(ra, rb, a.variant.name, b.variant.name)) is not None:
            findings.append(
                Finding(
                    FindingKind.DISAGREEMENT,
                    pair,
                    j,
                    f"same local hit {ra.hit_tokens}; {store}",
                    divergence_tokens=divergence[j],
                )
            )
        elif ra.retained_blocks_per_group != rb.retained_blocks_per_group:
            findings.append(
                Finding(
                    FindingKind.COST_CHANGE,
                    pair,
                    j,
                    f"same hit {ra.hit_tokens}; {cost}",
                    divergence_tokens=divergence[j],
                )
            )
    plan_a, plan_b = a.run.kv_cache_plan, b.run.kv_cache_plan
    if plan_a is not None and plan_b is not None and scenario.model is not None:
        change = plan_a.difference(plan_b)
        if change is not None:
            findings.append(
                Finding(
                    FindingKind.KV_CACHE_PLAN,
                    pair,
                    None,
                    f"model {scenario.model.name!r} planned otherwise for a pool of "
                    f"{plan_a.pool_blocks} blocks ({a.variant.name} vs {b.variant.name}): "
                    f"{change}",
                )
            )
    return findings


def _connector_difference(
    a: RequestObservation, b: RequestObservation, name_a: str, name_b: str
) -> str | None:
    """What a KV connector's remote store did differently for one request on
    two variants (``workload.connector``): the tokens it started with, local
    and external (what vLLM adopted, ``KVCacheManager.allocate_slots``), or
    what the store held, i.e. what vLLM had handed the connector (saved
    blocks, Mamba boundary states, partial tails); ``None`` when equal or
    not recorded."""
    ca, cb = a.connector, b.connector
    if ca is None or cb is None:
        return None
    if (ca.local_tokens, ca.external_tokens) != (cb.local_tokens, cb.external_tokens):
        return (
            f"computed tokens {ca.local_tokens} local + {ca.external_tokens} external on "
            f"{name_a} vs {cb.local_tokens} + {cb.external_tokens} on {name_b}"
        )
    if ca.store_tokens != cb.store_tokens:
        return (
            f"the connector's store held {ca.store_tokens} tokens of it on {name_a} vs "
            f"{cb.store_tokens} on {name_b} (what vLLM handed the connector differs)"
        )
    return None


def in_mode(scenario: Scenario, mode: DriveMode) -> Scenario:
    """``scenario`` driven in ``mode`` (the workload's other fields kept).

    vLLM's ``Scheduler`` ends a Mamba prefill chunk where its own
    ``_mamba_block_aligned_split`` says (``vllm/v1/core/sched/scheduler.py``),
    so in scheduler mode a block-carved Mamba prefill (``mamba_prefill:
    block``, manager mode's stand-in) becomes ``scheduler``, as it does in a
    file written for scheduler mode (the scenario model turns it:
    :attr:`Scenario.mamba_prefill`): the oracle then judges the chunks the
    run really had.

    Raises:
        ScenarioError: manager mode for a workload only the scheduler runs
            (arrivals or drafts), naming ``workload.mode``.
    """
    if scenario.workload.mode is mode:
        return scenario
    return dataclasses.replace(scenario, workload=dataclasses.replace(scenario.workload, mode=mode))


def synchronous(scenario: Scenario) -> Scenario:
    """``scenario`` with ``workload.async_scheduling`` off: vLLM's
    synchronous ``Scheduler``, each step's output applied before the next
    ``schedule()`` (the control run of the ``async-mismatch`` rule)."""
    if not scenario.workload.async_scheduling:
        return scenario
    return dataclasses.replace(
        scenario, workload=dataclasses.replace(scenario.workload, async_scheduling=False)
    )


def no_partial_hits_reason(scenario: Scenario) -> str:
    """Why vLLM serves no partial (hash-block) hits for ``scenario``'s layout.

    The conditions of ``partial_hash_hits_enabled`` (vllm/v1/core/kv_cache_utils.py)
    and ``UnitaryKVCacheCoordinator`` (vllm/v1/core/kv_cache_coordinator.py),
    the first that fails; when the layout meets them all, the running vLLM
    turned them off itself (``KVCacheCoordinator.enable_partial_hash_hits``).
    """
    hash_block = scenario.effective_hash_block_size_tokens
    mamba = scenario.mamba_groups
    if not mamba:
        return "no Mamba group in align mode"
    if len(scenario.kv_cache_groups) < 2:
        return "one KV cache group: UnitaryKVCacheCoordinator serves none"
    if not any(g.block_size_tokens > hash_block for g in mamba):
        return (
            f"the Mamba block, {mamba[0].block_size_tokens} tokens, is not larger than "
            "the hash block"
        )
    for g in scenario.kv_cache_groups:
        if not (
            g.kind.full_attention_family
            or g.kind is GroupKind.MAMBA
            or g.block_size_tokens == hash_block
        ):
            return (
                f"the {g.kind.value} group of block {g.block_size_tokens} tokens needs "
                "block-aligned lookups, as its manager in "
                "vllm/v1/core/single_type_kv_cache_manager.py supports no fine-grained ones"
            )
    return (
        "this vLLM keeps KVCacheCoordinator.enable_partial_hash_hits off for the layout "
        "(vllm/v1/core/kv_cache_coordinator.py)"
    )


def _plan_findings(scenario: Scenario, run: RunObservation, policy: Policy) -> tuple[Finding, ...]:
    """What the KV cache plan a model-level scenario's run made owes
    (:func:`differential.oracle.layout.kv_cache_plan_findings`), under ``policy``."""
    return tuple(
        dataclasses.replace(f, policy=policy) for f in kv_cache_plan_findings(scenario, run)
    )


def judge_variant(
    scenario: Scenario,
    variant: Variant,
    *,
    policy: Policy = Policy.VLLM,
    dense_cross_check: bool = True,
    stock_runs: StockRuns | None = None,
) -> tuple[VariantResult, tuple[str, ...]]:
    """Run ``scenario`` on one variant and judge it on its own.

    The per-variant half of :func:`compare_variants`: its runs (the scenario,
    the dense cross-check, the scheduler-mode cross-checks) and its findings;
    nothing compared with another variant. A variant's result does not depend
    on the other variants, so a caller comparing many variants with one
    baseline (``kvfuzz mutate``) judges the baseline once and reuses it with
    :func:`compare_results`. ``stock_runs``, shared by the variants of one
    comparison, holds the runs the installed vLLM makes exactly as one of
    them does, so each is made once (:func:`_run_shared`).

    Returns:
        ``(result, notices)``: notices the user should know (an unsupported
        run, an effective hash block size other than the scenario's).

    Raises:
        InternalError: kvfuzz's driver failed (in this process or in a
            tree's worker).
    """
    notices: list[str] = []
    started = time.perf_counter()
    run = _run_shared(scenario, variant, stock_runs)
    if run.unsupported is not None:
        notices.append(f"{variant.name}: unsupported: {run.unsupported}")
    if run.settings is not None:
        note = run.settings.effective_hash_note(
            scenario.hash_block_size_tokens, no_partial_hits_reason(scenario)
        )
        if note is not None:
            notices.append(note)
    # A tree of an older release judges the scenario it means there.
    judged = scenario
    if variant.tree is not None:
        from differential.variants.tree import scenario_as_run

        judged = scenario_as_run(variant.name, scenario)
    engine = scenario.workload.mode is DriveMode.SCHEDULER
    refs, findings = judge_observed_run(judged, run, policy)
    findings += _plan_findings(judged, run, policy)
    dense_run = None
    # A turn copying an earlier answer (shares_output) is cross-checked too:
    # the dense reference counts the decoded blocks its source cached.
    if dense_cross_check and scenario.workload.sequential:
        if scenario.retention_interval_tokens is None:
            findings += cross_check_dense(judged, run)
        else:
            dense_run = _run_shared(scenario, variant, stock_runs, dense=True)
            findings += (
                cross_check_dense(judged, dense_run)
                if stock_runs is None
                else stock_runs.cross_check_dense(judged, scenario, dense_run)
            )
    manager_run = retention0_run = None
    if engine and mode_cross_checkable(scenario):
        try:
            manager_run = _run_shared(in_mode(scenario, DriveMode.MANAGER), variant, stock_runs)
        except ScenarioError:
            # The manager-level driver does not preempt: a pool the
            # Scheduler copes with can be too small for it, and then
            # there is no replica to compare.
            manager_run = None
        if manager_run is not None:
            findings += cross_check_modes(scenario, run, manager_run)
    if engine and collapse_applies(scenario):
        retention0_run = _run_shared(
            dataclasses.replace(scenario, retention_interval_tokens=0), variant, stock_runs
        )
        collapse = eviction_collapse(scenario, run, retention0_run)
        if collapse is not None:
            findings += (dataclasses.replace(collapse, policy=policy),)
    sync_run = None
    if engine and async_cross_checkable(scenario):
        sync_run = _run_shared(synchronous(scenario), variant, stock_runs)
        findings += cross_check_scheduling(judged, run, sync_run, policy)
    findings = label_known(judged, findings, hits=run.hits, order=run.lookup_sequence)
    result = VariantResult(
        variant,
        run,
        dense_run,
        refs,
        findings,
        time.perf_counter() - started,
        manager_run=manager_run,
        retention0_run=retention0_run,
        sync_run=sync_run,
    )
    return result, tuple(notices)


def compare_variants(
    scenario: Scenario,
    variants: Sequence[Variant],
    *,
    policy: Policy = Policy.VLLM,
    source: str | None = None,
    dense_cross_check: bool = True,
) -> ScenarioResult:
    """Run ``scenario`` on every variant, judge each, and compare them.

    Args:
        scenario: the scenario.
        variants: the variants, in report order.
        policy: the checkpoint policy the oracle judges with.
        source: the file the scenario came from, for reports.
        dense_cross_check: also run each variant with retention ``None`` and
            compare it with the oracle's dense reference.

    Raises:
        ScenarioError: bad input only running could show (a pool too small for
            a request), naming ``source``.
    """
    try:
        return _compare_variants(scenario, variants, policy, source, dense_cross_check)
    except ScenarioError as exc:
        if source is None or exc.source is not None:
            raise
        raise exc.with_source(source) from None


def _compare_variants(
    scenario: Scenario,
    variants: Sequence[Variant],
    policy: Policy,
    source: str | None,
    dense_cross_check: bool,
) -> ScenarioResult:
    results: list[VariantResult] = []
    notices: list[str] = []
    stock_runs = StockRuns()
    for variant in variants:
        result, notes = judge_variant(
            scenario,
            variant,
            policy=policy,
            dense_cross_check=dense_cross_check,
            stock_runs=stock_runs,
        )
        results.append(result)
        notices += notes
    return compare_results(scenario, results, policy=policy, source=source, notices=notices)


def compare_results(
    scenario: Scenario,
    results: Sequence[VariantResult],
    *,
    policy: Policy = Policy.VLLM,
    source: str | None = None,
    notices: Sequence[str] = (),
) -> ScenarioResult:
    """Compare variants already judged by :func:`judge_variant` (the second
    half of :func:`compare_variants`, which it gives exactly).

    Args:
        scenario: the scenario the results ran.
        results: one per variant, in report order.
        policy: the checkpoint policy the results were judged with.
        source: the file the scenario came from, for reports.
        notices: the variants' notices (duplicates are dropped).
    """
    results = list(results)
    notices = list(dict.fromkeys(notices))
    comparison: list[Finding] = []
    blowup = alignment_blowup(scenario)
    if blowup is not None:
        comparison += label_known(scenario, [blowup])
    costs: list[FixCost] = []
    # Runs through the scheduler with evictions, concurrency or answer-sharing
    # turns keep blocks for reasons the fix's claims do not cover: compared
    # per variant by the engine oracle only.
    supported = [
        r
        for r in results
        if r.run.unsupported is None
        and (r.run.mode != "scheduler" or sequentially_judgeable(scenario, r.run))
    ]
    for fixed in supported:
        if fixed.variant.role is not VariantRole.FIXED:
            continue
        for base in supported:
            if base.variant.role is VariantRole.BASELINE:
                comparison += compare_pair(scenario, base.run, fixed.run, fixed.variant.fix_scope)
                retention = scenario.retention_interval_tokens
                sparse = retention is not None and retention != (
                    scenario.effective_hit_alignment_tokens
                )
                if sparse and scenario.sliding_window_groups and base.run.error is None:
                    costs.append(fix_cost(scenario, base.run, fixed.run))
    pressed = [
        r
        for r in results
        if r.run.unsupported is None
        and r.run.mode == "scheduler"
        and not sequentially_judgeable(scenario, r.run)
    ]
    for fixed in pressed:
        if fixed.variant.role is not VariantRole.FIXED:
            continue
        for base in pressed:
            if base.variant.role is VariantRole.BASELINE:
                regression = pool_regression(base.run, fixed.run)
                if regression is not None:
                    # The candidate's extra tails cost pool space: its known price.
                    comparison += label_fix_cost(scenario, [regression], fixed.variant.fix_scope)
    if not any(r.variant.role is VariantRole.FIXED for r in supported):
        # Two baselines (a pull request's base and head, one release and the
        # next, stock and a mutant) are compared on every run, those the
        # oracle judges only per variant included: a run through the
        # scheduler with concurrency, drafts, evictions or a KV connector's
        # store is deterministic, so a sibling's hit, what the store started
        # it with or held, or the blocks it kept that differ are a change of
        # behaviour even where the oracle owes neither side.
        baselines = [
            r
            for r in results
            if r.run.unsupported is None and r.variant.role is VariantRole.BASELINE
        ]
        for i, a in enumerate(baselines):
            for b in baselines[i + 1 :]:
                comparison += compare_unlabelled(scenario, a, b)
    return ScenarioResult(
        scenario=scenario,
        source=source,
        policy=policy,
        results=tuple(results),
        comparison_findings=tuple(comparison),
        notices=tuple(notices),
        costs=tuple(costs),
    )

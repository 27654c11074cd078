"""Run a scenario on several variants side by side and compare them.

For each variant: the scenario run, vLLM's own dense-retention run of the same
scenario (the oracle's cross-check), the oracle's verdicts. Across variants:
a variant carrying the fix must never hit less than one without it, must
agree exactly outside the fix's domain, and inside it may keep at most
``A / B_swa`` extra SWA blocks per periodic checkpoint.

The driver (and so vLLM) is imported on first use, not at import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from differential.findings import Finding, FindingKind, Policy
from differential.known import label_known
from differential.observation import RunObservation
from differential.oracle import (
    SiblingReference,
    cross_check_dense,
    divergence_points,
    judge_run,
)
from differential.scenario import DrafterKind, GroupKind, Scenario
from differential.variants import Variant, VariantRole

__all__ = [
    "ScenarioResult",
    "VariantResult",
    "compare_pair",
    "compare_variants",
    "in_fix_domain",
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
    """

    variant: Variant
    run: RunObservation
    dense_run: RunObservation | None
    references: tuple[SiblingReference, ...]
    findings: tuple[Finding, ...]


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
    """

    scenario: Scenario
    source: str | None
    policy: Policy
    results: tuple[VariantResult, ...]
    comparison_findings: tuple[Finding, ...] = ()
    notices: tuple[str, ...] = field(default=())

    @property
    def findings(self) -> tuple[Finding, ...]:
        """Every finding, per-variant first, then comparisons."""
        return tuple(f for r in self.results for f in r.findings) + self.comparison_findings


def in_fix_domain(scenario: Scenario, unfixed: RunObservation) -> bool:
    """Whether the seed fix may change this scenario's behaviour.

    True for the Gemma-4 MTP drafter (the fix stops its drop, which also
    changes whether lookahead hashes are used), and when the unfixed manager
    drops the last matched block with sparse retention (positive and not
    equal to the hit alignment).
    """
    if scenario.drafter.kind is DrafterKind.GEMMA4_MTP:
        return True  # the fix changes its drop, hence also its lookahead hashes
    settings = unfixed.settings
    if settings is None or not settings.use_eagle_block_drop:
        return False
    retention = scenario.retention_interval_tokens
    return bool(retention) and retention != scenario.effective_hit_alignment_tokens


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
    count, c = 0, retention
    while c + block - tail_blocks * block < extent:
        count += 1
        c += retention
    return count


def compare_pair(scenario: Scenario, base: RunObservation, fixed: RunObservation) -> list[Finding]:
    """Compare a run of a variant carrying the fix with a run of one without it.

    Returns ``variant-regression`` findings where ``fixed`` hits less than
    ``base``, and ``variant-drift`` findings where, outside the fix's domain
    (:func:`in_fix_domain`), hits or retained blocks differ, or where, inside
    it, ``fixed`` keeps more than ``A / B_swa`` extra SWA blocks per periodic
    checkpoint.
    """
    pair = f"{fixed.variant} vs {base.variant}"
    findings: list[Finding] = []
    domain = in_fix_domain(scenario, base)
    alignment = scenario.effective_hit_alignment_tokens
    swa = [
        (gi, g.block_size_tokens, g.sliding_window_tokens or 0)
        for gi, g in enumerate(scenario.kv_cache_groups)
        if g.kind is GroupKind.SLIDING_WINDOW
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
            tails = _periodic_tails(scenario, b.index, block, window)
            extra = f.retained_blocks_per_group[gi] - b.retained_blocks_per_group[gi]
            allowed = alignment // block * tails
            if extra > allowed:
                findings.append(
                    Finding(
                        FindingKind.VARIANT_DRIFT,
                        pair,
                        b.index,
                        f"group {gi} keeps {extra} extra SWA blocks; the fix claims at "
                        f"most {alignment // block} per periodic checkpoint tail x "
                        f"{tails} tails = {allowed}",
                        divergence_tokens=divergence[b.index],
                    )
                )
    return findings


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
    """
    from differential.driver import run_variant

    results: list[VariantResult] = []
    for variant in variants:
        run = run_variant(scenario, variant)
        refs, findings = judge_run(scenario, run, policy)
        dense_run = None
        if dense_cross_check:
            if scenario.retention_interval_tokens is None:
                findings += cross_check_dense(scenario, run)
            else:
                dense_run = run_variant(scenario, variant, dense=True)
                findings += cross_check_dense(scenario, dense_run)
        findings = label_known(scenario, findings)
        results.append(VariantResult(variant, run, dense_run, refs, findings))
    comparison: list[Finding] = []
    for fixed in results:
        if fixed.variant.role is not VariantRole.FIXED:
            continue
        for base in results:
            if base.variant.role is VariantRole.BASELINE:
                comparison += compare_pair(scenario, base.run, fixed.run)
    return ScenarioResult(
        scenario=scenario,
        source=source,
        policy=policy,
        results=tuple(results),
        comparison_findings=tuple(comparison),
    )

"""Render scenario results as a readable table or as versioned JSON."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from differential.compare import ScenarioResult
from differential.errors import InternalError, printable, short_text
from differential.findings import FIX_COMPARISONS, Finding, Policy
from differential.observation import RequestObservation, RunObservation
from differential.scenario import Scenario

__all__ = [
    "REPORT_FORMAT",
    "NotStarted",
    "connector_summary",
    "engine_figures",
    "engine_summary",
    "printable",
    "render_json",
    "render_text",
    "summary_counts",
]


@dataclass
class NotStarted:
    """A variant whose worker could not start, and the scenarios it did not run.

    Attributes:
        variant: the variant (``tree:...``, ``release:...``).
        reason: the worker's failure, as
            :class:`~differential.variants.tree.WorkerStartFailed` said it.
        scenarios: the scenarios it would have run (files or labels), in order.
    """

    variant: str
    reason: str
    scenarios: list[str] = field(default_factory=list)

    def short_reason(self) -> str:
        """The reason on one line, without the worker's stderr."""
        head = self.reason.split("; its stderr ends with")[0]
        return printable(" ".join(head.removeprefix(f"{self.variant}: ").split()))

    def line(self) -> str:
        """The report's line for it."""
        shown = ", ".join(self.scenarios[:3]) + (", ..." if len(self.scenarios) > 3 else "")
        return (
            f"! {self.variant} could not start; it would have run {len(self.scenarios)} "
            f"scenario(s) ({printable(shown)}): {self.short_reason()}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (a report's ``not_started``)."""
        return {"variant": self.variant, "reason": self.reason, "scenarios": self.scenarios}

    def error(self, others: int = 0) -> InternalError:
        """The one-line failure a command ends with (exit 3), after writing
        everything else; ``others``: more variants that could not start."""
        from differential.variants.tree import WorkerStartFailed

        more = f" (and {others} other variant(s))" if others else ""
        return WorkerStartFailed(
            f"{self.variant}{more} could not start, so {len(self.scenarios)} scenario(s) did "
            f"not run on it; every other result was written: {self.short_reason()}",
            self.variant,
        )


REPORT_FORMAT = "kvfuzz.replay"
REPORT_VERSION = 1


def _verdicts(result: ScenarioResult, variant: str) -> dict[int | None, list[str]]:
    out: dict[int | None, list[str]] = {}
    for finding in result.findings:
        if finding.owner == variant:
            out.setdefault(finding.request, []).append(finding.kind.value)
    return out


def _hash_block(result: ScenarioResult) -> int:
    """The hash block size, in tokens, that vLLM used (else the scenario's)."""
    for vr in result.results:
        if vr.run.settings is not None and vr.run.settings.hash_block_size_tokens:
            return vr.run.settings.hash_block_size_tokens
    return result.scenario.effective_hash_block_size_tokens


def summary_counts(results: Sequence[ScenarioResult]) -> Counter[str]:
    """Findings by kind across ``results``."""
    return Counter(f.kind.value for r in results for f in r.findings)


def render_text(
    results: Sequence[ScenarioResult], vllm_version: str, notices: Sequence[str] = ()
) -> str:
    """A table per scenario: one row per variant and sibling, then the findings."""
    lines: list[str] = [f"kvfuzz replay on vLLM {vllm_version}"]
    lines += [f"note: {n}" for n in notices]
    header = (
        f"  {'variant':<10} {'req':>3} {'divergence':>10} {'expected':>9} "
        f"{'hit':>9} {'dense':>9}  verdict"
    )
    for result in results:
        scenario = result.scenario
        lines.append("")
        # Names are shown escaped: a newline in a file name cannot fake a table row;
        # a scenario's name is cut short (its file may give it a megabyte).
        title = printable(result.source) if result.source else short_text(scenario.label)
        lines.append(
            f"{title}  [{short_text(scenario.label)}; A={scenario.effective_hit_alignment_tokens}, "
            f"hash block {_hash_block(result)}, policy {result.policy.value}"
            + ("" if scenario.prefix_caching else ", prefix caching off")
            + _failure_policy_words(scenario)
            + "]"
        )
        lines += [f"  note: {n}" for n in result.notices]
        lines.append(header)
        for vr in result.results:
            verdicts = _verdicts(result, vr.variant.name)
            if vr.references:
                for ref, obs in zip(vr.references, vr.run.requests, strict=True):
                    kinds = verdicts.get(ref.index, [])
                    lines.append(
                        f"  {vr.variant.name:<10} {ref.index:>3} {ref.divergence_tokens:>10} "
                        f"{ref.expected_tokens:>9} {obs.hit_tokens:>9} {ref.dense_tokens:>9}  "
                        f"{', '.join(dict.fromkeys(kinds)) or 'ok'}"
                    )
            else:  # judged per lookup as scheduled: no sequential reference
                for obs in vr.run.requests:
                    kinds = verdicts.get(obs.index, [])
                    lines.append(
                        f"  {vr.variant.name:<10} {obs.index:>3} {'-':>10} {'-':>9} "
                        f"{obs.hit_tokens:>9} {'-':>9}  {', '.join(dict.fromkeys(kinds)) or 'ok'}"
                    )
                lines += _aborted_unadmitted(scenario, vr)
                lines += _errored(vr)
            for kind in verdicts.get(None, []):
                lines.append(f"  {vr.variant.name:<10} run: {kind}")
            if vr.run.mode == "scheduler":
                lines.append(f"  {vr.variant.name:<10} engine: {engine_summary(vr.run)}")
                for obs in vr.run.requests:
                    if obs.connector is not None:
                        lines.append(f"  {vr.variant.name:<10} {connector_summary(obs)}")
        for finding in result.findings:
            lines.append(f"  ! {finding.summary()}")
        for cost in result.costs:
            lines.append(f"  cost: {cost.summary()}")
    counts = summary_counts(results)
    lines.append("")
    if counts:
        kind_counts = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        lines.append(f"{len(results)} scenario(s); findings: {kind_counts}")
    else:
        lines.append(f"{len(results)} scenario(s); no findings")
    return "\n".join(lines) + "\n"


def _aborted_unadmitted(scenario: Scenario, vr: Any) -> list[str]:
    """A row per request its client aborted before it was admitted: it has
    no lookup to judge, so it would otherwise be missing without a word."""
    aborts = scenario.workload.abort_steps
    if aborts is None or vr.run.error is not None:
        return []
    seen = {obs.index for obs in vr.run.requests}
    return [
        f"  {vr.variant.name:<10} {i:>3} aborted from step {step} before it was admitted"
        for i, step in enumerate(aborts)
        if step is not None and i not in seen
    ]


def _failure_policy_words(scenario: Any) -> str:
    """The title's words for a store whose failed loads fail their requests
    (``kv_load_failure_policy`` ``fail``); ``""`` otherwise."""
    store = scenario.workload.connector
    if store is None or store.kv_load_failure_policy.value != "fail":
        return ""
    return ", failed loads fail"


def _errored(vr: Any) -> list[str]:
    """A row per request vLLM finished with an error (``RunObservation.errored``):
    one failed before its admission has no lookup row to carry it."""
    lost = set(vr.run.failed_load_requests or ())
    return [
        f"  {vr.variant.name:<10} {i:>3} finished with an error after step {step}"
        + (" (its load failed)" if i in lost else "")
        for i, step in vr.run.errored or ()
    ]


def expected_line(
    judged: Sequence[tuple[ScenarioResult, Mapping[str, Sequence[str]] | None]],
) -> str | None:
    """One closing line saying whether a replay's findings were expected.

    ``judged`` pairs each result with its file's ``expect`` findings (variant
    -> tags) when its ``expect`` block held, ``None`` when the file has no
    such block or the replay contradicted it. A finding is expected when its
    owner (a variant, or ``layout``) is recorded in a block that held.

    Returns:
        ``None`` when nothing was found; else, per owner, the findings, the
        baseline variants named as lacking the fix (a ``tree:`` variant's
        findings: ``on the tree under test``) and the known vLLM issues
        named (``10 findings on unfixed, as expected: it lacks the fix;
        fixed: 1, all known vLLM issues the fix does not cover
        (unit-below-retained-boundary-falls-back); each is recorded in its
        file's expect block``), or how many are recorded nowhere.
    """
    from differential.variants import VariantRole

    roles: dict[str, VariantRole] = {}
    counts: Counter[str] = Counter()
    recorded = 0
    # owner -> (known vLLM issues, known costs of the fix), each in first-seen order
    known: dict[str, tuple[dict[str, None], dict[str, None]]] = {}
    for result, expect in judged:
        for vr in result.results:
            roles.setdefault(vr.variant.name, vr.variant.role)
        for finding in result.findings:
            owner = finding.owner
            counts[owner] += 1
            recorded += expect is not None and owner in expect
            if finding.known_issue:
                issues, costs = known.setdefault(owner, ({}, {}))
                (costs if finding.kind in FIX_COMPARISONS else issues)[finding.known_issue] = None
    total = sum(counts.values())
    if not total:
        return None
    parts = []
    for owner, n in counts.items():
        if roles.get(owner) is VariantRole.BASELINE and owner.startswith("tree:"):
            why = "on the tree under test"
        elif roles.get(owner) is VariantRole.BASELINE:
            why = "it lacks the fix"
        else:
            why = _known_why(*known.get(owner, ({}, {})), every=_all_known(judged, owner))
        parts.append(f"{owner}: {n}" + (f", {why}" if why else ""))
    if recorded == total:
        return (
            f"{total} finding(s), as expected: each is recorded in its file's expect block ("
            + "; ".join(parts)
            + ")"
        )
    return (
        f"{total} finding(s) ({'; '.join(parts)}); {total - recorded} of them recorded in no "
        "expect block that held"
    )


def _known_why(issues: Mapping[str, None], costs: Mapping[str, None], *, every: bool) -> str:
    """Why a fixed variant's findings were expected: the known vLLM issues
    the fix does not cover and the known costs of the fix
    (:data:`~differential.findings.FIX_COMPARISONS`) among them, or all of
    them (``every``); ``""`` when none is known."""
    named = []
    if issues:
        which = " the fix does not cover" if every else " among them"
        named.append(f"known vLLM issues{which} (" + ", ".join(issues) + ")")
    if costs:
        which = "" if every else " among them"
        named.append(f"known costs of the fix{which} (" + ", ".join(costs) + ")")
    return ("all " if every and named else "") + " and ".join(named)


def _all_known(
    judged: Sequence[tuple[ScenarioResult, Mapping[str, Sequence[str]] | None]], owner: str
) -> bool:
    return all(f.known_issue for result, _ in judged for f in result.findings if f.owner == owner)


def engine_figures(run: RunObservation) -> dict[str, Any] | None:
    """A scheduler-mode run's engine figures (``None`` in manager mode): pool,
    steps, preemptions, evicted blocks, and the cost figure: cached blocks no
    lookup can reach, in blocks and as a share of the pool."""
    if run.mode != "scheduler":
        return None
    return {
        "pool_blocks": run.pool_blocks,
        "steps": run.steps,
        "preemptions": run.preemptions,
        "evicted_blocks": run.evicted_blocks,
        "cached_blocks": run.cached_blocks,
        "unreachable_cached_blocks": run.unreachable_cached_blocks,
        "unreachable_share": round(run.unreachable_share, 4),
    }


def engine_summary(run: RunObservation) -> str:
    """One line of :func:`engine_figures`."""
    return (
        f"scheduler mode, pool {run.pool_blocks} blocks, {run.steps} steps, "
        f"{run.preemptions} preemptions, {run.evicted_blocks} evicted blocks; "
        f"{run.unreachable_cached_blocks} cached blocks unreachable by any lookup "
        f"({100 * run.unreachable_share:.1f}% of the pool)"
    )


def connector_summary(obs: RequestObservation) -> str:
    """One line of what a request's KV connector store held and what vLLM
    adopted at its admission, in tokens (``workload.connector``)."""
    c = obs.connector
    assert c is not None
    return (
        f"connector: req {obs.index}: local hit {c.local_hit_tokens}, store held "
        f"{c.store_tokens}, answered {c.matched_tokens} past {c.presented_tokens}; "
        f"started with {c.local_tokens} local + {c.external_tokens} external"
        + (" (async load)" if c.load_async else "")
        + (" (divergent hybrid hit)" if c.diverged else "")
        + (" (a load failed)" if c.load_failed else "")
    )


def _siblings(vr: Any, verdicts: dict[int | None, list[str]]) -> list[dict[str, Any]]:
    """Per request: the reference and the verdict (requests judged per lookup
    as scheduled have no sequential reference: hit, step and verdict only)."""
    if not vr.references:
        return [
            {
                "request": obs.index,
                "hit_tokens": obs.hit_tokens,
                "scheduled_step": obs.scheduled_step,
                "verdict": list(dict.fromkeys(verdicts.get(obs.index, []))) or ["ok"],
            }
            for obs in vr.run.requests
        ]
    return [
        {
            "request": ref.index,
            "divergence_tokens": ref.divergence_tokens,
            "expected_tokens": ref.expected_tokens,
            "dense_tokens": ref.dense_tokens,
            "hit_tokens": obs.hit_tokens,
            "shared_prefix_boundary_tokens": obs.shared_prefix_boundary_tokens,
            "verdict": list(dict.fromkeys(verdicts.get(ref.index, []))) or ["ok"],
        }
        for ref, obs in zip(vr.references, vr.run.requests, strict=True)
    ]


def _finding_list(findings: Sequence[Finding]) -> list[dict[str, Any]]:
    return [f.to_dict() for f in findings]


def render_json(
    results: Sequence[ScenarioResult],
    vllm_version: str,
    policy: Policy,
    notices: Sequence[str] = (),
) -> dict[str, Any]:
    """The same content as :func:`render_text`, machine-readable."""
    scenarios = []
    for result in results:
        variants = []
        for vr in result.results:
            verdicts = _verdicts(result, vr.variant.name)
            variants.append(
                {
                    "name": vr.variant.name,
                    "hits": list(vr.run.hits),
                    "dense_hits": None if vr.dense_run is None else list(vr.dense_run.hits),
                    "siblings": _siblings(vr, verdicts),
                    "findings": _finding_list(vr.findings),
                    "engine": engine_figures(vr.run),
                    "run": vr.run.to_dict(),
                }
            )
        scenarios.append(
            {
                "source": result.source,
                "scenario": result.scenario.to_dict(),
                "effective_hash_block_size_tokens": _hash_block(result),
                "variants": variants,
                "comparison_findings": _finding_list(result.comparison_findings),
                "costs": [cost.to_dict() for cost in result.costs],
                "notices": list(result.notices),
            }
        )
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "vllm_version": vllm_version,
        "policy": policy.value,
        "notices": list(notices),
        "scenarios": scenarios,
        "summary": {
            "scenarios": len(results),
            "findings_by_kind": dict(sorted(summary_counts(results).items())),
        },
    }

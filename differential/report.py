"""Render scenario results as a readable table or as versioned JSON."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from differential.compare import ScenarioResult
from differential.findings import Finding, Policy

__all__ = ["REPORT_FORMAT", "printable", "render_json", "render_text", "summary_counts"]

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


def printable(text: str) -> str:
    """``text`` with control characters (and backslashes) escaped, on one line."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


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
        # Names are shown escaped: a newline in a file name cannot fake a table row.
        title = printable(result.source or scenario.label)
        lines.append(
            f"{title}  [{printable(scenario.label)}; A={scenario.effective_hit_alignment_tokens}, "
            f"hash block {_hash_block(result)}, policy {result.policy.value}]"
        )
        lines += [f"  note: {n}" for n in result.notices]
        lines.append(header)
        for vr in result.results:
            verdicts = _verdicts(result, vr.variant.name)
            for ref, obs in zip(vr.references, vr.run.requests, strict=True):
                kinds = verdicts.get(ref.index, [])
                lines.append(
                    f"  {vr.variant.name:<10} {ref.index:>3} {ref.divergence_tokens:>10} "
                    f"{ref.expected_tokens:>9} {obs.hit_tokens:>9} {ref.dense_tokens:>9}  "
                    f"{', '.join(dict.fromkeys(kinds)) or 'ok'}"
                )
            for kind in verdicts.get(None, []):
                lines.append(f"  {vr.variant.name:<10} run: {kind}")
        for finding in result.findings:
            lines.append(f"  ! {finding.summary()}")
        for cost in result.costs:
            lines.append(f"  cost: {cost.summary()}")
    counts = summary_counts(results)
    lines.append("")
    if counts:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        lines.append(f"{len(results)} scenario(s); findings: {kinds}")
    else:
        lines.append(f"{len(results)} scenario(s); no findings")
    return "\n".join(lines) + "\n"


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
                    "siblings": [
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
                    ],
                    "findings": _finding_list(vr.findings),
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

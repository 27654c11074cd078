"""The one-page campaign report (``OUT/report.md``) and its pictures.

Findings by kind, executions per second, each distinct finding with its
count and file (and, for the first few unexplained ones, the ``kvfuzz explain``
picture), and the coverage of the scenario space: how many scenarios ran per
drafter, protection, retention class, geometry scale and number of SWA groups.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from differential.compare import ScenarioResult
from differential.corpus import write_atomic
from differential.scenario import Scenario

__all__ = ["campaign_markdown", "explain_pictures"]


def explain_pictures(
    items: Sequence[tuple[str, Scenario, ScenarioResult]], folder: Path, *, limit: int = 6
) -> dict[str, Path]:
    """Write an explain SVG for the first ``limit`` findings with a request.

    Args:
        items: ``(slug, scenario, result)`` per distinct finding, in order.
        folder: where the SVG files go.

    Returns:
        slug -> SVG path, for the pictures written.
    """
    from differential.explain import explain_request, render_svg

    pictures: dict[str, Path] = {}
    for slug, _scenario, result in items:
        if len(pictures) >= limit:
            break
        flagged = sorted(f.request for f in result.findings if f.request and f.known_issue is None)
        if not flagged:
            continue
        exp = explain_request(result, flagged[0])
        if exp is None:
            continue
        path = folder / f"{slug}.svg"
        write_atomic(path, render_svg(exp))
        pictures[slug] = path
    return pictures


def campaign_markdown(summary: dict[str, Any], pictures: dict[str, Path], out: Path) -> str:
    """The report as Markdown (links relative to ``out``)."""
    lines = [
        "# kvfuzz campaign",
        "",
        f"- seed {summary['seed']}, variants {', '.join(summary['variants'])}, "
        f"policy {summary['policy']}, vLLM {summary['vllm_version']}",
        f"- {summary['examples']} scenarios in {summary['elapsed_s']:.1f} s: "
        f"**{summary['executions_per_s']:.1f} executions/s**"
        + (
            f"; first finding after {summary['first_finding_s']:.2f} s"
            if summary["first_finding_s"] is not None
            else ""
        )
        + (" (interrupted)" if summary["interrupted"] else ""),
        "",
        "## Findings by kind",
        "",
        "| kind | findings (with duplicates) |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {n} |" for k, n in summary["findings_by_kind"].items()] or ["| none | 0 |"]
    lines += ["", "## Distinct findings", ""]
    if not summary["distinct"]:
        lines.append("None.")
    for entry in summary["distinct"]:
        file = Path(entry["file"])
        rel = file.relative_to(out) if file.is_relative_to(out) else file
        lines.append(f"- **{entry['signature']}** x{entry['count']}: [`{rel}`]({rel})")
        slug = file.stem
        if slug in pictures:
            picture = pictures[slug].relative_to(out)
            lines += ["", f"  ![explain {slug}]({picture})", ""]
    lines += ["", "## Coverage of the scenario space", ""]
    groups: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for key, count in summary.get("coverage", {}).items():
        name, _, value = key.partition(":")
        groups[name].append((value, count))
    for name, values in groups.items():
        lines += [f"| {name} | scenarios |", "| --- | --- |"]
        lines += [f"| {value} | {count} |" for value, count in sorted(values)]
        lines.append("")
    return "\n".join(lines) + "\n"

"""The one-page campaign report (``OUT/report.md``) and its pictures.

It opens with one table of root causes (:mod:`differential.triage.identity`), new ones
(no known vLLM issue, not in the known corpus) before known ones, each with
its count, its reproducer (the shrunk one when the background shrink made
it) and the variants it affects; then each root cause with its facets and
picture; then findings by kind, executions per second, each distinct finding with its
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

__all__ = ["campaign_markdown", "explain_pictures", "root_cause_pictures", "root_cause_table"]


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
    from differential.exports.explain import explain_request, render_svg

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


def _link(path: str) -> str:
    """A link to a file the summary names relative to OUT (the report's own
    folder: :func:`fuzz.campaign.shown_path`)."""
    return f"[`{path}`]({path})"


def _reproducer(cause: dict[str, Any]) -> str:
    """A root cause's reproducer: a link to the campaign's own file for a new
    one; for a known one, what it is known as (a path from the kvfuzz root),
    as code."""
    return _link(cause["reproducer"]) if cause["status"] == "new" else f"`{cause['reproducer']}`"


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


def root_cause_table(summary: dict[str, Any]) -> list[str]:
    """The opening table: one row per root cause, new ones first (Markdown lines)."""
    causes = summary.get("root_causes", [])
    new = sum(1 for c in causes if c["status"] == "new")
    lines = [
        f"**{len(causes)} root cause(s), {new} new** "
        f"({len(summary['distinct'])} distinct signatures)",
        "",
    ]
    if not causes:
        return [*lines, "No findings.", ""]
    lines += [
        "| # | status | root cause | count | variants | reproducer |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for index, cause in enumerate(causes, 1):
        status = "**NEW**" if cause["status"] == "new" else "known"
        link = _reproducer(cause)
        lines.append(
            f"| {index} | {status} | {_cell(cause['root_cause'])} | {cause['count']} | "
            f"{', '.join(cause['variants'])} | {link} |"
        )
    return [*lines, ""]


def root_cause_pictures(
    items: Sequence[tuple[str, ScenarioResult, int]], folder: Path, *, limit: int = 9
) -> dict[str, Path]:
    """Write an explain SVG for the sibling that shows each root cause.

    Args:
        items: ``(root cause text, result of its reproducer, request)``, in
            report order.
        folder: where the SVG files go.

    Returns:
        root cause text -> SVG path, for the pictures written.
    """
    import hashlib

    from differential.exports.explain import explain_request, render_svg

    pictures: dict[str, Path] = {}
    for text, result, request in items[:limit]:
        exp = explain_request(result, request)
        if exp is None:
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()[:10]
        path = folder / f"root-cause-{digest}.svg"
        write_atomic(path, render_svg(exp))
        pictures[text] = path
    return pictures


def _remaining_by_variant(summary: dict[str, Any]) -> list[str]:
    """Per variant, the root causes it still shows (known issues by name)."""
    lines = ["", "## What each variant still shows", ""]
    lines += [
        "| variant | root cause | status | findings on the variant |",
        "| --- | --- | --- | --- |",
    ]
    rows = 0
    for variant in summary["variants"]:
        for cause in summary.get("root_causes", []):
            if variant in cause["variants"]:
                rows += 1
                count = cause.get("count_by_variant", {}).get(variant, cause["count"])
                lines.append(
                    f"| {variant} | {_cell(cause['root_cause'])} | {cause['status']} | {count} |"
                )
    if not rows:
        lines.append("| every variant | none | clean | 0 |")
    return lines


def _pool_cell(need: dict[str, Any]) -> str:
    smallest = need["smallest_pool_blocks"]
    shown = "did not run" if smallest is None else f"{smallest} blocks"
    return f"{need['variant']}: {shown}"


def pool_needs_section(summary: dict[str, Any]) -> list[str]:
    """The smallest pool each variant needs to serve every hit, per
    ``pool-regression`` root cause (its first scenario), as a Markdown table."""
    rows = [c for c in summary.get("root_causes", []) if c.get("pool_needs")]
    if not rows:
        return []
    lines = [
        "",
        "## Pool the fixes need (pool-regression root causes)",
        "",
        "Smallest `workload.pool_blocks` at which each variant still serves every hit it "
        "serves with a pool that holds everything (bisection with real runs).",
        "",
        "| root cause | roomy pool | smallest pool per variant |",
        "| --- | --- | --- |",
    ]
    for cause in rows:
        needs = cause["pool_needs"]
        lines.append(
            f"| {cause['root_cause']} | {needs[0]['roomy_pool_blocks']} blocks | "
            + ", ".join(_pool_cell(n) for n in needs)
            + " |"
        )
    return lines


def _fix_costs(summary: dict[str, Any]) -> list[str]:
    """Each fixed-role variant's extra SWA blocks against each baseline, and
    the pool each variant needs where a fix cost hits (:func:`pool_needs_section`)."""
    costs = summary.get("fix_costs", [])
    if not costs:
        return pool_needs_section(summary)
    lines = ["", "## Cost of the fixes (sparse-retention scenarios, equal hits)", ""]
    lines += [
        "| fix vs baseline | scenarios | extra SWA blocks | retained boundaries | per boundary |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {c['pair']} | {c['scenarios']} | {c['extra_swa_blocks']} | "
        f"{c['retained_boundaries']} | {c['extra_swa_blocks_per_boundary']} |"
        for c in costs
    ]
    return lines + pool_needs_section(summary)


def engine_section(summary: dict[str, Any]) -> list[str]:
    """The scheduler-mode counts (``summary["engine"]``) as a Markdown table:
    what the engine scenarios exercised and the unreachable-cache cost."""
    engine = summary.get("engine") or {}
    if not engine.get("scenarios"):
        return []
    pool = engine.get("pool_blocks", 0)
    share = engine.get("unreachable_cached_blocks", 0) / pool if pool else 0.0
    rows = [
        ("scenarios through vLLM's Scheduler", engine.get("scenarios", 0)),
        ("concurrent (requests in flight together)", engine.get("concurrent", 0)),
        ("multi-turn sessions", engine.get("multi_turn", 0)),
        ("multi-turn reusing the previous answer", engine.get("answer_reused", 0)),
        ("speculative decoding (drafts accepted / rejected)", engine.get("speculative", 0)),
        ("speculative, with a draft rejected", engine.get("rejected_drafts", 0)),
        ("decoding (sampled tokens)", engine.get("decode", 0)),
        ("with a Mamba group", engine.get("mamba", 0)),
        ("with annotated draft groups (is_eagle_group)", engine.get("draft_groups", 0)),
        ("with eviction", engine.get("with_eviction", 0)),
        ("with preemption", engine.get("with_preemption", 0)),
        ("variant runs", engine.get("runs", 0)),
        ("evicted blocks (all runs)", engine.get("evicted_blocks", 0)),
        ("preemptions (all runs)", engine.get("preemptions", 0)),
        (
            "cached blocks no lookup can reach at run end, share of the pool (pooled over runs)",
            f"{100 * share:.1f}%",
        ),
    ]
    return [
        "",
        "## Engine scenarios (scheduler mode)",
        "",
        "| what | count |",
        "| --- | --- |",
        *(f"| {what} | {n} |" for what, n in rows),
    ]


def campaign_markdown(summary: dict[str, Any], pictures: dict[str, Path], out: Path) -> str:
    """The report as Markdown (links relative to ``out``).

    ``pictures`` maps a root cause's text (or a finding file's stem) to its
    explain SVG.
    """
    lines = [
        "# kvfuzz campaign",
        "",
        *root_cause_table(summary),
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
    lines += _remaining_by_variant(summary)
    lines += _fix_costs(summary)
    lines += engine_section(summary)
    lines += ["", "## Root causes", ""]
    for index, cause in enumerate(summary.get("root_causes", []), 1):
        facets = ", ".join(f"{k} x{n}" for k, n in cause["facets"].items())
        lines.append(
            f"### {index}. {'NEW' if cause['status'] == 'new' else 'known'}: {cause['root_cause']}"
        )
        lines += [
            "",
            f"- {cause['count']} finding(s): {facets}"
            + (f"; {cause['consequences']} as consequences" if cause["consequences"] else ""),
            f"- variants: {', '.join(cause['variants'])}",
            f"- first scenario: {_link(cause['file'])}"
            + (f"; shrunk: {_link(cause['shrunk'])}" if cause["shrunk"] else "")
            + (f"; known as: `{cause['known_as']}`" if cause["known_as"] else ""),
            f"- {len(cause['signatures'])} signature(s)",
        ]
        picture = pictures.get(cause["root_cause"])
        if picture is not None:
            lines += ["", f"  ![explain {cause['root_cause']}]({picture.relative_to(out)})"]
        lines.append("")
    lines += ["", "## Distinct findings", ""]
    if not summary["distinct"]:
        lines.append("None.")
    for entry in summary["distinct"]:
        lines.append(f"- **{entry['signature']}** x{entry['count']}: {_link(entry['file'])}")
        slug = Path(entry["file"]).stem
        if slug in pictures:
            picture = pictures[slug].relative_to(out)
            lines += ["", f"  ![explain {slug}]({picture})", ""]
    lines += ["", "## Coverage of the scenario space", ""]
    groups: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for key, count in summary.get("coverage", {}).items():
        name, _, value = key.partition(":")
        groups[name].append((value, count))
    for name, values in groups.items():
        if name == "group-mix":
            lines += [f"{len(values)} distinct group mixes.", ""]
        lines += coverage_table(name, values)
        lines.append("")
    return "\n".join(lines) + "\n"


#: A coverage table longer than this shows its most frequent rows only.
COVERAGE_ROWS = 10


def coverage_table(name: str, values: list[tuple[str, int]]) -> list[str]:
    """One coverage dimension as a Markdown table: every value (sorted) when
    there are at most ``COVERAGE_ROWS``; else the ``COVERAGE_ROWS`` most
    frequent, then one row counting the rest (a campaign draws hundreds of
    group mixes, which made ``report.md`` mostly one table)."""
    lines = [f"| {name} | scenarios |", "| --- | --- |"]
    if len(values) <= COVERAGE_ROWS:
        return lines + [f"| {value} | {count} |" for value, count in sorted(values)]
    ranked = sorted(values, key=lambda vc: (-vc[1], vc[0]))
    shown, rest = ranked[:COVERAGE_ROWS], ranked[COVERAGE_ROWS:]
    lines += [f"| {value} | {count} |" for value, count in shown]
    lines.append(
        f"| ... {len(rest)} more (the full counts: `coverage` in summary.json) | "
        f"{sum(count for _, count in rest)} |"
    )
    return lines

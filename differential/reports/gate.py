"""``kvfuzz gate``'s report: a pull request's tree judged against its base, as a review.

The runs (:func:`fuzz.gate.run_gate`: a corpus and a bounded campaign on the
base and the head, two tree variants) are judged by the oracle on each side;
this module sorts what it found, sibling by sibling (a finding is the same on
both sides when its kind and request are):

* **new on the head** -- a finding the head has and the base has not (the
  gate fails: exit 1);
* **resolved on the head** -- a finding the base has and the head has not;
* **on both** -- a finding both have (known vLLM issues, and whatever the
  base already had);
* **hits** -- a sibling's hit differs while the oracle's verdict is the same
  on both sides (it accepts both, or flags both);
* **cost** -- the same hits, different blocks kept;
* **unsupported** -- a scenario one side cannot run (the head's: the gate
  fails, it could not check it).

Findings are grouped by kind and root cause
(:mod:`differential.triage.identity`); each group names an example, its
reproducer file and the command that exports it as a test. Nothing here
imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from differential.compare import ScenarioResult, VariantResult
from differential.corpus import finding_tag
from differential.findings import Finding
from differential.reports.diff import (
    blocks_added_text,
    cost_text,
    finding_kinds_at,
    plan_change,
    ranked_groups,
    setting_text,
)
from differential.reports.table import NotStarted
from differential.triage.identity import Role, Triaged, triage

__all__ = ["GateItem", "GateReport", "Reproducer", "Section", "gate_items", "shared_tags"]

_EXAMPLES_SHOWN = 2
BASE, HEAD = "base", "head"


class Section(StrEnum):
    """Where a difference goes in the review."""

    NEW = "new"
    RESOLVED = "resolved"
    BOTH = "both"
    HITS = "hits"
    COST = "cost"
    PLAN = "plan"
    UNSUPPORTED = "unsupported"


_TITLES = {
    Section.NEW: "new on the head",
    Section.RESOLVED: "resolved on the head",
    Section.BOTH: "still on both (known vLLM issues and findings the base already had)",
    Section.HITS: "hits that differ (the oracle's verdict the same on both)",
    Section.COST: "blocks kept that differ (same hits)",
    Section.PLAN: "KV cache plans that differ (a model's groups, block sizes or tensors)",
    Section.UNSUPPORTED: "scenarios one side cannot run",
}


@dataclass(frozen=True)
class GateItem:
    """One sibling's difference (a whole scenario's, when unsupported).

    Attributes:
        section: where it goes in the review.
        cause: the group it belongs to (a finding's kind and root cause).
        scenario: where the scenario came from (a file, ``generated #N``).
        request: the sibling's index, or ``None`` for a whole run.
        detail: one line of figures (hits in tokens, the finding's words).
        side: the variant that shows it (``base`` or ``head``; both: ``head``).
        finding: the finding behind it, if any.
        extra_blocks: blocks cached on the head minus on the base (cost).
    """

    section: Section
    cause: str
    scenario: str
    request: int | None
    detail: str
    side: str = HEAD
    finding: Finding | None = None
    extra_blocks: int = 0


@dataclass(frozen=True)
class Reproducer:
    """A group's reproducer file and the command to run on it.

    Attributes:
        path: the scenario file written into the output folder.
        command: ``kvfuzz export-test FILE --variants tree:...`` for a
            finding, ``kvfuzz replay FILE --variants ...`` otherwise.
    """

    path: str
    command: str


def _by_side(result: ScenarioResult) -> tuple[VariantResult, VariantResult]:
    base, head = result.results
    return base, head


def _cause(t: Triaged) -> str:
    """A finding's group: its kind and root cause (``fallback | shortfall |
    SlidingWindowManager.find_longest_cache_hit | missing periodic - 1A``);
    a facet or consequence names the root cause it goes with."""
    kind, cause = t.finding.kind.value, t.root_cause.text
    if t.role is not Role.PRIMARY:
        return f"{kind} (a {t.role.value} of {cause})"
    return kind if cause == kind else f"{kind} | {cause}"


def _finding_items(result: ScenarioResult, label: str) -> list[GateItem]:
    base, head = _by_side(result)
    causes = {id(t.finding): _cause(t) for t in triage(result)}
    keys = {
        side: {finding_tag(f) for f in vr.findings} for side, vr in ((BASE, base), (HEAD, head))
    }
    items = []
    for side, vr, other in ((HEAD, head, BASE), (BASE, base, HEAD)):
        for finding in vr.findings:
            shared = finding_tag(finding) in keys[other]
            if side == BASE and shared:
                continue  # listed once, from the head
            section = (
                Section.BOTH if shared else (Section.NEW if side == HEAD else Section.RESOLVED)
            )
            cause = causes.get(id(finding), finding.kind.value)
            known = f" [known vLLM issue: {finding.known_issue}]" if finding.known_issue else ""
            detail = finding.detail + known
            items.append(GateItem(section, cause, label, finding.request, detail, side, finding))
    return items


def gate_items(result: ScenarioResult, label: str) -> list[GateItem]:
    """What differs between the base and the head (``result.results``, in
    that order) on one scenario, and the findings both have."""
    base, head = _by_side(result)
    scenario = result.scenario
    if base.run.unsupported is not None or head.run.unsupported is not None:
        return [
            GateItem(
                Section.UNSUPPORTED,
                f"{side} cannot run it: {vr.run.unsupported}",
                label,
                None,
                setting_text(scenario),
                side,
            )
            for side, vr in ((BASE, base), (HEAD, head))
            if vr.run.unsupported is not None
            and (base.run.unsupported is None or head.run.unsupported is None)
        ]
    items = _finding_items(result, label)
    for xa, xb in zip(base.run.requests, head.run.requests, strict=False):
        j = xa.index
        cached = (
            f"cached by the request: {blocks_added_text(xa.retained_blocks_per_group)} on the "
            f"base; {blocks_added_text(xb.retained_blocks_per_group)} on the head"
        )
        extra = sum(xb.retained_blocks_per_group) - sum(xa.retained_blocks_per_group)
        if xa.hit_tokens != xb.hit_tokens:
            flags = finding_kinds_at(base, j), finding_kinds_at(head, j)
            if flags[0] != flags[1]:
                continue  # a finding on one side: new or resolved
            verdict = (
                f"the oracle flags both ({', '.join(flags[0])})"
                if flags[0]
                else ("the oracle accepts both")
            )
            higher = "higher" if xb.hit_tokens > xa.hit_tokens else "lower"
            items.append(
                GateItem(
                    Section.HITS,
                    f"hits {higher} on the head; {verdict}",
                    label,
                    j,
                    f"hits {xa.hit_tokens} on the base, {xb.hit_tokens} on the head (tokens); "
                    f"{setting_text(scenario)}; {cached}",
                    extra_blocks=extra,
                )
            )
        elif xa.retained_blocks_per_group != xb.retained_blocks_per_group:
            items.append(
                GateItem(
                    Section.COST,
                    f"drafter {scenario.drafter.kind.value}",
                    label,
                    j,
                    f"same hit {xa.hit_tokens} tokens; {setting_text(scenario)}; {cached}",
                    extra_blocks=extra,
                )
            )
    plan = plan_change(result, BASE, HEAD)
    if plan is not None:
        items.append(GateItem(Section.PLAN, plan[0], label, None, plan[1]))
    return items


def shared_tags(items: list[GateItem]) -> frozenset[str]:
    """The head's finding tags (``kind@request``) the base has too."""
    return frozenset(
        finding_tag(i.finding) for i in items if i.section is Section.BOTH and i.finding
    )


@dataclass
class GateReport:
    """Everything ``kvfuzz gate`` found.

    Attributes:
        base, head: what each side is (commit, ref, working tree), one line each.
        versions: ``base``/``head`` -> the vLLM version (and commit) it ran.
        corpus_scenarios: corpus scenarios that ran on both sides.
        generated_scenarios: scenarios the campaign generated.
        seconds: the campaign's budget, in seconds (0: none).
        seed: the campaign's seed.
        items: every difference, in the order found.
        reproducers: (section, cause) -> its example's reproducer.
        not_started: a side whose worker could not start, and what it would
            have run (the runs stopped there), or ``None``.
        rejected: ``label: message`` of corpus scenarios that could not run.
        elapsed_s: wall time of the runs, in seconds.
    """

    base: str
    head: str
    versions: dict[str, str]
    corpus_scenarios: int
    generated_scenarios: int
    seconds: float
    seed: int
    items: tuple[GateItem, ...]
    reproducers: dict[tuple[Section, str], Reproducer] = field(default_factory=dict)
    not_started: NotStarted | None = None
    rejected: tuple[str, ...] = ()
    elapsed_s: float = 0.0

    def groups(self) -> list[tuple[Section, str, list[GateItem]]]:
        """Items grouped by (section, cause), sections in :class:`Section`
        order, larger groups first."""
        return ranked_groups(((i.section, i.cause, i) for i in self.items), list(Section))

    @property
    def introduced(self) -> list[GateItem]:
        """What the head introduces: findings new on it, scenarios it cannot run."""
        return [
            i
            for i in self.items
            if i.section is Section.NEW or (i.section is Section.UNSUPPORTED and i.side == HEAD)
        ]

    def verdict(self) -> str:
        """The review's last line."""
        introduced = self.introduced
        if introduced:
            scenarios = len({i.scenario for i in introduced})
            return (
                f"verdict: the head introduces {len(introduced)} finding(s) in {scenarios} "
                "scenario(s) (exit 1)"
            )
        counts = {s: sum(1 for i in self.items if i.section is s) for s in Section}
        both = (
            f"; {counts[Section.BOTH]} finding(s) on both, as on the base"
            if counts[Section.BOTH]
            else ""
        )
        if not any(n for s, n in counts.items() if s is not Section.BOTH):
            return f"verdict: no difference: the head introduces nothing{both} (exit 0)"
        parts = [
            f"{counts[s]} {what}"
            for s, what in (
                (Section.RESOLVED, "finding(s) resolved"),
                (Section.HITS, "hit change(s) the oracle accepts"),
                (Section.COST, "cost change(s)"),
                (Section.PLAN, "KV cache plan change(s)"),
                (Section.UNSUPPORTED, "scenario(s) only the head runs"),
            )
            if counts[s]
        ]
        return f"verdict: the head introduces nothing: {', '.join(parts)}{both} (exit 0)"

    def render(self) -> str:
        """The review as text."""
        campaign = (
            f"{self.generated_scenarios} generated in a {self.seconds:g} s campaign "
            f"(seed {self.seed})"
            if self.seconds > 0
            else "no campaign"
        )
        lines = [
            f"kvfuzz gate: head {self.head}",
            f"  against base {self.base}",
            "  " + ", ".join(f"{side} runs vLLM {v}" for side, v in self.versions.items()),
            f"  {self.corpus_scenarios} corpus scenario(s), {campaign}; {self.elapsed_s:.0f} s",
        ]
        lines += [f"! not run: {' '.join(r.split())}" for r in self.rejected]
        if self.not_started is not None:
            lines.append(self.not_started.line())
        current: Section | None = None
        for section, cause, items in self.groups():
            if section is not current:
                mine = [i for i in self.items if i.section is section]
                scenarios = len({i.scenario for i in mine})
                lines.append(f"{_TITLES[section]}: {len(mine)} in {scenarios} scenario(s)")
                current = section
            scenarios = len({i.scenario for i in items})
            cost = (
                f"; {cost_text([i.extra_blocks for i in items], 'the head')}"
                if section is Section.COST
                else ""
            )
            reproducer = self.reproducers.get((section, cause))
            if section is Section.BOTH:  # what the base already had: one line a group
                where = f": {reproducer.path}" if reproducer is not None else ""
                lines.append(f"  [{len(items)} in {scenarios} scenario(s)] {cause}{where}")
                continue
            lines.append(f"  [{len(items)} in {scenarios} scenario(s){cost}] {cause}")
            for item in items[:_EXAMPLES_SHOWN]:
                where = item.scenario + (
                    f" request {item.request}" if item.request is not None else ""
                )
                lines.append(f"      e.g. {where}: {item.detail}")
            if reproducer is not None:
                lines.append(f"      reproducer: {reproducer.path}")
                lines.append(f"      run: {reproducer.command}")
        lines.append(self.verdict())
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``format: kvfuzz.gate``, version 1)."""
        return {
            "format": "kvfuzz.gate",
            "version": 1,
            "base": self.base,
            "head": self.head,
            "versions": self.versions,
            "corpus_scenarios": self.corpus_scenarios,
            "generated_scenarios": self.generated_scenarios,
            "seconds": self.seconds,
            "seed": self.seed,
            "elapsed_s": round(self.elapsed_s, 1),
            "introduces": bool(self.introduced),
            "not_started": None if self.not_started is None else self.not_started.to_dict(),
            "rejected": list(self.rejected),
            "groups": [
                {
                    "section": section.value,
                    "cause": cause,
                    "count": len(items),
                    "reproducer": (
                        None
                        if (r := self.reproducers.get((section, cause))) is None
                        else {"path": r.path, "command": r.command}
                    ),
                    "items": [
                        {
                            "scenario": i.scenario,
                            "request": i.request,
                            "side": i.side,
                            "detail": i.detail,
                            "extra_blocks": i.extra_blocks,
                        }
                        for i in items
                    ],
                }
                for section, cause, items in self.groups()
            ],
        }

"""``kvfuzz diff A B``'s report: what changed in prefix-cache behaviour between two variants.

The runs (every scenario of a corpus and a bounded campaign on both variants,
:func:`fuzz.diff.run_diff`) are judged by the oracle; this module groups what
differs by root cause:

* **hits** -- a sibling's hit differs; the cause names the protection each side
  ran with (EAGLE drop, lookahead hashes, none: read off vLLM's resolved
  settings) and the oracle's blame (which side it flags, with the finding kind);
* **cost** -- the same hits, different blocks kept (per group, summed);
* **findings** -- an oracle finding on one side only, for the same sibling;
* **plan** -- (a scenario with a model) the two vLLMs planned its KV cache
  otherwise: groups, block sizes, ``num_blocks`` or tensors
  (:meth:`differential.observation.KVCachePlan.difference`);
* **unsupported** -- scenarios one side cannot run, by missing feature.

Both variants take part as baselines (neither is labelled fixed), so
``fixed`` or a mutant may be diffed too. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from differential.compare import ScenarioResult, VariantResult
from differential.observation import ManagerSettings
from differential.reports.table import NotStarted
from differential.scenario import Scenario

__all__ = [
    "Change",
    "ChangeKind",
    "DiffReport",
    "blocks_added_text",
    "changes_of",
    "cost_text",
    "finding_kinds_at",
    "plan_change",
    "ranked_groups",
    "setting_text",
]

_EXAMPLES_SHOWN = 2
_Order = TypeVar("_Order")
_Item = TypeVar("_Item")


class ChangeKind(StrEnum):
    """What differs between the two variants."""

    HITS = "hits"
    COST = "cost"
    FINDINGS = "findings"
    PLAN = "plan"
    UNSUPPORTED = "unsupported"


_TITLES = {
    ChangeKind.HITS: "hits that differ",
    ChangeKind.COST: "blocks kept that differ (same hits)",
    ChangeKind.FINDINGS: "oracle findings on one side only (same hits)",
    ChangeKind.PLAN: "KV cache plans that differ (a model's groups, block sizes or tensors)",
    ChangeKind.UNSUPPORTED: "scenarios one side cannot run",
}


@dataclass(frozen=True)
class Change:
    """One difference, for one sibling (or one whole scenario when unsupported).

    Attributes:
        kind: what differs.
        cause: the root-cause group it belongs to (one line).
        scenario: where the scenario came from (a file, or ``generated #N``).
        request: the sibling's index, or ``None`` for a whole scenario.
        detail: the figures (hits in tokens, blocks kept per group).
        drafter: the scenario's drafter kind.
        extra_blocks: blocks kept on B minus blocks kept on A (all groups).
    """

    kind: ChangeKind
    cause: str
    scenario: str
    request: int | None
    detail: str
    drafter: str = "none"
    extra_blocks: int = 0


@dataclass(frozen=True)
class DiffReport:
    """Everything ``kvfuzz diff`` found.

    Attributes:
        a, b: the two variant names (A is the "before").
        versions: variant name -> the vLLM version it ran.
        corpus_scenarios: scenarios replayed from the corpus.
        generated_scenarios: scenarios the campaign generated.
        seed: the campaign's seed.
        changes: every difference, in the order found.
        not_started: a variant whose worker could not start, and what it
            would have run (the runs stopped there), or ``None``.
        rejected: ``label: message`` of corpus scenarios that could not run
            (bad input only running could show).
    """

    a: str
    b: str
    versions: dict[str, str]
    corpus_scenarios: int
    generated_scenarios: int
    seed: int
    changes: tuple[Change, ...]
    not_started: NotStarted | None = None
    rejected: tuple[str, ...] = ()

    def groups(self) -> list[tuple[ChangeKind, str, list[Change]]]:
        """Changes grouped by (kind, cause), kinds in :class:`ChangeKind` order,
        larger groups first."""
        return ranked_groups(((c.kind, c.cause, c) for c in self.changes), list(ChangeKind))

    def render(self) -> str:
        """The report as text."""
        lines = [
            f"kvfuzz diff {self.a} -> {self.b}: {self.corpus_scenarios} corpus scenario(s) "
            f"+ {self.generated_scenarios} generated (seed {self.seed})",
        ]
        if self.versions:
            lines.append(
                "  " + ", ".join(f"{name} runs vLLM {v}" for name, v in self.versions.items())
            )
        lines += [f"! not run: {printable_line(r)}" for r in self.rejected]
        if self.not_started is not None:
            lines.append(self.not_started.line())
        if not self.changes:
            lines.append("no differences")
            return "\n".join(lines) + "\n"
        current: ChangeKind | None = None
        for kind, cause, changes in self.groups():
            if kind is not current:
                total = sum(1 for c in self.changes if c.kind is kind)
                scenarios = len({c.scenario for c in self.changes if c.kind is kind})
                whole = kind in (ChangeKind.UNSUPPORTED, ChangeKind.PLAN)
                unit = "scenario(s)" if whole else "sibling(s)"
                count = (
                    f"{scenarios} {unit}"
                    if whole
                    else (f"{total} {unit} in {scenarios} scenario(s)")
                )
                lines.append(f"{_TITLES[kind]}: {count}")
                current = kind
            scenarios = len({c.scenario for c in changes})
            drafters = ", ".join(sorted({c.drafter for c in changes}))
            cost = ""
            if kind is ChangeKind.COST:
                cost = "; " + cost_text([c.extra_blocks for c in changes], self.b)
            lines.append(
                f"  [{len(changes)} in {scenarios} scenario(s); drafters {drafters}{cost}] {cause}"
            )
            for change in changes[:_EXAMPLES_SHOWN]:
                where = change.scenario + (
                    f" request {change.request}" if change.request is not None else ""
                )
                lines.append(f"      e.g. {where}: {change.detail}")
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``format: kvfuzz.diff``, version 1)."""
        return {
            "format": "kvfuzz.diff",
            "version": 1,
            "a": self.a,
            "b": self.b,
            "versions": self.versions,
            "corpus_scenarios": self.corpus_scenarios,
            "generated_scenarios": self.generated_scenarios,
            "seed": self.seed,
            "not_started": None if self.not_started is None else self.not_started.to_dict(),
            "rejected": list(self.rejected),
            "groups": [
                {
                    "kind": kind.value,
                    "cause": cause,
                    "count": len(changes),
                    "changes": [
                        {
                            "scenario": c.scenario,
                            "drafter": c.drafter,
                            "request": c.request,
                            "detail": c.detail,
                            "extra_blocks": c.extra_blocks,
                        }
                        for c in changes
                    ],
                }
                for kind, cause, changes in self.groups()
            ],
        }


def printable_line(text: str) -> str:
    """``text`` on one line."""
    return " ".join(text.split())


def cost_text(extra_blocks: Sequence[int], b: str) -> str:
    """Blocks kept on B against A, one figure per sibling, in words: ``66
    fewer blocks kept on unfixed in all: more on 4 sibling(s), fewer on 24``."""
    more = sum(1 for x in extra_blocks if x > 0)
    fewer = sum(1 for x in extra_blocks if x < 0)
    blocks = sum(extra_blocks)
    total = (
        f"{abs(blocks)} {'more' if blocks > 0 else 'fewer'} block{'s' if abs(blocks) != 1 else ''} "
        f"kept on {b} in all"
        if blocks
        else f"as many blocks kept on {b} in all"
    )
    return f"{total}: more on {more} sibling(s), fewer on {fewer}"


def blocks_added_text(blocks: Sequence[int]) -> str:
    """What one request added to the prefix cache, per KV cache group, in
    words: ``[2, -2]`` is ``2 more blocks in group 0, 2 fewer in group 1``
    (the cached block count after the request against before it: evictions
    make it negative), ``[0, 3]`` is ``no change in group 0, 3 more blocks
    in group 1``."""
    parts = []
    noun = " blocks"
    for group, count in enumerate(blocks):
        if count == 0:
            parts.append(f"no change in group {group}")
            continue
        word = noun[:-1] if noun and abs(count) == 1 else noun  # "1 more block"
        parts.append(f"{abs(count)} {'more' if count > 0 else 'fewer'}{word} in group {group}")
        noun = ""
    return ", ".join(parts) or "no group"


def _protection(settings: ManagerSettings | None) -> str:
    if settings is None:
        return "?"
    if settings.use_eagle_block_drop:
        return "EAGLE drop"
    if settings.num_hash_lookahead_tokens:
        return "lookahead hashes"
    return "no drop"


def finding_kinds_at(result: VariantResult, request: int) -> list[str]:
    """The kinds of ``result``'s findings on sibling ``request``, sorted, once each."""
    return sorted({f.kind.value for f in result.findings if f.request == request})


def ranked_groups(
    keyed: Iterable[tuple[_Order, str, _Item]], order: Sequence[_Order]
) -> list[tuple[_Order, str, list[_Item]]]:
    """``(part, cause, item)`` triples grouped by (part, cause): parts in
    ``order``, then larger groups first, then by cause."""
    buckets: dict[tuple[_Order, str], list[_Item]] = {}
    for part, cause, item in keyed:
        buckets.setdefault((part, cause), []).append(item)
    ranked = sorted(buckets.items(), key=lambda kv: (order.index(kv[0][0]), -len(kv[1]), kv[0][1]))
    return [(part, cause, items) for (part, cause), items in ranked]


def setting_text(scenario: Scenario) -> str:
    """``drafter mtp, R=8192, 1 SWA group(s)``: what a scenario runs with."""
    drafter = scenario.drafter.kind.value
    retention = scenario.retention_interval_tokens
    kept = "dense" if retention is None else f"R={retention}"
    swa = len(scenario.sliding_window_groups)
    return f"drafter {drafter}, {kept}, {swa} SWA group(s)"


def changes_of(result: ScenarioResult, label: str) -> list[Change]:
    """The differences between the two variants of a :func:`compare_variants` result."""
    ra, rb = result.results
    a, b = ra.variant.name, rb.variant.name
    scenario = result.scenario
    out: list[Change] = []
    for side, other in ((ra, rb), (rb, ra)):
        if side.run.unsupported is not None and other.run.unsupported is None:
            out.append(
                Change(
                    ChangeKind.UNSUPPORTED,
                    f"{side.variant.name} lacks {side.run.unsupported}",
                    label,
                    None,
                    setting_text(scenario),
                    scenario.drafter.kind.value,
                )
            )
    if ra.run.unsupported is not None or rb.run.unsupported is not None:
        return out
    drafter = scenario.drafter.kind.value
    protection_a, protection_b = _protection(ra.run.settings), _protection(rb.run.settings)
    protection = (
        f"{protection_a} on both"
        if protection_a == protection_b
        else f"{protection_a} on {a}, {protection_b} on {b}"
    )
    for xa, xb in zip(ra.run.requests, rb.run.requests, strict=False):
        j = xa.index
        flags_a, flags_b = finding_kinds_at(ra, j), finding_kinds_at(rb, j)
        blocks = (
            f"cached by the request: {blocks_added_text(xa.retained_blocks_per_group)} on {a}; "
            f"{blocks_added_text(xb.retained_blocks_per_group)} on {b}"
        )
        extra = sum(xb.retained_blocks_per_group) - sum(xa.retained_blocks_per_group)
        if xa.hit_tokens != xb.hit_tokens:
            if bool(flags_a) == bool(flags_b):
                blame = (
                    f"the oracle flags both ({', '.join(flags_a)} / {', '.join(flags_b)})"
                    if flags_a
                    else "the oracle accepts both"
                )
            elif flags_a:
                blame = f"the oracle blames {a} ({', '.join(flags_a)})"
            else:
                blame = f"the oracle blames {b} ({', '.join(flags_b)})"
            direction = "higher" if xb.hit_tokens > xa.hit_tokens else "lower"
            out.append(
                Change(
                    ChangeKind.HITS,
                    f"{protection}: hits {direction} on {b}; {blame}",
                    label,
                    j,
                    f"hits {xa.hit_tokens} on {a}, {xb.hit_tokens} on {b} (tokens); "
                    f"{setting_text(scenario)}; {blocks}",
                    drafter,
                    extra,
                )
            )
            continue
        if xa.retained_blocks_per_group != xb.retained_blocks_per_group:
            out.append(
                Change(
                    ChangeKind.COST,
                    protection,
                    label,
                    j,
                    f"same hit {xa.hit_tokens} tokens; {setting_text(scenario)}; {blocks}",
                    drafter,
                    extra,
                )
            )
        for kind in sorted(set(flags_a) ^ set(flags_b)):
            owner = a if kind in flags_a else b
            out.append(
                Change(
                    ChangeKind.FINDINGS,
                    f"{kind} only on {owner} ({protection})",
                    label,
                    j,
                    f"hit {xa.hit_tokens} tokens on both; {setting_text(scenario)}",
                    drafter,
                )
            )
    plan = plan_change(result, a, b)
    if plan is not None:
        out.append(Change(ChangeKind.PLAN, plan[0], label, None, plan[1], drafter))
    return out


def plan_change(result: ScenarioResult, a: str, b: str) -> tuple[str, str] | None:
    """``(cause, detail)`` when the two variants of ``result`` (named ``a``
    and ``b`` in the detail) planned its model's KV cache otherwise
    (:meth:`~differential.observation.KVCachePlan.difference`), else ``None``
    (no model, or a plan not made)."""
    model = result.scenario.model
    plans = tuple(r.run.kv_cache_plan for r in result.results)
    if model is None or plans[0] is None or plans[1] is None:
        return None
    change = plans[0].difference(plans[1])
    if change is None:
        return None
    return (
        f"model {model.name!r} ({model.kv_cache_layout} layout)",
        f"pool of {plans[0].pool_blocks} blocks; {a} vs {b}: {change}",
    )

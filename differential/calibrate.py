"""The mutation table: which scenarios catch each calibration mutant.

An oracle that never fires is as useless as one that always does. Each
mutant (:data:`differential.variants.MUTANTS`) breaks one piece of vLLM's
behaviour on top of the ``fixed`` variant; a scenario *catches* it when the
mutant has findings there while ``fixed`` has none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from differential.compare import compare_variants
from differential.corpus import CorpusEntry, finding_tag
from differential.findings import Policy
from differential.variants import MUTANTS, parse_variants

__all__ = ["MutationRow", "mutation_table", "render_table"]


@dataclass(frozen=True)
class MutationRow:
    """One mutant and the scenarios that catch it.

    Attributes:
        mutant: the mutant variant's name.
        description: what it breaks.
        caught_by: ``(scenario file, finding tags)`` for each catching scenario.
        scenarios: how many scenarios were run.
    """

    mutant: str
    description: str
    caught_by: tuple[tuple[str, tuple[str, ...]], ...]
    scenarios: int


def mutation_table(
    entries: Sequence[CorpusEntry], mutants: Sequence[str] = MUTANTS
) -> tuple[tuple[MutationRow, ...], tuple[str, ...]]:
    """Run ``fixed`` and every mutant on every entry (``vllm`` policy).

    Returns:
        The rows, and the scenarios where ``fixed`` itself has findings (they
        cannot tell whether a mutant is caught and are left out).
    """
    variants = parse_variants(",".join(("fixed", *mutants)))
    caught: dict[str, list[tuple[str, tuple[str, ...]]]] = {m: [] for m in mutants}
    noisy: list[str] = []
    for entry in entries:
        result = compare_variants(entry.scenario, variants, policy=Policy.VLLM)
        by_variant = {vr.variant.name: vr.findings for vr in result.results}
        if by_variant["fixed"]:
            noisy.append(str(entry.path))
            continue
        for mutant in mutants:
            found = by_variant[mutant]
            if found:
                caught[mutant].append(
                    (str(entry.path), tuple(sorted({finding_tag(f) for f in found})))
                )
    rows = tuple(
        MutationRow(v.name, v.description, tuple(caught[v.name]), len(entries) - len(noisy))
        for v in variants[1:]
    )
    return rows, tuple(noisy)


def render_table(rows: Sequence[MutationRow], noisy: Sequence[str]) -> str:
    """The table as text: mutant, how many scenarios catch it, which."""
    lines = [f"{'mutant':<20} {'caught by':>10}  scenarios (finding kinds)"]
    for row in rows:
        lines.append(
            f"{row.mutant:<20} {len(row.caught_by):>4} / {row.scenarios:<4}  {row.description}"
        )
        for path, tags in row.caught_by:
            lines.append(f"{'':<20} {'':>10}  {path} ({', '.join(tags)})")
    for path in noisy:
        lines.append(f"note: {path} has findings on fixed itself and was left out")
    missed = [r.mutant for r in rows if not r.caught_by]
    lines.append("every mutant caught" if not missed else f"NOT caught: {', '.join(missed)}")
    return "\n".join(lines) + "\n"

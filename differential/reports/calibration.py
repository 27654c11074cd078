"""The mutation table: which scenarios catch each calibration mutant.

An oracle that never fires is as useless as one that always does. Each
mutant (:data:`differential.variants.MUTANTS`) breaks one piece of vLLM's
behaviour on top of its base variant (``fixed``, or ``candidate`` for the
mutants of the candidate fix); a scenario *catches* it when the mutant has
findings there while its base has none.
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
    """Run every mutant and its base on every entry (``vllm`` policy).

    Returns:
        The rows (``scenarios`` counts the entries where the mutant's base is
        clean), and ``"variant: file"`` for each entry where a base variant
        itself has findings (it cannot tell whether a mutant is caught there).
    """
    mutant_variants = parse_variants(",".join(mutants))
    bases = tuple(dict.fromkeys(v.base for v in mutant_variants))
    variants = parse_variants(",".join((*bases, *mutants)))
    caught: dict[str, list[tuple[str, tuple[str, ...]]]] = {m: [] for m in mutants}
    clean: dict[str, int] = dict.fromkeys(bases, 0)
    noisy: list[str] = []
    for entry in entries:
        result = compare_variants(entry.scenario, variants, policy=Policy.VLLM)
        by_variant = {vr.variant.name: vr.findings for vr in result.results}
        for base in bases:
            if by_variant[base]:
                noisy.append(f"{base}: {entry.path}")
            else:
                clean[base] += 1
        for mutant in mutant_variants:
            found = by_variant[mutant.name]
            if found and not by_variant[mutant.base]:
                caught[mutant.name].append(
                    (str(entry.path), tuple(sorted({finding_tag(f) for f in found})))
                )
    rows = tuple(
        MutationRow(v.name, v.description, tuple(caught[v.name]), clean[v.base])
        for v in mutant_variants
    )
    return rows, tuple(noisy)


def render_table(rows: Sequence[MutationRow], noisy: Sequence[str]) -> str:
    """The table as text: mutant, how many scenarios catch it, which."""
    width = max([26, *(len(r.mutant) + 1 for r in rows)])
    lines = [f"{'mutant':<{width}} {'caught by':>10}  scenarios (finding kinds)"]
    for row in rows:
        lines.append(
            f"{row.mutant:<{width}} {len(row.caught_by):>4} / {row.scenarios:<4}  {row.description}"
        )
        for path, tags in row.caught_by:
            lines.append(f"{'':<{width}} {'':>10}  {path} ({', '.join(tags)})")
    for where in noisy:
        variant, _, path = where.partition(": ")
        lines.append(f"note: {path} has findings on {variant} itself and was left out for it")
    missed = [r.mutant for r in rows if not r.caught_by]
    lines.append("every mutant caught" if not missed else f"NOT caught: {', '.join(missed)}")
    return "\n".join(lines) + "\n"

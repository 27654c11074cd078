"""A variant's identity: the value every floor reads.

:class:`Variant` says *what* runs (a name, a role in comparisons, the patch
or source tree behind it); the registry of named variants and the runners of
tree and release variants are :mod:`differential.variants`, and the driver
(:mod:`differential.driver`) says *how* a variant runs. Nothing here imports
another kvfuzz module.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["FixScope", "Variant", "VariantRole"]


class VariantRole(StrEnum):
    """How a variant takes part in comparisons.

    ``fixed`` variants are compared against every ``baseline`` variant (they
    must never hit less, and must agree outside the fix's domain); ``mutant``
    variants are judged by the oracle only.
    """

    BASELINE = "baseline"
    FIXED = "fixed"
    MUTANT = "mutant"


class FixScope(StrEnum):
    """What a ``fixed``-role variant changes, which decides where it may differ
    from a baseline and what extra blocks it may keep
    (:func:`differential.compare.compare_pair`).

    * ``seed-pr``: the seed PR: no drop for Gemma-4 MTP; periodic SWA tails
      ``A / B_swa`` blocks wider under the EAGLE drop with sparse periodic
      retention.
    * ``one-unit``: under sparse retention, the SWA tail one unit below every
      retained boundary (periodic, replay boundary, junction), any drafter.
    """

    SEED_PR = "seed-pr"
    ONE_UNIT = "one-unit"


@dataclass(frozen=True)
class Variant:
    """A version of vLLM's KV cache manager to run scenarios on.

    Attributes:
        name: the name used on the command line and in reports.
        description: one line for ``--help`` and reports.
        role: how the variant takes part in comparisons.
        patch: ``"module:function"`` of a zero-argument context manager factory
            that installs the variant around a run, or ``""`` for none.
        tree: for ``tree:PATH[@REF]`` variants, the folder holding that
            tree's ``vllm`` package (run in a worker process); else ``None``.
        timeout_s: per-scenario timeout for a tree variant's worker, in seconds.
        fix_scope: for ``fixed``-role variants, what the fix changes.
        base: for mutants, the variant the mutation is applied on top of
            (calibration compares the mutant with it).
        stock_when: ``"module:function"`` of a predicate ``(scenario,
            retention_interval_tokens) -> bool`` that holds when the
            variant's patches leave that run exactly as the installed vLLM
            runs it (``retention_interval_tokens``: the interval the run
            uses, ``None`` for the dense cross-check), so a comparison runs
            it once for both (:func:`differential.driver.runs_as_stock`);
            ``""``: never assumed.
    """

    name: str
    description: str
    role: VariantRole
    patch: str = ""
    tree: str | None = None
    timeout_s: float = 60.0
    fix_scope: FixScope = FixScope.SEED_PR
    base: str = "fixed"
    stock_when: str = ""

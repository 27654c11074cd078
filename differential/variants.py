"""Variants: named, pluggable versions of the KV cache manager under test.

A :class:`Variant` says *what* runs; the driver (:mod:`differential.driver`)
says *how*. Built in:

* ``unfixed`` -- the installed vLLM, as is.
* ``fixed`` -- the installed vLLM plus the seed PR's two changes
  (:mod:`differential.driver.fixes`).

New kinds of variant register a :class:`Variant` with :func:`register`; the
``patch`` is a ``"module:function"`` path to a context manager factory, so
this module never imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from differential.errors import VariantError

__all__ = ["DEFAULT_VARIANTS", "Variant", "known_variants", "parse_variants", "register"]


@dataclass(frozen=True)
class Variant:
    """A version of vLLM's KV cache manager to run scenarios on.

    Attributes:
        name: the name used on the command line and in reports.
        description: one line for ``--help`` and reports.
        carries_fix: whether the variant is expected to contain the seed fix
            (the comparison then checks it never hits less than an unfixed one).
        patch: ``"module:function"`` of a zero-argument context manager factory
            that installs the variant around a run, or ``""`` for none.
    """

    name: str
    description: str
    carries_fix: bool
    patch: str = ""


_REGISTRY: dict[str, Variant] = {}


def register(variant: Variant) -> None:
    """Make ``variant`` available by name (a later registration replaces)."""
    _REGISTRY[variant.name] = variant


register(Variant("unfixed", "the installed vLLM, unchanged", carries_fix=False))
register(
    Variant(
        "fixed",
        "the installed vLLM plus the seed PR's fix (no Gemma-4 MTP drop, "
        "periodic SWA tails A / B_swa blocks wider)",
        carries_fix=True,
        patch="differential.driver.fixes:seed_pr_fix",
    )
)

DEFAULT_VARIANTS = ("unfixed", "fixed")


def known_variants() -> tuple[str, ...]:
    """Names of every registered variant."""
    return tuple(_REGISTRY)


def parse_variants(text: str) -> tuple[Variant, ...]:
    """Parse a comma-separated list of variant names.

    Raises:
        VariantError: on an empty list, an unknown name or a repeated name.
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise VariantError(
            f"--variants is empty: allowed a comma-separated list of {', '.join(_REGISTRY)}"
        )
    variants: list[Variant] = []
    for name in names:
        if name not in _REGISTRY:
            raise VariantError(
                f"--variants: unknown variant {name!r}; allowed: {', '.join(_REGISTRY)}"
            )
        if any(v.name == name for v in variants):
            raise VariantError(f"--variants: {name!r} is listed twice")
        variants.append(_REGISTRY[name])
    return tuple(variants)

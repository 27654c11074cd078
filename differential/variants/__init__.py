"""Variants: named, pluggable versions of the KV cache manager under test.

A :class:`Variant` says *what* runs; the driver (:mod:`differential.driver`)
says *how*. Built in:

* ``unfixed`` -- the installed vLLM, as is.
* ``fixed`` -- the installed vLLM plus the seed PR's two changes
  (:mod:`differential.driver.fixes`).
* ``candidate`` -- ``fixed`` plus, under sparse retention, the SWA tail one
  alignment unit below every retained boundary, the fix kvfuzz proposes for
  the whole class (:mod:`differential.driver.candidate`).
* ``mutant-*`` -- ``fixed`` with one deliberate breakage, to prove the oracle
  catches it (:mod:`differential.driver.mutations`).
* ``tree:PATH[@REF]`` -- a vLLM source tree, run in a worker process
  (:mod:`differential.variants.tree`).
* ``release:X.Y.Z`` -- that vLLM release's wheel, fetched once and run as a
  tree (:mod:`differential.variants.releases`).

New kinds of variant register a :class:`Variant` with :func:`register`; the
``patch`` is a ``"module:function"`` path to a context manager factory, so
this module never imports vLLM.
"""

from __future__ import annotations

import hashlib
import re

from differential.errors import VariantError
from differential.variant import FixScope, Variant, VariantRole

__all__ = [
    "DEFAULT_VARIANTS",
    "MUTANTS",
    "FixScope",
    "Variant",
    "VariantRole",
    "file_label",
    "known_variants",
    "parse_variants",
    "register",
]


_REGISTRY: dict[str, Variant] = {}


def register(variant: Variant) -> None:
    """Make ``variant`` available by name (a later registration replaces)."""
    _REGISTRY[variant.name] = variant


register(Variant("unfixed", "the installed vLLM, unchanged", VariantRole.BASELINE))
register(
    Variant(
        "fixed",
        "the installed vLLM plus the seed PR's fix (no Gemma-4 MTP drop, "
        "periodic SWA tails A / B_swa blocks wider)",
        VariantRole.FIXED,
        patch="differential.driver.fixes:seed_pr_fix",
        stock_when="differential.driver.fix_probes:seed_pr_runs_as_stock",
    )
)
register(
    Variant(
        "candidate",
        "fixed plus, under sparse retention, the SWA tail one unit below every retained "
        "boundary (periodic, replay boundary, junction): each tail A / B_swa blocks wider "
        "under the drop, vLLM's tail moved A / B_swa blocks lower without it",
        VariantRole.FIXED,
        patch="differential.driver.candidate:candidate_fix",
        fix_scope=FixScope.ONE_UNIT,
        stock_when="differential.driver.fix_probes:candidate_runs_as_stock",
    )
)

for _name, _what, _base in (
    ("no-peek", "SWA tails kept as if there were no EAGLE peek block", "fixed"),
    ("double-drop", "the SWA lookup applies the EAGLE drop twice", "fixed"),
    ("no-junction", "get_computed_blocks never reports a shared-prefix junction", "candidate"),
    (
        "null-in-window",
        "get_computed_blocks hands out the null block inside the SWA window",
        "fixed",
    ),
    ("extra-block", "get_computed_blocks hands out the cached block past the hit", "fixed"),
    (
        "mamba-eagle-margin",
        "Mamba groups get the EAGLE margin back (their finder never drops)",
        "fixed",
    ),
    (
        "mamba-state-no-cow",
        "a running request writes its state into its own cached partial-tail state block",
        "fixed",
    ),
    (
        "mru-eviction",
        "freed cached blocks queued to be evicted first, not last (no LRU)",
        "fixed",
    ),
):
    register(
        Variant(
            f"mutant-{_name}",
            f"calibration mutant on top of {_base}: {_what}",
            VariantRole.MUTANT,
            patch=f"differential.driver.mutations:mutant_{_name.replace('-', '_')}",
            base=_base,
        )
    )

register(
    Variant(
        "mutant-no-replay-widening",
        "calibration mutant on top of candidate: only periodic SWA tails widened, "
        "not the replay-boundary and junction tails",
        VariantRole.MUTANT,
        patch="differential.driver.candidate:mutant_no_replay_widening",
        base="candidate",
    )
)

DEFAULT_VARIANTS = ("unfixed", "fixed")
MUTANTS = (
    "mutant-no-peek",
    "mutant-double-drop",
    "mutant-no-junction",
    "mutant-no-replay-widening",
    "mutant-null-in-window",
    "mutant-extra-block",
    "mutant-mamba-eagle-margin",
    "mutant-mamba-state-no-cow",
)


def known_variants() -> tuple[str, ...]:
    """Names of every registered variant."""
    return tuple(_REGISTRY)


_TREE_NAME = re.compile(r"tree:\S+")


def file_label(name: str) -> str:
    """``name`` (a variant or ``"a vs b"`` pair) with each tree path replaced by a short label.

    ``tree:PATH[@REF]`` becomes ``tree-`` plus 8 hex digits of the name's
    SHA-256 (stable across runs, short enough for any file name); other names
    are unchanged.
    """
    return _TREE_NAME.sub(
        lambda match: "tree-" + hashlib.sha256(match.group().encode()).hexdigest()[:8], name
    )


def parse_variants(text: str, *, timeout_s: float = 60.0) -> tuple[Variant, ...]:
    """Parse a comma-separated list of variant names.

    ``tree:PATH[@REF]`` names a vLLM source tree, ``release:X.Y.Z`` a vLLM
    release (its wheel fetched once into a cache folder, see
    :mod:`differential.variants.releases`); ``timeout_s`` is their per-scenario
    timeout, in seconds.

    Raises:
        VariantError: on an empty list, an unknown name or a repeated name,
            a tree without a ``vllm`` package, a release that cannot be fetched.
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise VariantError(
            f"--variants is empty: allowed a comma-separated list of {', '.join(_REGISTRY)}"
        )
    variants: list[Variant] = []
    for name in names:
        if name.startswith("tree:"):
            from differential.variants.tree import resolve_tree

            path = resolve_tree(name.removeprefix("tree:"))
            if any(v.name == name for v in variants):
                raise VariantError(f"--variants: {name!r} is listed twice")
            variants.append(
                Variant(
                    name,
                    f"the vLLM source tree at {path}",
                    VariantRole.BASELINE,
                    tree=str(path),
                    timeout_s=timeout_s,
                )
            )
            continue
        if name.startswith("release:"):
            from differential.variants.releases import release_tree

            version = name.removeprefix("release:")
            if any(v.name == name for v in variants):
                raise VariantError(f"--variants: {name!r} is listed twice")
            path = release_tree(version)
            variants.append(
                Variant(
                    name,
                    f"vLLM {version}, the release's wheel unpacked at {path}",
                    VariantRole.BASELINE,
                    tree=str(path),
                    timeout_s=timeout_s,
                )
            )
            continue
        if name not in _REGISTRY:
            raise VariantError(
                f"--variants: unknown variant {name!r}; allowed: {', '.join(_REGISTRY)}, "
                "tree:PATH[@REF] for a vLLM source tree, or release:X.Y.Z for a vLLM release"
            )
        if any(v.name == name for v in variants):
            raise VariantError(f"--variants: {name!r} is listed twice")
        variants.append(_REGISTRY[name])
    return tuple(variants)

"""kvfuzz's differential core: scenarios, the oracle, variants and comparison.

Importing this package does not import vLLM; :mod:`differential.driver` does.
The names below are imported when first used (``from differential import
Scenario``), so that importing a submodule alone (the ``kvfuzz`` command
line, a worker) does not load the oracle and the comparison first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from differential.compare import ScenarioResult, compare_variants
    from differential.errors import InternalError, ScenarioError, VariantError
    from differential.findings import Finding, FindingKind, Policy
    from differential.scenario import (
        Drafter,
        DrafterKind,
        GroupKind,
        KVCacheGroup,
        RequestSpec,
        Scenario,
    )
    from differential.variants import Variant, VariantRole, parse_variants

__all__ = [
    "Drafter",
    "DrafterKind",
    "Finding",
    "FindingKind",
    "GroupKind",
    "InternalError",
    "KVCacheGroup",
    "Policy",
    "RequestSpec",
    "Scenario",
    "ScenarioError",
    "ScenarioResult",
    "Variant",
    "VariantError",
    "VariantRole",
    "compare_variants",
    "parse_variants",
]

# Each public name -> the module it is defined in.
_HOMES = {
    "ScenarioResult": "differential.compare",
    "compare_variants": "differential.compare",
    "InternalError": "differential.errors",
    "ScenarioError": "differential.errors",
    "VariantError": "differential.errors",
    "Finding": "differential.findings",
    "FindingKind": "differential.findings",
    "Policy": "differential.findings",
    "Drafter": "differential.scenario",
    "DrafterKind": "differential.scenario",
    "GroupKind": "differential.scenario",
    "KVCacheGroup": "differential.scenario",
    "RequestSpec": "differential.scenario",
    "Scenario": "differential.scenario",
    "Variant": "differential.variants",
    "VariantRole": "differential.variants",
    "parse_variants": "differential.variants",
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use.

    Raises:
        AttributeError: not a public name of the package (a submodule is
            then imported by the import system itself).
    """
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'differential' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value

"""kvfuzz's differential core: scenarios, the oracle, variants and comparison.

Importing this package does not import vLLM; :mod:`differential.driver` does.
"""

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

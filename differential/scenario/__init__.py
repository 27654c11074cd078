"""The scenario model: one reproducible prefix-caching experiment.

:class:`Scenario` is a frozen value (KV cache groups, prefix-cache settings,
drafter, workload, requests) with a versioned JSON form. The package does not
import vLLM. Submodules: :mod:`.model` (the scenario value and its
validation), :mod:`.bounds` (what a scenario costs to run, and the limits),
:mod:`.models` (model descriptions for model-level scenarios).
"""

from differential.scenario.model import (
    SCENARIO_FORMAT,
    SCENARIO_VERSION,
    Drafter,
    DrafterKind,
    DraftGroups,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    MambaPrefill,
    RequestSpec,
    Scenario,
    Workload,
)

__all__ = [
    "SCENARIO_FORMAT",
    "SCENARIO_VERSION",
    "DraftGroups",
    "Drafter",
    "DrafterKind",
    "DriveMode",
    "GroupKind",
    "KVCacheGroup",
    "MambaPrefill",
    "RequestSpec",
    "Scenario",
    "Workload",
]

"""The scenario model: one reproducible prefix-caching experiment.

:class:`Scenario` is a frozen value (KV cache groups, prefix-cache settings,
drafter, workload, requests) with a versioned JSON form. The package does not
import vLLM. Its modules:

* :mod:`.model`: the scenario value and what it derives (block sizes, hit
  alignment, draft groups, prompts);
* :mod:`.multimodal`: where each request's images lie, and the content ids
  the oracle compares (token, image, cache salt);
* :mod:`.groups`, :mod:`.drafter`, :mod:`.workload`: its parts;
* :mod:`.rules`: the rules between fields, split by concern;
* :mod:`.json_form`: the JSON form on pydantic (field docs and units,
  parsing, the canonical form, the published JSON Schema);
* :mod:`.bounds`: what a scenario costs to run, and the limits;
* :mod:`.models`: model descriptions for model-level scenarios.

Every invalid scenario raises :class:`~differential.errors.ScenarioError`
naming the field path and the allowed values.
"""

from differential.scenario.model import (
    MM_PLACEHOLDER_TOKEN_ID,
    SCENARIO_FORMAT,
    SCENARIO_VERSION,
    ConnectorLoad,
    ConnectorStore,
    Drafter,
    DrafterKind,
    DraftGroups,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    KVEvents,
    KVEventsView,
    KVRole,
    LoadFailurePolicy,
    MambaPrefill,
    MultiModalInput,
    PlacedInput,
    RequestSpec,
    Scenario,
    Workload,
)

__all__ = [
    "MM_PLACEHOLDER_TOKEN_ID",
    "SCENARIO_FORMAT",
    "SCENARIO_VERSION",
    "ConnectorLoad",
    "ConnectorStore",
    "DraftGroups",
    "Drafter",
    "DrafterKind",
    "DriveMode",
    "GroupKind",
    "KVCacheGroup",
    "KVEvents",
    "KVEventsView",
    "KVRole",
    "LoadFailurePolicy",
    "MambaPrefill",
    "MultiModalInput",
    "PlacedInput",
    "RequestSpec",
    "Scenario",
    "Workload",
]

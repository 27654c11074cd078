"""Prefix-cache features a vLLM release may lack, and what a scenario means without them.

The driver detects each :class:`Feature` from the running vLLM's own code, once
per process (:func:`differential.driver.features.detect`). A scenario either
runs with the settings that release had for the same intent, or is reported
*unsupported*, naming the missing piece (:data:`DESCRIPTIONS`).

Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import StrEnum

from differential.errors import ScenarioError
from differential.scenario import DrafterKind, Scenario

__all__ = ["DESCRIPTIONS", "Feature", "Unsupported", "equivalent_scenario"]


class Unsupported(Exception):
    """The running vLLM cannot run the scenario: the run is *unsupported*.

    Neither a finding nor kvfuzz's failure: the scenario costs that one run
    (the run's ``unsupported`` field), and the replay or campaign goes on.

    Attributes:
        reason: what is missing or refused, naming the vLLM piece and its
            file (repository path), e.g. ``"SlidingWindowSpec.extra_retained_tokens
            (vllm/v1/kv_cache_interface.py)"``.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class Feature(StrEnum):
    """A prefix-cache feature of vLLM the driver uses or the oracle models."""

    SCHEDULER_BLOCK_SIZE = "scheduler_block_size"
    PREFILL_LOOKAHEAD = "prefill_lookahead"
    PREFILL_LOOKAHEAD_CONFIG = "prefill_lookahead_config"
    LOOKAHEAD_SLOTS_CONFIG = "lookahead_slots_config"
    EAGLE_BLOCK_DROP_CONFIG = "eagle_block_drop_config"
    NEEDS_EAGLE_BLOCK_DROP = "needs_eagle_block_drop"
    LOOKAHEAD_HASHES = "lookahead_hashes"
    RETENTION_INTERVAL = "retention_interval"
    EXTRA_RETAINED_TOKENS = "extra_retained_tokens"
    JUNCTION_PINNING = "junction_pinning"
    REPLAY_BOUNDARIES = "replay_boundaries"


#: The piece of vLLM each feature is detected by (vLLM repository paths).
DESCRIPTIONS: dict[Feature, str] = {
    Feature.SCHEDULER_BLOCK_SIZE: "KVCacheManager(scheduler_block_size=, hash_block_size=) "
    "(vllm/v1/core/kv_cache_manager.py)",
    Feature.PREFILL_LOOKAHEAD: "KVCacheManager(num_prefill_lookahead=) and "
    "Scheduler._reserve_prefill_lookahead (vllm/v1/core/sched/scheduler.py)",
    Feature.PREFILL_LOOKAHEAD_CONFIG: "VllmConfig.num_prefill_lookahead_tokens "
    "(vllm/config/vllm.py; older releases computed it inside Scheduler.__init__)",
    Feature.LOOKAHEAD_SLOTS_CONFIG: "VllmConfig.num_lookahead_tokens (vllm/config/vllm.py)",
    Feature.EAGLE_BLOCK_DROP_CONFIG: "SpeculativeConfig.disable_eagle_block_drop / "
    "use_eagle_block_drop (vllm/config/speculative.py)",
    Feature.NEEDS_EAGLE_BLOCK_DROP: "SpeculativeConfig.needs_eagle_block_drop "
    "(vllm/config/speculative.py)",
    Feature.LOOKAHEAD_HASHES: "lookahead block hashes: VllmConfig.num_hash_lookahead_tokens, "
    "KVCacheManager(num_hash_lookahead_tokens=), get_request_block_hasher(..., "
    "num_hash_lookahead_tokens) (vllm/config/vllm.py, vllm/v1/core/kv_cache_utils.py)",
    Feature.RETENTION_INTERVAL: "KVCacheConfig.prefix_cache_retention_interval "
    "(vllm/v1/kv_cache_interface.py)",
    Feature.EXTRA_RETAINED_TOKENS: "SlidingWindowSpec.extra_retained_tokens "
    "(vllm/v1/kv_cache_interface.py)",
    Feature.JUNCTION_PINNING: "get_computed_blocks returning the shared_prefix_boundary "
    "(vllm/v1/core/kv_cache_manager.py)",
    Feature.REPLAY_BOUNDARIES: "replay_boundaries (vllm/v1/core/kv_cache_coordinator.py)",
}


def equivalent_scenario(scenario: Scenario, features: Mapping[str, bool]) -> Scenario:
    """The scenario a release with ``features`` runs for ``scenario``'s intent.

    A release without lookahead block hashes protects a drafter that reads
    ahead with the EAGLE block drop alone (as every release did before
    ``VllmConfig.num_hash_lookahead_tokens``): the scenario then means the
    same one with ``disable_lookahead_block_hashes`` set, and the oracle judges
    it so. Everything else is unchanged; a missing feature that has no
    equivalent makes the scenario *unsupported* instead (see the driver).

    Args:
        scenario: the scenario as written.
        features: feature name -> present, as detected in the release
            (a feature not listed counts as present).

    Raises:
        Unsupported: the equivalent is a scenario kvfuzz refuses (e.g.
            chunked local attention, where the drop the drafter falls back
            to is refused: vLLM's ``ChunkedLocalAttentionManager`` does not
            support EAGLE, vllm/v1/core/single_type_kv_cache_manager.py);
            the reason names the missing feature and the refusal.
    """
    if (
        not features.get(Feature.LOOKAHEAD_HASHES.value, True)
        and scenario.drafter.kind is not DrafterKind.NONE
        and not scenario.disable_lookahead_block_hashes
    ):
        try:
            return dataclasses.replace(scenario, disable_lookahead_block_hashes=True)
        except ScenarioError as refused:
            # The advice after "): " speaks of the scenario as written.
            head, sep, _advice = refused.allowed.partition("): ")
            allowed = head + ")" if sep else refused.allowed
            raise Unsupported(
                f"{DESCRIPTIONS[Feature.LOOKAHEAD_HASHES]}; without them the drafter "
                f"takes the EAGLE block drop, and then {refused.field} = {refused.value!r} "
                f"is refused: allowed {allowed}"
            ) from None
    return scenario

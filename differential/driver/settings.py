"""Resolve a scenario's drafter into manager settings with vLLM's own config code.

Nothing here re-derives vLLM's rules: a real ``SpeculativeConfig`` instance and
a ``VllmConfig`` instance are created without running their model-loading
validators (no model weights, no hub access), given exactly the fields the
prefix-cache logic reads, and then asked. So a change to
``SpeculativeConfig.use_eagle_block_drop`` or ``VllmConfig.num_hash_lookahead_tokens``
in vLLM moves kvfuzz's results too.

vLLM code modelled: ``vllm/config/speculative.py`` (``use_eagle``,
``needs_eagle_block_drop``, ``use_eagle_block_drop``, ``use_gemma4_mtp``,
``use_multi_module_mtp``), ``vllm/config/vllm.py`` (``num_lookahead_tokens``,
``num_prefill_lookahead_tokens``, ``num_hash_lookahead_tokens``) and
``vllm/v1/core/sched/scheduler.py`` ``Scheduler.__init__`` (lookahead hashes
clear the drop).

A release without lookahead hashes (``VllmConfig.num_hash_lookahead_tokens``)
hashes 0 tokens ahead and keeps the drop, as its scheduler did; one without
``SpeculativeConfig.use_eagle_block_drop`` drops whenever ``use_eagle()``
(and cannot honour ``disable_eagle_block_drop``). Features are detected once
per process (:mod:`differential.driver.features`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from vllm.config import CacheConfig, SpeculativeConfig, VllmConfig
from vllm.config.kv_transfer import KVTransferConfig

from differential.capabilities import Feature
from differential.driver.features import UnsupportedFeature, has, vllm_build, vllm_call
from differential.scenario import DrafterKind, Scenario

__all__ = ["ResolvedDrafter", "resolve_drafter"]

# SpeculativeConfig.method and draft model type per drafter kind.
_METHOD: dict[DrafterKind, tuple[str, str | None]] = {
    DrafterKind.EAGLE: ("eagle", "eagle"),
    DrafterKind.EAGLE3: ("eagle3", "eagle"),
    DrafterKind.MTP: ("mtp", "deepseek_mtp"),
    DrafterKind.MULTI_MODULE_MTP: ("mtp", "deepseek_mtp"),
    DrafterKind.GEMMA4_MTP: ("mtp", "gemma4_mtp"),
    DrafterKind.DFLASH: ("dflash", "dflash"),
    DrafterKind.DSPARK: ("dspark", "dspark"),
    DrafterKind.DRAFT_MODEL: ("draft_model", "llama"),
    DrafterKind.NGRAM: ("ngram", None),
}


@dataclass(frozen=True)
class ResolvedDrafter:
    """Settings the scheduler would hand the KV cache manager.

    Attributes:
        use_eagle_block_drop: ``use_eagle`` for ``KVCacheManager``.
        num_hash_lookahead_tokens: tokens each block hash also covers.
        num_lookahead_tokens: slots, in tokens, reserved past each allocation.
        num_prefill_lookahead_tokens: prefill tokens the drafter reads ahead.
    """

    use_eagle_block_drop: bool
    num_hash_lookahead_tokens: int
    num_lookahead_tokens: int
    num_prefill_lookahead_tokens: int


def _speculative_config(scenario: Scenario) -> SpeculativeConfig | None:
    drafter = scenario.drafter
    if drafter.kind is DrafterKind.NONE:
        return None
    method, model_type = _METHOD[drafter.kind]
    modules = drafter.num_speculative_tokens if drafter.kind is DrafterKind.MULTI_MODULE_MTP else 1
    draft_model_config: Any = None
    if model_type is not None:
        draft_model_config = SimpleNamespace(
            model=f"kvfuzz/{drafter.kind.value}",
            architectures=[],
            hf_config=SimpleNamespace(
                model_type=model_type,
                num_nextn_predict_layers=modules,
                sample_from_anchor=True,
            ),
        )
    # A real instance, built without its validators (they load models).
    config = object.__new__(SpeculativeConfig)
    fields = {
        "method": method,
        "num_speculative_tokens": drafter.num_speculative_tokens,
        "num_speculative_tokens_per_batch_size": None,
        "disable_eagle_block_drop": scenario.disable_eagle_block_drop,
        "disable_lookahead_block_hashes": scenario.disable_lookahead_block_hashes,
        "parallel_drafting": False,
        "draft_model_config": draft_model_config,
    }
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    return config


def _kv_transfer_config(kv_connector: bool) -> KVTransferConfig | None:
    """vLLM's ``KVTransferConfig`` for a scenario with a KV connector (its
    bundled ``ExampleConnector``, both roles), else ``None``."""
    if not kv_connector:
        return None
    return vllm_build(
        "KVTransferConfig",
        "vllm/config/kv_transfer.py",
        KVTransferConfig,
        kv_connector="ExampleConnector",
        kv_role="kv_both",
    )


def resolve_drafter(scenario: Scenario) -> ResolvedDrafter:
    """Ask vLLM's config classes how the scenario's drafter reaches the manager.

    Raises:
        VllmCallError: one of vLLM's config calls raised (named in the error).
        UnsupportedFeature: the scenario disables the EAGLE drop and the
            release has no ``disable_eagle_block_drop``.
        Unsupported: a config class does not take an argument, or refuses it.
    """
    speculative = _speculative_config(scenario)
    vllm_config = object.__new__(VllmConfig)
    view = {
        "speculative_config": speculative,
        "cache_config": vllm_build(
            "CacheConfig", "vllm/config/cache.py", CacheConfig, enable_prefix_caching=True
        ),
        "kv_transfer_config": _kv_transfer_config(scenario.kv_connector),
        "diffusion_config": None,
    }
    for name, value in view.items():
        object.__setattr__(vllm_config, name, value)

    use_drop = False
    if speculative is not None:
        if has(Feature.EAGLE_BLOCK_DROP_CONFIG):
            use_drop = vllm_call(
                "SpeculativeConfig.use_eagle_block_drop", speculative.use_eagle_block_drop
            )
        elif scenario.disable_eagle_block_drop:
            raise UnsupportedFeature(Feature.EAGLE_BLOCK_DROP_CONFIG)
        else:
            use_drop = vllm_call("SpeculativeConfig.use_eagle", speculative.use_eagle)
    num_hash_lookahead = 0
    if has(Feature.LOOKAHEAD_HASHES):
        num_hash_lookahead = vllm_call(
            "VllmConfig.num_hash_lookahead_tokens",
            lambda: vllm_config.num_hash_lookahead_tokens,
        )
    if num_hash_lookahead:
        # Scheduler.__init__: lookahead hashes prove the boundary token.
        use_drop = False
    if not has(Feature.LOOKAHEAD_SLOTS_CONFIG):
        raise UnsupportedFeature(Feature.LOOKAHEAD_SLOTS_CONFIG)
    num_prefill_lookahead = 0  # no drafter: nothing read ahead
    if speculative is not None:
        if not has(Feature.PREFILL_LOOKAHEAD_CONFIG):
            raise UnsupportedFeature(Feature.PREFILL_LOOKAHEAD_CONFIG)
        num_prefill_lookahead = vllm_call(
            "VllmConfig.num_prefill_lookahead_tokens",
            lambda: vllm_config.num_prefill_lookahead_tokens,
        )
    return ResolvedDrafter(
        use_eagle_block_drop=use_drop,
        num_hash_lookahead_tokens=num_hash_lookahead,
        num_lookahead_tokens=vllm_call(
            "VllmConfig.num_lookahead_tokens", lambda: vllm_config.num_lookahead_tokens
        ),
        num_prefill_lookahead_tokens=num_prefill_lookahead,
    )

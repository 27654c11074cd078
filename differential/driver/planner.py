"""Model-level scenarios: vLLM's own KV cache planner turns a model into groups.

A model-level scenario names a :class:`~differential.scenario.models.ModelDescription`
instead of listing KV cache groups. Here each layer becomes the
``KVCacheSpec`` its attention layer would report
(``AttentionLayerBase.get_kv_cache_spec``: ``FullAttentionSpec``,
``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``, ``MLAAttentionSpec``,
``SlidingWindowMLASpec``, ``MambaSpec``; draft layers with ``is_draft``;
hidden-state layers ``HiddenStateCacheSpec``, planned as MLA groups of their
own, which vLLM manages as full attention), and
vLLM's planner, called as the engine core calls it, decides the layout:

* ``get_global_kv_cache_groups`` (vllm/v1/core/kv_cache_planning.py) merges
  the workers' specs, tags sliding windows with the multi-module MTP
  ``extra_retained_tokens``, groups the layers through the platform's
  ``KVCacheConfigBuilder`` -- ``get_kv_cache_groups``, which unifies page
  sizes (``unify_kv_cache_spec_page_size``: smaller pages get larger block
  sizes) or packs mixed pages for block-outermost layouts
  (``_get_packed_kv_cache_groups``), then splits layers into groups of equal
  size (``_get_kv_cache_groups_uniform_page_size``) -- and marks the groups
  holding draft layers ``is_eagle_group`` when the drafter takes the EAGLE
  drop;
* ``resolve_kv_cache_block_sizes`` (vllm/v1/core/kv_cache_utils.py) chooses
  the scheduler block size (LCM of the group block sizes) and the hash block
  size (their GCD);
* ``get_kv_cache_coordinator`` (vllm/v1/core/kv_cache_coordinator.py) builds
  the coordinator, whose ``_cache_hit_alignment_tokens`` is the hit alignment.

The ``VllmConfig`` is built offline: a real instance created without its
model-loading validators (no weights, no hub access), holding a real
``CacheConfig`` (``block_size``, prefix caching on, the description's
``kv_cache_layout``), ``ParallelConfig`` and ``SchedulerConfig``, the
scenario's ``SpeculativeConfig`` (as :mod:`differential.driver.settings`
builds it) and a model config stub saying the model declares no grouping of
its own (``supports_kv_cache_grouping`` false: vLLM's default grouping).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.v1 import kv_cache_interface
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from differential.driver.features import VllmCallError, quiet_vllm_logging, vllm_call
from differential.driver.settings import _kv_transfer_config, _speculative_config, resolve_drafter
from differential.driver.specs import pool_blocks, spec_for_kind
from differential.errors import InternalError, ScenarioError
from differential.observation import KVCachePlan, PlannedGroup, PlannedTensor, RunObservation
from differential.scenario import GroupKind, KVCacheGroup, Scenario
from differential.scenario.models import LayerSpec, ModelDescription, model_scenario_parts

__all__ = [
    "PlannedLayout",
    "layer_specs",
    "observe_kv_cache_plan",
    "plan_model",
    "resolve_model_scenario",
    "with_kv_cache_plan",
]


@dataclass(frozen=True)
class PlannedLayout:
    """The KV cache layout vLLM's planner chose for a model.

    Attributes:
        model: the description's name.
        groups: the KV cache groups, in vLLM's order, as scenario groups
            (kind, block size in tokens, window or chunk in tokens, draft mark).
        layers_per_group: how many layers each group holds.
        scheduler_block_size_tokens: ``resolve_kv_cache_block_sizes``'s
            scheduler block size, in tokens.
        hash_block_size_tokens: its hash block size, in tokens.
        hit_alignment_tokens: the coordinator's hit alignment, in tokens.
    """

    model: str
    groups: tuple[KVCacheGroup, ...]
    layers_per_group: tuple[int, ...]
    scheduler_block_size_tokens: int
    hash_block_size_tokens: int
    hit_alignment_tokens: int

    def describe(self) -> str:
        """One line per group and one for the sizes, for ``kvfuzz replay``."""
        lines = [f"vLLM's planner laid out model {self.model!r} in {len(self.groups)} group(s):"]
        for i, (g, n) in enumerate(zip(self.groups, self.layers_per_group, strict=True)):
            extra = ""
            if g.sliding_window_tokens is not None:
                extra = f", window {g.sliding_window_tokens}"
            if g.attention_chunk_size_tokens is not None:
                extra = f", chunk {g.attention_chunk_size_tokens}"
            draft = " (is_eagle_group)" if g.is_eagle_group else ""
            lines.append(
                f"  group {i}: {g.kind.value}, block {g.block_size_tokens} tokens{extra}, "
                f"{n} layer(s){draft}"
            )
        lines.append(
            f"  scheduler block {self.scheduler_block_size_tokens}, hash block "
            f"{self.hash_block_size_tokens}, hit alignment {self.hit_alignment_tokens} tokens"
        )
        return "\n".join(lines)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)  # names checked by ModelDescription


def _layer_spec(model: ModelDescription, layer: LayerSpec, num_spec_tokens: int) -> KVCacheSpec:
    """The spec one layer reports (``get_kv_cache_spec`` of its attention layer)."""
    block = layer.block_size_tokens or model.block_size_tokens
    if layer.kind is GroupKind.MAMBA:
        # MambaBase.get_kv_cache_spec in align mode (prefix caching).
        return vllm_call(
            "MambaSpec",
            MambaSpec,
            block_size=layer.block_size_tokens
            or model.mamba_block_size_tokens
            or model.block_size_tokens,
            shapes=layer.mamba_state_shapes,
            dtypes=tuple(_dtype(d) for d in layer.mamba_state_dtypes),
            mamba_cache_mode="align",
            num_speculative_blocks=num_spec_tokens,
        )
    common: dict[str, Any] = {
        "block_size": block,
        "num_kv_heads": layer.num_kv_heads,
        "head_size": layer.head_size,
        "dtype": _dtype(layer.dtype),
        "is_draft": layer.draft,
    }
    if layer.tokens_per_state != 1:
        common["tokens_per_state"] = layer.tokens_per_state
    if layer.hidden_state:
        # CacheOnlyAttentionLayer.get_kv_cache_spec
        # (vllm/model_executor/models/extract_hidden_states.py).
        hidden = getattr(kv_cache_interface, "HiddenStateCacheSpec", None)
        if hidden is None:
            raise ScenarioError(
                "model.layers.hidden_state", True, "false (this vLLM has no HiddenStateCacheSpec)"
            )
        return vllm_call("HiddenStateCacheSpec", hidden, **common)
    if layer.kind in (GroupKind.MLA, GroupKind.SLIDING_WINDOW_MLA) and _has_field(
        "MLAAttentionSpec", "max_tp_shards"
    ):
        # The latent cache is one per token whatever the TP size: every rank
        # holds all of it (MLAAttention.get_kv_cache_spec, mla_attention.py;
        # the sparse SWA backend's SlidingWindowMLASpec, sparse_swa.py).
        common["max_tp_shards"] = 1
    return spec_for_kind(
        layer.kind,
        window=layer.sliding_window_tokens,
        chunk=layer.attention_chunk_size_tokens,
        **common,
    )


def _has_field(spec: str, field: str) -> bool:
    """Whether this vLLM's spec class ``spec`` takes ``field``."""
    cls = getattr(kv_cache_interface, spec, None)
    return cls is not None and field in {f.name for f in dataclasses.fields(cls)}


def layer_specs(model: ModelDescription, num_spec_tokens: int = 0) -> dict[str, KVCacheSpec]:
    """Layer name -> spec for every layer (target ``model.layers.N``, drafter
    ``drafter.layers.N``), ``num_spec_tokens`` speculative Mamba blocks."""
    built = {id(layer): _layer_spec(model, layer, num_spec_tokens) for layer in model.layers}
    return {name: built[id(layer)] for name, layer in model.named_layers()}


def _check_mamba_page(model: ModelDescription, specs: Mapping[str, KVCacheSpec]) -> None:
    """Refuse a hybrid whose attention page cannot hold a Mamba state.

    vLLM never plans one: ``Platform._align_hybrid_block_size``
    (vllm/platforms/interface.py) raises ``cache_config.block_size`` until
    the target's attention page (its first attention layer at the cache
    block size) covers the largest Mamba page, then pads the Mamba page to
    it. A description names the block an engine runs with, so a smaller one
    is refused here, naming the smallest block (in tokens) that covers the
    state, not left to fail in ``unify_kv_cache_spec_page_size``.

    Raises:
        ScenarioError: naming ``model.block_size_tokens``.
    """
    mamba = [s.page_size_bytes for s in specs.values() if isinstance(s, MambaSpec)]
    layer = next(
        (
            layer
            for layer in model.layers
            if not layer.draft
            and not layer.hidden_state
            and layer.kind.full_attention_family
            and layer.block_size_tokens is None
        ),
        None,
    )
    attention = None if layer is None else _layer_spec(model, layer, 0)
    if not mamba or attention is None or attention.page_size_bytes >= max(mamba):
        return
    per_token = attention.page_size_bytes // model.block_size_tokens
    raise ScenarioError(
        "model.block_size_tokens",
        model.block_size_tokens,
        f"at least {-(-max(mamba) // per_token)} tokens: the attention page "
        f"({per_token} bytes a token) must hold the largest Mamba state ({max(mamba)} bytes); "
        "vLLM's _align_hybrid_block_size raises the block to a kernel-aligned size that does",
    )


def _vllm_config(model: ModelDescription, settings: Scenario) -> VllmConfig:
    cache = vllm_call(
        "CacheConfig",
        CacheConfig,
        block_size=model.block_size_tokens,
        enable_prefix_caching=True,
    )
    cache.kv_cache_layout = model.kv_cache_layout
    config = object.__new__(VllmConfig)
    fields: dict[str, Any] = {
        "cache_config": cache,
        "parallel_config": vllm_call(
            "ParallelConfig", ParallelConfig, tensor_parallel_size=model.tensor_parallel_size
        ),
        "scheduler_config": vllm_call(
            "SchedulerConfig", SchedulerConfig, max_model_len=1 << 20, is_encoder_decoder=False
        ),
        "speculative_config": _speculative_config(settings),
        "kv_transfer_config": _kv_transfer_config(settings.kv_connector),
        "attention_config": None,
        "diffusion_config": None,
        "model_config": SimpleNamespace(supports_kv_cache_grouping=False),
    }
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    return config


# CircularBufferSpec (vLLM 0.33.0; a release without it plans no ring).
_RING: tuple[tuple[type[KVCacheSpec], GroupKind], ...] = tuple(
    (cls, GroupKind.CIRCULAR_BUFFER)
    for cls in (getattr(kv_cache_interface, "CircularBufferSpec", None),)
    if cls is not None
)

# RSWASpec (vLLM 0.33.0), a FullAttentionSpec subclass: matched before it.
_RSWA: tuple[tuple[type[KVCacheSpec], GroupKind], ...] = tuple(
    (cls, GroupKind.RSWA)
    for cls in (getattr(kv_cache_interface, "RSWASpec", None),)
    if cls is not None
)

_KINDS: tuple[tuple[type[KVCacheSpec], GroupKind], ...] = (
    *_RING,
    *_RSWA,
    (SlidingWindowMLASpec, GroupKind.SLIDING_WINDOW_MLA),
    (SlidingWindowSpec, GroupKind.SLIDING_WINDOW),
    (ChunkedLocalAttentionSpec, GroupKind.CHUNKED_LOCAL_ATTENTION),
    (MLAAttentionSpec, GroupKind.MLA),
    (MambaSpec, GroupKind.MAMBA),
    (FullAttentionSpec, GroupKind.FULL_ATTENTION),
)


def _scenario_group(group: KVCacheGroupSpec) -> KVCacheGroup:
    """A vLLM group as a scenario group (the first layer's spec decides the
    kind, window and chunk; the group spec the block size)."""
    spec = group.kv_cache_spec
    layer = (
        next(iter(spec.kv_cache_specs.values()))
        if isinstance(spec, UniformTypeKVCacheSpecs)
        else spec
    )
    kind = next((k for cls, k in _KINDS if isinstance(layer, cls)), None)
    if kind is None:
        raise ScenarioError("model.layers", type(layer).__name__, "layers whose spec kvfuzz models")
    return KVCacheGroup(
        kind,
        spec.block_size,
        getattr(layer, "sliding_window", None)
        if kind.sliding_window_family
        else getattr(layer, "rswa_window", None)
        if kind is GroupKind.RSWA
        else None,
        getattr(layer, "attention_chunk_size", None)
        if kind is GroupKind.CHUNKED_LOCAL_ATTENTION
        else None,
        bool(group.is_eagle_group),
    )


def _managed_group(group: KVCacheGroupSpec) -> KVCacheGroupSpec:
    spec = group.kv_cache_spec
    if not isinstance(spec, UniformTypeKVCacheSpecs):
        return group
    first = replace(spec.first_spec, block_size=spec.block_size)
    return KVCacheGroupSpec(group.layer_names, first, is_eagle_group=group.is_eagle_group)


def plan_model(model: ModelDescription, settings: Scenario) -> PlannedLayout:
    """Ask vLLM's planner for ``model``'s KV cache layout.

    ``settings`` supplies the drafter, its switches and the KV connector
    (its groups are ignored).

    Raises:
        VllmCallError: one of vLLM's planning calls raised (vLLM refuses the
            model's layout), naming the call.
        ScenarioError: a group holds a spec kvfuzz does not model; a Mamba
            hybrid's block too small for its state (``model.block_size_tokens``).
    """
    quiet_vllm_logging()
    config = _vllm_config(model, settings)
    specs = layer_specs(model, settings.drafter.num_speculative_tokens)
    _check_mamba_page(model, specs)
    groups = vllm_call("get_global_kv_cache_groups", get_global_kv_cache_groups, config, [specs])
    kv_config = vllm_call(
        "KVCacheConfig", KVCacheConfig, num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups
    )
    scheduler_block, hash_block = vllm_call(
        "resolve_kv_cache_block_sizes", resolve_kv_cache_block_sizes, kv_config, config
    )
    # The coordinator's managers are looked up per spec class; a packed
    # group (UniformTypeKVCacheSpecs, block-outermost layouts) has no manager
    # of its own in the registry, so it is handed over as its first layer's
    # spec at the group's block size.
    managed = vllm_call(
        "KVCacheConfig",
        KVCacheConfig,
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[_managed_group(g) for g in groups],
    )
    coordinator = vllm_call(
        "get_kv_cache_coordinator",
        get_kv_cache_coordinator,
        kv_cache_config=managed,
        max_model_len=1 << 20,
        max_in_flight_tokens=8192,
        use_eagle=False,
        enable_caching=True,
        enable_kv_cache_events=False,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=scheduler_block,
        hash_block_size=hash_block,
    )
    alignment = getattr(coordinator, "_cache_hit_alignment_tokens", None)
    if alignment is None:  # UnitaryKVCacheCoordinator aligns to its block
        alignment = coordinator.block_size
    return PlannedLayout(
        model=model.name,
        groups=tuple(_scenario_group(g) for g in groups),
        layers_per_group=tuple(len(g.layer_names) for g in groups),
        scheduler_block_size_tokens=scheduler_block,
        hash_block_size_tokens=hash_block,
        hit_alignment_tokens=alignment,
    )


def resolve_model_scenario(data: Mapping[str, Any], base: Path) -> tuple[Scenario, PlannedLayout]:
    """A model-level scenario's JSON form -> the scenario vLLM's planner implies.

    ``data["model"]`` is a description file path relative to ``base`` (the
    scenario file's folder) or an inline description. The groups and the
    hash block size come from :func:`plan_model`; every other field from
    ``data``. The planner's hit alignment must equal the scenario's derived
    one.

    Raises:
        ScenarioError: an invalid description or scenario field, or a
            ``dcp_world_size`` other than 1.
        VllmCallError: vLLM's planner refused the layout.
        InternalError: kvfuzz derives a different hit alignment than vLLM.
    """
    model, body = model_scenario_parts(data, base)
    # The drafter settings alone, on a throwaway one-group scenario.
    probe_block = max(
        model.block_size_tokens,
        int(data.get("drafter", {}).get("num_speculative_tokens", 0) or 0),
    )
    probe_data: dict[str, Any] = {
        "kv_cache_groups": [{"kind": "full_attention", "block_size_tokens": probe_block}],
        "requests": [{"divergence_tokens": 0, "suffix_tokens": 1}],
        "shared_prefix_tokens": 0,
        "prefill_chunk_tokens": max(probe_block, 1),
        **{
            k: body[k]
            for k in (
                "drafter",
                "kv_connector",
                "disable_lookahead_block_hashes",
                "disable_eagle_block_drop",
            )
            if k in body
        },
    }
    probe = Scenario.from_dict(probe_data)
    plan = plan_model(model, probe)
    groups = [
        {
            "kind": g.kind.value,
            "block_size_tokens": g.block_size_tokens,
            "sliding_window_tokens": g.sliding_window_tokens,
            **(
                {"attention_chunk_size_tokens": g.attention_chunk_size_tokens}
                if g.attention_chunk_size_tokens is not None
                else {}
            ),
            **({"is_eagle_group": True} if g.is_eagle_group else {}),
        }
        for g in plan.groups
    ]
    derived_hash = (
        plan.groups[0].block_size_tokens
        if len(plan.groups) == 1
        else math.gcd(*(g.block_size_tokens for g in plan.groups))
    )
    if plan.hash_block_size_tokens != derived_hash:
        body["hash_block_size_tokens"] = plan.hash_block_size_tokens
    # The model travels with the scenario: every run plans it again on the
    # variant's own vLLM (observe_kv_cache_plan), and the oracle judges it.
    scenario = replace(Scenario.from_dict({**body, "kv_cache_groups": groups}), model=model)
    if scenario.effective_hit_alignment_tokens != plan.hit_alignment_tokens:
        raise InternalError(
            f"model {model.name!r}: kvfuzz derives hit alignment "
            f"{scenario.effective_hit_alignment_tokens}, vLLM's coordinator "
            f"{plan.hit_alignment_tokens}"
        )
    return scenario, plan


def _engine_config(model: ModelDescription, scenario: Scenario, pool: int) -> VllmConfig:
    """:func:`_vllm_config` as the engine core holds it when it sizes the KV
    cache: ``num_gpu_blocks_override`` the pool (as engine mode starts vLLM,
    :mod:`differential.driver.engine_mode`), ``max_model_len`` the longest
    request (``get_kv_cache_configs`` checks the pool holds one), no HiSparse."""
    config = _vllm_config(model, scenario)
    config.cache_config.num_gpu_blocks_override = pool
    longest = max(r.prompt_tokens for r in scenario.requests) + scenario.decode_steps
    object.__setattr__(
        config,
        "model_config",
        SimpleNamespace(
            supports_kv_cache_grouping=False,
            original_max_model_len=longest,
            max_model_len=longest,
        ),
    )
    object.__setattr__(config, "attention_config", SimpleNamespace(hisparse_config=None))
    return config


def _planned_group(group: KVCacheGroupSpec) -> PlannedGroup:
    spec = group.kv_cache_spec
    pages = tuple(
        spec.kv_cache_specs[name].page_size_bytes
        if isinstance(spec, UniformTypeKVCacheSpecs)
        else spec.page_size_bytes
        for name in group.layer_names
    )
    return PlannedGroup(
        type(spec).__name__,
        spec.block_size,
        tuple(group.layer_names),
        pages,
        getattr(spec, "extra_retained_tokens", 0),
    )


def observe_kv_cache_plan(scenario: Scenario) -> KVCachePlan | None:
    """The ``KVCacheConfig`` this vLLM plans for ``scenario.model``, as the
    engine core plans it at start-up (``EngineCore._initialize_kv_caches``,
    vllm/v1/engine/core.py): the layers' specs grouped by
    ``get_global_kv_cache_groups``, then ``get_kv_cache_configs``
    (vllm/v1/core/kv_cache_planning.py: the builder's
    ``get_kv_cache_config_from_groups`` turns the groups and the memory
    into ``num_blocks`` and tensors) for the scenario's pool
    (``workload.pool_blocks``, else a pool where nothing is evicted, in
    blocks, given as ``num_gpu_blocks_override``), and
    ``resolve_kv_cache_block_sizes`` (vllm/v1/core/kv_cache_utils.py); then
    the smallest pool ``get_kv_cache_configs`` accepts
    (:func:`_smallest_accepted_pool`).

    Returns:
        ``None`` for a scenario without a model; a plan whose ``error``
        names the call when one of vLLM's planning calls raised.
    """
    model = scenario.model
    if model is None:
        return None
    quiet_vllm_logging()
    pool = scenario.workload.pool_blocks or pool_blocks(scenario, resolve_drafter(scenario))
    try:
        config = _engine_config(model, scenario, pool)
        specs = layer_specs(model, scenario.drafter.num_speculative_tokens)
        groups = vllm_call(
            "get_global_kv_cache_groups", get_global_kv_cache_groups, config, [specs]
        )
        (kv_config,) = vllm_call(
            "get_kv_cache_configs", get_kv_cache_configs, config, [specs], [0], groups
        )
        scheduler_block, hash_block = vllm_call(
            "resolve_kv_cache_block_sizes", resolve_kv_cache_block_sizes, kv_config, config
        )
    except VllmCallError as exc:
        return KVCachePlan(pool_blocks=pool, error=str(exc))
    plan = KVCachePlan(
        pool_blocks=pool,
        num_blocks=kv_config.num_blocks,
        groups=tuple(_planned_group(g) for g in kv_config.kv_cache_groups),
        tensors=tuple(
            PlannedTensor(t.size, tuple(t.layers), t.offset, t.layer_stride, t.block_stride)
            for t in kv_config.kv_cache_tensors
        ),
        scheduler_block_size_tokens=scheduler_block,
        hash_block_size_tokens=hash_block,
        kv_tp_replicas=getattr(kv_config, "kv_tp_replicas", None),
    )
    smallest = _smallest_accepted_pool(model, scenario, specs, groups, pool)
    return replace(plan, smallest_pool_blocks=smallest)


def _smallest_accepted_pool(
    model: ModelDescription,
    scenario: Scenario,
    specs: dict[str, KVCacheSpec],
    groups: list[KVCacheGroupSpec],
    pool: int,
) -> int:
    """The smallest ``num_gpu_blocks_override`` (blocks, at most ``pool``,
    which ``get_kv_cache_configs`` accepted) for which
    ``get_kv_cache_configs`` (vllm/v1/core/kv_cache_planning.py) returns
    rather than raises: its start-up check that one request of
    ``max_model_len`` tokens fits the pool less its null block. Found by
    bisection (the check is monotone in the pool), about ``log2(pool)``
    planning calls of a few milliseconds."""

    def accepted(blocks: int) -> bool:
        try:
            get_kv_cache_configs(_engine_config(model, scenario, blocks), [specs], [0], groups)
        except Exception:  # the refusal (ValueError), or a pool too small to plan
            return False
        return True

    if accepted(0):
        return 0
    refused, taken = 0, pool
    while taken - refused > 1:
        middle = (refused + taken) // 2
        if accepted(middle):
            taken = middle
        else:
            refused = middle
    return taken


def with_kv_cache_plan(scenario: Scenario, run: RunObservation) -> RunObservation:
    """``run`` with the plan of :func:`observe_kv_cache_plan` (unchanged
    without a model, or when the run was not made)."""
    if scenario.model is None or run.unsupported is not None:
        return run
    return replace(run, kv_cache_plan=observe_kv_cache_plan(scenario))

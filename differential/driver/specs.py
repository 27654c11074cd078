"""Group kind -> vLLM spec: the KV cache groups as vLLM's planner leaves them.

The only place that builds vLLM's ``KVCacheSpec`` / ``KVCacheGroupSpec`` /
``KVCacheConfig`` from a scenario's groups (vllm/v1/kv_cache_interface.py).
A new group kind adds its spec here; both driving modes build from it.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1 import kv_cache_interface
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

from differential.capabilities import Feature, Unsupported
from differential.driver.features import UnsupportedFeature, has, vllm_build, vllm_call
from differential.driver.settings import ResolvedDrafter
from differential.errors import InternalError
from differential.scenario import GroupKind, MambaPrefill, Scenario

__all__ = [
    "attention_spec",
    "dcp_block_sizes",
    "group_spec",
    "kv_cache_config",
    "mamba_spec",
    "pool_blocks",
    "spec_for_kind",
]

_SOURCE = "vllm/v1/kv_cache_interface.py"


def _build_spec(name: str, **fields: Any) -> Any:
    """vLLM's spec class ``name`` built with ``fields``.

    Raises:
        Unsupported: the release has no class ``name``, takes not every
            field, or refuses the values.
    """
    cls = getattr(kv_cache_interface, name, None)
    if cls is None:
        raise Unsupported(f"{name} ({_SOURCE})")
    return vllm_build(name, _SOURCE, cls, **fields)


def attention_spec(
    block_size: int,
    kind: GroupKind,
    window: int | None,
    extra_retained: int,
    chunk: int | None = None,
    sink: int | None = None,
) -> KVCacheSpec:
    """An attention group's spec (block size in tokens; window in tokens for
    the sliding-window family; ``chunk`` in tokens for chunked local
    attention; ``sink`` tokens of static sink for sink full attention;
    ``extra_retained`` tokens kept below the window, see
    :func:`kv_cache_config`). Layer shapes are placeholders: no tensor is
    ever allocated.

    Kinds map to vllm/v1/kv_cache_interface.py: full attention
    ``FullAttentionSpec``, MLA ``MLAAttentionSpec`` (one latent head, no V),
    sliding window ``SlidingWindowSpec``, sliding-window MLA
    ``SlidingWindowMLASpec``, chunked local attention
    ``ChunkedLocalAttentionSpec``, sink full attention ``SinkFullAttentionSpec``.

    Raises:
        UnsupportedFeature: ``extra_retained`` is set on a release without it.
    """
    common = {"block_size": block_size, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    if kind.sliding_window_family:
        if has(Feature.EXTRA_RETAINED_TOKENS):
            common["extra_retained_tokens"] = extra_retained
        elif extra_retained:
            raise UnsupportedFeature(Feature.EXTRA_RETAINED_TOKENS)
    return spec_for_kind(kind, window=window, chunk=chunk, sink=sink, **common)


def spec_for_kind(
    kind: GroupKind,
    *,
    window: int | None = None,
    chunk: int | None = None,
    sink: int | None = None,
    **common: Any,
) -> KVCacheSpec:
    """vLLM's spec class for an attention ``kind``, built with ``common``
    (block size, heads, head size, dtype, ...) plus the kind's own field:
    ``window`` tokens for the sliding-window family, ``chunk`` tokens for
    chunked local attention, ``sink`` tokens of static sink for sink full
    attention (vllm/v1/kv_cache_interface.py: full attention
    ``FullAttentionSpec``, MLA ``MLAAttentionSpec``, sliding window
    ``SlidingWindowSpec``, sliding-window MLA ``SlidingWindowMLASpec``,
    chunked local attention ``ChunkedLocalAttentionSpec``, circular buffer
    ``CircularBufferSpec``, sink full attention ``SinkFullAttentionSpec``,
    R-SWA ``RSWASpec`` with ``window`` as its ``rswa_window``)."""
    if kind.sliding_window_family:
        assert window is not None
        if kind is GroupKind.SLIDING_WINDOW_MLA:
            return _build_spec("SlidingWindowMLASpec", sliding_window=window, **common)
        return _build_spec("SlidingWindowSpec", sliding_window=window, **common)
    if kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
        assert chunk is not None
        return _build_spec("ChunkedLocalAttentionSpec", attention_chunk_size=chunk, **common)
    if kind is GroupKind.MLA:
        return _build_spec("MLAAttentionSpec", **common)
    if kind is GroupKind.RSWA:
        assert window is not None
        return _build_spec("RSWASpec", rswa_window=window, **common)
    if kind is GroupKind.CIRCULAR_BUFFER:
        # As DeepseekCompressor.get_kv_cache_spec builds the ring
        # (vllm/models/deepseek_v41/compressor.py): one KV head, no V.
        return _build_spec("CircularBufferSpec", **{**common, "head_size_v": 0})
    if kind is GroupKind.SINK_FULL_ATTENTION:
        # As StaticSinkAttention.get_kv_cache_spec builds it
        # (vllm/model_executor/layers/attention/static_sink_attention.py).
        assert sink is not None
        return _build_spec("SinkFullAttentionSpec", sink_len=sink, **common)
    return _build_spec("FullAttentionSpec", **common)


def mamba_spec(
    block_size: int, num_speculative_blocks: int, mamba_cache_mode: str = "align"
) -> KVCacheSpec:
    """A Mamba group's spec as a Mamba layer builds it.

    As ``vllm/model_executor/layers/mamba/abstract.py``
    ``MambaBase.get_kv_cache_spec``: ``mamba_cache_mode="align"`` (the mode
    prefix caching sets, vllm/model_executor/models/config.py; ``"none"``
    without prefix caching, ``block_size`` then the model length),
    ``num_speculative_blocks = VllmConfig.num_speculative_tokens``, no
    internal prefill checkpoints (``num_prefill_checkpoint_blocks = 0``: state
    is written at chunk ends only, the block-carved prefill). The state shape
    is a token placeholder: no tensor is ever allocated.
    """
    return _build_spec(
        "MambaSpec",
        block_size=block_size,
        shapes=((8,),),
        dtypes=(torch.float16,),
        mamba_cache_mode=mamba_cache_mode,
        num_speculative_blocks=num_speculative_blocks,
    )


def group_spec(
    scenario: Scenario, index: int, extra_retained: int, max_model_len: int | None = None
) -> KVCacheSpec:
    """The spec of group ``index``: attention groups via :func:`attention_spec`, Mamba
    groups via :func:`mamba_spec`, with one prefill checkpoint block at
    alignment 1 under ``mamba_prefill: checkpoint`` (as
    ``MambaMixer2.get_kv_cache_spec`` declares it,
    vllm/model_executor/layers/mamba/mamba_mixer2.py). Without prefix
    caching (:attr:`Scenario.prefix_caching` false) a Mamba group's spec is
    vLLM's ``mamba_cache_mode="none"`` one, its block ``max_model_len``
    tokens. A bounded-replay group's ``SlidingWindowMLASpec`` has
    ``bounded_replay=True``.

    Under decode context parallelism (``Scenario.dcp_world_size`` ``D > 1``) an
    attention spec holds the per-rank block, ``block_size_tokens / D`` tokens
    (vLLM's attention specs are ``dcp_sharded``; the manager scales the block
    back by ``D``); vLLM's own ``resolve_dcp_kv_block_size``
    (vllm/v1/core/kv_cache_utils.py) must give back the scenario's block.

    Raises:
        InternalError: vLLM's DCP block of the spec is not the scenario's, or
            a Mamba group without prefix caching got no ``max_model_len``.
    """
    g = scenario.kv_cache_groups[index]
    if g.kind is GroupKind.MAMBA and not scenario.prefix_caching:
        # Without prefix caching vLLM keeps mamba_cache_mode "none" and a
        # Mamba block the whole model length (MambaModelConfig.
        # verify_and_update_config, vllm/model_executor/models/config.py).
        if max_model_len is None:
            raise InternalError("a Mamba group without prefix caching needs max_model_len")
        return mamba_spec(max_model_len, scenario.drafter.num_speculative_tokens, "none")
    if g.kind is GroupKind.MAMBA:
        spec = mamba_spec(g.block_size_tokens, scenario.drafter.num_speculative_tokens)
        if scenario.mamba_prefill is MambaPrefill.CHECKPOINT:
            spec = replace(spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
        return spec
    dcp = scenario.dcp_world_size
    spec = attention_spec(
        g.block_size_tokens // dcp,
        g.kind,
        g.sliding_window_tokens,
        extra_retained,
        g.attention_chunk_size_tokens,
        g.sink_len_tokens,
    )
    if g.bounded_replay:
        # DeepSeek-V4.1's SWA bounded replay (vLLM PR #56227): the same
        # SlidingWindowMLASpec, out of prefix caching, its window replayed.
        if "bounded_replay" not in {f.name for f in fields(spec)}:
            raise Unsupported(f"SlidingWindowMLASpec.bounded_replay ({_SOURCE})")
        spec = replace(spec, bounded_replay=True)
    if dcp > 1:
        resolve = getattr(kv_cache_utils, "resolve_dcp_kv_block_size", None)
        if resolve is None:
            raise Unsupported("resolve_dcp_kv_block_size (vllm/v1/core/kv_cache_utils.py)")
        sharded = vllm_call("resolve_dcp_kv_block_size", resolve, spec, dcp)
        if sharded != g.block_size_tokens:
            raise InternalError(
                f"kv_cache_groups[{index}]: vLLM's DCP block is {sharded} tokens for a "
                f"{g.block_size_tokens // dcp}-token spec at dcp {dcp}, not the scenario's "
                f"{g.block_size_tokens}"
            )
    return spec


def pool_blocks(scenario: Scenario, resolved: ResolvedDrafter) -> int:
    """The block-pool size in blocks: every request takes fresh blocks, nothing
    evicts. A sink full attention group's static sink holds its own blocks
    for the pool's life (vLLM PR #28775: taken off the free list)."""
    total = 1 + sum(g.num_sink_blocks for g in scenario.kv_cache_groups)  # the null block, sinks
    extra = scenario.decode_steps + resolved.num_lookahead_tokens + 1
    for request in scenario.requests:
        for group in scenario.kv_cache_groups:
            total += math.ceil((request.prompt_tokens + extra) / group.block_size_tokens)
            if group.kind is GroupKind.MAMBA:
                # Speculative state blocks, a copy-on-write block for a partial
                # hit and the running state's successor.
                total += scenario.drafter.num_speculative_tokens + 2
    return total + 8


def kv_cache_config(
    scenario: Scenario,
    resolved: ResolvedDrafter,
    num_blocks: int,
    retention: int | None,
    max_model_len: int | None = None,
) -> KVCacheConfig:
    """The groups as vLLM's planner leaves them.

    Sliding-window specs get ``extra_retained_tokens = num_prefill_lookahead - 1``
    as ``vllm/v1/core/kv_cache_planning.py`` tags them for multi-module MTP.
    A group the scenario marks ``is_eagle_group`` (the drafter's own layers)
    is marked as vLLM's planner marks it (``get_global_kv_cache_groups`` in
    vllm/v1/core/kv_cache_planning.py, only when the drafter asks for the
    drop), and only those groups drop; with none marked the coordinator
    applies the EAGLE drop to every group (``KVCacheCoordinator.__init__``'s
    conservative fallback). For a
    Mamba group vLLM's own code then decides what the drop means: its finder
    never drops and gets no EAGLE margin
    (``HybridKVCacheCoordinator.find_longest_cache_hit``: ``drop_eagle_block
    and not isinstance(spec, MambaSpec)``), and its checkpoints follow the
    attention replay boundary (``drop_eagle_checkpoint_block``).
    """
    extra_retained = max(0, resolved.num_prefill_lookahead_tokens - 1)
    groups = [
        vllm_build(
            "KVCacheGroupSpec",
            _SOURCE,
            KVCacheGroupSpec,
            layer_names=[f"{g.kind.value}.{i}"],
            kv_cache_spec=group_spec(scenario, i, extra_retained, max_model_len),
            **({"is_eagle_group": True} if g.is_eagle_group else {}),
        )
        for i, g in enumerate(scenario.kv_cache_groups)
    ]
    optional = {}
    if has(Feature.RETENTION_INTERVAL):
        optional["prefix_cache_retention_interval"] = retention
    elif retention is not None:
        raise UnsupportedFeature(Feature.RETENTION_INTERVAL)
    return vllm_build(
        "KVCacheConfig",
        _SOURCE,
        KVCacheConfig,
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        **optional,
    )


def dcp_block_sizes(scenario: Scenario, config: KVCacheConfig) -> tuple[int, int]:
    """(scheduler block, hash block), in tokens, as vLLM's engine resolves them
    for ``config``'s groups under the scenario's decode context parallelism:
    ``resolve_kv_cache_block_sizes`` (vllm/v1/core/kv_cache_utils.py, called
    by ``EngineCore`` before it builds the ``Scheduler``) on the config
    fields it reads (``CacheConfig.block_size``, the per-rank block of a
    single group; ``prefix_match_unit``, the scenario's hash block;
    ``ParallelConfig.decode_context_parallel_size``; whether a KV connector
    is configured).

    Raises:
        Unsupported: the release has no ``resolve_kv_cache_block_sizes``.
    """
    dcp = scenario.dcp_world_size
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=scenario.scheduler_block_size_tokens // dcp,
            prefix_match_unit=scenario.hash_block_size_tokens,
            enable_prefix_caching=True,
        ),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
        kv_transfer_config=SimpleNamespace() if scenario.kv_connector else None,
    )
    return resolved_block_sizes(config, vllm_config)


def resolved_block_sizes(config: KVCacheConfig, vllm_config: Any) -> tuple[int, int]:
    """(scheduler block, hash block), in tokens: vLLM's own
    ``resolve_kv_cache_block_sizes`` (vllm/v1/core/kv_cache_utils.py, as
    ``EngineCore`` calls it before it builds the ``Scheduler``) for
    ``config``'s groups under ``vllm_config`` (a ``VllmConfig``, or the
    fields of one it reads).

    Raises:
        Unsupported: the release has no ``resolve_kv_cache_block_sizes``.
    """
    resolve = getattr(kv_cache_utils, "resolve_kv_cache_block_sizes", None)
    if resolve is None:
        raise Unsupported("resolve_kv_cache_block_sizes (vllm/v1/core/kv_cache_utils.py)")
    scheduler_block, hash_block = vllm_call(
        "resolve_kv_cache_block_sizes", resolve, config, vllm_config
    )
    return int(scheduler_block), int(hash_block)

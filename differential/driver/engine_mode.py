"""Engine mode's plans: a scenario as plain data for vLLM's real CPU engine (``vllm.LLM``).

The driver side of engine mode; :mod:`differential.driver.engine_worker` runs
a plan inside the engine environment, and :mod:`differential.variants.engine`
starts that worker, runs plans on it and judges what comes back. A scenario
becomes a *plan* (plain data): a tiny model for its layout, the engine
arguments, the prompts as token ids (kvfuzz's ids mapped into the model's
1024-token vocabulary, every pair of prompts sharing exactly the tokens it
shares in the scenario), arrivals and decode lengths; the worker's reply
becomes a :class:`~differential.observation.RunObservation`
(:func:`observation`), each request's ``RequestOutput.num_cached_tokens`` its
hit.

What the CPU engine cannot run is *unsupported*, naming why
(:class:`EngineUnsupported`): blocks that are not multiples of 32 tokens (the
CPU attention kernels' ``MultipleOf(32)`` kernel block sizes,
vllm/v1/attention/backends/cpu_attn.py), groups of different block sizes
no tiny model gives (one sliding-window and one full-attention block size in
an integer ratio run on a tiny MiMo-V2-Flash model, :func:`_page_ratios`; any
other set of multiples of the smallest block beside both kinds on a tiny
Gemma 4 model, :func:`_gemma4_heads`), MLA groups (vLLM's CPU build turns
the prefix cache off for them: :func:`_refuse_mla`), several windows, kinds
or drafters kvfuzz builds no tiny model for. Chunked local attention runs on
a tiny Llama-4 text model (:func:`_llama4_layout`). With
``workload.kv_events`` the worker records the stream the engine publishes,
and :func:`event_log` puts it in the scenario's tokens for the event oracle.
By
default a scenario is mapped onto the CPU engine's grid: every token length
is multiplied by the smallest factor that makes each block a multiple of 32
(:func:`geometry_scale`, :func:`scaled`; factor 1 when already so), and the
report says so. A file may pin ``"engine": {"geometry": "exact"}`` (a
document key, not part of the scenario value): the scenario as written.

Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from differential.observation import (
    KVEvent,
    KVEventLog,
    ManagerSettings,
    RequestObservation,
    RunObservation,
    runs_of,
    tokens_of,
)
from differential.oracle.core import common_prefix_tokens
from differential.scenario import DrafterKind, GroupKind, KVCacheGroup, MambaPrefill, Scenario

__all__ = [
    "ENGINE_BLOCK_MULTIPLE",
    "OUTPUT_CHECK_TOKENS",
    "TOP_LOGPROBS",
    "EngineResult",
    "EngineUnsupported",
    "engine_plan",
    "event_log",
    "file_geometry",
    "geometry_scale",
    "mamba_steps",
    "observation",
    "output_tokens",
    "scaled",
]

#: CPU attention kernels take blocks of multiples of 32 tokens.
ENGINE_BLOCK_MULTIPLE = 32
_VOCAB = 1024
_FIRST_TOKEN = 3  # 0-2 are pad, BOS and EOS in the tiny configs

#: Sampled tokens per request the output check compares where decoding more
#: cannot change what the scenario observes (:func:`output_tokens`).
OUTPUT_CHECK_TOKENS = 8

#: Logprobs the engine returns per sampled position (``SamplingParams.logprobs``:
#: the ``TOP_LOGPROBS`` most likely tokens), compared as a vector between the
#: cache-on and cache-off runs.
TOP_LOGPROBS = 8


class EngineUnsupported(Exception):
    """The CPU engine cannot run the scenario; the message names why."""


# ---------------------------------------------------------------------- geometry


def geometry_scale(scenario: Scenario) -> int:
    """The smallest factor making every group's block a multiple of 32 tokens."""
    factor = 1
    for g in scenario.kv_cache_groups:
        need = ENGINE_BLOCK_MULTIPLE // math.gcd(g.block_size_tokens, ENGINE_BLOCK_MULTIPLE)
        factor = math.lcm(factor, need)
    return factor


def scaled(scenario: Scenario, factor: int) -> Scenario:
    """``scenario`` with every token length multiplied by ``factor``.

    Blocks, windows, chunks, the hash block, the hit alignment, the retention
    interval, the prefill chunk and step budget, the model length
    (``workload.max_model_len_tokens``), a KV connector store's chunk
    (``workload.connector.chunk_tokens``), the shared prefix, every
    divergence point and suffix, every image, and each request's sampled
    tokens scale; block counts (the pool) and draft counts do not. A request
    samples ``decode_steps + 1`` tokens (the first with its prefill), so
    ``decode_steps`` becomes ``(decode_steps + 1) * factor - 1``: every
    sequence, an answer a later turn copies included, is exactly ``factor``
    times as long. Every block boundary of the scenario maps to one of the
    scaled scenario, so hits scale by ``factor``.
    """
    if factor == 1:
        return scenario

    def n(value: int | None) -> int | None:
        return None if value is None else value * factor

    groups = tuple(
        KVCacheGroup(
            g.kind,
            g.block_size_tokens * factor,
            n(g.sliding_window_tokens),
            n(g.attention_chunk_size_tokens),
            g.is_eagle_group,
            n(g.sink_len_tokens),
        )
        for g in scenario.kv_cache_groups
    )
    requests = tuple(
        dataclasses.replace(
            r,
            divergence_tokens=r.divergence_tokens * factor,
            suffix_tokens=r.suffix_tokens * factor,
            rejoin_tokens=r.rejoin_tokens * factor,
            mm_inputs=tuple(
                dataclasses.replace(
                    m,
                    suffix_offset_tokens=m.suffix_offset_tokens * factor,
                    length_tokens=m.length_tokens * factor,
                )
                for m in r.mm_inputs
            ),
        )
        for r in scenario.requests
    )
    store = scenario.workload.connector
    workload = dataclasses.replace(
        scenario.workload,
        max_num_batched_tokens=n(scenario.workload.max_num_batched_tokens),
        max_model_len_tokens=n(scenario.workload.max_model_len_tokens),
        connector=(
            None
            if store is None
            else dataclasses.replace(store, chunk_tokens=n(store.chunk_tokens))
        ),
    )
    return dataclasses.replace(
        scenario,
        kv_cache_groups=groups,
        requests=requests,
        shared_prefix_tokens=scenario.shared_prefix_tokens * factor,
        retention_interval_tokens=n(scenario.retention_interval_tokens),
        hash_block_size_tokens=n(scenario.hash_block_size_tokens),
        hit_alignment_tokens=n(scenario.hit_alignment_tokens),
        prefill_chunk_tokens=scenario.prefill_chunk_tokens * factor,
        decode_steps=(scenario.decode_steps + 1) * factor - 1,
        workload=workload,
    )


def file_geometry(path: Path | None) -> str:
    """A scenario file's ``engine.geometry``: ``scale`` (the default, also for a file
    without an ``engine`` block, or no file) or ``exact`` (pinned by the file)."""
    if path is None:
        return "scale"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return "scale"
    engine = data.get("engine") if isinstance(data, dict) else None
    geometry = engine.get("geometry", "scale") if isinstance(engine, dict) else "scale"
    return "exact" if geometry == "exact" else "scale"


# -------------------------------------------------------------------------- plans

_DRAFTERS = {
    DrafterKind.EAGLE: "eagle",
    DrafterKind.EAGLE3: "eagle3",
    DrafterKind.NGRAM: "ngram",
    DrafterKind.MTP: "mtp",
    DrafterKind.MULTI_MODULE_MTP: "mtp",
}
_MTP_DRAFTERS = (DrafterKind.MTP, DrafterKind.MULTI_MODULE_MTP)

#: Why engine mode builds no tiny drafter of these kinds on the CPU engine.
_NOT_BUILT = {
    DrafterKind.GEMMA4_MTP: (
        "the Gemma-4 assistant (Gemma4MTPModel, vllm/model_executor/models/gemma4_mtp.py) "
        "is a draft checkpoint of its own (model_type gemma4_assistant: Q-only decoder "
        "layers that read K/V from the target's KV cache), and kvfuzz's engine mode builds "
        "no tiny assistant beside its tiny Gemma 4 target (Gemma4ForCausalLM, "
        "vllm/model_executor/models/gemma4.py)"
    ),
    DrafterKind.DSPARK: (
        "the CPU engine cannot run DSpark: VllmConfig (vllm/config/vllm.py) refuses it on "
        "Model Runner V1 ('Model Runner V1 does not support: dspark speculative "
        "decoding'), and Model Runner V2 needs Triton, which the CPU build does not have "
        "(VllmConfig.use_v2_model_runner)"
    ),
    DrafterKind.DFLASH: (
        "a tiny DFlash draft (DFlashDraftModel) starts on the CPU engine but fails its first "
        "draft: DFlash's _build_context_kv_buffers (vllm/model_executor/models/qwen3_dflash.py) "
        "concatenates the qkv_proj weights, which the CPU build has already packed for its "
        "GEMM kernels and replaced by empty tensors (dispatch_cpu_unquantized_gemm, "
        "vllm/model_executor/layers/utils.py): 'size mismatch, got input (600), mat (600x64), "
        "vec (0)'"
    ),
    DrafterKind.DRAFT_MODEL: (
        "kvfuzz's engine mode builds tiny EAGLE, EAGLE-3 and MTP drafters and n-gram "
        "speculation only"
    ),
}


def _token(salt: int, key: int) -> int:
    """A vocabulary token for kvfuzz token id ``key`` (ids >= 3)."""
    mixed = (key * 0x9E3779B1 + salt * 0x85EBCA77) % (2**32)
    mixed = (mixed ^ (mixed >> 15)) * 0x2C1B3C6D % (2**32)
    return _FIRST_TOKEN + mixed % (_VOCAB - _FIRST_TOKEN)


def _mapped_prompts(scenario: Scenario) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """A salt and the scenario's prompts in the model's vocabulary, each pair
    sharing exactly the prefix its kvfuzz ids share (salts are tried until
    no first differing token collides)."""
    raw = scenario.prompts
    for salt in range(64):
        mapped = tuple(tuple(_token(salt, t) for t in p) for p in raw)
        if all(
            _parts_where_raw_parts(raw[i], raw[j], mapped[i], mapped[j])
            for i in range(len(raw))
            for j in range(i)
        ):
            return salt, mapped
    raise EngineUnsupported("no token mapping into the 1024-token vocabulary keeps the sharing")


def _parts_where_raw_parts(
    a: Sequence[int], b: Sequence[int], ma: Sequence[int], mb: Sequence[int]
) -> bool:
    k = common_prefix_tokens(a, b)
    return k >= min(len(a), len(b)) or ma[k] != mb[k]


def mamba_steps(scenario: Scenario) -> Scenario:
    """A Mamba hybrid as the CPU engine runs it: vLLM's own prefill chunking
    (``mamba_prefill: scheduler``, ``Scheduler._mamba_block_aligned_split``)
    with a step budget of one block (``workload.max_num_batched_tokens``), the
    only budget at which vLLM's CPU Mamba2 kernels keep the states prefix
    caching needs. Other scenarios are returned unchanged."""
    if not scenario.mamba_groups:
        return scenario
    block = scenario.mamba_groups[0].block_size_tokens
    workload = dataclasses.replace(
        scenario.workload,
        max_num_batched_tokens=block,
        max_num_seqs=None
        if scenario.workload.max_num_seqs is None
        else min(scenario.workload.max_num_seqs, block),
    )
    return dataclasses.replace(scenario, mamba_prefill=MambaPrefill.SCHEDULER, workload=workload)


def engine_plan(
    scenario: Scenario,
    *,
    prefix_caching: bool | None = None,
    breakage: str | None = None,
    variant: str | None = None,
) -> dict[str, Any]:
    """The worker's plan for ``scenario`` (see
    :func:`differential.driver.engine_worker.run_plan`); ``variant`` is the
    patch (``"module:function"``, a variant's ``patch``) the engine is built
    and run under, ``None`` for vLLM as installed. ``prefix_caching``:
    ``CacheConfig.enable_prefix_caching``; ``None``: the scenario's
    (:attr:`Scenario.prefix_caching`).

    Raises:
        EngineUnsupported: the CPU engine (or kvfuzz's tiny models) cannot
            run it; the message names why.
    """
    if prefix_caching is None:
        prefix_caching = scenario.prefix_caching
    _refuse_inputs(scenario)
    kinds, block, windows = _engine_layout(scenario)
    _refuse_workload(scenario)
    engine = _engine_arguments(scenario, kinds, block, windows, prefix_caching)
    if not prefix_caching:
        # Without a prefix cache the retention interval and the hash block
        # mean nothing, and vLLM still validates the retention against the
        # scheduler block (vllm/v1/core/kv_cache_coordinator.py), which for a
        # Mamba hybrid without caching is the whole model length: left to
        # vLLM's defaults, the cache-off engine starts for every scenario and
        # is shared by scenarios that differ only in them.
        engine.pop("retention", None)
        engine["prefix_match_unit"] = None
    # A request that copies its source's answer (shares_output) gets the
    # engine's own sampled tokens from the worker; only its own tokens come
    # from here, so kvfuzz's stand-in answers in these prompts are never sent.
    salt, prompts = _mapped_prompts(scenario)
    sampled = output_tokens(scenario)
    longest = max(len(p) for p in prompts) + sampled
    if scenario.workload.shares_output:
        longest = sum(len(p) for p in prompts) + len(prompts) * (scenario.decode_steps + 1)
    engine["max_model_len"] = _max_model_len(scenario, longest, block)
    if not prefix_caching:
        # Without a prefix cache vLLM's Mamba cache mode is "none" and a Mamba
        # layer's block the whole model length (MambaModelConfig.
        # verify_and_update_config, vllm/model_executor/models/config.py).
        for group in engine["groups"]:
            if group["spec"] == "MambaSpec":
                group["block_size"] = engine["max_model_len"]
    prefix = [_token(salt, 1 + p % 50_000) for p in range(scenario.shared_prefix_tokens)]
    requests = []
    for i, r in enumerate(scenario.requests):
        arrival = scenario.workload.arrival_steps
        requests.append(
            {
                "source": r.shares_with,
                "divergence": r.divergence_tokens,
                # Its own tokens, then what it rejoins of its source.
                "own": list(prompts[i][r.divergence_tokens :]),
                "arrival": None if arrival is None else arrival[i],
                "max_tokens": sampled,
            }
        )
    return {
        "engine": engine,
        "prefix": prefix,
        "requests": requests,
        "shares_output": scenario.workload.shares_output,
        "breakage": breakage,
        "logprobs": TOP_LOGPROBS,
        "variant": variant,
        "kv_events": _kv_events_plan(scenario, prefix_caching),
    }


def output_tokens(scenario: Scenario) -> int:
    """Tokens each request samples on the engine: ``decode_steps + 1`` (the
    first with its prefill), or :data:`OUTPUT_CHECK_TOKENS` when more and
    decoding them cannot change what the scenario observes.

    More sampled tokens only lengthen each request's decode: in a sequential
    run (no ``workload.arrival_steps``: a request is added when the previous
    finished) nothing else is scheduled beside them; without a pool
    (``workload.pool_blocks``) the decoded blocks evict nothing; without
    ``workload.shares_output`` no later prompt copies them; without KV cache
    events no stream records them. A later prompt shares only prompt tokens,
    so the blocks vLLM caches while decoding
    (``KVCacheManager.allocate_slots``, vllm/v1/core/kv_cache_manager.py)
    serve no hit it would not get otherwise.
    """
    steps = scenario.decode_steps + 1
    w = scenario.workload
    if (
        w.sequential
        and w.pool_blocks is None
        and not w.shares_output
        and w.kv_events.value == "off"
    ):
        return max(steps, OUTPUT_CHECK_TOKENS)
    return steps


def _max_model_len(scenario: Scenario, longest: int, block: int) -> int:
    """The engine's ``max_model_len`` in tokens: room for the longest sequence
    (``longest`` tokens) and 64 more, in whole blocks of ``block`` tokens, at
    least 2048; under a pool (``workload.pool_blocks``) at most what the pool
    holds besides the null block, which vLLM's start-up check requires of one
    request (vllm/v1/core/kv_cache_utils.py, ``check_enough_kv_cache_memory``),
    and never below ``longest``; a scenario's own ``workload.max_model_len_tokens``
    when it sets one."""
    if scenario.workload.max_model_len_tokens is not None:
        return scenario.workload.max_model_len_tokens
    room = max(2048, -(-(longest + 64) // block) * block)
    pool = scenario.workload.pool_blocks
    if pool is not None:
        room = max(min(room, (pool - 1) * block), -(-longest // block) * block)
    return room


def _refuse_inputs(scenario: Scenario) -> None:
    """Refuse what the engine worker cannot send: images, cache salts,
    requests that skip reading the prefix cache, several DCP ranks.

    Raises:
        EngineUnsupported: naming the input.
    """
    if scenario.has_mm_inputs:
        raise EngineUnsupported(
            "images (requests' mm_inputs): kvfuzz's engine models are text-only tiny models, "
            "with no vision encoder and no multimodal processor to expand an image into "
            "placeholder tokens (vllm/multimodal/processing.py)"
        )
    if scenario.has_cache_salts:
        raise EngineUnsupported(
            "cache_salt: the engine worker sends each prompt as token ids alone, without a salt"
        )
    if any(r.skip_reading_prefix_cache for r in scenario.requests):
        raise EngineUnsupported(
            "skip_reading_prefix_cache: the engine worker sends every request with the same "
            "sampling parameters"
        )
    if scenario.dcp_world_size > 1:
        raise EngineUnsupported(
            f"dcp_world_size {scenario.dcp_world_size}: decode context parallelism shards "
            "KV over several ranks; the CPU engine runs one"
        )


def _engine_layout(scenario: Scenario) -> tuple[set[GroupKind], int, list[int]]:
    """The KV cache groups as a tiny model can have them: ``(kinds, block size in
    tokens, sliding windows in tokens)``.

    The block size is the smallest group's; several block sizes are checked by
    :func:`_block_model`.

    Raises:
        EngineUnsupported: a kind kvfuzz builds no tiny model for, block sizes
            no tiny model gives (:func:`_block_model`), a block that is not a
            multiple of 32 tokens, or several sliding windows beside several
            block sizes.
    """
    groups = scenario.kv_cache_groups
    kinds = {g.kind for g in groups}
    _refuse_mla(kinds)
    _refuse_chunked_local(scenario)
    unknown = kinds - {
        GroupKind.FULL_ATTENTION,
        GroupKind.SLIDING_WINDOW,
        GroupKind.MAMBA,
        GroupKind.CHUNKED_LOCAL_ATTENTION,
    }
    if unknown:
        raise EngineUnsupported(
            f"{', '.join(sorted(k.value for k in unknown))} groups: kvfuzz's engine mode "
            "builds tiny Llama (sliding-window and full attention) and NemotronH (Mamba2) "
            "models only"
        )
    blocks = sorted({g.block_size_tokens for g in groups})
    if len(blocks) > 1:
        _block_model(scenario)
    block = blocks[0]
    for size in blocks:
        if size % ENGINE_BLOCK_MULTIPLE:
            raise EngineUnsupported(
                f"block size {size}: the CPU attention kernels take multiples of "
                f"{ENGINE_BLOCK_MULTIPLE} tokens (vllm/v1/attention/backends/cpu_attn.py); "
                f'the file pins "engine": {{"geometry": "exact"}}; without it the scenario runs '
                f"scaled x{geometry_scale(scenario)}"
            )
    windows = sorted({g.sliding_window_tokens for g in groups if g.sliding_window_tokens})
    if len(windows) > 1 and len(blocks) > 1:
        raise EngineUnsupported(_several_windows(windows, blocks))
    return kinds, block, windows


#: The largest number of KV heads a tiny model's layer gets (MiMo-V2-Flash:
#: the block ratio; Gemma 4: the least common multiple of the ratios).
_MAX_BLOCK_RATIO = 64

_SPEC_NAMES = {
    GroupKind.FULL_ATTENTION: "FullAttentionSpec",
    GroupKind.SLIDING_WINDOW: "SlidingWindowSpec",
    GroupKind.MAMBA: "MambaSpec",
    GroupKind.CHUNKED_LOCAL_ATTENTION: "ChunkedLocalAttentionSpec",
}


def _block_model(scenario: Scenario) -> str:
    """The tiny model whose KV cache groups get the scenario's several block sizes.

    ``mimo_v2`` for one sliding-window and one full-attention block size
    (:func:`_page_ratios`), ``gemma4`` for any other set, several block sizes
    within one kind included (:func:`_gemma4_heads`).

    Raises:
        EngineUnsupported: a Mamba group beside them (its block is the
            attention block in vLLM 0.32), or block sizes neither model gives.
    """
    groups = scenario.kv_cache_groups
    if any(g.kind is GroupKind.MAMBA for g in groups):
        blocks = sorted({g.block_size_tokens for g in groups})
        raise EngineUnsupported(
            f"groups of block sizes {blocks} beside Mamba groups: in align mode, the only "
            "Mamba mode with prefix caching, vLLM 0.32 makes the Mamba block the attention "
            "block (vllm/platforms/interface.py, Platform._align_hybrid_block_size)"
        )
    by_kind: dict[GroupKind, set[int]] = {}
    for g in groups:
        by_kind.setdefault(g.kind, set()).add(g.block_size_tokens)
    if len(by_kind) == 2 and all(len(sizes) == 1 for sizes in by_kind.values()):
        _page_ratios(scenario)
        return "mimo_v2"
    _gemma4_heads(scenario)
    return "gemma4"


def _ratio_refusal(blocks: list[int], rule: str) -> EngineUnsupported:
    return EngineUnsupported(
        f"groups of block sizes {blocks}: vLLM grows a layer's block by the ratio of the "
        "largest page to its page only when that ratio is an integer, else pads the page "
        f"(vllm/v1/core/kv_cache_utils.py, unify_kv_cache_spec_page_size); kvfuzz builds {rule}"
    )


def _page_ratios(scenario: Scenario) -> dict[GroupKind, int]:
    """KV heads per layer kind (head size 32) for one sliding-window and one
    full-attention block size.

    vLLM's planner gives every layer the engine's block size, then
    ``unify_kv_cache_spec_page_size`` (vllm/v1/core/kv_cache_utils.py)
    multiplies the block of each layer whose page (bytes per block) divides
    the largest page by the ratio of the two. A tiny MiMo-V2-Flash model
    (vllm/model_executor/models/mimo_v2.py: ``swa_num_key_value_heads`` for
    the sliding-window layers, ``num_key_value_heads`` for the full-attention
    ones) whose layers with the smaller block have ``r`` KV heads and the
    others one makes the larger block ``r`` times the smaller, the engine's
    block size.

    Returns:
        ``{kind: KV heads}`` for the full-attention and sliding-window kinds
        (the kind with the larger block: 1).

    Raises:
        EngineUnsupported: a ratio that is not an integer (vLLM pads such a
            page instead of growing its block) or above 64.
    """
    sizes = {g.kind: g.block_size_tokens for g in scenario.kv_cache_groups}
    blocks = sorted(set(sizes.values()))
    smallest, largest = blocks[0], blocks[-1]
    if largest % smallest or largest // smallest > _MAX_BLOCK_RATIO:
        raise _ratio_refusal(blocks, f"integer ratios up to {_MAX_BLOCK_RATIO}")
    return {kind: largest // size for kind, size in sizes.items()}


def _gemma4_heads(scenario: Scenario) -> list[int]:
    """KV heads (head size 32) of each group's layer in a tiny Gemma 4 model.

    vLLM's ``Gemma4DecoderLayer`` (vllm/model_executor/models/gemma4.py)
    reads each layer's ``num_key_value_heads`` from
    ``config.per_layer_config[layer]``, so every layer gets its own KV bytes
    per token and, through ``unify_kv_cache_spec_page_size``
    (vllm/v1/core/kv_cache_utils.py), its own block: the layers of the
    smallest block ``s`` have ``H`` KV heads, a layer of block ``b`` has
    ``H * s / b``, where ``H`` is the least common multiple of the ratios
    ``b / s`` (every block a multiple of the smallest; ``H`` up to 64).

    Returns:
        The KV heads of each scenario group's layer, in the scenario's order.

    Raises:
        EngineUnsupported: no full-attention group (``Gemma4TextConfig`` makes
            the last layer full attention), no sliding-window group (vLLM
            puts layers of one kind into one group, whatever their KV heads),
            a block that is not a multiple of the smallest, or ``H`` above 64.
    """
    groups = scenario.kv_cache_groups
    blocks = sorted({g.block_size_tokens for g in groups})
    kinds = {g.kind for g in groups}
    if GroupKind.FULL_ATTENTION not in kinds:
        raise EngineUnsupported(
            f"sliding_window groups of block sizes {blocks} without a full-attention group: "
            "the tiny Gemma 4 model's last layer is full attention (Gemma4TextConfig, "
            "transformers/models/gemma4/configuration_gemma4.py), and the MiMo-V2-Flash "
            "model gives the layers of one kind one KV shape "
            "(vllm/model_executor/models/mimo_v2.py)"
        )
    if GroupKind.SLIDING_WINDOW not in kinds:
        raise EngineUnsupported(
            f"full_attention groups of block sizes {blocks} and no other kind: vLLM puts "
            "layers of one kind into one KV cache group of one block size, whatever their "
            "KV heads (vllm/v1/core/kv_cache_utils.py, get_kv_cache_groups: "
            "UniformTypeKVCacheSpecs.from_specs)"
        )
    smallest = blocks[0]
    rule = f"blocks that are multiples of the smallest, up to {_MAX_BLOCK_RATIO} KV heads"
    if any(b % smallest for b in blocks):
        raise _ratio_refusal(blocks, rule)
    heads = math.lcm(*(b // smallest for b in blocks))
    if heads > _MAX_BLOCK_RATIO:
        raise _ratio_refusal(blocks, rule)
    return [heads * smallest // g.block_size_tokens for g in groups]


def _several_windows(windows: list[int], blocks: list[int]) -> str:
    """Why several sliding windows beside several block sizes do not run on the engine."""
    return (
        f"sliding windows {windows} beside groups of block sizes {blocks}: the tiny model "
        "with a window per layer, Plamo 3 (vllm/model_executor/models/plamo3.py: "
        "config.interleaved_sliding_window), gives every layer one KV shape "
        "(config.num_key_value_heads), and those with KV heads per layer kind or per layer "
        "read one window per model (mimo_v2.py: config.sliding_window_size; gemma4.py, "
        "Gemma4Attention: config.sliding_window)"
    )


def _refuse_mla(kinds: set[GroupKind]) -> None:
    """Refuse MLA groups: vLLM's CPU build turns the prefix cache off for them.

    On a CPU without AMX tiles an MLA model runs on the reference CPU MLA
    backend (vllm/v1/attention/backends/mla/cpu_mla.py, ``CPUMLABackend``:
    blocks of 16 tokens only), and ``CpuPlatform.check_and_update_config``
    (vllm/platforms/cpu.py) then forces ``enable_prefix_caching = False`` and
    chunked prefill off ("MLA is enabled on a non-GPU platform"): every
    lookup would hit 0. Only the AMX MLA backend
    (vllm/v1/attention/backends/mla/amx_mla.py, Intel CPUs with AMX tiles)
    keeps the prefix cache, and kvfuzz's engine mode builds no tiny MLA model
    for it.

    Raises:
        EngineUnsupported: naming the MLA kinds and the vLLM function.
    """
    mla = sorted(k.value for k in kinds if k in (GroupKind.MLA, GroupKind.SLIDING_WINDOW_MLA))
    if mla:
        raise EngineUnsupported(
            f"{', '.join(mla)} groups: vLLM's CPU build turns the prefix cache off for MLA "
            "models on the reference CPU MLA backend (vllm/platforms/cpu.py, "
            "CpuPlatform.check_and_update_config; vllm/v1/attention/backends/mla/cpu_mla.py), "
            "keeping it only on the AMX MLA backend of Intel CPUs with AMX tiles"
        )


def _refuse_chunked_local(scenario: Scenario) -> None:
    """Refuse chunked local attention layouts a tiny Llama-4 text model
    (:func:`_llama4_layout`) cannot give the engine.

    Raises:
        EngineUnsupported: an EAGLE-family drafter (vLLM 0.32's
            ``VllmConfig.__post_init__``, vllm/config/vllm.py, disables the
            hybrid KV cache manager for chunked local attention with EAGLE,
            and ``unify_hybrid_kv_cache_specs``, vllm/v1/core/kv_cache_utils.py,
            then makes the chunked layers full attention), a sliding-window or
            Mamba group beside them, several chunk sizes or block sizes.
    """
    groups = scenario.kv_cache_groups
    chunks = sorted(
        {g.attention_chunk_size_tokens for g in groups if g.attention_chunk_size_tokens}
    )
    if not chunks:
        return
    drafter = scenario.drafter.kind
    if drafter in (DrafterKind.EAGLE, DrafterKind.EAGLE3):
        raise EngineUnsupported(
            f"chunked_local_attention groups with drafter {drafter.value!r}: vLLM 0.32 "
            "disables the hybrid KV cache manager for chunked local attention with EAGLE "
            "(vllm/config/vllm.py, VllmConfig.__post_init__) and then makes the chunked "
            "layers full attention (vllm/v1/core/kv_cache_utils.py, "
            "unify_hybrid_kv_cache_specs)"
        )
    others = {g.kind for g in groups} - {
        GroupKind.FULL_ATTENTION,
        GroupKind.CHUNKED_LOCAL_ATTENTION,
    }
    if others or len(chunks) > 1 or len({g.block_size_tokens for g in groups}) > 1:
        raise EngineUnsupported(
            f"chunked_local_attention groups (chunks {chunks}) beside "
            f"{sorted(k.value for k in others) or 'other block sizes or chunk sizes'}: the "
            "tiny Llama-4 text model (vllm/model_executor/models/llama4.py) has full and "
            "chunked local attention layers of one shape and one attention_chunk_size"
        )


def _refuse_workload(scenario: Scenario) -> None:
    """Refuse workload parts engine mode does not map: connectors, aborts, answers
    rejoined, the Mamba shared-prefix checkpoint, the watermark, the
    Scheduler's prefill policy, async scheduling, drafters kvfuzz builds no tiny model for.

    Raises:
        EngineUnsupported: naming the part.
    """
    if scenario.workload.connector is not None:
        raise EngineUnsupported(
            "workload.connector: the remote store is kvfuzz's scheduler-side connector "
            "(differential/driver/connector.py), with no worker side to load KV into a real "
            "engine"
        )
    if scenario.kv_connector:
        raise EngineUnsupported("a KV connector: engine mode configures none")
    if scenario.workload.abort_steps is not None:
        raise EngineUnsupported(
            "workload.abort_steps: engine mode runs every request to its end (it aborts none)"
        )
    if scenario.workload.shares_output and any(
        r.rejoin_tokens and r.shares_with is not None for r in scenario.requests
    ):
        raise EngineUnsupported(
            "rejoin_tokens with workload.shares_output: the source's sampled tokens are "
            "the engine's own, unknown when the plan is made"
        )
    if scenario.enable_mamba_shared_prefix_checkpoint:
        raise EngineUnsupported("enable_mamba_shared_prefix_checkpoint: not mapped to the engine")
    if scenario.workload.watermark:
        raise EngineUnsupported("workload.watermark: not mapped to the engine")
    w = scenario.workload
    if (w.long_prefill_token_threshold, w.prefill_schedule_interval) != (0, 1):
        raise EngineUnsupported(
            "workload.long_prefill_token_threshold / prefill_schedule_interval: the "
            "Scheduler's prefill policy is not mapped to the engine"
        )
    if w.priorities is not None:
        raise EngineUnsupported(
            "workload.priorities: the engine worker sends every request without a priority "
            "(the priority policy is not mapped to the engine)"
        )
    if scenario.workload.async_scheduling:
        raise EngineUnsupported(
            "workload.async_scheduling: not mapped to the engine (engine mode compares "
            "it with the synchronous drivers of its release)"
        )
    drafter = scenario.drafter.kind
    if drafter is not DrafterKind.NONE and scenario.mamba_groups:
        raise EngineUnsupported(_DRAFTER_BESIDE_MAMBA)
    if drafter is not DrafterKind.NONE and drafter not in _DRAFTERS:
        raise EngineUnsupported(f"drafter {drafter.value!r}: {_NOT_BUILT[drafter]}")


_DRAFTER_BESIDE_MAMBA = (
    "a drafter beside Mamba groups: the CPU engine starts but fails its first step: "
    "vllm/v1/worker/gpu_model_runner.py makes a MambaSpecDecodeGPUContext whenever a "
    "speculative config meets a hybrid model, and vllm/v1/worker/mamba_utils.py "
    "preprocess_mamba -> run_fused_precopy launches the Triton kernel "
    "precopy_mamba_align_fused_kernel, which the CPU build does not have"
)


def _engine_arguments(
    scenario: Scenario,
    kinds: set[GroupKind],
    block: int,
    windows: list[int],
    prefix_caching: bool,
) -> dict[str, Any]:
    """The plan's ``engine`` part: the tiny model's architecture and layers
    (:func:`_architecture`, :func:`_balanced_layers`), the KV cache groups
    vLLM's planner must make from them (``groups``: spec class, block size and
    window in tokens, ``is_eagle_group``, one entry per group, checked by the
    worker's ``_check_groups``) and the hash block (tokens), the scheduler's
    budget (tokens) and sequences, the pool (blocks), the drafter.

    Raises:
        EngineUnsupported: Mamba groups without vLLM's own one-block prefill
            steps, or beside a sliding window; a layout vLLM's planner cannot
            make (:func:`_balanced_layers`) or marks it does not set
            (:func:`_draft_marks`).
    """
    drafter = scenario.drafter.kind
    budget = scenario.step_budget_tokens
    engine: dict[str, Any] = {
        "block_size": block,
        "enable_prefix_caching": prefix_caching,
        "retention": scenario.retention_interval_tokens,
        "prefix_match_unit": scenario.hash_block_size_tokens,
        "num_gpu_blocks_override": scenario.workload.pool_blocks,
        "max_num_seqs": scenario.workload.max_num_seqs or min(8, budget),
        "max_num_batched_tokens": budget,
    }
    architecture = _architecture(scenario, kinds)
    if architecture == "nemotron_h":
        if scenario.mamba_prefill is not MambaPrefill.SCHEDULER or budget != block:
            raise EngineUnsupported(
                "Mamba groups need vLLM's own prefill chunking in steps of one block on the "
                "CPU engine (mamba_mixer2's CPU chunk scan ignores return_intermediate_states, "
                "so no state is kept inside a step): see mamba_steps()"
            )
        if GroupKind.SLIDING_WINDOW in kinds:
            raise EngineUnsupported("sliding windows beside Mamba groups: NemotronH has none")
    layers = _balanced_layers(scenario, architecture)
    if architecture == "nemotron_h":
        pattern = "".join("M" if g.kind is GroupKind.MAMBA else "*" for g in layers)
        engine.update(architecture="nemotron_h", pattern=pattern, max_num_batched_tokens=block)
        engine["max_num_seqs"] = min(engine["max_num_seqs"], block)
    else:
        engine.update(
            architecture=architecture,
            layer_types=[_LAYER_TYPES[g.kind] for g in layers],
            sliding_window=windows[0] if windows else None,
        )
        layout = _LAYOUTS.get(architecture)
        if layout is not None:
            layout(engine, scenario, layers)
    engine["groups"] = _planned_groups(scenario, architecture)
    engine["hash_block_size"] = scenario.effective_hash_block_size_tokens
    engine["drafter"] = None
    if drafter is not DrafterKind.NONE:
        engine["drafter"] = {
            "method": _DRAFTERS[drafter],
            "num_speculative_tokens": scenario.drafter.num_speculative_tokens,
            "disable_eagle_block_drop": scenario.disable_eagle_block_drop,
        }
        if drafter in _MTP_DRAFTERS:
            engine["drafter"]["modules"] = _mtp_modules(scenario)
    if engine["max_num_batched_tokens"] < engine["max_num_seqs"]:
        engine["max_num_seqs"] = engine["max_num_batched_tokens"]
    return engine


#: The ``layer_types`` entry of a layer of each kind.
_LAYER_TYPES = {
    GroupKind.FULL_ATTENTION: "full_attention",
    GroupKind.SLIDING_WINDOW: "sliding_attention",
    GroupKind.CHUNKED_LOCAL_ATTENTION: "chunked_attention",
}


def _architecture(scenario: Scenario, kinds: set[GroupKind]) -> str:
    """The tiny target for the scenario's groups and drafter: ``nemotron_h``
    (Mamba groups), ``llama4`` (chunked local attention:
    :func:`_llama4_layout`), ``mimo`` (MiMo, Qwen2 layers: an MTP drafter on
    one attention kind; ``SpeculativeConfig.hf_config_override``,
    vllm/config/speculative.py, makes its draft ``MiMoMTPModel``,
    vllm/model_executor/models/mimo_mtp.py, one Qwen2 layer per module),
    ``mimo_v2`` (MiMo-V2-Flash: one sliding-window and one full-attention
    block size, or both kinds with an MTP drafter, whose draft
    ``MiMoV2MTPModel``, vllm/model_executor/models/mimo_v2_mtp.py, is one
    sliding-window layer), ``gemma4`` (other sets of block sizes:
    :func:`_block_model`), ``plamo3`` (several sliding windows:
    :func:`_plamo3_layout`) or ``llama``.

    Raises:
        EngineUnsupported: an MTP drafter beside groups no tiny MTP target
            gives (:func:`_refuse_mtp_layout`), or multi-module MTP beside
            sliding-window and full-attention groups together.
    """
    drafter = scenario.drafter.kind
    groups = scenario.kv_cache_groups
    several_blocks = len({g.block_size_tokens for g in groups}) > 1
    if GroupKind.MAMBA in kinds:
        return "nemotron_h"
    if drafter in _MTP_DRAFTERS:
        _refuse_mtp_layout(scenario, kinds)
        if len(kinds) == 1:
            return "mimo"
        if drafter is DrafterKind.MULTI_MODULE_MTP:
            raise EngineUnsupported(_MULTI_MODULE_BESIDE_TWO_KINDS)
        return "mimo_v2"
    if GroupKind.CHUNKED_LOCAL_ATTENTION in kinds:
        return "llama4"
    if several_blocks:
        return _block_model(scenario)
    if len({g.sliding_window_tokens for g in groups if g.sliding_window_tokens}) > 1:
        return "plamo3"
    return "llama"


def _refuse_mtp_layout(scenario: Scenario, kinds: set[GroupKind]) -> None:
    """Refuse an MTP drafter beside groups neither tiny MTP target gives.

    vLLM builds an MTP draft from the target's own checkpoint: kvfuzz's tiny
    MTP targets are MiMo (vllm/model_executor/models/mimo.py, Qwen2 layers:
    one KV shape, one ``sliding_window``) and MiMo-V2-Flash
    (vllm/model_executor/models/mimo_v2.py: one KV shape per layer kind, one
    ``sliding_window_size``). The tiny Gemma 4, Plamo 3 and Llama-4 targets
    have no MTP layers (Gemma 4's drafter is the ``gemma4_mtp`` assistant;
    vLLM has no Plamo 3 or Llama-4 MTP model).

    Raises:
        EngineUnsupported: chunked local attention, several sliding windows,
            or block sizes other than one per kind of sliding-window and
            full-attention groups.
    """
    groups = scenario.kv_cache_groups
    windows = sorted({g.sliding_window_tokens for g in groups if g.sliding_window_tokens})
    blocks = {g.block_size_tokens for g in groups}
    several_blocks = len(blocks) > 1
    what = ""
    if GroupKind.CHUNKED_LOCAL_ATTENTION in kinds:
        what = "chunked_local_attention groups (the tiny Llama-4 target)"
    elif len(windows) > 1:
        what = f"sliding windows {windows} (the tiny Plamo 3 target)"
    elif several_blocks and _block_model(scenario) != "mimo_v2":
        what = f"groups of block sizes {sorted(blocks)} (the tiny Gemma 4 target)"
    if what:
        raise EngineUnsupported(
            f"drafter {scenario.drafter.kind.value!r} beside {what}: vLLM builds an MTP "
            "draft from the target's own MTP layers, and kvfuzz's tiny MTP targets are MiMo "
            "(vllm/model_executor/models/mimo.py: one KV shape, one sliding window) and "
            "MiMo-V2-Flash (vllm/model_executor/models/mimo_v2.py: one KV shape per layer "
            "kind, one sliding_window_size); vLLM has no Plamo 3 or Llama-4 MTP model, and "
            "Gemma 4's is the gemma4_mtp assistant"
        )


_MULTI_MODULE_BESIDE_TWO_KINDS = (
    "multi-module MTP beside sliding-window and full-attention groups: the tiny "
    "MiMo-V2-Flash draft has one MTP module (vllm/config/speculative.py, "
    "SpeculativeConfig.hf_config_override sets num_nextn_predict_layers to "
    "_MIMO_V2_FLASH_NUM_MTP_LAYERS, 1), so the engine would resolve "
    "num_prefill_lookahead_tokens 1 where kvfuzz's drivers resolve one per speculative "
    "token; MiMo's Qwen2 layers have no per-layer sliding window "
    "(vllm/model_executor/models/qwen2.py)"
)


def _spec(group: KVCacheGroup) -> KVCacheGroup:
    """The layer spec a scenario group stands for (its ``KVCacheSpec`` on the
    tiny model: kind, block, window, chunk), without its ``is_eagle_group``
    mark. vLLM's planner puts layers of one spec into the same groups
    (``_get_kv_cache_groups_uniform_page_size``, vllm/v1/core/kv_cache_utils.py)."""
    return dataclasses.replace(group, is_eagle_group=False)


def _planned_groups(scenario: Scenario, architecture: str) -> list[dict[str, Any]]:
    """The plan's ``groups``: the KV cache groups vLLM's planner must make, one
    per scenario group (spec class, block size and window in tokens,
    ``is_eagle_group``: :func:`_draft_marks`), which the worker checks before
    it runs the plan (:func:`differential.driver.engine_worker._check_groups`)."""
    marked = _draft_marks(scenario, architecture)
    return [
        {
            "spec": _SPEC_NAMES[g.kind],
            "block_size": g.block_size_tokens,
            "sliding_window": g.sliding_window_tokens,
            "is_eagle_group": i in marked,
        }
        for i, g in enumerate(scenario.kv_cache_groups)
    ]


def _draft_marks(scenario: Scenario, architecture: str) -> set[int]:
    """The scenario's groups (indices) that vLLM's planner marks
    ``is_eagle_group`` (only they take the EAGLE drop), checked against the
    scenario's marks.

    ``_annotate_eagle_groups`` (vllm/v1/core/kv_cache_utils.py) marks, for
    ``method="mtp"``, the one group holding the last registered layer, an MTP
    layer (``_uses_trailing_mtp_layers``): on MiMo-V2-Flash a sliding-window
    group (one of them, where the planner makes several). EAGLE, EAGLE-3 and
    n-gram get no mark, and ``KVCacheCoordinator.__init__`` then drops on
    every group. A one-group layout takes vLLM's uniform-spec path, which
    marks nothing (the one-group MiMo model came out with no mark on vLLM
    0.32.0, measured). A scenario without marks means every group; with one
    group, a mark means the same; without the drop
    (``disable_eagle_block_drop``) vLLM marks none.

    Raises:
        EngineUnsupported: the scenario marks other groups than the engine's
            planner would.
    """
    groups = scenario.kv_cache_groups
    marks = {i for i, g in enumerate(groups) if g.is_eagle_group}
    if scenario.disable_eagle_block_drop or len(groups) == 1:
        # No drop, or one group (whose mark changes nothing): vLLM 0.32.0
        # marked no group on the one-group tiny models (measured).
        return set()
    made = "none (every group drops)"
    if scenario.drafter.kind in _MTP_DRAFTERS:
        spec = next(iter(_draft_layers(scenario, architecture)))
        made = f"{spec.kind.value} (one group, of block {spec.block_size_tokens})"
        if len(marks) == 1 and _spec(groups[next(iter(marks))]) == spec:
            return marks
    elif not marks:
        return marks
    said = ", ".join(sorted({groups[i].kind.value for i in marks}))
    if len(marks) > 1:
        said += f" ({len(marks)} groups)"
    raise EngineUnsupported(
        f"is_eagle_group marks on {said or 'none (every group drops)'}: vLLM's planner "
        f"marks {made} for this drafter on the tiny model (vllm/v1/core/kv_cache_utils.py, "
        "_annotate_eagle_groups: for MTP the group of the last registered layer, the MTP "
        "layer's), so only those groups take the EAGLE drop"
    )


def _mtp_modules(scenario: Scenario) -> int:
    """MTP modules (``num_nextn_predict_layers``) the tiny target carries: one
    per speculative token for multi-module MTP, else one, as kvfuzz's drivers
    configure the draft model (differential/driver/settings.py)."""
    if scenario.drafter.kind is DrafterKind.MULTI_MODULE_MTP:
        return scenario.drafter.num_speculative_tokens
    return 1


def _draft_layers(scenario: Scenario, architecture: str) -> dict[KVCacheGroup, int]:
    """The attention layers the drafter adds, by spec (:func:`_spec`): an EAGLE
    or EAGLE-3 draft layer has the shape of the target's full-attention
    layers with the smallest block (Gemma 4: ``draft_kv_heads``), so it joins
    their group; MiMo-V2-Flash's MTP layer is a sliding-window layer with the
    sliding-window heads; MiMo's MTP modules are Qwen2 layers of the target's
    one spec; n-gram speculation adds none."""
    drafter = scenario.drafter.kind
    groups = scenario.kv_cache_groups
    block = min(g.block_size_tokens for g in groups)
    if drafter in (DrafterKind.EAGLE, DrafterKind.EAGLE3):
        full = [g.block_size_tokens for g in groups if g.kind is GroupKind.FULL_ATTENTION]
        return {KVCacheGroup(GroupKind.FULL_ATTENTION, min(full, default=block)): 1}
    if drafter in _MTP_DRAFTERS and architecture == "mimo_v2":
        sliding = next(g for g in groups if g.kind is GroupKind.SLIDING_WINDOW)
        return {_spec(sliding): 1}
    if drafter in _MTP_DRAFTERS:
        return {_spec(groups[0]): _mtp_modules(scenario)}
    return {}


def _planner_groups(layers: dict[KVCacheGroup, int]) -> dict[KVCacheGroup, int]:
    """The KV cache groups per spec vLLM's planner makes from ``layers`` (layers
    per spec): one group when every layer has one spec
    (``_get_kv_cache_groups_uniform_spec``), else groups of equal layer
    counts, the smallest spec's count (or the largest's, when it is under 1.5
    times the smallest) (``_get_kv_cache_groups_uniform_page_size``;
    vllm/v1/core/kv_cache_utils.py)."""
    if len(layers) == 1:
        return dict.fromkeys(layers, 1)
    size = min(layers.values())
    if max(layers.values()) < size * 1.5:
        size = max(layers.values())
    return {spec: -(-count // size) for spec, count in layers.items()}


#: The most target layers per scenario group :func:`_balanced_layers` tries.
_MAX_LAYERS_PER_GROUP = 8


def _balanced_layers(scenario: Scenario, architecture: str) -> list[KVCacheGroup]:
    """The tiny target's layers, each as the spec of the scenario group it
    stands for (:func:`_spec`): one per scenario group in the scenario's
    order (fewer where the drafter's layers stand in), then as many more as
    make vLLM's planner give exactly the scenario's groups once the drafter's
    layers join them (:func:`_draft_layers`, :func:`_planner_groups`); an
    EAGLE-3 target has at least four layers (three distinct auxiliary
    layers). Layers of one spec are what the planner groups together: a
    kind, block size, window or chunk of its own makes its own groups (Gemma
    4's block sizes, Plamo 3's windows).

    Raises:
        EngineUnsupported: no layer count makes the scenario's groups (the
            drafter's layers would make a group of a spec the scenario does
            not have, or the scenario has several groups of every spec).
    """
    want: dict[KVCacheGroup, int] = {}
    for g in scenario.kv_cache_groups:
        want[_spec(g)] = want.get(_spec(g), 0) + 1
    draft = _draft_layers(scenario, architecture)
    stray = [spec for spec in draft if spec not in want]
    if stray:
        named = ", ".join(f"{s.kind.value} (block {s.block_size_tokens})" for s in stray)
        raise EngineUnsupported(
            f"the {scenario.drafter.kind.value} drafter's layers are {named} layers: vLLM's "
            "planner would give them a group the scenario does not have "
            "(vllm/v1/core/kv_cache_utils.py, get_kv_cache_groups)"
        )
    least = 4 if scenario.drafter.kind is DrafterKind.EAGLE3 else 1
    for k in range(1, _MAX_LAYERS_PER_GROUP + 1):
        target = {spec: count * k - draft.get(spec, 0) for spec, count in want.items()}
        if min(target.values()) < 1 or sum(target.values()) < least:
            continue
        if _planner_groups({spec: count * k for spec, count in want.items()}) == want:
            return _ordered_layers(scenario, target)
    counts = ", ".join(f"{count} {spec.kind.value}" for spec, count in want.items())
    raise EngineUnsupported(
        f"groups {counts}: vLLM's planner gives the spec with the fewest layers one group "
        "(groups of equal layer counts: _get_kv_cache_groups_uniform_page_size, "
        "vllm/v1/core/kv_cache_utils.py), so no tiny model makes these groups"
    )


def _ordered_layers(scenario: Scenario, target: dict[KVCacheGroup, int]) -> list[KVCacheGroup]:
    """``target`` (target layers per spec) as a layer list: the scenario's
    groups in its order, one layer each while their spec has layers left (a
    drafter's layers may stand in for some), then the rest of each spec."""
    left = dict(target)
    layers = []
    for g in scenario.kv_cache_groups:
        if left[_spec(g)] > 0:
            layers.append(_spec(g))
            left[_spec(g)] -= 1
    for spec, count in left.items():
        layers += [spec] * count
    return layers


def _mimo_v2_layout(engine: dict[str, Any], scenario: Scenario, layers: list[KVCacheGroup]) -> None:
    """Give ``engine`` (a plan's ``mimo_v2`` block) ``kv_heads`` per layer type,
    so that its groups get the scenario's block sizes (:func:`_page_ratios`)."""
    heads = _page_ratios(scenario)
    engine["kv_heads"] = {
        "full_attention": heads.get(GroupKind.FULL_ATTENTION, 1),
        "sliding_attention": heads.get(GroupKind.SLIDING_WINDOW, 1),
    }


def _gemma4_layout(engine: dict[str, Any], scenario: Scenario, layers: list[KVCacheGroup]) -> None:
    """Give ``engine`` (a plan's ``gemma4`` block) its layers' ``kv_heads`` (a
    list, by layer: the heads of the scenario group each stands for,
    :func:`_gemma4_heads`, so that its groups get the scenario's block sizes)
    and ``draft_kv_heads``, the KV heads of the full-attention layers with the
    smallest block, which an EAGLE draft layer gets so that it joins their
    group (:func:`_draft_layers`).

    The layers keep their order except that the last full-attention layer
    goes last: ``Gemma4TextConfig``
    (transformers/models/gemma4/configuration_gemma4.py) turns a last layer of
    another kind into full attention.
    """
    groups = scenario.kv_cache_groups
    heads = dict(zip((_spec(g) for g in groups), _gemma4_heads(scenario), strict=True))
    last = max(i for i, g in enumerate(layers) if g.kind is GroupKind.FULL_ATTENTION)
    order = [*(layer for i, layer in enumerate(layers) if i != last), layers[last]]
    engine["layer_types"] = [_LAYER_TYPES[g.kind] for g in order]
    engine["kv_heads"] = [heads[g] for g in order]
    engine["draft_kv_heads"] = max(
        h for g, h in heads.items() if g.kind is GroupKind.FULL_ATTENTION
    )


def _plamo3_layout(engine: dict[str, Any], scenario: Scenario, layers: list[KVCacheGroup]) -> None:
    """Give ``engine`` (a plan's ``plamo3`` block) each layer's sliding window
    (``sliding_windows``: tokens, ``None`` on full-attention layers;
    vllm/model_executor/models/plamo3.py reads
    ``config.interleaved_sliding_window[layer]``) and no model-wide window.
    Every layer has one KV shape, so one block size."""
    engine["sliding_windows"] = [g.sliding_window_tokens for g in layers]
    engine["sliding_window"] = None


def _llama4_layout(engine: dict[str, Any], scenario: Scenario, layers: list[KVCacheGroup]) -> None:
    """Give ``engine`` (a plan's ``llama4`` block: a tiny Llama-4 text model,
    ``Llama4ForCausalLM``, vllm/model_executor/models/llama4.py, whose
    ``chunked_attention`` layers are RoPE ``ChunkedLocalAttention`` layers and
    ``full_attention`` layers NoPE full attention) its
    ``attention_chunk_size`` (tokens), so that vLLM's planner makes
    ``ChunkedLocalAttentionSpec`` and ``FullAttentionSpec`` groups."""
    engine["attention_chunk_size"] = next(
        g.attention_chunk_size_tokens for g in layers if g.attention_chunk_size_tokens
    )
    engine["sliding_window"] = None


#: What each architecture adds to the plan's ``engine`` block beside its
#: ``layer_types`` (:func:`_engine_arguments`).
_LAYOUTS = {
    "mimo_v2": _mimo_v2_layout,
    "gemma4": _gemma4_layout,
    "plamo3": _plamo3_layout,
    "llama4": _llama4_layout,
}


# ---------------------------------------------------------------------- results


@dataclass(frozen=True)
class EngineResult:
    """One scenario on the engine, cache on and off, as kvfuzz observes it.

    Attributes:
        scenario: the scenario the engine ran (scaled when mapped).
        scale: the geometry factor applied (1: exact).
        run: the cache-on run as an observation (``unsupported`` set when the
            engine cannot run it).
        off_run: the cache-off run (``None`` when not run).
        raw: the worker's cache-on reply (per request outputs and logprobs).
        raw_off: the worker's cache-off reply.
        capabilities: the features detected in the engine's vLLM.
        notes: how the scenario was mapped to the engine, one line each.
    """

    scenario: Scenario
    scale: int
    run: RunObservation
    off_run: RunObservation | None
    raw: dict[str, Any]
    raw_off: dict[str, Any]
    capabilities: dict[str, bool]
    notes: tuple[str, ...]


def observation(
    scenario: Scenario, raw: dict[str, Any], version: str, variant: str = "engine"
) -> RunObservation:
    """The worker's reply as a :class:`RunObservation` (variant ``variant``, mode
    ``engine``): per request ``num_cached_tokens`` as the hit, the junction
    ``get_computed_blocks`` reported, the step of its last lookup, the rank
    of that step (``lookup_order``) and the step it finished at; per-group hits are not exposed by
    the engine and repeat the hit."""
    groups = len(scenario.kv_cache_groups)
    info = raw.get("engine", {})
    rows = sorted(raw.get("requests", []), key=lambda r: r["index"])
    order = {
        r["index"]: rank
        for rank, r in enumerate(sorted(rows, key=lambda r: (r["lookup_step"], r["index"])))
    }
    requests = tuple(
        RequestObservation(
            index=r["index"],
            prompt_tokens=r["prompt_tokens"],
            hit_tokens=r["num_cached_tokens"],
            shared_prefix_boundary_tokens=r["boundary_tokens"],
            per_group_hit_tokens=(r["num_cached_tokens"],) * groups,
            retained_blocks_per_group=(0,) * groups,
            scheduled_step=r["lookup_step"],
            lookup_order=order[r["index"]],
            finished_step=r.get("finished_step"),
        )
        for r in rows
    )
    settings = None
    if info:
        settings = ManagerSettings(
            use_eagle_block_drop=bool(info.get("use_eagle")),
            num_hash_lookahead_tokens=int(info.get("num_hash_lookahead_tokens") or 0),
            num_lookahead_tokens=int(info.get("num_lookahead_tokens") or 0),
            num_prefill_lookahead_tokens=int(info.get("num_prefill_lookahead_tokens") or 0),
            hit_alignment_tokens=int(info.get("block_size") or 0),
            hash_block_size_tokens=int(info.get("hash_block_size") or 0),
        )
    return RunObservation(
        variant=variant,
        vllm_version=version,
        settings=settings,
        requests=requests,
        evicted_blocks=int(info.get("evicted_blocks", 0)),
        error=raw.get("error"),
        retention_interval_tokens=scenario.retention_interval_tokens,
        timed_out=bool(raw.get("timed_out", False)),
        unsupported=raw.get("unsupported"),
        mode="engine",
        pool_blocks=int(info.get("num_blocks", 0)),
        steps=int(info.get("steps", 0)),
        kv_events=event_log(scenario, raw),
    )


# ------------------------------------------------------------- KV cache events


def _kv_events_plan(scenario: Scenario, prefix_caching: bool) -> str:
    """The plan's ``kv_events``: the scenario's ``workload.kv_events``
    (``off``, ``incremental`` or ``full``: every request's
    ``kv_cache_report_mode``) on the cache-on run, ``off`` on the cache-off
    run (with no prefix cache there is no stream to judge)."""
    return scenario.workload.kv_events.value if prefix_caching else "off"


def event_log(scenario: Scenario, raw: dict[str, Any]) -> KVEventLog | None:
    """The engine's KV cache event stream (the worker's ``kv_events`` block) as
    a :class:`~differential.observation.KVEventLog` in the scenario's tokens,
    for the event oracle (:mod:`differential.oracle.kv_events`); ``None`` when
    the run recorded none (events off).

    The engine's ``BlockStored`` events carry the engine's token ids (kvfuzz's
    ids mapped into the tiny model's vocabulary, and the engine's own sampled
    tokens). Each event's ``token_ids`` are put back into the scenario's ids
    position by position: tokens ``[start, end)`` after its parent's prefix
    (``start`` the parent label's prefix length, 0 without a parent) are the
    first request's, in scenario order, whose engine tokens there are those
    (and whose engine tokens share the parent's prefix), replaced by that
    request's scenario tokens there (prompt, then ``Scenario.sampled_tokens``).
    The mapping keeps every pair of prompts' common prefix, so the owner is
    the one the oracle finds; ids no request has there (or after a parent
    naming no prefix) become negative, matching no scenario token, so the
    oracle's ``stored`` rule flags them.
    """
    block = raw.get("kv_events")
    if not block:
        return None
    log = KVEventLog.from_dict(block["log"])
    engine = [list(seq) for seq in block["sequences"]]
    ours = [
        list(scenario.prompts[i]) + list(scenario.sampled_tokens(i))
        for i in range(len(scenario.requests))
    ]

    def translated(event: KVEvent) -> KVEvent:
        if event.kind != "stored":
            return event
        tokens = tokens_of(event.tokens)
        start, parent = 0, None
        if event.parent is not None:
            named = log.prefixes.get(event.parent)
            if named is None:
                return dataclasses.replace(event, tokens=runs_of([-1 - t for t in tokens]))
            parent, start = named
        end = start + len(tokens)
        for r, seq in enumerate(engine):
            shares = parent is None or common_prefix_tokens(seq, engine[parent]) >= start
            if shares and seq[start:end] == tokens and r < len(ours):
                return dataclasses.replace(event, tokens=runs_of(ours[r][start:end]))
        return dataclasses.replace(event, tokens=runs_of([-1 - t for t in tokens]))

    steps = tuple(
        dataclasses.replace(step, events=tuple(translated(e) for e in step.events))
        for step in log.steps
    )
    return dataclasses.replace(log, steps=steps)

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
    "EngineResult",
    "EngineUnsupported",
    "engine_plan",
    "event_log",
    "file_geometry",
    "geometry_scale",
    "mamba_steps",
    "observation",
    "scaled",
]

#: CPU attention kernels take blocks of multiples of 32 tokens.
ENGINE_BLOCK_MULTIPLE = 32
_VOCAB = 1024
_FIRST_TOKEN = 3  # 0-2 are pad, BOS and EOS in the tiny configs


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
    interval, the prefill chunk and step budget, the shared prefix, every
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
    workload = dataclasses.replace(
        scenario.workload, max_num_batched_tokens=n(scenario.workload.max_num_batched_tokens)
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

_DRAFTERS = {DrafterKind.EAGLE: "eagle", DrafterKind.EAGLE3: "eagle3", DrafterKind.NGRAM: "ngram"}


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
    prefix_caching: bool = True,
    breakage: str | None = None,
    variant: str | None = None,
) -> dict[str, Any]:
    """The worker's plan for ``scenario`` (see
    :func:`differential.driver.engine_worker.run_plan`); ``variant`` is the
    patch (``"module:function"``, a variant's ``patch``) the engine is built
    and run under, ``None`` for vLLM as installed.

    Raises:
        EngineUnsupported: the CPU engine (or kvfuzz's tiny models) cannot
            run it; the message names why.
    """
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
    longest = max(len(p) for p in prompts) + scenario.decode_steps + 1
    if scenario.workload.shares_output:
        longest = sum(len(p) for p in prompts) + len(prompts) * (scenario.decode_steps + 1)
    engine["max_model_len"] = _max_model_len(scenario, longest, block)
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
                "max_tokens": scenario.decode_steps + 1,
            }
        )
    return {
        "engine": engine,
        "prefix": prefix,
        "requests": requests,
        "shares_output": scenario.workload.shares_output,
        "breakage": breakage,
        "variant": variant,
        "kv_events": _kv_events_plan(scenario, prefix_caching),
    }


def _max_model_len(scenario: Scenario, longest: int, block: int) -> int:
    """The engine's ``max_model_len`` in tokens: room for the longest sequence
    (``longest`` tokens) and 64 more, in whole blocks of ``block`` tokens, at
    least 2048; under a pool (``workload.pool_blocks``) at most what the pool
    holds besides the null block, which vLLM's start-up check requires of one
    request (vllm/v1/core/kv_cache_utils.py, ``check_enough_kv_cache_memory``),
    and never below ``longest``."""
    room = max(2048, -(-(longest + 64) // block) * block)
    pool = scenario.workload.pool_blocks
    if pool is not None:
        room = max(min(room, (pool - 1) * block), -(-longest // block) * block)
    return room


def _refuse_inputs(scenario: Scenario) -> None:
    """Refuse what the engine worker cannot send: images, cache salts, several DCP ranks.

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
            multiple of 32 tokens, several sliding windows, or
            ``is_eagle_group`` marks.
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
    if any(g.is_eagle_group for g in groups):
        raise EngineUnsupported(
            "is_eagle_group marks: the engine's planner decides the draft groups itself"
        )
    return kinds, block, windows


#: The largest number of KV heads a tiny model's layer gets (MiMo-V2-Flash:
#: the block ratio; Gemma 4: the least common multiple of the ratios).
_MAX_BLOCK_RATIO = 64

_SPEC_NAMES = {
    GroupKind.FULL_ATTENTION: "FullAttentionSpec",
    GroupKind.SLIDING_WINDOW: "SlidingWindowSpec",
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
    rejoined, the Mamba shared-prefix checkpoint, the watermark, async
    scheduling, drafters kvfuzz builds no tiny model for.

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
    if scenario.workload.async_scheduling:
        raise EngineUnsupported(
            "workload.async_scheduling: not mapped to the engine (engine mode compares "
            "it with the synchronous drivers of its release)"
        )
    drafter = scenario.drafter.kind
    if drafter is not DrafterKind.NONE and drafter not in _DRAFTERS:
        raise EngineUnsupported(
            f"drafter {drafter.value!r}: kvfuzz's engine mode builds tiny EAGLE and EAGLE-3 "
            "drafters and n-gram speculation only"
        )


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
    """The plan's ``engine`` part: the tiny model's architecture and layers, the
    scheduler's budget (tokens) and sequences, the pool (blocks), the drafter.

    Raises:
        EngineUnsupported: Mamba groups without vLLM's own one-block prefill
            steps, or beside a drafter or a sliding window.
    """
    groups = scenario.kv_cache_groups
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
    if GroupKind.MAMBA in kinds:
        if scenario.mamba_prefill is not MambaPrefill.SCHEDULER or budget != block:
            raise EngineUnsupported(
                "Mamba groups need vLLM's own prefill chunking in steps of one block on the "
                "CPU engine (mamba_mixer2's CPU chunk scan ignores return_intermediate_states, "
                "so no state is kept inside a step): see mamba_steps()"
            )
        if drafter is not DrafterKind.NONE:
            raise EngineUnsupported(_DRAFTER_BESIDE_MAMBA)
        pattern = "".join("M" if g.kind is GroupKind.MAMBA else "*" for g in groups)
        if GroupKind.SLIDING_WINDOW in kinds:
            raise EngineUnsupported("sliding windows beside Mamba groups: NemotronH has none")
        engine.update(architecture="nemotron_h", pattern=pattern, max_num_batched_tokens=block)
        engine["max_num_seqs"] = min(engine["max_num_seqs"], block)
    else:
        engine.update(
            architecture="llama",
            layer_types=[
                "sliding_attention" if g.kind is GroupKind.SLIDING_WINDOW else "full_attention"
                for g in groups
            ],
            sliding_window=windows[0] if windows else None,
        )
        if GroupKind.CHUNKED_LOCAL_ATTENTION in kinds:
            _llama4_layout(engine, scenario)
        else:
            _model_layout(engine, scenario)
    if drafter is not DrafterKind.NONE:
        engine["drafter"] = {
            "method": _DRAFTERS[drafter],
            "num_speculative_tokens": scenario.drafter.num_speculative_tokens,
            "disable_eagle_block_drop": scenario.disable_eagle_block_drop,
        }
    else:
        engine["drafter"] = None
    if engine["max_num_batched_tokens"] < engine["max_num_seqs"]:
        engine["max_num_seqs"] = engine["max_num_batched_tokens"]
    return engine


def _model_layout(engine: dict[str, Any], scenario: Scenario) -> None:
    """Make ``engine`` (a plan's Llama ``engine`` block) the tiny model the
    scenario's attention groups need: several block sizes
    (:func:`_several_blocks_layout`), several sliding windows
    (:func:`_plamo3_layout`), else the Llama model as it is."""
    groups = scenario.kv_cache_groups
    if len({g.block_size_tokens for g in groups}) > 1:
        _several_blocks_layout(engine, scenario)
    elif len({g.sliding_window_tokens for g in groups if g.sliding_window_tokens}) > 1:
        _plamo3_layout(engine, scenario)


def _plamo3_layout(engine: dict[str, Any], scenario: Scenario) -> None:
    """Make ``engine`` a tiny Plamo 3 model with each group's sliding window on
    its own layer: ``architecture`` ``plamo3``, ``sliding_windows`` (tokens,
    ``None`` on full-attention layers; vllm/model_executor/models/plamo3.py
    reads ``config.interleaved_sliding_window[layer]``), and the planned
    groups (:func:`_planned_groups`). Every layer has one KV shape, so one
    block size.

    Raises:
        EngineUnsupported: an EAGLE drafter without a full-attention group (its
            draft layer is full attention: a group the scenario lacks).
    """
    groups = scenario.kv_cache_groups
    eagle = scenario.drafter.kind in (DrafterKind.EAGLE, DrafterKind.EAGLE3)
    if eagle and all(g.kind is GroupKind.SLIDING_WINDOW for g in groups):
        raise EngineUnsupported(
            f"drafter {scenario.drafter.kind.value!r} beside sliding-window groups only: "
            "the EAGLE draft layer is full attention (vllm/model_executor/models/"
            "llama_eagle3.py), a KV cache group the scenario does not have"
        )
    engine["architecture"] = "plamo3"
    engine["sliding_windows"] = [g.sliding_window_tokens for g in groups]
    engine["sliding_window"] = None
    _planned_groups(engine, scenario)


def _several_blocks_layout(engine: dict[str, Any], scenario: Scenario) -> None:
    """Make ``engine`` (a plan's Llama ``engine`` block) the tiny model that
    :func:`_block_model` picks for the scenario's several block sizes."""
    if _block_model(scenario) == "mimo_v2":
        _mimo_layout(engine, scenario)
    else:
        _gemma4_layout(engine, scenario)


def _planned_groups(engine: dict[str, Any], scenario: Scenario) -> None:
    """Set ``engine["groups"]``, the KV cache groups vLLM's planner must make
    (spec class, block size and window in tokens), and its hash block
    (tokens), which the worker checks before it runs the plan
    (:func:`differential.driver.engine_worker._check_groups`)."""
    engine["groups"] = [
        {
            "spec": _SPEC_NAMES[g.kind],
            "block_size": g.block_size_tokens,
            "sliding_window": g.sliding_window_tokens,
        }
        for g in scenario.kv_cache_groups
    ]
    engine["hash_block_size"] = scenario.effective_hash_block_size_tokens


def _llama4_layout(engine: dict[str, Any], scenario: Scenario) -> None:
    """Make ``engine`` (a plan's Llama ``engine`` block) a tiny Llama-4 text
    model (``Llama4ForCausalLM``, vllm/model_executor/models/llama4.py): one
    layer per group, a chunked local attention layer (RoPE,
    ``ChunkedLocalAttention`` of ``attention_chunk_size`` tokens) for each
    ``chunked_local_attention`` group and a full-attention (NoPE) layer for
    each other, so vLLM's planner makes ``ChunkedLocalAttentionSpec`` and
    ``FullAttentionSpec`` groups in the scenario's order; ``groups`` and
    ``hash_block_size`` are what the worker checks (:func:`_check_groups`)."""
    groups = scenario.kv_cache_groups
    chunked = [g.kind is GroupKind.CHUNKED_LOCAL_ATTENTION for g in groups]
    engine["architecture"] = "llama4"
    engine["layer_types"] = [
        "chunked_attention" if c else "full_attention" for c in chunked
    ]
    engine["attention_chunk_size"] = next(
        g.attention_chunk_size_tokens for g in groups if g.attention_chunk_size_tokens
    )
    engine["groups"] = [
        {
            "spec": "ChunkedLocalAttentionSpec" if c else "FullAttentionSpec",
            "block_size": g.block_size_tokens,
            "sliding_window": None,
        }
        for c, g in zip(chunked, groups, strict=True)
    ]
    engine["hash_block_size"] = scenario.effective_hash_block_size_tokens


def _mimo_layout(engine: dict[str, Any], scenario: Scenario) -> None:
    """Make ``engine`` a tiny MiMo-V2-Flash model whose groups get the
    scenario's block sizes (:func:`_page_ratios`): ``architecture``
    ``mimo_v2``, ``kv_heads`` per layer type, and the planned groups
    (:func:`_planned_groups`)."""
    heads = _page_ratios(scenario)
    engine["architecture"] = "mimo_v2"
    engine["kv_heads"] = {
        "full_attention": heads.get(GroupKind.FULL_ATTENTION, 1),
        "sliding_attention": heads.get(GroupKind.SLIDING_WINDOW, 1),
    }
    _planned_groups(engine, scenario)


def _gemma4_layout(engine: dict[str, Any], scenario: Scenario) -> None:
    """Make ``engine`` a tiny Gemma 4 model whose groups get the scenario's
    block sizes (:func:`_gemma4_heads`): ``architecture`` ``gemma4``, one layer
    per group with its own ``kv_heads`` (a list, by layer), the planned groups
    (:func:`_planned_groups`), and ``draft_kv_heads``, the KV heads of the
    full-attention layer with the smallest block, which an EAGLE draft layer
    gets so that it joins that layer's group.

    The layers keep the scenario's order except that the last full-attention
    group's layer goes last: ``Gemma4TextConfig``
    (transformers/models/gemma4/configuration_gemma4.py) turns a last layer
    of another kind into full attention. vLLM's planner groups layers by spec
    and splits them into groups of equal layer counts
    (``_get_kv_cache_groups_uniform_page_size``, vllm/v1/core/kv_cache_utils.py),
    so one layer per group gives exactly the scenario's groups.
    """
    groups = scenario.kv_cache_groups
    heads = _gemma4_heads(scenario)
    last = max(i for i, g in enumerate(groups) if g.kind is GroupKind.FULL_ATTENTION)
    order = [i for i in range(len(groups)) if i != last] + [last]
    engine["architecture"] = "gemma4"
    engine["layer_types"] = [engine["layer_types"][i] for i in order]
    engine["kv_heads"] = [heads[i] for i in order]
    engine["draft_kv_heads"] = max(
        h for h, g in zip(heads, groups, strict=True) if g.kind is GroupKind.FULL_ATTENTION
    )
    _planned_groups(engine, scenario)


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

"""Drive vLLM's real ``KVCacheManager`` through a scenario, as the scheduler does.

Per request, in order (vLLM ``vllm/v1/core/sched/scheduler.py``
``Scheduler.schedule`` for a waiting then running request):

1. ``get_computed_blocks`` -> hit tokens and ``shared_prefix_boundary``, which
   is stored on the request as the scheduler stores it;
2. prefill in chunks of ``prefill_chunk_tokens``, each chunk trimmed by
   ``Scheduler._reserve_prefill_lookahead`` (called, not copied), with
   ``allocate_slots(..., num_lookahead_tokens=...)``; the first chunk adopts
   the hit blocks; ``num_computed_tokens`` advances after each step;
3. ``decode_steps`` decode steps of one sampled token each;
4. ``free``.

Every step starts with ``KVCacheManager.new_step_starts`` as
``Scheduler.schedule`` does (a Mamba state cached in the current step cannot
be hit until the next one). With Mamba groups (``MambaSpec``,
``mamba_cache_mode="align"``) each prefill chunk is also clipped by
``Scheduler._mamba_block_aligned_split`` (called, not copied; see
:func:`_mamba_scheduler_view`), before ``_reserve_prefill_lookahead`` as the
scheduler orders them.

The pool is sized so that no cached block is ever evicted; evictions are still
counted (cached block keys that disappear) and reported.
"""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import torch
import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from differential.driver.settings import ResolvedDrafter, resolve_drafter
from differential.errors import InternalError
from differential.observation import ManagerSettings, RequestObservation, RunObservation
from differential.scenario import GroupKind, MambaPrefill, Scenario

__all__ = ["VLLM_VERSION", "run_scenario"]

VLLM_VERSION: str = vllm.__version__

init_none_hash(sha256)

_UNSET = object()


def _spec(block_size: int, kind: GroupKind, window: int | None, extra_retained: int) -> KVCacheSpec:
    common = {"block_size": block_size, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    if kind is GroupKind.SLIDING_WINDOW:
        assert window is not None
        return SlidingWindowSpec(
            sliding_window=window, extra_retained_tokens=extra_retained, **common
        )
    return FullAttentionSpec(**common)


def _mamba_spec(block_size: int, num_speculative_blocks: int) -> MambaSpec:
    """A Mamba group's spec as a Mamba layer builds it in prefix-caching mode.

    As ``vllm/model_executor/layers/mamba/abstract.py``
    ``MambaBase.get_kv_cache_spec``: ``mamba_cache_mode="align"`` (the mode
    prefix caching sets, vllm/model_executor/models/config.py),
    ``num_speculative_blocks = VllmConfig.num_speculative_tokens``, no
    internal prefill checkpoints (``num_prefill_checkpoint_blocks = 0``: state
    is written at chunk ends only, the block-carved prefill). The state shape
    is a token placeholder: no tensor is ever allocated.
    """
    return MambaSpec(
        block_size=block_size,
        shapes=((8,),),
        dtypes=(torch.float16,),
        mamba_cache_mode="align",
        num_speculative_blocks=num_speculative_blocks,
    )


def _group_spec(scenario: Scenario, index: int, extra_retained: int) -> KVCacheSpec:
    """The spec of group ``index``: attention groups via :func:`_spec`, Mamba
    groups via :func:`_mamba_spec`."""
    g = scenario.kv_cache_groups[index]
    if g.kind is GroupKind.MAMBA:
        return _mamba_spec(g.block_size_tokens, scenario.drafter.num_speculative_tokens)
    return _spec(g.block_size_tokens, g.kind, g.sliding_window_tokens, extra_retained)


def _mamba_scheduler_view(
    scenario: Scenario, manager: KVCacheManager, resolved: ResolvedDrafter
) -> SimpleNamespace | None:
    """The attributes ``Scheduler._mamba_block_aligned_split`` reads, set as
    ``Scheduler.__init__`` sets them (vllm/v1/core/sched/scheduler.py), or
    ``None`` without Mamba groups (``need_mamba_block_aligned_split`` off).

    ``cache_config.block_size`` is the Mamba block size (vLLM sets
    ``mamba_block_size = cache_config.block_size`` in align mode);
    ``max_num_scheduled_tokens`` is the scenario's ``prefill_chunk_tokens``
    budget and ``long_prefill_token_threshold`` is 0. The base Mamba spec
    has no internal prefill checkpoint blocks, so
    ``mamba_has_prefill_checkpoint_blocks`` is off.
    """
    if not scenario.mamba_groups:
        return None
    block = scenario.mamba_groups[0].block_size_tokens
    hash_block = manager.block_pool.hash_block_size
    partial = hash_block < block and bool(
        getattr(manager.coordinator, "enable_partial_hash_hits", False)
    )
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block),
        block_size=scenario.scheduler_block_size_tokens,
        hash_block_size=hash_block,
        mamba_partial_cache_hit=partial,
        mamba_shared_prefix_checkpoint=partial
        and bool(getattr(manager, "mamba_shared_prefix_checkpoint", False)),
        use_eagle_block_drop=resolved.use_eagle_block_drop,
        num_hash_lookahead_tokens=resolved.num_hash_lookahead_tokens,
        mamba_has_prefill_checkpoint_blocks=False,
        mamba_prefill_checkpoint_alignment=None,
        max_num_scheduled_tokens=scenario.prefill_chunk_tokens,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        num_prefill_lookahead=resolved.num_prefill_lookahead_tokens,
    )


def _block_carved_chunk(view: SimpleNamespace, computed_tokens: int, num_new_tokens: int) -> int:
    """A block-carved prefill step (``MambaPrefill.BLOCK``), in tokens: the step
    ends at the next Mamba block boundary or earlier, with no other stop.

    Not vLLM's scheduler: the way vLLM's manager tests feed ``allocate_slots``
    (one block per step), kept to reproduce measurements taken that way.
    """
    block = int(view.cache_config.block_size)
    return min(num_new_tokens, (computed_tokens // block + 1) * block - computed_tokens)


def _pool_blocks(scenario: Scenario, resolved: ResolvedDrafter) -> int:
    """Blocks enough for every request to take fresh blocks: nothing evicts."""
    total = 1  # the null block
    extra = scenario.decode_steps + resolved.num_lookahead_tokens + 1
    for request in scenario.requests:
        for group in scenario.kv_cache_groups:
            total += math.ceil((request.prompt_tokens + extra) / group.block_size_tokens)
            if group.kind is GroupKind.MAMBA:
                # Speculative state blocks, a copy-on-write block for a partial
                # hit and the running state's successor.
                total += scenario.drafter.num_speculative_tokens + 2
    return total + 8


def _kv_cache_config(
    scenario: Scenario, resolved: ResolvedDrafter, num_blocks: int, retention: int | None
) -> KVCacheConfig:
    """The groups as vLLM's planner leaves them.

    Sliding-window specs get ``extra_retained_tokens = num_prefill_lookahead - 1``
    as ``vllm/v1/core/kv_cache_planning.py`` tags them for multi-module MTP.
    Drafter layers are not modelled separately, so no group is marked
    ``is_eagle_group`` and the coordinator applies the EAGLE drop to every
    group (``KVCacheCoordinator.__init__``'s conservative fallback). For a
    Mamba group vLLM's own code then decides what the drop means: its finder
    never drops and gets no EAGLE margin
    (``HybridKVCacheCoordinator.find_longest_cache_hit``: ``drop_eagle_block
    and not isinstance(spec, MambaSpec)``), and its checkpoints follow the
    attention replay boundary (``drop_eagle_checkpoint_block``).
    """
    extra_retained = max(0, resolved.num_prefill_lookahead_tokens - 1)
    groups = [
        KVCacheGroupSpec(
            layer_names=[f"{g.kind.value}.{i}"],
            kv_cache_spec=_group_spec(scenario, i, extra_retained),
        )
        for i, g in enumerate(scenario.kv_cache_groups)
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention,
    )


def _cached_keys(manager: KVCacheManager) -> Counter[bytes]:
    """Cached block keys (hash + group id) -> number of cached blocks."""
    cache = manager.block_pool.cached_block_hash_to_block._cache
    return Counter({key: (len(v) if isinstance(v, dict) else 1) for key, v in cache.items()})


def _state_map(manager: KVCacheManager, request: Request, gid: int) -> str:
    """A Mamba group's states: one character per hash block of the prompt,
    ``1`` if a state keyed at that block's end is cached now (a state is one
    block holding the state at exactly one position)."""
    pool = manager.block_pool
    return "".join("1" if pool.get_cached_block(h, [gid]) else "0" for h in request.block_hashes)


def _cache_map(scenario: Scenario, manager: KVCacheManager, request: Request) -> tuple[str, ...]:
    """Per group, one character per full prompt block: ``1`` if cached now;
    for a Mamba group one character per hash block (:func:`_state_map`)."""
    hash_block = scenario.effective_hash_block_size_tokens
    hashes = request.block_hashes
    maps = []
    for gid, group in enumerate(scenario.kv_cache_groups):
        if group.kind is GroupKind.MAMBA:
            maps.append(_state_map(manager, request, gid))
            continue
        step = group.block_size_tokens // hash_block
        marks = []
        for index in range(len(hashes) // step):
            cached = manager.block_pool.get_cached_block(hashes[(index + 1) * step - 1], [gid])
            marks.append("1" if cached else "0")
        maps.append("".join(marks))
    return tuple(maps)


def _blocks_per_group(keys: Counter[bytes], num_groups: int) -> list[int]:
    counts = [0] * num_groups
    for key, n in keys.items():
        counts[get_group_id(key)] += n
    return counts


def run_scenario(
    scenario: Scenario,
    variant: str,
    *,
    retention_interval_tokens: int | object | None = _UNSET,
    record_cache_map: bool = False,
) -> RunObservation:
    """Run ``scenario`` on the vLLM importable in this process.

    The caller applies the variant's patches around this call (see
    :func:`differential.driver.variants.run_variant`); ``variant`` only labels
    the observation.

    Args:
        scenario: the scenario to drive.
        variant: the variant name recorded in the observation.
        retention_interval_tokens: overrides the scenario's retention interval
            (``None`` for the dense cross-check run); defaults to the
            scenario's own.
        record_cache_map: record, per request and group, which of its prompt
            blocks were cached when it looked up (for ``kvfuzz explain``).

    Returns:
        The observation. If vLLM raised, ``error`` names the phase and the
        exception and ``requests`` holds the requests completed before it.
    """
    retention = (
        scenario.retention_interval_tokens
        if retention_interval_tokens is _UNSET
        else retention_interval_tokens
    )
    assert retention is None or isinstance(retention, int)
    phase = ["resolve drafter settings"]
    observed: list[RequestObservation] = []
    settings: ManagerSettings | None = None
    evicted = 0
    error: str | None = None
    try:
        resolved = resolve_drafter(scenario)
        phase[0] = "build KVCacheManager"
        num_groups = len(scenario.kv_cache_groups)
        longest = max(r.prompt_tokens for r in scenario.requests)
        max_model_len = longest + scenario.decode_steps + resolved.num_lookahead_tokens + 1
        optional: dict[str, bool] = {}
        if scenario.enable_mamba_shared_prefix_checkpoint:
            optional["enable_mamba_shared_prefix_checkpoint"] = True
        manager = KVCacheManager(
            kv_cache_config=_kv_cache_config(
                scenario, resolved, _pool_blocks(scenario, resolved), retention
            ),
            max_model_len=max_model_len,
            scheduler_block_size=scenario.scheduler_block_size_tokens,
            hash_block_size=scenario.effective_hash_block_size_tokens,
            enable_caching=True,
            use_eagle=resolved.use_eagle_block_drop,
            num_hash_lookahead_tokens=resolved.num_hash_lookahead_tokens,
            num_prefill_lookahead=resolved.num_prefill_lookahead_tokens,
            **optional,
        )
        coordinator = manager.coordinator
        mamba_view = _mamba_scheduler_view(scenario, manager, resolved)
        alignment = getattr(
            coordinator, "_cache_hit_alignment_tokens", scenario.scheduler_block_size_tokens
        )
        settings = ManagerSettings(
            use_eagle_block_drop=resolved.use_eagle_block_drop,
            num_hash_lookahead_tokens=resolved.num_hash_lookahead_tokens,
            num_lookahead_tokens=resolved.num_lookahead_tokens,
            num_prefill_lookahead_tokens=resolved.num_prefill_lookahead_tokens,
            hit_alignment_tokens=alignment,
            hash_block_size_tokens=manager.block_pool.hash_block_size,
            partial_hash_hits=bool(getattr(coordinator, "enable_partial_hash_hits", False)),
        )
        hasher = get_request_block_hasher(
            scenario.effective_hash_block_size_tokens,
            sha256,
            resolved.num_hash_lookahead_tokens,
        )
        # Scheduler._reserve_prefill_lookahead reads only this attribute.
        scheduler_view = SimpleNamespace(
            num_prefill_lookahead=resolved.num_prefill_lookahead_tokens
        )
        seen: Counter[bytes] = Counter()
        for index, (spec, prompt) in enumerate(
            zip(scenario.requests, scenario.prompts, strict=True)
        ):
            phase[0] = f"request {index}: lookup"
            request = Request(
                request_id=f"req-{index}",
                prompt_token_ids=list(prompt),
                sampling_params=SamplingParams(max_tokens=scenario.decode_steps + 1),
                pooling_params=None,
                block_hasher=hasher,
            )
            before = _cached_keys(manager)
            manager.new_step_starts()
            cache_map = _cache_map(scenario, manager, request) if record_cache_map else ()
            if hasattr(coordinator, "find_longest_cache_hit_per_group"):
                # Diagnostic only (the scheduler calls it just for connectors
                # on Mamba hybrids): cap at the hashed tokens, which lookahead
                # hashes make shorter than the prompt, as the combined lookup's
                # full-attention bound does.
                hashed = len(request.block_hashes) * scenario.effective_hash_block_size_tokens
                _, per_group = coordinator.find_longest_cache_hit_per_group(
                    request.block_hashes, min(request.num_tokens - 1, hashed)
                )
            else:
                per_group = ()
            blocks, hit, junction = manager.get_computed_blocks(request)
            request.shared_prefix_boundary = junction
            if not per_group:
                per_group = (hit,) * num_groups

            computed = hit
            first = True
            while computed < spec.prompt_tokens:
                phase[0] = f"request {index}: prefill allocate_slots at {computed} tokens"
                num_new = min(scenario.prefill_chunk_tokens, spec.prompt_tokens - computed)
                if not first:
                    manager.new_step_starts()
                if mamba_view is not None and scenario.mamba_prefill is MambaPrefill.BLOCK:
                    num_new = _block_carved_chunk(mamba_view, computed, num_new)
                elif mamba_view is not None:
                    num_new = Scheduler._mamba_block_aligned_split(
                        mamba_view,  # type: ignore[arg-type]
                        request,
                        num_new,
                        hit if first else 0,
                    )
                num_new = Scheduler._reserve_prefill_lookahead(
                    scheduler_view,  # type: ignore[arg-type]
                    request,
                    computed,
                    num_new,
                )
                if num_new == 0:
                    raise InternalError(
                        f"prefill stalled at {computed} tokens: chunk "
                        f"{scenario.prefill_chunk_tokens} cannot leave the prefill "
                        f"lookahead of {resolved.num_prefill_lookahead_tokens} tokens"
                    )
                if first:
                    allocated = manager.allocate_slots(
                        request,
                        num_new,
                        num_new_computed_tokens=hit,
                        new_computed_blocks=blocks,
                        num_lookahead_tokens=resolved.num_lookahead_tokens,
                    )
                    request.status = RequestStatus.RUNNING
                    first = False
                else:
                    allocated = manager.allocate_slots(
                        request, num_new, num_lookahead_tokens=resolved.num_lookahead_tokens
                    )
                if allocated is None:
                    raise InternalError(f"the block pool ran out at {computed} tokens")
                computed += num_new
                request.num_computed_tokens = computed
            for step in range(scenario.decode_steps):
                phase[0] = f"request {index}: decode step {step}"
                manager.new_step_starts()
                request.append_output_token_ids(scenario.output_token(index, step))
                allocated = manager.allocate_slots(
                    request, 1, num_lookahead_tokens=resolved.num_lookahead_tokens
                )
                if allocated is None:
                    raise InternalError(f"the block pool ran out at decode step {step}")
                computed += 1
                request.num_computed_tokens = computed
            phase[0] = f"request {index}: free"
            manager.free(request)
            after = _cached_keys(manager)
            evicted += sum((seen - after).values())
            seen = after
            added = [
                a - b
                for a, b in zip(
                    _blocks_per_group(after, num_groups),
                    _blocks_per_group(before, num_groups),
                    strict=True,
                )
            ]
            observed.append(
                RequestObservation(
                    index=index,
                    prompt_tokens=spec.prompt_tokens,
                    hit_tokens=hit,
                    shared_prefix_boundary_tokens=junction,
                    per_group_hit_tokens=tuple(per_group),
                    retained_blocks_per_group=tuple(added),
                    cache_map=cache_map,
                )
            )
    except InternalError:
        raise
    except Exception as exc:  # vLLM raised: a finding, not our failure.
        error = f"{phase[0]}: {type(exc).__name__}: {exc}"
    return RunObservation(
        variant=variant,
        vllm_version=VLLM_VERSION,
        settings=settings,
        requests=tuple(observed),
        evicted_blocks=evicted,
        error=error,
        retention_interval_tokens=retention,
    )

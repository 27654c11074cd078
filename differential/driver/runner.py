"""Drive vLLM's real ``KVCacheManager`` through a scenario, as the scheduler does.

Per request, in order (vLLM ``vllm/v1/core/sched/scheduler.py``
``Scheduler.schedule`` for a waiting then running request):

1. ``get_computed_blocks`` -> hit tokens and ``shared_prefix_boundary``, which
   is stored on the request as the scheduler stores it;
2. prefill in chunks of ``Scenario.step_budget_tokens`` (``prefill_chunk_tokens``
   unless the workload sets a token budget), each chunk trimmed by
   ``Scheduler._reserve_prefill_lookahead`` (called, not copied), with
   ``allocate_slots(..., num_lookahead_tokens=...)``; the first chunk adopts
   the hit blocks; ``num_computed_tokens`` advances after each step;
3. ``decode_steps`` decode steps of one sampled token each; each sampled
   token (the one prefill samples, then one per step, ``decode_steps + 1``
   in all) is appended as ``Scheduler.update_from_output`` appends it, with
   its ``cache_blocks`` call under speculative decoding (:func:`_sample`);
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

The driver adapts to the vLLM release it runs (features detected once per
process, :mod:`differential.driver.features`): constructor arguments a release
lacks are left out when their value is the release's default, and a scenario
that needs a missing piece comes back *unsupported*, naming it. Every call
into vLLM goes through :func:`~differential.driver.features.vllm_call`: an
exception inside one is vLLM's (the run's ``error`` names the phase and the
call); a constructor's missing argument or refusal, or a workload pool too
small for manager mode, is *unsupported*; any other exception is kvfuzz's
own failure (``InternalError``).
"""

from __future__ import annotations

import contextlib
import gc
import os

# vLLM resolves its platform once; the scheduler mode's VllmConfig needs it to
# be the CPU (set before vLLM is imported, never overriding the caller's).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import vllm
import vllm.v1.core.kv_cache_utils as kv_cache_utils
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from differential.capabilities import Feature, Unsupported
from differential.driver.block_ledger import BlockLedger
from differential.driver.cache_metrics import MetricsRecorder
from differential.driver.features import (
    RunEnd,
    UnsupportedFeature,
    VllmCallError,
    classified_run,
    has,
    parameters,
    vllm_build,
    vllm_call,
)
from differential.driver.kv_events import EventRecorder
from differential.driver.prefix_cache import cached_blocks, changed_counts
from differential.driver.settings import ResolvedDrafter, resolve_drafter
from differential.driver.specs import dcp_block_sizes, kv_cache_config, pool_blocks
from differential.driver.trace import trace_lookups
from differential.errors import InternalError, ScenarioError
from differential.observation import (
    BlockWrite,
    ManagerSettings,
    RequestObservation,
    RunObservation,
)
from differential.scenario import GroupKind, KVEvents, MambaPrefill, Scenario

__all__ = ["VLLM_VERSION", "run_scenario"]

VLLM_VERSION: str = vllm.__version__

init_none_hash(sha256)

# vLLM's import (about 4,300 modules, torch and transformers included) lives as
# long as the process: moved out of the collector's reach, it is never scanned
# again (garbage collection was 12 % of a campaign and 34 % of a seed-scale
# run), and forked children keep sharing its pages. Every process that drives
# vLLM (command line, campaign workers, shrinker, tree workers) imports this
# module once, right after vLLM.
gc.freeze()

# vLLM reads its environment variables through vllm.envs, which looks each one
# up in os.environ on every read (maybe_convert_block_hash reads one per block
# hash converted) until EngineCore caches them all once it has started
# (enable_envs_cache in vllm/v1/engine/core.py and
# vllm/v1/executor/multiproc_executor.py). kvfuzz drives the cache manager as
# that engine does, after its start: the same cache. A release without it, or
# a variable that cannot be read here (read, and raising, when vLLM reads it),
# leaves the rest lazy.
with contextlib.suppress(Exception):
    import vllm.envs

    vllm.envs.enable_envs_cache()

_MANAGER_PARAMETERS = parameters(KVCacheManager.__init__)
_HASHER_PARAMETERS = parameters(get_request_block_hasher)
_REQUEST_PARAMETERS = parameters(Request.__init__)
#: SamplingParams is a msgspec Struct: its fields, as its constructor takes them.
_SAMPLING_PARAMETERS = frozenset(getattr(SamplingParams, "__struct_fields__", ()))

#: Marks "no override": the scenario's own retention interval applies.
UNSET = object()


def resolve_retention(scenario: Scenario, override: int | object | None) -> int | None:
    """The retention interval a run uses, in tokens: ``override`` (``None``
    for the dense cross-check run), or the scenario's own when it is
    :data:`UNSET`."""
    retention = scenario.retention_interval_tokens if override is UNSET else override
    assert retention is None or isinstance(retention, int)
    return retention


def check_dcp_block_sizes(scenario: Scenario, config: Any) -> None:
    """The scheduler and hash block sizes vLLM's engine resolves under the
    scenario's decode context parallelism (:func:`~differential.driver.specs.dcp_block_sizes`)
    must be the scenario's own, which the oracle judges in.

    Raises:
        InternalError: they differ (kvfuzz's model of DCP is not vLLM's).
    """
    resolved = dcp_block_sizes(scenario, config)
    derived = (scenario.scheduler_block_size_tokens, scenario.effective_hash_block_size_tokens)
    if resolved != derived:
        raise InternalError(
            f"vLLM resolves (scheduler block, hash block) {resolved} tokens at dcp "
            f"{scenario.dcp_world_size}; the scenario derives {derived}"
        )


def _mamba_scheduler_view(
    scenario: Scenario, manager: KVCacheManager, resolved: ResolvedDrafter
) -> SimpleNamespace | None:
    """The attributes ``Scheduler._mamba_block_aligned_split`` reads, set as
    ``Scheduler.__init__`` sets them (vllm/v1/core/sched/scheduler.py), or
    ``None`` without Mamba groups (``need_mamba_block_aligned_split`` off).

    ``cache_config.block_size`` is the Mamba block size (vLLM sets
    ``mamba_block_size = cache_config.block_size`` in align mode);
    ``max_num_scheduled_tokens`` is the scenario's ``step_budget_tokens``
    budget and ``long_prefill_token_threshold`` is 0.
    ``mamba_has_prefill_checkpoint_blocks`` (alignment 1) is on exactly when
    the scenario's Mamba layers export prefill checkpoints
    (``mamba_prefill: checkpoint``, :func:`differential.driver.specs.group_spec`).
    """
    if not scenario.mamba_groups:
        return None
    block = scenario.mamba_groups[0].block_size_tokens
    hash_block = manager.block_pool.hash_block_size
    # The scheduler compares the hash block with its own (scheduler) block
    # size, which decode context parallelism makes larger than the Mamba one.
    partial = hash_block < scenario.scheduler_block_size_tokens and bool(
        getattr(manager.coordinator, "enable_partial_hash_hits", False)
    )
    checkpoints = scenario.mamba_prefill is MambaPrefill.CHECKPOINT
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block),
        block_size=scenario.scheduler_block_size_tokens,
        hash_block_size=hash_block,
        mamba_partial_cache_hit=partial,
        mamba_shared_prefix_checkpoint=partial
        and bool(getattr(manager, "mamba_shared_prefix_checkpoint", False)),
        use_eagle_block_drop=resolved.use_eagle_block_drop,
        num_hash_lookahead_tokens=resolved.num_hash_lookahead_tokens,
        mamba_has_prefill_checkpoint_blocks=checkpoints,
        mamba_prefill_checkpoint_alignment=1 if checkpoints else None,
        max_num_scheduled_tokens=scenario.step_budget_tokens,
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


def _new_step(manager: KVCacheManager) -> None:
    """Tell the manager a scheduler step starts, as ``Scheduler.schedule`` does
    (``KVCacheManager.new_step_starts``; releases without it need nothing)."""
    starts = getattr(manager, "new_step_starts", None)
    if starts is not None:
        vllm_call("KVCacheManager.new_step_starts", starts)


def _begin_step(d: _Driver) -> None:
    """A scheduler step begins (:func:`_new_step`), counted for the event log;
    the previous step's copy-on-write copies have run (:func:`_release_cow_copies`)."""
    _release_cow_copies(d)
    _new_step(d.manager)
    if d.ledger is not None:
        d.ledger.new_step()
    d.steps_begun += 1


def _release_cow_copies(d: _Driver) -> None:
    """Free the blocks a step's copy-on-write copies retained, as the
    synchronous ``Scheduler.schedule`` does right after its allocations
    (``KVCacheManager.take_kv_cache_block_copies``, then
    ``Scheduler._free_cow_retained_blocks``, vllm/v1/core/sched/scheduler.py):
    the worker runs the copies with the step, so nothing holds them after.
    Called when the next step begins (and after the run), once the block
    ledger has read the step's copies."""
    take = getattr(d.manager, "take_kv_cache_block_copies", None)
    if take is None:
        return
    _, retained = vllm_call("KVCacheManager.take_kv_cache_block_copies", take)
    if retained:
        d.manager.block_pool.free_blocks(retained)


def _drain_events(d: _Driver) -> None:
    """With events on, drain vLLM's event queue as the scheduler does once a
    step (``KVCacheManager.take_events``) and record it with the cache."""
    if d.events is not None:
        # Steps numbered from 0, as scheduler mode numbers them.
        step = max(0, d.steps_begun - 1)
        d.events.drain(step, vllm_call("KVCacheManager.take_events", d.events.take))


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
            cached = vllm_call(
                "BlockPool.get_cached_block",
                manager.block_pool.get_cached_block,
                hashes[(index + 1) * step - 1],
                [gid],
            )
            marks.append("1" if cached else "0")
        maps.append("".join(marks))
    return tuple(maps)


def _per_group_hits(scenario: Scenario, coordinator: Any, request: Request) -> tuple[int, ...]:
    """Each group's longest cache hit for ``request``, in tokens, in group order;
    ``()`` where the coordinator has no ``find_longest_cache_hit_per_group``.

    Diagnostic only (vLLM's scheduler calls it just for connectors on Mamba
    hybrids): capped at the hashed tokens, which lookahead hashes make
    shorter than the prompt, as the combined lookup's full-attention bound
    is (vllm/v1/core/kv_cache_coordinator.py).
    """
    if not hasattr(coordinator, "find_longest_cache_hit_per_group"):
        return ()
    hashed = len(request.block_hashes) * scenario.effective_hash_block_size_tokens
    _, found = coordinator.find_longest_cache_hit_per_group(
        request.block_hashes, min(request.num_tokens - 1, hashed)
    )
    return tuple(found)


def _blocks_per_group(keys: Counter[bytes], num_groups: int) -> list[int]:
    counts = [0] * num_groups
    for key, n in keys.items():
        counts[get_group_id(key)] += n
    return counts


@dataclass
class _Driver:
    """What the build phase made: the manager and the scheduler-side views
    every later phase reads (one per run; mutable only in ``seen`` and
    ``evicted``)."""

    scenario: Scenario
    resolved: ResolvedDrafter
    manager: KVCacheManager
    settings: ManagerSettings
    hasher: Any
    mamba_view: SimpleNamespace | None
    scheduler_view: SimpleNamespace
    ledger: BlockLedger | None
    record_cache_map: bool
    # The KV cache event recorder (None: events off, nothing recorded).
    events: EventRecorder | None = None
    # Prefix-cache statistics and resets (None: a release without log_stats).
    metrics: MetricsRecorder | None = None
    steps_begun: int = 0
    # vLLM's requests made so far, in order (their hashes name the events').
    made: list[Request] = field(default_factory=list)
    # The cached block keys after the last request (what the next one looks
    # up against: nothing changes the cache between a free and the next
    # lookup), and their count per group.
    seen: Counter[bytes] = field(default_factory=Counter)
    seen_per_group: list[int] = field(default_factory=list)
    evicted: int = 0
    # The cache map of the request being driven, from its lookup until freed.
    pending_cache_map: tuple[str, ...] = ()
    # (request index, step, group, tokens computed after the step, tokens its
    # table holds): the steps whose tokens an attention table held no slot for.
    uncovered: list[tuple[int, int, int, int, int]] = field(default_factory=list)


@dataclass
class _Lookup:
    """One request's lookup (``KVCacheManager.get_computed_blocks``) and what
    was recorded around it; ``hit_tokens`` and ``junction_tokens`` in tokens."""

    request: Request
    before: Counter[bytes]
    blocks: Any
    hit_tokens: int
    junction_tokens: int
    per_group: tuple[int, ...]
    traced: list[Any]
    lookup_blocks: tuple[Any, ...]
    cache_map: tuple[str, ...]


def manager_settings(
    manager: KVCacheManager, scenario: Scenario, resolved: ResolvedDrafter
) -> ManagerSettings:
    """The settings ``manager`` was built with, as the observation records them."""
    coordinator = manager.coordinator
    alignment = getattr(
        coordinator, "_cache_hit_alignment_tokens", scenario.scheduler_block_size_tokens
    )
    return ManagerSettings(
        use_eagle_block_drop=resolved.use_eagle_block_drop,
        num_hash_lookahead_tokens=resolved.num_hash_lookahead_tokens,
        num_lookahead_tokens=resolved.num_lookahead_tokens,
        num_prefill_lookahead_tokens=resolved.num_prefill_lookahead_tokens,
        hit_alignment_tokens=alignment,
        hash_block_size_tokens=manager.block_pool.hash_block_size,
        partial_hash_hits=bool(getattr(coordinator, "enable_partial_hash_hits", False)),
    )


# Block hashes vLLM's hasher computed in this process: (hash block size,
# lookahead tokens, parent hash or NONE_HASH, the tokens from the first
# unhashed block on) -> the new hashes. A judged comparison makes the same
# requests in every run of every variant (no variant patches the hasher), so
# each prompt is hashed once; see memoised_hasher.
_HASHES: dict[tuple[Any, ...], list[Any]] = {}
_HASHES_MAX_TOKENS = 4_000_000  # tokens held as keys before the memo is cleared
_hashes_tokens = 0


def memoised_hasher(hasher: Any, block_size: int, lookahead: int) -> Callable[[Request], list[Any]]:
    """``hasher`` (a ``request_block_hasher`` from vLLM's
    ``get_request_block_hasher``, vllm/v1/core/kv_cache_utils.py) answering
    from a per-process memo.

    vLLM's chained hash of a block depends on the parent hash (``NONE_HASH``
    for the first block), the block's tokens, the lookahead tokens after it
    and the request's extra keys. A request with extra keys (multimodal
    features or a cache salt, which scenarios may give; LoRA or prompt
    embeddings) is hashed afresh, by vLLM's hasher alone; for the others
    the new hashes are a function of the parent hash and the tokens from
    ``len(request.block_hashes) * block_size`` on, the memo's key with
    ``block_size`` (tokens) and ``lookahead`` (tokens). The memo is keyed by
    the ``kv_cache_utils`` module this process imported too (a tree's vLLM
    has its own), and cleared past 4M tokens of keys.
    """

    def hashes(request: Request) -> list[Any]:
        global _hashes_tokens
        if (
            getattr(request, "mm_features", None)
            or getattr(request, "lora_request", None) is not None
            or getattr(request, "cache_salt", None) is not None
            or getattr(request, "prompt_embeds", None) is not None
        ):
            return hasher(request)  # type: ignore[no-any-return]
        known = request.block_hashes
        tail = tuple(request.all_token_ids[len(known) * block_size :])
        parent = known[-1] if known else getattr(kv_cache_utils, "NONE_HASH", None)
        key = (kv_cache_utils, block_size, lookahead, parent, tail)
        found = _HASHES.get(key)
        if found is None:
            found = hasher(request)
            if _hashes_tokens + len(tail) > _HASHES_MAX_TOKENS:
                _HASHES.clear()
                _hashes_tokens = 0
            _HASHES[key] = found
            _hashes_tokens += len(tail)
        return list(found)

    return hashes


def block_hasher(scenario: Scenario, resolved: ResolvedDrafter) -> Any:
    """vLLM's request block hasher for the scenario's hash block size
    (``get_request_block_hasher``, vllm/v1/core/kv_cache_utils.py), memoised
    across runs (:func:`memoised_hasher`)."""
    with_lookahead = "num_hash_lookahead_tokens" in _HASHER_PARAMETERS
    lookahead = resolved.num_hash_lookahead_tokens if with_lookahead else 0
    block_size = scenario.effective_hash_block_size_tokens
    hasher = vllm_call(
        "get_request_block_hasher",
        get_request_block_hasher,
        block_size,
        sha256,
        *((lookahead,) if with_lookahead else ()),
    )
    return memoised_hasher(hasher, block_size, lookahead)


def mm_features(scenario: Scenario, index: int) -> list[Any] | None:
    """Request ``index``'s images as vLLM's ``MultiModalFeatureSpec`` list
    (vllm/multimodal/inputs.py), as vLLM's own tests build them
    (``tests/v1/core/utils.py`` ``create_requests``): a dummy encoder input,
    the ``PlaceholderRange`` (offset and length in tokens), the identifier,
    modality ``image``; sorted by offset. ``None`` without images, as vLLM's
    input processor leaves it."""
    placed = scenario.mm_placements[index]
    if not placed:
        return None
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalKwargsItem,
        PlaceholderRange,
    )

    return [
        vllm_call(
            "MultiModalFeatureSpec",
            MultiModalFeatureSpec,
            data=vllm_call("MultiModalKwargsItem.dummy", MultiModalKwargsItem.dummy),
            modality="image",
            identifier=p.identifier,
            mm_position=vllm_call(
                "PlaceholderRange",
                PlaceholderRange,
                offset=p.offset_tokens,
                length=p.length_tokens,
            ),
        )
        for p in placed
    ]


def make_request(
    scenario: Scenario, index: int, prompt: Sequence[int], hasher: Any, max_tokens: int
) -> Request:
    """vLLM's ``Request`` for request ``index`` (id ``req-<index>``), with at
    most ``max_tokens`` sampled tokens, its images (:func:`mm_features`) and
    its ``cache_salt``; with ``workload.kv_events`` ``full`` its
    ``kv_cache_report_mode`` is ``"full"`` (``SamplingParams.extra_args``);
    with ``workload.priorities`` its ``priority``, arriving at time ``index``.

    Raises:
        Unsupported: the request has images or a cache salt and the running
            vLLM's ``Request`` takes no ``mm_features`` or ``cache_salt``, or
            skips reading the prefix cache and its ``SamplingParams`` takes
            no ``skip_reading_prefix_cache``.
    """
    spec = scenario.requests[index]
    sampling: dict[str, Any] = {"max_tokens": max_tokens}
    if scenario.workload.kv_events is KVEvents.FULL:
        # vllm/v1/request.py reads the report mode from the sampling params.
        sampling["extra_args"] = {"kv_cache_report_mode": "full"}
    if spec.skip_reading_prefix_cache:
        # As a prompt_logprobs request sets it (vllm/sampling_params.py).
        if "skip_reading_prefix_cache" not in _SAMPLING_PARAMETERS:
            raise Unsupported(
                "SamplingParams(skip_reading_prefix_cache=) (vllm/sampling_params.py)"
            )
        sampling["skip_reading_prefix_cache"] = True
    request_args = {
        "request_id": f"req-{index}",
        "prompt_token_ids": list(prompt),
        "sampling_params": vllm_call("SamplingParams", SamplingParams, **sampling),
        "pooling_params": None,
        "block_hasher": hasher,
    }
    if scenario.mm_placements[index]:
        request_args["mm_features"] = mm_features(scenario, index)
    if spec.cache_salt is not None:
        request_args["cache_salt"] = spec.cache_salt
    if scenario.workload.priorities is not None:
        # The priority policy orders ties by arrival: request i arrives at i.
        request_args["priority"] = scenario.workload.priorities[index]
        request_args["arrival_time"] = float(index)

    for name in ("mm_features", "cache_salt", "priority", "arrival_time"):
        if name in request_args and name not in _REQUEST_PARAMETERS:
            raise Unsupported(f"Request({name}=) (vllm/v1/request.py)")
    return vllm_call(
        "Request",
        Request,
        **{k: v for k, v in request_args.items() if k in _REQUEST_PARAMETERS},
    )


def _build(
    scenario: Scenario,
    retention: int | None,
    phase: list[str],
    *,
    record_cache_map: bool,
    record_blocks: bool,
) -> _Driver:
    """Build phase: resolve the drafter, build ``KVCacheManager`` and the views."""
    resolved = resolve_drafter(scenario)
    phase[0] = "build KVCacheManager"
    longest = max(r.prompt_tokens for r in scenario.requests)
    max_model_len = longest + scenario.decode_steps + resolved.num_lookahead_tokens + 1
    if not has(Feature.SCHEDULER_BLOCK_SIZE):
        raise UnsupportedFeature(Feature.SCHEDULER_BLOCK_SIZE)
    optional: dict[str, int | bool] = {}
    if "num_hash_lookahead_tokens" in _MANAGER_PARAMETERS:
        optional["num_hash_lookahead_tokens"] = resolved.num_hash_lookahead_tokens
    if has(Feature.PREFILL_LOOKAHEAD):
        optional["num_prefill_lookahead"] = resolved.num_prefill_lookahead_tokens
    elif resolved.num_prefill_lookahead_tokens:
        raise UnsupportedFeature(Feature.PREFILL_LOOKAHEAD)
    if scenario.enable_mamba_shared_prefix_checkpoint:
        optional["enable_mamba_shared_prefix_checkpoint"] = True
    if scenario.workload.kv_events is not KVEvents.OFF:
        optional["enable_kv_cache_events"] = True
    if "log_stats" in _MANAGER_PARAMETERS:
        optional["log_stats"] = True
    config = kv_cache_config(
        scenario,
        resolved,
        scenario.workload.pool_blocks or pool_blocks(scenario, resolved),
        retention,
    )
    if scenario.dcp_world_size > 1:
        # As EngineCore builds the Scheduler's manager: the DCP size from
        # ParallelConfig, the block sizes from vLLM's own resolver.
        optional["dcp_world_size"] = scenario.dcp_world_size
        check_dcp_block_sizes(scenario, config)
    manager = vllm_build(
        "KVCacheManager",
        "vllm/v1/core/kv_cache_manager.py",
        KVCacheManager,
        kv_cache_config=config,
        max_model_len=max_model_len,
        scheduler_block_size=scenario.scheduler_block_size_tokens,
        hash_block_size=scenario.effective_hash_block_size_tokens,
        enable_caching=True,
        use_eagle=resolved.use_eagle_block_drop,
        **optional,
    )
    seen = cached_blocks(manager)
    return _Driver(
        scenario=scenario,
        resolved=resolved,
        manager=manager,
        settings=manager_settings(manager, scenario, resolved),
        hasher=block_hasher(scenario, resolved),
        mamba_view=_mamba_scheduler_view(scenario, manager, resolved),
        # Scheduler._reserve_prefill_lookahead reads only this attribute.
        scheduler_view=SimpleNamespace(num_prefill_lookahead=resolved.num_prefill_lookahead_tokens),
        ledger=(
            BlockLedger.for_manager(manager, scenario.num_sink_blocks) if record_blocks else None
        ),
        record_cache_map=record_cache_map,
        seen=seen,
        seen_per_group=_blocks_per_group(seen, len(scenario.kv_cache_groups)),
        events=None
        if scenario.workload.kv_events is KVEvents.OFF
        else EventRecorder(
            manager, scenario.workload.kv_events.value, scenario.effective_hash_block_size_tokens
        ),
        metrics=MetricsRecorder(manager) if "log_stats" in _MANAGER_PARAMETERS else None,
    )


def _lookup(d: _Driver, index: int, prompt: Sequence[int]) -> _Lookup:
    """Lookup phase: a new step, then ``get_computed_blocks`` (junction stored
    on the request as the scheduler stores it)."""
    scenario, manager = d.scenario, d.manager
    coordinator = manager.coordinator
    request = make_request(scenario, index, prompt, d.hasher, scenario.decode_steps + 1)
    d.made.append(request)
    before = d.seen  # the cache as the previous request's free left it
    _begin_step(d)
    cache_map = _cache_map(scenario, manager, request) if d.record_cache_map else ()
    d.pending_cache_map = cache_map
    per_group = vllm_call(
        "KVCacheCoordinator.find_longest_cache_hit_per_group",
        _per_group_hits,
        scenario,
        coordinator,
        request,
    )
    queue_start = d.events.queue_length() if d.events is not None else 0
    with trace_lookups(coordinator) as traced:
        lookup = vllm_call(
            "KVCacheManager.get_computed_blocks", manager.get_computed_blocks, request
        )
    # Releases without junction pinning return (blocks, hit tokens).
    blocks, hit, junction = (*lookup, 0) if len(lookup) == 2 else lookup
    if d.events is not None:
        d.events.lookup(index, hit, blocks, queue_start)
    if hasattr(manager, "record_prefix_cache_stats"):
        # The scheduler records the lookup once it admits the request
        # (Scheduler.schedule); releases before it record inside the lookup.
        vllm_call(
            "KVCacheManager.record_prefix_cache_stats",
            manager.record_prefix_cache_stats,
            request,
            hit,
        )
    request.shared_prefix_boundary = junction
    lookup_blocks = d.ledger.lookup(blocks.blocks) if d.ledger is not None else ()
    if not per_group:
        per_group = (hit,) * len(scenario.kv_cache_groups)
    return _Lookup(
        request=request,
        before=before,
        blocks=blocks,
        hit_tokens=hit,
        junction_tokens=junction,
        per_group=tuple(per_group),
        traced=list(traced),
        lookup_blocks=lookup_blocks,
        cache_map=cache_map,
    )


def _prefill(
    d: _Driver, index: int, prompt_tokens: int, found: _Lookup, phase: list[str]
) -> list[BlockWrite]:
    """Prefill phase: chunks trimmed as the scheduler trims them, each one
    ``allocate_slots``; the first adopts the hit blocks. Returns the unsafe
    writes the ledger saw."""
    scenario, manager, request = d.scenario, d.manager, found.request
    mamba_view, ledger, resolved = d.mamba_view, d.ledger, d.resolved
    hit, blocks = found.hit_tokens, found.blocks
    unsafe_writes: list[BlockWrite] = []
    computed = hit
    first = True
    while computed < prompt_tokens:
        phase[0] = f"request {index}: prefill allocate_slots at {computed} tokens"
        num_new = min(scenario.step_budget_tokens, prompt_tokens - computed)
        stalled_by = "the prefill chunking"
        if not first:
            _begin_step(d)
        if mamba_view is not None and scenario.mamba_prefill is MambaPrefill.BLOCK:
            num_new = _block_carved_chunk(mamba_view, computed, num_new)
        elif mamba_view is not None:
            stalled_by = "Scheduler._mamba_block_aligned_split"
            num_new = vllm_call(
                "Scheduler._mamba_block_aligned_split",
                Scheduler._mamba_block_aligned_split,
                mamba_view,
                request,
                num_new,
                hit if first else 0,
            )
        if has(Feature.PREFILL_LOOKAHEAD) and num_new:
            stalled_by = "Scheduler._reserve_prefill_lookahead"
            num_new = vllm_call(
                "Scheduler._reserve_prefill_lookahead",
                Scheduler._reserve_prefill_lookahead,
                d.scheduler_view,
                request,
                computed,
                num_new,
            )
        if num_new == 0:
            # vLLM's chunking left nothing to schedule: its scheduler would
            # never finish this prefill (a crash naming the call).
            raise VllmCallError(
                stalled_by,
                RuntimeError(
                    f"prefill stalled at {computed} tokens: nothing of a "
                    f"{scenario.step_budget_tokens}-token chunk is scheduled (prefill "
                    f"lookahead {resolved.num_prefill_lookahead_tokens} tokens)"
                ),
            )
        adopted = blocks.blocks if first else None
        cached_before = (
            ledger.before_step(request.request_id, computed, computed + num_new, adopted)
            if ledger is not None
            else {}
        )
        if first:
            allocated = vllm_call(
                "KVCacheManager.allocate_slots",
                manager.allocate_slots,
                request,
                num_new,
                num_new_computed_tokens=hit,
                new_computed_blocks=blocks,
                num_lookahead_tokens=resolved.num_lookahead_tokens,
            )
            request.status = RequestStatus.RUNNING
            first = False
        else:
            allocated = vllm_call(
                "KVCacheManager.allocate_slots",
                manager.allocate_slots,
                request,
                num_new,
                num_lookahead_tokens=resolved.num_lookahead_tokens,
            )
        if allocated is None:
            raise _pool_ran_out(d.scenario, f"at {computed} tokens of request {index}")
        _check_slots(d, index, request, computed + num_new)
        _drain_events(d)
        if ledger is not None:
            unsafe_writes += ledger.after_step(
                index, request.request_id, computed, computed + num_new, cached_before
            )
        computed += num_new
        request.num_computed_tokens = computed
    return unsafe_writes


def _check_slots(d: _Driver, index: int, request: Request, computed_tokens: int) -> None:
    """After a step's ``allocate_slots``: every attention group's table of
    ``request`` holds a slot for each of the ``computed_tokens`` the request
    will have computed (``allocate_slots``: "Allocate new blocks for tokens
    to be computed"); a shortfall goes to ``d.uncovered`` (Mamba and
    circular-buffer groups are not attention tables). The scheduler-mode
    driver's ``_record_uncovered`` is the same check after ``schedule()``."""
    groups = d.scenario.kv_cache_groups
    managers = d.manager.coordinator.single_type_managers
    for gid, (group, manager) in enumerate(zip(groups, managers, strict=False)):
        if not group.kind.slot_table:
            continue
        held = len(manager.req_to_blocks.get(request.request_id, ())) * manager.block_size
        if held < computed_tokens:
            d.uncovered.append((index, d.steps_begun, gid, computed_tokens, held))


def _pool_ran_out(scenario: Scenario, where: str) -> Exception:
    """The error for a pool that ran out ``where``: bad input when the scenario
    sized the pool (the manager-level driver never evicts a running request),
    else kvfuzz's own sizing bug (:func:`differential.driver.specs.pool_blocks`
    leaves room for every request)."""
    pool = scenario.workload.pool_blocks
    if pool is None:
        return InternalError(f"the block pool ran out {where}")
    return ScenarioError(
        "workload.pool_blocks",
        pool,
        f"enough blocks to hold each request on its own (it ran out {where}; the "
        "manager-level driver never evicts a running request), or null",
    )


def _sample(d: _Driver, index: int, step: int, request: Request) -> None:
    """The token sampled by the previous step reaches the request, as in
    ``Scheduler.update_from_output`` (vllm/v1/core/sched/scheduler.py): it is
    appended, and with speculative decoding configured (``num_spec_tokens >
    0``) the request's blocks are cached up to its computed tokens
    (``KVCacheManager.cache_blocks``): blocks whose lookahead hash needed
    that token become cached then."""
    vllm_call(
        "Request.append_output_token_ids",
        request.append_output_token_ids,
        d.scenario.output_token(index, step),
    )
    if d.scenario.drafter.num_speculative_tokens:
        vllm_call(
            "KVCacheManager.cache_blocks",
            d.manager.cache_blocks,
            request,
            request.num_computed_tokens,
        )


def _decode(d: _Driver, index: int, request: Request, phase: list[str]) -> list[BlockWrite]:
    """Decode phase: ``decode_steps`` steps of one sampled token each."""
    manager, ledger = d.manager, d.ledger
    unsafe_writes: list[BlockWrite] = []
    computed = request.num_computed_tokens
    for step in range(d.scenario.decode_steps):
        phase[0] = f"request {index}: decode step {step}"
        _begin_step(d)
        _sample(d, index, step, request)
        cached_before = (
            ledger.before_step(request.request_id, computed, computed + 1, None)
            if ledger is not None
            else {}
        )
        allocated = vllm_call(
            "KVCacheManager.allocate_slots",
            manager.allocate_slots,
            request,
            1,
            num_lookahead_tokens=d.resolved.num_lookahead_tokens,
        )
        if allocated is None:
            raise _pool_ran_out(d.scenario, f"at decode step {step} of request {index}")
        _check_slots(d, index, request, computed + 1)
        _drain_events(d)
        if ledger is not None:
            unsafe_writes += ledger.after_step(
                index, request.request_id, computed, computed + 1, cached_before
            )
        computed += 1
        request.num_computed_tokens = computed
    return unsafe_writes


def _free(
    d: _Driver, index: int, found: _Lookup, unsafe_writes: list[BlockWrite]
) -> RequestObservation:
    """Free phase: ``free``, count evictions and what the request retained."""
    manager = d.manager
    vllm_call("KVCacheManager.free", manager.free, found.request)
    _drain_events(d)
    after = cached_blocks(manager)
    # Evictions are the counts the changed keys lost, and the per-group
    # counts move by their changes.
    # found.before is d.seen: its per-group counts are d.seen_per_group.
    after_per_group = list(d.seen_per_group)
    for key, was, now in changed_counts(d.seen, after):
        d.evicted += max(0, was - now)
        after_per_group[get_group_id(key)] += now - was
    added = [a - b for a, b in zip(after_per_group, d.seen_per_group, strict=True)]
    d.seen, d.seen_per_group = after, after_per_group
    return RequestObservation(
        index=index,
        prompt_tokens=found.request.num_prompt_tokens,
        hit_tokens=found.hit_tokens,
        shared_prefix_boundary_tokens=found.junction_tokens,
        per_group_hit_tokens=found.per_group,
        retained_blocks_per_group=tuple(added),
        cache_map=found.cache_map,
        lookup=tuple(found.traced),
        lookup_blocks=found.lookup_blocks,
        unsafe_writes=tuple(unsafe_writes),
        step_tables=d.ledger.take_tables(index) if d.ledger is not None else (),
    )


def run_scenario(
    scenario: Scenario,
    variant: str,
    *,
    retention_interval_tokens: int | object | None = UNSET,
    record_cache_map: bool = False,
    record_blocks: bool = True,
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
        record_blocks: record the blocks every lookup returned and what they
            held, and every block a step wrote that was not the request's
            alone (:class:`~differential.driver.block_ledger.BlockLedger`), for
            the block-level check; off, the run is faster and that check is
            skipped.

    Returns:
        The observation. If vLLM raised, ``error`` names the phase, the vLLM
        call and the exception, and ``requests`` holds the requests completed
        before it. If the scenario needs a feature this vLLM lacks,
        ``unsupported`` names it and nothing ran.

    Raises:
        InternalError: kvfuzz's driver failed (an exception outside vLLM's
            calls), naming the phase.
    """
    retention = resolve_retention(scenario, retention_interval_tokens)
    phase = ["resolve drafter settings"]
    observed: list[RequestObservation] = []
    d: _Driver | None = None
    with classified_run("driver", phase, VLLM_VERSION) as outcome:
        d = _build(
            scenario,
            retention,
            phase,
            record_cache_map=record_cache_map,
            record_blocks=record_blocks,
        )
        for index, (spec, prompt) in enumerate(
            zip(scenario.requests, scenario.prompts, strict=True)
        ):
            phase[0] = f"request {index}: lookup"
            found = _lookup(d, index, prompt)
            unsafe_writes = _prefill(d, index, spec.prompt_tokens, found, phase)
            if d.metrics is not None and not d.metrics.resets:
                # The request holds its blocks: a reset must be refused.
                phase[0] = f"request {index}: reset_prefix_cache while it runs"
                vllm_call(
                    "KVCacheManager.reset_prefix_cache",
                    d.metrics.reset,
                    max(0, d.steps_begun - 1),
                    1,
                )
            unsafe_writes += _decode(d, index, found.request, phase)
            phase[0] = f"request {index}: last sampled token"
            _sample(d, index, scenario.decode_steps, found.request)
            _drain_events(d)
            phase[0] = f"request {index}: free"
            observed.append(_free(d, index, found, unsafe_writes))
            d.pending_cache_map = ()
        _release_cow_copies(d)
        if d.metrics is not None:
            phase[0] = "after the run: prefix-cache statistics"
            vllm_call("KVCacheManager.reset_prefix_cache", d.metrics.finish)
            if d.events is not None:
                d.events.drain_after_run()
    return _observation(variant, retention, d, outcome, observed)


def _observation(
    variant: str,
    retention: int | None,
    d: _Driver | None,
    outcome: RunEnd,
    observed: list[RequestObservation],
) -> RunObservation:
    """The run as observed: nothing but why when vLLM refused the scenario
    (``outcome.unsupported``), else every request observed and what the
    driver recorded, with the error that ended the run early, if any."""
    if outcome.unsupported is not None:
        return RunObservation(
            variant=variant,
            vllm_version=VLLM_VERSION,
            settings=None,
            requests=(),
            retention_interval_tokens=retention,
            unsupported=outcome.unsupported,
        )
    return RunObservation(
        variant=variant,
        vllm_version=VLLM_VERSION,
        settings=None if d is None else d.settings,
        requests=tuple(observed),
        evicted_blocks=0 if d is None else d.evicted,
        error=outcome.error,
        retention_interval_tokens=retention,
        blocks_recorded=d is not None and d.ledger is not None,
        crash_cache_map=d.pending_cache_map if d is not None and outcome.error else (),
        kv_events=d.events.log(d.made) if d is not None and d.events is not None else None,
        metrics=None if d is None or d.metrics is None else d.metrics.metrics(),
        uncovered_steps=() if d is None else tuple(d.uncovered),
    )

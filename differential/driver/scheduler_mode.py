"""Drive a scenario through vLLM's real ``Scheduler``, kvfuzz as the model runner.

vLLM code driven: vllm/v1/core/sched/scheduler.py ``Scheduler`` (``__init__``,
``add_request``, ``schedule``, ``update_from_output``,
``update_draft_token_ids``), built from a real ``VllmConfig``
(vllm/config/vllm.py) whose ``ModelConfig`` reads a tiny HF-style
``config.json`` kvfuzz writes to a temporary directory (no hub access, no
weights, no tokenizer), with ``CacheConfig`` (block size, prefix caching,
``num_gpu_blocks`` = the pool in blocks) and ``SchedulerConfig`` (token budget,
max sequences, chunked prefill). The KV cache groups come from
:func:`differential.driver.specs.kv_cache_config`, exactly as in manager mode,
so both modes run the same ``KVCacheConfig``.

The model runner is replaced: after every ``schedule()`` kvfuzz builds the
``ModelRunnerOutput`` (vllm/v1/outputs.py) itself. A request whose scheduled
tokens reach its end samples the next tokens of its deterministic stream
(:meth:`differential.scenario.Scenario.output_token`); with drafts, ``1 +
accepted`` tokens, the accepted count taken from the workload's
``accepted_drafts``; the next drafts are handed back with
``Scheduler.update_draft_token_ids`` as the engine core does.

Offline work-arounds (stated, not hidden):

* ``SpeculativeConfig`` cannot be validated offline (it loads a draft model
  config from the hub). The instance :mod:`differential.driver.settings`
  builds (a real ``SpeculativeConfig``, its validators skipped) is set on the
  built ``VllmConfig`` after validation, so ``Scheduler.__init__`` reads the
  same ``num_speculative_tokens``, ``use_eagle_block_drop`` and lookahead
  settings through vLLM's own properties.
* The KV connector (``kv_connector: true``) is set the same way: vLLM's
  ``KVConnectorFactory`` builds :class:`differential.driver.connector.EmptyRemoteConnector`
  (an external connector with an empty remote store; vLLM's bundled
  ``ExampleConnector`` refuses hybrid models) on the scheduler side, or,
  with ``workload.connector``, :class:`~differential.driver.connector.RemoteStoreConnector`
  (a store keeping what requests computed), with ``kv_role`` ``kv_both`` and
  the ``recompute`` load-failure policy. The model runner stands in for the
  worker's side of it (:meth:`_ModelRunner.loads`): an asynchronous load
  finishes in the step that starts it (``finished_recving``), or fails as
  the workload says (``failed_recving``, or ``invalid_block_ids`` for one
  KV cache group).

Client aborts (``workload.abort_steps``) call ``Scheduler.finish_requests``
with ``FINISHED_ABORTED`` before a step's ``schedule()``, as vLLM's engine
core does when a client disconnects.

Observation: one :class:`~differential.observation.RequestObservation` per
request, in scenario order, with the hit of the lookup that admitted it (the
``get_computed_blocks`` call followed by a successful ``allocate_slots``; a
preempted request's lookup when it is rescheduled is recorded apart, as a
:class:`~differential.observation.ResumedLookup`), ``scheduled_step`` (the
step it was admitted in), ``lookup_order`` and the free block queue's
counters (:class:`_FreeQueueClock`, for the oracle's LRU reference). Blocks
are recorded as in manager mode
(:class:`~differential.driver.block_ledger.BlockLedger`, for the block-level
check): what each group's blocks held at the admitting lookup, and every
``KVCacheManager.allocate_slots`` the scheduler makes (vLLM
``Scheduler.schedule``), wrapped like ``get_computed_blocks``, as a write of
the tokens ``[computed + new computed, + external + new tokens)`` (a
connector's load, then the step's tokens, drafts included), checked against
the blocks' reference counts right after the call, before a request
admitted later in the same step adopts them; a failed load's tokens are
forgotten again (:meth:`BlockLedger.forget`). With a connector's store, the
admitting lookup also records what the store was asked and what vLLM
adopted (:class:`~differential.observation.ConnectorLookup`; a divergent
hybrid lookup, ``get_computed_blocks_for_connector``, is recorded as the
lookup, and a reconcile after it as the same admission's). Evictions
(cached keys that disappear) and the unreachable cached blocks at the end
of the run are counted.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import logging
import os
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from vllm.v1.core.kv_cache_utils import get_group_id

import differential.driver.runner as runner
from differential.capabilities import Unsupported
from differential.driver import prefix_cache
from differential.driver.block_ledger import BlockLedger
from differential.driver.cache_metrics import MetricsRecorder
from differential.driver.disagg import PrefillInstance
from differential.driver.features import (
    VllmCallError,
    classified_run,
    quiet_vllm_logging,
    vllm_build,
    vllm_call,
)
from differential.driver.kv_events import EventRecorder
from differential.driver.runner import UNSET, resolve_retention
from differential.driver.settings import ResolvedDrafter, _speculative_config, resolve_drafter
from differential.driver.specs import kv_cache_config, pool_blocks, resolved_block_sizes
from differential.driver.trace import trace_lookups
from differential.errors import InternalError
from differential.findings import RESERVED_WITHOUT_BLOCKS, UNRESERVED_PARTIAL_TAIL_COPY
from differential.observation import (
    BlockRecord,
    BlockWrite,
    ConnectorLookup,
    LoadTargets,
    ManagerSettings,
    RequestObservation,
    ResumedLookup,
    RunObservation,
    StoreCall,
)
from differential.scenario import KVEvents, Scenario

__all__ = ["run_scheduler_scenario"]


# Steps without progress after which a run is declared stuck (kvfuzz's failure).
_MAX_IDLE_STEPS = 64

_TINY_MODEL = Path(__file__).resolve().parent / "tiny_model"


def _model_dir() -> str:
    """The folder holding a tiny HF-style ``config.json``, shipped with kvfuzz
    (``differential/driver/tiny_model``), so no run leaves a temporary folder.

    Only ``ModelConfig`` reads it (architecture, context length, dtype); no
    layer is ever built, so its sizes are placeholders.
    """
    return str(_TINY_MODEL)


@lru_cache(maxsize=64)
def _validated_config(
    block_size_tokens: int,
    budget_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    async_scheduling: bool = False,
) -> Any:
    """The validated ``VllmConfig`` for one layout, built once per process:
    ``ModelConfig`` (reading the tiny ``config.json``), ``CacheConfig`` and
    ``SchedulerConfig`` validated by vLLM, as :func:`_vllm_config` copies it.
    With ``async_scheduling`` the ``SchedulerConfig`` asks for it, so
    ``VllmConfig.__post_init__`` checks that this platform's executor
    supports it."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = vllm_call(
        "ModelConfig",
        ModelConfig,
        model=_model_dir(),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="float16",
    )
    cache_config = vllm_call(
        "CacheConfig",
        CacheConfig,
        block_size=block_size_tokens,
        enable_prefix_caching=True,
    )
    scheduler_config = vllm_call(
        "SchedulerConfig",
        SchedulerConfig,
        max_num_batched_tokens=budget_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        **({"async_scheduling": True} if async_scheduling else {}),
    )
    return vllm_call(
        "VllmConfig",
        VllmConfig,
        model_config=model,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        # Explicit, so a process that imported vLLM before kvfuzz set
        # VLLM_TARGET_DEVICE still builds it.
        device_config=vllm_call("DeviceConfig", DeviceConfig, device="cpu"),
    )


def _vllm_config(
    scenario: Scenario,
    resolved: ResolvedDrafter,
    num_blocks: int,
    max_model_len: int,
    prefill_instance: bool = False,
) -> Any:
    """A real ``VllmConfig`` for the scenario (see the module docstring): a
    deep copy of the layout's validated one (:func:`_validated_config`; a
    run's scheduler never sees another run's config), then set up as the
    scheduler reads it. ``prefill_instance``: the config of a disaggregated
    workload's prefill instance (:mod:`differential.driver.disagg`): its
    connector's ``kv_role`` ``kv_producer``, synchronous scheduling, no KV
    cache events."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import KVEventsConfig
    from vllm.config.kv_transfer import KVTransferConfig

    workload = scenario.workload
    budget = scenario.step_budget_tokens
    quiet_vllm_logging()
    config = copy.deepcopy(
        _validated_config(
            scenario.scheduler_block_size_tokens,
            budget,
            workload.max_num_seqs or min(8, budget),
            max_model_len,
            workload.async_scheduling and not prefill_instance,
        )
    )
    # After validation (see the module docstring): what the scheduler reads.
    _set_cache_layout(config, scenario, num_blocks)
    config.scheduler_config.max_num_batched_tokens = budget
    config.scheduler_config.max_num_scheduled_tokens = None
    # The prefill policy (vLLM's defaults unless the workload sets it): read
    # by Scheduler.__init__ and schedule(); the cap's range was checked on the
    # scenario (differential/scenario/rules.py).
    config.scheduler_config.long_prefill_token_threshold = workload.long_prefill_token_threshold
    config.scheduler_config.long_prefill_token_threshold_adaptive = (
        workload.long_prefill_token_threshold_adaptive
    )
    config.scheduler_config.prefill_schedule_interval = workload.prefill_schedule_interval
    # vLLM's own range check of the fraction (SchedulerConfig: 0 <= w < 1)
    # ran on the scenario's field (differential/scenario/json_form.py).
    config.scheduler_config.watermark = workload.watermark
    if workload.priorities is not None:
        # Request.priority per request (runner.make_request).
        config.scheduler_config.policy = "priority"
    if workload.kv_events is not KVEvents.OFF and not prefill_instance:
        # Events on, published nowhere: the driver records each batch at the
        # scheduler's own publish call (_install_recorders).
        object.__setattr__(
            config,
            "kv_events_config",
            vllm_call(
                "KVEventsConfig", KVEventsConfig, enable_kv_cache_events=True, publisher="null"
            ),
        )
    # Synchronous scheduling (each step's output before the next schedule())
    # unless the workload asks for vLLM's AsyncScheduler, whichever platform
    # vLLM resolved in this process: with an unresolved one VllmConfig turns
    # async scheduling on.
    config.scheduler_config.async_scheduling = workload.async_scheduling and not prefill_instance
    _set_drafter(config, scenario)
    store = workload.connector
    if scenario.kv_connector or store is not None:
        # An external connector with an empty remote store, or with a store
        # keeping what requests computed (workload.connector).
        object.__setattr__(
            config,
            "kv_transfer_config",
            vllm_call(
                "KVTransferConfig",
                KVTransferConfig,
                kv_connector=_connector_class(store),
                kv_connector_module_path="differential.driver.connector",
                kv_role=_kv_role(scenario, prefill_instance),
                **_remote_store_settings(scenario),
            ),
        )
        _set_hybrid_allocator(config)
    return config


def _set_hybrid_allocator(config: Any) -> None:
    """Turn the hybrid KV cache manager off for a connector without it, as
    ``VllmConfig.__post_init__`` (vllm/config/vllm.py) does once validation
    sees the connector (the config was validated without one):
    ``KVConnectorFactory.supports_hma_config`` decides."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    supported = vllm_call(
        "KVConnectorFactory.supports_hma_config",
        KVConnectorFactory.supports_hma_config,
        config.kv_transfer_config,
    )
    if not supported:
        config.scheduler_config.disable_hybrid_kv_cache_manager = True


def _connector_class(store: Any) -> str:
    """The class name of kvfuzz's connector (differential/driver/connector.py)
    for the workload's store (``None``: an empty one)."""
    if store is None:
        return "EmptyRemoteConnector"
    return "RemoteStoreConnector" if store.supports_hma else "SingleGroupStoreConnector"


def _set_cache_layout(config: Any, scenario: Scenario, num_blocks: int) -> None:
    """Set ``config``'s KV cache as the scenario lays it out, after
    validation: the pool (``num_blocks``, in blocks), prefix caching, the
    per-rank block size under decode context parallelism, and Mamba's align
    mode (its block the cache block, in tokens)."""
    config.cache_config.num_gpu_blocks = num_blocks
    config.cache_config.enable_prefix_caching = scenario.prefix_caching
    dcp = scenario.dcp_world_size
    if dcp > 1:
        # Decode context parallelism: the Scheduler hands this to its
        # KVCacheManager (Scheduler.__init__); CacheConfig.block_size is then
        # the per-rank block (EngineCore resolves the sharded scheduler block,
        # passed to the Scheduler as block_size, with resolve_kv_cache_block_sizes).
        config.parallel_config.decode_context_parallel_size = dcp
        config.cache_config.block_size = scenario.scheduler_block_size_tokens // dcp
    if scenario.mamba_groups and scenario.prefix_caching:
        # Prefix caching with Mamba runs in align mode (vllm/config/cache.py),
        # its block the cache block size (the per-rank one under DCP).
        config.cache_config.mamba_cache_mode = "align"
        config.cache_config.mamba_block_size = scenario.scheduler_block_size_tokens // dcp
    elif scenario.mamba_groups:
        # Without it vLLM keeps mode "none", a Mamba block the whole model
        # length (MambaModelConfig.verify_and_update_config,
        # vllm/model_executor/models/config.py).
        config.cache_config.mamba_cache_mode = "none"
        config.cache_config.mamba_block_size = config.model_config.max_model_len
    if scenario.enable_mamba_shared_prefix_checkpoint:
        config.cache_config.enable_mamba_shared_prefix_checkpoint = True


def _resolve_cache_block_size(config: Any, kv_config: Any) -> None:
    """Set ``CacheConfig.block_size`` as vLLM's engine does once the KV cache
    groups are known: ``EngineCore._initialize_kv_caches``
    (vllm/v1/engine/core.py, 0.32.0 and 0.33.0) sets it to the smallest block
    (tokens) of the prefix-cacheable groups (``KVCacheSpec.prefix_cacheable``;
    of all groups when none is, or when the release's specs do not say).

    The ``Scheduler`` reads it: ``_mamba_block_aligned_split`` aligns a Mamba
    hybrid's prefill chunks to it in align mode. With a group whose block is
    smaller than the Mamba block (a drafter's own group, vLLM's
    vllm/v1/worker/gpu/model_states/mamba_hybrid.py ``add_request`` names
    DFlash) that grid is not the Mamba block grid (vLLM PR #54076)."""
    groups = kv_config.kv_cache_groups
    if not groups:
        return
    participating = [
        g.kv_cache_spec.block_size
        for g in groups
        if getattr(g.kv_cache_spec, "prefix_cacheable", True)
    ]
    config.cache_config.block_size = min(
        participating or [g.kv_cache_spec.block_size for g in groups]
    )


def _set_drafter(config: Any, scenario: Scenario) -> None:
    """Set the scenario's ``SpeculativeConfig`` on ``config`` after
    validation (see the module docstring), then run vLLM's own check of the
    step budget against the draft slots (lookahead tokens), which
    validation skipped, and, under async scheduling, its check of the
    drafter (:func:`_check_async_drafter`).

    Raises:
        Unsupported: vLLM refuses async scheduling with this drafter.
    """
    object.__setattr__(config, "speculative_config", _speculative_config(scenario))
    if config.scheduler_config.async_scheduling:
        _check_async_drafter(config)
    if config.speculative_config is not None and hasattr(config, "_set_max_num_scheduled_tokens"):
        # A budget of no more than num_lookahead_tokens is a configuration
        # vLLM refuses, not one whose scheduler stalls.
        vllm_build(
            "VllmConfig._set_max_num_scheduled_tokens",
            "vllm/config/vllm.py",
            config._set_max_num_scheduled_tokens,
        )


def _check_async_drafter(config: Any) -> None:
    """vLLM's refusal of async scheduling with a drafter the V1 model runner
    cannot draft for asynchronously, which validation skipped (the
    ``SpeculativeConfig`` is set after it): ``VllmConfig.__post_init__``
    (vllm/config/vllm.py) raises when async scheduling is asked for, the V1
    model runner is used (``use_v2_model_runner`` false, as on this CPU
    build without Triton) and the method is none of ``EagleModelTypes``,
    ``NgramGPUTypes``, ``draft_model``, ``dspark`` or ``dflash``
    (vllm/config/speculative.py), or padded drafter batches are off. The
    same condition, read from vLLM's own type lists.

    Raises:
        Unsupported: naming vLLM's refusal and its file.
    """
    from typing import get_args

    from vllm.config.speculative import EagleModelTypes, NgramGPUTypes

    spec = config.speculative_config
    # The V1 model runner, always: VllmConfig.use_v2_model_runner reads the
    # process's platform and Triton (vllm/config/vllm.py), which differ
    # between processes here (a worker that has resolved the CPU platform
    # and one that has not), and the V1 runner is the one without Triton,
    # as on the CPU engine. Releases before 0.33.0 refuse the same drafters
    # whatever the runner.
    if spec is None:
        return
    allowed = {*get_args(EagleModelTypes), *get_args(NgramGPUTypes)}
    allowed |= {"draft_model", "dspark", "dflash"}
    if spec.method not in allowed or getattr(spec, "disable_padded_drafter_batch", False):
        raise Unsupported(
            "VllmConfig.__post_init__ refuses async scheduling with the V1 model runner "
            f"for {spec.method}-based speculative decoding (vllm/config/vllm.py)"
        )


def _kv_role(scenario: Scenario, prefill_instance: bool) -> str:
    """``KVTransferConfig.kv_role``: ``kv_producer`` for a prefill instance,
    else the workload's store's (``kv_both`` without a store)."""
    if prefill_instance:
        return "kv_producer"
    store = scenario.workload.connector
    return "kv_both" if store is None else store.kv_role.value


def _remote_store_settings(scenario: Scenario) -> dict[str, Any]:
    """The ``KVTransferConfig`` settings of the workload's connector store
    (none for the empty remote store): its lookup unit and hash block, in
    tokens, its own grid (tokens) and capacity (chunks), and its
    load-failure policy (``kv_load_failure_policy``)."""
    store = scenario.workload.connector
    if store is None:
        return {}
    return {
        "kv_load_failure_policy": store.kv_load_failure_policy.value,
        "kv_connector_extra_config": {
            "load": store.load.value,
            "divergent_hybrid_hits": store.divergent_hybrid_hits,
            "lookup_unit_tokens": scenario.effective_hit_alignment_tokens,
            "hash_block_tokens": scenario.effective_hash_block_size_tokens,
            "chunk_tokens": store.chunk_tokens,
            "capacity_chunks": store.capacity_chunks,
        },
    }


def _size_encoder_budget(scheduler: Any, scenario: Scenario) -> None:
    """Give ``scheduler`` an encoder budget for the scenario's images that
    never cuts a prefill step.

    ``Scheduler.__init__`` sizes its encoder compute budget and encoder
    cache from the model's multimodal processor (``MultiModalBudget``,
    vllm/multimodal/encoder_budget.py), which the tiny text-only model has
    not: both are 0, and a step stops before any image
    (``Scheduler._try_schedule_encoder_inputs``). As vLLM's own scheduler
    tests do (``tests/v1/core/test_scheduler.py``), kvfuzz sets
    ``max_num_encoder_input_tokens`` and a real ``EncoderCacheManager``
    (vllm/v1/core/encoder_cache_manager.py) itself, both the scenario's
    image tokens in all (in tokens): more than any step can schedule, so
    prefill steps end where they would without images and both driving
    modes chunk alike; the encoder budget's own scheduling is not what
    kvfuzz tests. Nothing changes for a scenario without images.
    """
    if not scenario.has_mm_inputs:
        return
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    total = sum(p.length_tokens for placed in scenario.mm_placements for p in placed)
    scheduler.max_num_encoder_input_tokens = total
    scheduler.encoder_cache_manager = vllm_call(
        "EncoderCacheManager", EncoderCacheManager, cache_size=total
    )


@dataclass
class _Admission:
    """A request's admitting lookup (tokens), recorded around the real call."""

    hit_tokens: int = 0
    junction_tokens: int = 0
    per_group: tuple[int, ...] = ()
    traced: tuple[Any, ...] = ()
    cache_map: tuple[str, ...] = ()
    before: Counter[bytes] = field(default_factory=Counter)
    step: int = -1
    blocks: tuple[tuple[BlockRecord | None, ...], ...] = ()
    # The blocks as the step's own forward leaves them, when the lookup
    # read a state that forward writes (BlockRecord.written_in_step_by):
    # what a request first scheduled in a later step reads (an async load).
    blocks_after_step: tuple[tuple[BlockRecord | None, ...], ...] | None = None
    queue_removals: int | None = None
    known_tokens: int = 0
    diverged: bool = False
    shown_tokens: int = 0  # the local hit shown to a KV connector (before a reconcile)
    # Set by the admitting allocate_slots (_record_adoption): the local and
    # external tokens adopted, and the connector's answer to this lookup.
    adopted: tuple[int, int] | None = None
    query: Any = None
    # Set when the request is first scheduled (_admit): NewRequestData's
    # (num_computed_tokens, replay_start), in tokens.
    replay: tuple[int, int] | None = None
    # The lookup's rank among every get_computed_blocks call of the process
    # (_LOOKUP_CALLS): the order Scheduler.schedule made the lookups in,
    # which within a step is the waiting queue's (FCFS: arrival; priority:
    # (priority, arrival_time)), not the scenario's request order.
    sequence: int = 0


_LOOKUP_CALLS = itertools.count()


def _looked_up(
    ledger: BlockLedger | None, blocks: Any
) -> tuple[
    tuple[tuple[BlockRecord | None, ...], ...], tuple[tuple[BlockRecord | None, ...], ...] | None
]:
    """What a lookup's ``blocks`` (``KVCacheBlocks.blocks``) held as the
    ledger knows them, and, when one is a state its own scheduler step
    writes, as that step's forward leaves them (``None`` otherwise)."""
    if ledger is None:
        return (), None
    held = ledger.lookup(blocks)
    if any(b is not None and b.written_in_step_by is not None for row in held for b in row):
        return held, ledger.lookup(blocks, after_step=True)
    return held, None


def _record_lookups(
    scenario: Scenario,
    manager: Any,
    record_cache_map: bool,
    lookups: dict[str, list[_Admission]],
    step: list[int],
    failures: list[BaseException],
    ledger: BlockLedger | None = None,
    clock: _FreeQueueClock | None = None,
    events: EventRecorder | None = None,
    index_of: dict[str, int] | None = None,
) -> None:
    """Wrap this manager's ``get_computed_blocks`` (an instance attribute, so
    variant patches on the class still run inside) to record every call, with
    what its blocks held when ``ledger`` is given, the free queue's removal
    count when ``clock`` is, and, when ``events`` is, the call and the KV
    cache events it emitted (``index_of``: request id -> scenario index,
    filled before the first call).

    An exception in kvfuzz's own bookkeeping is kept in ``failures`` (the
    caller raises it as kvfuzz's failure), never passed off as vLLM's.
    """
    real = manager.get_computed_blocks
    coordinator = manager.coordinator
    inside = [False]  # within get_computed_blocks_for_connector: one lookup, recorded there

    def get_computed_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
        if inside[0]:
            return real(request, *args, **kwargs)
        return recorded(real, request, *args, **kwargs)

    def recorded(call: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            cache_map = runner._cache_map(scenario, manager, request) if record_cache_map else ()
            before = prefix_cache.cached_blocks(manager)
        except Exception as exc:  # kvfuzz's own failure
            failures.append(exc)
            return real(request, *args, **kwargs)
        per_group = (  # diagnostic only
            runner._per_group_hits(scenario, coordinator, request)
            if scenario.prefix_caching
            else ()
        )
        queue_start = events.queue_length() if events is not None else 0
        with trace_lookups(coordinator) as traced:
            result = call(request, *args, **kwargs)
        hit, junction = result[1], (result[2] if len(result) > 2 else 0)
        if events is not None and index_of is not None:
            try:
                events.lookup(index_of[request.request_id], hit, result[0], queue_start)
            except Exception as exc:  # kvfuzz's own failure
                failures.append(exc)
        diverged = bool(result[3]) if len(result) > 3 else False
        shown = hit
        made = lookups.get(request.request_id)
        if made and made[-1].adopted is None and made[-1].step == step[0] and made[-1].diverged:
            # vLLM's reconcile after a divergent hit the connector added nothing
            # to (Scheduler.schedule): the same admission's lookup, redone.
            diverged, shown = True, made[-1].shown_tokens
        try:
            blocks, after = _looked_up(ledger, result[0].blocks)
        except Exception as exc:  # kvfuzz's own failure
            failures.append(exc)
            blocks, after = (), None
        lookups.setdefault(request.request_id, []).append(
            _Admission(
                hit_tokens=hit,
                junction_tokens=junction,
                per_group=per_group or (hit,) * len(scenario.kv_cache_groups),
                traced=tuple(traced),
                cache_map=cache_map,
                before=before,
                step=step[0],
                blocks=blocks,
                blocks_after_step=after,
                queue_removals=None if clock is None else clock.removals,
                known_tokens=request.num_tokens,
                diverged=diverged,
                shown_tokens=shown,
                sequence=next(_LOOKUP_CALLS),
            )
        )
        return result

    manager.get_computed_blocks = get_computed_blocks
    for_connector = getattr(manager, "get_computed_blocks_for_connector", None)
    if for_connector is None:
        return

    def get_computed_blocks_for_connector(request: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM's Scheduler._get_local_prefix_cache_hit for a connector with
        # supports_divergent_local_hybrid_hits; its fallback calls
        # get_computed_blocks, which is then this lookup, not another.
        inside[0] = True
        try:
            return recorded(for_connector, request, *args, **kwargs)
        finally:
            inside[0] = False

    manager.get_computed_blocks_for_connector = get_computed_blocks_for_connector


def _binder(function: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    """A function taking ``function``'s arguments and returning them by
    parameter name, defaults filled in: ``inspect.signature(function).bind``
    then ``apply_defaults``, without building a ``BoundArguments`` on every
    call when the parameters are plain (no ``*args`` or ``**kwargs``; the
    recorders below wrap ``allocate_slots`` on every step). The answer is
    keyed by parameter name, as the parameters' order differs between
    releases.

    Raises (from the returned function):
        TypeError: more positional arguments than ``function`` takes, a
            keyword it lacks or one given twice (a missing required
            argument is absent from the answer).
    """
    signature = inspect.signature(function)
    parameters = list(signature.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):

        def bound(*args: Any, **kwargs: Any) -> dict[str, Any]:
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()
            return dict(call.arguments)

        return bound
    positional = [
        p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    names = {p.name for p in parameters if p.kind is not p.POSITIONAL_ONLY}
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}

    def fast(*args: Any, **kwargs: Any) -> dict[str, Any]:
        if (
            len(args) > len(positional)
            or not names.issuperset(kwargs)
            or (kwargs and not kwargs.keys().isdisjoint(positional[: len(args)]))
        ):
            raise TypeError(f"arguments {args!r}, {kwargs!r} do not fit {signature}")
        given = dict(defaults)
        given.update(zip(positional, args, strict=False))
        given.update(kwargs)
        return given

    return fast


def _record_writes(
    manager: Any,
    ledger: BlockLedger,
    index_of: dict[str, int],
    writes: dict[int, list[BlockWrite]],
    failures: list[BaseException],
    replay_tokens: int = 0,
) -> None:
    """Wrap this manager's ``allocate_slots`` (an instance attribute, as in
    :func:`_record_lookups`) so the ledger records every step's write: the
    tokens ``[num_computed_tokens + num_new_computed_tokens,
    + num_external_computed_tokens + num_new_tokens)`` (vLLM's own layout in
    ``KVCacheManager.allocate_slots``: a KV connector's load writes the
    request's own tokens after the local hit, then the step computes), the
    lookup's blocks adopted when ``new_computed_blocks`` is given. Unsafe
    writes go to ``writes`` per request index; a failure of the ledger to
    ``failures``.

    Under the FCFS policy the scheduler only preempts requests not yet
    scheduled in the step, so every successful call is a step's write.

    ``replay_tokens``: the window ``W`` of the model's bounded-replay groups
    (vLLM PR #56227), 0 without one. The Scheduler rewinds a hit's computed
    count by the window (``Request.replay_start = H - W``, set afresh at
    every admission and after every remote load), and the steps that
    recompute the replayed tokens rebuild only that group ("the replayed
    tokens keep their cached KV in every other group"): what a step writes
    starts no lower than ``replay_start + W``.
    """
    real = manager.allocate_slots
    # Bound by name: the parameters' order differs between releases.
    bind = _binder(real)

    def allocate_slots(*args: Any, **kwargs: Any) -> Any:
        try:
            given = bind(*args, **kwargs)
            request = given["request"]
            # A connector's load writes the request's own tokens after the
            # local hit, as the step's compute does after it.
            start = request.num_computed_tokens + given.get("num_new_computed_tokens", 0)
            loaded = given.get("num_external_computed_tokens", 0)
            end = start + loaded + given["num_new_tokens"]
            # What allocate_slots frees against (remove_skipped_blocks): the
            # total computed tokens, local and external, less those in flight.
            processed = max(
                0,
                min(start + loaded, getattr(manager, "max_model_len", start + loaded))
                - getattr(request, "num_in_flight_tokens", 0),
            )
            replay_start = getattr(request, "replay_start", 0) if replay_tokens else 0
            if replay_start and not loaded:
                # (An admission's load ends at the hit: the floor itself.)
                floor = replay_start + replay_tokens
                if start < floor:
                    # A step inside the replayed range: nothing cached is rewritten.
                    start, end = floor, max(end, floor)
            blocks = given.get("new_computed_blocks")
            adopted = blocks.blocks if blocks is not None else None
            rid = request.request_id
            # Tokens past the request's own (and, under async scheduling, its
            # output placeholders') are the step's draft tokens.
            drafts = max(
                0, end - request.num_tokens - getattr(request, "num_output_placeholders", 0)
            )
            cached_before = ledger.before_step(rid, start, end, adopted)
        except Exception as exc:  # kvfuzz's own failure
            failures.append(exc)
            return real(*args, **kwargs)
        result = real(*args, **kwargs)
        if result is not None and rid in index_of:
            try:
                i = index_of[rid]
                writes.setdefault(i, []).extend(
                    ledger.after_step(
                        i,
                        rid,
                        start,
                        end,
                        cached_before,
                        processed_tokens=processed,
                        loaded_tokens=loaded,
                        draft_tokens=drafts,
                        adopted=adopted,
                    )
                )
            except Exception as exc:  # kvfuzz's own failure
                failures.append(exc)
        return result

    manager.allocate_slots = allocate_slots


def _record_watermark_admissions(
    manager: Any,
    index_of: dict[str, int],
    step: list[int],
    admissions: list[tuple[int, int, int]],
    failures: list[BaseException],
) -> None:
    """Wrap this manager's ``allocate_slots`` (an instance attribute, as in
    :func:`_record_lookups`) to record each successful call for a waiting or
    preempted request made while other requests were scheduled: the calls
    ``KVCacheManager.allocate_slots`` applies the watermark to
    (``has_scheduled_reqs`` and the request's ``RequestStatus``), as
    ``(request index, step, free blocks right after the call)``."""
    from vllm.v1.request import RequestStatus

    real = manager.allocate_slots
    # The method's own parameters (``real`` may be another recorder's wrapper).
    bind = _binder(type(manager).allocate_slots.__get__(manager))
    watched = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    def allocate_slots(*args: Any, **kwargs: Any) -> Any:
        try:
            given = bind(*args, **kwargs)
            request = given["request"]
            applies = bool(given.get("has_scheduled_reqs", True)) and (request.status in watched)
        except Exception as exc:  # kvfuzz's own failure
            failures.append(exc)
            return real(*args, **kwargs)
        result = real(*args, **kwargs)
        if result is not None and applies and request.request_id in index_of:
            free = manager.block_pool.get_num_free_blocks()
            admissions.append((index_of[request.request_id], step[0], free))
        return result

    manager.allocate_slots = allocate_slots


def _record_adoption(
    manager: Any,
    lookups: dict[str, list[_Admission]],
    connector: Any,
    failures: list[BaseException],
) -> None:
    """Wrap this manager's ``allocate_slots`` (an instance attribute, as in
    :func:`_record_lookups`) so the first successful call after a lookup
    records what it adopted: ``num_new_computed_tokens`` (local) and
    ``num_external_computed_tokens`` (the connector's store), in tokens,
    and the connector's last answer for the request (``connector``: the
    :class:`~differential.driver.connector.RemoteStoreConnector`, or
    ``None``)."""
    real = manager.allocate_slots
    # The method's own parameters (``real`` may be another recorder's wrapper).
    bind = _binder(type(manager).allocate_slots.__get__(manager))

    def allocate_slots(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if result is None:
            return result
        try:
            given = bind(*args, **kwargs)
            rid = given["request"].request_id
            made = lookups.get(rid)
            if made and made[-1].adopted is None:
                made[-1].adopted = (
                    given.get("num_new_computed_tokens", 0),
                    given.get("num_external_computed_tokens", 0),
                )
                queries = connector.queries.get(rid) if connector is not None else None
                made[-1].query = queries[-1] if queries else None
        except Exception as exc:  # kvfuzz's own failure
            failures.append(exc)
        return result

    manager.allocate_slots = allocate_slots


class _FreeQueueClock:
    """Removals from vLLM's free block queue, and each request's first free.

    vLLM's ``BlockPool`` (vllm/v1/core/block_pool.py) keeps free blocks in
    eviction order in a ``FreeKVCacheBlockQueue``
    (vllm/v1/core/kv_cache_utils.py): ``free_blocks`` appends freed cached
    blocks and prepends uncached ones, ``get_new_blocks`` pops from the front
    (``popleft_n``; evicting a cached block it pops) and ``touch`` takes a
    block a hit adopts out of the queue (``remove``). The clock counts every
    block removed (``removals``, in blocks; the null block is popped when the
    pool is built, before the clock is installed) and, per request, the
    queue's length and the removal count just before the first
    ``free_blocks`` call made on the request's behalf since it was last
    scheduled from the waiting queue (``first_free``: a preemption's free
    does not count, the request's blocks going back to the queue again
    later). A
    call is attributed to the request whose ``KVCacheManager.allocate_slots``,
    ``free`` or ``remove_skipped_blocks`` is running; a ``free_blocks`` call
    outside all three sets ``unattributed`` (the run's counters are then not
    used). A ``KVCacheManager.free`` of a request that has not finished is
    vLLM's ``Scheduler._preempt_request``: ``preempted`` keeps, per request,
    (its lookups so far, its ``num_computed_tokens``, the queue's length,
    the removal count, its ``num_tokens``, its ``num_in_flight_tokens`` and
    its ``num_tokens`` when ``allocate_slots`` last scheduled it,
    ``scheduled_known``) as the free begins. The oracle reads them in
    :func:`differential.oracle.engine.timeline_writers` and
    :func:`differential.oracle.engine.resumed_findings`.

    Deferred frees (async scheduling with a KV consumer connector,
    ``Scheduler.defer_block_free``): ``Scheduler._free_request_blocks``
    takes a finished or preempted request's blocks with
    ``KVCacheManager.pop_blocks_for_free`` and ``_drain_deferred_frees``
    hands them to ``free_blocks`` once the in-flight steps are processed, a
    call outside the three above. The clock records which request each
    popped block is (``deferred``: block id -> (request id, preempted, KV
    cache group, index in the group's table)) and attributes the later call
    to its owner (a preempted request's does not count as its first free);
    ``drained`` keeps each such call as ``(request id, step, (group, index)
    per block in the order freed)``.
    """

    __slots__ = (
        "current",
        "deferred",
        "drained",
        "first_free",
        "lookups",
        "num_free",
        "preempted",
        "removals",
        "scheduled_known",
        "step",
        "unattributed",
    )

    def __init__(self, lookups: dict[str, list[_Admission]], step: list[int] | None = None) -> None:
        self.removals = 0
        self.current: str | None = None
        self.first_free: dict[str, tuple[int, int]] = {}
        self.unattributed = False
        self.lookups = lookups
        self.preempted: dict[str, tuple[int, int, int, int, int, int, int | None]] = {}
        self.scheduled_known: dict[str, int] = {}
        self.step = step if step is not None else [0]
        self.deferred: dict[int, tuple[str, bool, int, int]] = {}
        self.drained: list[tuple[str, int, tuple[tuple[int, int], ...]]] = []

    def install(self, manager: Any) -> None:
        """Wrap the instance attributes of ``manager``'s block pool and free
        queue, and the manager's three calls that free blocks (instance
        attributes, so variant patches on the classes still run inside)."""
        pool = manager.block_pool
        queue = pool.free_block_queue
        popleft, popleft_n, remove = queue.popleft, queue.popleft_n, queue.remove
        free_blocks = pool.free_blocks
        num_free = self.num_free = pool.get_num_free_blocks

        def counted_popleft() -> Any:
            block = popleft()
            self.removals += 1
            return block

        def counted_popleft_n(n: int) -> Any:
            blocks = popleft_n(n)
            self.removals += n
            return blocks

        def counted_remove(block: Any) -> None:
            remove(block)
            self.removals += 1

        def attributed_free_blocks(ordered_blocks: Any) -> None:
            rid = self.current
            if rid is None and self.deferred:
                ordered_blocks = list(ordered_blocks)
                self._drain(ordered_blocks, num_free())
            elif rid is None:
                self.unattributed = True
            elif rid not in self.first_free:
                self.first_free[rid] = (num_free(), self.removals)
            free_blocks(ordered_blocks)

        queue.popleft, queue.popleft_n, queue.remove = (
            counted_popleft,
            counted_popleft_n,
            counted_remove,
        )
        pool.free_blocks = attributed_free_blocks
        self._attribute(
            manager, "allocate_slots", lambda a, k: (a[0] if a else k["request"]).request_id
        )
        free = manager.free

        def attributed_free(*args: Any, **kwargs: Any) -> None:
            request = args[0] if args else kwargs["request"]
            rid: str = request.request_id
            preempted = not request.is_finished()
            if preempted:
                self.preempted[rid] = (
                    len(self.lookups.get(rid, ())),
                    request.num_computed_tokens,
                    num_free(),
                    self.removals,
                    request.num_tokens,
                    getattr(request, "num_in_flight_tokens", 0),
                    self.scheduled_known.get(rid),
                )
            outer, self.current = self.current, rid
            try:
                free(*args, **kwargs)
            finally:
                self.current = outer
            if preempted:
                # Its blocks are handed out again from its resumption on; the
                # free that counts for what it promises is a later one.
                self.first_free.pop(rid, None)

        manager.free = attributed_free
        self._record_scheduled(manager)
        self._attribute(
            manager, "remove_skipped_blocks", lambda a, k: a[0] if a else k["request_id"]
        )
        self._record_pops(manager)

    def _record_scheduled(self, manager: Any) -> None:
        """Wrap ``manager.allocate_slots`` so ``scheduled_known`` keeps, per
        request, its ``num_tokens`` (in tokens) at its last successful call:
        ``KVCacheManager.allocate_slots`` (vllm/v1/core/kv_cache_manager.py)
        caches ``min(computed + new, request.num_tokens)`` tokens, never an
        output placeholder."""
        real = manager.allocate_slots

        def allocate_slots(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            if result is not None:
                request = args[0] if args else kwargs["request"]
                self.scheduled_known[request.request_id] = request.num_tokens
            return result

        manager.allocate_slots = allocate_slots

    def _record_pops(self, manager: Any) -> None:
        """Wrap ``manager.pop_blocks_for_free`` (the deferred-free path,
        vllm/v1/core/kv_cache_manager.py) so each popped block is known by
        its owner, group and index in the group's block table
        (``deferred``)."""
        pop = getattr(manager, "pop_blocks_for_free", None)
        if pop is None:
            return
        managers = manager.coordinator.single_type_managers

        def recorded_pop(*args: Any, **kwargs: Any) -> Any:
            request = args[0] if args else kwargs["request"]
            rid: str = request.request_id
            where = {
                block.block_id: (group, index)
                for group, single in enumerate(managers)
                for index, block in enumerate(single.req_to_blocks.get(rid, ()))
                if not block.is_null
            }
            blocks = pop(*args, **kwargs)
            preempted = not request.is_finished()
            for block in blocks:
                if block.block_id in where:
                    self.deferred[block.block_id] = (rid, preempted, *where[block.block_id])
            return blocks

        manager.pop_blocks_for_free = recorded_pop

    def _drain(self, blocks: list[Any], queued: int) -> None:
        """Attribute a ``free_blocks`` call made outside the manager's calls
        (``Scheduler._drain_deferred_frees``) to the request whose popped
        blocks it frees, ``queued`` the free queue's length before it (in
        blocks); a call freeing no popped block leaves the run unattributed."""
        owned = [self.deferred.pop(b.block_id) for b in blocks if b.block_id in self.deferred]
        if not owned:
            self.unattributed = True
            return
        rid, preempted = owned[0][0], owned[0][1]
        if any(o[0] != rid for o in owned):
            self.unattributed = True
        elif not preempted and rid not in self.first_free:
            self.first_free[rid] = (queued, self.removals)
        self.drained.append((rid, self.step[0], tuple((o[2], o[3]) for o in owned)))

    def _attribute(
        self, manager: Any, name: str, request_id: Callable[[tuple[Any, ...], dict[str, Any]], str]
    ) -> None:
        """Wrap ``manager.<name>`` so the ``free_blocks`` calls it makes are
        attributed to the request ``request_id(args, kwargs)`` names."""
        real = getattr(manager, name)

        def attributed(*args: Any, **kwargs: Any) -> Any:
            outer = self.current
            self.current = request_id(args, kwargs)
            try:
                return real(*args, **kwargs)
            finally:
                self.current = outer

        setattr(manager, name, attributed)

    def resumed(self, request_id: str, step: int) -> ResumedLookup | None:
        """The lookup that rescheduled ``request_id`` after its last
        preemption, if it made one since (the preemption is then consumed)."""
        mark = self.preempted.get(request_id)
        made = self.lookups.get(request_id) or []
        if mark is None or len(made) <= mark[0]:
            return None
        del self.preempted[request_id]
        lookup = made[-1]
        _, computed, queued, removals, known, in_flight, scheduled = mark
        recorded = not self.unattributed
        return ResumedLookup(
            step=step,
            hit_tokens=lookup.hit_tokens,
            known_tokens=lookup.known_tokens,
            preempted_computed_tokens=computed,
            freed_queue_blocks=queued if recorded else None,
            freed_queue_removals=removals if recorded else None,
            lookup_queue_removals=lookup.queue_removals if recorded else None,
            preempted_known_tokens=known,
            preempted_in_flight_tokens=in_flight,
            scheduled_known_tokens=scheduled,
        )

    def freed(self, request_id: str) -> tuple[int | None, int | None]:
        """(queue length, removals) at the request's first free, in blocks;
        ``(None, None)`` when never freed or the run's frees were not all attributed."""
        if self.unattributed or request_id not in self.first_free:
            return None, None
        return self.first_free[request_id]


def _arrive(
    scheduler: Any,
    requests: list[Any],
    arrival_steps: tuple[int, ...] | None,
    added: int,
    step: int,
    phase: list[str],
    prefill: Callable[[list[int]], None] | None = None,
) -> int:
    """Add the requests that arrive at ``step``: by their arrival step, or
    (``arrival_steps`` ``None``: sequential) the next one when the engine is
    empty, each first through ``prefill`` (a disaggregated workload's
    prefill instance) when given. Returns how many requests have been added
    in all."""
    now = added
    while now < len(requests):
        if arrival_steps is None:
            if scheduler.get_num_unfinished_requests():
                break
        elif arrival_steps[now] > step:
            break
        now += 1
        if arrival_steps is None:
            break
    if prefill is not None and now > added:
        phase[0] = f"step {step}: prefill instance, req-{added}..req-{now - 1}"
        prefill(list(range(added, now)))
    for i in range(added, now):
        phase[0] = f"step {step}: add_request req-{i}"
        vllm_call("Scheduler.add_request", scheduler.add_request, requests[i])
    return now


def _abort(
    scheduler: Any,
    requests: list[Any],
    abort_steps: tuple[int | None, ...] | None,
    added: int,
    step: int,
    aborted: set[int],
    phase: list[str],
) -> list[int]:
    """Abort, before ``step``'s ``schedule()``, every request added so far
    whose abort step has come and that has not finished
    (``Scheduler.finish_requests`` with ``FINISHED_ABORTED``, as vLLM's
    engine core aborts a disconnected client's request). Returns the indices
    aborted now; ``aborted`` collects them."""
    if abort_steps is None:
        return []
    from vllm.v1.request import RequestStatus

    now = []
    for i in range(added):
        due = abort_steps[i]
        if due is None or due > step or i in aborted or requests[i].is_finished():
            continue
        phase[0] = f"step {step}: abort req-{i}"
        vllm_call(
            "Scheduler.finish_requests",
            scheduler.finish_requests,
            requests[i].request_id,
            RequestStatus.FINISHED_ABORTED,
        )
        aborted.add(i)
        now.append(i)
    return now


class _InjectedLoadFailure(logging.Filter):
    """Drops vLLM's error line for a failed KV load under the ``fail``
    policy ("Failing N request(s) due to KV load failure",
    ``Scheduler._handle_invalid_blocks``): kvfuzz's model runner injected
    the failure (``workload.connector.failed_loads``), so the line is the
    answer expected, not news for the console; the oracle judges which
    requests failed (``wrong-finish``). Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failing %d request(s) due to KV load failure")


_INJECTED_LOAD_FAILURE = _InjectedLoadFailure()


class _ModelRunner:
    """kvfuzz in the model runner's place: what each scheduled request samples
    and drafts after a ``schedule()`` (see the module docstring)."""

    def __init__(self, scenario: Scenario, manager: Any) -> None:
        self.scenario = scenario
        self.accepted = scenario.workload.accepted_drafts
        # Drafts handed back per request (none when the workload accepts none).
        self.num_spec = scenario.drafter.num_speculative_tokens if self.accepted else 0
        self.decode_count = 0
        store = scenario.workload.connector
        self.to_fail = frozenset(store.failed_loads) if store is not None else frozenset()
        if self.to_fail:
            # Once per process: a filter added twice is one filter.
            logging.getLogger("vllm.v1.core.sched.scheduler").addFilter(_INJECTED_LOAD_FAILURE)
        self.failed: set[int] = set()  # request indices whose load failed
        self.manager = manager
        self.async_scheduling = scenario.workload.async_scheduling
        # Under async scheduling: per request id, the tokens the worker has
        # sampled so far (the scheduler learns of them a step later).
        self.sampled: dict[str, int] = {}

    @staticmethod
    def load_events(
        out: Any, index_of: dict[str, int], lost: list[tuple[str, int, int]]
    ) -> list[str]:
        """The timeline's words for the connector's loads this step: each
        load started, in tokens, and the loads lost (:meth:`loads`)."""
        meta = getattr(out, "kv_connector_metadata", None)
        words = [
            f"req-{index_of[load.request_id]} loads "
            f"[{load.start_tokens}, {load.end_tokens}) {'async' if load.load_async else 'sync'}"
            for load in getattr(meta, "loads", ())
        ]
        words += [
            f"req-{index_of[rid]}'s load of [{start}, {end}) fails" for rid, start, end in lost
        ]
        return words

    def loads(
        self, scheduler: Any, out: Any, index_of: dict[str, int]
    ) -> tuple[Any, list[tuple[str, int, int]]]:
        """The worker's ``KVConnectorOutput`` for the connector's loads this
        step (``None`` when there are none to report), and the loads lost,
        as ``(request id, first lost token, end)``.

        Synchronous loads run in the forward pass and are not reported. An
        asynchronous load finishes within the step (``finished_recving``),
        unless it is a listed request's first: then it fails, as the whole
        load (``failed_recving``, also in ``finished_recving``, vLLM's
        request-level report) or, with a single KV cache group, as its last
        block (``invalid_block_ids``: the valid prefix before it is kept,
        vllm/v1/core/sched/scheduler.py ``_update_requests_with_invalid_blocks``).
        """
        from vllm.v1.outputs import KVConnectorOutput

        meta = getattr(out, "kv_connector_metadata", None)
        finished: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        lost: list[tuple[str, int, int]] = []
        for load in getattr(meta, "loads", ()):
            if not load.load_async:
                continue
            finished.add(load.request_id)
            i = index_of[load.request_id]
            if i not in self.to_fail or i in self.failed:
                continue
            self.failed.add(i)
            managers = self.manager.coordinator.single_type_managers
            if len(managers) == 1:
                size = managers[0].block_size
                (table,) = self.manager.get_block_ids(load.request_id)
                last = (load.end_tokens - 1) // size
                invalid.add(table[last])
                lost.append((load.request_id, last * size, load.end_tokens))
            else:
                failed.add(load.request_id)
                lost.append((load.request_id, load.start_tokens, load.end_tokens))
        if not finished:
            return None, lost
        output = KVConnectorOutput(finished_recving=finished, failed_recving=failed)
        output.invalid_block_ids = invalid
        return output, lost

    def _partial_prefill(self, request: Any, spec: list[int]) -> bool:
        """Whether the request's scheduled tokens stop short of its end (a
        partial prefill chunk, which samples nothing), read right after
        ``schedule()``. Under async scheduling the tokens sampled by a step
        still in flight are placeholders the scheduler counts
        (``num_output_placeholders``), so vLLM's own mark is read:
        ``Request.is_prefill_chunk``, which ``Scheduler._update_after_schedule``
        sets (vllm/v1/core/sched/scheduler.py)."""
        if self.async_scheduling:
            return bool(request.is_prefill_chunk)
        return request.num_computed_tokens < request.num_tokens and not spec

    def step(
        self, scheduler: Any, out: Any, index_of: dict[str, int]
    ) -> tuple[list[list[int]], list[list[int]], list[str]]:
        """(sampled token ids, next drafts, timeline events), one each per
        request of ``out.num_scheduled_tokens``, in its order."""
        sampled: list[list[int]] = []
        drafts: list[list[int]] = []
        events: list[str] = []
        for rid, scheduled in out.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            i = index_of[rid]
            spec = out.scheduled_spec_decode_tokens.get(rid) or []
            if self._partial_prefill(request, spec):
                # A partial prefill chunk samples nothing.
                sampled.append([])
                drafts.append([])
                events.append(f"req-{i} +{scheduled} (prefill)")
                continue
            n = self.sampled.get(rid, 0) if self.async_scheduling else len(request.output_token_ids)
            take = 1
            if spec:  # drafts scheduled: accept the workload's count, reject the rest
                accepted = self.accepted
                wanted = accepted[self.decode_count % len(accepted)] if accepted else 0
                take += min(len(spec), wanted)
                self.decode_count += 1
            sampled.append([self.scenario.output_token(i, n + k) for k in range(take)])
            if self.async_scheduling:
                self.sampled[rid] = n + take
            events.append(
                f"req-{i} +{scheduled}"
                + (f" ({take - 1}/{len(spec)} drafts accepted)" if spec else "")
            )
            drafts.append(
                [self.scenario.output_token(i, n + take + k) for k in range(self.num_spec)]
            )
        return sampled, drafts, events


def _admission_note(admission: _Admission) -> str:
    """``hit H``, and where the request starts when it starts below its hit
    (a bounded-replay group's replay, vLLM PR #56227: ``starts at H - W``,
    or at 0 for a hit the replay does not adopt)."""
    note = f"hit {admission.hit_tokens}"
    if admission.replay is not None and admission.replay[0] < admission.hit_tokens:
        note += f", starts at {admission.replay[0]}"
    return note


def _timeline_line(
    step: int,
    *,
    arrivals: range,
    aborts: list[int],
    admitted: dict[int, str],
    events: list[str],
    loads: list[str],
    preempted: list[int],
    done: list[str],
    lost: int,
    applied: int | None = None,
) -> str:
    """One step of ``kvfuzz explain``'s timeline; ``admitted`` maps each
    request admitted this step to its note (:func:`_admission_note`); ``lost`` counts
    evicted cached blocks; ``applied`` (async scheduling) names the step
    whose model output this step applied."""
    line = f"step {step}:"
    if arrivals:
        line += f" arrive {', '.join(f'req-{k}' for k in arrivals)};"
    if aborts:
        line += f" abort {', '.join(f'req-{k}' for k in aborts)};"
    if admitted:
        line += f" admit {', '.join(f'req-{i} ({note})' for i, note in admitted.items())};"
    if loads:
        line += f" {'; '.join(loads)};"
    line += f" run {', '.join(events) or 'nothing'}"
    if preempted:
        line += f"; preempt {', '.join(f'req-{i}' for i in preempted)}"
    if applied is not None:
        line += f"; output of step {applied} applied"
    if done:
        line += f"; finish {', '.join(done)}"
    if lost:
        line += f"; {lost} cached blocks evicted"
    return line


def _observations(
    scenario: Scenario,
    admitted: dict[int, _Admission],
    finished_at: dict[int, Counter[bytes]],
    finished_step: dict[int, int],
    seen: Counter[bytes],
    writes: dict[int, list[BlockWrite]],
    clock: _FreeQueueClock,
    request_ids: list[str],
    resumed: dict[int, list[ResumedLookup]],
    failed_loads: set[int],
    ledger: BlockLedger | None = None,
    store: Any = None,
) -> list[RequestObservation]:
    """One observation per admitted request, in scenario order: its admitting
    lookup (with what its blocks held), the unsafe writes and block tables of
    its steps (``ledger``), the
    blocks per group it left cached (at its finish, or at the end of the
    run: ``seen``) and the free queue's counters (:class:`_FreeQueueClock`);
    ``store``: the connector whose load targets the lookups carry."""
    num_groups = len(scenario.kv_cache_groups)
    targets = getattr(store, "load_targets", {})
    # The admitting lookups in the order vLLM made them: a request scheduled
    # earlier in the same step has been allocated (its full blocks cached, at
    # allocate_slots) before a later one looks up, whatever their indices.
    order = sorted(admitted, key=lambda i: (admitted[i].step, admitted[i].sequence, i))
    observed = []
    for i in sorted(admitted):
        a = admitted[i]
        freed_blocks, freed_removals = clock.freed(request_ids[i])
        end = finished_at.get(i, seen)
        kept = [
            x - y
            for x, y in zip(
                runner._blocks_per_group(end, num_groups),
                runner._blocks_per_group(a.before, num_groups),
                strict=True,
            )
        ]
        observed.append(
            RequestObservation(
                index=i,
                prompt_tokens=scenario.requests[i].prompt_tokens,
                hit_tokens=a.hit_tokens,
                shared_prefix_boundary_tokens=a.junction_tokens,
                per_group_hit_tokens=a.per_group,
                retained_blocks_per_group=tuple(kept),
                cache_map=a.cache_map,
                lookup=a.traced,
                scheduled_step=a.step,
                lookup_order=order.index(i),
                finished_step=finished_step.get(i),
                lookup_blocks=a.blocks,
                unsafe_writes=tuple(writes.get(i, ())),
                step_tables=ledger.take_tables(i) if ledger is not None else (),
                lookup_queue_removals=None if clock.unattributed else a.queue_removals,
                freed_queue_blocks=freed_blocks,
                freed_queue_removals=freed_removals,
                resumed=tuple(
                    replace(
                        u,
                        freed_queue_blocks=None,
                        freed_queue_removals=None,
                        lookup_queue_removals=None,
                    )
                    if clock.unattributed
                    else u
                    for u in resumed.get(i, ())
                ),
                connector=_connector_lookup(a, i in failed_loads, targets.get(request_ids[i])),
                replay=a.replay if scenario.prefix_replay_tokens else None,
            )
        )
    return observed


def _connector_lookup(
    admission: _Admission,
    load_failed: bool,
    load_targets: LoadTargets | None = None,
) -> ConnectorLookup | None:
    """What the connector's store was asked and what vLLM adopted at the
    admitting lookup (``None`` without a store's answer), with the blocks
    its load fills (``load_targets``)."""
    query = admission.query
    if query is None or admission.adopted is None:
        return None
    local, external = admission.adopted
    return ConnectorLookup(
        local_hit_tokens=admission.shown_tokens,
        presented_tokens=query.presented_tokens,
        matched_tokens=query.matched_tokens,
        store_tokens=query.store_tokens,
        local_tokens=local,
        external_tokens=external,
        load_async=query.load_async,
        diverged=admission.diverged,
        load_failed=load_failed,
        load_targets=load_targets if external else None,
    )


@dataclass
class _RunReport:
    """What a scheduler-mode run reports, filled in as it goes: a run vLLM
    ends early (its ``error``) reports what it had reached."""

    pool: int = 0  # the KV cache pool, in blocks
    # Per KV cache group, blocks added to the prefix cache.
    newly_cached: list[int] = field(default_factory=list)
    evicted: int = 0  # cached blocks evicted, in blocks
    preemptions: int = 0
    steps: int = 0
    timeline: list[str] = field(default_factory=list)
    observed: list[RequestObservation] = field(default_factory=list)
    unreachable: int = 0  # cached blocks no lookup can reach, in blocks
    cached_blocks: int = 0
    ledger: BlockLedger | None = None
    recorder: EventRecorder | None = None
    requests: list[Any] = field(default_factory=list)  # vLLM's ``Request`` per scenario request
    # (request index, step, free blocks right after the admission)
    watermark_admissions: list[tuple[int, int, int]] = field(default_factory=list)
    store: Any = None  # the connector's store (RemoteStoreConnector), if any
    prefill: PrefillInstance | None = None  # a disaggregated workload's prefill instance
    # (request index, step, (group, index) per block in the order freed)
    deferred_frees: list[tuple[int, int, tuple[tuple[int, int], ...]]] = field(default_factory=list)
    metrics: MetricsRecorder | None = None  # prefix-cache statistics and resets
    # (request index, step, group, tokens computed after the step, tokens its table holds)
    uncovered: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # Steps the KV connector loads into synchronously or that say they do.
    sync_loads: list[tuple[int, bool, tuple[int, ...]]] = field(default_factory=list)
    # (a KV connector's store) the requests whose load the model runner failed,
    # and (request index, step) per request vLLM finished with an error.
    failed_loads: tuple[int, ...] | None = None
    errored: tuple[tuple[int, int], ...] | None = None


@dataclass
class _Recorders:
    """The recorders wrapped around the scheduler's ``KVCacheManager``, and
    what they share with the step loop."""

    step: list[int]  # the step being scheduled, read by the recorders
    lookups: dict[str, list[_Admission]]  # request id -> its lookups, in order
    failures: list[BaseException]  # kvfuzz's own failures while recording
    clock: _FreeQueueClock
    index_of: dict[str, int]  # request id -> scenario index
    writes: dict[int, list[BlockWrite]]  # request index -> its unsafe writes
    # The groups whose tables are no attention table (Mamba, circular buffer).
    untabled: frozenset[int] = frozenset()


@dataclass
class _Progress:
    """Where the step loop stands: the requests added, admitted, aborted,
    resumed and finished so far, and the prefix cache as last read."""

    added: int = 0  # requests added to the scheduler, in scenario order
    admitted: dict[int, _Admission] = field(default_factory=dict)
    aborted: set[int] = field(default_factory=set)
    resumed: dict[int, list[ResumedLookup]] = field(default_factory=dict)
    # Request index -> the prefix cache's block counts per key at its finish.
    finished_at: dict[int, Counter[bytes]] = field(default_factory=dict)
    finished_step: dict[int, int] = field(default_factory=dict)
    # Request index -> the step after which vLLM had finished it with an error.
    errored: dict[int, int] = field(default_factory=dict)
    seen: Counter[bytes] = field(default_factory=Counter)  # the cache after the last step


def _build_scheduler(
    scenario: Scenario,
    retention: int | None,
    phase: list[str],
    report: _RunReport,
    prefill_instance: bool = False,
) -> tuple[Any, ResolvedDrafter]:
    """vLLM's ``Scheduler`` configured for the scenario (see the module
    docstring): the drafter resolved, the pool (``report.pool``, in blocks),
    a context long enough for the longest request's tokens, decode steps and
    draft slots, and the KV cache groups of manager mode with the retention
    interval (tokens); ``prefill_instance``: a disaggregated workload's
    prefill instance (:func:`_vllm_config`). Returns it with the resolved
    drafter settings."""
    from vllm.v1.structured_output import StructuredOutputManager

    resolved = resolve_drafter(scenario)
    pool = report.pool = scenario.workload.pool_blocks or pool_blocks(scenario, resolved)
    longest = max(r.prompt_tokens for r in scenario.requests)
    max_model_len = (
        longest
        + scenario.decode_steps
        + resolved.num_lookahead_tokens
        + scenario.drafter.num_speculative_tokens
        + 2
    )
    if scenario.workload.max_model_len_tokens is not None:
        max_model_len = scenario.workload.max_model_len_tokens
    phase[0] = "build VllmConfig"
    config = _vllm_config(scenario, resolved, pool, max_model_len, prefill_instance)
    phase[0] = "build Scheduler"
    kv_config = kv_cache_config(scenario, resolved, pool, retention, max_model_len)
    if scenario.dcp_world_size > 1 and not _whole_length_mamba(scenario):
        runner.check_dcp_block_sizes(scenario, kv_config)
    _resolve_cache_block_size(config, kv_config)
    # The class vLLM's EngineCore.__init__ (vllm/v1/engine/core.py) builds:
    # SchedulerConfig.get_scheduler_cls, the AsyncScheduler
    # (vllm/v1/core/sched/async_scheduler.py) under async scheduling.
    scheduler_cls = config.scheduler_config.get_scheduler_cls()
    scheduler = vllm_build(
        scheduler_cls.__name__,
        "vllm/v1/core/sched/async_scheduler.py"
        if config.scheduler_config.async_scheduling
        else "vllm/v1/core/sched/scheduler.py",
        scheduler_cls,
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=vllm_call(
            "StructuredOutputManager", StructuredOutputManager, config
        ),
        **_scheduler_block_sizes(scenario, config, kv_config),
        # As the engine builds it unless --disable-log-stats: the prefix-cache
        # statistics are kept (differential.driver.cache_metrics).
        log_stats=True,
    )
    _size_encoder_budget(scheduler, scenario)
    return scheduler, resolved


def _whole_length_mamba(scenario: Scenario) -> bool:
    """A Mamba hybrid without prefix caching: its Mamba block is the whole
    model length (``mamba_cache_mode="none"``), so vLLM, not the scenario,
    resolves the Scheduler's block sizes (:func:`_scheduler_block_sizes`)."""
    return bool(scenario.mamba_groups) and not scenario.prefix_caching


def _scheduler_block_sizes(scenario: Scenario, config: Any, kv_config: Any) -> dict[str, int]:
    """The ``Scheduler``'s ``block_size`` and ``hash_block_size``, in tokens:
    the scenario's, except for a Mamba hybrid without prefix caching, whose
    whole-length Mamba block (``mamba_cache_mode="none"``) vLLM's own
    ``resolve_kv_cache_block_sizes`` (vllm/v1/core/kv_cache_utils.py, as
    ``EngineCore`` calls it) takes into the LCM of the group blocks, the
    hash block then equal to it.

    Raises:
        Unsupported: the release has no ``resolve_kv_cache_block_sizes``.
    """
    if not _whole_length_mamba(scenario):
        return {
            "block_size": scenario.scheduler_block_size_tokens,
            "hash_block_size": scenario.effective_hash_block_size_tokens,
        }
    block, hash_block = resolved_block_sizes(kv_config, config)
    return {"block_size": block, "hash_block_size": hash_block}


def _prefill_instance(
    scenario: Scenario, retention: int | None, phase: list[str], report: _RunReport
) -> PrefillInstance:
    """A disaggregated workload's prefill instance (:mod:`differential.driver.disagg`):
    a second ``Scheduler`` of the same layout and pool, its connector a
    ``kv_producer`` sharing the decode instance's store (``report.store``),
    and the scenario's requests for it, each with ``max_tokens`` 1 and
    ``kv_transfer_params`` ``{"do_remote_decode": True}``."""
    scheduler, resolved = _build_scheduler(
        scenario, retention, phase, _RunReport(), prefill_instance=True
    )
    scheduler.connector.share_store(report.store)
    hasher = runner.block_hasher(scenario, resolved)
    requests = []
    for i, prompt in enumerate(scenario.prompts):
        request = runner.make_request(scenario, i, prompt, hasher, 1)
        request.kv_transfer_params = {"do_remote_decode": True}
        requests.append(request)
    return PrefillInstance(scheduler, requests, lambda i: scenario.output_token(i, 0))


def _prefill_hook(
    report: _RunReport, requests: list[Any], record_cache_map: bool
) -> Callable[[list[int]], None] | None:
    """What :func:`_arrive` calls before adding requests to a disaggregated
    workload's decode instance: the prefill instance runs them to their end,
    and each decode request takes the ``kv_transfer_params`` its prefill
    returned (a timeline line with ``record_cache_map``); ``None`` without a
    prefill instance."""
    instance = report.prefill
    if instance is None:
        return None

    def prefill(indices: list[int]) -> None:
        line = instance.prefill(indices)
        for i in indices:
            requests[i].kv_transfer_params = instance.done[i].kv_transfer_params
        if record_cache_map:
            report.timeline.append(line)

    return prefill


def _with_prefills(
    observed: list[RequestObservation], instance: PrefillInstance
) -> list[RequestObservation]:
    """The observations with what the prefill instance did with each request
    set on its connector lookup (``prefill_hit_tokens``, ``prefill_tokens``,
    ``prefill_preemptions``)."""
    out = []
    for r in observed:
        done = instance.done.get(r.index)
        if r.connector is not None and done is not None:
            r = replace(
                r,
                connector=replace(
                    r.connector,
                    prefill_hit_tokens=done.hit_tokens,
                    prefill_tokens=done.computed_tokens,
                    prefill_preemptions=done.preemptions,
                ),
            )
        out.append(r)
    return out


def _fenced(scheduler: Any) -> Counter[int]:
    """The references vLLM's deferred frees hold, per block id: one per
    block of each entry of ``Scheduler.deferred_frees`` (a request's blocks,
    or a copy-on-write retention), returned to the pool when its fence step
    is processed (vllm/v1/core/sched/scheduler.py ``_drain_deferred_frees``)."""
    return Counter(b.block_id for _, blocks in scheduler.deferred_frees for b in blocks)


def _install_recorders(
    scenario: Scenario,
    scheduler: Any,
    resolved: ResolvedDrafter,
    record_cache_map: bool,
    report: _RunReport,
) -> _Recorders:
    """Wrap the scheduler's ``KVCacheManager`` in the recorders: lookups,
    the block ledger's writes (``report.ledger``), adoptions, the free
    queue's clock, the KV cache events (``report.recorder``) and the
    watermark's admissions; build the scenario's requests
    (``report.requests``), each owed ``decode_steps + 1`` output tokens."""
    workload = scenario.workload
    manager = scheduler.kv_cache_manager
    hasher = runner.block_hasher(scenario, resolved)
    step = [0]
    lookups: dict[str, list[_Admission]] = {}
    failures: list[BaseException] = []
    ledger = report.ledger = BlockLedger.for_manager(manager, scenario.num_sink_blocks)
    clock = _FreeQueueClock(lookups, step)
    report.metrics = MetricsRecorder(manager, scheduler)
    if workload.kv_events is not KVEvents.OFF:
        report.recorder = EventRecorder(
            manager, workload.kv_events.value, scenario.effective_hash_block_size_tokens
        )
        # The scheduler's own drain (update_from_output's take_events)
        # publishes each step's batch here.
        scheduler.kv_event_publisher.publish = report.recorder.publish
    index_of: dict[str, int] = {}
    _record_lookups(
        scenario,
        manager,
        record_cache_map,
        lookups,
        step,
        failures,
        ledger,
        clock,
        report.recorder,
        index_of,
    )
    report.requests = [
        runner.make_request(scenario, i, prompt, hasher, scenario.decode_steps + 1)
        for i, prompt in enumerate(scenario.prompts)
    ]
    index_of.update({r.request_id: i for i, r in enumerate(report.requests)})
    writes: dict[int, list[BlockWrite]] = {}
    if ledger is not None:
        _record_writes(manager, ledger, index_of, writes, failures, scenario.prefix_replay_tokens)
        if getattr(scheduler, "defer_block_free", False):
            ledger.hold_deferred(lambda: _fenced(scheduler))
    store = scheduler.connector if workload.connector is not None else None
    report.store = store
    _record_adoption(manager, lookups, store, failures)
    clock.install(manager)
    if workload.watermark:
        _record_watermark_admissions(manager, index_of, step, report.watermark_admissions, failures)
    untabled = frozenset(i for i, g in enumerate(scenario.kv_cache_groups) if not g.kind.slot_table)
    return _Recorders(step, lookups, failures, clock, index_of, writes, untabled)


def _arrivals(
    scheduler: Any,
    scenario: Scenario,
    requests: list[Any],
    progress: _Progress,
    step: list[int],
    phase: list[str],
    *,
    in_flight: bool = False,
    prefill: Callable[[list[int]], None] | None = None,
) -> tuple[range, list[int]]:
    """The requests that arrive and those aborted before the step's
    ``schedule()`` (:func:`_arrive`, :func:`_abort`; ``prefill``: a
    disaggregated workload's prefill instance), as scenario indices;
    with arrival steps, nothing to schedule and no batch ``in_flight``
    (async scheduling), ``step`` first jumps to the next arrival."""
    workload = scenario.workload
    if workload.arrival_steps is not None and not scheduler.has_requests() and not in_flight:
        # Nothing to schedule until the next arrival: an idle gap is
        # time passing, not a stall, so go straight to that step.
        step[0] = max(step[0], workload.arrival_steps[progress.added])
    arrived = progress.added
    progress.added = _arrive(
        scheduler, requests, workload.arrival_steps, progress.added, step[0], phase, prefill
    )
    aborts = _abort(
        scheduler, requests, workload.abort_steps, progress.added, step[0], progress.aborted, phase
    )
    return range(arrived, progress.added), aborts


def _admit(out: Any, recorders: _Recorders, progress: _Progress) -> list[int]:
    """The requests ``out`` (a ``SchedulerOutput``) schedules for the first
    time, by scenario index, their admitting lookup kept in
    ``progress.admitted`` (with what ``NewRequestData`` tells the worker of
    its computed tokens and replay start); a preempted request's lookup when it is
    rescheduled goes to ``progress.resumed``."""
    step = recorders.step[0]
    lookups = recorders.lookups
    clock = recorders.clock
    admitted_now = []
    new = {data.req_id: data for data in out.scheduled_new_reqs}
    for rid in out.num_scheduled_tokens:
        i = recorders.index_of[rid]
        if i not in progress.admitted and lookups.get(rid):
            progress.admitted[i] = admission = lookups[rid][-1]
            if admission.step != step and admission.blocks_after_step is not None:
                # First scheduled after its lookup's step (an asynchronous
                # load): that step's forward has run before its own.
                admission.blocks = admission.blocks_after_step
            if rid in new:
                data = new[rid]
                admission.replay = (data.num_computed_tokens, getattr(data, "replay_start", 0))
            admitted_now.append(i)
        elif rid in clock.preempted and (again := clock.resumed(rid, step)):
            progress.resumed.setdefault(i, []).append(again)
    return admitted_now


def _execute(
    scheduler: Any,
    out: Any,
    model_runner: _ModelRunner,
    index_of: dict[str, int],
    ledger: BlockLedger | None,
) -> tuple[Any, list[list[int]], list[str], list[tuple[str, int, int]]]:
    """kvfuzz as the worker running one scheduled step (``out``, a
    ``SchedulerOutput``): the ``ModelRunnerOutput`` (vllm/v1/outputs.py)
    with the sampled tokens and the KV connector's loads, the next drafts,
    the step's timeline events and the lost loads, as ``(request id, first
    lost token, end)``; a lost load's tokens are forgotten by the ledger."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled, drafts, events = model_runner.step(scheduler, out, index_of)
    transfers, lost_loads = model_runner.loads(scheduler, out, index_of)
    if ledger is not None:
        for rid, lost_from, lost_to in lost_loads:
            ledger.forget(rid, lost_from, lost_to)
        for rid, kept in zip(req_ids, sampled, strict=True):
            spec = out.scheduled_spec_decode_tokens.get(rid)
            if spec and kept:
                # The state the kept tokens end on, once the step's drafts are
                # judged (num_computed_tokens already counts the step's tokens).
                end = scheduler.requests[rid].num_computed_tokens
                ledger.after_drafts(index_of[rid], rid, end, len(spec), len(kept))
    output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: k for k, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=transfers,
    )
    return output, drafts, events, lost_loads


def _run_model(
    scheduler: Any,
    out: Any,
    model_runner: _ModelRunner,
    index_of: dict[str, int],
    ledger: BlockLedger | None,
    step: int,
    phase: list[str],
) -> tuple[list[str], list[tuple[str, int, int]]]:
    """kvfuzz as the model runner for one synchronous step: the step run
    (:func:`_execute`), its output applied at once (``update_from_output``)
    and the next drafts handed to the scheduler (``update_draft_token_ids``),
    as vLLM's ``EngineCore.step`` and ``post_step`` do (vllm/v1/engine/core.py).
    Returns the step's timeline events and the lost loads, as ``(request id,
    first lost token, end)``."""
    from vllm.v1.outputs import DraftTokenIds

    output, drafts, events, lost_loads = _execute(scheduler, out, model_runner, index_of, ledger)
    phase[0] = f"step {step}: update_from_output"
    vllm_call("Scheduler.update_from_output", scheduler.update_from_output, out, output)
    if model_runner.num_spec:
        vllm_call(
            "Scheduler.update_draft_token_ids",
            scheduler.update_draft_token_ids,
            DraftTokenIds(req_ids=list(out.num_scheduled_tokens), draft_token_ids=drafts),
        )
    return events, lost_loads


def _cache_changes(seen: Counter[bytes], after: Counter[bytes], newly_cached: list[int]) -> int:
    """The cached blocks evicted between two reads of the prefix cache, in
    blocks; the blocks newly cached are added to ``newly_cached``, per KV
    cache group. The counts the changed keys lost were evicted, those they
    gained newly cached."""
    lost = 0
    for key, was, now in prefix_cache.changed_counts(seen, after):
        if was > now:
            lost += was - now
        else:
            newly_cached[get_group_id(key)] += now - was
    return lost


def _finish(
    req_ids: list[str],
    index_of: dict[str, int],
    requests: list[Any],
    after: Counter[bytes],
    step: int,
    progress: _Progress,
) -> list[str]:
    """The scheduled requests that finished by themselves in ``step``
    (``req-<index>``); each keeps the prefix cache as it was then (``after``)
    and the step. One vLLM finished with an error does not (:func:`_errored`)."""
    from vllm.v1.request import RequestStatus

    done = []
    for rid in req_ids:
        i = index_of[rid]
        if (
            i not in progress.finished_at
            and requests[i].is_finished()
            and requests[i].status != RequestStatus.FINISHED_ERROR
        ):
            progress.finished_at[i] = after
            progress.finished_step[i] = step
            done.append(f"req-{i}")
    return done


def _errored(requests: list[Any], step: int, progress: _Progress) -> list[str]:
    """The requests vLLM finished with an error by the end of ``step``
    (``RequestStatus.FINISHED_ERROR``: a failed KV load under the ``fail``
    policy, ``Scheduler.update_from_output``), scheduled or waiting, not
    seen so (``req-<index> (error)``); each joins ``progress.errored``, not
    ``finished_step``: it promises no later request anything."""
    from vllm.v1.request import RequestStatus

    done = []
    for i, request in enumerate(requests):
        if i not in progress.errored and request.status == RequestStatus.FINISHED_ERROR:
            progress.errored[i] = step
            done.append(f"req-{i} (error)")
    return done


@dataclass
class _Step:
    """What one engine step did: the ``SchedulerOutput`` it scheduled
    (``None``: it scheduled nothing), the requests admitted, the model
    runner's timeline events and lost loads for it, and the output it
    applied (``update_from_output``): the ``SchedulerOutput`` and the step
    it was scheduled in (without async scheduling, this step's own)."""

    out: Any = None
    admitted: list[int] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    lost_loads: list[tuple[str, int, int]] = field(default_factory=list)
    applied: Any = None
    applied_step: int | None = None


def _schedule(
    scheduler: Any, recorders: _Recorders, report: _RunReport, progress: _Progress
) -> tuple[Any, list[int]]:
    """``Scheduler.schedule()`` for the step, then the requests it admitted
    (:func:`_admit`) and its preemptions counted (``report``). The block
    ledger learns a step begins (``BlockLedger.new_step``): the forwards of
    the steps scheduled before run before this one's, under async
    scheduling too.

    Raises:
        InternalError: a recorder failed during the call.
    """
    if report.ledger is not None:
        report.ledger.new_step()
    out = vllm_call("Scheduler.schedule", scheduler.schedule)
    failures = recorders.failures
    if failures:
        raise InternalError(
            f"recording a lookup or a write at step {recorders.step[0]} failed: "
            f"{type(failures[0]).__name__}: {failures[0]}"
        )
    admitted_now = _admit(out, recorders, progress)
    report.preemptions += len(getattr(out, "preempted_req_ids", ()) or ())
    _record_uncovered(scheduler, out, recorders, report.uncovered)
    _record_sync_loads(out, recorders, report.sync_loads)
    return out, admitted_now


def _record_sync_loads(
    out: Any, recorders: _Recorders, sync_loads: list[tuple[int, bool, tuple[int, ...]]]
) -> None:
    """``(step, SchedulerOutput.has_sync_kv_loads, the requests whose KV
    connector load this step is synchronous)`` appended to ``sync_loads``
    for a step with such a load or the flag set (nothing on a vLLM without
    the flag). The loads are the connector's metadata for the step (its
    ``build_connector_meta``: what the worker is told to load), synchronous
    ones consumed by this step's forward."""
    flag = getattr(out, "has_sync_kv_loads", None)
    if flag is None:
        return
    meta = getattr(out, "kv_connector_metadata", None)
    sync = tuple(
        recorders.index_of[load.request_id]
        for load in getattr(meta, "loads", ())
        if not load.load_async and load.request_id in recorders.index_of
    )
    if flag or sync:
        sync_loads.append((recorders.step[0], bool(flag), sync))


def _record_uncovered(
    scheduler: Any, out: Any, recorders: _Recorders, uncovered: list[tuple[int, int, int, int, int]]
) -> None:
    """The scheduled requests (``out``, a ``SchedulerOutput``) whose block
    table in an attention group holds fewer tokens than the request will
    have computed once the step is done, as ``(request index, step, group,
    tokens computed, tokens the table holds)``, appended to ``uncovered``.

    ``Scheduler.schedule`` advances each scheduled request's
    ``num_computed_tokens`` by its scheduled tokens before returning
    (``_update_after_schedule``), and ``KVCacheManager.allocate_slots`` must
    have given every group's table a slot for each of them ("Allocate new
    blocks for tokens to be computed (`new + lookahead`)", its docstring).
    Tables are read off the single-type managers (``req_to_blocks``; nulls
    below a window count, as the table's length is what a token's slot
    indexes). Mamba groups (a state per block) and circular buffers (one
    ring) are not attention tables and are skipped."""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    step = recorders.step[0]
    for rid, scheduled in out.num_scheduled_tokens.items():
        request = scheduler.requests.get(rid)
        if not scheduled or request is None or rid not in recorders.index_of:
            continue
        computed = request.num_computed_tokens
        for gid, manager in enumerate(managers):
            if gid in recorders.untabled:
                continue
            held = len(manager.req_to_blocks.get(rid, ())) * manager.block_size
            if held < computed:
                uncovered.append((recorders.index_of[rid], step, gid, computed, held))


def _sync_step(
    scheduler: Any,
    recorders: _Recorders,
    report: _RunReport,
    progress: _Progress,
    model_runner: _ModelRunner,
    phase: list[str],
) -> _Step:
    """One synchronous engine step (``EngineCore.step``, vllm/v1/engine/core.py):
    ``schedule()``, the model runner, the output applied at once."""
    out, admitted = _schedule(scheduler, recorders, report, progress)
    step = recorders.step[0]
    events, lost_loads = _run_model(
        scheduler, out, model_runner, recorders.index_of, report.ledger, step, phase
    )
    return _Step(out, admitted, events, lost_loads, out, step)


def _async_step(
    scheduler: Any,
    recorders: _Recorders,
    report: _RunReport,
    progress: _Progress,
    model_runner: _ModelRunner,
    queue: deque[tuple[int, Any, Any]],
    phase: list[str],
) -> _Step:
    """One call of vLLM's ``EngineCore.step_with_batch_queue``
    (vllm/v1/engine/core.py), its calls in its order, ``queue`` its batch
    queue (``maxlen``: ``VllmConfig.max_concurrent_batches``, 2 under async
    scheduling). While the scheduler has requests, ``schedule()`` and the
    step runs (the worker's sampled tokens are kvfuzz's, made now; no
    structured output, so sampling is never deferred); the batch joins the
    queue, and the call returns without waiting when the queue is not full
    and the step ran tokens or the scheduler still has requests. Otherwise
    (or with nothing to schedule and batches queued) the oldest batch's
    output is applied (``update_from_output``). No drafts are handed back:
    vLLM's worker keeps them under async scheduling (``EngineCore.post_step``),
    and the ``AsyncScheduler`` schedules placeholders for them."""
    done = _Step()
    if scheduler.has_requests():
        out, done.admitted = _schedule(scheduler, recorders, report, progress)
        output, _, done.events, done.lost_loads = _execute(
            scheduler, out, model_runner, recorders.index_of, report.ledger
        )
        done.out = out
        model_executed = out.total_num_scheduled_tokens > 0
        queue.appendleft((recorders.step[0], out, output))
        if len(queue) < (queue.maxlen or 1) and (model_executed or scheduler.has_requests()):
            return done
    elif not queue:
        return done
    done.applied_step, done.applied, output = queue.pop()
    phase[0] = f"step {recorders.step[0]}: update_from_output of step {done.applied_step}"
    vllm_call("Scheduler.update_from_output", scheduler.update_from_output, done.applied, output)
    return done


def _record_step(
    scheduler: Any,
    done: _Step,
    arrivals: range,
    aborts: list[int],
    recorders: _Recorders,
    report: _RunReport,
    progress: _Progress,
    model_runner: _ModelRunner,
    record_cache_map: bool,
) -> None:
    """After a step: the KV cache events, evictions, the requests the applied
    output finished and, with ``record_cache_map``, the timeline line.

    The KV cache events are drained only after a step that applied an output:
    vLLM publishes them in ``update_from_output`` (``take_events``), so under
    async scheduling a step that applies none publishes nothing, and its
    lookups and cache changes go with the next drain (the queue positions
    its lookups recorded stay valid, as nothing drained the queue)."""
    manager = scheduler.kv_cache_manager
    step = recorders.step[0]
    index_of = recorders.index_of
    if report.recorder is not None and done.applied is not None:
        report.recorder.drain(step)
    after = prefix_cache.cached_blocks(manager)
    lost = _cache_changes(progress.seen, after, report.newly_cached)
    report.evicted += lost
    progress.seen = after
    applied = list(done.applied.num_scheduled_tokens) if done.applied is not None else []
    finished = _finish(applied, index_of, report.requests, after, step, progress)
    if model_runner.scenario.workload.connector is not None:
        # Only a KV connector's failed load errs a request here.
        finished += _errored(report.requests, step, progress)
    if not record_cache_map:
        return
    out = done.out
    preempted = sorted(getattr(out, "preempted_req_ids", ()) or ()) if out is not None else []
    report.timeline.append(
        _timeline_line(
            step,
            arrivals=arrivals,
            aborts=aborts,
            admitted={i: _admission_note(progress.admitted[i]) for i in done.admitted},
            events=done.events,
            loads=model_runner.load_events(out, index_of, done.lost_loads)
            if out is not None
            else [],
            preempted=[index_of[r] for r in preempted],
            done=finished,
            lost=lost,
            applied=done.applied_step
            if model_runner.async_scheduling and done.applied is not None
            else None,
        )
    )


def _reserved_without_blocks(scheduler: Any) -> str:
    """What a stall message adds about vLLM's in-flight prefill reservations:
    ``", N of them"`` and :data:`~differential.findings.RESERVED_WITHOUT_BLOCKS` when ``N``
    waiting requests are still in ``Scheduler._inflight_prefills`` while no
    KV cache group holds a block for them (a failed asynchronous load that
    kept no token freed them: ``Scheduler._update_waiting_for_remote_kv``,
    vllm/v1/core/sched/scheduler.py), so that the next admission reserves
    their remaining blocks besides allocating them; ``""`` otherwise (and on
    a release without in-flight prefill reservations)."""
    from vllm.v1.request import RequestStatus

    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    return _inflight_prefills_named(
        scheduler,
        RESERVED_WITHOUT_BLOCKS,
        lambda request: (
            request.status != RequestStatus.RUNNING
            and not any(m.req_to_blocks.get(request.request_id) for m in managers)
        ),
    )


def _inflight_prefills_named(scheduler: Any, phrase: str, holds: Callable[[Any], bool]) -> str:
    """``", N of them PHRASE"`` for the ``N`` requests of vLLM's
    ``Scheduler._inflight_prefills`` that ``holds`` (a stall message's
    addition), ``""`` when none does or the release keeps no such set."""
    count = sum(1 for request in getattr(scheduler, "_inflight_prefills", ()) if holds(request))
    return f", {count} of them {phrase}" if count else ""


def _unreserved_partial_tail_copies(scheduler: Any) -> str:
    """What a stall message adds about Mamba partial tails: ``", N of them"``
    and :data:`~differential.findings.UNRESERVED_PARTIAL_TAIL_COPY` when ``N``
    waiting requests in ``Scheduler._inflight_prefills`` have had their
    asynchronous load arrive (``WAITING`` or ``PREEMPTED`` again) and a Mamba
    group (align mode) holds them in ``_partial_hit_reqs``: caching the load
    (``Scheduler._update_waiting_for_remote_kv``, vllm/v1/core/sched/scheduler.py)
    keyed the prompt's checkpoint inside a block
    (``MambaManager._cache_partial_tail_block``,
    vllm/v1/core/single_type_kv_cache_manager.py), whose state the next step
    overwrites, so ``MambaManager.get_num_blocks_to_allocate`` now asks one
    block more for its copy: a block ``Scheduler._request_remaining_blocks``
    did not count while the load was in flight. ``""`` otherwise."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.request import RequestStatus

    managers = [
        m
        for m in scheduler.kv_cache_manager.coordinator.single_type_managers
        if isinstance(m, MambaManager)
    ]
    return _inflight_prefills_named(
        scheduler,
        UNRESERVED_PARTIAL_TAIL_COPY,
        lambda request: (
            request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            and any(request.request_id in getattr(m, "_partial_hit_reqs", {}) for m in managers)
        ),
    )


def _drive_steps(
    scenario: Scenario,
    scheduler: Any,
    recorders: _Recorders,
    report: _RunReport,
    phase: list[str],
    record_cache_map: bool,
) -> tuple[_Progress, _ModelRunner]:
    """Step the scheduler until every request has arrived and none is left
    (under async scheduling, none is in flight either): arrivals and aborts,
    then one engine step (:func:`_sync_step`, or :func:`_async_step` under
    ``workload.async_scheduling``), then evictions, finishes and the
    timeline (:func:`_record_step`).

    Raises:
        InternalError: a recorder failed, or the run did not finish within
            ``1000 + 8 * tokens`` steps (the prompts' and outputs' tokens).
        VllmCallError: the scheduler scheduled nothing for
            :data:`_MAX_IDLE_STEPS` steps while requests waited.
    """
    requests = report.requests
    step = recorders.step
    progress = _Progress()
    model_runner = _ModelRunner(scenario, scheduler.kv_cache_manager)
    queue: deque[tuple[int, Any, Any]] | None = (
        deque(maxlen=scheduler.vllm_config.max_concurrent_batches)
        if scenario.workload.async_scheduling
        else None
    )
    idle = 0
    total_tokens = sum(len(p) for p in scenario.prompts) + len(requests) * (
        scenario.decode_steps + 1
    )
    max_steps = 1_000 + 8 * total_tokens
    executed = 0  # steps run, not counting the idle gaps skipped to an arrival
    while progress.added < len(requests) or scheduler.has_requests() or queue:
        arrivals, aborts = _arrivals(
            scheduler,
            scenario,
            requests,
            progress,
            step,
            phase,
            in_flight=bool(queue),
            prefill=_prefill_hook(report, requests, record_cache_map),
        )
        phase[0] = f"step {step[0]}: schedule"
        if queue is None:
            done = _sync_step(scheduler, recorders, report, progress, model_runner, phase)
        else:
            done = _async_step(scheduler, recorders, report, progress, model_runner, queue, phase)
        _record_step(
            scheduler,
            done,
            arrivals,
            aborts,
            recorders,
            report,
            progress,
            model_runner,
            record_cache_map,
        )
        _probe_metrics(report, done, progress, step[0], phase)
        scheduled = done.out is not None and bool(done.out.num_scheduled_tokens)
        idle = 0 if scheduled else idle + 1
        if idle > _MAX_IDLE_STEPS:
            # vLLM's scheduler leaves waiting requests unscheduled for good
            # (an engine would hang): vLLM's behaviour, a crash naming it.
            # Requests holding KV blocks (an async KV load) wait apart.
            waiting = len(scheduler.waiting) + len(getattr(scheduler, "kv_holding_waiting", ()))
            raise VllmCallError(
                "Scheduler.schedule",
                RuntimeError(
                    f"scheduled nothing for {_MAX_IDLE_STEPS} steps with "
                    f"{waiting} request(s) waiting (pool {report.pool} blocks)"
                    + _reserved_without_blocks(scheduler)
                    + _unreserved_partial_tail_copies(scheduler)
                ),
            )
        step[0] += 1
        executed += 1
        if executed > max_steps:
            raise InternalError(
                f"the scheduler had not finished after {max_steps} steps "
                f"({len(scheduler.running)} running, {len(scheduler.waiting)} waiting, "
                f"pool {report.pool} blocks)"
            )
    return progress, model_runner


def _probe_metrics(
    report: _RunReport, done: _Step, progress: _Progress, step: int, phase: list[str]
) -> None:
    """After a step: read the KV cache usage and, the first time a request
    admitted in the step still runs (it holds KV blocks), call
    ``Scheduler.reset_prefix_cache()``, which must refuse
    (:mod:`differential.driver.cache_metrics`; the step's
    ``update_from_output`` drained the statistics)."""
    metrics = report.metrics
    if metrics is None:
        return
    # The step's own phase is restored after: a stall raised later in the
    # step names the step's calls, not these reads.
    previous = phase[0]
    phase[0] = f"step {step}: KVCacheManager.usage"
    vllm_call("KVCacheManager.usage", metrics.read_usage)
    holding = [
        i for i in done.admitted if i not in progress.finished_step and i not in progress.errored
    ]
    if holding and not metrics.resets:
        phase[0] = f"step {step}: Scheduler.reset_prefix_cache with requests running"
        vllm_call("Scheduler.reset_prefix_cache", metrics.reset, step, len(holding))
    phase[0] = previous


def _finish_metrics(report: _RunReport, phase: list[str]) -> None:
    """After the run, every request finished: the statistics' last drain,
    the final usage, then ``Scheduler.reset_prefix_cache()``, and the KV
    cache events it queued drained (:mod:`differential.driver.cache_metrics`)."""
    if report.metrics is None:
        return
    phase[0] = "after the run: Scheduler.make_stats and Scheduler.reset_prefix_cache"
    vllm_call("Scheduler.reset_prefix_cache", report.metrics.finish)
    if report.recorder is not None:
        report.recorder.drain_after_run()


def _run_observation(
    variant: str,
    retention: int | None,
    settings: ManagerSettings | None,
    report: _RunReport,
    record_cache_map: bool,
    *,
    error: str | None,
    unsupported: str | None,
) -> RunObservation:
    """The run's observation (``mode="scheduler"``) from what it reported:
    with ``unsupported`` (a feature the release lacks) no request and no
    settings; else the requests observed, the cache's counts (blocks), the
    steps and, with ``record_cache_map``, the timeline; ``error``: vLLM's
    exception that ended the run early, if any."""
    if unsupported is not None:
        return RunObservation(
            variant=variant,
            vllm_version=runner.VLLM_VERSION,
            settings=None,
            requests=(),
            retention_interval_tokens=retention,
            unsupported=unsupported,
            mode="scheduler",
        )
    return RunObservation(
        variant=variant,
        vllm_version=runner.VLLM_VERSION,
        settings=settings,
        requests=tuple(report.observed),
        evicted_blocks=report.evicted,
        error=error,
        retention_interval_tokens=retention,
        mode="scheduler",
        pool_blocks=report.pool,
        unreachable_cached_blocks=report.unreachable,
        cached_blocks=report.cached_blocks,
        preemptions=report.preemptions,
        steps=report.steps,
        timeline=tuple(report.timeline) if record_cache_map else (),
        blocks_recorded=report.ledger is not None,
        newly_cached_blocks_per_group=tuple(report.newly_cached),
        kv_events=report.recorder.log(report.requests) if report.recorder is not None else None,
        watermark_admissions=tuple(report.watermark_admissions),
        uncovered_steps=tuple(report.uncovered),
        sync_kv_load_steps=tuple(report.sync_loads),
        store_calls=_store_calls(report),
        deferred_frees=tuple(report.deferred_frees),
        metrics=None
        if report.metrics is None
        else report.metrics.metrics({r.request_id: i for i, r in enumerate(report.requests)}),
        failed_load_requests=report.failed_loads,
        errored=report.errored,
    )


def _store_calls(report: _RunReport) -> tuple[StoreCall, ...]:
    """A bounded connector store's calls to its offloading manager, and its
    answers, each with its request index (none for other runs)."""
    calls = getattr(report.store, "calls", None)
    if not calls:
        return ()
    index_of = {r.request_id: i for i, r in enumerate(report.requests)}
    return tuple(replace(call, request=index_of[rid]) for rid, call in calls)


def run_scheduler_scenario(
    scenario: Scenario,
    variant: str,
    *,
    retention_interval_tokens: int | object | None = UNSET,
    record_cache_map: bool = False,
) -> RunObservation:
    """Run ``scenario`` through vLLM's ``Scheduler`` (see the module docstring).

    Args:
        scenario: the scenario (any workload; a sequential one reproduces
            manager mode's calls).
        variant: the variant name recorded in the observation (the caller
            installs its patches around this call).
        retention_interval_tokens: overrides the scenario's retention
            interval (``None``: dense); defaults to the scenario's own.
        record_cache_map: record each admitting lookup's cache map.

    Returns:
        The observation (``mode="scheduler"``). If vLLM raised, ``error``
        names the step and the exception and ``requests`` holds the requests
        admitted before it.

    Raises:
        InternalError: kvfuzz's own driver failed, or the run kept scheduling
            without finishing (a scheduler that schedules nothing while
            requests wait is vLLM's: the run's ``error``).
    """
    retention = resolve_retention(scenario, retention_interval_tokens)
    phase = ["resolve drafter settings"]
    report = _RunReport(newly_cached=[0] * len(scenario.kv_cache_groups))
    settings = None
    with classified_run("scheduler-mode driver", phase, runner.VLLM_VERSION) as outcome:
        scheduler, resolved = _build_scheduler(scenario, retention, phase, report)
        manager = scheduler.kv_cache_manager
        settings = runner.manager_settings(
            manager,
            scenario,
            replace(resolved, use_eagle_block_drop=bool(scheduler.use_eagle_block_drop)),
        )
        recorders = _install_recorders(scenario, scheduler, resolved, record_cache_map, report)
        store = scenario.workload.connector
        if store is not None and store.disaggregated:
            report.prefill = _prefill_instance(scenario, retention, phase, report)
        progress, model_runner = _drive_steps(
            scenario, scheduler, recorders, report, phase, record_cache_map
        )
        report.steps = recorders.step[0]
        index_of = recorders.index_of
        report.deferred_frees = [
            (index_of[rid], step, blocks) for rid, step, blocks in recorders.clock.drained
        ]
        report.observed = _observations(
            scenario,
            progress.admitted,
            progress.finished_at,
            progress.finished_step,
            progress.seen,
            recorders.writes,
            recorders.clock,
            [r.request_id for r in report.requests],
            progress.resumed,
            model_runner.failed,
            report.ledger,
            report.store,
        )
        if report.prefill is not None:
            report.observed = _with_prefills(report.observed, report.prefill)
        if store is not None:
            report.failed_loads = tuple(sorted(model_runner.failed))
            report.errored = tuple(sorted(progress.errored.items()))
        phase[0] = "count unreachable cached blocks"
        report.unreachable, report.cached_blocks = (
            _unreachable(scenario, manager, report.requests) if scenario.prefix_caching else (0, 0)
        )
        _finish_metrics(report, phase)
    return _run_observation(
        variant,
        retention,
        settings,
        report,
        record_cache_map,
        error=outcome.error,
        unsupported=outcome.unsupported,
    )


def _unreachable(scenario: Scenario, manager: Any, requests: list[Any]) -> tuple[int, int]:
    """(cached blocks no lookup can reach, cached blocks), in blocks, at the end.

    A block is reachable when some lookup of some request's tokens (prompt +
    sampled tokens, every prefix ending on the hit alignment) returns it:
    vLLM's own ``KVCacheCoordinator.find_longest_cache_hit``
    (vllm/v1/core/kv_cache_coordinator.py) on the final cache, non-null
    blocks only. Every other cached block (``BlockPool`` prefix-cache
    entries) holds pool space no lookup can use, e.g. full-attention blocks
    above the last surviving sliding-window tail, or sliding-window blocks
    below every reachable window.

    The lookups are not all made: vLLM's lookup returns the longest hit a
    prefix allows, so its answer is a non-decreasing step function of the
    prefix's length, and two prefixes of one request that get the same
    answer bracket only prefixes with that answer. The prefixes are
    bisected between answers that differ (:func:`_distinct_answers`): a
    request of ``n`` aligned prefixes costs about ``k log n`` lookups for
    ``k`` distinct answers instead of ``n``, with the same blocks.
    """
    coordinator = manager.coordinator
    hash_block = scenario.effective_hash_block_size_tokens
    alignment = scenario.effective_hit_alignment_tokens
    reachable: set[int] = set()
    # last block hash -> (block ids per group, hit length in tokens)
    answers: dict[Any, tuple[tuple[tuple[int, ...], ...], int]] = {}

    for request in requests:
        hashes = list(request.block_hashes)
        ends = range(alignment, len(hashes) * hash_block + 1, alignment)

        def answer(index: int, hashes: list[Any] = hashes, ends: range = ends) -> Any:
            end = ends[index]
            last = hashes[end // hash_block - 1]  # names the prefix (hashes are chained)
            if last not in answers:
                found = coordinator.find_longest_cache_hit(hashes[: end // hash_block], end)
                kept = tuple(tuple(b.block_id for b in g if not b.is_null) for g in found[0])
                answers[last] = (kept, found[1])
            return answers[last]

        for blocks, _ in _distinct_answers(answer, len(ends)):
            for group_blocks in blocks:
                reachable.update(group_blocks)
    cached: set[int] = set()
    for entry in manager.block_pool.cached_block_hash_to_block._cache.values():
        blocks = entry.values() if isinstance(entry, dict) else (entry,)
        cached.update(b.block_id for b in blocks)
    return len(cached - reachable), len(cached)


def _distinct_answers(answer: Callable[[int], Any], count: int) -> list[Any]:
    """The distinct values of ``answer(0) .. answer(count - 1)``, a
    non-decreasing step function of its index, by bisection: ``answer`` is
    called only where the values on either side of a span differ. In index order."""
    if count == 0:
        return []
    found = [answer(0)]
    spans = [(0, count - 1)] if count > 1 else []
    while spans:
        low, high = spans.pop()
        low_value, high_value = answer(low), answer(high)
        if low_value == high_value:
            continue
        if high - low == 1:
            found.append(high_value)
            continue
        middle = (low + high) // 2
        spans += [(middle, high), (low, middle)]  # the lower span first: values in order
    return list(dict.fromkeys(found))

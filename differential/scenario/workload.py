"""The requests of a scenario and how they reach the engine.

Units: lengths ending in ``_tokens`` are tokens; ``pool_blocks`` is blocks;
arrival steps are scheduler steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "ConnectorLoad",
    "ConnectorStore",
    "DriveMode",
    "KVEvents",
    "KVRole",
    "LoadFailurePolicy",
    "MultiModalInput",
    "RequestSpec",
    "Workload",
]


@dataclass(frozen=True)
class MultiModalInput:
    """One multimodal input (an image) among a request's own tokens.

    In vLLM a prompt holds an image as a run of placeholder tokens that the
    encoder's output replaces (vllm/multimodal/inputs.py ``PlaceholderRange``
    and ``MultiModalFeatureSpec``); the block hasher folds the image's
    ``identifier`` and its offset into the hash of every block the run
    overlaps (vllm/v1/core/kv_cache_utils.py ``_gen_mm_extra_hash_keys``), so
    two prompts with the same placeholder tokens but different images share
    no KV from the image's first token on.

    Attributes:
        suffix_offset_tokens: where the image's first placeholder token sits
            among the request's own tokens, in tokens (0: at the divergence
            point); the image lies within the request's own tokens.
        length_tokens: the image's placeholder tokens (``PlaceholderRange.length``),
            in tokens, at least 1.
        identifier: the image's identity (``MultiModalFeatureSpec.identifier``,
            the processor's hash of the image): inputs with the same
            identifier are the same image and have the same length.
    """

    suffix_offset_tokens: int
    length_tokens: int
    identifier: str


@dataclass(frozen=True)
class RequestSpec:
    """One request of a scenario.

    The request's prompt is the first ``divergence_tokens`` tokens of its
    source (the scenario's shared prefix, or the prompt of the earlier request
    ``shares_with``) followed by ``suffix_tokens`` tokens of its own, which no
    other request contains, then, when ``rejoin_tokens`` is set, the source's
    own tokens again at the same positions: the source's ``[D + suffix, D +
    suffix + rejoin)``. Such a prompt is the source with a stretch in the
    middle replaced (one edited paragraph, another retrieved document before
    the same question); it shares only its first ``D`` tokens with the
    source, since vLLM chains each block's hash to its parent's
    (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``).

    Attributes:
        divergence_tokens: tokens copied from the source, i.e. the divergence
            point ``D`` in tokens.
        suffix_tokens: the request's own tokens after ``D``.
        shares_with: index of an earlier request to copy from, or ``None`` for
            the shared prefix.
        name: optional label used in reports.
        rejoin_tokens: tokens copied from the source again after the
            request's own ones, at the same positions (0: none).
        mm_inputs: the images among the request's own tokens
            (:class:`MultiModalInput`), in order, not overlapping. The
            images of the source inside the copied tokens come with them:
            a copy carries the image (its identifier and position) as well
            as the placeholder tokens.
        cache_salt: vLLM's per-request ``cache_salt`` (``None``: none), which
            the first block's hash includes
            (``generate_block_hash_extra_keys``): requests of different salts
            share no KV, requests of the same salt share as if unsalted.
        skip_reading_prefix_cache: vLLM's per-request
            ``SamplingParams.skip_reading_prefix_cache`` (set for
            ``prompt_logprobs`` requests, vLLM PR #28194): the request
            computes every prompt token, reading neither the local prefix
            cache nor a KV connector's store (PR #57269), while its own
            blocks are still cached for later requests.
    """

    divergence_tokens: int
    suffix_tokens: int
    shares_with: int | None = None
    name: str | None = None
    rejoin_tokens: int = 0
    mm_inputs: tuple[MultiModalInput, ...] = ()
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool = False

    @property
    def prompt_tokens(self) -> int:
        """Prompt length ``L`` in tokens."""
        return self.divergence_tokens + self.suffix_tokens + self.rejoin_tokens

    @property
    def source_tokens(self) -> int:
        """How far into its source the request reads, in tokens: ``D``, or
        ``D + suffix + rejoin`` when it rejoins."""
        return self.prompt_tokens if self.rejoin_tokens else self.divergence_tokens


class DriveMode(StrEnum):
    """How a scenario reaches vLLM.

    ``MANAGER`` drives ``KVCacheManager`` directly, one request at a time,
    reconstructing the scheduler's calls (:mod:`differential.driver.runner`).
    ``SCHEDULER`` drives vLLM's real ``Scheduler``
    (vllm/v1/core/sched/scheduler.py ``schedule`` / ``update_from_output``)
    with kvfuzz standing in for the model runner
    (:mod:`differential.driver.scheduler_mode`).
    """

    MANAGER = "manager"
    SCHEDULER = "scheduler"


class KVEventsView(StrEnum):
    """How the KV cache event stream is judged (:mod:`differential.oracle.kv_events`).

    ``PER_COPY`` (the default): as vLLM 0.33.0 publishes it, one
    ``BlockStored`` / ``BlockRemoved`` per physical block, so a hash two
    blocks hold is removed once per copy; replaying the stream by counts
    must give the pool's blocks per hash. ``ROUTER``: as a KV-cache-aware
    router reads it (llm-d's KV-cache-aware routing, NVIDIA Dynamo's KV
    router: a ``BlockRemoved`` means the engine no longer holds the prefix),
    replaying the stream as a set of hashes must give exactly the hashes the
    pool still holds. vLLM PR #55092 (open) would emit a ``BlockRemoved`` only
    with a hash's last copy; until upstream settles it the router view is a
    named policy a scenario asks for, not the default.
    """

    PER_COPY = "per-copy"
    ROUTER = "router"


class KVEvents(StrEnum):
    """Whether vLLM publishes KV cache events in a run, and for which blocks.

    ``OFF`` (the default): events are off, as in every earlier kvfuzz run.
    ``INCREMENTAL``: events on (``KVCacheManager(enable_kv_cache_events=True)``;
    in scheduler mode ``KVEventsConfig(enable_kv_cache_events=True)``), each
    request with vLLM's default ``kv_cache_report_mode`` ``"incremental"``: a
    ``BlockStored`` for each block the pool newly caches, a ``BlockRemoved``
    for each cached block it drops. ``FULL``: events on and every request sent
    with ``SamplingParams.extra_args["kv_cache_report_mode"] = "full"``, so a
    lookup that reuses cached blocks also announces them again
    (``KVCacheManager.get_computed_blocks``, vllm/v1/core/kv_cache_manager.py).
    The stream is recorded per scheduler step and judged
    (:mod:`differential.oracle.kv_events`).
    """

    OFF = "off"
    INCREMENTAL = "incremental"
    FULL = "full"


class ConnectorLoad(StrEnum):
    """How the connector's remote store hands its tokens to vLLM.

    ``SYNC``: during the forward pass of the step that admits the request
    (``get_num_new_matched_tokens`` returns ``load_kv_async`` false).
    ``ASYNC``: between steps: the scheduler parks the request in
    ``WAITING_FOR_REMOTE_KVS`` until the worker reports the load finished
    (``KVConnectorOutput.finished_recving``), vllm/v1/core/sched/scheduler.py
    ``_update_waiting_for_remote_kv``.
    """

    SYNC = "sync"
    ASYNC = "async"


class LoadFailurePolicy(StrEnum):
    """What vLLM does with a request whose KV load failed
    (``KVTransferConfig.kv_load_failure_policy``, vllm/config/kv_transfer.py;
    vLLM PR #26813, "KV Load Failure Recovery/Abort Configuration").

    ``RECOMPUTE``: the request is rescheduled to recompute from its last
    valid block (``Scheduler._update_requests_with_invalid_blocks``), or from
    scratch when the whole load is lost (``_handle_failed_recving``).
    ``FAIL`` (vLLM's default): the request is finished at once with an error
    (``RequestStatus.FINISHED_ERROR``, finish reason ``error``), the blocks
    its synchronous load left invalid are evicted from the prefix cache
    (``Scheduler._handle_invalid_blocks``), and every other request goes on.
    """

    RECOMPUTE = "recompute"
    FAIL = "fail"


class KVRole(StrEnum):
    """The KV connector's role on the scheduler kvfuzz drives
    (``KVTransferConfig.kv_role``, vllm/config/kv_transfer.py).

    ``KV_BOTH`` (the default): one engine saves to the store and loads from
    it (a CPU-offload tier). ``KV_CONSUMER``: disaggregated prefill and
    decode. The driven scheduler is the decode instance (``kv_consumer``); a
    second vLLM ``Scheduler``, the prefill instance (``kv_producer``), shares
    the store. Every request is first sent to the prefill instance with
    ``max_tokens`` 1 and ``kv_transfer_params`` ``{"do_remote_decode":
    true}``, as vLLM's P/D proxies send it
    (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py); the prefill
    instance computes the prompt and saves it to the store; the
    ``kv_transfer_params`` its ``request_finished`` returns
    (``do_remote_prefill``) go with the request to the decode instance,
    which loads what the store holds and decodes. The decode instance saves
    nothing (a consumer), the prefill instance loads nothing (a producer).
    """

    KV_BOTH = "kv_both"
    KV_CONSUMER = "kv_consumer"


@dataclass(frozen=True)
class ConnectorStore:
    """(Scheduler mode) the KV connector's remote store and how it behaves.

    The connector is :class:`differential.driver.connector.RemoteStoreConnector`,
    a CPU-offload tier: it keeps the KV of every token a request computed
    (attention blocks, keyed by vLLM's chained block hashes) and the Mamba
    states vLLM hands off (boundary states and a producer's partial tail),
    evicts least recently used chunks over its capacity (by default it has
    none and never evicts), and answers ``get_num_new_matched_tokens`` with the tokens
    it holds beyond the local hit it is shown. Needs ``kv_connector`` true.

    Attributes:
        load: :class:`ConnectorLoad`, synchronous or asynchronous loads.
        failed_loads: request indices whose first load fails (asynchronous
            loads only): reported as ``failed_recving`` (the whole load is
            lost and the request is rescheduled from scratch), or, with a
            single KV cache group, as the last loaded block in
            ``invalid_block_ids`` (the valid prefix is kept).
        divergent_hybrid_hits: the connector's
            ``supports_divergent_local_hybrid_hits``: the scheduler shows it
            the full-attention hit of a Mamba hybrid even when a Mamba group
            hit less (``KVCacheManager.get_computed_blocks_for_connector``).
        prefix_caching: ``CacheConfig.enable_prefix_caching``; false leaves
            the store as the only source of computed tokens (no Mamba
            groups: vLLM's align mode needs prefix caching).
        capacity_chunks: the store's capacity, in chunks (one chunk: one
            KV cache group's KV, or Mamba state, of ``chunk_tokens`` tokens,
            one key): vLLM's ``CPUOffloadingManager(num_chunks=...)`` with its
            LRU policy (vllm/v1/kv_offload/cpu/manager.py,
            vllm/v1/kv_offload/cpu/policies/lru.py) evicts the least
            recently used chunk to make room. ``None``: unbounded, nothing is
            evicted.
        chunk_tokens: the store's own grid, in tokens: every group keeps one
            key per ``chunk_tokens`` tokens (vLLM's offloading connector's
            ``block_size`` in ``kv_connector_extra_config``, a whole number
            of each group's blocks) and a hit is a whole number of chunks.
            ``None``: each group keeps a key per block (vLLM's default,
            ``blocks_per_chunk`` 1) and hits land on the hit alignment.
        supports_hma: the connector subclasses vLLM's ``SupportsHMA``
            (finishes a request with every group's blocks,
            ``request_finished_all_groups``). ``False``: a connector without
            the hybrid allocator, for which vLLM turns the allocator off, so
            a layout of one KV cache group only; ``Scheduler._connector_finished``
            takes the legacy path (``request_finished`` with group 0's blocks).
        kv_role: :class:`KVRole`: ``kv_both`` (one engine), or
            ``kv_consumer``: the driven scheduler is a decode instance fed
            by a prefill instance (a ``kv_producer`` scheduler) through the
            store.
        kv_load_failure_policy: :class:`LoadFailurePolicy`: what vLLM does
            with a request in ``failed_loads`` (``recompute``, kvfuzz's
            default: a cache tier's lost copy is recomputed; or ``fail``,
            vLLM's own default).
    """

    load: ConnectorLoad = ConnectorLoad.SYNC
    failed_loads: tuple[int, ...] = ()
    divergent_hybrid_hits: bool = False
    prefix_caching: bool = True
    capacity_chunks: int | None = None
    chunk_tokens: int | None = None
    kv_role: KVRole = KVRole.KV_BOTH
    supports_hma: bool = True
    kv_load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE

    @property
    def disaggregated(self) -> bool:
        """A prefill instance computes every request before the driven
        (decode) scheduler sees it (``kv_role`` ``kv_consumer``)."""
        return self.kv_role is KVRole.KV_CONSUMER

    @property
    def bounded(self) -> bool:
        """The store has a capacity (it may evict)."""
        return self.capacity_chunks is not None


@dataclass(frozen=True)
class Workload:
    """How the requests reach the engine: mode, pool, arrivals, turns, drafts.

    Every default reproduces the manager-level run: one request at a time,
    a pool sized so that nothing is evicted, no drafted tokens.

    Attributes:
        mode: the driving mode (:class:`DriveMode`).
        pool_blocks: KV cache pool size in blocks, the null block included
            (``KVCacheConfig.num_blocks`` / ``CacheConfig.num_gpu_blocks``);
            ``None`` sizes it so that nothing is evicted. Both modes honour it.
        arrival_steps: per request, the scheduler step (0-based) at which it
            is added (``Scheduler.add_request``), non-decreasing; ``None``
            adds each request when the previous one has finished (a sequential
            scenario). Scheduler mode only.
        max_num_seqs: ``SchedulerConfig.max_num_seqs``: requests running at
            once; ``None`` uses the smaller of 8 and the token budget. At
            most the token budget (vLLM ``SchedulerConfig`` validation).
        max_num_batched_tokens: ``SchedulerConfig.max_num_batched_tokens``,
            the token budget per step, in tokens; ``None`` uses the scenario's
            ``prefill_chunk_tokens``.
        shares_output: a request with ``shares_with = j`` copies from
            request ``j``'s prompt followed by the ``decode_steps + 1`` tokens
            ``j`` sampled (a multi-turn chat: turn n+1 = turn n's prompt + its
            answer + new tokens), so decoded blocks are reused.
        accepted_drafts: draft tokens accepted per decode step (cycled), each
            at most ``drafter.num_speculative_tokens``; the rest of the drafts
            are rejected. Empty: no drafts are proposed. Scheduler mode only.
        kv_events: KV cache events and the requests' report mode
            (:class:`KVEvents`); both modes honour it.
        kv_events_view: how the stream is judged (:class:`KVEventsView`):
            vLLM 0.33.0's per-copy stream, or a router's view of it. Only
            with ``kv_events`` on.
        watermark: ``SchedulerConfig.watermark``: the fraction (``0 <= w <
            1``) of the pool's blocks vLLM keeps free when it admits a waiting
            or preempted request while others are scheduled
            (``KVCacheManager.__init__`` ``watermark_blocks = int(watermark *
            num_blocks)``, applied in ``KVCacheManager.allocate_slots``).
            ``0.0`` (vLLM's default) keeps none. Scheduler mode only.
        connector: the KV connector's remote store (:class:`ConnectorStore`);
            ``None``: a configured connector's store is empty. Scheduler mode
            only.
        abort_steps: per request, the scheduler step from which its client
            aborts it (``None``: never): before that step's ``schedule()``,
            or the first one after it at which the request has arrived,
            kvfuzz calls ``Scheduler.finish_requests`` with
            ``FINISHED_ABORTED``, as vLLM's engine core does when a client
            disconnects; a request already finished is left alone. ``None``:
            no request is aborted (a list holds at least one step). Scheduler
            mode only.
        async_scheduling: ``SchedulerConfig.async_scheduling``: vLLM's
            ``AsyncScheduler`` (vllm/v1/core/sched/async_scheduler.py), driven
            as vLLM's engine core drives it (``EngineCore.step_with_batch_queue``,
            vllm/v1/engine/core.py: a batch queue of two, each step scheduled
            before the previous step's output is applied), so a step's model
            output reaches the scheduler one step later. ``False`` (the
            default): the synchronous ``Scheduler``, each step's output
            applied before the next ``schedule()``. Scheduler mode only.
        long_prefill_token_threshold: ``SchedulerConfig.long_prefill_token_threshold``,
            in tokens: while more than one request is running or waiting,
            ``Scheduler.schedule`` gives a request at most this many tokens
            per step, and ``Scheduler._mamba_block_aligned_split`` lets a
            Mamba prefill advance by less than a block when the cap is below
            the Mamba block size. ``0`` (vLLM's default) sets no cap. At most
            the longest prompt, in tokens (a larger cap caps nothing; vLLM's
            ``SchedulerConfig`` refuses one past the model's length).
            Scheduler mode only.
        long_prefill_token_threshold_adaptive:
            ``SchedulerConfig.long_prefill_token_threshold_adaptive``: the cap
            is floored at a fair share of the step's token budget (the
            budget divided by the requests running and waiting). Only with a
            nonzero ``long_prefill_token_threshold``. Scheduler mode only.
        prefill_schedule_interval: ``SchedulerConfig.prefill_schedule_interval``,
            in scheduler steps: while a request decodes, prefill (admissions
            and chunks of admitted prompts alike) runs only once this many
            executed steps have passed since the last step that carried
            prefill (``Scheduler.schedule``'s local prefill cadence). ``1``
            (vLLM's default) admits prefill on every step. Scheduler mode
            only.
        prefix_caching: ``CacheConfig.enable_prefix_caching``. ``False``: no
            lookup hits and nothing is cached, so every request is owed
            nothing (:meth:`Scenario.reads_prefix_cache`); a Mamba group then
            runs in vLLM's ``mamba_cache_mode="none"``, its block the whole
            model length (``MambaModelConfig.verify_and_update_config``,
            vllm/model_executor/models/config.py), each request holding its
            running state and one block per speculative token
            (``MambaSpec.max_memory_usage_bytes``,
            vllm/v1/kv_cache_interface.py). With a KV connector the store's
            own ``ConnectorStore.prefix_caching`` says it instead. Scheduler
            mode only.
        max_model_len_tokens: ``ModelConfig.max_model_len``, in tokens;
            ``None``: the longest prompt plus ``decode_steps``, the lookahead
            and draft slots and 2 tokens more, so no length check binds. Set,
            vLLM's checks against the model length bind where a request
            nears it (the spec-decode pad's room check and the running
            loop's cap in ``Scheduler.schedule``, ``allocate_slots``' cap on
            its slots). At least the longest prompt plus ``decode_steps + 1``
            (each request's ``max_tokens``), so ``check_stop`` caps no request
            before its own end and no token sequence changes. Scheduler mode
            only.
        priorities: per request, its priority under vLLM's priority
            scheduling policy (``SchedulerConfig.policy`` ``"priority"``,
            ``Request.priority``; vllm/v1/core/sched/request_queue.py): a
            lower value is admitted first, ties by arrival, and the running
            request with the largest ``(priority, arrival_time)`` is the one
            preempted (``Scheduler.schedule``). Request ``i`` arrives at time
            ``i``. ``None``: vLLM's default first-come-first-served policy.
            Scheduler mode only.
    """

    mode: DriveMode = DriveMode.MANAGER
    pool_blocks: int | None = None
    arrival_steps: tuple[int, ...] | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    shares_output: bool = False
    accepted_drafts: tuple[int, ...] = ()
    kv_events: KVEvents = KVEvents.OFF
    kv_events_view: KVEventsView = KVEventsView.PER_COPY
    watermark: float = 0.0
    connector: ConnectorStore | None = None
    abort_steps: tuple[int | None, ...] | None = None
    async_scheduling: bool = False
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    prefill_schedule_interval: int = 1
    prefix_caching: bool = True
    max_model_len_tokens: int | None = None
    priorities: tuple[int, ...] | None = None

    @property
    def sequential(self) -> bool:
        """Requests run one at a time to their end, nothing is drafted, no
        remote store serves tokens and the prefix cache is on (so the
        manager-level driver reconstructs the same calls)."""
        return (
            self.prefix_caching
            and self.arrival_steps is None
            and not self.accepted_drafts
            and self.connector is None
            and self.abort_steps is None
        )

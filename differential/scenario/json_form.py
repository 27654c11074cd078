"""The scenario's JSON form (``format`` ``kvfuzz.scenario``, ``version`` 1).

The form is declared once, as pydantic models with field docs and units:
they parse a file (:func:`scenario_fields`), check every field of a
:class:`~differential.scenario.model.Scenario` built in Python
(:func:`checked_document`), write the canonical form (:func:`scenario_to_dict`)
and give the published JSON Schema (:func:`scenario_file_schema`). Rules between
fields (a window for a sliding-window group, a divergence within its source)
are the scenario's own (:mod:`differential.scenario.rules`).

The canonical form writes every field except those added after version 1
shipped (a group's chunk size and draft mark, the Mamba options, the
workload, decode context parallelism), which are written only when not their
default, so files written before them stay byte-identical.

Units: fields ending in ``_tokens`` are tokens; ``pool_blocks`` is blocks.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from differential.scenario._errors import scenario_error
from differential.scenario.drafter import Drafter, DrafterKind
from differential.scenario.finding_form import FindingRecordDocument
from differential.scenario.groups import GroupKind, KVCacheGroup, MambaPrefill
from differential.scenario.models import (
    FormatVersion,
    ModelDescription,
    ModelDocument,
    Size,
    SizeOrZero,
)
from differential.scenario.workload import (
    ConnectorLoad,
    ConnectorStore,
    DriveMode,
    KVEvents,
    KVEventsView,
    KVRole,
    LoadFailurePolicy,
    MultiModalInput,
    RequestSpec,
    Workload,
)

if TYPE_CHECKING:
    from differential.scenario.model import Scenario

__all__ = [
    "JSON_SCHEMA_DIALECT",
    "SCENARIO_FORMAT",
    "SCENARIO_VERSION",
    "ConnectorDocument",
    "DrafterDocument",
    "EngineDocument",
    "GroupDocument",
    "MultiModalInputDocument",
    "RequestDocument",
    "ScenarioDocument",
    "ScenarioFileDocument",
    "WorkloadDocument",
    "checked_document",
    "parse_engine_block",
    "scenario_fields",
    "scenario_file_schema",
    "scenario_to_dict",
]

SCENARIO_FORMAT: Final = "kvfuzz.scenario"
SCENARIO_VERSION: Final = 1
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

#: The largest decode context parallel size a scenario may ask for (ranks).
MAX_DCP_WORLD_SIZE: Final = 1024

# Integers with a lower bound; booleans, floats and strings are refused.
_Count = Annotated[StrictInt, Field(ge=0)]
_Positive = Annotated[StrictInt, Field(ge=1)]
_CONFIG = ConfigDict(extra="forbid", frozen=True, from_attributes=True)


def _is_none(value: object) -> bool:
    return value is None


def _is_false(value: object) -> bool:
    return value is False


class GroupDocument(BaseModel):
    """One KV cache group: layers sharing a spec (vLLM ``KVCacheGroupSpec``)."""

    model_config = _CONFIG

    kind: GroupKind = Field(description="The attention type of the group's layers.")
    block_size_tokens: Size = Field(
        description="The group's block size, in tokens (a Mamba group: one state per block)."
    )
    sliding_window_tokens: Size | None = Field(
        default=None,
        description="The attention window, in tokens: sliding_window and sliding_window_mla "
        "groups; an rswa group's rswa_window (the decoded tokens it keeps); null otherwise.",
    )
    attention_chunk_size_tokens: Size | None = Field(
        default=None,
        exclude_if=_is_none,
        description="vLLM's attention_chunk_size, in tokens: chunked_local_attention groups "
        "only. Written only when set.",
    )
    is_eagle_group: StrictBool = Field(
        default=False,
        exclude_if=_is_false,
        description="The group holds the drafter's own layers and takes the EAGLE block drop "
        "(vLLM KVCacheGroupSpec.is_eagle_group). Written only when true.",
    )
    sink_len_tokens: Size | None = Field(
        default=None,
        exclude_if=_is_none,
        description="vLLM's SinkFullAttentionSpec.sink_len, the static sink's length in tokens "
        "(a multiple of the block size): sink_full_attention groups only. Written only when "
        "set.",
    )
    bounded_replay: StrictBool = Field(
        default=False,
        exclude_if=_is_false,
        description="vLLM's SlidingWindowMLASpec.bounded_replay (DeepSeek-V4.1's SWA bounded "
        "replay, vLLM PR #56227): the group leaves prefix caching and a hit's last window is "
        "recomputed. sliding_window_mla groups only. Written only when true.",
    )

    def value(self) -> KVCacheGroup:
        """The group as a value."""
        return KVCacheGroup(
            kind=self.kind,
            block_size_tokens=self.block_size_tokens,
            sliding_window_tokens=self.sliding_window_tokens,
            attention_chunk_size_tokens=self.attention_chunk_size_tokens,
            is_eagle_group=self.is_eagle_group,
            sink_len_tokens=self.sink_len_tokens,
            bounded_replay=self.bounded_replay,
        )


class DrafterDocument(BaseModel):
    """The speculative-decoding drafter (vLLM ``SpeculativeConfig``)."""

    model_config = _CONFIG

    kind: DrafterKind = Field(
        default=DrafterKind.NONE, description="Which drafter; 'none' for plain decoding."
    )
    num_speculative_tokens: SizeOrZero = Field(
        default=0,
        description="Draft tokens proposed per step: 0 exactly when kind is 'none', at least 2 for "
        "multi_module_mtp.",
    )

    def value(self) -> Drafter:
        """The drafter as a value."""
        return Drafter(kind=self.kind, num_speculative_tokens=self.num_speculative_tokens)


class MultiModalInputDocument(BaseModel):
    """One image among a request's own tokens: a run of placeholder tokens
    (vLLM PlaceholderRange) and the image's identity (MultiModalFeatureSpec.identifier)."""

    model_config = _CONFIG

    suffix_offset_tokens: _Count = Field(
        description="Where the image's first placeholder token sits among the request's own "
        "tokens, in tokens (0: at the divergence point)."
    )
    length_tokens: _Positive = Field(description="The image's placeholder tokens, in tokens.")
    identifier: Annotated[StrictStr, Field(min_length=1)] = Field(
        description="The image's identity (vLLM's MultiModalFeatureSpec.identifier): the "
        "same identifier is the same image, of the same length."
    )

    def value(self) -> MultiModalInput:
        """The input as a value."""
        return MultiModalInput(
            suffix_offset_tokens=self.suffix_offset_tokens,
            length_tokens=self.length_tokens,
            identifier=self.identifier,
        )


class RequestDocument(BaseModel):
    """One request: the first divergence_tokens tokens of its source, then
    suffix_tokens tokens of its own that no other request contains, then
    rejoin_tokens tokens of the source again, at the same positions."""

    model_config = _CONFIG

    name: StrictStr | None = Field(default=None, description="A label used in reports.")
    shares_with: _Count | None = Field(
        default=None,
        description="Index of an earlier request whose prompt is the source; null: the "
        "shared prefix.",
    )
    divergence_tokens: _Count = Field(
        description="Tokens copied from the source (the divergence point), in tokens; at "
        "most the source's length."
    )
    suffix_tokens: _Count = Field(
        description="The request's own tokens after the divergence point, in tokens."
    )
    rejoin_tokens: _Count = Field(
        default=0,
        exclude_if=lambda v: v == 0,
        description="Tokens of the source again after the request's own ones, at the same "
        "positions (the source with a stretch in the middle replaced), in tokens; "
        "divergence_tokens + suffix_tokens + rejoin_tokens at most the source's length. "
        "Written only when not 0.",
    )
    mm_inputs: tuple[MultiModalInputDocument, ...] = Field(
        default=(),
        exclude_if=lambda v: v == (),
        description="Images among the request's own tokens, in order, not overlapping: each a "
        "run of placeholder tokens with the image's identifier, which vLLM's block hashes "
        "include. The source's images in the copied tokens come with them. Written only "
        "when not empty.",
    )
    cache_salt: Annotated[StrictStr, Field(min_length=1)] | None = Field(
        default=None,
        exclude_if=_is_none,
        description="vLLM's per-request cache_salt, which the first block's hash includes: "
        "requests of different salts share no KV. Written only when set.",
    )
    skip_reading_prefix_cache: StrictBool = Field(
        default=False,
        exclude_if=_is_false,
        description="vLLM's SamplingParams.skip_reading_prefix_cache (set for prompt_logprobs "
        "requests): the request computes every prompt token, reading neither the prefix "
        "cache nor a KV connector's store, and its blocks are still cached. Written only "
        "when true.",
    )

    def value(self) -> RequestSpec:
        """The request as a value."""
        return RequestSpec(
            divergence_tokens=self.divergence_tokens,
            suffix_tokens=self.suffix_tokens,
            shares_with=self.shares_with,
            name=self.name,
            rejoin_tokens=self.rejoin_tokens,
            mm_inputs=tuple(m.value() for m in self.mm_inputs),
            cache_salt=self.cache_salt,
            skip_reading_prefix_cache=self.skip_reading_prefix_cache,
        )


class ConnectorDocument(BaseModel):
    """The KV connector's remote store (scheduler mode): a CPU-offload tier
    keeping what requests computed; every default is the store's usual
    behaviour. Fields are written only when not their default."""

    model_config = _CONFIG

    load: ConnectorLoad = Field(
        default=ConnectorLoad.SYNC,
        exclude_if=lambda v: v is ConnectorLoad.SYNC,
        description="'sync': the store's tokens load in the admitting step's forward pass; "
        "'async': between steps, the request waiting in WAITING_FOR_REMOTE_KVS.",
    )
    failed_loads: tuple[_Count, ...] = Field(
        default=(),
        exclude_if=lambda v: v == (),
        description="Request indices whose first load fails (async loads only): the whole "
        "load (failed_recving), or with a single KV cache group its last block "
        "(invalid_block_ids).",
    )
    divergent_hybrid_hits: StrictBool = Field(
        default=False,
        exclude_if=_is_false,
        description="The connector's supports_divergent_local_hybrid_hits: a Mamba hybrid "
        "shows it the full-attention hit even when a Mamba group hit less.",
    )
    prefix_caching: StrictBool = Field(
        default=True,
        exclude_if=lambda v: v is True,
        description="CacheConfig.enable_prefix_caching; false: the store is the only source "
        "of computed tokens (not with mamba groups).",
    )
    capacity_chunks: _Positive | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="The store's capacity, in chunks (one key: one group's KV or Mamba state "
        "of chunk_tokens tokens); least recently used chunks are evicted over it "
        "(vLLM's CPUOffloadingManager with the LRU policy). null: unbounded.",
    )
    chunk_tokens: _Positive | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="The store's own grid, in tokens (vLLM's offloading block_size): a "
        "multiple of the scheduler block size; hits are whole chunks. null: a key per "
        "group block, hits on the hit alignment.",
    )
    kv_role: KVRole = Field(
        default=KVRole.KV_BOTH,
        exclude_if=lambda v: v is KVRole.KV_BOTH,
        description="KVTransferConfig.kv_role of the driven scheduler: 'kv_both' (one engine "
        "saves and loads), or 'kv_consumer' (disaggregated prefill and decode: a prefill "
        "instance, a kv_producer Scheduler, computes each request with max_tokens 1 and "
        "saves it to the shared store; the driven decode instance loads it and decodes).",
    )
    supports_hma: StrictBool = Field(
        default=True,
        exclude_if=lambda v: v is True,
        description="The connector subclasses vLLM's SupportsHMA (finishes a request with "
        "every group's blocks); false: a connector without the hybrid allocator, which vLLM "
        "turns off for it, so one KV cache group only, each request finished by "
        "Scheduler._connector_finished's legacy path. Written only when false.",
    )
    kv_load_failure_policy: LoadFailurePolicy = Field(
        default=LoadFailurePolicy.RECOMPUTE,
        exclude_if=lambda v: v is LoadFailurePolicy.RECOMPUTE,
        description="KVTransferConfig.kv_load_failure_policy: 'recompute' (a failed load's "
        "request recomputes from its last valid block) or 'fail' (vLLM's default: the request "
        "finishes with an error, every other request goes on).",
    )

    def value(self) -> ConnectorStore:
        """The store as a value."""
        return ConnectorStore(
            load=self.load,
            failed_loads=self.failed_loads,
            divergent_hybrid_hits=self.divergent_hybrid_hits,
            prefix_caching=self.prefix_caching,
            capacity_chunks=self.capacity_chunks,
            chunk_tokens=self.chunk_tokens,
            kv_role=self.kv_role,
            supports_hma=self.supports_hma,
            kv_load_failure_policy=self.kv_load_failure_policy,
        )


class WorkloadDocument(BaseModel):
    """How the requests reach the engine; every default reproduces the
    manager-level run (one request at a time, nothing evicted, no drafts)."""

    model_config = _CONFIG

    mode: DriveMode = Field(
        default=DriveMode.MANAGER,
        description="'manager' drives KVCacheManager directly, 'scheduler' vLLM's Scheduler.",
    )
    pool_blocks: Annotated[StrictInt, Field(ge=2)] | None = Field(
        default=None,
        description="KV cache pool size in blocks, the null block included; null: sized so "
        "that nothing is evicted.",
    )
    arrival_steps: tuple[_Count, ...] | None = Field(
        default=None,
        description="Per request, the scheduler step at which it is added, non-decreasing; "
        "null: each request when the previous one has finished. Scheduler mode only.",
    )
    max_num_seqs: _Positive | None = Field(
        default=None,
        description="SchedulerConfig.max_num_seqs, requests running at once (at most the "
        "token budget per step); null: the smaller of 8 and the budget.",
    )
    max_num_batched_tokens: _Positive | None = Field(
        default=None,
        description="SchedulerConfig.max_num_batched_tokens, the token budget per step, in "
        "tokens; null: prefill_chunk_tokens.",
    )
    shares_output: StrictBool = Field(
        default=False,
        description="A request copying from request j also copies the decode_steps + 1 "
        "tokens j sampled (a multi-turn chat).",
    )
    accepted_drafts: tuple[_Count, ...] = Field(
        default=(),
        description="Draft tokens accepted per decode step (cycled), each at most "
        "drafter.num_speculative_tokens; empty: no drafts. Scheduler mode only.",
    )
    kv_events: KVEvents = Field(
        default=KVEvents.OFF,
        exclude_if=lambda v: v is KVEvents.OFF,
        description="KV cache events: 'off'; 'incremental' (events on, vLLM's default "
        "kv_cache_report_mode); 'full' (events on, every request sent with "
        "kv_cache_report_mode 'full', so reused blocks are announced again). The stream "
        "is recorded per step and judged. Written only when not 'off'.",
    )
    kv_events_view: KVEventsView = Field(
        default=KVEventsView.PER_COPY,
        exclude_if=lambda v: v is KVEventsView.PER_COPY,
        description="How the KV cache event stream is judged: 'per-copy' (vLLM 0.33.0's "
        "stream, a BlockRemoved per physical copy of a hash; replayed by counts) or "
        "'router' (a KV-cache-aware router's view: replayed as a set of hashes, it must "
        "give exactly the hashes the pool still holds; vLLM PR #55092, open). Only with "
        "kv_events on. Written only when not 'per-copy'.",
    )
    watermark: Annotated[float, Field(ge=0.0, lt=1.0, strict=True)] = Field(
        default=0.0,
        exclude_if=lambda v: v == 0.0,
        description="SchedulerConfig.watermark: the fraction of the pool's blocks vLLM keeps "
        "free when admitting a waiting or preempted request while others are scheduled "
        "(0 <= w < 1). Scheduler mode only. Written only when not 0.",
    )

    connector: ConnectorDocument | None = Field(
        default=None,
        exclude_if=_is_none,
        description="The KV connector's remote store (needs kv_connector true); null: a "
        "configured connector's store is empty. Scheduler mode only. Written only when set.",
    )

    abort_steps: tuple[_Count | None, ...] | None = Field(
        default=None,
        exclude_if=_is_none,
        description="Per request, the scheduler step from which its client aborts it "
        "(Scheduler.finish_requests, FINISHED_ABORTED), or null: never, at least one a step; "
        "null: no aborts. "
        "Scheduler mode only. Written only when set.",
    )

    async_scheduling: StrictBool = Field(
        default=False,
        exclude_if=_is_false,
        description="SchedulerConfig.async_scheduling: vLLM's AsyncScheduler, driven as the "
        "engine core's step_with_batch_queue does (a batch queue of two: each step is "
        "scheduled before the previous step's output is applied). Scheduler mode only. "
        "Written only when true.",
    )

    long_prefill_token_threshold: _Count = Field(
        default=0,
        exclude_if=lambda v: v == 0,
        description="SchedulerConfig.long_prefill_token_threshold, in tokens: while more "
        "than one request runs or waits, a request gets at most this many tokens per step, "
        "and a Mamba prefill may advance by less than a block when the cap is below the "
        "Mamba block size; 0: no cap. At most the longest prompt. Scheduler mode only. "
        "Written only when not 0.",
    )

    long_prefill_token_threshold_adaptive: StrictBool = Field(
        default=False,
        exclude_if=_is_false,
        description="SchedulerConfig.long_prefill_token_threshold_adaptive: the cap is "
        "floored at the step's token budget divided by the requests running and waiting. "
        "Needs a nonzero long_prefill_token_threshold. Scheduler mode only. Written only "
        "when true.",
    )

    prefill_schedule_interval: _Positive = Field(
        default=1,
        exclude_if=lambda v: v == 1,
        description="SchedulerConfig.prefill_schedule_interval, in scheduler steps: while a "
        "request decodes, prefill runs only once this many executed steps have passed since "
        "the last step that carried prefill; 1: every step. Scheduler mode only. Written "
        "only when not 1.",
    )

    prefix_caching: StrictBool = Field(
        default=True,
        exclude_if=lambda v: v is True,
        description="CacheConfig.enable_prefix_caching; false: no lookup hits and nothing is "
        "owed, and a Mamba group runs in mamba_cache_mode 'none' (its block the whole model "
        "length, one state block per request plus one per speculative token). With a KV "
        "connector, set workload.connector.prefix_caching instead. Needs "
        "retention_interval_tokens null or 0 and kv_events 'off'. Scheduler mode only. Written "
        "only when false.",
    )

    max_model_len_tokens: _Positive | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="ModelConfig.max_model_len, in tokens; null: the longest prompt plus "
        "decode_steps, the lookahead and draft slots and 2 (no length check binds). At least "
        "the longest prompt plus decode_steps + 1 (every request's max_tokens). Scheduler "
        "mode only. Written only when set.",
    )

    priorities: tuple[StrictInt, ...] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="Per request, its priority under vLLM's priority scheduling policy "
        "(SchedulerConfig.policy 'priority', Request.priority): a lower value is admitted "
        "first, ties by arrival; the running request of the largest (priority, arrival) is "
        "preempted. null: first come, first served. Scheduler mode only.",
    )

    def value(self) -> Workload:
        """The workload as a value."""
        return Workload(
            mode=self.mode,
            pool_blocks=self.pool_blocks,
            arrival_steps=self.arrival_steps,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            shares_output=self.shares_output,
            accepted_drafts=self.accepted_drafts,
            kv_events=self.kv_events,
            kv_events_view=self.kv_events_view,
            watermark=self.watermark,
            connector=None if self.connector is None else self.connector.value(),
            abort_steps=self.abort_steps,
            async_scheduling=self.async_scheduling,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=self.long_prefill_token_threshold_adaptive,
            prefill_schedule_interval=self.prefill_schedule_interval,
            prefix_caching=self.prefix_caching,
            max_model_len_tokens=self.max_model_len_tokens,
            priorities=self.priorities,
        )


class ScenarioDocument(BaseModel):
    """A kvfuzz scenario: one reproducible prefix-caching experiment.

    Fields are in the order the canonical form writes them.
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, from_attributes=True, title="kvfuzz scenario"
    )

    format: Literal["kvfuzz.scenario"] = Field(
        default=SCENARIO_FORMAT, description="Always 'kvfuzz.scenario'."
    )
    version: FormatVersion = Field(default=SCENARIO_VERSION, description="The format version.")
    name: StrictStr = Field(default="", description="A short identifier, used in reports.")
    description: StrictStr = Field(default="", description="What the scenario shows.")
    kv_cache_groups: Annotated[tuple[GroupDocument, ...], Field(min_length=1)] = Field(
        description="The KV cache groups, any mix of kinds in any order: one group runs on "
        "vLLM's UnitaryKVCacheCoordinator, several on the HybridKVCacheCoordinator."
    )
    hash_block_size_tokens: Size | None = Field(
        default=None,
        description="The block hash size, in tokens (CacheConfig.prefix_match_unit), a "
        "divisor of every group block size; null: derived as vLLM does (the GCD of the "
        "block sizes).",
    )
    hit_alignment_tokens: Size | None = Field(
        default=None,
        description="The hit alignment, in tokens; null: derived as vLLM does. A given value "
        "must equal the derived one.",
    )
    retention_interval_tokens: SizeOrZero | None = Field(
        default=None,
        description="vLLM's prefix_cache_retention_interval, in tokens: null (dense), 0 "
        "(replay boundaries and junctions only) or a positive multiple of the scheduler "
        "block size.",
    )
    drafter: DrafterDocument = Field(
        default_factory=DrafterDocument, description="The speculative-decoding drafter."
    )
    kv_connector: StrictBool = Field(
        default=False,
        description="A KV connector is configured (turns lookahead block hashes off).",
    )
    disable_lookahead_block_hashes: StrictBool = Field(
        default=False, description="The SpeculativeConfig switch of that name."
    )
    disable_eagle_block_drop: StrictBool = Field(
        default=False, description="The SpeculativeConfig switch of that name."
    )
    prefill_chunk_tokens: Size = Field(
        default=2048, description="Tokens scheduled per prefill step, in tokens."
    )
    decode_steps: _Count = Field(
        default=0, description="Decode steps (one sampled token each) after prefill."
    )
    shared_prefix_tokens: _Count = Field(
        description="Length of the common prefix requests copy from, in tokens."
    )
    requests: Annotated[tuple[RequestDocument, ...], Field(min_length=1)] = Field(
        description="The requests, run in order."
    )
    enable_mamba_shared_prefix_checkpoint: StrictBool = Field(
        default=False,
        exclude_if=_is_false,
        description="CacheConfig.enable_mamba_shared_prefix_checkpoint: also keep a Mamba "
        "state at the shared-prefix junction. Needs a mamba group. Written only when true.",
    )
    mamba_prefill: MambaPrefill = Field(
        default=MambaPrefill.SCHEDULER,
        exclude_if=lambda v: v is MambaPrefill.SCHEDULER,
        description="Where prefill steps end with mamba groups: 'scheduler' (vLLM's own "
        "chunking), 'block' (at every Mamba block boundary) or 'checkpoint' (vLLM's own "
        "chunking for a Mamba layer that exports the prompt's checkpoint from inside a "
        "step, as MambaMixer2 does). Written only when not 'scheduler'.",
    )
    workload: WorkloadDocument = Field(
        default_factory=WorkloadDocument,
        exclude_if=lambda v: v == WorkloadDocument(),
        description="How the requests reach the engine. Written only when not the default.",
    )
    dcp_world_size: Annotated[StrictInt, Field(ge=1, le=MAX_DCP_WORLD_SIZE)] = Field(
        default=1,
        exclude_if=lambda v: v == 1,
        description="Decode context parallelism (vLLM ParallelConfig."
        "decode_context_parallel_size): ranks each attention group's KV is sharded over; "
        "block_size_tokens stays the tokens a block spans (per-rank block times this). "
        "Full attention, MLA and Mamba groups only. Written only when not 1.",
    )
    model: ModelDocument | None = Field(
        default=None,
        exclude_if=_is_none,
        description="The model description the groups were planned from (a model-level "
        "scenario resolved by vLLM's planner): each run plans it again, on the variant's "
        "vLLM, and the oracle judges that plan. Written only when set.",
    )
    # Documents that embed a scenario (corpus entries, campaign findings)
    # carry these; they are not part of the scenario value and are checked
    # by their readers (differential/corpus.py).
    expect: Any = Field(
        default=None,
        exclude=True,
        description="What a replay must observe (a corpus entry): {'hits': {variant: "
        "[hit tokens per request]}, 'findings': {variant: ['kind@request', ...]}}.",
    )
    notes: Any = Field(default=None, exclude=True, description="Free text (a corpus entry).")
    finding: Any = Field(
        default=None, exclude=True, description="A campaign finding's record (an object)."
    )
    engine: Any = Field(
        default=None,
        exclude=True,
        description="How engine mode maps the scenario, and what the engine measured (an object).",
    )

    def fields(self) -> dict[str, Any]:
        """The keyword arguments of :class:`Scenario` this document gives."""
        return {
            "kv_cache_groups": tuple(g.value() for g in self.kv_cache_groups),
            "requests": tuple(r.value() for r in self.requests),
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "retention_interval_tokens": self.retention_interval_tokens,
            "hash_block_size_tokens": self.hash_block_size_tokens,
            "hit_alignment_tokens": self.hit_alignment_tokens,
            "drafter": self.drafter.value(),
            "kv_connector": self.kv_connector,
            "disable_lookahead_block_hashes": self.disable_lookahead_block_hashes,
            "disable_eagle_block_drop": self.disable_eagle_block_drop,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "decode_steps": self.decode_steps,
            "name": self.name,
            "description": self.description,
            "enable_mamba_shared_prefix_checkpoint": self.enable_mamba_shared_prefix_checkpoint,
            "mamba_prefill": self.mamba_prefill,
            "workload": self.workload.value(),
            "dcp_world_size": self.dcp_world_size,
            "model": None if self.model is None else ModelDescription.from_document(self.model),
        }


def _absent_when_unused(schema: dict[str, Any]) -> None:
    """A field that is left out rather than null when unused: the schema
    shows neither a default nor a null branch."""
    schema.pop("default", None)
    branches = [b for b in schema.pop("anyOf", []) if b != {"type": "null"}]
    if len(branches) == 1:
        schema.update(branches[0])
    elif branches:
        schema["anyOf"] = branches


class ExpectDocument(BaseModel):
    """What a replay of a corpus entry must observe."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hits: dict[str, tuple[StrictInt, ...]] = Field(
        default_factory=dict, description="Variant name -> hit tokens per request, in tokens."
    )
    findings: dict[str, tuple[StrictStr, ...]] = Field(
        default_factory=dict,
        description="Variant name -> 'kind@request' (or 'kind@run') tags of the findings "
        "under the vllm policy.",
    )


class EngineDocument(BaseModel):
    """How engine mode (differential/driver/engine_mode.py) maps a scenario to
    vLLM's real CPU engine, and what the engine measured for it."""

    model_config = ConfigDict(extra="allow", frozen=True)

    geometry: Literal["exact", "scale"] = Field(
        default="scale",
        description="'scale' (the default, also when the block is absent): every token length "
        "is multiplied by the smallest factor that makes each block a multiple of 32 tokens "
        "(the CPU attention kernels'; factor 1 when already so), and the report says so; "
        "'exact': the scenario as written, its blocks multiples of 32 tokens.",
    )
    hits: tuple[StrictInt, ...] | None = Field(
        default=None,
        description="The engine's hit tokens per request (replay --mode engine checks "
        "them like an expect block).",
    )


class ScenarioFileDocument(ScenarioDocument):
    """A kvfuzz scenario file: a scenario with its KV cache groups, a model
    description vLLM's planner lays out (``model``), or both (a scenario
    resolved from a model), and, in a corpus entry or a campaign finding,
    what a replay must observe."""

    # The published schema's model only: scenario_fields parses with
    # ScenarioDocument; corpus.py reads expect and notes, and checks finding
    # (parse_finding_record) and engine (parse_engine_block) with these models.

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        title="kvfuzz scenario",
        # Either or both: a scenario resolved from a model keeps its
        # description (inline, never a path) beside the groups vLLM's planner
        # gave it.
        json_schema_extra={
            "anyOf": [{"required": ["kv_cache_groups"]}, {"required": ["model"]}],
            "if": {"required": ["kv_cache_groups", "model"]},
            "then": {"properties": {"model": {"type": "object"}}},
        },
    )

    # Widened from the parsed form's required groups: a model-level file names
    # a model instead (the schema's anyOf), which the planner resolves.
    kv_cache_groups: Annotated[tuple[GroupDocument, ...], Field(min_length=1)] | None = Field(  # type: ignore[assignment]
        default=None,
        json_schema_extra=_absent_when_unused,
        description="The KV cache groups, any mix of kinds in any order: one group runs on "
        "vLLM's UnitaryKVCacheCoordinator, several on the HybridKVCacheCoordinator. Absent "
        "with a model's file path; beside an inline model, the groups vLLM's planner gave it.",
    )
    model: Annotated[StrictStr, Field(min_length=1)] | ModelDocument | None = Field(  # type: ignore[assignment]
        default=None,
        json_schema_extra=_absent_when_unused,
        description="Instead of kv_cache_groups: a model description (a file path relative "
        "to the scenario file, or the description itself) vLLM's planner lays out into "
        "groups, block sizes and the hash block size. Beside kv_cache_groups (an inline "
        "description only): the model those groups were planned from; each run plans it "
        "again on the variant's vLLM and the oracle judges that plan (kv-cache-plan).",
    )
    expect: ExpectDocument | None = Field(
        default=None, description="What a replay must observe (a corpus entry)."
    )
    notes: StrictStr = Field(default="", description="Free text (a corpus entry).")
    finding: FindingRecordDocument | None = Field(
        default=None,
        description="A campaign finding's record (a finding file; written by kvfuzz fuzz, "
        "shrink and import-crash).",
    )
    engine: EngineDocument | None = Field(
        default=None,
        description="How engine mode maps the scenario to vLLM's real engine, and what the "
        "engine measured (docs/engine.md).",
    )


@cache
def _engine_schema() -> dict[str, Any]:
    return EngineDocument.model_json_schema()


def parse_engine_block(data: object) -> EngineDocument:
    """A scenario file's ``engine`` block, checked.

    Raises:
        ScenarioError: not an object, or a known field of the wrong type or
            value (``engine.geometry``), naming the field path and the allowed
            values.
    """
    try:
        return EngineDocument.model_validate(data)
    except ValidationError as exc:
        raise scenario_error(exc, _engine_schema(), prefix="engine", root="engine") from None


def scenario_file_schema() -> dict[str, Any]:
    """The JSON Schema of a scenario file (draft 2020-12), as published in
    ``schema/scenario.schema.json``."""
    return {"$schema": JSON_SCHEMA_DIALECT, **ScenarioFileDocument.model_json_schema()}


@cache
def _schema() -> dict[str, Any]:
    return ScenarioDocument.model_json_schema()


def scenario_fields(data: object) -> dict[str, Any]:
    """The keyword arguments of :class:`Scenario` a JSON form gives.

    Raises:
        ScenarioError: a wrong format or version, an unknown or missing key or
            a value of the wrong type or range, naming the field path and the
            allowed values.
    """
    try:
        document = ScenarioDocument.model_validate(data)
    except ValidationError as exc:
        raise scenario_error(exc, _schema()) from None
    return document.fields()


def checked_document(scenario: Scenario) -> ScenarioDocument:
    """``scenario``'s fields checked against the JSON form's types and ranges
    (enums must be enum members, lists tuples).

    Raises:
        ScenarioError: naming the first field of the wrong type or range.
    """
    try:
        return ScenarioDocument.model_validate(scenario, from_attributes=True, strict=True)
    except ValidationError as exc:
        raise scenario_error(exc, _schema(), python=True) from None


def scenario_to_dict(document: ScenarioDocument) -> dict[str, Any]:
    """The canonical JSON-ready form of a checked document (see the module docstring)."""
    return document.model_dump(mode="json")

"""The scenario value: one reproducible prefix-caching experiment.

A :class:`Scenario` is a frozen value describing a hybrid model's KV cache
groups, the prefix-cache settings, the drafter and a sequence of requests that
share prefixes. Its JSON form is versioned and round-trips exactly
(``Scenario.from_dict(s.to_dict()) == s``; :mod:`.json_form`). Token ids are
never stored: they are generated deterministically from the request shapes,
so a scenario file stays small and readable.

Units: every length ending in ``_tokens`` is in tokens; block counts say
``blocks``.

This module does not import vLLM. Where a rule mirrors vLLM's own validation
the vLLM function is named in the docstring.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from differential.errors import ScenarioError
from differential.files import json_data
from differential.scenario.drafter import DROPPING_DRAFTERS, Drafter, DrafterKind
from differential.scenario.groups import DraftGroups, GroupKind, KVCacheGroup, MambaPrefill
from differential.scenario.json_form import (
    SCENARIO_FORMAT,
    SCENARIO_VERSION,
    ScenarioDocument,
    checked_document,
    scenario_fields,
    scenario_to_dict,
)
from differential.scenario.models import ModelDescription
from differential.scenario.multimodal import (
    MM_PLACEHOLDER_TOKEN_ID,
    ContentCoder,
    PlacedInput,
    placed_inputs,
)
from differential.scenario.rules import check_scenario
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

__all__ = [
    "MM_PLACEHOLDER_TOKEN_ID",
    "SCENARIO_FORMAT",
    "SCENARIO_VERSION",
    "ConnectorLoad",
    "ConnectorStore",
    "DraftGroups",
    "Drafter",
    "DrafterKind",
    "DriveMode",
    "GroupKind",
    "KVCacheGroup",
    "KVEvents",
    "KVEventsView",
    "KVRole",
    "LoadFailurePolicy",
    "MambaPrefill",
    "MultiModalInput",
    "PlacedInput",
    "RequestSpec",
    "Scenario",
    "Workload",
]

# Token id ranges: prefix tokens and each request's own tokens never collide,
# so two requests share exactly the tokens the scenario says they share.
_PREFIX_TOKEN_MODULUS = 50_000
_OWN_TOKEN_BASE = 1_000_000
_OWN_TOKEN_STRIDE = 1_000_000


@dataclass(frozen=True)
class Scenario:
    """A complete, reproducible prefix-caching experiment.

    Building one checks each field's type and range against the JSON form
    (:mod:`.json_form`), then the rules between fields (:mod:`.rules`), and
    raises :class:`ScenarioError` naming the first field that breaks one.

    Attributes:
        kv_cache_groups: any mix of group kinds in any order, each with its
            own block size: one group runs on vLLM's
            ``UnitaryKVCacheCoordinator``, several on the
            ``HybridKVCacheCoordinator``. Mamba groups share one block size,
            the scheduler block size; a chunked-local group's block is the hit
            alignment and never takes the EAGLE drop; ``is_eagle_group`` needs
            a dropping drafter (see :func:`.rules.check_draft_groups`).
        requests: the requests, run in order; each is prefilled, decoded for
            ``decode_steps`` tokens and freed before the next starts; a
            request may hold images and a cache salt (:class:`RequestSpec`,
            :mod:`.multimodal`).
        shared_prefix_tokens: length of the common prefix requests copy from.
        retention_interval_tokens: vLLM's ``prefix_cache_retention_interval``:
            ``None`` (dense), ``0`` (replay boundaries and junctions only) or a
            positive multiple of the scheduler block size.
        hash_block_size_tokens: tokens per block hash (vLLM's
            ``CacheConfig.prefix_match_unit``); ``None`` derives it as vLLM
            does (GCD of the group block sizes, see
            ``resolve_kv_cache_block_sizes``). Finer than a Mamba block it
            turns on fine-grained (partial) hits (:attr:`partial_hash_hits`).
        hit_alignment_tokens: the hit alignment ``A``; ``None`` derives it as
            vLLM does (``HybridKVCacheCoordinator._cache_hit_alignment_tokens``:
            the hash block size with fine-grained hits, else the scheduler
            block size). A given value must equal the derived one.
        drafter: the speculative-decoding drafter.
        kv_connector: whether a KV connector is configured (turns lookahead
            block hashes off, vLLM ``VllmConfig.num_hash_lookahead_tokens``).
        disable_lookahead_block_hashes: ``SpeculativeConfig`` switch of that name.
        disable_eagle_block_drop: ``SpeculativeConfig`` switch of that name.
        prefill_chunk_tokens: tokens scheduled per prefill step.
        decode_steps: decode steps (one sampled token each) after prefill.
        name: short identifier, used in reports.
        description: free text saying what the scenario shows.
        enable_mamba_shared_prefix_checkpoint: vLLM's
            ``CacheConfig.enable_mamba_shared_prefix_checkpoint``: also keep a
            Mamba state at the shared-prefix junction a request pinned, and
            end a prefill chunk there. vLLM applies it only with the EAGLE
            drop on, fine-grained hits and no multi-module MTP re-prefill
            tail (``KVCacheManager.__init__``); needs a Mamba group. Written
            to JSON only when true, so older files stay byte-identical.
        mamba_prefill: where prefill steps end with Mamba groups
            (:class:`MambaPrefill`); written to JSON only when not the
            default ``scheduler``. A scheduler-mode workload always runs
            vLLM's own chunking: ``block`` is read as ``scheduler`` there.
        dcp_world_size: decode context parallelism, vLLM's
            ``ParallelConfig.decode_context_parallel_size``: each attention
            group's KV is sharded over this many ranks, so a block spans this
            many times the tokens one rank holds. Every ``block_size_tokens``
            stays the tokens a block spans, as the manager sees it (vLLM's
            ``resolve_dcp_kv_block_size``); the spec's per-rank block is
            ``block_size_tokens / dcp_world_size``. A Mamba group's state is
            not sharded. Only full attention, MLA and Mamba groups take it
            (:func:`.rules.check_dcp`). Written to JSON only when not 1.
        model: the model description a model-level scenario's groups were
            planned from (:mod:`.models`), or ``None``. Each run plans it
            again on the variant's own vLLM, as an engine start does, and the
            oracle judges that plan (``differential.oracle.layout``); the
            groups above stay the ones the scenario runs. Written to JSON
            only when set.
    """

    kv_cache_groups: tuple[KVCacheGroup, ...]
    requests: tuple[RequestSpec, ...]
    shared_prefix_tokens: int
    retention_interval_tokens: int | None = None
    hash_block_size_tokens: int | None = None
    hit_alignment_tokens: int | None = None
    drafter: Drafter = field(default_factory=Drafter)
    kv_connector: bool = False
    disable_lookahead_block_hashes: bool = False
    disable_eagle_block_drop: bool = False
    prefill_chunk_tokens: int = 2048
    decode_steps: int = 0
    name: str = ""
    description: str = ""
    enable_mamba_shared_prefix_checkpoint: bool = False
    mamba_prefill: MambaPrefill = MambaPrefill.SCHEDULER
    workload: Workload = field(default_factory=Workload)
    dcp_world_size: int = 1
    model: ModelDescription | None = None

    def __post_init__(self) -> None:
        self._document  # noqa: B018 - checks every field's type and range
        if (
            self.workload.mode is DriveMode.SCHEDULER
            and self.mamba_prefill is MambaPrefill.BLOCK
            and self.mamba_groups
        ):
            # vLLM's Scheduler ends each Mamba prefill chunk where its own
            # _mamba_block_aligned_split says (vllm/v1/core/sched/scheduler.py);
            # a block-carved prefill is manager mode's stand-in. Every
            # scheduler-mode scenario, from a file or from --mode, is judged
            # on the chunks the Scheduler runs.
            object.__setattr__(self, "mamba_prefill", MambaPrefill.SCHEDULER)
            del self.__dict__["_document"]
        check_scenario(self)

    @cached_property
    def _document(self) -> ScenarioDocument:
        """The scenario as its JSON form's model (:mod:`.json_form`); building
        it checks every field's type and range.

        Raises:
            ScenarioError: naming the first field of the wrong type or range.
        """
        return checked_document(self)

    # ----------------------------------------------------------------- derived

    @cached_property
    def scheduler_block_size_tokens(self) -> int:
        """LCM of all group block sizes, in tokens (vLLM
        ``resolve_kv_cache_block_sizes``)."""
        return math.lcm(*(g.block_size_tokens for g in self.kv_cache_groups))

    @cached_property
    def effective_hash_block_size_tokens(self) -> int:
        """Hash block size in tokens: the given one, else the GCD of the
        prefix-cacheable groups' block sizes (vLLM
        ``resolve_kv_cache_block_sizes``: a circular buffer's ring is no
        hashing size)."""
        if self.hash_block_size_tokens is not None:
            return self.hash_block_size_tokens
        if len(self.kv_cache_groups) == 1:
            return self.kv_cache_groups[0].block_size_tokens
        return math.gcd(*(g.block_size_tokens for g in self.cacheable_groups))

    @cached_property
    def partial_hash_hits(self) -> bool:
        """Whether vLLM serves hits at hash-block granularity (fine-grained hits).

        As ``vllm/v1/core/kv_cache_utils.py`` ``partial_hash_hits_enabled``
        decides for ``HybridKVCacheCoordinator``: some Mamba group (align
        mode) has a block larger than the hash block (or equal to it under
        decode context parallelism), and every other group
        either supports fine-grained lookup (full attention, MLA, Mamba:
        ``supports_fine_grained_hash_lookup``) or has a block equal to the hash
        block (sliding window, sliding-window MLA, chunked local attention);
        a circular buffer takes no part (it is not prefix-cacheable). A single
        group runs on ``UnitaryKVCacheCoordinator``, which never does.
        """
        if len(self.kv_cache_groups) < 2:
            return False
        hash_block = self.effective_hash_block_size_tokens
        # Under DCP a Mamba block equal to the hash block also counts: DCP
        # scales the full-attention block instead (partial_hash_hits_enabled).
        if not any(
            g.kind is GroupKind.MAMBA
            and (
                g.block_size_tokens > hash_block
                or (self.dcp_world_size > 1 and g.block_size_tokens >= hash_block)
            )
            for g in self.kv_cache_groups
        ):
            return False
        return all(
            g.kind.full_attention_family
            or g.kind is GroupKind.MAMBA
            or g.block_size_tokens == hash_block
            for g in self.cacheable_groups
        )

    @property
    def prefix_caching(self) -> bool:
        """vLLM's ``CacheConfig.enable_prefix_caching``: on unless the
        workload turns it off (:attr:`Workload.prefix_caching`) or its
        connector store does (:attr:`ConnectorStore.prefix_caching`)."""
        store = self.workload.connector
        return self.workload.prefix_caching and (store is None or store.prefix_caching)

    @cached_property
    def effective_hit_alignment_tokens(self) -> int:
        """Hit alignment ``A`` in tokens: the hash block size with fine-grained
        hits, else the scheduler block size (vLLM
        ``HybridKVCacheCoordinator._cache_hit_alignment_tokens``)."""
        if self.partial_hash_hits:
            return self.effective_hash_block_size_tokens
        return self.scheduler_block_size_tokens

    @property
    def num_sink_blocks(self) -> int:
        """The physical blocks after the null block that static sinks hold, in
        blocks: the largest sink full attention group's ``sink_len /
        block_size`` (0 without one). Every group's layers alias them: vLLM
        PR #28775 takes them off the block pool's free list."""
        return max((g.num_sink_blocks for g in self.kv_cache_groups), default=0)

    @property
    def cacheable_groups(self) -> tuple[KVCacheGroup, ...]:
        """The groups that take part in prefix caching, in order (all but
        circular buffers: vLLM ``KVCacheConfig.prefix_cacheable_groups``)."""
        return tuple(g for g in self.kv_cache_groups if g.prefix_cacheable)

    def reads_prefix_cache(self, index: int) -> bool:
        """Whether request ``index`` reads the prefix cache (and a KV
        connector's store): not when it sets ``skip_reading_prefix_cache``
        (vLLM ``KVCacheManager.prefix_cache_lookup_enabled``), nor when the
        workload turns prefix caching off without a connector
        (:attr:`Workload.prefix_caching`: ``KVCacheManager.get_computed_blocks``
        looks nothing up, vllm/v1/core/kv_cache_manager.py)."""
        return self.workload.prefix_caching and not self.requests[index].skip_reading_prefix_cache

    @property
    def prefix_replay_tokens(self) -> int:
        """The window a hit replays, in tokens: the bounded-replay groups'
        window (vLLM ``Scheduler.prefix_replay_tokens``; the groups' windows
        agree), 0 without one."""
        return max((g.prefix_replay_tokens for g in self.kv_cache_groups), default=0)

    @property
    def mamba_groups(self) -> tuple[KVCacheGroup, ...]:
        """The Mamba groups, in order."""
        return tuple(g for g in self.kv_cache_groups if g.kind is GroupKind.MAMBA)

    @property
    def full_attention_group(self) -> KVCacheGroup:
        """The first full-attention-family group (full attention or MLA).

        Raises:
            StopIteration: the model has none.
        """
        return next(g for g in self.kv_cache_groups if g.kind.full_attention_family)

    @property
    def sliding_window_groups(self) -> tuple[KVCacheGroup, ...]:
        """The prefix-cacheable sliding-window-family groups (sliding window,
        sliding-window MLA: both run on ``SlidingWindowManager``), in order:
        a bounded-replay group (:attr:`KVCacheGroup.bounded_replay`) takes no
        part in any lookup, so no hit rule reads it."""
        return tuple(
            g for g in self.kv_cache_groups if g.kind.sliding_window_family and g.prefix_cacheable
        )

    @property
    def group_mix(self) -> str:
        """The layout's group mix, e.g. ``mla+3xsliding_window_mla``: kinds in
        :class:`GroupKind` order (whatever the groups' order) with counts,
        draft groups marked ``draft:`` after the target groups."""
        order = {kind: rank for rank, kind in enumerate(GroupKind)}
        counts: dict[tuple[bool, int, str], int] = {}
        for g in self.kv_cache_groups:
            key = (
                g.is_eagle_group,
                order[g.kind],
                ("draft:" if g.is_eagle_group else "") + g.kind.value,
            )
            counts[key] = counts.get(key, 0) + 1
        return "+".join(
            name if n == 1 else f"{n}x{name}" for (_, _, name), n in sorted(counts.items())
        )

    @cached_property
    def draft_groups(self) -> DraftGroups:
        """Which groups the EAGLE block drop applies to (:class:`DraftGroups`).

        ``NONE`` when the drafter never asks for the drop
        (``SpeculativeConfig.use_eagle_block_drop`` in stock vLLM 0.33.0:
        EAGLE, EAGLE3, MTP, multi-module and Gemma-4 MTP, unless
        ``disable_eagle_block_drop``); else ``ANNOTATED`` when some group is
        marked ``is_eagle_group``, ``FALLBACK`` otherwise. Lookahead block
        hashes may still clear the drop at run time (``Scheduler.__init__``).
        """
        if (
            self.drafter.kind.value not in DROPPING_DRAFTERS
            or self.disable_eagle_block_drop is True
        ):
            return DraftGroups.NONE
        if any(g.is_eagle_group for g in self.kv_cache_groups):
            return DraftGroups.ANNOTATED
        return DraftGroups.FALLBACK

    @cached_property
    def drop_group_indices(self) -> frozenset[int]:
        """Indices of the groups that take the EAGLE drop when the manager
        drops (``KVCacheCoordinator.eagle_group_ids``).

        Annotated: the ``is_eagle_group`` groups and, with several groups,
        every group whose spec equals one of theirs
        (``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups`` decides
        the drop per spec). Fallback: every group. None: no group. A group
        that is not prefix-cacheable (a circular buffer) never drops:
        ``verify_and_split_kv_cache_groups`` leaves it out of every lookup.
        """
        mode = self.draft_groups
        if mode is DraftGroups.NONE:
            return frozenset()
        groups = self.kv_cache_groups
        if mode is DraftGroups.FALLBACK:
            return frozenset(i for i, g in enumerate(groups) if g.prefix_cacheable)
        keys = {g.spec_key for g in groups if g.is_eagle_group}
        return frozenset(i for i, g in enumerate(groups) if g.spec_key in keys)

    @property
    def drop_applies(self) -> bool:
        """Whether stock vLLM 0.33.0 runs with the EAGLE drop on: a dropping
        drafter (:attr:`draft_groups` not ``NONE``) and lookahead block hashes
        off (disabled, or a KV connector configured;
        ``VllmConfig.num_hash_lookahead_tokens``)."""
        return self.draft_groups is not DraftGroups.NONE and (
            self.disable_lookahead_block_hashes is True or self.kv_connector is True
        )

    @property
    def pins_junctions(self) -> bool:
        """Whether vLLM can report an uncached common prefix for this layout,
        which ``KVCacheManager.get_computed_blocks`` pins as the request's
        shared-prefix junction.

        ``HybridKVCacheCoordinator.find_longest_cache_hit``
        (vllm/v1/core/kv_cache_coordinator.py) reports the longest hit an
        attention type found before the reconciled one; types are groups of
        equal spec (:attr:`KVCacheGroup.spec_key`), a full-attention-family
        type first. kvfuzz models that longest hit as the dense hit, which the
        downward-closed full-attention type finds, so junctions are modelled
        for layouts of two or more types with a full-attention-family group.
        A single type (one group, or groups of equal spec) reports none; a
        layout without full attention reports its first sliding-window
        type's own hit, and a layout whose full-attention groups skip the EAGLE
        drop that marked draft groups take reports full attention's undropped
        hit: kvfuzz promises neither (it owes less there, never more).
        Circular buffers are no type (vLLM looks none of them up).
        """
        groups = self.kv_cache_groups
        if len({g.spec_key for g in self.cacheable_groups}) < 2:
            return False
        full = [i for i, g in enumerate(groups) if g.kind.full_attention_family]
        if self.drop_applies and any(i not in self.drop_group_indices for i in full):
            # Annotated draft groups leave full attention without the drop:
            # its own hit, one drop unit above the dense hit, is the junction
            # vLLM pins; kvfuzz does not model it and promises none there.
            return False
        return bool(full)

    @cached_property
    def prompts(self) -> tuple[tuple[int, ...], ...]:
        """Every request's prompt token ids, generated deterministically.

        Only the part of the shared prefix some request copies is built: an
        unused prefix costs nothing (and is not counted against the limits).
        A request's own images (``RequestSpec.mm_inputs``) are runs of
        :data:`~differential.scenario.multimodal.MM_PLACEHOLDER_TOKEN_ID`
        among its own tokens, so prompts with different images can have the
        same token ids; :attr:`contents` tells them apart.
        """
        used = max((r.source_tokens for r in self.requests if r.shares_with is None), default=0)
        prefix = tuple(1 + p % _PREFIX_TOKEN_MODULUS for p in range(used))
        prompts: list[tuple[int, ...]] = []
        for index, request in enumerate(self.requests):
            source = prefix if request.shares_with is None else prompts[request.shares_with]
            if request.shares_with is not None and self.workload.shares_output:
                source = source + self.sampled_tokens(request.shares_with)
            own_base = _OWN_TOKEN_BASE + index * _OWN_TOKEN_STRIDE
            own = tuple(own_base + k for k in range(request.suffix_tokens))
            if request.mm_inputs:
                own_list = list(own)
                for m in request.mm_inputs:
                    end = m.suffix_offset_tokens + m.length_tokens
                    own_list[m.suffix_offset_tokens : end] = [MM_PLACEHOLDER_TOKEN_ID] * (
                        m.length_tokens
                    )
                own = tuple(own_list)
            rejoin = request.divergence_tokens + request.suffix_tokens
            prompts.append(
                source[: request.divergence_tokens]
                + own
                + source[rejoin : rejoin + request.rejoin_tokens]
            )
        return tuple(prompts)

    @property
    def has_mm_inputs(self) -> bool:
        """Whether some request has multimodal inputs (``RequestSpec.mm_inputs``)."""
        return any(r.mm_inputs for r in self.requests)

    @property
    def has_cache_salts(self) -> bool:
        """Whether some request has a ``cache_salt``."""
        return any(r.cache_salt is not None for r in self.requests)

    @cached_property
    def mm_placements(self) -> tuple[tuple[PlacedInput, ...], ...]:
        """Per request, every image in its prompt (copied from its source
        and its own), sorted by offset: vLLM's ``PlaceholderRange`` offsets
        and lengths in tokens, with the identifiers
        (:func:`~differential.scenario.multimodal.placed_inputs`)."""
        return placed_inputs(self.requests)

    @cached_property
    def _content_coder(self) -> ContentCoder:
        largest = max((max(p, default=0) for p in self.prompts), default=0)
        if self.requests:
            largest = max(largest, self.output_token(len(self.requests) - 1, self.decode_steps))
        return ContentCoder.build(self.requests, self.mm_placements, largest)

    @cached_property
    def contents(self) -> tuple[tuple[int, ...], ...]:
        """Every request's prompt as content ids, what the oracle compares:
        the token id, and where an image lies its identifier and offset in
        it, under the request's cache salt (one-to-one;
        :class:`~differential.scenario.multimodal.ContentCoder`). Two prompts
        share a prefix of content exactly where vLLM's block hashes can
        agree. The prompts themselves (:attr:`prompts`) when no request has
        an image or a salt."""
        if not self.has_mm_inputs and not self.has_cache_salts:
            return self.prompts
        coder = self._content_coder
        return tuple(
            coder.prompt(i, prompt, placed)
            for i, (prompt, placed) in enumerate(zip(self.prompts, self.mm_placements, strict=True))
        )

    def sampled_contents(self, request_index: int) -> tuple[int, ...]:
        """:meth:`sampled_tokens` of ``request_index`` as content ids (under
        its cache salt), to follow :attr:`contents`."""
        sampled = self.sampled_tokens(request_index)
        if not self.has_cache_salts:
            return sampled
        return self._content_coder.tokens(request_index, sampled)

    @property
    def step_budget_tokens(self) -> int:
        """Tokens scheduled per step, in tokens: ``workload.max_num_batched_tokens``
        (vLLM ``SchedulerConfig``), else ``prefill_chunk_tokens``. A prefill
        chunk is at most this long in both driving modes."""
        return self.workload.max_num_batched_tokens or self.prefill_chunk_tokens

    def sampled_tokens(self, request_index: int) -> tuple[int, ...]:
        """The ``decode_steps + 1`` tokens request ``request_index`` samples
        (its answer: the first at prefill end, one per decode step)."""
        return tuple(self.output_token(request_index, k) for k in range(self.decode_steps + 1))

    def output_token(self, request_index: int, step: int) -> int:
        """Token id sampled by ``request_index`` at decode ``step`` (unique)."""
        return _OWN_TOKEN_BASE + request_index * _OWN_TOKEN_STRIDE + _OWN_TOKEN_STRIDE // 2 + step

    @property
    def label(self) -> str:
        """A name for reports: ``name`` if set, else a short geometry summary."""
        if self.name:
            return self.name
        groups = "/".join(str(g.block_size_tokens) for g in self.kv_cache_groups)
        return f"blocks {groups}, R={self.retention_interval_tokens}, {self.drafter.kind.value}"

    # -------------------------------------------------------------------- JSON

    def to_dict(self) -> dict[str, Any]:
        """The canonical, versioned JSON-ready form (every field present, except
        ``enable_mamba_shared_prefix_checkpoint``, ``mamba_prefill``,
        ``workload`` and ``dcp_world_size``, written only when not their
        default)."""
        return scenario_to_dict(self._document)

    def to_json(self) -> str:
        """Canonical JSON text (2-space indent, trailing newline)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: object) -> Scenario:
        """Build a scenario from its JSON form.

        Raises:
            ScenarioError: on a wrong format or version, an unknown or missing
                key, a value of the wrong type, or an invalid combination.
        """
        return cls(**scenario_fields(data))

    @classmethod
    def from_json(cls, text: str, *, source: str | None = None) -> Scenario:
        """Parse JSON text; ``source`` (a file name) is added to error messages.

        Raises:
            ScenarioError: malformed or absurdly deeply nested JSON (field
                ``<json>``) or any :meth:`from_dict` error.
        """
        data = json_data(text, source=source)
        try:
            return cls.from_dict(data)
        except ScenarioError as exc:
            raise exc.with_source(source) if source else exc from None

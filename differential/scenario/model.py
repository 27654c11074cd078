"""The scenario model: one reproducible prefix-caching experiment.

A :class:`Scenario` is a frozen value describing a hybrid model's KV cache
groups, the prefix-cache settings, the drafter and a sequence of requests that
share prefixes. Its JSON form is versioned and round-trips exactly
(``Scenario.from_dict(s.to_dict()) == s``). Token ids are never stored: they
are generated deterministically from the request shapes, so a scenario file
stays small and readable.

Units: every length ending in ``_tokens`` is in tokens; block counts say
``blocks``.

This module does not import vLLM. Where a rule mirrors vLLM's own validation
the vLLM function is named in the docstring.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Any, TypeVar

from differential.errors import ScenarioError

__all__ = [
    "SCENARIO_FORMAT",
    "SCENARIO_VERSION",
    "DraftGroups",
    "Drafter",
    "DrafterKind",
    "DriveMode",
    "GroupKind",
    "KVCacheGroup",
    "MambaPrefill",
    "RequestSpec",
    "Scenario",
    "Workload",
]

SCENARIO_FORMAT = "kvfuzz.scenario"
SCENARIO_VERSION = 1

# Token id ranges: prefix tokens and each request's own tokens never collide,
# so two requests share exactly the tokens the scenario says they share.
_PREFIX_TOKEN_MODULUS = 50_000
_OWN_TOKEN_BASE = 1_000_000
_OWN_TOKEN_STRIDE = 1_000_000

_E = TypeVar("_E", bound=StrEnum)


class GroupKind(StrEnum):
    """Attention type of a KV cache group (vLLM ``kv_cache_interface.py``)."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    #: A Mamba / linear-attention (GDN, KDA) state group: vLLM's ``MambaSpec``
    #: driven by ``MambaManager`` in ``mamba_cache_mode="align"``, the only
    #: mode with prefix caching (vllm/config/cache.py). One block holds one
    #: state: the recurrent state after exactly the tokens up to its end.
    MAMBA = "mamba"
    #: Multi-head latent attention (DeepSeek-V2/V3/V4): vLLM's
    #: ``MLAAttentionSpec``, a ``FullAttentionSpec`` subclass driven by
    #: ``FullAttentionManager`` (vllm/v1/core/single_type_kv_cache_manager.py
    #: registers it so); for hits it behaves exactly like full attention.
    MLA = "mla"
    #: Sliding-window MLA (DeepSeek-V4's compressed local layers): vLLM's
    #: ``SlidingWindowMLASpec``, a ``SlidingWindowSpec`` subclass driven by
    #: ``SlidingWindowManager``; for hits it behaves like a sliding window.
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    #: Chunked local attention (Llama-4's ``attention_chunk_size`` layers):
    #: vLLM's ``ChunkedLocalAttentionSpec`` driven by
    #: ``ChunkedLocalAttentionManager``: a token attends only to the tokens of
    #: its own chunk, so blocks of earlier chunks are never needed for a hit.
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"

    @property
    def full_attention_family(self) -> bool:
        """Driven by vLLM's ``FullAttentionManager`` (full attention, MLA)."""
        return self in (GroupKind.FULL_ATTENTION, GroupKind.MLA)

    @property
    def sliding_window_family(self) -> bool:
        """Driven by vLLM's ``SlidingWindowManager`` (sliding window, SW-MLA)."""
        return self in (GroupKind.SLIDING_WINDOW, GroupKind.SLIDING_WINDOW_MLA)


class DraftGroups(StrEnum):
    """Which KV cache groups take the EAGLE block drop, and why.

    ``NONE``: the scenario's drafter never drops (no drafter, or one whose
    draft KV does not read the next token). ``ANNOTATED``: some groups are
    marked ``is_eagle_group`` as vLLM's planner marks the drafter's own KV
    groups (vllm/v1/core/kv_cache_planning.py), and only they (and groups
    sharing their spec, batched together by
    ``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups``) drop.
    ``FALLBACK``: no group is marked, so ``KVCacheCoordinator.__init__``
    conservatively flags every group (vllm/v1/core/kv_cache_coordinator.py).
    """

    NONE = "none"
    ANNOTATED = "annotated"
    FALLBACK = "fallback"


# Drafters whose draft KV reads the next token(s): vLLM
# SpeculativeConfig.needs_eagle_block_drop (use_eagle and not DFlash/DSpark);
# Gemma-4 MTP counts as stock vLLM 0.33.0 drops for it.
_DROPPING_DRAFTERS = frozenset({"eagle", "eagle3", "mtp", "multi_module_mtp", "gemma4_mtp"})


class MambaPrefill(StrEnum):
    """Where prefill steps end for a model with Mamba groups (a Mamba state
    exists only where a step ended).

    ``SCHEDULER`` (the default) is vLLM's own chunking,
    ``Scheduler._mamba_block_aligned_split`` in vllm/v1/core/sched/scheduler.py
    (called by the driver): the chunk budget ends long steps on the block grid
    and steps stop at the last cacheable block boundary, at the prompt's
    fine-grained checkpoint and at the shared-prefix junction. ``BLOCK`` is a
    block-carved prefill: a step ends at every Mamba block boundary and at the
    prompt end, with no other stop; it is how vLLM's own manager tests feed
    ``allocate_slots`` and how the upstream measurements of vLLM PR #57444
    were taken.
    """

    SCHEDULER = "scheduler"
    BLOCK = "block"


class DrafterKind(StrEnum):
    """Speculative-decoding drafter, as ``SpeculativeConfig.method`` plus model type.

    ``MULTI_MODULE_MTP`` is ``method="mtp"`` with one MTP module per speculative
    token (``num_nextn_predict_layers``); ``GEMMA4_MTP`` is ``method="mtp"``
    with a ``gemma4_mtp`` draft model (vLLM ``config/speculative.py``).
    """

    NONE = "none"
    EAGLE = "eagle"
    EAGLE3 = "eagle3"
    MTP = "mtp"
    MULTI_MODULE_MTP = "multi_module_mtp"
    GEMMA4_MTP = "gemma4_mtp"
    DFLASH = "dflash"
    DSPARK = "dspark"
    DRAFT_MODEL = "draft_model"
    NGRAM = "ngram"


def _allowed_enum(enum: type[StrEnum]) -> str:
    return "one of " + ", ".join(repr(m.value) for m in enum)


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group: layers sharing a spec (vLLM ``KVCacheGroupSpec``).

    Attributes:
        kind: the attention type (:class:`GroupKind`).
        block_size_tokens: the group's block size, in tokens (for a Mamba
            group vLLM's ``mamba_block_size``: one state per block).
        sliding_window_tokens: the attention window in tokens (sliding-window
            and sliding-window MLA groups only; ``None`` otherwise).
        attention_chunk_size_tokens: the attention chunk in tokens (chunked
            local attention only, vLLM's ``attention_chunk_size``; ``None``
            otherwise). Written to JSON only when set.
        is_eagle_group: the group holds the drafter's own layers and takes the
            EAGLE block drop, as vLLM's planner sets
            ``KVCacheGroupSpec.is_eagle_group``. Written to JSON only when true.
    """

    kind: GroupKind
    block_size_tokens: int
    sliding_window_tokens: int | None = None
    attention_chunk_size_tokens: int | None = None
    is_eagle_group: bool = False

    def validate(self, where: str) -> None:
        """Raise :class:`ScenarioError` naming ``where`` if the group is invalid."""
        if not isinstance(self.kind, GroupKind):
            raise ScenarioError(f"{where}.kind", self.kind, _allowed_enum(GroupKind))
        _require_int(self.block_size_tokens, f"{where}.block_size_tokens", minimum=1)
        if self.kind.sliding_window_family:
            _require_int(self.sliding_window_tokens, f"{where}.sliding_window_tokens", minimum=1)
        elif self.sliding_window_tokens is not None:
            raise ScenarioError(
                f"{where}.sliding_window_tokens",
                self.sliding_window_tokens,
                f"null for a {self.kind.value} group",
            )
        if self.kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
            _require_int(
                self.attention_chunk_size_tokens,
                f"{where}.attention_chunk_size_tokens",
                minimum=1,
            )
        elif self.attention_chunk_size_tokens is not None:
            raise ScenarioError(
                f"{where}.attention_chunk_size_tokens",
                self.attention_chunk_size_tokens,
                f"null for a {self.kind.value} group",
            )
        if not isinstance(self.is_eagle_group, bool):
            raise ScenarioError(f"{where}.is_eagle_group", self.is_eagle_group, "true or false")
        if self.is_eagle_group and self.kind is GroupKind.MAMBA:
            # HybridKVCacheCoordinator.find_longest_cache_hit: draft models
            # have no Mamba layers (the Mamba finder never drops).
            raise ScenarioError(
                f"{where}.is_eagle_group",
                True,
                "false for a mamba group (a drafter has no Mamba layers)",
            )

    @property
    def spec_key(self) -> tuple[object, ...]:
        """What makes two groups' vLLM specs equal (kind, block, window, chunk).

        ``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups`` looks up
        groups of equal spec together and decides the EAGLE drop for all of
        them at once.
        """
        return (
            self.kind,
            self.block_size_tokens,
            self.sliding_window_tokens,
            self.attention_chunk_size_tokens,
        )


@dataclass(frozen=True)
class Drafter:
    """The speculative-decoding drafter.

    Attributes:
        kind: which drafter (``DrafterKind.NONE`` for plain decoding).
        num_speculative_tokens: tokens drafted per step; 0 exactly when
            ``kind`` is ``none``.
    """

    kind: DrafterKind = DrafterKind.NONE
    num_speculative_tokens: int = 0

    def validate(self) -> None:
        """Raise :class:`ScenarioError` if kind and token count disagree."""
        if self.kind is DrafterKind.NONE:
            if self.num_speculative_tokens != 0:
                raise ScenarioError(
                    "drafter.num_speculative_tokens",
                    self.num_speculative_tokens,
                    "0 when drafter.kind is 'none'",
                )
            return
        # vLLM SpeculativeConfig._verify_args: num_speculative_tokens > 0.
        _require_int(self.num_speculative_tokens, "drafter.num_speculative_tokens", minimum=1)
        if self.kind is DrafterKind.MULTI_MODULE_MTP and self.num_speculative_tokens < 2:
            raise ScenarioError(
                "drafter.num_speculative_tokens",
                self.num_speculative_tokens,
                "at least 2 for multi_module_mtp (one MTP module per token)",
            )


@dataclass(frozen=True)
class RequestSpec:
    """One request of a scenario.

    The request's prompt is the first ``divergence_tokens`` tokens of its
    source (the scenario's shared prefix, or the prompt of the earlier request
    ``shares_with``) followed by ``suffix_tokens`` tokens of its own, which no
    other request contains.

    Attributes:
        divergence_tokens: tokens copied from the source, i.e. the divergence
            point ``D`` in tokens.
        suffix_tokens: the request's own tokens after ``D``.
        shares_with: index of an earlier request to copy from, or ``None`` for
            the shared prefix.
        name: optional label used in reports.
    """

    divergence_tokens: int
    suffix_tokens: int
    shares_with: int | None = None
    name: str | None = None

    @property
    def prompt_tokens(self) -> int:
        """Prompt length ``L`` in tokens."""
        return self.divergence_tokens + self.suffix_tokens


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
    """

    mode: DriveMode = DriveMode.MANAGER
    pool_blocks: int | None = None
    arrival_steps: tuple[int, ...] | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    shares_output: bool = False
    accepted_drafts: tuple[int, ...] = ()

    @property
    def sequential(self) -> bool:
        """Requests run one at a time and nothing is drafted (so the
        manager-level driver reconstructs the same calls)."""
        return self.arrival_steps is None and not self.accepted_drafts

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (every field present)."""
        return {
            "mode": self.mode.value,
            "pool_blocks": self.pool_blocks,
            "arrival_steps": None if self.arrival_steps is None else list(self.arrival_steps),
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "shares_output": self.shares_output,
            "accepted_drafts": list(self.accepted_drafts),
        }


_WORKLOAD_KEYS = frozenset(
    {
        "mode",
        "pool_blocks",
        "arrival_steps",
        "max_num_seqs",
        "max_num_batched_tokens",
        "shares_output",
        "accepted_drafts",
    }
)


def _workload_from(raw: object) -> Workload:
    obj = _expect_mapping(raw, "workload")
    _reject_unknown(obj, _WORKLOAD_KEYS, "workload.")
    arrivals = obj.get("arrival_steps")
    if arrivals is not None:
        arrivals = tuple(_expect_list(arrivals, "workload.arrival_steps"))
    return Workload(
        mode=_enum(DriveMode, obj.get("mode", "manager"), "workload.mode"),
        pool_blocks=obj.get("pool_blocks"),
        arrival_steps=arrivals,
        max_num_seqs=obj.get("max_num_seqs"),
        max_num_batched_tokens=obj.get("max_num_batched_tokens"),
        shares_output=obj.get("shares_output", False),
        accepted_drafts=tuple(
            _expect_list(obj.get("accepted_drafts", []), "workload.accepted_drafts")
        ),
    )


@dataclass(frozen=True)
class Scenario:
    """A complete, reproducible prefix-caching experiment.

    Attributes:
        kv_cache_groups: any mix of group kinds in any order, each with its
            own block size: one group runs on vLLM's
            ``UnitaryKVCacheCoordinator``, several on the
            ``HybridKVCacheCoordinator``. Mamba groups share one block size,
            the scheduler block size; a chunked-local group's block is the hit
            alignment and never takes the EAGLE drop; ``is_eagle_group`` needs
            a dropping drafter (see :meth:`_validate_draft_groups`).
        requests: the requests, run in order; each is prefilled, decoded for
            ``decode_steps`` tokens and freed before the next starts.
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
            default ``scheduler``.
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

    def __post_init__(self) -> None:
        self._validate()

    # ----------------------------------------------------------------- derived

    @cached_property
    def scheduler_block_size_tokens(self) -> int:
        """LCM of all group block sizes, in tokens (vLLM
        ``resolve_kv_cache_block_sizes``)."""
        return math.lcm(*(g.block_size_tokens for g in self.kv_cache_groups))

    @cached_property
    def effective_hash_block_size_tokens(self) -> int:
        """Hash block size in tokens: the given one, else the GCD of the group
        block sizes (vLLM ``resolve_kv_cache_block_sizes``)."""
        if self.hash_block_size_tokens is not None:
            return self.hash_block_size_tokens
        if len(self.kv_cache_groups) == 1:
            return self.kv_cache_groups[0].block_size_tokens
        return math.gcd(*(g.block_size_tokens for g in self.kv_cache_groups))

    @cached_property
    def partial_hash_hits(self) -> bool:
        """Whether vLLM serves hits at hash-block granularity (fine-grained hits).

        As ``vllm/v1/core/kv_cache_utils.py`` ``partial_hash_hits_enabled``
        decides for ``HybridKVCacheCoordinator``: some Mamba group (align
        mode) has a block larger than the hash block, and every other group
        either supports fine-grained lookup (full attention, MLA, Mamba:
        ``supports_fine_grained_hash_lookup``) or has a block equal to the hash
        block (sliding window, sliding-window MLA, chunked local attention). A single
        group runs on ``UnitaryKVCacheCoordinator``, which never does.
        """
        if len(self.kv_cache_groups) < 2:
            return False
        hash_block = self.effective_hash_block_size_tokens
        if not any(
            g.kind is GroupKind.MAMBA and g.block_size_tokens > hash_block
            for g in self.kv_cache_groups
        ):
            return False
        return all(
            g.kind.full_attention_family
            or g.kind is GroupKind.MAMBA
            or g.block_size_tokens == hash_block
            for g in self.kv_cache_groups
        )

    @cached_property
    def effective_hit_alignment_tokens(self) -> int:
        """Hit alignment ``A`` in tokens: the hash block size with fine-grained
        hits, else the scheduler block size (vLLM
        ``HybridKVCacheCoordinator._cache_hit_alignment_tokens``)."""
        if self.partial_hash_hits:
            return self.effective_hash_block_size_tokens
        return self.scheduler_block_size_tokens

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
        """The sliding-window-family groups (sliding window, sliding-window
        MLA: both run on ``SlidingWindowManager``), in order."""
        return tuple(g for g in self.kv_cache_groups if g.kind.sliding_window_family)

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

    @property
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
            self.drafter.kind.value not in _DROPPING_DRAFTERS
            or self.disable_eagle_block_drop is True
        ):
            return DraftGroups.NONE
        if any(g.is_eagle_group for g in self.kv_cache_groups):
            return DraftGroups.ANNOTATED
        return DraftGroups.FALLBACK

    @property
    def drop_group_indices(self) -> frozenset[int]:
        """Indices of the groups that take the EAGLE drop when the manager
        drops (``KVCacheCoordinator.eagle_group_ids``).

        Annotated: the ``is_eagle_group`` groups and, with several groups,
        every group whose spec equals one of theirs
        (``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups`` decides
        the drop per spec). Fallback: every group. None: no group.
        """
        mode = self.draft_groups
        if mode is DraftGroups.NONE:
            return frozenset()
        groups = self.kv_cache_groups
        if mode is DraftGroups.FALLBACK:
            return frozenset(range(len(groups)))
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
        """
        groups = self.kv_cache_groups
        if len({g.spec_key for g in groups}) < 2:
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
        """Every request's prompt token ids, generated deterministically."""
        prefix = tuple(1 + p % _PREFIX_TOKEN_MODULUS for p in range(self.shared_prefix_tokens))
        prompts: list[tuple[int, ...]] = []
        for index, request in enumerate(self.requests):
            source = prefix if request.shares_with is None else prompts[request.shares_with]
            if request.shares_with is not None and self.workload.shares_output:
                source = source + self.sampled_tokens(request.shares_with)
            own_base = _OWN_TOKEN_BASE + index * _OWN_TOKEN_STRIDE
            own = tuple(own_base + k for k in range(request.suffix_tokens))
            prompts.append(source[: request.divergence_tokens] + own)
        return tuple(prompts)

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

    # -------------------------------------------------------------- validation

    def _validate(self) -> None:
        if not isinstance(self.kv_cache_groups, tuple) or not self.kv_cache_groups:
            raise ScenarioError(
                "kv_cache_groups", self.kv_cache_groups, "a non-empty list of groups"
            )
        for i, group in enumerate(self.kv_cache_groups):
            group.validate(f"kv_cache_groups[{i}]")
        # Any mix of kinds, in any order, is accepted: one group runs on
        # vLLM's UnitaryKVCacheCoordinator, several on the
        # HybridKVCacheCoordinator (which needs no full-attention group).
        sbs = self.scheduler_block_size_tokens
        self._validate_mamba(sbs)
        if self.hash_block_size_tokens is not None:
            _require_int(self.hash_block_size_tokens, "hash_block_size_tokens", minimum=1)
            bad = [
                g.block_size_tokens
                for g in self.kv_cache_groups
                if g.block_size_tokens % self.hash_block_size_tokens
            ]
            if bad or (
                len(self.kv_cache_groups) == 1
                and self.hash_block_size_tokens != self.kv_cache_groups[0].block_size_tokens
            ):
                # vLLM HybridKVCacheCoordinator.__init__ asserts divisibility;
                # resolve_kv_cache_block_sizes rejects any other value for a
                # single group.
                raise ScenarioError(
                    "hash_block_size_tokens",
                    self.hash_block_size_tokens,
                    "null or a divisor of every group block size "
                    f"({[g.block_size_tokens for g in self.kv_cache_groups]}); "
                    "with a single group, its block size",
                )
        alignment = self.effective_hit_alignment_tokens
        if self.hit_alignment_tokens is not None and self.hit_alignment_tokens != alignment:
            raise ScenarioError(
                "hit_alignment_tokens",
                self.hit_alignment_tokens,
                f"null or {alignment} (vLLM derives it as the hash block size with "
                "fine-grained Mamba hits, else the scheduler block size, the LCM of "
                "the group block sizes)",
            )
        r = self.retention_interval_tokens
        if r is not None:
            # vLLM kv_cache_coordinator._validate_prefix_cache_retention_interval.
            if not isinstance(r, int) or isinstance(r, bool) or r < 0 or r % sbs:
                raise ScenarioError(
                    "retention_interval_tokens",
                    r,
                    f"null, 0, or a positive multiple of the scheduler block size {sbs}",
                )
            if r > 0 and not self.sliding_window_groups and not self.mamba_groups:
                raise ScenarioError(
                    "retention_interval_tokens",
                    r,
                    "null or 0 for a model without sliding_window or mamba groups "
                    "(retention only applies to sliding-window and Mamba groups)",
                )
        self.drafter.validate()
        self._validate_draft_groups()
        if (
            self.drafter.kind is DrafterKind.MULTI_MODULE_MTP
            and sbs < self.drafter.num_speculative_tokens
        ):
            # vLLM KVCacheCoordinator.__init__.
            raise ScenarioError(
                "drafter.num_speculative_tokens",
                self.drafter.num_speculative_tokens,
                f"at most the scheduler block size {sbs} for multi_module_mtp with prefix caching",
            )
        if (
            self.drafter.kind is DrafterKind.MULTI_MODULE_MTP
            and self.prefill_chunk_tokens < self.drafter.num_speculative_tokens
        ):
            # Scheduler._reserve_prefill_lookahead would never schedule the
            # last chunk: a chunk must cover the prefill lookahead.
            raise ScenarioError(
                "prefill_chunk_tokens",
                self.prefill_chunk_tokens,
                f"at least drafter.num_speculative_tokens "
                f"({self.drafter.num_speculative_tokens}) for multi_module_mtp",
            )
        for name in (
            "kv_connector",
            "disable_lookahead_block_hashes",
            "disable_eagle_block_drop",
            "enable_mamba_shared_prefix_checkpoint",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ScenarioError(name, value, "true or false")
        _require_int(self.prefill_chunk_tokens, "prefill_chunk_tokens", minimum=1)
        self._validate_workload()
        _require_int(self.decode_steps, "decode_steps", minimum=0)
        _require_int(self.shared_prefix_tokens, "shared_prefix_tokens", minimum=0)
        if not isinstance(self.requests, tuple) or not self.requests:
            raise ScenarioError("requests", self.requests, "a non-empty list of requests")
        lengths: list[int] = []
        for i, request in enumerate(self.requests):
            where = f"requests[{i}]"
            if request.shares_with is None:
                source_len = self.shared_prefix_tokens
                source = "shared_prefix_tokens"
            else:
                _require_int(request.shares_with, f"{where}.shares_with", minimum=0)
                if request.shares_with >= i:
                    raise ScenarioError(
                        f"{where}.shares_with",
                        request.shares_with,
                        f"null or the index of an earlier request (0..{i - 1})",
                    )
                source_len = lengths[request.shares_with]
                source = f"requests[{request.shares_with}] prompt length"
                if self.workload.shares_output:
                    source_len += self.decode_steps + 1
                    source += " + its decode_steps + 1 sampled tokens"
            _require_int(request.divergence_tokens, f"{where}.divergence_tokens", minimum=0)
            if request.divergence_tokens > source_len:
                raise ScenarioError(
                    f"{where}.divergence_tokens",
                    request.divergence_tokens,
                    f"0..{source_len} ({source})",
                )
            _require_int(request.suffix_tokens, f"{where}.suffix_tokens", minimum=0)
            if request.prompt_tokens < 1:
                raise ScenarioError(
                    f"{where}.suffix_tokens",
                    request.suffix_tokens,
                    "at least 1 when divergence_tokens is 0 (a prompt needs a token)",
                )
            if request.name is not None and not isinstance(request.name, str):
                raise ScenarioError(f"{where}.name", request.name, "a string or null")
            lengths.append(request.prompt_tokens)

    def _validate_workload(self) -> None:
        """The workload's fields, each named on error."""
        w = self.workload
        if not isinstance(w.mode, DriveMode):
            raise ScenarioError("workload.mode", w.mode, _allowed_enum(DriveMode))
        if w.pool_blocks is not None:
            _require_int(w.pool_blocks, "workload.pool_blocks", minimum=2)
        budget = self.step_budget_tokens
        if w.max_num_seqs is not None:
            _require_int(w.max_num_seqs, "workload.max_num_seqs", minimum=1)
            if w.max_num_seqs > budget:
                # vLLM SchedulerConfig: max_num_batched_tokens >= max_num_seqs.
                raise ScenarioError(
                    "workload.max_num_seqs",
                    w.max_num_seqs,
                    f"null or at most the token budget per step ({budget} tokens: "
                    "workload.max_num_batched_tokens, else prefill_chunk_tokens)",
                )
        if w.max_num_batched_tokens is not None:
            _require_int(w.max_num_batched_tokens, "workload.max_num_batched_tokens", minimum=1)
        if not isinstance(w.shares_output, bool):
            raise ScenarioError("workload.shares_output", w.shares_output, "true or false")
        if w.arrival_steps is not None:
            if not isinstance(w.arrival_steps, tuple) or len(w.arrival_steps) != len(self.requests):
                raise ScenarioError(
                    "workload.arrival_steps",
                    w.arrival_steps,
                    f"null or a list of {len(self.requests)} steps (one per request)",
                )
            last = 0
            for i, step in enumerate(w.arrival_steps):
                _require_int(step, f"workload.arrival_steps[{i}]", minimum=last)
                last = step
        limit = self.drafter.num_speculative_tokens
        if w.accepted_drafts and limit == 0:
            raise ScenarioError(
                "workload.accepted_drafts", list(w.accepted_drafts), "[] without a drafter"
            )
        for i, n in enumerate(w.accepted_drafts):
            _require_int(n, f"workload.accepted_drafts[{i}]", minimum=0)
            if n > limit:
                raise ScenarioError(
                    f"workload.accepted_drafts[{i}]",
                    n,
                    f"at most drafter.num_speculative_tokens ({limit})",
                )
        if w.mode is DriveMode.MANAGER and not w.sequential:
            raise ScenarioError(
                "workload.mode",
                w.mode.value,
                "'scheduler' when arrival_steps or accepted_drafts are set "
                "(the manager-level driver runs one request at a time, without drafts)",
            )

    def _validate_draft_groups(self) -> None:
        """What vLLM accepts for draft groups and chunked local attention.

        Refused: ``is_eagle_group`` without a drafter that asks for the EAGLE
        drop (vLLM's planner, ``get_global_kv_cache_groups`` in
        vllm/v1/core/kv_cache_planning.py, marks draft groups only when
        ``SpeculativeConfig.use_eagle_block_drop()``); a chunked-local group
        that would take the drop, or whose block size is not the hit
        alignment (``ChunkedLocalAttentionManager.find_longest_cache_hit``
        asserts both: "eagle + chunked local attention" is unsupported and
        groups of different block sizes are "not compatible with chunked
        local attention").
        """
        mode = self.draft_groups
        if mode is DraftGroups.NONE:
            for i, g in enumerate(self.kv_cache_groups):
                if g.is_eagle_group:
                    raise ScenarioError(
                        f"kv_cache_groups[{i}].is_eagle_group",
                        True,
                        "false unless the drafter takes the EAGLE block drop "
                        f"(drafter.kind one of {sorted(_DROPPING_DRAFTERS)} and "
                        "disable_eagle_block_drop false)",
                    )
        alignment = self.effective_hit_alignment_tokens
        dropping = self.drop_group_indices if self.drop_applies else frozenset()
        chunked = any(g.kind is GroupKind.CHUNKED_LOCAL_ATTENTION for g in self.kv_cache_groups)
        if chunked and not any(g.kind.full_attention_family for g in self.kv_cache_groups):
            # vLLM accepts it, but no released model has chunked local
            # attention without full attention (Llama-4 interleaves it), and
            # without a full-attention bound ChunkedLocalAttentionManager's
            # null-padded hit reaches positions no earlier request shared
            # (and inflates the shared-prefix junction vLLM pins): the
            # oracle does not judge it.
            raise ScenarioError(
                "kv_cache_groups",
                self.group_mix,
                "a full_attention or mla group beside chunked_local_attention "
                "(kvfuzz judges chunked local attention as Llama-4 has it)",
            )
        if self.mamba_groups and (
            mode is DraftGroups.ANNOTATED
            or any(g.kind is GroupKind.CHUNKED_LOCAL_ATTENTION for g in self.kv_cache_groups)
        ):
            # kvfuzz's own restriction: the state-group oracle
            # (differential/oracle/state.py) models the drop on every
            # attention group and no chunked local attention.
            raise ScenarioError(
                "kv_cache_groups",
                self.group_mix,
                "no is_eagle_group and no chunked_local_attention group beside "
                "mamba groups (kvfuzz's state-group oracle does not judge them yet)",
            )
        for i, g in enumerate(self.kv_cache_groups):
            if g.kind is not GroupKind.CHUNKED_LOCAL_ATTENTION:
                continue
            chunk = g.attention_chunk_size_tokens
            assert chunk is not None
            if chunk % g.block_size_tokens:
                # kvfuzz's own restriction (every released chunk size, e.g.
                # Llama-4's 8192, is a multiple of the block size): the
                # oracle's chunk rule assumes chunks start on a block.
                raise ScenarioError(
                    f"kv_cache_groups[{i}].attention_chunk_size_tokens",
                    chunk,
                    f"a multiple of the group's block size {g.block_size_tokens}",
                )
            if g.block_size_tokens != alignment:
                raise ScenarioError(
                    f"kv_cache_groups[{i}].block_size_tokens",
                    g.block_size_tokens,
                    f"the hit alignment {alignment} for a chunked_local_attention group "
                    "(vLLM's ChunkedLocalAttentionManager needs every group's block size "
                    "to divide it)",
                )
            if i in dropping:
                raise ScenarioError(
                    "kv_cache_groups",
                    self.group_mix,
                    "no chunked_local_attention group taking the EAGLE block drop "
                    "(vLLM does not support EAGLE with chunked local attention): mark "
                    "the drafter's groups is_eagle_group, turn on lookahead block "
                    "hashes, or use a drafter that does not drop",
                )

    def _validate_mamba(self, scheduler_block_tokens: int) -> None:
        """What vLLM accepts for Mamba groups (prefix caching on, align mode).

        Refused: Mamba groups of different block sizes, or (in a hybrid) a
        Mamba block other than the scheduler block size. vLLM sets
        ``mamba_block_size = cache_config.block_size`` in align mode
        (vllm/model_executor/models/config.py ``verify_and_update_config``,
        vllm/platforms/interface.py), and ``Scheduler._mamba_block_aligned_split``
        ends prefill chunks on that one block size for every Mamba group.
        Also refused: ``enable_mamba_shared_prefix_checkpoint`` without a
        Mamba group (it would silently do nothing).
        """
        if not isinstance(self.mamba_prefill, MambaPrefill):
            raise ScenarioError("mamba_prefill", self.mamba_prefill, _allowed_enum(MambaPrefill))
        mamba = self.mamba_groups
        if not mamba:
            if self.mamba_prefill is not MambaPrefill.SCHEDULER:
                raise ScenarioError(
                    "mamba_prefill",
                    self.mamba_prefill.value,
                    "'scheduler' for a model without mamba groups",
                )
            if self.enable_mamba_shared_prefix_checkpoint is True:
                raise ScenarioError(
                    "enable_mamba_shared_prefix_checkpoint",
                    True,
                    "false for a model without mamba groups (it only affects Mamba states)",
                )
            return
        sizes = sorted({g.block_size_tokens for g in mamba})
        if len(sizes) > 1 or sizes[0] != scheduler_block_tokens:
            raise ScenarioError(
                "kv_cache_groups",
                [g.block_size_tokens for g in self.kv_cache_groups],
                "mamba groups that share one block size equal to the scheduler block "
                f"size {scheduler_block_tokens} (vLLM sets mamba_block_size to the "
                "cache block size in align mode)",
            )

    # -------------------------------------------------------------------- JSON

    def to_dict(self) -> dict[str, Any]:
        """The canonical, versioned JSON-ready form (every field present, except
        ``enable_mamba_shared_prefix_checkpoint``, written only when true)."""
        data: dict[str, Any] = {
            "format": SCENARIO_FORMAT,
            "version": SCENARIO_VERSION,
            "name": self.name,
            "description": self.description,
            "kv_cache_groups": [_group_dict(g) for g in self.kv_cache_groups],
            "hash_block_size_tokens": self.hash_block_size_tokens,
            "hit_alignment_tokens": self.hit_alignment_tokens,
            "retention_interval_tokens": self.retention_interval_tokens,
            "drafter": {
                "kind": self.drafter.kind.value,
                "num_speculative_tokens": self.drafter.num_speculative_tokens,
            },
            "kv_connector": self.kv_connector,
            "disable_lookahead_block_hashes": self.disable_lookahead_block_hashes,
            "disable_eagle_block_drop": self.disable_eagle_block_drop,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "decode_steps": self.decode_steps,
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "requests": [
                {
                    "name": r.name,
                    "shares_with": r.shares_with,
                    "divergence_tokens": r.divergence_tokens,
                    "suffix_tokens": r.suffix_tokens,
                }
                for r in self.requests
            ],
        }
        if self.enable_mamba_shared_prefix_checkpoint:
            data["enable_mamba_shared_prefix_checkpoint"] = True
        if self.mamba_prefill is not MambaPrefill.SCHEDULER:
            data["mamba_prefill"] = self.mamba_prefill.value
        if self.workload != Workload():
            data["workload"] = self.workload.to_dict()
        return data

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
        obj = _expect_mapping(data, "scenario")
        _reject_unknown(obj, _TOP_KEYS, "")
        fmt = obj.get("format", SCENARIO_FORMAT)
        if fmt != SCENARIO_FORMAT:
            raise ScenarioError("format", fmt, repr(SCENARIO_FORMAT))
        version = obj.get("version", SCENARIO_VERSION)
        if version != SCENARIO_VERSION:
            raise ScenarioError("version", version, str(SCENARIO_VERSION))
        groups_raw = _expect_list(_required(obj, "kv_cache_groups", ""), "kv_cache_groups")
        groups = tuple(_group_from(g, f"kv_cache_groups[{i}]") for i, g in enumerate(groups_raw))
        drafter_raw = _expect_mapping(obj.get("drafter", {"kind": "none"}), "drafter")
        _reject_unknown(drafter_raw, {"kind", "num_speculative_tokens"}, "drafter.")
        drafter = Drafter(
            kind=_enum(DrafterKind, drafter_raw.get("kind", "none"), "drafter.kind"),
            num_speculative_tokens=drafter_raw.get("num_speculative_tokens", 0),
        )
        requests_raw = _expect_list(_required(obj, "requests", ""), "requests")
        requests = tuple(_request_from(r, f"requests[{i}]") for i, r in enumerate(requests_raw))
        return cls(
            kv_cache_groups=groups,
            requests=requests,
            shared_prefix_tokens=_required(obj, "shared_prefix_tokens", ""),
            retention_interval_tokens=obj.get("retention_interval_tokens"),
            hash_block_size_tokens=obj.get("hash_block_size_tokens"),
            hit_alignment_tokens=obj.get("hit_alignment_tokens"),
            drafter=drafter,
            kv_connector=obj.get("kv_connector", False),
            disable_lookahead_block_hashes=obj.get("disable_lookahead_block_hashes", False),
            disable_eagle_block_drop=obj.get("disable_eagle_block_drop", False),
            prefill_chunk_tokens=obj.get("prefill_chunk_tokens", 2048),
            decode_steps=obj.get("decode_steps", 0),
            name=_string(obj.get("name", ""), "name"),
            description=_string(obj.get("description", ""), "description"),
            enable_mamba_shared_prefix_checkpoint=obj.get(
                "enable_mamba_shared_prefix_checkpoint", False
            ),
            mamba_prefill=_enum(
                MambaPrefill, obj.get("mamba_prefill", "scheduler"), "mamba_prefill"
            ),
            workload=_workload_from(obj.get("workload", {})),
        )

    @classmethod
    def from_json(cls, text: str, *, source: str | None = None) -> Scenario:
        """Parse JSON text; ``source`` (a file name) is added to error messages.

        Raises:
            ScenarioError: malformed or absurdly deeply nested JSON (field
                ``<json>``) or any :meth:`from_dict` error.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScenarioError(
                "<json>",
                f"line {exc.lineno} column {exc.colno}",
                f"valid JSON ({exc.msg})",
                source=source,
            ) from None
        except RecursionError:
            raise ScenarioError(
                "<json>",
                "arrays or objects nested too deep to parse",
                "JSON nested at most a few hundred levels (a scenario needs 3)",
                source=source,
            ) from None
        try:
            return cls.from_dict(data)
        except ScenarioError as exc:
            raise exc.with_source(source) if source else exc from None


_TOP_KEYS = frozenset(
    {
        "format",
        "version",
        "name",
        "description",
        "kv_cache_groups",
        "hash_block_size_tokens",
        "hit_alignment_tokens",
        "retention_interval_tokens",
        "drafter",
        "kv_connector",
        "disable_lookahead_block_hashes",
        "disable_eagle_block_drop",
        "enable_mamba_shared_prefix_checkpoint",
        "mamba_prefill",
        "prefill_chunk_tokens",
        "decode_steps",
        "shared_prefix_tokens",
        "requests",
        "workload",
        # Documents that embed a scenario (corpus entries, campaign findings)
        # may carry these; they are not part of the scenario value.
        "expect",
        "notes",
        "finding",
    }
)


def _require_int(value: object, where: str, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ScenarioError(where, value, f"an integer >= {minimum}")


def _expect_mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ScenarioError(where, value, "a JSON object")
    return value


def _expect_list(value: object, where: str) -> Sequence[Any]:
    if not isinstance(value, list):
        raise ScenarioError(where, value, "a JSON list")
    return value


def _required(obj: Mapping[str, Any], key: str, prefix: str) -> Any:
    if key not in obj:
        raise ScenarioError(f"{prefix}{key}", None, "a value (the field is required)")
    return obj[key]


def _reject_unknown(obj: Mapping[str, Any], known: frozenset[str] | set[str], prefix: str) -> None:
    for key in obj:
        if key not in known:
            raise ScenarioError(
                f"{prefix}{key}",
                obj[key],
                f"no such field; known fields: {', '.join(sorted(known))}",
            )


def _enum(enum: type[_E], value: object, where: str) -> _E:
    try:
        return enum(value)  # type: ignore[arg-type]  # any JSON value: a wrong one raises
    except ValueError:
        raise ScenarioError(where, value, _allowed_enum(enum)) from None


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ScenarioError(where, value, "a string")
    return value


_GROUP_KEYS = frozenset(
    {
        "kind",
        "block_size_tokens",
        "sliding_window_tokens",
        "attention_chunk_size_tokens",
        "is_eagle_group",
    }
)


def _group_dict(g: KVCacheGroup) -> dict[str, Any]:
    """A group's JSON form; the chunk size and the draft mark only when set,
    so files written before those fields existed stay byte-identical."""
    data: dict[str, Any] = {
        "kind": g.kind.value,
        "block_size_tokens": g.block_size_tokens,
        "sliding_window_tokens": g.sliding_window_tokens,
    }
    if g.attention_chunk_size_tokens is not None:
        data["attention_chunk_size_tokens"] = g.attention_chunk_size_tokens
    if g.is_eagle_group:
        data["is_eagle_group"] = True
    return data


def _group_from(raw: object, where: str) -> KVCacheGroup:
    obj = _expect_mapping(raw, where)
    _reject_unknown(obj, _GROUP_KEYS, f"{where}.")
    return KVCacheGroup(
        kind=_enum(GroupKind, _required(obj, "kind", f"{where}."), f"{where}.kind"),
        block_size_tokens=_required(obj, "block_size_tokens", f"{where}."),
        sliding_window_tokens=obj.get("sliding_window_tokens"),
        attention_chunk_size_tokens=obj.get("attention_chunk_size_tokens"),
        is_eagle_group=obj.get("is_eagle_group", False),
    )


def _request_from(raw: object, where: str) -> RequestSpec:
    obj = _expect_mapping(raw, where)
    _reject_unknown(obj, {"name", "shares_with", "divergence_tokens", "suffix_tokens"}, f"{where}.")
    return RequestSpec(
        divergence_tokens=_required(obj, "divergence_tokens", f"{where}."),
        suffix_tokens=_required(obj, "suffix_tokens", f"{where}."),
        shares_with=obj.get("shares_with"),
        name=obj.get("name"),
    )

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
from differential.scenario._checks import _allowed_enum, _require_int
from differential.scenario.drafter import DROPPING_DRAFTERS, Drafter, DrafterKind
from differential.scenario.groups import DraftGroups, GroupKind, KVCacheGroup, MambaPrefill
from differential.scenario.json_form import (
    SCENARIO_FORMAT,
    SCENARIO_VERSION,
    json_data,
    scenario_fields,
    scenario_to_dict,
)
from differential.scenario.workload import DriveMode, RequestSpec, Workload

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

# Token id ranges: prefix tokens and each request's own tokens never collide,
# so two requests share exactly the tokens the scenario says they share.
_PREFIX_TOKEN_MODULUS = 50_000
_OWN_TOKEN_BASE = 1_000_000
_OWN_TOKEN_STRIDE = 1_000_000


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
            self.drafter.kind.value not in DROPPING_DRAFTERS
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
                        f"(drafter.kind one of {sorted(DROPPING_DRAFTERS)} and "
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
        ``enable_mamba_shared_prefix_checkpoint``, ``mamba_prefill`` and
        ``workload``, written only when not their default)."""
        return scenario_to_dict(self)

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

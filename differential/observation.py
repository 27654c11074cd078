"""What a run of vLLM's KV cache manager reported, as plain values.

The driver (:mod:`differential.driver`) fills these in; the oracle and the
comparison read them. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

__all__ = [
    "BlockRecord",
    "BlockWrite",
    "CacheMetrics",
    "ConnectorLookup",
    "GroupLookup",
    "KVCachePlan",
    "KVEvent",
    "KVEventLog",
    "KVEventLookup",
    "KVEventStep",
    "LoadTargets",
    "ManagerSettings",
    "PlannedGroup",
    "PlannedTensor",
    "PrefixCacheCounts",
    "RequestObservation",
    "ResetCall",
    "ResumedLookup",
    "RunObservation",
    "StepTable",
    "StoreCall",
    "event_extra_keys",
    "layer_names_text",
    "runs_of",
    "tokens_of",
]


@dataclass(frozen=True)
class BlockRecord:
    """A real (non-null) KV cache block a lookup handed out, and what it held.

    The driver keeps, per block id, which request last wrote KV into it, at
    which block index of that request and group, and how many of the block's
    tokens it wrote (vLLM ``BlockPool`` block ids; vLLM's own cache keys are
    not used, so a wrong hash match still shows).

    Attributes:
        block_id: vLLM's ``KVCacheBlock.block_id``.
        group: the KV cache group the writer wrote it for (``None`` if no
            request of the run ever wrote it).
        writer: index of the request that wrote it (``None``: never written).
        writer_block_index: the block's index in the writer's block table, in
            blocks (it held the writer's tokens ``[i * B, (i + 1) * B)``).
        filled_tokens: how many of those tokens the writer computed, in tokens.
        state_tokens: for a state group's block (Mamba in ``align`` mode), the
            position, in tokens, of the writer's state it holds: the state
            after the writer's tokens ``[0, state_tokens)``; ``None`` for an
            attention block, or a state the driver does not follow (one a
            step with draft tokens wrote, whose position the drafts'
            acceptance decides). See
            :class:`~differential.driver.block_ledger.BlockLedger`.
        written_in_step_by: for a state group's block, the request whose step
            in the lookup's own scheduler step writes the block's state: that
            forward runs together with the one reading the block, so the
            lookup reads what the block held before, which the other
            fields describe (``None``: no step of the lookup's scheduler step
            writes it).
    """

    block_id: int
    group: int | None
    writer: int | None
    writer_block_index: int | None
    filled_tokens: int
    state_tokens: int | None = None
    written_in_step_by: int | None = None

    @classmethod
    def from_list(cls, data: list[Any] | None) -> BlockRecord | None:
        """Inverse of :meth:`to_list` (``None`` is the null block)."""
        return None if data is None else cls(*data)

    def to_list(self) -> list[Any]:
        """Compact JSON form ``[block_id, group, writer, writer_block_index,
        filled_tokens]``, with ``state_tokens`` next when it or
        ``written_in_step_by`` is set, and ``written_in_step_by`` last when
        it is set."""
        out = [self.block_id, self.group, self.writer, self.writer_block_index, self.filled_tokens]
        if self.state_tokens is not None or self.written_in_step_by is not None:
            out.append(self.state_tokens)
        if self.written_in_step_by is not None:
            out.append(self.written_in_step_by)
        return out


@dataclass(frozen=True)
class BlockWrite:
    """A block an ``allocate_slots`` step handed out for writing that was not
    the request's alone (vLLM ``BlockPool.is_block_writable``: not the null
    block, reference count 1, not already in the prefix cache).

    Attributes:
        position_tokens: first token the step computed, in tokens.
        group: the KV cache group.
        block_index: index in the request's block table, in blocks.
        block_id: vLLM's ``KVCacheBlock.block_id``.
        ref_cnt: the block's reference count after the step (1 when only
            this request holds it).
        cached: the block's prefix-cache entry already covered tokens the
            step wrote.
        null: the block is vLLM's null block.
        held_by: another request (its index) whose block table still holds
            the block, whatever the reference count says (``None``: none).
        cached_state_tokens: for a state group's block whose prefix-cache
            entry promises the state at another position, that position in
            tokens (``None`` otherwise).
        sink: the block id is one of the physical blocks a static sink
            holds (``1 .. sink_len / block_size`` of a sink full attention
            group, vllm/model_executor/layers/attention/static_sink_attention.py):
            every group's layers alias that memory.
    """

    position_tokens: int
    group: int
    block_index: int
    block_id: int
    ref_cnt: int
    cached: bool
    null: bool
    held_by: int | None = None
    cached_state_tokens: int | None = None
    sink: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BlockWrite:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "position_tokens": self.position_tokens,
            "group": self.group,
            "block_index": self.block_index,
            "block_id": self.block_id,
            "ref_cnt": self.ref_cnt,
            "cached": self.cached,
            "null": self.null,
            **({} if self.held_by is None else {"held_by": self.held_by}),
            **(
                {}
                if self.cached_state_tokens is None
                else {"cached_state_tokens": self.cached_state_tokens}
            ),
            **({"sink": True} if self.sink else {}),
        }


def runs_of(tokens: list[int] | tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Token ids as runs of consecutive ids: ``((first id, count), ...)``.

    Lossless (:func:`tokens_of` inverts it); kvfuzz's prompts and answers
    are runs of consecutive ids, so a block's tokens take a few pairs."""
    if tokens and list(tokens) == list(range(tokens[0], tokens[0] + len(tokens))):
        return ((tokens[0], len(tokens)),)  # one run, checked in C
    runs: list[list[int]] = []
    for token in tokens:
        if runs and runs[-1][0] + runs[-1][1] == token:
            runs[-1][1] += 1
        else:
            runs.append([token, 1])
    return tuple((first, count) for first, count in runs)


def tokens_of(runs: tuple[tuple[int, int], ...]) -> list[int]:
    """Inverse of :func:`runs_of`."""
    return list(chain.from_iterable(range(first, first + count) for first, count in runs))


@dataclass(frozen=True)
class KVEvent:
    """One KV cache event vLLM published (vllm/distributed/kv_events.py),
    as plain values.

    Block hashes are written as labels (small integers, numbered by the
    driver in order of first appearance in the run; the same hash has the
    same label everywhere in the run, pool snapshots included), and
    :attr:`KVEventLog.prefixes` says which token prefix each label's hash
    names.

    Attributes:
        kind: ``"stored"`` (``BlockStored``), ``"removed"``
            (``BlockRemoved``) or ``"cleared"`` (``AllBlocksCleared``).
        group: the event's ``group_idx`` (the KV cache group), ``None`` if unset.
        hashes: the event's ``block_hashes``, as labels.
        parent: (stored) ``parent_block_hash`` as a label, ``None`` if unset.
        block_size: (stored) ``block_size``, in tokens.
        tokens: (stored) ``token_ids`` as runs (:func:`runs_of`).
        spec_kind: (stored) ``kv_cache_spec_kind``.
        sliding_window: (stored) ``kv_cache_spec_sliding_window``, in tokens.
        lookup: the index, in its step's :attr:`KVEventStep.lookups`, of the
            ``KVCacheManager.get_computed_blocks`` call that emitted the event
            (the reused blocks a ``"full"`` report re-announces); ``None``
            for an event any other call emitted.
        lookahead: (stored) ``lookahead_token_ids``: per block hash, the
            token ids past its block that the hash covers; ``None`` when the
            event carries none (lookahead hashing off).
        extra_keys: (stored) ``extra_keys``: per block hash, the untagged
            keys its hash covers besides the token ids (an image's
            ``(identifier, offset in the block's tokens)`` pair, a cache
            salt), ``None`` for a block with none; ``None`` when the event
            carries no list.
    """

    kind: str
    group: int | None = None
    hashes: tuple[int, ...] = ()
    parent: int | None = None
    block_size: int = 0
    tokens: tuple[tuple[int, int], ...] = ()
    spec_kind: str | None = None
    sliding_window: int | None = None
    lookup: int | None = None
    lookahead: tuple[tuple[int, ...], ...] | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEvent:
        """Inverse of :meth:`to_dict`."""
        return cls(
            kind=data["kind"],
            group=data.get("group"),
            hashes=tuple(data.get("hashes", ())),
            parent=data.get("parent"),
            block_size=data.get("block_size", 0),
            tokens=tuple((a, b) for a, b in data.get("tokens", ())),
            spec_kind=data.get("spec_kind"),
            sliding_window=data.get("sliding_window"),
            lookup=data.get("lookup"),
            lookahead=None
            if data.get("lookahead") is None
            else tuple(tuple(ids) for ids in data["lookahead"]),
            extra_keys=event_extra_keys(data.get("extra_keys")),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (fields of a ``BlockStored`` only on one)."""
        out: dict[str, Any] = {"kind": self.kind, "group": self.group}
        if self.kind != "cleared":
            out["hashes"] = list(self.hashes)
        if self.kind == "stored":
            out["parent"] = self.parent
            out["block_size"] = self.block_size
            out["tokens"] = [list(r) for r in self.tokens]
            out["spec_kind"] = self.spec_kind
            out["sliding_window"] = self.sliding_window
        if self.lookup is not None:
            out["lookup"] = self.lookup
        if self.lookahead is not None:
            out["lookahead"] = [list(ids) for ids in self.lookahead]
        if self.extra_keys is not None:
            out["extra_keys"] = [
                None if keys is None else [list(k) if isinstance(k, tuple) else k for k in keys]
                for keys in self.extra_keys
            ]
        return out


def event_extra_keys(keys: Any) -> tuple[tuple[Any, ...] | None, ...] | None:
    """A ``BlockStored.extra_keys`` list (or its JSON form) as tuples: per
    block ``None`` or a tuple of keys, each an ``(identifier, offset)`` pair
    as a tuple or a bare value (a cache salt)."""
    if keys is None:
        return None
    return tuple(
        None
        if block is None
        else tuple(tuple(k) if isinstance(k, (list, tuple)) else k for k in block)
        for block in keys
    )


@dataclass(frozen=True)
class KVEventLookup:
    """One ``KVCacheManager.get_computed_blocks`` call made while KV cache
    events were on.

    Attributes:
        request: the request's index in the scenario.
        hit_tokens: the hit it returned, in tokens.
        blocks_per_group: per KV cache group, how many blocks it returned
            (null blocks included), in blocks.
    """

    request: int
    hit_tokens: int
    blocks_per_group: tuple[int, ...]

    @classmethod
    def from_list(cls, data: list[Any]) -> KVEventLookup:
        """Inverse of :meth:`to_list`."""
        return cls(data[0], data[1], tuple(data[2]))

    def to_list(self) -> list[Any]:
        """Compact JSON form ``[request, hit_tokens, blocks_per_group]``."""
        return [self.request, self.hit_tokens, list(self.blocks_per_group)]


@dataclass(frozen=True)
class KVEventStep:
    """The KV cache events of one drain of vLLM's event queue and the cache
    right after it.

    Scheduler mode drains once per scheduler step, at the scheduler's own
    call (``Scheduler.update_from_output``'s ``KVCacheManager.take_events``,
    published through its ``kv_event_publisher``); manager mode drains
    (``KVCacheManager.take_events``) after each lookup and each
    ``allocate_slots``, ``cache_blocks`` and ``free`` call it makes.

    Attributes:
        step: the scheduler step, from 0 (manager mode: the steps the driver
            began, ``new_step_starts`` calls, counted from 0 as well).
        events: the events drained, in vLLM's order.
        lookups: the ``get_computed_blocks`` calls made since the last drain.
        pool: the prefix cache's entries whose count changed since the last
            drain: ``(group, hash label, blocks)``, ``blocks`` the number of
            blocks ``BlockPool.cached_block_hash_to_block`` holds under that
            group and hash now (0: gone).
    """

    step: int
    events: tuple[KVEvent, ...] = ()
    lookups: tuple[KVEventLookup, ...] = ()
    pool: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEventStep:
        """Inverse of :meth:`to_dict`."""
        return cls(
            step=data["step"],
            events=tuple(KVEvent.from_dict(e) for e in data.get("events", ())),
            lookups=tuple(KVEventLookup.from_list(u) for u in data.get("lookups", ())),
            pool=tuple((g, h, n) for g, h, n in data.get("pool", ())),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (empty parts left out)."""
        out: dict[str, Any] = {"step": self.step}
        if self.events:
            out["events"] = [e.to_dict() for e in self.events]
        if self.lookups:
            out["lookups"] = [u.to_list() for u in self.lookups]
        if self.pool:
            out["pool"] = [list(p) for p in self.pool]
        return out


@dataclass(frozen=True)
class KVEventLog:
    """A run's KV cache event stream, drain by drain, and what the cache held.

    Attributes:
        report_mode: every request's ``kv_cache_report_mode``
            (``"incremental"`` or ``"full"``).
        steps: the drains, in order (a drain that changed nothing is left out).
        prefixes: hash label -> ``(request index, tokens)``: the label's hash
            is the chained block hash vLLM's hasher gave that request's first
            ``tokens`` tokens (``Request.block_hashes``, at the hash block
            size); a label naming no request's prefix is absent.
        extra_keys: whether the events' ``extra_keys`` were recorded
            (:attr:`KVEvent.extra_keys`); a log written before they were is
            not judged on them.
    """

    report_mode: str
    steps: tuple[KVEventStep, ...] = ()
    prefixes: dict[int, tuple[int, int]] = field(default_factory=dict)
    extra_keys: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEventLog:
        """Inverse of :meth:`to_dict`."""
        return cls(
            report_mode=data["report_mode"],
            steps=tuple(KVEventStep.from_dict(s) for s in data.get("steps", ())),
            prefixes={int(k): (v[0], v[1]) for k, v in data.get("prefixes", {}).items()},
            extra_keys=bool(data.get("extra_keys", False)),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "report_mode": self.report_mode,
            "steps": [s.to_dict() for s in self.steps],
            "prefixes": {str(k): list(v) for k, v in sorted(self.prefixes.items())},
            **({"extra_keys": True} if self.extra_keys else {}),
        }

    @property
    def num_events(self) -> tuple[int, int, int]:
        """(stored, removed, cleared) events in the run."""
        kinds = [e.kind for s in self.steps for e in s.events]
        return kinds.count("stored"), kinds.count("removed"), kinds.count("cleared")


@dataclass(frozen=True)
class StepTable:
    """One group's block table for a request right after one of its
    ``allocate_slots`` steps: where its null blocks are (an attention group,
    or a Mamba state group in align mode).

    vLLM's ``KVCacheManager.allocate_slots`` first frees the blocks no later
    step attends to (``SingleTypeKVCacheManager.remove_skipped_blocks``,
    replacing them with the null block), then adds the step's blocks; a
    prefix-cache hit's skipped blocks enter the table as null blocks
    (``add_local_computed_blocks``). The oracle
    (:func:`differential.oracle.blocks.table_violations`) reads where the
    nulls are against the window.

    Attributes:
        processed_tokens: the computed tokens the step frees against, in
            tokens: vLLM passes ``max(0, total computed - in flight)`` to
            ``remove_skipped_blocks`` (the hit and external tokens included
            on the first step).
        start_tokens: the first token the step computes, in tokens.
        group: the KV cache group.
        num_blocks: the table's length, in blocks.
        first_real: index of its first real (non-null) block, in blocks
            (``num_blocks`` when it holds none).
        null_end: one past the index of its last null block, in blocks (0
            when it holds none).
        first_unregistered: a state group's only: index of its first real
            block holding no prefix-cache entry (``block_hash`` ``None``), in
            blocks (``num_blocks`` when it holds none); ``None`` for an
            attention group.
    """

    processed_tokens: int
    start_tokens: int
    group: int
    num_blocks: int
    first_real: int
    null_end: int
    first_unregistered: int | None = None

    @classmethod
    def from_list(cls, data: list[int]) -> StepTable:
        """Inverse of :meth:`to_list`."""
        return cls(*data)

    def to_list(self) -> list[int]:
        """Compact JSON form ``[processed_tokens, start_tokens, group, num_blocks,
        first_real, null_end]``, with ``first_unregistered`` appended for a
        state group."""
        out = [
            self.processed_tokens,
            self.start_tokens,
            self.group,
            self.num_blocks,
            self.first_real,
            self.null_end,
        ]
        if self.first_unregistered is not None:
            out.append(self.first_unregistered)
        return out


@dataclass(frozen=True)
class ManagerSettings:
    """The drafter-dependent settings vLLM's config code resolved for a scenario.

    Attributes:
        use_eagle_block_drop: the ``use_eagle`` flag handed to ``KVCacheManager``
            (``SpeculativeConfig.use_eagle_block_drop()``, cleared when lookahead
            hashes are on, as ``Scheduler.__init__`` does).
        num_hash_lookahead_tokens: ``VllmConfig.num_hash_lookahead_tokens``, in
            tokens.
        num_lookahead_tokens: ``VllmConfig.num_lookahead_tokens``: slots, in
            tokens, reserved past the scheduled tokens at every allocation.
        num_prefill_lookahead_tokens: ``VllmConfig.num_prefill_lookahead_tokens``,
            in tokens.
        hit_alignment_tokens: the coordinator's hit alignment ``A``, in tokens.
        hash_block_size_tokens: the block pool's hash block size, in tokens (0
            when not recorded).
        partial_hash_hits: whether the coordinator serves hits at hash-block
            granularity (``KVCacheCoordinator.enable_partial_hash_hits``;
            vLLM ``kv_cache_utils.partial_hash_hits_enabled`` needs a Mamba
            group in align mode): when off, a finer hash block size only
            changes hashing and hits stay aligned to ``A``.
    """

    use_eagle_block_drop: bool
    num_hash_lookahead_tokens: int
    num_lookahead_tokens: int
    num_prefill_lookahead_tokens: int
    hit_alignment_tokens: int
    hash_block_size_tokens: int = 0
    partial_hash_hits: bool = False

    def effective_hash_note(
        self, requested_tokens: int | None, why: str = "no Mamba group in align mode"
    ) -> str | None:
        """A notice when vLLM does not serve hits at a requested finer hash block size.

        Args:
            requested_tokens: the scenario's ``hash_block_size_tokens``.
            why: why vLLM serves no partial hits for this layout (see
                :func:`differential.compare.no_partial_hits_reason`).
        """
        if requested_tokens is None or self.partial_hash_hits:
            return None
        if requested_tokens >= self.hit_alignment_tokens:
            return None
        return (
            f"hash block size {requested_tokens} tokens is used for hashing only: vLLM "
            f"serves no partial hits here ({why}), so hits align "
            f"to A = {self.hit_alignment_tokens} tokens"
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ManagerSettings:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "use_eagle_block_drop": self.use_eagle_block_drop,
            "num_hash_lookahead_tokens": self.num_hash_lookahead_tokens,
            "num_lookahead_tokens": self.num_lookahead_tokens,
            "num_prefill_lookahead_tokens": self.num_prefill_lookahead_tokens,
            "hit_alignment_tokens": self.hit_alignment_tokens,
            "hash_block_size_tokens": self.hash_block_size_tokens,
            "partial_hash_hits": self.partial_hash_hits,
        }


@dataclass(frozen=True)
class GroupLookup:
    """One single-type manager lookup made while a request looked up its hit.

    ``vllm/v1/core/kv_cache_coordinator.py``
    ``HybridKVCacheCoordinator.find_longest_cache_hit`` calls each attention
    group's ``find_longest_cache_hit`` (``vllm/v1/core/single_type_kv_cache_manager.py``),
    possibly several times in its fixed-point loop; the unitary coordinator
    calls its one manager once.

    Attributes:
        group: the first KV cache group index of the call.
        max_length_tokens: the length cap passed (``max_length``), in tokens;
            it includes the EAGLE proof margin when the call drops.
        drop_eagle_block: whether the call dropped the last matched block.
        hit_tokens: the hit the call returned, in tokens.
        run_start_block: index, in blocks of the group, of the first non-null
            block returned: 0 when the matched run starts at the first block
            (always for full attention; for a sliding window, the run that is
            shorter than the window needs), higher when a sliding-window run
            of the full window length was found further in.
    """

    group: int
    max_length_tokens: int
    drop_eagle_block: bool
    hit_tokens: int
    run_start_block: int

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroupLookup:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "group": self.group,
            "max_length_tokens": self.max_length_tokens,
            "drop_eagle_block": self.drop_eagle_block,
            "hit_tokens": self.hit_tokens,
            "run_start_block": self.run_start_block,
        }


@dataclass(frozen=True)
class ResumedLookup:
    """(Scheduler mode) the lookup that rescheduled a preempted request.

    vLLM's ``Scheduler._preempt_request`` (vllm/v1/core/sched/scheduler.py)
    frees the request's blocks (``KVCacheManager.free``) and resets its
    ``num_computed_tokens`` to 0; when the scheduler takes it up again it
    looks up its whole token sequence so far (``get_computed_blocks``).

    Attributes:
        step: the scheduler step that rescheduled it.
        hit_tokens: the hit that lookup returned, in tokens.
        known_tokens: the request's tokens at the lookup (prompt and sampled
            tokens, ``Request.num_tokens``), in tokens.
        preempted_computed_tokens: its ``num_computed_tokens`` when it was
            preempted, in tokens.
        freed_queue_blocks: the free block queue's length when the
            preemption's ``KVCacheManager.free`` began, in blocks (``None``
            when the run's frees were not all attributed to a request).
        freed_queue_removals: blocks removed from the free queue since the
            start of the run at that moment, in blocks.
        lookup_queue_removals: the same count at the lookup, in blocks.
        preempted_known_tokens: its tokens (``Request.num_tokens``) when it
            was preempted, in tokens: under async scheduling a token sampled
            by a step still in flight arrives after the preemption's free
            (``None``: not recorded; ``known_tokens`` stands for it).
        preempted_in_flight_tokens: its ``Request.num_in_flight_tokens`` when
            it was preempted, in tokens: under async scheduling the tokens
            steps still in flight compute (``None``: not recorded).
        scheduled_known_tokens: its tokens (``Request.num_tokens``) when
            ``KVCacheManager.allocate_slots`` last scheduled it before the
            preemption, in tokens: what that call could cache
            (``None``: not recorded).
    """

    step: int
    hit_tokens: int
    known_tokens: int
    preempted_computed_tokens: int
    freed_queue_blocks: int | None
    freed_queue_removals: int | None
    lookup_queue_removals: int | None
    preempted_known_tokens: int | None = None
    preempted_in_flight_tokens: int | None = None
    scheduled_known_tokens: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ResumedLookup:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "step": self.step,
            "hit_tokens": self.hit_tokens,
            "known_tokens": self.known_tokens,
            "preempted_computed_tokens": self.preempted_computed_tokens,
            "freed_queue_blocks": self.freed_queue_blocks,
            "freed_queue_removals": self.freed_queue_removals,
            "lookup_queue_removals": self.lookup_queue_removals,
            **{
                name: value
                for name, value in (
                    ("preempted_known_tokens", self.preempted_known_tokens),
                    ("preempted_in_flight_tokens", self.preempted_in_flight_tokens),
                    ("scheduled_known_tokens", self.scheduled_known_tokens),
                )
                if value is not None
            },
        }


@dataclass(frozen=True)
class PrefixCacheCounts:
    """vLLM's prefix-cache statistics summed over a run
    (``PrefixCacheStats``, vllm/v1/metrics/stats.py, read through
    ``Scheduler.make_stats`` or ``KVCacheManager.make_prefix_cache_stats``).

    Attributes:
        requests: lookups of requests never preempted (``requests``).
        queries: the tokens those lookups queried (``queries``), in tokens.
        hits: the tokens they hit (``hits``), in tokens.
        preempted_requests: lookups of preempted requests taken up again
            (``preempted_requests``).
        preempted_queries: the tokens those queried, in tokens.
        preempted_hits: the tokens those hit, in tokens.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def __add__(self, other: PrefixCacheCounts) -> PrefixCacheCounts:
        return PrefixCacheCounts(
            *(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True))
        )

    def as_tuple(self) -> tuple[int, int, int, int, int, int]:
        """The six counts, in field order."""
        return (
            self.requests,
            self.queries,
            self.hits,
            self.preempted_requests,
            self.preempted_queries,
            self.preempted_hits,
        )


@dataclass(frozen=True)
class ResetCall:
    """One call of ``reset_prefix_cache`` the driver made (``Scheduler.reset_prefix_cache()``
    in scheduler mode, ``KVCacheManager.reset_prefix_cache()`` in manager mode).

    Attributes:
        step: the scheduler step after which it was called; ``None``: after
            the run, every request finished.
        holding: requests admitted and not finished at the call, by the
            driver's own count (they hold KV blocks).
        returned: what the call returned.
        cached_after: cached block entries the pool held right after it
            (``BlockPool.cached_block_hash_to_block``), in blocks.
        flagged: the ``reset`` flag of the prefix-cache statistics read next
            (``None``: not read).
        connector_flagged: (a reset of the KV connector's cache too,
            ``reset_connector=True``) the ``reset`` flag of the connector's
            prefix-cache statistics read next; ``None``: no connector reset.
        store_held_after: (a connector reset, kvfuzz's store connector) the
            tokens its store still held right after, of every request it
            had seen (their longest held prefixes summed), in tokens;
            ``None``: not read.
    """

    step: int | None
    holding: int
    returned: bool
    cached_after: int
    flagged: bool | None = None
    connector_flagged: bool | None = None
    store_held_after: int | None = None

    def to_list(self) -> list[Any]:
        """JSON-ready form: the fields in order (the connector's two only
        when a connector was reset)."""
        out = [self.step, self.holding, self.returned, self.cached_after, self.flagged]
        if self.connector_flagged is not None or self.store_held_after is not None:
            out += [self.connector_flagged, self.store_held_after]
        return out


@dataclass(frozen=True)
class CacheMetrics:
    """What vLLM reported about its own cache in a run: prefix-cache
    statistics, KV cache usage and prefix-cache resets.

    Attributes:
        stats: the prefix-cache statistics summed over every read
            (:class:`PrefixCacheCounts`).
        connector_stats: (scheduler mode, a KV connector) the connector's
            prefix-cache statistics summed likewise
            (``SchedulerStats.connector_prefix_cache_stats``: queries are the
            tokens past the local hit, hits the tokens the store supplied);
            ``None`` without a connector.
        usage_min: the lowest ``KVCacheManager.usage`` read after a step
            (0.0 to 1.0: the share of the pool's blocks, the null block
            aside, that are not free).
        usage_max: the highest.
        usage_end: the usage once every request had finished, before any
            reset (``None``: not read, a run vLLM ended early).
        resets: the ``reset_prefix_cache`` calls made (:class:`ResetCall`).
        prefill_reports: (scheduler mode) each ``EngineCoreOutput.prefill_stats``
            ``Scheduler.update_from_output`` returned, in order: ``(request
            index, prompt tokens, local cached tokens, external cached
            tokens)``, what the request's usage reports
            (``RequestOutput.num_cached_tokens`` is the last two summed);
            ``None``: not read (manager mode, an older record).
    """

    stats: PrefixCacheCounts = field(default_factory=PrefixCacheCounts)
    connector_stats: PrefixCacheCounts | None = None
    usage_min: float = 0.0
    usage_max: float = 0.0
    usage_end: float | None = None
    resets: tuple[ResetCall, ...] = ()
    prefill_reports: tuple[tuple[int, int, int, int], ...] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheMetrics:
        """Inverse of :meth:`to_dict`."""
        return cls(
            stats=PrefixCacheCounts(*data["stats"]),
            connector_stats=None
            if data.get("connector_stats") is None
            else PrefixCacheCounts(*data["connector_stats"]),
            usage_min=data["usage"][0],
            usage_max=data["usage"][1],
            usage_end=data["usage"][2],
            resets=tuple(ResetCall(*r) for r in data.get("resets", ())),
            prefill_reports=None
            if data.get("prefill") is None
            else tuple((int(i), int(p), int(lc), int(ec)) for i, p, lc, ec in data["prefill"]),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        out: dict[str, Any] = {
            "stats": list(self.stats.as_tuple()),
            "usage": [self.usage_min, self.usage_max, self.usage_end],
            "resets": [r.to_list() for r in self.resets],
        }
        if self.connector_stats is not None:
            out["connector_stats"] = list(self.connector_stats.as_tuple())
        if self.prefill_reports is not None:
            out["prefill"] = [list(r) for r in self.prefill_reports]
        return out


#: Per KV cache group, the blocks a connector's load fills:
#: ``(block id, null, cached)`` each (:attr:`ConnectorLookup.load_targets`).
LoadTargets = tuple[tuple[tuple[int, bool, bool], ...], ...]


@dataclass(frozen=True)
class ConnectorLookup:
    """(Scheduler mode, ``workload.connector``) what the KV connector's remote
    store was asked at a request's admitting lookup and what vLLM adopted.

    vLLM's ``Scheduler.schedule`` (vllm/v1/core/sched/scheduler.py, the
    waiting loop) shows the connector the local hit rounded down to a block
    (``get_num_new_matched_tokens``), then adopts ``local`` tokens from the
    prefix cache and ``external`` tokens from the store
    (``KVCacheManager.allocate_slots``'s ``num_new_computed_tokens`` and
    ``num_external_computed_tokens``).

    Attributes:
        local_hit_tokens: the local prefix-cache hit the scheduler built on,
            in tokens (``get_computed_blocks``, or
            ``get_computed_blocks_for_connector``'s full-attention hit, before
            any truncation or reconcile).
        presented_tokens: that hit rounded down to the scheduler block, as
            shown to the connector, in tokens.
        matched_tokens: the tokens the connector reported beyond it, in tokens.
        store_tokens: the longest prefix of the request the store held, in
            tokens (what the connector's answer rests on).
        local_tokens: tokens adopted from the local prefix cache, in tokens.
        external_tokens: tokens adopted from the store, in tokens.
        load_async: the store's tokens loaded between steps.
        diverged: the local lookup was vLLM's
            ``KVCacheManager.get_computed_blocks_for_connector`` and reported
            ``hit_diverged`` (a Mamba group hit less than full attention).
        load_failed: a load of this request failed (kvfuzz's model runner
            reported it, ``workload.connector.failed_loads``): before this
            admission (the whole load: this is the lookup that rescheduled
            it) or after it (its last block).
        prefill_hit_tokens: (disaggregated prefill and decode,
            ``workload.connector.kv_role`` ``kv_consumer``) the prefill
            instance's local prefix-cache hit for the request, in tokens;
            ``None`` without a prefill instance.
        prefill_tokens: the tokens the prefill instance had computed when
            the request finished there (what its connector saved), in
            tokens; ``None`` without a prefill instance.
        prefill_preemptions: how often the prefill instance preempted the
            request (``Request.num_preemptions`` when it finished there).
        load_targets: the blocks the store's tokens are loaded into, per KV
            cache group (``KVCacheBlocks.get_unhashed_block_ids_all_groups``
            at ``update_state_after_alloc``): ``(block id, null, cached)``
            each; ``None``: no load, or a release without the call.
    """

    local_hit_tokens: int
    presented_tokens: int
    matched_tokens: int
    store_tokens: int
    local_tokens: int
    external_tokens: int
    load_async: bool = False
    diverged: bool = False
    load_failed: bool = False
    prefill_hit_tokens: int | None = None
    prefill_tokens: int | None = None
    load_targets: LoadTargets | None = None
    prefill_preemptions: int = 0

    @property
    def computed_tokens(self) -> int:
        """Tokens the request starts computed, local and external, in tokens."""
        return self.local_tokens + self.external_tokens

    @property
    def divergent_hit_kept(self) -> bool:
        """vLLM adopted a divergent lookup's per-group blocks: each group's own
        hit (``RequestObservation.per_group_hit_tokens``), a lagging Mamba
        group's state coming with the load. With no external tokens the
        scheduler reconciles instead, and the recorded lookup is the
        reconciled one."""
        return self.diverged and self.external_tokens > 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConnectorLookup:
        """Inverse of :meth:`to_dict`."""
        targets = data.get("load_targets")
        return cls(
            **{k: v for k, v in data.items() if k != "load_targets"},
            load_targets=None
            if targets is None
            else tuple(tuple((i, n, c) for i, n, c in group) for group in targets),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return (
            {
                "local_hit_tokens": self.local_hit_tokens,
                "presented_tokens": self.presented_tokens,
                "matched_tokens": self.matched_tokens,
                "store_tokens": self.store_tokens,
                "local_tokens": self.local_tokens,
                "external_tokens": self.external_tokens,
                "load_async": self.load_async,
                "diverged": self.diverged,
                "load_failed": self.load_failed,
            }
            | (
                {}
                if self.prefill_tokens is None
                else {
                    "prefill_hit_tokens": self.prefill_hit_tokens,
                    "prefill_tokens": self.prefill_tokens,
                }
            )
            | (
                {}
                if self.load_targets is None
                else {"load_targets": [[list(t) for t in group] for group in self.load_targets]}
            )
            | (
                {"prefill_preemptions": self.prefill_preemptions}
                if self.prefill_preemptions
                else {}
            )
        )


@dataclass(frozen=True)
class StoreCall:
    """(Scheduler mode, a bounded ``workload.connector``) one call kvfuzz's
    stand-in connector made to its store's offloading manager (vLLM's
    ``CPUOffloadingManager`` with the LRU policy, vllm/v1/kv_offload/cpu/),
    or one answer it gave, in order, for the oracle to replay
    (:mod:`differential.oracle.offload_lru`).

    A key is vLLM's ``OffloadKey``: a chained block hash and a KV cache
    group (``make_offload_key``, vllm/v1/kv_offload/base.py), named here by
    a small id (the same key, the same id, across requests).

    Attributes:
        op: ``"store"`` (``prepare_store``), ``"stored"``
            (``complete_store``), ``"load"`` (``prepare_load``), ``"loaded"``
            (``complete_load``), ``"finish"`` (``on_request_finished``) or
            ``"lookup"`` (a ``get_num_new_matched_tokens`` answer).
        request: the request index.
        keys: ``(key id, group, end position in tokens)`` per key: offered,
            completed or loaded; for a lookup, the keys of the request's
            full-attention-family groups, chunk by chunk, up to the longest
            prefix it may hit (all of them up to ``n`` back a hit of ``n``).
        evicted: (store) the key ids the manager evicted to make room.
        refused: (store) the manager could not make room
            (``prepare_store`` returned ``None``): nothing was stored.
        needs: (lookup) per candidate hit ``unit, 2 unit, ...`` tokens, the
            other key ids it needs: the chunks holding a sliding-window
            group's tail, a Mamba group's state.
        unit_tokens: (lookup) the lookup grid, in tokens.
        presented_tokens: (lookup) the local hit shown, in tokens.
        held_tokens: (lookup) the longest prefix the store held, in tokens.
        matched_tokens: (lookup) the tokens answered past the shown hit.
    """

    op: str
    request: int
    keys: tuple[tuple[int, int, int], ...] = ()
    evicted: tuple[int, ...] = ()
    refused: bool = False
    needs: tuple[tuple[int, ...], ...] = ()
    unit_tokens: int = 0
    presented_tokens: int = 0
    held_tokens: int = 0
    matched_tokens: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StoreCall:
        """Inverse of :meth:`to_dict`."""
        return cls(
            op=data["op"],
            request=data["request"],
            keys=tuple((k, g, p) for k, g, p in data.get("keys", ())),
            evicted=tuple(data.get("evicted", ())),
            refused=data.get("refused", False),
            needs=tuple(tuple(n) for n in data.get("needs", ())),
            unit_tokens=data.get("unit_tokens", 0),
            presented_tokens=data.get("presented_tokens", 0),
            held_tokens=data.get("held_tokens", 0),
            matched_tokens=data.get("matched_tokens", 0),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (fields at their default left out)."""
        out: dict[str, Any] = {"op": self.op, "request": self.request}
        if self.keys:
            out["keys"] = [list(k) for k in self.keys]
        if self.evicted:
            out["evicted"] = list(self.evicted)
        if self.refused:
            out["refused"] = True
        if self.op == "lookup":
            out["needs"] = [list(n) for n in self.needs]
            out["unit_tokens"] = self.unit_tokens
            out["presented_tokens"] = self.presented_tokens
            out["held_tokens"] = self.held_tokens
            out["matched_tokens"] = self.matched_tokens
        return out


@dataclass(frozen=True)
class RequestObservation:
    """One request as the real manager served it.

    Attributes:
        index: position of the request in the scenario.
        prompt_tokens: prompt length, in tokens.
        hit_tokens: cached tokens ``get_computed_blocks`` returned, in tokens.
        shared_prefix_boundary_tokens: the junction the request pinned
            (``shared_prefix_boundary``), in tokens; 0 if none.
        per_group_hit_tokens: each KV cache group's own hit, in tokens, from
            ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``
            (equal to ``hit_tokens`` for a single-group model).
        retained_blocks_per_group: blocks, per group, that this request added
            to the prefix cache (cached block count after it was freed minus
            before it started), in blocks.
        cache_map: per group, one character per full block of the prompt,
            ``"1"`` if that block was cached when the request looked up
            (recorded only for ``kvfuzz explain``; empty otherwise).
        lookup: the single-type manager lookups ``get_computed_blocks`` made,
            in call order (empty if not recorded).
        lookup_blocks: per group, the blocks ``get_computed_blocks`` returned,
            in block-table order: ``None`` for vLLM's null block, else what the
            block held (empty when the run did not record blocks).
        unsafe_writes: blocks this request's ``allocate_slots`` steps handed
            out for writing that were not the request's alone.
        step_tables: each attention group's block table after each of this
            request's ``allocate_slots`` steps (:class:`StepTable`; empty
            when the run did not record blocks).
        scheduled_step: (scheduler mode) the scheduler step that admitted
            the request, its lookup being the one judged; ``None`` in
            manager mode.
        lookup_order: (scheduler mode) the request's rank among admissions
            (0 = first admitted), in the order vLLM made the admitting
            lookups (within a step the waiting queue's: arrival under FCFS,
            ``(priority, arrival)`` under the priority policy); ``None`` in
            manager mode, where it is the request index.
        finished_step: (scheduler mode) the scheduler step at whose end the
            request had finished and been freed (its blocks released to the
            prefix cache); ``None`` in manager mode or if it never finished.
        lookup_queue_removals: (scheduler mode) blocks removed from vLLM's
            free block queue (``FreeKVCacheBlockQueue.popleft``,
            ``popleft_n``, ``remove``, in vllm/v1/core/kv_cache_utils.py)
            from the start of the run up to the admitting lookup, in blocks;
            ``None`` when not recorded (manager mode, older files, a run
            whose frees could not all be attributed to a request).
        freed_queue_blocks: (scheduler mode) the free queue's length
            (``BlockPool.get_num_free_blocks``) just before the first
            ``BlockPool.free_blocks`` call made on this request's behalf
            since it was last scheduled from the waiting queue (a
            preemption's free does not count: the blocks it holds when it
            finishes are freed later), in blocks; ``None`` when not recorded
            or never freed.
        freed_queue_removals: (scheduler mode) the removal count (as
            ``lookup_queue_removals``) at that same moment, in blocks.
        resumed: (scheduler mode) the lookups that rescheduled the request
            after each preemption, in order (empty when never preempted, or
            not recorded).
        connector: (scheduler mode with a connector's remote store) what the
            store was asked at the admitting lookup and what vLLM adopted
            (:class:`ConnectorLookup`); ``None`` otherwise.
        replay: (scheduler mode, a model with a bounded-replay group) what the
            worker is told when the request is first scheduled (vLLM's
            ``NewRequestData``, vllm/v1/core/sched/output.py):
            ``(num_computed_tokens, replay_start)``, in tokens; ``None``
            otherwise.
    """

    index: int
    prompt_tokens: int
    hit_tokens: int
    shared_prefix_boundary_tokens: int
    per_group_hit_tokens: tuple[int, ...]
    retained_blocks_per_group: tuple[int, ...]
    cache_map: tuple[str, ...] = ()
    lookup: tuple[GroupLookup, ...] = ()
    lookup_blocks: tuple[tuple[BlockRecord | None, ...], ...] = ()
    unsafe_writes: tuple[BlockWrite, ...] = ()
    scheduled_step: int | None = None
    lookup_order: int | None = None
    finished_step: int | None = None
    lookup_queue_removals: int | None = None
    freed_queue_blocks: int | None = None
    freed_queue_removals: int | None = None
    resumed: tuple[ResumedLookup, ...] = ()
    step_tables: tuple[StepTable, ...] = ()
    connector: ConnectorLookup | None = None
    replay: tuple[int, int] | None = None

    def aborted_by_client(self, abort_steps: Sequence[int | None] | None) -> bool:
        """Whether its client aborted it (``workload.abort_steps``, per
        request) before it finished by itself: it finished at or after its
        abort step.

        An aborted request computed only part of its prompt or answer, so it
        promises nothing to a later lookup, local or through a KV connector's
        store. The synchronous ``Scheduler`` frees it inside
        ``finish_requests``, so it never finishes in a step; under async
        scheduling the output of its step in flight is applied after the
        abort, and the step that applies it records the finish
        (``finished_step``), which alone would count it as a writer of its
        whole prompt."""
        due = None if abort_steps is None else abort_steps[self.index]
        return due is not None and self.finished_step is not None and due <= self.finished_step

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestObservation:
        """Inverse of :meth:`to_dict`."""
        return cls(
            index=data["index"],
            prompt_tokens=data["prompt_tokens"],
            hit_tokens=data["hit_tokens"],
            shared_prefix_boundary_tokens=data["shared_prefix_boundary_tokens"],
            per_group_hit_tokens=tuple(data["per_group_hit_tokens"]),
            retained_blocks_per_group=tuple(data["retained_blocks_per_group"]),
            cache_map=tuple(data.get("cache_map", ())),
            lookup=tuple(GroupLookup.from_dict(c) for c in data.get("lookup", ())),
            lookup_blocks=tuple(
                tuple(BlockRecord.from_list(b) for b in group)
                for group in data.get("lookup_blocks", ())
            ),
            unsafe_writes=tuple(BlockWrite.from_dict(w) for w in data.get("unsafe_writes", ())),
            scheduled_step=data.get("scheduled_step"),
            lookup_order=data.get("lookup_order"),
            finished_step=data.get("finished_step"),
            lookup_queue_removals=data.get("lookup_queue_removals"),
            freed_queue_blocks=data.get("freed_queue_blocks"),
            freed_queue_removals=data.get("freed_queue_removals"),
            resumed=tuple(ResumedLookup.from_dict(u) for u in data.get("resumed", ())),
            step_tables=tuple(StepTable.from_list(t) for t in data.get("step_tables", ())),
            connector=(
                None
                if data.get("connector") is None
                else ConnectorLookup.from_dict(data["connector"])
            ),
            replay=None if data.get("replay") is None else tuple(data["replay"]),
        )

    @property
    def lookup_block_ids(self) -> tuple[tuple[int | None, ...], ...]:
        """Per group, the block ids the lookup returned (``None``: the null block)."""
        return tuple(
            tuple(None if b is None else b.block_id for b in group) for group in self.lookup_blocks
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (block, timeline, free-queue and connector fields
        only when recorded)."""
        out = self._base_dict()
        if self.lookup_blocks:
            out["lookup_blocks"] = [
                [None if b is None else b.to_list() for b in group] for group in self.lookup_blocks
            ]
        if self.unsafe_writes:
            out["unsafe_writes"] = [w.to_dict() for w in self.unsafe_writes]
        if self.scheduled_step is not None:
            out["scheduled_step"] = self.scheduled_step
            out["lookup_order"] = self.lookup_order
            out["finished_step"] = self.finished_step
        if self.lookup_queue_removals is not None:
            out["lookup_queue_removals"] = self.lookup_queue_removals
        if self.freed_queue_blocks is not None:
            out["freed_queue_blocks"] = self.freed_queue_blocks
            out["freed_queue_removals"] = self.freed_queue_removals
        if self.resumed:
            out["resumed"] = [u.to_dict() for u in self.resumed]
        if self.step_tables:
            out["step_tables"] = [t.to_list() for t in self.step_tables]
        if self.connector is not None:
            out["connector"] = self.connector.to_dict()
        if self.replay is not None:
            out["replay"] = list(self.replay)
        return out

    def _base_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "shared_prefix_boundary_tokens": self.shared_prefix_boundary_tokens,
            "per_group_hit_tokens": list(self.per_group_hit_tokens),
            "retained_blocks_per_group": list(self.retained_blocks_per_group),
            "cache_map": list(self.cache_map),
            "lookup": [c.to_dict() for c in self.lookup],
        }


@dataclass(frozen=True)
class PlannedGroup:
    """One KV cache group of a planned ``KVCacheConfig``.

    Attributes:
        spec: the group spec's class name (``FullAttentionSpec``,
            ``SlidingWindowSpec``, ``MambaSpec``, ``UniformTypeKVCacheSpecs``, ...).
        block_size_tokens: the group's block size after page-size
            unification, in tokens.
        layers: the layer names the group holds, in vLLM's order.
        page_size_bytes: each layer's page (padded when vLLM pads it), in
            bytes, in the order of ``layers``.
        extra_retained_tokens: (a sliding-window group) the tokens past the
            window whose blocks the group also keeps
            (``SlidingWindowSpec.extra_retained_tokens``); 0 otherwise.
    """

    spec: str
    block_size_tokens: int
    layers: tuple[str, ...]
    page_size_bytes: tuple[int, ...]
    extra_retained_tokens: int = 0

    def describe(self) -> str:
        """One line: spec, block (tokens), layers, pages (bytes), extra retained tokens."""
        return (
            f"{self.spec} block {self.block_size_tokens} tokens, layers "
            f"{layer_names_text(self.layers)}, pages {sorted(set(self.page_size_bytes))} bytes, "
            f"{self.extra_retained_tokens} extra retained tokens"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "spec": self.spec,
            "block_size_tokens": self.block_size_tokens,
            "layers": list(self.layers),
            "page_size_bytes": list(self.page_size_bytes),
            "extra_retained_tokens": self.extra_retained_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlannedGroup:
        """Inverse of :meth:`to_dict`."""
        return cls(
            data["spec"],
            data["block_size_tokens"],
            tuple(data["layers"]),
            tuple(data["page_size_bytes"]),
            data["extra_retained_tokens"],
        )


@dataclass(frozen=True)
class PlannedTensor:
    """One ``KVCacheTensor`` of a planned ``KVCacheConfig``.

    Attributes:
        size_bytes: the tensor's size, in bytes.
        layers: the layers sharing it.
        offset_bytes: where its first layer starts inside it, in bytes.
        layer_stride_bytes: bytes from one layer's region to the next.
        block_stride_bytes: bytes from one block to the next inside a layer.
    """

    size_bytes: int
    layers: tuple[str, ...]
    offset_bytes: int
    layer_stride_bytes: int
    block_stride_bytes: int

    def describe(self) -> str:
        """One line: size, layers, offset and strides (bytes)."""
        return (
            f"{self.size_bytes} bytes, layers {layer_names_text(self.layers)}, offset "
            f"{self.offset_bytes}, layer stride {self.layer_stride_bytes}, block stride "
            f"{self.block_stride_bytes}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "size_bytes": self.size_bytes,
            "layers": list(self.layers),
            "offset_bytes": self.offset_bytes,
            "layer_stride_bytes": self.layer_stride_bytes,
            "block_stride_bytes": self.block_stride_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlannedTensor:
        """Inverse of :meth:`to_dict`."""
        return cls(
            data["size_bytes"],
            tuple(data["layers"]),
            data["offset_bytes"],
            data["layer_stride_bytes"],
            data["block_stride_bytes"],
        )


@dataclass(frozen=True)
class KVCachePlan:
    """The ``KVCacheConfig`` a variant's vLLM planned for a model-level
    scenario's model, as the engine core plans it at start-up
    (``get_global_kv_cache_groups``, ``resolve_kv_cache_block_sizes``,
    ``get_kv_cache_configs`` in vllm/v1/core/kv_cache_planning.py), for the
    scenario's pool.

    Attributes:
        pool_blocks: the pool asked for (``CacheConfig.num_gpu_blocks_override``),
            in blocks.
        num_blocks: ``KVCacheConfig.num_blocks``, in blocks.
        groups: the KV cache groups, in vLLM's order.
        tensors: the KV cache tensors, in vLLM's order.
        scheduler_block_size_tokens: the scheduler block size, in tokens.
        hash_block_size_tokens: the hash block size, in tokens.
        error: ``"<call>: <ExceptionType>: <message>"`` when a planning call
            raised (the other fields are then empty).
        smallest_pool_blocks: the smallest ``num_gpu_blocks_override`` at
            which ``get_kv_cache_configs`` accepts the model for a
            ``max_model_len`` of the longest request (its start-up check that
            one such request fits, ``_check_enough_kv_cache_memory``), in
            blocks, the null block included; ``None`` when not probed (a
            planning error).
        kv_tp_replicas: ``KVCacheConfig.kv_tp_replicas``, the consecutive
            tensor-parallel ranks holding identical KV for every layer
            (``kv_cache_groups_tp_replicas``); ``None`` on a vLLM without it.
    """

    pool_blocks: int
    num_blocks: int = 0
    groups: tuple[PlannedGroup, ...] = ()
    tensors: tuple[PlannedTensor, ...] = ()
    scheduler_block_size_tokens: int = 0
    hash_block_size_tokens: int = 0
    error: str | None = None
    smallest_pool_blocks: int | None = None
    kv_tp_replicas: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "pool_blocks": self.pool_blocks,
            "num_blocks": self.num_blocks,
            "groups": [g.to_dict() for g in self.groups],
            "tensors": [t.to_dict() for t in self.tensors],
            "scheduler_block_size_tokens": self.scheduler_block_size_tokens,
            "hash_block_size_tokens": self.hash_block_size_tokens,
            "error": self.error,
            "smallest_pool_blocks": self.smallest_pool_blocks,
            "kv_tp_replicas": self.kv_tp_replicas,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCachePlan:
        """Inverse of :meth:`to_dict`."""
        return cls(
            pool_blocks=data["pool_blocks"],
            num_blocks=data["num_blocks"],
            groups=tuple(PlannedGroup.from_dict(g) for g in data["groups"]),
            tensors=tuple(PlannedTensor.from_dict(t) for t in data["tensors"]),
            scheduler_block_size_tokens=data["scheduler_block_size_tokens"],
            hash_block_size_tokens=data["hash_block_size_tokens"],
            error=data["error"],
            smallest_pool_blocks=data.get("smallest_pool_blocks"),
            kv_tp_replicas=data.get("kv_tp_replicas"),
        )

    def difference(self, other: KVCachePlan) -> str | None:
        """The first way ``other`` (another variant's plan of the same model
        for the same pool) departs from this plan, in words, or ``None``
        when the two are equal: a planning error, ``num_blocks`` (blocks),
        the scheduler and hash block sizes (tokens), the first differing
        group (spec, block in tokens, layers, pages in bytes, extra retained
        tokens), the group count, the first differing tensor (bytes, layers,
        offset and strides in bytes), the tensor count, the TP replicas, the
        smallest pool accepted (blocks)."""
        if self == other:
            return None
        if self.error != other.error:
            return f"planning raised {self.error or 'nothing'} vs {other.error or 'nothing'}"
        if self.num_blocks != other.num_blocks:
            return f"num_blocks {self.num_blocks} vs {other.num_blocks}"
        blocks = (self.scheduler_block_size_tokens, self.hash_block_size_tokens)
        others = (other.scheduler_block_size_tokens, other.hash_block_size_tokens)
        if blocks != others:
            return (
                f"scheduler and hash block sizes {blocks[0]} and {blocks[1]} tokens vs "
                f"{others[0]} and {others[1]}"
            )
        for i, (g, h) in enumerate(zip(self.groups, other.groups, strict=False)):
            if g != h:
                return f"group {i}: {g.describe()} vs {h.describe()}"
        if len(self.groups) != len(other.groups):
            return f"{len(self.groups)} group(s) vs {len(other.groups)}"
        for i, (t, u) in enumerate(zip(self.tensors, other.tensors, strict=False)):
            if t != u:
                return f"tensor {i}: {t.describe()} vs {u.describe()}"
        if len(self.tensors) != len(other.tensors):
            return f"{len(self.tensors)} tensor(s) vs {len(other.tensors)}"
        if self.kv_tp_replicas != other.kv_tp_replicas:
            return f"kv_tp_replicas {self.kv_tp_replicas} vs {other.kv_tp_replicas}"
        return (
            f"smallest pool accepted {self.smallest_pool_blocks} vs "
            f"{other.smallest_pool_blocks} blocks"
        )


def layer_names_text(layers: Sequence[str]) -> str:
    """Layer names, all of them up to six, else the first three and a count."""
    if len(layers) <= 6:
        return "[" + ", ".join(layers) + "]"
    return "[" + ", ".join(layers[:3]) + f", ... {len(layers)} in all]"


@dataclass(frozen=True)
class RunObservation:
    """A whole scenario run on one variant.

    Attributes:
        variant: the variant's name.
        vllm_version: ``vllm.__version__`` of the code that ran.
        settings: the manager settings vLLM resolved (``None`` if resolving
            them raised).
        requests: one observation per request that completed, in order.
        evicted_blocks: cached blocks evicted during the run (the pool is sized
            so this is 0; a non-zero value makes the run unjudgeable).
        error: ``"<phase>: <ExceptionType>: <message>"`` if vLLM raised, else
            ``None``; ``requests`` then holds the requests before the failure.
        retention_interval_tokens: the retention interval the run used (the
            scenario's, or ``None`` for the dense cross-check run).
        timed_out: the run exceeded its per-scenario timeout and was stopped
            (tree variants, which run in a worker process).
        unsupported: the variant lacks a feature the scenario needs (named
            here); the run did not happen and is not judged.
        blocks_recorded: the driver recorded the blocks of every lookup and
            unsafe writes (``RequestObservation.lookup_blocks``), so the
            block-level check (:mod:`differential.oracle.blocks`) applies.
        mode: ``"manager"`` or ``"scheduler"`` (the driving mode,
            :class:`differential.scenario.DriveMode`).
        pool_blocks: (scheduler mode) the KV cache pool, in blocks.
        unreachable_cached_blocks: (scheduler mode) cached blocks at the end
            of the run that no lookup of any request's tokens can reach, in
            blocks (a cost: pool space held for nothing).
        cached_blocks: (scheduler mode) cached blocks at the end, in blocks.
        newly_cached_blocks_per_group: (scheduler mode) per group, the blocks
            the run added to the prefix cache over all its steps, in blocks
            (what a retention policy kept, evictions not subtracted).
        preemptions: (scheduler mode) requests the scheduler preempted.
        steps: (scheduler mode) scheduler steps run.
        timeline: (scheduler mode, recorded with the cache map for ``kvfuzz
            explain``) one line per scheduler step: arrivals, what each
            request was scheduled for (tokens, prefill or decode, drafts
            accepted), preemptions, finished requests, evicted blocks.
        store_calls: (scheduler mode, a bounded connector store) the calls
            the connector made to its store's offloading manager, and its
            answers, in order (:class:`StoreCall`).
        watermark_admissions: (scheduler mode, recorded only with a
            ``workload.watermark``) every ``KVCacheManager.allocate_slots``
            call that admitted a waiting or preempted request while other
            requests were scheduled (its ``has_scheduled_reqs``), as
            ``(request index, step, free blocks right after the call)``, the
            free blocks in blocks (``BlockPool.get_num_free_blocks``).
        uncovered_steps: every step (in scheduler mode, every scheduled
            step) after which a request had computed more tokens than an
            attention group's block table holds slots for, as ``(request
            index, step, group, tokens computed, tokens the table holds)``,
            in tokens (Mamba and circular-buffer groups are not attention
            tables); empty when every step's tokens had slots.
        sync_kv_load_steps: (scheduler mode, a KV connector's store) every
            step whose ``SchedulerOutput.has_sync_kv_loads`` is set or whose
            connector metadata loads a request synchronously (into this
            step's forward), as ``(step, has_sync_kv_loads, request indices
            loaded synchronously)``; empty on a vLLM without the flag.
        deferred_frees: (scheduler mode, async scheduling with a KV consumer
            connector) every deferred return of a finished or preempted
            request's blocks to the block pool (``Scheduler._drain_deferred_frees``,
            vllm/v1/core/sched/scheduler.py), as ``(request index, step,
            blocks)``, ``blocks`` the ``(KV cache group, index in that
            group's block table)`` of each block in the order handed to
            ``BlockPool.free_blocks`` (the table without its leading null
            blocks, as ``pop_blocks_for_free`` trims it).
        kv_events: the KV cache event stream and the cache beside it
            (:class:`KVEventLog`), recorded only when the scenario turns
            events on (``workload.kv_events``); ``None`` otherwise.
        kv_cache_plan: (a scenario with a ``model``) the ``KVCacheConfig``
            the variant's vLLM planned for it (:class:`KVCachePlan`);
            ``None`` otherwise.
        metrics: vLLM's prefix-cache statistics, KV cache usage and the
            driver's ``reset_prefix_cache`` calls (:class:`CacheMetrics`;
            ``None``: not recorded, as in engine mode).
        failed_load_requests: (scheduler mode, a KV connector's store) the
            requests whose load kvfuzz's model runner reported failed
            (``workload.connector.failed_loads`` whose load ran), by index;
            ``None``: not recorded (an observation written before they were).
        errored: (scheduler mode, a KV connector's store) every request vLLM
            finished with an error
            (``RequestStatus.FINISHED_ERROR``, finish reason ``error``), as
            ``(request index, step)``: the step after which it was found so;
            such a request has no ``finished_step`` (it did not finish by
            itself); ``None``: not recorded.
        crash_cache_map: (manager mode, recorded with the cache map) when vLLM
            raised, the cache map of the request it raised on, taken at that
            request's lookup (as :attr:`RequestObservation.cache_map`), so
            ``kvfuzz explain`` draws the blocks up to the crash.
    """

    variant: str
    vllm_version: str
    settings: ManagerSettings | None
    requests: tuple[RequestObservation, ...]
    evicted_blocks: int = 0
    error: str | None = None
    retention_interval_tokens: int | None = None
    timed_out: bool = False
    unsupported: str | None = None
    blocks_recorded: bool = False
    mode: str = "manager"
    pool_blocks: int = 0
    unreachable_cached_blocks: int = 0
    cached_blocks: int = 0
    preemptions: int = 0
    steps: int = 0
    timeline: tuple[str, ...] = ()
    crash_cache_map: tuple[str, ...] = ()
    newly_cached_blocks_per_group: tuple[int, ...] = ()
    kv_events: KVEventLog | None = None
    watermark_admissions: tuple[tuple[int, int, int], ...] = ()
    uncovered_steps: tuple[tuple[int, int, int, int, int], ...] = ()
    store_calls: tuple[StoreCall, ...] = ()
    sync_kv_load_steps: tuple[tuple[int, bool, tuple[int, ...]], ...] = ()
    deferred_frees: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...] = ()
    kv_cache_plan: KVCachePlan | None = None
    metrics: CacheMetrics | None = None
    failed_load_requests: tuple[int, ...] | None = None
    errored: tuple[tuple[int, int], ...] | None = None

    @property
    def unreachable_share(self) -> float:
        """Share of the pool holding cached blocks no lookup can reach (0..1)."""
        return self.unreachable_cached_blocks / self.pool_blocks if self.pool_blocks else 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunObservation:
        """Inverse of :meth:`to_dict`."""
        settings = data.get("settings")
        return cls(
            variant=data["variant"],
            vllm_version=data["vllm_version"],
            settings=None if settings is None else ManagerSettings.from_dict(settings),
            requests=tuple(RequestObservation.from_dict(r) for r in data["requests"]),
            evicted_blocks=data.get("evicted_blocks", 0),
            error=data.get("error"),
            retention_interval_tokens=data.get("retention_interval_tokens"),
            timed_out=data.get("timed_out", False),
            unsupported=data.get("unsupported"),
            blocks_recorded=data.get("blocks_recorded", False),
            mode=data.get("mode", "manager"),
            pool_blocks=data.get("pool_blocks", 0),
            unreachable_cached_blocks=data.get("unreachable_cached_blocks", 0),
            cached_blocks=data.get("cached_blocks", 0),
            preemptions=data.get("preemptions", 0),
            steps=data.get("steps", 0),
            timeline=tuple(data.get("timeline", ())),
            crash_cache_map=tuple(data.get("crash_cache_map", ())),
            newly_cached_blocks_per_group=tuple(data.get("newly_cached_blocks_per_group", ())),
            kv_events=None
            if data.get("kv_events") is None
            else KVEventLog.from_dict(data["kv_events"]),
            watermark_admissions=tuple(
                (i, step, free) for i, step, free in data.get("watermark_admissions", ())
            ),
            uncovered_steps=tuple(
                (i, step, g, computed, held)
                for i, step, g, computed, held in data.get("uncovered_steps", ())
            ),
            store_calls=tuple(StoreCall.from_dict(c) for c in data.get("store_calls", ())),
            sync_kv_load_steps=tuple(
                (step, flag, tuple(loaded))
                for step, flag, loaded in data.get("sync_kv_load_steps", ())
            ),
            deferred_frees=tuple(
                (i, step, tuple((g, k) for g, k in blocks))
                for i, step, blocks in data.get("deferred_frees", ())
            ),
            kv_cache_plan=None
            if data.get("kv_cache_plan") is None
            else KVCachePlan.from_dict(data["kv_cache_plan"]),
            metrics=None
            if data.get("metrics") is None
            else CacheMetrics.from_dict(data["metrics"]),
            failed_load_requests=None
            if data.get("failed_load_requests") is None
            else tuple(data["failed_load_requests"]),
            errored=None
            if data.get("errored") is None
            else tuple((i, step) for i, step in data["errored"]),
        )

    @property
    def hits(self) -> tuple[int, ...]:
        """Hit tokens per completed request."""
        return tuple(r.hit_tokens for r in self.requests)

    @property
    def lookup_sequence(self) -> tuple[int, ...] | None:
        """(scheduler mode) the indices of the requests observed, in the
        order vLLM made their admitting lookups
        (:attr:`RequestObservation.lookup_order`); ``None`` when not recorded."""
        if any(r.lookup_order is None for r in self.requests):
            return None
        return tuple(r.index for r in sorted(self.requests, key=lambda r: r.lookup_order or 0))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``blocks_recorded`` only when true)."""
        out = self._base_dict()
        if self.blocks_recorded:
            out["blocks_recorded"] = True
        if self.mode != "manager":
            out["mode"] = self.mode
            out["pool_blocks"] = self.pool_blocks
            out["unreachable_cached_blocks"] = self.unreachable_cached_blocks
            out["cached_blocks"] = self.cached_blocks
            out["preemptions"] = self.preemptions
            out["steps"] = self.steps
        if self.timeline:
            out["timeline"] = list(self.timeline)
        if self.crash_cache_map:
            out["crash_cache_map"] = list(self.crash_cache_map)
        if self.newly_cached_blocks_per_group:
            out["newly_cached_blocks_per_group"] = list(self.newly_cached_blocks_per_group)
        if self.kv_events is not None:
            out["kv_events"] = self.kv_events.to_dict()
        if self.watermark_admissions:
            out["watermark_admissions"] = [list(a) for a in self.watermark_admissions]
        if self.uncovered_steps:
            out["uncovered_steps"] = [list(u) for u in self.uncovered_steps]
        if self.store_calls:
            out["store_calls"] = [c.to_dict() for c in self.store_calls]
        if self.sync_kv_load_steps:
            out["sync_kv_load_steps"] = [
                [step, flag, list(loaded)] for step, flag, loaded in self.sync_kv_load_steps
            ]
        if self.deferred_frees:
            out["deferred_frees"] = [
                [i, step, [list(b) for b in blocks]] for i, step, blocks in self.deferred_frees
            ]
        if self.kv_cache_plan is not None:
            out["kv_cache_plan"] = self.kv_cache_plan.to_dict()
        if self.metrics is not None:
            out["metrics"] = self.metrics.to_dict()
        if self.failed_load_requests is not None:
            out["failed_load_requests"] = list(self.failed_load_requests)
        if self.errored is not None:
            out["errored"] = [list(e) for e in self.errored]
        return out

    def _base_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "vllm_version": self.vllm_version,
            "settings": None if self.settings is None else self.settings.to_dict(),
            "retention_interval_tokens": self.retention_interval_tokens,
            "evicted_blocks": self.evicted_blocks,
            "error": self.error,
            "timed_out": self.timed_out,
            "unsupported": self.unsupported,
            "requests": [r.to_dict() for r in self.requests],
        }

"""Record vLLM's KV cache event stream and the prefix cache beside it.

Used only when a scenario turns events on (``workload.kv_events``): the
manager is built with ``enable_kv_cache_events=True`` (manager mode) or the
scheduler with vLLM's ``KVEventsConfig(enable_kv_cache_events=True)``
(scheduler mode), and every drain of the event queue is recorded as a
:class:`~differential.observation.KVEventStep`: the events
(vllm/distributed/kv_events.py ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) as plain values, the ``get_computed_blocks`` calls made
since the last drain (the events each emitted are marked), and the prefix
cache's entries that changed (``BlockPool.cached_block_hash_to_block``,
vllm/v1/core/block_pool.py). The oracle judges the stream against the cache
(:mod:`differential.oracle.kv_events`).

Block hashes are recorded as labels (numbered in order of first appearance:
deterministic for a deterministic run). The cache's and the requests' hashes
are put in the events' wire form by kvfuzz itself (:func:`wire_block_hash`),
not by vLLM's ``maybe_convert_block_hash``, so an event whose hash is in
another form names no prefix; the log names the token prefix each label's
hash stands for, read off vLLM's own ``Request.block_hashes`` at the end of
the run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import vllm.envs
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

from differential.driver.prefix_cache import cached_blocks, changed_counts
from differential.observation import (
    KVEvent,
    KVEventLog,
    KVEventLookup,
    KVEventStep,
    event_extra_keys,
    runs_of,
)

__all__ = ["EventRecorder", "wire_block_hash"]


def wire_block_hash(block_hash: bytes) -> int | bytes:
    """A block hash as vLLM's KV cache events carry it (``ExternalBlockHash``,
    vllm/distributed/kv_events.py): the low 64 bits of its bytes read
    big-endian, an int, unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is 0,
    then the bytes themselves. vLLM PR #23673 moved block hashes to raw
    bytes and kept the events' int hashes for their consumers (routers and
    KV indexes that compute the same value from the same block: the wire
    form is a contract, which ``maybe_convert_block_hash`` in
    vllm/v1/core/kv_cache_utils.py implements). Only the flag is read from
    vLLM (``vllm.envs``, default 1)."""
    if not vllm.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return bytes(block_hash)
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)


class EventRecorder:
    """Records a run's KV cache events, drain by drain (see the module docstring).

    Args:
        manager: vLLM's ``KVCacheManager`` the run drives (events on).
        report_mode: the requests' ``kv_cache_report_mode``.
        hash_block_size: the block pool's hash block size, in tokens.
    """

    def __init__(self, manager: Any, report_mode: str, hash_block_size: int) -> None:
        self.manager = manager
        self.report_mode = report_mode
        self.hash_block_size = hash_block_size
        self.labels: dict[Any, int] = {}
        # vLLM's cache key (hash with group id) -> (group, label): converting a
        # hash for events reads an environment variable each time, and every
        # drain reads the whole cache.
        self._keys: dict[Any, tuple[int, int]] = {}
        self.steps: list[KVEventStep] = []
        # The cache at the last snapshot: blocks per cache key, and per
        # (group, label) (positive counts only).
        self._blocks: Mapping[Any, int] = {}
        self.pool: dict[tuple[int, int], int] = {}
        # Since the last drain: the lookups made and, per lookup, the span of
        # the event queue its call appended.
        self.lookups: list[KVEventLookup] = []
        self.spans: list[tuple[int, int]] = []
        # Events published by the scheduler's own drain (scheduler mode).
        self.published: list[Any] = []
        self.snapshot()

    def label(self, block_hash: Any) -> int:
        """The label of an event-form block hash (a new one if unseen)."""
        return self.labels.setdefault(block_hash, len(self.labels))

    def queue_length(self) -> int:
        """How many events vLLM's queue holds now (``BlockPool.kv_event_queue``)."""
        return len(self.manager.block_pool.kv_event_queue)

    def lookup(self, request_index: int, hit_tokens: int, blocks: Any, queue_start: int) -> None:
        """Record a ``get_computed_blocks`` call that returned ``blocks`` (a
        ``KVCacheBlocks``) and ``hit_tokens``; the events it emitted are the
        queue's entries from ``queue_start`` (its length before the call) on."""
        self.lookups.append(
            KVEventLookup(
                request=request_index,
                hit_tokens=hit_tokens,
                blocks_per_group=tuple(len(g) for g in blocks.blocks),
            )
        )
        self.spans.append((queue_start, self.queue_length()))

    def publish(self, batch: Any) -> None:
        """Stands in for the scheduler's ``kv_event_publisher.publish``: keeps
        the batch's events for the next :meth:`drain`."""
        self.published.extend(batch.events)

    def take(self) -> list[Any]:
        """Drain vLLM's queue through ``KVCacheManager.take_events`` (manager
        mode: the driver plays the scheduler's part)."""
        return list(self.manager.take_events())

    def drain(self, step: int, events: Sequence[Any] | None = None) -> None:
        """Record one drain: ``events`` (default: what the scheduler published
        since the last drain), the lookups since then and the cache's changes."""
        if events is None:
            events, self.published = self.published, []
        owner: dict[int, int] = {}
        for index, (start, end) in enumerate(self.spans):
            for position in range(start, end):
                owner[position] = index
        recorded = tuple(self._event(e, owner.get(k)) for k, e in enumerate(events))
        changed = self.snapshot()
        if recorded or changed or self.lookups:
            self.steps.append(
                KVEventStep(step=step, events=recorded, lookups=tuple(self.lookups), pool=changed)
            )
        self.lookups, self.spans = [], []

    def drain_after_run(self) -> None:
        """Record what vLLM's queue holds after the run (the final
        ``reset_prefix_cache``'s ``AllBlocksCleared``) as one drain past the
        last recorded one, numbered alike in both modes."""
        step = self.steps[-1].step + 1 if self.steps else 0
        self.drain(step, self.take())

    def snapshot(self) -> tuple[tuple[int, int, int], ...]:
        """The cache's entries whose block count changed since the last
        snapshot, as ``(group, label, blocks)``, in sorted order."""
        blocks = cached_blocks(self.manager)
        moved = changed_counts(self._blocks, blocks)
        self._blocks = blocks
        if not moved:
            return ()
        keys = self._keys
        fresh = [key for key, _, _ in moved if key not in keys]
        if fresh:
            converted = {key: wire_block_hash(get_block_hash(key)) for key in fresh}
            unlabelled = {key for key, hashed in converted.items() if hashed not in self.labels}
            if len(unlabelled) > 1:
                # New labels are numbered in the cache's order, as a full scan
                # would meet them (the set above has no stable order).
                fresh = [key for key in blocks if key in unlabelled] + [
                    key for key in fresh if key not in unlabelled
                ]
            for key in fresh:
                keys[key] = (get_group_id(key), self.label(converted[key]))
        pool = self.pool
        prior: dict[tuple[int, int], int] = {}
        for key, was, now in moved:
            entry = keys[key]
            count = pool.get(entry, 0)
            prior.setdefault(entry, count)
            count += now - was
            if count:
                pool[entry] = count
            else:
                pool.pop(entry, None)
        # An entry whose keys' changes cancel out has not changed.
        return tuple(
            sorted(
                (group, label, pool.get((group, label), 0))
                for (group, label), count in prior.items()
                if pool.get((group, label), 0) != count
            )
        )

    def _event(self, event: Any, lookup: int | None) -> KVEvent:
        name = type(event).__name__
        if name == "BlockStored":
            parent = event.parent_block_hash
            return KVEvent(
                kind="stored",
                group=event.group_idx,
                hashes=tuple(self.label(h) for h in event.block_hashes),
                parent=None if parent is None else self.label(parent),
                block_size=event.block_size,
                tokens=runs_of(event.token_ids),
                spec_kind=getattr(event, "kv_cache_spec_kind", None),
                sliding_window=getattr(event, "kv_cache_spec_sliding_window", None),
                lookup=lookup,
                lookahead=None
                if (ahead := getattr(event, "lookahead_token_ids", None)) is None
                else tuple(tuple(ids) for ids in ahead),
                extra_keys=event_extra_keys(getattr(event, "extra_keys", None)),
            )
        if name == "BlockRemoved":
            return KVEvent(
                kind="removed",
                group=event.group_idx,
                hashes=tuple(self.label(h) for h in event.block_hashes),
                lookup=lookup,
            )
        return KVEvent(kind="cleared", lookup=lookup)

    def log(self, requests: Sequence[Any]) -> KVEventLog:
        """The run's log; ``requests`` are vLLM's ``Request`` objects of the
        run, in scenario order (their block hashes name the labels' prefixes)."""
        prefixes: dict[int, tuple[int, int]] = {}
        seen: set[Any] = set()  # requests share prefixes: convert each hash once
        for index, request in enumerate(requests):
            for k, block_hash in enumerate(request.block_hashes):
                if block_hash in seen:
                    continue
                seen.add(block_hash)
                label = self.labels.get(wire_block_hash(block_hash))
                if label is not None and label not in prefixes:
                    prefixes[label] = (index, (k + 1) * self.hash_block_size)
        return KVEventLog(
            report_mode=self.report_mode,
            steps=tuple(self.steps),
            prefixes=prefixes,
            extra_keys=True,
        )

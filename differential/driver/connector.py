"""Scheduler-side KV connectors for scheduler mode: an empty one and a remote store.

vLLM's bundled ``ExampleConnector`` does not support the hybrid allocator
(``SupportsHMA``), so ``Scheduler.__init__`` refuses it for a model with
several KV cache groups. Both connectors here are loaded by vLLM's own
``KVConnectorFactory`` through ``KVTransferConfig.kv_connector_module_path``
(vllm/distributed/kv_transfer/kv_connector/factory.py), the extension point
for external connectors.

* :class:`EmptyRemoteConnector` (``kv_connector: true`` without a store): its
  remote store is always empty. It never reports external tokens
  (``get_num_new_matched_tokens`` -> 0), never loads or saves, and never
  delays a free. What a configured connector changes in the KV cache manager
  (legacy block hashes, ``VllmConfig.num_hash_lookahead_tokens`` = 0)
  therefore happens through vLLM's own code, with no transfer to model.
* :class:`RemoteStoreConnector` (``workload.connector``): a CPU-offload tier
  (the role LMCache or vLLM's offloading connector plays) whose store keeps
  what requests computed and answers lookups with what it holds beyond the
  local hit; by default unbounded, or bounded and on its own chunk grid.
  No KV moves: the store records *which* prefixes it holds, one key per
  chunk and group named by vLLM's own chained block hashes
  (``Request.block_hashes``), in vLLM's own ``CPUOffloadingManager`` with
  its LRU policy, and kvfuzz's stand-in model runner reports the loads
  finished (vllm/v1/outputs.py ``KVConnectorOutput``).
  :class:`SingleGroupStoreConnector` (``workload.connector.supports_hma``
  false) is the same store without the hybrid allocator, for one-group
  layouts: vLLM finishes its requests by the legacy path.

Only the scheduler role is served; the worker-side methods are never called
(no model runs) and raise if they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from differential.observation import LoadTargets, StoreCall

__all__ = [
    "EmptyRemoteConnector",
    "RemoteStoreConnector",
    "SingleGroupStoreConnector",
    "StoreLoad",
    "StoreQuery",
]


# vLLM is not type-checked (pyproject.toml), so its base classes are Any here.
class _SchedulerSideConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """A KV connector whose remote store holds nothing (scheduler side only),
    without the hybrid allocator's finish (``SupportsHMA``)."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """No external tokens, synchronously (tokens: always 0)."""
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Nothing to load."""

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Empty metadata (nothing to transfer)."""
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        """Free at once, nothing sent."""
        return False, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Worker side: never called (no model runs)."""
        raise NotImplementedError("EmptyRemoteConnector serves the scheduler role only")

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker side: never called."""
        raise NotImplementedError("EmptyRemoteConnector serves the scheduler role only")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        """Worker side: never called."""
        raise NotImplementedError("EmptyRemoteConnector serves the scheduler role only")

    def wait_for_save(self) -> None:
        """Worker side: never called."""
        raise NotImplementedError("EmptyRemoteConnector serves the scheduler role only")


class EmptyRemoteConnector(_SchedulerSideConnector, SupportsHMA):  # type: ignore[misc]
    """A KV connector whose remote store holds nothing (scheduler side only)."""

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        """Free at once, nothing sent (hybrid allocator form)."""
        return False, None


@dataclass(frozen=True)
class StoreQuery:
    """One ``get_num_new_matched_tokens`` call and the store's answer.

    Attributes:
        presented_tokens: the local hit the scheduler showed the connector
            (``num_computed_tokens``: the block-aligned local hit,
            vllm/v1/core/sched/scheduler.py), in tokens.
        matched_tokens: the tokens the connector reported beyond it, in tokens.
        store_tokens: the longest prefix of the request the store held at
            the call (a multiple of the lookup unit, at most ``num_tokens - 1``),
            in tokens; 0 when it held none.
        load_async: whether the connector asked for an asynchronous load.
    """

    presented_tokens: int
    matched_tokens: int
    store_tokens: int
    load_async: bool


@dataclass(frozen=True)
class StoreLoad:
    """A load the scheduler allocated blocks for (``update_state_after_alloc``).

    Attributes:
        request_id: vLLM's request id.
        start_tokens, end_tokens: the loaded tokens ``[start, end)``.
        load_async: loaded between steps (the request waits in
            ``WAITING_FOR_REMOTE_KVS``) rather than in the forward pass.
    """

    request_id: str
    start_tokens: int
    end_tokens: int
    load_async: bool


@dataclass
class StoreMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler side hands the worker this step: the loads started."""

    loads: tuple[StoreLoad, ...] = ()


_UNBOUNDED_CHUNKS = 1 << 62
"""The chunks of an unbounded store: vLLM's ``CPUOffloadingManager`` hands out
chunk ids lazily (``_allocate_chunks``), so this reserves nothing and nothing
is ever evicted."""


@dataclass(frozen=True)
class _Group:
    """One KV cache group as the store keys it.

    Attributes:
        gid: the KV cache group index.
        kind: ``"attention"`` (full-attention family: every chunk before a
            hit), ``"window"`` (sliding window: the chunks of its tail) or
            ``"state"`` (Mamba: the state at the hit).
        chunk_tokens: one key per this many tokens.
        spec: vLLM's ``KVCacheSpec`` of the group.
    """

    gid: int
    kind: str
    chunk_tokens: int
    spec: Any


def _store_groups(kv_cache_config: Any, chunk_tokens: int | None, hash_block: int) -> list[_Group]:
    """The groups the store keeps, each with its chunk, in tokens: the
    store's own grid (``chunk_tokens``), else a key per hash block (a Mamba
    state at any hash boundary) and per block of a sliding-window group
    (vLLM's default ``blocks_per_chunk`` 1). Groups whose KV is not
    prefix-cacheable are not kept (vLLM's ``get_offloading_group_ids``)."""
    groups: list[_Group] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not spec.prefix_cacheable:
            continue
        if isinstance(spec, MambaSpec):
            kind, own = "state", hash_block
        elif isinstance(spec, SlidingWindowSpec):
            kind, own = "window", spec.block_size
        else:
            kind, own = "attention", hash_block
        groups.append(_Group(gid, kind, chunk_tokens or own, spec))
    return groups


class _StoreConnector(_SchedulerSideConnector):
    """A CPU-offload tier: a remote store that keeps what requests computed.

    **Keys.** As vLLM's ``OffloadingConnector`` keys its store
    (vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py
    ``RequestOffloadState.update_offload_keys``): one ``OffloadKey`` per
    chunk and KV cache group, the request's chained block hash at the chunk's
    end and the group index (``make_offload_key``, vllm/v1/kv_offload/base.py).
    A chunk is ``chunk_tokens`` tokens of every group (the offloaded
    ``block_size``), or by default a hash block (a sliding-window group: its
    block).

    **What is kept.** The store is vLLM's own ``CPUOffloadingManager`` with
    the ``"lru"`` cache policy (vllm/v1/kv_offload/cpu/manager.py,
    vllm/v1/kv_offload/cpu/policies/lru.py), ``capacity_chunks`` chunks
    (unbounded by default), driven as the offloading connector's scheduler
    side drives it:

    * **store** (``prepare_store``, in ``build_connector_meta``, as
      ``_build_store_jobs``): for every request scheduled, the chunks its
      earlier steps completed: every chunk of a full-attention-family group;
      of a sliding-window group the chunks with a block vLLM's own
      ``SlidingWindowManager.reachable_block_mask``
      (vllm/v1/core/single_type_kv_cache_manager.py) says a lookup can
      reach; a Mamba state where vLLM hands it off on the grid (the boundary
      states of ``SchedulerOutput.kv_connector_block_state``, a producer's
      finished partial tail from ``register_finished_partial_tail``); a
      finished request's last chunks at ``request_finished_all_groups``.
      Each lookup restarts the offers at chunk 0 (``next_stored_chunk_idx =
      0``), a load past the loaded chunks. A new key takes a free chunk or
      evicts the least recently used evictable one; the offer's own keys
      are protected, and a store that cannot make room stores nothing (the
      manager returns ``None``; the same chunks are offered again next step);
    * **load** (``prepare_load``, in ``update_state_after_alloc``): the
      chunks the scheduler adopted are pinned (not evictable) until the
      step's transfers are reported, at the end of the step's
      ``build_connector_meta`` (kvfuzz's model runner finishes every
      transfer within the step); stores made in ``build_connector_meta`` are
      write-pending (not evictable, not readable) until then too; a finished
      request's are copied at once;
    * **recency**: a lookup touches nothing (``CPUOffloadingManager.lookup``);
      a stored or loaded chunk takes the request's rank, tails before heads
      (``LRUCachePolicy.insert``, ``on_request_access``), and
      ``on_request_finished`` (called when the request finishes) makes every
      chunk it stored or reused most recent, its head the most recent of all.

    **Answers.** The store holds a prefix of ``n`` tokens (``n`` on the
    lookup grid: the chunk, or by default the scheduler's hit alignment)
    when every full-attention group holds all chunks of ``[0, n)``, every
    sliding-window group the chunks holding the blocks a hit at ``n`` reads
    (``_contiguous_blocks_for_hit``), and every Mamba group a state at
    ``n``. ``get_num_new_matched_tokens`` answers the longest such ``n`` up
    to ``num_tokens - 1`` (one token is always left to compute, as vLLM's
    ``ExampleConnector`` does) past the local hit it is shown, or nothing
    when that is less than a grid unit (``_lookup_complete_chunks``: "We can
    only load less than a chunk, so skip."), loaded synchronously or
    asynchronously (``kv_connector_extra_config["load"]``).

    **Roles** (``KVTransferConfig.kv_role``, vllm/config/kv_transfer.py):
    ``kv_both`` saves and loads. In disaggregated prefill and decode the
    prefill instance's connector (``kv_producer``) loads nothing and saves
    (NIXL's scheduler side answers a lookup only for a request whose
    ``kv_transfer_params`` say ``do_remote_prefill``,
    vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py
    ``get_num_new_matched_tokens``; the prefill instance's requests say
    ``do_remote_decode``), and at a request's end returns the
    ``kv_transfer_params`` the decode instance gets (``do_remote_prefill``
    true, ``do_remote_decode`` false, as nixl/push_scheduler.py's
    ``request_finished``); the decode instance's (``kv_consumer``) loads and
    saves nothing, as LMCache's connector forces ``skip_save`` for a
    ``kv_consumer`` (``build_connector_meta`` in
    vllm/distributed/kv_transfer/kv_connector/v1/lmcache_integration/vllm_v1_adapter.py).
    Both share one ``CPUOffloadingManager`` (:meth:`share_store`).

    Extra config (``KVTransferConfig.kv_connector_extra_config``): ``load``
    (``"sync"`` / ``"async"``), ``divergent_hybrid_hits`` (bool),
    ``lookup_unit_tokens`` (the hit alignment) and ``hash_block_tokens``
    (the block pool's hash block size), in tokens; ``chunk_tokens`` (the
    store's grid, tokens) and ``capacity_chunks`` (chunks), each ``None`` by
    default. With a capacity every manager call and answer is recorded
    (:attr:`calls`), where the importable vLLM's ``LRUCachePolicy`` ranks
    chunks per request (vLLM 0.33; 0.31 and 0.32 rank them by insertion).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.load_async: bool = extra.get("load") == "async"
        self._divergent = bool(extra.get("divergent_hybrid_hits", False))
        self.hash_block_tokens: int = int(extra["hash_block_tokens"])
        chunk = extra.get("chunk_tokens")
        #: The lookup grid, in tokens: the store's chunk, else the hit alignment.
        self.unit_tokens: int = int(chunk or extra["lookup_unit_tokens"])
        role = self._kv_transfer_config.kv_role
        #: Loads from the store (every role but ``kv_producer``).
        self.loads: bool = role != "kv_producer"
        #: Saves to the store (every role but ``kv_consumer``).
        self.saves: bool = role != "kv_consumer"
        capacity = extra.get("capacity_chunks")
        self.bounded = capacity is not None
        # The oracle's replay states the request-ranked policy of vLLM 0.33's
        # LRUCachePolicy (_get_request_rank); an older release ranks chunks by
        # insertion alone, so its calls are not recorded for it.
        self._recorded = self.bounded and hasattr(LRUCachePolicy, "_get_request_rank")
        self.store = CPUOffloadingManager(
            num_chunks=int(capacity) if capacity is not None else _UNBOUNDED_CHUNKS,
            cache_policy="lru",
        )
        self._groups = _store_groups(
            kv_cache_config, None if chunk is None else int(chunk), self.hash_block_tokens
        )
        self._requests: dict[str, Any] = {}
        #: Every request the connector was shown, finished ones too.
        self._seen: dict[str, Any] = {}
        self._contexts: dict[str, ReqContext] = {}
        self._offered: dict[str, dict[int, int]] = {}  # request id -> group -> chunks offered
        self._allocated: list[StoreLoad] = []
        # Transfers reported at the end of the step: (op, context, keys).
        self._in_flight: list[tuple[str, ReqContext, list[OffloadKey]]] = []
        self._key_ids: dict[OffloadKey, int] = {}
        #: Per request id, every ``get_num_new_matched_tokens`` answer, in order.
        self.queries: dict[str, list[StoreQuery]] = {}
        #: (bounded stores) every manager call and answer, with its request id.
        self.calls: list[tuple[str, StoreCall]] = []
        #: Per request id, the blocks its last load would fill, per KV cache
        #: group: ``(block id, null, cached)`` (:meth:`_load_targets`).
        self.load_targets: dict[str, LoadTargets] = {}

    def reset_cache(self) -> bool:
        """The connector's part of ``reset_prefix_cache(reset_connector=True)``
        (vLLM PR #27170: "both the local (GPU) and external (connector)
        prefix caches are reset"), as vLLM's ``OffloadingConnector`` does it
        (offloading_connector.py ``reset_cache``: its scheduler resets the
        offloading manager, ``CPUOffloadingManager.reset_cache`` dropping
        every stored chunk); returns true, as that connector does."""
        self.store.reset_cache()
        return True

    def held_tokens(self) -> int:
        """What the store holds of every request it has seen, finished ones
        too: their longest held prefixes (:meth:`store_tokens`) summed, in
        tokens."""
        return sum(self.store_tokens(r) for r in self._seen.values())

    def share_store(self, other: _StoreConnector) -> None:
        """Use ``other``'s store (the decode instance's): a prefill instance's
        connector saves where the decode instance's loads (one store, two
        schedulers; keys name the same chained block hashes)."""
        self.store = other.store
        self._key_ids = other._key_ids

    # ------------------------------------------------------------- properties

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """As configured (``divergent_hybrid_hits``)."""
        return self._divergent

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is a future miss (vLLM's base
        class documents ``False`` for such caches)."""
        return False

    # ------------------------------------------------------------------ keys

    def _context(self, request: Any) -> ReqContext:
        """The request's ``ReqContext`` (vLLM's ``_create_req_context``),
        announced to the manager the first time (``on_new_request``)."""
        rid = request.request_id
        self._requests.setdefault(rid, request)
        self._seen.setdefault(rid, request)
        context = self._contexts.get(rid)
        if context is None:
            context = self._contexts[rid] = ReqContext(req_id=rid)
            self.store.on_new_request(context)
        return context

    def _key(self, request: Any, group: _Group, end_tokens: int) -> OffloadKey:
        """The key of ``group``'s chunk ending at ``end_tokens`` (a multiple
        of the hash block), its position recorded in the request's context."""
        key = make_offload_key(
            request.block_hashes[end_tokens // self.hash_block_tokens - 1], group.gid
        )
        self._context(request).set_offload_key_position(key, end_tokens)
        return key

    def _prefix_keys(self, request: Any, start: int, end: int) -> list[OffloadKey]:
        """The full-attention-family keys of the chunks ending in ``(start,
        end]`` (tokens)."""
        return [
            self._key(request, g, e)
            for g in self._groups
            if g.kind == "attention"
            for e in range(start - start % g.chunk_tokens + g.chunk_tokens, end + 1, g.chunk_tokens)
        ]

    def _point_keys(self, request: Any, tokens: int, after: int = 0) -> list[OffloadKey]:
        """The other keys a hit of ``tokens`` needs: each sliding-window
        group's chunks holding the blocks it reads (``_contiguous_blocks_for_hit``),
        each Mamba group's state; chunks ending at or before ``after`` left out."""
        keys: list[OffloadKey] = []
        for g in self._groups:
            if g.kind == "state":
                keys.append(self._key(request, g, tokens))
            elif g.kind == "window":
                block = g.spec.block_size
                need = SlidingWindowManager._contiguous_blocks_for_hit(
                    g.spec.sliding_window, block, use_eagle=False
                )
                end, chunk = tokens // block, g.chunk_tokens
                ends = sorted(
                    {k * block // chunk * chunk + chunk for k in range(max(0, end - need), end)}
                )
                keys += [self._key(request, g, e) for e in ends if e > after]
        return keys

    def _holds(self, request: Any, keys: list[OffloadKey]) -> bool:
        """Whether the store holds every key (``lookup``: touches nothing)."""
        context = self._context(request)
        return all(self.store.lookup(k, context) is not LookupResult.MISS for k in keys)

    # --------------------------------------------------------------- lookups

    def _limit(self, request: Any) -> int:
        """The longest prefix a lookup may answer, in tokens: on the grid,
        within ``num_tokens - 1`` and the request's hashed tokens."""
        unit = self.unit_tokens
        hashed = len(request.block_hashes) * self.hash_block_tokens
        return int(min(request.num_tokens - 1, hashed)) // unit * unit

    def store_tokens(self, request: Any) -> int:
        """The longest prefix of ``request`` the store holds, in tokens (see
        the class docstring): a multiple of the lookup grid, at most
        ``num_tokens - 1``; 0 when none."""
        unit = self.unit_tokens
        held = 0
        for n in range(unit, self._limit(request) + 1, unit):
            # Full attention reads every token before the hit: all of it or nothing past.
            if not self._holds(request, self._prefix_keys(request, n - unit, n)):
                break
            if self._holds(request, self._point_keys(request, n)):
                held = n
        return held

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The tokens the store holds beyond the ``num_computed_tokens`` local
        hit it is shown, in tokens (none when less than a grid unit), and
        whether they load asynchronously."""
        self._context(request)
        # vLLM offers every chunk again after a lookup (next_stored_chunk_idx = 0).
        self._offered[request.request_id] = {}
        if not self.loads:
            return 0, False  # a prefill instance (kv_producer) loads nothing
        held = self.store_tokens(request)
        matched = held - num_computed_tokens
        if matched < self.unit_tokens:
            matched = 0  # "We can only load less than a chunk, so skip."
        load_async = self.load_async and matched > 0
        self.queries.setdefault(request.request_id, []).append(
            StoreQuery(num_computed_tokens, matched, held, load_async)
        )
        if self._recorded:
            self._log_lookup(request, num_computed_tokens, held, matched)
        return matched, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the ``num_external_tokens`` the scheduler adopted,
        right after the local hit the connector was shown, pinning its chunks
        (``prepare_load``)."""
        if num_external_tokens <= 0:
            return
        self._load_targets(request, blocks)
        query = self.queries[request.request_id][-1]
        start = query.presented_tokens
        end = start + num_external_tokens
        self._allocated.append(StoreLoad(request.request_id, start, end, query.load_async))
        keys = self._prefix_keys(request, start, end) + self._point_keys(
            request, end, after=start - start % self.unit_tokens
        )
        keys = [k for k in keys if self._holds(request, [k])]
        context = self._context(request)
        self.store.prepare_load(keys, context)
        self._in_flight.append(("loaded", context, keys))
        self._log(request.request_id, "load", keys)
        # The loaded chunks are not offered again (next_stored_chunk_idx = num_chunks).
        self._offered[request.request_id] = {g.gid: -(-end // g.chunk_tokens) for g in self._groups}

    # ------------------------------------------------------------------ saves

    def on_new_request(self, request: Any) -> None:
        """Track the request (its block hashes name what the store keeps)."""
        self._context(request)

    def _chunk_keys(self, request: Any, group: _Group, start: int, end: int) -> list[OffloadKey]:
        """The keys of ``group``'s chunks ``start .. end - 1`` worth storing:
        all of them, or, for a sliding-window group, those with a block a
        lookup can reach (``reachable_block_mask``, as ``_build_store_jobs``)."""
        chunk = group.chunk_tokens
        if group.kind != "window":
            return [self._key(request, group, (k + 1) * chunk) for k in range(start, end)]
        block = group.spec.block_size
        per = chunk // block
        mask = SlidingWindowManager.reachable_block_mask(
            start_block=start * per,
            end_block=end * per,
            alignment_tokens=self.unit_tokens,
            kv_cache_spec=group.spec,
            use_eagle=False,
            retention_interval=None,
            final_segment_end_block=request.num_prompt_tokens // block,
        )
        return [
            self._key(request, group, (k + 1) * chunk)
            for k in range(start, end)
            if mask is None or any(mask[(k - start) * per : (k - start + 1) * per])
        ]

    def _save(self, request: Any, computed_tokens: int, at_once: bool) -> None:
        """Store the chunks of the request's first ``computed_tokens`` tokens
        not offered yet (Mamba states come by hand-off); nothing for a
        decode instance (``kv_consumer``)."""
        if not self.saves:
            return
        offered = self._offered.setdefault(request.request_id, {})
        full = min(computed_tokens, len(request.block_hashes) * self.hash_block_tokens)
        keys: list[OffloadKey] = []
        ends: dict[int, int] = {}
        for g in self._groups:
            start, end = offered.get(g.gid, 0), full // g.chunk_tokens
            if g.kind == "state" or end <= start:
                continue
            ends[g.gid] = end
            keys += self._chunk_keys(request, g, start, end)
        if not keys or self._store(request, keys, at_once):
            offered.update(ends)

    def _store(self, request: Any, keys: list[OffloadKey], at_once: bool) -> bool:
        """``prepare_store`` the keys (completed at once, or when the step's
        transfers are reported); false when the manager could not make room."""
        context = self._context(request)
        if not self.saves:
            return True  # a decode instance (kv_consumer) saves nothing
        out = self.store.prepare_store(keys, context)
        self._log(
            request.request_id,
            "store",
            keys,
            evicted=() if out is None else tuple(self._id(k) for k in out.evicted_keys),
            refused=out is None,
        )
        if out is None:
            return False
        if out.keys_to_store:
            if at_once:
                self.store.complete_store(out.keys_to_store, context)
                self._log(request.request_id, "stored", out.keys_to_store)
            else:
                self._in_flight.append(("stored", context, list(out.keys_to_store)))
        return True

    def _state_keys(self, request_id: str, group_id: int, boundary_tokens: int) -> list[OffloadKey]:
        """The key of a Mamba state of group ``group_id`` at ``boundary_tokens``
        handed off, when on the grid (none otherwise)."""
        request = self._requests.get(request_id)
        group = next((g for g in self._groups if g.gid == group_id and g.kind == "state"), None)
        if (
            request is None
            or group is None
            or boundary_tokens <= 0
            or boundary_tokens % group.chunk_tokens
            or boundary_tokens > len(request.block_hashes) * self.hash_block_tokens
        ):
            return []
        return [self._key(request, group, boundary_tokens)]

    def _load_targets(self, request: Any, blocks: Any) -> None:
        """Record the blocks a pulling connector loads the store's tokens
        into: ``KVCacheBlocks.get_unhashed_block_ids_all_groups`` (vLLM's
        NIXL and Mooncake connectors pass it to their transfers:
        "Get unhashed blocks to pull from remote",
        vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py),
        each id with whether it names the null block or a cached block."""
        targets = getattr(blocks, "get_unhashed_block_ids_all_groups", None)
        if targets is None:
            return
        by_id = {b.block_id: b for group in blocks.blocks for b in group}
        self.load_targets[request.request_id] = tuple(
            tuple((i, bool(by_id[i].is_null), by_id[i].block_hash is not None) for i in group)
            for group in targets()
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Store the boundary states handed off this step and what the
        scheduled requests' earlier steps computed; report the step's
        transfers; hand the loads allocated this step to the worker
        (kvfuzz's model runner)."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is not None:
            for request_id, offloads in block_state.boundary_state_offloads.items():
                keys = [
                    k
                    for group_id, _block_id, boundary in offloads
                    for k in self._state_keys(request_id, group_id, boundary)
                ]
                if keys:
                    self._store(self._requests[request_id], keys, at_once=False)
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self._requests.get(request_id)
            if request is not None:
                self._save(request, request.num_computed_tokens, at_once=False)
        self._report_transfers()
        loads, self._allocated = tuple(self._allocated), []
        return StoreMetadata(loads=loads)

    def _report_transfers(self) -> None:
        """The step's stores and loads are done (``complete_store``,
        ``complete_load``): stored chunks become readable, and both evictable."""
        for op, context, keys in self._in_flight:
            if op == "stored":
                self.store.complete_store(keys, context)
            else:
                self.store.complete_load(keys, context)
            self._log(context.req_id, op, keys)
        self._in_flight = []

    def register_finished_partial_tail(
        self, request: Any, block_ids: Any, partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        """Keep a producer's finished partial-tail states on the grid; copied
        at once, so the blocks need not outlive the request."""
        keys = [
            k
            for group_id, _block_id, boundary in partial_tail_offloads
            for k in self._state_keys(request.request_id, group_id, boundary)
        ]
        if keys:
            self._store(request, keys, at_once=True)
        return False

    def request_finished(  # type: ignore[override]
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The finish without the hybrid allocator (one group's ``block_ids``):
        :meth:`_finish`."""
        return self._finish(request)

    def _finish(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Keep everything the request computed, then commit its recency
        (``on_request_finished``); freed at once (the copy is synchronous in
        this model). A prefill instance's request (``do_remote_decode``)
        returns the ``kv_transfer_params`` its decode instance gets."""
        self._save(request, request.num_computed_tokens, at_once=True)
        context = self._context(request)
        self.store.on_request_finished(context)
        self._log(request.request_id, "finish", [])
        self._requests.pop(request.request_id, None)
        self._contexts.pop(request.request_id, None)
        self._offered.pop(request.request_id, None)
        params = request.kv_transfer_params or {}
        if self.saves and not self.loads and params.get("do_remote_decode"):
            # NixlConnectorScheduler.request_finished's hand-over to the decode side.
            return False, {"do_remote_prefill": True, "do_remote_decode": False}
        return False, None

    # ------------------------------------------------------------------- log

    def _id(self, key: OffloadKey) -> int:
        """The key's small id (first seen, first numbered)."""
        return self._key_ids.setdefault(key, len(self._key_ids))

    def _triples(self, request_id: str, keys: Any) -> tuple[tuple[int, int, int], ...]:
        """``(id, group, end position)`` per key (the position the request's
        context holds for it)."""
        context = self._contexts.get(request_id)
        return tuple(
            (
                self._id(k),
                get_offload_group_idx(k),
                (context.get_offload_key_position(k) if context is not None else None) or 0,
            )
            for k in keys
        )

    def _log(
        self,
        request_id: str,
        op: str,
        keys: Any,
        evicted: tuple[int, ...] = (),
        refused: bool = False,
    ) -> None:
        """Record one manager call (bounded stores only)."""
        if self._recorded:
            call = StoreCall(
                op, -1, self._triples(request_id, keys), evicted=evicted, refused=refused
            )
            self.calls.append((request_id, call))

    def _log_lookup(self, request: Any, presented: int, held: int, matched: int) -> None:
        """Record a lookup: the keys each candidate prefix needs, and the answer."""
        unit = self.unit_tokens
        limit = self._limit(request)
        prefix = self._prefix_keys(request, 0, limit)
        needs = tuple(
            tuple(self._id(k) for k in self._point_keys(request, n))
            for n in range(unit, limit + 1, unit)
        )
        call = StoreCall(
            "lookup",
            -1,
            self._triples(request.request_id, prefix),
            needs=needs,
            unit_tokens=unit,
            presented_tokens=presented,
            held_tokens=held,
            matched_tokens=matched,
        )
        self.calls.append((request.request_id, call))


class RemoteStoreConnector(_StoreConnector, SupportsHMA):  # type: ignore[misc]
    """The store (see :class:`_StoreConnector`) with the hybrid allocator
    (``SupportsHMA``): ``Scheduler._connector_finished`` hands it every
    group's blocks."""

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The hybrid allocator's finish: :meth:`_StoreConnector._finish`."""
        return self._finish(request)


class SingleGroupStoreConnector(_StoreConnector):
    """The store (see :class:`_StoreConnector`) without the hybrid allocator,
    as connectors not subclassing ``SupportsHMA`` are: vLLM turns the hybrid
    allocator off for them (``VllmConfig.__post_init__``), so a layout has one
    KV cache group, and ``Scheduler._connector_finished`` takes the legacy
    path, ``request_finished`` with group 0's blocks after checking that
    there is one group ("We should deprecate this code path after we enforce
    all connectors to support HMA")."""

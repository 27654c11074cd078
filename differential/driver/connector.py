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
  local hit. No KV moves: the store records *which* prefixes it holds, keyed
  by vLLM's own chained block hashes (``Request.block_hashes``, one per hash
  block), and kvfuzz's stand-in model runner reports the loads finished
  (vllm/v1/outputs.py ``KVConnectorOutput``).

Only the scheduler role is served; the worker-side methods are never called
(no model runs) and raise if they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

__all__ = ["EmptyRemoteConnector", "RemoteStoreConnector", "StoreLoad", "StoreQuery"]


# vLLM is not type-checked (pyproject.toml), so its base classes are Any here.
class EmptyRemoteConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A KV connector whose remote store holds nothing (scheduler side only)."""

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

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        """Free at once, nothing sent (hybrid allocator form)."""
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


@dataclass
class _Saved:
    """What the store has taken of one request so far (per-group block counts)."""

    attention_blocks: int = 0  # hash blocks of full-attention-family KV
    window_blocks: dict[int, int] = field(default_factory=dict)  # per SWA group, its blocks


class RemoteStoreConnector(EmptyRemoteConnector):
    """A CPU-offload tier: a remote store that keeps what requests computed.

    What the store keeps (never evicted):

    * **attention KV**, saved as steps complete (``build_connector_meta``, for
      every request scheduled, the tokens its earlier steps computed) and
      when a request finishes (``request_finished_all_groups``): every full
      hash block of full-attention-family groups; for a sliding-window group
      only the blocks vLLM's own ``SlidingWindowManager.reachable_block_mask``
      (vllm/v1/core/single_type_kv_cache_manager.py) says a lookup can reach
      (dense tails at every lookup unit, and the reachable tail of the
      prompt's final partial segment, ``final_segment_end_block``), as vLLM's
      offloading connector filters its store jobs;
    * **Mamba states** exactly where vLLM hands them off: the boundary states
      ``KVCacheManager.take_boundary_state_offloads`` offers each step
      (``SchedulerOutput.kv_connector_block_state``) and a producer's
      finished partial tail (``register_finished_partial_tail``, from
      ``KVCacheManager.finalize_partial_tail_offloads``); vLLM says such
      states "cannot be reconstructed from a connector's append-only block
      table" (vllm/v1/core/sched/scheduler.py).

    The store holds a prefix of ``n`` tokens (``n`` a multiple of the lookup
    unit, the scheduler's hit alignment) when every full-attention group has
    all of ``[0, n)``, every sliding-window group the blocks a hit at ``n``
    reads, and every Mamba group a state at ``n``. ``get_num_new_matched_tokens``
    answers the longest such ``n`` up to ``num_tokens - 1`` (one token is
    always left to compute, as vLLM's ``ExampleConnector`` does) beyond the
    local hit it is shown, loaded synchronously or asynchronously
    (``kv_connector_extra_config["load"]``).

    Extra config (``KVTransferConfig.kv_connector_extra_config``): ``load``
    (``"sync"`` / ``"async"``), ``divergent_hybrid_hits`` (bool),
    ``lookup_unit_tokens`` (the lookup unit) and ``hash_block_tokens`` (the
    block pool's hash block size), in tokens.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.load_async: bool = extra.get("load") == "async"
        self._divergent = bool(extra.get("divergent_hybrid_hits", False))
        self.unit_tokens: int = int(extra["lookup_unit_tokens"])
        self.hash_block_tokens: int = int(extra["hash_block_tokens"])
        self._attention: set[Any] = set()  # keys of hash blocks with full-attention KV
        self._windows: dict[int, tuple[Any, set[Any]]] = {}  # SWA group -> (spec, block keys)
        self._states: dict[int, set[Any]] = {}  # Mamba group -> keys of prefixes with a state
        self._full_attention = False
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if isinstance(spec, MambaSpec):
                self._states[gid] = set()
            elif isinstance(spec, SlidingWindowSpec):
                self._windows[gid] = (spec, set())
            elif spec.prefix_cacheable:
                self._full_attention = True
        self._requests: dict[str, Any] = {}
        self._saved: dict[str, _Saved] = {}
        self._allocated: list[StoreLoad] = []
        #: Per request id, every ``get_num_new_matched_tokens`` answer, in order.
        self.queries: dict[str, list[StoreQuery]] = {}

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

    # --------------------------------------------------------------- lookups

    def _key(self, request: Any, tokens: int) -> Any:
        """The chained block hash naming the request's first ``tokens`` tokens
        (a multiple of the hash block)."""
        return request.block_hashes[tokens // self.hash_block_tokens - 1]

    def store_tokens(self, request: Any) -> int:
        """The longest prefix of ``request`` the store holds, in tokens (see
        the class docstring): a multiple of the lookup unit, at most
        ``num_tokens - 1``; 0 when none."""
        unit = self.unit_tokens
        hashes = len(request.block_hashes) * self.hash_block_tokens
        limit = min(request.num_tokens - 1, hashes) // unit * unit
        hash_block = self.hash_block_tokens
        held = 0
        for n in range(unit, limit + 1, unit):
            # Full attention reads every token before the hit: all of it or nothing past.
            if self._full_attention and not all(
                self._key(request, t) in self._attention
                for t in range(n - unit + hash_block, n + 1, hash_block)
            ):
                break
            if all(self._window_holds(gid, request, n) for gid in self._windows) and all(
                self._key(request, n) in keys for keys in self._states.values()
            ):
                held = n
        return held

    def _window_holds(self, gid: int, request: Any, tokens: int) -> bool:
        """Whether the store holds the blocks of sliding-window group ``gid``
        that a hit of ``tokens`` reads (vLLM's ``_contiguous_blocks_for_hit``)."""
        spec, keys = self._windows[gid]
        block = spec.block_size
        need = SlidingWindowManager._contiguous_blocks_for_hit(
            spec.sliding_window, block, use_eagle=False
        )
        end = tokens // block
        return all(
            self._key(request, (k + 1) * block) in keys for k in range(max(0, end - need), end)
        )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The tokens the store holds beyond the ``num_computed_tokens`` local
        hit it is shown, in tokens, and whether they load asynchronously."""
        self._requests.setdefault(request.request_id, request)
        held = self.store_tokens(request)
        matched = max(0, held - num_computed_tokens)
        load_async = self.load_async and matched > 0
        self.queries.setdefault(request.request_id, []).append(
            StoreQuery(num_computed_tokens, matched, held, load_async)
        )
        return matched, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the ``num_external_tokens`` the scheduler adopted,
        right after the local hit the connector was shown."""
        if num_external_tokens <= 0:
            return
        query = self.queries[request.request_id][-1]
        start = query.presented_tokens
        self._allocated.append(
            StoreLoad(request.request_id, start, start + num_external_tokens, query.load_async)
        )

    # ------------------------------------------------------------------ saves

    def on_new_request(self, request: Any) -> None:
        """Track the request (its block hashes name what the store keeps)."""
        self._requests[request.request_id] = request

    def _save(self, request: Any, computed_tokens: int) -> None:
        """Keep the attention KV of the request's first ``computed_tokens`` tokens."""
        saved = self._saved.setdefault(request.request_id, _Saved())
        hash_block = self.hash_block_tokens
        full = min(computed_tokens, len(request.block_hashes) * hash_block) // hash_block
        for k in range(saved.attention_blocks, full):
            self._attention.add(request.block_hashes[k])
        saved.attention_blocks = max(saved.attention_blocks, full)
        for gid, (spec, keys) in self._windows.items():
            block = spec.block_size
            end = full * hash_block // block
            start = saved.window_blocks.get(gid, 0)
            if end <= start:
                continue
            mask = SlidingWindowManager.reachable_block_mask(
                start_block=start,
                end_block=end,
                alignment_tokens=self.unit_tokens,
                kv_cache_spec=spec,
                use_eagle=False,
                retention_interval=None,
                final_segment_end_block=request.num_prompt_tokens // block,
            )
            for k in range(start, end):
                if mask is None or mask[k - start]:
                    keys.add(self._key(request, (k + 1) * block))
            saved.window_blocks[gid] = end

    def _save_state(self, request_id: str, group_id: int, boundary_tokens: int) -> None:
        """Keep a Mamba state of group ``group_id`` at ``boundary_tokens``."""
        request = self._requests.get(request_id)
        keys = self._states.get(group_id)
        if (
            request is None
            or keys is None
            or boundary_tokens <= 0
            or boundary_tokens % self.hash_block_tokens
            or boundary_tokens > len(request.block_hashes) * self.hash_block_tokens
        ):
            return
        keys.add(self._key(request, boundary_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Save what the scheduled requests' earlier steps computed and the
        boundary states handed off this step; hand the loads allocated this
        step to the worker (kvfuzz's model runner)."""
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self._requests.get(request_id)
            if request is not None:
                self._save(request, request.num_computed_tokens)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is not None:
            for request_id, offloads in block_state.boundary_state_offloads.items():
                for group_id, _block_id, boundary in offloads:
                    self._save_state(request_id, group_id, boundary)
        loads, self._allocated = tuple(self._allocated), []
        return StoreMetadata(loads=loads)

    def register_finished_partial_tail(
        self, request: Any, block_ids: Any, partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        """Keep a producer's finished partial-tail states; copied at once, so
        the blocks need not outlive the request."""
        for group_id, _block_id, boundary in partial_tail_offloads:
            self._save_state(request.request_id, group_id, boundary)
        return False

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        """Keep everything the request computed; freed at once (the copy is
        synchronous in this model)."""
        self._save(request, request.num_computed_tokens)
        self._requests.pop(request.request_id, None)
        self._saved.pop(request.request_id, None)
        return False, None

"""Deliberate breakages of vLLM's behaviour, to prove the oracle has teeth.

Each mutation is applied on top of the ``fixed`` variant (which is clean on
the bundled corpus), so every finding a mutant produces is the mutation's.
The wrappers wrap whatever is installed when they are entered, so they
compose with the seed fix.

* ``mutant-no-peek``: ``SlidingWindowManager.reachable_block_mask`` keeps the
  tails as if there were no EAGLE drop (no peek block past the boundary).
* ``mutant-double-drop``: ``SlidingWindowManager.find_longest_cache_hit``
  applies the EAGLE drop twice.
* ``mutant-no-junction``: ``KVCacheManager.get_computed_blocks`` never
  reports a shared-prefix boundary, so no junction is pinned. Applied on top
  of the ``candidate`` variant, whose one-unit promise makes junctions matter
  on scenarios where the candidate itself is clean.
* ``mutant-null-in-window``: ``KVCacheManager.get_computed_blocks`` hands out
  the null block for the last block below the hit of the first
  sliding-window group, inside the window (the hit length is unchanged).
* ``mutant-extra-block``: ``KVCacheManager.get_computed_blocks`` hands out,
  in the first group, the cached block just past the hit as well (the hit
  length is unchanged).
* ``mutant-mamba-eagle-margin``: ``MambaManager.find_longest_cache_hit``
  gets back the EAGLE margin vLLM withholds from Mamba groups, so it can hit a
  state past the point full attention proves.
* ``mutant-mamba-state-no-cow``: ``MambaManager.allocate_new_blocks``
  forgets a running request's partial hit on its own cached partial tail,
  so the step neither moves the tail's cache entry to a copy-on-write block
  nor queues the copy: the request's next forward writes its running state
  into the block the prefix cache holds for the state at the tail, a cached
  state changed after it was cached (the write vLLM's
  ``move_block_hashes`` + ``_pending_cow_copies`` path exists to avoid:
  "the queued copy fills it before forward overwrites source_block",
  vllm/v1/core/single_type_kv_cache_manager.py). Only the block-level
  check sees it: an ``unsafe-write`` of a cached block, and a later hit on
  the tail handed a state for other tokens.
* ``mutant-mru-eviction``: ``FreeKVCacheBlockQueue.append_n`` puts the
  blocks at the front of the free queue, so ``BlockPool.free_blocks`` queues
  freed cached blocks to be evicted first (most recently used first) instead
  of last (vllm/v1/core/block_pool.py: "FIFO reuse of cached blocks for LRU
  eviction behavior"); only a pool that evicts sees it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue
from vllm.v1.core.single_type_kv_cache_manager import MambaManager, SlidingWindowManager

from differential.driver.fixes import patched, seed_pr_fix

__all__ = [
    "mutant_double_drop",
    "mutant_extra_block",
    "mutant_mamba_eagle_margin",
    "mutant_mamba_state_no_cow",
    "mutant_mru_eviction",
    "mutant_no_junction",
    "mutant_no_peek",
    "mutant_null_in_window",
]


def _classmethod_function(owner: type, name: str) -> Callable[..., Any]:
    return owner.__dict__[name].__func__  # type: ignore[no-any-return]


@contextmanager
def mutant_no_peek() -> Iterator[None]:
    """The fixed variant, with SWA tails kept as if the drop were off."""
    with seed_pr_fix():
        current = _classmethod_function(SlidingWindowManager, "reachable_block_mask")

        def no_peek(cls: type, *args: Any, **kwargs: Any) -> list[bool] | None:
            if "use_eagle" in kwargs:
                kwargs["use_eagle"] = False
            else:
                args = (*args[:4], False, *args[5:])
            return current(cls, *args, **kwargs)  # type: ignore[no-any-return]

        with patched(((SlidingWindowManager, "reachable_block_mask", classmethod(no_peek)),)):
            yield


@contextmanager
def mutant_double_drop() -> Iterator[None]:
    """The fixed variant, with the SWA lookup dropping the last block twice."""
    with seed_pr_fix():
        current = _classmethod_function(SlidingWindowManager, "find_longest_cache_hit")

        def double_drop(
            cls: type, block_hashes: Any, max_length: int, *args: Any, **kwargs: Any
        ) -> Any:
            blocks, hit = current(cls, block_hashes, max_length, *args, **kwargs)
            drop = kwargs.get("drop_eagle_block", args[3] if len(args) > 3 else False)
            if drop and hit > 0:
                blocks, hit = current(cls, block_hashes, hit, *args, **kwargs)
            return blocks, hit

        with patched(((SlidingWindowManager, "find_longest_cache_hit", classmethod(double_drop)),)):
            yield


@contextmanager
def mutant_no_junction() -> Iterator[None]:
    """The candidate variant, with no shared-prefix junction ever reported."""
    from differential.driver.candidate import candidate_fix

    with candidate_fix():
        current = KVCacheManager.__dict__["get_computed_blocks"]

        def no_junction(self: KVCacheManager, *args: Any, **kwargs: Any) -> Any:
            blocks, hit, _junction = current(self, *args, **kwargs)
            return blocks, hit, 0

        with patched(((KVCacheManager, "get_computed_blocks", no_junction),)):
            yield


@contextmanager
def mutant_null_in_window() -> Iterator[None]:
    """The fixed variant, with the null block inside the first SWA group's window."""
    with seed_pr_fix():
        current = KVCacheManager.__dict__["get_computed_blocks"]

        def null_in_window(self: KVCacheManager, *args: Any, **kwargs: Any) -> Any:
            blocks, hit, junction = current(self, *args, **kwargs)
            groups = [list(g) for g in blocks.blocks]
            for gid, manager in enumerate(self.coordinator.single_type_managers):
                if isinstance(manager, SlidingWindowManager):
                    if groups[gid] and not groups[gid][-1].is_null:
                        groups[gid][-1] = self.block_pool.null_block
                        blocks = KVCacheBlocks(tuple(groups))
                    break
            return blocks, hit, junction

        with patched(((KVCacheManager, "get_computed_blocks", null_in_window),)):
            yield


@contextmanager
def mutant_extra_block() -> Iterator[None]:
    """The fixed variant, handing out the cached block past the hit in group 0."""
    with seed_pr_fix():
        current = KVCacheManager.__dict__["get_computed_blocks"]

        def extra_block(self: KVCacheManager, request: Any, *args: Any, **kwargs: Any) -> Any:
            blocks, hit, junction = current(self, request, *args, **kwargs)
            manager = self.coordinator.single_type_managers[0]
            step = manager.block_size // self.block_pool.hash_block_size
            index = hit // manager.block_size
            hashes = request.block_hashes
            if (index + 1) * step <= len(hashes):
                cached = self.block_pool.get_cached_block(hashes[(index + 1) * step - 1], [0])
                if cached:
                    groups = [list(g) for g in blocks.blocks]
                    groups[0].append(cached[0])
                    blocks = KVCacheBlocks(tuple(groups))
            return blocks, hit, junction

        with patched(((KVCacheManager, "get_computed_blocks", extra_block),)):
            yield


@contextmanager
def mutant_mamba_eagle_margin() -> Iterator[None]:
    """The fixed variant, with the EAGLE margin given back to Mamba groups.

    ``HybridKVCacheCoordinator.find_longest_cache_hit`` lets an EAGLE group
    match one drop unit past the candidate and then drop it, but gives Mamba
    groups no margin because their finder never drops. This wrapper around
    ``MambaManager.find_longest_cache_hit`` adds the margin back (one hash
    block with fine-grained hits, else one block, as
    ``kv_cache_utils.eagle_proof_margin``), so a Mamba state past the point
    full attention proves can be hit.
    """
    with seed_pr_fix():
        current = _classmethod_function(MambaManager, "find_longest_cache_hit")

        def with_margin(
            cls: type, block_hashes: Any, max_length: int, *args: Any, **kwargs: Any
        ) -> Any:
            drop = kwargs.get("drop_eagle_block", args[3] if len(args) > 3 else False)
            if drop:
                spec = kwargs.get("kv_cache_spec", args[2] if len(args) > 2 else None)
                alignment = kwargs.get("alignment_tokens", args[4] if len(args) > 4 else None)
                pool = kwargs.get("block_pool", args[1] if len(args) > 1 else None)
                block = spec.block_size if spec is not None else 0
                margin = alignment if alignment and alignment < block else block
                # Never past the hashed tokens: the finder indexes one hash
                # per block below max_length (with the hash block equal to
                # the Mamba block, one margin past the last hash would be an
                # IndexError of the mutant's own making).
                hashed = len(block_hashes) * pool.hash_block_size if pool is not None else None
                max_length += margin
                if hashed is not None:
                    max_length = min(max_length, hashed)
            return current(cls, block_hashes, max_length, *args, **kwargs)

        with patched(((MambaManager, "find_longest_cache_hit", classmethod(with_margin)),)):
            yield


@contextmanager
def mutant_mamba_state_no_cow() -> Iterator[None]:
    """The fixed variant, whose running requests write into their own cached
    partial-tail state block (no copy-on-write)."""
    with seed_pr_fix():
        current = MambaManager.__dict__["allocate_new_blocks"]

        def no_cow(self: MambaManager, request_id: str, *args: Any, **kwargs: Any) -> Any:
            if request_id in getattr(self, "_allocated_block_reqs", ()):
                self._partial_hit_reqs.pop(request_id, None)
                self._producer_partial_tail_reqs.pop(request_id, None)
            return current(self, request_id, *args, **kwargs)

        with patched(((MambaManager, "allocate_new_blocks", no_cow),)):
            yield


@contextmanager
def mutant_mru_eviction() -> Iterator[None]:
    """The fixed variant, with freed cached blocks queued for eviction first."""
    with seed_pr_fix():

        def to_front(self: FreeKVCacheBlockQueue, blocks: list[Any]) -> None:
            self.prepend_n(list(blocks))

        with patched(((FreeKVCacheBlockQueue, "append_n", to_front),)):
            yield

"""The engine worker's Mamba state breakages: one part of a hit state from the
wrong position, and a cached state written again by another request.

Run inside the engine worker (:mod:`differential.driver.engine_worker`, vLLM's
CPU build 0.32.0); imports vLLM only inside its methods and nothing of
kvfuzz. Each Mamba layer keeps its state as a tuple of tensors indexed by
block id, ``(conv, ssm)``: ``MambaBase.bind_kv_cache`` slices them out of the
layer's pages in the order of ``MambaMixer2.get_state_shape``
(vllm/model_executor/layers/mamba/abstract.py, mamba_mixer2.py). In the
prefix cache's ``align`` mode each Mamba block holds the state at its last
token, and a request's state is written to the block of the last token its
step computes; at the request's first step ``preprocess_mamba``
(vllm/v1/worker/mamba_utils.py) copies the hit state (the block of token
``num_computed_tokens - 1``) into that block, the only time the hit block is
read. The breakages act on that call, which the model runner
(vllm/v1/worker/gpu_model_runner.py, ``execute_model``) makes after the
scheduler's step and before the forward pass reads the Mamba metadata's
state indices (``mamba_get_block_table_tensor``,
vllm/v1/attention/backends/utils.py: the block table's block of the step's
last token).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The breakages of :class:`MambaBreakage`, and the state part each swaps
#: (index into a Mamba layer's ``kv_cache`` tuple: 0 conv, 1 ssm).
MAMBA_PARTS = {"wrong-mamba-conv": 0, "wrong-mamba-ssm": 1}
WRITTEN_AFTER_CACHE = "state-written-after-cache"
MAMBA_BREAKAGES = (*MAMBA_PARTS, WRITTEN_AFTER_CACHE)


def _index(request_id: str) -> int:
    """The plan's request index of an engine request id (``RUN-INDEX``, to
    which vLLM's engine may append its own ``-SUFFIX``)."""
    return int(request_id.split("-")[1])


class MambaBreakage:
    """One of :data:`MAMBA_BREAKAGES` on one run of the engine.

    * ``wrong-mamba-ssm`` / ``wrong-mamba-conv``: at the step where a request
      with a Mamba hit first runs, the hit state block's SSM (temporal) state,
      or its conv state, is replaced in place by that part of another cached
      state block of the group (the first by block id whose part differs in
      some layer: a state for other tokens or another position) for the
      duration of ``preprocess_mamba``, which copies it into the request's
      own block, and restored right after: only the requests whose state
      that call copies from the hit block read it (every one of them is
      reported broken), and the cached block is intact for later hits.
    * ``state-written-after-cache``: at every step, each scheduled request
      writes its state into a cached state block it did not cache (the first
      by block id that is cached for the group, held by no request, not yet
      overwritten, and cached by another request: ``BlockPool.cache_full_blocks``,
      vllm/v1/core/block_pool.py): after ``preprocess_mamba`` the block
      table's entry of the request's state block (``mamba_state_idx``) is
      that cached block, holding the request's state, so the step's kernels
      read and write the request's state there; after the step the state is
      copied back to the request's own block and the entry restored, so the
      writer's own outputs are unchanged. The cached block keeps its block
      hash and now holds another request's state; a later request whose
      Mamba hit ends on it reads that state and is reported broken
      (``broken_blocks``: request, group, slot of the hit); a write that left
      the block unchanged (the same state) counts as none, and an evicted
      block is forgotten.
    """

    def __init__(self, breakage: str, core: Any) -> None:
        self.breakage = breakage
        self.manager = core.scheduler.kv_cache_manager
        self.pool = self.manager.block_pool
        self.kv_cache_config = core.scheduler.kv_cache_config
        groups = self.kv_cache_config.kv_cache_groups
        self.groups = [
            g for g, group in enumerate(groups) if type(group.kv_cache_spec).__name__ == "MambaSpec"
        ]
        self.block_size = {g: groups[g].kv_cache_spec.block_size for g in self.groups}
        self.broken: list[int] = []
        self.replaced: list[list[int]] = []  # [request, group, block slot]
        self.writes: list[list[int]] = []  # [writer request, group, block id, step]
        # request id -> (group, hit block id, its slot in the hit's blocks)
        self.pending: dict[str, tuple[int, int, int]] = {}
        self._restore: list[tuple[Any, int, Any]] = []  # (state tensor, block id, saved part)
        self.cached_by: dict[int, int] = {}  # block id -> request index that cached it
        self.overwritten: dict[int, int] = {}  # block id -> writer request index
        self._redirected: list[tuple[Any, int, int, int, int, int, list[Any], list[Any]]] = []

    # ------------------------------------------------------------ scheduler side

    def looked_up(self, request: Any, blocks: Any) -> None:
        """Note one ``KVCacheManager.get_computed_blocks`` result (per group the
        hit's blocks): a part breakage remembers the request's Mamba hit block
        for its first step; ``state-written-after-cache`` reports the request
        broken when its hit block was overwritten."""
        index = _index(request.request_id)
        for g in self.groups:
            real = [j for j, b in enumerate(blocks.blocks[g]) if not b.is_null]
            if not real:
                continue
            block_id = blocks.blocks[g][real[-1]].block_id
            if self.breakage in MAMBA_PARTS:
                self.pending[request.request_id] = (g, block_id, real[-1])
            elif block_id in self.overwritten:
                self._report(index, g, real[-1])

    def cached(self, request: Any, blocks: list[Any], start: int, end: int, group: int) -> None:
        """``BlockPool.cache_full_blocks`` cached ``blocks[start:end]`` of
        ``group`` for ``request``: remember who cached each."""
        if group in self.groups:
            for block in blocks[start:end]:
                self.cached_by.setdefault(block.block_id, _index(request.request_id))

    def moved(self, source: Any, copy: Any) -> None:
        """``BlockPool.move_block_hashes`` re-pointed ``source``'s cache
        entries to ``copy`` (vllm/v1/core/block_pool.py): a request that
        keeps writing into a state block it cached at a partial hit or a
        fine-grained checkpoint leaves the prefix cache a private copy
        (``MambaManager`` allocation, vllm/v1/core/single_type_kv_cache_manager.py),
        which later hits read; its cacher is the source's."""
        for known in (self.cached_by, self.overwritten):
            if source.block_id in known:
                known[copy.block_id] = known.pop(source.block_id)

    def evicted(self, block: Any) -> None:
        """A cached block was evicted (its hash dropped): forget it."""
        self.cached_by.pop(block.block_id, None)
        self.overwritten.pop(block.block_id, None)

    def _report(self, index: int, group: int, slot: int) -> None:
        if [index, group, slot] not in self.replaced:
            self.replaced.append([index, group, slot])
        if index not in self.broken:
            self.broken.append(index)

    # ------------------------------------------------------------ model-runner side

    def scheduled(self, scheduler_output: Any, forward_context: dict[str, Any]) -> None:
        """After ``Scheduler.schedule``: for a part breakage, put the part of
        another cached state block into the hit block of every request first
        scheduled now with a Mamba hit (it reads the hit block in this step,
        before the forward pass: the model runner's copy-on-write of a hit
        that ends inside a block, ``copy_kv_cache_blocks_inplace`` in
        ``_update_states``, vllm/v1/worker/utils.py, or ``preprocess_mamba``'s
        copy of a hit that ends on a block boundary); it is restored after
        ``preprocess_mamba``, before the forward pass."""
        if self.breakage not in MAMBA_PARTS:
            return
        part = MAMBA_PARTS[self.breakage]
        swapped: dict[int, int | None] = {}  # hit block id -> the other block (None: none)
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self.pending:
                continue
            g, hit_block, slot = self.pending.pop(new.req_id)
            layers = self._layers(g, forward_context)
            if hit_block not in swapped:
                other = self._other_part(g, hit_block, part, layers)
                swapped[hit_block] = other
                for states in layers if other is not None else []:
                    saved = states[part][hit_block].clone()
                    self._restore.append((states[part], hit_block, saved))
                    states[part][hit_block].copy_(states[part][other])
            if swapped[hit_block] is not None:
                self._report(_index(new.req_id), g, slot)

    def _layers(self, group: int, forward_context: dict[str, Any]) -> list[Any]:
        """Each Mamba layer's state tensors (``kv_cache``) of ``group``."""
        names = self.kv_cache_config.kv_cache_groups[group].layer_names
        return [forward_context[n].kv_cache for n in names]

    def wrap_preprocess(self, original: Callable[..., Any], step: Callable[[], int]) -> Any:
        """``preprocess_mamba`` with the breakage around it (``step``: the
        engine step now): a part breakage's hit blocks restored after it,
        ``state-written-after-cache``'s writes redirected."""

        def preprocess(
            scheduler_output: Any,
            kv_cache_config: Any,
            cache_config: Any,
            mamba_state_idx: dict[str, int],
            input_batch: Any,
            requests: dict[str, Any],
            forward_context: dict[str, Any],
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            try:
                out = original(
                    scheduler_output,
                    kv_cache_config,
                    cache_config,
                    mamba_state_idx,
                    input_batch,
                    requests,
                    forward_context,
                    *args,
                    **kwargs,
                )
            finally:
                self.restore()
            if self.breakage == WRITTEN_AFTER_CACHE:
                layers = {g: self._layers(g, forward_context) for g in self.groups}
                self._redirect(mamba_state_idx, input_batch, requests, layers, step())
            return out

        return preprocess

    def restore(self) -> None:
        """Put back the hit blocks' parts a part breakage replaced."""
        for state, block_id, saved in self._restore:
            state[block_id].copy_(saved)
        self._restore.clear()

    def _cached_blocks(self, group: int) -> list[Any]:
        """The blocks cached for ``group`` (the pool's
        ``cached_block_hash_to_block``, vllm/v1/core/block_pool.py), by block
        id, the null block left out."""
        from vllm.v1.core.kv_cache_utils import get_group_id

        found: list[Any] = []
        for key, blocks in self.pool.cached_block_hash_to_block._cache.items():
            if get_group_id(key) == group:
                found += [blocks] if not isinstance(blocks, dict) else list(blocks.values())
        return sorted((b for b in found if not b.is_null), key=lambda b: b.block_id)

    def _other_part(self, group: int, block_id: int, part: int, layers: list[Any]) -> int | None:
        """The first cached block of ``group`` (by block id; not ``block_id``)
        whose ``part`` differs from ``block_id``'s in some layer of the group."""
        for candidate in self._cached_blocks(group):
            if candidate.block_id != block_id and any(
                not states[part][candidate.block_id].equal(states[part][block_id])
                for states in layers
            ):
                return int(candidate.block_id)
        return None

    def _write_target(self, group: int, writer: int, taken: set[int]) -> int | None:
        """The cached block ``writer`` writes its state into (see the class)."""
        for candidate in self._cached_blocks(group):
            block_id = int(candidate.block_id)
            if (
                candidate.ref_cnt == 0
                and block_id not in self.overwritten
                and block_id not in taken
                and self.cached_by.get(block_id, writer) != writer
            ):
                return block_id
        return None

    def _redirect(
        self,
        mamba_state_idx: dict[str, int],
        input_batch: Any,
        requests: dict[str, Any],
        layers: dict[int, list[Any]],
        step: int,
    ) -> None:
        """Point each scheduled request's state block, in the model runner's
        block table, at a cached block holding a copy of its state (the
        class's ``state-written-after-cache``)."""
        taken: set[int] = set()
        for row, req_id in enumerate(input_batch.req_ids):
            writer = _index(req_id)
            for g in self.groups:
                curr = mamba_state_idx[req_id]
                own = requests[req_id].block_ids[g][curr]
                table = input_batch.block_table[g].block_table  # CpuGpuBuffer
                target = self._write_target(g, writer, taken)
                if target is None or int(table.gpu[row, curr]) != own:
                    continue
                taken.add(target)
                before = [state[target].clone() for states in layers[g] for state in states]
                for states in layers[g]:
                    for state in states:
                        state[target].copy_(state[own])
                table.np[row, curr] = target
                table.gpu[row, curr] = target  # committed before preprocess_mamba
                self._redirected.append((table, row, curr, own, target, writer, layers[g], before))
                self.writes.append([writer, g, target, step])

    def after_step(self) -> None:
        """After an engine step: each redirected request's state copied back to
        its own block and its block table entry restored; a cached block the
        step's kernels changed is overwritten."""
        self.restore()
        for table, row, curr, own, target, writer, layers, before in self._redirected:
            for states in layers:
                for state in states:
                    state[own].copy_(state[target])
            table.np[row, curr] = own
            table.gpu[row, curr] = own
            after = [state[target] for states in layers for state in states]
            if any(not a.equal(b) for a, b in zip(after, before, strict=True)):
                self.overwritten[target] = writer
            else:
                self.writes = [w for w in self.writes if w[2] != target or w[0] != writer]
        self._redirected.clear()

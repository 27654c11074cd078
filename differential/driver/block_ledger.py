"""Record, as plain data, which blocks vLLM hands out and what they hold.

The block-level check (:mod:`differential.oracle.blocks`) needs two facts the
hit length does not carry:

* for every ``get_computed_blocks``, the blocks of each KV cache group and,
  for each real block, which request wrote KV into it, at which block index,
  and how many of its tokens (:class:`BlockLedger.lookup`);
* for every ``allocate_slots`` step, where each attention group's block
  table holds vLLM's null block afterwards (:class:`StepTable`: the blocks
  ``remove_skipped_blocks`` freed, and a hit's skipped blocks), which
  :func:`differential.oracle.blocks.table_violations` reads against the
  window;
* for every ``allocate_slots`` step, each block the step writes into that
  was not the request's alone: vLLM's null block, a block whose reference
  count (``KVCacheBlock.ref_cnt``, kept by ``vllm/v1/core/block_pool.py``
  ``BlockPool``) is not 1, a block another request's block table still
  holds (whatever its reference count says: a bookkeeping bug may leave it
  at 1), or a block whose prefix-cache entry already
  covers the tokens the step writes (:meth:`BlockLedger.before_step` /
  :meth:`BlockLedger.after_step`), the conditions of
  ``BlockPool.is_block_writable``. A full-attention prompt tail that ends
  inside a block is cached as a partial entry
  (``FullAttentionManager._cache_partial_tail_block``) that covers only the
  prompt's last hash boundary; the request keeps writing its sampled tokens
  past it, which is safe, so only writes below the entry's
  ``block_hash_num_tokens`` count.

* for every ``allocate_slots`` step of a Mamba group in ``align`` mode,
  which state each block holds afterwards: the model runner keeps a
  request's running state in the block at index ``cdiv(e, B) - 1`` of its
  table for a step ending at ``e`` tokens (``curr_state_idx`` in
  ``preprocess_mamba``, vllm/v1/worker/mamba_utils.py: "We always save the
  current running state at the last (1 + num_speculative_blocks) block"),
  so once the forward has run that block holds the request's state after
  its tokens ``[0, e)``; a copy-on-write copy the step queued
  (``SingleTypeKVCacheManager._pending_cow_copies``, run by the worker
  before the forward) gives its destination the source's state first. A
  step whose running block is the null block, held by another request, or
  already in the prefix cache for a state at another position
  (``KVCacheBlock.block_hash_num_tokens``) is an unsafe write: a cached
  state block changed after it was cached. A step with draft tokens leaves
  states whose position the drafts' acceptance decides
  (``postprocess_mamba_fused_kernel``): the blocks it touches are recorded
  as written by the request at a position not followed, as are the states
  of a group with prefill checkpoint blocks (none of kvfuzz's specs has
  them: ``differential.driver.specs``).

The ledger is keyed by block id and updated only for the blocks a step
writes (the tokens ``[start, end)``), so its cost is proportional to the
tokens computed, not to the cache size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from differential.observation import BlockRecord, BlockWrite, StepTable

__all__ = ["BlockLedger"]


class BlockLedger:
    """What each block id of one manager's pool was last filled with.

    Args:
        manager: the ``KVCacheManager`` being driven; its coordinator's
            ``single_type_managers`` give each group's block table
            (``req_to_blocks``) and block size, in tokens.
        sink_blocks: how many physical blocks after the null block a static
            sink holds (``Scenario.num_sink_blocks``, in blocks): a step
            writing block ids ``1 .. sink_blocks`` overwrites the sink's KV.
    """

    def __init__(self, manager: KVCacheManager, sink_blocks: int = 0) -> None:
        self._sink_blocks = sink_blocks
        self._managers = manager.coordinator.single_type_managers
        self._block_sizes = [m.block_size for m in self._managers]
        # State groups (Mamba) keep one state block per step end and null
        # blocks elsewhere in the table: not the attention write pattern, so
        # they are followed apart (_record_state_write).
        self._state_groups = {
            gid for gid, m in enumerate(self._managers) if isinstance(m, MambaManager)
        }
        # (group, manager, block size in tokens) of the attention groups.
        self._attention = [
            (gid, m, self._block_sizes[gid])
            for gid, m in enumerate(self._managers)
            if gid not in self._state_groups
        ]
        # (group, manager, block size in tokens) of the state groups whose
        # states the ledger follows (align mode: vLLM caches a state per block).
        self._state = [
            (gid, m, self._block_sizes[gid])
            for gid in sorted(self._state_groups)
            if getattr(m := self._managers[gid], "mamba_cache_mode", None) == "align"
        ]
        # block id -> [group, writer request index, writer block index, filled
        # tokens] for attention, plus [state position in tokens, or -1: not
        # followed] for a state group's block
        self._filled: dict[int, list[int]] = {}
        # group -> how many copy-on-write copies it had queued before the step
        self._cow_seen: dict[int, int] = {}
        # request index -> vLLM request id, for the writers recorded above
        self._request_ids: dict[int, str] = {}
        # block id -> the record a lookup returns for it, until it is written again
        self._records: dict[int, BlockRecord] = {}
        # request index -> its attention groups' tables after each step
        self._tables: dict[int, list[StepTable]] = {}
        self._null_id = id(manager.block_pool.null_block)
        #: The references vLLM's deferred frees hold per block id (see
        #: :meth:`hold_deferred`); ``None``: none (synchronous scheduling).
        self._deferred: Callable[[], Counter[int]] | None = None

    def hold_deferred(self, deferred: Callable[[], Counter[int]]) -> None:
        """Count the references ``deferred()`` gives per block id as held by
        no request: vLLM's deferred frees under async scheduling with a KV
        consumer connector (``Scheduler.deferred_frees``, drained by
        ``_drain_deferred_frees``, vllm/v1/core/sched/scheduler.py) keep one
        reference per block until the steps in flight are processed, a fence
        and not a reader. A copy-on-write block's extra reference
        (``SingleTypeKVCacheManager._apply_cow``) is released that way too
        (``Scheduler._free_cow_retained_blocks`` defers it to the copy
        step's completion), so without this a request's next step, scheduled
        before that step's output is applied, would seem to write a block
        another request holds. A block such a fence holds is never handed to
        another request's table before it is returned, so a request writing
        it holds it alone but for the fence."""
        self._deferred = deferred

    @classmethod
    def for_manager(cls, manager: KVCacheManager, sink_blocks: int = 0) -> BlockLedger | None:
        """A ledger for ``manager`` (``sink_blocks`` as :class:`BlockLedger`), or
        ``None`` if its vLLM lacks what the ledger reads (per-group
        ``req_to_blocks`` and ``block_size``, a null block with ``is_null``):
        an older release then runs without the block-level check."""
        try:
            managers = manager.coordinator.single_type_managers
            null = manager.block_pool.null_block
            if not all(hasattr(m, "req_to_blocks") for m in managers) or not null.is_null:
                return None
        except AttributeError:
            return None
        return cls(manager, sink_blocks)

    def lookup(self, blocks: Sequence[Sequence[Any]]) -> tuple[tuple[BlockRecord | None, ...], ...]:
        """Per group, what each block a lookup returned held (``None``: the null block).

        Args:
            blocks: ``KVCacheBlocks.blocks`` as ``get_computed_blocks`` returned it.
        """
        out = []
        filled = self._filled
        records = self._records
        for group in blocks:
            row: list[BlockRecord | None] = []
            for block in group:
                if block.is_null:
                    row.append(None)
                    continue
                block_id = block.block_id
                record = records.get(block_id)
                if record is None:
                    rec = filled.get(block_id)
                    if rec is None:
                        record = BlockRecord(block_id, None, None, None, 0)
                    elif len(rec) > 4:
                        state = rec[4] if rec[4] >= 0 else None
                        record = BlockRecord(block_id, rec[0], rec[1], rec[2], rec[3], state)
                    else:
                        record = BlockRecord(block_id, rec[0], rec[1], rec[2], rec[3])
                    records[block_id] = record
                row.append(record)
            out.append(tuple(row))
        return tuple(out)

    def before_step(
        self,
        request_id: str,
        start_tokens: int,
        end_tokens: int,
        hit_blocks: Sequence[Sequence[Any]] | None,
    ) -> dict[int, int]:
        """Block ids already in the prefix cache where the step will write, and
        the tokens (absolute, from position 0) their cache entry covers.

        Args:
            request_id: the request's id.
            start_tokens, end_tokens: the tokens ``[start, end)`` the step computes.
            hit_blocks: the lookup's blocks when this step adopts them (first
                prefill step), else ``None``.
        """
        cached: dict[int, int] = {}
        for gid, manager, _size in self._state:
            self._cow_seen[gid] = len(getattr(manager, "_pending_cow_copies", ()))
        if end_tokens <= start_tokens:
            return cached
        for gid, manager in enumerate(self._managers):
            size = self._block_sizes[gid]
            table = manager.req_to_blocks.get(request_id, ())
            adopted = hit_blocks[gid] if hit_blocks is not None else ()
            # Only blocks the request already holds (or adopts) can be cached;
            # the rest of the range will be fresh blocks.
            last = min((end_tokens - 1) // size + 1, max(len(table), len(adopted)))
            for k in range(start_tokens // size, last):
                if k < len(table):
                    block = table[k]
                elif k < len(adopted):
                    block = adopted[k]
                else:
                    continue
                if block.block_hash is not None:
                    covered = getattr(block, "block_hash_num_tokens", None)
                    cached[block.block_id] = (k + 1) * size if covered is None else covered
        return cached

    def forget(self, request_id: str, start_tokens: int, end_tokens: int) -> None:
        """A KV connector's load of the request's tokens ``[start, end)``
        failed (recorded as written by :meth:`after_step`): the request's
        blocks covering them hold none of its tokens until it computes them.

        Args:
            request_id: the request's id.
            start_tokens, end_tokens: the tokens the load was to write; the
                start is a block boundary of every group.
        """
        for gid, manager in enumerate(self._managers):
            if end_tokens <= start_tokens:
                continue
            size = self._block_sizes[gid]
            table = manager.req_to_blocks.get(request_id, ())
            if gid in self._state_groups:
                # The state the load was to leave at its end was never written.
                k = -(-end_tokens // size) - 1
                if 0 <= k < len(table) and not table[k].is_null:
                    self._filled.pop(table[k].block_id, None)
                    self._records.pop(table[k].block_id, None)
                continue
            for block in table[start_tokens // size : (end_tokens - 1) // size + 1]:
                if not block.is_null:
                    self._filled.pop(block.block_id, None)
                    self._records.pop(block.block_id, None)

    def _held_by_other(self, block: Any, rec: list[int] | None, request_index: int) -> int | None:
        """The request, other than ``request_index``, that last wrote ``block``
        and whose block table (``req_to_blocks`` of the group it wrote in)
        still holds it, or ``None``. A finished or preempted writer's table is
        gone (``SingleTypeKVCacheManager.free``), so a reused block costs one
        dict lookup."""
        if rec is None or rec[1] == request_index:
            return None
        writer_id = self._request_ids.get(rec[1])
        table = self._managers[rec[0]].req_to_blocks.get(writer_id) if writer_id else None
        if table and any(b is block for b in table):
            return rec[1]
        return None

    def take_tables(self, request_index: int) -> tuple[StepTable, ...]:
        """The tables :meth:`after_step` recorded for ``request_index`` since the
        last call, in step order (then group order); forgets them."""
        return tuple(self._tables.pop(request_index, ()))

    def _record_tables(
        self, request_index: int, request_id: str, processed_tokens: int, start_tokens: int
    ) -> None:
        """Where each attention group's table for ``request_id`` holds the null
        block now (:class:`StepTable`), and each align-mode state group's, with
        its first real block holding no prefix-cache entry. Null entries are
        one shared object, so they are found by identity at C speed: a step
        costs O(table length)."""
        null_id = self._null_id
        tables = self._tables.setdefault(request_index, [])
        for gid, manager, _size in self._attention:
            ids = list(map(id, manager.req_to_blocks.get(request_id, ())))
            n = len(ids)
            nulls = ids.count(null_id)
            if not nulls:
                first_real, null_end = 0, 0
            else:
                ids.reverse()
                null_end = n - ids.index(null_id)
                if nulls == null_end:  # the nulls are the table's head
                    first_real = null_end
                else:
                    ids.reverse()
                    first_real = next(i for i, b in enumerate(ids) if b != null_id)
            tables.append(StepTable(processed_tokens, start_tokens, gid, n, first_real, null_end))
        for gid, manager, _size in self._state:
            table = manager.req_to_blocks.get(request_id, ())
            first_real = unregistered = len(table)
            null_end = 0
            for i, block in enumerate(table):
                if id(block) == null_id:
                    null_end = i + 1
                else:
                    first_real = min(first_real, i)
                    if block.block_hash is None:
                        unregistered = min(unregistered, i)
            tables.append(
                StepTable(
                    processed_tokens,
                    start_tokens,
                    gid,
                    len(table),
                    first_real,
                    null_end,
                    unregistered,
                )
            )

    def after_step(
        self,
        request_index: int,
        request_id: str,
        start_tokens: int,
        end_tokens: int,
        cached_before: dict[int, int],
        *,
        processed_tokens: int | None = None,
        loaded_tokens: int = 0,
        draft_tokens: int = 0,
    ) -> list[BlockWrite]:
        """Record the tokens ``[start, end)`` the step wrote and where each
        attention group's table holds null blocks (:meth:`take_tables`);
        return unsafe writes.

        Args:
            request_index: the writing request's index in the scenario.
            request_id: its vLLM request id.
            start_tokens, end_tokens: the tokens the step computed.
            cached_before: :meth:`before_step`'s answer for the same step.
            processed_tokens: the computed tokens ``allocate_slots`` freed
                against (``max(0, total computed - in flight)``), in tokens;
                ``None``: ``start_tokens + loaded_tokens``.
            loaded_tokens: the first ``loaded_tokens`` of the range a KV
                connector loads rather than the step computing them: a load
                writes only the blocks the request holds there, so a null
                block wholly inside them (a sliding window's skipped block,
                ``SingleTypeKVCacheManager.allocate_external_computed_blocks``)
                is no write.
            draft_tokens: how many of the step's tokens are draft tokens
                (``Request.spec_token_ids`` scheduled): the states such a
                step leaves are not followed.
        """
        # The step computes from past the connector's load.
        computed_from = start_tokens + loaded_tokens
        self._record_tables(
            request_index,
            request_id,
            computed_from if processed_tokens is None else processed_tokens,
            computed_from,
        )
        unsafe: list[BlockWrite] = []
        if end_tokens <= start_tokens:
            return unsafe
        self._request_ids[request_index] = request_id
        for gid, manager, size in self._attention:
            table = manager.req_to_blocks.get(request_id)
            if table:
                self._record_group_writes(
                    gid,
                    manager,
                    size,
                    table,
                    request_index,
                    start_tokens,
                    end_tokens,
                    computed_from,
                    cached_before,
                    unsafe,
                )
        for gid, manager, size in self._state:
            table = manager.req_to_blocks.get(request_id)
            if table:
                self._record_state_write(
                    gid,
                    manager,
                    size,
                    table,
                    request_index,
                    (start_tokens, computed_from, end_tokens),
                    draft_tokens,
                    unsafe,
                )
        return unsafe

    def after_drafts(
        self,
        request_index: int,
        request_id: str,
        end_tokens: int,
        draft_tokens: int,
        accepted_tokens: int,
    ) -> None:
        """Record the state a step with drafts leaves on a block boundary once
        its drafts are accepted or rejected: vLLM's postprocess
        (``postprocess_mamba_fused_kernel``, vllm/v1/worker/mamba_utils.py)
        copies the state after ``aligned = new // B * B`` tokens, ``new`` the
        tokens computed once the step is accepted, into the block at index
        ``aligned // B - 1`` when ``aligned`` is at least the running state's
        ``end - drafts`` tokens. The blocks :meth:`after_step` recorded as not
        followed for the step stay so but that one.

        Args:
            request_index, request_id: the request.
            end_tokens: its computed tokens with the step's, drafts included.
            draft_tokens: the step's draft tokens.
            accepted_tokens: the tokens the step keeps (``num_accepted``: the
                sampled token and the drafts accepted, at least 1).
        """
        running = end_tokens - draft_tokens
        new = running + accepted_tokens - 1
        for gid, manager, size in self._state:
            table = manager.req_to_blocks.get(request_id)
            aligned = new // size * size
            if not table or aligned < running or aligned == 0:
                continue
            k = aligned // size - 1
            if k < len(table) and not table[k].is_null:
                self._records.pop(table[k].block_id, None)
                self._filled[table[k].block_id] = [gid, request_index, k, 0, aligned]

    def _take_cow_copies(self, gid: int, manager: Any) -> None:
        """Give each copy-on-write destination the copy-on-write source's state,
        for the copies ``manager`` queued since :meth:`before_step` (the worker
        runs them before the step's forward: ``KVCacheManager.take_kv_cache_block_copies``,
        vllm/v1/core/kv_cache_manager.py)."""
        pending = getattr(manager, "_pending_cow_copies", None) or []
        seen = self._cow_seen.pop(gid, 0)
        for source, dest in pending[seen if seen <= len(pending) else 0 :]:
            self._records.pop(dest.block_id, None)
            rec = self._filled.get(source.block_id)
            if rec is not None and len(rec) > 4 and rec[0] == gid:
                self._filled[dest.block_id] = list(rec)
            else:
                self._filled.pop(dest.block_id, None)

    def _record_state_write(
        self,
        gid: int,
        manager: Any,
        size: int,
        table: Sequence[Any],
        request_index: int,
        span: tuple[int, int, int],
        draft_tokens: int,
        unsafe: list[BlockWrite],
    ) -> None:
        """Record the state one step leaves in a state group (``table``, blocks
        of ``size`` tokens; ``span``: the step's first token, its first
        computed token past a connector's load, and its end, in tokens) and
        append an unsafe write of its running state block to ``unsafe``.

        The running state of a step ending at ``e`` tokens is kept in the
        block at index ``cdiv(e, size) - 1`` (``preprocess_mamba``,
        vllm/v1/worker/mamba_utils.py); a step with drafts, or a group with
        prefill checkpoint blocks (``MambaManager.has_prefill_checkpoint_blocks``:
        the worker also exports a checkpoint state,
        vllm/model_executor/layers/mamba/checkpoint.py), leaves states at
        positions the ledger does not follow (recorded as position -1)."""
        start, computed_from, end = span
        self._take_cow_copies(gid, manager)
        if start < computed_from:
            # A connector's load leaves the state at its end in the block
            # for it (the store's state for the request's own tokens).
            k = -(-computed_from // size) - 1
            if k < len(table) and not table[k].is_null:
                self._records.pop(table[k].block_id, None)
                self._filled[table[k].block_id] = [gid, request_index, k, 0, computed_from]
        if end <= computed_from:
            return
        followed = draft_tokens == 0 and not getattr(
            manager, "has_prefill_checkpoint_blocks", False
        )
        last = -(-end // size) - 1
        if last >= len(table):
            return  # no block for it: vLLM's own assertion, not the ledger's
        # A step with drafts may leave a state in any block from the first
        # one it computes into (postprocess_mamba_fused_kernel's aligned copy).
        first = last if followed else max(0, -(-(computed_from + 1) // size) - 1)
        for k in range(first, last + 1):
            block = table[k]
            if block.is_null and k < last:
                continue
            write = self._unsafe_state_write(
                block, gid, k, manager, end if followed else None, request_index, computed_from
            )
            if write is not None:
                unsafe.append(write)
            if block.is_null:
                continue
            self._records.pop(block.block_id, None)
            self._filled[block.block_id] = [gid, request_index, k, 0, end if followed else -1]

    def _unsafe_state_write(
        self,
        block: Any,
        gid: int,
        k: int,
        manager: Any,
        position: int | None,
        request_index: int,
        start_tokens: int,
    ) -> BlockWrite | None:
        """The step's write of a state at ``position`` tokens (``None``: not
        followed) into ``block`` (index ``k`` of KV cache group ``gid``) as a
        :class:`BlockWrite`, or ``None`` when the block is the request's
        alone: not the null block, one reference (less those a queued
        copy-on-write copy holds on either end,
        ``SingleTypeKVCacheManager._apply_cow`` and ``MambaManager.allocate_new_blocks``,
        and vLLM's deferred frees' fences), and no prefix-cache entry
        promising the state at another position
        (``KVCacheBlock.block_hash_num_tokens``, set by
        ``BlockPool.cache_partial_block`` and ``cache_full_blocks``, the block's
        end when unset)."""
        null = bool(block.is_null)
        ref_cnt = block.ref_cnt
        block_id = block.block_id
        pending = getattr(manager, "_pending_cow_copies", None) or ()
        copying = sum((s is block) + (d is block) for s, d in pending)
        fenced = self._deferred().get(block_id, 0) if self._deferred is not None else 0
        covered = None
        if block.block_hash is not None:
            covered = getattr(block, "block_hash_num_tokens", None)
            covered = (k + 1) * self._block_sizes[gid] if covered is None else covered
        overwrites = covered is not None and position is not None and covered != position
        sink = not null and block_id <= self._sink_blocks
        if not (null or overwrites or sink or ref_cnt - copying - fenced != 1):
            return None
        return BlockWrite(
            position_tokens=start_tokens,
            group=gid,
            block_index=k,
            block_id=block_id,
            ref_cnt=ref_cnt,
            cached=overwrites,
            null=null,
            held_by=None,
            cached_state_tokens=covered if overwrites else None,
            sink=sink,
        )

    def _record_group_writes(
        self,
        gid: int,
        manager: Any,
        size: int,
        table: Sequence[Any],
        request_index: int,
        start_tokens: int,
        end_tokens: int,
        computed_from: int,
        cached_before: dict[int, int],
        unsafe: list[BlockWrite],
    ) -> None:
        """Record the tokens ``[start, end)`` the step wrote into one attention
        KV cache group's blocks (``table``, its blocks ``size`` tokens each),
        from ``computed_from`` on in a null block; append its unsafe writes to
        ``unsafe``."""
        filled = self._filled
        records = self._records
        # A fine-grained partial hit is redirected to a private copy-on-write
        # block (SingleTypeKVCacheManager._apply_cow): it holds one extra
        # reference until the worker has copied the shared block into it.
        pending = getattr(manager, "_pending_cow_copies", None)
        cow = {dst.block_id: src.block_id for src, dst in pending} if pending else None
        fenced = self._deferred() if self._deferred is not None else None
        first = start_tokens // size
        for k, block in enumerate(table[first : (end_tokens - 1) // size + 1], first):
            null = block.is_null
            if null and (k + 1) * size <= computed_from:
                continue  # a connector's load skips it
            block_id = block.block_id
            records.pop(block_id, None)  # written below (or null, never recorded)
            rec = filled.get(block_id)
            source = cow.get(block_id) if cow is not None else None
            copied = source is not None
            if copied and source in filled and (rec is None or rec[:3] != [gid, request_index, k]):
                # The copy holds the hit tokens before this step: the
                # request's own tokens (it matched them), written by it,
                # whatever the block held before it was freed and reused.
                rec = filled[block_id] = [gid, request_index, k, max(0, start_tokens - k * size)]
            write = self._unsafe_write(
                block,
                rec,
                gid,
                k,
                size,
                request_index,
                start_tokens,
                copied,
                cached_before,
                fenced.get(block_id, 0) if fenced else 0,
            )
            if write is not None:
                unsafe.append(write)
                if null:
                    continue
            self._record_fill(block_id, rec, gid, k, size, request_index, start_tokens, end_tokens)

    def _unsafe_write(
        self,
        block: Any,
        rec: list[int] | None,
        gid: int,
        k: int,
        size: int,
        request_index: int,
        start_tokens: int,
        copied: bool,
        cached_before: dict[int, int],
        fenced: int = 0,
    ) -> BlockWrite | None:
        """The step's write from ``start_tokens`` into ``block`` (block ``k``
        of KV cache group ``gid``, ``size`` tokens a block; ``rec``: what the
        ledger last recorded it filled with) as a :class:`BlockWrite`, or
        ``None`` when the block is the request's alone: vLLM's null block, a
        reference count other than 1 (less the pending copy of a
        copy-on-write block and the ``fenced`` references vLLM's deferred
        frees hold, :meth:`hold_deferred`), a prefix-cache entry covering the
        tokens written, another request's table holding it, or a static
        sink's block are unsafe."""
        block_id = block.block_id
        overwrites = bool(cached_before) and (
            max(start_tokens, k * size) < cached_before.get(block_id, 0)
        )
        ref_cnt = block.ref_cnt
        held_by = (
            None
            if rec is None or rec[1] == request_index
            else self._held_by_other(block, rec, request_index)
        )
        null = block.is_null
        sink = not null and block_id <= self._sink_blocks
        if not (
            (ref_cnt - 1 if copied else ref_cnt) - fenced != 1
            or null
            or overwrites
            or sink
            or held_by is not None
        ):
            return None
        return BlockWrite(
            position_tokens=start_tokens,
            group=gid,
            block_index=k,
            block_id=block_id,
            ref_cnt=ref_cnt,
            cached=overwrites,
            null=bool(null),
            held_by=held_by,
            sink=sink,
        )

    def _record_fill(
        self,
        block_id: int,
        rec: list[int] | None,
        gid: int,
        k: int,
        size: int,
        request_index: int,
        start_tokens: int,
        end_tokens: int,
    ) -> None:
        """Record how many tokens of block ``k`` (``size`` tokens, KV cache
        group ``gid``) request ``request_index`` has written once the step
        wrote the tokens ``[start, end)``; ``rec``: what the ledger held
        for the block before."""
        base = k * size
        begin = max(base, start_tokens) - base
        stop = min(base + size, end_tokens) - base
        if rec is not None and rec[0] == gid and rec[1] == request_index and rec[2] == k:
            # The request's own block again. A rewrite (rejected
            # drafts recomputed, a preempted request resumed into the
            # same block) adds no tokens: written up to the furthest end.
            rec[3] = max(rec[3], stop) if begin <= rec[3] else rec[3] + stop - begin
        else:
            self._filled[block_id] = [gid, request_index, k, stop - begin]

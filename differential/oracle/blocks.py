"""The block-level check: every block a hit hands out, not only its length.

A hit of the right length can still hand out the wrong KV: a null block
inside a sliding window (vLLM PR #17398), one block past what the other
groups proved (vLLM PR #45614), or a block that holds another prompt's
tokens. Outputs then silently differ from a cache-off run, so a violation is
a ``wrong-kv`` finding, the most severe kind.

For each lookup (vLLM ``vllm/v1/core/kv_cache_manager.py``
``KVCacheManager.get_computed_blocks``) and each KV cache group of block
size ``B``, with hit ``h`` tokens:

1. **Count**: the group returns exactly ``h / B`` blocks (vLLM's own tests,
   ``tests/v1/core/test_prefix_caching.py``, assert the same per group).
2. **Window**: attention reads every block it attends to. Full attention
   attends to all of ``[0, h)``; a sliding window of ``W`` tokens to
   ``[h - W + 1, h)`` (``vllm/v1/core/single_type_kv_cache_manager.py``
   ``SlidingWindowManager.get_num_skipped_tokens``), so every block there is
   a real block, never vLLM's null block.
3. **Contents**: every real block at index ``k`` was written, in this group,
   at index ``k``, in full (``B`` tokens), by an earlier request whose tokens
   ``[k * B, (k + 1) * B)`` equal the sibling's, compared by content
   (``Scenario.contents``: a placeholder token of another image, or of
   another cache salt, is another token). Blocks below a window are
   not read (``add_local_computed_blocks`` replaces them with null blocks)
   and are not checked.
4. **Writes**: no ``allocate_slots`` step writes into a block that was not the
   request's alone (vLLM ``vllm/v1/core/block_pool.py``
   ``BlockPool.is_block_writable``: not null, reference count 1, not cached).
5. **Tables** (:func:`table_violations`): after every ``allocate_slots``
   step that had ``p`` tokens processed, a sliding-window or chunked-local
   group's block table holds the null block at every index below ``s // B``,
   where ``s`` are the tokens no later step attends to (``p - W + 1`` minus
   the extra retained tokens for a window of ``W``, the start of ``p``'s
   chunk for chunked local attention), and a real block everywhere the step
   attends to. vLLM PR #14097 made the manager drop the blocks outside the
   window ("block_table becomes [null_block*1000] + [1k:2k]"; now
   ``remove_skipped_blocks``, run by ``allocate_slots`` before it allocates),
   and admission caps a request at its window's blocks on that promise
   (``SingleTypeKVCacheManager.get_num_blocks_to_allocate``: drift
   "would re-introduce the deadlock from issue #39734 or, worse,
   mid-prefill OOM"). A block kept below ``s`` is a ``kept-skipped-block``
   finding; the null block where the step attends, a ``wrong-kv`` one.
   A Mamba group's table (align mode) owes back every state block below
   index ``(p - 1) // B``, the state the next step reads
   (``MambaManager.get_num_skipped_tokens`` is ``p - 1``: align mode, vLLM
   PR #30877, keeps "the state of the last computed token"), judged on the
   blocks holding no cache entry (:func:`_kept_state`; vLLM PR #57253
   proposes keeping cache-registered states).
6. **Slots** (:func:`uncovered_findings`): once a step is allocated (in
   scheduler mode, scheduled), every attention group's block table holds a
   slot for each token the request will then have computed: ``KVCacheManager.allocate_slots``
   is asked for the step's tokens before the step runs ("Allocate new
   blocks for tokens to be computed (`new + lookahead`)", its docstring),
   and the worker writes each token's KV at its slot. A token without a
   slot has its KV written nowhere, or where the table's length says
   another block's slot is: a ``wrong-kv`` finding.
7. **Whole-sequence states** (:func:`_whole_state`): without prefix caching
   a Mamba group runs in ``mamba_cache_mode="none"``, its block the whole
   model length, and after every ``allocate_slots`` step a request's table
   holds exactly ``1 + S`` real blocks for ``S`` speculative tokens: the
   running state and one state per draft token
   (``MambaManager.allocate_new_blocks``: "Allocate extra
   `num_speculative_blocks` blocks for speculative decoding (MTP/EAGLE)
   with linear attention", vllm/v1/core/single_type_kv_cache_manager.py;
   ``MambaSpec.max_memory_usage_bytes`` in vllm/v1/kv_cache_interface.py
   sizes the request at ``1 + num_speculative_blocks`` pages; vLLM PR
   #33726 runs Mamba speculative decoding this way, with
   ``--no-enable-prefix-caching``, "decode state indices will have spec
   tokens on the second axis"). Fewer, or a null block: a
   state the worker writes has no block of its own (``wrong-kv``); more:
   blocks held from the pool that no step writes (``kept-skipped-block``).

A state group (Mamba) is checked by :func:`state_group_violations`: the
count, the state at the hit a real block, nothing past the hit, and the
state's contents: the state after exactly the sibling's tokens before the
hit (``BlockRecord.state_tokens``). Rule 4 covers a state group's writes
too: the running state a step leaves (``preprocess_mamba``,
vllm/v1/worker/mamba_utils.py) must not land in a block another request
holds or one cached for a state at another position: a cached state
changed after it was cached.

The facts come from the driver (:class:`~differential.observation.BlockRecord`,
:class:`~differential.observation.BlockWrite`); nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from differential.findings import Finding, FindingKind, Policy
from differential.observation import (
    BlockRecord,
    ManagerSettings,
    RequestObservation,
    RunObservation,
    StepTable,
)
from differential.oracle.prefix import (
    common_prefix_packed,
    common_prefix_tokens,
    packed_tokens,
    scenario_memo,
)
from differential.scenario import GroupKind, KVCacheGroup, Scenario

__all__ = [
    "GROUP_CHECKS",
    "BlockViolation",
    "TokenView",
    "ViolationKind",
    "attention_violations",
    "check_blocks",
    "render_blocks",
    "state_group_violations",
    "table_violations",
    "uncovered_findings",
]


class ViolationKind(StrEnum):
    """What was wrong with a handed-out block."""

    COUNT = "count"
    """The group returned more or fewer blocks than the hit covers."""
    NULL_IN_WINDOW = "null-in-window"
    """The null block where attention reads."""
    FOREIGN = "foreign"
    """A real block holding other tokens, another position or another group."""
    UNWRITTEN = "unwritten"
    """A real block that no request wrote in full."""
    UNSAFE_WRITE = "unsafe-write"
    """A step wrote into a block that was not the request's alone."""
    STATE_PAST_HIT = "state-past-hit"
    """A state group returned a state other than the one at the hit."""
    KEPT_SKIPPED = "kept-skipped"
    """A step left a real block where no later step attends (not freed)."""


@dataclass(frozen=True)
class BlockViolation:
    """One wrong block.

    Attributes:
        kind: what was wrong.
        group: the KV cache group index.
        block_index: the block's index in the request's block table, in blocks.
        held: what the block held (``None``: the null block or none at all).
        detail: one readable sentence.
    """

    kind: ViolationKind
    group: int
    block_index: int
    held: BlockRecord | None
    detail: str


class TokenView:
    """Which tokens each request wrote, for comparing block contents.

    A writer's tokens are its prompt followed by its sampled tokens
    (``Scenario.output_token``), as the driver feeds them to vLLM, as
    content ids (``Scenario.contents``, ``Scenario.sampled_contents``: the
    image a placeholder token stands for and the request's cache salt count).

    Args:
        scenario: the scenario.
        lookup_order: per request index, its rank among the admitting
            lookups (scheduler mode: ``RequestObservation.lookup_order``);
            ``None``: requests look up in index order (manager mode).
    """

    def __init__(self, scenario: Scenario, lookup_order: dict[int, int] | None = None) -> None:
        self._scenario = scenario
        self._order = lookup_order
        self._prompts = scenario.contents
        # What each request wrote, and how far two requests' tokens agree,
        # depend on the scenario alone: shared by every run judged on it.
        known = scenario_memo(scenario).setdefault("token_view", ({}, {}, {}))
        self._written: dict[int, tuple[int, ...]] = known[0]
        self._common: dict[tuple[int, int], int] = known[1]
        self._packings: dict[tuple[str, int], bytes | None] = known[2]
        # (writer, sibling) -> reach (the lookup order is this run's own)
        self._reach: dict[tuple[int, int], int] = {}

    def written(self, request: int) -> tuple[int, ...]:
        """Every token ``request`` computed KV for."""
        if request not in self._written:
            steps = self._scenario.decode_steps
            self._written[request] = (
                self._prompts[request] + self._scenario.sampled_contents(request)[:steps]
            )
        return self._written[request]

    def looked_up_before(self, writer: int, sibling: int) -> bool:
        """Whether ``writer``'s admitting lookup came before ``sibling``'s, so
        the writer can have written KV the sibling's lookup hands out (a
        request still in flight may: vLLM caches a block when it is
        allocated, computed in the same step)."""
        if self._order is None or writer not in self._order or sibling not in self._order:
            return writer < sibling
        return self._order[writer] < self._order[sibling]

    def reach(self, writer: int, sibling: int) -> int:
        """How far ``writer``'s blocks can hold ``sibling``'s tokens, in
        tokens: :meth:`agreed_tokens` when ``writer`` :meth:`looked_up_before`
        ``sibling``, else -1 (none of them). Kept per run: a lookup hands out
        many blocks of one writer."""
        key = (writer, sibling)
        reach = self._reach.get(key)
        if reach is None:
            reach = self._reach[key] = (
                self.agreed_tokens(writer, sibling)
                if self.looked_up_before(writer, sibling)
                else -1
            )
        return reach

    def agreed_tokens(self, writer: int, sibling: int) -> int:
        """Tokens, from position 0, where ``writer``'s tokens equal ``sibling``'s prompt."""
        key = (writer, sibling)
        if key not in self._common:
            a = self._packed(("written", writer), self.written(writer))
            b = self._packed(("prompt", sibling), self._prompts[sibling])
            self._common[key] = (
                common_prefix_packed(a, b)
                if a is not None and b is not None
                else common_prefix_tokens(self.written(writer), self._prompts[sibling])
            )
        return self._common[key]

    def _packed(self, key: tuple[str, int], tokens: tuple[int, ...]) -> bytes | None:
        if key not in self._packings:
            self._packings[key] = packed_tokens(tokens)
        return self._packings[key]


def _describe(held: BlockRecord | None) -> str:
    if held is None:
        return "the null block"
    if held.writer is None:
        return f"block {held.block_id}, never written in this run"
    if held.state_tokens is not None:
        return (
            f"block {held.block_id}: request {held.writer}'s group-{held.group} state "
            f"after {held.state_tokens} tokens"
        )
    return (
        f"block {held.block_id}: request {held.writer}'s group-{held.group} block "
        f"{held.writer_block_index}, {held.filled_tokens} token(s) written"
    )


def _content_violation(
    group: int,
    block_size_tokens: int,
    index: int,
    held: BlockRecord,
    sibling: int,
    tokens: TokenView,
    read_end_tokens: int | None = None,
) -> BlockViolation | None:
    """Check a real block at ``index`` against the sibling's tokens, up to
    ``read_end_tokens`` (default: the block's end), in tokens."""
    end = (index + 1) * block_size_tokens
    if read_end_tokens is not None:
        end = min(end, read_end_tokens)
    needed = end - index * block_size_tokens
    if held.writer is None or held.filled_tokens < needed:
        return BlockViolation(
            ViolationKind.UNWRITTEN,
            group,
            index,
            held,
            f"group {group} block index {index} is {_describe(held)}; a hit needs "
            f"{needed} of its tokens written",
        )
    if (
        held.group != group
        or held.writer_block_index != index
        or tokens.reach(held.writer, sibling) < end
    ):
        return BlockViolation(
            ViolationKind.FOREIGN,
            group,
            index,
            held,
            f"group {group} block index {index} is {_describe(held)}, not request {sibling}'s "
            f"tokens {index * block_size_tokens}..{end}",
        )
    return None


def _window_start_tokens(group: KVCacheGroup, position_tokens: int) -> int:
    """The first token the token at ``position_tokens`` attends to, in tokens:
    ``position - W + 1`` for a window of ``W`` tokens
    (``SlidingWindowManager.get_num_skipped_tokens``), the start of its chunk
    for chunked local attention (``ChunkedLocalAttentionManager``), 0 for
    full attention."""
    if group.kind.sliding_window_family:
        window = group.sliding_window_tokens or 1
        return max(0, position_tokens - window + 1)
    chunk = group.attention_chunk_size_tokens
    if chunk is not None:
        return position_tokens // chunk * chunk
    return 0


def _skipped_tokens(group: KVCacheGroup, processed_tokens: int, extra_retained: int) -> int:
    """Tokens no step after ``processed_tokens`` processed ones attends to, in
    tokens (a window keeps ``extra_retained`` more below it for a multi-module
    MTP re-prefill, ``SlidingWindowSpec.extra_retained_tokens``)."""
    if group.kind.sliding_window_family:
        return max(0, _window_start_tokens(group, processed_tokens) - extra_retained)
    return _window_start_tokens(group, processed_tokens)


def _read_from_tokens(group: KVCacheGroup, start_tokens: int, prompt_tokens: int | None) -> int:
    """The token from which a step starting at ``start_tokens`` needs every
    block, in tokens (blocks wholly below it may be null).

    An R-SWA group (``RSWAManager.remove_skipped_blocks`` with
    ``num_prompt_tokens``) attends to the whole prompt and the last
    ``rswa_window`` tokens: the gap between them, blocks wholly in
    ``[prompt, start - rswa_window)``, may be null, the prompt's may not; the
    table records only where its nulls end, so that end is bounded by the
    window's start (a null prompt block below it is not seen here)."""
    if group.kind is GroupKind.RSWA and prompt_tokens is not None:
        return max(prompt_tokens, start_tokens - (group.sliding_window_tokens or 0))
    return _window_start_tokens(group, start_tokens)


def _rswa_gap_end(group: KVCacheGroup, processed_tokens: int, prompt_tokens: int | None) -> int:
    """One past the last block of an R-SWA group's decode gap after a step
    that had ``processed_tokens`` processed, in blocks; 0 when the gap holds
    no whole block (or the group is no R-SWA group, or the prompt is unknown).

    vLLM ``RSWAManager.remove_skipped_blocks``
    (vllm/v1/core/single_type_kv_cache_manager.py) frees the blocks wholly
    in ``[ceil(L / B) * B, max(L, p - rswa_window))``, which "bounds
    per-request KV memory at O(prefix_len + rswa_window) instead of growing
    linearly with decode length" (vLLM PR #46564)."""
    if group.kind is not GroupKind.RSWA or prompt_tokens is None:
        return 0
    size = group.block_size_tokens
    window = group.sliding_window_tokens or 0
    end = max(prompt_tokens, processed_tokens - window) // size
    return end if end > -(-prompt_tokens // size) else 0


def table_violations(
    scenario: Scenario,
    tables: Sequence[StepTable],
    extra_retained_tokens: int,
    prompt_tokens: int | None = None,
) -> tuple[list[BlockViolation], list[BlockViolation]]:
    """Rule 5 of the module docstring over one request's step tables.

    Args:
        scenario: the scenario (each group's kind, block, window or chunk).
        tables: the request's tables, one per step and attention group.
        extra_retained_tokens: tokens a sliding window keeps below itself
            (``max(0, num_prefill_lookahead_tokens - 1)``, as vLLM's planner
            sets ``SlidingWindowSpec.extra_retained_tokens``), in tokens.
        prompt_tokens: the request's prompt length, in tokens (an R-SWA
            group frees decoded blocks above it); ``None``: unknown.

    Returns:
        (null blocks where a step attends, real blocks kept below what every
        later step skips, or at the top of an R-SWA group's decode gap,
        :func:`_rswa_gap_end`): the first of each per group, in step order.
    """
    freed: list[BlockViolation] = []
    kept: list[BlockViolation] = []
    seen_freed: set[int] = set()
    seen_kept: set[int] = set()
    groups = scenario.kv_cache_groups
    for t in tables:
        if t.group >= len(groups):
            continue
        group = groups[t.group]
        size = group.block_size_tokens
        if t.first_unregistered is not None:
            if t.group not in seen_kept and (bad := _kept_state(t, size)) is not None:
                seen_kept.add(t.group)
                kept.append(bad)
            continue
        if group.kind is GroupKind.MAMBA:
            _whole_state(scenario, t, (freed, seen_freed), (kept, seen_kept))
            continue
        skipped = _skipped_tokens(group, t.processed_tokens, extra_retained_tokens)
        freed_below = min(skipped // size, t.num_blocks)
        if t.first_real < freed_below and t.group not in seen_kept:
            seen_kept.add(t.group)
            kept.append(
                BlockViolation(
                    ViolationKind.KEPT_SKIPPED,
                    t.group,
                    t.first_real,
                    None,
                    f"after the step at {t.processed_tokens} processed tokens group {t.group} "
                    f"still holds a real block at block index {t.first_real} (tokens "
                    f"{t.first_real * size}..{(t.first_real + 1) * size}); no later step "
                    f"attends below token {skipped}, so blocks 0..{freed_below - 1} are due "
                    "back to the pool",
                )
            )
        gap_end = _rswa_gap_end(group, t.processed_tokens, prompt_tokens)
        if gap_end and t.null_end < min(gap_end, t.num_blocks) and t.group not in seen_kept:
            seen_kept.add(t.group)
            index = min(gap_end, t.num_blocks) - 1
            kept.append(
                BlockViolation(
                    ViolationKind.KEPT_SKIPPED,
                    t.group,
                    index,
                    None,
                    f"after the step at {t.processed_tokens} processed tokens R-SWA group "
                    f"{t.group} still holds a real block at block index {index} (tokens "
                    f"{index * size}..{(index + 1) * size}), in the decode gap between the "
                    f"{prompt_tokens}-token prompt and the last {group.sliding_window_tokens} "
                    "tokens, which no later step attends to",
                )
            )
        read_from = _read_from_tokens(group, t.start_tokens, prompt_tokens) // size
        if t.null_end > read_from and t.group not in seen_freed:
            seen_freed.add(t.group)
            index = t.null_end - 1
            freed.append(
                BlockViolation(
                    ViolationKind.NULL_IN_WINDOW,
                    t.group,
                    index,
                    None,
                    f"after the step at {t.start_tokens} tokens group {t.group} block index "
                    f"{index} is the null block, inside the tokens "
                    f"{read_from * size}..{t.start_tokens} the step attends to",
                )
            )
    return freed, kept


def _whole_state(
    scenario: Scenario,
    table: StepTable,
    freed: tuple[list[BlockViolation], set[int]],
    kept: tuple[list[BlockViolation], set[int]],
) -> None:
    """Rule 7 of the module docstring, on one step's table of a Mamba group
    outside align mode: exactly ``1 + S`` real blocks for ``S`` speculative
    tokens. Fewer: a state the worker writes has no block of its own
    (``freed``, a ``wrong-kv`` finding); more: blocks no step writes are
    held from the pool (``kept``, a ``kept-skipped-block`` finding). The
    first per group is added to each list, its group to the list's set."""
    owed = 1 + scenario.drafter.num_speculative_tokens
    if table.null_end or table.num_blocks < owed:
        target, seen = freed
        kind, why = ViolationKind.COUNT, "a state the worker writes has no block of its own"
    elif table.num_blocks > owed:
        target, seen = kept
        kind, why = ViolationKind.KEPT_SKIPPED, "the blocks past them are held from the pool"
    else:
        return
    if table.group in seen:
        return
    seen.add(table.group)
    target.append(
        BlockViolation(
            kind,
            table.group,
            min(table.num_blocks, owed) if kind is ViolationKind.KEPT_SKIPPED else 0,
            None,
            f"after the step at {table.start_tokens} tokens Mamba group {table.group} (no "
            f"prefix caching, mamba_cache_mode 'none') holds {table.num_blocks} block(s)"
            + (f", {table.null_end} of them null" if table.null_end else "")
            + f"; it owes {owed} real ones, the running state and one per speculative token "
            f"({owed - 1}): {why}",
        )
    )


def _kept_state(table: StepTable, size: int) -> BlockViolation | None:
    """Rule 5 for a state group's table: after a step that leaves ``p``
    processed tokens, the next step reads only the state after ``p`` tokens,
    in the block at index ``(p - 1) // B`` (``MambaManager.get_num_skipped_tokens``
    is ``p - 1``), so a real block below it that holds no prefix-cache entry
    is due back to the pool. A block that does hold one is not judged: vLLM
    PR #57253 proposes keeping cache-registered states out of retirement."""
    due = max(0, table.processed_tokens - 1) // size
    index = table.first_unregistered
    if index is None or index >= min(due, table.num_blocks):
        return None
    return BlockViolation(
        ViolationKind.KEPT_SKIPPED,
        table.group,
        index,
        None,
        f"after the step at {table.processed_tokens} processed tokens Mamba group "
        f"{table.group} still holds a state block with no cache entry at block index {index} "
        f"(tokens {index * size}..{(index + 1) * size}); the next step reads only the state "
        f"at block index {due}, so the states below it are due back to the pool",
    )


def _extra_retained(settings: ManagerSettings | None) -> int | None:
    """``SlidingWindowSpec.extra_retained_tokens`` for a run's settings (``None``:
    not recorded)."""
    if settings is None:
        return None
    return max(0, settings.num_prefill_lookahead_tokens - 1)


def attention_violations(
    group: KVCacheGroup,
    gid: int,
    hit_tokens: int,
    blocks: Sequence[BlockRecord | None],
    sibling: int,
    tokens: TokenView,
) -> list[BlockViolation]:
    """Violations of an attention group's lookup (full attention or sliding window).

    Args:
        group: the group's geometry.
        gid: its index.
        hit_tokens: the lookup's hit, in tokens.
        blocks: the blocks it returned for the group, in block-table order.
        sibling: the looking-up request's index.
        tokens: the scenario's tokens.

    Returns:
        Every violation, count first, then by block index.
    """
    size = group.block_size_tokens
    # With fine-grained hits (a hash block finer than the block) a hit may end
    # inside a block, which is then handed out and read up to the hit.
    owed = -(-hit_tokens // size)
    out: list[BlockViolation] = []
    if len(blocks) != owed:
        extra = ""
        if len(blocks) > owed:
            extra = f"; block index {owed} past the hit is {_describe(blocks[owed])}"
        out.append(
            BlockViolation(
                ViolationKind.COUNT,
                gid,
                min(owed, len(blocks)),
                blocks[owed] if len(blocks) > owed else None,
                f"group {gid} returned {len(blocks)} blocks for a hit of {hit_tokens} "
                f"tokens ({owed} blocks of {size}){extra}",
            )
        )
    first_read = _window_start_tokens(group, hit_tokens) // size
    for index, held in enumerate(blocks[:owed]):
        if held is None:
            if index >= first_read:
                out.append(
                    BlockViolation(
                        ViolationKind.NULL_IN_WINDOW,
                        gid,
                        index,
                        None,
                        f"group {gid} block index {index} is the null block, inside the "
                        f"tokens {first_read * size}..{hit_tokens} attention reads",
                    )
                )
            continue
        if index < first_read:
            continue  # below the window: never read
        bad = _content_violation(gid, size, index, held, sibling, tokens, hit_tokens)
        if bad is not None:
            out.append(bad)
    return out


def state_group_violations(
    group: KVCacheGroup,
    gid: int,
    hit_tokens: int,
    blocks: Sequence[BlockRecord | None],
    sibling: int,
    tokens: TokenView,
) -> list[BlockViolation]:
    """Violations of a state group's lookup (a Mamba-style recurrent state).

    A state group holds one state per block boundary and a hit needs only the
    state at the hit (vLLM ``MambaManager.find_longest_cache_hit`` pads the
    blocks below it with null blocks): ``ceil(h / B)`` blocks (a fine-grained
    hit may end inside a block), the last one real, nothing past the hit.

    **Contents**: a state sums every token before it, so the last block must
    hold the state after exactly ``h`` tokens (``BlockRecord.state_tokens``),
    in this group, written by an earlier request whose tokens ``[0, h)``
    equal the sibling's (vLLM's own end-to-end test of vLLM #43559 compares
    greedy outputs with prefix caching on and off: a state for other tokens,
    or for another position, is silent output corruption). The driver's
    ledger follows where the model runner keeps each step's state
    (:class:`~differential.driver.block_ledger.BlockLedger`); a state it does
    not follow (``state_tokens`` ``None`` with a writer: a step with drafts)
    is not judged, and a state never written in the run is ``unwritten``; a
    block whose last write was another group's (attention KV, or another
    state group's state) is ``foreign`` whatever it held.
    A state the lookup's own scheduler step writes is not there yet
    (``BlockRecord.written_in_step_by``: the forward that writes it also
    reads it; vLLM's ``MambaManager.get_num_blocks_to_allocate`` defers such
    a hit, "Mamba can't rely on blocks generated by other requests in the
    current step"): the record describes what the block held before.
    Same arguments as :func:`attention_violations`.
    """
    size = group.block_size_tokens
    # A fine-grained hit ends inside a block, whose state is the hit's.
    owed = -(-hit_tokens // size)
    out: list[BlockViolation] = []
    if len(blocks) > owed:
        out.append(
            BlockViolation(
                ViolationKind.STATE_PAST_HIT,
                gid,
                owed,
                blocks[owed],
                f"group {gid} returned {len(blocks)} states for a hit of {hit_tokens} tokens: "
                f"block index {owed} past the hit is {_describe(blocks[owed])}",
            )
        )
    elif len(blocks) < owed:
        out.append(
            BlockViolation(
                ViolationKind.COUNT,
                gid,
                len(blocks),
                None,
                f"group {gid} returned {len(blocks)} blocks for a hit of {hit_tokens} "
                f"tokens ({owed} blocks of {size})",
            )
        )
    if owed and len(blocks) >= owed:
        held = blocks[owed - 1]
        if held is None:
            out.append(
                BlockViolation(
                    ViolationKind.NULL_IN_WINDOW,
                    gid,
                    owed - 1,
                    None,
                    f"group {gid} has the null block where the state at {hit_tokens} is due",
                )
            )
        else:
            bad = _state_violation(gid, owed - 1, held, hit_tokens, sibling, tokens)
            if bad is not None:
                out.append(bad)
    return out


def _state_violation(
    gid: int, index: int, held: BlockRecord, hit_tokens: int, sibling: int, tokens: TokenView
) -> BlockViolation | None:
    """Check the state block at ``index`` a hit of ``hit_tokens`` hands the
    sibling: the state after exactly the sibling's tokens ``[0, hit)``."""
    same_step = (
        ""
        if held.written_in_step_by is None
        else f" (request {held.written_in_step_by}'s step in the same scheduler step writes "
        "its state: that forward runs with the one reading it, so the lookup reads the "
        "block as it was before)"
    )
    if held.writer is None:
        return BlockViolation(
            ViolationKind.UNWRITTEN,
            gid,
            index,
            held,
            f"group {gid} block index {index} is {_describe(held)}{same_step}; a hit of "
            f"{hit_tokens} tokens needs the state after them",
        )
    if held.state_tokens is None and held.group == gid:
        return None  # a state the driver does not follow
    if (
        held.group != gid
        or held.state_tokens != hit_tokens
        or tokens.reach(held.writer, sibling) < hit_tokens
    ):
        return BlockViolation(
            ViolationKind.FOREIGN,
            gid,
            index,
            held,
            f"group {gid} block index {index} is {_describe(held)}{same_step}, not the state "
            f"after request {sibling}'s tokens 0..{hit_tokens}",
        )
    return None


def ring_violations(
    group: KVCacheGroup,
    gid: int,
    hit_tokens: int,
    blocks: Sequence[BlockRecord | None],
    sibling: int,
    tokens: TokenView,
) -> list[BlockViolation]:
    """Violations of a lookup of a group that is not prefix-cacheable (a
    circular buffer, a bounded-replay sliding-window MLA group): any block
    at all.

    A ring holds the raw keys of the token group a KV compressor has not
    compressed yet, one block per request (vLLM ``CircularBufferSpec``); it is
    not prefix-cacheable, ``HybridKVCacheCoordinator`` looks none of it up and
    leaves its slot of the hit empty, and the new request claims a fresh
    ring (``CircularBufferManager._claim_ring_block``). A ring block handed to
    a hit would hold another request's open group. A bounded-replay group
    (vLLM PR #56227) is rebuilt by replaying the hit's last window, never
    adopted. Arguments as :func:`attention_violations`.
    """
    if not blocks:
        return []
    return [
        BlockViolation(
            ViolationKind.COUNT,
            gid,
            0,
            blocks[0],
            f"group {gid} ({group.kind.value}, block {group.block_size_tokens}) returned "
            f"{len(blocks)} blocks for a hit of {hit_tokens} tokens: a "
            f"{'bounded-replay group' if group.bounded_replay else 'circular buffer'} is not "
            "prefix-cacheable and owes none",
        )
    ]


GroupCheck = Callable[
    [KVCacheGroup, int, int, Sequence[BlockRecord | None], int, TokenView], list[BlockViolation]
]

GROUP_CHECKS: dict[GroupKind, GroupCheck] = {
    GroupKind.FULL_ATTENTION: attention_violations,
    GroupKind.SLIDING_WINDOW: attention_violations,
    GroupKind.MAMBA: state_group_violations,
    GroupKind.MLA: attention_violations,
    GroupKind.SLIDING_WINDOW_MLA: attention_violations,
    GroupKind.CHUNKED_LOCAL_ATTENTION: attention_violations,
    GroupKind.CIRCULAR_BUFFER: ring_violations,
    # SinkFullAttentionManager inherits FullAttentionManager's lookup; the
    # sink is no request's prefix, so a hit owes exactly full attention's.
    GroupKind.SINK_FULL_ATTENTION: attention_violations,
    GroupKind.RSWA: attention_violations,
}
"""The check for each group kind (a state kind: :func:`state_group_violations`)."""


def _sink_write(sink_blocks: int) -> str:
    """Why a write into a static sink's block is unsafe.

    The sink is learned KV shared by every request and part of none's
    prefix: ``create_static_sink_attention_backend``
    (vllm/model_executor/layers/attention/static_sink_attention.py) prepends
    the physical blocks ``1 .. sink_len / block_size`` to every block table
    and ``StaticSinkAttention.populate_sink_kv`` writes the sink there once.
    vLLM PR #28775 therefore takes those blocks off the free list
    (``SinkFullAttentionManager``: ``free_block_queue.popleft_n``); a request
    handed one writes its own KV over the sink every later step reads (every
    group's layers alias the memory of a block id).
    """
    return (
        f"one of the static sink's blocks (physical blocks 1-{sink_blocks}, which the "
        "attention backend reads as the sink: never handed to a request, vLLM PR #28775)"
    )


def request_violations(
    scenario: Scenario,
    obs: RequestObservation,
    tokens: TokenView,
    freed_early: Sequence[BlockViolation] = (),
) -> list[BlockViolation]:
    """Every violation of one request's lookup and steps (``freed_early``: its
    steps' null blocks where they attend, from :func:`table_violations`)."""
    out: list[BlockViolation] = []
    # A KV connector's divergent hybrid lookup hands out each group's own hit
    # (vLLM KVCacheManager.get_computed_blocks_for_connector).
    divergent = obs.connector is not None and obs.connector.divergent_hit_kept
    for gid, (group, blocks) in enumerate(
        zip(scenario.kv_cache_groups, obs.lookup_blocks, strict=False)
    ):
        hit = obs.per_group_hit_tokens[gid] if divergent else obs.hit_tokens
        check = GROUP_CHECKS[group.kind] if group.prefix_cacheable else ring_violations
        out += check(group, gid, hit, blocks, obs.index, tokens)
    sink_blocks = scenario.num_sink_blocks
    for write in obs.unsafe_writes:
        why = (
            "the null block"
            if write.null
            else _sink_write(sink_blocks)
            if 1 <= write.block_id <= sink_blocks
            else f"whose prefix-cache entry is the state after {write.cached_state_tokens} "
            "tokens: a cached state changed after it was cached"
            if write.cached_state_tokens is not None
            else "whose prefix-cache entry already covers them"
            if write.cached
            else f"which request {write.held_by}'s block table holds (ref_cnt {write.ref_cnt})"
            if write.held_by is not None
            else f"held by {write.ref_cnt} request(s)"
        )
        out.append(
            BlockViolation(
                ViolationKind.UNSAFE_WRITE,
                write.group,
                write.block_index,
                None,
                f"the step at {write.position_tokens} tokens writes group {write.group} "
                f"block index {write.block_index} (block {write.block_id}), {why}",
            )
        )
    # A step's table null already named (handed out by the lookup, or written
    # into) is one violation, not two.
    named = {(v.group, v.block_index) for v in out}
    out += [v for v in freed_early if (v.group, v.block_index) not in named]
    return out


def uncovered_findings(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM
) -> list[Finding]:
    """Rule 6 of the module docstring: one ``wrong-kv`` finding per request
    with a step whose tokens an attention group's table holds no slot for
    (``RunObservation.uncovered_steps``), naming the first such step and
    group; the rest are counted."""
    if run.unsupported is not None:
        return []
    first: dict[int, tuple[int, int, int, int]] = {}
    count: dict[int, int] = {}
    for request, step, group, computed, held in run.uncovered_steps:
        if computed <= held:
            continue
        first.setdefault(request, (step, group, computed, held))
        count[request] = count.get(request, 0) + 1
    findings = []
    for request, (step, group, computed, held) in sorted(first.items()):
        g = scenario.kv_cache_groups[group]
        more = f" (+{count[request] - 1} more)" if count[request] > 1 else ""
        findings.append(
            Finding(
                FindingKind.WRONG_KV,
                run.variant,
                request,
                f"step {step} computes the request up to {computed} tokens, but group {group} "
                f"({g.kind.value}, block {g.block_size_tokens}) holds slots for {held}: "
                f"allocate_slots gave the step's tokens no block{more}",
                policy=policy,
            )
        )
    return findings


def check_blocks(
    scenario: Scenario,
    run: RunObservation,
    policy: Policy = Policy.VLLM,
    *,
    label: str = "",
) -> tuple[Finding, ...]:
    """``wrong-kv`` findings for one run: one per request with violations.

    Args:
        scenario: the scenario.
        run: the run; nothing is checked unless ``run.blocks_recorded``, nor
            a manager-mode run that evicted (a scheduler-mode one is: the
            ledger follows every block a step writes, an evicted block's
            included, and a lookup never hands out an evicted block).
        policy: the policy judging (recorded on the findings).
        label: prefix for the detail, e.g. ``"dense cross-check run: "``.

    Returns:
        One ``wrong-kv`` finding per request with violations, naming the
        first (group, block index, what it held) and how many more there
        are, with the lookup's block ids per group in ``blocks_per_group``;
        and one ``kept-skipped-block`` finding per request whose steps kept a
        block no later step attends to (rule 5), naming the first per group.
    """
    if not run.blocks_recorded or run.unsupported is not None:
        return ()
    if run.evicted_blocks and run.mode != "scheduler":
        return ()
    order = {r.index: r.lookup_order for r in run.requests if r.lookup_order is not None} or None
    tokens = TokenView(scenario, order)
    findings = []
    extra = _extra_retained(run.settings)
    for obs in run.requests:
        freed, kept = (
            table_violations(scenario, obs.step_tables, extra, len(scenario.prompts[obs.index]))
            if extra is not None
            else ([], [])
        )
        if kept:
            more = f" (+{len(kept) - 1} more group(s))" if len(kept) > 1 else ""
            findings.append(
                Finding(
                    FindingKind.KEPT_SKIPPED_BLOCK,
                    run.variant,
                    obs.index,
                    f"{label}{kept[0].detail}{more}",
                    hit_tokens=obs.hit_tokens,
                    policy=policy,
                )
            )
        violations = request_violations(scenario, obs, tokens, freed)
        if not violations:
            continue
        more = f" (+{len(violations) - 1} more)" if len(violations) > 1 else ""
        findings.append(
            Finding(
                FindingKind.WRONG_KV,
                run.variant,
                obs.index,
                f"{label}{violations[0].detail}{more}",
                hit_tokens=obs.hit_tokens,
                expected_tokens=obs.hit_tokens,
                policy=policy,
                blocks_per_group=obs.lookup_block_ids,
            )
        )
    return tuple(findings)


def render_blocks(block_ids: Sequence[int | None], *, edge: int = 8) -> str:
    """A block list for people: ids, ``null`` for the null block, long runs elided.

    Shows the first and the last ``edge`` entries of a longer list, e.g.
    ``[null, null, …(40 more)…, 17, 18]``.
    """
    shown = ["null" if b is None else str(b) for b in block_ids]
    if len(shown) > 2 * edge + 1:
        shown = [*shown[:edge], f"…({len(shown) - 2 * edge} more)…", *shown[-edge:]]
    return "[" + ", ".join(shown) + "]"

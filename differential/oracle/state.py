"""Oracle rules for state groups (Mamba / linear attention), from first principles.

Nothing here imports vLLM. A *state group* (``GroupKind.MAMBA``) does not keep
one KV entry per token: a block holds one recurrent state, the state after
exactly the tokens up to one position. So a state group can serve a hit at
position ``p`` only if a state *at exactly* ``p`` was kept, whereas an
attention group serves every position up to what it proves. The rules:

1. **Where a state exists after a writer ran** (:func:`state_positions`).
   A state is materialized only where a prefill step of the writer ended (the
   running state after the step); it is kept (cached) only at such a step end
   that is

   * on the block grid (a multiple of the Mamba block ``B_m``), or
   * the writer's EAGLE resume position, the highest position a resend of its
     prompt can resume at (:func:`differential.oracle.core.replay_boundaries`
     at the hit alignment ``A``; only with fine-grained hits, where ``A`` is
     finer than ``B_m``), or
   * its pinned shared-prefix junction, with the shared-prefix checkpoint
     option in effect (EAGLE drop, fine-grained hits, no re-prefill tail).

   Step ends come from the prefill mode and the chunk budget (the step
   budget, :attr:`Scenario.step_budget_tokens`: ``max_num_batched_tokens``
   when the workload sets it, as both drivers schedule): ``block`` ends a
   step at every block boundary (and wherever the budget runs out before
   one); ``scheduler`` (vLLM's own chunking) spends the budget, ends long
   steps on the block grid, and must stop at the block grid's resume
   position, at the EAGLE resume position and at the junction
   (floored to the block grid without the option), since a state skipped
   there can never be recovered. ``checkpoint`` (a Mamba layer that exports
   the prompt's checkpoint state from inside a step: one prefill checkpoint
   block, as vLLM 0.33.0's ``MambaMixer2`` and, on the prefix-cache grid,
   the GDN layers declare, vllm/model_executor/layers/mamba/) chunks as
   ``scheduler`` does, except that a final step able to export the
   checkpoint (:func:`_exports_checkpoint`) need not stop at it: it keeps
   the state there from inside, and runs on to the prompt's end ("The
   block-boundary state can be exported from inside one forward pass, so
   the scheduler need not split the prefill", ``MambaMixer2.get_kv_cache_spec``).
2. **What a sibling is owed**: the highest position every group can serve.
   Attention groups prove a prefix (:func:`attention_dense_hit`: the dense
   reference over attention groups, with fine-grained hits proving per hash
   block and dropping one hash block under the EAGLE drop); a state group
   serves only positions where the writer kept a state. The dense reference
   is the highest writer state at or below the attention proof; ``ideal``
   owes the attention proof floored to the block grid (a state at every
   block boundary the writer computed).
3. **The one-unit rule for state checkpoints**: every boundary ``b`` the
   writer retains (periodic ``k*R``, replay boundaries, the junction) and
   ``b - A`` promise, in a state group, the highest state the writer
   materialized at or below them: a lookup resuming at ``b`` falls back to
   the state below it, and retention must not discard that state. Dense
   retention keeps every materialized state. A boundary's sliding-window
   tail (and its peek block under the drop) is the writer's own, so with
   sliding-window groups the promise reaches only as far as the writer
   alone proves for the sibling (as the attention oracle's per-writer dense
   hit does); full-attention blocks are all kept.
4. **Over-hit**: the dense reference bounds every hit, so a hit that no
   state can justify (past the point the attention groups prove, or past
   the highest state below it) is reported by the verdicts as ``over-hit``.

A block-level check of which state block a hit adopted plugs in through
:func:`state_group_indices` (the groups whose blocks are states, one block at
one position).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from differential.findings import Policy
from differential.oracle.prefix import (
    common_prefix_tokens,
    scenario_memo,
    shared_prefixes,
    written_contents,
)
from differential.scenario import GroupKind, MambaPrefill, Scenario

__all__ = [
    "attention_dense_hit",
    "attention_proofs",
    "decode_states",
    "floor_state",
    "state_group_indices",
    "state_positions",
    "state_references",
    "written_extent",
]


def state_group_indices(scenario: Scenario) -> tuple[int, ...]:
    """Indices of the scenario's state groups (one block = one state)."""
    return tuple(i for i, g in enumerate(scenario.kv_cache_groups) if g.kind is GroupKind.MAMBA)


def attention_dense_hit(
    scenario: Scenario,
    drop: bool,
    hash_lookahead_tokens: int,
    cached_tokens: int,
    total_tokens: int,
    sibling_prompt_tokens: int,
    shared_tokens: int,
    hashed_tokens: int | None = None,
    *,
    lookup: bool = True,
) -> int:
    """What every attention group proves for a sibling, in tokens.

    The largest multiple of ``A`` at most ``L - 1`` such that, in every
    attention group, the tokens up to it (plus one drop unit under the EAGLE
    drop) are cached by the writer and match. A group's proof unit is its
    block; with fine-grained hits a sliding-window group's block equals the
    hash block, and a full-attention group proves its whole blocks plus the
    one partial block the writer's prompt ends in, keyed only at the prompt's
    last usable hash boundary (a resend's reach), and drops one hash block
    under the EAGLE drop. ``total_tokens`` is the writer's prompt length,
    ``cached_tokens`` how far its finalized KV reaches (its answer's
    included: :func:`differential.oracle.core.writer_extent`) and
    ``hashed_tokens`` how far its block hashes reach (default: its prompt
    less the lookahead tokens). With fine-grained hits and ``lookup`` (the
    hit vLLM can land on) full attention proves only what its one lookup at
    the sibling's ``L - 1`` (plus one hash unit under the drop) finds, whole
    blocks and the partial key below it: a block that length cuts proves
    nothing past its start; without ``lookup`` (the positions the sibling
    reaches, which the one-unit rule's boundaries are held to) it proves
    every hash block it shares. A state group
    only bounds the hit by the tokens its state's hash covers (the shared
    tokens less the lookahead);
    it takes no drop, since the drafter's KV lives in attention layers.
    Under the drop only the groups that take it
    (:attr:`Scenario.drop_group_indices`) prove the extra unit.
    """
    if hashed_tokens is None:
        hashed_tokens = total_tokens - hash_lookahead_tokens
    alignment = scenario.effective_hit_alignment_tokens
    limit = sibling_prompt_tokens - 1
    drops = scenario.drop_group_indices
    for index, group in enumerate(scenario.kv_cache_groups):
        if group.kind is GroupKind.MAMBA:
            limit = min(limit, shared_tokens - hash_lookahead_tokens, hashed_tokens)
            continue
        block = group.block_size_tokens
        extent = min(cached_tokens, hashed_tokens)
        reach = max(0, min(shared_tokens - hash_lookahead_tokens, extent))
        proven = reach // block * block
        unit = block
        if scenario.partial_hash_hits:
            unit = alignment
            if lookup and group.kind.full_attention_family:
                # Full attention looks up once, at the coordinator's length
                # (L - 1, one hash unit more under the drop, within the
                # sibling's hashes), and hits the whole blocks and the one
                # cached partial block below it; a lower candidate only trims
                # that hit (HybridKVCacheCoordinator.find_longest_cache_hit:
                # "full attention is downward-closed"). So a block the length
                # cuts proves nothing past its start.
                length = sibling_prompt_tokens - 1
                if drop and index in drops:
                    length = min(length + alignment, sibling_prompt_tokens // alignment * alignment)
                reach = min(reach, length)
                proven = reach // block * block
            # The one partial key: the prompt's last hash boundary a lookup
            # can use (the whole prompt under the drop, else all but its last
            # token).
            last = total_tokens if drop else total_tokens - 1
            tail_key = min(last, total_tokens - hash_lookahead_tokens) // alignment * alignment
            if group.kind.full_attention_family and proven < tail_key <= reach:
                proven = tail_key
        # Only the groups that take the drop prove one more unit
        # (``KVCacheCoordinator.eagle_group_ids``: the drafter's groups when
        # they are marked ``is_eagle_group``).
        limit = min(limit, proven - (unit if drop and index in drops else 0))
    return max(0, limit) // alignment * alignment


def _resume_position(length: int, unit: int, drop: bool, hash_lookahead_tokens: int) -> int:
    """The highest multiple of ``unit`` a resend of a ``length``-token prompt
    resumes at: the last token (or, with lookahead hashes, the lookahead
    tokens) is recomputed, and the EAGLE drop gives back one more unit."""
    proof = length if drop else length - max(1, hash_lookahead_tokens)
    return max(proof // unit * unit - (unit if drop else 0), 0)


def _shared_prefix_checkpoint(scenario: Scenario, drop: bool, reprefillable_tokens: int) -> bool:
    """Whether the shared-prefix state checkpoint option is in effect."""
    return (
        scenario.enable_mamba_shared_prefix_checkpoint
        and drop
        and scenario.partial_hash_hits
        and reprefillable_tokens == 0
    )


def _step_ends(
    scenario: Scenario,
    length: int,
    start: int,
    junction: int,
    drop: bool,
    hash_lookahead_tokens: int,
    prefill_lookahead_tokens: int,
    option: bool,
) -> list[int]:
    """Positions where the writer's prefill steps end, in tokens (rule 1),
    and a final step's exported checkpoint (``MambaPrefill.CHECKPOINT``)."""
    block = scenario.mamba_groups[0].block_size_tokens
    # Both drivers schedule prefill chunks of the step budget
    # (workload.max_num_batched_tokens when set, else prefill_chunk_tokens).
    budget = scenario.step_budget_tokens
    if scenario.mamba_prefill is MambaPrefill.BLOCK:
        # The chunk budget, never crossing a block boundary.
        carved: list[int] = []
        while start < length:
            start = min(start + budget, (start // block + 1) * block, length)
            carved.append(start)
        return carved
    alignment = scenario.effective_hit_alignment_tokens
    grid_resume = _resume_position(length, block, drop, hash_lookahead_tokens)
    tail = (
        _resume_position(length, alignment, drop, hash_lookahead_tokens)
        if scenario.partial_hash_hits
        else 0
    )
    # The prompt's checkpoint the Scheduler splits against, at the hit
    # granularity (the hash block with partial hash hits, else the Mamba block).
    checkpoint = tail if scenario.partial_hash_hits else grid_resume
    hash_block = scenario.effective_hash_block_size_tokens
    ends: list[int] = []
    while start < length:
        end = min(start + budget, length)
        internal = (
            scenario.mamba_prefill is MambaPrefill.CHECKPOINT
            and end >= length
            and _exports_checkpoint(start, end, checkpoint, hash_block, block)
        )
        if end < length and (end // block * block > start or block <= budget):
            end = end // block * block
        junction_stop = (
            junction
            if option and junction <= length
            else start + (junction - start) // block * block
        )
        stops = (
            (start // block + 1) * block if start % block and not internal else 0,
            0 if internal else grid_resume,
            tail if not internal and grid_resume < tail < length else 0,
            junction_stop if start < junction < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        remaining = length - end
        if 0 < remaining < prefill_lookahead_tokens:
            end -= prefill_lookahead_tokens - remaining
        if end <= start:
            break
        if scenario.mamba_prefill is MambaPrefill.CHECKPOINT and (
            end >= length or scenario.retention_interval_tokens != 0
        ):
            exported = _resume_position(end, alignment, drop, hash_lookahead_tokens)
            if _exports_checkpoint(start, end, exported, hash_block, block):
                ends.append(exported)
        ends.append(end)
        start = end
    return ends


def _exports_checkpoint(start: int, end: int, checkpoint: int, hash_block: int, block: int) -> bool:
    """Whether a final prefill step over tokens ``[start, end)`` exports the
    state at ``checkpoint`` from inside itself (``MambaPrefill.CHECKPOINT``:
    a Mamba layer with one prefill checkpoint block at alignment 1, as
    ``MambaMixer2.get_kv_cache_spec`` gives it, vllm/model_executor/layers/
    mamba/mamba_mixer2.py): the step starts on the hash grid, the checkpoint
    lies strictly inside it at least one hash block past its start, and the
    step spans a Mamba block column past the one its initial state is in
    (``is_mamba_prefill_checkpoint_valid``, vllm/v1/kv_cache_interface.py).
    All in tokens."""
    return (
        start % hash_block == 0
        and -(-end // block) - 2 > (start - 1) // block
        and start + hash_block <= checkpoint
        and start < checkpoint < end
    )


def state_positions(
    scenario: Scenario,
    writer: int,
    writer_hit_tokens: int,
    junction_tokens: int,
    drop: bool,
    hash_lookahead_tokens: int,
    reprefillable_tokens: int,
    prefill_lookahead_tokens: int = 0,
) -> tuple[int, ...]:
    """Positions, in tokens, where ``writer`` kept a Mamba state (rule 1).

    Only states the writer computed itself (above its own hit
    ``writer_hit_tokens``) and within its cached extent (its prompt less the
    re-prefillable tail) count. In a multi-turn chat
    (``workload.shares_output``, where a later turn copies the answer) the
    states it kept while decoding count too (:func:`decode_states`);
    otherwise states past its prompt serve no sibling. Returns sorted
    positions, without 0.
    """
    # A function of the scenario and the arguments: each variant's run, its
    # dense cross-check and every sibling of the writer ask the same.
    memo = scenario_memo(scenario)
    key = (
        "state_positions",
        writer,
        writer_hit_tokens,
        junction_tokens,
        drop,
        hash_lookahead_tokens,
        reprefillable_tokens,
        prefill_lookahead_tokens,
    )
    known: tuple[int, ...] | None = memo.get(key)
    if known is not None:
        return known
    length = scenario.requests[writer].prompt_tokens
    block = scenario.mamba_groups[0].block_size_tokens
    option = _shared_prefix_checkpoint(scenario, drop, reprefillable_tokens)
    tail = (
        _resume_position(
            length, scenario.effective_hit_alignment_tokens, drop, hash_lookahead_tokens
        )
        if scenario.partial_hash_hits
        else -1
    )
    cached = min(length - reprefillable_tokens, length - hash_lookahead_tokens)
    chat = scenario.workload.shares_output
    final = length + scenario.decode_steps
    kept = {
        end
        for end in _step_ends(
            scenario,
            length,
            writer_hit_tokens,
            junction_tokens,
            drop,
            hash_lookahead_tokens,
            prefill_lookahead_tokens,
            option,
        )
        if (end % block == 0 or end == tail or (option and end == junction_tokens))
        and (
            end <= cached
            or (
                chat
                and end % block == 0
                and _late_state_kept(
                    end, length, final, hash_lookahead_tokens, reprefillable_tokens
                )
            )
        )
    }
    if chat:
        kept.update(decode_states(scenario, writer, hash_lookahead_tokens, reprefillable_tokens))
    positions = memo[key] = tuple(sorted(p for p in kept if p > 0))
    return positions


def _dense_run_states(
    scenario: Scenario, states: tuple[int, ...], args: tuple[int, int, int, bool, int, int, int]
) -> tuple[int, ...]:
    """The states the writer materializes in the dense-retention run, in
    tokens: ``states`` (:func:`state_positions` of ``scenario`` with
    ``args``), except that checkpoint-exporting Mamba layers under
    ``retention_interval_tokens`` 0 export only the final prefill step's
    checkpoint, where under dense retention every step publishes one
    (``KVCacheCoordinator.get_num_blocks_to_allocate``'s ``prefill_end``,
    vllm/v1/core/kv_cache_coordinator.py: "under dense retention every chunk
    publishes a state")."""
    if scenario.mamba_prefill is not MambaPrefill.CHECKPOINT or (
        scenario.retention_interval_tokens != 0
    ):
        return states
    memo = scenario_memo(scenario)
    dense = memo.get("dense_retention_scenario")
    if dense is None:
        dense = memo["dense_retention_scenario"] = dataclasses.replace(
            scenario, retention_interval_tokens=None
        )
    return state_positions(dense, *args)


def _late_state_kept(
    position: int, length: int, final: int, hash_lookahead_tokens: int, reprefillable_tokens: int
) -> bool:
    """Whether a state on the Mamba block grid at ``position`` (tokens), whose
    block hash or finalized KV the writer's prefill alone does not give
    (``position`` past ``L - k`` or ``L - r``), is cached before its block
    is freed; ``final = L + decode_steps`` is the writer's last computed
    position, ``k`` the lookahead hash tokens and ``r`` the re-prefillable
    tail, in tokens.

    In align mode the state block of the block a step completes is released
    by the next step but one (vllm/v1/core/single_type_kv_cache_manager.py
    ``MambaManager.remove_skipped_blocks`` frees ``last_state_block_idx``,
    which ``allocate_new_blocks`` set when the next step began), so it is
    kept only if one of the ``cache_blocks`` calls before that can key it:
    the next step's ``KVCacheManager.allocate_slots`` (``p + 1`` tokens
    known and computed) and, under speculative decoding, its
    ``Scheduler.update_from_output`` (``p + 2`` known). A hash needs ``k``
    tokens past the block and ``get_num_cacheable_tokens`` holds back the
    last ``r`` computed tokens, so a decoded state is kept when ``k <= 2``
    and ``r <= 1`` (the writer's last state, at ``final``, only with ``k <=
    1`` and ``r = 0``: the request ends there). A prefill step end before
    the prompt's last token is keyed at the latest by the
    ``update_from_output`` after the prompt's last chunk (``L + 1`` tokens
    known, ``L`` computed). Measured on vLLM 0.33.0: FA 16 + Mamba 16, a
    40-token prompt and 17 decode steps keep the decoded state at 48 with
    no drafter, EAGLE, or two-module MTP (lookahead hashes or the drop),
    and lose it with three-module MTP either way.
    """
    k, r = hash_lookahead_tokens, reprefillable_tokens
    if position < length:
        return position + k <= length + 1 and position + r <= length
    return k <= 2 and r <= 1 and position + k <= final + 1 and position + r <= final


def written_extent(
    scenario: Scenario, writer: int, hash_lookahead_tokens: int, reprefillable_tokens: int
) -> tuple[int, int]:
    """``(cached, hashed)``, in tokens: how far ``writer``'s finalized KV and
    its block hashes reach when it is freed, its answer included (the
    rule of :func:`differential.oracle.core.writer_extent`: ``L +
    decode_steps`` computed, less the re-prefillable tail; hashes over its
    ``L + decode_steps + 1`` tokens less the lookahead)."""
    computed = scenario.requests[writer].prompt_tokens + scenario.decode_steps
    return computed - reprefillable_tokens, computed + 1 - hash_lookahead_tokens


def decode_states(
    scenario: Scenario, writer: int, hash_lookahead_tokens: int, reprefillable_tokens: int
) -> tuple[int, ...]:
    """Positions, in tokens, past ``writer``'s prompt where it kept a Mamba
    state while decoding: every multiple of the Mamba block ``B_m`` in
    ``(L, L + decode_steps]`` that is keyed before its block is freed
    (:func:`_late_state_kept`).

    A decode step computes one token, so the running state passes every
    position, and in align mode the state block of the block a step
    completes keeps the state at its end: ``MambaManager.allocate_new_blocks``
    (vllm/v1/core/single_type_kv_cache_manager.py) gives the next step a new
    block and copies the state forward, and ``cache_blocks`` keys the
    completed block once its hash exists (``KVCacheManager.allocate_slots``,
    and ``Scheduler.update_from_output`` under speculative decoding, which
    every drafter with lookahead hashes runs). Decode never stops off the
    block grid, so no partial state is kept past the prompt.
    """
    block = scenario.mamba_groups[0].block_size_tokens
    length = scenario.requests[writer].prompt_tokens
    final = length + scenario.decode_steps
    first = length // block * block + block
    return tuple(
        p
        for p in range(first, final + 1, block)
        if _late_state_kept(p, length, final, hash_lookahead_tokens, reprefillable_tokens)
    )


def _writer_proof(
    scenario: Scenario,
    drop: bool,
    hash_lookahead_tokens: int,
    reprefillable_tokens: int,
    writer: int,
    sibling: int,
    *,
    lookup: bool = True,
) -> int:
    """What ``writer``'s attention blocks alone prove for ``sibling``, in
    tokens (:func:`attention_dense_hit` over their common prefix: the
    writer's prompt, and in a multi-turn chat its answer too, whose blocks
    it cached while decoding, :func:`written_extent`; ``lookup`` as there)."""
    length = scenario.requests[writer].prompt_tokens
    cached, hashed = length - reprefillable_tokens, length - hash_lookahead_tokens
    if scenario.workload.shares_output:
        cached, hashed = written_extent(
            scenario, writer, hash_lookahead_tokens, reprefillable_tokens
        )
    return attention_dense_hit(
        scenario,
        drop,
        hash_lookahead_tokens,
        cached,
        length,
        scenario.requests[sibling].prompt_tokens,
        shared_prefixes(scenario)[sibling][writer]
        if writer < sibling
        else common_prefix_tokens(written_contents(scenario)[writer], scenario.contents[sibling]),
        hashed_tokens=hashed,
        lookup=lookup,
    )


def attention_proofs(
    scenario: Scenario,
    drop: bool,
    hash_lookahead_tokens: int,
    reprefillable_tokens: int,
    num_requests: int,
    *,
    lookup: bool = True,
) -> tuple[int, ...]:
    """Per request, what its attention groups prove from every earlier
    request, in tokens (:func:`attention_dense_hit`, best over writers;
    ``lookup`` as there).

    Attention groups are content-addressed and downward-closed: any writer's
    blocks of the shared prefix serve, so they prove the best over writers (a
    state serves only from the writer that kept it). A request whose hit
    falls short of its proof pins the proof as its shared-prefix junction
    (vLLM ``KVCacheManager.get_computed_blocks``: the hit plus the uncached
    common prefix).
    """
    proofs = []
    for j in range(num_requests):
        proofs.append(
            max(
                (
                    _writer_proof(
                        scenario,
                        drop,
                        hash_lookahead_tokens,
                        reprefillable_tokens,
                        i,
                        j,
                        lookup=lookup,
                    )
                    for i in range(j)
                ),
                default=0,
            )
        )
    return tuple(proofs)


def floor_state(states: Sequence[int], position: int) -> int:
    """The highest state at or below ``position``, in tokens (0 if none)."""
    return max((s for s in states if s <= position), default=0)


def state_references(
    scenario: Scenario,
    drop: bool,
    hash_lookahead_tokens: int,
    reprefillable_tokens: int,
    prefill_lookahead_tokens: int,
    observed_hits: Sequence[int],
    checkpoints_for: Callable[[int, int, int, int], tuple[int, ...]],
    policy: Policy,
) -> list[tuple[int, int, int, int | None, tuple[int, ...]]]:
    """Per request: (divergence, dense, expected, writer, checkpoints), in tokens.

    ``checkpoints_for(writer, junction, up_to, writer_hit)`` returns the
    policy's promised boundaries of a writer (the core's one-unit rule);
    each is mapped to the highest state at or below it (rule 3). A request
    pins as its junction what its attention groups prove when its own hit
    fell short of it (vLLM ``KVCacheManager.get_computed_blocks``: the hit
    plus the uncached common prefix). The dense reference is capped by the
    hit full attention's lookup can land on; a promised boundary counts
    where the sibling reaches it (:func:`attention_dense_hit`'s ``lookup``).
    """
    shared_rows = shared_prefixes(scenario)
    block = scenario.mamba_groups[0].block_size_tokens
    attention_by_request = attention_proofs(
        scenario, drop, hash_lookahead_tokens, reprefillable_tokens, len(observed_hits)
    )
    reach_by_request = attention_proofs(
        scenario,
        drop,
        hash_lookahead_tokens,
        reprefillable_tokens,
        len(observed_hits),
        lookup=False,
    )
    out: list[tuple[int, int, int, int | None, tuple[int, ...]]] = []
    for j in range(len(observed_hits)):
        shared = shared_rows[j]
        attention = attention_by_request[j]
        best_dense, best_expected, best_writer = 0, 0, None
        points: set[int] = {0}
        for i in range(j):
            # Only layouts with a lagging attention type pin junctions
            # (Scenario.pins_junctions).
            # A request that skips reading the prefix cache looks nothing
            # up, so pins nothing (vLLM PR #28194).
            pins = (
                scenario.pins_junctions
                and scenario.reads_prefix_cache(i)
                and observed_hits[i] < attention_by_request[i]
            )
            junction = attention_by_request[i] if pins else 0
            writer = (
                i,
                observed_hits[i],
                junction,
                drop,
                hash_lookahead_tokens,
                reprefillable_tokens,
                prefill_lookahead_tokens,
            )
            states = state_positions(scenario, *writer)
            cap = min(attention, shared[i] - hash_lookahead_tokens)
            dense = floor_state(_dense_run_states(scenario, states, writer), cap)
            best_dense = max(best_dense, dense)
            # A boundary's SWA tail (and its peek block under the drop) is the
            # writer's own: it serves only as far as the writer alone proves.
            # Full-attention blocks are all kept, by any writer.
            shared_reach = min(reach_by_request[j], shared[i] - hash_lookahead_tokens)
            reach = shared_reach
            if scenario.sliding_window_groups:
                own = _writer_proof(
                    scenario, drop, hash_lookahead_tokens, reprefillable_tokens, i, j, lookup=False
                )
                reach = min(reach, own)
            promised = checkpoints_for(i, junction, reach, observed_hits[i])
            mapped = {floor_state(states, c) for c in promised if c <= reach} | {0}
            mapped = {p for p in mapped if p <= dense}
            points.update(mapped)
            if policy is Policy.IDEAL:
                owed = max(dense, max(0, shared_reach) // block * block)
            else:
                owed = max(mapped)
            if owed > best_expected or best_writer is None:
                best_expected, best_writer = owed, i
        if not scenario.reads_prefix_cache(j):
            # Skipping the prefix cache (vLLM PR #28194): owed nothing.
            best_dense, best_expected, best_writer, points = 0, 0, None, {0}
        out.append(
            (max(shared, default=0), best_dense, best_expected, best_writer, tuple(sorted(points)))
        )
    return out

"""The rules between a scenario's fields, split by concern.

Each field's type and range is the JSON form's
(:mod:`differential.scenario.json_form`, checked first); what is left here is
what one field allows given another: the geometry of the groups, retention,
the drafter, the draft groups, Mamba, the workload and the requests. Where a
rule mirrors vLLM's own validation the vLLM function is named. Every check
raises :class:`ScenarioError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from differential.errors import ScenarioError
from differential.scenario.drafter import DROPPING_DRAFTERS, DrafterKind
from differential.scenario.groups import DraftGroups, GroupKind, MambaPrefill
from differential.scenario.multimodal import PlacedInput, placed_inputs, split_input
from differential.scenario.workload import ConnectorLoad, DriveMode, KVEvents, KVEventsView

if TYPE_CHECKING:
    from differential.scenario.model import Scenario

__all__ = [
    "check_connector",
    "check_dcp",
    "check_draft_groups",
    "check_drafter",
    "check_geometry",
    "check_mamba",
    "check_mm_inputs",
    "check_pool",
    "check_requests",
    "check_retention",
    "check_scenario",
    "check_store_grid",
    "check_workload",
]


def check_scenario(s: Scenario) -> None:
    """Every rule, in the order their errors are reported.

    Raises:
        ScenarioError: the first rule ``s`` breaks.
    """
    for i, group in enumerate(s.kv_cache_groups):
        group.validate(f"kv_cache_groups[{i}]")
    # Any mix of kinds, in any order, is accepted: one group runs on
    # vLLM's UnitaryKVCacheCoordinator, several on the
    # HybridKVCacheCoordinator (which needs no full-attention group).
    check_dcp(s)
    check_mamba(s)
    check_geometry(s)
    check_retention(s)
    check_replay(s)
    check_drafter(s)
    check_draft_groups(s)
    check_workload(s)
    check_requests(s)
    check_mm_inputs(s)
    check_pool(s)
    check_max_model_len(s)


#: Group kinds vLLM 0.33.0 serves under decode context parallelism.
DCP_KINDS = (GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.MAMBA)


def check_dcp(s: Scenario) -> None:
    """What vLLM accepts under decode context parallelism (``dcp_world_size > 1``).

    Refused: a sliding-window, sliding-window MLA or chunked-local group
    (``SlidingWindowManager.find_longest_cache_hit`` and
    ``ChunkedLocalAttentionManager.find_longest_cache_hit`` assert "DCP not
    support sliding window attn now" / "chunked local attn";
    ``HybridKVCacheCoordinator.__init__``: "DCP with hybrid KV cache layouts
    only supports full-attention, Mamba, and replicated draft groups"); a
    layout without a full-attention or MLA group (DCP shards attention KV
    only: a Mamba state is not sharded, so it would change nothing); an
    attention group's block that is not a multiple of ``dcp_world_size``
    (``block_size_tokens`` is the sharded block, ``resolve_dcp_kv_block_size``:
    the per-rank block times the ranks).
    """
    dcp = s.dcp_world_size
    if dcp == 1:
        return
    for i, g in enumerate(s.kv_cache_groups):
        if g.kind not in DCP_KINDS:
            raise ScenarioError(
                "dcp_world_size",
                dcp,
                f"1 with a {g.kind.value} group (kv_cache_groups[{i}]): vLLM serves decode "
                "context parallelism on full_attention, mla and mamba groups only",
            )
    if not any(g.kind.full_attention_family for g in s.kv_cache_groups):
        raise ScenarioError(
            "dcp_world_size",
            dcp,
            "1 for a model without full_attention or mla groups (DCP shards attention KV; "
            "a Mamba state is not sharded)",
        )
    for i, g in enumerate(s.kv_cache_groups):
        if g.kind is not GroupKind.MAMBA and g.block_size_tokens % dcp:
            raise ScenarioError(
                f"kv_cache_groups[{i}].block_size_tokens",
                g.block_size_tokens,
                f"a multiple of dcp_world_size {dcp} (the tokens a block spans over the "
                f"{dcp} ranks: the per-rank block times {dcp})",
            )


def check_geometry(s: Scenario) -> None:
    """Some group is prefix-cacheable; the hash block size divides every
    prefix-cacheable group's block (a single group: equals it); a given hit
    alignment equals the derived one."""
    groups = s.kv_cache_groups
    if not s.cacheable_groups:
        # UnitaryKVCacheCoordinator asserts hash_block_size == block_size for
        # a lone circular buffer; HybridKVCacheCoordinator asserts "requires
        # at least one cacheable group" (vllm/v1/core/kv_cache_coordinator.py).
        raise ScenarioError(
            "kv_cache_groups",
            s.group_mix,
            "at least one prefix-cacheable group (circular_buffer and bounded_replay groups "
            "take no part in prefix caching; vLLM's coordinators refuse a layout of them alone)",
        )
    hash_block = s.hash_block_size_tokens
    if hash_block is not None and (
        any(g.block_size_tokens % hash_block for g in s.cacheable_groups)
        or (len(groups) == 1 and hash_block != groups[0].block_size_tokens)
    ):
        # vLLM HybridKVCacheCoordinator.__init__ asserts divisibility;
        # resolve_kv_cache_block_sizes rejects any other value for a
        # single group.
        raise ScenarioError(
            "hash_block_size_tokens",
            hash_block,
            "null or a divisor of every prefix-cacheable group block size "
            f"({[g.block_size_tokens for g in s.cacheable_groups]}); with a single group, "
            "its block size",
        )
    alignment = s.effective_hit_alignment_tokens
    if s.hit_alignment_tokens is not None and s.hit_alignment_tokens != alignment:
        raise ScenarioError(
            "hit_alignment_tokens",
            s.hit_alignment_tokens,
            f"null or {alignment} (vLLM derives it as the hash block size with "
            "fine-grained Mamba hits, else the scheduler block size, the LCM of "
            "the group block sizes)",
        )


def check_retention(s: Scenario) -> None:
    """vLLM ``kv_cache_coordinator._validate_prefix_cache_retention_interval``:
    null, 0 or a positive multiple of the scheduler block size; positive only
    with sliding-window or Mamba groups."""
    r = s.retention_interval_tokens
    if r is None:
        return
    sbs = s.scheduler_block_size_tokens
    if r % sbs:
        raise ScenarioError(
            "retention_interval_tokens",
            r,
            f"null, 0, or a positive multiple of the scheduler block size {sbs}",
        )
    windowed = any(g.kind.sliding_window_family for g in s.kv_cache_groups)
    if r > 0 and not windowed and not s.mamba_groups:
        raise ScenarioError(
            "retention_interval_tokens",
            r,
            "null or 0 for a model without sliding_window or mamba groups "
            "(retention only applies to sliding-window and Mamba groups)",
        )


def check_replay(s: Scenario) -> None:
    """vLLM ``Scheduler.__init__`` asserts that the bounded-replay groups'
    windows agree ("Prefix replay windows should agree": one rewind for
    every group's allocation)."""
    replayed = [(i, g) for i, g in enumerate(s.kv_cache_groups) if g.bounded_replay]
    if not replayed:
        return
    first = replayed[0][1].sliding_window_tokens
    for i, g in replayed[1:]:
        if g.sliding_window_tokens != first:
            raise ScenarioError(
                f"kv_cache_groups[{i}].sliding_window_tokens",
                g.sliding_window_tokens,
                f"{first}, the window of every bounded_replay group (vLLM's Scheduler "
                "asserts that prefix replay windows agree)",
            )


def check_drafter(s: Scenario) -> None:
    """The drafter's kind and token count agree; multi-module MTP fits the
    scheduler block (vLLM ``KVCacheCoordinator.__init__``) and the prefill
    chunk (``Scheduler._reserve_prefill_lookahead`` would never schedule the
    last chunk otherwise)."""
    drafter = s.drafter
    drafter.validate()
    if drafter.kind is not DrafterKind.MULTI_MODULE_MTP:
        return
    sbs = s.scheduler_block_size_tokens
    if sbs < drafter.num_speculative_tokens:
        raise ScenarioError(
            "drafter.num_speculative_tokens",
            drafter.num_speculative_tokens,
            f"at most the scheduler block size {sbs} for multi_module_mtp with prefix caching",
        )
    if s.prefill_chunk_tokens < drafter.num_speculative_tokens:
        raise ScenarioError(
            "prefill_chunk_tokens",
            s.prefill_chunk_tokens,
            f"at least drafter.num_speculative_tokens "
            f"({drafter.num_speculative_tokens}) for multi_module_mtp",
        )


def check_workload(s: Scenario) -> None:
    """The workload against the requests, the step budget and the drafter."""
    w = s.workload
    budget = s.step_budget_tokens
    if w.max_num_seqs is not None and w.max_num_seqs > budget:
        # vLLM SchedulerConfig: max_num_batched_tokens >= max_num_seqs.
        raise ScenarioError(
            "workload.max_num_seqs",
            w.max_num_seqs,
            f"null or at most the token budget per step ({budget} tokens: "
            "workload.max_num_batched_tokens, else prefill_chunk_tokens)",
        )
    if w.arrival_steps is not None:
        if len(w.arrival_steps) != len(s.requests):
            raise ScenarioError(
                "workload.arrival_steps",
                list(w.arrival_steps),
                f"null or a list of {len(s.requests)} steps (one per request)",
            )
        last = 0
        for i, step in enumerate(w.arrival_steps):
            if step < last:
                raise ScenarioError(
                    f"workload.arrival_steps[{i}]",
                    step,
                    f"an integer >= {last} (arrival steps never decrease)",
                )
            last = step
    limit = s.drafter.num_speculative_tokens
    if w.accepted_drafts and limit == 0:
        raise ScenarioError(
            "workload.accepted_drafts", list(w.accepted_drafts), "[] without a drafter"
        )
    for i, n in enumerate(w.accepted_drafts):
        if n > limit:
            raise ScenarioError(
                f"workload.accepted_drafts[{i}]",
                n,
                f"at most drafter.num_speculative_tokens ({limit})",
            )
    if w.mode is DriveMode.MANAGER and w.watermark:
        # One request at a time: no request is ever scheduled beside the one
        # admitted, so vLLM's watermark (applied only then) never applies.
        raise ScenarioError(
            "workload.mode",
            w.mode.value,
            "'scheduler' when watermark is set (vLLM applies the watermark only while "
            "other requests are scheduled; the manager-level driver runs one at a time)",
        )
    check_connector(s)
    if w.abort_steps is not None:
        if w.mode is DriveMode.MANAGER:
            raise ScenarioError(
                "workload.abort_steps",
                list(w.abort_steps),
                "null in manager mode (aborts happen between scheduler steps: "
                "workload.mode 'scheduler')",
            )
        if len(w.abort_steps) != len(s.requests):
            raise ScenarioError(
                "workload.abort_steps",
                list(w.abort_steps),
                f"null or a list of {len(s.requests)} steps or nulls (one per request)",
            )
        if all(step is None for step in w.abort_steps):
            # Aborting nothing, yet not null: the run would be judged as one
            # with aborts (per lookup as scheduled, not exactly).
            raise ScenarioError(
                "workload.abort_steps",
                list(w.abort_steps),
                "null or a list with at least one step (a list of nulls aborts nothing: "
                "write null)",
            )
    if w.kv_events_view is not KVEventsView.PER_COPY and w.kv_events is KVEvents.OFF:
        raise ScenarioError(
            "workload.kv_events_view",
            w.kv_events_view.value,
            "'per-copy' when kv_events is 'off' (a view of a stream needs the stream: "
            "kv_events 'incremental' or 'full')",
        )
    if w.mode is DriveMode.MANAGER and w.async_scheduling:
        # The manager-level driver makes no scheduler steps, so no batch is
        # ever in flight.
        raise ScenarioError(
            "workload.async_scheduling",
            True,
            "false in manager mode (a batch in flight needs vLLM's scheduler steps: "
            "workload.mode 'scheduler')",
        )
    _check_prefill_policy(s)
    _check_prefix_caching(s)
    _check_priorities(s)
    if w.mode is DriveMode.MANAGER and not w.sequential:
        raise ScenarioError(
            "workload.mode",
            w.mode.value,
            "'scheduler' when arrival_steps or accepted_drafts are set "
            "(the manager-level driver runs one request at a time, without drafts)",
        )


def _check_priorities(s: Scenario) -> None:
    """``workload.priorities``: one per request, scheduler mode only (the
    manager-level driver admits one request at a time, in order)."""
    priorities = s.workload.priorities
    if priorities is None:
        return
    if s.workload.mode is DriveMode.MANAGER:
        raise ScenarioError(
            "workload.priorities",
            list(priorities),
            "null in manager mode (vLLM's priority policy orders the Scheduler's queues: "
            "workload.mode 'scheduler')",
        )
    if len(priorities) != len(s.requests):
        raise ScenarioError(
            "workload.priorities",
            list(priorities),
            f"null or a list of {len(s.requests)} integers (one per request)",
        )


def check_connector(s: Scenario) -> None:
    """The connector's remote store (``workload.connector``): scheduler mode
    only, with a configured connector; failed loads name requests and are
    asynchronous (a failed synchronous load is reported by block id only, for
    a single KV cache group, and its blocks stay in the prefix cache until
    recomputed: vllm/v1/core/sched/scheduler.py ``_handle_invalid_blocks``);
    prefix caching off only without Mamba groups (align mode needs it,
    vllm/config/cache.py)."""
    store = s.workload.connector
    if store is None:
        return
    if s.workload.mode is DriveMode.MANAGER:
        raise ScenarioError(
            "workload.connector",
            "a remote store",
            "null in manager mode (a KV connector's store is driven through vLLM's "
            "Scheduler only: workload.mode 'scheduler')",
        )
    if not s.kv_connector:
        raise ScenarioError(
            "workload.connector",
            "a remote store",
            "null unless kv_connector is true (the store is the configured connector's)",
        )
    count = len(s.requests)
    for i, index in enumerate(store.failed_loads):
        if index >= count:
            raise ScenarioError(
                f"workload.connector.failed_loads[{i}]",
                index,
                f"a request index 0..{count - 1}",
            )
        if index in store.failed_loads[:i]:
            raise ScenarioError(
                f"workload.connector.failed_loads[{i}]",
                index,
                "each request at most once (only a request's first load fails)",
            )
    if store.failed_loads and store.load is not ConnectorLoad.ASYNC:
        raise ScenarioError(
            "workload.connector.failed_loads",
            list(store.failed_loads),
            "[] unless workload.connector.load is 'async' (a failed synchronous load is "
            "reported by block id, its blocks left cached until recomputed)",
        )
    if store.divergent_hybrid_hits and not (
        s.mamba_groups and any(g.kind.full_attention_family for g in s.kv_cache_groups)
    ):
        # vLLM's get_computed_blocks_for_connector falls back to
        # get_computed_blocks on any other layout: the flag would do nothing.
        raise ScenarioError(
            "workload.connector.divergent_hybrid_hits",
            True,
            "false for a model without mamba groups beside a full_attention or mla group "
            "(vLLM shows a connector divergent hits on such Mamba hybrids only)",
        )
    if not store.supports_hma and len(s.kv_cache_groups) > 1:
        # VllmConfig.__post_init__ turns the hybrid allocator off for such a
        # connector; the scenario describes the groups vLLM then plans.
        raise ScenarioError(
            "workload.connector.supports_hma",
            False,
            "true with more than one KV cache group (vLLM turns the hybrid allocator off "
            "for a connector without it: describe the one group it plans)",
        )
    if not store.prefix_caching and s.mamba_groups:
        raise ScenarioError(
            "workload.connector.prefix_caching",
            False,
            "true with mamba groups (vLLM's Mamba align mode needs prefix caching)",
        )
    check_store_grid(s)
    if store.disaggregated and store.bounded:
        raise ScenarioError(
            "workload.connector.capacity_chunks",
            store.capacity_chunks,
            "null when kv_role is 'kv_consumer' (the prefill and decode instances share "
            "one store; a bounded one's LRU replay follows a single scheduler's calls)",
        )


def check_store_grid(s: Scenario) -> None:
    """The store's own grid (``workload.connector.chunk_tokens``): a whole
    number of every group's blocks, so a multiple of the scheduler block
    (vLLM's ``build_offloading_config``,
    vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py,
    refuses an offloaded ``block_size`` that is not a multiple of the GPU
    block). ``capacity_chunks`` is checked positive by the JSON form."""
    store = s.workload.connector
    if store is None or store.chunk_tokens is None:
        return
    block = s.scheduler_block_size_tokens
    if store.chunk_tokens % block:
        raise ScenarioError(
            "workload.connector.chunk_tokens",
            store.chunk_tokens,
            f"null or a positive multiple of the scheduler block size ({block} tokens: an "
            "offloaded chunk is a whole number of every group's blocks)",
        )


def check_requests(s: Scenario) -> None:
    """Each request copies from an earlier one (or the shared prefix), at
    most its source's length (a rejoining request reads its source up to
    ``D + suffix + rejoin``), and has at least one token."""
    lengths: list[int] = []
    for i, request in enumerate(s.requests):
        where = f"requests[{i}]"
        if request.shares_with is None:
            source_len = s.shared_prefix_tokens
            source = "shared_prefix_tokens"
        else:
            if request.shares_with >= i:
                raise ScenarioError(
                    f"{where}.shares_with",
                    request.shares_with,
                    f"null or the index of an earlier request (0..{i - 1})"
                    if i
                    else "null (the first request has no earlier request to share with; "
                    "it shares shared_prefix_tokens)",
                )
            source_len = lengths[request.shares_with]
            source = f"requests[{request.shares_with}] prompt length"
            if s.workload.shares_output:
                source_len += s.decode_steps + 1
                source += " + its decode_steps + 1 sampled tokens"
        if request.divergence_tokens > source_len:
            raise ScenarioError(
                f"{where}.divergence_tokens",
                request.divergence_tokens,
                f"0..{source_len} ({source})",
            )
        if request.rejoin_tokens and not request.suffix_tokens:
            raise ScenarioError(
                f"{where}.rejoin_tokens",
                request.rejoin_tokens,
                "0 when suffix_tokens is 0 (a request rejoins its source after its own tokens)",
            )
        if request.rejoin_tokens and request.source_tokens > source_len:
            raise ScenarioError(
                f"{where}.rejoin_tokens",
                request.rejoin_tokens,
                f"0..{max(0, source_len - request.divergence_tokens - request.suffix_tokens)} "
                f"(divergence_tokens + suffix_tokens + rejoin_tokens at most {source}, "
                f"{source_len})",
            )
        if request.prompt_tokens < 1:
            raise ScenarioError(
                f"{where}.suffix_tokens",
                request.suffix_tokens,
                "at least 1 when divergence_tokens is 0 (a prompt needs a token)",
            )
        lengths.append(request.prompt_tokens)


def _image_text(source: int, placed: PlacedInput) -> str:
    return (
        f"requests[{source}]'s image {placed.identifier!r} at "
        f"[{placed.offset_tokens}, {placed.end_tokens})"
    )


def check_mm_inputs(s: Scenario) -> None:
    """Each request's images lie among its own tokens, in order and apart;
    an identifier names one image, of one length; a copy carries whole
    images.

    vLLM's processor expands an image into all of its placeholder tokens,
    and ``_gen_mm_extra_hash_keys`` (vllm/v1/core/kv_cache_utils.py) assumes
    a request's inputs sorted by offset and apart; an identifier is the
    image's hash, so the same identifier is the same encoder output, of the
    same length (vLLM's own scheduler tests assert as much,
    ``tests/v1/core/utils.py`` ``create_requests``). A copy boundary inside
    a source's image (the divergence point, or where a rejoin starts or
    ends) would make a prompt of part of an image, which no processor
    writes: refused, naming the image.
    """
    lengths: dict[str, tuple[int, int]] = {}
    for i, request in enumerate(s.requests):
        end = 0
        for k, m in enumerate(request.mm_inputs):
            where = f"requests[{i}].mm_inputs[{k}]"
            if m.suffix_offset_tokens < end:
                raise ScenarioError(
                    f"{where}.suffix_offset_tokens",
                    m.suffix_offset_tokens,
                    f"at least {end} (a request's images are in order and do not overlap)",
                )
            if not request.suffix_tokens:
                raise ScenarioError(
                    f"requests[{i}].mm_inputs",
                    f"{len(request.mm_inputs)} image(s)",
                    "[] when suffix_tokens is 0 (an image lies among the request's own tokens)",
                )
            if m.suffix_offset_tokens >= request.suffix_tokens:
                raise ScenarioError(
                    f"{where}.suffix_offset_tokens",
                    m.suffix_offset_tokens,
                    f"0..{request.suffix_tokens - 1} (an image starts among the request's "
                    f"{request.suffix_tokens} own tokens)",
                )
            end = m.suffix_offset_tokens + m.length_tokens
            if end > request.suffix_tokens:
                raise ScenarioError(
                    f"{where}.length_tokens",
                    m.length_tokens,
                    f"at most {max(0, request.suffix_tokens - m.suffix_offset_tokens)} (an "
                    f"image lies among the request's {request.suffix_tokens} own tokens)",
                )
            first = lengths.setdefault(m.identifier, (i, m.length_tokens))
            if first[1] != m.length_tokens:
                raise ScenarioError(
                    f"{where}.length_tokens",
                    m.length_tokens,
                    f"{first[1]}, the length of image {m.identifier!r} in requests[{first[0]}] "
                    "(an identifier is one image)",
                )
    if not s.has_mm_inputs:
        return
    placed = placed_inputs(s.requests)
    for i, request in enumerate(s.requests):
        if request.shares_with is None:
            continue
        source = placed[request.shares_with]
        d = request.divergence_tokens
        cuts = [("divergence_tokens", d)]
        if request.rejoin_tokens:
            start = d + request.suffix_tokens
            cuts += [("suffix_tokens", start), ("rejoin_tokens", start + request.rejoin_tokens)]
        for field, position in cuts:
            cut = split_input(source, position)
            if cut is not None:
                value = getattr(request, field)
                raise ScenarioError(
                    f"requests[{i}].{field}",
                    value,
                    f"a value that puts no copy boundary inside "
                    f"{_image_text(request.shares_with, cut)}: this one puts it at {position} "
                    f"(a copy of an image is whole: boundaries at {cut.offset_tokens} or "
                    f"{cut.end_tokens})",
                )


def check_pool(s: Scenario) -> None:
    """A pool size must hold the longest request on its own.

    vLLM's ``BlockPool`` (vllm/v1/core/block_pool.py) takes the null block
    from the pool; a request keeps every full-attention-family block it
    computed until it finishes (its prompt and ``decode_steps`` decoded
    tokens: the last sampled token is never computed), and any other group
    holds at least one block. A smaller pool can never run the request in
    either mode (the manager-level driver runs out, vLLM's ``Scheduler``
    never schedules it), so it is bad input, named before anything runs.
    """
    pool = s.workload.pool_blocks
    if pool is None:
        return
    longest = max(r.prompt_tokens for r in s.requests)
    computed = longest + s.decode_steps
    need = 1 + sum(
        -(-computed // g.block_size_tokens) if g.kind.full_attention_family else 1
        for g in s.kv_cache_groups
    )
    if pool < need:
        decoded = f" and its {s.decode_steps} decoded tokens" if s.decode_steps else ""
        raise ScenarioError(
            "workload.pool_blocks",
            pool,
            f"null or at least {need} blocks (the null block, the longest prompt of "
            f"{longest} tokens{decoded} in each full-attention group's blocks, one block "
            "per other group)",
        )


def check_max_model_len(s: Scenario) -> None:
    """``workload.max_model_len_tokens``: scheduler mode only, and room for
    every request's prompt and its ``decode_steps + 1`` sampled tokens
    (``check_stop`` caps a request at ``max_model_len`` tokens; below that a
    request would stop before its ``max_tokens``)."""
    mml = s.workload.max_model_len_tokens
    if mml is None:
        return
    if s.workload.mode is not DriveMode.SCHEDULER:
        raise ScenarioError(
            "workload.max_model_len_tokens", mml, "null in manager mode (workload.mode 'scheduler')"
        )
    need = max(r.prompt_tokens for r in s.requests) + s.decode_steps + 1
    if mml < need:
        raise ScenarioError(
            "workload.max_model_len_tokens",
            mml,
            f"null or at least {need} tokens (the longest prompt and decode_steps + 1 "
            "sampled tokens)",
        )


def check_draft_groups(s: Scenario) -> None:
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
    mode = s.draft_groups
    if mode is DraftGroups.NONE:
        for i, g in enumerate(s.kv_cache_groups):
            if g.is_eagle_group:
                raise ScenarioError(
                    f"kv_cache_groups[{i}].is_eagle_group",
                    True,
                    "false unless the drafter takes the EAGLE block drop "
                    f"(drafter.kind one of {sorted(DROPPING_DRAFTERS)} and "
                    "disable_eagle_block_drop false)",
                )
    alignment = s.effective_hit_alignment_tokens
    dropping = s.drop_group_indices if s.drop_applies else frozenset()
    chunked = any(g.kind is GroupKind.CHUNKED_LOCAL_ATTENTION for g in s.kv_cache_groups)
    if chunked and not any(g.kind.full_attention_family for g in s.kv_cache_groups):
        # vLLM accepts it, but no released model has chunked local
        # attention without full attention (Llama-4 interleaves it), and
        # without a full-attention bound ChunkedLocalAttentionManager's
        # null-padded hit reaches positions no earlier request shared
        # (and inflates the shared-prefix junction vLLM pins): the
        # oracle does not judge it.
        raise ScenarioError(
            "kv_cache_groups",
            s.group_mix,
            "a full_attention or mla group beside chunked_local_attention "
            "(kvfuzz judges chunked local attention as Llama-4 has it)",
        )
    if s.mamba_groups and chunked:
        # kvfuzz's own restriction: the state-group oracle
        # (differential/oracle/state.py) models no chunked local attention.
        # Draft groups beside Mamba groups run: only the groups that take
        # the drop prove its extra unit there.
        raise ScenarioError(
            "kv_cache_groups",
            s.group_mix,
            "no chunked_local_attention group beside mamba groups "
            "(kvfuzz's state-group oracle does not judge them yet)",
        )
    for i, g in enumerate(s.kv_cache_groups):
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
                s.group_mix,
                "no chunked_local_attention group taking the EAGLE block drop "
                "(vLLM does not support EAGLE with chunked local attention): mark "
                "the drafter's groups is_eagle_group, turn on lookahead block "
                "hashes, or use a drafter that does not drop",
            )


def check_mamba(s: Scenario) -> None:
    """What vLLM accepts for Mamba groups (prefix caching on, align mode).

    Refused: Mamba groups of different block sizes, or (in a hybrid) a
    Mamba block other than the scheduler block size (divided by
    ``dcp_world_size`` under decode context parallelism, where the cache
    block size is the per-rank attention block). vLLM sets
    ``mamba_block_size = cache_config.block_size`` in align mode
    (vllm/model_executor/models/config.py ``verify_and_update_config``,
    vllm/platforms/interface.py), and ``Scheduler._mamba_block_aligned_split``
    ends prefill chunks on that one block size for every Mamba group.
    Also refused: ``enable_mamba_shared_prefix_checkpoint`` without a
    Mamba group (it would silently do nothing).
    """
    mamba = s.mamba_groups
    if not mamba:
        if s.mamba_prefill is not MambaPrefill.SCHEDULER:
            raise ScenarioError(
                "mamba_prefill",
                s.mamba_prefill.value,
                "'scheduler' for a model without mamba groups",
            )
        if s.enable_mamba_shared_prefix_checkpoint is True:
            raise ScenarioError(
                "enable_mamba_shared_prefix_checkpoint",
                True,
                "false for a model without mamba groups (it only affects Mamba states)",
            )
        return
    sizes = sorted({g.block_size_tokens for g in mamba})
    # Under DCP the cache block size is the per-rank one: the scheduler block
    # (the sharded attention block) is dcp_world_size times the Mamba block.
    dcp = s.dcp_world_size
    if len(sizes) > 1 or sizes[0] * dcp != s.scheduler_block_size_tokens:
        per_rank = "" if dcp == 1 else f" divided by dcp_world_size {dcp}"
        raise ScenarioError(
            "kv_cache_groups",
            [g.block_size_tokens for g in s.kv_cache_groups],
            "mamba groups that share one block size equal to the scheduler block "
            f"size {s.scheduler_block_size_tokens}{per_rank} (vLLM sets mamba_block_size "
            "to the cache block size in align mode)",
        )


def _check_prefix_caching(s: Scenario) -> None:
    """``workload.prefix_caching`` false: scheduler mode only (the
    manager-level driver runs vLLM's managers with caching on), no
    connector store (a store's ``prefix_caching`` says it there), no
    positive retention interval (nothing is retained without a prefix
    cache), no KV cache events (vLLM emits none without one) and no Mamba
    checkpoints (align mode's: ``mamba_prefill`` ``scheduler``, no
    shared-prefix checkpoint).

    Raises:
        ScenarioError: naming the field and the values allowed.
    """
    w = s.workload
    if w.prefix_caching:
        return
    if w.mode is DriveMode.MANAGER:
        raise ScenarioError(
            "workload.prefix_caching",
            False,
            "true in manager mode (the manager-level driver runs with prefix caching on: "
            "workload.mode 'scheduler')",
        )
    if w.connector is not None:
        raise ScenarioError(
            "workload.prefix_caching",
            False,
            "true with a connector store (set workload.connector.prefix_caching instead)",
        )
    if s.retention_interval_tokens:
        raise ScenarioError(
            "retention_interval_tokens",
            s.retention_interval_tokens,
            "null or 0 when workload.prefix_caching is false (nothing is retained without a "
            "prefix cache)",
        )
    if w.kv_events is not KVEvents.OFF:
        raise ScenarioError(
            "workload.kv_events",
            w.kv_events.value,
            "'off' when workload.prefix_caching is false (vLLM emits no KV cache events "
            "without a prefix cache)",
        )
    why = (
        "when workload.prefix_caching is false (Mamba checkpoints are align mode's; without "
        "a prefix cache vLLM keeps mode 'none')"
    )
    if s.mamba_prefill is not MambaPrefill.SCHEDULER:
        raise ScenarioError("mamba_prefill", s.mamba_prefill.value, f"'scheduler' {why}")
    if s.enable_mamba_shared_prefix_checkpoint:
        raise ScenarioError("enable_mamba_shared_prefix_checkpoint", True, f"false {why}")


def _check_prefill_policy(s: Scenario) -> None:
    """The Scheduler's prefill policy (``workload.long_prefill_token_threshold``,
    its adaptive floor and ``prefill_schedule_interval``): scheduler mode
    only, a cap no longer than the longest prompt (a larger one caps nothing
    kvfuzz sends; vLLM's ``SchedulerConfig`` refuses one past the model's
    length), and the adaptive floor only beside a cap.

    Raises:
        ScenarioError: naming the field and the values allowed.
    """
    w = s.workload
    fields = (
        ("long_prefill_token_threshold", w.long_prefill_token_threshold, 0),
        ("long_prefill_token_threshold_adaptive", w.long_prefill_token_threshold_adaptive, False),
        ("prefill_schedule_interval", w.prefill_schedule_interval, 1),
    )
    for name, value, default in fields:
        if w.mode is DriveMode.MANAGER and value != default:
            raise ScenarioError(
                f"workload.{name}",
                value,
                f"{str(default).lower()} in manager mode (the Scheduler's prefill policy "
                "needs its steps: workload.mode 'scheduler')",
            )
    longest = max(r.prompt_tokens for r in s.requests)
    if w.long_prefill_token_threshold > longest:
        raise ScenarioError(
            "workload.long_prefill_token_threshold",
            w.long_prefill_token_threshold,
            f"0 to the longest prompt ({longest} tokens; a larger cap caps nothing)",
        )
    if w.long_prefill_token_threshold_adaptive and not w.long_prefill_token_threshold:
        raise ScenarioError(
            "workload.long_prefill_token_threshold_adaptive",
            True,
            "false when long_prefill_token_threshold is 0 (the floor applies to a cap)",
        )

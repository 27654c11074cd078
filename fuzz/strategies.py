"""Hypothesis strategies for scenarios: the one generator, reused everywhere.

``scenarios()`` draws valid :class:`~differential.scenario.Scenario` values.
It searches small scopes first -- toy block sizes and windows reproduce the
bug class hundreds of times faster than real ones -- while still reaching
real geometries (block 64, window 1024, 16K-token prefixes). Divergence
points are placed on, just before and just after checkpoints and alignment
boundaries as well as at random, since that is where checkpoint bugs live.

The same strategy drives property tests (``@given``), the ``kvfuzz fuzz``
campaign and the atheris harness (through ``fuzz_one_input``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from hypothesis import strategies as st

from differential.errors import ScenarioError
from differential.scenario import (
    ConnectorLoad,
    ConnectorStore,
    Drafter,
    DrafterKind,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    KVEvents,
    KVEventsView,
    KVRole,
    LoadFailurePolicy,
    MambaPrefill,
    MultiModalInput,
    RequestSpec,
    Scenario,
    Workload,
)
from differential.scenario.models import MAX_HEADS, LayerSpec, ModelDescription

__all__ = [
    "Scale",
    "engine_scenarios",
    "geometries",
    "mamba_geometries",
    "model_of",
    "scenarios",
]

# KV cache events (workload.kv_events): off three times in four.
_KV_EVENTS = (KVEvents.OFF,) * 6 + (KVEvents.INCREMENTAL, KVEvents.FULL)

# Prefill modes for Mamba hybrids: vLLM's chunking mostly.
_MAMBA_PREFILLS = (MambaPrefill.SCHEDULER, MambaPrefill.SCHEDULER, MambaPrefill.BLOCK)

# Mamba block sizes (tokens) per scale; "real" are the production sizes of
# public reports (Qwen3.5/3.6-style GDN, Nemotron, Kimi, GLM hybrids).
_MAMBA_BLOCKS = {
    "toy": (4, 8, 16, 16, 32, 64),
    "medium": (64, 128, 256),
    "real": (528, 896, 1536, 1600, 2144, 3200),
}

Scale = str  # "toy" | "medium" | "real"

# Drafters whose draft KV depends on the next token: vLLM protects them with
# the EAGLE drop (lookahead hashes off) or lookahead hashes.
_DROPPING = (
    DrafterKind.EAGLE,
    DrafterKind.EAGLE3,
    DrafterKind.MTP,
    DrafterKind.MULTI_MODULE_MTP,
    DrafterKind.GEMMA4_MTP,
)
# Drafters the engine generator draws (weighted as manager mode weights them
# less the draft model, whose second model the Scheduler does not run);
# Mamba hybrids with the drafters their models ship (Qwen3-Next's and
# NemotronH's MTP, EAGLE, n-gram): no Gemma-4 MTP, whose model has no Mamba
# layer, and no multi-module MTP, whose re-prefill tail the state-group
# oracle does not model.
_ENGINE_DRAFTERS = (
    DrafterKind.NONE,
    DrafterKind.NONE,
    DrafterKind.EAGLE,
    DrafterKind.EAGLE3,
    DrafterKind.MTP,
    DrafterKind.MTP,
    DrafterKind.MULTI_MODULE_MTP,
    DrafterKind.GEMMA4_MTP,
    DrafterKind.DFLASH,
    DrafterKind.DSPARK,
    DrafterKind.NGRAM,
)
_ENGINE_DRAFTERS_MAMBA = (
    DrafterKind.NONE,
    DrafterKind.NONE,
    DrafterKind.MTP,
    DrafterKind.MTP,
    DrafterKind.EAGLE,
    DrafterKind.NGRAM,
)
# Drafters with draft attention layers of their own that take the EAGLE drop.
_ATTENTION_DRAFTERS = frozenset({DrafterKind.EAGLE, DrafterKind.EAGLE3, DrafterKind.MTP})

# Drafters, repeated to weight the ones whose behaviour is most intricate.
_DRAFTERS = (
    DrafterKind.MTP,
    DrafterKind.MTP,
    DrafterKind.EAGLE,
    DrafterKind.EAGLE3,
    DrafterKind.MULTI_MODULE_MTP,
    DrafterKind.GEMMA4_MTP,
    DrafterKind.DFLASH,
    DrafterKind.DSPARK,
    DrafterKind.DRAFT_MODEL,
    DrafterKind.NGRAM,
    DrafterKind.NONE,
)


@st.composite
def geometries(draw: st.DrawFn, scale: Scale) -> tuple[KVCacheGroup, ...]:
    """KV cache groups: one full-attention group and one or two SWA groups,
    or a single group (full attention or sliding window alone: vLLM's
    ``UnitaryKVCacheCoordinator``), or, two times in seven, any other mix
    (:func:`mixed_geometries`).

    Covers equal and unequal full / SWA block sizes and hit alignments larger
    than the SWA block.
    """
    if scale == "toy":
        swa = draw(st.sampled_from((2, 4, 4, 8)))
        full = swa * draw(st.sampled_from((1, 2, 2, 4)))
        window = draw(st.sampled_from((swa, 2 * swa, 3 * swa + 1, 4 * swa, 16, 7)))
    elif scale == "medium":
        swa = draw(st.sampled_from((8, 16)))
        full = swa * draw(st.sampled_from((1, 2, 4)))
        window = draw(st.sampled_from((64, 128, 100)))
    else:
        swa = draw(st.sampled_from((16, 64)))
        full = swa * draw(st.sampled_from((1, 2)))
        window = draw(st.sampled_from((512, 1024)))
    layout = draw(st.integers(0, 13))
    if layout >= 10:  # any other mix vLLM accepts
        return draw(mixed_geometries(swa, full, window))
    if layout == 1:  # a full-attention-only model
        return (KVCacheGroup(GroupKind.FULL_ATTENTION, full),)
    if layout == 2:  # a sliding-window-only model
        return (KVCacheGroup(GroupKind.SLIDING_WINDOW, swa, window),)
    groups = [
        KVCacheGroup(GroupKind.FULL_ATTENTION, full),
        KVCacheGroup(GroupKind.SLIDING_WINDOW, swa, window),
    ]
    if layout == 0:  # occasionally a second SWA group (never a 1-token window)
        groups.append(KVCacheGroup(GroupKind.SLIDING_WINDOW, swa, max(2, window // 2)))
    return tuple(groups)


# Attention kinds a mixed layout draws from (each has a single-type manager
# in vLLM 0.33.0 and a released model using it).
_MIXED_KINDS = (
    GroupKind.FULL_ATTENTION,
    GroupKind.MLA,
    GroupKind.SLIDING_WINDOW,
    GroupKind.SLIDING_WINDOW_MLA,
    GroupKind.CHUNKED_LOCAL_ATTENTION,
)


@st.composite
def mixed_geometries(
    draw: st.DrawFn, block: int, full: int, window: int
) -> tuple[KVCacheGroup, ...]:
    """Any attention mix: one to five groups of full attention, MLA, sliding
    window, sliding-window MLA and chunked local attention, in any order,
    each with its own block size (multiples of ``block``; one time in eight
    a 3x block, whose LCM with a 2x or 4x block exceeds every block: an
    alignment blowup). A chunked-local group's block is the LCM of the
    others, as vLLM's ``ChunkedLocalAttentionManager`` requires; its chunk a
    multiple of it. Window in tokens.
    """
    count = draw(st.integers(1, 5))
    factors = (1, 2, 4, full // block) + ((3,) if draw(st.integers(0, 7)) == 0 else ())
    groups: list[KVCacheGroup] = []
    chunked = 0
    for _ in range(count):
        kind = draw(st.sampled_from(_MIXED_KINDS))
        if kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
            chunked += 1
            continue
        size = block * draw(st.sampled_from(factors))
        win = window if kind.sliding_window_family else None
        if win is not None and draw(st.booleans()):
            # Never a 1-token window: no released model has one, and its
            # degenerate lookups (window-one-multi-group-spiral; a dense run
            # that hits nothing) would crowd out real layouts.
            win = max(2, win // 2)
        groups.append(KVCacheGroup(kind, size, win))
    if chunked and not any(g.kind.full_attention_family for g in groups):
        # Chunked local attention beside full attention, as Llama-4 has it
        # (``block`` divides every block: the alignment stays).
        groups.append(KVCacheGroup(GroupKind.FULL_ATTENTION, block))
    if not groups:
        groups.append(KVCacheGroup(GroupKind.FULL_ATTENTION, full))
    lcm = math.lcm(*(g.block_size_tokens for g in groups))
    for _ in range(chunked):
        chunk = lcm * draw(st.sampled_from((1, 2, 4)))
        at = draw(st.integers(0, len(groups)))
        groups.insert(
            at,
            KVCacheGroup(GroupKind.CHUNKED_LOCAL_ATTENTION, lcm, attention_chunk_size_tokens=chunk),
        )
    return tuple(groups)


@st.composite
def mamba_geometries(draw: st.DrawFn, scale: Scale) -> tuple[tuple[KVCacheGroup, ...], int | None]:
    """A Mamba hybrid's KV cache groups and its hash block size, in tokens.

    One full-attention group with one to three Mamba groups (vLLM groups a
    GDN hybrid's linear-attention layers into several groups of one spec),
    sometimes a sliding-window group, or a Mamba group alone. Every Mamba
    group and the full-attention group share the block size, as vLLM sets
    ``mamba_block_size = cache_config.block_size`` in align mode. The hash
    block is ``None`` (no fine-grained hits) or a divisor of the block
    (fine-grained hits unless a coarser sliding-window block vetoes them).
    """
    if scale == "real" and draw(st.integers(0, 2)) == 0:
        scale = "medium"  # production sizes sometimes, at their own cost
    block = draw(st.sampled_from(_MAMBA_BLOCKS[scale]))
    if draw(st.integers(0, 7)) == 0:
        return (KVCacheGroup(GroupKind.MAMBA, block),), None
    divisors = [
        d for d in (block // 2, block // 4, 16, 32, 64, 4, 2) if 0 < d < block and not block % d
    ]
    hash_block = draw(st.sampled_from((None, *divisors))) if divisors else None
    groups = [KVCacheGroup(GroupKind.FULL_ATTENTION, block)]
    groups += [KVCacheGroup(GroupKind.MAMBA, block)] * draw(st.sampled_from((1, 1, 1, 2, 3)))
    if draw(st.integers(0, 3)) == 0:
        swa = draw(st.sampled_from((block, hash_block or block)))
        # Never a 1-token window (a hash block of 1 token gives swa 1): vLLM
        # keeps no block of a window that needs none (reachable_block_mask)
        # and its lookup then finds none to end a hit on, so every hit is 0;
        # no released model has one (see mixed_geometries).
        window = max(2, draw(st.sampled_from((swa, 2 * swa + 1, 4 * swa))))
        groups.insert(1, KVCacheGroup(GroupKind.SLIDING_WINDOW, swa, window))
    return tuple(groups), hash_block


def _pin(groups: tuple[KVCacheGroup, ...], kinds: frozenset[GroupKind]) -> tuple[KVCacheGroup, ...]:
    """Attention groups with every pinned attention kind present (adds a
    group of each missing kind, at the layout's hit alignment, so no
    block size changes the alignment; a circular buffer at the layout's
    smallest block, a divisor of the alignment, as DeepSeek-V4.1's 8-token
    ring sits beside its larger blocks; a sink full attention group with a
    static sink of two of its blocks)."""
    have = {g.kind for g in groups}
    if kinds <= have:
        return groups
    if GroupKind.CIRCULAR_BUFFER in kinds - have:
        ring = KVCacheGroup(GroupKind.CIRCULAR_BUFFER, min(g.block_size_tokens for g in groups))
        groups = (*groups, ring)
        have.add(GroupKind.CIRCULAR_BUFFER)
    block = math.lcm(*(g.block_size_tokens for g in groups))
    if GroupKind.CHUNKED_LOCAL_ATTENTION in kinds | have and not any(
        g.kind.full_attention_family for g in groups
    ):
        kinds = kinds | {GroupKind.FULL_ATTENTION}
    added = []
    for kind in sorted(kinds - have - {GroupKind.MAMBA}):
        # An R-SWA window of one block: short decodes already free its gap.
        window = block if kind is GroupKind.RSWA else 4 * block if kind.windowed else None
        chunk = 4 * block if kind is GroupKind.CHUNKED_LOCAL_ATTENTION else None
        sink = 2 * block if kind is GroupKind.SINK_FULL_ATTENTION else None
        added.append(KVCacheGroup(kind, block, window, chunk, sink_len_tokens=sink))
    return (*groups, *added)


@st.composite
def _draft_groups(
    draw: st.DrawFn, groups: tuple[KVCacheGroup, ...], may_drop: bool
) -> tuple[KVCacheGroup, ...]:
    """Mark the drafter's own KV groups as vLLM's planner does
    (``is_eagle_group``), half the time when the drafter drops: a new draft
    full-attention group (its block one of the layout's), or an existing
    non-chunked group. A chunked-local layout whose drop would fall back to
    every group always gets a draft group (vLLM refuses EAGLE's drop on
    chunked local attention)."""
    chunked = any(g.kind is GroupKind.CHUNKED_LOCAL_ATTENTION for g in groups)
    if not may_drop or (not chunked and draw(st.booleans())):
        return groups
    blocks = sorted({g.block_size_tokens for g in groups})
    candidates = [
        i
        for i, g in enumerate(groups)
        if g.kind is not GroupKind.CHUNKED_LOCAL_ATTENTION and g.kind.prefix_cacheable
    ]
    if draw(st.booleans()) or not candidates:
        draft = KVCacheGroup(
            GroupKind.FULL_ATTENTION, draw(st.sampled_from(blocks)), is_eagle_group=True
        )
        return (*groups, draft)
    mark = draw(st.sampled_from(candidates))
    return tuple(
        dataclasses.replace(g, is_eagle_group=True) if i == mark else g
        for i, g in enumerate(groups)
    )


def _near(points: list[int], alignment: int) -> st.SearchStrategy[int]:
    """A position on, just before or just after one of ``points``."""
    offsets = st.sampled_from((0, 1, -1, alignment, -alignment, alignment + 1, 2))
    return st.builds(lambda p, d: max(0, p + d), st.sampled_from(points), offsets)


# The per-layout strategies below are kept, not rebuilt for every example:
# Hypothesis validates each new strategy object on its first draw, which cost
# about a fifth of generating a scenario. The same object draws the same
# values from the same choices, so the scenarios drawn do not change.


@functools.lru_cache(maxsize=4096)
def _divergence(
    checkpoints: tuple[int, ...], alignment: int, prefix: int
) -> st.SearchStrategy[int]:
    """A sibling's divergence point, in tokens: near a checkpoint, anywhere in
    the shared prefix, or all of it."""
    return st.one_of(
        _near(list(checkpoints), alignment), st.integers(0, prefix), st.just(prefix)
    ).map(lambda d: min(d, prefix))


@functools.lru_cache(maxsize=1024)
def _suffix(alignment: int) -> st.SearchStrategy[int]:
    """A request's tokens after its shared part: around the hit alignment."""
    return st.one_of(
        st.sampled_from((0, 1, alignment, 2 * alignment, alignment + 1)),
        st.integers(0, 3 * alignment),
    )


def _scenario_geometry(
    draw: st.DrawFn, scale: Scale, kinds: frozenset[GroupKind], any_scale: bool
) -> tuple[tuple[KVCacheGroup, ...], int | None, bool]:
    """The KV cache groups, the hash block size (tokens; ``None`` but on some
    Mamba hybrids) and whether the layout is a Mamba hybrid: one in five
    when neither ``kinds`` nor the scale is pinned, always when ``kinds``
    pins Mamba groups; a pinned sliding-window group joins a Mamba hybrid
    drawn without one (its block the hash block, its window four blocks)."""
    hash_block: int | None = None
    mamba = GroupKind.MAMBA in kinds or (not kinds and any_scale and draw(st.integers(0, 4)) == 0)
    if not mamba:
        return _pin(draw(geometries(scale)), kinds), hash_block, mamba
    groups, hash_block = draw(mamba_geometries(scale))
    if GroupKind.SLIDING_WINDOW in kinds and not any(
        g.kind is GroupKind.SLIDING_WINDOW for g in groups
    ):
        block = groups[0].block_size_tokens
        groups = (
            KVCacheGroup(GroupKind.FULL_ATTENTION, block),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, hash_block or block, 4 * block),
            *(g for g in groups if g.kind is GroupKind.MAMBA),
        )
    if GroupKind.CIRCULAR_BUFFER in kinds:
        # A ring beside the Mamba hybrid at its smallest block (a divisor of
        # the Mamba block: the scheduler block stays the Mamba block).
        ring = KVCacheGroup(GroupKind.CIRCULAR_BUFFER, min(g.block_size_tokens for g in groups))
        groups = (*groups, ring)
    if GroupKind.SINK_FULL_ATTENTION in kinds:
        # openPangu's static-sink layers beside the hybrid, at its scheduler
        # block (which stays), with a sink of two blocks.
        block = math.lcm(*(g.block_size_tokens for g in groups))
        sink = KVCacheGroup(GroupKind.SINK_FULL_ATTENTION, block, sink_len_tokens=2 * block)
        groups = (*groups, sink)
    return groups, hash_block, mamba


def _retention_interval(
    draw: st.DrawFn,
    groups: tuple[KVCacheGroup, ...],
    alignment: int,
    units: tuple[int, ...],
    mamba: bool,
) -> int | None:
    """The retention interval, in tokens: ``None``, 0, the hit alignment or a
    sparse multiple of it (``units`` of alignments, per scale); on Mamba
    hybrids vLLM's default (0) two times in three; 0 for any nonzero
    interval on layouts without sliding-window or Mamba groups."""
    retention = draw(
        st.sampled_from(
            (None, 0, alignment, *(alignment * u for u in units), *(alignment * u for u in units))
        )
    )
    if mamba:  # vLLM's default retention (0) for Mamba hybrids two times in three
        retention = draw(st.sampled_from((0, 0, retention)))
    if retention and not any(
        g.kind.sliding_window_family or g.kind is GroupKind.MAMBA for g in groups
    ):
        retention = 0  # vLLM accepts only None or 0 without SWA or Mamba groups
    return retention


def _scenario_drafter(
    draw: st.DrawFn,
    groups: tuple[KVCacheGroup, ...],
    alignment: int,
    hash_block: int | None,
    mamba: bool,
) -> tuple[Drafter, tuple[KVCacheGroup, ...], int]:
    """The drafter (one to four speculative tokens; a multi-module MTP two up
    to the hit alignment's, at most four), with the groups and hit alignment
    (tokens) its draft attention layer gives a Mamba-only model: a
    full-attention group of the Mamba block. Mamba hybrids draw no
    multi-module MTP (its state-group re-prefill tail is not modelled)."""
    kind = draw(st.sampled_from(_DRAFTERS))
    if mamba and kind is DrafterKind.MULTI_MODULE_MTP:
        kind = DrafterKind.MTP  # its re-prefill tail is not modelled for state groups
    if mamba and len(groups) == 1 and kind in _ATTENTION_DRAFTERS:
        # A Mamba-only model's EAGLE or MTP drafter brings its own attention
        # layer: vLLM's planner makes it a full-attention group (and warns
        # about such a drafter without one), so there is no Mamba-only layout.
        groups = (KVCacheGroup(GroupKind.FULL_ATTENTION, groups[0].block_size_tokens), *groups)
        if hash_block is not None:
            alignment = _fine_alignment(groups, hash_block)
    if kind is DrafterKind.NONE:
        drafter = Drafter()
    elif kind is DrafterKind.MULTI_MODULE_MTP:
        drafter = Drafter(kind, draw(st.integers(2, max(2, min(4, alignment)))))
    else:
        drafter = Drafter(kind, draw(st.integers(1, 4)))
    return drafter, groups, alignment


def _draft_protection(
    draw: st.DrawFn,
    drafter: Drafter,
    groups: tuple[KVCacheGroup, ...],
    alignment: int,
    mamba: bool,
) -> tuple[str, bool, tuple[KVCacheGroup, ...]]:
    """How the draft KV is protected -- ``"disabled"`` (lookahead block
    hashes off: the EAGLE drop), ``"connector"`` or ``"lookahead"`` --,
    whether the EAGLE block drop is disabled (one in twenty), and the groups
    with the drafter's own KV groups marked (``is_eagle_group``) when it
    drops. ``alignment`` (the hit alignment, tokens) must not change."""
    protection = draw(st.sampled_from(("disabled", "disabled", "connector", "lookahead")))
    disable_drop = draw(st.integers(0, 19)) == 0
    # Gemma-4 MTP writes no draft KV: it has no draft layer, so no draft
    # group (vLLM's planner marks the groups holding draft layers); beside
    # chunked local attention, where stock vLLM's drop would be refused, it
    # runs with lookahead hashes.
    if drafter.kind is DrafterKind.GEMMA4_MTP and any(
        g.kind is GroupKind.CHUNKED_LOCAL_ATTENTION for g in groups
    ):
        protection, disable_drop = "lookahead", False
    dropping = drafter.kind in _ATTENTION_DRAFTERS or drafter.kind is DrafterKind.MULTI_MODULE_MTP
    drops = dropping and not disable_drop and protection != "lookahead"
    if mamba:
        if drops and not any(g.kind.sliding_window_family for g in groups) and draw(st.booleans()):
            # The drafter's full-attention layer shares the target's spec:
            # the planner puts it in the target's group and marks that group.
            groups = tuple(
                KVCacheGroup(g.kind, g.block_size_tokens, is_eagle_group=True)
                if g.kind is GroupKind.FULL_ATTENTION
                else g
                for g in groups
            )
    else:
        groups = draw(_draft_groups(groups, dropping and not disable_drop))
        if any(g.kind is GroupKind.CHUNKED_LOCAL_ATTENTION for g in groups) and (
            math.lcm(*(g.block_size_tokens for g in groups)) != alignment
        ):  # pragma: no cover - draft blocks are drawn from the layout's own
            raise AssertionError("a draft group changed a chunked layout's alignment")
    return protection, disable_drop, groups


def _shared_prefix(draw: st.DrawFn, scale: Scale, period: int, alignment: int) -> int:
    """The shared prefix, in tokens: one to four checkpoint periods
    (``period`` tokens), sometimes plus the hit alignment or one token,
    capped by scale (512, 2048 or 16384 tokens), at least one token."""
    max_prefix = {"toy": 512, "medium": 2048, "real": 16384}[scale]
    periods = draw(st.integers(1, max(1, min(4, max_prefix // period))))
    prefix = min(max_prefix, periods * period + draw(st.sampled_from((0, 0, alignment, 1))))
    return max(prefix, 1)


def _sibling_requests(
    draw: st.DrawFn, prefix: int, period: int, alignment: int
) -> list[RequestSpec]:
    """The writer of the shared prefix and one to four siblings: most diverge
    from the prefix on, around or between its checkpoints (every ``period``
    tokens, and one hit alignment before each), one in five copies part of
    an earlier request's prompt; each with a suffix around the hit
    alignment, and at least one token of prompt. Tokens throughout."""
    checkpoints = sorted({k * period for k in range(1, prefix // period + 1)} | {prefix})
    checkpoints += [c - alignment for c in checkpoints if c > alignment]
    divergence = _divergence(tuple(checkpoints), alignment, prefix)
    suffix = _suffix(alignment)
    requests = [RequestSpec(prefix, draw(suffix), name="writer")]
    for _ in range(draw(st.integers(1, 4))):
        index = len(requests)
        if draw(st.integers(0, 4)) == 0:
            source = draw(st.integers(0, index - 1))
            length = requests[source].prompt_tokens
            requests.append(
                RequestSpec(draw(st.integers(0, length)), draw(suffix), shares_with=source)
            )
        else:
            requests.append(RequestSpec(draw(divergence), draw(suffix)))
    return [
        r if r.prompt_tokens > 0 else RequestSpec(r.divergence_tokens, 1, r.shares_with, r.name)
        for r in requests
    ]


def _prefill_chunk(
    draw: st.DrawFn,
    groups: tuple[KVCacheGroup, ...],
    alignment: int,
    prefix: int,
    drafter: Drafter,
    mamba: bool,
) -> int:
    """The prefill chunk, in tokens: around the hit alignment, a fixed size
    or the whole prefix; no smaller than a multi-module MTP's speculative
    tokens; on Mamba hybrids sometimes the Mamba block, twice or half it."""
    chunk = draw(
        st.sampled_from(
            (alignment, 2 * alignment, 3 * alignment + 1, 64, 512, 2048, max(prefix, 1))
        )
    )
    if drafter.kind is DrafterKind.MULTI_MODULE_MTP:
        chunk = max(chunk, drafter.num_speculative_tokens)
    if mamba:
        block = groups[-1].block_size_tokens
        chunk = draw(st.sampled_from((chunk, block, 2 * block, max(1, block // 2))))
    return chunk


def _mamba_options(
    draw: st.DrawFn, groups: tuple[KVCacheGroup, ...], hash_block: int | None
) -> dict[str, object]:
    """A Mamba hybrid's scenario options: its hash block size (tokens; none
    for a Mamba group alone), prefill mode, and the shared-prefix
    checkpoint one time in three."""
    return {
        "hash_block_size_tokens": hash_block if len(groups) > 1 else None,
        "mamba_prefill": draw(st.sampled_from(_MAMBA_PREFILLS)),
        "enable_mamba_shared_prefix_checkpoint": draw(st.integers(0, 2)) == 0,
    }


def _kv_events_view(draw: st.DrawFn, events: KVEvents) -> KVEventsView:
    """With KV cache events on, the router view for one scenario in three
    (``Workload.kv_events_view``); drawn only then."""
    if events is KVEvents.OFF:
        return KVEventsView.PER_COPY
    return KVEventsView.ROUTER if draw(st.integers(0, 2)) == 0 else KVEventsView.PER_COPY


def _kv_events(draw: st.DrawFn, mamba: bool) -> KVEvents:
    """KV cache events for one scenario in four, in 'full' report mode only
    without Mamba groups (vLLM 0.33.0's full report indexes past the block
    hashes on a Mamba hit that ends inside a block: vLLM PR #57358)."""
    events: KVEvents = draw(st.sampled_from(_KV_EVENTS))
    if mamba and events is KVEvents.FULL:
        events = KVEvents.INCREMENTAL
    return events


@st.composite
def scenarios(
    draw: st.DrawFn,
    scale: Scale | None = None,
    kinds: frozenset[GroupKind] = frozenset(),
) -> Scenario:
    """A valid scenario; ``scale`` fixes the geometry scope (default: mostly
    toy); ``kinds`` pins KV cache group kinds every scenario contains
    (``kvfuzz fuzz --groups``; empty: any layout, Mamba hybrids one in five
    when ``scale`` is not fixed; a fixed scale draws attention layouts only)."""
    any_scale = scale is None
    if scale is None:
        scale = draw(st.sampled_from(("toy",) * 6 + ("medium",) * 3 + ("real",)))
    groups, hash_block, mamba = _scenario_geometry(draw, scale, kinds, any_scale)
    alignment = math.lcm(*(g.block_size_tokens for g in groups))

    # Retention: None, 0, the alignment itself, or a sparse multiple of it.
    units = {"toy": (2, 4, 8, 16), "medium": (4, 8, 16), "real": (8, 64, 128)}[scale]
    retention = _retention_interval(draw, groups, alignment, units, mamba)
    period = retention if retention else alignment * units[0]
    if mamba and hash_block is not None and len(groups) > 1:
        alignment = _fine_alignment(groups, hash_block)

    drafter, groups, alignment = _scenario_drafter(draw, groups, alignment, hash_block, mamba)
    protection, disable_drop, groups = _draft_protection(draw, drafter, groups, alignment, mamba)

    # The shared prefix spans a few checkpoint periods, capped by scale.
    prefix = _shared_prefix(draw, scale, period, alignment)
    requests = _sibling_requests(draw, prefix, period, alignment)

    chunk = _prefill_chunk(draw, groups, alignment, prefix, drafter, mamba)
    mamba_options = _mamba_options(draw, groups, hash_block) if mamba else {}
    # Drawn last, so that every draw above reads the bytes it read before.
    requests = _rejoining(draw, requests, prefix, alignment)
    decode_steps = draw(st.sampled_from((0, 0, 0, 1, 3)))
    # Then KV cache events for one scenario in four.
    events = _kv_events(draw, mamba)
    # Drawn after everything else, for the same reason.
    requests = _multimodal(draw, requests, alignment)
    # Last of all, decode context parallelism (it may scale the groups' blocks).
    groups, dcp = _decode_context_parallel(draw, groups, retention)
    # And after it the event stream's view, drawn only with events on.
    view = _kv_events_view(draw, events)
    # Last, one eligible layout in three as a model vLLM's planner lays out.
    model = model_of(groups) if dcp == 1 and draw(st.integers(0, 2)) == 0 else None
    try:
        scenario = Scenario(
            kv_cache_groups=groups,
            requests=tuple(requests),
            shared_prefix_tokens=prefix,
            retention_interval_tokens=retention,
            drafter=drafter,
            kv_connector=protection == "connector",
            disable_lookahead_block_hashes=protection == "disabled",
            disable_eagle_block_drop=disable_drop,
            prefill_chunk_tokens=chunk,
            decode_steps=decode_steps,
            workload=Workload(kv_events=events, kv_events_view=view),
            dcp_world_size=dcp,
            model=model,
            **mamba_options,  # type: ignore[arg-type]
        )
        # Drawn last, so that every draw above reads the bytes it read before.
        return _skipped_read(draw, _hidden_state_layer(draw, _prefill_checkpoints(draw, scenario)))
    except ScenarioError as exc:  # pragma: no cover - the generator's own bug
        raise AssertionError(f"the scenario generator produced an invalid scenario: {exc}") from exc


# The kinds a first layer's spec takes into one group of mixed pages at one
# block size (``is_uniform_with_collection``, vllm/v1/kv_cache_interface.py).
_ONE_TYPE_WITH = {
    GroupKind.FULL_ATTENTION: frozenset({GroupKind.FULL_ATTENTION, GroupKind.MLA}),
    GroupKind.MLA: frozenset({GroupKind.FULL_ATTENTION, GroupKind.MLA}),
    GroupKind.SLIDING_WINDOW: frozenset({GroupKind.SLIDING_WINDOW, GroupKind.SLIDING_WINDOW_MLA}),
    GroupKind.SLIDING_WINDOW_MLA: frozenset({GroupKind.SLIDING_WINDOW_MLA}),
    GroupKind.CHUNKED_LOCAL_ATTENTION: frozenset({GroupKind.CHUNKED_LOCAL_ATTENTION}),
}

#: Bytes per token of the group with the smallest block, per token of the
#: blocks' LCM (bf16, one KV head): pages of 64-element heads and up.
_PAGE_BYTES_PER_LCM_TOKEN = 256


def model_of(groups: tuple[KVCacheGroup, ...]) -> ModelDescription | None:
    """A model whose layers vLLM's planner lays out into exactly ``groups``
    with unequal pages, or ``None`` when no such model is built here.

    Built backwards from the groups: the configured block is the smallest
    group block B; a group of block b gets layers of
    ``256 x lcm / b`` bytes per token (one bf16 KV head: a head of
    ``64 x lcm / b`` elements, twice that for MLA's single latent), so its
    page at B is b / B times smaller than the largest and
    ``unify_kv_cache_spec_page_size`` (vllm/v1/core/kv_cache_planning.py)
    scales its block back to b. One layer per group, listed in the groups'
    order, makes one bucket per group in that order
    (``_get_kv_cache_groups_uniform_page_size``). Only attention groups
    without a draft mark (draft layers are not drawn), of more than one
    block size (unequal pages), each group its own spec, not all of one
    type at one block (vLLM would keep them in one group of mixed pages), and
    sliding-window MLA groups of one window side by side (vLLM's buckets fill
    first-fit by ``merge``).
    """
    kinds = {g.kind for g in groups}
    if (
        len(groups) < 2
        or GroupKind.MAMBA in kinds
        or any(g.is_eagle_group for g in groups)
        or len(
            {
                (
                    g.kind,
                    g.block_size_tokens,
                    g.sliding_window_tokens,
                    g.attention_chunk_size_tokens,
                )
                for g in groups
            }
        )
        < len(groups)
    ):
        return None
    first = groups[0]
    if all(
        g.kind in _ONE_TYPE_WITH[first.kind]
        and g.sliding_window_tokens == first.sliding_window_tokens
        and g.attention_chunk_size_tokens == first.attention_chunk_size_tokens
        for g in groups
    ):
        return None
    # vLLM buckets sliding-window MLA layers of one window together whatever
    # their blocks (``SlidingWindowMLASpec.merge`` takes its first spec's),
    # so its plan puts groups of one such window side by side.
    windows = [
        g.sliding_window_tokens if g.kind is GroupKind.SLIDING_WINDOW_MLA else 0 for g in groups
    ]
    if any(w and w in windows[: i - 1] and windows[i - 1] != w for i, w in enumerate(windows) if i):
        return None
    blocks = [g.block_size_tokens for g in groups]
    smallest, lcm = min(blocks), math.lcm(*blocks)
    if len(set(blocks)) < 2 or any(b % smallest for b in blocks):
        return None
    layers = []
    for g in groups:
        per_token = _PAGE_BYTES_PER_LCM_TOKEN * lcm // g.block_size_tokens
        mla = g.kind in (GroupKind.MLA, GroupKind.SLIDING_WINDOW_MLA)
        layers.append(
            LayerSpec(
                g.kind,
                head_size=per_token // 2 if mla else per_token // 4,
                sliding_window_tokens=g.sliding_window_tokens,
                attention_chunk_size_tokens=g.attention_chunk_size_tokens,
            )
        )
    try:
        return ModelDescription("drawn", tuple(layers), block_size_tokens=smallest)
    except ScenarioError:  # a head past MAX_HEADS elements: no such model
        return None


# Decode context parallel sizes drawn (ranks; DeepSeek-V3-class MLA serving
# uses 8, vLLM's DCP tests 2, 4 and 8).
_DCP_SIZES = (2, 4, 8)
# Group kinds vLLM serves under decode context parallelism.
_DCP_KINDS = frozenset({GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.MAMBA})


def _decode_context_parallel(
    draw: st.DrawFn, groups: tuple[KVCacheGroup, ...], retention: int | None
) -> tuple[tuple[KVCacheGroup, ...], int]:
    """The groups and ``dcp_world_size``: one eligible layout in four runs
    under decode context parallelism (full attention, MLA and Mamba groups
    only, with a full-attention-family group). Without Mamba the blocks stay
    (the per-rank block shrinks instead, so the hits are the same as at one
    rank: vLLM's DCP lookup path must agree); with Mamba, whose state block
    stays the cache block size, every attention block spans ``dcp`` times it,
    when the retention interval is still a multiple of that scheduler block.
    Draws nothing for other layouts, so their bytes are read as before."""
    kinds = {g.kind for g in groups}
    if not kinds <= _DCP_KINDS or not any(k.full_attention_family for k in kinds):
        return groups, 1
    if draw(st.integers(0, 3)):
        return groups, 1
    mamba = GroupKind.MAMBA in kinds
    if not mamba:
        sizes = [d for d in _DCP_SIZES if all(g.block_size_tokens % d == 0 for g in groups)]
        return (groups, draw(st.sampled_from(sizes))) if sizes else (groups, 1)
    block = next(g.block_size_tokens for g in groups if g.kind is GroupKind.MAMBA)
    sizes = [d for d in _DCP_SIZES[:2] if not retention or retention % (block * d) == 0]
    if not sizes:
        return groups, 1
    dcp = draw(st.sampled_from(sizes))
    sharded = tuple(
        g if g.kind is GroupKind.MAMBA else dataclasses.replace(g, block_size_tokens=block * dcp)
        for g in groups
    )
    return sharded, dcp


def _rejoining(
    draw: st.DrawFn, requests: list[RequestSpec], prefix: int, alignment: int
) -> list[RequestSpec]:
    """The requests, one sibling with its own tokens in six rejoining its
    source after them (``RequestSpec.rejoin_tokens``): to the source's end, a
    multiple of the hit alignment, or any length that fits. ``prefix`` and
    ``alignment`` in tokens."""
    out: list[RequestSpec] = []
    for index, r in enumerate(requests):
        source = prefix if r.shares_with is None else out[r.shares_with].prompt_tokens
        room = source - r.divergence_tokens - r.suffix_tokens
        if index and r.suffix_tokens and room > 0 and draw(st.integers(0, 5)) == 0:
            units = [k * alignment for k in range(1, 4) if k * alignment <= room] or [room]
            rejoin = draw(st.one_of(st.just(room), st.sampled_from(units), st.integers(1, room)))
            r = dataclasses.replace(r, rejoin_tokens=rejoin)
        out.append(r)
    return out


# Image identifiers the generator draws: few, so the same image recurs.
_IMAGES = ("image-a", "image-b", "image-c")
_SALTS = ("tenant-a", "tenant-b")


def _copy_boundaries(requests: list[RequestSpec]) -> set[int]:
    """Every prompt position, in tokens, where some request's copy of its
    source starts or stops (a divergence point, a rejoin's start and end):
    an image may not straddle one (:func:`differential.scenario.rules.check_mm_inputs`)."""
    cuts: set[int] = set()
    for r in requests:
        if r.shares_with is None:
            continue
        cuts.add(r.divergence_tokens)
        if r.rejoin_tokens:
            cuts.update((r.divergence_tokens + r.suffix_tokens, r.source_tokens))
    return cuts


def _multimodal(draw: st.DrawFn, requests: list[RequestSpec], alignment: int) -> list[RequestSpec]:
    """The requests, in one scenario in four with images and cache salts.

    Half the requests with tokens of their own get one to three images
    among them (``RequestSpec.mm_inputs``; lengths of 1, the hit alignment
    and either side of it, each identifier one length), placed clear of
    every copy boundary so that copies carry whole images; then, half the
    time, a sibling that swaps one of them for another image, every token
    the same (the source up to the image, the new image, the source's rest
    rejoined); and one request in six a cache salt of two. ``alignment`` in
    tokens.
    """
    if draw(st.integers(0, 3)):
        return requests
    cuts = _copy_boundaries(requests)
    lengths: dict[str, int] = {}
    sizes = st.sampled_from((1, max(1, alignment - 1), alignment, alignment + 1, 2 * alignment))
    out: list[RequestSpec] = []
    for r in requests:
        inputs: list[MultiModalInput] = []
        if r.suffix_tokens and draw(st.booleans()):
            offset = 0
            for _ in range(draw(st.integers(1, 3))):
                identifier = draw(st.sampled_from(_IMAGES))
                offset += draw(st.sampled_from((0, 0, 1, alignment)))
                room = r.suffix_tokens - offset
                length = lengths.get(identifier) or min(draw(sizes), max(1, room))
                start = r.divergence_tokens + offset
                inside = [c for c in cuts if start < c < start + length]
                if inside:  # start at the last copy boundary it straddled
                    offset += max(inside) - start
                    start = max(inside)
                if offset + length > r.suffix_tokens or any(
                    start < c < start + length for c in cuts
                ):
                    break
                lengths[identifier] = length
                inputs.append(MultiModalInput(offset, length, identifier))
                offset += length
        salt = draw(st.sampled_from(_SALTS)) if draw(st.integers(0, 5)) == 0 else None
        out.append(dataclasses.replace(r, mm_inputs=tuple(inputs), cache_salt=salt))
    owners = [i for i, r in enumerate(out) if r.mm_inputs]
    if bool(owners) and draw(st.booleans()):
        source = draw(st.sampled_from(owners))
        image = draw(st.sampled_from(out[source].mm_inputs))
        start = out[source].divergence_tokens + image.suffix_offset_tokens
        rest = out[source].prompt_tokens - start - image.length_tokens
        swapped = f"{image.identifier}-swapped"
        out.append(
            RequestSpec(
                start,
                image.length_tokens,
                shares_with=source,
                name="image swapped",
                rejoin_tokens=rest,
                mm_inputs=(MultiModalInput(0, image.length_tokens, swapped),),
                cache_salt=out[source].cache_salt,
            )
        )
    return out


def _fine_alignment(groups: tuple[KVCacheGroup, ...], hash_block: int) -> int:
    """The hit alignment of a Mamba hybrid with a hash block, in tokens: the
    hash block with fine-grained hits, else the scheduler block size."""
    probe = Scenario(
        kv_cache_groups=groups,
        requests=(RequestSpec(1, 0),),
        shared_prefix_tokens=1,
        hash_block_size_tokens=hash_block,
    )
    return probe.effective_hit_alignment_tokens


@st.composite
def _connector_stores(
    draw: st.DrawFn, num_requests: int, mamba: bool, full_attention: bool
) -> ConnectorStore | None:
    """A KV connector's remote store one workload in four (``None``
    otherwise): synchronous or asynchronous loads, up to two requests whose
    first asynchronous load fails, divergent hybrid hits on Mamba hybrids
    with full attention (the only layouts vLLM reads them on; the draw is
    made on every Mamba layout, so the bytes read stay those of before),
    prefix caching off one time in four without Mamba groups (vLLM's align
    mode needs it)."""
    if draw(st.integers(0, 3)):
        return None
    load = draw(st.sampled_from((ConnectorLoad.SYNC, ConnectorLoad.ASYNC)))
    failed: tuple[int, ...] = ()
    if load is ConnectorLoad.ASYNC:
        picked = draw(st.sets(st.integers(0, num_requests - 1), max_size=2))
        failed = tuple(sorted(picked))
    return ConnectorStore(
        load=load,
        failed_loads=failed,
        divergent_hybrid_hits=mamba and draw(st.booleans()) and full_attention,
        prefix_caching=mamba or draw(st.integers(0, 3)) > 0,
    )


def _engine_geometry(
    draw: st.DrawFn, kinds: frozenset[GroupKind] = frozenset()
) -> tuple[tuple[KVCacheGroup, ...], int | None, bool]:
    """A toy engine layout's KV cache groups, its hash block size (tokens;
    ``None`` but on Mamba hybrids with attention groups) and whether it is
    a Mamba hybrid (one layout in four; with ``kinds`` pinned, as the
    manager-mode generator pins them: :func:`_scenario_geometry`)."""
    if kinds:
        groups, pinned_hash_block, mamba = _scenario_geometry(draw, "toy", kinds, any_scale=False)
        return groups, None if len(groups) == 1 else pinned_hash_block, mamba
    hash_block: int | None = None
    mamba = draw(st.integers(0, 3)) == 0
    if mamba:
        groups, hash_block = draw(mamba_geometries("toy"))
        if len(groups) == 1:
            hash_block = None
    else:
        groups = draw(geometries("toy"))
    return groups, hash_block, mamba


def _engine_drafter(draw: st.DrawFn, groups: tuple[KVCacheGroup, ...], mamba: bool) -> Drafter:
    """The engine workload's drafter, with one to three speculative tokens (a
    multi-module MTP two up to the scheduler block's, at most three): the
    drafters a Mamba hybrid's models ship on Mamba hybrids, none that drops
    on a Mamba-only model."""
    kinds: tuple[DrafterKind, ...] = _ENGINE_DRAFTERS_MAMBA if mamba else _ENGINE_DRAFTERS
    if mamba and len(groups) == 1:
        # A Mamba-only model has no attention layer for a drafter's KV
        # (vLLM's planner warns): no drafter that drops.
        kinds = tuple(k for k in kinds if k not in _DROPPING)
    kind = draw(st.sampled_from(kinds))
    if kind is DrafterKind.NONE:
        return Drafter()
    if kind is DrafterKind.MULTI_MODULE_MTP:
        # One MTP module per token, at most the scheduler block of them.
        block = math.lcm(*(g.block_size_tokens for g in groups))
        return Drafter(kind, draw(st.integers(2, max(2, min(3, block)))))
    return Drafter(kind, draw(st.integers(1, 3)))


def _chat_sessions(
    draw: st.DrawFn, alignment: int, decode_steps: int, shares_output: bool
) -> tuple[list[RequestSpec], int, int]:
    """The requests of one to four chat sessions of one to three turns, in
    round-robin order, the number of sessions and the shared prefix (tokens:
    none, one or four hit alignments): a first turn that shares the prefix
    or not with up to eight alignments of its own tokens, each later turn
    copying the turn before's prompt (and, with ``shares_output``, its
    ``decode_steps + 1`` output tokens) plus new tokens around the hit
    alignment."""
    sessions = draw(st.integers(1, 4))
    turns = draw(st.integers(1, 3))
    prefix = draw(st.sampled_from((0, alignment, 4 * alignment)))
    base = st.integers(1, 8 * alignment)
    new_tokens = st.sampled_from((1, alignment, alignment + 1, 2 * alignment))
    requests: list[RequestSpec] = []
    for turn in range(turns):
        for session in range(sessions):
            if turn == 0:
                shared = draw(st.sampled_from((0, prefix)))
                spec = RequestSpec(shared, draw(base), name=f"s{session}t1")
            else:
                previous = (turn - 1) * sessions + session
                source = requests[previous].prompt_tokens
                source += decode_steps + 1 if shares_output else 0
                spec = RequestSpec(source, draw(new_tokens), previous, f"s{session}t{turn + 1}")
            requests.append(spec)
    return requests, sessions, prefix


def _arrival_steps(draw: st.DrawFn, num_requests: int, sessions: int) -> tuple[int, ...] | None:
    """The step each request arrives at, two workloads in three: each round
    of ``sessions`` requests a gap of 0, 1, 4 or 16 steps after the one
    before (several requests in flight); ``None`` (sequential) otherwise."""
    if not draw(st.integers(0, 2)):
        return None
    gap = draw(st.sampled_from((0, 1, 4, 16)))
    return tuple((i // sessions) * gap for i in range(num_requests))


def _accepted_drafts(draw: st.DrawFn, drafter: Drafter) -> tuple[int, ...]:
    """Half the time with a drafter, the draft tokens accepted per step (one to
    three steps' counts, cycled; each at most the speculative tokens);
    ``()`` (no drafts proposed) otherwise."""
    if not drafter.num_speculative_tokens or not draw(st.booleans()):
        return ()
    limit = drafter.num_speculative_tokens
    return tuple(draw(st.lists(st.integers(0, limit), min_size=1, max_size=3)))


def _pool_bounds(
    groups: tuple[KVCacheGroup, ...],
    lengths: list[int],
    sessions: int,
    reserve: int,
    speculative_tokens: int,
) -> tuple[int, int]:
    """The fewest blocks the pool may hold (the longest request alone, with
    ``reserve`` tokens for its decode and drafts; a Mamba group's state
    blocks for its speculative tokens besides) and the working set, in
    blocks: every session's last turn at once. ``lengths`` are the
    requests' prompts, in tokens."""
    # A Mamba group in align mode holds a block per block of tokens while a
    # request runs, and state blocks for its speculative tokens besides.
    need = 2 + sum(
        math.ceil((max(lengths) + reserve) / g.block_size_tokens)
        + (2 + speculative_tokens if g.kind is GroupKind.MAMBA else 0)
        for g in groups
    )
    working = 1 + sum(
        math.ceil((lengths[-sessions + s] + reserve) / g.block_size_tokens)
        for s in range(sessions)
        for g in groups
    )
    return need, working


def _client_aborts(
    draw: st.DrawFn, store: ConnectorStore | None, num_requests: int
) -> tuple[int | None, ...] | None:
    """With a KV connector, one workload in four a client aborting one request
    a few steps in (``Workload.abort_steps``); ``None`` otherwise."""
    if store is None or draw(st.integers(0, 3)):
        return None
    # A client aborting one request a few steps in (mid-prefill, often):
    # the producer's hand-off of a request that never finished.
    doomed = draw(st.integers(0, num_requests - 1))
    step = draw(st.sampled_from((1, 2, 3, 5, 8)))
    return tuple(step if i == doomed else None for i in range(num_requests))


def _async_scheduling(draw: st.DrawFn, drafter: DrafterKind) -> bool:
    """One workload in four vLLM's ``AsyncScheduler`` (``Workload.async_scheduling``),
    never with an n-gram drafter (vLLM refuses async scheduling with it on
    the V1 model runner, ``VllmConfig.__post_init__``)."""
    if drafter is DrafterKind.NGRAM:
        return False
    return draw(st.integers(0, 3)) == 0


def _scheduling_and_events(
    draw: st.DrawFn, workload: Workload, kind: DrafterKind, mamba: bool
) -> Workload:
    """``workload`` with async scheduling (:func:`_async_scheduling`), then KV
    cache events (:func:`_kv_events`, one workload in four) and the stream's
    view (:func:`_kv_events_view`), drawn in that order."""
    workload = dataclasses.replace(workload, async_scheduling=_async_scheduling(draw, kind))
    events = _kv_events(draw, mamba)
    return dataclasses.replace(
        workload, kv_events=events, kv_events_view=_kv_events_view(draw, events)
    )


def _prefill_policy(draw: st.DrawFn, workload: Workload, longest: int) -> Workload:
    """``workload`` with the Scheduler's prefill policy: one workload in four
    a long-prefill cap of 8 to 48 tokens (at most ``longest``, the longest
    prompt, in tokens), half of those floored at a fair share of the budget;
    one in four a local prefill cadence of 2, 4 or 8 steps."""
    cap = 0
    if draw(st.integers(0, 3)) == 0:
        cap = min(longest, draw(st.sampled_from((8, 16, 24, 48))))
    adaptive = cap > 0 and draw(st.booleans())
    interval = draw(st.sampled_from((2, 4, 8))) if draw(st.integers(0, 3)) == 0 else 1
    return dataclasses.replace(
        workload,
        long_prefill_token_threshold=cap,
        long_prefill_token_threshold_adaptive=adaptive,
        prefill_schedule_interval=interval,
    )


def _engine_mamba_options(mamba: bool, hash_block: int | None) -> dict[str, Any]:
    """A Mamba hybrid's scenario fields in scheduler mode: its hash block
    (tokens) and vLLM's Scheduler's own prefill chunking; none otherwise."""
    if not mamba:
        return {}
    return {"hash_block_size_tokens": hash_block, "mamba_prefill": MambaPrefill.SCHEDULER}


@st.composite
def engine_scenarios(
    draw: st.DrawFn, scale: Scale = "toy", kinds: frozenset[GroupKind] = frozenset()
) -> Scenario:
    """A scheduler-mode scenario: chat sessions through vLLM's ``Scheduler``.

    One to four sessions of one to three turns fired round robin (vLLM issue
    #48435's pattern), turn n+1 copying turn n's prompt (and, with
    ``shares_output``, its answer) plus new tokens; arrivals either
    sequential or by step (several requests in flight); decode lengths;
    drafters of every kind (the drop ones with vLLM's draft KV groups, as
    the manager-mode generator marks them) with accepted / rejected drafts
    per step; one layout in four a Mamba hybrid (the Scheduler's own prefill
    chunks, sometimes fine-grained hash blocks); a pool from a third of the
    working set (eviction, preemption) to four times it, never below what
    the longest request needs alone; one workload in four (not with chunked
    local attention, whose drop a connector would turn on) a KV connector
    with a remote store (:func:`_connector_stores`; its grid and capacity:
    :func:`_store_bounds`), and one of those in four a client aborting one
    request a few steps in; async scheduling and KV cache events
    (:func:`_scheduling_and_events`), then the prefill policy
    (:func:`_prefill_policy`), and one Mamba hybrid in four without a store
    or events with prefix caching off (:func:`_cache_off`). ``scale``:
    ``toy`` (the only scale); ``kinds``
    pins KV cache group kinds every scenario contains (``kvfuzz fuzz --mode
    scheduler --groups``; empty: any layout).
    """
    del scale  # toy scale first
    groups, hash_block, mamba = _engine_geometry(draw, kinds)
    chunked = any(g.kind is GroupKind.CHUNKED_LOCAL_ATTENTION for g in groups)
    alignment = math.lcm(*(g.block_size_tokens for g in groups))
    # Retention is a multiple of the scheduler block, whatever the hash block.
    retention = draw(st.sampled_from((None, None, 0, alignment, 4 * alignment)))
    if mamba and hash_block is not None:
        alignment = _fine_alignment(groups, hash_block)
    if retention and not any(
        g.kind.sliding_window_family or g.kind is GroupKind.MAMBA for g in groups
    ):
        retention = 0  # vLLM accepts only None or 0 without SWA or Mamba groups
    drafter = _engine_drafter(draw, groups, mamba)
    kind = drafter.kind
    disable_lookahead = not chunked and draw(st.booleans())
    if not mamba:  # the state-group oracle models the drop on every group
        # Gemma-4 MTP has no draft layer, so no draft group.
        dropping = kind in _DROPPING and kind is not DrafterKind.GEMMA4_MTP
        groups = draw(_draft_groups(groups, dropping and disable_lookahead))
    decode_steps = draw(st.sampled_from((0, 1, 3, 6)))
    shares_output = draw(st.booleans())
    requests, sessions, prefix = _chat_sessions(draw, alignment, decode_steps, shares_output)
    lengths = [r.prompt_tokens for r in requests]
    arrivals = _arrival_steps(draw, len(requests), sessions)
    accepted = _accepted_drafts(draw, drafter)
    chunk = draw(st.sampled_from((alignment, 2 * alignment, 16, 32, 64)))
    reserve = decode_steps + 2 * drafter.num_speculative_tokens + 2
    need, working = _pool_bounds(groups, lengths, sessions, reserve, drafter.num_speculative_tokens)
    factor = draw(st.sampled_from((0.3, 0.6, 1.0, 2.0, 4.0)))
    budget = draw(st.sampled_from((None, 2 * chunk)))
    pool = max(need, int(working * factor))
    max_num_seqs = min(draw(st.sampled_from((1, 2, 4, 8))), budget or chunk)
    # Drawn last, so every draw above reads the bytes it read before.
    full_attention = any(g.kind.full_attention_family for g in groups)
    store = None if chunked else draw(_connector_stores(len(requests), mamba, full_attention))
    aborts = _client_aborts(draw, store, len(requests))
    workload = Workload(
        mode=DriveMode.SCHEDULER,
        pool_blocks=pool,
        arrival_steps=arrivals,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        shares_output=shares_output,
        accepted_drafts=accepted,
        connector=store,
        abort_steps=aborts,
    )
    # Sharded attention blocks hold more tokens: the pool still suffices.
    groups, dcp = _decode_context_parallel(draw, groups, retention)
    workload = _prefill_policy(
        draw, _scheduling_and_events(draw, workload, kind, mamba), max(lengths)
    )
    try:
        scenario = Scenario(
            kv_cache_groups=groups,
            requests=tuple(requests),
            shared_prefix_tokens=prefix,
            retention_interval_tokens=retention,
            drafter=drafter,
            # vLLM runs no EAGLE drop on chunked local attention: such layouts
            # keep lookahead block hashes on (the drop off).
            disable_lookahead_block_hashes=disable_lookahead,
            prefill_chunk_tokens=chunk,
            decode_steps=decode_steps,
            name="engine",
            workload=workload,
            dcp_world_size=dcp,
            kv_connector=store is not None,
            **_engine_mamba_options(mamba, hash_block),
        )
        return _last_draws(draw, scenario)
    except ScenarioError as exc:  # pragma: no cover - the generator's own bug
        raise AssertionError(f"the engine generator produced an invalid scenario: {exc}") from exc


def _last_draws(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """The engine generator's last draws, in this order, so that every draw
    before them reads the bytes it read before: the store's bounds, the
    disaggregation, the managers of their own, the prefill checkpoints, the
    bounded replay, a skipped read, prefix caching off, a connector
    without the hybrid allocator, failed loads that fail their requests, a
    model length the requests reach and the priority policy."""
    scenario = _undriven_managers(draw, _disaggregation(draw, _store_bounds(draw, scenario)))
    scenario = _skipped_read(draw, _bounded_replay(draw, _prefill_checkpoints(draw, scenario)))
    scenario = _failing_loads(draw, _legacy_connector(draw, _cache_off(draw, scenario)))
    return _priorities(draw, _tight_model_len(draw, scenario))


def _priorities(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """One workload in four whose requests arrive at steps of their own
    (``arrival_steps``, so several may wait or run at once) runs under vLLM's
    priority policy, each request's priority 0 to 3 (``Workload.priorities``);
    not a chat (``shares_output``), whose next turn no client sends before
    its source's answer, which a priority could put first. Drawn last, and
    only for such a workload, so every other scenario keeps its bytes."""
    w = scenario.workload
    if w.arrival_steps is None or w.shares_output or w.mode is not DriveMode.SCHEDULER:
        return scenario
    if draw(st.integers(0, 3)):
        return scenario
    priorities = tuple(draw(st.integers(0, 3)) for _ in scenario.requests)
    return dataclasses.replace(scenario, workload=dataclasses.replace(w, priorities=priorities))


def _tight_model_len(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """One scenario with speculative tokens in four runs with a model length
    its longest request reaches (``Workload.max_model_len_tokens``): the
    longest prompt plus ``decode_steps + 1``, and up to the speculative
    tokens more, so that the spec-decode pad's room check and the caps at
    the model length bind. Drawn last, and only for such a scenario, so
    every other scenario keeps its bytes."""
    spec = scenario.drafter.num_speculative_tokens
    if spec == 0 or scenario.workload.mode is not DriveMode.SCHEDULER:
        return scenario
    if draw(st.integers(0, 3)):
        return scenario
    need = max(r.prompt_tokens for r in scenario.requests) + scenario.decode_steps + 1
    length = need + draw(st.integers(0, spec))
    return dataclasses.replace(
        scenario, workload=dataclasses.replace(scenario.workload, max_model_len_tokens=length)
    )


def _failing_loads(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """One store in two with failed loads fails their requests
    (``kv_load_failure_policy`` ``fail``, vLLM's default) instead of
    recomputing them. Drawn last, and only for such a store, so every other
    scenario keeps its bytes."""
    store = scenario.workload.connector
    if store is None or not store.failed_loads or draw(st.booleans()):
        return scenario
    failing = dataclasses.replace(store, kv_load_failure_policy=LoadFailurePolicy.FAIL)
    return dataclasses.replace(
        scenario, workload=dataclasses.replace(scenario.workload, connector=failing)
    )


def _legacy_connector(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """One store in four on a one-group layout belongs to a connector
    without the hybrid allocator (``ConnectorStore.supports_hma`` false:
    vLLM finishes its requests by ``Scheduler._connector_finished``'s legacy
    path). Drawn last, and only for such a store, so every other scenario
    keeps its bytes."""
    store = scenario.workload.connector
    if store is None or len(scenario.kv_cache_groups) != 1 or draw(st.integers(0, 3)):
        return scenario
    legacy = dataclasses.replace(store, supports_hma=False)
    return dataclasses.replace(
        scenario, workload=dataclasses.replace(scenario.workload, connector=legacy)
    )


def _cache_off(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """One Mamba hybrid in four without a connector store or KV cache events
    runs with prefix caching off (``Workload.prefix_caching``: vLLM's Mamba
    ``mamba_cache_mode="none"``, one whole-length state block per request
    and one per speculative token), its retention and checkpoints dropped.
    Drawn last, and only for such a hybrid, so every other scenario keeps
    its bytes."""
    w = scenario.workload
    if not scenario.mamba_groups or w.connector is not None or w.kv_events is not KVEvents.OFF:
        return scenario
    if draw(st.integers(0, 3)) != 0:
        return scenario
    return dataclasses.replace(
        scenario,
        retention_interval_tokens=None,
        mamba_prefill=MambaPrefill.SCHEDULER,
        enable_mamba_shared_prefix_checkpoint=False,
        workload=dataclasses.replace(w, prefix_caching=False),
    )


def _skipped_read(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """One scenario in eight of two requests or more has a later request
    that skips reading the prefix cache, as a ``prompt_logprobs`` request
    does (``skip_reading_prefix_cache``, vLLM PR #28194): owed no hit, its
    blocks still cached. Drawn last, so every other scenario keeps its
    bytes."""
    count = len(scenario.requests)
    if count < 2 or draw(st.integers(0, 7)) != 0:
        return scenario
    index = draw(st.integers(1, count - 1))
    requests = list(scenario.requests)
    requests[index] = dataclasses.replace(requests[index], skip_reading_prefix_cache=True)
    return dataclasses.replace(scenario, requests=tuple(requests))


def _bounded_replay(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """One layout in four with sliding-window MLA groups, not laid out from
    a model, runs them as DeepSeek-V4.1 does (vLLM PR #56227): the groups of
    the first one's window take bounded replay (``bounded_replay``: out of
    prefix caching, a hit's last window recomputed), draft groups and a
    layout left without a prefix-cacheable group excepted. Drawn only for
    those, and last, so every other scenario keeps its bytes."""
    groups = scenario.kv_cache_groups
    swmla = [g for g in groups if g.kind is GroupKind.SLIDING_WINDOW_MLA and not g.is_eagle_group]
    if not swmla or scenario.model is not None or draw(st.integers(0, 3)) != 0:
        return scenario
    window = swmla[0].sliding_window_tokens
    replayed = tuple(
        dataclasses.replace(g, bounded_replay=True)
        if g in swmla and g.sliding_window_tokens == window
        else g
        for g in groups
    )
    if not any(g.prefix_cacheable for g in replayed):
        return scenario
    return dataclasses.replace(scenario, kv_cache_groups=replayed)


def _prefill_checkpoints(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """One Mamba layout in two that vLLM's own chunking prefills
    (``mamba_prefill: scheduler``), not laid out from a model, gets Mamba
    layers that export the prompt's checkpoint from inside a step
    (``mamba_prefill: checkpoint``: one prefill checkpoint block at alignment
    1, as every Mamba2 layer of vLLM 0.33.0 declares it,
    ``MambaMixer2.get_kv_cache_spec``). Drawn only for those, and last, so
    every other scenario keeps its bytes."""
    if not scenario.mamba_groups or scenario.model is not None:
        return scenario
    if scenario.mamba_prefill is not MambaPrefill.SCHEDULER or not draw(st.booleans()):
        return scenario
    return dataclasses.replace(scenario, mamba_prefill=MambaPrefill.CHECKPOINT)


def _hidden_state_layer(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """One model-level scenario in three gains a hidden-state cache layer
    (vLLM's hidden-state extraction: a ``HiddenStateCacheSpec``, which
    ``get_kv_cache_groups``, vllm/v1/core/kv_cache_planning.py, plans in a
    group of its own at the largest block that divides every other group's
    and whose entries fit the common page) and the MLA group vLLM plans for
    it (``FullAttentionManager`` manages both). The group's block ``h`` is
    drawn among the divisors of the groups' GCD, and the layer built for it:
    an entry of P / h bytes, P = 256 x the blocks' LCM the common page of a
    :func:`model_of` model, bf16. Draws nothing without a model."""
    model = scenario.model
    if model is None or draw(st.integers(0, 2)) != 0:
        return scenario
    groups = scenario.kv_cache_groups
    blocks = [g.block_size_tokens for g in groups]
    common, lcm = math.gcd(*blocks), math.lcm(*blocks)
    block = draw(st.sampled_from([d for d in range(1, common + 1) if common % d == 0]))
    # 128 x lcm / h elements a token (2 bytes each), split into at most 128
    # heads of at most MAX_HEADS elements (128 divides the count).
    elements = _PAGE_BYTES_PER_LCM_TOKEN * lcm // block // 2
    heads = next((h for h in (1, 2, 4, 8, 16, 32, 64, 128) if elements // h <= MAX_HEADS), None)
    if heads is None:
        return scenario
    layer = LayerSpec(
        GroupKind.MLA, num_kv_heads=heads, head_size=elements // heads, hidden_state=True
    )
    grown = (*groups, KVCacheGroup(GroupKind.MLA, block))
    workload = scenario.workload
    if workload.pool_blocks is not None:
        workload = dataclasses.replace(workload, pool_blocks=_grown_pool(scenario, grown))
    return dataclasses.replace(
        scenario,
        kv_cache_groups=grown,
        model=dataclasses.replace(model, layers=(*model.layers, layer)),
        workload=workload,
    )


def _undriven_managers(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """One attention layout in ten (no Mamba, chunked local attention or
    decode context parallelism) gains a circular buffer group
    (``CircularBufferManager``, at the layout's smallest block, as
    :func:`_pin` adds it: DeepSeek-V4.1's compressor ring beside its
    prefix-cached groups); the pool grows by the blocks it needs for every
    request at once. Two kinds with managers of their own are drawn only
    when ``--groups`` pins them: R-SWA, whose one model in vLLM 0.33.0 turns
    prefix caching off (``UnlimitedOCRForCausalLMConfig``,
    vllm/model_executor/models/config.py: its decode-phase KV "cannot be
    safely reused"), and sink full attention, whose manager no release
    kvfuzz drives can build (known issue
    ``sink-full-attention-manager-rejects-needs-kv-cache-zeroing``)."""
    kinds = {g.kind for g in scenario.kv_cache_groups}
    if draw(st.integers(0, 9)) != 1 or GroupKind.CIRCULAR_BUFFER in kinds:
        return scenario
    if kinds & {GroupKind.MAMBA, GroupKind.CHUNKED_LOCAL_ATTENTION} or scenario.dcp_world_size > 1:
        return scenario
    groups = _pin(scenario.kv_cache_groups, frozenset({GroupKind.CIRCULAR_BUFFER}))
    workload = dataclasses.replace(scenario.workload, pool_blocks=_grown_pool(scenario, groups))
    return dataclasses.replace(scenario, kv_cache_groups=groups, workload=workload)


def _grown_pool(scenario: Scenario, groups: tuple[KVCacheGroup, ...]) -> int:
    """The pool, in blocks, once ``scenario``'s groups become ``groups``:
    its blocks (none when unset) grown by the working set the new groups
    add, and at least the fewest blocks they need (:func:`_pool_bounds`)."""
    lengths = [r.prompt_tokens for r in scenario.requests]
    reserve = scenario.decode_steps + 2 * scenario.drafter.num_speculative_tokens + 2
    spec = scenario.drafter.num_speculative_tokens
    before = _pool_bounds(scenario.kv_cache_groups, lengths, len(lengths), reserve, spec)
    after = _pool_bounds(groups, lengths, len(lengths), reserve, spec)
    return max(after[0], (scenario.workload.pool_blocks or 0) + after[1] - before[1])


def _disaggregation(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """Disaggregated prefill and decode (``workload.connector.kv_role``
    ``kv_consumer``: a prefill instance computes every request first) for
    one unbounded store in three, its loads asynchronous (vLLM's P/D
    connectors load between steps, ``WAITING_FOR_REMOTE_KVS``), or, one in
    four without failed loads, synchronous (a connector's
    ``get_num_new_matched_tokens`` says which: the load then runs in the
    admitting step's forward pass)."""
    store = scenario.workload.connector
    if store is None or store.bounded or draw(st.integers(0, 2)):
        return scenario
    load = ConnectorLoad.ASYNC
    if not store.failed_loads and draw(st.integers(0, 3)) == 0:
        load = ConnectorLoad.SYNC
    consumer = dataclasses.replace(store, kv_role=KVRole.KV_CONSUMER, load=load)
    return dataclasses.replace(
        scenario, workload=dataclasses.replace(scenario.workload, connector=consumer)
    )


def _store_bounds(draw: st.DrawFn, scenario: Scenario) -> Scenario:
    """A KV connector store's own grid and capacity: one store in two on a
    grid of 1, 2 or 4 scheduler blocks (``chunk_tokens``), one in two
    bounded, at a quarter, half or all of the chunks the workload's tokens
    could fill (``capacity_chunks``: every request's prompt and answer, in
    chunks, times the KV cache groups)."""
    store = scenario.workload.connector
    if store is None:
        return scenario
    grid = None
    if draw(st.booleans()):
        grid = draw(st.sampled_from((1, 2, 4))) * scenario.scheduler_block_size_tokens
    capacity = None
    if draw(st.booleans()):
        chunk = grid or scenario.effective_hash_block_size_tokens
        tokens = sum(r.prompt_tokens + scenario.decode_steps + 1 for r in scenario.requests)
        chunks = tokens // chunk * len(scenario.kv_cache_groups)
        capacity = max(1, int(chunks * draw(st.sampled_from((0.25, 0.5, 1.0)))))
    if grid is None and capacity is None:
        return scenario
    bounded = dataclasses.replace(store, chunk_tokens=grid, capacity_chunks=capacity)
    return dataclasses.replace(
        scenario, workload=dataclasses.replace(scenario.workload, connector=bounded)
    )

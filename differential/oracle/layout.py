"""Layout findings: what a KV cache layout costs before any manager runs.

Nothing here imports vLLM. vLLM aligns every hybrid cache hit to the
scheduler block size, the LCM of the group block sizes
(``HybridKVCacheCoordinator._cache_hit_alignment_tokens`` in
vllm/v1/core/kv_cache_coordinator.py; ``resolve_kv_cache_block_sizes`` in
vllm/v1/core/kv_cache_utils.py). When the block sizes divide one another the
LCM is the largest block and nothing is lost; when they do not, the LCM
exceeds every block and each hit is rounded down to it. vLLM PR #52804: a
drafter KV block of 3456 tokens beside a target block of 1536 makes the
alignment 13824 tokens, about 7K tokens lost per request.

:func:`alignment_blowup` prices that on the scenario's own requests: per
sibling, the dense-reference hit at the granularity of the largest group
block against the dense-reference hit at the alignment, in tokens.

The alignment can also be a block vLLM chose for another group, far above
the full-attention block: vllm-ascend issue #16270, a scheduler block of
4096 tokens (a Mamba group's) beside a full-attention block of 128, where
every prompt shorter than 4096 tokens gets 0. That is flagged too, when the
alignment exceeds the full-attention block and a sibling whose prompt is
shorter than the alignment loses a hit the full-attention block would give
(priced over the full-attention groups alone: the other groups' blocks are
what is at issue).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from differential.errors import ScenarioError
from differential.findings import Finding, FindingKind
from differential.observation import KVCachePlan, PlannedTensor, RunObservation, layer_names_text
from differential.oracle.core import dense_hit, drafter_model
from differential.oracle.prefix import shared_prefixes
from differential.scenario import GroupKind, Scenario
from differential.scenario.models import LayerSpec, ModelDescription

__all__ = [
    "LAYOUT_VARIANT",
    "SPEC_CLASS",
    "OwedGroup",
    "alignment_blowup",
    "alignment_losses",
    "kv_cache_plan_findings",
    "layer_page_bytes",
    "merges_unequal_layers",
    "owed_groups",
    "owed_tensors",
    "owed_tp_replicas",
]

#: The ``variant`` of a layout finding: it belongs to the layout, not to a
#: manager, so it is reported once per scenario.
LAYOUT_VARIANT = "layout"


def alignment_losses(scenario: Scenario, granularity_tokens: int | None = None) -> tuple[int, ...]:
    """Tokens each request loses to the hit alignment, per request (0 for the first).

    For request ``j`` the best dense-reference hit over the earlier requests
    at the granularity of the largest group block (or ``granularity_tokens``),
    minus the same at the hit alignment ``A``
    (:func:`differential.oracle.core.dense_hit`), in tokens.
    """
    largest = granularity_tokens or max(g.block_size_tokens for g in scenario.kv_cache_groups)
    return _losses(scenario, scenario, largest)


def _losses(scenario: Scenario, at_block_scenario: Scenario, block_tokens: int) -> tuple[int, ...]:
    """Per request ``j`` (0 for the first): the best dense hit of
    ``at_block_scenario`` over the earlier requests at ``block_tokens``
    granularity, minus ``scenario``'s best at its hit alignment, in tokens."""
    model, block_model = drafter_model(scenario), drafter_model(at_block_scenario)
    # Shared tokens by content, an earlier turn's answer included in a
    # multi-turn chat (both scenarios have the same requests).
    rows = shared_prefixes(scenario)
    losses = [0]
    for j in range(1, len(rows)):
        at_block, at_alignment = 0, 0
        for i in range(j):
            shared = rows[j][i]
            at_block = max(
                at_block, dense_hit(at_block_scenario, block_model, j, i, shared, block_tokens)
            )
            at_alignment = max(at_alignment, dense_hit(scenario, model, j, i, shared))
        losses.append(max(0, at_block - at_alignment))
    return tuple(losses)


def _full_attention_losses(scenario: Scenario, block_tokens: int) -> tuple[int, ...]:
    """Per request, what the full-attention groups alone would give at their
    block's granularity minus the hit at the alignment, in tokens (0 for the
    first): the other groups' blocks are the alignment at issue."""
    groups = tuple(g for g in scenario.kv_cache_groups if g.kind.full_attention_family)
    try:
        alone = dataclasses.replace(
            scenario,
            kv_cache_groups=groups,
            hash_block_size_tokens=None,
            hit_alignment_tokens=None,
            retention_interval_tokens=None,
        )
    except ScenarioError:
        return alignment_losses(scenario, block_tokens)
    return _losses(scenario, alone, block_tokens)


def _describe(scenario: Scenario) -> str:
    return ", ".join(
        f"group {i} {'draft ' if g.is_eagle_group else ''}{g.kind.value} "
        f"block {g.block_size_tokens}"
        for i, g in enumerate(scenario.kv_cache_groups)
    )


def alignment_blowup(scenario: Scenario) -> Finding | None:
    """An ``alignment-blowup`` finding when the hit alignment exceeds the
    largest group block size, or exceeds the full-attention block while a
    sibling shorter than the alignment loses everything; else ``None``.

    The finding names the groups (index, kind, block size in tokens, draft
    mark), the alignment in tokens and the tokens each sibling loses to it
    (:func:`alignment_losses`); ``expected_tokens`` is the largest block
    (the full-attention block in the second form), ``hit_tokens`` the
    alignment. Fine-grained Mamba hits align to the hash block instead,
    which never exceeds a block: no finding.
    """
    alignment = scenario.effective_hit_alignment_tokens
    largest = max(g.block_size_tokens for g in scenario.kv_cache_groups)
    if alignment > largest:
        losses = alignment_losses(scenario)
        return Finding(
            FindingKind.ALIGNMENT_BLOWUP,
            LAYOUT_VARIANT,
            None,
            f"hit alignment {alignment} tokens (LCM of {_describe(scenario)}) exceeds the "
            f"largest block {largest}: siblings lose {list(losses[1:])} tokens "
            f"(total {sum(losses)}) against hits at the largest block's granularity",
            expected_tokens=largest,
            hit_tokens=alignment,
        )
    full = [g.block_size_tokens for g in scenario.kv_cache_groups if g.kind.full_attention_family]
    if not full or alignment <= min(full):
        return None
    block = min(full)
    losses = _full_attention_losses(scenario, block)
    prompts = [r.prompt_tokens for r in scenario.requests]
    starved = [j for j in range(1, len(losses)) if prompts[j] < alignment and losses[j] > 0]
    if not starved:
        return None
    return Finding(
        FindingKind.ALIGNMENT_BLOWUP,
        LAYOUT_VARIANT,
        None,
        f"hit alignment {alignment} tokens ({_describe(scenario)}) exceeds the "
        f"full-attention block {block}: requests {starved}, shorter than {alignment} "
        f"tokens, get 0 where the full-attention block gives "
        f"{[losses[j] for j in starved]} tokens; siblings lose {list(losses[1:])} tokens "
        f"(total {sum(losses)})",
        expected_tokens=block,
        hit_tokens=alignment,
    )


# ------------------------------------------------------------ the KV cache plan
#
# What vLLM's planner owes a model-level scenario's model, from the layers'
# page sizes alone (nothing here imports vLLM). The rules, as vLLM 0.33.0
# states them (vllm/v1/core/kv_cache_planning.py unless named):
#
# * a layer's page is the bytes one block of it holds: 2 (K and V) x block x
#   KV heads x head size x dtype bytes for attention (``AttentionSpec``), the
#   same without the 2 for MLA (one latent per token), the states' bytes for
#   Mamba, whatever the block (``MambaSpec.page_size_bytes``,
#   vllm/v1/kv_cache_interface.py);
# * identical layers form one group (``_get_kv_cache_groups_uniform_spec``);
#   layers of one attention type at one block size form one group of mixed
#   pages (``UniformTypeKVCacheSpecs.from_specs``; MLA counts as full
#   attention, sliding-window MLA beside a first sliding-window layer as
#   sliding window), one tensor per distinct layer spec
#   (``get_kv_cache_config_from_groups``'s ``layers_by_spec``);
# * otherwise every page is unified to the largest, P
#   (``unify_kv_cache_spec_page_size``): an attention layer whose page p
#   divides P gets a block P/p times larger, in tokens; a Mamba layer's page,
#   and an attention page that does not divide P, is padded to P, its block
#   unchanged (vLLM PR #45207);
# * equal (unified) layers form a bucket, in the order their first layer
#   comes; all buckets are split into groups of one size, the smallest
#   bucket's, or the largest's when it is under 1.5 times the smallest; a
#   bucket of n layers makes ceil(n / size) groups, group i holding its
#   layers i, i + groups, ... (``_get_kv_cache_groups_uniform_page_size``:
#   "a model with 10 full attention layers and 20 sliding window attention
#   layers ... 3 kv_cache_groups, each of which represents 10 layers");
# * hidden-state layers (``HiddenStateCacheSpec``, vLLM's hidden-state
#   extraction) join no bucket ("Hidden-state layers use their own block
#   table and must not be absorbed into a compatible attention bucket",
#   ``get_kv_cache_groups``): after the split each makes a group of its own,
#   its page padded to the common page P ("page aligned to the common page")
#   and its block the largest that divides every other group's block and
#   whose entries fit in P (one token's entry at least: when one does not fit,
#   every group's block and P are first scaled by the smallest integer that
#   makes it, ``_ensure_min_page_size``); among layers of one type and one
#   block, or all alike, a hidden-state layer counts as MLA;
# * every sliding window keeps the drafter's re-prefillable tail past it,
#   ``extra_retained_tokens`` = ``num_prefill_lookahead_tokens`` - 1
#   (``get_global_kv_cache_groups``: multi-module MTP re-prefills its last
#   tokens; :func:`differential.oracle.core.drafter_model`);
# * the scheduler block is the LCM of the group blocks, the hash block their
#   GCD; one group's are both the configured block
#   (``resolve_kv_cache_block_sizes``, vllm/v1/core/kv_cache_utils.py);
# * a layer-outermost layout gives each layer its own region of every tensor:
#   one block of the pool costs the largest group's pages summed
#   (``_get_kv_cache_bytes_per_block``), the pool holds
#   ``num_gpu_blocks_override`` blocks (``may_override_num_blocks``), every
#   tensor is num_blocks x that many bytes, each layer's blocks lie one page
#   apart and its region num_blocks pages long, the layers of one spec side by
#   side from the end of the previous spec's (vLLM PR #14079 made one tensor
#   serve one layer of every group: groups alias from byte 0).
#
# * an MLA page that does not divide the largest cannot be unified: MLA,
#   full-attention and sliding-window layers then make one group of mixed
#   pages at the full-attention block, the windows allocated as full
#   attention (``_try_get_full_allocation_fallback_groups``).
#
# Not judged (no finding either way): block-outermost layouts (packed pages,
# ``_get_packed_kv_cache_groups``), compressed MLA (``tokens_per_state`` > 1),
# an MLA page that does not divide the largest beside other kinds, and Mamba
# layers of one block with mixed pages.

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1}

#: vLLM's spec class per layer kind (vllm/v1/kv_cache_interface.py).
SPEC_CLASS = {
    GroupKind.FULL_ATTENTION: "FullAttentionSpec",
    GroupKind.SLIDING_WINDOW: "SlidingWindowSpec",
    GroupKind.CHUNKED_LOCAL_ATTENTION: "ChunkedLocalAttentionSpec",
    GroupKind.MLA: "MLAAttentionSpec",
    GroupKind.SLIDING_WINDOW_MLA: "SlidingWindowMLASpec",
    GroupKind.MAMBA: "MambaSpec",
}


@dataclasses.dataclass(frozen=True)
class _Layer:
    """One layer as the planner sees it: its block (tokens) and page (bytes)."""

    name: str
    spec: LayerSpec
    block_tokens: int
    page_bytes: int

    @property
    def shape(self) -> tuple[object, ...]:
        """What makes two layers one spec (the draft mark does not:
        ``KVCacheSpec.is_draft`` is ``compare=False``)."""
        s = self.spec
        return (
            s.kind,
            s.num_kv_heads,
            s.head_size,
            s.dtype,
            s.sliding_window_tokens,
            s.attention_chunk_size_tokens,
            s.mamba_state_shapes,
            s.mamba_state_dtypes,
            s.hidden_state,
            self.block_tokens,
            self.page_bytes,
        )


def layer_page_bytes(layer: LayerSpec, block_tokens: int) -> int:
    """Bytes one block of ``layer`` holds at ``block_tokens`` tokens per block
    (unpadded): K and V per token for attention, one latent for MLA, the
    states for Mamba (whatever the block)."""
    if layer.kind is GroupKind.MAMBA:
        return sum(
            math.prod(shape) * _DTYPE_BYTES[dtype]
            for shape, dtype in zip(layer.mamba_state_shapes, layer.mamba_state_dtypes, strict=True)
        )
    per_token = layer.num_kv_heads * layer.head_size * _DTYPE_BYTES[layer.dtype]
    if layer.kind in (GroupKind.MLA, GroupKind.SLIDING_WINDOW_MLA):
        return block_tokens * per_token
    return 2 * block_tokens * per_token


@dataclasses.dataclass(frozen=True)
class OwedGroup:
    """A KV cache group first principles owe: its spec class, block (tokens),
    layers, each layer's page (bytes, padded) and, for a sliding window, the
    tokens kept past the window (``extra_retained_tokens``)."""

    spec: str
    block_size_tokens: int
    layers: tuple[str, ...]
    page_size_bytes: tuple[int, ...]
    extra_retained_tokens: int = 0
    #: Per layer, what makes it one spec (:attr:`_Layer.shape`): layers of
    #: one spec share a tensor. Not compared (vLLM reports pages, not specs).
    layer_shapes: tuple[tuple[object, ...], ...] = dataclasses.field(default=(), compare=False)


def _raw_layers(model: ModelDescription) -> list[_Layer] | None:
    layers = []
    for name, spec in model.named_layers():
        # Compressed states, and kinds whose specs these rules do not model
        # (R-SWA, a circular buffer, a static sink): not judged.
        if spec.tokens_per_state != 1 or spec.kind not in SPEC_CLASS:
            return None
        block = spec.block_size_tokens or (
            model.mamba_block_size_tokens or model.block_size_tokens
            if spec.kind is GroupKind.MAMBA
            else model.block_size_tokens
        )
        layers.append(_Layer(name, spec, block, layer_page_bytes(spec, block)))
    return layers


def _unified(layers: list[_Layer]) -> list[_Layer] | None:
    """Every page made the largest (``unify_kv_cache_spec_page_size``);
    ``None`` where vLLM falls back (an MLA page that does not divide it)."""
    largest = max(layer.page_bytes for layer in layers)
    out = []
    for layer in layers:
        if layer.page_bytes == largest or layer.spec.kind is GroupKind.MAMBA:
            out.append(dataclasses.replace(layer, page_bytes=largest))
        elif largest % layer.page_bytes == 0:
            ratio = largest // layer.page_bytes
            out.append(
                dataclasses.replace(
                    layer, block_tokens=layer.block_tokens * ratio, page_bytes=largest
                )
            )
        elif layer.spec.kind in (GroupKind.MLA, GroupKind.SLIDING_WINDOW_MLA):
            return None
        else:
            out.append(dataclasses.replace(layer, page_bytes=largest))
    return out


def _merge_key(layer: _Layer) -> tuple[object, ...]:
    """What vLLM's ``merge`` of the layer's spec compares: every field of an
    attention spec for full attention and MLA (``FullAttentionSpec.merge``,
    ``MLAAttentionSpec.merge``), equality for the other kinds
    (``KVCacheSpec.merge``), but for sliding-window MLA only the dtype, the
    window and the tokens per state (``SlidingWindowMLASpec.merge`` takes the
    block and head sizes from its first spec)."""
    s = layer.spec
    if s.kind is GroupKind.SLIDING_WINDOW_MLA:
        return (s.kind, s.dtype, s.sliding_window_tokens, s.tokens_per_state)
    return layer.shape


def _split(layers: list[_Layer]) -> list[list[_Layer]]:
    """Buckets of equal layers split into groups of one size
    (``_get_kv_cache_groups_uniform_page_size``).

    vLLM fills its buckets first-fit, a layer joining the first bucket whose
    specs ``merge`` with its own: buckets come in the order of vLLM's, a
    bucket right after the first one it would merge with. Their layers stay
    apart (the function's own assumption 2: "within each KV cache group, all
    layers must share the same block size"), so a group mixing them is a
    finding."""
    exact: dict[tuple[object, ...], list[_Layer]] = {}
    for layer in layers:
        exact.setdefault(layer.shape, []).append(layer)
    merged: list[tuple[object, ...]] = []
    for bucket in exact.values():
        key = _merge_key(bucket[0])
        if key not in merged:
            merged.append(key)
    order = sorted(exact, key=lambda shape: merged.index(_merge_key(exact[shape][0])))
    buckets = {shape: exact[shape] for shape in order}
    sizes = [len(b) for b in buckets.values()]
    size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups = []
    for bucket in buckets.values():
        count = -(-len(bucket) // size)
        groups += [bucket[i::count] for i in range(count)]
    return groups


def merges_unequal_layers(model: ModelDescription) -> bool:
    """Whether vLLM's first-fit ``merge`` puts layers of different shapes
    (sliding-window MLA of different blocks or head sizes once pages are
    unified) into one bucket (:func:`_merge_key`), which its split may then
    mix into one group."""
    if model.kv_cache_layout.startswith("B"):
        return False
    layers = _raw_layers(model)
    kv = [layer for layer in layers or () if not layer.spec.hidden_state]
    unified = _unified(kv) if kv else None
    if not unified:
        return False
    shapes: dict[tuple[object, ...], set[tuple[object, ...]]] = {}
    for layer in unified:
        shapes.setdefault(_merge_key(layer), set()).add(layer.shape)
    return any(len(found) > 1 for found in shapes.values())


def owed_groups(
    model: ModelDescription, extra_retained_tokens: int = 0
) -> tuple[OwedGroup, ...] | None:
    """The KV cache groups first principles owe ``model`` (the rules above),
    each sliding-window group keeping ``extra_retained_tokens`` tokens past
    its window; ``None`` for a model they do not judge (packed pages,
    compressed states, layers of a kind outside :data:`SPEC_CLASS`, a model
    of hidden-state layers of different blocks alone)."""
    if model.kv_cache_layout.startswith("B"):
        return None
    layers = _raw_layers(model)
    if layers is None:
        return None
    first = layers[0]
    if all(layer.shape == first.shape for layer in layers):
        return (_owed(first.spec.kind, [layers], extra_retained_tokens),)
    uniform = _uniform_type(layers)
    if uniform is None:
        return None
    if uniform:
        return (_owed(first.spec.kind, [layers], 0, uniform_type=True),)
    hidden = [layer for layer in layers if layer.spec.hidden_state]
    kv = [layer for layer in layers if not layer.spec.hidden_state]
    unified = _unified(kv) if kv else None
    if unified is None:
        fallback = None if hidden else _full_allocation(layers)
        return None if fallback is None else (fallback,)
    groups = [_owed(g[0].spec.kind, [g], extra_retained_tokens) for g in _split(unified)]
    return tuple(_with_hidden_state_groups(groups, hidden) if hidden else groups)


def _full_allocation(layers: list[_Layer]) -> OwedGroup | None:
    """vLLM's allocation-only fallback when an MLA page does not divide the
    largest (``_try_get_full_allocation_fallback_groups``: "treating
    sliding-window layers as full attention for cache allocation"): MLA,
    full-attention and sliding-window layers, none hidden-state, make one
    group of mixed pages at the full-attention block, every sliding window
    allocated as full attention (``_promote_local_kv_cache_specs``); ``None``
    for other layers, or full-attention blocks that differ."""
    kinds = {layer.spec.kind for layer in layers}
    window = GroupKind.SLIDING_WINDOW
    if not {GroupKind.MLA, window} <= kinds <= {GroupKind.FULL_ATTENTION, GroupKind.MLA, window}:
        return None
    blocks = {layer.block_tokens for layer in layers if layer.spec.kind is not window}
    if len(blocks) != 1:
        return None
    (block,) = blocks
    promoted = [
        dataclasses.replace(
            layer, block_tokens=block, page_bytes=layer_page_bytes(layer.spec, block)
        )
        for layer in layers
    ]
    return _owed(layers[0].spec.kind, [promoted], 0, uniform_type=True)


def _with_hidden_state_groups(groups: list[OwedGroup], hidden: list[_Layer]) -> list[OwedGroup]:
    """``groups`` (one page P, bytes), scaled when a hidden-state layer's
    token entry exceeds P, then one group per hidden-state layer: its block
    the largest dividing every group block whose entries fit in P, its page
    padded to P (``get_kv_cache_groups``, ``_ensure_min_page_size`` and
    ``_largest_divisor_at_most``, vllm/v1/core/kv_cache_planning.py)."""
    page = groups[0].page_size_bytes[0]
    entries = [layer_page_bytes(layer.spec, 1) for layer in hidden]
    scale = -(-max(entries) // page)
    if scale > 1:
        page *= scale
        groups = [
            dataclasses.replace(
                g,
                block_size_tokens=g.block_size_tokens * scale,
                # The layer shapes stay: they only tell layer specs apart.
                page_size_bytes=tuple(p * scale for p in g.page_size_bytes),
            )
            for g in groups
        ]
    common = math.gcd(*(g.block_size_tokens for g in groups))
    out = list(groups)
    for layer, entry in zip(hidden, entries, strict=True):
        fits = max(page // entry, 1)
        block = max(d for d in range(1, min(common, fits) + 1) if common % d == 0)
        out.append(
            OwedGroup(
                "HiddenStateCacheSpec",
                block,
                (layer.name,),
                (page,),
                0,
                (dataclasses.replace(layer, block_tokens=block, page_bytes=page).shape,),
            )
        )
    return out


#: The kinds one group of mixed pages may hold, by its first layer's kind
#: (``is_uniform_with_collection`` of its spec, vllm/v1/kv_cache_interface.py:
#: an MLA spec is a full-attention spec, a sliding-window MLA spec a
#: sliding-window one, not the other way round).
_UNIFORM_WITH = {
    GroupKind.FULL_ATTENTION: (GroupKind.FULL_ATTENTION, GroupKind.MLA),
    GroupKind.MLA: (GroupKind.FULL_ATTENTION, GroupKind.MLA),
    GroupKind.SLIDING_WINDOW: (GroupKind.SLIDING_WINDOW, GroupKind.SLIDING_WINDOW_MLA),
    GroupKind.SLIDING_WINDOW_MLA: (GroupKind.SLIDING_WINDOW_MLA,),
    GroupKind.CHUNKED_LOCAL_ATTENTION: (GroupKind.CHUNKED_LOCAL_ATTENTION,),
}


def _uniform_type(layers: list[_Layer]) -> bool | None:
    """Whether the layers make one group of mixed pages
    (``UniformTypeKVCacheSpecs.from_specs``: one block size, and every layer
    of the first layer's type, with its window or chunk); ``None`` for Mamba
    layers of one block (not judged)."""
    first = layers[0]
    if any(layer.block_tokens != first.block_tokens for layer in layers):
        return False
    if first.spec.kind is GroupKind.MAMBA:
        return None if all(layer.spec.kind is GroupKind.MAMBA for layer in layers) else False
    return all(
        layer.spec.kind in _UNIFORM_WITH[first.spec.kind]
        and layer.spec.sliding_window_tokens == first.spec.sliding_window_tokens
        and layer.spec.attention_chunk_size_tokens == first.spec.attention_chunk_size_tokens
        for layer in layers
    )


def _owed(
    kind: GroupKind, groups: list[list[_Layer]], extra_retained: int, uniform_type: bool = False
) -> OwedGroup:
    """One owed group; a sliding window (MLA too: ``SlidingWindowMLASpec``
    is a ``SlidingWindowSpec``) keeps ``extra_retained`` tokens past its
    window; a group of mixed pages reports none of its own."""
    (layers,) = groups
    spec = "HiddenStateCacheSpec" if layers[0].spec.hidden_state else SPEC_CLASS[kind]
    return OwedGroup(
        "UniformTypeKVCacheSpecs" if uniform_type else spec,
        layers[0].block_tokens,
        tuple(layer.name for layer in layers),
        tuple(layer.page_bytes for layer in layers),
        extra_retained if kind.sliding_window_family and not uniform_type else 0,
        tuple(layer.shape for layer in layers),
    )


def owed_tensors(groups: Sequence[OwedGroup], num_blocks: int) -> tuple[PlannedTensor, ...]:
    """The KV cache tensors a layer-outermost layout owes ``groups`` at
    ``num_blocks`` blocks (``get_kv_cache_config_from_groups``): one per
    distinct layer spec of a group (per distinct page when the group does
    not say), in the order of its first layer."""
    per_block = max(sum(g.page_size_bytes) for g in groups)
    tensors = []
    for group in groups:
        runs: dict[object, tuple[int, list[str]]] = {}
        shapes = group.layer_shapes or group.page_size_bytes
        for name, page, shape in zip(group.layers, group.page_size_bytes, shapes, strict=True):
            runs.setdefault(shape, (page, []))[1].append(name)
        offset = 0
        for page, names in runs.values():
            tensors.append(
                PlannedTensor(num_blocks * per_block, tuple(names), offset, num_blocks * page, page)
            )
            offset += len(names) * num_blocks * page
    return tuple(tensors)


def _plan_problems(plan: KVCachePlan, groups: tuple[OwedGroup, ...], block: int) -> list[str]:
    """What of ``plan`` differs from what ``groups`` owe (``block``: the
    configured block size, in tokens)."""
    problems = []
    got = [
        OwedGroup(g.spec, g.block_size_tokens, g.layers, g.page_size_bytes, g.extra_retained_tokens)
        for g in plan.groups
    ]
    if got != list(groups):
        for i, (owed, seen) in enumerate(zip(groups, got, strict=False)):
            if owed != seen:
                problems.append(
                    f"group {i}: {seen.spec} block {seen.block_size_tokens} tokens, "
                    f"layers {layer_names_text(seen.layers)}, pages "
                    f"{sorted(set(seen.page_size_bytes))} bytes, {seen.extra_retained_tokens} "
                    f"extra retained tokens; owed {owed.spec} block {owed.block_size_tokens} "
                    f"tokens, layers {layer_names_text(owed.layers)}, pages "
                    f"{sorted(set(owed.page_size_bytes))} bytes, {owed.extra_retained_tokens} "
                    "extra retained tokens"
                )
                break
        if len(got) != len(groups):
            problems.append(f"{len(got)} group(s); owed {len(groups)}")
    blocks = [g.block_size_tokens for g in groups]
    scheduler = math.lcm(*blocks) if len(blocks) > 1 else block
    hashed = math.gcd(*blocks) if len(blocks) > 1 else block
    if (plan.scheduler_block_size_tokens, plan.hash_block_size_tokens) != (scheduler, hashed):
        problems.append(
            f"scheduler block {plan.scheduler_block_size_tokens}, hash block "
            f"{plan.hash_block_size_tokens} tokens; owed {scheduler} and {hashed}"
        )
    if plan.num_blocks != plan.pool_blocks:
        problems.append(f"num_blocks {plan.num_blocks}; owed the pool's {plan.pool_blocks}")
    tensors = owed_tensors(groups, plan.pool_blocks)
    for i, (owed_t, seen_t) in enumerate(zip(tensors, plan.tensors, strict=False)):
        if owed_t != seen_t:
            problems.append(f"tensor {i}: {seen_t.describe()}; owed {owed_t.describe()}")
            break
    if len(plan.tensors) != len(tensors):
        problems.append(f"{len(plan.tensors)} tensor(s); owed {len(tensors)}")
    return problems


def owed_tp_replicas(model: ModelDescription) -> int:
    """The consecutive tensor-parallel ranks that hold identical KV for every
    layer of ``model`` (``KVCacheConfig.kv_tp_replicas``, which the
    offloading connector reads to store one copy for them): an MLA or
    sliding-window MLA layer's latent cache is one per token however many
    ranks there are (its spec's ``max_tp_shards`` is 1: every rank a
    replica), while any other layer is split across the ranks or not known to
    be replicated (``max_tp_shards`` unset), which leaves each rank its own
    (vllm/v1/kv_cache_interface.py ``AttentionSpec.max_tp_shards``;
    ``kv_cache_groups_tp_replicas`` in vllm/v1/core/kv_cache_planning.py).
    So ``model.tensor_parallel_size`` when every layer is MLA-family KV, 1
    otherwise."""
    latent = all(
        layer.kind in (GroupKind.MLA, GroupKind.SLIDING_WINDOW_MLA) and not layer.hidden_state
        for layer in model.layers
    )
    return model.tensor_parallel_size if latent else 1


def kv_cache_plan_findings(scenario: Scenario, run: RunObservation) -> list[Finding]:
    """``kv-cache-plan`` when the ``KVCacheConfig`` the run's vLLM planned for
    ``scenario.model`` (``run.kv_cache_plan``) departs from what first
    principles owe (the rules above), a ``crash`` when planning raised; empty
    without a model or plan, or for a model the rules do not judge.

    The finding names every difference found: the TP replicas
    (:func:`owed_tp_replicas`, judged for every layout), the first differing
    group (spec, block in tokens, layers, pages in bytes, extra retained
    tokens), the scheduler and hash block sizes (tokens), ``num_blocks``
    against the pool (blocks), the first differing tensor (bytes, layers,
    offset and strides in bytes).
    """
    plan, model = run.kv_cache_plan, scenario.model
    if plan is None or model is None:
        return []
    if plan.error is not None:
        return [
            Finding(FindingKind.CRASH, run.variant, None, f"planning the KV cache: {plan.error}")
        ]
    # The drafter's re-prefillable tail (multi-module MTP) stays in every
    # sliding window: get_global_kv_cache_groups tags each SlidingWindowSpec
    # with num_prefill_lookahead_tokens - 1.
    problems = []
    replicas = owed_tp_replicas(model)
    if plan.kv_tp_replicas is not None and plan.kv_tp_replicas != replicas:
        problems.append(f"kv_tp_replicas {plan.kv_tp_replicas}; owed {replicas}")
    groups = owed_groups(model, drafter_model(scenario).reprefillable_tokens)
    if groups is not None:
        problems += _plan_problems(plan, groups, model.block_size_tokens)
    if not problems:
        return []
    return [
        Finding(
            FindingKind.KV_CACHE_PLAN,
            run.variant,
            None,
            f"vLLM planned model {model.name!r} for a pool of {plan.pool_blocks} blocks other "
            "than its layers' pages owe: " + "; ".join(problems),
        )
    ]

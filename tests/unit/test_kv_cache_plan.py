"""The KV cache plan a model owes, worked by hand from the layers' pages (no
vLLM): unified block sizes, groups, tensors, and the ``kv-cache-plan``
verdict on a plan that departs from them
(:func:`differential.oracle.layout.kv_cache_plan_findings`)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings

from differential.errors import ScenarioError
from differential.findings import FindingKind
from differential.observation import KVCachePlan, PlannedGroup, RunObservation
from differential.oracle.layout import (
    SPEC_CLASS,
    OwedGroup,
    kv_cache_plan_findings,
    layer_page_bytes,
    owed_groups,
    owed_tensors,
    owed_tp_replicas,
)
from differential.scenario import GroupKind, KVCacheGroup, Scenario
from differential.scenario.drafter import Drafter, DrafterKind
from differential.scenario.models import LayerSpec, ModelDescription
from fuzz.strategies import model_of, scenarios

K = GroupKind


def _model(*layers: LayerSpec, block: int = 16, layout: str = "LBNHC") -> ModelDescription:
    return ModelDescription("m", tuple(layers), block_size_tokens=block, kv_cache_layout=layout)


def _names(*indices: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}" for i in indices)


# MiMo-V2-Flash's interleaving: full, 2 sliding-window, full, 2 sliding-window.
# A sliding-window page is 2 (K, V) x 16 tokens x 2 heads x 128 x 2 bytes =
# 16384 bytes, a full-attention page half that (1 head): its block doubles.
MIMO = _model(
    LayerSpec(K.FULL_ATTENTION, 1, num_kv_heads=1),
    LayerSpec(K.SLIDING_WINDOW, 2, num_kv_heads=2, sliding_window_tokens=64),
    LayerSpec(K.FULL_ATTENTION, 1, num_kv_heads=1),
    LayerSpec(K.SLIDING_WINDOW, 2, num_kv_heads=2, sliding_window_tokens=64),
)
MIMO_GROUPS = (
    OwedGroup("FullAttentionSpec", 32, _names(0, 3), (16384, 16384)),
    # Buckets of 2 and 4 layers: 4 is not under 1.5 x 2, so groups of 2,
    # the sliding-window bucket's layers i::2.
    OwedGroup("SlidingWindowSpec", 16, _names(1, 4), (16384, 16384)),
    OwedGroup("SlidingWindowSpec", 16, _names(2, 5), (16384, 16384)),
)


def test_pages_by_kind() -> None:
    full = LayerSpec(K.FULL_ATTENTION, num_kv_heads=2, head_size=128)
    assert layer_page_bytes(full, 16) == 2 * 16 * 2 * 128 * 2 == 16384
    mla = LayerSpec(K.MLA, head_size=576)  # one latent per token, no K/V pair
    assert layer_page_bytes(mla, 32) == 32 * 576 * 2 == 36864
    mamba = LayerSpec(K.MAMBA, mamba_state_shapes=((128, 64),), mamba_state_dtypes=("bfloat16",))
    assert layer_page_bytes(mamba, 16) == layer_page_bytes(mamba, 64) == 128 * 64 * 2


def test_a_smaller_page_gets_a_proportionally_larger_block() -> None:
    assert owed_groups(MIMO) == MIMO_GROUPS


def test_sliding_windows_keep_a_multi_module_mtp_tail() -> None:
    # Three MTP modules re-prefill the last 2 tokens: every sliding window
    # keeps them (get_global_kv_cache_groups), full attention has no window.
    owed = owed_groups(MIMO, extra_retained_tokens=2)
    assert owed is not None
    assert [g.extra_retained_tokens for g in owed] == [0, 2, 2]
    mtp = dataclasses.replace(_scenario(), drafter=Drafter(DrafterKind.MULTI_MODULE_MTP, 3))
    plan = _plan()  # planned as if no tail were kept
    run = RunObservation("stock", "0.33.0", None, (), kv_cache_plan=plan)
    (finding,) = kv_cache_plan_findings(mtp, run)
    assert "group 1: SlidingWindowSpec block 16 tokens" in finding.detail
    assert "0 extra retained tokens; owed SlidingWindowSpec" in finding.detail
    assert finding.detail.endswith("2 extra retained tokens")


@pytest.mark.parametrize(
    ("full", "sliding", "groups"),
    [
        # vLLM's own example (_get_kv_cache_groups_uniform_page_size): 10 full
        # and 20 sliding-window layers make 3 groups of 10.
        (10, 20, [10, 10, 10]),
        # gpt-oss-20b with its EAGLE-3 layer: 13 full beside 12 sliding-window
        # layers, under 1.5 x 12, so groups of 13 (one sliding-window slot padded).
        (13, 12, [13, 12]),
    ],
)
def test_group_size_rule(full: int, sliding: int, groups: list[int]) -> None:
    model = _model(
        LayerSpec(K.FULL_ATTENTION, full),
        LayerSpec(K.SLIDING_WINDOW, sliding, sliding_window_tokens=64),
    )
    owed = owed_groups(model)
    assert owed is not None and [len(g.layers) for g in owed] == groups
    assert owed[1].layers[:2] == _names(full, full + len(groups) - 1)


def test_a_mamba_page_is_padded_and_keeps_its_block() -> None:
    # Mamba states of 128 x 64 bf16 = 16384 bytes beside a full-attention
    # page of 2 x 64 x 128 x 2 = 32768 (and a draft layer of the same spec):
    # the Mamba page is padded to 32768, its block stays 64 (vLLM PR #45207).
    model = _model(
        LayerSpec(K.MAMBA, 3, mamba_state_shapes=((128, 64),), mamba_state_dtypes=("bfloat16",)),
        LayerSpec(K.FULL_ATTENTION, 1),
        LayerSpec(K.FULL_ATTENTION, 1, draft=True),
        block=64,
    )
    assert owed_groups(model) == (
        OwedGroup("MambaSpec", 64, _names(0, 2), (32768, 32768)),
        OwedGroup("MambaSpec", 64, _names(1), (32768,)),
        OwedGroup("FullAttentionSpec", 64, ("model.layers.3", "drafter.layers.0"), (32768, 32768)),
    )


def test_a_page_that_does_not_divide_the_largest_is_padded() -> None:
    # 3 heads: 24576 bytes; 2 heads: 16384, which does not divide it.
    model = _model(
        LayerSpec(K.SLIDING_WINDOW, 2, num_kv_heads=3, sliding_window_tokens=64),
        LayerSpec(K.FULL_ATTENTION, 2, num_kv_heads=2),
    )
    assert owed_groups(model) == (
        OwedGroup("SlidingWindowSpec", 16, _names(0, 1), (24576, 24576)),
        OwedGroup("FullAttentionSpec", 16, _names(2, 3), (24576, 24576)),
    )


def test_one_attention_type_with_mixed_pages_is_one_group_with_a_tensor_per_page() -> None:
    model = _model(
        LayerSpec(K.FULL_ATTENTION, 2, num_kv_heads=2),
        LayerSpec(K.FULL_ATTENTION, 1, num_kv_heads=1),
        LayerSpec(K.FULL_ATTENTION, 1, num_kv_heads=2),
    )
    groups = owed_groups(model)
    assert groups == (
        OwedGroup("UniformTypeKVCacheSpecs", 16, _names(0, 1, 2, 3), (16384, 16384, 8192, 16384)),
    )
    # One block costs 3 x 16384 + 8192 = 57344 bytes; 40 blocks.
    sizes = [
        (t.size_bytes, t.layers, t.offset_bytes, t.layer_stride_bytes)
        for t in owed_tensors(groups, 40)
    ]
    assert sizes == [
        (40 * 57344, _names(0, 1, 3), 0, 40 * 16384),
        (40 * 57344, _names(2), 3 * 40 * 16384, 40 * 8192),
    ]


def test_mla_joins_full_attention_in_one_group_of_mixed_pages() -> None:
    # An MLA spec is a full-attention spec (is_uniform_with_collection): at
    # one block the two share a group; a sliding window does not join MLA.
    model = _model(LayerSpec(K.FULL_ATTENTION, head_size=64), LayerSpec(K.MLA, head_size=64))
    groups = owed_groups(model)
    assert groups == (OwedGroup("UniformTypeKVCacheSpecs", 16, _names(0, 1), (4096, 2048)),)
    assert [(t.layers, t.offset_bytes) for t in owed_tensors(groups, 40)] == [
        (_names(0), 0),
        (_names(1), 40 * 4096),
    ]
    swa = _model(
        LayerSpec(K.SLIDING_WINDOW_MLA, head_size=64, sliding_window_tokens=64),
        LayerSpec(K.SLIDING_WINDOW, head_size=64, sliding_window_tokens=64),
    )
    assert [(g.spec, g.block_size_tokens) for g in owed_groups(swa) or ()] == [
        ("SlidingWindowMLASpec", 32),
        ("SlidingWindowSpec", 16),
    ]


def test_tensors_of_the_mimo_layout() -> None:
    # Every group holds 2 pages of 16384 bytes: 32768 bytes a block, 153 blocks.
    tensors = owed_tensors(MIMO_GROUPS, 153)
    assert {t.size_bytes for t in tensors} == {153 * 32768} == {5013504}
    assert [
        (t.layers, t.offset_bytes, t.layer_stride_bytes, t.block_stride_bytes) for t in tensors
    ] == [(g.layers, 0, 153 * 16384, 16384) for g in MIMO_GROUPS]


@pytest.mark.parametrize(
    "model",
    [
        _model(LayerSpec(K.FULL_ATTENTION), layout="BLHNC"),  # packed pages
        _model(LayerSpec(K.MLA, tokens_per_state=4), LayerSpec(K.FULL_ATTENTION)),
        # An MLA page that does not divide the largest beside Mamba: no
        # fallback either (vLLM raises).
        _model(
            LayerSpec(K.MLA, head_size=3),
            LayerSpec(K.SLIDING_WINDOW, head_size=2, sliding_window_tokens=64),
            LayerSpec(K.MAMBA, mamba_state_shapes=((64,),), mamba_state_dtypes=("bfloat16",)),
        ),
        # Mamba layers of one block with mixed pages.
        _model(
            LayerSpec(K.MAMBA, mamba_state_shapes=((4,),), mamba_state_dtypes=("bfloat16",)),
            LayerSpec(K.MAMBA, mamba_state_shapes=((8,),), mamba_state_dtypes=("bfloat16",)),
        ),
        # Kinds whose specs the rules do not model (a model the manager-mode
        # generator built from an R-SWA layout raised KeyError here, exit 3).
        _model(LayerSpec(K.FULL_ATTENTION), LayerSpec(K.RSWA, sliding_window_tokens=16)),
        _model(LayerSpec(K.FULL_ATTENTION), LayerSpec(K.CIRCULAR_BUFFER)),
    ],
)
def test_what_the_rules_do_not_judge(model: ModelDescription) -> None:
    assert owed_groups(model) is None


def test_an_mla_page_not_dividing_the_largest_takes_the_full_allocation_fallback() -> None:
    # An MLA page of 16 x 3 x 2 = 96 bytes does not divide a sliding-window
    # page of 2 x 16 x 2 x 2 = 128: one group of mixed pages at 16 tokens,
    # the window allocated as full attention (its page unchanged at 16).
    model = _model(
        LayerSpec(K.MLA, head_size=3),
        LayerSpec(K.SLIDING_WINDOW, head_size=2, sliding_window_tokens=64),
    )
    assert owed_groups(model, extra_retained_tokens=2) == (
        OwedGroup("UniformTypeKVCacheSpecs", 16, _names(0, 1), (96, 128)),
    )


# Full attention and a sliding window of 1 KV head of 128 at 16 tokens:
# pages of 2 x 16 x 128 x 2 = 8192 bytes.
_FA = LayerSpec(K.FULL_ATTENTION)
_SW = LayerSpec(K.SLIDING_WINDOW, sliding_window_tokens=64)


@pytest.mark.parametrize(
    ("others", "heads", "hidden", "blocks", "page"),
    [
        # 2 x 512 x 2 = 2048 bytes a token: 4 tokens fit 8192, and 4 divides 16.
        ((_FA, _SW), 2, 512, (16, 16, 4), 8192),
        # 1 x 1280 x 2 = 2560 bytes: 3 tokens fit, 3 does not divide 16: 2.
        ((_FA, _SW), 1, 1280, (16, 16, 2), 8192),
        # 1 x 256 x 2 = 512 bytes: 16 fit, and the block is 16.
        ((_FA, _SW), 1, 256, (16, 16, 16), 8192),
        # A full-attention page of 4096 at 16 tokens (head 64) doubles its
        # block to 32: the hidden-state block divides their GCD, 16: 8.
        ((LayerSpec(K.FULL_ATTENTION, head_size=64), _SW), 1, 512, (32, 16, 8), 8192),
        # 8 x 2048 x 2 = 32768 bytes: one entry needs every page x 4, the
        # blocks x 4, and 1 token fits.
        ((_FA, _SW), 8, 2048, (64, 64, 1), 32768),
        # 3 x 2048 x 2 = 12288 bytes: pages x 2 (16384), 1 token fits.
        ((_FA, _SW), 3, 2048, (32, 32, 1), 16384),
    ],
)
def test_a_hidden_state_layer_gets_a_group_and_block_of_its_own(
    others: tuple[LayerSpec, ...],
    heads: int,
    hidden: int,
    blocks: tuple[int, ...],
    page: int,
) -> None:
    layer = LayerSpec(K.MLA, num_kv_heads=heads, head_size=hidden, hidden_state=True)
    owed = owed_groups(_model(*others, layer))
    assert owed is not None
    assert [(g.spec, g.block_size_tokens, g.layers, g.page_size_bytes) for g in owed] == [
        ("FullAttentionSpec", blocks[0], _names(0), (page,)),
        ("SlidingWindowSpec", blocks[1], _names(1), (page,)),
        ("HiddenStateCacheSpec", blocks[2], _names(2), (page,)),
    ]


def test_a_hidden_state_layer_beside_one_attention_type_joins_its_group() -> None:
    # All full-attention-family specs at one block: one group of mixed
    # pages (UniformTypeKVCacheSpecs), the hidden-state layer in it.
    hidden = LayerSpec(K.MLA, num_kv_heads=2, head_size=256, hidden_state=True)
    owed = owed_groups(_model(_FA, _FA, hidden))
    assert owed == (OwedGroup("UniformTypeKVCacheSpecs", 16, _names(0, 1, 2), (8192, 8192, 16384)),)
    # Hidden-state layers alone, all alike: one HiddenStateCacheSpec group.
    assert owed_groups(_model(dataclasses.replace(hidden, count=2))) == (
        OwedGroup("HiddenStateCacheSpec", 16, _names(0, 1), (16384, 16384)),
    )


def test_hidden_state_is_an_mla_layer_only() -> None:
    with pytest.raises(ScenarioError) as raised:
        _model(LayerSpec(K.FULL_ATTENTION, hidden_state=True))
    assert raised.value.field == "model.layers[0].hidden_state"


def _scenario() -> Scenario:
    base = Scenario.from_dict(
        {
            "kv_cache_groups": [
                {"kind": "full_attention", "block_size_tokens": 32},
                {"kind": "sliding_window", "block_size_tokens": 16, "sliding_window_tokens": 64},
                {"kind": "sliding_window", "block_size_tokens": 16, "sliding_window_tokens": 64},
            ],
            "requests": [{"divergence_tokens": 0, "suffix_tokens": 8}],
            "shared_prefix_tokens": 0,
        }
    )
    return dataclasses.replace(base, model=MIMO)


def _plan(**changes: object) -> KVCachePlan:
    plan = KVCachePlan(
        pool_blocks=153,
        num_blocks=153,
        groups=tuple(
            PlannedGroup(g.spec, g.block_size_tokens, g.layers, g.page_size_bytes)
            for g in MIMO_GROUPS
        ),
        tensors=owed_tensors(MIMO_GROUPS, 153),
        scheduler_block_size_tokens=32,
        hash_block_size_tokens=16,
    )
    return dataclasses.replace(plan, **changes)  # type: ignore[arg-type]


def _judge(plan: KVCachePlan) -> list[tuple[FindingKind, str]]:
    run = RunObservation("stock", "0.33.0", None, (), kv_cache_plan=plan)
    return [(f.kind, f.detail) for f in kv_cache_plan_findings(_scenario(), run)]


def test_the_owed_plan_is_clean() -> None:
    assert _judge(_plan()) == []


def test_a_departing_plan_is_a_kv_cache_plan_finding() -> None:
    owed = _plan()
    small = dataclasses.replace(owed.tensors[0], size_bytes=32768 % 153)
    ((kind, detail),) = _judge(_plan(tensors=(small, *owed.tensors[1:])))
    assert kind is FindingKind.KV_CACHE_PLAN
    assert "tensor 0: 26 bytes" in detail and "owed 5013504 bytes" in detail
    wide = dataclasses.replace(owed.groups[0], block_size_tokens=64)
    ((kind, detail),) = _judge(_plan(groups=(wide, *owed.groups[1:])))
    assert "group 0: FullAttentionSpec block 64 tokens" in detail
    assert "owed FullAttentionSpec block 32 tokens" in detail
    ((kind, detail),) = _judge(_plan(num_blocks=152, scheduler_block_size_tokens=16))
    assert detail.endswith(
        "scheduler block 16, hash block 16 tokens; owed 32 and 16; "
        "num_blocks 152; owed the pool's 153"
    )


def test_a_planning_error_is_a_crash() -> None:
    ((kind, detail),) = _judge(
        KVCachePlan(pool_blocks=153, error="get_kv_cache_configs: ZeroDivisionError")
    )
    assert kind is FindingKind.CRASH
    assert detail == "planning the KV cache: get_kv_cache_configs: ZeroDivisionError"


def test_tp_ranks_replicate_only_mla_latent_kv() -> None:
    mla = _model(
        LayerSpec(K.MLA, 2, head_size=576),
        LayerSpec(K.SLIDING_WINDOW_MLA, 1, head_size=576, sliding_window_tokens=128),
    )
    assert owed_tp_replicas(mla) == 1
    assert owed_tp_replicas(dataclasses.replace(mla, tensor_parallel_size=8)) == 8
    # One full-attention layer splits its heads across the ranks.
    mixed = dataclasses.replace(MIMO, tensor_parallel_size=8)
    assert owed_tp_replicas(mixed) == 1
    hidden = _model(LayerSpec(K.MLA, 1, head_size=576), LayerSpec(K.MLA, 1, hidden_state=True))
    assert owed_tp_replicas(dataclasses.replace(hidden, tensor_parallel_size=4)) == 1


def test_a_plan_with_other_tp_replicas_is_a_kv_cache_plan_finding() -> None:
    ((kind, detail),) = _judge(_plan(kv_tp_replicas=8))
    assert kind is FindingKind.KV_CACHE_PLAN
    assert detail.endswith("than its layers' pages owe: kv_tp_replicas 8; owed 1")
    assert _judge(_plan(kv_tp_replicas=1)) == []


def test_two_plans_are_told_apart_by_their_first_difference() -> None:
    owed = _plan()
    assert owed.difference(_plan()) is None
    assert owed.difference(_plan(num_blocks=152)) == "num_blocks 153 vs 152"
    assert owed.difference(_plan(hash_block_size_tokens=32)) == (
        "scheduler and hash block sizes 32 and 16 tokens vs 32 and 32"
    )
    merged = dataclasses.replace(owed.groups[1], layers=_names(1, 2, 4, 5))
    assert owed.difference(_plan(groups=(owed.groups[0], merged))) == (
        "group 1: SlidingWindowSpec block 16 tokens, layers [model.layers.1, "
        "model.layers.4], pages [16384] bytes, 0 extra retained tokens vs "
        "SlidingWindowSpec block 16 tokens, layers [model.layers.1, model.layers.2, "
        "model.layers.4, model.layers.5], pages [16384] bytes, 0 extra retained tokens"
    )
    assert owed.difference(_plan(groups=owed.groups[:2])) == "3 group(s) vs 2"
    shifted = dataclasses.replace(owed.tensors[1], offset_bytes=8192)
    assert owed.difference(_plan(tensors=(owed.tensors[0], shifted, *owed.tensors[2:]))) == (
        "tensor 1: 5013504 bytes, layers [model.layers.1, model.layers.4], offset 0, "
        "layer stride 2506752, block stride 16384 vs 5013504 bytes, layers "
        "[model.layers.1, model.layers.4], offset 8192, layer stride 2506752, block stride 16384"
    )
    assert owed.difference(_plan(error="get_kv_cache_configs: TypeError")) == (
        "planning raised nothing vs get_kv_cache_configs: TypeError"
    )
    assert _plan(smallest_pool_blocks=46).difference(_plan(smallest_pool_blocks=1)) == (
        "smallest pool accepted 46 vs 1 blocks"
    )
    assert KVCachePlan.from_dict(_plan(smallest_pool_blocks=46).to_dict()) == _plan(
        smallest_pool_blocks=46
    )


def test_two_trees_planning_a_model_otherwise_is_a_kv_cache_plan_between_them() -> None:
    from differential.compare import ScenarioResult, VariantResult, compare_unlabelled
    from differential.findings import Policy
    from differential.reports.diff import ChangeKind, changes_of
    from differential.reports.gate import Section, gate_items
    from differential.variants import parse_variants

    a, b = parse_variants("unfixed,fixed")

    def result(variant: object, plan: KVCachePlan) -> VariantResult:
        name = variant.name  # type: ignore[attr-defined]
        run = RunObservation(name, "0.33.0", None, (), kv_cache_plan=plan)
        return VariantResult(variant, run, None, (), (), 0.0)  # type: ignore[arg-type]

    assert compare_unlabelled(_scenario(), result(a, _plan()), result(b, _plan())) == []
    results = result(a, _plan()), result(b, _plan(num_blocks=152))
    (finding,) = compare_unlabelled(_scenario(), *results)
    assert (finding.kind, finding.variant, finding.request) == (
        FindingKind.KV_CACHE_PLAN,
        "unfixed vs fixed",
        None,
    )
    assert finding.detail == (
        "model 'm' planned otherwise for a pool of 153 blocks (unfixed vs fixed): "
        "num_blocks 153 vs 152"
    )
    (change,) = changes_of(ScenarioResult(_scenario(), None, Policy.VLLM, results), "s.json")
    assert (change.kind, change.cause, change.request) == (
        ChangeKind.PLAN,
        "model 'm' (LBNHC layout)",
        None,
    )
    assert change.detail == "pool of 153 blocks; unfixed vs fixed: num_blocks 153 vs 152"
    (item,) = gate_items(ScenarioResult(_scenario(), None, Policy.VLLM, results), "s.json")
    assert (item.section, item.cause, item.request) == (
        Section.PLAN,
        "model 'm' (LBNHC layout)",
        None,
    )
    assert item.detail == "pool of 153 blocks; base vs head: num_blocks 153 vs 152"


def test_the_generator_builds_a_model_back_from_its_groups() -> None:
    groups = (
        KVCacheGroup(K.FULL_ATTENTION, 32),
        KVCacheGroup(K.SLIDING_WINDOW, 16, 64),
    )
    model = model_of(groups)
    assert model is not None and model.block_size_tokens == 16
    # 256 x 32 / b bytes a token: heads of 64 and 128 elements, pages of 4096
    # and 8192 bytes at 16 tokens, so the full-attention block doubles.
    assert [(layer.kind, layer.head_size) for layer in model.layers] == [
        (K.FULL_ATTENTION, 64),
        (K.SLIDING_WINDOW, 128),
    ]
    assert [(g.spec, g.block_size_tokens) for g in owed_groups(model) or ()] == [
        ("FullAttentionSpec", 32),
        ("SlidingWindowSpec", 16),
    ]
    # One block size (equal pages), or full attention beside MLA (one group
    # of mixed pages in vLLM): no model.
    assert (
        model_of((KVCacheGroup(K.FULL_ATTENTION, 16), KVCacheGroup(K.SLIDING_WINDOW, 16, 64)))
        is None
    )
    assert model_of((KVCacheGroup(K.FULL_ATTENTION, 32), KVCacheGroup(K.MLA, 16))) is None


def drawn_specs(scenario: Scenario) -> list[tuple[str, int]]:
    """Per group of a drawn model-level scenario, the spec class and block
    (tokens) its model's plan gives it: a drawn hidden-state layer comes last,
    in a ``HiddenStateCacheSpec`` group (an MLA group in the scenario)."""
    assert scenario.model is not None
    hidden = scenario.model.layers[-1].hidden_state
    last = len(scenario.kv_cache_groups) - 1
    return [
        (
            "HiddenStateCacheSpec" if hidden and i == last else SPEC_CLASS[g.kind],
            g.block_size_tokens,
        )
        for i, g in enumerate(scenario.kv_cache_groups)
    ]


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(scenarios())
def test_every_drawn_model_owes_its_scenarios_groups(scenario: Scenario) -> None:
    if scenario.model is None:
        return
    owed = owed_groups(scenario.model)
    assert owed is not None
    assert [(g.spec, g.block_size_tokens) for g in owed] == drawn_specs(scenario)
    assert len({g.block_size_tokens for g in scenario.kv_cache_groups}) > 1  # unequal pages

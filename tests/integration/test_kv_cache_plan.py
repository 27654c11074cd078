"""vLLM's planner on model-level scenarios, as the engine core runs it
(``get_global_kv_cache_groups``, ``get_kv_cache_configs``): the plans of real
runs, exactly, equal what the layers' pages owe
(:func:`differential.oracle.layout.owed_groups`), and mutants of the page-size
unification and of ``get_kv_cache_config_from_groups`` are killed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from differential.corpus import load_entry
from differential.driver.planner import observe_kv_cache_plan
from differential.mutation.mutants import MODULES, enumerate_mutants, installed_vllm
from differential.mutation.score import MutantOutcome, MutantStatus, run_mutation
from differential.observation import KVCachePlan, RunObservation
from differential.oracle.layout import kv_cache_plan_findings, owed_groups
from differential.scenario import GroupKind, Scenario
from differential.scenario.drafter import Drafter, DrafterKind
from differential.scenario.models import LayerSpec, ModelDescription
from fuzz.strategies import scenarios
from tests.factories import CORPORA, ROOT
from tests.unit.test_kv_cache_plan import drawn_specs

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("forked_tree_workers")]

K = GroupKind
MIMO = CORPORA / "cases" / "mimo-v2-unequal-pages.json"
NAS = CORPORA / "cases" / "nemotron-nas-per-layer-kv-heads.json"
NEAR = CORPORA / "cases" / "near-equal-layer-counts-pad-to-the-larger.json"
HIDDEN = CORPORA / "cases" / "hidden-state-layer-gets-its-own-block.json"
HIDDEN_SCALED = CORPORA / "cases" / "hidden-state-layer-scales-every-block.json"
FALLBACK = CORPORA / "cases" / "mla-page-not-dividing-full-allocation-fallback.json"
MIMO_MTP = CORPORA / "cases" / "mimo-v2-multi-module-mtp-tail-in-every-window.json"
PACKED_SPLIT = CORPORA / "cases" / "block-outermost-window-states-split-to-fit-the-block.json"
PACKED_TWO = CORPORA / "cases" / "block-outermost-repeat-pattern-two-per-group.json"
PACKED_ONE = CORPORA / "cases" / "block-outermost-one-repeat-per-group.json"


def _findings(scenario: Scenario, plan: KVCachePlan | None) -> list[str]:
    run = RunObservation("stock", "0.33.0", None, (), kv_cache_plan=plan)
    return [f.detail for f in kv_cache_plan_findings(scenario, run)]


def test_the_mimo_case_is_planned_with_a_doubled_full_attention_block() -> None:
    scenario = load_entry(MIMO).scenario
    plan = observe_kv_cache_plan(scenario)
    assert plan is not None and plan.error is None
    assert (plan.pool_blocks, plan.num_blocks) == (153, 153)
    assert (plan.scheduler_block_size_tokens, plan.hash_block_size_tokens) == (32, 16)
    assert [(g.spec, g.block_size_tokens, g.layers, g.page_size_bytes) for g in plan.groups] == [
        ("FullAttentionSpec", 32, ("model.layers.0", "model.layers.3"), (16384, 16384)),
        ("SlidingWindowSpec", 16, ("model.layers.1", "model.layers.4"), (16384, 16384)),
        ("SlidingWindowSpec", 16, ("model.layers.2", "model.layers.5"), (16384, 16384)),
    ]
    assert [
        (t.size_bytes, t.offset_bytes, t.layer_stride_bytes, t.block_stride_bytes)
        for t in plan.tensors
    ] == [(5013504, 0, 2506752, 16384)] * 3
    assert [t.layers for t in plan.tensors] == [g.layers for g in plan.groups]
    assert _findings(scenario, plan) == []
    # get_kv_cache_configs accepts a pool whose blocks, less the null block,
    # hold one request of max_model_len = 264 tokens in every group: 9 blocks
    # of 32 tokens of full attention, and per sliding-window group (window
    # 64, blocks of 16) cdiv(min(63 + in-flight tokens, 264), 16) + 1 = 18
    # (SlidingWindowSpec.max_admission_blocks_per_request): 1 + 9 + 2 x 18.
    assert plan.smallest_pool_blocks == 46


_BASE = {
    "kv_cache_groups": [{"kind": "full_attention", "block_size_tokens": 16}],
    "requests": [{"divergence_tokens": 0, "suffix_tokens": 100}],
    "shared_prefix_tokens": 0,
    "workload": {"pool_blocks": 40},
}
_MAMBA = LayerSpec(K.MAMBA, 3, mamba_state_shapes=((128, 64),), mamba_state_dtypes=("bfloat16",))

# name: (layers, block; then per group of the real plan: spec, block, layers,
# page; and per tensor: size, offset, layer stride, block stride), 40 blocks.
PLANS = {
    "one-type-mixed-pages": (
        (
            LayerSpec(K.FULL_ATTENTION, 2, num_kv_heads=2),
            LayerSpec(K.FULL_ATTENTION, 1, num_kv_heads=1),
            LayerSpec(K.FULL_ATTENTION, 1, num_kv_heads=2),
        ),
        16,
        [("UniformTypeKVCacheSpecs", 16, (0, 1, 2, 3), (16384, 16384, 8192, 16384))],
        [(2293760, 0, 655360, 16384), (2293760, 1966080, 327680, 8192)],
    ),
    # MLA is a full-attention spec: full attention and MLA at one block
    # make one group of mixed pages (2 x 16 x 64 x 2 and 16 x 64 x 2 bytes).
    "full-beside-mla": (
        (LayerSpec(K.FULL_ATTENTION, head_size=64), LayerSpec(K.MLA, head_size=64)),
        16,
        [("UniformTypeKVCacheSpecs", 16, (0, 1), (4096, 2048))],
        [(245760, 0, 163840, 4096), (245760, 163840, 81920, 2048)],
    ),
    "mamba-padded": (
        (_MAMBA, LayerSpec(K.FULL_ATTENTION), LayerSpec(K.FULL_ATTENTION, draft=True)),
        64,
        [
            ("MambaSpec", 64, (0, 2), (32768, 32768)),
            ("MambaSpec", 64, (1,), (32768,)),
            ("FullAttentionSpec", 64, (3, "drafter.layers.0"), (32768, 32768)),
        ],
        [(2621440, 0, 1310720, 32768)] * 3,
    ),
    "page-not-dividing": (
        (
            LayerSpec(K.SLIDING_WINDOW, 2, num_kv_heads=3, sliding_window_tokens=64),
            LayerSpec(K.FULL_ATTENTION, 2, num_kv_heads=2),
        ),
        16,
        [
            ("SlidingWindowSpec", 16, (0, 1), (24576, 24576)),
            ("FullAttentionSpec", 16, (2, 3), (24576, 24576)),
        ],
        [(1966080, 0, 983040, 24576)] * 2,
    ),
    "mla-beside-sliding-window": (
        (
            LayerSpec(K.MLA, 2, head_size=576),
            LayerSpec(K.SLIDING_WINDOW, 2, head_size=576, sliding_window_tokens=64),
        ),
        16,
        [
            ("MLAAttentionSpec", 32, (0, 1), (36864, 36864)),
            ("SlidingWindowSpec", 16, (2, 3), (36864, 36864)),
        ],
        [(2949120, 0, 1474560, 36864)] * 2,
    ),
    # vLLM fills its buckets first-fit by SlidingWindowMLASpec.merge, which
    # ignores block and head sizes: the two sliding-window MLA layers (blocks
    # 16 and 32 once pages are unified) share a bucket and come before MLA.
    # One layer each, they still split into two groups.
    "sliding-window-mla-in-merge-order": (
        (
            LayerSpec(K.SLIDING_WINDOW, sliding_window_tokens=32),
            LayerSpec(K.FULL_ATTENTION),
            LayerSpec(K.SLIDING_WINDOW_MLA, head_size=256, sliding_window_tokens=64),
            LayerSpec(K.MLA, head_size=256),
            LayerSpec(K.SLIDING_WINDOW_MLA, sliding_window_tokens=64),
        ),
        16,
        [
            ("SlidingWindowSpec", 16, (0,), (8192,)),
            ("FullAttentionSpec", 16, (1,), (8192,)),
            ("SlidingWindowMLASpec", 16, (2,), (8192,)),
            ("SlidingWindowMLASpec", 32, (4,), (8192,)),
            ("MLAAttentionSpec", 16, (3,), (8192,)),
        ],
        [(327680, 0, 327680, 8192)] * 5,
    ),
    # A hidden-state cache layer (1 x 512 elements, bf16: 1024 bytes a token)
    # gets a group of its own, its page padded to the common 8192 bytes and
    # its block the largest divisor of 16 whose entries fit: 8.
    "hidden-state-own-block": (
        (
            LayerSpec(K.FULL_ATTENTION),
            LayerSpec(K.SLIDING_WINDOW, sliding_window_tokens=64),
            LayerSpec(K.MLA, head_size=512, hidden_state=True),
        ),
        16,
        [
            ("FullAttentionSpec", 16, (0,), (8192,)),
            ("SlidingWindowSpec", 16, (1,), (8192,)),
            ("HiddenStateCacheSpec", 8, (2,), (8192,)),
        ],
        [(327680, 0, 327680, 8192)] * 3,
    ),
    # An MLA page (96 elements: 3072 bytes) that does not divide 8192: the
    # allocation-only fallback, one group of mixed pages, the windows
    # allocated as full attention.
    "mla-page-not-dividing-fallback": (
        (
            LayerSpec(K.MLA, 2, head_size=96),
            LayerSpec(K.SLIDING_WINDOW, 2, sliding_window_tokens=32),
        ),
        16,
        [("UniformTypeKVCacheSpecs", 16, (0, 1, 2, 3), (3072, 3072, 8192, 8192))],
        [(901120, 0, 122880, 3072), (901120, 245760, 327680, 8192)],
    ),
}

#: Two sliding-window MLA layers of head 256 (block 16) and two of head 128
#: (page 4096 at 16 tokens: block 32 once unified to the 8192-byte page).
SWMLA_MIXED = (
    LayerSpec(K.FULL_ATTENTION, 2),
    LayerSpec(K.SLIDING_WINDOW_MLA, 2, head_size=256, sliding_window_tokens=64),
    LayerSpec(K.SLIDING_WINDOW_MLA, 2, sliding_window_tokens=64),
)


def _layer(name: int | str) -> str:
    return name if isinstance(name, str) else f"model.layers.{name}"


@pytest.mark.parametrize("name", sorted(PLANS))
def test_real_plans_equal_what_the_pages_owe(name: str) -> None:
    layers, block, groups, tensors = PLANS[name]
    model = ModelDescription(name, layers, block_size_tokens=block)
    scenario = dataclasses.replace(Scenario.from_dict(_BASE), model=model)
    plan = observe_kv_cache_plan(scenario)
    assert plan is not None and plan.error is None and plan.num_blocks == 40
    got = [(g.spec, g.block_size_tokens, g.layers, g.page_size_bytes) for g in plan.groups]
    assert got == [(s, b, tuple(_layer(x) for x in n), p) for s, b, n, p in groups]
    assert [
        (t.size_bytes, t.offset_bytes, t.layer_stride_bytes, t.block_stride_bytes)
        for t in plan.tensors
    ] == tensors
    assert owed_groups(model) is not None
    assert _findings(scenario, plan) == []


def test_sliding_window_mla_groups_mixing_block_sizes_are_a_finding() -> None:
    # SlidingWindowMLASpec.merge takes the block and head sizes of its first
    # spec: vLLM's one bucket of four layers is split 2 and 2, each group
    # pairing a 16-token layer with a 32-token one under a 16-token spec.
    model = ModelDescription("swmla-mixed", SWMLA_MIXED, block_size_tokens=16)
    scenario = dataclasses.replace(Scenario.from_dict(_BASE), model=model)
    plan = observe_kv_cache_plan(scenario)
    assert plan is not None and plan.error is None
    assert [(g.spec, g.block_size_tokens, g.layers) for g in plan.groups] == [
        ("FullAttentionSpec", 16, ("model.layers.0", "model.layers.1")),
        ("SlidingWindowMLASpec", 16, ("model.layers.2", "model.layers.4")),
        ("SlidingWindowMLASpec", 16, ("model.layers.3", "model.layers.5")),
    ]
    owed = owed_groups(model)
    assert owed is not None
    assert [(g.spec, g.block_size_tokens, g.layers) for g in owed] == [
        ("FullAttentionSpec", 16, ("model.layers.0", "model.layers.1")),
        ("SlidingWindowMLASpec", 16, ("model.layers.2", "model.layers.3")),
        ("SlidingWindowMLASpec", 32, ("model.layers.4", "model.layers.5")),
    ]
    (detail,) = _findings(scenario, plan)
    assert (
        "group 1: SlidingWindowMLASpec block 16 tokens, layers [model.layers.2, "
        "model.layers.4], pages [8192] bytes, 0 extra retained tokens; owed "
        "SlidingWindowMLASpec block 16 tokens, layers [model.layers.2, model.layers.3]"
    ) in detail
    assert "scheduler block 16, hash block 16 tokens; owed 32 and 16" in detail


def test_a_hidden_state_layer_too_wide_for_the_page_scales_every_block() -> None:
    # 8 x 2048 bf16 elements a token (32768 bytes) against an 8192-byte page:
    # every block and page x 4, the hidden-state block 1 token.
    scenario = load_entry(HIDDEN_SCALED).scenario
    plan = observe_kv_cache_plan(scenario)
    assert plan is not None and plan.error is None
    assert [(g.spec, g.block_size_tokens, g.page_size_bytes) for g in plan.groups] == [
        ("FullAttentionSpec", 64, (32768,)),
        ("SlidingWindowSpec", 64, (32768,)),
        ("HiddenStateCacheSpec", 1, (32768,)),
    ]
    assert (plan.scheduler_block_size_tokens, plan.hash_block_size_tokens) == (64, 1)
    assert [(g.kind, g.block_size_tokens) for g in scenario.kv_cache_groups] == [
        (K.FULL_ATTENTION, 64),
        (K.SLIDING_WINDOW, 64),
        (K.MLA, 1),
    ]
    assert _findings(scenario, plan) == []


def test_one_type_with_three_pages_gets_three_tensors_end_to_end() -> None:
    # 8, 4 and 2 KV heads of 128: pages 65536, 32768 and 16384 bytes, one
    # block 3 x 65536 + 2 x 32768 + 16384 = 278528 bytes, 43 blocks.
    scenario = load_entry(NAS).scenario
    plan = observe_kv_cache_plan(scenario)
    assert plan is not None and plan.num_blocks == 43
    (group,) = plan.groups
    assert (group.spec, group.block_size_tokens) == ("UniformTypeKVCacheSpecs", 16)
    assert [
        (t.size_bytes, t.layers, t.offset_bytes, t.layer_stride_bytes, t.block_stride_bytes)
        for t in plan.tensors
    ] == [
        (11976704, ("model.layers.0", "model.layers.1", "model.layers.5"), 0, 2818048, 65536),
        (11976704, ("model.layers.2", "model.layers.4"), 8454144, 1409024, 32768),
        (11976704, ("model.layers.3",), 11272192, 704512, 16384),
    ]
    assert _findings(scenario, plan) == []


def test_every_tp_rank_holds_the_mla_latent_cache() -> None:
    scenario = load_entry(
        CORPORA / "cases" / "mla-latent-replicated-on-every-tp-rank.json"
    ).scenario
    assert scenario.model is not None and scenario.model.tensor_parallel_size == 8
    plan = observe_kv_cache_plan(scenario)
    assert plan is not None and plan.kv_tp_replicas == 8
    assert _findings(scenario, plan) == []
    # A full-attention layer beside them splits its heads: no replicas.
    full = LayerSpec(K.FULL_ATTENTION, 1, num_kv_heads=1, head_size=64)
    model = dataclasses.replace(scenario.model, layers=(*scenario.model.layers, full))
    mixed = observe_kv_cache_plan(dataclasses.replace(scenario, model=model))
    assert mixed is not None and mixed.error is None and mixed.kv_tp_replicas == 1


def test_a_multi_module_mtp_tail_stays_in_every_sliding_window() -> None:
    scenario = load_entry(MIMO).scenario
    mtp = dataclasses.replace(scenario, drafter=Drafter(DrafterKind.MULTI_MODULE_MTP, 3))
    plan = observe_kv_cache_plan(mtp)
    assert plan is not None
    assert [(g.spec, g.extra_retained_tokens) for g in plan.groups] == [
        ("FullAttentionSpec", 0),
        ("SlidingWindowSpec", 2),
        ("SlidingWindowSpec", 2),
    ]
    assert _findings(mtp, plan) == []


# Block-outermost packing (_get_packed_kv_cache_groups): every group at the
# configured 16-token block; per group (layers, page bytes), per tensor
# (layers, offset, layer stride, block stride) in bytes. A KV head of 64 bf16
# elements is 2 x 16 x 64 x 2 = 4096 bytes a page.
PACKED = {
    PACKED_SPLIT.name: (
        [((0, 1, 2, 3), (4096,)), ((4, 6), (8192,)), ((5, 7), (8192,))],
        [((0, 1, 2, 3), 0, 4096), ((4, 6), 0, 8192), ((5, 7), 0, 8192)],
        16384,
    ),
    PACKED_TWO.name: (
        [((0, 1, 2, 3), (4096, 8192)), ((4, 6), (4096,)), ((5, 7), (4096,))],
        [((0, 2), 0, 8192), ((1, 3), 16384, 4096), ((4, 6), 0, 4096), ((5, 7), 0, 4096)],
        24576,
    ),
    PACKED_ONE.name: (
        [((0, 1), (4096, 8192)), ((2,), (4096,)), ((3,), (4096,)), ((4,), (4096,))],
        [((0,), 0, 8192), ((1,), 8192, 4096), ((2,), 0, 4096), ((3,), 0, 4096), ((4,), 0, 4096)],
        12288,
    ),
}


@pytest.mark.parametrize("name", sorted(PACKED))
def test_a_block_outermost_layout_packs_its_groups_at_the_configured_block(name: str) -> None:
    groups, tensors, block_bytes = PACKED[name]
    scenario = load_entry(CORPORA / "cases" / name).scenario
    assert scenario.model is not None and owed_groups(scenario.model) is None  # not judged
    plan = observe_kv_cache_plan(scenario)
    assert plan is not None and plan.error is None
    assert {g.spec for g in plan.groups} == {"UniformTypeKVCacheSpecs"}
    assert {g.block_size_tokens for g in plan.groups} == {16}
    assert [(g.layers, tuple(sorted(set(g.page_size_bytes)))) for g in plan.groups] == [
        (tuple(f"model.layers.{i}" for i in layers), pages) for layers, pages in groups
    ]
    assert [
        (t.layers, t.offset_bytes, t.layer_stride_bytes, t.block_stride_bytes) for t in plan.tensors
    ] == [
        (tuple(f"model.layers.{i}" for i in layers), offset, stride, block_bytes)
        for layers, offset, stride in tensors
    ]
    assert {t.size_bytes for t in plan.tensors} == {plan.num_blocks * block_bytes}
    # The scenario runs the groups vLLM planned: full attention, then windows.
    kinds = [g.kind for g in scenario.kv_cache_groups]
    assert kinds == [K.FULL_ATTENTION] + [K.SLIDING_WINDOW] * (len(groups) - 1)


def test_every_shipped_model_scenario_plans_as_owed() -> None:
    judged = []
    shipped = [MIMO, NAS, NEAR, HIDDEN, HIDDEN_SCALED, FALLBACK, MIMO_MTP, PACKED_SPLIT]
    for path in [*shipped, *sorted((ROOT / "models" / "scenarios").glob("*.json"))]:
        scenario = load_entry(path).scenario
        assert scenario.model is not None
        assert _findings(scenario, observe_kv_cache_plan(scenario)) == [], path.name
        if owed_groups(scenario.model) is not None:
            judged.append(path.stem)
    # DeepSeek-V4 packs its pages (a block-outermost layout): not judged.
    assert judged == [
        "mimo-v2-unequal-pages",
        "nemotron-nas-per-layer-kv-heads",
        "near-equal-layer-counts-pad-to-the-larger",
        "hidden-state-layer-gets-its-own-block",
        "hidden-state-layer-scales-every-block",
        "mla-page-not-dividing-full-allocation-fallback",
        "mimo-v2-multi-module-mtp-tail-in-every-window",
        "gemma4-mtp",
        "gpt-oss-20b-eagle3",
        "llama4-scout",
        "qwen3-next-gdn-mtp",
        "qwen3-next-gdn",
    ]


# Identities in vLLM 0.33.0; the diffs are checked too.
UNIFY = "kv_cache_planning:ReplaceBinaryOperator_FloorDiv_Pow:1"
CONFIG = "kv_cache_planning:ReplaceBinaryOperator_Mul_Mod:3"
GROUPING = "kv_cache_planning:NumberReplacer:35"


def _planning_outcomes(
    work: Path, idents: list[str], operators: list[str], path: Path
) -> list[MutantOutcome]:
    """The outcomes of ``kv_cache_planning`` mutants ``idents`` (drawn from
    ``operators``) on the scenario file ``path``, as ``kvfuzz mutate`` runs them."""
    root = installed_vllm()
    (planning,) = [m for m in MODULES if m.path.endswith("kv_cache_planning.py")]
    pool = enumerate_mutants(root, [planning], operators=operators)
    by_id = {m.ident: m for m in pool[planning.path]}
    run = run_mutation(
        [by_id[ident] for ident in idents],
        [(path.name, load_entry(path).scenario)],
        vllm_root=root,
        work=work,
        seed=0,
        generated={planning.path: len(pool[planning.path])},
        timeout_s=60.0,
        modules=[planning],
    )
    return list(run.outcomes)


def test_planning_mutants_are_killed_on_the_mimo_case(tmp_path: Path) -> None:
    operators = ["core/ReplaceBinaryOperator_FloorDiv_Pow", "core/ReplaceBinaryOperator_Mul_Mod"]
    unify, config = _planning_outcomes(tmp_path, [UNIFY, CONFIG], operators, MIMO)
    assert "+                ratio = max_page_size ** layer_page_size" in unify.diff
    assert "+    size = bytes_per_block % num_blocks" in config.diff
    assert (unify.status, config.status) == (MutantStatus.KILLED, MutantStatus.KILLED)
    # The unified block is so large its page is not the largest one:
    # unify_kv_cache_spec_page_size's own assertion; the tensors' size is
    # 0 and the engine core's pool probe divides by it.
    assert unify.evidence == (
        f"crash on {MIMO.name}: planning the KV cache: get_global_kv_cache_groups: "
        "AssertionError:  [raised in unify_kv_cache_spec_page_size "
        "(vllm/v1/core/kv_cache_planning.py)]"
    )
    assert config.evidence.startswith(
        f"crash on {MIMO.name}: planning the KV cache: get_kv_cache_configs: "
        "ZeroDivisionError: integer division or modulo by zero"
    )


def test_the_grouping_mutant_is_killed_on_near_equal_layer_counts(tmp_path: Path) -> None:
    # 4 full-attention and 3 sliding-window layers: vLLM groups by the
    # larger count (4 < 3 * 1.5); at 0.5 it groups by 3 and splits full
    # attention in two, which the plan's judge refuses.
    (grouping,) = _planning_outcomes(tmp_path, [GROUPING], ["core/NumberReplacer"], NEAR)
    assert "+    if max_num_layers < min_num_layers * 0.5:" in grouping.diff
    assert grouping.status is MutantStatus.KILLED
    assert grouping.evidence == f"new finding(s) kv-cache-plan@run on {NEAR.name}"


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(scenarios())
def test_drawn_models_plan_into_their_scenarios_groups(scenario: Scenario) -> None:
    # The generator's models (fuzz.strategies.model_of): vLLM's own planner
    # gives back exactly the drawn groups, and the plan is as owed.
    if scenario.model is None:
        return
    plan = observe_kv_cache_plan(scenario)
    assert plan is not None and plan.error is None
    assert [(g.spec, g.block_size_tokens) for g in plan.groups] == drawn_specs(scenario)
    assert _findings(scenario, plan) == []

"""Engine mode's plans (``differential.driver.engine_mode.engine_plan``): what the
worker is told to send, checked without the engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from differential.corpus import load_entry
from differential.driver.engine_mode import (
    EngineUnsupported,
    engine_plan,
    geometry_scale,
    mamba_steps,
    scaled,
)
from differential.scenario import DrafterKind, GroupKind, KVCacheGroup, Scenario
from tests.factories import CORPORA, ROOT


def test_a_turn_copying_the_previous_answer_is_planned_from_the_engines_own_answer() -> None:
    # Turn 2 copies turn 1's 80-token prompt and its 41 sampled tokens, then
    # 16 of its own: the worker appends the engine's real answer, so the plan
    # carries only the 16 own tokens after a 121-token divergence.
    scenario = load_entry(CORPORA / "cases" / "multi-turn-decoded-blocks.json").scenario
    plan = engine_plan(scenario)
    assert plan["shares_output"] is True
    first, second = plan["requests"]
    assert (first["source"], first["divergence"], len(first["own"])) == (None, 64, 16)
    assert (second["source"], second["divergence"], len(second["own"])) == (0, 121, 16)
    assert second["max_tokens"] == 41
    assert len(plan["prefix"]) == 64


def test_scaling_a_turn_that_copies_the_previous_answer_scales_the_answer_exactly() -> None:
    # Turn 1: 80 prompt tokens and 41 sampled ones (decode_steps 40, plus the
    # first token sampled with the prefill); turn 2 copies all 121. Scaled x2
    # every sequence is twice as long: turn 1 samples 82 tokens (decode_steps
    # 81) and turn 2 copies 242, the whole answer. Scaling decode_steps alone
    # (80) left turn 1 with 241 tokens to copy, and the scaled scenario was
    # refused (divergence 242, allowed 0..241).
    scenario = load_entry(CORPORA / "cases" / "multi-turn-decoded-blocks.json").scenario
    double = scaled(scenario, 2)
    assert double.decode_steps == 81
    assert [r.divergence_tokens for r in double.requests] == [128, 242]
    assert [r.suffix_tokens for r in double.requests] == [32, 32]
    first, second = engine_plan(double)["requests"]
    assert first["max_tokens"] == 82
    assert (second["source"], second["divergence"], len(second["own"])) == (0, 242, 32)
    assert [r.divergence_tokens for r in scaled(scenario, 1).requests] == [64, 121]


def test_a_rejoining_request_sends_its_own_tokens_then_the_sources_again() -> None:
    scenario = load_entry(CORPORA / "cases" / "rejoin-swa-only.json").scenario
    plan = engine_plan(scenario)
    writer, edited, again = plan["requests"]
    assert (writer["divergence"], len(writer["own"])) == (512, 32)
    # The edited sibling: the prefix's first 128 tokens, 64 of its own, then
    # the prefix's tokens 192 to 512 again.
    assert (edited["divergence"], len(edited["own"])) == (128, 64 + 320)
    assert edited["own"][64:] == plan["prefix"][192:512]
    # A 1024-token vocabulary repeats tokens; what must differ is the first
    # token after the divergence point.
    assert edited["own"][0] != plan["prefix"][128]
    # The second edit rejoins the first sibling's prompt.
    assert (again["source"], again["divergence"], len(again["own"])) == (1, 256, 32 + 224)


def test_images_and_salts_are_unsupported_naming_why() -> None:
    scenario = load_entry(CORPORA / "cases" / "multimodal-image-swap.json").scenario
    with pytest.raises(EngineUnsupported, match=r"^images \(requests' mm_inputs\): kvfuzz's"):
        engine_plan(scenario)
    salted = dataclasses.replace(
        scenario,
        requests=tuple(
            dataclasses.replace(r, mm_inputs=(), cache_salt="t") for r in scenario.requests
        ),
    )
    with pytest.raises(EngineUnsupported, match=r"^cache_salt: the engine worker sends"):
        engine_plan(salted)


def test_decode_context_parallelism_is_unsupported_naming_why() -> None:
    scenario = load_entry(CORPORA / "cases" / "dcp8-mla-hits-at-sharded-block.json").scenario
    with pytest.raises(EngineUnsupported) as info:
        engine_plan(scenario)
    assert str(info.value) == (
        "dcp_world_size 8: decode context parallelism shards KV over several ranks; "
        "the CPU engine runs one"
    )


def test_an_unsupported_engine_run_of_a_scenario_its_release_cannot_mean_is_not_judged() -> None:
    # Llama-4-style chunked local attention beside full attention, with an
    # EAGLE drafter, on an engine without lookahead block hashes (vLLM
    # 0.32.0): the drafter would take the EAGLE block drop, which vLLM
    # refuses for chunked local attention, so the release means no scenario
    # at all. Judging its unsupported run once raised Unsupported out of
    # `kvfuzz replay --mode engine` (kvfuzz's internal error, exit 3).
    from differential.capabilities import Feature, Unsupported, equivalent_scenario
    from differential.driver.engine_mode import EngineResult
    from differential.observation import RunObservation
    from differential.variants.engine import judge

    scenario = load_entry(CORPORA / "cases" / "llama4-chunked-local.json").scenario
    features = {Feature.LOOKAHEAD_HASHES.value: False}
    with pytest.raises(Unsupported, match=r"chunked_local_attention group taking the EAGLE"):
        equivalent_scenario(scenario, features)
    run = RunObservation("engine", "0.32.0 (engine)", None, (), unsupported="engine: why")
    result = EngineResult(scenario, 1, run, None, {}, {}, features, ())
    assert judge(result) == ((), ())


SEED_JUNCTION = CORPORA / "seeds" / "junction-retention0-swa4-fa8.json"


def test_sliding_blocks_half_the_full_blocks_plan_a_mimo_model_with_two_sliding_kv_heads() -> None:
    # FA 8 + SWA 4 (window 16) scaled x8: FA 64, SWA 32, window 128. vLLM's
    # page-size unification gives the full-attention layer, one KV head
    # against the sliding layer's two (head size 32 both), a block of 2 x 32.
    scenario = load_entry(SEED_JUNCTION).scenario
    engine = engine_plan(scaled(scenario, 8))["engine"]
    assert engine["architecture"] == "mimo_v2"
    assert engine["block_size"] == 32
    assert engine["layer_types"] == ["full_attention", "sliding_attention"]
    assert engine["sliding_window"] == 128
    assert engine["kv_heads"] == {"full_attention": 1, "sliding_attention": 2}
    assert engine["groups"] == [
        {
            "spec": "FullAttentionSpec",
            "block_size": 64,
            "sliding_window": None,
            "is_eagle_group": False,
        },
        {
            "spec": "SlidingWindowSpec",
            "block_size": 32,
            "sliding_window": 128,
            "is_eagle_group": False,
        },
    ]
    assert engine["hash_block_size"] == 32


def test_a_sliding_block_four_times_the_full_block_gives_full_attention_four_kv_heads() -> None:
    scenario = load_entry(SEED_JUNCTION).scenario
    groups = (
        dataclasses.replace(scenario.kv_cache_groups[0], block_size_tokens=32),
        dataclasses.replace(
            scenario.kv_cache_groups[1], block_size_tokens=128, sliding_window_tokens=256
        ),
    )
    engine = engine_plan(dataclasses.replace(scenario, kv_cache_groups=groups))["engine"]
    assert (engine["block_size"], engine["kv_heads"]) == (
        32,
        {"full_attention": 4, "sliding_attention": 1},
    )
    assert [g["block_size"] for g in engine["groups"]] == [32, 128]


def test_one_block_size_keeps_the_tiny_llama_model() -> None:
    engine = engine_plan(load_entry(CORPORA / "cases" / "rejoin-swa-only.json").scenario)["engine"]
    assert engine["architecture"] == "llama"
    assert "kv_heads" not in engine
    # Every plan names the groups the worker checks the engine's against.
    assert engine["groups"] == [
        {
            "spec": "SlidingWindowSpec",
            "block_size": 32,
            "sliding_window": 64,
            "is_eagle_group": False,
        }
    ]
    assert engine["hash_block_size"] == 32


def test_block_sizes_the_cpu_engine_cannot_give_are_unsupported_naming_the_vllm_file() -> None:
    # Exact geometry: the smallest block is not a multiple of 32.
    with pytest.raises(EngineUnsupported, match=r"^block size 4: the CPU attention kernels"):
        engine_plan(load_entry(SEED_JUNCTION).scenario)
    # Two full-attention groups of block sizes 1536 and 3456 (a draft group)
    # and no other kind: vLLM puts them into one group of one block size.
    blowup = load_entry(ROOT / "known-issues" / "alignment-blowup-1536-3456.json").scenario
    with pytest.raises(
        EngineUnsupported,
        match=r"^full_attention groups of block sizes \[1536, 3456\] and no other kind: vLLM",
    ):
        engine_plan(blowup)
    # 96 / 64 is not an integer: vLLM pads such a page instead of growing its block.
    scenario = scaled(load_entry(SEED_JUNCTION).scenario, 8)
    odd = dataclasses.replace(
        scenario,
        kv_cache_groups=(
            scenario.kv_cache_groups[0],
            dataclasses.replace(scenario.kv_cache_groups[1], block_size_tokens=96),
        ),
    )
    with pytest.raises(EngineUnsupported) as info:
        engine_plan(odd)
    assert str(info.value) == (
        "groups of block sizes [64, 96]: vLLM grows a layer's block by the ratio of the largest "
        "page to its page only when that ratio is an integer, else pads the page "
        "(vllm/v1/core/kv_cache_utils.py, unify_kv_cache_spec_page_size); kvfuzz builds integer "
        "ratios up to 64"
    )
    # A Mamba block unlike the attention block (x32: Mamba 128, attention 32).
    mamba = load_entry(ROOT / "known-issues" / "mamba-state-cached-one-token-short.json").scenario
    with pytest.raises(EngineUnsupported) as info:
        engine_plan(scaled(mamba, 8))
    assert str(info.value) == (
        "groups of block sizes [32, 128] beside Mamba groups: in align mode, the only Mamba "
        "mode with prefix caching, vLLM 0.32 makes the Mamba block the attention block "
        "(vllm/platforms/interface.py, Platform._align_hybrid_block_size)"
    )


def test_the_worker_writes_the_mimo_model_and_an_eagle_draft_joining_full_attention(
    tmp_path: Path,
) -> None:
    import json

    from differential.driver.engine_worker import engine_arguments
    from differential.scenario import DrafterKind

    scenario = scaled(load_entry(SEED_JUNCTION).scenario, 8)
    drafter = dataclasses.replace(
        scenario.drafter, kind=DrafterKind.EAGLE, num_speculative_tokens=1
    )
    plan = engine_plan(dataclasses.replace(scenario, drafter=drafter))
    kwargs = engine_arguments(plan, tmp_path)
    target = json.loads((Path(kwargs["model"]) / "config.json").read_text())
    assert target["architectures"] == ["MiMoV2FlashForCausalLM"]
    # One full-attention and two sliding-window layers: with the draft layer,
    # two of each, which vLLM's planner makes one group each, the scenario's.
    assert target["hybrid_layer_pattern"] == [0, 1, 1]
    assert target["moe_layer_freq"] == [0, 0, 0]
    assert (target["num_key_value_heads"], target["swa_num_key_value_heads"]) == (1, 2)
    assert (target["head_dim"], target["swa_head_dim"], target["sliding_window_size"]) == (
        32,
        32,
        128,
    )
    assert kwargs["block_size"] == 32
    draft = kwargs["speculative_config"]
    assert (draft["method"], draft["num_speculative_tokens"]) == ("eagle", 1)
    draft_config = json.loads((Path(draft["model"]) / "config.json").read_text())
    # The draft layer has the full-attention layer's KV shape (1 head of 32).
    assert (draft_config["num_key_value_heads"], draft_config["head_dim"]) == (1, 32)


class FullAttentionSpec:
    """Stands for vLLM's spec class of that name (the worker reads its name,
    ``block_size`` and ``sliding_window``)."""

    def __init__(self, block_size: int, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window


class SlidingWindowSpec(FullAttentionSpec):
    """Stands for vLLM's spec class of that name."""


def _core(*specs: FullAttentionSpec) -> SimpleNamespace:
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=[f"l{i}"]) for i, s in enumerate(specs)]
    config = SimpleNamespace(kv_cache_groups=groups)
    return SimpleNamespace(scheduler=SimpleNamespace(kv_cache_config=config))


def test_the_worker_refuses_to_run_on_groups_other_than_the_plans() -> None:
    from differential.driver.engine_worker import PlanError, _check_groups

    engine = engine_plan(scaled(load_entry(SEED_JUNCTION).scenario, 8))["engine"]
    cache = SimpleNamespace(block_size=32, hash_block_size=32)
    _check_groups(engine, _core(FullAttentionSpec(64), SlidingWindowSpec(32, 128)), cache)
    # A second full-attention group of the same spec (a draft layer vLLM's
    # planner did not balance) takes its own blocks: another layout.
    with pytest.raises(PlanError, match=r"64, 0, False\), \('FullAttentionSpec'"):
        _check_groups(
            engine,
            _core(FullAttentionSpec(64), FullAttentionSpec(64), SlidingWindowSpec(32, 128)),
            cache,
        )
    with pytest.raises(PlanError, match=r"came out as \[\('FullAttentionSpec', 32, 0, False\)"):
        _check_groups(engine, _core(FullAttentionSpec(32), SlidingWindowSpec(32, 128)), cache)
    # Another hash block matters only with prefix caching on.
    coarse = SimpleNamespace(block_size=32, hash_block_size=64)
    with pytest.raises(PlanError, match=r"hash block 64\), not the scenario's"):
        _check_groups(engine, _core(FullAttentionSpec(64), SlidingWindowSpec(32, 128)), coarse)
    _check_groups(
        {**engine, "enable_prefix_caching": False},
        _core(FullAttentionSpec(64), SlidingWindowSpec(32, 128)),
        coarse,
    )


def test_a_variants_patch_travels_in_the_plan_and_a_tree_variant_is_refused() -> None:
    from differential.variants import Variant, VariantRole, parse_variants
    from differential.variants.engine import _variant_patch, engine_run_name

    unfixed, fixed = parse_variants("unfixed,fixed")
    scenario = load_entry(
        CORPORA / "cases" / "engine-seed-class-eagle1-swa64-fa32-r256.json"
    ).scenario
    assert engine_plan(scenario)["variant"] is None
    assert _variant_patch(unfixed) is None
    patch = _variant_patch(fixed)
    assert patch == "differential.driver.fixes:seed_pr_fix"
    assert engine_plan(scenario, variant=patch)["variant"] == patch
    assert (engine_run_name(None), engine_run_name(fixed)) == ("engine", "fixed@engine")
    tree = Variant("tree:/x", "a tree", VariantRole.BASELINE, tree="/x")
    with pytest.raises(EngineUnsupported, match="runs in its own worker"):
        _variant_patch(tree)


def test_the_engine_worker_enters_only_the_variants_patch_modules() -> None:
    from differential.driver.engine_worker import PlanError, _variant_patches

    with _variant_patches(None) as applied:
        assert applied == ()
    with (
        pytest.raises(PlanError, match=r"allowed differential\.driver\.fixes"),
        _variant_patches("os:getcwd"),
    ):
        pass


def test_an_mtp_drafter_beside_two_kinds_plans_mimo_v2_with_its_mtp_layer_in_the_sliding_group(
    tmp_path: Path,
) -> None:
    import json

    from differential.driver.engine_worker import engine_arguments

    # The seed bug's own geometry (FA 2 + SWA 1, window 2) scaled x32 with its
    # MTP drafter: MiMo-V2-Flash's one MTP layer is a sliding-window layer, so
    # the target has two full-attention layers and one sliding-window layer,
    # two of each with the MTP layer: one group each.
    written = load_entry(CORPORA / "regressions" / "fallback-unfixed-517c289c14.json").scenario
    # As written no group is marked: every group takes the EAGLE drop
    # (KVCacheCoordinator's fallback), but vLLM's planner marks the MTP
    # layer's group, the sliding-window one, and only it drops.
    with pytest.raises(
        EngineUnsupported,
        match=r"^is_eagle_group marks on none \(every group drops\): vLLM's planner marks "
        r"sliding_window",
    ):
        engine_plan(scaled(written, 32))
    scenario = scaled(_swa_marked(written), 32)
    engine = engine_plan(scenario)["engine"]
    assert engine["architecture"] == "mimo_v2"
    assert engine["layer_types"] == ["full_attention", "sliding_attention", "full_attention"]
    assert engine["kv_heads"] == {"full_attention": 1, "sliding_attention": 2}
    assert engine["drafter"] == {
        "method": "mtp",
        "num_speculative_tokens": 1,
        "disable_eagle_block_drop": False,
        "modules": 1,
    }
    assert [(g["spec"], g["block_size"], g["is_eagle_group"]) for g in engine["groups"]] == [
        ("FullAttentionSpec", 64, False),
        ("SlidingWindowSpec", 32, True),
    ]
    kwargs = engine_arguments({"engine": engine}, tmp_path)
    # No draft model: vLLM builds MiMoV2MTPModel from the target's config.
    assert kwargs["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 1}
    target = json.loads((Path(kwargs["model"]) / "config.json").read_text())
    assert target["architectures"] == ["MiMoV2FlashForCausalLM"]
    assert (target["num_nextn_predict_layers"], target["hybrid_layer_pattern"]) == (1, [0, 1, 0])
    # Equal block sizes: one KV head on both kinds.
    equal = load_entry(CORPORA / "seeds" / "equal-block-alignment-mtp3-swa16-fa16-r8192.json")
    engine = engine_plan(scaled(_swa_marked(equal.scenario), 2))["engine"]
    assert (engine["architecture"], engine["kv_heads"]) == (
        "mimo_v2",
        {"full_attention": 1, "sliding_attention": 1},
    )


def _swa_marked(scenario: Scenario) -> Scenario:
    """``scenario`` with its sliding-window groups marked ``is_eagle_group``."""
    groups = tuple(
        dataclasses.replace(g, is_eagle_group=g.kind is GroupKind.SLIDING_WINDOW)
        for g in scenario.kv_cache_groups
    )
    return dataclasses.replace(scenario, kv_cache_groups=groups)


def test_mtp_on_one_attention_kind_plans_mimo_with_one_module_per_token(tmp_path: Path) -> None:
    import json

    from differential.driver.engine_worker import engine_arguments

    full = load_entry(CORPORA / "cases" / "multi-turn-decoded-blocks--two-lookahead-tokens.json")
    engine = engine_plan(scaled(full.scenario, 2))["engine"]
    assert (engine["architecture"], engine["layer_types"]) == ("mimo", ["full_attention"])
    assert engine["drafter"]["modules"] == 2
    kwargs = engine_arguments({"engine": engine}, tmp_path)
    assert kwargs["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    target = json.loads((Path(kwargs["model"]) / "config.json").read_text())
    assert (target["architectures"], target["num_nextn_predict_layers"]) == (
        ["MiMoForCausalLM"],
        2,
    )
    assert "use_sliding_window" not in target
    # A sliding-window-only layout: every Qwen2 layer slides, the MTP ones too.
    swa = load_entry(ROOT / "known-issues" / "single-swa-group-lookahead-hashes-index-error.json")
    engine = engine_plan(scaled(swa.scenario, 16))["engine"]
    assert (engine["architecture"], engine["layer_types"]) == ("mimo", ["sliding_attention"])
    target = json.loads(
        (Path(engine_arguments({"engine": engine}, tmp_path)["model"]) / "config.json").read_text()
    )
    assert (target["use_sliding_window"], target["sliding_window"]) == (True, 32)
    assert target["layer_types"] == ["sliding_attention"]
    # Single-module MTP on one kind: one module.
    mtp = dataclasses.replace(
        full.scenario, drafter=dataclasses.replace(full.scenario.drafter, kind=DrafterKind.MTP)
    )
    assert engine_plan(scaled(mtp, 2))["engine"]["drafter"]["modules"] == 1


def test_draft_layers_are_balanced_so_the_planner_makes_the_scenarios_groups() -> None:
    # EAGLE's draft layer is a full-attention layer: beside one sliding-window
    # group the target gets a second sliding-window layer (two layers of each).
    eagle = load_entry(CORPORA / "cases" / "engine-seed-class-eagle1-swa64-fa32-r256.json").scenario
    engine = engine_plan(eagle)["engine"]
    assert engine["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    # EAGLE-3 needs three distinct auxiliary layers: 2 full + 3 sliding, with
    # the draft layer three of each.
    eagle3 = dataclasses.replace(
        eagle, drafter=dataclasses.replace(eagle.drafter, kind=DrafterKind.EAGLE3)
    )
    layers = engine_plan(eagle3)["engine"]["layer_types"]
    assert (layers.count("full_attention"), layers.count("sliding_attention")) == (2, 3)
    # n-gram speculation adds no layer; Mamba groups keep one layer per group.
    ngram = dataclasses.replace(
        eagle, drafter=dataclasses.replace(eagle.drafter, kind=DrafterKind.NGRAM)
    )
    assert engine_plan(ngram)["engine"]["layer_types"] == ["sliding_attention", "full_attention"]
    periodic = (
        ROOT
        / "corpora"
        / "regressions"
        / "mamba-scheduler-chunks-of-the-step-budget--periodic.json"
    )
    mamba = load_entry(periodic).scenario
    engine = engine_plan(mamba_steps(scaled(mamba, geometry_scale(mamba))))["engine"]
    assert engine["pattern"] == "*MM"
    assert [g["spec"] for g in engine["groups"]] == ["FullAttentionSpec", "MambaSpec", "MambaSpec"]
    # Two groups of each kind: vLLM's planner gives the kind with the fewest
    # layers one group, whatever the layer counts.
    two_each = dataclasses.replace(
        eagle, kv_cache_groups=eagle.kv_cache_groups * 2, drafter=ngram.drafter
    )
    with pytest.raises(EngineUnsupported, match=r"^groups 2 sliding_window, 2 full_attention: "):
        engine_plan(two_each)
    # EAGLE on a sliding-window-only layout: its full-attention draft layer
    # would make a group the scenario does not have.
    swa_only = load_entry(CORPORA / "cases" / "rejoin-swa-only.json").scenario
    with pytest.raises(EngineUnsupported, match=r"^the eagle drafter's layers are full_attention"):
        engine_plan(dataclasses.replace(swa_only, drafter=eagle.drafter))


def test_drafters_the_cpu_engine_cannot_run_are_refused_naming_the_vllm_file() -> None:
    def why(path: Path, factor: int) -> str:
        with pytest.raises(EngineUnsupported) as info:
            engine_plan(mamba_steps(scaled(load_entry(path).scenario, factor)))
        return str(info.value)

    multi = why(CORPORA / "cases" / "multi-module-mtp-drop-caches-finalized-tokens-only.json", 8)
    assert multi.startswith("multi-module MTP beside sliding-window and full-attention groups:")
    assert "_MIMO_V2_FLASH_NUM_MTP_LAYERS" in multi
    gemma = why(CORPORA / "seeds" / "gemma4-mtp3-swa16-fa32-r8192.json", 2)
    assert gemma.startswith("drafter 'gemma4_mtp': the Gemma-4 assistant (Gemma4MTPModel")
    dspark = why(ROOT / "known-issues" / "unit-below-replay-boundary-dspark.json", 8)
    assert dspark.startswith("drafter 'dspark': the CPU engine cannot run DSpark")
    assert "Model Runner V1 does not support: dspark" in dspark
    dflash = why(CORPORA / "seeds" / "dflash-swa16-fa32-r8192.json", 2)
    assert dflash.startswith("drafter 'dflash': a tiny DFlash draft")
    assert "dispatch_cpu_unquantized_gemm" in dflash
    marked = why(CORPORA / "cases" / "seed-shrunk-draft-group-marked.json", 32)
    assert marked.startswith(
        "is_eagle_group marks on full_attention: vLLM's planner marks sliding_window"
    )
    # Any drafter beside Mamba groups, MTP included.
    mamba = why(ROOT / "known-issues" / "mamba-finder-ignores-eagle-drop.json", 8)
    assert mamba.startswith("a drafter beside Mamba groups: the CPU engine starts but fails")
    assert "precopy_mamba_align_fused_kernel" in mamba


def test_the_cache_off_plan_leaves_retention_and_the_hash_block_to_vllm() -> None:
    # Without a prefix cache vLLM still validates the retention interval
    # against the scheduler block (vllm/v1/core/kv_cache_coordinator.py): a
    # Mamba hybrid's cache-off engine, whose scheduler block is the model
    # length, refused to start with retention 128 and its outputs went
    # uncompared. The cache-off plan leaves both to vLLM's defaults, so two
    # scenarios that differ only there share one cache-off engine.
    path = CORPORA / "regressions" / "mamba-scheduler-chunks-of-the-step-budget--periodic.json"
    scenario = mamba_steps(scaled(load_entry(path).scenario, 32))
    on, off = engine_plan(scenario), engine_plan(scenario, prefix_caching=False)
    assert on["engine"]["retention"] == 128
    assert "retention" not in off["engine"]
    assert off["engine"]["prefix_match_unit"] is None
    # Without a prefix cache vLLM makes a Mamba layer's block the model length
    # (mamba_cache_mode "none"), and the worker checks the groups it plans.
    assert off["engine"]["max_model_len"] == 2048
    assert [(g["spec"], g["block_size"]) for g in off["engine"]["groups"]] == [
        ("FullAttentionSpec", 32),
        ("MambaSpec", 2048),
        ("MambaSpec", 2048),
    ]
    assert [g["block_size"] for g in on["engine"]["groups"]] == [32, 32, 32]
    dense = dataclasses.replace(scenario, retention_interval_tokens=None)
    assert engine_plan(dense, prefix_caching=False) == off
    assert engine_plan(dense)["engine"] != on["engine"]


GEMMA4_FALLBACK = CORPORA / "cases" / "gemma4-eagle3-draft-group--fallback.json"


def _groups_with(scenario: Scenario, *groups: tuple[GroupKind, int, int | None]) -> Scenario:
    """``scenario`` with these groups (kind, block, window in tokens) and dense retention."""
    return dataclasses.replace(
        scenario,
        kv_cache_groups=tuple(KVCacheGroup(k, b, w) for k, b, w in groups),
        retention_interval_tokens=None,
    )


def test_two_full_attention_block_sizes_plan_a_gemma4_model_with_kv_heads_per_layer() -> None:
    # FA 8 + SWA 4 (window 16) + FA 4, EAGLE-3, scaled x8: FA 64, SWA 32
    # (window 128), FA 32. The layers of block 32 get two KV heads, the
    # layers of block 64 one; the draft layer gets the heads of the
    # full-attention layers of the smallest block, so it joins their group.
    # Two layers per group, the draft layer the FA 32 group's second, so
    # vLLM's planner makes one group of each spec (one target layer each
    # would leave FA 32 two layers against one, split into two groups), and
    # the last full-attention layer goes last.
    scenario = scaled(load_entry(GEMMA4_FALLBACK).scenario, 8)
    engine = engine_plan(scenario)["engine"]
    assert engine["architecture"] == "gemma4"
    assert engine["block_size"] == 32
    assert engine["layer_types"] == [
        "full_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ]
    assert engine["kv_heads"] == [1, 2, 2, 2, 1]
    assert engine["draft_kv_heads"] == 2
    assert engine["sliding_window"] == 128
    assert engine["groups"] == [
        {
            "spec": "FullAttentionSpec",
            "block_size": 64,
            "sliding_window": None,
            "is_eagle_group": False,
        },
        {
            "spec": "SlidingWindowSpec",
            "block_size": 32,
            "sliding_window": 128,
            "is_eagle_group": False,
        },
        {
            "spec": "FullAttentionSpec",
            "block_size": 32,
            "sliding_window": None,
            "is_eagle_group": False,
        },
    ]
    assert engine["hash_block_size"] == 32


def test_the_gemma4_layers_end_with_full_attention_and_heads_are_the_lcm_of_the_ratios() -> None:
    # Gemma4TextConfig makes a last layer of another kind full attention, so
    # the last full-attention group's layer goes last. Blocks 32, 64 and 96
    # are ratios 1, 2, 3 of the smallest: six KV heads on block 32, three on
    # 64, two on 96 (pages 6:3:2, each dividing the largest).
    base = scaled(load_entry(GEMMA4_FALLBACK).scenario, 8)
    fa, swa = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW
    # EAGLE-3's draft layer joins the FA 32 group: two layers per group.
    scenario = _groups_with(base, (fa, 32, None), (fa, 64, None), (swa, 96, 192))
    engine = engine_plan(scenario)["engine"]
    assert engine["layer_types"] == [
        "full_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ]
    assert engine["kv_heads"] == [6, 3, 2, 2, 3]
    assert (engine["block_size"], engine["draft_kv_heads"]) == (32, 6)
    assert [g["block_size"] for g in engine["groups"]] == [32, 64, 96]
    # Two sliding-window block sizes beside one full-attention one.
    engine = engine_plan(_groups_with(base, (swa, 32, 128), (swa, 64, 128), (fa, 128, None)))[
        "engine"
    ]
    assert (engine["architecture"], engine["kv_heads"]) == ("gemma4", [4, 2, 4, 2, 1])
    # One block size per kind keeps the MiMo-V2-Flash model.
    engine = engine_plan(_groups_with(base, (fa, 64, None), (swa, 32, 128)))["engine"]
    assert engine["architecture"] == "mimo_v2"


def test_block_sizes_the_gemma4_model_cannot_give_are_unsupported_naming_why() -> None:
    base = scaled(load_entry(GEMMA4_FALLBACK).scenario, 8)
    fa, swa = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW
    # 96 is not a multiple of 64: vLLM pads that layer's page.
    with pytest.raises(EngineUnsupported) as info:
        engine_plan(_groups_with(base, (fa, 64, None), (fa, 192, None), (swa, 96, 128)))
    assert str(info.value) == (
        "groups of block sizes [64, 96, 192]: vLLM grows a layer's block by the ratio of the "
        "largest page to its page only when that ratio is an integer, else pads the page "
        "(vllm/v1/core/kv_cache_utils.py, unify_kv_cache_spec_page_size); kvfuzz builds "
        "blocks that are multiples of the smallest, up to 64 KV heads"
    )
    # Ratios 1, 5, 7: 35 KV heads; 1, 9, 11: 99, above 64.
    engine_plan(_groups_with(base, (fa, 32, None), (fa, 160, None), (swa, 224, 256)))
    with pytest.raises(EngineUnsupported, match=r"up to 64 KV heads$"):
        engine_plan(_groups_with(base, (fa, 32, None), (fa, 288, None), (swa, 352, 512)))
    # No full-attention group: the Gemma 4 model's last layer is one.
    with pytest.raises(EngineUnsupported) as info:
        engine_plan(_groups_with(base, (swa, 32, 128), (swa, 64, 128)))
    assert str(info.value).startswith(
        "sliding_window groups of block sizes [32, 64] without a full-attention group: the "
        "tiny Gemma 4 model's last layer is full attention (Gemma4TextConfig, "
        "transformers/models/gemma4/configuration_gemma4.py)"
    )


def test_the_worker_writes_a_gemma4_model_with_kv_heads_per_layer(tmp_path: Path) -> None:
    import json

    from differential.driver.engine_worker import engine_arguments

    plan = engine_plan(scaled(load_entry(GEMMA4_FALLBACK).scenario, 8))
    kwargs = engine_arguments(plan, tmp_path)
    target = json.loads((Path(kwargs["model"]) / "config.json").read_text())
    assert (target["architectures"], target["model_type"]) == (
        ["Gemma4ForCausalLM"],
        "gemma4_text",
    )
    # The plan's five layers (two per group with the draft layer), as planned.
    assert target["layer_types"] == ["full_attention", "sliding_attention"] * 2 + ["full_attention"]
    assert {i: c["num_key_value_heads"] for i, c in target["per_layer_config"].items()} == {
        "0": 1,
        "1": 2,
        "2": 2,
        "3": 2,
        "4": 1,
    }
    assert {c["head_dim"] for c in target["per_layer_config"].values()} == {32}
    assert (target["num_attention_heads"], target["sliding_window"]) == (2, 128)
    # Dense, no per-layer inputs, no shared KV, causal (no window conversion).
    assert (target["enable_moe_block"], target["hidden_size_per_layer_input"]) == (False, 0)
    assert (target["num_kv_shared_layers"], target["use_bidirectional_attention"]) == (0, None)
    assert kwargs["block_size"] == 32
    draft = kwargs["speculative_config"]
    assert (draft["method"], draft["num_speculative_tokens"]) == ("eagle3", 3)
    draft_config = json.loads((Path(draft["model"]) / "config.json").read_text())
    assert draft_config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert (draft_config["num_key_value_heads"], draft_config["head_dim"]) == (2, 32)


def test_several_windows_of_one_block_size_plan_a_plamo3_model_with_a_window_per_layer(
    tmp_path: Path,
) -> None:
    import json

    from differential.driver.engine_worker import engine_arguments

    base = load_entry(GEMMA4_FALLBACK).scenario
    fa, swa = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW
    scenario = scaled(_groups_with(base, (fa, 4, None), (swa, 4, 16), (swa, 4, 8)), 8)
    plan = engine_plan(scenario)
    engine = plan["engine"]
    assert (engine["architecture"], engine["block_size"]) == ("plamo3", 32)
    assert engine["sliding_windows"] == [None, 128, 64, 128, 64]
    assert [(g["spec"], g["sliding_window"]) for g in engine["groups"]] == [
        ("FullAttentionSpec", None),
        ("SlidingWindowSpec", 128),
        ("SlidingWindowSpec", 64),
    ]
    target = json.loads(
        (Path(engine_arguments(plan, tmp_path)["model"]) / "config.json").read_text()
    )
    assert target["architectures"] == ["Plamo3ForCausalLM"]
    # EAGLE-3: the draft layer joins the full-attention group, and each
    # window's layers are balanced to two.
    assert target["interleaved_sliding_window"] == [None, 128, 64, 128, 64]
    assert target["layer_types"] == ["full_attention"] + ["sliding_attention"] * 4


def test_several_windows_the_tiny_models_cannot_give_are_unsupported_naming_why() -> None:
    base = load_entry(GEMMA4_FALLBACK).scenario
    fa, swa = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW
    # Windows 8 and 16 beside blocks 4 and 8.
    with pytest.raises(EngineUnsupported) as info:
        engine_plan(scaled(_groups_with(base, (fa, 8, None), (swa, 4, 16), (swa, 4, 8)), 8))
    assert str(info.value) == (
        "sliding windows [64, 128] beside groups of block sizes [32, 64]: the tiny model with "
        "a window per layer, Plamo 3 (vllm/model_executor/models/plamo3.py: "
        "config.interleaved_sliding_window), gives every layer one KV shape "
        "(config.num_key_value_heads), and those with KV heads per layer kind or per layer read "
        "one window per model (mimo_v2.py: config.sliding_window_size; gemma4.py, "
        "Gemma4Attention: config.sliding_window)"
    )
    # An EAGLE-3 draft layer is full attention: a group two sliding windows lack.
    with pytest.raises(
        EngineUnsupported, match=r"^the eagle3 drafter's layers are full_attention \(block 32\)"
    ):
        engine_plan(scaled(_groups_with(base, (swa, 4, 16), (swa, 4, 8)), 8))
    no_drafter = dataclasses.replace(
        base,
        drafter=dataclasses.replace(base.drafter, kind=DrafterKind.NONE, num_speculative_tokens=0),
    )
    engine = engine_plan(scaled(_groups_with(no_drafter, (swa, 4, 16), (swa, 4, 8)), 8))["engine"]
    assert (engine["architecture"], engine["sliding_windows"]) == ("plamo3", [128, 64])


def test_mtp_beside_the_gemma4_plamo3_and_llama4_layouts_is_refused_naming_why() -> None:
    # vLLM builds an MTP draft from the target's own MTP layers: the tiny
    # Gemma 4, Plamo 3 and Llama-4 targets have none.
    base = load_entry(GEMMA4_FALLBACK).scenario
    fa, swa = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW
    mtp = dataclasses.replace(base, drafter=dataclasses.replace(base.drafter, kind=DrafterKind.MTP))
    with pytest.raises(EngineUnsupported) as info:
        engine_plan(scaled(mtp, 8))
    assert str(info.value).startswith(
        "drafter 'mtp' beside groups of block sizes [32, 64] (the tiny Gemma 4 target): "
        "vLLM builds an MTP draft from the target's own MTP layers"
    )
    windows = _groups_with(mtp, (fa, 4, None), (swa, 4, 16), (swa, 4, 8))
    with pytest.raises(
        EngineUnsupported, match=r"^drafter 'mtp' beside sliding windows \[64, 128\] "
    ):
        engine_plan(scaled(windows, 8))
    chunked = load_entry(CORPORA / "cases" / "llama4-chunked-local.json").scenario
    chunked = dataclasses.replace(chunked, drafter=mtp.drafter)
    with pytest.raises(
        EngineUnsupported, match=r"^drafter 'mtp' beside chunked_local_attention groups"
    ):
        engine_plan(scaled(chunked, 8))


def test_mtp_marks_one_group_of_its_layers_spec_where_the_planner_makes_several() -> None:
    # The seed regression scaled x32 as FA 64 + SWA 32 + SWA 32 (window 64)
    # with its MTP drafter: one full-attention and one sliding-window target
    # layer, the MTP layer the sliding-window spec's second, so vLLM's
    # planner makes one full-attention group and two sliding-window groups
    # (a second target sliding-window layer would make three), and marks
    # one of them is_eagle_group (the group holding the last registered
    # layer). A scenario marking both sliding-window groups drops on both.
    written = load_entry(CORPORA / "regressions" / "fallback-unfixed-517c289c14.json").scenario
    fa, swa = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW
    one = dataclasses.replace(
        scaled(written, 32),
        kv_cache_groups=(
            KVCacheGroup(fa, 64),
            KVCacheGroup(swa, 32, 64, is_eagle_group=True),
            KVCacheGroup(swa, 32, 64),
        ),
    )
    engine = engine_plan(one)["engine"]
    assert (engine["architecture"], engine["layer_types"]) == (
        "mimo_v2",
        ["full_attention", "sliding_attention"],
    )
    assert [g["is_eagle_group"] for g in engine["groups"]] == [False, True, False]
    both = dataclasses.replace(
        one,
        kv_cache_groups=tuple(
            dataclasses.replace(g, is_eagle_group=g.kind is swa) for g in one.kv_cache_groups
        ),
    )
    with pytest.raises(
        EngineUnsupported,
        match=r"^is_eagle_group marks on sliding_window \(2 groups\): vLLM's planner marks "
        r"sliding_window \(one group, of block 32\)",
    ):
        engine_plan(both)


def test_every_layout_plans_the_groups_the_worker_checks() -> None:
    # The Llama-4 and NemotronH plans name their groups too, with no
    # is_eagle_group mark (no drafter, or n-gram speculation).
    chunked = load_entry(CORPORA / "cases" / "llama4-chunked-local.json").scenario
    ngram = dataclasses.replace(
        chunked, drafter=dataclasses.replace(chunked.drafter, kind=DrafterKind.NGRAM)
    )
    engine = engine_plan(scaled(ngram, geometry_scale(ngram)))["engine"]
    assert engine["architecture"] == "llama4"
    assert [(g["spec"], g["is_eagle_group"]) for g in engine["groups"]] == [
        ("FullAttentionSpec", False),
        ("ChunkedLocalAttentionSpec", False),
    ]
    assert engine["drafter"]["method"] == "ngram"

"""Engine mode's plans (``differential.driver.engine_mode.engine_plan``): what the
worker is told to send, checked without the engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from differential.corpus import load_entry
from differential.driver.engine_mode import EngineUnsupported, engine_plan, mamba_steps, scaled
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
        {"spec": "FullAttentionSpec", "block_size": 64, "sliding_window": None},
        {"spec": "SlidingWindowSpec", "block_size": 32, "sliding_window": 128},
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
    assert "groups" not in engine and "kv_heads" not in engine


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
    assert target["hybrid_layer_pattern"] == [0, 1]
    assert target["moe_layer_freq"] == [0, 0]
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
    # A draft layer's second full-attention group of the same spec is the same layout.
    _check_groups(
        engine,
        _core(FullAttentionSpec(64), FullAttentionSpec(64), SlidingWindowSpec(32, 128)),
        cache,
    )
    with pytest.raises(PlanError, match=r"came out as \[\('FullAttentionSpec', 32, 0\)"):
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
    # layer of block 64 one; the draft layer gets the heads of the
    # full-attention layer of the smallest block, so it joins that group.
    scenario = scaled(load_entry(GEMMA4_FALLBACK).scenario, 8)
    engine = engine_plan(scenario)["engine"]
    assert engine["architecture"] == "gemma4"
    assert engine["block_size"] == 32
    assert engine["layer_types"] == ["full_attention", "sliding_attention", "full_attention"]
    assert engine["kv_heads"] == [1, 2, 2]
    assert engine["draft_kv_heads"] == 2
    assert engine["sliding_window"] == 128
    assert engine["groups"] == [
        {"spec": "FullAttentionSpec", "block_size": 64, "sliding_window": None},
        {"spec": "SlidingWindowSpec", "block_size": 32, "sliding_window": 128},
        {"spec": "FullAttentionSpec", "block_size": 32, "sliding_window": None},
    ]
    assert engine["hash_block_size"] == 32


def test_the_gemma4_layers_end_with_full_attention_and_heads_are_the_lcm_of_the_ratios() -> None:
    # Gemma4TextConfig makes a last layer of another kind full attention, so
    # the last full-attention group's layer goes last. Blocks 32, 64 and 96
    # are ratios 1, 2, 3 of the smallest: six KV heads on block 32, three on
    # 64, two on 96 (pages 6:3:2, each dividing the largest).
    base = scaled(load_entry(GEMMA4_FALLBACK).scenario, 8)
    fa, swa = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW
    scenario = _groups_with(base, (fa, 32, None), (fa, 64, None), (swa, 96, 192))
    engine = engine_plan(scenario)["engine"]
    assert engine["layer_types"] == ["full_attention", "sliding_attention", "full_attention"]
    assert engine["kv_heads"] == [6, 2, 3]
    assert (engine["block_size"], engine["draft_kv_heads"]) == (32, 6)
    assert [g["block_size"] for g in engine["groups"]] == [32, 64, 96]
    # Two sliding-window block sizes beside one full-attention one.
    engine = engine_plan(_groups_with(base, (swa, 32, 128), (swa, 64, 128), (fa, 128, None)))[
        "engine"
    ]
    assert (engine["architecture"], engine["kv_heads"]) == ("gemma4", [4, 2, 1])
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
    # EAGLE-3 reads three distinct layers: the three-layer pattern twice.
    assert target["layer_types"] == ["full_attention", "sliding_attention", "full_attention"] * 2
    assert {i: c["num_key_value_heads"] for i, c in target["per_layer_config"].items()} == {
        "0": 1,
        "1": 2,
        "2": 2,
        "3": 1,
        "4": 2,
        "5": 2,
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
    assert draft_config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
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
    assert engine["sliding_windows"] == [None, 128, 64]
    assert [(g["spec"], g["sliding_window"]) for g in engine["groups"]] == [
        ("FullAttentionSpec", None),
        ("SlidingWindowSpec", 128),
        ("SlidingWindowSpec", 64),
    ]
    target = json.loads(
        (Path(engine_arguments(plan, tmp_path)["model"]) / "config.json").read_text()
    )
    assert target["architectures"] == ["Plamo3ForCausalLM"]
    # EAGLE-3: the three-layer pattern twice.
    assert target["interleaved_sliding_window"] == [None, 128, 64] * 2
    assert target["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"] * 2


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
    with pytest.raises(EngineUnsupported, match=r"^drafter 'eagle3' beside sliding-window groups"):
        engine_plan(scaled(_groups_with(base, (swa, 4, 16), (swa, 4, 8)), 8))
    no_drafter = dataclasses.replace(
        base,
        drafter=dataclasses.replace(base.drafter, kind=DrafterKind.NONE, num_speculative_tokens=0),
    )
    engine = engine_plan(scaled(_groups_with(no_drafter, (swa, 4, 16), (swa, 4, 8)), 8))["engine"]
    assert (engine["architecture"], engine["sliding_windows"]) == ("plamo3", [128, 64])

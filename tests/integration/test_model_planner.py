"""Model-level scenarios: vLLM's own planner lays out each shipped model
description; the groups, block sizes and hits are those of real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from differential.compare import compare_variants
from differential.corpus import finding_tag, load_entry
from differential.scenario import DraftGroups, GroupKind
from differential.variants import parse_variants
from tests.factories import ROOT, kvfuzz_cli

pytestmark = pytest.mark.vllm

SCENARIOS = ROOT / "models" / "scenarios"
K = GroupKind

LAYOUTS = {
    # name: ((kind, block, window or chunk, draft) per group, scheduler block, hash block)
    "deepseek-v4-flash-dspark": (
        [(K.MLA, 256, None, False)]
        + [(K.SLIDING_WINDOW_MLA, 64, 128, False)] * 3
        + [(K.SLIDING_WINDOW_MLA, 4, 8, False), (K.SLIDING_WINDOW, 8, 128, False)],
        256,
        4,
    ),
    "gemma4-mtp": (
        [(K.SLIDING_WINDOW, 16, 1024, False)] * 5 + [(K.FULL_ATTENTION, 32, None, False)],
        32,
        16,
    ),
    "gpt-oss-20b-eagle3": (
        [(K.SLIDING_WINDOW, 16, 128, False), (K.FULL_ATTENTION, 16, None, True)],
        16,
        16,
    ),
    "llama4-scout": (
        [(K.CHUNKED_LOCAL_ATTENTION, 16, 8192, False)] * 3 + [(K.FULL_ATTENTION, 16, None, False)],
        16,
        16,
    ),
    "qwen3-next-gdn": (
        [(K.MAMBA, 544, None, False)] * 3 + [(K.FULL_ATTENTION, 544, None, False)],
        544,
        544,
    ),
    # The MTP draft layer shares the target's full-attention spec: the
    # planner puts it in that group (13 layers) and marks it.
    "qwen3-next-gdn-mtp": (
        [(K.MAMBA, 544, None, False)] * 3 + [(K.FULL_ATTENTION, 544, None, True)],
        544,
        544,
    ),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_planner_layout(name: str) -> None:
    entry = load_entry(SCENARIOS / f"{name}.json")
    groups, scheduler_block, hash_block = LAYOUTS[name]
    got = [
        (
            g.kind,
            g.block_size_tokens,
            g.sliding_window_tokens or g.attention_chunk_size_tokens,
            g.is_eagle_group,
        )
        for g in entry.scenario.kv_cache_groups
    ]
    assert got == groups
    assert entry.scenario.scheduler_block_size_tokens == scheduler_block
    assert entry.scenario.effective_hash_block_size_tokens == hash_block
    assert f"scheduler block {scheduler_block}, hash block {hash_block}" in entry.plan


def test_deepseek_v4_flash_dspark_replays_through_the_planner() -> None:
    # vLLM issue #51771: an MLA group beside sliding-window-family groups of
    # 64, 4 and 8 tokens, chosen by vLLM's planner from per-layer specs.
    entry = load_entry(SCENARIOS / "deepseek-v4-flash-dspark.json")
    assert entry.scenario.draft_groups is DraftGroups.NONE  # DSpark takes no drop
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed"))
    assert [list(r.run.hits) for r in result.results] == [[0, 2048, 1536, 2048]] * 2
    tags = sorted(finding_tag(f) for f in result.findings if f.owner == "unfixed")
    assert tags == ["fallback@2"]


def test_gpt_oss_draft_layer_is_marked_by_the_planner() -> None:
    entry = load_entry(SCENARIOS / "gpt-oss-20b-eagle3.json")
    assert entry.scenario.draft_groups is DraftGroups.ANNOTATED
    assert entry.scenario.drop_group_indices == frozenset({1})
    assert "13 layer(s) (is_eagle_group)" in entry.plan


def test_gdn_with_an_mtp_draft_layer_replays() -> None:
    # A draft group beside Mamba groups: only the marked full-attention group
    # takes the drop; the hits are those of the unmarked layout.
    entry = load_entry(SCENARIOS / "qwen3-next-gdn-mtp.json")
    assert entry.scenario.draft_groups is DraftGroups.ANNOTATED
    assert entry.scenario.drop_group_indices == frozenset({3})
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed"))
    assert [list(r.run.hits) for r in result.results] == [[0, 3808, 0]] * 2
    assert result.findings == ()


def test_cli_replay_prints_the_plan() -> None:
    proc = kvfuzz_cli("replay", str(SCENARIOS / "gemma4-mtp.json"), cwd=ROOT, timeout=300)
    assert "vLLM's planner laid out model 'gemma4-mtp' in 6 group(s)" in proc.stdout
    assert "group 5: full_attention, block 32 tokens, 10 layer(s)" in proc.stdout
    assert proc.returncode == 1  # stock vLLM: needless drop and fallbacks


def test_expectations_of_every_model_scenario() -> None:
    from differential.corpus import expectation_problems

    for path in sorted(SCENARIOS.glob("*.json")):
        entry = load_entry(path)
        result = compare_variants(entry.scenario, parse_variants("unfixed,fixed"))
        assert not expectation_problems(entry, result), path.name


def test_a_model_scenario_refuses_decode_context_parallelism(tmp_path: Path) -> None:
    data = json.loads((SCENARIOS / "gemma4-mtp.json").read_text())
    data["model"] = str(SCENARIOS.parent / "gemma4-mtp.json")
    data["dcp_world_size"] = 2
    path = tmp_path / "dcp.json"
    path.write_text(json.dumps(data))
    proc = kvfuzz_cli("replay", str(path), cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    assert "dcp_world_size = 2 is invalid: allowed 1 with a model" in proc.stderr


def _kimi_k3_like(block: int) -> dict[str, object]:
    """A Kimi-K3-like model-level scenario (inline description): 20 KDA
    layers (vllm/models/kimi_k3/nvidia/kda.py: MambaSpec of
    MambaStateShapeCalculator.kda_state_shape, 32 heads of 128, conv kernel
    4 plus 3 speculative rows, bf16 conv and fp32 recurrent state), 7 MLA
    layers (576-element latent, bf16) and 2 dense-MLA DSpark draft layers
    (vllm/models/kimi_k3/nvidia/dspark_mla.py)."""
    mla = {"kind": "mla", "num_kv_heads": 1, "head_size": 576, "dtype": "bfloat16"}
    model = {
        "format": "kvfuzz.model",
        "version": 1,
        "name": "kimi-k3-like-dspark",
        "block_size_tokens": block,
        "mamba_block_size_tokens": block,
        "layers": [
            {
                "kind": "mamba",
                "count": 20,
                "mamba_state_shapes": [[6, 12288], [32, 128, 128]],
                "mamba_state_dtypes": ["bfloat16", "float32"],
            },
            {**mla, "count": 7},
            {**mla, "count": 2, "draft": True},
        ],
    }
    return {
        "format": "kvfuzz.scenario",
        "version": 1,
        "model": model,
        "retention_interval_tokens": 4096,
        "drafter": {"kind": "dspark", "num_speculative_tokens": 3},
        "prefill_chunk_tokens": 2048,
        "shared_prefix_tokens": 8192,
        "requests": [
            {"divergence_tokens": 8192, "suffix_tokens": 100},
            {"divergence_tokens": 8192, "suffix_tokens": 100},
            {"divergence_tokens": 5000, "suffix_tokens": 50},
        ],
    }


def test_kimi_k3_like_kda_beside_mla_with_dspark_replays() -> None:
    # vLLM's _align_hybrid_block_size makes an MLA hybrid's block a multiple
    # of 128 covering the KDA state (2244608 bytes / 1152 a token: 2048).
    from differential.driver.planner import resolve_model_scenario

    scenario, plan = resolve_model_scenario(_kimi_k3_like(2048), ROOT)
    got = [(g.kind, g.block_size_tokens, g.is_eagle_group) for g in scenario.kv_cache_groups]
    assert got == [(K.MAMBA, 2048, False)] * 3 + [(K.MLA, 2048, False)]
    assert plan.layers_per_group == (7, 7, 6, 9)  # the draft MLA layers join the target's
    assert (plan.scheduler_block_size_tokens, plan.hash_block_size_tokens) == (2048, 2048)
    assert plan.hit_alignment_tokens == 2048
    result = compare_variants(scenario, parse_variants("unfixed,fixed"))
    assert [list(r.run.hits) for r in result.results] == [[0, 8192, 4096]] * 2
    assert result.findings == ()


def test_a_hybrid_block_too_small_for_its_mamba_state_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "k3.json"
    path.write_text(json.dumps(_kimi_k3_like(1920)))
    proc = kvfuzz_cli("replay", str(path), cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    assert "model.block_size_tokens = 1920 is invalid: allowed at least 1949 tokens" in proc.stderr
    assert "internal error" not in proc.stderr

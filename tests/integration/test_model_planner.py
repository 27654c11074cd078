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

"""Engine mode's plans for chunked local attention and MLA groups
(``differential.driver.engine_mode.engine_plan``), checked without the engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from differential.corpus import load_entry
from differential.driver.engine_mode import EngineUnsupported, engine_plan, geometry_scale, scaled
from differential.scenario import DrafterKind, Scenario
from tests.factories import CORPORA, ROOT

CHUNKED = CORPORA / "cases" / "llama4-chunked-local.json"


def _scaled(path: Path) -> Scenario:
    scenario = load_entry(path).scenario
    return scaled(scenario, geometry_scale(scenario))


def test_chunked_local_attention_is_planned_on_a_tiny_llama4_model() -> None:
    scenario = _scaled(CHUNKED)
    none = dataclasses.replace(scenario.drafter, kind=DrafterKind.NONE, num_speculative_tokens=0)
    plain = dataclasses.replace(scenario, drafter=none)
    engine = engine_plan(plain)["engine"]
    assert engine["architecture"] == "llama4"
    assert engine["layer_types"] == ["full_attention", "chunked_attention"]
    assert engine["attention_chunk_size"] == 128
    assert [g["spec"] for g in engine["groups"]] == [
        "FullAttentionSpec",
        "ChunkedLocalAttentionSpec",
    ]
    assert engine["hash_block_size"] == 32


def test_chunked_local_attention_with_eagle_is_refused_naming_vllms_config() -> None:
    with pytest.raises(EngineUnsupported, match=r"VllmConfig\.__post_init__"):
        engine_plan(_scaled(CHUNKED))


@pytest.mark.parametrize(
    "path",
    [
        CORPORA / "cases" / "mla-single-group.json",
        ROOT / "corpora" / "regressions" / "junction-at-full-attention-hit-swa32-above-fa8.json",
    ],
)
def test_mla_groups_are_refused_naming_the_cpu_platform(path: Path) -> None:
    with pytest.raises(
        EngineUnsupported, match=r"CpuPlatform\.check_and_update_config.*cpu_mla\.py"
    ):
        engine_plan(_scaled(path))

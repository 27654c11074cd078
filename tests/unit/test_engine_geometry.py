"""Engine mode's geometry mapping by default, and ``kvfuzz confirm``'s units:
checked without the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from differential.commands.confirm import _release_words, recorded_in_engine_tokens
from differential.corpus import load_entry
from differential.driver.engine_mode import file_geometry, geometry_scale
from differential.scenario.json_form import parse_engine_block
from tests.factories import CORPORA, ROOT

COLLAPSE = ROOT / "known-issues" / "eviction-collapse-48435-pool130-dense.json"
SEED_CLASS = CORPORA / "cases" / "engine-seed-class-eagle1-swa64-fa32-r256.json"
REGRESSION = CORPORA / "regressions" / "fallback-unfixed-517c289c14.json"


def _with_engine_block(tmp_path: Path, source: Path, block: object) -> Path:
    data = json.loads(source.read_text())
    data["engine"] = block
    path = tmp_path / source.name
    path.write_text(json.dumps(data))
    return path


def test_a_file_without_an_engine_block_is_scaled(tmp_path: Path) -> None:
    # No file carries an engine block: replay --mode engine, confirm and the
    # fidelity benchmark all map it onto the CPU engine's grid.
    assert "engine" not in json.loads(COLLAPSE.read_text())
    assert file_geometry(COLLAPSE) == "scale"
    assert file_geometry(None) == "scale"
    assert file_geometry(_with_engine_block(tmp_path, COLLAPSE, {"hits": [0]})) == "scale"
    assert parse_engine_block({}).geometry == "scale"


def test_a_file_may_pin_the_exact_geometry(tmp_path: Path) -> None:
    assert file_geometry(_with_engine_block(tmp_path, COLLAPSE, {"geometry": "exact"})) == "exact"
    assert file_geometry(_with_engine_block(tmp_path, COLLAPSE, {"geometry": "scale"})) == "scale"
    assert parse_engine_block({"geometry": "exact"}).geometry == "exact"


def test_the_factor_is_the_smallest_that_puts_every_block_on_the_grid() -> None:
    # #48435: blocks of 4 tokens (x8 to 32); the seed class: blocks of 32 (x1);
    # the regression: blocks of 1 and 2 tokens (x32 makes both multiples of 32).
    assert geometry_scale(load_entry(COLLAPSE).scenario) == 8
    assert geometry_scale(load_entry(SEED_CLASS).scenario) == 1
    assert sorted(
        {g.block_size_tokens for g in load_entry(REGRESSION).scenario.kv_cache_groups}
    ) == [1, 2]
    assert geometry_scale(load_entry(REGRESSION).scenario) == 32


def test_recorded_tokens_are_mapped_into_the_engines_units() -> None:
    # The regression's finding block: fallback@1, checkpoint 6 expected, hit 4
    # (the file's tokens); its expect block: unfixed hits [0, 4]. Scaled x32
    # the engine's tokens are 192, 128 and [0, 128].
    entry = load_entry(REGRESSION)
    assert recorded_in_engine_tokens(entry, 32) == {
        "scale": 32,
        "hits": [0, 128],
        "findings": [{"tag": "fallback@1", "expected_tokens": 192, "hit_tokens": 128}],
    }
    assert recorded_in_engine_tokens(entry, 1)["findings"] == [
        {"tag": "fallback@1", "expected_tokens": 6, "hit_tokens": 4}
    ]
    # A file with an expect block only: its hits scale, no tokens per finding.
    collapse = recorded_in_engine_tokens(load_entry(COLLAPSE), 8)
    assert collapse == {"scale": 8, "hits": [0] * 12, "findings": []}


@pytest.mark.parametrize(
    ("confirmed", "disagree", "same_hits", "opening"),
    [
        (True, [], ["manager", "scheduler"], "not a driver artefact"),
        (True, ["scheduler"], [], "driver artefact: the engine shows it"),
        (False, ["manager"], [], "driver artefact: kvfuzz's drivers on release:0.32.0 (manager"),
        # Neither the engine nor the drivers show it, and their hits are the
        # same: the release shows the same hits; no release difference.
        (
            False,
            [],
            ["manager", "scheduler"],
            "not reproduced: the engine's hits equal vLLM 0.32.0's drivers' (manager and "
            "scheduler mode): the release shows the same hits",
        ),
        (False, [], [], "release difference: vLLM 0.32.0 does not have it"),
    ],
)
def test_the_release_verdict_says_release_difference_only_where_the_hits_differ(
    confirmed: bool, disagree: list[str], same_hits: list[str], opening: str
) -> None:
    words = _release_words("0.32.0", {"eviction-collapse@run"}, confirmed, disagree, same_hits)
    assert words.startswith(opening)
    assert ("release difference" in words) == (not confirmed and not disagree and not same_hits)


def test_every_bundled_file_maps_to_the_engines_geometry() -> None:
    # Scaling keeps a scenario valid: every token length scales, a KV
    # connector store's own chunk grid included (connector.chunk_tokens 16
    # beside blocks of 4, scaled by 16: 256 beside 64).
    from differential.driver.engine_mode import mamba_steps, scaled

    files = sorted((*CORPORA.rglob("*.json"), *(ROOT / "known-issues").glob("*.json")))
    for path in files:
        scenario = load_entry(path).scenario
        factor = geometry_scale(scenario) if file_geometry(path) == "scale" else 1
        mamba_steps(scaled(scenario, factor))
    lagging = load_entry(
        ROOT / "known-issues" / "connector-divergent-hit-truncates-lagging-window.json"
    )
    store = lagging.scenario.workload.connector
    assert store is not None and store.chunk_tokens is not None
    factor = geometry_scale(lagging.scenario)
    mapped = scaled(lagging.scenario, factor).workload.connector
    assert mapped is not None and mapped.chunk_tokens == store.chunk_tokens * factor

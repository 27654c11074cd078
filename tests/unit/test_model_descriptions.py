"""Model descriptions (no vLLM): the shipped files load, bad fields are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from differential.errors import ScenarioError
from differential.scenario import GroupKind
from differential.scenario.models import LayerSpec, ModelDescription
from tests.factories import ROOT

MODELS = sorted((ROOT / "models").glob("*.json"))


def test_shipped_descriptions_load() -> None:
    names = {ModelDescription.load(p).name for p in MODELS}
    assert names == {
        "deepseek-v4-flash-dspark",
        "gemma4-mtp",
        "gpt-oss-20b-eagle3",
        "llama4-scout",
        "qwen3-next-gdn",
        "qwen3-next-gdn-mtp",
    }
    gpt_oss = ModelDescription.load(ROOT / "models" / "gpt-oss-20b-eagle3.json")
    assert gpt_oss.num_layers == 25
    assert [layer.draft for layer in gpt_oss.layers] == [False, False, True]
    gdn_mtp = ModelDescription.load(ROOT / "models" / "qwen3-next-gdn-mtp.json")
    assert gdn_mtp.num_layers == 49
    assert [(layer.kind, layer.draft) for layer in gdn_mtp.layers] == [
        (GroupKind.MAMBA, False),
        (GroupKind.FULL_ATTENTION, False),
        (GroupKind.FULL_ATTENTION, True),
    ]


@pytest.mark.parametrize(
    ("layer", "field"),
    [
        ({"kind": "sliding_window"}, "model.layers[0].sliding_window_tokens"),
        (
            {"kind": "full_attention", "sliding_window_tokens": 8},
            "model.layers[0].sliding_window_tokens",
        ),
        ({"kind": "chunked_local_attention"}, "model.layers[0].attention_chunk_size_tokens"),
        ({"kind": "full_attention", "dtype": "int4"}, "model.layers[0].dtype"),
        ({"kind": "full_attention", "count": 0}, "model.layers[0].count"),
        ({"kind": "mamba"}, "model.layers[0].mamba_state_shapes"),
        ({"kind": "attention"}, "model.layers[0].kind"),
        ({"kind": "full_attention", "heads": 8}, "model.layers[0].heads"),
        (
            {
                "kind": "mamba",
                "mamba_state_shapes": [[4]],
                "mamba_state_dtypes": ["bfloat16"],
                "draft": True,
            },
            "model.layers[0].draft",
        ),
    ],
)
def test_bad_layer_fields_are_named(layer: dict[str, object], field: str) -> None:
    with pytest.raises(ScenarioError) as info:
        ModelDescription.from_dict({"name": "m", "layers": [layer]})
    assert info.value.field == field


def test_bad_model_fields_are_named(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError) as info:
        ModelDescription.from_dict({"name": "m", "kv_cache_layout": "NHD", "layers": []})
    assert info.value.field == "model.kv_cache_layout"
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"name": "m", "layers": "none"}))
    with pytest.raises(ScenarioError, match=r"broken\.json"):
        ModelDescription.load(broken)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            '"version": 1, "version": 2',
            "<json> key 'version' = 'given twice in one object' is invalid: "
            "allowed each key at most once per object",
            id="duplicate-key",
        ),
        pytest.param(
            '"version": 1.0', "model.version = 1.0 is invalid: allowed 1", id="version-1.0"
        ),
        pytest.param(
            '"version": true', "model.version = True is invalid: allowed 1", id="version-true"
        ),
    ],
)
def test_duplicate_keys_and_inexact_versions_are_refused(
    tmp_path: Path, text: str, message: str
) -> None:
    shipped = (ROOT / "models" / "gemma4-mtp.json").read_text()
    assert '"version": 1,' in shipped
    path = tmp_path / "m.json"
    path.write_text(shipped.replace('"version": 1', text, 1))
    with pytest.raises(ScenarioError) as info:
        ModelDescription.load(path)
    assert str(info.value) == f"{path}: {message}"


def test_layer_defaults() -> None:
    layer = LayerSpec(GroupKind.MLA, head_size=576)
    layer.validate("layer")
    assert (layer.count, layer.num_kv_heads, layer.tokens_per_state, layer.draft) == (
        1,
        1,
        1,
        False,
    )

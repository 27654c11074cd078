"""The published JSON Schema: equal to ``kvfuzz schema``, valid for every
shipped file, and the source of the allowed values in error messages."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from differential.cli import main
from differential.errors import ScenarioError
from differential.scenario import GroupKind, KVCacheGroup, Scenario
from tests.factories import CORPORA, ROOT, triton

SCHEMA = ROOT / "schema"


def _jsonschema() -> ModuleType:
    try:
        import jsonschema
    except ImportError:
        # make test installs requirements/test.txt and must run this test.
        if os.environ.get("KVFUZZ_REQUIRE_VLLM") == "1":
            pytest.fail("jsonschema is not installed (requirements/test.txt)")
        pytest.skip("jsonschema is not installed (requirements/test.txt)")
    return jsonschema


def _validator(name: str) -> Any:
    jsonschema = _jsonschema()
    schema = json.loads((SCHEMA / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _scenario_files() -> list[Path]:
    return sorted(
        [
            *CORPORA.rglob("*.json"),
            *(ROOT / "known-issues").glob("*.json"),
            *(ROOT / "models" / "scenarios").glob("*.json"),
        ]
    )


@pytest.mark.parametrize(
    ("args", "published"), [([], "scenario.schema.json"), (["--model"], "model.schema.json")]
)
def test_published_schema_is_the_commands_output(
    capsys: pytest.CaptureFixture[str], args: list[str], published: str
) -> None:
    assert main(["schema", *args]) == 0
    out = capsys.readouterr().out
    assert out == (SCHEMA / published).read_text(), f"regenerate with: kvfuzz schema {args}"


def test_every_shipped_file_validates() -> None:
    scenarios = _validator("scenario.schema.json")
    models = _validator("model.schema.json")
    files = _scenario_files()
    assert len(files) > 70 and any(p.parent.name == "scenarios" for p in files)
    for path in files:
        errors = [e.message for e in scenarios.iter_errors(json.loads(path.read_text()))]
        assert errors == [], path
    descriptions = sorted((ROOT / "models").glob("*.json"))
    assert len(descriptions) == 6
    for path in descriptions:
        errors = [e.message for e in models.iter_errors(json.loads(path.read_text()))]
        assert errors == [], path


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"colour": "blue"}, []),
        ({"drafter": {"kind": "medusa", "num_speculative_tokens": 3}}, ["drafter", "kind"]),
        ({"prefill_chunk_tokens": 0}, ["prefill_chunk_tokens"]),
        ({"kv_connector": "yes"}, ["kv_connector"]),
        ({"requests": []}, ["requests"]),
        # A path beside kv_cache_groups (an inline description may be there).
        ({"model": "../models/llama4-scout.json"}, ["model"]),
        ({"expect": {"hits": {"fixed": ["8"]}}}, ["expect", "hits", "fixed", 0]),
    ],
)
def test_schema_refuses_what_kvfuzz_refuses(change: dict[str, Any], path: list[object]) -> None:
    data = {**triton().to_dict(), **change}
    errors = list(_validator("scenario.schema.json").iter_errors(data))
    assert len(errors) == 1, [e.message for e in errors]
    error = _jsonschema().exceptions.best_match(errors)  # into anyOf branches
    assert list(error.absolute_path) == path, error.message


def test_a_model_level_scenario_needs_no_groups() -> None:
    data = json.loads((ROOT / "models" / "scenarios" / "llama4-scout.json").read_text())
    validator = _validator("scenario.schema.json")
    assert "kv_cache_groups" not in data and validator.is_valid(data)
    del data["model"]
    assert not validator.is_valid(data)  # neither groups nor a model


def test_every_length_field_documents_its_unit() -> None:
    schema = json.loads((SCHEMA / "scenario.schema.json").read_text())
    models = json.loads((SCHEMA / "model.schema.json").read_text())
    described = 0
    for node in [schema, models, *schema["$defs"].values(), *models["$defs"].values()]:
        for name, prop in node.get("properties", {}).items():
            assert prop.get("description"), name
            if name.endswith("_tokens"):
                assert "tokens" in prop["description"], name
                described += 1
    assert described >= 15


def _error(build: Any) -> ScenarioError:
    with pytest.raises(ScenarioError) as info:
        build()
    return info.value


def test_errors_name_the_path_and_the_schemas_allowed_values() -> None:
    data = triton().to_dict()
    group = data["kv_cache_groups"][0]
    misspelt = {**data, "kv_cache_groups": [{"kind": group["kind"], "block_size": 16}]}
    error = _error(lambda: Scenario.from_dict(misspelt))
    # The unknown key is named, not the missing block_size_tokens it stands for.
    assert error.field == "kv_cache_groups[0].block_size"
    assert error.allowed == (
        "no such field; known fields: attention_chunk_size_tokens, block_size_tokens, "
        "bounded_replay, is_eagle_group, kind, sink_len_tokens, sliding_window_tokens"
    )
    error = _error(lambda: Scenario.from_dict({**data, "hash_block_size_tokens": "8"}))
    assert (error.field, error.value, error.allowed) == (
        "hash_block_size_tokens",
        "8",
        "null or an integer 1..16777216",
    )
    error = _error(lambda: Scenario.from_dict({**data, "mamba_prefill": "step"}))
    assert error.allowed == "one of 'scheduler', 'block', 'checkpoint'"
    error = _error(lambda: Scenario.from_dict({**data, "workload": {"accepted_drafts": [-1]}}))
    assert (error.field, error.allowed) == ("workload.accepted_drafts[0]", "an integer >= 0")
    error = _error(lambda: Scenario.from_dict({**data, "version": 2}))
    assert (error.field, error.allowed) == ("version", "1")
    assert str(_error(lambda: Scenario.from_dict([]))) == (
        "scenario = [] is invalid: allowed a JSON object"
    )


def test_a_scenario_built_in_python_is_checked_field_by_field() -> None:
    scenario = triton()
    error = _error(lambda: dataclasses.replace(scenario, decode_steps=True))
    assert (error.field, error.allowed) == ("decode_steps", "an integer >= 0")
    as_text = KVCacheGroup("full_attention", 16)  # type: ignore[arg-type]
    error = _error(lambda: dataclasses.replace(scenario, kv_cache_groups=(as_text,)))
    assert error.field == "kv_cache_groups[0].kind"
    assert error.allowed.startswith("a GroupKind member, one of 'full_attention', ")
    as_list = [KVCacheGroup(GroupKind.FULL_ATTENTION, 16)]
    error = _error(lambda: dataclasses.replace(scenario, kv_cache_groups=as_list))
    assert (error.field, error.allowed) == ("kv_cache_groups", "a non-empty tuple")


@pytest.mark.vllm  # the planner resolves the groups
def test_a_resolved_model_scenario_keeps_its_inline_model_beside_the_groups() -> None:
    from differential.corpus import load_entry

    entry = load_entry(ROOT / "corpora" / "cases" / "mimo-v2-unequal-pages.json")
    data = entry.scenario.to_dict()
    assert data["kv_cache_groups"] and data["model"]["name"] == "mimo-v2-unequal-pages"
    assert _validator("scenario.schema.json").is_valid(data)

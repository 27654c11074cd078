"""A finding file's ``finding`` block and its ``engine`` block: checked on
loading by the models that write and publish them.

Every command loads files through ``differential.corpus.load_entry``, so a
block the model refuses is exit 2 naming the field path and the allowed
values, in ``replay`` and ``confirm`` alike, before any work starts (for
``confirm``: before the engine is even looked for).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from differential.corpus import load_entry
from differential.errors import ScenarioError
from differential.findings import FindingKind
from differential.scenario.finding_form import finding_record
from tests.factories import CORPORA, ROOT

# Two requests; its one finding is fallback@1 on unfixed.
SHRUNK = CORPORA / "regressions" / "fallback-unfixed-517c289c14.json"
# Three requests, a root cause and a shrink record.
ROOT_CAUSE = CORPORA / "regressions" / "junction-at-full-attention-hit-swa32-above-fa8.json"

KINDS = ", ".join(repr(kind.value) for kind in FindingKind)


def _changed(tmp: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    data = json.loads(SHRUNK.read_text())
    change(data)
    path = tmp / "finding.json"
    path.write_text(json.dumps(data))
    return path


def _set(*path: str | int, value: object) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        node: Any = data
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value

    return change


def _drop(*path: str) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        node: Any = data
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]

    return change


# (change to the file, the field the error names, the value, what is allowed)
REFUSED = [
    pytest.param(
        _set("finding", "findings", 0, "kind", value=5),
        "finding.findings[0].kind",
        5,
        f"one of {KINDS}",
        id="finding-kind-5",
    ),
    pytest.param(
        _set("finding", "bogus", value=1),
        "finding.bogus",
        1,
        "no such field; known fields: example, findings, format, policy, root_cause, seed, "
        "shrink, signature, signature_fields, version, vllm_version, vllm_versions",
        id="finding-unknown-field",
    ),
    pytest.param(
        _set("finding", "findings", 0, "request", value=99),
        "finding.findings[0].request",
        99,
        "null or a request index 0..1 (the scenario has 2 requests)",
        id="finding-request-99",
    ),
    pytest.param(
        _set("finding", "signature_fields", "kind", value="fallbak"),
        "finding.signature_fields.kind",
        "fallbak",
        f"one of {KINDS}",
        id="signature-kind-misspelt",
    ),
    pytest.param(
        _drop("finding", "signature"),
        "finding.signature",
        None,
        "a value (the field is required)",
        id="finding-without-signature",
    ),
    pytest.param(
        _set("finding", "format", value="kvfuzz.scenario"),
        "finding.format",
        "kvfuzz.scenario",
        "'kvfuzz.finding'",
        id="finding-format",
    ),
    pytest.param(_set("finding", value="x"), "finding", "x", "a JSON object", id="finding-string"),
    pytest.param(_set("engine", value="yes"), "engine", "yes", "a JSON object", id="engine-yes"),
    pytest.param(
        _set("engine", value={"geometry": "stretch"}),
        "engine.geometry",
        "stretch",
        "one of 'exact', 'scale'",
        id="engine-geometry",
    ),
]


@pytest.mark.parametrize(("change", "field", "value", "allowed"), REFUSED)
def test_the_loader_refuses_a_malformed_block_naming_the_field(
    tmp_path: Path,
    change: Callable[[dict[str, Any]], None],
    field: str,
    value: object,
    allowed: str,
) -> None:
    path = _changed(tmp_path, change)
    with pytest.raises(ScenarioError) as info:
        load_entry(path)
    error = info.value
    assert (error.field, error.value, error.allowed, error.source) == (
        field,
        value,
        allowed,
        str(path),
    )


def test_the_published_schema_refuses_them_too(tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "schema" / "scenario.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(json.loads(SHRUNK.read_text()))
    for case in REFUSED:
        change, field = case.values[0], case.values[1]
        if field.endswith(".request"):
            continue  # against the scenario's requests: the loader's check alone
        data = json.loads(SHRUNK.read_text())
        change(data)
        assert not validator.is_valid(data), case.id


@pytest.mark.parametrize("path", [SHRUNK, ROOT_CAUSE], ids=lambda p: p.name)
def test_the_model_that_reads_a_finding_block_writes_it_unchanged(path: Path) -> None:
    data = json.loads(path.read_text())
    block = data["finding"]
    written = finding_record(copy.deepcopy(block))
    assert json.dumps(written, indent=2) == json.dumps(block, indent=2)
    entry = load_entry(path)
    assert entry.finding is not None
    assert entry.signature == block["signature"]
    assert [f.request for f in entry.finding.findings] == [f["request"] for f in block["findings"]]


@pytest.mark.parametrize("command", [["replay"], ["confirm", "--no-release"]])
@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            _set("finding", "findings", 0, "kind", value=5),
            "finding.json: finding.findings[0].kind = 5 is invalid: allowed one of",
        ),
        (
            _set("finding", "findings", 0, "request", value=99),
            "finding.json: finding.findings[0].request = 99 is invalid: allowed null or a "
            "request index 0..1 (the scenario has 2 requests)",
        ),
        (_set("engine", value="yes"), "finding.json: engine = 'yes' is invalid"),
    ],
    ids=["kind-5", "request-99", "engine-yes"],
)
def test_every_command_refuses_a_malformed_block_before_work(
    tmp_path: Path, command: list[str], change: Callable[[dict[str, Any]], None], named: str
) -> None:
    path = _changed(tmp_path, change)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        # confirm checks its files before it looks for the engine: none here.
        "KVFUZZ_ENGINE_VENV": str(tmp_path / "no-engine"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "differential.cli", *command, str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("kvfuzz: error: ") and named in lines[0]

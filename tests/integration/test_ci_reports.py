"""JUnit XML, SARIF and GitHub annotations from ``kvfuzz replay``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from junitparser import Failure, JUnitXml

from tests.factories import CORPORA, ROOT, kvfuzz_cli

pytestmark = pytest.mark.vllm

TRITON = CORPORA / "seeds" / "triton-mtp3-swa16-fa32-r8192.json"
DENSE = CORPORA / "seeds" / "dense-retention-mtp3-swa16-fa32.json"


def test_junit_sarif_and_annotations(tmp_path: Path) -> None:
    junit, sarif = tmp_path / "junit.xml", tmp_path / "kvfuzz.sarif"
    proc = kvfuzz_cli(
        "replay",
        str(TRITON),
        str(DENSE),
        "--junit-xml",
        str(junit),
        "--sarif",
        str(sarif),
        "--github-annotations",
        cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stderr
    xml = JUnitXml.fromfile(str(junit))
    cases = [(suite.name, case.name, case.result) for suite in xml for case in suite]
    assert len(cases) == 4  # 2 scenarios x 2 variants
    failed = [(s, n, r) for s, n, r in cases if any(isinstance(x, Failure) for x in r)]
    assert [(Path(s).name, n) for s, n, _ in failed] == [(TRITON.name, "unfixed (policy vllm)")]
    (failure,) = failed[0][2]
    assert failure.type == "fallback"
    assert "request 1: expected checkpoint 16352, hit 8192" in failure.message
    log = json.loads(sarif.read_text())
    assert log["version"] == "2.1.0"
    (result,) = log["runs"][0]["results"]
    assert result["ruleId"] == "fallback" and result["level"] == "error"
    assert result["properties"]["fallback_checkpoint_tokens"] == 8192
    assert "::error file=" in proc.stdout and "title=kvfuzz fallback::" in proc.stdout

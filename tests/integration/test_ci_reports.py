"""JUnit XML, SARIF and GitHub annotations from ``kvfuzz replay``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from junitparser import Failure, JUnitXml, Skipped

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


LOOKAHEAD = CORPORA / "seeds" / "lookahead-hashes-mtp3-swa16-fa32-r8192.json"


@pytest.mark.parametrize("as_failures", [False, True])
def test_known_issues_are_skips_and_notes_unless_asked(tmp_path: Path, as_failures: bool) -> None:
    # The lookahead-hashes seed's fallback (on both variants) is the known
    # vLLM issue unit-below-retained-boundary-falls-back: not a failure that
    # never goes away, unless --known-as-failures.
    junit, sarif = tmp_path / "junit.xml", tmp_path / "kvfuzz.sarif"
    proc = kvfuzz_cli(
        "replay",
        str(TRITON),
        str(LOOKAHEAD),
        "--junit-xml",
        str(junit),
        "--sarif",
        str(sarif),
        "--github-annotations",
        *(["--known-as-failures"] if as_failures else []),
        cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stderr  # the exit code is the same either way
    xml = JUnitXml.fromfile(str(junit))
    outcome = {
        (Path(suite.name).name, case.name): [type(r).__name__ for r in case.result]
        for suite in xml
        for case in suite
    }
    known = ["Failure"] if as_failures else ["Skipped"]
    assert outcome == {
        (TRITON.name, "unfixed (policy vllm)"): ["Failure"],
        (TRITON.name, "fixed (policy vllm)"): [],
        (LOOKAHEAD.name, "unfixed (policy vllm)"): known,
        (LOOKAHEAD.name, "fixed (policy vllm)"): known,
    }
    if not as_failures:
        skipped = [
            r for suite in xml for case in suite for r in case.result if isinstance(r, Skipped)
        ]
        assert all(
            "(known vLLM issue unit-below-retained-boundary-falls-back)" in r.message
            for r in skipped
        )
        assert xml.skipped == 2 and xml.failures == 1
    results = json.loads(sarif.read_text())["runs"][0]["results"]
    levels = [
        (Path(r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]).name, r["level"])
        for r in results
    ]
    note = "error" if as_failures else "note"
    assert levels == [(TRITON.name, "error"), (LOOKAHEAD.name, note), (LOOKAHEAD.name, note)]
    commands = [line.split(" ")[0] for line in proc.stdout.splitlines() if line.startswith("::")]
    assert commands == ["::error", *(["::error"] * 2 if as_failures else ["::notice"] * 2)]

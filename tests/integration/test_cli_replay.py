"""``kvfuzz replay`` end to end, as a subprocess, on real vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.factories import CORPORA, kvfuzz_cli

pytestmark = pytest.mark.vllm

SEEDS = CORPORA / "seeds"


kvfuzz = kvfuzz_cli


def test_replay_triton_prints_the_fallback() -> None:
    proc = kvfuzz("replay", str(SEEDS / "triton-mtp3-swa16-fa32-r8192.json"))
    assert proc.returncode == 1, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("  unfixed")]
    assert rows[1] == ["unfixed", "1", "16384", "16352", "8192", "16352", "fallback"]
    assert "expected checkpoint 16352, hit 8192: fell back to checkpoint 8192" in proc.stdout


def test_replay_json_and_report_file(tmp_path: Path) -> None:
    report = tmp_path / "out" / "report.json"
    proc = kvfuzz(
        "replay",
        str(SEEDS / "triton-mtp3-swa16-fa32-r8192.json"),
        "--json",
        "--report",
        str(report),
    )
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert json.loads(report.read_text()) == data
    assert data["format"] == "kvfuzz.replay" and data["vllm_version"] == "0.33.0"
    (scenario,) = data["scenarios"]
    unfixed, fixed = scenario["variants"]
    assert unfixed["hits"] == [0, 8192, 16352, 16352]
    assert fixed["hits"] == [0, 16352, 16352, 16352]
    assert unfixed["siblings"][1]["verdict"] == ["fallback"]
    assert [s["verdict"] for s in fixed["siblings"]] == [["ok"]] * 4
    assert data["summary"]["findings_by_kind"] == {"fallback": 1}


def test_clean_variants_exit_zero() -> None:
    proc = kvfuzz("replay", str(SEEDS / "dense-retention-mtp3-swa16-fa32.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no findings" in proc.stdout
    candidate_only = kvfuzz("replay", str(SEEDS), "--variants", "candidate")
    assert candidate_only.returncode == 0, candidate_only.stdout


def test_policies_judge_the_lookahead_seed() -> None:
    seed = str(SEEDS / "lookahead-hashes-mtp3-swa16-fa32-r8192.json")
    one_unit = kvfuzz("replay", seed, "--variants", "fixed")
    assert one_unit.returncode == 1
    assert "fallback on fixed, request 1: expected checkpoint 16352, hit 8192" in one_unit.stdout
    assert "[known vLLM issue: unit-below-retained-boundary-falls-back]" in one_unit.stdout
    literal = kvfuzz("replay", seed, "--variants", "fixed", "--policy", "retained")
    assert literal.returncode == 0, literal.stdout
    assert "policy retained" in literal.stdout


def test_replay_closes_by_saying_whether_its_findings_were_expected(tmp_path: Path) -> None:
    # make replay's last line: unfixed lacks the fix; the fixed variant's one
    # finding is a labelled known vLLM issue; both recorded in expect blocks.
    known = SEEDS / "lookahead-hashes-mtp3-swa16-fa32-r8192.json"
    proc = kvfuzz("replay", str(SEEDS / "toy-mtp1-swa4-fa8-r64.json"), str(known))
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        "3 finding(s), as expected: each is recorded in its file's expect block (unfixed: 2, "
        "it lacks the fix; fixed: 1, all known vLLM issues the fix does not cover "
        "(unit-below-retained-boundary-falls-back))"
    )
    # Without its expect block the same finding is not called expected.
    bare = json.loads((SEEDS / "toy-mtp1-swa4-fa8-r64.json").read_text())
    del bare["expect"]
    (tmp_path / "toy.json").write_text(json.dumps(bare))
    proc = kvfuzz("replay", str(tmp_path / "toy.json"))
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        "1 finding(s) (unfixed: 1, it lacks the fix); 1 of them recorded in no expect block "
        "that held"
    )

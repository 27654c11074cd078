"""The pytest plugin: the corpus and generated scenarios as test items."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.factories import CORPORA, ROOT, python_module

pytestmark = pytest.mark.vllm


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return python_module("pytest", "-q", "-p", "no:cacheprovider", *args, cwd=tmp_path)


def test_corpus_items_fail_on_stock_vllm_with_the_diagram(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "--kvfuzz-corpus", str(CORPORA / "seeds"))
    assert proc.returncode == 1
    assert "6 failed, 8 passed" in proc.stdout
    assert "triton-mtp3-swa16-fa32-r8192.json::unfixed" in proc.stdout
    assert "expected checkpoint 16352, hit 8192: fell back to checkpoint 8192" in proc.stdout
    assert "unfixed g1 swa16" in proc.stdout  # the explain diagram


def test_corpus_and_fuzz_items_pass_on_candidate(tmp_path: Path) -> None:
    # corpora/ replays clean on the candidate fix (known-issues/ holds what it
    # does not fix); the seed PR's fix alone leaves the seed class where the
    # drafter's own group is marked (corpora/cases/*draft-group*).
    proc = _pytest(
        tmp_path,
        "--kvfuzz-corpus",
        str(CORPORA),
        "--kvfuzz-variants",
        "candidate",
        "--kvfuzz-fuzz",
        "10",
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    files = len(list(CORPORA.rglob("*.json")))
    assert f"{files + 10} passed" in proc.stdout


def test_bad_corpus_path_is_a_usage_error(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "--kvfuzz-corpus", str(tmp_path / "missing"))
    assert proc.returncode == 4
    assert "kvfuzz:" in proc.stderr and "missing" in proc.stderr


def test_scheduler_mode_items_show_the_timeline(tmp_path: Path) -> None:
    proc = _pytest(
        tmp_path,
        "--kvfuzz-corpus",
        str(CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json"),
        "--kvfuzz-corpus",
        str(ROOT / "known-issues" / "eviction-collapse-48435-pool130-dense.json"),
        "--kvfuzz-mode",
        "scheduler",
    )
    # The toy seed's fallback fails the item; #48435's collapse is a known issue.
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "1 failed, 1 passed" in proc.stdout
    assert "expected checkpoint 248, hit 192" in proc.stdout
    assert "step 5: arrive req-1; admit req-1 (hit 192)" in proc.stdout

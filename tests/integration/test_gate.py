"""``kvfuzz gate`` on a git repository holding vLLM 0.33.0's package: a
one-line breakage is new on the head (exit 1), the seed PR's fix resolves the
seed-class fallbacks (exit 0), a comment changes nothing (exit 0)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.factories import CORPORA, ROOT, kvfuzz_cli
from tests.trees import (
    COMMENT_ONLY,
    HANGING_IMPORT,
    INSTALLED,
    SEED_FIX,
    SHORT_WINDOW_RUN,
    commit_edits,
)

pytestmark = pytest.mark.vllm

TRITON = CORPORA / "seeds" / "triton-mtp3-swa16-fa32-r8192.json"
TOY = CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM 0.33.0's package (a farm of links to the installed files) committed
    on ``main``, with four branches: ``breakage``, ``seed-fix``, ``comment``
    and ``hang`` (its vLLM hangs on import)."""
    root = tmp_path_factory.mktemp("gate") / "vllm-repo"
    root.mkdir()
    subprocess.run(["cp", "-rs", str(INSTALLED), str(root / "vllm")], check=True)
    (root / ".gitignore").write_text("__pycache__/\n*.so\n.kvfuzz-worktrees/\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "vLLM 0.33.0"], check=True)
    commit_edits(root, "breakage", SHORT_WINDOW_RUN)
    commit_edits(root, "seed-fix", SEED_FIX)
    commit_edits(root, "comment", COMMENT_ONLY)
    commit_edits(root, "hang", HANGING_IMPORT)
    return root


def gate(repo: Path, out: Path, *args: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    """``kvfuzz gate`` run inside ``repo`` (as a maintainer runs it), on two seeds."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_vars)
    return kvfuzz_cli(
        "gate", *args, "--corpus", str(TOY), str(TRITON), "--seconds", "0", "--out", str(out),
        cwd=repo, env=env,
    )  # fmt: skip


def test_a_one_line_breakage_is_new_on_the_head(repo: Path, tmp_path: Path) -> None:
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "breakage"], check=True)
    try:
        sarif = tmp_path / "gate.sarif"
        proc = gate(repo, tmp_path / "out", "--sarif", str(sarif))
    finally:
        subprocess.run(["git", "-C", str(repo), "checkout", "-q", "main"], check=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"kvfuzz gate: head the working tree of {repo} (HEAD ")
    assert lines[1].startswith("  against base ") and "(the merge base with main)" in lines[1]
    assert "new on the head: 6 in 2 scenario(s)" in lines
    assert "  [6 in 2 scenario(s)] wrong-kv" in lines
    assert (
        "      e.g. corpora/seeds/toy-mtp1-swa4-fa8-r64.json request 1: group 1 block index 44 "
        "is the null block, inside the tokens 176..192 attention reads" in lines
    )
    reproducer = tmp_path / "out" / "new" / "01-wrong-kv.json"
    assert f"      reproducer: {reproducer}" in lines
    assert f"      run: kvfuzz export-test {reproducer} --variants tree:{repo}" in lines
    assert lines[-1] == "verdict: the head introduces 6 finding(s) in 2 scenario(s) (exit 1)"
    written = json.loads(reproducer.read_text())
    assert written["expect"]["findings"]["head"] == [
        "fallback@1",
        "wrong-kv@1",
        "wrong-kv@2",
        "wrong-kv@3",
    ]
    assert written["expect"]["findings"]["base"] == ["fallback@1"]
    assert (tmp_path / "out" / "report.txt").read_text() == proc.stdout
    assert json.loads((tmp_path / "out" / "report.json").read_text())["introduces"] is True
    levels = [
        (r["ruleId"], r["level"]) for r in json.loads(sarif.read_text())["runs"][0]["results"]
    ]
    # The head's findings: the new ones errors, the fallback the base has too a note.
    assert sorted(set(levels)) == [("fallback", "note"), ("wrong-kv", "error")]
    assert "[1/2] corpora/seeds/toy-mtp1-swa4-fa8-r64.json" in proc.stderr


def test_the_seed_fix_resolves_the_seed_fallbacks(repo: Path, tmp_path: Path) -> None:
    proc = gate(repo, tmp_path / "out", "--head", "seed-fix", "--base", "main")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("kvfuzz gate: head ") and lines[0].endswith(" (--head seed-fix)")
    assert lines[1].endswith(" (--base main)")
    assert "new on the head" not in proc.stdout
    assert "resolved on the head: 2 in 2 scenario(s)" in lines
    assert (
        "  [2 in 2 scenario(s)] fallback | shortfall | SlidingWindowManager.find_longest_cache_hit"
        " | missing periodic - 1A" in lines
    )
    assert (
        "      e.g. corpora/seeds/triton-mtp3-swa16-fa32-r8192.json request 1: expected "
        "checkpoint 16352, hit 8192: fell back to checkpoint 8192" in lines
    )
    assert lines[-1] == (
        "verdict: the head introduces nothing: 2 finding(s) resolved, 2 cost change(s) (exit 0)"
    )
    assert (tmp_path / "out" / "resolved" / "01-fallback.json").is_file()


def test_a_comment_makes_no_difference(repo: Path, tmp_path: Path) -> None:
    stale = tmp_path / "out" / "new" / "01-wrong-kv.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    proc = gate(repo, tmp_path / "out", "--head", "comment")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == (
        "verdict: no difference: the head introduces nothing; 2 finding(s) on both, as on "
        "the base (exit 0)"
    )
    assert not stale.exists()  # an earlier run's reproducer is not this run's


def test_a_head_that_cannot_start_is_named_and_the_report_written(
    repo: Path, tmp_path: Path
) -> None:
    proc = gate(
        repo, tmp_path / "out", "--head", "hang", "--timeout", "1",
        KVFUZZ_TREE_START_TIMEOUT="1",
    )  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
    missed = [line for line in proc.stdout.splitlines() if line.startswith("! ")]
    assert len(missed) == 1 and missed[0].startswith(
        "! head could not start; it would have run 2 scenario(s) (corpora/seeds/toy-mtp1-swa4-"
        "fa8-r64.json, corpora/seeds/triton-mtp3-swa16-fa32-r8192.json): the worker for "
    )
    assert (tmp_path / "out" / "report.txt").read_text() == proc.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["not_started"]["variant"] == "head"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kvfuzz: ")]
    assert len(errors) == 1 and errors[0].startswith("kvfuzz: head could not start, so 2 ")

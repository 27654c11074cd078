"""``kvfuzz gate`` without running vLLM: its usage errors (exit 2 before
anything runs), how it sorts a base/head result into the review, and the
words ``kvfuzz diff`` uses for block counts."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from differential.cli import main
from differential.compare import ScenarioResult, VariantResult
from differential.findings import Finding, FindingKind, Policy
from differential.observation import ManagerSettings, RequestObservation, RunObservation
from differential.reports.diff import blocks_added_text, cost_text
from differential.reports.gate import GateReport, Reproducer, Section, gate_items
from differential.variants import parse_variants
from fuzz.diff import run_diff
from fuzz.gate import gate_trees
from tests.factories import triton

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]


def _repo(path: Path, branch: str = "main") -> Path:
    (path / "vllm").mkdir(parents=True)
    (path / "vllm" / "__init__.py").write_text("")
    subprocess.run([*GIT, "-C", str(path), "init", "-q", "-b", branch], check=True)
    subprocess.run([*GIT, "-C", str(path), "add", "."], check=True)
    subprocess.run([*GIT, "-C", str(path), "commit", "-qm", "one"], check=True)
    return path


def _commit(repo: Path, branch: str) -> str:
    subprocess.run([*GIT, "-C", str(repo), "checkout", "-q", "-b", branch], check=True)
    (repo / "vllm" / "x.py").write_text("x = 1\n")
    subprocess.run([*GIT, "-C", str(repo), "add", "."], check=True)
    subprocess.run([*GIT, "-C", str(repo), "commit", "-qm", branch], check=True)
    done = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip()


def _first(repo: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "rev-list", "--max-parents=0", "HEAD"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


def test_bad_input_exits_2_naming_the_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "plain").mkdir()
    assert main(["gate", str(tmp_path / "plain"), "--seconds", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvfuzz: error: PATH = '{tmp_path / 'plain'}' is invalid: allowed ")
    assert "(git rev-parse finds no repository there)" in err
    no_vllm = tmp_path / "no-vllm"
    no_vllm.mkdir()
    subprocess.run([*GIT, "-C", str(no_vllm), "init", "-q"], check=True)
    assert main(["gate", str(no_vllm), "--seconds", "0"]) == 2
    assert "allowed a vLLM git checkout (no vllm/__init__.py there)" in capsys.readouterr().err
    repo = _repo(tmp_path / "repo")
    assert main(["gate", str(repo), "--base", "nonesuch", "--seconds", "0"]) == 2
    assert "--base = 'nonesuch' is invalid: allowed a ref of " in capsys.readouterr().err
    assert main(["gate", str(repo), "--head", "nonesuch", "--seconds", "0"]) == 2
    assert "--head = 'nonesuch' is invalid" in capsys.readouterr().err
    assert main(["gate", str(repo / "vllm"), "--seconds", "0"]) == 2
    assert f"allowed the top folder of a vLLM git checkout ({repo}," in capsys.readouterr().err
    trunk = _repo(tmp_path / "trunk", branch="trunk")
    assert main(["gate", str(trunk), "--seconds", "0"]) == 2
    assert "--base is needed: the repository has none of origin/HEAD, main, master" in (
        capsys.readouterr().err
    )


def test_the_default_base_is_the_merge_base_with_main_then_master(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    first = _first(repo)
    head = _commit(repo, "feature")
    trees = gate_trees(repo)
    assert (trees.base, trees.base_why, trees.head, trees.dirty) == (
        first,
        "the merge base with main",
        head,
        False,
    )
    (repo / "vllm" / "x.py").write_text("x = 2\n")
    dirty = gate_trees(repo, head="feature")
    assert dirty.describe_head() == f"{head[:12]} (--head feature)" and not dirty.dirty
    working = gate_trees(repo)
    assert working.dirty
    assert working.describe_head() == (
        f"the working tree of {repo} (HEAD {head[:12]} + uncommitted changes)"
    )
    assert working.variant_spec("head") == f"tree:{repo}"
    assert working.variant_spec("base") == f"tree:{repo}@{first}"
    old = _repo(tmp_path / "old", branch="master")
    assert gate_trees(old).base_why == "the merge base with master"
    assert gate_trees(repo, base="feature").base_why == "--base feature"


def _run(name: str, hits: tuple[int, ...], kept: tuple[tuple[int, int], ...]) -> RunObservation:
    settings = ManagerSettings(
        use_eagle_block_drop=True,
        num_hash_lookahead_tokens=0,
        num_lookahead_tokens=3,
        num_prefill_lookahead_tokens=1,
        hit_alignment_tokens=32,
    )
    requests = tuple(
        RequestObservation(
            index=i,
            prompt_tokens=16448,
            hit_tokens=hit,
            shared_prefix_boundary_tokens=0,
            per_group_hit_tokens=(hit, hit),
            retained_blocks_per_group=blocks,
        )
        for i, (hit, blocks) in enumerate(zip(hits, kept, strict=True))
    )
    return RunObservation(name, "0.33.0", settings, requests, retention_interval_tokens=8192)


def _result(
    base_findings: tuple[Finding, ...], head_findings: tuple[Finding, ...]
) -> ScenarioResult:
    (unfixed,) = parse_variants("unfixed")
    base = dataclasses.replace(unfixed, name="base")
    head = dataclasses.replace(unfixed, name="head")
    kept = ((514, 132), (258, 70), (3, 5), (3, -2))
    return ScenarioResult(
        triton(),
        "seed.json",
        Policy.VLLM,
        (
            VariantResult(
                base, _run("base", (0, 8192, 16352, 16352), kept), None, (), base_findings
            ),
            VariantResult(
                head,
                _run("head", (0, 8192, 16384, 16352), (*kept[:3], (3, 2))),
                None,
                (),
                head_findings,
            ),
        ),
    )


def test_a_result_sorts_into_new_resolved_both_hits_and_cost() -> None:
    def finding(variant: str, kind: FindingKind, request: int, known: str | None = None) -> Finding:
        return Finding(kind, variant, request, f"{kind.value} {request}", known_issue=known)

    known = "unit-below-retained-boundary-falls-back"
    result = _result(
        (finding("base", FindingKind.FALLBACK, 1, known), finding("base", FindingKind.FALLBACK, 3)),
        (finding("head", FindingKind.FALLBACK, 1, known), finding("head", FindingKind.WRONG_KV, 2)),
    )
    items = gate_items(result, "seed.json")
    assert [(i.section, i.request, i.side) for i in items] == [
        (Section.BOTH, 1, "head"),
        (Section.NEW, 2, "head"),
        (Section.RESOLVED, 3, "base"),
        (Section.COST, 3, "head"),
    ]
    # Request 2's hit differs, but the head has a finding there: it is new,
    # not a hit change. Request 3: the same hit, 4 more blocks on the head.
    cost = items[3]
    assert cost.extra_blocks == 4
    assert cost.detail == (
        "same hit 16352 tokens; drafter mtp, R=8192, 1 SWA group(s); cached by the request: "
        "3 more blocks in group 0, 2 fewer in group 1 on the base; 3 more blocks in group 0, "
        "2 more in group 1 on the head"
    )
    assert items[0].detail == f"fallback 1 [known vLLM issue: {known}]"
    report = GateReport("c0ffee (--base main)", "the working tree", {}, 1, 0, 0.0, 1, tuple(items))
    assert report.introduced == [items[1]]
    assert report.verdict() == "verdict: the head introduces 1 finding(s) in 1 scenario(s) (exit 1)"
    report.reproducers[(Section.NEW, items[1].cause)] = Reproducer(
        "out/new/01-wrong-kv.json", "run"
    )
    text = report.render().splitlines()
    assert text[4:9] == [
        "new on the head: 1 in 1 scenario(s)",
        f"  [1 in 1 scenario(s)] {items[1].cause}",
        "      e.g. seed.json request 2: wrong-kv 2",
        "      reproducer: out/new/01-wrong-kv.json",
        "      run: run",
    ]
    assert "  [1 in 1 scenario(s); 4 more blocks kept on the head in all: more on 1 " in (
        "\n".join(text)
    )
    hits_only = gate_items(_result((), ()), "seed.json")
    assert [(i.section, i.cause) for i in hits_only] == [
        (Section.HITS, "hits higher on the head; the oracle accepts both"),
        (Section.COST, "drafter mtp"),
    ]
    clean = GateReport("b", "h", {}, 1, 0, 0.0, 1, (items[0],))
    assert clean.verdict() == (
        "verdict: no difference: the head introduces nothing; 1 finding(s) on both, as on the "
        "base (exit 0)"
    )


def test_block_counts_in_words() -> None:
    assert blocks_added_text([2, -2]) == "2 more blocks in group 0, 2 fewer in group 1"
    assert blocks_added_text([0, 3]) == "no change in group 0, 3 more blocks in group 1"
    assert cost_text([2, -3, -1], "unfixed") == (
        "2 fewer blocks kept on unfixed in all: more on 1 sibling(s), fewer on 2"
    )
    assert (
        cost_text([1, -1], "b")
        == "as many blocks kept on b in all: more on 1 sibling(s), fewer on 1"
    )


def test_seconds_0_runs_no_generated_scenario_whatever_max_examples_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b = parse_variants("unfixed,fixed")
    report = run_diff(a, b, [], seconds=0, max_examples=3)
    assert (report.corpus_scenarios, report.generated_scenarios) == (0, 0)
    assert (
        main(["diff", "unfixed", "fixed", "--corpus", "--seconds", "0", "--max-examples", "3"]) == 2
    )
    assert "--corpus with no PATH and --seconds 0 would compare nothing" in capsys.readouterr().err

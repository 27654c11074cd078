"""Tree variants: vLLM source trees in worker processes, compared without a fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from differential.compare import compare_variants
from differential.corpus import finding_tag, load_entry
from differential.errors import InternalError, VariantError
from differential.variants import parse_variants
from differential.variants.tree import (
    _WORKERS,
    WorkerStartFailed,
    resolve_tree,
    run_tree,
    shutdown_workers,
)
from tests.factories import CORPORA, ROOT, kvfuzz_cli, triton
from tests.trees import (
    BANNER,
    BROKEN_MASK,
    HANGING_IMPORT,
    HANGING_LOOKUP,
    INSTALLED,
    RAISING_IMPORT,
    RENAMED_BLOCK_CACHE,
    SEED_FIX,
    SLOW_IMPORT,
    make_tree,
)

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("forked_tree_workers")]

SEEDS = sorted((CORPORA / "seeds").glob("*.json"))


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("trees")
    built = {
        "stock": make_tree(root / "stock"),
        "fixed": make_tree(root / "fixed", SEED_FIX),
        "broken": make_tree(root / "broken", BROKEN_MASK),
        "hang": make_tree(root / "hang", HANGING_LOOKUP),
    }
    yield built
    shutdown_workers()


def test_stock_tree_agrees_with_the_in_process_unfixed_variant(trees) -> None:
    variants = parse_variants(f"unfixed,tree:{trees['stock']}")
    for path in SEEDS:
        result = compare_variants(load_entry(path).scenario, variants, dense_cross_check=False)
        unfixed, tree = result.results
        assert tree.run.vllm_version.startswith("0.33.0")
        assert tree.run.hits == unfixed.run.hits, path.name
        assert result.comparison_findings == (), path.name
        assert [finding_tag(f) for f in tree.findings] == [
            finding_tag(f) for f in unfixed.findings
        ], path.name


def test_fixed_tree_against_stock_tree_blames_stock(trees) -> None:
    variants = parse_variants(f"tree:{trees['stock']},tree:{trees['fixed']}")
    scenario = load_entry(CORPORA / "seeds" / "triton-mtp3-swa16-fa32-r8192.json").scenario
    result = compare_variants(scenario, variants, dense_cross_check=False)
    assert [vr.run.hits for vr in result.results] == [
        (0, 8192, 16352, 16352),
        (0, 16352, 16352, 16352),
    ]
    by_tag = {finding_tag(f): f for f in result.comparison_findings}
    assert sorted(by_tag) == ["cost-change@0", "disagreement@1"]
    assert f"the oracle supports tree:{trees['fixed']} and blames tree:{trees['stock']}" in (
        by_tag["disagreement@1"].detail
    )
    # The writer keeps two SWA blocks more per periodic checkpoint tail.
    assert "difference per periodic checkpoint tail: [0.0, -2.0]" in by_tag["cost-change@0"].detail


def test_broken_and_hanging_trees_give_crash_and_timeout(trees) -> None:
    scenario = triton()
    broken = run_tree("tree:broken", trees["broken"], scenario, timeout_s=30)
    assert broken.error is not None and "broken reachable_block_mask" in broken.error
    hang = run_tree("tree:hang", trees["hang"], scenario, timeout_s=3)
    assert hang.timed_out and "no answer within 3 s" in (hang.error or "")
    variants = parse_variants(f"tree:{trees['broken']},tree:{trees['hang']}", timeout_s=3.0)
    assert [v.timeout_s for v in variants] == [3.0, 3.0]
    result = compare_variants(scenario, variants, dense_cross_check=False)
    kinds = sorted({f.kind.value for f in result.findings})
    assert "crash" in kinds and "timeout" in kinds


def test_missing_feature_is_unsupported_not_a_finding(tmp_path: Path) -> None:
    old = make_tree(
        tmp_path / "old",
        {
            "v1/kv_cache_interface.py": [
                (
                    "    prefix_cache_retention_interval: int | None = None\n",
                    "    retention_interval_renamed: int | None = None\n",
                )
            ]
        },
    )
    variants = parse_variants(f"tree:{old}")
    result = compare_variants(triton(), variants, dense_cross_check=False)
    assert result.findings == ()
    assert result.notices == (
        f"tree:{old}: unsupported: KVCacheConfig.prefix_cache_retention_interval "
        "(vllm/v1/kv_cache_interface.py)",
    )
    shutdown_workers()


def test_tree_paths_and_git_refs(tmp_path: Path) -> None:
    with pytest.raises(VariantError, match=r"no vllm/__init__\.py"):
        resolve_tree(str(tmp_path))
    repo = make_tree(tmp_path / "repo")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "vllm"], check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], check=True)
    worktree = resolve_tree(f"{repo}@HEAD")
    assert worktree == repo / ".kvfuzz-worktrees" / "HEAD"
    assert (worktree / "vllm" / "__init__.py").is_file()

    # A new commit on the branch is used the next time the variant is resolved.
    def head(path: Path) -> str:
        done = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        return done.stdout.strip()

    branch = subprocess.run(
        [*git, "branch", "--show-current"], capture_output=True, text=True, check=True
    ).stdout.strip()
    first = resolve_tree(f"{repo}@{branch}")
    assert head(first) == head(repo)
    (repo / "marker.txt").write_text("second commit\n")
    subprocess.run([*git, "add", "marker.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "second"], check=True)
    again = resolve_tree(f"{repo}@{branch}")
    assert again == first
    assert head(again) == head(repo)
    assert (again / "marker.txt").read_text() == "second commit\n"


def test_driver_failure_in_a_worker_exits_3_with_the_workers_message(tmp_path: Path) -> None:
    broken = make_tree(tmp_path / "renamed", RENAMED_BLOCK_CACHE)
    with pytest.raises(InternalError, match=r"_cache") as caught:
        run_tree("tree:renamed", broken, triton(), timeout_s=60)
    message = str(caught.value)
    assert message.startswith("tree:renamed: kvfuzz internal error (please report): ")
    # The renamed internal is read where the driver first needs it (building
    # the manager's traced class, or the first lookup).
    assert "the driver failed at '" in message and "_cache" in message
    assert "AttributeError: 'BlockHashToBlockMap' object has no attribute '_cache'" in message
    shutdown_workers()
    proc = kvfuzz_cli(
        "replay",
        str(CORPORA / "seeds" / "triton-mtp3-swa16-fa32-r8192.json"),
        "--variants",
        f"tree:{broken}",
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "object has no attribute '_cache'" in proc.stderr
    assert "fallback" not in proc.stdout and "crash" not in proc.stdout


def test_vllm_raising_on_import_shows_its_own_message(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "raising", RAISING_IMPORT)
    with pytest.raises(InternalError) as caught:
        run_tree("tree:raising", tree, triton(), timeout_s=60)
    message = str(caught.value)
    assert "the worker died while importing vLLM" in message
    assert "exited with status 1" in message
    assert "RuntimeError: this vLLM build refuses to import: no libcudart" in message
    proc = kvfuzz_cli(
        "replay",
        str(CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json"),
        "--variants",
        f"tree:{tree}",
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "refuses to import: no libcudart" in proc.stderr


def test_a_banner_on_stdout_does_not_break_the_protocol(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "banner", BANNER)
    run = run_tree("tree:banner", tree, triton(), timeout_s=60)
    assert run.error is None and run.hits == (0, 8192, 16352, 16352)
    assert "Welcome to vLLM! {not json" in "\n".join(_WORKERS["tree:banner"].stderr_tail)
    shutdown_workers()


def test_start_up_timeout_is_adjustable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = make_tree(tmp_path / "hanging-import", HANGING_IMPORT)
    monkeypatch.setenv("KVFUZZ_TREE_START_TIMEOUT", "2")
    # A hung import uses no CPU: it is stopped once a whole limit passes without any.
    limit = (
        r"did not start within \d+ s \(importing vLLM; it used no CPU in its last 2 s; "
        r"KVFUZZ_TREE_START_TIMEOUT = 2 s sets the limit\)"
    )
    with pytest.raises(WorkerStartFailed, match=limit) as caught:
        run_tree("tree:hanging-import", tree, triton(), timeout_s=1)
    assert caught.value.variant == "tree:hanging-import"
    monkeypatch.setenv("KVFUZZ_TREE_START_TIMEOUT", "soon")
    with pytest.raises(VariantError, match=r"KVFUZZ_TREE_START_TIMEOUT = 'soon' is invalid"):
        run_tree("tree:hanging-import-2", tree, triton(), timeout_s=1)


def test_a_worker_killed_mid_run_says_so(trees) -> None:
    scenario = triton()
    name = "tree:hang-killed"
    run_tree(name, trees["stock"], scenario, timeout_s=60)  # started, vLLM imported
    worker = _WORKERS[name]
    worker.tree = trees["hang"]
    worker.stop()  # the next run restarts it on the hanging tree
    worker.start()
    assert worker.process is not None
    pid = worker.process.pid
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    run = run_tree(name, trees["hang"], scenario, timeout_s=60)
    killer.join()
    assert run.error is not None and run.error.startswith(
        "the worker process was killed by SIGKILL"
    )
    assert "None" not in run.error


SCHEDULER_CASES = [
    CORPORA / "cases" / "eviction-collapse-48435-pool130-retention0.json",
    CORPORA / "cases" / "eviction-collapse-48435-pool400-dense.json",
    CORPORA.parent / "known-issues" / "eviction-collapse-48435-pool130-dense.json",
]


@pytest.fixture(scope="module")
def farm(tmp_path_factory: pytest.TempPathFactory):
    """An unmutated symlink farm of the installed vLLM (``cp -rs``)."""
    root = tmp_path_factory.mktemp("farm")
    subprocess.run(["cp", "-rs", str(INSTALLED), str(root / "vllm")], check=True)
    yield root
    shutdown_workers()


def _observed(run):
    """Everything a run observed but the variant's name and version."""
    data = run.to_dict()
    del data["variant"], data["vllm_version"]
    return data


@pytest.mark.parametrize("path", SCHEDULER_CASES, ids=lambda p: p.stem)
def test_an_unmutated_farm_runs_scheduler_scenarios_as_unfixed_does(farm, path: Path) -> None:
    # The tree's worker drives vLLM's Scheduler as the in-process variant
    # does; it used to drive the manager instead, where the pool-130 case's
    # 4 evictions made an `eviction` finding stock did not have.
    result = compare_variants(load_entry(path).scenario, parse_variants(f"unfixed,tree:{farm}"))
    unfixed, tree = result.results
    for attr in ("run", "dense_run", "manager_run", "retention0_run"):
        a, b = getattr(unfixed, attr), getattr(tree, attr)
        assert (a is None) == (b is None), attr
        if a is not None:
            assert _observed(a) == _observed(b), attr
    assert tree.run.mode == "scheduler"
    assert [finding_tag(f) for f in tree.findings] == [finding_tag(f) for f in unfixed.findings]
    assert result.comparison_findings == ()
    if path.stem == "eviction-collapse-48435-pool130-retention0":
        assert tree.run.evicted_blocks == unfixed.run.evicted_blocks == 4
        assert tree.run.hits == (0, 0, 0, 0, 96, 96, 96, 96, 100, 100, 100, 100)
        assert tree.findings == unfixed.findings == ()


def test_a_slow_but_healthy_start_outlasts_a_short_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Importing this vLLM takes two CPU-seconds more than the limit allows
    # in wall time; while the worker keeps using CPU it is given the limit
    # again, so it starts and runs the scenario as stock vLLM does.
    tree = make_tree(tmp_path / "slow-import", SLOW_IMPORT)
    monkeypatch.setenv("KVFUZZ_TREE_START_TIMEOUT", "0.5")
    run = run_tree("tree:slow-import", tree, triton(), timeout_s=0.5)
    assert run.error is None and run.hits == (0, 8192, 16352, 16352)
    shutdown_workers()


def test_a_tree_worker_imports_its_own_tree_inside_another_checkout(tmp_path: Path) -> None:
    # Run from inside a vLLM checkout (as `kvfuzz gate` runs in the pull
    # request's), the worker of another tree must not import the checkout's vllm.
    checkout = make_tree(tmp_path / "checkout", BROKEN_MASK)
    stock = make_tree(tmp_path / "stock")
    proc = kvfuzz_cli(
        "replay",
        str(CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json"),
        "--variants",
        f"tree:{stock}",
        cwd=checkout,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert "broken reachable_block_mask" not in proc.stdout
    assert proc.stdout.splitlines()[-1] == (
        f"1 finding(s) (tree:{stock}: 1, on the tree under test); 1 of them recorded in no "
        "expect block that held"
    )


def test_a_variant_that_cannot_start_leaves_the_others_results_written(
    tmp_path: Path,
) -> None:
    tree = make_tree(tmp_path / "hanging-import", HANGING_IMPORT)
    name = f"tree:{tree}"
    seeds = [
        CORPORA / "seeds" / n
        for n in ("toy-mtp1-swa4-fa8-r64.json", "single-group-swa16-w64-r0.json")
    ]
    env = dict(os.environ, KVFUZZ_TREE_START_TIMEOUT="1")
    report = tmp_path / "replay.json"
    proc = kvfuzz_cli(
        "replay", *map(str, seeds), "--variants", f"unfixed,{name}", "--timeout", "1",
        "--report", str(report), env=env,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr[-2000:]
    data = json.loads(report.read_text())
    # Every scenario ran on unfixed; the tree is named with what it did not run.
    assert [[v["name"] for v in s["variants"]] for s in data["scenarios"]] == [["unfixed"]] * 2
    assert [(m["variant"], m["scenarios"]) for m in data["not_started"]] == [
        (name, [str(p) for p in seeds])
    ]
    assert f"! {name} could not start; it would have run 2 scenario(s) (" in proc.stdout
    error = [line for line in proc.stderr.splitlines() if "could not start, so" in line]
    assert len(error) == 1 and error[0].startswith(f"kvfuzz: {name} could not start, so 2 ")
    stock = make_tree(tmp_path / "stock")  # no vLLM import in the command's own process
    diff = kvfuzz_cli(
        "diff", f"tree:{stock}", name, "--corpus", str(seeds[0]), "--seconds", "0",
        "--timeout", "1", env=env,
    )  # fmt: skip
    assert diff.returncode == 3, diff.stdout + diff.stderr[-2000:]
    first, missed, verdict = diff.stdout.splitlines()[:3]
    assert (
        first == f"kvfuzz diff tree:{stock} -> {name}: 0 corpus scenario(s) + 0 generated (seed 1)"
    )
    assert missed.startswith(
        f"! {name} could not start; it would have run 1 scenario(s) ({seeds[0]}): the worker "
        f"for {tree} did not start within "
    )
    assert missed.endswith(
        "(importing vLLM; it used no CPU in its last 1 s; KVFUZZ_TREE_START_TIMEOUT = 1 s "
        "sets the limit)"
    )
    assert verdict == "no differences"


def test_the_in_process_driver_refuses_a_tree_variant_rather_than_run_stock(trees) -> None:
    # run_variant drives this process's (installed) vLLM; a tree runs only in
    # its worker (differential.compare.run_any).
    from differential.driver import run_variant

    (tree,) = parse_variants(f"tree:{trees['stock']}")
    scenario = load_entry(CORPORA / "cases" / "watermark-admission-pool10.json").scenario
    with pytest.raises(VariantError, match="is a tree: it runs in its worker process"):
        run_variant(scenario, tree)

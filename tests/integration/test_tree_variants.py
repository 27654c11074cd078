"""Tree variants: vLLM source trees in worker processes, compared without a fix."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from differential.compare import compare_variants
from differential.corpus import finding_tag, load_entry
from differential.errors import VariantError
from differential.tree import resolve_tree, run_tree, shutdown_workers
from differential.variants import parse_variants
from tests.factories import CORPORA, triton
from tests.trees import BROKEN_MASK, HANGING_LOOKUP, SEED_FIX, make_tree

pytestmark = pytest.mark.vllm

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
        f"tree:{old}: unsupported: KVCacheConfig.prefix_cache_retention_interval",
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

"""``kvfuzz mutate --vllm-tests`` without vLLM: a real pytest run of a toy tests
folder read back per test (outcomes, timeouts, collection errors, coverage
per test), the selection by coverage, the stand-in model folders, and the
report's split of verdicts (kvfuzz only, tests only, both, neither) on
hand-made outcomes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from differential.errors import VariantError
from differential.mutation.mutants import MODULES, Mutant
from differential.mutation.score import MutantOutcome, MutantStatus, MutationRun, render_markdown
from differential.mutation.vllm_tests import (
    VllmTests,
    VllmTestsBaseline,
    VllmTestsOutcome,
    VllmTestsVerdict,
    check_tests_folder,
    run_pytest,
    write_model_folders,
)

TOY = """\
def double(n):
    if n > 3:
        return 2 * n
    return n + n
"""

TESTS = """\
import pytest

from toy import double


def test_small():
    assert double(2) == 4


@pytest.mark.parametrize("n", [5, 6])
def test_large(n):
    assert double(n) == 2 * n


def test_wrong():
    assert double(1) == 3


@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")


def test_setup_error(broken):
    pass


def test_skipped():
    pytest.skip("not here")


def test_uses_no_toy():
    assert "Qwen/Qwen3-0.6B".split("/")[0] == "Qwen"
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A folder laid out like a vLLM checkout, testing a toy module beside it."""
    root = tmp_path / "checkout"
    core = root / "tests" / "v1" / "core"
    core.mkdir(parents=True)
    for package in (root / "tests", root / "tests" / "v1", core):
        (package / "__init__.py").write_text("")
    (core / "test_toy.py").write_text(TESTS)
    (core / "test_broken.py").write_text("import no_such_module_here\n")
    (root / "toy.py").write_text(TOY)
    return root


def test_a_real_pytest_run_reports_each_test_and_its_coverage(folder: Path, tmp_path: Path) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    hang = "import time\n\n\ndef test_hangs():\n    time.sleep(30)\n"
    (folder / "tests" / "v1" / "core" / "test_slow.py").write_text(hang)
    run = run_pytest(folder, ["tests/v1/core"], cwd=cwd, timeout_s=2, cover=[folder / "toy.py"])
    core = "tests/v1/core/test_toy.py::"
    assert {test: outcome for test, (outcome, _) in run.outcomes.items()} == {
        f"{core}test_small": "passed",
        f"{core}test_large[5]": "passed",
        f"{core}test_large[6]": "passed",
        f"{core}test_wrong": "failed",
        f"{core}test_setup_error": "error",
        "tests/v1/core/test_slow.py::test_hangs": "timeout",
        f"{core}test_skipped": "skipped",
        f"{core}test_uses_no_toy": "passed",
    }
    assert run.outcomes[f"{core}test_wrong"][1] == "assert 2 == 3"
    assert run.outcomes[f"{core}test_setup_error"][1] == "RuntimeError: fixture broke"
    assert run.collect_errors.keys() == {"tests/v1/core/test_broken.py"}
    assert (
        "No module named 'no_such_module_here'"
        in run.collect_errors["tests/v1/core/test_broken.py"]
    )
    # Per test, the toy's lines it executed: 2 is the `if`, 3 the large
    # branch, 4 the small one.
    (lines,) = run.coverage.values()
    assert lines[3] == {f"{core}test_large[5]", f"{core}test_large[6]"}
    assert lines[4] == {f"{core}test_small", f"{core}test_wrong"}
    assert lines[2] == lines[3] | lines[4]


def test_selection_is_by_the_mutated_statement_and_stock_passing_tests(
    folder: Path, tmp_path: Path
) -> None:
    tests = VllmTests.prepare(folder, folder, ["toy.py"], cwd=tmp_path / "cwd", timeout_s=2)
    assert tests.baseline.collected == 7 and tests.baseline.passed == 4
    core = "tests/v1/core/test_toy.py::"
    # `return 2 * n` (line 3): the two large cases. `return n + n` (line 4):
    # test_small only; test_wrong executes it too but fails on stock.
    assert tests.select("toy.py", (3, 3), False) == [f"{core}test_large[5]", f"{core}test_large[6]"]
    assert tests.select("toy.py", (4, 4), False) == [f"{core}test_small"]
    # At import time (a default value, say): every stock-passing test that
    # executes any line of the module; test_uses_no_toy executes none.
    assert tests.select("toy.py", (1, 1), True) == [
        f"{core}test_small",
        f"{core}test_large[5]",
        f"{core}test_large[6]",
    ]
    assert tests.select("other.py", (3, 3), False) == []


def test_a_test_that_fails_on_the_mutant_kills_it(folder: Path, tmp_path: Path) -> None:
    tests = VllmTests.prepare(folder, folder, ["toy.py"], cwd=tmp_path / "cwd", timeout_s=2)
    # A "tree" whose toy.py doubles wrongly above 3 (the mutant): found first
    # on PYTHONPATH, before the checkout.
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "toy.py").write_text(TOY.replace("2 * n", "2 + n"))
    outcome = tests.judge("toy.py", (3, 3), False, tree, tmp_path / "work")
    assert outcome.verdict is VllmTestsVerdict.KILLED
    assert outcome.test == "tests/v1/core/test_toy.py::test_large[5]"
    assert outcome.detail == "failed: assert 7 == (2 * 5)"
    assert outcome.selected == 2
    # Line 4 is not mutated: both selected tests pass there.
    assert tests.judge("toy.py", (4, 4), False, tree, tmp_path / "work").verdict is (
        VllmTestsVerdict.SURVIVED
    )
    none = tests.judge("toy.py", (9, 9), False, tree, tmp_path / "work")
    assert (none.verdict, none.selected) == (VllmTestsVerdict.NOT_RUN, 0)


def test_model_folders_for_every_hub_name_the_tests_mention(folder: Path, tmp_path: Path) -> None:
    assert write_model_folders(folder, tmp_path) == ["Qwen/Qwen3-0.6B"]
    config = json.loads((tmp_path / "Qwen" / "Qwen3-0.6B" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_attention_heads"] == 8
    tokenizer = json.loads((tmp_path / "Qwen" / "Qwen3-0.6B" / "tokenizer.json").read_text())
    assert tokenizer["model"]["vocab"] == {"<unk>": 0, "<s>": 1, "</s>": 2}


def test_a_folder_without_tests_v1_core_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(VariantError, match=r"--vllm-tests .*: no tests/v1/core folder there"):
        check_tests_folder(tmp_path)


def _mutant(module: str, i: int, function: str) -> Mutant:
    return Mutant(module, "core/AddNot", i, 10 + i, function, (10 + i, 10 + i))


def _outcome(
    module: str, i: int, status: MutantStatus, tests: VllmTestsOutcome | None, function: str = "F.g"
) -> MutantOutcome:
    diff = f"--- a\n+++ b\n@@ -1 +1 @@\n-    x = {i}\n+    x = not {i}\n"
    return MutantOutcome(
        _mutant(module, i, function), status, f"why {i}", True, 3, 2.0, diff, tests
    )


def _tests(verdict: VllmTestsVerdict, test: str | None = None) -> VllmTestsOutcome:
    return VllmTestsOutcome(verdict, test, "failed: AssertionError" if test else "", 4, 1.5)


def test_the_report_splits_kills_between_kvfuzz_and_vllms_tests() -> None:
    first, second = MODULES[0].path, MODULES[1].path
    killed, survived = MutantStatus.KILLED, MutantStatus.SURVIVED
    outcomes = (
        # kvfuzz only (a timeout is kvfuzz's kill), tests only, both, neither, not run.
        _outcome(first, 0, killed, _tests(VllmTestsVerdict.SURVIVED)),
        _outcome(first, 1, MutantStatus.TIMED_OUT, _tests(VllmTestsVerdict.NOT_RUN)),
        _outcome(first, 2, survived, _tests(VllmTestsVerdict.KILLED, "tests/v1/core/t.py::test_a")),
        _outcome(
            first, 3, killed, _tests(VllmTestsVerdict.KILLED, "tests/v1/core/t.py::test_b"), "h"
        ),
        _outcome(second, 4, MutantStatus.EQUIVALENT_SUSPECT, _tests(VllmTestsVerdict.SURVIVED)),
        _outcome(second, 5, survived, _tests(VllmTestsVerdict.NOT_RUN)),
    )
    baseline = VllmTestsBaseline("/src/vllm", 10, 8, 30.0, 60.0)
    run = MutationRun(
        vllm_version="0.33.0",
        seed=0,
        generated={first: 50, second: 20},
        outcomes=outcomes,
        scenarios=("s1",),
        elapsed_s=20.0,
        tests_baseline=baseline,
    )
    assert run.score() == pytest.approx(3 / 6)
    assert run.tests_score() == pytest.approx(2 / 6)
    assert run.union_score() == pytest.approx(4 / 6)
    assert run.tests_score(first) == pytest.approx(2 / 4) and run.union_score(second) == 0.0
    text = render_markdown(run)
    assert "## Side by side with vLLM's own tests" in text
    assert "**Selection is by coverage**" in text
    assert "Scores: kvfuzz **50%**, vLLM's tests **33%**, union **67%** (6 mutants)" in text
    assert "10 tests ran on stock, 8 passed" in text
    # sampled, kvfuzz only, tests only, both, neither, tests not run, then the scores.
    # Reached: every mutant by kvfuzz's stock runs; by the tests, those not "not run".
    assert f"| `{first}` | 4 | 2 | 1 | 1 | 0 | 1 | 4 / 3 | 75% | 50% | 100% |" in text
    assert f"| `{second}` | 2 | 0 | 0 | 0 | 2 | 1 | 2 / 1 | 0% | 0% | 0% |" in text
    assert "| all | 6 | 2 | 1 | 1 | 2 | 2 | 6 / 4 | 50% | 33% | 67% |" in text
    assert "| single_type_kv_cache_manager | `F.g` | 3 | 2 | 1 | 0 | 0 | 3 / 2 |" in text
    assert "| single_type_kv_cache_manager | `h` | 1 | 0 | 0 | 1 | 0 |" in text
    kvfuzz_only = text.split("### Killed by kvfuzz only")[1].split("###")[0]
    assert "- `single_type_kv_cache_manager:AddNot:0` (F.g, line 10): `x = not 0`: why 0\n" in (
        kvfuzz_only
    )
    assert "`single_type_kv_cache_manager:AddNot:1` (F.g, line 11): `x = not 1`: why 1 " in (
        kvfuzz_only
    )
    assert "(tests: not run)" in kvfuzz_only and "AddNot:3" not in kvfuzz_only
    tests_only = text.split("### Killed by vLLM's tests only")[1].split("##")[0]
    assert tests_only.strip() == (
        "- `single_type_kv_cache_manager:AddNot:2` (F.g, line 12): `x = not 2`: "
        "`tests/v1/core/t.py::test_a` (failed: AssertionError); kvfuzz: survived"
    )
    data = run.to_dict()
    assert data["vllm_tests"]["passed"] == 8 and data["union_score"] == pytest.approx(4 / 6)
    assert data["mutants"][2]["tests"] == {
        "verdict": "killed",
        "test": "tests/v1/core/t.py::test_a",
        "detail": "failed: AssertionError",
        "selected": 4,
        "elapsed_s": 1.5,
    }


def test_without_vllms_tests_the_report_and_json_are_unchanged() -> None:
    outcome = _outcome(MODULES[0].path, 0, MutantStatus.KILLED, None)
    run = MutationRun("0.33.0", 0, {MODULES[0].path: 3}, (outcome,), ("s1",), 5.0)
    assert "Side by side" not in render_markdown(run)
    data = run.to_dict()
    assert "vllm_tests" not in data and "union_score" not in data
    assert "tests" not in data["mutants"][0]


def test_a_test_that_fails_on_any_tree_is_left_out_not_a_kill(folder: Path, tmp_path: Path) -> None:
    # Executes the large branch on stock and passes there, but fails whenever
    # a tree is on the path: on the mutant's tree and on the unmutated one.
    sensitive = (
        "import sys\n\nfrom toy import double\n\n\n"
        "def test_tree_sensitive():\n"
        "    assert double(5) == 10\n"
        "    assert not any(p.endswith(('tree', 'unmutated-tests-toy')) for p in sys.path)\n"
    )
    (folder / "tests" / "v1" / "core" / "test_sensitive.py").write_text(sensitive)
    tests = VllmTests.prepare(folder, folder, ["toy.py"], cwd=tmp_path / "cwd", timeout_s=2)
    assert "tests/v1/core/test_sensitive.py::test_tree_sensitive" in tests.passed
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "toy.py").write_text(TOY)  # unchanged: nothing to kill
    outcome = tests.judge("toy.py", (3, 3), False, tree, tmp_path / "work")
    assert (outcome.verdict, outcome.selected) == (VllmTestsVerdict.SURVIVED, 2)
    assert tests.baseline.tree_sensitive == (
        "tests/v1/core/test_sensitive.py::test_tree_sensitive",
    )
    assert "tests/v1/core/test_sensitive.py::test_tree_sensitive" not in tests.select(
        "toy.py", (3, 3), False
    )

"""``kvfuzz mutate`` on real vLLM: a cosmic-ray mutant of the sliding-window
lookup is killed, and a mutant that kvfuzz's no-eviction pool makes
equivalent survives as equivalent-suspect; both run as tree variants. An
unmutated tree equals stock on every corpus file and known issue, and a
scenario where a tree differs from stock without any mutation is excluded,
never a kill. With ``--vllm-tests``, a tiny checkout's test kills the mutant
kvfuzz misses, and kvfuzz kills the one no test executes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from differential import forkserver
from differential.corpus import load_entry
from differential.mutation.mutants import MANAGER_MODULES as MODULES
from differential.mutation.mutants import MODULES as ALL_MODULES
from differential.mutation.mutants import Mutant, enumerate_mutants, installed_vllm
from differential.mutation.score import (
    ExcludedScenario,
    MutantStatus,
    MutationRun,
    check_unmutated,
    draw_scenarios,
    judge_stock,
    run_mutation,
)
from differential.scenario import Scenario
from tests.factories import CORPORA, ROOT, alive, kvfuzz_cli, still_alive
from tests.trees import SEED_FIX, SPECULATIVE

# Mutant workers forked from the tests' fork server, as `kvfuzz mutate` forks them.
pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("forked_tree_workers")]

# Identities in vLLM 0.33.0 (module stem:operator:occurrence); each test also
# checks the diff, so a different vLLM fails loudly rather than testing another
# mutant.
KILLED = "single_type_kv_cache_manager:ReplaceBinaryOperator_Mul_Mod:12"
EQUIVALENT = "kv_cache_coordinator:ZeroIterationForLoop:1"
# No drop for Gemma-4 MTP: the writer keeps one full-attention block more and
# two SWA blocks fewer (vLLM 0.33.0).
EXCLUDED_GEMMA = (
    "cost-change@0 on gemma4-mtp3-swa16-fa32-r8192.json: same hit 0; blocks kept per group "
    "[514, 132] on unfixed, [515, 130] on the tree (difference per periodic checkpoint tail: "
    "[-0.5, 1.0])"
)


def _run_mutants(
    mutants: Sequence[Mutant],
    scenarios: Sequence[tuple[str, Scenario]],
    root: Path,
    pool: Mapping[str, Sequence[Mutant]],
    work: Path,
    **kwargs: Any,
) -> MutationRun:
    """``run_mutation`` as every test here calls it: sampling seed 0, the
    generated counts of ``pool``, a 60 s per-scenario timeout."""
    return run_mutation(
        mutants,
        scenarios,
        vllm_root=root,
        work=work,
        seed=0,
        generated={m: len(v) for m, v in pool.items()},
        timeout_s=60.0,
        **kwargs,
    )


def test_a_real_mutant_is_killed_and_an_equivalent_one_survives(tmp_path: Path) -> None:
    root = installed_vllm()
    pool = enumerate_mutants(
        root,
        MODULES[:2],
        operators=["core/ReplaceBinaryOperator_Mul_Mod", "core/ZeroIterationForLoop"],
    )
    by_id = {m.ident: m for mutants in pool.values() for m in mutants}
    mutants = [by_id[KILLED], by_id[EQUIVALENT]]
    assert mutants[0].function == "SlidingWindowManager.find_longest_cache_hit"
    assert mutants[1].function == "KVCacheCoordinator.get_num_blocks_to_allocate"
    seed = CORPORA / "seeds" / "dense-retention-mtp3-swa16-fa32.json"
    scenarios = [(seed.name, load_entry(seed).scenario)]
    run = _run_mutants(mutants, scenarios, root, pool, tmp_path)
    killed, equivalent = run.outcomes
    assert "-                and len(computed_blocks[0]) * block_size % alignment_tokens" in (
        killed.diff
    )
    assert "+        for i, manager in []:" in equivalent.diff
    # The SWA alignment loop drops blocks while the hit is not a multiple of
    # A: with `%` for `*` it drops below the checkpoint; request 1 hits 16128
    # instead of stock's 16352.
    assert killed.status is MutantStatus.KILLED
    assert killed.evidence.startswith(f"disagreement@1 on {seed.name}: hits 16352 on unfixed")
    assert "16128 on mutant" in killed.evidence
    assert killed.scenarios_run == 1
    # get_num_blocks_to_allocate only gates admission against free blocks;
    # kvfuzz's pool never runs short, so skipping it changes nothing observable.
    assert equivalent.status is MutantStatus.EQUIVALENT_SUSPECT
    assert equivalent.reached
    assert run.score() == pytest.approx(0.5)
    assert run.score(MODULES[0].path) == 1.0 and run.score(MODULES[1].path) == 0.0


# find_longest_cache_hit_per_group skipping every group: each group alone
# then reports 0 tokens.
PER_GROUP = "kv_cache_coordinator:ZeroIterationForLoop:20"


def test_a_per_group_lookup_below_the_reconciled_hit_kills_its_mutant(tmp_path: Path) -> None:
    root = installed_vllm()
    pool = enumerate_mutants(root, MODULES[1:2], operators=["core/ZeroIterationForLoop"])
    mutant = next(m for m in pool[MODULES[1].path] if m.ident == PER_GROUP)
    assert mutant.function == "HybridKVCacheCoordinator.find_longest_cache_hit_per_group"
    seed = CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json"
    run = _run_mutants([mutant], [(seed.name, load_entry(seed).scenario)], root, pool, tmp_path)
    (outcome,) = run.outcomes
    assert "+        for spec, group_ids, manager_cls, use_eagle in []:" in outcome.diff
    # Stock's per-group hits on the toy seed are (248, 192), (248, 248) and
    # (248, 248) over reconciled hits 192, 248, 248 (no per-group-hit); the
    # mutant's are all 0.
    assert outcome.status is MutantStatus.KILLED
    assert outcome.evidence == (
        f"new finding(s) per-group-hit@1, per-group-hit@2, per-group-hit@3 on {seed.name}"
    )


# Per-variant runs, told apart by comparing the two trees (vLLM 0.33.0):
# Scheduler.update_from_output caching `num_computed | num_in_flight` tokens
# under async scheduling, two requests in flight; and an external load's
# skipped range from `num_local_computed % num_external` tokens beside a
# KV connector's store (the store's answers unchanged, the blocks kept not);
# the spec-decode pad's room check true only at exactly max_model_len, so a
# preempted request's one-token re-admission runs unpadded and this pool
# evicts other blocks; and a scheduled victim of the priority policy giving
# back `restored << draft_slots` of input budget, so a later request runs a
# step early and another keeps a block it would have lost.
PER_VARIANT = [
    (
        "scheduler:ReplaceBinaryOperator_Sub_BitOr:32",
        "Scheduler.update_from_output",
        "+                        request.num_computed_tokens | request.num_in_flight_tokens,",
        "async-in-flight-decoded-block.json",
        "cost-change@0 on {case}: same hit 0; blocks kept per group [7] on unfixed, [6] on "
        "mutant (difference per periodic checkpoint tail: [1.0])",
    ),
    (
        "single_type_kv_cache_manager:ReplaceBinaryOperator_Add_Mod:3",
        "SingleTypeKVCacheManager.allocate_external_computed_blocks",
        "+            num_local_computed_tokens % num_external_computed_tokens",
        "connector-divergent-hybrid-hit-reconciled--plain-connector.json",
        "cost-change@3 on {case}: same hit 0; blocks kept per group [0, -2] on unfixed, "
        "[1, -3] on mutant (difference per periodic checkpoint tail: [-1.0, 1.0])",
    ),
    (
        "scheduler:ReplaceComparisonOperator_LtE_Eq:11",
        "Scheduler.schedule",
        "+                            + self.num_sampled_tokens_per_step == self.max_model_len",
        "spec-decode-padding-holds-blocks-under-pool-pressure--scheduler.json",
        "cost-change@2 on {case}: same hit 4; blocks kept per group [5, -1] on unfixed, "
        "[5, 0] on mutant (difference per periodic checkpoint tail: [0.0, -1.0])",
    ),
    (
        "scheduler:ReplaceBinaryOperator_Add_LShift:14",
        "Scheduler.schedule",
        "+                            input_budget += restored << draft_slots",
        "priority-preempted-victim-restores-its-draft-slot--scheduler.json",
        "cost-change@4 on {case}: same hit 0; blocks kept per group [0] on unfixed, [1] on "
        "mutant (difference per periodic checkpoint tail: [-1.0])",
    ),
]


@pytest.mark.parametrize(("ident", "function", "line", "case", "evidence"), PER_VARIANT)
def test_a_mutant_is_told_apart_on_a_run_the_oracle_judges_only_per_variant(
    tmp_path: Path, ident: str, function: str, line: str, case: str, evidence: str
) -> None:
    # The oracle judges each such run on its own (concurrency, a store), never
    # one against the other, yet the run is deterministic, so the blocks a
    # sibling keeps are compared.
    assert not load_entry(CORPORA / "cases" / case).scenario.workload.sequential
    _assert_killed_on_case(tmp_path, ident, function, line, case, evidence)


def _assert_killed_on_case(
    tmp_path: Path, ident: str, function: str, line: str, case: str, evidence: str
) -> None:
    """The mutant ``ident`` (of ``function``, its diff holding ``line``) is
    killed on ``corpora/cases/<case>`` with ``evidence`` (``{case}``: the
    file's name)."""
    root = installed_vllm()
    stem, operator, _ = ident.split(":")
    module = next(m for m in ALL_MODULES if m.path.endswith(f"{stem}.py"))
    pool = enumerate_mutants(root, [module], operators=[f"core/{operator}"])
    mutant = next(m for m in pool[module.path] if m.ident == ident)
    assert mutant.function == function
    path = CORPORA / "cases" / case
    run = _run_mutants([mutant], [(path.name, load_entry(path).scenario)], root, pool, tmp_path)
    (outcome,) = run.outcomes
    assert line in outcome.diff
    assert outcome.status is MutantStatus.KILLED
    assert outcome.evidence == evidence.format(case=path.name)


# Mutants a per-variant rule names on a case made for them: the scan of a
# failed load marking every request of the step affected, which fails the
# writer and the bystander beside the reader under the fail policy; and the
# spec-decode pad's room check as `!=`, which pads a one-token admission at
# the model length past it.
NAMED = [
    (
        "scheduler:ReplaceFalseWithTrue:42",
        "Scheduler._update_requests_with_invalid_blocks",
        "+            is_affected = True",
        "connector-fail-policy-errors-only-the-failed-load--scheduler.json",
        "new finding(s) wrong-finish@0, wrong-finish@1 on {case}",
    ),
    (
        "scheduler:ReplaceComparisonOperator_LtE_NotEq:11",
        "Scheduler.schedule",
        "+                            + self.num_sampled_tokens_per_step != self.max_model_len",
        "spec-decode-pad-past-max-model-len--scheduler.json",
        "new finding(s) wrong-kv@1 on {case}",
    ),
]


@pytest.mark.parametrize(("ident", "function", "line", "case", "evidence"), NAMED)
def test_a_mutant_is_killed_by_the_finding_its_case_names(
    tmp_path: Path, ident: str, function: str, line: str, case: str, evidence: str
) -> None:
    _assert_killed_on_case(tmp_path, ident, function, line, case, evidence)


def test_a_planning_mutant_is_told_apart_by_the_plan_of_a_block_outermost_model(
    tmp_path: Path,
) -> None:
    # _approximate_gcd searching from 2 repeats instead of 1: on a full-attention
    # pattern repeated once beside 3 sliding-window layers, 1 and 3 repeats pad
    # 2 layers each at 2 or more, and the tie goes to 3: one sliding-window
    # group of 3 layers where stock plans three of 1. The oracle owes no plan
    # to a block-outermost layout; the plans of the two trees differ.
    root = installed_vllm()
    module = next(m for m in ALL_MODULES if m.path.endswith("kv_cache_planning.py"))
    pool = enumerate_mutants(root, [module], operators=["core/NumberReplacer"])
    mutant = next(m for m in pool[module.path] if m.ident == "kv_cache_planning:NumberReplacer:54")
    assert mutant.function == "_approximate_gcd"
    path = CORPORA / "cases" / "block-outermost-one-repeat-per-group.json"
    run = _run_mutants([mutant], [(path.name, load_entry(path).scenario)], root, pool, tmp_path)
    (outcome,) = run.outcomes
    assert "+    min_d = max( 2, lower_bound if lower_bound is not None else 1)" in outcome.diff
    assert outcome.status is MutantStatus.KILLED
    assert outcome.evidence == (
        f"kv-cache-plan@None on {path.name}: model 'block-outermost-one-repeat-per-group' "
        "planned otherwise for a pool of 77 blocks (unfixed vs mutant): group 1: "
        "UniformTypeKVCacheSpecs block 16 tokens, la"
    )


def test_an_unmutated_tree_equals_stock_on_every_corpus_file_and_known_issue(
    tmp_path: Path,
) -> None:
    # The tree is built as a mutant's is (build_mutant_tree with the stock
    # source) and judged as a mutant is: every finding, the comparison with
    # stock and every raw observation of every run must be equal. Before
    # trees drove the scheduler, the pool-130 eviction case differed here.
    root = installed_vllm()
    scenarios = draw_scenarios([CORPORA, ROOT / "known-issues"], 0, 0)
    assert any("eviction-collapse-48435-pool130-retention0" in n for n, _ in scenarios)
    stock, _ = judge_stock([s for _, s in scenarios], root)
    excluded = check_unmutated(
        scenarios, stock, vllm_root=root, work=tmp_path, modules=[MODULES[0].path], timeout_s=60
    )
    assert excluded == []
    assert not any(tmp_path.iterdir())  # the tree is removed


def test_a_scenario_a_tree_changes_without_a_mutation_is_excluded_not_a_kill(
    tmp_path: Path,
) -> None:
    # Mutants made from a vLLM whose Gemma-4 MTP drafter drops no block (the
    # seed fix's config half): even unmutated, that tree hits more than stock
    # on the Gemma-4 seed, so the seed is kvfuzz's difference, not a mutant's.
    farm = tmp_path / "farm"
    farm.mkdir()
    subprocess.run(["cp", "-rs", str(installed_vllm()), str(farm / "vllm")], check=True)
    target = farm / "vllm" / SPECULATIVE
    text = target.read_text()
    target.unlink()
    for old, new in SEED_FIX[SPECULATIVE]:
        text = text.replace(old, new, 1)
    target.write_text(text)
    root = farm / "vllm"
    pool = enumerate_mutants(root, MODULES[:1], operators=["core/ReplaceBinaryOperator_Mul_Mod"])
    (mutant,) = [m for m in pool[MODULES[0].path] if m.ident == KILLED]
    gemma = CORPORA / "seeds" / "gemma4-mtp3-swa16-fa32-r8192.json"
    dense = CORPORA / "seeds" / "dense-retention-mtp3-swa16-fa32.json"
    scenarios = [(p.name, load_entry(p).scenario) for p in (gemma, dense)]
    seen: list[ExcludedScenario] = []
    run = _run_mutants([mutant], scenarios, root, pool, tmp_path / "work", on_excluded=seen.append)
    (excluded,) = run.excluded
    assert seen == [excluded]
    assert excluded.name == gemma.name and excluded.module == MODULES[0].path
    assert excluded.difference == EXCLUDED_GEMMA
    assert run.scenarios == (gemma.name, dense.name)
    # The mutant ran the dense-retention seed only, and was killed there.
    (outcome,) = run.outcomes
    assert outcome.status is MutantStatus.KILLED and outcome.scenarios_run == 1
    assert outcome.evidence.startswith(f"disagreement@1 on {dense.name}")
    assert run.to_dict()["excluded"] == [excluded.to_dict()]


TINY_CHECKOUT_TEST = """\
from vllm.v1.core.kv_cache_utils import get_group_id, make_block_hash_with_group_id


def test_group_id_round_trips():
    key = make_block_hash_with_group_id(b"\\x01" * 32, 7)
    assert len(key) == 36
    assert get_group_id(key) == 7


def test_fails_on_stock():
    assert len(make_block_hash_with_group_id(b"\\x01" * 32, 7)) == 35


def test_unrelated():
    assert 1 + 1 == 2
"""


def test_vllms_tests_kill_what_kvfuzz_misses_and_miss_what_kvfuzz_kills(tmp_path: Path) -> None:
    # A folder laid out like a vLLM checkout, with one test file. The two
    # mutants --sample 2 --seed 0 draws from the block hasher: `//` for `/`
    # in BlockHashListWithBlockSize.__len__ (no test here executes it;
    # kvfuzz's Triton seed crashes on it), and 5 bytes for 4 in
    # make_block_hash_with_group_id (the lookups stay consistent, so kvfuzz
    # sees nothing; the test's length check fails).
    core = tmp_path / "checkout" / "tests" / "v1" / "core"
    core.mkdir(parents=True)
    for package in (core.parent.parent, core.parent, core):
        (package / "__init__.py").write_text("")
    (core / "test_x.py").write_text(TINY_CHECKOUT_TEST)
    run_json, report = tmp_path / "run.json", tmp_path / "report.md"
    result = kvfuzz_cli(
        "mutate",
        "corpora/seeds/triton-mtp3-swa16-fa32-r8192.json",
        "--scope",
        "managers",
        "--modules",
        "kv_cache_utils",
        "--sample",
        "2",
        "--campaign-examples",
        "0",
        "--vllm-tests",
        str(tmp_path / "checkout"),
        "--json",
        str(run_json),
        "--markdown",
        str(report),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(run_json.read_text())
    assert data["vllm_tests"]["collected"] == 3 and data["vllm_tests"]["passed"] == 2
    floor_div, number = data["mutants"]
    assert floor_div["id"] == "kv_cache_utils:ReplaceBinaryOperator_FloorDiv_Div:2"
    assert "-        return len(self.block_hashes) // self.scale_factor" in floor_div["diff"]
    assert floor_div["status"] == "killed" and floor_div["evidence"].startswith("crash on ")
    crash = "TypeError: 'float' object cannot be interpreted as an integer"
    assert crash in floor_div["evidence"]
    assert floor_div["tests"]["verdict"] == "not run" and floor_div["tests"]["selected"] == 0
    assert number["id"] == "kv_cache_utils:NumberReplacer:0"
    five = '+    return BlockHashWithGroupId(block_hash + group_id.to_bytes( 5, "big"'
    assert five in number["diff"]
    assert number["status"] == "equivalent-suspect"
    # Only the stock-passing test that executes the mutated line runs.
    assert number["tests"]["verdict"] == "killed" and number["tests"]["selected"] == 1
    assert number["tests"]["test"] == "tests/v1/core/test_x.py::test_group_id_round_trips"
    assert number["tests"]["detail"] == "failed: AssertionError: assert 37 == 36"
    assert data["score"] == 0.5 and data["vllm_tests_score"] == 0.5
    assert data["union_score"] == 1.0
    text = report.read_text()
    row = "| `v1/core/kv_cache_utils.py` | 2 | 1 | 1 | 0 | 0 | 1 | 2 / 1 | 50% | 50% | 100% |"
    assert row in text
    assert "- `kv_cache_utils:NumberReplacer:0` (make_block_hash_with_group_id, line 69)" in text
    assert "vLLM's tests: 2 of 3 pass on stock" in result.stdout


HELPER_TEST = """\
import subprocess
import sys
from pathlib import Path


def test_starts_an_interpreter_of_its_own():
    # as test_is_uniform_kv_cache_spec_optimized starts `python -O -c ...`
    helper = subprocess.Popen([sys.executable, "-O", "-c", "import time; time.sleep(600)"])
    Path({pid_file!r}).write_text(str(helper.pid))
    helper.wait()
"""


def _forkservers_of(parent: int) -> list[int]:
    """The fork servers (``_kvfuzz_forkserver``) ``parent`` started, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == parent and b"_kvfuzz_forkserver" in argv:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_mutate_leaves_no_fork_server_no_test_helper_and_no_folder(
    tmp_path: Path, signum: int
) -> None:
    """``kvfuzz mutate --vllm-tests`` stopped while vLLM's tests run (one of
    them running an interpreter of its own, as ``tests/v1/core`` does): its
    fork server, the tests' helper process and the server's folder are gone;
    the helper was left running on SIGTERM and SIGKILL alike (Ctrl-C unwinds
    as SIGTERM does; the server's own stop on each signal, while it is still
    pre-importing too, is tests/unit/test_forkserver.py's)."""
    core = tmp_path / "checkout" / "tests" / "v1" / "core"
    core.mkdir(parents=True)
    for package in (core.parent.parent, core.parent, core):
        (package / "__init__.py").write_text("")
    pid_file = tmp_path / "helper.pid"
    (core / "test_helper.py").write_text(HELPER_TEST.format(pid_file=str(pid_file)))
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {key: value for key, value in os.environ.items() if key != forkserver.ENV}
    env.update(PYTHONPATH=str(ROOT), TMPDIR=str(temp))
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "differential.cli", "mutate"),
            "corpora/seeds/triton-mtp3-swa16-fa32-r8192.json",
            *("--modules", "kv_cache_utils", "--sample", "1", "--campaign-examples", "0"),
            *("--vllm-tests", str(tmp_path / "checkout")),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the signal reaches kvfuzz only, not its group
    )
    left: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while not pid_file.exists() or not pid_file.read_text():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "vLLM's tests never started"
            time.sleep(0.2)
        left = [int(pid_file.read_text()), *_forkservers_of(proc.pid)]
        assert len(left) == 2, left
        os.kill(proc.pid, signum)
        _, stderr = proc.communicate(timeout=120)
        assert not still_alive(left, 10.0), "the fork server or the tests' helper outlived kvfuzz"
    finally:
        for pid in left:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    left_behind = sorted(path.name for path in temp.glob("kvfuzz-*"))
    if signum == signal.SIGKILL:  # only the work folder, named by the dead pid: the next run's
        assert left_behind == [f"kvfuzz-mutants-{proc.pid}"]
        return
    assert left_behind == []
    last = stderr.strip().splitlines()[-1]
    assert (proc.returncode, last) == (143, "kvfuzz: terminated (SIGTERM)")

"""``kvfuzz mutate`` without vLLM: mutant generation on a hand-written module,
scopes, sampling, the symlink-farm tree, the score arithmetic, what the
unmutated-tree check compares, and the recorded run's scenario list against
what the documented command draws today."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from differential.cli import main
from differential.compare import VariantResult
from differential.errors import VariantError
from differential.findings import Finding, FindingKind
from differential.mutation.mutants import (
    MODULES,
    ModuleScope,
    Mutant,
    build_mutant_tree,
    enumerate_mutants,
    mutant_diff,
    mutant_source,
    sample_mutants,
    select_modules,
)
from differential.mutation.score import (
    ExcludedScenario,
    MutantOutcome,
    MutantStatus,
    MutationRun,
    draw_scenarios,
    load_run,
    merge_runs,
    render_markdown,
    scenario_digest,
    stock_difference,
    write_json,
)
from differential.observation import RequestObservation, RunObservation
from differential.variants import parse_variants
from tests.factories import ROOT, triton

MODULE = "v1/core/toy.py"
SOURCE = """\
import logging

logger = logging.getLogger(__name__)


def in_scope(n: int = 3) -> int:
    if n < 2:
        logger.info("n is %d of %d", n, 10)
        return 0
    return n


class Out:
    def method(self, n: int) -> int:
        return n < 5
"""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A fake ``vllm`` package folder holding one module (and a sibling)."""
    package = tmp_path / "vllm"
    (package / "v1" / "core" / "__pycache__").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "v1" / "core" / "toy.py").write_text(SOURCE)
    (package / "v1" / "core" / "sibling.py").write_text("X = 1\n")
    (package / "v1" / "core" / "__pycache__" / "toy.cpython-311.pyc").write_bytes(b"stock")
    (package / "v1" / "core" / "__pycache__" / "sibling.cpython-311.pyc").write_bytes(b"sib")
    (package / "config.py").write_text("Y = 2\n")
    return package


def test_scope_includes_and_excludes() -> None:
    scope = ModuleScope("m.py", include=("A", "f"), exclude=("A.skip",))
    assert scope.covers("A.run") and scope.covers("f") and scope.covers("A")
    assert not scope.covers("A.skip") and not scope.covers("A.skip.inner")
    assert not scope.covers("AB.run") and not scope.covers("")
    assert ModuleScope("m.py").covers("")


def test_mutants_stay_in_scope_and_out_of_annotations_and_logger_calls(root: Path) -> None:
    scope = ModuleScope(MODULE, include=("in_scope",))
    mutants = enumerate_mutants(root, [scope])[MODULE]
    assert {m.function for m in mutants} == {"in_scope"}
    # `int` annotations, the logger call's 10 and `Out.method` give no mutant.
    assert all(m.line in (6, 7, 9, 10) for m in mutants)
    by_operator = Counter(m.operator for m in mutants)
    # One `<` (line 7): each comparison replacement once.
    assert by_operator["core/ReplaceComparisonOperator_Lt_LtE"] == 1
    # Numbers, each +1 and -1: the default 3 (line 6), 2 (line 7), 0 (line 9); not
    # the logger call's 10.
    assert sorted(m.line for m in mutants if m.operator == "core/NumberReplacer") == [
        6,
        6,
        7,
        7,
        9,
        9,
    ]
    default = next(m for m in mutants if m.operator == "core/NumberReplacer" and m.line == 6)
    assert default.at_import  # a default value is evaluated when the module is imported
    lt = next(m for m in mutants if m.operator == "core/ReplaceComparisonOperator_Lt_LtE")
    assert not lt.at_import and lt.statement_lines == (7, 7)
    ret = next(m for m in mutants if m.operator == "core/NumberReplacer" and m.line == 9)
    assert ret.statement_lines == (9, 9)


def test_mutant_source_rewrites_exactly_one_occurrence(root: Path) -> None:
    scope = ModuleScope(MODULE, include=("in_scope",))
    lt = next(
        m
        for m in enumerate_mutants(root, [scope])[MODULE]
        if m.operator == "core/ReplaceComparisonOperator_Lt_LtE"
    )
    original, mutated = mutant_source(root, lt)
    assert original == SOURCE
    assert mutated == SOURCE.replace("if n < 2:", "if n <= 2:")
    diff = mutant_diff(lt, original, mutated)
    assert "-    if n < 2:\n+    if n <= 2:\n" in diff
    assert diff.startswith("--- a/vllm/v1/core/toy.py\n+++ b/vllm/v1/core/toy.py\n")


def test_a_missing_occurrence_is_a_variant_error(root: Path) -> None:
    gone = Mutant(MODULE, "core/ReplaceComparisonOperator_Lt_LtE", 99, 7, "in_scope", (7, 7))
    with pytest.raises(VariantError, match="no occurrence 99"):
        mutant_source(root, gone)


def _fake(module: str, n: int) -> list[Mutant]:
    return [Mutant(module, "core/NumberReplacer", i, i + 1, "f", (i + 1, i + 1)) for i in range(n)]


def test_sampling_is_even_across_modules_and_seeded() -> None:
    pool = {"a.py": _fake("a.py", 50), "b.py": _fake("b.py", 30), "c.py": _fake("c.py", 2)}
    sample = sample_mutants(pool, 10, seed=7)
    assert sample == sample_mutants(pool, 10, seed=7)
    assert sample != sample_mutants(pool, 10, seed=8)
    # 10 // 3 = 3 each, the remainder to the largest module; c.py gives all it has.
    assert Counter(m.module for m in sample) == {"a.py": 4, "b.py": 3, "c.py": 2}
    assert len(set(sample)) == len(sample)
    with pytest.raises(VariantError, match="--sample"):
        sample_mutants(pool, 0, seed=0)


def test_proportional_sampling_is_seeded_and_in_proportion_to_mutants() -> None:
    pool = {"a.py": _fake("a.py", 50), "b.py": _fake("b.py", 30), "c.py": _fake("c.py", 2)}
    sample = sample_mutants(pool, 10, seed=7, proportional=True)
    assert sample == sample_mutants(pool, 10, seed=7, proportional=True)
    assert sample != sample_mutants(pool, 10, seed=8, proportional=True)
    # 10 x (50, 30, 2) / 82 = 6.10, 3.66, 0.24: floors 6, 3, 0, the one left to
    # the largest remainder (b.py).
    assert Counter(m.module for m in sample) == {"a.py": 6, "b.py": 4}
    # 41 is exactly half of every module.
    half = sample_mutants(pool, 41, seed=0, proportional=True)
    assert Counter(m.module for m in half) == {"a.py": 25, "b.py": 15, "c.py": 1}
    assert len(set(half)) == 41
    # More than there are: every mutant once.
    assert len(set(sample_mutants(pool, 500, seed=0, proportional=True))) == 82
    with pytest.raises(VariantError, match="--sample"):
        sample_mutants(pool, 0, seed=0, proportional=True)


@pytest.fixture(scope="module")
def cache_scope() -> dict[str, list[Mutant]]:
    """Every mutant of the ``cache`` scope of the installed vLLM 0.33.0."""
    from differential.mutation.mutants import installed_vllm

    return enumerate_mutants(installed_vllm(), MODULES)


def test_the_cache_scope_widens_to_every_cache_module(
    cache_scope: dict[str, list[Mutant]],
) -> None:
    from differential.mutation.mutants import MANAGER_MODULES

    assert [m.path for m in MODULES] == [
        "v1/core/single_type_kv_cache_manager.py",
        "v1/core/block_pool.py",
        "v1/core/kv_cache_coordinator.py",
        "v1/core/kv_cache_manager.py",
        "v1/core/kv_cache_utils.py",
        "v1/core/kv_cache_planning.py",
        "v1/core/kv_cache_config_builder.py",
        "v1/core/sched/scheduler.py",
    ]
    functions = {m.function for mutants in cache_scope.values() for m in mutants}
    # Widened: the managers the first scope left out, the block pool, the
    # free queue and hit granularity, planning, draft-group marking.
    for name in (
        "MambaManager.allocate_new_blocks",
        "ChunkedLocalAttentionManager.find_longest_cache_hit",
        "CrossAttentionManager.find_longest_cache_hit",
        "CircularBufferManager.get_num_blocks_to_allocate",
        "HiSparseResidentManager.get_num_blocks_to_allocate",
        "BlockPool.touch",
        "BlockPool.get_new_blocks",
        "FreeKVCacheBlockQueue.popleft_n",
        "resolve_cache_hit_alignment_tokens",
        "eagle_proof_margin",
        "partial_hash_hits_enabled",
        "unify_kv_cache_spec_page_size",
        "get_global_kv_cache_groups",
        "Scheduler.schedule",
        "Scheduler._update_waiting_for_remote_kv",
        "Scheduler._update_requests_with_invalid_blocks",
        "Scheduler._preempt_request",
    ):
        assert name in functions, name
    # Out: memory sizing, capacity reporting, a repr, no-prefix-cache.
    for name in (
        "estimate_max_model_len",
        "get_kv_cache_capacity",
        "KVCacheBlock.__repr__",
        "KVCacheCoordinatorNoPrefixCache.find_longest_cache_hit",
    ):
        assert name not in functions, name
    # The managers scope is untouched: a subset of the cache scope, same ids.
    managers = enumerate_mutants(installed_vllm_root(), MANAGER_MODULES[3:])
    assert {m.ident for m in managers[MANAGER_MODULES[3].path]} < {
        m.ident for m in cache_scope[MANAGER_MODULES[3].path]
    }


def installed_vllm_root() -> Path:
    from differential.mutation.mutants import installed_vllm

    return installed_vllm()


def test_only_the_schedulers_cache_paths_are_mutated(
    cache_scope: dict[str, list[Mutant]],
) -> None:
    """vllm/v1/core/sched/scheduler.py: mutants lie only in the methods that
    call the KV cache manager, the block pool or the connector, or decide
    admission and preemption; none in output processing, stats, the encoder
    cache or structured output, and none inside a logger call."""
    import ast

    from differential.mutation.mutants import SCHEDULER_CACHE_METHODS

    path = "v1/core/sched/scheduler.py"
    mutants = cache_scope[path]
    by_function = Counter(m.function.split(".")[1] for m in mutants)
    assert set(by_function) <= set(SCHEDULER_CACHE_METHODS)
    source = (installed_vllm_root() / path).read_text()
    (scheduler,) = (
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Scheduler"
    )
    methods = {n.name for n in scheduler.body if isinstance(n, ast.FunctionDef)}
    # Every named method still exists in this vLLM; all but one give mutants
    # (_inflight_prefill_reserved_blocks is one sum() of a generator).
    assert set(SCHEDULER_CACHE_METHODS) <= methods
    assert set(SCHEDULER_CACHE_METHODS) - set(by_function) == {"_inflight_prefill_reserved_blocks"}
    for name in (
        "_update_request_with_output",
        "_make_cached_request_data",
        "make_stats",
        "_try_schedule_encoder_inputs",
        "get_grammar_bitmask",
        "update_draft_token_ids",
        "shutdown",
    ):
        assert name not in by_function, name
    # A logger call's argument lines (after the line it starts on) give no mutant.
    logger_lines = {
        line
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "logger"
        for line in range(node.lineno + 1, (node.end_lineno or node.lineno) + 1)
    }
    assert len(logger_lines) > 10  # schedule() and update_from_output() do log
    assert [m.ident for m in mutants if m.line in logger_lines] == []


def test_scopes_are_chosen_by_name() -> None:
    from differential.mutation.mutants import MANAGER_MODULES

    assert select_modules(None) == MODULES
    assert select_modules(None, "managers") == MANAGER_MODULES
    assert [m.short for m in select_modules("scheduler,block_pool")] == [
        "scheduler",
        "block_pool",
    ]
    with pytest.raises(VariantError, match="unknown module block_pool in --scope managers"):
        select_modules("block_pool", "managers")
    with pytest.raises(VariantError, match="--scope 'all' is unknown; allowed: cache, managers"):
        select_modules(None, "all")


def test_tree_is_a_symlink_farm_with_one_real_file(root: Path, tmp_path: Path) -> None:
    tree = build_mutant_tree(root, MODULE, "MUTATED = True\n", tmp_path / "tree")
    package = tree / "vllm"
    assert (package / "__init__.py").is_symlink() and (package / "config.py").is_symlink()
    assert not (package / "v1").is_symlink() and not (package / "v1" / "core").is_symlink()
    toy = package / "v1" / "core" / "toy.py"
    assert not toy.is_symlink() and toy.read_text() == "MUTATED = True\n"
    assert (package / "v1" / "core" / "sibling.py").resolve() == (
        root / "v1" / "core" / "sibling.py"
    )
    cache = package / "v1" / "core" / "__pycache__"
    assert not cache.is_symlink()
    assert sorted(p.name for p in cache.iterdir()) == ["sibling.cpython-311.pyc"]
    # The stock module is untouched.
    assert (root / "v1" / "core" / "toy.py").read_text() == SOURCE


def _outcome(module: str, status: MutantStatus, i: int) -> MutantOutcome:
    mutant = Mutant(module, "core/AddNot", i, 10 + i, "F.g", (10 + i, 10 + i))
    return MutantOutcome(mutant, status, "why", True, 3, 2.0, "--- a\n+++ b\n-x\n+y\n")


def test_score_counts_timeouts_as_killed_per_module() -> None:
    first, second = MODULES[0].path, MODULES[1].path
    run = MutationRun(
        vllm_version="0.33.0",
        seed=5,
        generated={first: 100, second: 40},
        outcomes=(
            _outcome(first, MutantStatus.KILLED, 0),
            _outcome(first, MutantStatus.TIMED_OUT, 1),
            _outcome(first, MutantStatus.SURVIVED, 2),
            _outcome(first, MutantStatus.EQUIVALENT_SUSPECT, 3),
            _outcome(second, MutantStatus.SURVIVED, 4),
        ),
        scenarios=("s1", "s2"),
        elapsed_s=10.0,
    )
    assert run.score() == pytest.approx(2 / 5)
    assert run.score(first) == pytest.approx(2 / 4)
    assert run.score(second) == 0.0
    assert run.score(MODULES[2].path) is None
    data = run.to_dict()
    assert data["format"] == "kvfuzz.mutation" and data["seed"] == 5
    assert data["mutants"][2]["status"] == "survived"
    text = render_markdown(run)
    assert "Score: **40%**" in text
    assert f"| `{first}` | 100 | 4 | 1 | 1 | 1 | 1 | 50% |" in text
    assert "### `single_type_kv_cache_manager:AddNot:2`: survived" in text
    assert "### `single_type_kv_cache_manager:AddNot:0`" not in text  # killed: no diff


def test_module_selection() -> None:
    assert select_modules(None) == MODULES
    assert select_modules("kv_cache_utils.py,kv_cache_manager") == (MODULES[4], MODULES[3])
    with pytest.raises(VariantError, match="allowed: single_type_kv_cache_manager"):
        select_modules("mamba")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modules", "mamba"], "--modules: unknown module mamba"),
        (["--sample", "0"], "--sample must be >= 1"),
        (["--campaign-examples", "-1"], "--campaign-examples must be >= 0"),
        (["--scheduler-examples", "-1"], "--scheduler-examples must be >= 0"),
        (["--json", "/nonexistent-folder/x.json"], "folder /nonexistent-folder does not exist"),
        (["--shard", "3/2"], "--shard '3/2': allowed: I/N with 1 <= I <= N"),
        (["--vllm-tests", "/nonexistent-folder"], "no tests/v1/core folder there"),
        (["--merge", "/nonexistent-folder/a.json"], "--merge /nonexistent-folder/a.json: cannot"),
        (["--mutants", "x:AddNot:0", "--sample", "3"], "--mutants and --sample: give one"),
        (
            ["--vllm-tests-from", "/nonexistent-folder/a.json"],
            "--vllm-tests-from /nonexistent-folder/a.json: cannot",
        ),
        (
            ["--vllm-tests", "/tmp", "--vllm-tests-from", "a.json"],
            "--vllm-tests and --vllm-tests-from: give one",
        ),
    ],
)
def test_usage_errors_exit_2_before_any_work(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["mutate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_test_timeout_that_is_no_positive_number_is_refused_at_parse_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["mutate", "--test-timeout", "0"])
    assert exited.value.code == 2
    assert "argument --test-timeout: '0' is invalid: allowed a finite number of seconds > 0" in (
        capsys.readouterr().err
    )


def _result(
    variant: str,
    hits: tuple[int, ...],
    kept: tuple[tuple[int, int], ...],
    findings: tuple[Finding, ...] = (),
    *,
    evicted: int = 0,
    mode: str = "manager",
) -> VariantResult:
    """A judged run of two requests on two groups, made by hand."""
    (parsed,) = parse_variants(variant)
    requests = tuple(
        RequestObservation(i, 64, hit, 0, (hit, hit), blocks)
        for i, (hit, blocks) in enumerate(zip(hits, kept, strict=True))
    )
    run = RunObservation(variant, "0.33.0", None, requests, evicted_blocks=evicted, mode=mode)
    return VariantResult(parsed, run, None, (), findings)


def test_an_unmutated_tree_equal_to_stock_shows_no_difference(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    stock = _result("unfixed", (0, 48), ((4, 2), (1, 1)))
    tree = dataclasses.replace(stock, variant=parse_variants(f"tree:{tmp_path}")[0])
    assert stock_difference(stock, tree, (), "s.json") is None


def test_a_finding_only_the_tree_has_is_named_with_its_scenario() -> None:
    # The eviction scenario's symptom before trees drove the scheduler: same
    # hits and evictions, but only the tree's run was judged as an evicting one.
    stock = _result("unfixed", (0, 96), ((25, 2), (2, 1)), evicted=4, mode="scheduler")
    eviction = Finding(FindingKind.EVICTION, "tree:x", None, "4 cached blocks were evicted")
    tree = dataclasses.replace(stock, findings=(eviction,))
    assert stock_difference(stock, tree, (), "pool130.json") == (
        "new finding(s) eviction@run on pool130.json"
    )
    # The driving mode alone differing is reported too.
    manager = dataclasses.replace(stock, run=dataclasses.replace(stock.run, mode="manager"))
    assert stock_difference(stock, manager, (), "pool130.json") == (
        "retention run: mode scheduler, blocks recorded False on stock vs manager, False "
        "on the tree on pool130.json"
    )


def test_a_raw_observation_the_verdicts_miss_is_still_a_difference() -> None:
    stock = _result("unfixed", (0, 48), ((4, 2), (1, 1)))
    tree = _result("unfixed", (0, 48), ((4, 3), (1, 1)))
    assert stock_difference(stock, tree, (), "s.json") == (
        "retention run: request 0: blocks kept (4, 2) on stock vs (4, 3) on the tree on s.json"
    )
    cost = Finding(FindingKind.COST_CHANGE, "unfixed vs tree:x", 0, "same hit 0; blocks kept")
    assert stock_difference(stock, tree, (cost,), "s.json") == (
        "cost-change@0 on s.json: same hit 0; blocks kept"
    )


def test_the_report_names_every_excluded_scenario() -> None:
    run = MutationRun(
        vllm_version="0.33.0",
        seed=0,
        generated={MODULES[0].path: 3},
        outcomes=(_outcome(MODULES[0].path, MutantStatus.KILLED, 0),),
        scenarios=("a.json", "b.json"),
        elapsed_s=5.0,
        excluded=(ExcludedScenario("b.json", MODULES[0].path, "new finding(s) x on b.json"),),
    )
    text = render_markdown(run)
    assert "1 of 2 scenarios equal stock on an unmutated tree, 1 excluded" in text
    assert f"- `b.json` ({MODULES[0].path}): new finding(s) x on b.json" in text
    assert run.to_dict()["excluded"] == [
        {
            "scenario": "b.json",
            "module": MODULES[0].path,
            "difference": "new finding(s) x on b.json",
        }
    ]


def test_a_scenario_digest_changes_with_the_scenario() -> None:
    scenario = triton()
    assert scenario_digest(scenario) == scenario_digest(triton())
    assert len(scenario_digest(scenario)) == 16
    other = dataclasses.replace(scenario, retention_interval_tokens=4096)
    assert scenario_digest(other) != scenario_digest(scenario)


@pytest.mark.parametrize(
    "record", ["mutation-run.json", "mutation-side-by-side-run.json", "mutation-cache-run.json"]
)
def test_the_recorded_run_draws_the_scenarios_its_command_draws_today(
    monkeypatch: pytest.MonkeyPatch, record: str
) -> None:
    """docs/mutation-run.json (the 60-mutant score),
    docs/mutation-side-by-side-run.json (the 120 mutants beside vLLM's tests)
    and docs/mutation-cache-run.json (the 480 mutants of the cache scope)
    must be the runs their documented commands make on today's code: the same
    corpus files and campaign scenarios, byte for byte (by digest), and the
    same mutants, drawn from the same scope. A corpus, generator or scope
    change that draws other scenarios or mutants fails here: rerun the
    commands in docs/mutation-report.md."""
    recorded = json.loads((ROOT / "docs" / record).read_text())
    command = recorded["command"]
    monkeypatch.chdir(ROOT)  # corpus files are named by their path as given
    drawn = draw_scenarios(
        command["paths"],
        recorded["seed"],
        command["campaign_examples"],
        command.get("scheduler_examples", 0),
    )
    names = [name for name, _ in drawn]
    assert names == recorded["scenarios"]
    changed = [
        name
        for (name, scenario), digest in zip(drawn, recorded["scenario_sha256"], strict=True)
        if scenario_digest(scenario) != digest
    ]
    assert changed == [], f"{len(changed)} scenarios differ from docs/{record}; regenerate it"
    _check_recorded_mutants(recorded, record)


def _check_recorded_mutants(recorded: dict[str, Any], record: str) -> None:
    """The recorded run's scope, generated counts and sampled mutants are what
    its command draws today, and its documented command names its scope."""
    from differential.mutation.mutants import SCOPES, installed_vllm
    from differential.mutation.score import recorded_scope

    command = recorded["command"]
    scope_name = recorded_scope(command)
    scope = SCOPES[scope_name]
    modules = select_modules(command.get("modules"), scope_name)
    generated = enumerate_mutants(installed_vllm(), modules)
    assert {m: len(v) for m, v in generated.items()} == recorded["generated"]
    sample = sample_mutants(
        generated, command["sample"], recorded["seed"], proportional=scope.proportional
    )
    assert [m.ident for m in sample] == [m["id"] for m in recorded["mutants"]], (
        f"docs/{record} holds other mutants than its command samples today; regenerate it"
    )
    report = (ROOT / "docs" / "mutation-report.md").read_text()
    documented = (
        f"kvfuzz mutate {' '.join(command['paths'])} --sample {command['sample']} "
        f"--seed {recorded['seed']} --campaign-examples {command['campaign_examples']}"
        + (
            f" --scheduler-examples {command['scheduler_examples']}"
            if command.get("scheduler_examples")
            else ""
        )
        + f" --scope {scope_name}"
    )
    assert documented in " ".join(report.replace("\\\n", " ").split())


def test_scheduler_examples_are_the_scheduler_mode_campaigns_first_scenarios() -> None:
    """``--scheduler-examples J``: the first J scenarios of ``kvfuzz fuzz
    --mode scheduler --seed SEED``, after the manager-mode campaign's: they
    drive vLLM's Scheduler, so they reach vllm/v1/core/sched/scheduler.py."""
    from differential.scenario import DriveMode

    drawn = draw_scenarios([], 3, 1, 2)
    assert [name for name, _ in drawn] == [
        "campaign seed 3 example 0",
        "scheduler campaign seed 3 example 0",
        "scheduler campaign seed 3 example 1",
    ]
    assert [s.workload.mode for _, s in drawn] == [
        DriveMode.MANAGER,
        DriveMode.SCHEDULER,
        DriveMode.SCHEDULER,
    ]
    assert draw_scenarios([], 3, 1) == drawn[:1]


def test_the_recorded_run_loads_back_as_it_was_written() -> None:
    path = ROOT / "docs" / "mutation-run.json"
    recorded = json.loads(path.read_text())
    run = load_run(path)
    assert "vllm_tests" not in recorded and run.tests_baseline is None
    again = run.to_dict()
    assert again["mutants"] == recorded["mutants"]
    for key in ("seed", "command", "score", "generated", "scenarios", "excluded", "elapsed_s"):
        assert again[key] == recorded[key], key


def _shard(outcomes: list[MutantOutcome], index: int, count: int, seed: int = 0) -> MutationRun:
    return MutationRun(
        vllm_version="0.33.0",
        seed=seed,
        generated={MODULES[0].path: 40},
        outcomes=tuple(outcomes[index - 1 :: count]),
        scenarios=("s1", "s2"),
        elapsed_s=10.0 * index,
        scenario_sha256=("aa", "bb"),
        stock_s=1.0,
        check_s=2.0,
        command={"paths": ["corpora"], "sample": 5, "shard": f"{index}/{count}"},
    )


def test_shards_merge_back_into_one_run_in_sample_order(tmp_path: Path) -> None:
    statuses = [MutantStatus.KILLED, MutantStatus.SURVIVED] * 2 + [MutantStatus.TIMED_OUT]
    outcomes = [_outcome(MODULES[0].path, status, i) for i, status in enumerate(statuses)]
    files = []
    for index in (2, 1):  # given in any order
        files.append(tmp_path / f"shard{index}.json")
        write_json(_shard(outcomes, index, 2), files[-1])
    merged = merge_runs([(f, load_run(f)) for f in files])
    assert [o.mutant.ident for o in merged.outcomes] == [o.mutant.ident for o in outcomes]
    assert merged.score() == pytest.approx(3 / 5)
    # Times are machine-seconds, added over the shards.
    assert (merged.elapsed_s, merged.stock_s, merged.check_s) == (30.0, 2.0, 4.0)
    assert merged.command == {"paths": ["corpora"], "sample": 5, "merged_shards": 2}
    out = tmp_path / "merged.json"
    assert main(["mutate", "--merge", *map(str, files), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["mutants"] == [o.to_dict() for o in outcomes]


def test_merging_shards_of_different_runs_or_an_incomplete_split_is_refused(
    tmp_path: Path,
) -> None:
    outcomes = [_outcome(MODULES[0].path, MutantStatus.KILLED, i) for i in range(4)]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    write_json(_shard(outcomes, 1, 2), one)
    write_json(_shard(outcomes, 2, 2, seed=1), two)
    runs = [(one, load_run(one)), (two, load_run(two))]
    with pytest.raises(VariantError, match=r"two.json: seed differs from .*one.json's"):
        merge_runs(runs)
    with pytest.raises(VariantError, match="shard 1/2 given twice"):
        merge_runs([runs[0], runs[0]])
    with pytest.raises(VariantError, match="shard 2/2 missing"):
        merge_runs([runs[0]])


def test_a_timed_out_scenario_is_retried_with_four_times_the_time(tmp_path: Path) -> None:
    """A run past the per-scenario timeout on a loaded machine is the
    machine's: the rerun on the restarted worker gets 4x the time, so a load
    that slows every run does not time a mutant out (a false kill)."""
    from differential.mutation.score import _attempt_variants

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    attempts = _attempt_variants(tmp_path, 10.0)
    assert [v.timeout_s for v in attempts] == [10.0, 40.0]
    assert {v.name for v in attempts} == {f"tree:{tmp_path}"}  # one worker, keyed by the tree


def test_a_tests_only_kill_in_out_of_scope_code_says_so() -> None:
    from differential.mutation.mutants import OUT_OF_SCOPE
    from differential.mutation.score import _side_by_side
    from differential.mutation.vllm_tests import (
        VllmTestsBaseline,
        VllmTestsOutcome,
        VllmTestsVerdict,
    )

    module = MODULES[3].path
    killed = VllmTestsOutcome(VllmTestsVerdict.KILLED, "tests/v1/core/t.py::t", "failed", 3, 1.0)
    outcomes = tuple(
        dataclasses.replace(
            MutantOutcome(
                Mutant(module, "core/AddNot", n, 10 + n, function, (10 + n, 10 + n)),
                MutantStatus.SURVIVED,
                "not reached",
                False,
                2,
                1.0,
                "-a\n+b\n",
            ),
            tests=killed,
        )
        for n, function in enumerate(
            ("KVCacheManager.get_num_common_prefix_blocks", "KVCacheManager.allocate_slots")
        )
    )
    run = MutationRun("0.33.0", 0, {module: 2}, outcomes, ("s",), 1.0)
    lines = _side_by_side(run, VllmTestsBaseline("tests", 10, 9, 1.0, 60.0))
    first, second = (line for line in lines if line.startswith("- `kv_cache_manager:AddNot:"))
    assert first.endswith(
        "; out of kvfuzz's scope: " + OUT_OF_SCOPE["KVCacheManager.get_num_common_prefix_blocks"]
    )
    assert "cascade attention was removed" in first and "scope" not in second
    # Per module: neither reached by kvfuzz's stock runs, both run by the tests.
    assert f"| `{module}` | 2 | 0 | 2 | 0 | 0 | 0 | 0 / 2 | 0% | 100% | 100% |" in lines
    assert "1 of these 2 lie in code kvfuzz does not reach by design" in "\n".join(lines)


def test_mutants_are_selected_by_id_in_the_order_given(root: Path) -> None:
    from differential.mutation.mutants import select_mutants

    scope = ModuleScope(MODULE, include=("in_scope",))
    generated = enumerate_mutants(root, [scope])
    lt = "toy:ReplaceComparisonOperator_Lt_LtE:0"
    number = "toy:NumberReplacer:1"
    assert [m.ident for m in select_mutants(generated, f"{number}, {lt}")] == [number, lt]
    with pytest.raises(VariantError, match=r"--mutants 'toy:AddNot:99' is not a mutant"):
        select_mutants(generated, f"{lt},toy:AddNot:99")
    with pytest.raises(VariantError, match="given twice"):
        select_mutants(generated, f"{lt},{lt}")
    with pytest.raises(VariantError, match="--mutants is empty"):
        select_mutants(generated, " , ")


def test_recorded_tests_verdicts_are_reused_only_for_the_same_mutants(
    root: Path, tmp_path: Path
) -> None:
    """``--vllm-tests-from``: the tests' verdicts of a recorded run join a
    kvfuzz-only run mutant for mutant; a record without tests, of another
    vLLM, without the mutant or with another diff is refused."""
    from differential.mutation.score import recorded_tests
    from differential.mutation.vllm_tests import (
        VllmTestsBaseline,
        VllmTestsOutcome,
        VllmTestsVerdict,
    )

    scope = ModuleScope(MODULE, include=("in_scope",))
    mutants = sample_mutants(enumerate_mutants(root, [scope]), 2, seed=0)
    diffs = [mutant_diff(m, *mutant_source(root, m)) for m in mutants]
    verdicts = [
        VllmTestsOutcome(VllmTestsVerdict.KILLED, "t.py::a", "failed", 3, 1.5),
        VllmTestsOutcome(VllmTestsVerdict.SURVIVED, None, "", 2, 2.5),
    ]
    recorded_outcomes = tuple(
        MutantOutcome(m, MutantStatus.SURVIVED, "old", True, 1, 1.0, d, t)
        for m, d, t in zip(mutants, diffs, verdicts, strict=True)
    )
    baseline = VllmTestsBaseline("tests-root", 10, 9, 100.0, 60.0)
    recorded = MutationRun(
        "0.33.0", 0, {MODULE: 9}, recorded_outcomes, ("s",), 1.0, tests_baseline=baseline
    )
    path = tmp_path / "recorded.json"
    write_json(recorded, path)
    reuse = recorded_tests(path)
    reuse.check(mutants, root, "0.33.0")
    fresh = MutationRun(
        "0.33.0",
        0,
        {MODULE: 9},
        tuple(
            MutantOutcome(m, MutantStatus.KILLED, "new", True, 1, 1.0, d)
            for m, d in zip(mutants, diffs, strict=True)
        ),
        ("s",),
        1.0,
        command={"paths": ["corpora"]},
    )
    joined = reuse.attach(fresh)
    assert [o.tests for o in joined.outcomes] == verdicts
    assert [o.status for o in joined.outcomes] == [MutantStatus.KILLED] * 2  # kvfuzz's own
    assert joined.tests_baseline == baseline
    assert joined.tests_score() == pytest.approx(1 / 2) and joined.union_score() == 1.0
    assert joined.command == {"paths": ["corpora"], "vllm_tests_from": str(path)}
    assert f"taken from {path}" in render_markdown(joined)
    assert "2 mutants sampled with seed 0 from 9 generated" in render_markdown(joined)
    given = dataclasses.replace(joined, command={"mutants": "a,b"})
    assert "2 mutants given by id from 9 generated" in render_markdown(given)

    with pytest.raises(VariantError, match=r"recorded on vLLM 0\.33\.0, this is 0\.34\.0"):
        reuse.check(mutants, root, "0.34.0")
    other = enumerate_mutants(root, [ModuleScope(MODULE)])[MODULE]
    missing = next(m for m in other if m not in mutants)
    with pytest.raises(VariantError, match=f"mutant {missing.ident} has no recorded verdict"):
        reuse.check([missing], root, "0.33.0")
    # Another source (one line added on top) gives every mutant another diff.
    (root / "v1" / "core" / "toy.py").write_text("# changed\n" + SOURCE)
    with pytest.raises(VariantError, match="recorded with another diff"):
        reuse.check(mutants, root, "0.33.0")
    write_json(dataclasses.replace(recorded, tests_baseline=None), path)
    with pytest.raises(VariantError, match="has no vLLM tests' verdicts"):
        recorded_tests(path).check(mutants, root, "0.33.0")

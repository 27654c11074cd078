"""``kvfuzz mutate``: the mutation score of kvfuzz on vLLM's cache-manager code."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from differential import forkserver
from differential.commands.options import add_policy, percent, timeout_seconds
from differential.errors import VariantError
from differential.findings import Policy
from differential.mutation.mutants import (
    SCOPES,
    ModuleScope,
    enumerate_mutants,
    installed_vllm,
    sample_mutants,
    select_modules,
    select_mutants,
)
from differential.mutation.score import (
    ExcludedScenario,
    MutantOutcome,
    MutantStatus,
    MutationRun,
    default_work_dir,
    draw_scenarios,
    load_run,
    merge_runs,
    parse_shard,
    pct,
    recorded_tests,
    render_markdown,
    run_mutation,
    write_json,
)
from differential.mutation.vllm_tests import check_tests_folder

__all__ = ["add_parser", "run"]

#: Mutants sampled when neither ``--sample`` nor ``--mutants`` is given.
DEFAULT_SAMPLE = 40


def add_parser(sub: Any) -> None:
    """Register ``kvfuzz mutate`` on the command line's subparsers."""
    parser: ArgumentParser = sub.add_parser(
        "mutate",
        help="mutation score: run mutants of vLLM's cache-manager code as tree variants",
        description=(
            "Generate mutants (cosmic-ray operators) of vLLM's prefix-cache modules, "
            "sample them with --seed, run each as a tree variant next to stock vLLM on "
            "PATH... and the first --campaign-examples scenarios of a --seed campaign, and "
            "report killed / timed out / survived / equivalent-suspect per module and "
            "function, with every survivor's diff. Exit 0 when the score is at least "
            "--fail-under, 1 below it."
        ),
    )
    _add_drawing_options(parser)
    _add_running_options(parser)
    _add_shard_options(parser)
    _add_output_options(parser)


def _add_drawing_options(parser: ArgumentParser) -> None:
    """What runs: the scenarios (PATH..., the seeded campaign's), the modules
    mutated, and the mutants sampled from them or named."""
    parser.add_argument(
        "paths",
        nargs="*",
        default=["corpora"],
        metavar="PATH",
        help="scenario files or folders (default: corpora)",
    )
    parser.add_argument(
        "--sample",
        type=int,
        default=None,
        metavar="N",
        help="mutants to run, in proportion to each module's mutants in scope (--scope "
        f"managers: evenly over its modules) (default: {DEFAULT_SAMPLE})",
    )
    parser.add_argument(
        "--mutants",
        default=None,
        metavar="ID[,ID...]",
        help="run exactly these mutants, by the id the report prints "
        "(e.g. kv_cache_manager:ReplaceComparisonOperator_LtE_GtE:0) instead of a sample "
        "(default: a --sample)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="sampling and campaign seed (default: %(default)s)"
    )
    parser.add_argument(
        "--campaign-examples",
        type=int,
        default=40,
        metavar="K",
        help="scenarios of the seeded campaign run after PATH... (default: %(default)s)",
    )
    parser.add_argument(
        "--scheduler-examples",
        type=int,
        default=0,
        metavar="J",
        help="scenarios of the seeded scheduler-mode campaign (kvfuzz fuzz --mode scheduler) "
        "run after those: they drive vLLM's Scheduler, as the corpus's scheduler-mode files "
        "do (default: %(default)s)",
    )
    parser.add_argument(
        "--scope",
        default="cache",
        choices=list(SCOPES),
        help="cache: all of vLLM's prefix-cache code (the managers, the block pool, the "
        "coordinators, kv_cache_utils, the planning code, the Scheduler's cache paths), "
        "sampled in proportion to each module's mutants; managers: the four modules of "
        "the first recorded runs, sampled evenly (default: %(default)s)",
    )
    parser.add_argument(
        "--modules",
        default=None,
        help="comma-separated module stems of the --scope (default: all of its modules: "
        + ", ".join(m.short for m in SCOPES["cache"].modules)
        + " in cache)",
    )


def _add_running_options(parser: ArgumentParser) -> None:
    """How each mutant is judged: its worker's timeout per scenario, and vLLM's
    own tests, run (each under its own timeout) or taken from a recorded run."""
    parser.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=10.0,
        metavar="SECONDS",
        help="per-scenario timeout of a mutant's worker (default: %(default)s)",
    )
    parser.add_argument(
        "--vllm-tests",
        type=Path,
        default=None,
        metavar="PATH",
        help="also judge every mutant by vLLM's own tests under PATH/tests/v1/core (a vLLM "
        "checkout or a folder laid out like one): those passing on stock that execute the "
        "mutated statement (by coverage), run on the mutant's tree (default: off)",
    )
    parser.add_argument(
        "--vllm-tests-from",
        type=Path,
        default=None,
        metavar="FILE",
        help="take vLLM's tests' verdicts from a recorded run (a --json file of a run "
        "with --vllm-tests on the same vLLM) instead of running the tests: every mutant "
        "run must be in FILE with the same diff (default: off)",
    )
    parser.add_argument(
        "--test-timeout",
        type=timeout_seconds,
        default=60.0,
        metavar="SECONDS",
        help="per-test timeout of vLLM's tests (pytest-timeout; default: %(default)s)",
    )


def _add_shard_options(parser: ArgumentParser) -> None:
    """One run over many machines: a shard of the sampled mutants each, and
    the recorded shards' runs merged into one."""
    parser.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="run only shard I of N of the sampled mutants (sample positions I-1, I-1+N, ...), "
        "for one machine of many; join the --json files with --merge (default: all)",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        metavar="FILE",
        help="run nothing: join the --json files of every --shard of one run into one run, "
        "written with --json / --markdown (default: off)",
    )


def _add_output_options(parser: ArgumentParser) -> None:
    """The verdicts and what comes out: the oracle's checkpoint policy, the
    run as JSON and Markdown, and the score (percent) the exit code needs."""
    add_policy(parser, "checkpoint policy the oracle judges with (default: %(default)s)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the run as JSON")
    parser.add_argument(
        "--markdown", type=Path, metavar="FILE", help="write the report as Markdown"
    )
    parser.add_argument(
        "--fail-under",
        type=percent,
        default=0.0,
        metavar="PERCENT",
        help="exit 1 when the score is below PERCENT (default: %(default)s)",
    )


def _check_output(option: str, path: Path | None) -> None:
    if path is None:
        return
    if path.is_dir():
        raise VariantError(f"{option} {path} is a folder; allowed: a file path")
    if not path.parent.is_dir():
        raise VariantError(f"{option} {path}: folder {path.parent} does not exist")


def _check_outputs(args: Any, inputs: list[Path]) -> None:
    """``--json`` and ``--markdown``: writable paths, not one file, and none of
    ``inputs`` (the ``--merge`` or ``--vllm-tests-from`` files, the scenario
    files), which writing would destroy.

    Raises:
        VariantError, ScenarioError: naming the option and the path.
    """
    from differential.reports.outputs import check_distinct_outputs, check_not_an_input

    outputs = [("--json", args.json), ("--markdown", args.markdown)]
    for option, path in outputs:
        _check_output(option, path)
        if path is not None:
            check_not_an_input(path, option, inputs)
    check_distinct_outputs(outputs)


def _run_inputs(args: Any) -> list[Path]:
    """The files a run reads that an output must not replace."""
    given = [Path(p) for p in args.paths if Path(p).is_file()]
    return given + ([args.vllm_tests_from] if args.vllm_tests_from is not None else [])


def _start_forkserver() -> forkserver.ForkServer | None:
    """A fork server for the mutants' workers, unless ``KVFUZZ_FORKSERVER`` already
    names one or the platform cannot run one: each worker then imports only
    its tree's vLLM (about 1 CPU-second), not vLLM's dependencies as well (7).

    A mutant stays isolated: vLLM itself is never pre-imported, so each
    worker imports its own tree's files (:mod:`differential.forkserver`).
    """
    if os.environ.get(forkserver.ENV):
        return None
    # vLLM's import pulls in the dependencies the server pre-imports: listed
    # from this process's modules, so vLLM must be imported here first (the
    # stock runs import it anyway).
    try:
        import differential.driver.runner  # noqa: F401
    except ImportError:  # no vLLM: nothing worth pre-importing
        return None
    try:
        server = forkserver.ForkServer.start(forkserver.default_preload())
    except (OSError, RuntimeError):  # no Unix sockets or no fork: fresh interpreters
        return None
    os.environ[forkserver.ENV] = server.address
    return server


def run(args: Any) -> int:
    """``kvfuzz mutate``: validate every input, then run and report; returns the exit code.

    Before any mutant, an unmutated tree per sampled module runs every
    scenario; a scenario where it differs from stock is printed and left out.
    """
    if args.merge is not None:
        return _merge(args)
    shard, modules, sample = _check_options(args)
    vllm_tests = None if args.vllm_tests is None else check_tests_folder(args.vllm_tests)
    recorded = None if args.vllm_tests_from is None else recorded_tests(args.vllm_tests_from)
    _check_outputs(args, _run_inputs(args))
    scenarios = draw_scenarios(
        args.paths, args.seed, args.campaign_examples, args.scheduler_examples
    )
    vllm_root = installed_vllm()
    generated_by = enumerate_mutants(vllm_root, modules)
    if args.mutants is not None:
        mutants = select_mutants(generated_by, args.mutants)
    else:
        proportional = SCOPES[args.scope].proportional
        mutants = sample_mutants(generated_by, sample, args.seed, proportional=proportional)
    if shard is not None:
        mutants = mutants[shard[0] - 1 :: shard[1]]
    if not scenarios:
        raise VariantError("no scenarios: give PATH... or --campaign-examples above 0")
    if recorded is not None:
        recorded.check(mutants, vllm_root, importlib.metadata.version("vllm"))
    print(
        f"{sum(len(v) for v in generated_by.values())} mutants generated, {len(mutants)} "
        + ("given" if args.mutants is not None else f"sampled (seed {args.seed})")
        + f"; {len(scenarios)} scenarios",
        flush=True,
    )
    if vllm_tests is not None:
        print(
            f"vLLM's tests: running {vllm_tests / 'tests' / 'v1' / 'core'} once on stock "
            f"(each test under {args.test_timeout:g} s, coverage per test)",
            flush=True,
        )

    work = default_work_dir()
    server = None
    try:
        server = _start_forkserver()
        run = run_mutation(
            mutants,
            scenarios,
            vllm_root=vllm_root,
            work=work,
            seed=args.seed,
            generated={m: len(v) for m, v in generated_by.items()},
            timeout_s=args.timeout,
            policy=Policy(args.policy),
            progress=_show_outcome,
            on_excluded=_show_excluded,
            command=_run_command(args, sample, vllm_tests),
            vllm_tests=vllm_tests,
            test_timeout_s=args.test_timeout,
            modules=modules,
        )
        if recorded is not None:
            run = recorded.attach(run)
    finally:
        if server is not None:
            os.environ.pop(forkserver.ENV, None)
            server.close()
        shutil.rmtree(work, ignore_errors=True)
    return _summary(run, args)


def _check_options(args: Any) -> tuple[tuple[int, int] | None, tuple[ModuleScope, ...], int]:
    """``--shard``, ``--modules``, ``--mutants`` / ``--sample``,
    ``--campaign-examples`` and ``--vllm-tests`` / ``--vllm-tests-from``
    checked: the shard, the modules and the sample size.

    Raises:
        VariantError: naming the option and what is allowed.
    """
    shard = None if args.shard is None else parse_shard(args.shard)
    modules = select_modules(args.modules, args.scope)
    if args.mutants is not None and args.sample is not None:
        raise VariantError("--mutants and --sample: give one; allowed: a sample or a list")
    sample = DEFAULT_SAMPLE if args.sample is None else args.sample
    if sample < 1:
        raise VariantError(f"--sample must be >= 1, got {sample}")
    if args.campaign_examples < 0:
        raise VariantError(f"--campaign-examples must be >= 0, got {args.campaign_examples}")
    if args.scheduler_examples < 0:
        raise VariantError(f"--scheduler-examples must be >= 0, got {args.scheduler_examples}")
    if args.vllm_tests is not None and args.vllm_tests_from is not None:
        raise VariantError(
            "--vllm-tests and --vllm-tests-from: give one; allowed: run the tests or reuse "
            "a recorded run's verdicts"
        )
    return shard, modules, sample


def _run_command(args: Any, sample: int, vllm_tests: Path | None) -> dict[str, Any]:
    """The options the run was made with, as its JSON records them: the mutants
    given or the sample size, the shard, and vLLM's tests when they ran."""
    return {
        "paths": [str(p) for p in args.paths],
        "campaign_examples": args.campaign_examples,
        "scheduler_examples": args.scheduler_examples,
        "scope": args.scope,
        **({"modules": args.modules} if args.modules is not None else {}),
        **({"sample": sample} if args.mutants is None else {"mutants": args.mutants}),
        "timeout_s": args.timeout,
        "policy": args.policy,
        **({} if args.shard is None else {"shard": args.shard}),
        **(
            {}
            if vllm_tests is None
            else {"vllm_tests": str(vllm_tests), "test_timeout_s": args.test_timeout}
        ),
    }


def _show_outcome(outcome: MutantOutcome, done: int, total: int) -> None:
    """One mutant's progress lines: its status, id, seconds and evidence, then
    its verdict by vLLM's tests when they ran."""
    print(
        f"[{done}/{total}] {outcome.status.value:<18} {outcome.mutant.ident:<48} "
        f"{outcome.elapsed_s:5.1f} s  {outcome.evidence[:100]}",
        flush=True,
    )
    tests = outcome.tests
    if tests is not None:
        print(
            f"        vLLM's tests: {tests.verdict.value:<9} {tests.selected:>4} selected "
            f"{tests.elapsed_s:5.1f} s  {tests.test or ''} {tests.detail[:80]}".rstrip(),
            flush=True,
        )


def _show_excluded(one: ExcludedScenario) -> None:
    """The line for a scenario left out: an unmutated tree differs from stock on it."""
    print(
        f"! excluded: an unmutated tree ({one.module}) differs from stock: {one.difference}",
        flush=True,
    )


def _merge(args: Any) -> int:
    """``kvfuzz mutate --merge FILE...``: one run from its shards' ``--json`` files."""
    if not 0 <= args.fail_under <= 100:
        raise VariantError(f"--fail-under must be within 0..100, got {args.fail_under}")
    if args.shard is not None:
        raise VariantError(
            f"--merge and --shard {args.shard}: give one; allowed: run one shard, or merge "
            "the --json files of every shard"
        )
    _check_outputs(args, list(args.merge))
    run = merge_runs([(path, load_run(path)) for path in args.merge])
    print(f"merged {len(args.merge)} shard(s): {len(run.outcomes)} mutants")
    return _summary(run, args)


def _summary(run: MutationRun, args: Any) -> int:
    """Write ``--json`` / ``--markdown``, print the scores; the exit code by ``--fail-under``."""
    if args.json is not None:
        write_json(run, args.json)
    if args.markdown is not None:
        from differential.corpus import write_atomic

        write_atomic(args.markdown, render_markdown(run))
    for module in run.generated:
        c = run.counts(module)
        if not c:
            continue
        print(
            f"{module:<42} {pct(run.score(module)):>5}  killed {c[MutantStatus.KILLED]}"
            f", timed out {c[MutantStatus.TIMED_OUT]}, survived {c[MutantStatus.SURVIVED]}, "
            f"equivalent-suspect {c[MutantStatus.EQUIVALENT_SUSPECT]}"
        )
    print(
        f"unmutated-tree check: {len(run.scenarios) - len(run.excluded)} of "
        f"{len(run.scenarios)} scenarios equal stock, {len(run.excluded)} excluded "
        f"({run.check_s:.0f} s); stock judged once ({run.stock_s:.0f} s)"
    )
    if run.tests_baseline is not None:
        b = run.tests_baseline
        print(
            f"vLLM's tests: {b.passed} of {b.collected} pass on stock ({b.elapsed_s:.0f} s); "
            f"score {pct(run.tests_score())}, kvfuzz {pct(run.score())}, union "
            f"{pct(run.union_score())} (selection by coverage)"
        )
    score = run.score() or 0.0
    print(
        f"mutation score {100 * score:.1f}% ({len(run.outcomes)} mutants, "
        f"{run.elapsed_s:.0f} s, {run.elapsed_s / max(1, len(run.outcomes)):.1f} s per mutant)"
    )
    return 0 if 100 * score >= args.fail_under else 1

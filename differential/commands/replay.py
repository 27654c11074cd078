"""``kvfuzz replay``: run scenario files on the variants side by side and judge every sibling."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from differential.commands.options import (
    EXIT_CLEAN,
    EXIT_FOUND,
    EXIT_USAGE,
    add_ci_reports,
    add_common,
    check_ci_outputs,
    load_scenario,
    one_line,
    outputs_failed,
    write_ci_reports,
    write_output,
)
from differential.errors import ScenarioError
from differential.findings import Policy
from differential.variants import (
    DEFAULT_VARIANTS,
    Variant,
    VariantRole,
    parse_variants,
)

if TYPE_CHECKING:
    from differential.compare import ScenarioResult
    from differential.corpus import CorpusEntry
    from differential.reports.table import NotStarted

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """``kvfuzz replay``: scenario files in, per-sibling verdicts out."""
    replay = sub.add_parser(
        "replay",
        help="run scenario files or folders and print per-sibling verdicts",
        description="Run every scenario in PATH... on each variant and judge every sibling.",
    )
    replay.add_argument("paths", nargs="+", metavar="PATH", help="scenario JSON files or folders")
    add_common(replay, engine=True)
    replay.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of a table"
    )
    replay.add_argument(
        "--report",
        type=Path,
        metavar="FILE",
        help="also write the JSON report to FILE (atomically)",
    )
    add_ci_reports(replay)
    replay.add_argument(
        "--no-dense-check",
        action="store_true",
        help="skip the dense-retention cross-check runs (about halves the run time)",
    )


def _replay_entries(
    args: argparse.Namespace,
    entries: list[CorpusEntry],
    variants: tuple[Variant, ...],
    policy: Policy,
) -> tuple[list[ScenarioResult], list[CorpusEntry], list[ScenarioError], list[NotStarted]]:
    """Run every entry on the variants; a variant whose worker cannot start
    is left out from that scenario on (named on stderr at once), the others
    go on.

    Returns:
        The results, the entries they are of, the scenarios bad input only
        running could show, and the variants that could not start.
    """
    from differential.compare import compare_variants
    from differential.reports.table import NotStarted, printable
    from differential.scenario.bounds import scenario_cost
    from differential.variants.tree import WorkerStartFailed

    results: list[ScenarioResult] = []
    ran: list[CorpusEntry] = []
    rejected: list[ScenarioError] = []
    not_started: dict[str, NotStarted] = {}
    for index, entry in enumerate(entries, 1):
        # Progress on stderr, one line per scenario, its cost stated before it runs.
        print(
            f"[{index}/{len(entries)}] {printable(str(entry.path))}: "
            f"{scenario_cost(entry.scenario).describe()}",
            file=sys.stderr,
            flush=True,
        )
        result = None
        while variants and result is None:
            try:
                result = compare_variants(
                    entry.scenario,
                    variants,
                    policy=policy,
                    source=str(entry.path),
                    dense_cross_check=not args.no_dense_check,
                )
            except WorkerStartFailed as exc:
                print(
                    f"kvfuzz: {one_line(str(exc))} (going on without {exc.variant})",
                    file=sys.stderr,
                    flush=True,
                )
                not_started[exc.variant] = NotStarted(exc.variant, str(exc))
                variants = tuple(v for v in variants if v.name != exc.variant)
            except ScenarioError as exc:
                # Bad input only running could show costs that scenario, not the run.
                print(f"kvfuzz: error: {one_line(str(exc))}", file=sys.stderr, flush=True)
                rejected.append(exc)
                break
        for missed in not_started.values():
            missed.scenarios.append(str(entry.path))
        if result is not None:
            results.append(result)
            ran.append(entry)
    return results, ran, rejected, list(not_started.values())


def run(args: argparse.Namespace) -> int:
    from differential.corpus import expectation_problems

    if args.mode == "engine":
        return _replay_on_engine(args)
    variants = parse_variants(args.variants or ",".join(DEFAULT_VARIANTS), timeout_s=args.timeout)
    policy = Policy(args.policy)
    # Validate every input (and its cost) and every output path before running anything.
    entries = _checked_entries(args)

    from differential.driver import VLLM_VERSION
    from differential.reports.table import expected_line, printable, render_json, render_text

    started = time.perf_counter()  # after the vLLM import, as the summary line says

    notices: list[str] = []
    if any(v.role is VariantRole.FIXED for v in variants):
        notices, fix_complete = _seed_fix_notices()
        if fix_complete:
            variants = tuple(v for v in variants if v.role is not VariantRole.FIXED)
    notices += [f"{printable(str(entry.path))}: {entry.plan}" for entry in entries if entry.plan]
    results, ran, rejected, not_started = _replay_entries(args, entries, variants, policy)
    # A corpus file's `expect` block is checked too: a contradiction fails like a finding.
    contradictions = [
        (entry.path, problem)
        for entry, result in zip(ran, results, strict=True)
        for problem in expectation_problems(entry, result, dense_checked=not args.no_dense_check)
    ]
    report = render_json(results, VLLM_VERSION, policy, notices)
    report["expectations_failed"] = [
        {"file": str(path), "problem": problem} for path, problem in contradictions
    ]
    report["not_started"] = [missed.to_dict() for missed in not_started]
    problems = write_ci_reports(args, results)
    if args.report is not None:
        problem = write_output("--report", args.report, json.dumps(report, indent=2) + "\n")
        problems += [problem] if problem else []
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(render_text(results, VLLM_VERSION, notices))
        for path, problem in contradictions:
            sys.stdout.write(f"! expectation not met: {printable(str(path))}: {problem}\n")
        for missed in not_started:
            sys.stdout.write(missed.line() + "\n")
        sys.stdout.write(f"({time.perf_counter() - started:.1f} s after importing vLLM)\n")
        contradicted = {path for path, _ in contradictions}
        closing = expected_line(
            [
                (result, None if entry.path in contradicted else entry.expect.findings or None)
                for entry, result in zip(ran, results, strict=True)
            ]
        )
        if closing is not None:
            sys.stdout.write(closing + "\n")
    if not_started:
        raise not_started[0].error(len(not_started) - 1)
    if problems:
        raise outputs_failed(problems)
    if rejected:
        return EXIT_USAGE  # each named on stderr as it happened; the reports hold the rest
    found = any(r.findings for r in results) or bool(contradictions)
    return EXIT_FOUND if found else EXIT_CLEAN


def _replay_on_engine(args: argparse.Namespace) -> int:
    """``replay --mode engine``: every input and output checked, then the
    scenarios run on vLLM's real CPU engine; the exit code."""
    from differential.commands.confirm import replay_on_engine
    from differential.corpus import iter_scenario_files

    variants = None if args.variants is None else parse_variants(args.variants)
    entries = [load_scenario(args, path) for path in iter_scenario_files(args.paths)]
    check_ci_outputs(args, others=[("--report", args.report)])
    if args.report is not None:
        from differential.reports.outputs import check_output_file

        check_output_file(args.report, "--report")
    return replay_on_engine(args, entries, variants)


def _checked_entries(args: argparse.Namespace) -> list[CorpusEntry]:
    """Every scenario of ``args.paths``, each valid and within the limits on its
    cost, once every output path is checked too (none may be an input): all
    before anything runs."""
    from differential.corpus import iter_scenario_files

    entries = [load_scenario(args, path) for path in iter_scenario_files(args.paths)]
    inputs = [entry.path for entry in entries]
    check_ci_outputs(args, inputs, others=[("--report", args.report)])
    if args.report is not None:
        from differential.reports.outputs import check_not_an_input, check_output_file

        check_output_file(args.report, "--report")
        check_not_an_input(args.report, "--report", inputs)
    return entries


def _seed_fix_notices() -> tuple[list[str], bool]:
    """What the installed vLLM already has of the seed fix, as notices, and
    whether it has all of it (variants that add the fix would then compare
    vLLM with itself)."""
    from differential.driver import VLLM_VERSION, fix_status

    status = fix_status()
    if status.complete:
        return [
            f"the installed vLLM {VLLM_VERSION} already contains the seed fix; "
            "variants that add it would compare vLLM with itself and are skipped"
        ], True
    if status.gemma4_no_drop or status.widened_tails:
        part = "no Gemma-4 MTP drop" if status.gemma4_no_drop else "widened SWA tails"
        return [
            f"the installed vLLM {VLLM_VERSION} already has part of the seed fix ({part})"
        ], False
    return [], False

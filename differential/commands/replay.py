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
    VariantRole,
    parse_variants,
)

if TYPE_CHECKING:
    from differential.corpus import CorpusEntry

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


def run(args: argparse.Namespace) -> int:
    from differential.corpus import expectation_problems, iter_scenario_files
    from differential.scenario.bounds import scenario_cost

    if args.mode == "engine":
        from differential.commands.confirm import replay_on_engine

        entries = [load_scenario(args, path) for path in iter_scenario_files(args.paths)]
        check_ci_outputs(args, others=[("--report", args.report)])
        if args.report is not None:
            from differential.reports.outputs import check_output_file

            check_output_file(args.report, "--report")
        return replay_on_engine(args, entries)
    variants = parse_variants(args.variants, timeout_s=args.timeout)
    policy = Policy(args.policy)
    # Validate every input (and its cost) and every output path before running anything.
    entries = [load_scenario(args, path) for path in iter_scenario_files(args.paths)]
    inputs = [entry.path for entry in entries]
    check_ci_outputs(args, inputs, others=[("--report", args.report)])
    if args.report is not None:
        from differential.reports.outputs import check_not_an_input, check_output_file

        check_output_file(args.report, "--report")
        check_not_an_input(args.report, "--report", inputs)

    from differential.compare import compare_variants
    from differential.driver import VLLM_VERSION, fix_status
    from differential.reports.table import expected_line, printable, render_json, render_text

    started = time.perf_counter()  # after the vLLM import, as the summary line says

    notices: list[str] = []
    if any(v.role is VariantRole.FIXED for v in variants):
        status = fix_status()
        if status.complete:
            notices.append(
                f"the installed vLLM {VLLM_VERSION} already contains the seed fix; "
                "variants that add it would compare vLLM with itself and are skipped"
            )
            variants = tuple(v for v in variants if v.role is not VariantRole.FIXED)
        elif status.gemma4_no_drop or status.widened_tails:
            part = "no Gemma-4 MTP drop" if status.gemma4_no_drop else "widened SWA tails"
            notices.append(
                f"the installed vLLM {VLLM_VERSION} already has part of the seed fix ({part})"
            )
    notices += [f"{printable(str(entry.path))}: {entry.plan}" for entry in entries if entry.plan]
    results = []
    ran: list[CorpusEntry] = []
    rejected: list[ScenarioError] = []
    for index, entry in enumerate(entries, 1):
        # Progress on stderr, one line per scenario, its cost stated before it runs.
        print(
            f"[{index}/{len(entries)}] {printable(str(entry.path))}: "
            f"{scenario_cost(entry.scenario).describe()}",
            file=sys.stderr,
            flush=True,
        )
        try:
            result = compare_variants(
                entry.scenario,
                variants,
                policy=policy,
                source=str(entry.path),
                dense_cross_check=not args.no_dense_check,
            )
        except ScenarioError as exc:
            # Bad input only running could show costs that scenario, not the run.
            print(f"kvfuzz: error: {one_line(str(exc))}", file=sys.stderr, flush=True)
            rejected.append(exc)
            continue
        results.append(result)
        ran.append(entry)
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
    if problems:
        raise outputs_failed(problems)
    if rejected:
        return EXIT_USAGE  # each named on stderr as it happened; the reports hold the rest
    found = any(r.findings for r in results) or bool(contradictions)
    return EXIT_FOUND if found else EXIT_CLEAN

"""The ``kvfuzz`` command line.

Exit codes: 0 when the variants under test are clean, 1 when anything is
found, 2 for bad input or usage (the message names the field or option and
what is allowed), 3 when kvfuzz itself failed (an unexpected exception, a
campaign worker that died without reporting, an output that cannot be
written): one line on stderr names the error and the file holding the full
traceback. A crash is never reported as success or as a finding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from differential.errors import InternalError, ScenarioError, VariantError
from differential.findings import SEVERITY, FindingKind, Policy
from differential.scenario import DriveMode, GroupKind
from differential.variants import (
    DEFAULT_VARIANTS,
    VariantRole,
    known_variants,
    parse_variants,
)

if TYPE_CHECKING:
    from differential.corpus import CorpusEntry

__all__ = ["main"]

EXIT_CLEAN, EXIT_FOUND, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
_MESSAGE_CHARS = 500  # longest error message printed (the rest is elided)


MAX_JOBS = 256  # --jobs above this is a typo, not a machine


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: allowed {what}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed {what}")
    return value


def _seconds_budget(text: str) -> float:
    """A finite time budget in seconds, >= 0 (0: none)."""
    value = _number(text, "a finite number of seconds >= 0 (0: no limit)")
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: allowed a finite number of seconds >= 0 (0: no limit)"
        )
    return value


def _timeout_seconds(text: str) -> float:
    """A finite timeout in seconds, > 0."""
    value = _number(text, "a finite number of seconds > 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: allowed a finite number of seconds > 0"
        )
    return value


def _positive_int(text: str, *, maximum: int | None = None) -> int:
    allowed = "an integer >= 1" if maximum is None else f"an integer 1..{maximum}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed {allowed}") from None
    if value < 1 or (maximum is not None and value > maximum):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed {allowed}")
    return value


def _jobs(text: str) -> int:
    """Worker processes: 1..``MAX_JOBS``."""
    return _positive_int(text, maximum=MAX_JOBS)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=(
            "comma-separated variants to run side by side "
            f"(known: {', '.join(known_variants())}; default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--timeout",
        type=_timeout_seconds,
        default=60.0,
        metavar="SECONDS",
        help="per-scenario timeout for tree:PATH variants (default: %(default)s)",
    )
    parser.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        default=Policy.VLLM.value,
        help=(
            "checkpoint policy the oracle judges with: vllm = the one-unit rule "
            "(every retained boundary b and b - A), retained = what vLLM 0.33.0 "
            "literally keeps, ideal = the dense reference (default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--mode",
        choices=["manager", "scheduler"],
        default=None,
        help=(
            "driving mode, overriding each scenario's workload.mode: manager = "
            "KVCacheManager directly, scheduler = vLLM's real Scheduler (default: "
            "the scenario's own)"
        ),
    )
    _add_limits(parser)


def _add_limits(parser: argparse.ArgumentParser) -> None:
    from differential.bounds import DEFAULT_LIMITS

    limits = parser.add_argument_group(
        "limits", "a scenario file over a limit is rejected (exit 2) before anything runs"
    )
    limits.add_argument(
        "--max-requests",
        type=_positive_int,
        default=DEFAULT_LIMITS.max_requests,
        metavar="N",
        help="requests per scenario (default: %(default)s)",
    )
    limits.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=DEFAULT_LIMITS.max_tokens,
        metavar="N",
        help="prompt plus decode tokens per scenario (default: %(default)s)",
    )
    limits.add_argument(
        "--max-pool-blocks",
        type=_positive_int,
        default=DEFAULT_LIMITS.max_pool_blocks,
        metavar="N",
        help="block-pool size per scenario, in blocks (default: %(default)s)",
    )


def _load(args: argparse.Namespace, path: Path) -> CorpusEntry:
    """Load a scenario file and check its cost against the limits (exit 2 over one)."""
    from differential.bounds import Limits, check_cost
    from differential.corpus import load_entry

    entry = load_entry(path)
    mode = getattr(args, "mode", None)
    if mode is not None:
        from dataclasses import replace

        from differential.compare import in_mode
        from differential.scenario import DriveMode

        try:
            entry = replace(entry, scenario=in_mode(entry.scenario, DriveMode(mode)))
        except ScenarioError as exc:
            raise exc.with_source(str(path)) from None
    limits = Limits(
        max_requests=args.max_requests,
        max_tokens=args.max_tokens,
        max_pool_blocks=args.max_pool_blocks,
    )
    check_cost(entry.scenario, limits, source=str(path))
    return entry


def _add_ci_reports(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--junit-xml",
        type=Path,
        metavar="FILE",
        help="write JUnit XML: a test case per scenario and variant, findings as failures",
    )
    parser.add_argument("--sarif", type=Path, metavar="FILE", help="write findings as SARIF 2.1.0")
    parser.add_argument(
        "--github-annotations",
        action="store_true",
        help="print a GitHub Actions ::error/::warning line per finding",
    )


def _write_ci_reports(args: argparse.Namespace, results: Sequence[object]) -> None:
    from differential.corpus import write_atomic
    from differential.reports.ci import dumps_sarif, github_annotations, junit_xml

    if args.junit_xml is not None:
        write_atomic(args.junit_xml, junit_xml(results))  # type: ignore[arg-type]
    if args.sarif is not None:
        write_atomic(args.sarif, dumps_sarif(results))  # type: ignore[arg-type]
    if args.github_annotations:
        sys.stdout.write(github_annotations(results))  # type: ignore[arg-type]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfuzz",
        description=(
            "Differential testing of vLLM's prefix-cache managers: run scenarios "
            "on vLLM's real KVCacheManager, unfixed and fixed side by side, and "
            "report hits that fall back to an earlier checkpoint or reuse KV they must not."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_replay_parser(sub)
    _add_calibrate_parser(sub)
    _add_fuzz_parser(sub)
    _add_import_crash_parser(sub)
    _add_explain_parser(sub)
    _add_shrink_parser(sub)
    from differential.variants.mutation import add_mutate_parser

    add_mutate_parser(sub)
    _add_export_parser(sub)
    _add_diff_parser(sub)
    return parser


def _add_replay_parser(sub: Any) -> None:
    """``kvfuzz replay``: scenario files in, per-sibling verdicts out."""
    replay = sub.add_parser(
        "replay",
        help="run scenario files or folders and print per-sibling verdicts",
        description="Run every scenario in PATH... on each variant and judge every sibling.",
    )
    replay.add_argument("paths", nargs="+", metavar="PATH", help="scenario JSON files or folders")
    _add_common(replay)
    replay.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of a table"
    )
    replay.add_argument(
        "--report",
        type=Path,
        metavar="FILE",
        help="also write the JSON report to FILE (atomically)",
    )
    _add_ci_reports(replay)
    replay.add_argument(
        "--no-dense-check",
        action="store_true",
        help="skip the dense-retention cross-check runs (about halves the run time)",
    )


def _add_calibrate_parser(sub: Any) -> None:
    """``kvfuzz calibrate``: which scenarios catch each calibration mutant."""
    calibrate = sub.add_parser(
        "calibrate",
        help="print which scenarios catch each calibration mutant",
        description=(
            "Run the fixed variant and each calibration mutant (fixed plus one "
            "deliberate breakage) on PATH... and print the mutation table. Exit 0 "
            "when every mutant is caught at least once, 1 otherwise."
        ),
    )
    calibrate.add_argument(
        "paths",
        nargs="*",
        default=["corpora"],
        metavar="PATH",
        help="scenario files or folders (default: corpora)",
    )
    _add_limits(calibrate)


def _add_fuzz_parser(sub: Any) -> None:
    """``kvfuzz fuzz``: a campaign over the scenario space."""
    fuzz = sub.add_parser(
        "fuzz",
        help="run a fuzz campaign over the scenario space",
        description=(
            "Generate scenarios (Hypothesis strategies, driven by bytes from --seed), "
            "run them on the variants and keep one file per distinct finding in "
            "OUT/findings. The same seed and versions give the same findings. "
            "Ctrl-C or SIGTERM stops cleanly and keeps what was found."
        ),
    )
    _add_common(fuzz)
    fuzz.add_argument("--seed", type=int, default=0, help="campaign seed (default: %(default)s)")
    fuzz.add_argument(
        "--seconds",
        type=_seconds_budget,
        default=60.0,
        help="wall-time budget in seconds, after vLLM is imported; 0 for none "
        "(default: %(default)s)",
    )
    fuzz.add_argument(
        "--max-examples",
        type=_positive_int,
        default=None,
        metavar="N",
        help="stop after N scenarios (default: no limit)",
    )
    fuzz.add_argument(
        "--out",
        type=Path,
        default=Path("kvfuzz-out"),
        help="output folder for findings, the example database and summary.json "
        "(default: %(default)s)",
    )
    fuzz.add_argument(
        "--no-dense-check",
        action="store_true",
        help="skip the dense-retention cross-check runs (about twice as fast)",
    )
    fuzz.add_argument(
        "--groups",
        default="",
        metavar="KINDS",
        help="comma-separated KV cache group kinds every scenario contains "
        f"({', '.join(k.value for k in GroupKind)}; e.g. --groups mamba for Mamba "
        "hybrids only; default: any layout)",
    )
    fuzz.add_argument("--quiet", action="store_true", help="no progress display")
    fuzz.add_argument(
        "--jobs",
        type=_jobs,
        default=1,
        metavar="N",
        help=f"worker processes, each importing vLLM once, 1..{MAX_JOBS} (default: %(default)s)",
    )
    fuzz.add_argument(
        "--no-shrink",
        action="store_true",
        help="do not shrink new root causes in the background",
    )
    fuzz.add_argument(
        "--shrink-seconds",
        type=float,
        default=10.0,
        metavar="S",
        help="time box, in seconds, of each background shrink (default: %(default)s)",
    )
    fuzz.add_argument(
        "--known-corpus",
        action="append",
        type=Path,
        default=None,
        metavar="PATH",
        help="scenario files or folders whose root causes count as known, not new "
        "(repeatable; default: corpora and known-issues, where they exist)",
    )
    fuzz.add_argument(
        "--fail-on",
        choices=("any", "new"),
        default="any",
        help="exit 1 for any finding, or only for new root causes on the variants "
        "under test (default: %(default)s)",
    )
    _add_ci_reports(fuzz)


def _add_import_crash_parser(sub: Any) -> None:
    """``kvfuzz import-crash``: atheris crash files to scenario JSON."""
    crash = sub.add_parser(
        "import-crash",
        help="turn atheris/libFuzzer crash files into scenario JSON",
        description=(
            "Decode each crash file through the same scenario strategy the fuzz "
            "target uses, run it on the variants and write it as a replayable "
            "scenario file (with its verdicts) to OUT."
        ),
    )
    crash.add_argument("crashes", nargs="+", type=Path, metavar="CRASH")
    _add_common(crash)
    crash.add_argument(
        "--out",
        type=Path,
        default=Path("kvfuzz-out/imported"),
        help="folder for the scenario files (default: %(default)s)",
    )


def _add_explain_parser(sub: Any) -> None:
    """``kvfuzz explain``: one sibling's blocks, per group and variant."""
    explain = sub.add_parser(
        "explain",
        help="draw the blocks each variant kept around one sibling's divergence point",
        description=(
            "Run SCENARIO on the variants and show, for one sibling, which blocks of "
            "each KV cache group were cached when it looked up, with the divergence "
            "point, the expected checkpoint and each variant's hit; optionally as SVG."
        ),
    )
    explain.add_argument("scenario", type=Path, metavar="SCENARIO")
    _add_common(explain)
    explain.add_argument(
        "--request",
        type=int,
        default=None,
        help="the sibling to explain (default: the first with a finding, else the last)",
    )
    explain.add_argument("--svg", type=Path, metavar="FILE", help="also write the picture as SVG")


def _add_shrink_parser(sub: Any) -> None:
    """``kvfuzz shrink``: a failing scenario to a minimal reproducer."""
    shrink = sub.add_parser(
        "shrink",
        help="shrink a failing scenario to a minimal reproducer in corpora/regressions",
        description=(
            "Reduce FINDING (a campaign finding file or any scenario file) while the "
            "same finding signature still holds, then write it with its expected "
            "verdicts to OUT, named by signature (never overwriting a different case)."
        ),
    )
    shrink.add_argument("finding", type=Path, metavar="FINDING")
    _add_common(shrink)
    shrink.add_argument(
        "--signature",
        default=None,
        help="the signature to keep (default: the file's own, else its most severe finding's)",
    )
    shrink.add_argument(
        "--seconds",
        type=_seconds_budget,
        default=60.0,
        help="time budget in seconds (default: %(default)s)",
    )
    shrink.add_argument(
        "--out",
        type=Path,
        default=Path("corpora/regressions"),
        help="folder for the reproducer (default: %(default)s)",
    )


def _add_export_parser(sub: Any) -> None:
    """``kvfuzz export-test``: a standalone vLLM-style pytest."""
    export = sub.add_parser(
        "export-test",
        help="print a standalone vLLM-style pytest reproducing a finding",
        description=(
            "Print a pytest function that imports only vLLM, builds the managers with "
            "vLLM's public constructors, sends the scenario's requests and asserts the "
            "hit kvfuzz's oracle expects. It fails on stock vLLM 0.33.0 and passes "
            "with the fix (check with: pytest --kvfuzz-variant fixed FILE)."
        ),
    )
    export.add_argument("finding", type=Path, metavar="FINDING")
    _add_common(export)


def _add_diff_parser(sub: Any) -> None:
    diff = sub.add_parser(
        "diff",
        help="show what changed in prefix-cache behaviour between two variants",
        description=(
            "Run the corpus and a bounded campaign on variants A and B (e.g. "
            "release:0.32.0 unfixed) and print, grouped by root cause, the hits "
            "that differ (with the oracle's blame), the blocks kept that differ, "
            "findings on one side only and scenarios one side cannot run. Exit 0 "
            "when nothing differs, 1 otherwise."
        ),
    )
    diff.add_argument("a", metavar="A", help="the 'before' variant (any --variants name)")
    diff.add_argument("b", metavar="B", help="the 'after' variant")
    diff.add_argument(
        "--corpus",
        nargs="*",
        default=["corpora"],
        metavar="PATH",
        help="scenario files or folders to replay (default: corpora)",
    )
    diff.add_argument(
        "--seconds",
        type=float,
        default=30.0,
        help="campaign budget in seconds; 0 for no campaign (default: %(default)s)",
    )
    diff.add_argument(
        "--max-examples",
        type=int,
        default=None,
        metavar="N",
        help="campaign: stop after N generated inputs (default: only --seconds bounds it)",
    )
    diff.add_argument("--seed", type=int, default=1, help="campaign seed (default: %(default)s)")
    diff.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="per-scenario timeout for tree and release variants (default: %(default)s)",
    )
    diff.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        default=Policy.VLLM.value,
        help="checkpoint policy the oracle judges with (default: %(default)s)",
    )
    diff.add_argument("--json", action="store_true", help="print the report as JSON")


def _diff(args: argparse.Namespace) -> int:
    import math

    from differential.corpus import iter_scenario_files, load_entry
    from differential.reports.diff import run_diff

    for option, value in (("--seconds", args.seconds), ("--timeout", args.timeout)):
        if not math.isfinite(value) or value < 0 or (option == "--timeout" and value == 0):
            raise VariantError(f"{option} = {value!r} is invalid: allowed a positive number")
    if args.max_examples is not None and args.max_examples < 0:
        raise VariantError(f"--max-examples = {args.max_examples} is invalid: allowed N >= 0")
    a, b = parse_variants(f"{args.a},{args.b}", timeout_s=args.timeout)
    entries = [(str(path), load_entry(path).scenario) for path in iter_scenario_files(args.corpus)]
    report = run_diff(
        a,
        b,
        entries,
        seconds=args.seconds,
        max_examples=args.max_examples,
        seed=args.seed,
        policy=Policy(args.policy),
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        sys.stdout.write(report.render())
    return EXIT_FOUND if report.changes else EXIT_CLEAN


def _export_test(args: argparse.Namespace) -> int:
    variants = parse_variants(args.variants, timeout_s=args.timeout)
    entry = _load(args, args.finding)
    from differential.compare import compare_variants
    from differential.exports.manager_test import export_test
    from fuzz.signature import signature_of

    scenario = entry.scenario
    result = compare_variants(scenario, variants, policy=Policy(args.policy))
    if scenario.workload.mode is DriveMode.SCHEDULER:
        return _export_engine_test(args, entry, result)
    candidates = [
        (vr, f)
        for vr in result.results
        for f in vr.findings
        if f.request is not None and f.kind is not FindingKind.DENSE_MISMATCH
    ]
    if not candidates:
        raise ScenarioError(
            "FINDING", str(args.finding), "a scenario with a per-request finding to assert"
        )
    # The finding the file is about (its recorded signature), else the first.
    recorded = [
        (vr, f) for vr, f in candidates if signature_of(scenario, f).text == entry.signature
    ]
    variant_result, finding = (recorded or candidates)[0]
    fixed_hit = next(
        (
            vr.run.hits[finding.request]
            for vr in result.results
            if vr.variant.role is VariantRole.FIXED and finding.request < len(vr.run.hits)
        ),
        None,
    )
    source = export_test(
        scenario,
        finding,
        variant_result.references[finding.request],
        signature=signature_of(scenario, finding).text,
        name=scenario.name or args.finding.stem,
        fixed_hit_tokens=fixed_hit,
    )
    sys.stdout.write(source)
    return EXIT_CLEAN


def _export_engine_test(args: argparse.Namespace, entry: Any, result: Any) -> int:
    """``export-test`` for a scheduler-mode scenario: the test drives vLLM's
    ``Scheduler`` (:mod:`differential.exports.scheduler_test`)."""
    import dataclasses

    from differential.exports.scheduler_test import export_engine_test
    from fuzz.signature import signature_of

    scenario = entry.scenario
    exportable = {
        FindingKind.EVICTION_COLLAPSE,
        FindingKind.OVER_HIT,
        FindingKind.MISALIGNED,
        FindingKind.FALLBACK,
        FindingKind.MODE_MISMATCH,
    }
    candidates = [
        (vr, f)
        for vr in result.results
        for f in vr.findings
        if f.kind in exportable
        and (f.request is not None or f.kind is FindingKind.EVICTION_COLLAPSE)
    ]
    if not candidates:
        raise ScenarioError(
            "FINDING",
            str(args.finding),
            "a scheduler-mode scenario with an eviction-collapse, over-hit, misaligned, "
            "fallback or mode-mismatch finding",
        )
    recorded = [
        (vr, f) for vr, f in candidates if signature_of(scenario, f).text == entry.signature
    ]
    variant_result, finding = (recorded or candidates)[0]
    if scenario.workload.pool_blocks is None:  # the pool the run used, in blocks
        scenario = dataclasses.replace(
            scenario,
            workload=dataclasses.replace(
                scenario.workload, pool_blocks=variant_result.run.pool_blocks
            ),
        )
    sys.stdout.write(
        export_engine_test(
            scenario,
            finding,
            signature=signature_of(entry.scenario, finding).text,
            name=scenario.name or args.finding.stem,
        )
    )
    return EXIT_CLEAN


def _shrink(args: argparse.Namespace) -> int:
    from differential.corpus import write_atomic

    variants = parse_variants(args.variants, timeout_s=args.timeout)
    entry = _load(args, args.finding)
    wanted = args.signature or entry.signature
    from differential.reports.outputs import check_output_folder

    check_output_folder(args.out, "--out")
    from differential.compare import compare_variants
    from differential.driver import VLLM_VERSION
    from fuzz.campaign import finding_document
    from fuzz.minimize import shrink
    from fuzz.signature import signature_of

    policy = Policy(args.policy)
    result = compare_variants(entry.scenario, variants, policy=policy)
    by_severity = sorted(result.findings, key=lambda f: SEVERITY[f.kind])
    signatures = [signature_of(entry.scenario, f) for f in by_severity]
    if not signatures:
        raise ScenarioError("FINDING", str(args.finding), "a scenario that shows a finding")
    if wanted is None:
        signature = signatures[0]
    else:
        matching = [sig for sig in signatures if sig.text == wanted]
        if not matching:
            shown = "; ".join(sorted({sig.text for sig in signatures}))
            raise ScenarioError("--signature", wanted, f"one the scenario shows: {shown}")
        signature = matching[0]
    print(f"shrinking for: {signature.text}")
    outcome = shrink(
        entry.scenario,
        signature,
        variants,
        policy=policy,
        seconds=args.seconds,
        progress=lambda line: print(f"  {line}", flush=True),
    )
    small = dataclasses.replace(
        outcome.scenario,
        name=signature.slug,
        description=f"Shrunk by kvfuzz shrink from {args.finding.name}: {signature.text}",
    )
    # The reproducer records both sides of the fix, whatever was shrunk against.
    names = dict.fromkeys([v.name for v in variants] + list(DEFAULT_VARIANTS))
    final = compare_variants(small, parse_variants(",".join(names)), policy=policy)
    document = finding_document(
        small, final, signature, seed=None, example=None, vllm_version=VLLM_VERSION
    )
    text = json.dumps(document, indent=2) + "\n"
    out = args.out / f"{signature.slug}.json"
    counter = 2
    while out.exists() and out.read_text(encoding="utf-8") != text:
        out = args.out / f"{signature.slug}-{counter}.json"
        counter += 1
    write_atomic(out, text)
    s = small
    print(
        f"{'timed out' if outcome.timed_out else 'done'} after {outcome.checks} checks in "
        f"{outcome.elapsed_s:.1f} s: {len(s.requests)} requests, shared prefix "
        f"{s.shared_prefix_tokens}, retention {s.retention_interval_tokens}, blocks "
        f"{[g.block_size_tokens for g in s.kv_cache_groups]}, windows "
        f"{[g.sliding_window_tokens for g in s.sliding_window_groups]}"
    )
    print(f"reproducer: {out}")
    return EXIT_CLEAN  # shrinking succeeded; the reproducer's findings are in the file


def _explain(args: argparse.Namespace) -> int:
    from differential.corpus import write_atomic

    variants = parse_variants(args.variants, timeout_s=args.timeout)
    entry = _load(args, args.scenario)
    scenario = entry.scenario
    if args.svg is not None:
        from differential.reports.outputs import check_output_file

        check_output_file(args.svg, "--svg")
    if args.request is not None and not 0 <= args.request < len(scenario.requests):
        raise ScenarioError(
            "--request", args.request, f"0..{len(scenario.requests) - 1} (the scenario's requests)"
        )
    from differential.compare import compare_variants
    from differential.exports.explain import explain_request, render_svg, render_text

    result = compare_variants(scenario, variants, policy=Policy(args.policy))
    request = args.request
    if request is None:
        flagged = sorted(
            f.request for f in result.findings if f.request is not None and f.request > 0
        )
        request = flagged[0] if flagged else len(scenario.requests) - 1
    engine = scenario.workload.mode is DriveMode.SCHEDULER
    if engine:
        from differential.exports.explain import render_timeline

        sys.stdout.write(render_timeline(result, request))
    exp = explain_request(result, request)
    if exp is None:
        if engine:  # judged per lookup as scheduled: the timeline is the picture
            return EXIT_FOUND if result.findings else EXIT_CLEAN
        raise ScenarioError("--request", request, "a request every variant completed")
    sys.stdout.write(render_text(exp))
    if args.svg is not None:
        write_atomic(args.svg, render_svg(exp))
        print(f"SVG: {args.svg}")
    return EXIT_FOUND if result.findings else EXIT_CLEAN


def _import_crash(args: argparse.Namespace) -> int:
    variants = parse_variants(args.variants, timeout_s=args.timeout)
    buffers = []
    for path in args.crashes:
        try:
            buffers.append((path, path.read_bytes()))
        except OSError as exc:
            raise ScenarioError("CRASH", str(path), f"a readable file ({exc.strerror})") from None
    from differential.reports.outputs import check_output_folder

    check_output_folder(args.out, "--out")
    from differential.compare import compare_variants
    from differential.corpus import write_atomic
    from differential.driver import VLLM_VERSION
    from fuzz.campaign import finding_document
    from fuzz.signature import signature_of
    from fuzz.target import decode

    found = False
    for path, buffer in buffers:
        scenario = decode(buffer, DriveMode(args.mode or "manager"))
        if scenario is None:
            print(f"{path}: decodes to no scenario (too short for the strategy)", file=sys.stderr)
            continue
        result = compare_variants(scenario, variants, policy=Policy(args.policy))
        if result.findings:
            found = True
            first = min(result.findings, key=lambda f: SEVERITY[f.kind])
            signature = signature_of(scenario, first)
            name = f"{signature.slug}.json"
        else:
            signature, name = None, f"{path.name}.json"
        document = (
            finding_document(
                scenario, result, signature, seed=None, example=None, vllm_version=VLLM_VERSION
            )
            if signature is not None
            else {**scenario.to_dict(), "notes": f"imported from {path.name}"}
        )
        out = args.out / name
        write_atomic(out, json.dumps(document, indent=2) + "\n")
        verdict = signature.text if signature is not None else "no finding"
        print(f"{path} -> {out}: {verdict}")
    return EXIT_FOUND if found else EXIT_CLEAN


def _fuzz(args: argparse.Namespace) -> int:
    variants = parse_variants(args.variants, timeout_s=args.timeout)
    kinds = _group_kinds(args.groups)
    if args.shrink_seconds <= 0:
        raise VariantError(f"--shrink-seconds must be > 0, got {args.shrink_seconds}")
    known = args.known_corpus
    if known is None:
        known = [p for p in (Path("corpora"), Path("known-issues")) if p.is_dir()]
    from differential.corpus import iter_scenario_files

    iter_scenario_files([str(p) for p in known])  # bad paths are usage errors, now
    from differential.reports.outputs import check_output_folder

    check_output_folder(args.out, "--out")
    for sub in ("findings", "hypothesis-db", "pictures"):
        check_output_folder(args.out / sub, f"--out ({sub}/)")
    _check_ci_outputs(args)
    _keep_earlier_run(args.out)
    from fuzz.campaign import CampaignConfig
    from fuzz.parallel import run_parallel

    summary = run_parallel(
        CampaignConfig(
            out=args.out,
            variants=variants,
            seed=args.seed,
            seconds=args.seconds or None,
            max_examples=args.max_examples,
            policy=Policy(args.policy),
            dense_cross_check=not args.no_dense_check,
            shrink_seconds=None if args.no_shrink else args.shrink_seconds,
            known_corpus=tuple(known),
            group_kinds=kinds,
            mode=DriveMode(args.mode or "manager"),
        ),
        args.jobs,
        quiet=args.quiet,
    )
    _campaign_reports(args, summary)
    first = summary["first_finding_s"]
    print(
        f"{summary['examples']} examples in {summary['elapsed_s']:.1f} s "
        f"({summary['executions_per_s']:.1f} executions/s); "
        f"{len(summary['distinct'])} distinct finding(s)"
        + (f", first after {first:.2f} s" if first is not None else "")
        + (" [interrupted]" if summary["interrupted"] else "")
    )
    causes = summary.get("root_causes", [])
    new = [c for c in causes if c["status"] == "new"]
    print(f"{len(causes)} root cause(s), {len(new)} new:")
    for cause in causes:
        status = "NEW  " if cause["status"] == "new" else "known"
        print(
            f"  {status} {cause['count']:>5} x {cause['root_cause']} "
            f"[{', '.join(cause['variants'])}]\n          {cause['reproducer']}"
        )
    print(f"summary: {args.out / 'summary.json'}; report: {args.out / 'report.md'}")
    failed = summary.get("failed_jobs") or []
    for job in failed:
        where = f"traceback in {job['traceback']}" if job["traceback"] else "no traceback saved"
        print(
            f"kvfuzz: internal error: job {job['job']} died without finishing "
            f"(exit status {job['exit_status']}; {where})",
            file=sys.stderr,
        )
    if failed:
        return EXIT_INTERNAL
    if args.fail_on == "new":
        tested = {v.name for v in variants}
        return EXIT_FOUND if any(tested & set(c["variants"]) for c in new) else EXIT_CLEAN
    return EXIT_FOUND if summary["distinct"] else EXIT_CLEAN


def _keep_earlier_run(out: Path) -> None:
    """Move an earlier campaign's summary.json and report.md (a rerun into the
    same folder) to ``OUT/earlier-runs/<n>/`` instead of overwriting them."""
    earlier = [out / name for name in ("summary.json", "report.md") if (out / name).is_file()]
    if not earlier:
        return
    runs = out / "earlier-runs"
    number = 1
    while (runs / str(number)).exists():
        number += 1
    (runs / str(number)).mkdir(parents=True)
    for path in earlier:
        path.rename(runs / str(number) / path.name)
    print(
        f"kvfuzz: {out} holds an earlier run: its summary and report moved to "
        f"{runs / str(number)}; its findings stay in {out / 'findings'}",
        file=sys.stderr,
    )


def _check_ci_outputs(args: argparse.Namespace) -> None:
    from differential.reports.outputs import check_output_file

    if args.junit_xml is not None:
        check_output_file(args.junit_xml, "--junit-xml")
    if args.sarif is not None:
        check_output_file(args.sarif, "--sarif")


def _group_kinds(text: str) -> frozenset[GroupKind]:
    """``--groups``: comma-separated ``GroupKind`` values (empty: none pinned).

    Raises:
        VariantError: an unknown kind (exit 2, naming the allowed values).
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    allowed = ", ".join(k.value for k in GroupKind)
    for name in names:
        if name not in {k.value for k in GroupKind}:
            raise VariantError(f"--groups: unknown group kind {name!r}; allowed: {allowed}")
    return frozenset(GroupKind(n) for n in names)


def _campaign_reports(args: argparse.Namespace, summary: dict[str, object]) -> None:
    """report.md (with explain pictures) and the CI reports for a campaign.

    Each root cause's reproducer (the shrunk one if there is one, else its
    first scenario) is replayed (finding files are self-contained), so the
    reports are the same for one job or many. The CI reports list the root
    causes in the summary's order: new ones first.
    """
    from differential.compare import compare_variants
    from differential.corpus import load_entry, write_atomic
    from differential.triage.identity import RootCause, triage
    from fuzz.report import campaign_markdown, root_cause_pictures

    variants = parse_variants(args.variants, timeout_s=args.timeout)
    if summary["interrupted"] or summary.get("failed_jobs"):
        # Stopping must be quick, and a failed campaign must not fail again
        # here: no replays (nor a vLLM import in the parent).
        write_atomic(args.out / "report.md", campaign_markdown(summary, {}, args.out))
        if args.junit_xml is not None or args.sarif is not None:
            why = "interrupted" if summary["interrupted"] else "a job failed"
            print(
                f"kvfuzz: {why}: JUnit/SARIF not written; "
                f"`kvfuzz replay {args.out / 'findings'}` writes them",
                file=sys.stderr,
            )
        return
    items = []
    results = []
    for cause in summary.get("root_causes", []):  # type: ignore[attr-defined]
        path = Path(cause["shrunk"] or cause["file"])
        if not path.exists():
            continue
        loaded = load_entry(path)
        result = compare_variants(
            loaded.scenario, variants, policy=Policy(args.policy), source=str(path)
        )
        target = RootCause.from_dict(cause["identity"])
        shown = [t for t in triage(result) if t.root_cause == target]
        request = next((t.finding.request for t in shown if t.finding.request), None)
        if request is not None:
            items.append((cause["root_cause"], result, request))
        results.append(result)
    pictures = root_cause_pictures(items, args.out / "pictures")
    write_atomic(args.out / "report.md", campaign_markdown(summary, pictures, args.out))
    _write_ci_reports(args, results)


def _calibrate(args: argparse.Namespace) -> int:
    from differential.corpus import iter_scenario_files

    entries = [_load(args, path) for path in iter_scenario_files(args.paths)]
    from differential.reports.calibration import mutation_table, render_table

    rows, noisy = mutation_table(entries)
    sys.stdout.write(render_table(rows, noisy))
    return EXIT_CLEAN if all(row.caught_by for row in rows) else EXIT_FOUND


def _replay(args: argparse.Namespace) -> int:
    from differential.bounds import scenario_cost
    from differential.corpus import expectation_problems, iter_scenario_files, write_atomic

    variants = parse_variants(args.variants, timeout_s=args.timeout)
    policy = Policy(args.policy)
    # Validate every input (and its cost) and every output path before running anything.
    entries = [_load(args, path) for path in iter_scenario_files(args.paths)]
    _check_ci_outputs(args)
    if args.report is not None:
        from differential.reports.outputs import check_output_file

        check_output_file(args.report, "--report")

    from differential.compare import compare_variants
    from differential.driver import VLLM_VERSION, fix_status
    from differential.reports.table import printable, render_json, render_text

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
    notices += [f"{entry.path}: {entry.plan}" for entry in entries if entry.plan]
    results = []
    for index, entry in enumerate(entries, 1):
        # Progress on stderr, one line per scenario, its cost stated before it runs.
        print(
            f"[{index}/{len(entries)}] {entry.path}: {scenario_cost(entry.scenario).describe()}",
            file=sys.stderr,
            flush=True,
        )
        results.append(
            compare_variants(
                entry.scenario,
                variants,
                policy=policy,
                source=str(entry.path),
                dense_cross_check=not args.no_dense_check,
            )
        )
    # A corpus file's `expect` block is checked too: a contradiction fails like a finding.
    contradictions = [
        (entry.path, problem)
        for entry, result in zip(entries, results, strict=True)
        for problem in expectation_problems(entry, result)
    ]
    report = render_json(results, VLLM_VERSION, policy, notices)
    report["expectations_failed"] = [
        {"file": str(path), "problem": problem} for path, problem in contradictions
    ]
    _write_ci_reports(args, results)
    if args.report is not None:
        write_atomic(args.report, json.dumps(report, indent=2) + "\n")
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(render_text(results, VLLM_VERSION, notices))
        for path, problem in contradictions:
            sys.stdout.write(f"! expectation not met: {printable(str(path))}: {problem}\n")
        sys.stdout.write(f"({time.perf_counter() - started:.1f} s after importing vLLM)\n")
    found = any(r.findings for r in results) or bool(contradictions)
    return EXIT_FOUND if found else EXIT_CLEAN


def _one_line(text: str) -> str:
    """``text`` on one line, at most about ``_MESSAGE_CHARS`` characters.

    Keeps both ends: the start says what failed, the end of a traceback (a
    tree worker's stderr) says why.
    """
    flat = " ".join(text.split())
    if len(flat) > _MESSAGE_CHARS:
        half = (_MESSAGE_CHARS - 40) // 2
        flat = f"{flat[:half]} ... ({len(flat)} chars) ... {flat[-half:]}"
    return flat


def save_traceback(exc: BaseException, argv: Sequence[str] | None = None) -> Path | None:
    """Write ``exc``'s full traceback to a new file in the temporary folder.

    Returns:
        The file, or ``None`` if it could not be written.
    """
    try:
        text = "".join(traceback.format_exception(exc))
    except RecursionError:
        text = f"{type(exc).__name__} (traceback too deep to format)\n"
    header = f"kvfuzz {' '.join(sys.argv[1:] if argv is None else argv)}\n\n"
    try:
        fd, name = tempfile.mkstemp(prefix="kvfuzz-traceback-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as handle:
            handle.write(header + text)
    except OSError:
        return None
    return Path(name)


def internal_failure(exc: BaseException, argv: Sequence[str] | None = None) -> int:
    """Report kvfuzz's own failure in one line (traceback saved to a file): exit 3."""
    saved = save_traceback(exc, argv)
    where = f"full traceback in {saved}" if saved else "the traceback could not be saved"
    if isinstance(exc, InternalError):
        detail = str(exc).removeprefix("kvfuzz ")
    else:
        detail = f"internal error (please report): {type(exc).__name__}: {exc}"
    print(f"kvfuzz: {_one_line(detail)} [{where}]", file=sys.stderr, flush=True)
    return EXIT_INTERNAL


def _mutate(args: argparse.Namespace) -> int:
    from differential.variants.mutation import run_mutate_command

    return run_mutate_command(args)


_COMMANDS = {
    "replay": _replay,
    "calibrate": _calibrate,
    "fuzz": _fuzz,
    "import-crash": _import_crash,
    "explain": _explain,
    "shrink": _shrink,
    "export-test": _export_test,
    "diff": _diff,
    "mutate": _mutate,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvfuzz`` console script; returns the exit code.

    0 clean, 1 findings, 2 bad input or usage, 3 kvfuzz's own failure,
    130 interrupted outside a campaign (a campaign keeps what it found).
    """
    args = _parser().parse_args(argv)
    command = _COMMANDS.get(args.command)
    if command is None:
        return internal_failure(InternalError(f"unhandled command {args.command!r}"), argv)
    try:
        return command(args)
    except (ScenarioError, VariantError) as exc:
        print(f"kvfuzz: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvfuzz: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        return internal_failure(exc, argv)


if __name__ == "__main__":
    sys.exit(main())

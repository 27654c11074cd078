"""The ``kvfuzz`` command line.

Exit codes: 0 when the variants under test are clean, 1 when anything is
found, 2 for bad input or usage (the message names the field or option and
what is allowed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from differential.errors import ScenarioError, VariantError
from differential.findings import SEVERITY, Policy
from differential.scenario import GroupKind
from differential.variants import (
    DEFAULT_VARIANTS,
    VariantRole,
    known_variants,
    parse_variants,
)

__all__ = ["main"]

EXIT_CLEAN, EXIT_FOUND, EXIT_USAGE = 0, 1, 2


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
        type=float,
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
    from differential.ci_reports import dumps_sarif, github_annotations, junit_xml
    from differential.corpus import write_atomic

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
    fuzz = sub.add_parser(
        "fuzz",
        help="run a fuzz campaign over the scenario space",
        description=(
            "Generate scenarios (Hypothesis strategies, driven by bytes from --seed), "
            "run them on the variants and keep one file per distinct finding in "
            "OUT/findings. The same seed and versions give the same findings. "
            "Ctrl-C stops cleanly and keeps what was found."
        ),
    )
    _add_common(fuzz)
    fuzz.add_argument("--seed", type=int, default=0, help="campaign seed (default: %(default)s)")
    fuzz.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="wall-time budget in seconds, after vLLM is imported; 0 for none "
        "(default: %(default)s)",
    )
    fuzz.add_argument(
        "--max-examples",
        type=int,
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
        "(full_attention, sliding_window, mamba; e.g. --groups mamba for Mamba "
        "hybrids only; default: any layout)",
    )
    fuzz.add_argument("--quiet", action="store_true", help="no progress display")
    fuzz.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="worker processes, each importing vLLM once (default: %(default)s)",
    )
    _add_ci_reports(fuzz)
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
        "--seconds", type=float, default=60.0, help="time budget (default: %(default)s)"
    )
    shrink.add_argument(
        "--out",
        type=Path,
        default=Path("corpora/regressions"),
        help="folder for the reproducer (default: %(default)s)",
    )
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
    return parser


def _export_test(args: argparse.Namespace) -> int:
    from differential.corpus import load_entry

    variants = parse_variants(args.variants, timeout_s=args.timeout)
    entry = load_entry(args.finding)
    from differential.compare import compare_variants
    from differential.export import export_test
    from differential.findings import FindingKind
    from fuzz.signature import signature_of

    scenario = entry.scenario
    result = compare_variants(scenario, variants, policy=Policy(args.policy))
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
    variant_result, finding = candidates[0]
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


def _shrink(args: argparse.Namespace) -> int:
    from differential.corpus import load_entry, write_atomic

    variants = parse_variants(args.variants, timeout_s=args.timeout)
    entry = load_entry(args.finding)
    raw = json.loads(args.finding.read_text(encoding="utf-8"))
    wanted = args.signature or (raw.get("finding") or {}).get("signature")
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
    return EXIT_FOUND


def _explain(args: argparse.Namespace) -> int:
    from differential.corpus import load_entry, write_atomic

    variants = parse_variants(args.variants, timeout_s=args.timeout)
    entry = load_entry(args.scenario)
    scenario = entry.scenario
    if args.request is not None and not 0 <= args.request < len(scenario.requests):
        raise ScenarioError(
            "--request", args.request, f"0..{len(scenario.requests) - 1} (the scenario's requests)"
        )
    from differential.compare import compare_variants
    from differential.explain import explain_request, render_svg, render_text

    result = compare_variants(scenario, variants, policy=Policy(args.policy))
    request = args.request
    if request is None:
        flagged = sorted(
            f.request for f in result.findings if f.request is not None and f.request > 0
        )
        request = flagged[0] if flagged else len(scenario.requests) - 1
    exp = explain_request(result, request)
    if exp is None:
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
    from differential.compare import compare_variants
    from differential.corpus import write_atomic
    from differential.driver import VLLM_VERSION
    from fuzz.campaign import finding_document
    from fuzz.signature import signature_of
    from fuzz.target import decode

    found = False
    for path, buffer in buffers:
        scenario = decode(buffer)
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
    if args.seconds < 0:
        raise VariantError(f"--seconds must be >= 0, got {args.seconds}")
    if args.max_examples is not None and args.max_examples < 1:
        raise VariantError(f"--max-examples must be >= 1, got {args.max_examples}")
    if args.out.exists() and not args.out.is_dir():
        raise VariantError(f"--out {args.out} exists and is not a folder")
    if args.jobs < 1:
        raise VariantError(f"--jobs must be >= 1, got {args.jobs}")
    kinds = _group_kinds(args.groups)
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
            group_kinds=kinds,
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
    for entry in summary["distinct"]:
        print(f"  {entry['count']:>5} x {entry['signature']}\n          {entry['file']}")
    print(f"summary: {args.out / 'summary.json'}; report: {args.out / 'report.md'}")
    return EXIT_FOUND if summary["distinct"] else EXIT_CLEAN


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

    The distinct finding files are replayed (they are self-contained), so the
    reports are the same for one job or many.
    """
    from differential.compare import compare_variants
    from differential.corpus import load_entry, write_atomic
    from fuzz.report import campaign_markdown, explain_pictures

    variants = parse_variants(args.variants, timeout_s=args.timeout)
    items = []
    results = []
    for entry in summary["distinct"][:200]:  # type: ignore[index]
        path = Path(entry["file"])
        if not path.exists():
            continue
        loaded = load_entry(path)
        result = compare_variants(
            loaded.scenario, variants, policy=Policy(args.policy), source=str(path)
        )
        items.append((path.stem, loaded.scenario, result))
        results.append(result)
    pictures = explain_pictures(items, args.out / "pictures")
    write_atomic(args.out / "report.md", campaign_markdown(summary, pictures, args.out))
    _write_ci_reports(args, results)


def _calibrate(args: argparse.Namespace) -> int:
    from differential.corpus import iter_scenario_files, load_entry

    entries = [load_entry(path) for path in iter_scenario_files(args.paths)]
    from differential.calibrate import mutation_table, render_table

    rows, noisy = mutation_table(entries)
    sys.stdout.write(render_table(rows, noisy))
    return EXIT_CLEAN if all(row.caught_by for row in rows) else EXIT_FOUND


def _replay(args: argparse.Namespace) -> int:
    from differential.corpus import iter_scenario_files, load_entry, write_atomic

    variants = parse_variants(args.variants, timeout_s=args.timeout)
    policy = Policy(args.policy)
    # Validate every input before running anything.
    entries = [load_entry(path) for path in iter_scenario_files(args.paths)]

    started = time.perf_counter()
    from differential.compare import compare_variants
    from differential.driver import VLLM_VERSION, fix_status
    from differential.report import render_json, render_text

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
    results = [
        compare_variants(
            entry.scenario,
            variants,
            policy=policy,
            source=str(entry.path),
            dense_cross_check=not args.no_dense_check,
        )
        for entry in entries
    ]
    report = render_json(results, VLLM_VERSION, policy, notices)
    _write_ci_reports(args, results)
    if args.report is not None:
        write_atomic(args.report, json.dumps(report, indent=2) + "\n")
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(render_text(results, VLLM_VERSION, notices))
        sys.stdout.write(f"({time.perf_counter() - started:.1f} s after importing vLLM)\n")
    return EXIT_FOUND if any(r.findings for r in results) else EXIT_CLEAN


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvfuzz`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "replay":
            return _replay(args)
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "fuzz":
            return _fuzz(args)
        if args.command == "import-crash":
            return _import_crash(args)
        if args.command == "explain":
            return _explain(args)
        if args.command == "shrink":
            return _shrink(args)
        if args.command == "export-test":
            return _export_test(args)
    except (ScenarioError, VariantError) as exc:
        print(f"kvfuzz: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())

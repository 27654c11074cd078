"""``kvfuzz fuzz``: a campaign of generated scenarios, its report and CI reports."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import IO, Any

from differential.commands.options import (
    EXIT_CLEAN,
    EXIT_FOUND,
    EXIT_INTERNAL,
    MAX_JOBS,
    add_ci_reports,
    add_common,
    check_ci_outputs,
    jobs,
    outputs_failed,
    positive_int,
    seconds_budget,
    timeout_seconds,
    write_ci_reports,
)
from differential.errors import ScenarioError, VariantError
from differential.files import project_root
from differential.findings import Policy
from differential.scenario import DriveMode, GroupKind
from differential.variants import (
    Variant,
    parse_variants,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
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
    add_common(fuzz)
    fuzz.add_argument("--seed", type=int, default=0, help="campaign seed (default: %(default)s)")
    fuzz.add_argument(
        "--seconds",
        type=seconds_budget,
        default=60.0,
        help="wall-time budget in seconds, after vLLM is imported; 0 for none "
        "(default: %(default)s)",
    )
    fuzz.add_argument(
        "--max-examples",
        type=positive_int,
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
        default=None,
        metavar="KINDS",
        help="comma-separated KV cache group kinds every scenario contains "
        f"({', '.join(k.value for k in GroupKind)}; e.g. --groups mamba for Mamba "
        "hybrids only; default: any layout)",
    )
    fuzz.add_argument("--quiet", action="store_true", help="no progress display")
    fuzz.add_argument(
        "--jobs",
        type=jobs,
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
        type=timeout_seconds,
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
        "(repeatable; default: the project's corpora/ and known-issues/, found beside "
        "the installed differential package whatever the working directory)",
    )
    fuzz.add_argument(
        "--fail-on",
        choices=("any", "new"),
        default="any",
        help="exit 1 for any finding, or only for new root causes on the variants "
        "under test (default: %(default)s)",
    )
    add_ci_reports(fuzz)


def run(args: argparse.Namespace) -> int:
    variants = parse_variants(args.variants, timeout_s=args.timeout)
    kinds = _group_kinds(args.groups)
    known = args.known_corpus
    if known is None:
        known = default_known_corpus()
        if not known:
            print(
                "kvfuzz: warning: no known corpus found (looked for corpora/ and "
                f"known-issues/ in {project_root()}): every root cause will show as NEW; "
                "pass --known-corpus PATH",
                file=sys.stderr,
            )
    from differential.corpus import iter_scenario_files, load_entry
    from differential.reports.outputs import check_output_file, check_output_folder

    # Output paths first: a known corpus with model-level files imports vLLM
    # (its planner resolves their groups).
    check_output_folder(args.out, "--out")
    for sub in ("findings", "hypothesis-db", "pictures", "earlier-runs", "shrunk"):
        check_output_folder(args.out / sub, f"--out ({sub}/)")
    reports = [(f"--out ({name})", args.out / name) for name in ("report.md", "summary.json")]
    for option, path in reports:
        check_output_file(path, option)
    check_ci_outputs(args, others=reports)
    # Bad paths and bad files are usage errors, now (not skipped later); JSON
    # that is no scenario is left out (the campaign reports skipped files).
    for path in iter_scenario_files([str(p) for p in known], skipped=None):
        load_entry(path)
    lock = _lock_out(args.out)
    try:
        _keep_earlier_run(args.out)
        return _campaign(args, variants, kinds, known)
    finally:
        lock.close()


def _lock_out(out: Path) -> IO[str]:
    """Hold ``OUT/.kvfuzz-campaign.lock`` for the campaign: a second campaign
    on the same ``--out`` would overwrite this one's summary and report.

    Raises:
        ScenarioError: another campaign holds the folder (exit 2).
        OSError: the lock could not be written (a full disk), naming it.
    """
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    path = out / ".kvfuzz-campaign.lock"
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ScenarioError(
            "--out", str(out), f"a folder no other campaign is writing ({holder} is)"
        ) from None
    try:
        handle.truncate(0)
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
    except OSError as exc:
        with contextlib.suppress(OSError):
            handle.close()
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    return handle


def _campaign(
    args: argparse.Namespace,
    variants: tuple[Variant, ...],
    kinds: frozenset[GroupKind],
    known: list[Path],
) -> int:
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
    problems = _campaign_reports(args, summary)
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
        # A new cause's reproducer is the campaign's own file, named from OUT.
        where = args.out / cause["reproducer"] if cause["status"] == "new" else cause["reproducer"]
        print(
            f"  {status} {cause['count']:>5} x {cause['root_cause']} "
            f"[{', '.join(cause['variants'])}]\n          {where}"
        )
    print(f"summary: {args.out / 'summary.json'}; report: {args.out / 'report.md'}")
    failed = summary.get("failed_jobs") or []
    for job in failed:
        where = (
            f"traceback in {args.out / job['traceback']}"
            if job["traceback"]
            else "no traceback saved"
        )
        print(
            f"kvfuzz: internal error: job {job['job']} died without finishing "
            f"(exit status {job['exit_status']}; {where})",
            file=sys.stderr,
        )
    if failed:
        return EXIT_INTERNAL
    if problems:
        raise outputs_failed(problems)  # after everything else was written and printed
    if args.fail_on == "new":
        tested = {v.name for v in variants}
        return EXIT_FOUND if any(tested & set(c["variants"]) for c in new) else EXIT_CLEAN
    return EXIT_FOUND if summary["distinct"] else EXIT_CLEAN


def default_known_corpus() -> list[Path]:
    """``--known-corpus``'s default: the project's ``corpora/`` and
    ``known-issues/`` folders, resolved from the package (not from the working
    directory), those that exist; empty when neither does."""
    root = project_root()
    found = [p for p in (root / "corpora", root / "known-issues") if p.is_dir()]
    cwd = Path.cwd().resolve()
    # Relative to the working directory where they lie under it (reproducers
    # then read as ``corpora/...``), absolute elsewhere.
    return [p.relative_to(cwd) if p.is_relative_to(cwd) else p for p in found]


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


def _group_kinds(text: str | None) -> frozenset[GroupKind]:
    """``--groups``: comma-separated ``GroupKind`` values (``None``: none pinned).

    Raises:
        VariantError: an unknown kind (exit 2, naming the allowed values).
    """
    if text is None:
        return frozenset()
    names = [n.strip() for n in text.split(",") if n.strip()]
    allowed = ", ".join(k.value for k in GroupKind)
    if not names:
        raise VariantError(f"--groups {text!r} names no group kind; allowed: {allowed}")
    for name in names:
        if name not in {k.value for k in GroupKind}:
            raise VariantError(f"--groups: unknown group kind {name!r}; allowed: {allowed}")
    return frozenset(GroupKind(n) for n in names)


def _campaign_reports(args: argparse.Namespace, summary: dict[str, object]) -> list[str]:
    """report.md (with explain pictures) and the CI reports for a campaign;
    returns the CI reports that could not be written.

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
        return []
    items = []
    results = []
    known = [
        RootCause.from_dict(cause["identity"])
        for cause in summary.get("root_causes", [])  # type: ignore[attr-defined]
        if cause["status"] != "new"
    ]
    for cause in summary.get("root_causes", []):  # type: ignore[attr-defined]
        path = args.out / (cause["shrunk"] or cause["file"])  # named from OUT
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
    return write_ci_reports(args, results, known)

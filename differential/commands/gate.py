"""``kvfuzz gate [PATH]``: judge a vLLM pull request's tree against its base."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from differential.commands.options import (
    EXIT_CLEAN,
    EXIT_FOUND,
    EXIT_USAGE,
    add_ci_reports,
    add_policy,
    check_ci_outputs,
    outputs_failed,
    seconds_budget,
    timeout_seconds,
    write_ci_reports,
    write_output,
)
from differential.errors import VariantError
from differential.findings import Policy

__all__ = ["DEFAULT_SECONDS", "add_parser", "bundled_corpus", "run"]

DEFAULT_SECONDS = 120.0
_ROOT = Path(__file__).resolve().parents[2]  # kvfuzz's source folder (corpora/ beside it)
BUNDLED = ("corpora", "known-issues")


def bundled_corpus() -> list[Path]:
    """kvfuzz's own ``corpora/`` and ``known-issues/`` (beside its code).

    Raises:
        VariantError: they are not there (kvfuzz installed from a wheel).
    """
    folders = [_ROOT / name for name in BUNDLED]
    missing = [str(f) for f in folders if not f.is_dir()]
    if missing:
        raise VariantError(
            f"--corpus: kvfuzz's bundled {' and '.join(missing)} are missing (kvfuzz installed "
            "without its source); allowed: install kvfuzz from a checkout (pip install -e "
            "PATH), or name scenario files or folders with --corpus PATH"
        )
    return folders


def add_parser(sub: Any) -> None:
    """``kvfuzz gate``: the pull-request gate."""
    gate = sub.add_parser(
        "gate",
        help="judge a vLLM checkout's working tree (a pull request) against its base",
        description=(
            "In a vLLM git checkout (PATH), run kvfuzz's bundled corpora/ and known-issues/ "
            "and a bounded campaign on the base (--base, default: the merge base with "
            "origin/HEAD, main or master) and on the head (the working tree, or --head), "
            "each a tree variant, and print a review: findings new on the head, findings "
            "it resolves, findings both have, hits and blocks kept that differ, each with "
            "a reproducer file in --out and the command that exports it as a test. "
            "Progress goes to stderr. Exit 0 when the head introduces nothing, 1 when it "
            "does, 2 for bad input (not a git checkout, a ref that does not resolve), 3 "
            "for kvfuzz's own failure (a worker that cannot start: what was found before "
            "is printed and written)."
        ),
    )
    gate.add_argument(
        "path",
        nargs="?",
        default=".",
        type=Path,
        metavar="PATH",
        help="the vLLM git checkout's top folder (default: the current folder)",
    )
    gate.add_argument(
        "--base",
        metavar="REF",
        help="the base commit (default: the merge base of the head with origin/HEAD, "
        "else main, else master)",
    )
    gate.add_argument(
        "--head",
        metavar="REF",
        help="the head commit (default: the working tree, uncommitted changes included)",
    )
    gate.add_argument(
        "--corpus",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="scenario files or folders to replay instead of kvfuzz's bundled corpora/ and "
        "known-issues/",
    )
    gate.add_argument(
        "--seconds",
        type=seconds_budget,
        default=DEFAULT_SECONDS,
        help="campaign budget in seconds; 0 for no campaign: no generated scenario at all "
        "(default: %(default)s)",
    )
    gate.add_argument(
        "--max-examples",
        type=int,
        default=None,
        metavar="N",
        help="campaign: also stop after N generated inputs (default: only --seconds bounds it)",
    )
    gate.add_argument("--seed", type=int, default=1, help="campaign seed (default: %(default)s)")
    gate.add_argument(
        "--out",
        type=Path,
        default=Path("kvfuzz-gate"),
        metavar="DIR",
        help="where the reproducers and report.txt / report.json go (default: %(default)s)",
    )
    gate.add_argument(
        "--database",
        type=Path,
        default=Path(".hypothesis/examples"),
        metavar="DIR",
        help="Hypothesis's example database: replayed before the campaign, and each input "
        "with a finding saved there (default: %(default)s, Hypothesis's own folder; keep it "
        "between CI runs)",
    )
    gate.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=60.0,
        metavar="SECONDS",
        help="per-scenario timeout in each tree's worker (default: %(default)s)",
    )
    add_policy(gate)
    gate.add_argument("--json", action="store_true", help="print the report as JSON")
    add_ci_reports(gate)


def _check_outputs(args: argparse.Namespace) -> None:
    from differential.reports.outputs import check_output_folder

    check_output_folder(args.out, "--out")
    if args.seconds > 0:
        check_output_folder(args.database, "--database")
    check_ci_outputs(args)


def run(args: argparse.Namespace) -> int:
    from differential.corpus import iter_scenario_files, load_entry
    from fuzz.gate import gate_trees, gate_variants, run_gate

    if args.max_examples is not None and args.max_examples < 0:
        raise VariantError(f"--max-examples = {args.max_examples} is invalid: allowed N >= 0")
    trees = gate_trees(args.path, args.base, args.head)
    folders = args.corpus or bundled_corpus()
    _check_outputs(args)
    files = list(iter_scenario_files(folders))
    if not files and args.seconds == 0:
        raise VariantError(
            "--corpus holds no scenario and --seconds 0 would compare nothing: give scenario "
            "files, or a campaign budget (--seconds S > 0)"
        )
    entries = [(_label(path), load_entry(path).scenario) for path in files]
    say = _progress
    say(f"kvfuzz gate: head {trees.describe_head()} against base {trees.describe_base()}")
    variants = gate_variants(trees, timeout_s=args.timeout)
    database = None
    if args.seconds > 0:
        from hypothesis.database import DirectoryBasedExampleDatabase

        database = DirectoryBasedExampleDatabase(args.database)
    gate = run_gate(
        trees,
        variants,
        entries,
        args.out,
        seconds=args.seconds,
        max_examples=args.max_examples,
        seed=args.seed,
        policy=Policy(args.policy),
        progress=say,
        database=database,
    )
    report = gate.report
    text = report.render()
    data = json.dumps(report.to_dict(), indent=2) + "\n"
    problems = [
        p
        for p in (
            write_output("--out", args.out / "report.txt", text),
            write_output("--out", args.out / "report.json", data),
        )
        if p is not None
    ]
    problems += write_ci_reports(args, gate.head_results, on_base=gate.on_base)
    sys.stdout.write(data if args.json else text)
    if report.not_started is not None:
        sys.stdout.flush()
        raise report.not_started.error()
    if problems:
        raise outputs_failed(problems)
    if report.rejected:
        return EXIT_USAGE
    return EXIT_FOUND if report.introduced else EXIT_CLEAN


def _label(path: Path) -> str:
    """A scenario file as the report names it: relative to kvfuzz's source
    folder for the bundled corpus, else as given."""
    try:
        return str(path.resolve().relative_to(_ROOT))
    except ValueError:
        return str(path)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

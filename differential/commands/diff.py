"""``kvfuzz diff A B``: what changed in prefix-cache behaviour between two variants."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from differential.commands.options import (
    EXIT_CLEAN,
    EXIT_FOUND,
    EXIT_USAGE,
    seconds_budget,
    timeout_seconds,
)
from differential.errors import VariantError
from differential.findings import Policy
from differential.variants import (
    parse_variants,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    diff = sub.add_parser(
        "diff",
        help="show what changed in prefix-cache behaviour between two variants",
        description=(
            "Run the corpus and a bounded campaign on variants A and B (e.g. "
            "release:0.32.0 unfixed) and print, grouped by root cause, the hits "
            "that differ (with the oracle's blame), the blocks kept that differ, "
            "findings on one side only and scenarios one side cannot run. Progress "
            "goes to stderr, one line per corpus scenario and per 25 generated ones. "
            "Exit 0 when nothing differs, 1 otherwise, 3 when a variant's worker "
            "cannot start (after printing what was found before)."
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
        type=seconds_budget,
        default=30.0,
        help=(
            "campaign budget in seconds; 0 for no campaign: no generated scenario at all, "
            "whatever --max-examples says (default: %(default)s)"
        ),
    )
    diff.add_argument(
        "--max-examples",
        type=int,
        default=None,
        metavar="N",
        help=(
            "campaign: also stop after N generated inputs (default: only --seconds bounds it)"
        ),
    )
    diff.add_argument("--seed", type=int, default=1, help="campaign seed (default: %(default)s)")
    diff.add_argument(
        "--timeout",
        type=timeout_seconds,
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


def run(args: argparse.Namespace) -> int:

    from differential.corpus import iter_scenario_files, load_entry
    from fuzz.diff import run_diff

    if args.max_examples is not None and args.max_examples < 0:
        raise VariantError(f"--max-examples = {args.max_examples} is invalid: allowed N >= 0")
    if not args.corpus and args.seconds == 0:
        raise VariantError(
            "--corpus with no PATH and --seconds 0 would compare nothing: give a corpus "
            "PATH, or a campaign budget (--seconds S > 0)"
        )
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
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        sys.stdout.write(report.render())
    if report.not_started is not None:
        sys.stdout.flush()
        raise report.not_started.error()
    if report.rejected:
        return EXIT_USAGE  # each named on stderr as it happened, and in the report
    return EXIT_FOUND if report.changes else EXIT_CLEAN

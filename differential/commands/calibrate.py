"""``kvfuzz calibrate``: which scenarios catch each calibration mutant."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from differential.commands.options import (
    EXIT_CLEAN,
    EXIT_FOUND,
    add_limits,
    load_scenario,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
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
    add_limits(calibrate)


def run(args: argparse.Namespace) -> int:
    from differential.corpus import iter_scenario_files

    entries = [load_scenario(args, path) for path in iter_scenario_files(args.paths)]
    from differential.reports.calibration import mutation_table, render_table

    rows, noisy = mutation_table(entries)
    sys.stdout.write(render_table(rows, noisy))
    return EXIT_CLEAN if all(row.caught_by for row in rows) else EXIT_FOUND

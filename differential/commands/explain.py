"""``kvfuzz explain``: the blocks each variant kept around one sibling's divergence."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from differential.commands.options import (
    EXIT_CLEAN,
    EXIT_FOUND,
    add_common,
    load_scenario,
)
from differential.errors import ScenarioError, printable
from differential.findings import Policy
from differential.scenario import DriveMode
from differential.variants import (
    parse_variants,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """``kvfuzz explain``: one sibling's blocks, per group and variant."""
    explain = sub.add_parser(
        "explain",
        help="draw the blocks each variant kept around one sibling's divergence point",
        description=(
            "Run SCENARIO on the variants and show, for one sibling, which blocks of "
            "each KV cache group were cached when it looked up, with the divergence "
            "point, the expected checkpoint and each variant's hit; optionally as SVG. "
            "A scheduler-mode scenario is shown as a timeline of scheduler steps, with "
            "the smallest pool (bisection over workload.pool_blocks) at which each "
            "variant still serves every hit it serves with a pool that holds everything."
        ),
    )
    explain.add_argument("scenario", type=Path, metavar="SCENARIO")
    add_common(explain)
    explain.add_argument(
        "--request",
        type=int,
        default=None,
        help="the sibling to explain (default: the first with a finding, else the last)",
    )
    explain.add_argument("--svg", type=Path, metavar="FILE", help="also write the picture as SVG")


def run(args: argparse.Namespace) -> int:
    from differential.corpus import write_atomic

    variants = parse_variants(args.variants, timeout_s=args.timeout)
    entry = load_scenario(args, args.scenario)
    scenario = entry.scenario
    if args.svg is not None:
        from differential.reports.outputs import check_not_an_input, check_output_file

        check_output_file(args.svg, "--svg")
        check_not_an_input(args.svg, "--svg", [args.scenario])
        if scenario.workload.mode is DriveMode.SCHEDULER and not scenario.workload.sequential:
            # No sequential reference to draw against: only the timeline.
            raise ScenarioError(
                "--svg",
                str(args.svg),
                "no --svg for a scheduler-mode run with arrivals, drafts, a store or "
                "aborts (judged per lookup as scheduled: the timeline is its picture)",
            )
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
        from differential.pool_need import pool_needs, render_pool_needs

        # What pool each variant needs to serve every hit it serves with room.
        lines = render_pool_needs(pool_needs(scenario, [vr.variant for vr in result.results]))
        sys.stdout.write("".join(f"{line}\n" for line in lines))
    exp = explain_request(result, request)
    if exp is None:
        if engine:  # judged per lookup as scheduled: the timeline is the picture
            if args.svg is not None:  # known only now: say why no SVG came
                print(
                    f"kvfuzz: no SVG written to {printable(str(args.svg))}: no run of request "
                    f"{request} has a sequential reference to draw against (a run that evicted "
                    "cached blocks is judged per lookup as scheduled; one that stopped before "
                    "the request has none): the timeline is its picture",
                    file=sys.stderr,
                )
            return EXIT_FOUND if result.findings else EXIT_CLEAN
        raise ScenarioError("--request", request, "a request every variant completed")
    sys.stdout.write(render_text(exp))
    for vr in result.results:  # a variant that could not run it has no row: say why
        if vr.run.unsupported is not None:
            print(f"{vr.variant.name}: unsupported: {vr.run.unsupported}")
    if args.svg is not None:
        write_atomic(args.svg, render_svg(exp))
        print(f"SVG: {args.svg}")
    return EXIT_FOUND if result.findings else EXIT_CLEAN

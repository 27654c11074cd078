"""``kvfuzz import-crash``: fuzzer crash inputs (atheris, ClusterFuzzLite) as finding files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from differential.commands.options import (
    EXIT_CLEAN,
    EXIT_FOUND,
    add_common,
)
from differential.errors import ScenarioError, printable
from differential.findings import SEVERITY, Policy
from differential.scenario import DriveMode
from differential.variants import (
    parse_variants,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
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
    add_common(crash)
    crash.add_argument(
        "--out",
        type=Path,
        default=Path("kvfuzz-out/imported"),
        help="folder for the scenario files (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
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
            print(
                f"{printable(str(path))}: decodes to no scenario (too short for the strategy)",
                file=sys.stderr,
            )
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
        print(f"{printable(str(path))} -> {printable(str(out))}: {verdict}")
    return EXIT_FOUND if found else EXIT_CLEAN

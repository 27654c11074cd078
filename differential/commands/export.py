"""``kvfuzz export-test``: a finding as a standalone pytest in vLLM's idiom."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from differential.commands.options import (
    EXIT_CLEAN,
    add_common,
    load_scenario,
)
from differential.errors import ScenarioError
from differential.findings import FindingKind, Policy
from differential.scenario import DriveMode
from differential.variants import (
    VariantRole,
    parse_variants,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """``kvfuzz export-test``: a standalone vLLM-style pytest."""
    export = sub.add_parser(
        "export-test",
        help="print a standalone vLLM-style pytest reproducing a finding",
        description=(
            "Print a pytest function that imports only vLLM, builds the managers with "
            "vLLM's public constructors, sends the scenario's requests and asserts the "
            "hit kvfuzz's oracle expects (for a crash: that every request runs, so it "
            "fails with vLLM's own exception). It fails on stock vLLM 0.33.0 and passes "
            "with the fix (check with: pytest --kvfuzz-variant fixed FILE)."
        ),
    )
    export.add_argument("finding", type=Path, metavar="FINDING")
    add_common(export)


def run(args: argparse.Namespace) -> int:
    variants = parse_variants(args.variants, timeout_s=args.timeout)
    entry = load_scenario(args, args.finding)
    if entry.scenario.workload.mode is DriveMode.SCHEDULER:
        from differential.exports.scheduler_test import check_exportable

        try:  # before anything runs: these refusals hold whatever is found
            check_exportable(entry.scenario)
        except ScenarioError as exc:
            raise exc.with_source(str(args.finding)) from None
    from differential.compare import compare_variants
    from differential.exports.manager_test import export_test
    from fuzz.signature import signature_of

    scenario = entry.scenario
    result = compare_variants(scenario, variants, policy=Policy(args.policy))
    if scenario.workload.mode is DriveMode.SCHEDULER:
        return _export_scheduler_test(args, entry, result)
    candidates = [
        (vr, f)
        for vr in result.results
        for f in vr.findings
        if f.request is not None
        # A block table's null blocks or an event stream, not a hit: no hit
        # assertion states them.
        and f.kind
        not in (FindingKind.DENSE_MISMATCH, FindingKind.KV_EVENTS, FindingKind.KEPT_SKIPPED_BLOCK)
        and (f.kind is FindingKind.CRASH or f.request < len(vr.references))
    ]
    if not candidates:
        raise ScenarioError(
            "FINDING",
            str(args.finding),
            "a scenario with a per-request finding to assert on hits" + _found(result),
        )
    # The finding the file is about (its recorded signature), else the first.
    recorded = [
        (vr, f) for vr, f in candidates if signature_of(scenario, f).text == entry.signature
    ]
    variant_result, finding = (recorded or candidates)[0]
    request = finding.request
    assert request is not None  # candidates hold per-request findings only
    fixed_hit = next(
        (
            vr.run.hits[request]
            for vr in result.results
            if vr.variant.role is VariantRole.FIXED and request < len(vr.run.hits)
        ),
        None,
    )
    owed = variant_result.references
    source = export_test(
        scenario,
        finding,
        owed[request] if request < len(owed) else None,
        signature=signature_of(scenario, finding).text,
        name=scenario.name or args.finding.stem,
        fixed_hit_tokens=fixed_hit,
    )
    sys.stdout.write(source)
    return EXIT_CLEAN


def _found(result: Any) -> str:
    """What a run with nothing to export found, for the refusal's message."""
    kinds = sorted({f.kind.value for f in result.findings})
    if not kinds:
        variants = ", ".join(vr.variant.name for vr in result.results)
        return f"; this one shows no finding on {variants}"
    return (
        f"; this one shows only {', '.join(kinds)}, which an exported test does not assert: "
        "replay the file instead"
    )


def _export_scheduler_test(args: argparse.Namespace, entry: Any, result: Any) -> int:
    """``export-test`` for a scheduler-mode scenario: the test drives vLLM's
    ``Scheduler`` (:mod:`differential.exports.scheduler_test`)."""

    from differential.exports.scheduler_test import export_engine_test
    from fuzz.signature import signature_of

    scenario = entry.scenario
    exportable = {
        FindingKind.EVICTION_COLLAPSE,
        FindingKind.OVER_HIT,
        FindingKind.MISALIGNED,
        FindingKind.FALLBACK,
        FindingKind.MODE_MISMATCH,
        FindingKind.CRASH,
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
            "fallback, mode-mismatch or crash finding" + _found(result),
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

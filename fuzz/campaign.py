"""``kvfuzz fuzz``: a reproducible campaign over the whole scenario space.

The campaign drives the fuzz target (:mod:`fuzz.target`) through Hypothesis's
``fuzz_one_input`` with bytes from ``random.Random(seed)``: the same seed and
versions give the same scenarios and the same findings, byte for byte.

Output folder layout::

    OUT/findings/<slug>.json   one file per distinct signature, written once,
                               atomically: the scenario, an ``expect`` block
                               (so ``kvfuzz replay`` and the corpus replay
                               reproduce it) and the verdicts
    OUT/hypothesis-db/         Hypothesis's example database: a rerun into
                               the same folder replays earlier failures first
    OUT/root-causes/<slug>.json  the first scenario of each root cause
                               (:mod:`differential.triage.identity`), written once
    OUT/shrunk/<slug>.json     each new root cause shrunk in the background
                               (time-boxed; ``shrink_seconds``)
    OUT/summary.json           counts per root cause and per signature,
                               executions per second, time to the first
                               finding (rewritten atomically); its paths
                               are relative (:func:`shown_path`)

A root cause is *new* when no known vLLM issue explains it and no scenario of
the known corpus (``known_corpus``, e.g. ``corpora``) shows it; the summary
lists new root causes before known ones.

Ctrl-C or SIGTERM (under :func:`fuzz.lifetime.stop_on_signals`) stops after the
current scenario, stops a running background shrink, and keeps everything
found so far.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import sys
import time
import unittest
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import Phase
from hypothesis.database import DirectoryBasedExampleDatabase

from differential.compare import ScenarioResult
from differential.corpus import finding_tag, write_atomic, write_once
from differential.files import project_root
from differential.findings import Policy
from differential.oracle.known import KNOWN_FIX_COSTS, KNOWN_ISSUES
from differential.oracle.layout import LAYOUT_VARIANT
from differential.scenario import DriveMode, GroupKind, Scenario
from differential.scenario.finding_form import finding_record
from differential.triage.identity import Role, RootCause, Triaged, triage
from differential.variants import Variant
from fuzz.lifetime import die_with_parent, stop_requested, terminate_pool
from fuzz.progress import CampaignStats, Progress
from fuzz.signature import Signature, coverage_keys, signature_of
from fuzz.target import FindingRaised, build_target

__all__ = [
    "Campaign",
    "CampaignConfig",
    "FindingRecord",
    "RootCauseRecord",
    "corpus_root_causes",
    "finding_document",
    "shown_path",
    "shrink_root_cause",
]

_BUFFER_SIZES = (512, 2048, 8192)


@dataclass(frozen=True)
class CampaignConfig:
    """What a campaign runs.

    Attributes:
        out: the output folder.
        variants: the variants every scenario runs on.
        seed: the seed of the input bytes.
        seconds: wall-time budget in seconds (``None``: no limit).
        max_examples: example budget (``None``: no limit).
        policy: the oracle's checkpoint policy.
        dense_cross_check: run the dense-retention cross-check too.
        summary_name: the summary's file name in ``out`` (parallel jobs each
            write their own and the parent merges them).
        summary_interval_s: seconds between summary rewrites while running.
        replay_database: replay the example database before fuzzing; ``None``
            decides by whether it holds entries when the campaign starts.
        shrink_seconds: shrink each new root cause in a background process
            for at most this many seconds; ``None``: do not shrink.
        known_corpus: scenario files or folders whose root causes count as
            known (replayed once before the clock starts).
        group_kinds: KV cache group kinds every scenario contains
            (``--groups``; empty: any layout).
        mode: the driving mode; ``scheduler`` draws engine workloads
            (:func:`fuzz.strategies.engine_scenarios`) through vLLM's
            ``Scheduler``.
    """

    out: Path
    variants: tuple[Variant, ...]
    seed: int
    seconds: float | None = 60.0
    max_examples: int | None = None
    policy: Policy = Policy.VLLM
    dense_cross_check: bool = True
    summary_name: str = "summary.json"
    summary_interval_s: float = 10.0
    replay_database: bool | None = None
    shrink_seconds: float | None = None
    known_corpus: tuple[Path, ...] = ()
    group_kinds: frozenset[GroupKind] = frozenset()
    mode: DriveMode = DriveMode.MANAGER


def engine_counts(scenario: Scenario, result: ScenarioResult) -> Counter[str]:
    """What one scheduler-mode scenario exercised (see ``CampaignStats.engine``);
    empty for a manager-mode scenario."""
    counts: Counter[str] = Counter()
    if scenario.workload.mode is not DriveMode.SCHEDULER:
        return counts
    w = scenario.workload
    counts["scenarios"] += 1
    counts["concurrent"] += w.arrival_steps is not None
    counts["multi_turn"] += any(r.shares_with is not None for r in scenario.requests)
    counts["answer_reused"] += w.shares_output and any(
        r.shares_with is not None for r in scenario.requests
    )
    counts["speculative"] += bool(w.accepted_drafts)
    counts["rejected_drafts"] += any(
        n < scenario.drafter.num_speculative_tokens for n in w.accepted_drafts
    )
    counts["decode"] += scenario.decode_steps > 0
    counts["mamba"] += bool(scenario.mamba_groups)
    counts["draft_groups"] += any(g.is_eagle_group for g in scenario.kv_cache_groups)
    runs = [vr.run for vr in result.results if vr.run.mode == "scheduler"]
    counts["with_eviction"] += any(r.evicted_blocks for r in runs)
    counts["with_preemption"] += any(r.preemptions for r in runs)
    for run in runs:
        counts["runs"] += 1
        counts["evicted_blocks"] += run.evicted_blocks
        counts["preemptions"] += run.preemptions
        counts["unreachable_cached_blocks"] += run.unreachable_cached_blocks
        counts["pool_blocks"] += run.pool_blocks
    return +counts


@dataclass
class FindingRecord:
    """One distinct signature seen by the campaign.

    Attributes:
        signature: the signature.
        path: its finding file.
        first_example: index of the example that first showed it.
        first_seen_s: seconds from the campaign start to that example.
        count: how many findings had it, duplicates included.
    """

    signature: Signature
    path: Path
    first_example: int
    first_seen_s: float
    count: int = 1


@dataclass
class RootCauseRecord:
    """One root cause seen by the campaign.

    Attributes:
        root_cause: the identity (:class:`differential.triage.identity.RootCause`).
        path: the finding file of its first scenario (``OUT/root-causes``).
        first_example: index of the example that first showed it.
        first_seen_s: seconds from the campaign start to that example.
        known_as: the known issue's reproducer or the corpus file that shows
            it, as :func:`shown_path` names it (``""`` for a new root cause).
        count: findings it explains (facets and consequences included).
        facets: finding kind -> count.
        consequences: findings that follow from it on a later request.
        variants: variants its findings belong to (consequences, which are
            differences between variants, excluded).
        count_by_variant: variant -> findings of it that it explains.
        signatures: the distinct signatures (:mod:`fuzz.signature`) it covers.
        shrunk: the shrunk reproducer, once the background shrink wrote it.
        pool_needs: for a ``pool-regression`` root cause, each variant's
            smallest pool serving every hit of its first scenario
            (:meth:`differential.pool_need.PoolNeed.to_dict`).
    """

    root_cause: RootCause
    path: Path
    first_example: int
    first_seen_s: float
    known_as: str = ""
    count: int = 0
    facets: Counter[str] = field(default_factory=Counter)
    consequences: int = 0
    variants: set[str] = field(default_factory=set)
    count_by_variant: Counter[str] = field(default_factory=Counter)
    signatures: set[str] = field(default_factory=set)
    shrunk: Path | None = None
    pool_needs: tuple[dict[str, Any], ...] = ()

    @property
    def new(self) -> bool:
        """Neither a known vLLM issue nor shown by the known corpus."""
        return not self.known_as

    def to_dict(self, out: Path) -> dict[str, Any]:
        """The summary entry; its paths relative to ``out`` (the campaign's
        folder) or to the kvfuzz root (:func:`shown_path`)."""
        reproducer = shown_path(self.shrunk or self.path, out)
        return {
            "root_cause": self.root_cause.text,
            "identity": self.root_cause.to_dict(),
            "status": "new" if self.new else "known",
            "known_as": self.known_as,
            "count": self.count,
            "facets": dict(sorted(self.facets.items())),
            "consequences": self.consequences,
            "variants": sorted(self.variants),
            "count_by_variant": dict(sorted(self.count_by_variant.items())),
            "file": shown_path(self.path, out),
            "shrunk": None if self.shrunk is None else shown_path(self.shrunk, out),
            "reproducer": reproducer if self.new else self.known_as,
            "first_example": self.first_example,
            "first_seen_s": round(self.first_seen_s, 3),
            "signatures": sorted(self.signatures),
        } | ({"pool_needs": list(self.pool_needs)} if self.pool_needs else {})


def shown_path(path: Path | str, out: Path) -> str:
    """``path`` as a campaign's ``summary.json`` and ``report.md`` name it,
    never absolute (CI uploads them): relative to ``out`` for what the
    campaign wrote there, relative to the kvfuzz root (:func:`project_root`)
    for the project's own files (``corpora/...``, ``known-issues/...``, as a
    known issue's example is named), relative to ``out`` for any other file.
    A relative ``path`` is taken from the working directory."""
    file = Path(path).resolve()
    folder = out.resolve()
    if file.is_relative_to(folder):
        return str(file.relative_to(folder))
    root = project_root()
    if file.is_relative_to(root):
        return str(file.relative_to(root))
    return os.path.relpath(file, folder)


def fix_cost_entries(totals: dict[str, list[int]]) -> list[dict[str, Any]]:
    """Summary entries for each fixed-role variant's cost against a baseline.

    ``totals`` maps ``"variant vs baseline"`` to ``[scenarios, extra SWA
    blocks, retained boundaries]`` (blocks summed over SWA groups; only
    sparse-retention scenarios with equal hits count, see
    :func:`differential.compare.fix_cost`).
    """
    return [
        {
            "pair": pair,
            "scenarios": n,
            "extra_swa_blocks": extra,
            "retained_boundaries": boundaries,
            "extra_swa_blocks_per_boundary": round(extra / boundaries, 3) if boundaries else 0.0,
        }
        for pair, (n, extra, boundaries) in sorted(totals.items())
    ]


def corpus_root_causes(
    paths: Sequence[Path], variants: Sequence[Variant], policy: Policy
) -> dict[RootCause, str]:
    """Root causes the known corpus shows, each with the first file showing it.

    Every file under ``paths`` is replayed on ``variants``; known issues
    count with their reproducer (:data:`differential.oracle.known.KNOWN_ISSUES`).
    An unreadable or invalid file is skipped with a warning on stderr naming it.
    """
    from differential.compare import compare_variants
    from differential.corpus import iter_scenario_files, load_entry
    from differential.errors import ScenarioError

    known: dict[RootCause, str] = {}
    existing = [p for p in paths if p.exists()]
    for path in iter_scenario_files([str(p) for p in existing]) if existing else ():
        try:
            entry = load_entry(path)
            result = compare_variants(entry.scenario, variants, policy=policy, source=str(path))
        except ScenarioError as exc:
            # One bad file costs that file: said, then skipped.
            print(f"kvfuzz: warning: known corpus file skipped: {exc}", file=sys.stderr)
            continue
        for t in triage(result):
            known.setdefault(t.root_cause, str(path))
    return known


def _known_issue_example(name: str) -> str:
    issue = next((i for i in (*KNOWN_ISSUES, *KNOWN_FIX_COSTS) if i.name == name), None)
    return issue.example if issue is not None else f"known issue {name}"


def shrink_root_cause(
    path: str,
    identity: dict[str, Any],
    variants: tuple[Variant, ...],
    policy: str,
    seconds: float,
    out: str,
) -> str | None:
    """Shrink the scenario at ``path`` while it still shows the root cause ``identity``.

    Runs in the campaign's background process (it imports vLLM once). Writes
    ``out/<root cause slug>.json`` (a replayable finding file) and returns its
    path, or ``None`` when the file does not show the root cause.
    """
    from differential.compare import compare_variants
    from differential.corpus import load_entry
    from differential.driver import VLLM_VERSION
    from differential.findings import FindingKind
    from fuzz.minimize import shrink

    target = RootCause.from_dict(identity)
    scenario = load_entry(Path(path)).scenario
    first = compare_variants(scenario, variants, policy=Policy(policy))
    shown = [t for t in triage(first) if t.root_cause == target]
    if not shown:
        return None
    finding = shown[0].finding
    signature = signature_of(scenario, finding)
    dense = all(t.finding.kind is FindingKind.DENSE_MISMATCH for t in shown)

    def keep(result: ScenarioResult) -> bool:
        return any(t.root_cause == target for t in triage(result))

    outcome = shrink(
        scenario,
        signature,
        variants,
        policy=Policy(policy),
        seconds=seconds,
        keep=keep,
        dense_cross_check=dense,
    )
    small = outcome.scenario
    final = compare_variants(small, variants, policy=Policy(policy))
    document = finding_document(
        small,
        final,
        signature,
        seed=None,
        example=None,
        vllm_version=VLLM_VERSION,
        root_cause=target.to_dict(),
        shrink={
            "from": shown_path(path, Path(out).parent),  # OUT/shrunk's OUT
            "steps": list(outcome.accepted),
            "checks": outcome.checks,
            "elapsed_s": round(outcome.elapsed_s, 3),
            "timed_out": outcome.timed_out,
        },
    )
    destination = Path(out) / f"{target.slug}.json"
    write_atomic(destination, json.dumps(document, indent=2) + "\n")
    return str(destination)


def finding_document(
    scenario: Scenario,
    result: ScenarioResult,
    signature: Signature,
    *,
    seed: int | None,
    example: int | None,
    vllm_version: str,
    root_cause: Mapping[str, Any] | None = None,
    shrink: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A self-contained, replayable finding: the scenario plus its verdicts.

    The ``finding`` block is written by the model the loader checks it with
    (:func:`differential.scenario.finding_form.finding_record`); ``root_cause``
    and ``shrink`` are added when given (a root cause's file, a shrunk one).

    Its ``expect`` block records each variant's hits and findings and, when
    the layout has findings of its own (``alignment-blowup``), those under
    ``layout`` (:func:`differential.corpus.expectation_problems`), so a
    replay of the file holds every finding to it.
    """
    document = scenario.to_dict()
    findings = {
        vr.variant.name: sorted(
            finding_tag(f) for f in result.findings if f.owner == vr.variant.name
        )
        for vr in result.results
    }
    layout = sorted(finding_tag(f) for f in result.findings if f.owner == LAYOUT_VARIANT)
    if layout:
        findings[LAYOUT_VARIANT] = layout
    document["expect"] = {
        "hits": {vr.variant.name: list(vr.run.hits) for vr in result.results},
        "findings": findings,
    }
    record: dict[str, Any] = {
        "signature": signature.text,
        "signature_fields": {
            "kind": signature.kind,
            "variant": signature.variant,
            "drafter": signature.drafter,
            "retention": signature.retention,
            "position": signature.position,
            "known_issue": signature.known_issue,
        },
        "policy": result.policy.value,
        "vllm_version": vllm_version,
        "vllm_versions": {vr.variant.name: vr.run.vllm_version for vr in result.results},
        "seed": seed,
        "example": example,
        "findings": [f.to_dict() for f in result.findings],
        "root_cause": root_cause,
        "shrink": shrink,
    }
    document["finding"] = finding_record(record)
    return document


@dataclass
class Campaign:
    """A running campaign; :meth:`run` does the work."""

    config: CampaignConfig
    stats: CampaignStats = field(default_factory=CampaignStats)
    records: dict[Signature, FindingRecord] = field(default_factory=dict)
    causes: dict[RootCause, RootCauseRecord] = field(default_factory=dict)
    interrupted: bool = False
    _known: dict[RootCause, str] = field(default_factory=dict)
    _shrinker: ProcessPoolExecutor | None = None
    _shrinks: dict[RootCause, Future[str | None]] = field(default_factory=dict)
    _fuzzed_s: float | None = None
    _progress: Progress | None = None
    _example: int = 0
    _vllm_version: str = ""
    _last_summary_s: float = 0.0
    # "variant vs baseline" -> [scenarios, extra SWA blocks, retained boundaries]
    fix_costs: dict[str, list[int]] = field(default_factory=dict)

    @property
    def findings_dir(self) -> Path:
        """``OUT/findings``."""
        return self.config.out / "findings"

    def _on_root_cause(self, scenario: Scenario, result: ScenarioResult, t: Triaged) -> None:
        """Count ``t`` under its root cause; a new root cause is written and shrunk."""
        cause = t.root_cause
        record = self.causes.get(cause)
        if record is None:
            path = self.config.out / "root-causes" / f"{cause.slug}.json"
            document = finding_document(
                scenario,
                result,
                signature_of(scenario, t.finding),
                seed=self.config.seed,
                example=self._example,
                vllm_version=self._vllm_version,
                root_cause=cause.to_dict(),
            )
            write_once(path, json.dumps(document, indent=2) + "\n")
            if cause.known_issue:
                known_as = _known_issue_example(cause.known_issue)
            elif cause in self._known:
                known_as = shown_path(self._known[cause], self.config.out)
            else:
                known_as = ""
            record = RootCauseRecord(
                cause, path, self._example, self.stats.elapsed_s, known_as=known_as
            )
            self.causes[cause] = record
            record.pool_needs = self._pool_needs(scenario, result, t)
            if self._progress is not None:
                status = "new" if record.new else f"known ({known_as})"
                where = "example database" if self._example < 0 else str(self._example)
                self._progress.note(f"root cause [{where}] {status}: {cause.text}")
            self._start_shrink(record)
        record.count += 1
        record.facets[t.finding.kind.value] += 1
        record.consequences += t.role is Role.CONSEQUENCE
        if t.role is not Role.CONSEQUENCE:
            record.variants.add(t.owner)
            record.count_by_variant[t.owner] += 1
        record.signatures.add(signature_of(scenario, t.finding).text)

    def _pool_needs(
        self, scenario: Scenario, result: ScenarioResult, t: Triaged
    ) -> tuple[dict[str, Any], ...]:
        """Each variant's smallest serving pool on a ``pool-regression``'s
        first scenario (:mod:`differential.pool_need`), once per root cause;
        ``()`` for other kinds, or when the bisection's runs fail (the
        campaign goes on, saying so)."""
        from differential.findings import FindingKind
        from differential.pool_need import pool_needs

        if t.finding.kind is not FindingKind.POOL_REGRESSION:
            return ()
        try:
            needs = pool_needs(scenario, [vr.variant for vr in result.results])
        except Exception as exc:  # one scenario's figure, never the campaign
            if self._progress is not None:
                self._progress.note(f"smallest pool for {t.root_cause.text} failed: {exc!r}")
            return ()
        return tuple(n.to_dict() for n in needs)

    def _start_shrink(self, record: RootCauseRecord) -> None:
        seconds = self.config.shrink_seconds
        if seconds is None or not record.new:
            return
        if self._shrinker is None:
            self._shrinker = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=die_with_parent,
                initargs=(os.getpid(),),
            )
        self._shrinks[record.root_cause] = self._shrinker.submit(
            shrink_root_cause,
            str(record.path),
            record.root_cause.to_dict(),
            self.config.variants,
            self.config.policy.value,
            seconds,
            str(self.config.out / "shrunk"),
        )

    def _collect_shrinks(self, *, wait: bool) -> None:
        """Note finished background shrinks; with ``wait``, wait for the rest
        (each for its time box plus a minute, until a stop is requested)."""
        budget = (self.config.shrink_seconds or 0.0) + 60.0  # + importing vLLM once
        for cause, future in list(self._shrinks.items()):
            deadline = time.monotonic() + budget
            while wait and not future.done() and time.monotonic() < deadline:
                if stop_requested():
                    return
                futures_wait([future], timeout=0.5)
            if not future.done():
                continue
            try:
                path = future.result()
            except Exception as exc:  # the shrink's own failure must not lose the campaign
                if self._progress is not None:
                    self._progress.note(f"shrinking {cause.text} failed: {exc!r}")
                path = None
            del self._shrinks[cause]
            if path is not None:
                self.causes[cause].shrunk = Path(path)

    def _on_result(self, scenario: Scenario, result: ScenarioResult) -> None:
        self.stats.examples += 1
        self.stats.coverage.update(coverage_keys(scenario))
        self.stats.engine.update(engine_counts(scenario, result))
        for cost in result.costs:
            totals = self.fix_costs.setdefault(f"{cost.variant} vs {cost.baseline}", [0, 0, 0])
            totals[0] += 1
            totals[1] += sum(cost.extra_swa_blocks)
            totals[2] += cost.retained_boundaries
        if result.findings:
            for t in triage(result):
                self._on_root_cause(scenario, result, t)
        for finding in result.findings:
            self.stats.findings_by_kind[finding.kind.value] += 1
            signature = signature_of(scenario, finding)
            record = self.records.get(signature)
            if record is not None:
                record.count += 1
                continue
            if self.stats.first_finding_s is None:
                self.stats.first_finding_s = self.stats.elapsed_s
            path = self.findings_dir / f"{signature.slug}.json"
            # Kept if an earlier run (or another job of this one) wrote it first.
            document = finding_document(
                scenario,
                result,
                signature,
                seed=self.config.seed,
                example=self._example,
                vllm_version=self._vllm_version,
            )
            created = write_once(path, json.dumps(document, indent=2) + "\n")
            self.records[signature] = FindingRecord(
                signature, path, self._example, self.stats.elapsed_s
            )
            self.stats.distinct = len(self.records)
            if self._progress is not None:
                where = "example database" if self._example < 0 else f"example {self._example}"
                what = "new finding" if created else "finding already on file"
                self._progress.note(f"{what} [{where}]: {signature.text} -> {path}")
        if self._progress is not None:
            self._progress.tick()
        if self.stats.elapsed_s - self._last_summary_s >= self.config.summary_interval_s:
            self._collect_shrinks(wait=False)
            self._write_summary()  # a killed campaign still leaves its counts
            self._last_summary_s = self.stats.elapsed_s

    def summary(self) -> dict[str, Any]:
        """The campaign summary (also written to ``OUT/summary.json``)."""
        stats = self.stats
        # Waiting for the background shrinks is not fuzzing time.
        elapsed = stats.elapsed_s if self._fuzzed_s is None else self._fuzzed_s
        return {
            "format": "kvfuzz.campaign",
            "version": 1,
            "seed": self.config.seed,
            "variants": [v.name for v in self.config.variants],
            "policy": self.config.policy.value,
            "vllm_version": self._vllm_version,
            "examples": stats.examples,
            "elapsed_s": round(elapsed, 3),
            "executions_per_s": round(stats.examples / elapsed, 2) if elapsed > 0 else 0.0,
            "first_finding_s": None
            if stats.first_finding_s is None
            else round(stats.first_finding_s, 3),
            "interrupted": self.interrupted,
            "findings_by_kind": dict(sorted(stats.findings_by_kind.items())),
            "coverage": dict(sorted(stats.coverage.items())),
            "engine": dict(sorted(stats.engine.items())),
            "fix_costs": fix_cost_entries(self.fix_costs),
            "root_causes": [
                r.to_dict(self.config.out)
                for r in sorted(self.causes.values(), key=lambda r: (not r.new, r.first_example))
            ],
            "distinct": [
                {
                    "signature": r.signature.text,
                    "file": shown_path(r.path, self.config.out),
                    "first_example": r.first_example,
                    "first_seen_s": round(r.first_seen_s, 3),
                    "count": r.count,
                }
                for r in sorted(self.records.values(), key=lambda r: r.first_example)
            ],
            "failed_jobs": [],  # parallel campaigns list workers that died
        }

    def _write_summary(self) -> None:
        write_atomic(
            self.config.out / self.config.summary_name,
            json.dumps(self.summary(), indent=2) + "\n",
        )

    def _replay_database(self, database: DirectoryBasedExampleDatabase) -> None:
        replay = build_target(
            self.config.variants,
            policy=self.config.policy,
            on_result=self._on_result,
            database=database,
            dense_cross_check=self.config.dense_cross_check,
            phases=[Phase.reuse],
            kinds=self.config.group_kinds,
            mode=self.config.mode,
        )
        try:
            with contextlib.suppress(FindingRaised, BaseExceptionGroup):
                replay()
        except unittest.SkipTest:
            # Nothing in the database decoded to an input of this target
            # (entries of another key, or random bytes, which Hypothesis
            # deletes): nothing to replay is not a failure.
            if self._progress is not None:
                self._progress.note("the example database held nothing to replay")

    def run(self, progress: Progress | None = None) -> dict[str, Any]:
        """Run until the time or example budget is spent, or Ctrl-C.

        Returns:
            The summary (see :meth:`summary`).
        """
        from differential.driver import VLLM_VERSION

        self._vllm_version = VLLM_VERSION
        self._progress = progress
        config = self.config
        config.out.mkdir(parents=True, exist_ok=True)
        database = DirectoryBasedExampleDatabase(config.out / "hypothesis-db")
        if config.known_corpus:
            if progress is not None:
                progress.note("replaying the known corpus for its root causes")
            self._known = corpus_root_causes(config.known_corpus, config.variants, config.policy)
        self.stats.started = time.perf_counter()
        try:
            db_path = config.out / "hypothesis-db"
            replay = config.replay_database
            if replay is None:
                replay = db_path.is_dir() and any(db_path.iterdir())
            if replay:
                if progress is not None:
                    progress.note("replaying earlier failures from the example database first")
                self._example = -1
                self._replay_database(database)
            target = build_target(
                config.variants,
                policy=config.policy,
                on_result=self._on_result,
                database=database,
                dense_cross_check=config.dense_cross_check,
                kinds=config.group_kinds,
                mode=config.mode,
            )
            rng = random.Random(config.seed)
            self._example = 0
            while True:
                if config.max_examples is not None and self._example >= config.max_examples:
                    break
                if config.seconds is not None and self.stats.elapsed_s >= config.seconds:
                    break
                if stop_requested():  # a signal whose KeyboardInterrupt was swallowed
                    self.interrupted = True
                    break
                buffer = rng.randbytes(rng.choice(_BUFFER_SIZES))
                with contextlib.suppress(FindingRaised):
                    target.hypothesis.fuzz_one_input(buffer)
                self._example += 1
        except KeyboardInterrupt:
            self.interrupted = True
        finally:
            self._fuzzed_s = self.stats.elapsed_s
            if self._shrinker is not None:
                if self.interrupted:
                    terminate_pool(self._shrinker)  # else exit waits for a running shrink
                else:
                    if progress is not None and self._shrinks:
                        progress.note(f"waiting for {len(self._shrinks)} background shrink(s)")
                    with contextlib.suppress(KeyboardInterrupt):
                        self._collect_shrinks(wait=True)
                    terminate_pool(self._shrinker)  # what outlived its budget
            self._write_summary()
            if progress is not None:
                progress.tick(force=True)
        return self.summary()


def run_campaign(config: CampaignConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Import vLLM, then run a campaign with the default progress display.

    The clock (time budget, time to first finding) starts after the import.
    """
    import differential.driver  # noqa: F401  (import vLLM before the clock starts)

    campaign = Campaign(config)
    if quiet:
        return campaign.run()
    with Progress(campaign.stats) as progress:
        return campaign.run(progress)

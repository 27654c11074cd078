"""``kvfuzz diff A B``'s and ``kvfuzz gate``'s runs: a corpus and a bounded
campaign on two variants.

Runs every scenario of a corpus and a bounded campaign (the fuzz generator,
:func:`fuzz.strategies.scenarios`, driven by bytes from ``random.Random(seed)``
as in ``kvfuzz fuzz``) on both variants, each judged by the oracle
(:func:`run_pair`); :func:`run_diff` collects what differs
(:func:`differential.reports.diff.changes_of`) into a
:class:`~differential.reports.diff.DiffReport`. Both variants take part as
baselines (neither is labelled fixed). A variant whose worker cannot start
ends the runs, and what was computed before is kept. Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
import unittest
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hypothesis import Phase
from hypothesis.database import ExampleDatabase

from differential.compare import ScenarioResult, compare_variants
from differential.errors import ScenarioError
from differential.findings import Policy
from differential.reports.diff import Change, DiffReport, changes_of
from differential.reports.table import NotStarted
from differential.scenario import Scenario
from differential.variants import Variant, VariantRole
from differential.variants.tree import WorkerStartFailed
from fuzz.target import FindingRaised, build_target

__all__ = ["PairRuns", "run_diff", "run_pair"]

_BUFFER_SIZES = (512, 2048, 8192)
PROGRESS_EVERY = 25  # generated scenarios between two progress lines of a campaign
PROGRESS_EVERY_S = 15.0  # ... or seconds, whichever comes first

Progress = Callable[[str], None]
OnResult = Callable[[str, ScenarioResult], None]


@dataclass
class PairRuns:
    """What :func:`run_pair` ran.

    Attributes:
        corpus_scenarios: corpus scenarios that ran on both variants.
        generated: scenarios the campaign generated (the example database's
            replays included).
        rejected: ``label: message`` of corpus scenarios only running could
            show to be bad input (each costs that scenario, not the run).
        not_started: the variant whose worker could not start, and what it
            would have run, or ``None``.
    """

    corpus_scenarios: int = 0
    generated: int = 0
    rejected: list[str] = field(default_factory=list)
    not_started: NotStarted | None = None


def run_pair(
    pair: Sequence[Variant],
    corpus: Sequence[tuple[str, Scenario]],
    on_result: OnResult,
    *,
    seconds: float = 0.0,
    max_examples: int | None = None,
    seed: int = 1,
    policy: Policy = Policy.VLLM,
    progress: Progress | None = None,
    database: ExampleDatabase | None = None,
) -> PairRuns:
    """Run the corpus, then a bounded campaign, on two variants (as baselines).

    Args:
        pair: the two variants.
        corpus: (label, scenario) pairs to replay.
        on_result: called with each scenario's label and judged result.
        seconds: wall-time budget of the campaign, in seconds; 0: no
            campaign, and no generated scenario at all (``max_examples``
            notwithstanding).
        max_examples: also stop the campaign after this many generated inputs.
        seed: the campaign's seed (same seed and versions: same scenarios).
        policy: the oracle's checkpoint policy.
        progress: called with one line per corpus scenario and one per
            :data:`PROGRESS_EVERY` generated scenarios (or
            :data:`PROGRESS_EVERY_S` seconds).
        database: Hypothesis's example database: its inputs are replayed
            before the campaign, and each input with a finding on either
            variant is saved there (one per signature); ``None``: none.

    Raises:
        InternalError: kvfuzz failed (e.g. its driver inside a tree's worker).
    """
    pair = tuple(dataclasses.replace(v, role=VariantRole.BASELINE) for v in pair)
    runs = PairRuns()
    say = progress or (lambda line: None)
    campaign = f"a {seconds:g} s campaign (seed {seed})" if seconds > 0 else ""
    for index, (label, scenario) in enumerate(corpus):
        say(f"[{index + 1}/{len(corpus)}] {label}")
        try:
            result = compare_variants(scenario, pair, policy=policy, dense_cross_check=False)
        except ScenarioError as exc:
            say(f"kvfuzz: error: {exc}")
            runs.rejected.append(f"{label}: {exc}")
            continue
        except WorkerStartFailed as exc:
            rest = [name for name, _ in corpus[index:]]
            runs.not_started = NotStarted(exc.variant, str(exc), [*rest, *filter(None, [campaign])])
            return runs
        on_result(label, result)
        runs.corpus_scenarios += 1
    if seconds > 0:
        try:
            _campaign(pair, on_result, runs, seconds, max_examples, seed, policy, say, database)
        except WorkerStartFailed as exc:
            left = f"the rest of {campaign} ({runs.generated} scenario(s) ran)"
            runs.not_started = NotStarted(exc.variant, str(exc), [left])
    return runs


def run_diff(
    a: Variant,
    b: Variant,
    corpus: Sequence[tuple[str, Scenario]],
    *,
    seconds: float = 0.0,
    max_examples: int | None = None,
    seed: int = 1,
    policy: Policy = Policy.VLLM,
    progress: Progress | None = None,
) -> DiffReport:
    """Run the corpus and a bounded campaign on ``a`` and ``b`` and collect what differs.

    Args:
        a, b: the variants ("before" and "after").
        corpus: (label, scenario) pairs to replay.
        seconds: wall-time budget of the campaign, in seconds (0: no campaign,
            whatever ``max_examples`` says).
        max_examples: the campaign's number of generated inputs, if bounded so.
        seed: the campaign's seed (same seed and versions: same scenarios).
        policy: the oracle's checkpoint policy.
        progress: called with each progress line (see :func:`run_pair`).

    Raises:
        InternalError: kvfuzz failed (e.g. its driver inside a tree's worker).
    """
    changes: list[Change] = []
    versions: dict[str, str] = {}

    def collect(label: str, result: ScenarioResult) -> None:
        for vr in result.results:
            if vr.run.vllm_version:
                versions.setdefault(vr.variant.name, vr.run.vllm_version)
        changes.extend(changes_of(result, label))

    runs = run_pair(
        (a, b),
        corpus,
        collect,
        seconds=seconds,
        max_examples=max_examples,
        seed=seed,
        policy=policy,
        progress=progress,
    )
    return DiffReport(
        a.name,
        b.name,
        versions,
        runs.corpus_scenarios,
        runs.generated,
        seed,
        tuple(changes),
        not_started=runs.not_started,
        rejected=tuple(runs.rejected),
    )


def _campaign(
    pair: Sequence[Variant],
    on_result: OnResult,
    runs: PairRuns,
    seconds: float,
    max_examples: int | None,
    seed: int,
    policy: Policy,
    say: Progress,
    database: ExampleDatabase | None,
) -> None:
    """The campaign: the example database's inputs first, then seeded random
    bytes through the generator until ``seconds`` (or ``max_examples``) are
    spent; counts go to ``runs.generated``."""
    started = time.perf_counter()
    shown = [0, started]  # generated, time at the last progress line

    def tick(final: bool = False) -> None:
        now = time.perf_counter()
        due = runs.generated - shown[0] >= PROGRESS_EVERY or now - shown[1] >= PROGRESS_EVERY_S
        if (due or final) and (runs.generated != shown[0] or final):
            say(
                f"campaign: {runs.generated} generated scenario(s) in {now - started:.0f} s "
                f"of {seconds:g} s"
            )
            shown[:] = [runs.generated, now]

    def collect(label: str) -> Callable[[Scenario, ScenarioResult], None]:
        def on_generated(scenario: Scenario, result: ScenarioResult) -> None:
            runs.generated += 1
            on_result(f"{label} #{runs.generated}", result)

        return on_generated

    if database is not None:
        _replay_database(pair, collect("example database"), policy, database, say)
    target = build_target(
        pair,
        policy=policy,
        on_result=collect("generated"),
        database=database,
        dense_cross_check=False,
        raise_on_finding=database is not None,
    )
    rng = random.Random(seed)
    examples = 0
    say(f"campaign: {seconds:g} s (seed {seed})")
    while time.perf_counter() - started < seconds:
        if max_examples is not None and examples >= max_examples:
            break
        with contextlib.suppress(FindingRaised):
            target.hypothesis.fuzz_one_input(rng.randbytes(rng.choice(_BUFFER_SIZES)))
        examples += 1
        tick()
    tick(final=True)


def _replay_database(
    pair: Sequence[Variant],
    on_result: Callable[[Scenario, ScenarioResult], None],
    policy: Policy,
    database: ExampleDatabase,
    say: Progress,
) -> None:
    """Replay the inputs Hypothesis's example database holds for the target
    (earlier runs' findings); a database with none is not a failure."""
    replay = build_target(
        pair,
        policy=policy,
        on_result=on_result,
        database=database,
        dense_cross_check=False,
        phases=[Phase.reuse],
    )
    say("campaign: replaying earlier findings from the example database first")
    try:
        replay()
    except unittest.SkipTest:
        say("campaign: the example database held nothing to replay")
    except FindingRaised:
        pass
    except BaseExceptionGroup as group:
        failed, _ = group.split(WorkerStartFailed)
        if failed is not None:
            raise failed.exceptions[0] from None
        if group.split(FindingRaised)[1] is not None:
            raise

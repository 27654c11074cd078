"""The report's line on engine mode's prefix-cache-off run (``confirm``'s
``_cache_off_notice``): it never says the sampled tokens were compared when
the cache-off run failed or left requests unserved."""

from __future__ import annotations

from differential.commands.confirm import _cache_off_notice
from differential.corpus import load_entry
from differential.driver.engine_mode import EngineResult
from differential.observation import RequestObservation, RunObservation
from tests.factories import CORPORA


def _request(index: int, hit: int) -> RequestObservation:
    return RequestObservation(
        index=index,
        prompt_tokens=100,
        hit_tokens=hit,
        shared_prefix_boundary_tokens=0,
        per_group_hit_tokens=(hit,),
        retained_blocks_per_group=(0,),
    )


def _result(off: RunObservation, raw_off: dict[str, object]) -> EngineResult:
    scenario = load_entry(CORPORA / "cases" / "rejoin-swa-only.json").scenario
    on = RunObservation("engine", "0.32.0", None, (_request(0, 0), _request(1, 64)))
    return EngineResult(scenario, 1, on, off, {"requests": []}, raw_off, {}, ())


def test_a_failed_cache_off_run_is_said_not_compared() -> None:
    off = RunObservation("engine", "0.32.0", None, (), error="engine start: ValueError: x")
    line = _cache_off_notice(_result(off, {}))
    assert line == (
        "engine, prefix cache off: the run failed (engine start: ValueError: x); sampled "
        "tokens NOT compared (no wrong-output check for this scenario)"
    )


def test_requests_the_cache_off_run_did_not_serve_are_named() -> None:
    off = RunObservation("engine", "0.32.0", None, (_request(0, 0),))
    line = _cache_off_notice(_result(off, {"requests": []}))
    assert line.startswith("engine, prefix cache off: hits [0]; sampled tokens compared")
    assert line.endswith("; requests [1] not served, not compared")

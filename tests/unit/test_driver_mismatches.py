"""``confirm``'s and the fidelity benchmark's comparison of the engine's run with
the drivers' (``driver_mismatches``), on hand-built runs."""

from __future__ import annotations

from differential.commands.confirm import driver_mismatches
from differential.observation import RequestObservation, RunObservation

STALL = "engine step 97: RuntimeError: Scheduler.schedule scheduled nothing for 64 steps"


def _run(hits: list[int], error: str | None = None, name: str = "engine") -> RunObservation:
    requests = tuple(
        RequestObservation(
            index=i,
            prompt_tokens=100,
            hit_tokens=h,
            shared_prefix_boundary_tokens=0,
            per_group_hit_tokens=(h,),
            retained_blocks_per_group=(0,),
        )
        for i, h in enumerate(hits)
    )
    return RunObservation(name, "0.32.0", None, requests, error=error)


def test_a_stall_on_the_engine_matches_a_crashed_scheduler_run_only() -> None:
    # Scheduler mode observes no request of a crashed run, the engine those it
    # served; manager mode runs no Scheduler and is not compared.
    crashed = _run([], "scheduled nothing for 64 steps", "release:0.32.0")
    runs = {"manager": _run([0, 32], name="release:0.32.0"), "scheduler": crashed}
    assert driver_mismatches(_run([0], STALL), runs) == []
    served = {"scheduler": _run([0], name="release:0.32.0")}
    (finding,) = driver_mismatches(_run([0], STALL), served)
    assert (finding.variant, finding.request, finding.detail) == (
        "release:0.32.0 scheduler vs engine",
        1,
        f"the engine crashes ({STALL}), scheduler mode on release:0.32.0 does not (hits [0])",
    )


def test_hits_that_part_are_a_mismatch_at_the_first_request_they_part() -> None:
    (finding,) = driver_mismatches(
        _run([0, 160]), {"scheduler": _run([0, 128], name="release:0.32.0")}
    )
    assert (finding.request, finding.hit_tokens, finding.expected_tokens) == (1, 128, 160)

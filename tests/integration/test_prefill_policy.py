"""The Scheduler's prefill policy on real runs: the long-prefill cap, its
adaptive floor and the local prefill cadence (``workload``'s
``long_prefill_token_threshold``, ``long_prefill_token_threshold_adaptive``,
``prefill_schedule_interval``) reach vLLM's ``Scheduler`` and move the hits
a concurrent sibling gets; an exported test sets them too."""

from __future__ import annotations

import dataclasses

import pytest

from differential.corpus import load_entry
from differential.driver import run_variant
from differential.findings import Finding, FindingKind
from differential.oracle.engine import judge_engine_run
from differential.scenario import Scenario
from differential.variants import parse_variants
from tests.factories import CORPORA

pytestmark = pytest.mark.vllm

CASES = CORPORA / "cases"
FLOOR = "long-prefill-cap-adaptive-floor--scheduler"
CADENCE = "prefill-interval-holds-a-turn-while-its-source-decodes--scheduler"
MAMBA_CAP = "mamba-long-prefill-cap-below-the-block--scheduler"


def _case(name: str) -> Scenario:
    return load_entry(CASES / f"{name}.json").scenario


def _hits(scenario: Scenario, **workload: object) -> tuple[int, ...]:
    (unfixed,) = parse_variants("unfixed")
    changed = dataclasses.replace(
        scenario, workload=dataclasses.replace(scenario.workload, **workload)
    )
    run = run_variant(changed, unfixed)
    assert run.error is None
    assert judge_engine_run(changed, run)[1] == ()
    return run.hits


def test_the_long_prefill_cap_and_its_floor_set_what_a_late_sibling_hits() -> None:
    floor = _case(FLOOR)
    # a and x share a 64-token budget: 32 each a step under the floor, 16
    # under the bare cap, the whole budget without a cap.
    assert _hits(floor) == (0, 0, 112)
    assert _hits(floor, long_prefill_token_threshold_adaptive=False) == (0, 0, 64)
    assert _hits(
        floor, long_prefill_token_threshold=0, long_prefill_token_threshold_adaptive=False
    ) == (0, 0, 192)


def test_the_prefill_cadence_holds_a_turn_until_its_source_decoded_a_block() -> None:
    cadence = _case(CADENCE)
    assert _hits(cadence) == (0, 40)
    assert _hits(cadence, prefill_schedule_interval=1) == (0, 32)


def test_a_cap_below_the_mamba_block_advances_by_less_than_a_block() -> None:
    # Without the cap a and b take whole blocks; with it, 24 tokens a step,
    # and either way c finds a's Mamba states at 64 and 128.
    mamba = _case(MAMBA_CAP)
    assert _hits(mamba) == (0, 0, 128)
    assert _hits(mamba, long_prefill_token_threshold=0) == (0, 0, 128)


def test_an_exported_scheduler_test_sets_the_prefill_policy(tmp_path) -> None:
    from differential.exports.scheduler_test import export_engine_test

    for name, lines, request, hit in (
        (
            FLOOR,
            (
                "    config.scheduler_config.long_prefill_token_threshold = 16\n",
                "    config.scheduler_config.long_prefill_token_threshold_adaptive = True\n",
            ),
            2,
            112,
        ),
        (CADENCE, ("    config.scheduler_config.prefill_schedule_interval = 8\n",), 1, 40),
    ):
        owed = Finding(FindingKind.FALLBACK, "unfixed", request, f"owed {hit}", expected_tokens=hit)
        source = export_engine_test(_case(name), owed, signature="s", name="policy")
        for line in lines:
            assert line in source
        namespace: dict[str, object] = {}
        exec(compile(source, "exported.py", "exec"), namespace)
        namespace["test_kvfuzz_policy"](tmp_path)  # type: ignore[operator]


def test_a_load_of_a_request_aborted_before_its_admission_may_serve_a_later_turn() -> None:
    # The cadence holds request 1's prefill after its asynchronous load has
    # cached its blocks; its client aborts it before any step of its own.
    scenario = _case("connector-aborted-load-serves-a-later-turn--scheduler")
    (unfixed,) = parse_variants("unfixed")
    run = run_variant(scenario, unfixed)
    assert [r.index for r in run.requests] == [0, 2, 3, 4]
    late = run.requests[2]
    assert (late.index, late.hit_tokens, late.scheduled_step) == (3, 4, 17)
    assert late.connector is not None and late.connector.local_tokens == 4
    assert judge_engine_run(scenario, run)[1] == ()

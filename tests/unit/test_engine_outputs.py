"""Engine mode's output check (``differential.variants.engine.wrong_outputs``):
the top-k logprob comparison rule on hand-built worker replies, and how many
tokens a plan samples for it (``engine_mode.output_tokens``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from differential.corpus import load_entry
from differential.driver.engine_mode import (
    OUTPUT_CHECK_TOKENS,
    TOP_LOGPROBS,
    EngineResult,
    engine_plan,
    output_tokens,
)
from differential.findings import FindingKind
from differential.scenario import DriveMode
from differential.variants.engine import (
    LOGPROB_TOLERANCE,
    compared_tokens,
    max_logprob_difference,
    top_logprob_difference,
    wrong_outputs,
)
from tests.factories import CORPORA, ROOT

NO_DRAFTER = CORPORA / "cases" / "engine-seed-class-nodrafter-swa64-fa32-r256.json"
TOP = [[7, -0.5], [9, -1.5], [11, -2.0], [13, -3.0]]


def test_equal_vectors_differ_by_nothing() -> None:
    assert top_logprob_difference(TOP, [list(p) for p in TOP]) == (0.0, 7)
    assert top_logprob_difference([], []) == (0.0, None)


def test_a_shared_token_counts_its_absolute_difference() -> None:
    moved = [[7, -0.5], [9, -1.5], [11, -2.0003], [13, -3.0]]
    delta, token = top_logprob_difference(TOP, moved)
    assert token == 11 and delta == pytest.approx(3e-4)


def test_a_token_missing_from_one_set_counts_its_excess_over_the_others_kth() -> None:
    # Token 13 (-3.0 with the cache) left the cache-off top k, whose lowest is
    # -2.5: off ranked 13 at or below -2.5, so it moved by at least 0.5.
    other = [[7, -0.5], [9, -1.5], [11, -2.0], [17, -2.5]]
    delta, token = top_logprob_difference(other, TOP)
    # 17 is at -2.5 in ``other``, above TOP's k-th (-3.0) by 0.5 too; 13 sits
    # below other's k-th by 0.5 on its side (counted 0). The largest: 0.5.
    assert delta == pytest.approx(0.5) and token == 17
    # A swap at the k-th rank within rounding is no difference.
    swapped = [[7, -0.5], [9, -1.5], [11, -2.0], [17, -3.0 + 1e-6]]
    assert top_logprob_difference(swapped, TOP)[0] < LOGPROB_TOLERANCE


def _row(index: int, tokens: list[int], tops: list[list[list[float]]]) -> dict[str, Any]:
    return {
        "index": index,
        "prompt_tokens": 100,
        "num_cached_tokens": 64,
        "output_token_ids": tokens,
        "logprobs": [
            dict((int(t), lp) for t, lp in top)[tok] for tok, top in zip(tokens, tops, strict=True)
        ],
        "runner_up_logprobs": [top[1][1] for top in tops],
        "top_logprobs": tops,
    }


def _result(on: list[dict[str, Any]], off: list[dict[str, Any]]) -> EngineResult:
    scenario = load_entry(NO_DRAFTER).scenario
    return EngineResult(scenario, 1, None, None, {"requests": on}, {"requests": off}, {}, ())  # type: ignore[arg-type]


def test_a_runner_up_that_moved_is_a_wrong_output_though_the_sampled_logprob_did_not() -> None:
    # The sampled token's logprob is the same in both runs; the runner-up at
    # position 2 moved by 2e-3: a one-number check passes it, the vector not.
    tops = [TOP, TOP, TOP]
    moved = [TOP, TOP, [[7, -0.5], [9, -1.502], [11, -2.0], [13, -3.0]]]
    on, off = [_row(0, [7, 7, 7], tops)], [_row(0, [7, 7, 7], moved)]
    found = wrong_outputs(_result(on, off))
    assert [(f.kind, f.request) for f in found] == [(FindingKind.WRONG_OUTPUT, 0)]
    assert "sampled token 2 (position 102): top-k logprobs differ by 2.00e-03" in found[0].detail
    assert "at token 9" in found[0].detail
    assert max_logprob_difference(_result(on, off)) == pytest.approx(2e-3)
    assert compared_tokens(_result(on, off)) == (3, 1)


def test_rounding_below_the_tolerance_is_clean_and_a_different_token_is_caught() -> None:
    near = [[[7, -0.5 + 1e-6], [9, -1.5], [11, -2.0], [13, -3.0]]]
    assert wrong_outputs(_result([_row(0, [7], [TOP])], [_row(0, [7], near)])) == []
    other = [[[9, -0.4], [7, -0.6], [11, -2.0], [13, -3.0]]]
    found = wrong_outputs(_result([_row(0, [7], [TOP])], [_row(0, [9], other)]))
    assert [f.request for f in found] == [0]
    assert "is 7 with the prefix cache (64 cached tokens) and 9 without it" in found[0].detail
    # A near tie in the cache-off run (best two within the tolerance) is not one.
    tie = [[[9, -0.5], [7, -0.5 + 5e-5], [11, -2.0], [13, -3.0]]]
    assert wrong_outputs(_result([_row(0, [7], [TOP])], [_row(0, [9], tie)])) == []


def test_rows_without_top_logprobs_compare_the_sampled_logprob() -> None:
    a, b = _row(0, [7], [TOP]), _row(0, [7], [TOP])
    del a["top_logprobs"], b["top_logprobs"]
    b["logprobs"] = [-0.5003]
    found = wrong_outputs(_result([a], [b]))
    assert [f.request for f in found] == [0] and "logprob differ by 3.00e-04" in found[0].detail


def test_sequential_scenarios_sample_eight_tokens_others_keep_their_decode() -> None:
    scenario = load_entry(NO_DRAFTER).scenario
    assert scenario.decode_steps == 0 and OUTPUT_CHECK_TOKENS == 8
    plan = engine_plan(scenario)
    assert [r["max_tokens"] for r in plan["requests"]] == [8, 8, 8, 8]
    assert plan["logprobs"] == TOP_LOGPROBS == 8
    workload = scenario.workload
    for changed in (
        dataclasses.replace(workload, mode=DriveMode.SCHEDULER, arrival_steps=(0, 0, 3, 3)),
        dataclasses.replace(workload, pool_blocks=400),
    ):
        assert output_tokens(dataclasses.replace(scenario, workload=changed)) == 1
    shares = load_entry(CORPORA / "cases" / "multi-turn-decoded-blocks.json").scenario
    assert output_tokens(shares) == shares.decode_steps + 1 == 41
    events = load_entry(CORPORA / "cases" / "kv-events-full-readmission.json").scenario
    assert output_tokens(events) == events.decode_steps + 1
    pool = load_entry(ROOT / "known-issues" / "eviction-collapse-48435-pool130-dense.json")
    assert output_tokens(pool.scenario) == pool.scenario.decode_steps + 1

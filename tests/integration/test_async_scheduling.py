"""Async scheduling through vLLM 0.33.0's real ``AsyncScheduler``.

Exact hits from real runs: the seed corpus and a one-at-a-time chat with
drafts give the synchronous run's hits; a decoded block still in flight is
not cached yet; a deferred free hands a two-group request's blocks back in
another order than the immediate free (vLLM issue #48489); a preempted
request is owed only the blocks cached at its free, not those a step still
in flight computes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from differential.compare import compare_variants, in_mode, synchronous
from differential.corpus import finding_tag, load_entry
from differential.driver import run_variant
from differential.findings import Policy
from differential.scenario import DrafterKind, DriveMode, Scenario
from differential.variants import parse_variants
from tests.factories import CORPORA, ROOT

pytestmark = pytest.mark.vllm

UNFIXED = parse_variants("unfixed")
(STOCK,) = UNFIXED
CASES = CORPORA / "cases"
SEEDS = sorted((CORPORA / "seeds").glob("*.json"))


def _async(scenario: Scenario) -> Scenario:
    s = in_mode(scenario, DriveMode.SCHEDULER)
    return dataclasses.replace(s, workload=dataclasses.replace(s.workload, async_scheduling=True))


@pytest.mark.parametrize("path", SEEDS, ids=lambda p: p.name)
def test_seed_gives_the_synchronous_hits_under_async_scheduling(path: Path) -> None:
    scenario = _async(load_entry(path).scenario)
    run = run_variant(scenario, STOCK)
    sync = run_variant(synchronous(scenario), STOCK)
    assert run.error is None and run.unsupported is None, (run.error, run.unsupported)
    assert run.hits == sync.hits
    # The output of each step is applied a step later: never fewer steps.
    assert run.steps > sync.steps


def test_one_at_a_time_chat_with_drafts_gives_the_synchronous_hits() -> None:
    entry = load_entry(CASES / "async-one-at-a-time-same-hits.json")
    result = compare_variants(entry.scenario, UNFIXED)
    vr = result.results[0]
    assert vr.run.hits == (0, 96, 128)
    assert vr.sync_run is not None and vr.sync_run.hits == (0, 96, 128)
    assert result.findings == ()
    assert (vr.run.steps, vr.sync_run.steps) == (27, 23)


def test_a_decoded_block_in_flight_is_not_cached_yet() -> None:
    entry = load_entry(CASES / "async-in-flight-decoded-block.json")
    run = run_variant(entry.scenario, STOCK, record_cache_map=True)
    assert run.hits == (0, 64)
    assert run.timeline[17] == (
        "step 17: arrive req-1; admit req-1 (hit 64); run req-1 +33; "
        "output of step 16 applied; finish req-0"
    )
    twin = run_variant(
        load_entry(CASES / "async-in-flight-decoded-block--synchronous.json").scenario,
        STOCK,
        record_cache_map=True,
    )
    assert twin.hits == (0, 80)
    assert twin.timeline[16:18] == (
        "step 16: run req-0 +1; finish req-0",
        "step 17: arrive req-1; admit req-1 (hit 80); run req-1 +17",
    )
    # A step later the block is cached under async scheduling too.
    later = dataclasses.replace(
        entry.scenario, workload=dataclasses.replace(entry.scenario.workload, arrival_steps=(0, 18))
    )
    assert run_variant(later, STOCK).hits == (0, 80)
    # Not a finding: turn 1 had not finished at turn 2's lookup.
    assert compare_variants(entry.scenario, UNFIXED).findings == ()


def test_a_request_freed_with_its_step_in_flight_is_freed_later_group_by_group_reversed() -> (
    None
):
    entry = load_entry(ROOT / "known-issues" / "async-deferred-free-flattens-group-order.json")
    run = run_variant(entry.scenario, STOCK, record_cache_map=True)
    assert run.hits == (0, 0, 0)
    assert run.timeline[3] == (
        "step 3: abort req-0; run nothing; output of step 2 applied; finish req-0"
    )
    # Aborted at step 3 with its step-2 decode in flight: its 14 blocks (9 of
    # 16 tokens, 5 of 32) go back when step 2's output is applied, the
    # 32-token group's first, each group tail first.
    flattened = tuple((1, k) for k in range(4, -1, -1)) + tuple((0, k) for k in range(8, -1, -1))
    assert run.deferred_frees == ((0, 3, flattened),)
    result = compare_variants(entry.scenario, UNFIXED)
    assert [finding_tag(f) for f in result.findings] == ["free-order@0"]
    assert result.findings[0].known_issue == "deferred-free-flattens-group-order"
    # `retained` accepts vLLM 0.33.0's flattened order.
    assert compare_variants(entry.scenario, UNFIXED, policy=Policy.RETAINED).findings == ()
    twin = run_variant(
        load_entry(CASES / "async-deferred-free-group-order--synchronous.json").scenario, STOCK
    )
    assert twin.hits == (0, 0, 64)
    assert twin.deferred_frees == ()


def test_an_ngram_drafter_is_refused_under_async_scheduling() -> None:
    scenario = _async(load_entry(CASES / "async-one-at-a-time-same-hits.json").scenario)
    ngram = dataclasses.replace(
        scenario,
        drafter=dataclasses.replace(scenario.drafter, kind=DrafterKind.NGRAM),
        workload=dataclasses.replace(scenario.workload, accepted_drafts=()),
    )
    run = run_variant(ngram, STOCK)
    assert run.unsupported is not None
    assert run.unsupported.startswith(
        "VllmConfig.__post_init__ refuses async scheduling with the V1 model runner for "
        "ngram-based speculative decoding"
    )


def test_a_copy_on_write_block_fenced_by_a_deferred_free_is_its_writers_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from collections import Counter

    import differential.driver.scheduler_mode as scheduler_mode

    entry = load_entry(CORPORA / "regressions" / "async-cow-retention-fenced-write.json")
    run = run_variant(entry.scenario, STOCK)
    assert run.hits == (0, 12)
    assert [w for r in run.requests for w in r.unsafe_writes] == []
    # Counting the deferred copy-on-write retention as a holder is the false
    # positive a campaign found: request 1's step at 16 tokens writes its
    # private copy, block 4, while the fence still holds it (2 references).
    monkeypatch.setattr(scheduler_mode, "_fenced", lambda scheduler: Counter())
    unfenced = run_variant(entry.scenario, STOCK)
    (write,) = [w for r in unfenced.requests for w in r.unsafe_writes]
    assert (write.position_tokens, write.group, write.block_id, write.ref_cnt) == (16, 0, 4, 2)


def test_kv_cache_events_are_judged_where_vllm_publishes_them() -> None:
    # vLLM publishes a step's events in update_from_output: under async
    # scheduling the first step applies no output and publishes nothing.
    entry = load_entry(CASES / "kv-events-full-readmission.json")
    scenario = _async(entry.scenario)
    result = compare_variants(scenario, UNFIXED)
    vr = result.results[0]
    assert vr.run.hits == run_variant(synchronous(scenario), STOCK).hits == (0, 48, 0, 32)
    assert result.findings == ()
    assert vr.run.kv_events is not None
    assert vr.run.kv_events.steps[0].step == 1


def test_a_preempted_request_is_owed_the_blocks_hashed_before_its_token_in_flight() -> None:
    # Request 1 is preempted with 23 tokens computed, steps in flight
    # included, and 20 tokens known at the free: under EAGLE's lookahead hash
    # (one token past the block) block [16, 20) had no hash and was never
    # cached. The resumed lookup (21 tokens known by then) hits 16, which is
    # owed; the tokens known at the lookup would owe 20.
    from differential.oracle.core import drafter_model
    from differential.oracle.engine import resumed_owed_tokens

    rel = "regressions/async-preempted-in-flight-token-lookahead-hash.json"
    entry = load_entry(CORPORA / rel)
    result = compare_variants(entry.scenario, parse_variants("unfixed"))
    run = result.results[0].run
    (resumed,) = run.requests[1].resumed
    assert (
        resumed.hit_tokens,
        resumed.known_tokens,
        resumed.preempted_computed_tokens,
        resumed.preempted_known_tokens,
        resumed.preempted_in_flight_tokens,
        resumed.scheduled_known_tokens,
    ) == (16, 21, 23, 20, 4, 19)
    model = drafter_model(entry.scenario)
    assert model.hash_lookahead_tokens == 1
    assert resumed_owed_tokens(entry.scenario, model, resumed) == 16
    # The tokens known at the free bound it alone (19 processed, 18 hashed
    # when last scheduled, 20 - 1 hashed at the free: [16, 20) uncached).
    hashed = dataclasses.replace(
        resumed, preempted_in_flight_tokens=None, scheduled_known_tokens=None
    )
    assert resumed_owed_tokens(entry.scenario, model, hashed) == 16
    stale = dataclasses.replace(hashed, preempted_known_tokens=None)
    assert resumed_owed_tokens(entry.scenario, model, stale) == 20
    assert result.findings == ()


def _preempted_with_a_decode_step_in_flight() -> Scenario:
    """Full attention, block 16, a 10-block pool: request 1 (29-token
    prompt) decodes beside request 0 (119 tokens) until the pool runs out
    and step 12 preempts it (shrunk from a seed-91 campaign's three false
    fallbacks, on FA 4, MLA 4 and FA 16)."""
    return Scenario.from_dict(
        {
            "format": "kvfuzz.scenario",
            "version": 1,
            "name": "async-preempted-decode-step-in-flight",
            "kv_cache_groups": [
                {"kind": "full_attention", "block_size_tokens": 16, "sliding_window_tokens": None}
            ],
            "prefill_chunk_tokens": 16,
            "decode_steps": 6,
            "shared_prefix_tokens": 16,
            "requests": [
                {"name": "s0t1", "shares_with": None, "divergence_tokens": 0, "suffix_tokens": 103},
                {"name": "s1t1", "shares_with": None, "divergence_tokens": 16, "suffix_tokens": 13},
            ],
            "workload": {
                "mode": "scheduler",
                "pool_blocks": 10,
                "arrival_steps": [0, 0],
                "max_num_seqs": 4,
                "async_scheduling": True,
            },
        }
    )


def test_a_preempted_request_is_owed_no_block_its_decode_step_in_flight_completes() -> None:
    # Step 11 computes request 1's position 31 while step 10, which samples
    # its token, is in flight: a placeholder when allocate_slots ran (31
    # tokens known), so block [16, 32) was left for update_from_output to
    # cache once step 11's output is applied (num_computed_tokens -
    # num_in_flight_tokens). Step 12 preempts request 1 first (32 tokens
    # computed, 1 in flight, 32 known); step 11's output is then stale and
    # caches nothing. The resumed lookup hits 16, which is owed; counting
    # the in-flight token as cached would owe 32.
    from differential.oracle.core import drafter_model
    from differential.oracle.engine import resumed_owed_tokens

    scenario = _preempted_with_a_decode_step_in_flight()
    result = compare_variants(scenario, UNFIXED)
    run = result.results[0].run
    assert (run.hits, run.evicted_blocks, run.preemptions) == ((0, 0), 0, 1)
    (resumed,) = run.requests[1].resumed
    assert (
        resumed.step,
        resumed.hit_tokens,
        resumed.known_tokens,
        resumed.preempted_computed_tokens,
        resumed.preempted_in_flight_tokens,
        resumed.preempted_known_tokens,
        resumed.scheduled_known_tokens,
    ) == (14, 16, 33, 32, 1, 32, 31)
    model = drafter_model(scenario)
    assert resumed_owed_tokens(scenario, model, resumed) == 16
    unrecorded = dataclasses.replace(resumed, preempted_in_flight_tokens=None)
    assert resumed_owed_tokens(scenario, model, unrecorded) == 32
    assert result.findings == ()
    # The synchronous Scheduler preempts it too, with no step in
    # flight: position 31's token was known when its step was scheduled, so
    # allocate_slots cached [16, 32) and the resumed lookup hits 32.
    sync = run_variant(synchronous(scenario), STOCK)
    (again,) = sync.requests[1].resumed
    assert (
        again.hit_tokens,
        again.preempted_computed_tokens,
        again.preempted_in_flight_tokens,
        again.scheduled_known_tokens,
    ) == (32, 32, 0, 32)
    assert resumed_owed_tokens(scenario, model, again) == 32


def _resend_of_an_aborted_prompt(abort_steps: list[int | None] | None) -> Scenario:
    """Full attention, block 2, 2-token chunks: request 0 (13 tokens) is
    aborted from step 5, when it has computed 10; request 1 resends it
    (shrunk from a seed-92 campaign's false fallback, on FA 2 with EAGLE-3
    and a bounded store)."""
    return Scenario.from_dict(
        {
            "format": "kvfuzz.scenario",
            "version": 1,
            "name": "async-resend-of-an-aborted-prompt",
            "kv_cache_groups": [
                {"kind": "full_attention", "block_size_tokens": 2, "sliding_window_tokens": None}
            ],
            "prefill_chunk_tokens": 2,
            "shared_prefix_tokens": 8,
            "requests": [
                {"name": "s0t1", "shares_with": None, "divergence_tokens": 8, "suffix_tokens": 5},
                {"name": "s0t2", "shares_with": 0, "divergence_tokens": 13, "suffix_tokens": 0},
            ],
            "workload": {
                "mode": "scheduler",
                "pool_blocks": 44,
                "max_num_seqs": 1,
                "abort_steps": abort_steps,
                "async_scheduling": True,
            },
        }
    )


def test_an_aborted_request_promises_nothing_under_async_scheduling() -> None:
    # Under async scheduling the output of request 0's step 4 is applied
    # after the abort, so the step that applies it records a finish (step
    # 5); the request computed 10 of its 13 tokens and the resend hits 10.
    # Counted as a writer it would owe its whole prompt less a token, 12.
    from differential.oracle.engine import timeline_writers

    scenario = _resend_of_an_aborted_prompt([5, None])
    result = compare_variants(scenario, UNFIXED)
    run = result.results[0].run
    assert run.hits == (0, 10)
    assert [r.finished_step for r in run.requests] == [5, 8]
    assert timeline_writers(scenario, run) == [frozenset(), frozenset()]
    assert result.findings == ()
    # The synchronous Scheduler frees it inside finish_requests: no step
    # finishes it, and the resend hits the same 10.
    sync = run_variant(synchronous(scenario), STOCK)
    assert sync.hits == (0, 10)
    assert sync.requests[0].finished_step is None
    # Near miss: never aborted, request 0 is a writer and owes 12, hit.
    whole = _resend_of_an_aborted_prompt(None)
    run = compare_variants(whole, UNFIXED).results[0].run
    assert run.hits == (0, 12)
    assert timeline_writers(whole, run) == [frozenset(), frozenset({0})]

"""The scheduler-mode oracle and the workload part of the scenario model, by hand."""

from __future__ import annotations

import dataclasses
import json

import pytest

from differential.errors import ScenarioError
from differential.findings import FindingKind, Policy
from differential.observation import GroupLookup, RequestObservation, RunObservation
from differential.oracle.engine import (
    cross_check_modes,
    eviction_collapse,
    judge_engine_run,
    session_hits,
    session_of,
)
from differential.scenario import (
    DriveMode,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
    Workload,
)


def _sessions(workload: Workload) -> Scenario:
    """Two sessions of two turns each (FA 4 + SWA 4, window 8)."""
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 8),
        ),
        requests=(
            RequestSpec(0, 20),
            RequestSpec(0, 24),
            RequestSpec(20, 4, 0),
            RequestSpec(24, 4, 1),
        ),
        shared_prefix_tokens=0,
        prefill_chunk_tokens=16,
        decode_steps=2,
        workload=workload,
    )


def _run(
    hits: tuple[int, ...],
    *,
    variant: str = "unfixed",
    mode: str = "scheduler",
    order: tuple[int, ...] | None = None,
    lookups: tuple[tuple[GroupLookup, ...], ...] = (),
) -> RunObservation:
    return RunObservation(
        variant=variant,
        vllm_version="0.33.0",
        settings=None,
        requests=tuple(
            RequestObservation(
                index=i,
                prompt_tokens=0,
                hit_tokens=h,
                shared_prefix_boundary_tokens=0,
                per_group_hit_tokens=(h, h),
                retained_blocks_per_group=(0, 0),
                lookup=lookups[i] if lookups else (),
                scheduled_step=None if order is None else order[i],
                lookup_order=None if order is None else order[i],
            )
            for i, h in enumerate(hits)
        ),
        mode=mode,
        pool_blocks=130,
    )


def test_workload_round_trips_and_old_files_stay_identical() -> None:
    workload = Workload(
        mode=DriveMode.SCHEDULER,
        pool_blocks=130,
        arrival_steps=(0, 0, 3, 3),
        max_num_seqs=2,
        max_num_batched_tokens=24,
        shares_output=True,
    )
    scenario = _sessions(workload)
    assert Scenario.from_json(scenario.to_json()) == scenario
    plain = _sessions(Workload())
    assert "workload" not in plain.to_dict()


def test_shares_output_copies_the_answer_into_the_next_turn() -> None:
    base = _sessions(Workload(mode=DriveMode.SCHEDULER, shares_output=True))
    scenario = dataclasses.replace(
        base, requests=(*base.requests[:2], RequestSpec(23, 1, 0), base.requests[3])
    )
    first, turn2 = scenario.prompts[0], scenario.prompts[2]
    answer = scenario.sampled_tokens(0)
    assert len(answer) == 3  # decode_steps + 1 sampled tokens
    assert turn2[:23] == first + answer and len(turn2) == 24
    # The source is the prompt (20) + 3 sampled tokens: 24 is past it.
    with pytest.raises(ScenarioError, match=r"requests\[2\]\.divergence_tokens"):
        dataclasses.replace(
            base, requests=(*base.requests[:2], RequestSpec(24, 1, 0), base.requests[3])
        )


@pytest.mark.parametrize(
    ("workload", "field"),
    [
        ({"mode": "engine"}, "workload.mode"),
        ({"pool_blocks": 1}, "workload.pool_blocks"),
        ({"mode": "scheduler", "arrival_steps": [0, 2, 1, 3]}, r"workload.arrival_steps\[2\]"),
        ({"mode": "scheduler", "arrival_steps": [0]}, "workload.arrival_steps"),
        ({"mode": "scheduler", "accepted_drafts": [1]}, "workload.accepted_drafts"),
        ({"arrival_steps": [0, 0, 0, 0]}, "workload.mode"),
        ({"threads": 2}, "workload.threads"),
    ],
)
def test_bad_workload_is_named(workload: dict[str, object], field: str) -> None:
    data = _sessions(Workload()).to_dict()
    data["workload"] = workload
    with pytest.raises(ScenarioError, match=field):
        Scenario.from_json(json.dumps(data))


def test_sessions_follow_shares_with_chains() -> None:
    scenario = _sessions(Workload())
    assert [session_of(scenario, i) for i in range(4)] == [0, 1, 0, 1]
    assert session_hits(scenario, _run((0, 0, 20, 24))) == {0: [0, 20], 1: [0, 24]}


def test_mode_mismatch_names_the_first_differing_call() -> None:
    scenario = _sessions(Workload(mode=DriveMode.SCHEDULER))
    same = GroupLookup(0, 23, False, 20, 0)
    manager = _run((0, 0, 20, 24), mode="manager", lookups=((), (), (same,), ()))
    scheduler = _run((0, 0, 16, 24), lookups=((), (), (GroupLookup(0, 23, False, 16, 0),), ()))
    (finding,) = cross_check_modes(scenario, scheduler, manager)
    assert finding.kind is FindingKind.MODE_MISMATCH and finding.request == 2
    assert finding.hit_tokens == 16 and finding.expected_tokens == 20
    assert "find_longest_cache_hit #0 of request 2" in finding.detail
    assert cross_check_modes(scenario, manager, manager) == ()
    # A concurrent workload is not cross-checked (the calls differ by design).
    concurrent = _sessions(Workload(mode=DriveMode.SCHEDULER, arrival_steps=(0, 0, 0, 0)))
    assert cross_check_modes(concurrent, scheduler, manager) == ()
    # Under eviction the blocks kept follow each driver's allocation order:
    # hits that differ where either run evicted are not compared.
    evicting = dataclasses.replace(scheduler, evicted_blocks=3)
    assert cross_check_modes(scenario, evicting, manager) == ()
    assert (
        cross_check_modes(scenario, scheduler, dataclasses.replace(manager, evicted_blocks=5)) == ()
    )


def test_eviction_collapse_needs_zero_dense_and_hitting_retention_0() -> None:
    scenario = _sessions(Workload(mode=DriveMode.SCHEDULER, pool_blocks=130))
    collapse = eviction_collapse(scenario, _run((0, 0, 0, 0)), _run((0, 0, 16, 20)))
    assert collapse is not None and collapse.kind is FindingKind.EVICTION_COLLAPSE
    assert "[[0, 0], [0, 0]]" in collapse.detail and "[[0, 16], [0, 20]]" in collapse.detail
    # One later turn still hits under dense retention: no collapse.
    assert eviction_collapse(scenario, _run((0, 0, 0, 20)), _run((0, 0, 16, 20))) is None
    # Retention 0 hits nothing either (capacity): no collapse.
    assert eviction_collapse(scenario, _run((0, 0, 0, 0)), _run((0, 0, 0, 0))) is None


def test_concurrent_hit_is_judged_against_requests_admitted_before_it() -> None:
    scenario = _sessions(
        Workload(mode=DriveMode.SCHEDULER, arrival_steps=(0, 0, 0, 0), shares_output=True)
    )
    # Request 2 admitted before its session's first turn: nothing could be cached.
    run = _run((0, 0, 20, 0), order=(1, 2, 0, 3))
    _, findings = judge_engine_run(scenario, run)
    assert [(f.kind, f.request, f.expected_tokens) for f in findings] == [
        (FindingKind.OVER_HIT, 2, 0)
    ]
    # Admitted after it: 20 tokens (a multiple of A = 4) are sound; 18 is misaligned.
    _, findings = judge_engine_run(scenario, _run((0, 0, 20, 24), order=(0, 1, 2, 3)))
    assert findings == ()
    _, findings = judge_engine_run(scenario, _run((0, 0, 18, 24), order=(0, 1, 2, 3)))
    assert [(f.kind, f.request) for f in findings] == [(FindingKind.MISALIGNED, 2)]


def _stream() -> Scenario:
    """Four requests sharing a 16-token prefix, full attention in blocks of 4,
    two arriving at step 0 and two at step 3 (a stream at concurrency 2)."""
    return Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 4),),
        requests=tuple(RequestSpec(16, 4) for _ in range(4)),
        shared_prefix_tokens=16,
        prefill_chunk_tokens=32,
        workload=Workload(mode=DriveMode.SCHEDULER, arrival_steps=(0, 0, 3, 3)),
    )


def _timed(hits: tuple[int, ...], admitted: tuple[int, ...], finished: tuple[int, ...]):
    run = _run(hits, order=admitted)
    return dataclasses.replace(
        run,
        requests=tuple(
            dataclasses.replace(
                r,
                per_group_hit_tokens=(r.hit_tokens,),
                retained_blocks_per_group=(0,),
                lookup_order=k,
                finished_step=finished[k],
            )
            for k, r in enumerate(run.requests)
        ),
    )


def test_timeline_owes_what_finished_writers_promise() -> None:
    from differential.oracle.engine import timeline_writers

    scenario = _stream()
    # Requests 0 and 1 are admitted at step 0 and finish at step 1; 2 and 3 at
    # step 3. Request 1 looked up while request 0 (a sharer) was in flight, so
    # only request 0 promises: 2 and 3 are owed its 16 shared tokens, 1 nothing.
    run = _timed((0, 0, 12, 16), admitted=(0, 0, 3, 3), finished=(1, 1, 4, 5))
    assert timeline_writers(scenario, run) == [
        frozenset(),
        frozenset(),
        frozenset({0}),
        frozenset({0}),
    ]
    _, findings = judge_engine_run(scenario, run)
    assert [(f.kind, f.request, f.expected_tokens, f.hit_tokens) for f in findings] == [
        (FindingKind.FALLBACK, 2, 16, 12)
    ]
    clean = _timed((0, 0, 16, 16), admitted=(0, 0, 3, 3), finished=(1, 1, 4, 5))
    assert judge_engine_run(scenario, clean)[1] == ()


def test_timeline_promises_nothing_under_eviction_without_counters() -> None:
    from differential.oracle.engine import timeline_writers

    scenario = _stream()
    run = _timed((0, 0, 12, 16), admitted=(0, 0, 3, 3), finished=(1, 1, 4, 5))
    # Evictions without the free queue's counters (manager mode, older files).
    assert timeline_writers(scenario, dataclasses.replace(run, evicted_blocks=1)) is None
    # Preemptions are judged on full attention only, where a writer holds
    # every block of its prefix itself.
    preempted = dataclasses.replace(run, preemptions=1)
    assert timeline_writers(scenario, preempted) == timeline_writers(scenario, run)
    hybrid = dataclasses.replace(
        scenario,
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 8),
        ),
    )
    assert timeline_writers(hybrid, preempted) is None
    # A later turn copying an answer is owed by the same finished writers
    # (their decoded blocks count: oracle.core.writer_extent).
    copied = dataclasses.replace(
        scenario, workload=dataclasses.replace(scenario.workload, shares_output=True)
    )
    assert timeline_writers(copied, run) == timeline_writers(scenario, run)
    # A writer that had not finished before the lookup promises nothing.
    late = _timed((0, 0, 12, 16), admitted=(0, 0, 3, 3), finished=(3, 3, 4, 5))
    assert timeline_writers(scenario, late)[2] == frozenset()
    assert judge_engine_run(scenario, late)[1] == ()


def _queued(
    run: RunObservation, counters: dict[int, tuple[int | None, int | None, int | None]]
) -> RunObservation:
    """``run`` with free-queue counters per request, in blocks: (removals at
    the lookup, queue length at the first free, removals at the first free)."""
    return dataclasses.replace(
        run,
        evicted_blocks=3,
        requests=tuple(
            dataclasses.replace(
                r,
                lookup_queue_removals=counters[r.index][0],
                freed_queue_blocks=counters[r.index][1],
                freed_queue_removals=counters[r.index][2],
            )
            for r in run.requests
        ),
    )


def test_lru_keeps_a_writer_for_as_many_removals_as_its_queue_held() -> None:
    from differential.oracle.engine import timeline_writers

    scenario = _stream()
    run = _timed((0, 0, 12, 12), admitted=(0, 0, 3, 3), finished=(1, 1, 4, 5))
    # Request 0 was first freed with 10 blocks in the free queue, after 4
    # removals. Request 2 looks up 10 removals later: each of those 10 blocks
    # may have gone, but the next removal would be the first of request 0's
    # own, so its 16 tokens are still owed. Request 3 looks up 11 removals
    # later: one of request 0's blocks may be evicted, nothing is owed.
    lru = _queued(
        run,
        {0: (0, 10, 4), 1: (0, 9, 5), 2: (4 + 10, 8, 20), 3: (4 + 11, None, None)},
    )
    assert timeline_writers(scenario, lru) == [
        frozenset(),
        frozenset(),
        frozenset({0}),
        frozenset(),
    ]
    _, findings = judge_engine_run(scenario, lru)
    assert [(f.kind, f.request, f.expected_tokens, f.hit_tokens) for f in findings] == [
        (FindingKind.FALLBACK, 2, 16, 12)
    ]
    # Without the counters (manager mode, older files) nothing is owed.
    unrecorded = _queued(run, {0: (0, 10, 4), 1: (0, 9, 5), 2: (None, 8, 20), 3: (15, 1, 1)})
    assert timeline_writers(scenario, unrecorded) is None


def test_lru_on_a_sliding_window_needs_the_blocks_the_writer_found_too() -> None:
    from differential.oracle.engine import timeline_writers

    def sequential(groups: tuple[KVCacheGroup, ...]) -> Scenario:
        return Scenario(
            kv_cache_groups=groups,
            requests=(RequestSpec(16, 4), RequestSpec(16, 8), RequestSpec(16, 4)),
            shared_prefix_tokens=16,
            prefill_chunk_tokens=32,
            workload=Workload(mode=DriveMode.SCHEDULER),
        )

    fa = KVCacheGroup(GroupKind.FULL_ATTENTION, 4)
    swa = KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 8)
    run = _timed((0, 16, 16), admitted=(0, 2, 4), finished=(1, 3, 5))
    # Request 0 (first freed with 5 queued blocks, after 4 removals) may have
    # lost a block by request 2's lookup (12 - 4 > 5); request 1 (20 queued,
    # after 6) has not (12 - 6 <= 20).
    lru = _queued(run, {0: (0, 5, 4), 1: (4, 20, 6), 2: (12, None, None)})
    # Full attention: request 1 holds every block of its prefix itself.
    assert timeline_writers(sequential((fa,)), lru)[2] == frozenset({1})
    # With a sliding window, request 1 found the blocks below its window
    # cached by request 0 and handed out the null block there: request 0's
    # possible eviction takes request 1's promise with it.
    assert timeline_writers(sequential((fa, swa)), lru)[2] == frozenset()


def test_repeated_requests_are_recognised_by_tokens() -> None:
    from differential.oracle.engine import repeated_requests

    # Requests 0 and 2 copy the 16-token shared prefix (2 repeats 0 as plain
    # tokens); 1 and 3 are unique, and 4 is a later turn of 1 (shares_with).
    scenario = Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 4),),
        requests=(
            RequestSpec(16, 4),
            RequestSpec(0, 20),
            RequestSpec(16, 4),
            RequestSpec(0, 20),
            RequestSpec(20, 4, 1),
        ),
        shared_prefix_tokens=16,
        prefill_chunk_tokens=32,
    )
    assert repeated_requests(scenario) == frozenset({2, 4})
    # Three shared tokens are below the hit alignment (4): nothing repeats.
    short = dataclasses.replace(
        scenario, shared_prefix_tokens=3, requests=(RequestSpec(3, 4), RequestSpec(3, 4))
    )
    assert repeated_requests(short) == frozenset()


def test_pool_regression_compares_totals_under_pressure_only() -> None:
    from differential.compare import pool_regression

    base = dataclasses.replace(_run((0, 40, 40)), evicted_blocks=3)
    worse = dataclasses.replace(_run((0, 40, 0), variant="candidate"), evicted_blocks=9)
    (finding,) = [pool_regression(base, worse)]
    assert finding is not None and finding.kind is FindingKind.POOL_REGRESSION
    assert (finding.variant, finding.request, finding.expected_tokens, finding.hit_tokens) == (
        "candidate vs unfixed",
        None,
        80,
        40,
    )
    assert "lower on requests [2]" in finding.summary()
    # More in all is no regression, whatever one request lost; and without
    # evictions or preemptions the pool is not the cause.
    assert pool_regression(base, dataclasses.replace(worse, requests=base.requests)) is None
    calm = dataclasses.replace(base, evicted_blocks=0)
    assert pool_regression(calm, dataclasses.replace(worse, evicted_blocks=0)) is None


def test_a_resumed_lookup_is_owed_the_prefix_the_free_queue_kept() -> None:
    from differential.observation import ResumedLookup
    from differential.oracle.core import drafter_model
    from differential.oracle.engine import resumed_findings, resumed_owed_tokens
    from differential.scenario import Drafter, DrafterKind

    def fa8(**changes: object) -> Scenario:
        scenario = Scenario(
            kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 8),),
            requests=(RequestSpec(0, 30),),
            shared_prefix_tokens=0,
            prefill_chunk_tokens=64,
            workload=Workload(mode=DriveMode.SCHEDULER, arrival_steps=(0,)),
        )
        return dataclasses.replace(scenario, **changes)

    def lookup(hit: int, queued: int, removed: int) -> ResumedLookup:
        # Preempted with 48 of its 49 tokens computed: 6 cached blocks.
        return ResumedLookup(9, hit, 49, 48, queued, 100, 100 + removed)

    plain = fa8()
    model = drafter_model(plain)
    # Nothing removed: all 6 blocks, within 49 - 1 tokens: 48.
    assert resumed_owed_tokens(plain, model, lookup(0, 0, 0)) == 48
    # 3 queued ahead, 5 removed: at most the 2 last blocks gone, 4 kept: 32.
    assert resumed_owed_tokens(plain, model, lookup(0, 3, 5)) == 32
    # 9 removed past the 3: no block is sure to be cached.
    assert resumed_owed_tokens(plain, model, lookup(0, 3, 9)) == 0
    # The EAGLE drop (lookahead hashes off) recomputes the last kept block.
    eagle = fa8(drafter=Drafter(DrafterKind.EAGLE, 1), disable_lookahead_block_hashes=True)
    assert resumed_owed_tokens(eagle, drafter_model(eagle), lookup(0, 0, 0)) == 40
    run = dataclasses.replace(
        _timed((0,), admitted=(0,), finished=(20,)),
        preemptions=1,
        requests=(
            dataclasses.replace(_timed((0,), (0,), (20,)).requests[0], resumed=(lookup(24, 3, 5),)),
        ),
    )
    (finding,) = resumed_findings(plain, run, Policy.VLLM)
    assert (finding.kind, finding.request, finding.expected_tokens, finding.hit_tokens) == (
        FindingKind.FALLBACK,
        0,
        32,
        24,
    )
    # Not judged where a block table does not hold the whole prefix.
    swa = fa8(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 8),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 8, 16),
        )
    )
    assert resumed_findings(swa, run, Policy.VLLM) == []

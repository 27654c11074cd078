"""DeepSeek-V4.1's SWA bounded replay (vLLM PR #56227), hand-worked (no
vLLM): the layout rules of ``bounded_replay`` groups, the ``replay`` rule,
the statistics and the connector's adoption under replay, and the slot rule
(every token a step computes has a slot in each attention table)."""

from __future__ import annotations

import dataclasses

import pytest

from differential.errors import ScenarioError
from differential.findings import FindingKind
from differential.observation import (
    ConnectorLookup,
    RequestObservation,
)
from differential.oracle.blocks import uncovered_findings
from differential.oracle.connector import adoption_owed
from differential.oracle.metrics import expected_counts
from differential.oracle.replay import adopted_hit_tokens, owed_start, replay_findings
from differential.scenario import (
    DriveMode,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
    Workload,
)
from tests.factories import layout_scenario, scheduler_run

K = GroupKind
G = KVCacheGroup
REPLAY = G(K.SLIDING_WINDOW_MLA, 64, 128, bounded_replay=True)
SCHEDULER = Workload(mode=DriveMode.SCHEDULER)


def replay_scenario(*groups: KVCacheGroup) -> Scenario:
    return Scenario(
        kv_cache_groups=groups or (G(K.MLA, 64), REPLAY),
        requests=(RequestSpec(512, 40), RequestSpec(512, 30), RequestSpec(100, 30)),
        shared_prefix_tokens=512,
        prefill_chunk_tokens=64,
        workload=SCHEDULER,
    )


def test_a_replay_group_leaves_prefix_caching_and_round_trips() -> None:
    s = replay_scenario()
    assert not REPLAY.prefix_cacheable and REPLAY.prefix_replay_tokens == 128
    assert s.prefix_replay_tokens == 128
    # Out of every lookup: no hash block, hit alignment or window rule reads it.
    assert s.cacheable_groups == (G(K.MLA, 64),)
    assert s.sliding_window_groups == ()
    assert Scenario.from_json(s.to_json()) == s
    assert s.to_dict()["kv_cache_groups"][1]["bounded_replay"] is True
    # Written only when true: a plain sliding-window MLA group keeps its form.
    plain = replay_scenario(G(K.MLA, 64), G(K.SLIDING_WINDOW_MLA, 64, 128))
    assert "bounded_replay" not in plain.to_dict()["kv_cache_groups"][1]
    assert plain.prefix_replay_tokens == 0


@pytest.mark.parametrize(
    ("groups", "field", "message"),
    [
        (
            (G(K.MLA, 64), G(K.SLIDING_WINDOW, 64, 128, bounded_replay=True)),
            "kv_cache_groups[1].bounded_replay",
            "only sliding_window_mla groups replay",
        ),
        (
            (G(K.MLA, 64), REPLAY, dataclasses.replace(REPLAY, sliding_window_tokens=64)),
            "kv_cache_groups[2].sliding_window_tokens",
            "prefix replay windows agree",
        ),
        ((REPLAY,), "kv_cache_groups", "at least one prefix-cacheable group"),
        (
            (G(K.MLA, 64), dataclasses.replace(REPLAY, is_eagle_group=True)),
            "kv_cache_groups[1].is_eagle_group",
            "no part in prefix caching",
        ),
    ],
)
def test_refused_replay_layouts(groups: tuple[KVCacheGroup, ...], field: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        layout_scenario(*groups)
    assert info.value.field == field


def test_the_owed_start_of_a_hit() -> None:
    s = replay_scenario()
    # Past the window: the hit's last 128 tokens are recomputed.
    assert (adopted_hit_tokens(s, 512), owed_start(s, 512)) == (512, (384, 384))
    assert owed_start(s, 192) == (64, 64)
    # No longer than the window: not adopted at all.
    assert (adopted_hit_tokens(s, 128), adopted_hit_tokens(s, 64)) == (0, 0)
    assert owed_start(s, 0) == (0, 0)
    # Without a replay group every hit is adopted.
    plain = replay_scenario(G(K.MLA, 64), G(K.SLIDING_WINDOW_MLA, 64, 128))
    assert adopted_hit_tokens(plain, 64) == 64


def observed(index: int, hit: int, replay: tuple[int, int]) -> RequestObservation:
    return RequestObservation(
        index, 552, hit, 0, (hit, 0), (0, 0), scheduled_step=index, replay=replay
    )


def test_the_replay_rule_names_what_the_worker_was_told() -> None:
    s = replay_scenario()
    clean = scheduler_run(
        observed(0, 0, (0, 0)), observed(1, 512, (384, 384)), observed(2, 64, (0, 0))
    )
    assert replay_findings(s, clean) == []
    # A replay start left at the hit's start, and a short hit adopted.
    wrong = scheduler_run(observed(1, 512, (384, 0)), observed(2, 64, (0, 64)))
    found = replay_findings(s, wrong)
    assert [(f.kind, f.request, f.expected_tokens) for f in found] == [
        (FindingKind.REPLAY, 1, 384),
        (FindingKind.REPLAY, 2, 0),
    ]
    assert found[0].detail == (
        "first scheduled with 384 computed tokens and replay_start 0, owed 384 and 384 "
        "(a hit of 512 tokens replays its last 128)"
    )
    assert found[1].detail == (
        "first scheduled with 0 computed tokens and replay_start 64, owed 0 and 0 "
        "(a hit of 64 tokens, no longer than the 128-token window, is not adopted)"
    )
    # Nothing is owed without a replay group.
    plain = replay_scenario(G(K.MLA, 64), G(K.SLIDING_WINDOW_MLA, 64, 128))
    assert replay_findings(plain, wrong) == []


def test_statistics_count_no_hit_the_replay_does_not_adopt() -> None:
    s = replay_scenario()
    run = scheduler_run(
        observed(0, 0, (0, 0)),
        observed(1, 512, (384, 384)),
        observed(2, 64, (0, 0)),
    )
    assert expected_counts(run, s).hits == 512
    # Manager mode drives no Scheduler, so no replay: every hit counts.
    assert expected_counts(dataclasses.replace(run, mode="manager"), s).hits == 576


def test_the_connector_answer_is_taken_in_whole_blocks_under_replay() -> None:
    lookup = ConnectorLookup(
        local_hit_tokens=0,
        presented_tokens=0,
        matched_tokens=330,
        store_tokens=330,
        local_tokens=0,
        external_tokens=320,
    )
    # 330 answered: 320 in whole 64-token blocks (then 192 computed, 128 replayed).
    assert adoption_owed(lookup, 64) == 330
    assert adoption_owed(lookup, 64, replay_tokens=128) == 320
    short = dataclasses.replace(lookup, matched_tokens=100, store_tokens=100)
    # 64 in whole blocks, no longer than the window: nothing adopted.
    assert adoption_owed(short, 64, replay_tokens=128) == 0


def test_a_step_without_slots_is_wrong_kv() -> None:
    s = replay_scenario()
    # Step 3 computes request 1 to 448 tokens, but its MLA table holds 384.
    run = scheduler_run(
        uncovered_steps=((1, 3, 0, 448, 384), (1, 4, 0, 512, 384), (2, 5, 1, 64, 64))
    )
    found = uncovered_findings(s, run)
    assert [(f.kind, f.request) for f in found] == [(FindingKind.WRONG_KV, 1)]
    assert found[0].detail == (
        "step 3 computes the request up to 448 tokens, but group 0 (mla, block 64) holds "
        "slots for 384: allocate_slots gave the step's tokens no block (+1 more)"
    )
    assert uncovered_findings(s, scheduler_run()) == []

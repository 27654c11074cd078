"""Disaggregated prefill and decode through two real vLLM Schedulers
(``workload.connector.kv_role`` ``kv_consumer``): a prefill instance
(``kv_producer``) computes each request with ``max_tokens`` 1 and saves it to
the shared store, the driven decode instance loads it asynchronously and
decodes. Exact values from real runs."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from differential.corpus import load_entry
from differential.driver.scheduler_mode import run_scheduler_scenario
from differential.observation import RunObservation
from differential.oracle.connector import connector_findings
from differential.oracle.disagg import disagg_findings, local_owed, prefill_owed
from differential.oracle.engine import judge_observed_run
from differential.scenario import ConnectorLoad, KVRole, Scenario
from tests.factories import ROOT

pytestmark = pytest.mark.vllm


def _scenario(groups: list[dict[str, Any]], **fields: Any) -> Scenario:
    """Three requests on the decode instance: a 100-token prompt of a
    128-token prefix, a 148-token prompt of all of it and 20 more, a resend
    of the first prompt's 100 tokens and 7 more; four decode steps each."""
    data: dict[str, Any] = {
        "format": "kvfuzz.scenario",
        "version": 1,
        "name": "disagg",
        "kv_cache_groups": groups,
        "retention_interval_tokens": None,
        "drafter": {"kind": "none", "num_speculative_tokens": 0},
        "kv_connector": True,
        "prefill_chunk_tokens": 64,
        "decode_steps": 4,
        "shared_prefix_tokens": 128,
        "requests": [
            {"shares_with": None, "divergence_tokens": 100, "suffix_tokens": 0},
            {"shares_with": None, "divergence_tokens": 128, "suffix_tokens": 20},
            {"shares_with": 0, "divergence_tokens": 100, "suffix_tokens": 7},
        ],
        "workload": {
            "mode": "scheduler",
            "connector": {"load": "async", "kv_role": "kv_consumer"},
        },
    }
    data.update(fields)
    return Scenario.from_json(json.dumps(data))


FA16 = {"kind": "full_attention", "block_size_tokens": 16, "sliding_window_tokens": None}
MAMBA32 = {"kind": "mamba", "block_size_tokens": 32, "sliding_window_tokens": None}


def _lookups(run: RunObservation) -> list[tuple[int | None, int | None, int, int, int, bool]]:
    """Per request: (prefill instance's hit, tokens it computed, decode
    instance's local hit, store held, external tokens loaded, async), in tokens."""
    assert run.error is None
    out = []
    for r in run.requests:
        c = r.connector
        assert c is not None
        out.append(
            (
                c.prefill_hit_tokens,
                c.prefill_tokens,
                c.local_hit_tokens,
                c.store_tokens,
                c.external_tokens,
                c.load_async,
            )
        )
    return out


@pytest.mark.parametrize("groups", [[FA16], [FA16, MAMBA32]], ids=["fa", "mamba-hybrid"])
def test_decode_instance_loads_what_the_prefill_instance_computed(
    groups: list[dict[str, Any]],
) -> None:
    s = _scenario(groups)
    run = run_scheduler_scenario(s, "unfixed", record_cache_map=True)
    # Request 0: the prefill instance computes 100 tokens, the store holds
    # 96 (six 16-token hash blocks; on the hybrid the Mamba state at the
    # prompt's checkpoint (100 - 1) // 16 * 16 = 96), the decode instance
    # loads all 96 asynchronously. Request 1: the prefill instance hits 96
    # in its own cache and computes 148; the decode instance hits the 96 it
    # loaded for request 0 in its local cache and loads 48 more. Request 2:
    # the 96 are local, the store holds nothing past them.
    assert _lookups(run) == [
        (0, 100, 0, 96, 96, True),
        (96, 148, 96, 144, 48, True),
        (96, 107, 96, 96, 0, False),
    ]
    assert [r.hit_tokens for r in run.requests] == [0, 96, 96]
    assert run.timeline[0].startswith("prefill instance, steps 0..")
    assert "req-0 (hit 0) computed 100" in run.timeline[0]
    assert "req-0 loads [0, 96) async" in run.timeline[1]
    # Both rules judge and are met: request 1 is owed 144 from the store and
    # 96 locally from request 0's load; request 2 is owed 96 locally.
    assert [prefill_owed(s, run, r) for r in run.requests] == [96, 144, None]
    owed = [local_owed(s, run, r) for r in run.requests]
    assert [(o.tokens, o.loader) if o else None for o in owed] == [None, (96, 0), (96, 0)]
    assert disagg_findings(s, run) == []
    assert connector_findings(s, run) == []


def test_one_engine_loads_nothing_the_prefill_instance_would_have_saved() -> None:
    """The same workload with kv_role kv_both (one engine, no prefill
    instance): the store is empty at request 0 and holds only what the
    engine computed itself, so nothing is loaded."""
    s = _scenario([FA16, MAMBA32])
    assert s.workload.connector is not None
    both = dataclasses.replace(s.workload.connector, kv_role=KVRole.KV_BOTH)
    s = dataclasses.replace(s, workload=dataclasses.replace(s.workload, connector=both))
    run = run_scheduler_scenario(s, "unfixed")
    assert [
        (c.local_hit_tokens, c.store_tokens, c.external_tokens, c.prefill_tokens)
        for c in (r.connector for r in run.requests)
        if c is not None
    ] == [
        (0, 0, 0, None),
        (96, 96, 0, None),
        (96, 96, 0, None),
    ]


def test_eagle_drop_gives_back_a_block_of_what_was_loaded() -> None:
    """Shrunk from a seed-71 campaign (full attention, block 4, MTP drafter:
    a KV connector turns lookahead hashes off, so the EAGLE drop is on). The
    decode instance loads 24 of request 0's 25 tokens; request 1 (request
    0's prompt and 4 more) hits 20 locally, one block under the 24 loaded,
    as vLLM's lookup with ``use_eagle`` gives back its last matched block,
    and loads 8 more. The local rule owes 20, not 24."""
    s = _scenario(
        [{"kind": "full_attention", "block_size_tokens": 4, "sliding_window_tokens": None}],
        drafter={"kind": "mtp", "num_speculative_tokens": 1},
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=8,
        decode_steps=0,
        shared_prefix_tokens=0,
        requests=[
            {"shares_with": None, "divergence_tokens": 0, "suffix_tokens": 25},
            {"shares_with": 0, "divergence_tokens": 25, "suffix_tokens": 4},
        ],
        workload={
            "mode": "scheduler",
            "max_num_seqs": 1,
            "connector": {"load": "async", "kv_role": "kv_consumer"},
        },
    )
    run = run_scheduler_scenario(s, "unfixed")
    assert _lookups(run) == [(0, 25, 0, 24, 24, True), (20, 29, 20, 28, 8, True)]
    owed = local_owed(s, run, run.requests[1])
    assert owed is not None and (owed.tokens, owed.loader, owed.loaded_tokens) == (20, 0, 24)
    assert disagg_findings(s, run) == []


def test_a_loaded_mamba_state_under_the_eagle_drop_serves_no_local_hit() -> None:
    """Shrunk from a seed-71 campaign (full attention 8 + three Mamba groups
    of 8, EAGLE drafter, divergent hybrid hits): two 17-token prompts
    sharing 16 tokens. The prefill instance, which computed request 0
    itself, hits 8 for request 1 (its state at 8 proves the block past it);
    the decode instance loaded only the state at 16, which under the drop
    proves nothing, so it hits 0 and loads [0, 16) again. Not judged."""
    s = _scenario(
        [
            {"kind": "full_attention", "block_size_tokens": 8, "sliding_window_tokens": None},
            *[{"kind": "mamba", "block_size_tokens": 8, "sliding_window_tokens": None}] * 3,
        ],
        drafter={"kind": "eagle", "num_speculative_tokens": 1},
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=8,
        decode_steps=0,
        shared_prefix_tokens=16,
        requests=[
            {"shares_with": None, "divergence_tokens": 16, "suffix_tokens": 1},
            {"shares_with": None, "divergence_tokens": 16, "suffix_tokens": 1},
        ],
        workload={
            "mode": "scheduler",
            "max_num_seqs": 1,
            "connector": {"load": "async", "divergent_hybrid_hits": True, "kv_role": "kv_consumer"},
        },
    )
    run = run_scheduler_scenario(s, "unfixed")
    assert _lookups(run) == [(0, 17, 0, 16, 16, True), (8, 17, 0, 16, 16, True)]
    assert local_owed(s, run, run.requests[1]) is None
    assert disagg_findings(s, run) == []


def test_a_loaded_mamba_partial_tail_stalls_the_decode_instance() -> None:
    # known-issues/...-misses-mamba-partial-tail-stalls.json: FA 16 + Mamba 16,
    # hash block 2, two 3-token prompts each loading 2 tokens. The decode
    # instance stalls (the prefill instance finished both): each load takes 2
    # of the 4 free blocks, and once request 0's load is cached it owes its
    # Mamba group a copy of the state keyed at 2 inside the block, with 0 free.
    entry = load_entry(
        ROOT / "known-issues/connector-async-load-reservation-misses-mamba-partial-tail-stalls.json"
    )
    run = run_scheduler_scenario(entry.scenario, "unfixed")
    assert run.error == (
        "step 64: update_from_output: Scheduler.schedule: RuntimeError: scheduled nothing for "
        "64 steps with 2 request(s) waiting (pool 5 blocks), 1 of them loaded request(s) "
        "owing a Mamba partial-tail copy"
    )
    # One block more (the copy's) and both loads run to their end.
    roomy = dataclasses.replace(
        entry.scenario, workload=dataclasses.replace(entry.scenario.workload, pool_blocks=6)
    )
    run = run_scheduler_scenario(roomy, "unfixed")
    assert run.error is None
    assert [(r.connector.local_tokens, r.connector.external_tokens) for r in run.requests] == [
        (0, 2),
        (0, 2),
    ]


def test_a_store_answer_ending_at_a_diverged_hit_is_dropped() -> None:
    # known-issues/connector-divergent-hit-drops-equal-remote-tail.json: the
    # third request resends the first's 45 tokens; the decode instance's
    # lookup diverges at 44 (full attention) past 16 (Mamba), the store
    # answers 12 past 32, exactly the tail, and vLLM starts it at 16.
    entry = load_entry(ROOT / "known-issues/connector-divergent-hit-drops-equal-remote-tail.json")
    run = run_scheduler_scenario(entry.scenario, "unfixed")
    assert run.error is None
    assert run.hits == (0, 0, 16)
    c = run.requests[2].connector
    assert c is not None
    assert (c.local_hit_tokens, c.presented_tokens, c.matched_tokens, c.store_tokens) == (
        44,
        32,
        12,
        44,
    )
    assert (c.local_tokens, c.external_tokens, c.diverged, c.prefill_tokens) == (16, 0, True, 45)
    assert [prefill_owed(entry.scenario, run, r) for r in run.requests] == [44, None, 44]
    assert [f.detail for f in disagg_findings(entry.scenario, run)] == [
        "disaggregated: starts with 16 computed tokens (16 local + 0 external), owed 44 the "
        "prefill instance computed (45 tokens) and saved; the store held 44 (the store's "
        "answer ending where the diverged local hit does was dropped: local hit 44, 12 past 32)"
    ]


def test_a_synchronous_load_leaves_its_mamba_tail_unkeyed() -> None:
    # sync-load-mamba-tail-not-cached: FA 8 + Mamba 8, hash block 4, a
    # 13-token prompt loads 12 synchronously; the resend's Mamba group hits
    # nothing locally (full attention 12), so it loads the 12 again.
    path = ROOT / "known-issues/connector-sync-load-mamba-tail-not-cached.json"
    s = load_entry(path).scenario
    run = run_scheduler_scenario(s, "unfixed")
    assert [(c.local_tokens, c.external_tokens) for c in _connectors(run)] == [(0, 12), (0, 12)]
    assert run.requests[1].per_group_hit_tokens == (12, 0)
    assert [(f.request, f.expected_tokens, f.hit_tokens) for f in disagg_findings(s, run)] == [
        (1, 12, 0)
    ]
    # Near misses on real runs: an asynchronous load is cached at its end,
    # and a load ending on the Mamba block grid (a 17-token prompt) is a
    # full block's state.
    store = dataclasses.replace(s.workload.connector, load=ConnectorLoad.ASYNC)
    loaded_async = dataclasses.replace(s, workload=dataclasses.replace(s.workload, connector=store))
    run = run_scheduler_scenario(loaded_async, "unfixed")
    assert [(c.local_tokens, c.external_tokens) for c in _connectors(run)] == [(0, 12), (12, 0)]
    longer = dataclasses.replace(
        s,
        shared_prefix_tokens=17,
        requests=tuple(dataclasses.replace(q, divergence_tokens=17) for q in s.requests),
    )
    run = run_scheduler_scenario(longer, "unfixed")
    assert [(c.local_tokens, c.external_tokens) for c in _connectors(run)] == [(0, 16), (16, 0)]
    assert disagg_findings(longer, run) == []


def _connectors(run: RunObservation) -> list[Any]:
    """Per request, its connector lookup (every request of these runs has one)."""
    return [r.connector for r in run.requests]


def test_a_divergent_load_fills_the_lagging_windows_blocks_below_the_hit() -> None:
    # FA 2 + SWA 1 (window 3) + Mamba 2 on the decode instance, MTP 1, divergent
    # hybrid hits. Turn 2 hits 8 locally in full attention and Mamba but 0 in
    # the sliding window: the store loads the window's blocks below the hit
    # (vLLM PR #50344) besides token 8. Turn 3 then hits 8 through those
    # blocks; the ledger once recorded only the tokens past the local hit,
    # and read turn 3's window block as a freed Mamba state block (a false
    # wrong-kv found by a seed-21 Mamba campaign).
    scenario = Scenario.from_dict(
        {
            "format": "kvfuzz.scenario",
            "version": 1,
            "name": "divergent-load-fills-the-window",
            "kv_cache_groups": [
                {"kind": "full_attention", "block_size_tokens": 2, "sliding_window_tokens": None},
                {"kind": "sliding_window", "block_size_tokens": 1, "sliding_window_tokens": 3},
                {"kind": "mamba", "block_size_tokens": 2, "sliding_window_tokens": None},
            ],
            "hash_block_size_tokens": None,
            "hit_alignment_tokens": None,
            "retention_interval_tokens": 0,
            "drafter": {"kind": "mtp", "num_speculative_tokens": 1},
            "kv_connector": True,
            "disable_lookahead_block_hashes": True,
            "disable_eagle_block_drop": False,
            "prefill_chunk_tokens": 1,
            "decode_steps": 0,
            "shared_prefix_tokens": 4,
            "requests": [
                {"name": "t1", "shares_with": None, "divergence_tokens": 4, "suffix_tokens": 5},
                {"name": "t2", "shares_with": 0, "divergence_tokens": 9, "suffix_tokens": 1},
                {"name": "t3", "shares_with": 1, "divergence_tokens": 10, "suffix_tokens": 0},
            ],
            "workload": {
                "mode": "scheduler",
                "pool_blocks": 94,
                "max_num_seqs": 1,
                "max_num_batched_tokens": 2,
                "shares_output": True,
                "connector": {
                    "load": "async",
                    "divergent_hybrid_hits": True,
                    "kv_role": "kv_consumer",
                },
            },
        }
    )
    run = run_scheduler_scenario(scenario, "unfixed")
    turn2, turn3 = run.requests[1], run.requests[2]
    assert list(run.hits) == [0, 8, 8]
    assert turn2.per_group_hit_tokens == (8, 0, 8)
    assert turn2.connector is not None and turn2.connector.diverged
    assert turn2.connector.load_targets is not None
    loaded_window = [block for block, null, _ in turn2.connector.load_targets[1] if not null]
    # Turn 3's window: token 6 (turn 1's own block) and token 7, loaded for turn 2.
    window = turn3.lookup_blocks[1]
    assert window[:6] == (None,) * 6
    assert window[6] is not None and (window[6].writer, window[6].group) == (0, 1)
    assert window[7] is not None and window[7].block_id in loaded_window
    assert (window[7].writer, window[7].group, window[7].writer_block_index) == (1, 1, 7)
    assert judge_observed_run(scenario, run)[1] == ()


def test_a_mamba_state_the_prefill_instance_preempted_is_not_owed() -> None:
    # FA 32 + three Mamba 32, hash block 2, a 12-block pool on both instances.
    # The prefill instance runs both requests in step 0 (10 and 6 tokens),
    # preempts request 1 at step 1, and resumes it with a local hit of 6:
    # the state at 6 it had pending for hand-off went with the freed blocks
    # (MambaManager.pop_blocks_for_free), and the resumed request hands off
    # none it hit. The decode instance finds nothing in the store for it.
    scenario = Scenario.from_dict(
        {
            "format": "kvfuzz.scenario",
            "version": 1,
            "name": "prefill-instance-preempts-a-mamba-request",
            "kv_cache_groups": [
                {"kind": "full_attention", "block_size_tokens": 32, "sliding_window_tokens": None}
            ]
            + [{"kind": "mamba", "block_size_tokens": 32, "sliding_window_tokens": None}] * 3,
            "hash_block_size_tokens": 2,
            "hit_alignment_tokens": None,
            "retention_interval_tokens": 32,
            "drafter": {"kind": "none", "num_speculative_tokens": 0},
            "kv_connector": True,
            "prefill_chunk_tokens": 16,
            "decode_steps": 0,
            "shared_prefix_tokens": 8,
            "requests": [
                {"name": "a", "shares_with": None, "divergence_tokens": 8, "suffix_tokens": 3},
                {"name": "b", "shares_with": None, "divergence_tokens": 8, "suffix_tokens": 0},
            ],
            "workload": {
                "mode": "scheduler",
                "pool_blocks": 12,
                "arrival_steps": [0, 0],
                "max_num_seqs": 4,
                "max_num_batched_tokens": 32,
                "connector": {"kv_role": "kv_consumer"},
            },
        }
    )
    run = run_scheduler_scenario(scenario, "unfixed")
    a, b = (r.connector for r in run.requests)
    assert a is not None and b is not None
    assert (a.prefill_tokens, a.prefill_preemptions, a.external_tokens) == (11, 0, 10)
    assert (b.prefill_tokens, b.prefill_preemptions, b.store_tokens) == (8, 1, 0)
    assert type(b).from_dict(b.to_dict()) == b
    assert prefill_owed(scenario, run, run.requests[0]) == 10
    assert prefill_owed(scenario, run, run.requests[1]) is None
    assert judge_observed_run(scenario, run)[1] == ()

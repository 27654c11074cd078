"""Mamba groups without vLLM: the scenario model and the state-group oracle on
hand-worked cases."""

from __future__ import annotations

import dataclasses
import json

import pytest

from differential.corpus import finding_tag
from differential.errors import ScenarioError
from differential.findings import Policy
from differential.observation import ManagerSettings, RequestObservation, RunObservation
from differential.oracle import (
    attention_dense_hit,
    drafter_model,
    judge_run,
    references,
    state_group_indices,
    state_positions,
)
from differential.scenario import (
    Drafter,
    DrafterKind,
    GroupKind,
    KVCacheGroup,
    MambaPrefill,
    RequestSpec,
    Scenario,
)
from tests.factories import ROOT, reach

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA
EAGLE = Drafter(DrafterKind.EAGLE, 1)


def fa_mamba(
    length: int,
    *,
    block: int = 64,
    hash_block: int | None = 16,
    prefill: MambaPrefill = MambaPrefill.BLOCK,
    drafter: Drafter = EAGLE,
    **kw: object,
) -> Scenario:
    """FA + Mamba of one block size, a writer and its identical resend."""
    return Scenario(
        kv_cache_groups=(KVCacheGroup(FA, block), KVCacheGroup(MAMBA, block)),
        requests=(RequestSpec(length, 0), RequestSpec(length, 0, shares_with=0)),
        shared_prefix_tokens=length,
        hash_block_size_tokens=hash_block,
        retention_interval_tokens=kw.pop("retention", 0),  # type: ignore[arg-type]
        drafter=drafter,
        disable_lookahead_block_hashes=True,
        mamba_prefill=prefill,
        **kw,  # type: ignore[arg-type]
    )


def observed(scenario: Scenario, hits: list[int]) -> RunObservation:
    settings = ManagerSettings(
        drafter_model(scenario).drop, 0, 0, 1, scenario.effective_hit_alignment_tokens
    )
    return RunObservation(
        variant="v",
        vllm_version="test",
        settings=settings,
        requests=tuple(
            RequestObservation(i, r.prompt_tokens, h, 0, (h, h), (0, 0))
            for i, (r, h) in enumerate(zip(scenario.requests, hits, strict=True))
        ),
    )


# ------------------------------------------------------------ scenario model


def test_fine_grained_hash_block_sets_the_hit_alignment() -> None:
    # vLLM partial_hash_hits_enabled: a Mamba block coarser than the hash block.
    s = fa_mamba(100)
    assert (s.partial_hash_hits, s.effective_hit_alignment_tokens) == (True, 16)
    # The hash block equal to the Mamba block: no partial hits, A = 64.
    s = fa_mamba(100, hash_block=None)
    assert (s.partial_hash_hits, s.effective_hit_alignment_tokens) == (False, 64)
    # A sliding-window group coarser than the hash block vetoes partial hits.
    s = Scenario(
        kv_cache_groups=(
            KVCacheGroup(FA, 64),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 32, 128),
            KVCacheGroup(MAMBA, 64),
        ),
        requests=(RequestSpec(10, 0),),
        shared_prefix_tokens=10,
        hash_block_size_tokens=16,
    )
    assert (s.partial_hash_hits, s.effective_hit_alignment_tokens) == (False, 64)
    assert state_group_indices(s) == (2,)


@pytest.mark.parametrize(
    ("groups", "field"),
    [
        ((KVCacheGroup(FA, 64), KVCacheGroup(MAMBA, 32)), "kv_cache_groups"),
        (
            (KVCacheGroup(FA, 16), KVCacheGroup(MAMBA, 32), KVCacheGroup(MAMBA, 16)),
            "kv_cache_groups",
        ),
        (
            (KVCacheGroup(FA, 16), KVCacheGroup(MAMBA, 16), KVCacheGroup(MAMBA, 32)),
            "kv_cache_groups",
        ),
    ],
)
def test_refused_mamba_layouts_name_the_field(groups, field) -> None:
    with pytest.raises(ScenarioError) as info:
        Scenario(kv_cache_groups=groups, requests=(RequestSpec(4, 0),), shared_prefix_tokens=4)
    assert info.value.field == field


def test_mamba_options_need_a_mamba_group() -> None:
    groups = (KVCacheGroup(FA, 16),)
    for kw, field in (
        ({"enable_mamba_shared_prefix_checkpoint": True}, "enable_mamba_shared_prefix_checkpoint"),
        ({"mamba_prefill": MambaPrefill.BLOCK}, "mamba_prefill"),
    ):
        with pytest.raises(ScenarioError) as info:
            Scenario(groups, (RequestSpec(4, 0),), 4, **kw)  # type: ignore[arg-type]
        assert info.value.field == field
    with pytest.raises(ScenarioError) as info:
        Scenario.from_dict({**fa_mamba(10).to_dict(), "mamba_prefill": "step"})
    assert info.value.field == "mamba_prefill"
    # Positive retention is accepted with a Mamba group and no SWA group.
    assert fa_mamba(10, retention=128).retention_interval_tokens == 128


def test_mamba_json_round_trips_and_old_files_are_unchanged() -> None:
    s = fa_mamba(100, enable_mamba_shared_prefix_checkpoint=True)
    data = s.to_dict()
    assert data["mamba_prefill"] == "block"
    assert data["enable_mamba_shared_prefix_checkpoint"] is True
    assert Scenario.from_dict(json.loads(s.to_json())) == s
    default = fa_mamba(100, prefill=MambaPrefill.SCHEDULER).to_dict()
    assert "mamba_prefill" not in default
    assert "enable_mamba_shared_prefix_checkpoint" not in default
    old = json.loads((ROOT / "corpora/cases/swa-eagle-spiral.json").read_text())
    old.pop("expect", None), old.pop("notes", None)
    assert Scenario.from_dict(old).to_dict() == old


# ---------------------------------------------------------------- the oracle


def test_states_exist_where_steps_ended() -> None:
    # Block-carved: a state at every block boundary the writer computed.
    s = fa_mamba(100)
    assert state_positions(s, 0, 0, 0, True, 0, 0) == (64,)
    # vLLM's chunking, budget 2048: the prompt's fine-grained EAGLE resume
    # position 96 - 16 = 80 is the only stop; block 0 (64) gets no state.
    s = fa_mamba(100, prefill=MambaPrefill.SCHEDULER)
    assert state_positions(s, 0, 0, 0, True, 0, 0) == (80,)
    # Without the drop the resume position is 96 and the block grid's 64 is a stop.
    assert state_positions(s, 0, 0, 0, False, 0, 0) == (64, 96)
    # A 200-token writer: the last block-grid resume position 128, the
    # fine-grained resume position 176, then the next block boundary 192 (a
    # step that starts mid-block ends on the grid).
    s = fa_mamba(200, prefill=MambaPrefill.SCHEDULER)
    assert state_positions(s, 0, 0, 0, True, 0, 0) == (128, 176, 192)
    # A junction at 80 with budget 2048 is floored to the block grid (64) ...
    assert state_positions(s, 0, 0, 80, True, 0, 0) == (64, 128, 176, 192)
    # ... and kept exactly with the shared-prefix checkpoint option.
    s = fa_mamba(200, prefill=MambaPrefill.SCHEDULER, enable_mamba_shared_prefix_checkpoint=True)
    assert state_positions(s, 0, 0, 80, True, 0, 0) == (80, 128, 176, 192)


def test_states_exist_where_a_checkpoint_exporting_step_keeps_one() -> None:
    # mamba_prefill: checkpoint (MambaMixer2's one prefill checkpoint block):
    # the 200-token writer's one step 0..200 spans Mamba columns 0..3, starts
    # on the hash grid and holds the fine-grained EAGLE resume position
    # 200 // 16 * 16 - 16 = 176 strictly inside, at least a hash block past
    # its start: the state at 176 is exported from inside the step, which
    # runs on to 200 (no state kept there, off the grid). Split, the
    # scheduler's prefill keeps 128, 176 and 192.
    s = fa_mamba(200, prefill=MambaPrefill.CHECKPOINT)
    assert state_positions(s, 0, 0, 0, True, 0, 0) == (176,)
    # Without the drop the checkpoint is 199 // 16 * 16 = 192, on the grid.
    assert state_positions(s, 0, 0, 0, False, 0, 0) == (192,)
    # 100-token chunks: 0..100 ends on the grid at 64 and 64..164 at 128
    # (not final steps: they stop as the scheduler's do); the final step
    # 128..200 exports 176.
    s = fa_mamba(200, prefill=MambaPrefill.CHECKPOINT, prefill_chunk_tokens=100)
    assert state_positions(s, 0, 0, 0, True, 0, 0) == (64, 128, 176)
    # 192-token chunks: the first step stops at the block grid's resume
    # position 200 // 64 * 64 - 64 = 128 (it is not final), the final one
    # 128..200 exports 176.
    s = fa_mamba(200, prefill=MambaPrefill.CHECKPOINT, prefill_chunk_tokens=192)
    assert state_positions(s, 0, 0, 0, True, 0, 0) == (128, 176)
    # A final step that cannot hold the checkpoint strictly inside exports
    # nothing (64-token steps: the last, 192..200, starts at the checkpoint
    # 199 // 64 * 64 = 192): one-block steps keep the scheduler's states.
    s = fa_mamba(200, prefill=MambaPrefill.CHECKPOINT, prefill_chunk_tokens=64, hash_block=None)
    split = dataclasses.replace(s, mamba_prefill=MambaPrefill.SCHEDULER)
    assert state_positions(s, 0, 0, 0, False, 0, 0) == state_positions(split, 0, 0, 0, False, 0, 0)
    assert state_positions(s, 0, 0, 0, False, 0, 0) == (64, 128, 192)


def test_states_exist_where_steps_of_the_step_budget_ended() -> None:
    # FA 4 + Mamba 4, no drafter, a 24-token writer whose chunks are the
    # workload's max_num_batched_tokens (16), not prefill_chunk_tokens (8):
    # vLLM's chunking ends a step at 16, then at the block grid's resume
    # position (24 - 1) // 4 * 4 = 20, then at 24. No step ends at 8.
    from differential.scenario import DriveMode, Workload

    s = Scenario(
        kv_cache_groups=(KVCacheGroup(FA, 4), KVCacheGroup(MAMBA, 4)),
        requests=(RequestSpec(12, 12), RequestSpec(12, 1)),
        shared_prefix_tokens=12,
        prefill_chunk_tokens=8,
        workload=Workload(mode=DriveMode.SCHEDULER, max_num_batched_tokens=16, max_num_seqs=1),
    )
    assert s.step_budget_tokens == 16
    assert state_positions(s, 0, 0, 0, False, 0, 0) == (16, 20, 24)
    # The sibling shares 12 tokens: full attention proves 12, but the highest
    # state at or below it is none, so it is owed 0 and its hit 0 is clean
    # (chunks of 8 would have kept a state at 8 and owed it).
    refs, findings = judge_run(s, observed(s, [0, 0]))
    assert [(r.dense_tokens, r.expected_tokens) for r in refs] == [(0, 0), (0, 0)]
    assert findings == ()
    # Without the workload's budget the chunks are prefill_chunk_tokens: 8, 16, 20, 24.
    s = dataclasses.replace(s, workload=Workload())
    assert state_positions(s, 0, 0, 0, False, 0, 0) == (8, 16, 20, 24)
    assert [r.expected_tokens for r in judge_run(s, observed(s, [0, 8]))[0]] == [0, 8]


def test_attention_proves_per_hash_block_with_fine_grained_hits() -> None:
    s = fa_mamba(100)
    # 100 shared tokens, resend capped at 99: FA proves 96, the drop gives one
    # hash block back.
    assert attention_dense_hit(s, True, 0, 100, 100, 100, 100) == 80
    assert attention_dense_hit(s, False, 0, 100, 100, 100, 100) == 96


def test_state_one_unit_rule_owes_the_block_state_below_the_replay_boundary() -> None:
    # PR #57444: the writer's replay boundary at A = 16 is 80, one unit below
    # 64; the highest state at or below them is 64: the resend is owed 64.
    s = fa_mamba(100)
    refs, findings = judge_run(s, observed(s, [0, 0]))
    assert [(r.dense_tokens, r.expected_tokens) for r in refs] == [(0, 0), (64, 64)]
    assert [finding_tag(f) for f in findings] == ["fallback@1"]
    # Under `retained` (vLLM's literal retention: no state at 64) nothing is owed.
    refs, findings = judge_run(s, observed(s, [0, 0]), Policy.RETAINED)
    assert refs[1].expected_tokens == 64 and findings  # 80 - A is literal under the drop
    # The hit 64 is clean.
    assert judge_run(s, observed(s, [0, 64]))[1] == ()


def test_a_swa_tail_serves_only_as_far_as_its_writer_proves() -> None:
    # FA 2 + SWA 2 (window 4) + Mamba 2, retention 0, MTP drop, A = 2. Request
    # 1 shares 3 tokens of the 16-token writer; its replay boundary 2 keeps
    # the state at 2 and an SWA tail whose peek block (tokens 2-3) holds its
    # own token 3. Request 2 shares 10 tokens of the prefix, 3 with request
    # 1: request 1 alone proves 2 - 2 (drop) = 0 for it, and the writer keeps
    # only its tails at 12 and 14, so 0 is owed; dense retention gives the
    # writer's state at 8 (10 - one block under the drop).
    s = Scenario(
        kv_cache_groups=(
            KVCacheGroup(FA, 2),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 4),
            KVCacheGroup(MAMBA, 2),
        ),
        requests=(RequestSpec(16, 0), RequestSpec(3, 1), RequestSpec(10, 0)),
        shared_prefix_tokens=16,
        retention_interval_tokens=0,
        drafter=Drafter(DrafterKind.MTP, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=1,
        mamba_prefill=MambaPrefill.BLOCK,
    )
    refs = references(s, drafter_model(s), [0, 0, 0])
    assert [(r.dense_tokens, r.expected_tokens) for r in refs] == [(0, 0), (0, 0), (8, 0)]
    # Without the SWA group the full-attention blocks are all kept and the
    # state request 1 keeps at its replay boundary 2 is owed.
    fa_only = dataclasses.replace(s, kv_cache_groups=(KVCacheGroup(FA, 2), KVCacheGroup(MAMBA, 2)))
    assert references(fa_only, drafter_model(fa_only), [0, 0, 0])[2].expected_tokens == 2


def test_a_needless_drop_makes_states_a_hit_may_reuse() -> None:
    # FA 4 + Mamba 4, hash block 1 (A = 1), Gemma-4 MTP (needs no drop), a
    # 9-token writer and a sibling of its first 8 tokens. A run that drops
    # needlessly stops the writer's prefill at the drop's resume position 4,
    # so a state at 4 exists and the hit 4 reuses nothing stale; the
    # drafter's own model (no drop) makes a state at 8 only.
    s = Scenario(
        kv_cache_groups=(KVCacheGroup(FA, 4), KVCacheGroup(MAMBA, 4)),
        requests=(RequestSpec(9, 0), RequestSpec(8, 0, shares_with=0)),
        shared_prefix_tokens=9,
        hash_block_size_tokens=1,
        retention_interval_tokens=0,
        drafter=Drafter(DrafterKind.GEMMA4_MTP, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=8,
    )

    def kinds(hits: list[int], drop: bool) -> list[str]:
        run = dataclasses.replace(observed(s, hits), settings=ManagerSettings(drop, 0, 0, 1, 1))
        return sorted(f.kind.value for f in judge_run(s, run)[1])

    assert kinds([0, 4], drop=True) == ["needless-drop"]
    assert kinds([0, 4], drop=False) == ["over-hit"]  # no step ended at 4
    assert kinds([0, 6], drop=True) == ["needless-drop", "over-hit"]  # no state at 6


def test_a_hit_no_state_justifies_is_an_over_hit() -> None:
    # The scheduler's writer keeps a state at 80 only; a state at 96 is past
    # the point full attention proves under the drop (80).
    s = fa_mamba(100, prefill=MambaPrefill.SCHEDULER)
    tags = [finding_tag(f) for f in judge_run(s, observed(s, [0, 96]))[1]]
    assert tags == ["over-hit@1"]
    assert judge_run(s, observed(s, [0, 80]))[1] == ()
    # Without a drafter full attention proves 96 and the writer keeps 96.
    s = fa_mamba(100, prefill=MambaPrefill.SCHEDULER, drafter=Drafter())
    assert judge_run(s, observed(s, [0, 96]))[1] == ()
    assert [finding_tag(f) for f in judge_run(s, observed(s, [0, 112]))[1]] == ["over-hit@1"]


def test_junction_state_case_of_issue_45238() -> None:
    # FA 16 + Mamba 16, no drafter, retention 0: A keeps a state at 96 only.
    s = Scenario(
        kv_cache_groups=(KVCacheGroup(FA, 16), KVCacheGroup(MAMBA, 16)),
        requests=(RequestSpec(40, 60), RequestSpec(40, 60), RequestSpec(40, 60)),
        shared_prefix_tokens=40,
        hash_block_size_tokens=16,
        retention_interval_tokens=0,
    )
    model = drafter_model(s)
    refs = references(s, model, [0, 0, 32])
    assert [r.expected_tokens for r in refs] == [0, 0, 32]
    assert judge_run(s, observed(s, [0, 0, 32]))[1] == ()
    # C = 0 is a fallback: B pinned the junction 32 and kept its state.
    assert [finding_tag(f) for f in judge_run(s, observed(s, [0, 0, 0]))[1]] == ["fallback@2"]
    # Under `ideal` B is a design gap: full attention proves 32.
    ideal = judge_run(s, observed(s, [0, 0, 32]), Policy.IDEAL)[1]
    assert [(f.kind.value, f.request) for f in ideal] == [("design-gap", 1)]


# ------------------------------------------------------- labels and generator


def test_pr57444_label_matches_its_mechanism_and_rejects_near_misses() -> None:
    from differential.oracle.known import label_known

    s = fa_mamba(100)
    findings = judge_run(s, observed(s, [0, 0]))[1]
    assert [f.known_issue for f in label_known(s, findings)] == [
        "fine-grained-replay-state-discarded"
    ]
    # Near misses: the same shortfall without the drop, or with dense
    # retention, is not this issue (the writer's state is kept there).
    for near in (fa_mamba(100, drafter=Drafter()), fa_mamba(100, retention=None)):
        labelled = label_known(near, judge_run(near, observed(near, [0, 0]))[1])
        assert all(f.known_issue != "fine-grained-replay-state-discarded" for f in labelled)


def test_generator_reaches_mamba_hybrids() -> None:
    from fuzz.strategies import scenarios

    def found(condition, kinds=frozenset(), scale=None) -> Scenario:
        return reach(condition, scenarios(scale=scale, kinds=kinds))

    several = found(lambda s: len(s.mamba_groups) >= 2 and s.partial_hash_hits)
    assert several.effective_hit_alignment_tokens < several.mamba_groups[0].block_size_tokens
    # The default mix reaches production-scale Mamba hybrids; pinned to them,
    # the production block sizes. (Searched apart: one condition rarer than
    # about 1 in 50 drawn examples made the search depend on the constants
    # Hypothesis collects from whichever modules are loaded, so it failed
    # when this test ran alone.)
    real = found(lambda s: bool(s.mamba_groups) and s.mamba_groups[0].block_size_tokens >= 528)
    assert real.scheduler_block_size_tokens >= 528
    production = found(
        lambda s: s.mamba_groups[0].block_size_tokens in (1536, 3200),
        frozenset({GroupKind.MAMBA}),
        "real",
    )
    # Under decode context parallelism the scheduler block is the Mamba block
    # times the ranks (vLLM's resolve_kv_cache_block_sizes).
    assert production.scheduler_block_size_tokens in (
        1536 * production.dcp_world_size,
        3200 * production.dcp_world_size,
    )
    with_swa = found(lambda s: bool(s.mamba_groups) and bool(s.sliding_window_groups))
    assert (
        with_swa.full_attention_group.block_size_tokens
        == with_swa.mamba_groups[0].block_size_tokens
    )
    pinned = found(lambda s: True, frozenset({GroupKind.MAMBA}))
    assert pinned.mamba_groups


def test_a_scheduler_mode_workload_runs_the_schedulers_mamba_chunks() -> None:
    # vLLM's Scheduler chunks a Mamba prefill itself: a file written for
    # scheduler mode with mamba_prefill block is judged on the scheduler's
    # chunks, as --mode scheduler judges it; manager mode keeps the carving.
    from differential.scenario import DriveMode, Workload

    data = {**fa_mamba(100).to_dict(), "workload": {"mode": "scheduler"}}
    assert data["mamba_prefill"] == "block"
    scenario = Scenario.from_dict(data)
    assert scenario.mamba_prefill is MambaPrefill.SCHEDULER
    assert scenario.workload.mode is DriveMode.SCHEDULER
    assert "mamba_prefill" not in scenario.to_dict()
    assert fa_mamba(100, workload=Workload(mode=DriveMode.SCHEDULER)) == scenario
    assert fa_mamba(100).mamba_prefill is MambaPrefill.BLOCK

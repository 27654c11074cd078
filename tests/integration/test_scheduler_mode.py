"""Scenarios through vLLM 0.33.0's real ``Scheduler`` (scheduler mode).

Exact hits from real runs: the seed corpus in both modes, vLLM issue #48435's
round-robin sessions at three pool sizes, and a concurrent multi-turn workload
with drafts, eviction and preemption.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from differential.compare import compare_variants, in_mode
from differential.corpus import finding_tag, load_entry
from differential.driver import run_variant
from differential.findings import FindingKind
from differential.oracle.engine import session_hits
from differential.reports.table import render_json, render_text
from differential.scenario import (
    Drafter,
    DrafterKind,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
    Workload,
)
from differential.triage.identity import triage
from differential.variants import parse_variants
from tests.factories import CORPORA, ROOT, kvfuzz_cli

pytestmark = pytest.mark.vllm

UNFIXED = parse_variants("unfixed")
BOTH = parse_variants("unfixed,fixed")
SEEDS = sorted((CORPORA / "seeds").glob("*.json"))
KNOWN = ROOT / "known-issues"


@pytest.mark.parametrize("path", SEEDS, ids=lambda p: p.name)
def test_seed_gives_the_same_hits_in_both_modes(path: Path) -> None:
    scenario = load_entry(path).scenario
    for variant in BOTH:
        manager = run_variant(scenario, variant, mode=DriveMode.MANAGER)
        scheduler = run_variant(scenario, variant, mode=DriveMode.SCHEDULER)
        assert scheduler.mode == "scheduler" and manager.mode == "manager"
        assert scheduler.error is None, scheduler.error
        assert scheduler.hits == manager.hits, (variant.name, scheduler.hits, manager.hits)
        assert scheduler.settings == manager.settings
    # The comparison runs the cross-check itself and finds no mode-mismatch.
    result = compare_variants(in_mode(scenario, DriveMode.SCHEDULER), UNFIXED)
    assert result.results[0].manager_run is not None
    assert not [f for f in result.findings if f.kind is FindingKind.MODE_MISMATCH]


def _sessions(name: str) -> tuple[dict[int, list[int]], list[str], object]:
    folder = KNOWN if name.endswith("pool130-dense") else CORPORA / "cases"
    entry = load_entry(folder / f"{name}.json")
    result = compare_variants(entry.scenario, UNFIXED)
    vr = result.results[0]
    tags = sorted(finding_tag(f) for f in result.findings)
    return session_hits(entry.scenario, vr.run), tags, vr


def test_48435_pool_130_dense_retention_collapses() -> None:
    hits, tags, vr = _sessions("eviction-collapse-48435-pool130-dense")
    assert hits == {0: [0, 0, 0], 1: [0, 0, 0], 2: [0, 0, 0], 3: [0, 0, 0]}
    assert tags == ["eviction-collapse@run"]
    # The rule's own retention-0 run at the same pool keeps hitting.
    assert vr.retention0_run is not None
    assert vr.retention0_run.hits == (0, 0, 0, 0, 96, 96, 96, 96, 100, 100, 100, 100)
    assert vr.run.pool_blocks == 130 and vr.run.evicted_blocks > 0
    assert vr.run.unreachable_cached_blocks == 21
    # The same sequential scenario through the manager-level driver agrees.
    assert vr.manager_run is not None and vr.manager_run.hits == vr.run.hits


def test_48435_pool_130_retention_0_keeps_hits() -> None:
    hits, tags, _ = _sessions("eviction-collapse-48435-pool130-retention0")
    assert hits == {0: [0, 96, 100], 1: [0, 96, 100], 2: [0, 96, 100], 3: [0, 96, 100]}
    assert tags == []


def test_48435_pool_400_dense_retention_keeps_everything() -> None:
    hits, tags, vr = _sessions("eviction-collapse-48435-pool400-dense")
    assert hits == {0: [0, 100, 104], 1: [0, 100, 104], 2: [0, 100, 104], 3: [0, 100, 104]}
    assert tags == []
    assert vr.run.evicted_blocks == 0 and vr.run.unreachable_cached_blocks == 0


@pytest.mark.parametrize("pool", [110, 90])
def test_48435_smaller_pools_hit_nothing_in_either_retention(pool: int) -> None:
    entry = load_entry(KNOWN / "eviction-collapse-48435-pool130-dense.json")
    scenario = dataclasses.replace(
        entry.scenario, workload=dataclasses.replace(entry.scenario.workload, pool_blocks=pool)
    )
    result = compare_variants(scenario, UNFIXED)
    vr = result.results[0]
    assert set(vr.run.hits) == {0}
    assert vr.retention0_run is not None and set(vr.retention0_run.hits) == {0}
    # Retention 0 does not keep hitting: no collapse to blame on dense retention.
    assert not [f for f in result.findings if f.kind is FindingKind.EVICTION_COLLAPSE]


def _concurrent(pool: int, decode_steps: int, arrivals: tuple[int, ...], seqs: int) -> Scenario:
    """Four two-turn chat sessions (turn 2 = turn 1's prompt + its answer + 8
    tokens), EAGLE with 2 drafted tokens accepted 1, 0, 2, ... per step."""
    requests = (
        RequestSpec(0, 40, name="s0t1"),
        RequestSpec(0, 36, name="s1t1"),
        RequestSpec(20, 30, name="s2t1"),
        RequestSpec(0, 44, name="s3t1"),
        RequestSpec(46, 8, 0, "s0t2"),
        RequestSpec(42, 8, 1, "s1t2"),
        RequestSpec(56, 8, 2, "s2t2"),
        RequestSpec(50, 8, 3, "s3t2"),
    )
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 8),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 8),
        ),
        requests=requests,
        shared_prefix_tokens=32,
        drafter=Drafter(DrafterKind.EAGLE, 2),
        prefill_chunk_tokens=16,
        decode_steps=decode_steps,
        workload=Workload(
            mode=DriveMode.SCHEDULER,
            pool_blocks=pool,
            arrival_steps=arrivals,
            max_num_seqs=seqs,
            max_num_batched_tokens=24,
            shares_output=True,
            accepted_drafts=(1, 0, 2),
        ),
    )


def test_concurrent_multi_turn_with_drafts_reuses_decoded_blocks() -> None:
    scenario = _concurrent(200, 5, (0, 0, 1, 1, 6, 6, 7, 7), 4)
    result = compare_variants(scenario, UNFIXED)
    run = result.results[0].run
    # Turn 2 of session 0 reuses turn 1's prompt (40) and decoded tokens up to
    # the full-attention block boundary; session 2's turn 1 wrote 50 tokens + 5.
    assert run.hits == (0, 0, 0, 0, 40, 40, 48, 48)
    assert [r.scheduled_step for r in run.requests] == [0, 1, 3, 5, 8, 8, 9, 11]
    assert run.evicted_blocks == 0 and run.preemptions == 0
    assert result.findings == ()


def test_an_idle_gap_before_an_arrival_is_time_passing_not_a_stall() -> None:
    # The second turns arrive 300 steps after the first (the engine idle for
    # most of them, more than the 64 steps of no progress that mean a stall):
    # the run goes on at the arrival step and is judged like a short gap.
    scenario = _concurrent(200, 5, (0, 0, 1, 1, 300, 300, 301, 301), 4)
    result = compare_variants(scenario, UNFIXED)
    run = result.results[0].run
    assert run.error is None
    assert run.hits == (0, 0, 0, 0, 40, 40, 48, 48)
    assert [r.scheduled_step for r in run.requests] == [0, 1, 3, 5, 300, 300, 301, 301]
    assert result.findings == ()


def test_small_pool_evicts_and_preempts_and_stays_sound() -> None:
    scenario = _concurrent(26, 24, (0, 0, 0, 0, 1, 1, 1, 1), 8)
    result = compare_variants(scenario, UNFIXED)
    run = result.results[0].run
    assert run.error is None
    assert run.preemptions == 2
    assert run.evicted_blocks > 0
    assert run.hits == (0,) * 8
    assert result.findings == ()
    text = render_text([result], "0.33.0")
    assert "2 preemptions" in text and "of the pool" in text
    figures = render_json([result], "0.33.0", result.policy)["scenarios"][0]["variants"][0]
    assert figures["engine"]["preemptions"] == 2
    assert figures["engine"]["pool_blocks"] == 26


def test_manager_mode_refuses_a_concurrent_workload() -> None:
    from differential.errors import ScenarioError

    with pytest.raises(ScenarioError, match=r"workload\.mode"):
        in_mode(_concurrent(200, 5, (0, 0, 1, 1, 6, 6, 7, 7), 4), DriveMode.MANAGER)


def _exported(scenario: Scenario) -> tuple[str, str]:
    from differential.exports.scheduler_test import export_engine_test
    from fuzz.signature import signature_of

    result = compare_variants(scenario, UNFIXED)
    finding = next(f for f in result.findings if f.kind is FindingKind.EVICTION_COLLAPSE)
    source = export_engine_test(
        scenario, finding, signature=signature_of(scenario, finding).text, name="collapse"
    )
    return source, "test_kvfuzz_collapse"


def test_exported_engine_test_reproduces_48435(tmp_path: Path) -> None:
    entry = load_entry(KNOWN / "eviction-collapse-48435-pool130-dense.json")
    source, name = _exported(entry.scenario)
    assert "from differential" not in source and "import differential" not in source
    namespace: dict[str, object] = {}
    exec(compile(source, "exported.py", "exec"), namespace)
    test = namespace[name]
    with pytest.raises(AssertionError, match=r"\[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0\]"):
        test(tmp_path)  # type: ignore[operator]
    # The same test with retention 0 (the fix of #48435) passes.
    fixed = source.replace(
        "prefix_cache_retention_interval=None", "prefix_cache_retention_interval=0"
    )
    namespace = {}
    exec(compile(fixed, "exported_fixed.py", "exec"), namespace)
    (tmp_path / "fixed").mkdir()
    namespace[name](tmp_path / "fixed")  # type: ignore[operator]


def test_explain_timeline_and_shrink_on_a_concurrent_collapse(tmp_path: Path) -> None:
    from differential.exports.explain import render_timeline
    from fuzz.minimize import shrink
    from fuzz.signature import signature_of

    entry = load_entry(KNOWN / "eviction-collapse-48435-pool130-dense.json")
    # The same sessions fired concurrently: round r arrives at step 8 * r.
    concurrent = dataclasses.replace(
        entry.scenario,
        workload=dataclasses.replace(
            entry.scenario.workload,
            arrival_steps=tuple(8 * (i // 4) for i in range(12)),
            max_num_seqs=4,
        ),
    )
    result = compare_variants(concurrent, UNFIXED)
    tags = sorted(finding_tag(f) for f in result.findings)
    assert tags == ["eviction-collapse@run"]
    text = render_timeline(result, 11)
    assert "step 0: arrive req-0, req-1, req-2, req-3; admit req-0 (hit 0)" in text
    assert "step 8: arrive req-4, req-5, req-6, req-7" in text
    finding = result.findings[0]
    outcome = shrink(concurrent, signature_of(concurrent, finding), UNFIXED, seconds=60)
    small = outcome.scenario
    assert len(small.requests) < len(concurrent.requests)
    assert small.workload.arrival_steps is None or len(small.workload.arrival_steps) == len(
        small.requests
    )
    assert any(
        f.kind is FindingKind.EVICTION_COLLAPSE for f in compare_variants(small, UNFIXED).findings
    )


def test_campaign_in_scheduler_mode_counts_the_engine(tmp_path: Path) -> None:
    from fuzz.campaign import CampaignConfig, run_campaign
    from fuzz.report import engine_section

    summary = run_campaign(
        CampaignConfig(
            out=tmp_path,
            variants=UNFIXED,
            seed=0,
            seconds=None,
            max_examples=40,
            mode=DriveMode.SCHEDULER,
        ),
        quiet=True,
    )
    engine = summary["engine"]
    assert engine["scenarios"] == summary["examples"] == 40
    assert engine["concurrent"] > 0 and engine["multi_turn"] > 0
    assert engine["speculative"] > 0 and engine["with_eviction"] > 0
    assert engine["rejected_drafts"] > 0 and engine["decode"] > 0
    assert engine["mamba"] > 0 and engine["draft_groups"] > 0
    assert any("Engine scenarios (scheduler mode)" in line for line in engine_section(summary))


def test_a_prompt_repeated_as_plain_tokens_collapses_under_dense_retention() -> None:
    # The repeated prompt is the shared prefix, written without shares_with:
    # the collapse is recognised by tokens (vLLM PR #43447's replay, #48435).
    entry = load_entry(KNOWN / "eviction-collapse-plain-token-repeat-pool120.json")
    assert all(r.shares_with is None for r in entry.scenario.requests)
    result = compare_variants(entry.scenario, UNFIXED)
    vr = result.results[0]
    assert vr.run.hits == (0,) * 8
    assert vr.retention0_run is not None
    assert vr.retention0_run.hits == (0, 0, 96, 0, 96, 0, 96, 0)
    (collapse,) = [f for f in result.findings if f.kind is FindingKind.EVICTION_COLLAPSE]
    assert collapse.known_issue == "dense-retention-eviction-collapse"


def _answer_reusing_sessions(pool: int) -> Scenario:
    """Four chat sessions of two turns (each second turn copies the first turn's
    prompt and answer), FA block 16 + SWA block 8 (window 7), EAGLE protected by
    lookahead hashes, retention 0 (vLLM's default), the second turns arriving
    together at step 10."""
    prompts = (84, 70, 84, 70)
    decode = 8
    requests = tuple(RequestSpec(0, p, name=f"s{i}t1") for i, p in enumerate(prompts)) + tuple(
        RequestSpec(p + decode + 1, 8, i, f"s{i}t2") for i, p in enumerate(prompts)
    )
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 16),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 8, 7),
        ),
        requests=requests,
        shared_prefix_tokens=0,
        drafter=Drafter(DrafterKind.EAGLE, 1),
        retention_interval_tokens=0,
        prefill_chunk_tokens=64,
        decode_steps=decode,
        workload=Workload(
            mode=DriveMode.SCHEDULER,
            pool_blocks=pool,
            arrival_steps=(0, 0, 0, 0, 10, 10, 10, 10),
            max_num_seqs=4,
            shares_output=True,
        ),
    )


def test_candidate_costs_hits_under_pool_pressure_and_says_so() -> None:
    variants = parse_variants("unfixed,fixed,candidate")
    result = compare_variants(_answer_reusing_sessions(36), variants)
    hits = {vr.variant.name: vr.run.hits for vr in result.results}
    assert hits == {
        "unfixed": (0, 0, 0, 0, 80, 64, 80, 0),
        "fixed": (0, 0, 0, 0, 80, 64, 80, 0),
        "candidate": (0, 0, 0, 0, 80, 0, 0, 0),
    }
    regressions = [f for f in result.findings if f.kind is FindingKind.POOL_REGRESSION]
    assert [(f.variant, f.expected_tokens, f.hit_tokens) for f in regressions] == [
        ("candidate vs unfixed", 224, 80)
    ]
    assert "pool 36 blocks" in regressions[0].summary()
    # The candidate's documented price, not news about vLLM: labelled as the
    # fix's known cost, its own known root cause, known as its documentation.
    from fuzz.campaign import _known_issue_example

    assert regressions[0].known_issue == "candidate-pool-cost"
    assert regressions[0].summary().endswith("[known cost of the fix: candidate-pool-cost]")
    assert [t.root_cause.text for t in triage(result)] == [
        "pool-regression | known:candidate-pool-cost"
    ]
    assert _known_issue_example("candidate-pool-cost") == "docs/variants.md#the-candidate-fix"
    # With room for every tail (pool 60) the candidate keeps every hit.
    roomy = compare_variants(_answer_reusing_sessions(60), variants)
    assert {vr.run.hits for vr in roomy.results} == {(0, 0, 0, 0, 80, 64, 80, 64)}
    assert not [f for f in roomy.findings if f.kind is FindingKind.POOL_REGRESSION]


def test_candidate_without_the_drop_keeps_only_the_tails_one_unit_below() -> None:
    # The same sessions with DSpark (no drop). The candidate keeps, per
    # retained boundary b, vLLM's tail for b and the one a hit at b - A reads
    # (one 8-token SWA block each: window 7, A = 16), not the block between
    # them nor a wider tail at the final segment. The second turns' lower
    # tails lie in blocks they adopted from their hit (80 or 64), so they keep
    # what fixed keeps; the run keeps 36 SWA blocks against fixed's 26 (62
    # with the contiguous widening).
    variants = parse_variants("unfixed,fixed,candidate")
    roomy = dataclasses.replace(
        _answer_reusing_sessions(200), drafter=Drafter(DrafterKind.DSPARK, 2)
    )
    result = compare_variants(roomy, variants)
    runs = {vr.variant.name: vr.run for vr in result.results}
    assert {r.hits for r in runs.values()} == {(0, 0, 0, 0, 80, 64, 80, 64)}
    assert not runs["candidate"].settings.use_eagle_block_drop
    kept = {name: [r.retained_blocks_per_group for r in run.requests] for name, run in runs.items()}
    assert kept["fixed"] == kept["unfixed"]
    assert kept["fixed"] == [(18, 4), (14, 4), (11, 4), (7, 4), (4, 4), (3, 3), (2, 2), (1, 1)]
    assert kept["candidate"] == [(18, 8), (14, 7), (11, 6), (7, 5), (4, 4), (3, 3), (2, 2), (1, 1)]
    assert kept["candidate"][4:] == kept["fixed"][4:]
    # At pool 30 the candidate now hits what fixed hits (it used to keep
    # three blocks per tail, lose every hit and be a pool-regression).
    tight = dataclasses.replace(roomy, workload=dataclasses.replace(roomy.workload, pool_blocks=30))
    result = compare_variants(tight, variants)
    assert {vr.variant.name: vr.run.hits for vr in result.results} == {
        name: (0, 0, 0, 0, 80, 0, 0, 0) for name in ("unfixed", "fixed", "candidate")
    }
    assert not [f for f in result.findings if f.kind is FindingKind.POOL_REGRESSION]


def _dspark_lanes(pool: int) -> Scenario:
    """A DeepSeek-V4-like toy layout (MLA block 16, sliding-window MLA blocks
    16 and 4, sliding window block 8; windows 16, 8 and 16) with DSpark (3
    tokens, no drop), retention 0: 8 chat lanes of two turns, the first
    turns (120-token prompts, 8 decode steps) in flight together, the
    second turns (each copying its first turn's prompt and answer) arriving
    together at step 12."""
    lanes, prompt, decode = 8, 120, 8
    first = tuple(RequestSpec(0, prompt, name=f"s{i}t1") for i in range(lanes))
    second = tuple(RequestSpec(prompt + decode + 1, 8, i, f"s{i}t2") for i in range(lanes))
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.MLA, 16),
            KVCacheGroup(GroupKind.SLIDING_WINDOW_MLA, 16, 16),
            KVCacheGroup(GroupKind.SLIDING_WINDOW_MLA, 4, 8),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 8, 16),
        ),
        requests=first + second,
        shared_prefix_tokens=0,
        drafter=Drafter(DrafterKind.DSPARK, 3),
        retention_interval_tokens=0,
        prefill_chunk_tokens=64,
        decode_steps=decode,
        workload=Workload(
            mode=DriveMode.SCHEDULER,
            pool_blocks=pool,
            arrival_steps=(0,) * lanes + (12,) * lanes,
            max_num_seqs=lanes,
            shares_output=True,
        ),
    )


def test_eight_dspark_lanes_keep_their_hits_on_every_variant_with_room() -> None:
    # Pool 600 holds every lane: each second turn hits 112 (its first turn's
    # 120-token prompt, aligned to the 16-token unit) on every variant; the
    # candidate no longer widens for a drafter that never drops.
    result = compare_variants(_dspark_lanes(600), parse_variants("unfixed,fixed,candidate"))
    assert {vr.variant.name: vr.run.hits for vr in result.results} == {
        name: (0,) * 8 + (112,) * 8 for name in ("unfixed", "fixed", "candidate")
    }
    assert not [f for f in result.findings if f.kind is FindingKind.POOL_REGRESSION]


def test_eight_dspark_lanes_under_pressure_are_a_candidate_pool_regression() -> None:
    # At pool 200 the one-unit tails the candidate keeps (one more sliding-
    # window block per retained boundary) evict three more lanes' prefixes:
    # 3 second turns hit 112 on the candidate against 6 on unfixed and fixed.
    result = compare_variants(_dspark_lanes(200), parse_variants("unfixed,fixed,candidate"))
    hits = {vr.variant.name: vr.run.hits for vr in result.results}
    assert hits == {
        "unfixed": (0,) * 8 + (112,) * 6 + (0, 0),
        "fixed": (0,) * 8 + (112,) * 6 + (0, 0),
        "candidate": (0,) * 8 + (112,) * 3 + (0,) * 5,
    }
    (regression,) = [f for f in result.findings if f.kind is FindingKind.POOL_REGRESSION]
    assert (regression.variant, regression.expected_tokens, regression.hit_tokens) == (
        "candidate vs unfixed",
        672,
        336,
    )
    assert "pool 200 blocks" in regression.summary()
    assert regression.known_issue == "candidate-pool-cost"
    assert "lower on requests [11, 12, 13]" in regression.summary()
    assert "blocks cached per group [131, 28, 58, 57] vs [110, 16, 32, 32]" in (
        regression.summary()
    )


def test_block_carved_mamba_prefill_is_judged_as_the_scheduler_chunks_it() -> None:
    # Manager mode carves this Mamba prefill per block (mamba_prefill: block);
    # vLLM's Scheduler ends its chunks elsewhere (at 80), so in scheduler mode
    # the oracle judges the scheduler's chunks: hits of 80, no over-hit.
    entry = load_entry(KNOWN / "fine-grained-replay-state-discarded-L100.json")
    scenario = in_mode(entry.scenario, DriveMode.SCHEDULER)
    assert scenario.mamba_prefill.value == "scheduler"
    result = compare_variants(scenario, BOTH)
    assert {vr.variant.name: vr.run.hits for vr in result.results} == {
        "unfixed": (0, 80, 0, 80),
        "fixed": (0, 80, 0, 80),
    }
    assert not [f for f in result.findings if f.kind is FindingKind.OVER_HIT]


def test_a_file_written_for_scheduler_mode_judges_the_scheduler_chunks_too(
    tmp_path: Path,
) -> None:
    # The same L100 workload whose file itself says workload.mode scheduler
    # beside mamba_prefill: block: judged like --mode scheduler (no false
    # over-hit at 80), by the file and by the command line alike.
    import json

    data = json.loads((KNOWN / "fine-grained-replay-state-discarded-L100.json").read_text())
    assert data["mamba_prefill"] == "block"
    data["workload"] = {"mode": "scheduler"}
    del data["expect"]
    path = tmp_path / "l100-scheduler.json"
    path.write_text(json.dumps(data))
    scenario = load_entry(path).scenario
    assert scenario.mamba_prefill.value == "scheduler"
    result = compare_variants(scenario, BOTH)
    assert {vr.variant.name: vr.run.hits for vr in result.results} == {
        "unfixed": (0, 80, 0, 80),
        "fixed": (0, 80, 0, 80),
    }
    assert result.findings == ()
    proc = kvfuzz_cli("replay", str(path), "--variants", "unfixed")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no findings" in proc.stdout


def test_a_pool_the_scheduler_never_admits_into_costs_the_scenario_not_the_run() -> None:
    # FA 64 + Mamba 64 with EAGLE (2 tokens): pool 9 holds the first turns but
    # never admits the third request; the run ends with that as its error
    # (a crash finding naming the Scheduler), not kvfuzz's failure.
    scenario = Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 64),
            KVCacheGroup(GroupKind.MAMBA, 64),
        ),
        requests=(RequestSpec(64, 2), RequestSpec(73, 32, 0), RequestSpec(112, 32, 1)),
        shared_prefix_tokens=64,
        drafter=Drafter(DrafterKind.EAGLE, 2),
        hash_block_size_tokens=16,
        prefill_chunk_tokens=32,
        decode_steps=6,
        workload=Workload(
            mode=DriveMode.SCHEDULER,
            pool_blocks=9,
            arrival_steps=(0, 16, 32),
            max_num_seqs=2,
            shares_output=True,
            accepted_drafts=(2, 1, 1),
        ),
    )
    result = compare_variants(scenario, UNFIXED)
    run = result.results[0].run
    assert run.error is not None and "scheduled nothing for 64 steps" in run.error
    assert [f.kind for f in result.findings if f.kind is FindingKind.CRASH]


def test_a_step_budget_vllm_refuses_for_the_draft_is_unsupported_not_a_stall() -> None:
    """EAGLE-3 with one speculative token and a step budget of 1 token:
    ``VllmConfig._set_max_num_scheduled_tokens`` (vllm/config/vllm.py)
    refuses ``max_num_batched_tokens <= num_lookahead_tokens``. Validation
    runs before kvfuzz sets the drafter, so the driver runs that check
    itself; without it the Scheduler stalled and the run was exit 3."""
    scenario = load_entry(CORPORA / "cases" / "mamba-swa-peek-block-own-token-eagle3.json").scenario
    run = run_variant(in_mode(scenario, DriveMode.SCHEDULER), parse_variants("unfixed")[0])
    assert run.error is None and run.requests == ()
    assert run.unsupported == (
        "VllmConfig._set_max_num_scheduled_tokens refuses this configuration "
        "(vllm/config/vllm.py): ValueError: VllmConfig does not have enough slots to "
        "schedule a token and support the speculative decoding settings. Got "
        "max_num_batched_tokens=1 and num_lookahead_tokens=1."
    )


def test_smallest_pool_serving_every_hit_is_bisected_with_real_runs() -> None:
    from differential.pool_need import pool_needs

    # The answer-reusing sessions under the EAGLE drop (lookahead hashes off):
    # with room for everything each variant hits 64, 48, 64, 48 on the second
    # turns. The candidate's extra tails (replay boundaries and junctions
    # under retention 0) need 4 more blocks of pool to keep serving them.
    scenario = dataclasses.replace(
        _answer_reusing_sessions(30), disable_lookahead_block_hashes=True
    )
    needs = pool_needs(scenario, parse_variants("unfixed,fixed,candidate"))
    assert [(n.variant, n.smallest_pool_blocks) for n in needs] == [
        ("unfixed", 48),
        ("fixed", 48),
        ("candidate", 52),
    ]
    assert {n.owed_hit_tokens for n in needs} == {(0, 0, 0, 0, 64, 48, 64, 48)}
    assert {(n.roomy_pool_blocks, n.runs) for n in needs} == {(157, 9)}
    # One block less and a second turn loses its hit.
    candidate = parse_variants("candidate")[0]
    short = run_variant(
        dataclasses.replace(
            scenario, workload=dataclasses.replace(scenario.workload, pool_blocks=51)
        ),
        candidate,
    )
    assert short.hits[4:] != (64, 48, 64, 48)
    assert needs[2].summary() == (
        "candidate: 52 blocks serve every hit (224 tokens; roomy pool 157 blocks, 9 runs)"
    )


def test_explain_prints_the_smallest_pool_of_each_variant(tmp_path: Path) -> None:
    from tests.factories import kvfuzz_cli

    scenario = dataclasses.replace(
        _answer_reusing_sessions(30), disable_lookahead_block_hashes=True
    )
    path = tmp_path / "sessions.json"
    path.write_text(scenario.to_json())
    proc = kvfuzz_cli("explain", str(path), "--variants", "unfixed,candidate")
    assert proc.returncode == 0, proc.stderr  # no finding at pool 30
    assert (
        "smallest pool serving every hit (bisection over workload.pool_blocks):\n"
        "  unfixed: 48 blocks serve every hit (224 tokens; roomy pool 157 blocks, 9 runs)\n"
        "  candidate: 52 blocks serve every hit (224 tokens; roomy pool 157 blocks, 9 runs)\n"
    ) in proc.stdout


def _lru(pool: int) -> Scenario:
    """One request at a time, full attention in blocks of 8: an unrelated
    40-token request, a writer of the 64-token prefix (+ 8 own tokens), an
    unrelated 64-token request whose allocation evicts, and a sibling of the
    writer (+ 16)."""
    return Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 8),),
        requests=(RequestSpec(0, 40), RequestSpec(64, 8), RequestSpec(0, 64), RequestSpec(64, 16)),
        shared_prefix_tokens=64,
        prefill_chunk_tokens=128,
        decode_steps=0,
        workload=Workload(mode=DriveMode.SCHEDULER, pool_blocks=pool),
    )


def test_lru_reference_owes_the_writer_whose_blocks_outlive_the_evictions() -> None:
    from differential.oracle.engine import timeline_writers

    scenario = _lru(20)
    result = compare_variants(scenario, parse_variants("unfixed,fixed,mutant-mru-eviction"))
    runs = {vr.variant.name: vr.run for vr in result.results}
    fixed = runs["fixed"]
    # 19 free blocks (the null block taken). Request 0 takes 5 and frees them
    # with 14 queued; request 1 takes 9 (removals 14), frees with 10 queued:
    # the 5 fresh ones, then request 0's 5 cached. Request 2 takes 8: the 5
    # fresh and 3 of request 0's, evicting them (removals 22). Request 3
    # looks up 22 - 14 = 8 <= 10 removals after request 1's free: request 1
    # is owed in full, request 0 (22 - 5 = 17 > 14) is not.
    counters = [
        (r.lookup_queue_removals, r.freed_queue_blocks, r.freed_queue_removals)
        for r in fixed.requests
    ]
    assert counters == [(0, 14, 5), (5, 10, 14), (14, 11, 22), (22, 9, 32)]
    assert fixed.evicted_blocks == 5 and fixed.preemptions == 0
    assert timeline_writers(scenario, fixed) == [
        frozenset(),
        frozenset({0}),
        frozenset({0, 1}),
        frozenset({1, 2}),
    ]
    assert runs["unfixed"].hits == fixed.hits == (0, 0, 0, 64)
    # Most recently freed first: request 2's allocation takes request 1's
    # tail blocks, and the sibling keeps only the first block of the prefix.
    assert runs["mutant-mru-eviction"].hits == (0, 0, 0, 8)
    assert [
        (f.owner, f.kind, f.request, f.expected_tokens, f.hit_tokens) for f in result.findings
    ] == [("mutant-mru-eviction", FindingKind.FALLBACK, 3, 64, 8)]


def _preempting() -> Scenario:
    """Three unrelated 30-token requests at step 0, full attention in blocks
    of 8, 40 decode steps each, pool 14 blocks: decode outgrows the pool and
    the scheduler preempts."""
    return Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 8),),
        requests=(RequestSpec(0, 30), RequestSpec(0, 30), RequestSpec(0, 30)),
        shared_prefix_tokens=0,
        prefill_chunk_tokens=64,
        decode_steps=40,
        workload=Workload(
            mode=DriveMode.SCHEDULER, pool_blocks=14, arrival_steps=(0, 0, 0), max_num_seqs=3
        ),
    )


def _resumed(run: object) -> list[list[tuple[int, ...]]]:
    return [
        [
            (
                u.step,
                u.hit_tokens,
                u.known_tokens,
                u.preempted_computed_tokens,
                u.freed_queue_blocks,
                u.lookup_queue_removals - u.freed_queue_removals,
            )
            for u in r.resumed
        ]
        for r in run.requests
    ]


def test_a_resumed_lookup_is_owed_its_own_prefix_that_survived() -> None:
    from differential.oracle.core import drafter_model
    from differential.oracle.engine import resumed_owed_tokens

    scenario = _preempting()
    result = compare_variants(scenario, UNFIXED)
    run = result.results[0].run
    assert run.error is None and run.preemptions == 3 and run.evicted_blocks == 18
    # (step, hit, known tokens, computed when preempted, queued at the free,
    # removed from the queue by the lookup). Request 1 was preempted with 48
    # of its 49 tokens computed: 6 cached blocks, freed tail first behind 0
    # queued ones; 2 blocks left the queue by its lookup, so at most its 2
    # last blocks are gone and blocks 0..3 (32 tokens) are owed: it hits 32.
    # Request 2's first preemption (3 cached blocks) saw 13 removals: owed 0;
    # its second (5 cached blocks, 1 removal) is owed 4 blocks, 32 tokens.
    assert _resumed(run) == [
        [],
        [(41, 32, 49, 48, 0, 2)],
        [(41, 0, 32, 31, 0, 13), (63, 32, 41, 40, 0, 1)],
    ]
    model = drafter_model(scenario)
    owed = [[resumed_owed_tokens(scenario, model, u) for u in r.resumed] for r in run.requests]
    assert owed == [[], [32], [0, 32]]
    assert result.findings == ()


def test_a_preempted_writer_is_owed_from_its_finish() -> None:
    from differential.oracle.engine import timeline_writers

    # The same three requests (requests 2 and 3 share a 24-token prefix),
    # and a fourth arriving at step 130, after they all finished.
    scenario = dataclasses.replace(
        _preempting(),
        requests=(RequestSpec(0, 30), RequestSpec(0, 30), RequestSpec(24, 6), RequestSpec(24, 10)),
        shared_prefix_tokens=24,
        workload=dataclasses.replace(_preempting().workload, arrival_steps=(0, 0, 0, 130)),
    )
    result = compare_variants(scenario, UNFIXED)
    run = result.results[0].run
    assert run.preemptions == 3 and run.evicted_blocks == 24
    # Request 2, preempted twice, finished at step 92 and was freed with 4
    # blocks queued after 42 removals; request 3 looks up at 42 removals:
    # nothing left the queue since, so request 2's 24 shared tokens are owed.
    fields = [
        (r.finished_step, r.lookup_queue_removals, r.freed_queue_blocks, r.freed_queue_removals)
        for r in run.requests
    ]
    assert fields == [(40, 0, 4, 19), (62, 4, 4, 33), (92, 8, 4, 42), (170, 42, 3, 52)]
    assert timeline_writers(scenario, run) == [
        frozenset(),
        frozenset(),
        frozenset(),
        frozenset({2}),
    ]
    assert run.hits == (0, 0, 0, 24)
    assert result.findings == ()


@pytest.fixture
def forgetful_preemption(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVCacheManager.free`` that, when vLLM preempts a request, also drops
    its blocks from the prefix cache (``BlockPool.evict_blocks``)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    real = KVCacheManager.free

    def free(self: Any, request: Any) -> None:
        ids = {b for group in self.get_block_ids(request.request_id) for b in group}
        real(self, request)
        if not request.is_finished():
            self.block_pool.evict_blocks(ids)

    monkeypatch.setattr(KVCacheManager, "free", free)


def test_a_resumed_lookup_that_lost_its_own_prefix_is_a_fallback(
    forgetful_preemption: None,
) -> None:
    result = compare_variants(_preempting(), UNFIXED)
    run = result.results[0].run
    # The same queue counters as on stock vLLM, so the same 32 and 32 owed.
    assert _resumed(run) == [
        [],
        [(41, 0, 49, 48, 0, 2)],
        [(41, 0, 32, 31, 0, 13), (63, 0, 41, 40, 0, 1)],
    ]
    assert [
        (f.kind, f.request, f.expected_tokens, f.hit_tokens, f.detail.split(":")[0])
        for f in result.findings
    ] == [
        (FindingKind.FALLBACK, 1, 32, 0, "resumed lookup 1 (step 41, after a preemption)"),
        (FindingKind.FALLBACK, 2, 32, 0, "resumed lookup 2 (step 63, after a preemption)"),
    ]

"""The oracle on hand-worked cases, at least one per finding kind (no vLLM)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from differential.compare import FixCost, compare_pair
from differential.corpus import finding_tag
from differential.findings import Finding, FindingKind, Policy
from differential.observation import ManagerSettings, RequestObservation, RunObservation
from differential.oracle import (
    checkpoints,
    common_prefix_tokens,
    cross_check_dense,
    dense_hit,
    drafter_model,
    judge_run,
    references,
    replay_boundaries,
)
from differential.oracle.prefix import shared_prefixes
from differential.scenario import (
    Drafter,
    DrafterKind,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
)
from fuzz.strategies import scenarios
from tests.factories import hybrid, triton

DROP = ManagerSettings(True, 0, 3, 1, 32)
NO_DROP = ManagerSettings(False, 0, 3, 1, 32)


def run(
    hits: list[int], *, settings: ManagerSettings = DROP, retained=None, **kw
) -> RunObservation:
    retained = retained or [(0, 0)] * len(hits)
    return RunObservation(
        variant=kw.pop("variant", "v"),
        vllm_version="test",
        settings=settings,
        requests=tuple(
            RequestObservation(i, 16448, h, 0, (h, h), tuple(r))
            for i, (h, r) in enumerate(zip(hits, retained, strict=True))
        ),
        **kw,
    )


def tags(findings: tuple[Finding, ...] | list[Finding]) -> list[str]:
    return sorted(finding_tag(f) for f in findings)


def test_dense_reference_triton_by_hand() -> None:
    # A = 32, drop on. Writer cached all 16448 tokens; sibling shares c = 16384.
    # Full attention (B = 32): proven 16384, minus the peek block -> 16352.
    # SWA (B = 16): proven 16384, minus its peek block -> 16368.
    # min(16352, 16368, L - 1 = 16447) aligned down to 32 -> 16352.
    scenario = triton()
    model = drafter_model(scenario)
    assert model.drop and model.dependency_tokens == 1
    assert dense_hit(scenario, model, 1, 0, 16384) == 16352
    # Without a drafter nothing is dropped: min(16384, 16447) -> 16384.
    plain = triton(DrafterKind.NONE)
    assert dense_hit(plain, drafter_model(plain), 1, 0, 16384) == 16384


def test_fallback_triton_unfixed() -> None:
    # Checkpoints under R = 8192 with the drop: 8192, 16384 and (the seed PR's
    # promise) 8160, 16352; the writer's replay boundaries: 16384, 16416.
    # The highest at or below h_dense = 16352 is 16352; the hit 8192 falls back.
    refs, findings = judge_run(triton(), run([0, 8192, 16352, 16352]))
    assert [r.dense_tokens for r in refs] == [0, 16352, 16352, 16352]
    assert [r.expected_tokens for r in refs] == [0, 16352, 16352, 16352]
    assert [r.divergence_tokens for r in refs] == [0, 16384, 16384, 16384]
    assert tags(findings) == ["fallback@1"]
    (f,) = findings
    assert (f.expected_tokens, f.hit_tokens, f.fallback_checkpoint_tokens) == (16352, 8192, 8192)
    assert f.divergence_tokens == 16384


def test_fixed_hits_are_clean() -> None:
    assert judge_run(triton(), run([0, 16352, 16352, 16352]))[1] == ()


def test_junction_pinned_by_a_fallback_is_a_checkpoint() -> None:
    # Request 1 fell back to 8192, so it pins its dense hit 16352 as a
    # junction; request 2 is owed 16352 through it even without the c - A rule.
    scenario = triton()
    refs = references(scenario, drafter_model(scenario), [0, 8192, 16352])
    assert 16352 in refs[2].checkpoints


def test_over_hit_past_the_dense_reference() -> None:
    findings = judge_run(triton(), run([0, 16384, 16352, 16352]))[1]
    assert tags(findings) == ["over-hit@1"]
    assert findings[0].expected_tokens == 16352


def test_first_request_must_not_hit() -> None:
    assert tags(judge_run(triton(), run([32, 8192, 16352, 16352]))[1]) == [
        "fallback@1",
        "over-hit@0",
    ]


def test_misaligned_hit() -> None:
    findings = judge_run(triton(), run([0, 16336, 16352, 16352]))[1]
    assert tags(findings) == ["fallback@1", "misaligned@1"]


def test_crash_is_reported_with_the_phase() -> None:
    crashed = run([0], error="request 1: lookup: AssertionError: boom")
    findings = judge_run(triton(), crashed)[1]
    assert tags(findings) == ["crash@1"]
    assert "request 1: lookup" in findings[0].detail


def test_eviction_makes_the_run_unjudged() -> None:
    refs, findings = judge_run(triton(), run([0, 0, 0, 0], evicted_blocks=3))
    assert refs == ()
    assert tags(findings) == ["eviction@run"]


def test_needless_drop_for_gemma4_mtp() -> None:
    # Gemma-4 MTP writes no draft KV: no drop is needed, dense = 16384, and the
    # periodic checkpoint 16384 is owed to every sibling.
    scenario = triton(DrafterKind.GEMMA4_MTP)
    refs, findings = judge_run(scenario, run([0, 8192, 16352, 16352]))
    assert [r.expected_tokens for r in refs] == [0, 16384, 16384, 16384]
    assert tags(findings) == ["fallback@1", "fallback@2", "fallback@3", "needless-drop@run"]
    assert judge_run(scenario, run([0, 16384, 16384, 16384], settings=NO_DROP))[1] == ()


def test_dense_mismatch_uses_the_runs_own_protection() -> None:
    dense = run([0, 16384, 16352, 16352])  # settings say drop: reference is 16352
    assert tags(cross_check_dense(triton(retention=None), dense)) == ["dense-mismatch@1"]
    assert cross_check_dense(triton(retention=None), run([0, 16352, 16352, 16352])) == ()


def test_variant_regression_and_cost() -> None:
    scenario = triton()
    base = run([0, 16352, 16352, 16352], variant="unfixed", retained=[(514, 132)] * 4)
    worse = run([0, 8192, 16352, 16352], variant="fixed", retained=[(514, 132)] * 4)
    assert tags(compare_pair(scenario, base, worse)) == ["variant-regression@1"]
    # Inside the domain the fix may keep A / B = 2 extra SWA blocks per
    # periodic checkpoint tail: 16448 tokens overlap the tails of 8192 and
    # 16384 (the tail of 24576 starts at 24576 + 16 - 67 * 16 > 16448): 4 blocks.
    costly = run([0, 16352, 16352, 16352], variant="fixed", retained=[(514, 137)] * 4)
    assert tags(compare_pair(scenario, base, costly)) == [f"variant-drift@{i}" for i in range(4)]
    fine = run([0, 16352, 16352, 16352], variant="fixed", retained=[(514, 136)] * 4)
    assert compare_pair(scenario, base, fine) == []


def test_a_widened_tail_filling_a_segment_keeps_every_block() -> None:
    # FA 8 + SWA 2 (window 6), R = 16, EAGLE3 drop, A = 8: the widened tail is
    # ceil(5 / 2) + 1 + 8 / 2 = 8 blocks = R / B, so vLLM's own mask for the
    # wider window keeps every block (including block 0, below the first
    # tail): the 27-token writer's 9 extra SWA blocks are no drift.
    scenario = Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 8),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 6),
        ),
        requests=(RequestSpec(24, 3, name="writer"),),
        shared_prefix_tokens=24,
        retention_interval_tokens=16,
        drafter=Drafter(DrafterKind.EAGLE3, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=8,
    )
    settings = ManagerSettings(True, 0, 1, 1, 8)
    base = run([0], variant="unfixed", settings=settings, retained=[(3, 4)])
    fixed = run([0], variant="fixed", settings=settings, retained=[(3, 13)])
    assert compare_pair(scenario, base, fixed) == []
    # A window of 4 leaves the widened tail 7 blocks, short of a segment: the
    # claim of A / B = 4 blocks per periodic tail holds again.
    narrower = dataclasses.replace(
        scenario,
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 8),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 4),
        ),
    )
    assert tags(compare_pair(narrower, base, fixed)) == ["variant-drift@0"]


def test_variant_drift_outside_the_domain() -> None:
    scenario = triton(retention=None)
    base = run([0, 16352, 16352, 16352], variant="unfixed", retained=[(514, 1028)] * 4)
    other = run([0, 16352, 16352, 16352], variant="fixed", retained=[(514, 1030)] * 4)
    findings = compare_pair(scenario, base, other)
    assert tags(findings) == [f"variant-drift@{i}" for i in range(4)]
    assert findings[0].variant == "fixed vs unfixed"


def test_one_unit_rule_holds_without_the_drop() -> None:
    # Lookahead hashes on: the block hash ending at 16384 covers token 16384,
    # where the sibling diverges, so h_dense = 16352 = c - A. The one-unit rule
    # (default policy) promises c - A below every periodic checkpoint c,
    # whatever the protection: 8192 is a fallback. vLLM 0.33.0 literally keeps
    # c - A only under the drop: no finding under `retained`, a design gap
    # under `ideal` only when the one-unit promise is met.
    scenario = triton(disable_lookahead_block_hashes=False)
    model = drafter_model(scenario)
    assert (model.drop, model.hash_lookahead_tokens) == (False, 1)
    lookahead = ManagerSettings(False, 1, 3, 1, 32)
    observed = run([0, 8192, 16352, 16352], settings=lookahead)
    findings = judge_run(scenario, observed)[1]
    assert tags(findings) == ["fallback@1"]
    assert (findings[0].expected_tokens, findings[0].fallback_checkpoint_tokens) == (16352, 8192)
    assert judge_run(scenario, observed, Policy.RETAINED)[1] == ()
    assert tags(judge_run(scenario, observed, Policy.IDEAL)[1]) == ["fallback@1"]


def test_design_gap_only_under_the_ideal_policy() -> None:
    # Retention 0, no drafter (FA 8 + SWA 4, window 16): the writer's 100-token
    # prompt keeps its replay boundary 96 and, by the one-unit rule, 88. A
    # sibling sharing 50 tokens has h_dense = 48, which no retained boundary
    # serves: a design gap under `ideal` only.
    scenario = hybrid(
        8,
        4,
        16,
        retention=0,
        requests=(RequestSpec(100, 0), RequestSpec(50, 10)),
        prefix=100,
        drafter=DrafterKind.NONE,
    )
    observed = run([0, 0], settings=ManagerSettings(False, 0, 0, 0, 8))
    refs, findings = judge_run(scenario, observed)
    assert findings == () and refs[1].checkpoints == (0,) and refs[1].dense_tokens == 48
    refs, findings = judge_run(scenario, observed, Policy.IDEAL)
    assert tags(findings) == ["design-gap@1"]
    assert findings[0].kind is FindingKind.DESIGN_GAP and refs[1].expected_tokens == 48


@pytest.mark.parametrize(
    ("shared", "hit", "expected", "policy_tags"),
    [
        # Sibling diverging inside the last unit before the replay boundary
        # 96: owed 88 = 96 - A (vLLM issue #57610), 0 is a fallback.
        (94, 0, 88, ["fallback@1"]),
        # Near miss: sharing 97 tokens reaches the boundary 96 itself.
        (97, 96, 96, []),
    ],
)
def test_one_unit_below_the_replay_boundary(
    shared: int, hit: int, expected: int, policy_tags: list[str]
) -> None:
    scenario = hybrid(
        8,
        4,
        16,
        retention=0,
        requests=(RequestSpec(100, 0), RequestSpec(shared, 100 - shared)),
        prefix=100,
        drafter=DrafterKind.NONE,
    )
    observed = run([0, hit], settings=ManagerSettings(False, 0, 0, 0, 8))
    refs, findings = judge_run(scenario, observed)
    assert refs[1].expected_tokens == expected
    assert tags(findings) == policy_tags
    assert judge_run(scenario, observed, Policy.RETAINED)[1] == ()


@pytest.mark.parametrize(
    ("length", "drop", "expected"),
    [
        (16448, True, (16384, 16416)),
        (16448, False, (16416,)),
        (32, True, (16, 24)),  # block-aligned prompt: the resend and the extension differ
        (31, True, (16,)),
        (96, False, (88,)),
    ],
)
def test_replay_boundaries_follow_vllm(length: int, drop: bool, expected: tuple[int, ...]) -> None:
    alignment = 32 if length > 100 else 8
    full = 32 if alignment == 32 else 8
    scenario = hybrid(
        full,
        4 if alignment == 8 else 16,
        16,
        prefix=length,
        requests=(RequestSpec(length, 0),),
        retention=0,
        drafter=DrafterKind.MTP if drop else DrafterKind.NONE,
        spec_tokens=1,
    )
    assert replay_boundaries(scenario, drafter_model(scenario), 0) == expected


@pytest.mark.parametrize(
    ("kind", "drop", "lookahead", "reprefill"),
    [
        (DrafterKind.EAGLE, True, 0, 0),
        (DrafterKind.EAGLE3, True, 0, 0),
        (DrafterKind.MTP, True, 0, 0),
        (DrafterKind.MULTI_MODULE_MTP, True, 0, 2),
        (DrafterKind.GEMMA4_MTP, False, 0, 0),
        (DrafterKind.DFLASH, False, 0, 0),
        (DrafterKind.DSPARK, False, 0, 0),
        (DrafterKind.DRAFT_MODEL, False, 0, 0),
        (DrafterKind.NGRAM, False, 0, 0),
        (DrafterKind.NONE, False, 0, 0),
    ],
)
def test_drafter_model_table(kind: DrafterKind, drop: bool, lookahead: int, reprefill: int) -> None:
    model = drafter_model(triton(kind))
    assert (model.drop, model.hash_lookahead_tokens, model.reprefillable_tokens) == (
        drop,
        lookahead,
        reprefill,
    )


def test_lookahead_hashes_cover_multi_module_reach() -> None:
    scenario = triton(DrafterKind.MULTI_MODULE_MTP, disable_lookahead_block_hashes=False)
    model = drafter_model(scenario)
    assert (model.drop, model.hash_lookahead_tokens, model.dependency_tokens) == (False, 3, 3)
    # c = 16384: hashes prove 16384 - 3 -> 16352 full-attention tokens.
    assert dense_hit(scenario, model, 1, 0, 16384) == 16352


def test_common_prefix_tokens() -> None:
    assert common_prefix_tokens((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix_tokens((1, 2, 3), (1, 2, 3, 4)) == 3
    assert common_prefix_tokens((), (1,)) == 0
    assert common_prefix_tokens((5,), (6,)) == 0


def test_swa_eagle_spiral_old_behaviour_is_flagged() -> None:
    # Case swa-eagle-spiral: full 4 / SWA 4, window 8, dense retention, EAGLE.
    # Resend of 100 tokens: h <= 99 and full attention proves 100 - 4 -> 96.
    # Sibling sharing 70: proves 68, minus the peek block -> 64.
    scenario = hybrid(
        4,
        4,
        8,
        prefix=100,
        requests=(RequestSpec(100, 0), RequestSpec(100, 0), RequestSpec(70, 30)),
        retention=None,
        drafter=DrafterKind.EAGLE,
        spec_tokens=1,
        chunk=32,
    )
    settings = ManagerSettings(True, 0, 1, 1, 4)
    refs, findings = judge_run(scenario, run([0, 96, 64], settings=settings))
    assert [r.dense_tokens for r in refs] == [0, 96, 64] and findings == ()
    spiral = judge_run(scenario, run([0, 0, 0], settings=settings))[1]
    assert tags(spiral) == ["fallback@1", "fallback@2"]


def test_window_below_alignment_retention_0_is_one_unit_below_a_boundary() -> None:
    # Case swa-window-below-alignment-eagle, retention 0: vLLM 0.33.0 keeps
    # only the writer's replay boundaries {96, 112}; the sibling's dense hit
    # is 80 = 96 - A, so 0 is what vLLM literally retains (no finding under
    # `retained`) but a fallback under the one-unit rule.
    scenario = hybrid(
        16,
        4,
        4,
        prefix=128,
        requests=(RequestSpec(128, 0), RequestSpec(128, 0), RequestSpec(100, 28)),
        retention=0,
        drafter=DrafterKind.EAGLE,
        spec_tokens=1,
        chunk=32,
    )
    settings = ManagerSettings(True, 0, 1, 1, 16)
    observed = run([0, 112, 0], settings=settings)
    refs, findings = judge_run(scenario, observed, Policy.RETAINED)
    assert findings == ()
    assert [r.dense_tokens for r in refs] == [0, 112, 80]
    assert replay_boundaries(scenario, drafter_model(scenario), 0) == (96, 112)
    refs, findings = judge_run(scenario, observed)
    assert tags(findings) == ["fallback@2"] and refs[2].expected_tokens == 80
    assert tags(judge_run(scenario, observed, Policy.IDEAL)[1]) == ["fallback@2"]


def test_known_issue_labels() -> None:
    from differential.oracle.known import label_known

    scenario = hybrid(
        32,
        16,
        512,
        prefix=256,
        requests=(RequestSpec(256, 1), RequestSpec(184, 40)),
        retention=None,
        spec_tokens=1,
        chunk=64,
    )
    refs, findings = judge_run(scenario, run([0, 96], settings=ManagerSettings(True, 0, 1, 1, 32)))
    assert refs[1].dense_tokens == 128
    labelled = label_known(scenario, findings)
    assert [f.known_issue for f in labelled] == ["swa-short-run-align-before-drop"]
    # Losing two units is not explained by the issue.
    worse = judge_run(scenario, run([0, 64], settings=ManagerSettings(True, 0, 1, 1, 32)))[1]
    assert [f.known_issue for f in label_known(scenario, worse)] == [None]


def test_junctions_need_a_lagging_attention_type() -> None:
    # Two sliding-window groups of equal spec are one attention type: vLLM's
    # hybrid lookup reports no uncached common prefix, so request 1 (hit 0,
    # dense 2) pins no junction; the writers' own boundaries (replay
    # boundaries 8 and 6, one unit below them 6 and 4) lie above request 2's
    # dense 2: nothing is owed.
    swa = KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 2)
    scenario = Scenario(
        kv_cache_groups=(swa, swa),
        requests=(
            RequestSpec(8, 1, name="writer"),
            RequestSpec(2, 6, shares_with=0),
            RequestSpec(2, 1, shares_with=0),
        ),
        shared_prefix_tokens=8,
        retention_interval_tokens=0,
        disable_eagle_block_drop=True,
        prefill_chunk_tokens=2,
    )
    assert not scenario.pins_junctions
    refs = references(scenario, drafter_model(scenario), [0, 0, 0])
    assert [(r.dense_tokens, r.expected_tokens) for r in refs] == [(0, 0), (2, 0), (2, 0)]
    # A full-attention group beside them is a second, downward-closed type:
    # request 1 pins its dense hit 2 as a junction and owes it to request 2.
    with_fa = dataclasses.replace(
        scenario, kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 2), swa, swa)
    )
    assert with_fa.pins_junctions
    refs = references(with_fa, drafter_model(with_fa), [0, 0, 0])
    assert [(r.expected_tokens, r.writer) for r in refs][2] == (2, 1)


def test_no_junction_is_promised_where_full_attention_skips_the_drop() -> None:
    # A marked draft SWA group takes the EAGLE drop, the full-attention groups
    # do not: vLLM pins full attention's undropped hit, which kvfuzz does not
    # model, so it promises no junction there (found by the fixed-variant
    # property test: SWA 2 is_eagle_group + 4 x FA 2, retention 0, MTP).
    swa = KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 2, is_eagle_group=True)
    full = KVCacheGroup(GroupKind.FULL_ATTENTION, 2)
    scenario = Scenario(
        kv_cache_groups=(swa, full, full, full, full),
        requests=(
            RequestSpec(12, 1, name="writer"),
            RequestSpec(11, 0),
            RequestSpec(8, 0, shares_with=0),
        ),
        shared_prefix_tokens=12,
        retention_interval_tokens=0,
        drafter=Drafter(DrafterKind.MTP, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=2,
    )
    assert scenario.drop_applies and not scenario.pins_junctions
    # Unmarked, every group drops (the coordinator's fallback): junctions again.
    fallback = dataclasses.replace(
        scenario, kv_cache_groups=(KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 2), full)
    )
    assert fallback.pins_junctions


@pytest.mark.parametrize(
    ("extra", "boundaries", "line"),
    [
        (
            (4,),
            12,
            "fixed vs unfixed: +4 SWA blocks over 12 retained boundaries (+0.33 per boundary)",
        ),
        ((0,), 3, "fixed vs unfixed: 0 SWA blocks over 3 retained boundaries (0 per boundary)"),
        # A variant keeping fewer blocks than the baseline: a plain minus,
        # never "+[-2]".
        (
            (-2,),
            4,
            "fixed vs unfixed: -2 SWA blocks over 4 retained boundaries (-0.5 per boundary)",
        ),
        (
            (-2, 6),
            4,
            "fixed vs unfixed: -2, +6 SWA blocks per SWA group over 4 retained boundaries "
            "(-0.5, +1.5 per boundary)",
        ),
    ],
)
def test_fix_cost_line_is_signed(extra: tuple[int, ...], boundaries: int, line: str) -> None:
    assert FixCost("fixed", "unfixed", extra, boundaries).summary() == line


def _per_group(hits: list[int], per_group: dict[int, tuple[int, int]]) -> RunObservation:
    base = run(hits)
    requests = tuple(
        dataclasses.replace(r, per_group_hit_tokens=per_group.get(r.index, r.per_group_hit_tokens))
        for r in base.requests
    )
    return dataclasses.replace(base, requests=requests)


def test_a_group_alone_hitting_below_the_reconciled_hit_is_a_per_group_hit() -> None:
    # Triton geometry, A = 32. Request 1's reconciled hit is 16352; the SWA
    # group alone hitting 16320 (one unit lower) breaks "every group holds the
    # reconciled prefix". Full attention alone hitting 16384, above it, is fine.
    findings = judge_run(triton(), _per_group([0, 16352, 16352, 16352], {1: (16384, 16320)}))[1]
    assert tags(findings) == ["per-group-hit@1"]
    (f,) = findings
    assert (f.expected_tokens, f.hit_tokens) == (16352, 16320)
    assert f.detail.startswith("group 1 (sliding_window, block 16) looked up alone hits 16320")
    assert judge_run(triton(), _per_group([0, 16352, 16352, 16352], {1: (16384, 16352)}))[1] == ()


def test_a_misaligned_per_group_hit_is_a_per_group_hit() -> None:
    # 16360 is above the reconciled 16352 but 8 tokens off the 32-token grid.
    findings = judge_run(triton(), _per_group([0, 16352, 16352, 16352], {2: (16352, 16360)}))[1]
    assert tags(findings) == ["per-group-hit@2"]
    assert (findings[0].expected_tokens, findings[0].hit_tokens) == (16352, 16360)
    assert "not a multiple of the hit alignment 32" in findings[0].detail


def test_the_dense_cross_check_run_has_its_per_group_hits_judged() -> None:
    # Dense run hits are the dense references (no dense-mismatch); only the
    # per-group hit of request 3 is short.
    dense = dataclasses.replace(
        _per_group([0, 16352, 16352, 16352], {3: (0, 0)}), variant="v (dense)"
    )
    findings = cross_check_dense(triton(), dense)
    assert tags(findings) == ["per-group-hit@3"]
    assert findings[0].detail.startswith("dense cross-check run: group 0 (full_attention")


@settings(max_examples=120, suppress_health_check=list(HealthCheck), deadline=None)
@given(
    scenarios(kinds=frozenset()),
    st.sampled_from(list(Policy)),
    st.randoms(use_true_random=False),
)
def test_references_are_the_pairwise_definition(
    scenario: Scenario, policy: Policy, rng: random.Random
) -> None:
    # references() reduces each sibling's writers in C; it must equal the
    # definition taken writer by writer: dense_hit per pair, checkpoints per
    # writer (with the junction it pinned), the first writer owed the most;
    # a request that skips reading the prefix cache has no writer.
    assume(not scenario.mamba_groups)
    model = drafter_model(scenario)
    hits = [rng.randrange(r.prompt_tokens + 1) for r in scenario.requests]
    refs = references(scenario, model, hits, policy)
    shared = shared_prefixes(scenario)
    pinned: list[int] = []
    for j, ref in enumerate(refs):
        writers = range(j) if scenario.reads_prefix_cache(j) else range(0)
        dense = [dense_hit(scenario, model, j, i, shared[j][i]) for i in writers]
        promised = [
            checkpoints(scenario, model, i, pinned[i], dense[i], hits[i], policy) for i in writers
        ]
        owed = [dense[i] if policy is Policy.IDEAL else promised[i][-1] for i in writers]
        assert ref.divergence_tokens == max((shared[j][i] for i in writers), default=0)
        assert ref.dense_tokens == max(dense, default=0)
        assert ref.expected_tokens == max(owed, default=0)
        assert ref.writer == (owed.index(max(owed)) if owed else None)
        assert ref.checkpoints == tuple(sorted({0}.union(*promised)))
        assert ref.junction_tokens >= ref.dense_tokens
        pins = scenario.pins_junctions and hits[j] < ref.junction_tokens
        pinned.append(ref.junction_tokens if pins else 0)

"""Known-issue labels: each predicate matches its mechanism and rejects a near miss (no vLLM)."""

from __future__ import annotations

import dataclasses

import pytest

from differential.findings import (
    RESERVED_WITHOUT_BLOCKS,
    UNRESERVED_PARTIAL_TAIL_COPY,
    Finding,
    FindingKind,
    Policy,
)
from differential.observation import ManagerSettings
from differential.oracle import judge_run
from differential.oracle.known import label_known
from differential.scenario import (
    Drafter,
    DrafterKind,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
)
from differential.scenario.models import LayerSpec, ModelDescription
from tests.factories import hybrid
from tests.unit.test_oracle import run

NO_DROP_8 = ManagerSettings(False, 0, 0, 0, 8)


def _toy_57610(shared: int) -> Scenario:
    # vLLM issue #57610: FA 8 + SWA 4 (window 16), retention 0, no drafter.
    return hybrid(
        8,
        4,
        16,
        prefix=100,
        requests=(RequestSpec(100, 0), RequestSpec(shared, 100 - shared)),
        retention=0,
        drafter=DrafterKind.NONE,
    )


def _labels(scenario: Scenario, hits: list[int], settings: ManagerSettings) -> list[str | None]:
    findings = judge_run(scenario, run(hits, settings=settings))[1]
    return [f.known_issue for f in label_known(scenario, findings)]


def test_unit_below_replay_boundary_is_labelled() -> None:
    assert _labels(_toy_57610(94), [0, 0], NO_DROP_8) == ["unit-below-retained-boundary-falls-back"]


def test_unit_below_replay_boundary_rejects_a_near_miss() -> None:
    # Sharing 97 tokens is owed the retained boundary 96 itself: a fallback
    # from there is some other mechanism.
    assert _labels(_toy_57610(97), [0, 88], NO_DROP_8) == [None]


def test_seed_bug_is_not_the_one_unit_known_issue() -> None:
    # The Triton seed under the drop: c - A is promised by vLLM's own seed
    # PR policy, so its fallback on unfixed stays unlabelled (the bug the
    # fixed variant fixes).
    from tests.factories import triton

    assert _labels(triton(), [0, 8192, 16352, 16352], ManagerSettings(True, 0, 3, 1, 32)) == [None]


def _gemma4_like(second_swa: bool) -> Scenario:
    groups = [
        KVCacheGroup(GroupKind.FULL_ATTENTION, 64),
        KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, 1024),
    ]
    if second_swa:
        groups.append(KVCacheGroup(GroupKind.SLIDING_WINDOW, 64, 8192))
    return Scenario(
        kv_cache_groups=tuple(groups),
        requests=tuple(RequestSpec(1000, 24) for _ in range(4)),
        shared_prefix_tokens=1000,
        drafter=Drafter(DrafterKind.EAGLE3, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=512,
    )


@pytest.mark.parametrize("second_swa", [True, False])
def test_one_unit_short_run_loss_is_not_a_spiral(second_swa: bool) -> None:
    # 832 where 896 is due: one unit, on the 1024-window group's short run.
    settings = ManagerSettings(True, 0, 1, 1, 64)
    labels = set(_labels(_gemma4_like(second_swa), [0, 832, 832, 832], settings))
    assert labels == {"swa-short-run-align-before-drop"}


def _two_swa_short_run() -> Scenario:
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 16),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 8, 128),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 8, 64),
        ),
        requests=(RequestSpec(128, 0), RequestSpec(128, 0), RequestSpec(120, 8)),
        shared_prefix_tokens=128,
        retention_interval_tokens=0,
        drafter=Drafter(DrafterKind.MTP, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=32,
    )


@pytest.mark.parametrize("hit", [0, 96])
def test_the_multi_group_spiral_is_the_short_run_loss_repeated(hit: int) -> None:
    # 112 -> 0 (the fixed-point loop repeats the loss on every pass) and
    # 112 -> 96 (one pass) are one mechanism, one label.
    finding = Finding(FindingKind.FALLBACK, "v", 2, "", expected_tokens=112, hit_tokens=hit)
    assert label_known(_two_swa_short_run(), [finding])[0].known_issue == (
        "swa-short-run-align-before-drop"
    )


def test_short_run_label_needs_the_short_run() -> None:
    # Near miss: windows of 16 and 8 tokens have a full-window run at 112.
    import dataclasses

    scenario = dataclasses.replace(
        _two_swa_short_run(),
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 16),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 8, 16),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 8, 8),
        ),
    )
    finding = Finding(FindingKind.FALLBACK, "v", 2, "", expected_tokens=112, hit_tokens=0)
    assert label_known(scenario, [finding])[0].known_issue is None


def test_short_prefix_seed_form_is_not_the_short_run_spiral() -> None:
    # Near miss: two SWA groups of block 4 (windows 50 and 20) under periodic
    # retention 64, owed 48 = 64 - A: the tail kept at 64 for window 50 is 14
    # blocks from 8, so the run from block 0 to 48 misses blocks 0 and 1 and
    # the fall to 0 is the seed PR's class in its short-prefix form.
    scenario = Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 16),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 50),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 20),
        ),
        requests=(RequestSpec(64, 20), RequestSpec(64, 0)),
        shared_prefix_tokens=64,
        retention_interval_tokens=64,
        drafter=Drafter(DrafterKind.EAGLE, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=16,
    )
    finding = Finding(FindingKind.FALLBACK, "v", 1, "", expected_tokens=48, hit_tokens=0)
    assert label_known(scenario, [finding])[0].known_issue is None
    # One unit per short group is the short-run loss whatever the tails.
    spiral = Finding(FindingKind.FALLBACK, "v", 1, "", expected_tokens=48, hit_tokens=16)
    assert label_known(scenario, [spiral])[0].known_issue == "swa-short-run-align-before-drop"


def test_spiral_below_a_periodic_checkpoint_whose_tails_reach_token_0() -> None:
    # The known reproducer's shape: windows 128 and 64 (blocks 8) under
    # retention 128 keep tails from token 0, so 112 -> 0 is the spiral.
    import dataclasses

    scenario = dataclasses.replace(_two_swa_short_run(), retention_interval_tokens=128)
    finding = Finding(FindingKind.FALLBACK, "v", 2, "", expected_tokens=112, hit_tokens=0)
    assert label_known(scenario, [finding])[0].known_issue == "swa-short-run-align-before-drop"


def _single_fa(length: int, drafter: DrafterKind = DrafterKind.EAGLE) -> Scenario:
    return Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
        requests=(RequestSpec(length, 0), RequestSpec(length, 0)),
        shared_prefix_tokens=length,
        drafter=Drafter(drafter, 0 if drafter is DrafterKind.NONE else 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=32,
    )


def test_single_group_drop_after_length_cap() -> None:
    settings = ManagerSettings(True, 0, 1, 1, 16)
    refs, findings = judge_run(_single_fa(64), run([0, 32], settings=settings))
    assert refs[1].dense_tokens == 48
    labels = {f.known_issue for f in label_known(_single_fa(64), findings)}
    assert labels == {"single-group-drop-after-length-cap"}
    # Near miss: losing two blocks is not this mechanism.
    worse = judge_run(_single_fa(64), run([0, 16], settings=settings))[1]
    assert {f.known_issue for f in label_known(_single_fa(64), worse)} == {None}


def _window_one(groups: tuple[KVCacheGroup, ...]) -> Scenario:
    return Scenario(
        kv_cache_groups=groups,
        requests=(RequestSpec(16, 5), RequestSpec(14, 4)),
        shared_prefix_tokens=16,
        drafter=Drafter(DrafterKind.MTP, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=8,
    )


FA4 = KVCacheGroup(GroupKind.FULL_ATTENTION, 4)


@pytest.mark.parametrize(
    "groups",
    [
        (
            FA4,
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 2),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 1),
        ),
        (
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 4),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 1),
        ),
    ],
    ids=["three-groups", "two-swa-groups"],
)
def test_window_one_spiral_in_both_forms(groups: tuple[KVCacheGroup, ...]) -> None:
    finding = Finding(FindingKind.FALLBACK, "v", 1, "", expected_tokens=8, hit_tokens=0)
    assert label_known(_window_one(groups), [finding])[0].known_issue == (
        "window-one-multi-group-spiral"
    )


@pytest.mark.parametrize(
    "groups",
    [
        # A 2-token window is not the degenerate geometry.
        (
            FA4,
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 2),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 2),
        ),
        # One window-1 group beside full attention does not spiral (vLLM
        # gives 8 there; a fallback on it is the seed class).
        (FA4, KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 1)),
    ],
    ids=["window-two", "one-swa-group"],
)
def test_window_one_spiral_near_misses(groups: tuple[KVCacheGroup, ...]) -> None:
    finding = Finding(FindingKind.FALLBACK, "v", 1, "", expected_tokens=8, hit_tokens=0)
    assert label_known(_window_one(groups), [finding])[0].known_issue != (
        "window-one-multi-group-spiral"
    )


def test_unit_below_boundary_counts_only_writers_that_share_the_prefix() -> None:
    # Found by the property tests: a sliding-window-only model (block 2,
    # window 2), retention 0. Request 1 shares nothing with request 2, so its
    # own replay boundary 2 must not hide that request 2 is owed 2 = 4 - A
    # below the writer's replay boundary 4.
    scenario = Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 2),),
        requests=(
            RequestSpec(4, 1, name="writer"),
            RequestSpec(0, 4, shares_with=0),
            RequestSpec(2, 1, shares_with=0),
        ),
        shared_prefix_tokens=4,
        retention_interval_tokens=0,
        drafter=Drafter(DrafterKind.MTP, 1),
        disable_lookahead_block_hashes=True,
        disable_eagle_block_drop=True,
        prefill_chunk_tokens=2,
    )
    labels = _labels(scenario, [0, 0, 0], ManagerSettings(False, 0, 0, 0, 2))
    assert labels == ["unit-below-retained-boundary-falls-back"]


def test_a_single_group_pins_no_junction() -> None:
    # Found by a seed-11 campaign: one SWA group (block 8, window 8), R = 16,
    # no protection. Request 1 hits 16 where 24 is owed; vLLM's
    # UnitaryKVCacheCoordinator pins no junction for it, so request 2 (owed
    # 24 = 32 - A below the writer's periodic checkpoint 32) is the one-unit
    # class too, not a missed junction.
    scenario = Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.SLIDING_WINDOW, 8, 8),),
        requests=(
            RequestSpec(32, 22, name="writer"),
            RequestSpec(30, 8),
            RequestSpec(29, 9),
        ),
        shared_prefix_tokens=32,
        retention_interval_tokens=16,
        drafter=Drafter(DrafterKind.DRAFT_MODEL, 3),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=16,
    )
    findings = judge_run(scenario, run([0, 16, 16], settings=ManagerSettings(False, 0, 0, 0, 8)))[1]
    assert 24 not in judge_run(scenario, run([0, 16, 16]), Policy.RETAINED)[0][2].checkpoints
    assert [f.known_issue for f in label_known(scenario, findings)] == [
        "unit-below-retained-boundary-falls-back"
    ] * 2


LOOKAHEAD_CRASH = "lookahead-hashes-index-error-without-full-attention"


def _crash(raised_in: str | None) -> Finding:
    detail = (
        "request 0: lookup: KVCacheManager.get_computed_blocks: IndexError: list index out of range"
    )
    if raised_in is not None:
        detail += f" [raised in {raised_in} (vllm/v1/core/single_type_kv_cache_manager.py)]"
    return Finding(FindingKind.CRASH, "v", 0, detail)


def _crashing(groups: tuple[KVCacheGroup, ...], drafter: Drafter) -> Scenario:
    return Scenario(
        kv_cache_groups=groups,
        requests=(RequestSpec(18, 1),),
        shared_prefix_tokens=18,
        drafter=drafter,
        prefill_chunk_tokens=4,
    )


TWO = Drafter(DrafterKind.MULTI_MODULE_MTP, 2)


@pytest.mark.parametrize(
    ("groups", "raised_in"),
    [
        ((KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 2),), None),
        (
            (KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 2),),
            "SlidingWindowManager.find_longest_cache_hit",
        ),
        (
            (
                KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 4),
                KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 8),
            ),
            "SlidingWindowManager.find_longest_cache_hit",
        ),
        (
            (KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 8), KVCacheGroup(GroupKind.MAMBA, 4)),
            "MambaManager.find_longest_cache_hit",
        ),
        # Blocks of 16 and 8 beside 4 read the 4-token hashes through
        # BlockHashListWithBlockSize, which raises (a scheduler campaign, seed 48).
        (
            (
                KVCacheGroup(GroupKind.SLIDING_WINDOW, 8, 8),
                KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 4),
            ),
            "BlockHashListWithBlockSize._get_value_at",
        ),
    ],
    ids=["one-swa-untraced", "one-swa", "two-swa", "swa-mamba", "block-hash-view"],
)
def test_lookahead_crash_label_without_full_attention(
    groups: tuple[KVCacheGroup, ...], raised_in: str | None
) -> None:
    labelled = label_known(_crashing(groups, TWO), [_crash(raised_in)])[0]
    assert labelled.known_issue == LOOKAHEAD_CRASH


def test_lookahead_crash_label_near_misses() -> None:
    swa = (
        KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 4),
        KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 8),
    )
    where = "SlidingWindowManager.find_longest_cache_hit"
    # One lookahead token (EAGLE) is capped by the hashes.
    eagle = Drafter(DrafterKind.EAGLE, 1)
    assert label_known(_crashing(swa, eagle), [_crash(where)])[0].known_issue is None
    # A full-attention group caps the lookup.
    fa = (KVCacheGroup(GroupKind.FULL_ATTENTION, 4), *swa)
    assert label_known(_crashing(fa, TWO), [_crash(where)])[0].known_issue is None
    alone = (KVCacheGroup(GroupKind.FULL_ATTENTION, 2),)
    assert label_known(_crashing(alone, TWO), [_crash(None)])[0].known_issue is None
    # Raised elsewhere: another mechanism.
    other = _crash("BlockPool.get_new_blocks")
    assert label_known(_crashing(swa, TWO), [other])[0].known_issue is None


def _state_one_token_short(drafter: Drafter, hash_block: int | None = 4) -> Scenario:
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
            KVCacheGroup(GroupKind.MAMBA, 16),
        ),
        requests=(RequestSpec(61, 0), RequestSpec(61, 0, shares_with=0)),
        shared_prefix_tokens=61,
        hash_block_size_tokens=hash_block,
        drafter=drafter,
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=16,
    )


def test_state_cached_one_token_short_label() -> None:
    name = "mamba-state-cached-one-token-short"
    short = Finding(FindingKind.FALLBACK, "v", 1, "", expected_tokens=56, hit_tokens=48)
    assert label_known(_state_one_token_short(TWO), [short])[0].known_issue == name
    # Near misses: single-module MTP leaves no tail uncached; a state owed
    # on the Mamba block grid is cached by a later step's cache_blocks.
    mtp = Drafter(DrafterKind.MTP, 1)
    assert label_known(_state_one_token_short(mtp), [short])[0].known_issue is None
    on_grid = Finding(FindingKind.FALLBACK, "v", 1, "", expected_tokens=48, hit_tokens=32)
    assert label_known(_state_one_token_short(TWO), [on_grid])[0].known_issue is None


def test_single_group_cap_explains_the_dense_check_of_a_needless_drop() -> None:
    # Found by a campaign: FA block 1 alone, Gemma-4 MTP on stock vLLM (which
    # drops needlessly); the dense cross-check judges with that drop: owed 1,
    # capped at L - 1 = 1 and dropped to 0.
    scenario = Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 1),),
        requests=(RequestSpec(17, 0), RequestSpec(2, 0)),
        shared_prefix_tokens=17,
        retention_interval_tokens=0,
        drafter=Drafter(DrafterKind.GEMMA4_MTP, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=1,
    )
    mismatch = Finding(FindingKind.DENSE_MISMATCH, "v", 1, "", expected_tokens=1, hit_tokens=0)
    labelled = label_known(scenario, [mismatch])[0]
    assert labelled.known_issue == "single-group-drop-after-length-cap"
    fallback = Finding(FindingKind.FALLBACK, "v", 1, "", expected_tokens=1, hit_tokens=0)
    assert label_known(scenario, [fallback])[0].known_issue is None  # Gemma-4 owes no drop


def test_a_writer_keeps_only_the_boundaries_it_computed() -> None:
    # Found by the property tests at real scale: request 1 (a resend) hit
    # 16256, so its own replay boundary 16128 was never computed by it and is
    # not retained; request 3 is owed 16128 = 16256 - A below the writer's
    # replay boundary: the one-unit class.
    scenario = Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 128),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 64, 512),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 64, 256),
        ),
        requests=(
            RequestSpec(16384, 1, name="writer"),
            RequestSpec(16384, 0),
            RequestSpec(0, 1, shares_with=0),
            RequestSpec(16256, 0, shares_with=0),
        ),
        shared_prefix_tokens=16384,
        retention_interval_tokens=16384,
        drafter=Drafter(DrafterKind.MTP, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=128,
    )
    hits = [0, 16256, 0, 0]
    findings = judge_run(scenario, run(hits, settings=ManagerSettings(True, 0, 1, 1, 128)))[1]
    labelled = label_known(scenario, findings, hits=hits)
    assert [(f.request, f.expected_tokens, f.known_issue) for f in labelled] == [
        (3, 16128, "unit-below-retained-boundary-falls-back")
    ]


def test_label_regressions_from_the_property_tests() -> None:
    # A single SWA group (block 2, window 2), R = 8, MTP drop: the resend is
    # owed 6 = 8 - A, which needs the block past L - 1 as its peek block; the
    # unitary cap leaves 4, which sparse retention does not keep: 0.
    single = Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 2),),
        requests=(RequestSpec(8, 1, name="writer"), RequestSpec(8, 0)),
        shared_prefix_tokens=8,
        retention_interval_tokens=8,
        drafter=Drafter(DrafterKind.MTP, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=2,
    )
    hits = [0, 0]
    findings = judge_run(single, run(hits, settings=ManagerSettings(True, 0, 1, 1, 2)))[1]
    assert [f.known_issue for f in label_known(single, findings, hits=hits)] == [
        "single-group-drop-after-length-cap"
    ]
    # FA 8 + SWA 4 (window 4) + SWA 4 (window 2), R = 32, MTP drop: request 4
    # (the prefix's first 24 tokens) is owed 16 = 24 - A below the writer's
    # replay boundary 24; request 1 diverged at 16, so its own boundary 16
    # cannot serve request 4 (its peek block holds its own tokens).
    three = Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 8),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 4),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 2),
        ),
        requests=(
            RequestSpec(32, 1, name="writer"),
            RequestSpec(16, 8, shares_with=0),
            RequestSpec(0, 1, shares_with=0),
            RequestSpec(0, 1, shares_with=0),
            RequestSpec(24, 0, shares_with=0),
        ),
        shared_prefix_tokens=32,
        retention_interval_tokens=32,
        drafter=Drafter(DrafterKind.MTP, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=8,
    )
    hits = [0, 8, 0, 0, 8]
    findings = judge_run(three, run(hits, settings=ManagerSettings(True, 0, 1, 1, 8)))[1]
    labelled = [
        (f.request, f.expected_tokens, f.known_issue)
        for f in label_known(three, findings, hits=hits)
    ]
    assert (4, 16, "unit-below-retained-boundary-falls-back") in labelled


def _corpus_scenario(path: str) -> tuple[Scenario, list[int]]:
    """A corpus file's scenario and its recorded ``unfixed`` hits (real runs)."""
    import json
    from pathlib import Path

    raw = json.loads((Path(__file__).parents[2] / path).read_text())
    expect = raw.pop("expect")
    return Scenario.from_dict(raw), list(expect["hits"]["unfixed"])


def _corpus_labels(
    path: str, hits: list[int] | None = None, **changes: object
) -> list[tuple[int, int, str | None]]:
    """(request, expected, label) of every fallback the oracle finds for the
    corpus file's recorded hits, or for ``hits``."""
    import dataclasses

    scenario, recorded = _corpus_scenario(path)
    scenario = dataclasses.replace(scenario, **changes)  # type: ignore[arg-type]
    return _fallback_labels(scenario, hits if hits is not None else recorded)


def _fallback_labels(scenario: Scenario, hits: list[int]) -> list[tuple[int, int, str | None]]:
    """(request, expected, label) of every fallback the oracle finds for ``hits``."""
    from differential.oracle import drafter_model, references

    findings = [
        Finding(
            FindingKind.FALLBACK,
            "unfixed",
            r.index,
            "",
            divergence_tokens=r.divergence_tokens,
            expected_tokens=r.expected_tokens,
            hit_tokens=hits[r.index],
        )
        for r in references(scenario, drafter_model(scenario), hits)
        if hits[r.index] < r.expected_tokens
    ]
    return [
        (f.request or 0, f.expected_tokens or 0, f.known_issue)
        for f in label_known(scenario, findings, hits=hits)
    ]


STATE_BELOW = "unit-below-retained-state-discarded"


def test_state_below_a_periodic_checkpoint_with_sparse_states() -> None:
    # States every 8 tokens (the chunk), not every Mamba block: the state owed
    # below 48 - A = 47 is the one at 40.
    path = "known-issues/unit-below-retained-state-discarded--periodic-checkpoint-chunk8.json"
    assert _corpus_labels(path) == [(1, 40, STATE_BELOW)]
    # Near miss: a fallback from the state at a retained boundary itself.
    scenario, _ = _corpus_scenario(path)
    owed_boundary = Finding(FindingKind.FALLBACK, "v", 1, "", expected_tokens=32, hit_tokens=16)
    assert label_known(scenario, [owed_boundary], hits=[0, 16])[0].known_issue is None


def test_state_below_a_pinned_junction() -> None:
    path = "known-issues/unit-below-retained-state-discarded--pinned-junction-gdn2.json"
    assert _corpus_labels(path) == [(1, 96, STATE_BELOW), (2, 64, STATE_BELOW)]
    assert _corpus_labels(
        "known-issues/unit-below-retained-state-discarded--junction-eagle.json"
    ) == [(2, 40, STATE_BELOW)]
    # Near miss: request 1 hit its proof, so it pinned no junction and
    # computed nothing below 96; a shortfall of request 2 from 64 is then
    # owed to no boundary vLLM retains.
    scenario, _ = _corpus_scenario(path)
    short = Finding(FindingKind.FALLBACK, "v", 2, "", expected_tokens=64, hit_tokens=0)
    assert label_known(scenario, [short], hits=[0, 96, 0])[0].known_issue is None


def test_fine_grained_replay_loses_the_swa_tail() -> None:
    path = "known-issues/fine-grained-replay-swa-tail-discarded.json"
    assert _corpus_labels(path) == [(2, 162, "fine-grained-replay-state-discarded")]
    # Near miss: without the drop vLLM's replay boundary is L - 1 on any grid.
    assert _corpus_labels(path, disable_eagle_block_drop=True) == [(2, 162, None)]


def test_state_below_a_periodic_checkpoint_past_the_prompt() -> None:
    # b = 536 lies past the writer's 469-token prompt; 469 = b - A is owed.
    path = "known-issues/unit-below-retained-state-discarded--periodic-past-prompt.json"
    assert _corpus_labels(path) == [(1, 469, STATE_BELOW)]
    # Near miss: a fallback from the replay boundary 335 itself (a boundary
    # vLLM keeps a state at) is some other mechanism.
    scenario, _ = _corpus_scenario(path)
    at_boundary = Finding(FindingKind.FALLBACK, "v", 1, "", expected_tokens=335, hit_tokens=268)
    assert label_known(scenario, [at_boundary], hits=[0, 268])[0].known_issue is None


def test_state_below_a_periodic_checkpoint_is_a_decoded_state_in_a_chat() -> None:
    # Mamba 4 alone, retention 16: the writer's last state is the decoded 24
    # (21 prompt tokens, 6 decode steps); the next turn shares 28 = 32 - A,
    # one unit below a periodic checkpoint 32 the writer never reached.
    path = "known-issues/unit-below-retained-state-discarded--decoded-state.json"
    assert _corpus_labels(path) == [(1, 24, STATE_BELOW)]
    # Near miss: sharing 27 tokens, no unit below 32 is reached; the next
    # turn is owed the prompt's replay boundary 20 and hits it, and a
    # shortfall from 24 there is some other mechanism.
    import dataclasses

    scenario, _ = _corpus_scenario(path)
    turn = dataclasses.replace(scenario.requests[1], divergence_tokens=27)
    short = dataclasses.replace(scenario, requests=(scenario.requests[0], turn))
    assert _fallback_labels(short, [0, 20]) == []
    from_24 = Finding(FindingKind.FALLBACK, "v", 1, "", 27, expected_tokens=24, hit_tokens=20)
    assert label_known(short, [from_24], hits=[0, 20])[0].known_issue is None


def _small_draft_block(marked: bool) -> Scenario:
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 2, 2),
            KVCacheGroup(GroupKind.FULL_ATTENTION, 2, is_eagle_group=marked),
        ),
        requests=(RequestSpec(20, 0), RequestSpec(10, 0)),
        shared_prefix_tokens=20,
        retention_interval_tokens=8,
        drafter=Drafter(DrafterKind.MULTI_MODULE_MTP, 4),
        kv_connector=True,
        prefill_chunk_tokens=2048,
    )


def test_small_draft_block_over_hit_label_needs_the_marked_group() -> None:
    # The real run's hits (known-issues/draft-group-multi-module-mtp-small-draft-block.json).
    drop = ManagerSettings(True, 0, 4, 4, 4)
    over = Finding(FindingKind.OVER_HIT, "unfixed", 1, "x", 10, 6, 8)
    (marked,) = label_known(_small_draft_block(True), [over])
    assert marked.known_issue == "draft-group-drop-shorter-than-lookahead"
    # Unmarked, the fallback drops the 4-token full-attention block: the
    # same over-hit would be something else.
    (unmarked,) = label_known(_small_draft_block(False), [over])
    assert unmarked.known_issue is None
    # And the fallback's own hit (4) is judged clean.
    assert [
        f.kind for f in judge_run(_small_draft_block(False), run([0, 4], settings=drop))[1]
    ] == []


def test_alignment_blowup_label_is_the_layout_finding_only() -> None:
    s = _small_draft_block(True)
    blowup = Finding(FindingKind.ALIGNMENT_BLOWUP, "layout", None, "x", None, 3456, 13824)
    fallback = Finding(FindingKind.FALLBACK, "unfixed", 1, "x", 10, 8, 4)
    labels = [f.known_issue for f in label_known(s, [blowup, fallback])]
    assert labels[0] == "alignment-lcm-blowup"
    assert labels[1] != "alignment-lcm-blowup"


STALL = (
    "step 66: update_from_output: Scheduler.schedule: RuntimeError: scheduled nothing for "
    "64 steps with 1 request(s) waiting (pool 88 blocks)"
)


def _stalling(drafter: Drafter, chunk: int) -> Scenario:
    """The shrunk reproducer's shape: one sliding-window group (block 1,
    window 2), a 2-token writer, its sibling sharing both tokens, the step
    budget ``chunk`` tokens."""
    return Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.SLIDING_WINDOW, 1, 2),),
        requests=(RequestSpec(0, 2), RequestSpec(2, 0, shares_with=0)),
        shared_prefix_tokens=0,
        drafter=drafter,
        prefill_chunk_tokens=chunk,
    )


def test_a_stall_is_the_padded_draft_only_where_the_draft_outgrows_the_budget() -> None:
    stall = Finding(FindingKind.CRASH, "v", 0, STALL)
    ngram = Drafter(DrafterKind.NGRAM, 1)
    assert label_known(_stalling(ngram, 1), [stall])[0].known_issue == (
        "scheduler-stall-padded-draft-above-budget"
    )
    # Near misses: a budget that holds the padded draft (1 + 1 tokens), no
    # drafter, and a crash that is not the stall.
    assert label_known(_stalling(ngram, 2), [stall])[0].known_issue is None
    assert label_known(_stalling(Drafter(DrafterKind.NONE, 0), 1), [stall])[0].known_issue is None
    other = Finding(FindingKind.CRASH, "v", 0, "request 0: lookup: ValueError: no")
    assert label_known(_stalling(ngram, 1), [other])[0].known_issue is None


def test_a_stall_after_a_whole_failed_async_load_is_the_self_reserving_retry() -> None:
    from differential.scenario import ConnectorLoad, ConnectorStore, DriveMode, Workload

    def stalling(store: ConnectorStore, groups: tuple[KVCacheGroup, ...]) -> Scenario:
        return Scenario(
            kv_cache_groups=groups,
            requests=(RequestSpec(0, 23), RequestSpec(23, 0, shares_with=0)),
            shared_prefix_tokens=0,
            kv_connector=True,
            workload=Workload(mode=DriveMode.SCHEDULER, pool_blocks=16, connector=store),
        )

    hybrid = (
        KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
        KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 8),
    )
    failing = ConnectorStore(ConnectorLoad.ASYNC, failed_loads=(1,), prefix_caching=False)
    stall = Finding(FindingKind.CRASH, "v", 0, f"{STALL}, 1 of them {RESERVED_WITHOUT_BLOCKS}")
    assert label_known(stalling(failing, hybrid), [stall])[0].known_issue == (
        "scheduler-stall-failed-load-reserves-itself"
    )
    # One KV cache group: the failure is the last loaded block, and the
    # request is reserved without blocks only where that block was the load.
    single = (KVCacheGroup(GroupKind.FULL_ATTENTION, 4),)
    assert label_known(stalling(failing, single), [stall])[0].known_issue == (
        "scheduler-stall-failed-load-reserves-itself"
    )
    # Near misses: no failed load; no request reserved without blocks (the
    # failed load kept its valid prefix); a crash that is not the stall.
    plain = ConnectorStore(ConnectorLoad.ASYNC, prefix_caching=False)
    assert label_known(stalling(plain, hybrid), [stall])[0].known_issue is None
    holding = Finding(FindingKind.CRASH, "v", 0, STALL)
    assert label_known(stalling(failing, single), [holding])[0].known_issue is None
    assert label_known(stalling(failing, hybrid), [holding])[0].known_issue is None
    other = Finding(FindingKind.CRASH, "v", 0, "request 0: lookup: ValueError: no")
    assert label_known(stalling(failing, hybrid), [other])[0].known_issue is None
    # Two requests holding KV stalled without a failed load: the reservation
    # that caps the window (both waiting), not with one waiting or no window.
    two = Finding(FindingKind.CRASH, "v", 0, STALL.replace("with 1 request", "with 2 request"))
    assert label_known(stalling(plain, hybrid), [two])[0].known_issue == (
        "async-load-reservation-caps-the-window"
    )
    assert label_known(stalling(plain, single), [two])[0].known_issue is None
    assert label_known(stalling(failing, hybrid), [two])[0].known_issue is None
    reserved = Finding(
        FindingKind.CRASH, "v", 0, f"{two.detail}, 1 of them {RESERVED_WITHOUT_BLOCKS}"
    )
    assert label_known(stalling(failing, hybrid), [reserved])[0].known_issue == (
        "scheduler-stall-failed-load-reserves-itself"
    )


def test_a_pool_error_with_external_tokens_on_a_mamba_hybrid_is_the_uncounted_block() -> None:
    from differential.scenario import ConnectorStore, DriveMode, Workload

    def hybrid(drafter: Drafter, store: ConnectorStore | None) -> Scenario:
        return Scenario(
            kv_cache_groups=(
                KVCacheGroup(GroupKind.FULL_ATTENTION, 16),
                KVCacheGroup(GroupKind.MAMBA, 16),
            ),
            requests=(RequestSpec(0, 21), RequestSpec(20, 0, shares_with=0)),
            shared_prefix_tokens=0,
            hash_block_size_tokens=4,
            drafter=drafter,
            kv_connector=True,
            workload=Workload(mode=DriveMode.SCHEDULER, pool_blocks=12, connector=store),
        )

    crash = Finding(
        FindingKind.CRASH,
        "v",
        0,
        "step 5: schedule: Scheduler.schedule: ValueError: Cannot get 3 free blocks from "
        "the pool [raised in BlockPool.get_new_blocks (vllm/v1/core/block_pool.py)]",
    )
    mtp = Drafter(DrafterKind.MTP, 2)
    assert label_known(hybrid(mtp, ConnectorStore()), [crash])[0].known_issue == (
        "mamba-external-block-uncounted"
    )
    # Without speculative blocks the cap is the running state block alone,
    # and the external block is still on top of it.
    plain = Drafter(DrafterKind.NONE, 0)
    assert label_known(hybrid(plain, ConnectorStore()), [crash])[0].known_issue == (
        "mamba-external-block-uncounted"
    )
    # Near misses: no store (no external tokens); no Mamba group.
    assert label_known(hybrid(mtp, None), [crash])[0].known_issue is None
    attention = Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
        requests=(RequestSpec(0, 21), RequestSpec(20, 0, shares_with=0)),
        shared_prefix_tokens=0,
        kv_connector=True,
        workload=Workload(mode=DriveMode.SCHEDULER, pool_blocks=12, connector=ConnectorStore()),
    )
    assert label_known(attention, [crash])[0].known_issue is None


def test_a_null_block_in_the_window_after_a_failed_block_is_the_rewind_into_freed_blocks() -> None:
    from differential.scenario import ConnectorLoad, ConnectorStore, DriveMode, Workload

    def reader(store: ConnectorStore, groups: tuple[KVCacheGroup, ...]) -> Scenario:
        return Scenario(
            kv_cache_groups=groups,
            requests=(RequestSpec(0, 100), RequestSpec(100, 30, shares_with=0)),
            shared_prefix_tokens=0,
            prefill_chunk_tokens=64,
            kv_connector=True,
            workload=Workload(mode=DriveMode.SCHEDULER, connector=store),
        )

    swa = (KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, 32),)
    failing = ConnectorStore(ConnectorLoad.ASYNC, failed_loads=(1,), prefix_caching=False)
    null = Finding(
        FindingKind.WRONG_KV,
        "v",
        1,
        "after the step at 80 tokens group 0 block index 3 is the null block, inside "
        "the tokens 48..80 the step attends to",
    )
    name = "failed-block-recompute-reads-freed-window"
    assert label_known(reader(failing, swa), [null])[0].known_issue == name
    swmla = (KVCacheGroup(GroupKind.SLIDING_WINDOW_MLA, 16, 32),)
    assert label_known(reader(failing, swmla), [null])[0].known_issue == name
    # Near misses: no failed load; the failure on another request; two KV
    # cache groups (a whole-request failure rewinds to 0); the block-level
    # check's other wrong-kv (a lookup handing out the null block where its
    # hit's attention reads, or a block of other tokens).
    plain = ConnectorStore(ConnectorLoad.ASYNC, prefix_caching=False)
    assert label_known(reader(plain, swa), [null])[0].known_issue is None
    other = ConnectorStore(ConnectorLoad.ASYNC, failed_loads=(0,), prefix_caching=False)
    assert label_known(reader(other, swa), [null])[0].known_issue is None
    hybrid = (KVCacheGroup(GroupKind.FULL_ATTENTION, 16), *swa)
    assert label_known(reader(failing, hybrid), [null])[0].known_issue is None
    for detail in (
        "group 0 block index 3 is the null block, inside the tokens 48..80 attention reads",
        "group 0 block index 2 is block 7 of request 0, not request 1's tokens 32..48",
    ):
        lookup = Finding(FindingKind.WRONG_KV, "v", 1, detail)
        assert label_known(reader(failing, swa), [lookup])[0].known_issue is None


SEED_FIX_LIMIT = "seed-fix-limit-marked-draft-group"


def _seed_shrunk(*groups: KVCacheGroup) -> Scenario:
    # corpora/cases/seed-shrunk-draft-group-marked.json's shape: R = 4, MTP
    # under the drop, a sibling sharing 8 tokens owed 6 = 8 - A.
    return Scenario(
        kv_cache_groups=groups,
        requests=(RequestSpec(8, 4), RequestSpec(8, 0)),
        shared_prefix_tokens=8,
        retention_interval_tokens=4,
        drafter=Drafter(DrafterKind.MTP, 1),
        disable_lookahead_block_hashes=True,
        prefill_chunk_tokens=128,
    )


MARKED_FA2 = KVCacheGroup(GroupKind.FULL_ATTENTION, 2, is_eagle_group=True)
SWA1 = KVCacheGroup(GroupKind.SLIDING_WINDOW, 1, 2)
SEED_SHORTFALL = Finding(FindingKind.FALLBACK, "fixed", 1, "", expected_tokens=6, hit_tokens=4)


def test_the_seed_class_beside_a_marked_draft_group_is_the_seed_fix_limit() -> None:
    # The drafter's group marked is_eagle_group: the sliding-window group
    # takes no drop, keeps the tail ending on 8 and nothing below it, on
    # unfixed and on the seed fix alike (4 where 6 is owed).
    assert _labels(_seed_shrunk(MARKED_FA2, SWA1), [0, 4], ManagerSettings(True, 0, 1, 1, 2)) == [
        SEED_FIX_LIMIT
    ]


@pytest.mark.parametrize(
    ("groups", "finding"),
    [
        # No group marked: every group drops and the seed PR widens the
        # sliding window's tails: the seed class itself, unlabelled.
        (
            (KVCacheGroup(GroupKind.FULL_ATTENTION, 2), SWA1),
            SEED_SHORTFALL,
        ),
        # The sliding-window group is the marked one: it drops, the seed PR
        # widens it.
        (
            (
                KVCacheGroup(GroupKind.FULL_ATTENTION, 2),
                KVCacheGroup(GroupKind.SLIDING_WINDOW, 1, 2, is_eagle_group=True),
            ),
            SEED_SHORTFALL,
        ),
        # A window whose tail kept for 8 reaches token 0 keeps the whole run.
        (
            (MARKED_FA2, KVCacheGroup(GroupKind.SLIDING_WINDOW, 1, 9)),
            SEED_SHORTFALL,
        ),
        # Owed no unit below a periodic checkpoint (4 is one).
        (
            (MARKED_FA2, SWA1),
            Finding(FindingKind.FALLBACK, "fixed", 1, "", expected_tokens=4, hit_tokens=0),
        ),
    ],
    ids=["fallback-layout", "swa-group-marked", "tail-from-token-0", "owed-a-checkpoint"],
)
def test_the_seed_fix_limit_near_misses(groups: tuple[KVCacheGroup, ...], finding: Finding) -> None:
    assert label_known(_seed_shrunk(*groups), [finding])[0].known_issue != SEED_FIX_LIMIT


POOL_COST = Finding(
    FindingKind.POOL_REGRESSION,
    "candidate vs unfixed",
    None,
    "pool 36 blocks: candidate hit 80 tokens in all, unfixed 224",
    expected_tokens=224,
    hit_tokens=80,
)


def test_a_pool_regression_is_the_known_cost_of_the_candidate_fix_alone() -> None:
    import dataclasses

    from differential.oracle.known import label_fix_cost
    from differential.variant import FixScope
    from tests.factories import triton

    (cost,) = label_fix_cost(triton(), [POOL_COST], FixScope.ONE_UNIT)
    assert cost.known_issue == "candidate-pool-cost"
    assert cost.summary() == (
        "pool-regression on candidate vs unfixed, run: pool 36 blocks: candidate hit 80 "
        "tokens in all, unfixed 224 [known cost of the fix: candidate-pool-cost]"
    )
    # The seed PR's own pool cost is news about the seed PR: unlabelled.
    seed = dataclasses.replace(POOL_COST, variant="fixed vs unfixed")
    assert label_fix_cost(triton(), [seed], FixScope.SEED_PR)[0].known_issue is None
    # No known vLLM issue explains a pool regression.
    assert label_known(triton(), [POOL_COST])[0].known_issue is None


def test_a_replay_says_a_known_cost_is_the_fixs_own_price() -> None:
    import dataclasses

    from differential.compare import ScenarioResult, VariantResult
    from differential.reports.table import expected_line
    from differential.variants import parse_variants
    from tests.factories import triton

    unfixed, candidate = parse_variants("unfixed,candidate")
    labelled = dataclasses.replace(POOL_COST, known_issue="candidate-pool-cost")
    result = ScenarioResult(
        scenario=triton(),
        source=None,
        policy=Policy.VLLM,
        results=(
            VariantResult(unfixed, run([0, 0]), None, (), ()),
            VariantResult(candidate, run([0, 0]), None, (), ()),
        ),
        comparison_findings=(labelled,),
    )
    assert expected_line([(result, {"candidate": ("pool-regression@run",)})]) == (
        "1 finding(s), as expected: each is recorded in its file's expect block "
        "(candidate: 1, all known costs of the fix (candidate-pool-cost))"
    )
    one_unit = Finding(
        FindingKind.FALLBACK,
        "candidate",
        1,
        "",
        expected_tokens=88,
        hit_tokens=0,
        known_issue="unit-below-retained-boundary-falls-back",
    )
    both = dataclasses.replace(
        result,
        results=(result.results[0], dataclasses.replace(result.results[1], findings=(one_unit,))),
    )
    assert expected_line([(both, None)]) == (
        "2 finding(s) (candidate: 2, all known vLLM issues the fix does not cover "
        "(unit-below-retained-boundary-falls-back) and known costs of the fix "
        "(candidate-pool-cost)); 2 of them recorded in no expect block that held"
    )


def test_a_stall_owing_an_unreserved_mamba_partial_tail_copy() -> None:
    # known-issues/connector-async-load-reservation-misses-mamba-partial-tail-stalls.json:
    # FA 16 + Mamba 16, hash block 2, two 3-token prompts loading 2 tokens
    # each on a disaggregated decode instance, pool 5.
    from differential.scenario import ConnectorLoad, ConnectorStore, DriveMode, KVRole, Workload

    def stalling(store: ConnectorStore, groups: tuple[KVCacheGroup, ...]) -> Scenario:
        return Scenario(
            kv_cache_groups=groups,
            requests=(RequestSpec(0, 3), RequestSpec(2, 1)),
            shared_prefix_tokens=2,
            hash_block_size_tokens=2 if len(groups) > 1 else None,
            kv_connector=True,
            workload=Workload(mode=DriveMode.SCHEDULER, pool_blocks=5, connector=store),
        )

    mamba = (KVCacheGroup(GroupKind.FULL_ATTENTION, 16), KVCacheGroup(GroupKind.MAMBA, 16))
    consumer = ConnectorStore(ConnectorLoad.ASYNC, kv_role=KVRole.KV_CONSUMER)
    real = (
        "step 64: update_from_output: Scheduler.schedule: RuntimeError: scheduled nothing for "
        "64 steps with 2 request(s) waiting (pool 5 blocks), 1 of them "
        f"{UNRESERVED_PARTIAL_TAIL_COPY}"
    )
    stall = Finding(FindingKind.CRASH, "v", 0, real)
    name = "async-load-reservation-misses-mamba-partial-tail"
    assert label_known(stalling(consumer, mamba), [stall])[0].known_issue == name
    # One engine's asynchronous loads owe the same copy.
    both = ConnectorStore(ConnectorLoad.ASYNC)
    assert label_known(stalling(both, mamba), [stall])[0].known_issue == name
    # Another request's failed load changes nothing (a seed-94 campaign's
    # stall, shrunk with request 3's load failing, was this one).
    failing = ConnectorStore(ConnectorLoad.ASYNC, failed_loads=(1,), kv_role=KVRole.KV_CONSUMER)
    assert label_known(stalling(failing, mamba), [stall])[0].known_issue == name
    # Near misses: the stall without a loaded request owing the copy (the
    # driver found none in a Mamba group's _partial_hit_reqs); synchronous
    # loads; a stall that also names an in-flight prefill holding no blocks
    # (a failed load reserving itself); no Mamba group; a crash that is not
    # the stall.
    plain = Finding(FindingKind.CRASH, "v", 0, real.split(", 1 of them")[0])
    assert label_known(stalling(consumer, mamba), [plain])[0].known_issue is None
    sync = ConnectorStore(ConnectorLoad.SYNC, kv_role=KVRole.KV_CONSUMER)
    assert label_known(stalling(sync, mamba), [stall])[0].known_issue is None
    both_named = Finding(FindingKind.CRASH, "v", 0, f"{real}, 1 of them {RESERVED_WITHOUT_BLOCKS}")
    assert label_known(stalling(failing, mamba), [both_named])[0].known_issue != name
    attention = (KVCacheGroup(GroupKind.FULL_ATTENTION, 16),)
    assert label_known(stalling(consumer, attention), [stall])[0].known_issue is None
    other = Finding(FindingKind.CRASH, "v", 0, "request 0: lookup: ValueError: no")
    assert label_known(stalling(consumer, mamba), [other])[0].known_issue is None


def test_a_dropped_equal_remote_tail_on_a_diverged_hit() -> None:
    # known-issues/connector-divergent-hit-drops-equal-remote-tail.json: FA 16
    # + Mamba 16, hash block 4, a disaggregated decode instance whose
    # connector declares divergent hybrid hits.
    from differential.oracle.disagg import EQUAL_TAIL_DROPPED
    from differential.scenario import ConnectorStore, DriveMode, KVRole, Workload

    def decode(store: ConnectorStore, groups: tuple[KVCacheGroup, ...]) -> Scenario:
        return Scenario(
            kv_cache_groups=groups,
            requests=(
                RequestSpec(16, 29),
                RequestSpec(20, 0, shares_with=0),
                RequestSpec(45, 0, shares_with=0),
            ),
            shared_prefix_tokens=16,
            hash_block_size_tokens=4 if len(groups) > 1 else None,
            kv_connector=True,
            workload=Workload(mode=DriveMode.SCHEDULER, pool_blocks=13, connector=store),
        )

    mamba = (KVCacheGroup(GroupKind.FULL_ATTENTION, 16), KVCacheGroup(GroupKind.MAMBA, 16))
    divergent = ConnectorStore(divergent_hybrid_hits=True, kv_role=KVRole.KV_CONSUMER)
    base = (
        "disaggregated: starts with 16 computed tokens (16 local + 0 external), owed 44 the "
        "prefill instance computed (45 tokens) and saved; the store held 44"
    )
    dropped = Finding(
        FindingKind.FALLBACK, "v", 2, f"{base} ({EQUAL_TAIL_DROPPED}: local hit 44, 12 past 32)"
    )
    name = "divergent-hit-drops-equal-remote-tail"
    assert label_known(decode(divergent, mamba), [dropped])[0].known_issue == name
    # Near misses: a shortfall whose answer was not dropped for ending at the
    # hit; a connector without divergent hits (which a Mamba hybrid alone may
    # declare); another kind.
    short = Finding(FindingKind.FALLBACK, "v", 2, base)
    assert label_known(decode(divergent, mamba), [short])[0].known_issue is None
    plain = ConnectorStore(kv_role=KVRole.KV_CONSUMER)
    assert label_known(decode(plain, mamba), [dropped])[0].known_issue is None
    over = Finding(FindingKind.OVER_HIT, "v", 2, dropped.detail)
    assert label_known(decode(divergent, mamba), [over])[0].known_issue is None


def test_a_synchronous_load_whose_mamba_tail_is_not_keyed() -> None:
    # known-issues/connector-sync-load-mamba-tail-not-cached.json: FA 8 +
    # Mamba 8, hash block 4, a disaggregated decode instance loading
    # synchronously; the resend is owed the 12 loaded tokens and hits 0.
    from differential.scenario import ConnectorLoad, ConnectorStore, DriveMode, KVRole, Workload

    def decode(store: ConnectorStore, prompt: int) -> Scenario:
        return Scenario(
            kv_cache_groups=(
                KVCacheGroup(GroupKind.FULL_ATTENTION, 8),
                KVCacheGroup(GroupKind.MAMBA, 8),
            ),
            requests=(RequestSpec(prompt, 0), RequestSpec(prompt, 0, shares_with=0)),
            shared_prefix_tokens=prompt,
            hash_block_size_tokens=4,
            kv_connector=True,
            workload=Workload(mode=DriveMode.SCHEDULER, max_num_seqs=1, connector=store),
        )

    def local(owed: int) -> Finding:
        return Finding(
            FindingKind.FALLBACK,
            "v",
            1,
            f"disaggregated: local hit 0, owed {owed} of the {owed} tokens request 0 loaded into "
            f"the decode instance's prefix cache (then loaded {owed} from the store)",
            expected_tokens=owed,
            hit_tokens=0,
        )

    sync = ConnectorStore(load=ConnectorLoad.SYNC, kv_role=KVRole.KV_CONSUMER)
    name = "sync-load-mamba-tail-not-cached"
    assert label_known(decode(sync, 13), [local(12)])[0].known_issue == name
    # Near misses: an asynchronous load (cached at its end), a loaded end on
    # the Mamba block grid (a full block's state), the store rule's shortfall.
    loaded_async = ConnectorStore(load=ConnectorLoad.ASYNC, kv_role=KVRole.KV_CONSUMER)
    assert label_known(decode(loaded_async, 13), [local(12)])[0].known_issue is None
    assert label_known(decode(sync, 17), [local(16)])[0].known_issue is None
    store_rule = Finding(
        FindingKind.FALLBACK,
        "v",
        1,
        "disaggregated: starts with 0 computed tokens (0 local + 0 external), owed 12 the "
        "prefill instance computed (13 tokens) and saved; the store held 12",
        expected_tokens=12,
        hit_tokens=0,
    )
    assert label_known(decode(sync, 13), [store_rule])[0].known_issue is None


def test_a_checkpoint_step_that_skips_the_junction_state() -> None:
    # known-issues/mamba-checkpoint-step-skips-junction-state.json: FA 32 +
    # Mamba 32, hash block 4, EAGLE, checkpoint-exporting Mamba layers, the
    # shared-prefix checkpoint option, dense retention. Request 1 (97
    # tokens, 92 shared with the 96-token writer) pins its junction at 60 and
    # materializes the state there; request 2, sharing 92 with it, is owed 60.
    from differential.scenario import DrafterKind, MambaPrefill

    def scenario(prefill: MambaPrefill, retention: int | None, option: bool = True) -> Scenario:
        return Scenario(
            kv_cache_groups=(
                KVCacheGroup(GroupKind.FULL_ATTENTION, 32, is_eagle_group=True),
                KVCacheGroup(GroupKind.MAMBA, 32),
            ),
            requests=(
                RequestSpec(96, 0),
                RequestSpec(92, 5, shares_with=0),
                RequestSpec(92, 0, shares_with=1),
            ),
            shared_prefix_tokens=96,
            hash_block_size_tokens=4,
            retention_interval_tokens=retention,
            drafter=Drafter(DrafterKind.EAGLE, 1),
            kv_connector=True,  # lookahead block hashes off
            prefill_chunk_tokens=64,
            enable_mamba_shared_prefix_checkpoint=option,
            mamba_prefill=prefill,
        )

    def short(kind: FindingKind) -> Finding:
        return Finding(kind, "v", 2, "x", expected_tokens=60, hit_tokens=0)

    name = "checkpoint-step-skips-junction-state"
    checkpoint = scenario(MambaPrefill.CHECKPOINT, None)
    hits = (0, 0, 0)
    for kind in (FindingKind.FALLBACK, FindingKind.DENSE_MISMATCH):
        assert label_known(checkpoint, [short(kind)], hits=hits)[0].known_issue == name
    assert (
        label_known(
            scenario(MambaPrefill.CHECKPOINT, 256), [short(FindingKind.FALLBACK)], hits=hits
        )[0].known_issue
        == name
    )
    # Near misses: the scheduler's split prefill, retention 0 (only the final
    # step publishes a checkpoint), the option off, and a shortfall to below
    # some other state (owed 64, no junction there).
    for near in (
        scenario(MambaPrefill.SCHEDULER, None),
        scenario(MambaPrefill.CHECKPOINT, 0),
        scenario(MambaPrefill.CHECKPOINT, None, option=False),
    ):
        assert label_known(near, [short(FindingKind.FALLBACK)], hits=hits)[0].known_issue != name
    # Under retention 0 the dense cross-check run still has it.
    zero = scenario(MambaPrefill.CHECKPOINT, 0)
    assert label_known(zero, [short(FindingKind.DENSE_MISMATCH)], hits=hits)[0].known_issue == name
    other = Finding(FindingKind.FALLBACK, "v", 2, "x", expected_tokens=64, hit_tokens=0)
    assert label_known(checkpoint, [other], hits=hits)[0].known_issue != name


def test_a_checkpoint_at_a_replay_boundary_discarded_under_periodic_retention() -> None:
    # known-issues/mamba-checkpoint-retention-ignores-replay-boundaries.json:
    # FA 4 + Mamba 4, MTP (the drop), retention 8, 8-token chunks; the
    # 28-token writer's step 16..24 exports the state at 20, a replay
    # boundary of the writer (24 less one unit), and the sibling sharing 24
    # is owed it.
    from differential.scenario import DrafterKind, MambaPrefill

    def scenario(prefill: MambaPrefill, retention: int | None) -> Scenario:
        return Scenario(
            kv_cache_groups=(
                KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
                KVCacheGroup(GroupKind.MAMBA, 4),
            ),
            requests=(RequestSpec(24, 4), RequestSpec(24, 0)),
            shared_prefix_tokens=24,
            retention_interval_tokens=retention,
            drafter=Drafter(DrafterKind.MTP, 1),
            kv_connector=True,
            prefill_chunk_tokens=8,
            mamba_prefill=prefill,
        )

    def short(expected: int) -> Finding:
        return Finding(FindingKind.FALLBACK, "v", 1, "x", expected_tokens=expected, hit_tokens=16)

    name = "checkpoint-retention-ignores-replay-boundaries"
    hits = (0, 16)
    assert (
        label_known(scenario(MambaPrefill.CHECKPOINT, 8), [short(20)], hits=hits)[0].known_issue
        == name
    )
    # Near misses: the split prefill, dense retention, retention 0 (no
    # periodic test), a position on the retention grid, and a dense-run mismatch.
    for near, finding in (
        (scenario(MambaPrefill.SCHEDULER, 8), short(20)),
        (scenario(MambaPrefill.CHECKPOINT, None), short(20)),
        (scenario(MambaPrefill.CHECKPOINT, 0), short(20)),
        (scenario(MambaPrefill.CHECKPOINT, 8), short(24)),
    ):
        assert label_known(near, [finding], hits=hits)[0].known_issue != name
    dense = Finding(FindingKind.DENSE_MISMATCH, "v", 1, "x", expected_tokens=20, hit_tokens=16)
    assert (
        label_known(scenario(MambaPrefill.CHECKPOINT, 8), [dense], hits=hits)[0].known_issue != name
    )


def test_a_checkpoint_step_that_keys_the_block_it_started_in() -> None:
    # known-issues/mamba-checkpoint-step-keys-start-state.json: request 1
    # stops at its junction 11 (mid-block, Mamba block 4) and runs on in one
    # checkpoint step; request 2 hits 12, the boundary above the junction.
    import dataclasses
    from pathlib import Path

    from differential.corpus import load_entry
    from differential.scenario import MambaPrefill

    path = Path(__file__).parents[2] / "known-issues/mamba-checkpoint-step-keys-start-state.json"
    s = load_entry(path).scenario
    name = "checkpoint-step-keys-start-state"
    hits = (0, 0, 12)

    def over(hit: int, expected: int = 11) -> Finding:
        return Finding(FindingKind.OVER_HIT, "v", 2, "x", expected_tokens=expected, hit_tokens=hit)

    assert label_known(s, [over(12)], hits=hits)[0].known_issue == name
    # Near misses: the scheduler's split prefill, a hit off the block grid, a
    # boundary with no junction inside the block below it.
    split = dataclasses.replace(s, mamba_prefill=MambaPrefill.SCHEDULER)
    assert label_known(split, [over(12)], hits=hits)[0].known_issue != name
    assert label_known(s, [over(13)], hits=hits)[0].known_issue != name
    assert label_known(s, [over(8, 7)], hits=hits)[0].known_issue != name


def test_checkpoint_step_keys_start_state_after_a_fine_grained_hit() -> None:
    # A campaign's over-hit (manager mode, seed 7): request 3 hits 16 (hash
    # block 16, Mamba block 64) and its next stop is its junction 112 cut to
    # the block grid from its start, 80; the step 16..80 is split as one that
    # exports the prompt's checkpoint (no stop at 64), yet is no longer the
    # final step and exports nothing. Request 4 (request 3's first 128
    # tokens) hits the block of tokens 0..64, keyed as the state at 64.
    s = Scenario.from_dict(SCENARIO_FINE_HIT)
    name = "checkpoint-step-keys-start-state"
    hits = (0, 0, 0, 16, 64)

    def over(hit: int, expected: int = 16) -> Finding:
        return Finding(FindingKind.OVER_HIT, "v", 4, "x", expected_tokens=expected, hit_tokens=hit)

    assert label_known(s, [over(64)], hits=hits)[0].known_issue == name
    # Near misses: no earlier step started inside the block below 128; the
    # sibling's hit on the block grid (0) starts no step mid-block.
    assert label_known(s, [over(128, 64)], hits=hits)[0].known_issue != name
    assert label_known(s, [over(64)], hits=(0, 0, 0, 0, 64))[0].known_issue != name


SCENARIO_FINE_HIT = {
    "kv_cache_groups": [
        {"kind": "full_attention", "block_size_tokens": 64, "is_eagle_group": True},
        {"kind": "mamba", "block_size_tokens": 64},
    ],
    "hash_block_size_tokens": 16,
    "retention_interval_tokens": 64,
    "drafter": {"kind": "mtp", "num_speculative_tokens": 1},
    "kv_connector": True,
    "prefill_chunk_tokens": 2048,
    "shared_prefix_tokens": 128,
    "requests": [
        {"name": "writer", "divergence_tokens": 128, "suffix_tokens": 21},
        {"divergence_tokens": 64, "suffix_tokens": 0, "cache_salt": "tenant-a"},
        {"shares_with": 1, "divergence_tokens": 16, "suffix_tokens": 27},
        {"divergence_tokens": 128, "suffix_tokens": 17},
        {"name": "image swapped", "shares_with": 3, "divergence_tokens": 128, "suffix_tokens": 0},
    ],
    "mamba_prefill": "checkpoint",
}


def _swmla_model(head_sizes: tuple[int, int]) -> Scenario:
    """known-issues/swmla-merge-mixes-block-sizes.json's model: two full-attention
    layers and two sliding-window MLA layers of each head size."""
    layers = (
        LayerSpec(GroupKind.FULL_ATTENTION, 2),
        *(
            LayerSpec(GroupKind.SLIDING_WINDOW_MLA, 2, head_size=h, sliding_window_tokens=64)
            for h in head_sizes
        ),
    )
    model = ModelDescription("swmla-two-head-sizes", layers, block_size_tokens=16)
    return dataclasses.replace(
        hybrid(
            16,
            16,
            64,
            prefix=128,
            requests=(RequestSpec(128, 8), RequestSpec(100, 20)),
            retention=None,
        ),
        model=model,
    )


def test_a_sliding_window_mla_plan_mixing_block_sizes() -> None:
    scenario = _swmla_model((256, 128))
    plan = Finding(
        FindingKind.KV_CACHE_PLAN,
        "unfixed",
        None,
        "vLLM planned model 'swmla-two-head-sizes' for a pool of 60 blocks other than its "
        "layers' pages owe: group 1: SlidingWindowMLASpec block 16 tokens, layers "
        "[model.layers.2, model.layers.4], ...",
    )
    (labelled,) = label_known(scenario, [plan])
    assert labelled.known_issue == "swmla-merge-mixes-block-sizes"
    # One head size: the same finding is something else.
    (other,) = label_known(_swmla_model((128, 128)), [plan])
    assert other.known_issue is None
    # Nor is a plan finding about another group.
    full = dataclasses.replace(plan, detail="... group 0: FullAttentionSpec block 16 tokens, ...")
    (unlabelled,) = label_known(scenario, [full])
    assert unlabelled.known_issue is None

"""Known vLLM issues found by fuzzing: still reproduced, and labelled."""

from __future__ import annotations

import pytest

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.oracle.known import KNOWN_ISSUES
from differential.variants import parse_variants
from tests.factories import ROOT

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("issue", KNOWN_ISSUES, ids=lambda i: i.name)
def test_known_issue_example_reproduces_and_is_labelled(issue) -> None:
    entry = load_entry(ROOT / issue.example)
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed"))
    assert result.findings, (
        f"{issue.name} no longer reproduces on this vLLM: update {issue.example}"
    )
    labels = {f.known_issue for f in result.findings}
    # Every finding is explained; the example's own issue among them (a
    # sparse-retention spiral's dense-retention facet is the one-unit short run).
    assert issue.name in labels and None not in labels, labels


def test_short_run_issue_is_the_lookup_not_retention() -> None:
    # Same sibling, window 64 (a full-window run exists): 128 as the oracle says.
    entry = load_entry(ROOT / "known-issues/swa-short-run-align-before-drop.json")
    data = entry.scenario.to_dict()
    data["kv_cache_groups"][1]["sliding_window_tokens"] = 64
    from differential.scenario import Scenario

    result = compare_variants(Scenario.from_dict(data), parse_variants("unfixed"))
    assert result.results[0].run.hits == (0, 128)
    assert result.findings == ()


@pytest.mark.parametrize(
    ("example", "hits", "candidate_hits"),
    [
        ("unit-below-replay-boundary-toy", [0, 0], [0, 88]),
        ("unit-below-replay-boundary-4096", [0, 0, 4096], [0, 4064, 4096]),
        ("unit-below-replay-boundary-dspark", [0, 0], [0, 96]),
    ],
)
def test_one_unit_below_the_replay_boundary(
    example: str, hits: list[int], candidate_hits: list[int]
) -> None:
    # vLLM issue #57610: stock vLLM and the seed fix fall back to 0; the
    # candidate keeps the tail one unit lower and is clean.
    entry = load_entry(ROOT / "known-issues" / f"{example}.json")
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed,candidate"))
    got = {vr.variant.name: list(vr.run.hits) for vr in result.results}
    assert got == {"unfixed": hits, "fixed": hits, "candidate": candidate_hits}
    for name in ("unfixed", "fixed"):
        mine = [f for f in result.findings if f.owner == name]
        assert [(f.kind.value, f.request, f.known_issue) for f in mine] == [
            ("fallback", 1, "unit-below-retained-boundary-falls-back")
        ]
        assert mine[0].expected_tokens == candidate_hits[1]
    assert [f for f in result.findings if f.owner == "candidate"] == []
    cost = next(c for c in result.costs if c.variant == "candidate")
    swa = entry.scenario.sliding_window_groups[0]
    alignment = entry.scenario.effective_hit_alignment_tokens
    assert max(cost.per_boundary) <= alignment // swa.block_size_tokens


def test_one_unit_near_miss_is_clean_everywhere() -> None:
    entry = load_entry(ROOT / "corpora/cases/unit-below-replay-boundary-near-miss.json")
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed,candidate"))
    assert [list(vr.run.hits) for vr in result.results] == [[0, 96]] * 3
    assert result.findings == ()


def test_single_group_drop_after_length_cap() -> None:
    # FA 16 alone, EAGLE with the drop: a 64-token resend gets 32 (48 is
    # provable); a 65-token prompt and a hybrid FA 16 + SWA 16 model get 48.
    import dataclasses

    from differential.scenario import GroupKind, KVCacheGroup

    entry = load_entry(ROOT / "known-issues/single-group-drop-after-length-cap.json")
    variants = parse_variants("unfixed")
    assert compare_variants(entry.scenario, variants).results[0].run.hits == (0, 32)
    control = load_entry(ROOT / "corpora/seeds/single-group-fa16-eagle-65.json").scenario
    assert compare_variants(control, variants).results[0].run.hits == (0, 48)
    hybrid = dataclasses.replace(
        entry.scenario,
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 16),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, 32),
        ),
    )
    assert compare_variants(hybrid, variants).results[0].run.hits == (0, 48)


def test_lookahead_index_error_without_full_attention_two_swa_groups() -> None:
    # Two SWA groups of block 4 (windows 4 and 8), 2-token lookahead hashes,
    # one 5-token prompt: max_cache_hit_length 4 is one block, and there is
    # no block hash (hashes stop 2 tokens before the end).
    entry = load_entry(ROOT / "known-issues/lookahead-hashes-index-error-two-swa-groups.json")
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed"))
    for vr in result.results:
        assert vr.run.hits == ()
        (crash,) = vr.findings
        assert crash.kind.value == "crash" and crash.request == 0
        assert crash.detail == (
            "request 0: lookup: KVCacheManager.get_computed_blocks: IndexError: list index out "
            "of range [raised in SlidingWindowManager.find_longest_cache_hit "
            "(vllm/v1/core/single_type_kv_cache_manager.py)]"
        )
        assert crash.known_issue == "lookahead-hashes-index-error-without-full-attention"
    # Near miss: a full-attention group beside them caps the lookup.
    import dataclasses

    from differential.scenario import GroupKind, KVCacheGroup

    capped = dataclasses.replace(
        entry.scenario,
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
            *entry.scenario.kv_cache_groups,
        ),
    )
    assert compare_variants(capped, parse_variants("unfixed")).results[0].run.error is None


def test_mamba_state_cached_one_token_short() -> None:
    # FA 4 + Mamba 16, hash block 4, two MTP modules under the drop, dense
    # retention, a 61-token prompt in chunks of 16: the resend gets 48, the
    # state at 56 (the last chunk's end) is owed.
    import dataclasses

    from differential.scenario import Drafter, DrafterKind

    entry = load_entry(ROOT / "known-issues/mamba-state-cached-one-token-short.json")
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed"))
    for vr in result.results:
        assert vr.run.hits == (0, 48)
        fallback = next(f for f in vr.findings if f.kind.value == "fallback")
        assert (fallback.expected_tokens, fallback.hit_tokens) == (56, 48)
        assert fallback.known_issue == "mamba-state-cached-one-token-short"
    # Near miss: single-module MTP leaves no tail uncached and gets 56.
    single = dataclasses.replace(entry.scenario, drafter=Drafter(DrafterKind.MTP, 1))
    control = compare_variants(single, parse_variants("unfixed"))
    assert control.results[0].run.hits == (0, 56)
    assert control.findings == ()


def test_a_shared_stock_dense_run_is_judged_once_with_the_same_findings() -> None:
    # fixed's dense cross-check run is stock vLLM's (runs_as_stock): one run,
    # judged once, its findings relabelled; each variant judged on its own
    # (no sharing) finds exactly the same, under its own name.
    from differential.compare import judge_variant
    from differential.findings import FindingKind

    scenario = load_entry(ROOT / "known-issues/seed-within-one-window-of-token-0.json").scenario
    variants = parse_variants("unfixed,fixed")
    shared = compare_variants(scenario, variants).results
    assert shared[1].dense_run is not None and shared[0].dense_run is not None
    assert shared[1].dense_run.requests is shared[0].dense_run.requests  # one run
    for variant, result in zip(variants, shared, strict=True):
        alone, _ = judge_variant(scenario, variant)
        assert result.findings == alone.findings
        dense = [f for f in result.findings if f.kind is FindingKind.DENSE_MISMATCH]
        assert [(f.variant, f.request, f.hit_tokens, f.expected_tokens) for f in dense] == [
            (variant.name, 1, 32, 48)
        ]


def test_mamba_chunk_split_on_the_engines_block_grid() -> None:
    # vLLM PR #54076: the Scheduler aligns prefill chunks to CacheConfig.block_size,
    # which the engine sets to the smallest group block (16), not the Mamba
    # block (64): the state at 64 is never made. Manager mode chunks on the
    # Mamba grid and hits 64.
    import dataclasses

    from differential.scenario import DriveMode

    entry = load_entry(ROOT / "known-issues/mamba-chunk-split-on-attention-block-grid.json")
    scheduler = compare_variants(entry.scenario, parse_variants("unfixed"))
    assert list(scheduler.results[0].run.hits) == [0, 0, 128]
    assert {f.known_issue for f in scheduler.findings} == {
        "mamba-chunk-split-on-attention-block-grid"
    }
    # Request 2's hit is the owed length, 128, but the state block hashed for
    # 128 holds the state after the step that ended at 80.
    wrong = [f for f in scheduler.findings if f.kind.value == "wrong-kv"]
    assert [(f.request, f.detail) for f in wrong] == [
        (
            2,
            "group 1 block index 1 is block 6: request 0's group-1 state after 80 tokens, "
            "not the state after request 2's tokens 0..128",
        )
    ]
    manager_workload = dataclasses.replace(entry.scenario.workload, mode=DriveMode.MANAGER)
    manager = compare_variants(
        dataclasses.replace(entry.scenario, workload=manager_workload), parse_variants("unfixed")
    )
    assert list(manager.results[0].run.hits) == [0, 64, 128]
    assert manager.findings == ()

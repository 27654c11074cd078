"""Known vLLM issues found by fuzzing: still reproduced, and labelled."""

from __future__ import annotations

import pytest

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.triage.known import KNOWN_ISSUES
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

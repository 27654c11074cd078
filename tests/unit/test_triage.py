"""Root-cause triage on hand-worked observations (no vLLM).

The observations below are written out by hand in the shape the driver
records them (``RequestObservation.lookup``); the integration tests check the
same identities on real runs.
"""

from __future__ import annotations

import dataclasses

from differential.compare import ScenarioResult, VariantResult
from differential.findings import Finding, FindingKind, Policy
from differential.observation import (
    GroupLookup,
    ManagerSettings,
    RequestObservation,
    RunObservation,
)
from differential.oracle import drafter_model
from differential.scenario import DrafterKind, RequestSpec
from differential.triage.identity import (
    Boundary,
    Role,
    RootCause,
    binding_lookup,
    missing_checkpoint,
    triage,
)
from differential.variants import parse_variants
from tests.factories import hybrid, triton

SEED_BUG = RootCause("shortfall", group_kind="sliding_window", boundary="periodic", units_below=1)
_SETTINGS = ManagerSettings(True, 0, 3, 3, 32)


def _request(
    index: int, hit: int, junction: int = 0, lookup: tuple[GroupLookup, ...] = ()
) -> RequestObservation:
    return RequestObservation(index, 16448, hit, junction, (hit, hit), (0, 0), (), lookup)


def _run(name: str, *requests: RequestObservation) -> RunObservation:
    return RunObservation(name, "0.33.0", _SETTINGS, requests, retention_interval_tokens=8192)


# The Triton seed's sibling on stock 0.33.0: full attention matches 16352
# (16384 + the 32-token EAGLE margin, minus the dropped block), the SWA
# group's run search lands on the tail kept for 8192 (block 448 onwards).
_UNFIXED_LOOKUP = (
    GroupLookup(0, 16448, True, 16352, 0),
    GroupLookup(1, 16368, True, 8192, 448),
)


def test_binding_lookup_is_the_first_call_returning_the_hit() -> None:
    call, passes = binding_lookup(_request(1, 8192, 16352, _UNFIXED_LOOKUP))
    assert call == _UNFIXED_LOOKUP[1]
    assert passes == 1
    assert binding_lookup(_request(1, 8192)) == (None, 0)


def test_missing_checkpoint_names_the_boundary_and_units_below() -> None:
    scenario = triton()
    model = drafter_model(scenario)
    run = _run("unfixed", _request(0, 0), _request(1, 8192, 16352), _request(2, 16352))
    # c - A below the periodic checkpoint 16384 = 2 R.
    assert missing_checkpoint(scenario, model, run, 1, 16352) == (Boundary.PERIODIC, 1)
    assert missing_checkpoint(scenario, model, run, 1, 8192) == (Boundary.PERIODIC, 0)
    # 16000 is no periodic point, no junction (request 1 pinned 16352) and
    # no replay boundary (L = 16448 under the drop: 16384 and 16416).
    assert missing_checkpoint(scenario, model, run, 2, 16000) == (Boundary.OTHER, 0)
    assert missing_checkpoint(scenario, model, run, 1, 0) == (Boundary.START, 0)
    assert missing_checkpoint(scenario, model, run, 1, 16352, dense=True) == (Boundary.DENSE, 0)


def test_junction_and_replay_boundaries() -> None:
    # R = 0: only replay boundaries and junctions. A = 32, prompts 1000 + 10.
    scenario = hybrid(
        32,
        16,
        256,
        prefix=1000,
        requests=(RequestSpec(1000, 10), RequestSpec(1000, 10), RequestSpec(900, 10)),
        retention=0,
    )
    model = drafter_model(scenario)
    run = _run("unfixed", _request(0, 0), _request(1, 640, 960), _request(2, 0))
    # The writer (1010 tokens) under the drop: resend 992 - 32 = 960 and
    # extension 992 - 32 = 960; request 1 pinned the junction 960 too.
    assert missing_checkpoint(scenario, model, run, 1, 960) == (Boundary.REPLAY, 0)
    assert missing_checkpoint(scenario, model, run, 2, 960) == (Boundary.JUNCTION, 0)
    assert missing_checkpoint(scenario, model, run, 2, 928) == (Boundary.JUNCTION, 1)


def _result(unfixed: RunObservation, fixed: RunObservation, *findings: Finding) -> ScenarioResult:
    variants = {v.name: v for v in parse_variants("unfixed,fixed")}
    per = {name: tuple(f for f in findings if f.variant == name) for name in ("unfixed", "fixed")}
    return ScenarioResult(
        scenario=triton(),
        source=None,
        policy=Policy.VLLM,
        results=(
            VariantResult(variants["unfixed"], unfixed, unfixed, (), per["unfixed"]),
            VariantResult(variants["fixed"], fixed, fixed, (), per["fixed"]),
        ),
        comparison_findings=tuple(f for f in findings if " vs " in f.variant),
    )


def _fallback(request: int, expected: int, hit: int) -> Finding:
    return Finding(
        FindingKind.FALLBACK,
        "unfixed",
        request,
        f"expected checkpoint {expected}, hit {hit}",
        divergence_tokens=16384,
        expected_tokens=expected,
        hit_tokens=hit,
        fallback_checkpoint_tokens=hit,
    )


def test_fallback_and_dense_mismatch_on_one_sibling_are_facets_of_one_cause() -> None:
    unfixed = _run("unfixed", _request(0, 0), _request(1, 8192, 16352, _UNFIXED_LOOKUP))
    fixed = _run("fixed", _request(0, 0), _request(1, 16352))
    dense = Finding(
        FindingKind.DENSE_MISMATCH,
        "unfixed",
        1,
        "dense run hit 8192, reference 16352",
        divergence_tokens=16384,
        expected_tokens=16352,
        hit_tokens=8192,
    )
    triaged = triage(_result(unfixed, fixed, dense, _fallback(1, 16352, 8192)))
    assert [(t.finding.kind, t.role, t.root_cause) for t in triaged] == [
        (FindingKind.FALLBACK, Role.PRIMARY, SEED_BUG),
        (FindingKind.DENSE_MISMATCH, Role.FACET, SEED_BUG),
    ]
    assert triaged[0].divergence_units == 1


def test_a_regression_after_different_histories_is_a_consequence() -> None:
    # Request 1 falls back on unfixed and pins the junction 16352; request 2
    # then finds it on unfixed. Fixed hit request 1 and pinned nothing.
    lookup = (GroupLookup(0, 16448, True, 16352, 0), GroupLookup(1, 16368, True, 16320, 900))
    unfixed = _run(
        "unfixed",
        _request(0, 0),
        _request(1, 8192, 16352, _UNFIXED_LOOKUP),
        _request(2, 16352),
    )
    fixed = _run("fixed", _request(0, 0), _request(1, 16352), _request(2, 16320, 16352, lookup))
    regression = Finding(
        FindingKind.VARIANT_REGRESSION,
        "fixed vs unfixed",
        2,
        "fixed hit 16320 < unfixed hit 16352",
        divergence_tokens=16384,
        expected_tokens=16352,
        hit_tokens=16320,
    )
    triaged = triage(_result(unfixed, fixed, _fallback(1, 16352, 8192), regression))
    assert triaged[1].role is Role.CONSEQUENCE
    assert triaged[1].root_cause == SEED_BUG
    assert triaged[1].cause_request == 1
    assert triaged[1].owner == "fixed"


def test_a_regression_on_the_same_history_is_its_own_cause() -> None:
    lookup = (GroupLookup(0, 16448, True, 16352, 0), GroupLookup(1, 16368, True, 8192, 448))
    unfixed = _run("unfixed", _request(0, 0), _request(1, 16352))
    fixed = _run("fixed", _request(0, 0), _request(1, 8192, 16352, lookup))
    regression = Finding(
        FindingKind.VARIANT_REGRESSION,
        "fixed vs unfixed",
        1,
        "fixed hit 8192 < unfixed hit 16352",
        divergence_tokens=16384,
        expected_tokens=16352,
        hit_tokens=8192,
    )
    (t,) = triage(_result(unfixed, fixed, regression))
    assert t.role is Role.PRIMARY
    assert t.root_cause == RootCause(
        "variant-regression", group_kind="sliding_window", boundary="periodic", units_below=1
    )


def _needless_result(hit: int, lookup: tuple[GroupLookup, ...] = ()) -> ScenarioResult:
    scenario = triton(DrafterKind.GEMMA4_MTP)
    assert scenario.drafter.kind is DrafterKind.GEMMA4_MTP
    unfixed = _run("unfixed", _request(0, 0), _request(1, hit, 16352, lookup))
    fixed = _run("fixed", _request(0, 0), _request(1, 16384))
    fixed = RunObservation(
        "fixed", "0.33.0", ManagerSettings(False, 0, 3, 3, 32), fixed.requests, 0, None, 8192
    )
    needless = Finding(FindingKind.NEEDLESS_DROP, "unfixed", None, "drops for gemma4_mtp")
    result = _result(unfixed, fixed, needless, _fallback(1, 16384, hit))
    return ScenarioResult(scenario, None, Policy.VLLM, result.results, result.comparison_findings)


def test_needless_protection_owns_the_shortfall_it_brings() -> None:
    # 16352: what the needless drop costs (16384 is owed without it), and
    # all a drop allows: the fix's Gemma-4 half removes it.
    causes = {(t.finding.kind, t.role, t.root_cause.text) for t in triage(_needless_result(16352))}
    assert causes == {
        (FindingKind.NEEDLESS_DROP, Role.PRIMARY, "needless-protection | drafter gemma4_mtp"),
        (FindingKind.FALLBACK, Role.FACET, "needless-protection | drafter gemma4_mtp"),
    }


def test_needless_protection_does_not_absorb_another_cause() -> None:
    # 8192 is short even of the 16352 the drop allows (c - A under the
    # periodic checkpoint 16384): the seed PR's tail, on a needless-drop run.
    triaged = triage(_needless_result(8192, _UNFIXED_LOOKUP))
    causes = {(t.finding.kind, t.role, t.root_cause) for t in triaged}
    needless = RootCause("needless-protection", detail="drafter gemma4_mtp")
    assert causes == {
        (FindingKind.NEEDLESS_DROP, Role.PRIMARY, needless),
        (FindingKind.FALLBACK, Role.PRIMARY, SEED_BUG),
    }


def test_root_cause_round_trips_and_names_itself() -> None:
    assert RootCause.from_dict(SEED_BUG.to_dict()) == SEED_BUG
    assert SEED_BUG.text == (
        "shortfall | SlidingWindowManager.find_longest_cache_hit | missing periodic - 1A"
    )
    capped = RootCause("shortfall", group_kind="full_attention", branch="prefix capped")
    assert capped.text == "shortfall | FullAttentionManager.find_longest_cache_hit: prefix capped"
    known = RootCause("shortfall", known_issue="swa-short-run-align-before-drop")
    assert known.text == "shortfall | known:swa-short-run-align-before-drop"
    assert SEED_BUG.slug.startswith("shortfall-") and SEED_BUG.slug != known.slug


def test_parallel_jobs_merge_root_causes_by_identity() -> None:
    from pathlib import Path

    from fuzz.campaign import CampaignConfig
    from fuzz.parallel import merge_summaries

    def job(count: int, first_s: float, variants: list[str], shrunk: str | None) -> dict:
        cause = {
            "root_cause": SEED_BUG.text,
            "identity": SEED_BUG.to_dict(),
            "status": "new",
            "known_as": "",
            "count": count,
            "facets": {"fallback": count},
            "consequences": 0,
            "variants": variants,
            "count_by_variant": {v: count for v in variants},
            "file": f"out/root-causes/{SEED_BUG.slug}.json",
            "shrunk": shrunk,
            "reproducer": shrunk or f"out/root-causes/{SEED_BUG.slug}.json",
            "first_example": 3,
            "first_seen_s": first_s,
            "signatures": [f"sig-{count}"],
        }
        return {
            "seed": 1,
            "variants": ["unfixed", "fixed"],
            "vllm_version": "0.33.0",
            "examples": 10,
            "elapsed_s": 2.0,
            "first_finding_s": first_s,
            "interrupted": False,
            "findings_by_kind": {"fallback": count},
            "coverage": {},
            "distinct": [],
            "root_causes": [cause],
        }

    config = CampaignConfig(out=Path("out"), variants=(), seed=1)
    merged = merge_summaries(
        [job(3, 0.5, ["unfixed"], None), job(2, 0.2, ["fixed"], "out/shrunk/a.json")], config
    )
    (cause,) = merged["root_causes"]
    assert (cause["count"], cause["facets"], cause["variants"]) == (
        5,
        {"fallback": 5},
        ["fixed", "unfixed"],
    )
    assert (cause["shrunk"], cause["reproducer"], cause["first_seen_s"]) == (
        "out/shrunk/a.json",
        "out/shrunk/a.json",
        0.2,
    )
    assert cause["signatures"] == ["sig-2", "sig-3"]
    assert cause["count_by_variant"] == {"fixed": 2, "unfixed": 3}
    # report.md counts each variant's own findings, not the cluster's.
    from fuzz.report import campaign_markdown

    report = campaign_markdown(merged, {}, Path("out"))
    assert f"| fixed | {SEED_BUG.text.replace('|', chr(92) + '|')} | new | 2 |" in report
    assert f"| unfixed | {SEED_BUG.text.replace('|', chr(92) + '|')} | new | 3 |" in report


def test_expectations_judge_comparisons_only_when_both_variants_ran() -> None:
    from pathlib import Path

    from differential.corpus import CorpusEntry, Expectation, expectation_problems

    unfixed = _run("unfixed", _request(0, 0), _request(1, 16352))
    fixed = _run("fixed", _request(0, 0), _request(1, 8192))
    regression = Finding(FindingKind.VARIANT_REGRESSION, "fixed vs unfixed", 1, "")
    both = _result(unfixed, fixed, regression)
    entry = CorpusEntry(
        Path("case.json"),
        triton(),
        Expectation(
            hits={"unfixed": (0, 16352), "fixed": (0, 8192)},
            findings={"unfixed": (), "fixed": ("variant-regression@1",)},
        ),
    )
    assert expectation_problems(entry, both) == []
    # Replayed on `fixed` alone there is nothing to compare with: not a
    # contradiction; a hit that changed still is.
    alone = ScenarioResult(both.scenario, None, Policy.VLLM, both.results[1:])
    assert expectation_problems(entry, alone) == []
    moved = _run("fixed", _request(0, 0), _request(1, 0))
    alone = ScenarioResult(
        both.scenario, None, Policy.VLLM, (dataclasses.replace(both.results[1], run=moved),)
    )
    assert expectation_problems(entry, alone) == ["fixed: hits [0, 0], expected [0, 8192]"]


def _crash_cause(detail: str) -> RootCause:
    unfixed = RunObservation("unfixed", "0.33.0", _SETTINGS, (), error=detail)
    fixed = _run("fixed")
    crash = Finding(FindingKind.CRASH, "unfixed", int(detail.split()[1].rstrip(":")), detail)
    (t,) = triage(_result(unfixed, fixed, crash))
    return t.root_cause


def test_a_crash_is_named_by_the_vllm_function_that_raised_and_the_exception() -> None:
    def detail(request: int, where: str, exc: str = "IndexError") -> str:
        return (
            f"request {request}: lookup: KVCacheManager.get_computed_blocks: {exc}: list index "
            f"out of range [raised in {where} (vllm/v1/core/single_type_kv_cache_manager.py)]"
        )

    swa = "SlidingWindowManager.find_longest_cache_hit"
    assert _crash_cause(detail(0, swa)) == RootCause("crash", detail=f"lookup | {swa}: IndexError")
    # The request number does not split it; the function and the exception do.
    assert _crash_cause(detail(3, swa)) == _crash_cause(detail(0, swa))
    mamba = "MambaManager.find_longest_cache_hit"
    assert _crash_cause(detail(0, mamba)) != _crash_cause(detail(0, swa))
    assert _crash_cause(detail(0, swa, "AssertionError")) != _crash_cause(detail(0, swa))
    # Without the innermost frame the called vLLM function stands in.
    plain = "request 1: allocate: KVCacheManager.allocate_slots: ValueError: no blocks"
    assert _crash_cause(plain).detail == "allocate | KVCacheManager.allocate_slots: ValueError"


def test_an_over_hit_is_named_after_the_group_that_over_reached() -> None:
    from differential.scenario import GroupKind, KVCacheGroup, Scenario
    from differential.triage.identity import over_reaching_lookup

    scenario = Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
            KVCacheGroup(GroupKind.MAMBA, 4),
        ),
        requests=(RequestSpec(32, 0), RequestSpec(28, 1)),
        shared_prefix_tokens=32,
        retention_interval_tokens=0,
    )
    # Both groups returned 28; full attention only matched hashes, the Mamba
    # group accepted a state it should not have: it over-reached.
    both = (GroupLookup(0, 29, True, 28, 0), GroupLookup(1, 28, True, 28, 0))
    assert over_reaching_lookup(scenario, _request(1, 28, 0, both)) == both[1]
    # Full attention alone returned the hit: it is the one.
    alone = (GroupLookup(0, 29, True, 28, 0), GroupLookup(1, 32, True, 32, 0))
    assert over_reaching_lookup(scenario, _request(1, 28, 0, alone)) == alone[0]


def test_report_lists_the_pool_each_variant_needs_for_a_pool_regression() -> None:
    from fuzz.report import pool_needs_section

    needs = [
        {
            "variant": name,
            "owed_hit_tokens": [0, 0, 64, 48],
            "roomy_pool_blocks": 157,
            "smallest_pool_blocks": pool,
            "runs": 9,
        }
        for name, pool in (("unfixed", 48), ("candidate", 52), ("tree:x", None))
    ]
    summary = {
        "root_causes": [
            {"root_cause": "pool-regression", "pool_needs": needs},
            {"root_cause": "fallback | missing periodic - 1A"},
        ]
    }
    assert pool_needs_section(summary)[-3:] == [
        "| root cause | roomy pool | smallest pool per variant |",
        "| --- | --- | --- |",
        "| pool-regression | 157 blocks | unfixed: 48 blocks, candidate: 52 blocks, "
        "tree:x: did not run |",
    ]
    assert pool_needs_section({"root_causes": summary["root_causes"][1:]}) == []


def test_report_md_summarises_long_coverage_tables() -> None:
    from fuzz.report import coverage_table

    short = [("b", 1), ("a", 5)]
    assert coverage_table("drafter", short) == [
        "| drafter | scenarios |",
        "| --- | --- |",
        "| a | 5 |",
        "| b | 1 |",
    ]
    # 431 group mixes made report.md mostly one table: the 10 most frequent
    # rows, then one row counting the other 421 and their scenarios.
    mixes = [(f"mix-{i:03}", 1 + i % 7) for i in range(431)]
    table = coverage_table("group-mix", mixes)
    assert len(table) == 2 + 10 + 1
    assert table[2:4] == ["| mix-006 | 7 |", "| mix-013 | 7 |"]
    rest = sum(n for _, n in mixes) - 10 * 7
    assert table[-1] == (f"| ... 421 more (the full counts: `coverage` in summary.json) | {rest} |")


def test_a_per_group_hit_is_named_after_the_group_that_came_up_short() -> None:
    from differential.oracle import judge_run

    variants = {v.name: v for v in parse_variants("unfixed")}
    scenario = triton()
    short = dataclasses.replace(_request(1, 16352), per_group_hit_tokens=(16352, 16320))
    run = _run("unfixed", _request(0, 0), short, _request(2, 16352), _request(3, 16352))
    _, findings = judge_run(scenario, run)
    assert [(f.kind, f.request) for f in findings] == [(FindingKind.PER_GROUP_HIT, 1)]
    result = ScenarioResult(
        scenario,
        None,
        Policy.VLLM,
        (VariantResult(variants["unfixed"], run, None, (), findings),),
    )
    (triaged,) = triage(result)
    # Group 1 is the sliding window: its manager's lookup is the one named.
    assert triaged.root_cause == RootCause("per-group-hit", group_kind="sliding_window")
    assert triaged.root_cause.text == "per-group-hit | SlidingWindowManager.find_longest_cache_hit"


def test_a_campaign_names_its_paths_from_out_or_from_the_kvfuzz_root(tmp_path) -> None:
    # summary.json and report.md hold no absolute path: the campaign's own
    # files from OUT, the project's corpus from the kvfuzz root (as a known
    # issue's example is named), any other file from OUT.
    from differential.files import project_root
    from fuzz.campaign import shown_path

    out = tmp_path / "out"
    root = project_root()
    assert shown_path(out / "shrunk" / "a.json", out) == "shrunk/a.json"
    assert shown_path(root / "corpora" / "cases" / "x.json", out) == "corpora/cases/x.json"
    assert shown_path(tmp_path / "mine" / "y.json", out) == "../mine/y.json"

"""Root-cause triage on real runs: one identity per cause, across scales."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.findings import FindingKind
from differential.observation import GroupLookup
from differential.oracle.engine import judge_observed_run
from differential.scenario import DrafterKind, Scenario
from differential.triage.identity import Role, RootCause, protected_as_run, triage
from differential.variants import parse_variants
from tests.factories import CORPORA, ROOT, kvfuzz_cli

pytestmark = pytest.mark.vllm

SEED_BUG = RootCause("shortfall", group_kind="sliding_window", boundary="periodic", units_below=1)


def _triage(path: Path) -> list[tuple[str, FindingKind, int | None, Role, RootCause]]:
    result = compare_variants(load_entry(path).scenario, parse_variants("unfixed,fixed"))
    return [
        (t.owner, t.finding.kind, t.finding.request, t.role, t.root_cause) for t in triage(result)
    ]


@pytest.mark.parametrize(
    "name",
    [
        "seeds/triton-mtp3-swa16-fa32-r8192.json",
        "regressions/fallback-unfixed-517c289c14.json",
        "seeds/flashinfer-mtp3-swa64-fa128-r8192.json",
    ],
)
def test_the_seed_its_shrunk_form_and_flashinfer_share_one_identity(name: str) -> None:
    assert _triage(CORPORA / name) == [("unfixed", FindingKind.FALLBACK, 1, Role.PRIMARY, SEED_BUG)]


@pytest.mark.parametrize(
    "name",
    [
        "seeds/triton-mtp3-swa16-fa32-r8192.json",
        # The owed checkpoint within one window of token 0: the SWA lookup's
        # not-match_found path, once a root cause of its own.
        "../known-issues/seed-within-one-window-of-token-0.json",
        "regressions/fallback-unfixed-517c289c14.json",
    ],
)
def test_the_seed_bugs_forms_merge_into_one_root_cause(name: str) -> None:
    unfixed = {cause for owner, _, _, role, cause in _triage(CORPORA / name) if owner == "unfixed"}
    assert unfixed == {SEED_BUG}
    assert SEED_BUG.text == (
        "shortfall | SlidingWindowManager.find_longest_cache_hit | missing periodic - 1A"
    )


@pytest.mark.parametrize(
    ("name", "request_index", "expected", "hit"),
    [
        ("cases/seed-shrunk-draft-group-marked.json", 1, 6, 4),
        ("cases/gemma4-eagle3-draft-group.json", 2, 120, 64),
    ],
)
def test_the_seed_class_beside_a_marked_draft_group_is_named_the_seed_fix_limit(
    name: str, request_index: int, expected: int, hit: int
) -> None:
    # The drafter's group marked is_eagle_group (vLLM's planner's layout for
    # EAGLE-3 and MTP draft groups): the sliding-window group takes no drop,
    # so the seed fix does not widen it and fixed keeps the fallback the
    # candidate closes. Both variants name it; a campaign points at the
    # marked shrunk reproducer.
    from fuzz.campaign import _known_issue_example

    result = compare_variants(
        load_entry(CORPORA / name).scenario, parse_variants("unfixed,fixed,candidate")
    )
    limit = RootCause("shortfall", known_issue="seed-fix-limit-marked-draft-group")
    assert [
        (
            t.owner,
            t.finding.kind,
            t.finding.request,
            t.finding.expected_tokens,
            t.finding.hit_tokens,
            t.root_cause,
        )
        for t in triage(result)
    ] == [
        (owner, FindingKind.FALLBACK, request_index, expected, hit, limit)
        for owner in ("unfixed", "fixed")
    ]
    assert all(f.known_issue == limit.known_issue for f in result.findings)
    assert _known_issue_example(limit.known_issue) == (
        "corpora/cases/seed-shrunk-draft-group-marked.json"
    )


def test_the_false_over_hit_of_needless_lookahead_hashes_is_clean() -> None:
    # FA 4 + Mamba 4, Gemma-4 MTP under stock vLLM's 1-token lookahead
    # hashes: request 2 hits the state request 1's junction kept at 12.
    result = compare_variants(
        load_entry(ROOT / "known-issues/gemma4-mamba-needless-lookahead-hashes.json").scenario,
        parse_variants("unfixed,fixed"),
    )
    unfixed = result.results[0]
    assert list(unfixed.run.hits) == [0, 0, 12]
    assert [r.shared_prefix_boundary_tokens for r in unfixed.run.requests] == [0, 12, 0]
    assert [(f.kind, f.request) for f in unfixed.findings] == [(FindingKind.FALLBACK, 1)]
    # Request 1's 0 is short even of the writer's state at 8 that the
    # lookahead hashes allow: the state-group #57610 mechanism, not the
    # needless protection (which costs 16 -> 8 only).
    causes = {t.root_cause.text for t in triage(result) if t.owner == "unfixed"}
    assert causes == {"shortfall | known:unit-below-retained-state-discarded"}


# A scheduler-mode chat from a seed-12 campaign: Gemma-4 MTP (which needs no
# EAGLE drop), FA 8 + SWA 4 (window 4) + a circular buffer, three sessions of
# turns arriving over three steps while earlier turns still decode.
_GEMMA4_CHAT = {
    "format": "kvfuzz.scenario",
    "version": 1,
    "name": "gemma4-mtp-chat-needless-drop--scheduler",
    "kv_cache_groups": [
        {"kind": "full_attention", "block_size_tokens": 8, "sliding_window_tokens": None},
        {"kind": "sliding_window", "block_size_tokens": 4, "sliding_window_tokens": 4},
        {"kind": "circular_buffer", "block_size_tokens": 4, "sliding_window_tokens": None},
    ],
    "hash_block_size_tokens": None,
    "hit_alignment_tokens": None,
    "retention_interval_tokens": None,
    "drafter": {"kind": "gemma4_mtp", "num_speculative_tokens": 3},
    "kv_connector": False,
    "disable_lookahead_block_hashes": True,
    "disable_eagle_block_drop": False,
    "prefill_chunk_tokens": 16,
    "decode_steps": 6,
    "shared_prefix_tokens": 0,
    "requests": [
        {"name": "s0t1", "shares_with": None, "divergence_tokens": 0, "suffix_tokens": 52},
        {"name": "s1t1", "shares_with": None, "divergence_tokens": 0, "suffix_tokens": 1},
        {"name": "s2t1", "shares_with": None, "divergence_tokens": 0, "suffix_tokens": 21},
        {"name": "s0t2", "shares_with": 0, "divergence_tokens": 59, "suffix_tokens": 9},
        {"name": "s1t2", "shares_with": 1, "divergence_tokens": 8, "suffix_tokens": 0},
        {"name": "s2t2", "shares_with": 2, "divergence_tokens": 28, "suffix_tokens": 0},
        {"name": "s0t3", "shares_with": 3, "divergence_tokens": 72, "suffix_tokens": 9},
        {"name": "s2t3", "shares_with": 5, "divergence_tokens": 32, "suffix_tokens": 0},
    ],
    "workload": {
        "mode": "scheduler",
        "pool_blocks": 162,
        "arrival_steps": [0, 0, 0, 1, 1, 1, 2, 2],
        "max_num_seqs": 8,
        "max_num_batched_tokens": 32,
        "shares_output": True,
        "accepted_drafts": [0, 1],
    },
}


def test_a_needless_drop_on_a_scheduler_timeline_is_triaged_on_that_timeline() -> None:
    # vLLM drops the last matched block for Gemma-4 MTP, which needs no drop:
    # turn s2t3 hits 16 where 24 is owed. Judged with the drop the run used,
    # on the run's own timeline (as every verdict of a scheduler-mode run is
    # given), 16 is owed: the needless protection is the whole cause. Judged
    # as a sequential manager-mode run, turns that arrived while their
    # source still decoded looked short, and a campaign reported the fallback
    # as a new full-attention shortfall.
    result = compare_variants(Scenario.from_dict(_GEMMA4_CHAT), parse_variants("unfixed,fixed"))
    unfixed, fixed = result.results
    assert list(unfixed.run.hits) == [0, 0, 0, 40, 0, 8, 56, 16]
    assert sorted((f.kind.value, f.request) for f in unfixed.findings) == [
        ("fallback", 7),
        ("needless-drop", None),
    ]
    assert fixed.findings == ()
    assert {
        (t.finding.kind, t.finding.request, t.role, t.root_cause.text) for t in triage(result)
    } == {
        (FindingKind.NEEDLESS_DROP, None, Role.PRIMARY, "needless-protection | drafter gemma4_mtp"),
        (FindingKind.FALLBACK, 7, Role.FACET, "needless-protection | drafter gemma4_mtp"),
    }
    as_run = protected_as_run(result.scenario, unfixed.run)
    assert as_run is not None and as_run.drafter.kind is DrafterKind.MTP
    assert judge_observed_run(as_run, unfixed.run)[1] == ()


_GEMMA4_MAMBA = {
    "format": "kvfuzz.scenario",
    "version": 1,
    "name": "gemma4-mamba-dense-mismatch",
    "description": "",
    "kv_cache_groups": [
        {"kind": "full_attention", "block_size_tokens": 8, "sliding_window_tokens": None},
        {"kind": "mamba", "block_size_tokens": 8, "sliding_window_tokens": None},
    ],
    "hash_block_size_tokens": 2,
    "hit_alignment_tokens": None,
    "retention_interval_tokens": 0,
    "drafter": {"kind": "gemma4_mtp", "num_speculative_tokens": 1},
    "kv_connector": False,
    "disable_lookahead_block_hashes": True,
    "disable_eagle_block_drop": False,
    "prefill_chunk_tokens": 64,
    "decode_steps": 0,
    "shared_prefix_tokens": 32,
    "requests": [
        {"name": "writer", "shares_with": None, "divergence_tokens": 32, "suffix_tokens": 0},
        {"name": None, "shares_with": None, "divergence_tokens": 16, "suffix_tokens": 0},
        {"name": None, "shares_with": None, "divergence_tokens": 16, "suffix_tokens": 0},
    ],
    "enable_mamba_shared_prefix_checkpoint": True,
    "mamba_prefill": "checkpoint",
    "workload": {
        "mode": "manager",
        "pool_blocks": None,
        "arrival_steps": None,
        "max_num_seqs": 1,
        "max_num_batched_tokens": None,
        "shares_output": False,
        "accepted_drafts": [],
    },
}


def test_a_dense_mismatch_is_triaged_with_the_protection_the_run_used() -> None:
    # FA 8 + Mamba 8 (hash block 2, checkpoint-exporting layers, a junction
    # at 32), Gemma-4 MTP under the needless EAGLE drop, retention 0: the
    # dense cross-check run hits 0 where the dense reference is 14. Judged
    # with the drop the run used it is still short, and it is the known
    # issue of the junction state a checkpoint step skips, not a new
    # Mamba shortfall (a seed-24 campaign once reported it as new).
    result = compare_variants(Scenario.from_dict(_GEMMA4_MAMBA), parse_variants("unfixed,fixed"))
    unfixed, fixed = result.results
    assert list(unfixed.run.hits) == [0, 0, 14]
    assert sorted((f.kind.value, f.request) for f in unfixed.findings) == [
        ("dense-mismatch", 2),
        ("needless-drop", None),
    ]
    assert fixed.findings == ()
    causes = {(t.finding.kind, t.root_cause.text) for t in triage(result)}
    assert causes == {
        (FindingKind.NEEDLESS_DROP, "needless-protection | drafter gemma4_mtp"),
        (FindingKind.DENSE_MISMATCH, "shortfall | known:checkpoint-step-skips-junction-state"),
    }


def test_the_driver_traces_each_groups_lookup() -> None:
    result = compare_variants(
        load_entry(CORPORA / "seeds/triton-mtp3-swa16-fa32-r8192.json").scenario,
        parse_variants("unfixed,fixed"),
    )
    unfixed, fixed = (vr.run.requests[1].lookup for vr in result.results)
    # Full attention matches 16384 + the 32-token margin and drops a block;
    # the SWA run search of stock vLLM lands on the tail kept for 8192.
    assert unfixed == (
        GroupLookup(0, 16448, True, 16352, 0),
        GroupLookup(1, 16368, True, 8192, 448),
    )
    assert fixed[1] == GroupLookup(1, 16368, True, 16352, 958)


def test_a_known_issue_is_one_cause_with_dense_mismatch_as_facet() -> None:
    cause = RootCause("shortfall", known_issue="swa-short-run-align-before-drop")
    assert _triage(ROOT / "known-issues/swa-short-run-align-before-drop.json") == [
        ("unfixed", FindingKind.FALLBACK, 1, Role.PRIMARY, cause),
        ("unfixed", FindingKind.DENSE_MISMATCH, 1, Role.FACET, cause),
        ("fixed", FindingKind.FALLBACK, 1, Role.PRIMARY, cause),
        ("fixed", FindingKind.DENSE_MISMATCH, 1, Role.FACET, cause),
    ]


ONE_UNIT = "shortfall | known:unit-below-retained-boundary-falls-back"


def _fuzz(out: Path, *extra: str, seed: int = 11) -> tuple[int, dict]:
    proc = kvfuzz_cli(
        "fuzz",
        "--variants",
        "unfixed,fixed",
        "--seed",
        str(seed),
        "--max-examples",
        "60",
        "--no-dense-check",
        "--quiet",
        "--out",
        str(out),
        *extra,
    )
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads((out / "summary.json").read_text())


def test_campaign_reports_new_root_causes_first_with_shrunk_reproducers(tmp_path: Path) -> None:
    code, summary = _fuzz(
        tmp_path, "--known-corpus", "known-issues", "--shrink-seconds", "5", "--fail-on", "new"
    )
    assert code == 1  # new root causes on the variants under test
    causes = summary["root_causes"]
    new = [(c["root_cause"], c["variants"]) for c in causes if c["status"] == "new"]
    # With only known-issues/ as the known corpus, Gemma-4's needless
    # protection is new; new causes come first. The seed class these 60
    # examples show is its form beside a marked draft group, on both
    # variants: the seed fix's known limit, known as its marked reproducer,
    # not the seed class on `fixed`.
    assert ("needless-protection | drafter gemma4_mtp", ["unfixed"]) in new
    limit = "shortfall | known:seed-fix-limit-marked-draft-group"
    assert [
        (c["status"], c["variants"], c["known_as"], c["reproducer"])
        for c in causes
        if c["root_cause"] == limit
    ] == [
        ("known", ["fixed", "unfixed"], *["corpora/cases/seed-shrunk-draft-group-marked.json"] * 2)
    ]
    assert SEED_BUG.text not in {c["root_cause"] for c in causes}
    assert [c["status"] for c in causes] == sorted(
        (c["status"] for c in causes), key=lambda s: s != "new"
    )
    known = {c["root_cause"] for c in causes if c["status"] == "known"}
    assert ONE_UNIT in known
    assert len(causes) < len(summary["distinct"])  # fewer causes than signatures
    for cause in causes[: len(new)]:
        shrunk = tmp_path / cause["shrunk"]  # named from OUT
        assert cause["reproducer"] == cause["shrunk"]
        document = json.loads(shrunk.read_text())
        assert document["finding"]["root_cause"]["text"] == cause["root_cause"]
        replayed = {t[-1] for t in _triage(shrunk)}
        assert RootCause.from_dict(cause["identity"]) in replayed
    text = (tmp_path / "report.md").read_text()
    assert "; known as: `corpora/cases/seed-shrunk-draft-group-marked.json`" in text
    report = text.splitlines()
    assert report[2].startswith(f"**{len(causes)} root cause(s), {len(new)} new** (")
    assert report[4] == "| # | status | root cause | count | variants | reproducer |"
    assert report[6].startswith("| 1 | **NEW** | ")
    assert "[`shrunk/" in report[6]


def test_fail_on_new_is_clean_when_every_root_cause_is_known(tmp_path: Path) -> None:
    # corpora/ holds the seed class (its first file in path order, the
    # engine-confirmed seed-class case, ahead of the shrunk seed in
    # corpora/regressions/) and Gemma-4 MTP's needless protection (first
    # shown by vLLM #53670's workload, ahead of the Gemma-4 seed), known-issues/
    # the one-unit class: on attention layouts (Mamba hybrids still have causes
    # kvfuzz has not explained) every cause is known. Seed 12's 60 scenarios
    # reach all three.
    code, summary = _fuzz(
        tmp_path, "--no-shrink", "--fail-on", "new", "--groups", "full_attention", seed=12
    )
    assert code == 0, [c["root_cause"] for c in summary["root_causes"]]
    causes = {c["reproducer"]: c["status"] for c in summary["root_causes"]}
    assert set(causes.values()) == {"known"}
    for reproducer in (
        "known-issues/unit-below-replay-boundary-toy.json",
        "corpora/cases/engine-seed-class-eagle1-swa64-fa32-r256.json",
        "corpora/cases/gemma4-mtp-53670-concurrency2.json",
    ):
        assert reproducer in causes
    assert not (tmp_path / "shrunk").exists()


def test_a_campaign_run_elsewhere_finds_the_projects_known_corpus(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = kvfuzz_cli(
        "fuzz",
        "--variants",
        "unfixed,fixed",
        "--seed",
        "11",
        "--max-examples",
        "60",
        "--no-dense-check",
        "--no-shrink",
        "--quiet",
        "--out",
        str(tmp_path / "out"),
        cwd=elsewhere,
        # This tree's kvfuzz, as an install of it is found from anywhere.
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode in (0, 1), proc.stderr
    assert "no known corpus found" not in proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    known = {c["root_cause"] for c in summary["root_causes"] if c["status"] == "known"}
    assert ONE_UNIT in known
    # Corpus files are named from the kvfuzz root, as known issues' examples
    # are, and the campaign's own files from OUT: summary.json and report.md
    # (CI uploads them) hold no absolute path, wherever the campaign ran.
    reproducers = {c["reproducer"] for c in summary["root_causes"] if c["status"] == "known"}
    assert any(r.startswith("corpora/") for r in reproducers), reproducers
    assert all((ROOT / r.partition("#")[0]).is_file() for r in reproducers), reproducers
    for cause in summary["root_causes"]:
        assert (tmp_path / "out" / cause["file"]).is_file(), cause["file"]
    for entry in summary["distinct"]:
        assert (tmp_path / "out" / entry["file"]).is_file(), entry["file"]

    def strings(value: object) -> list[str]:
        if isinstance(value, dict):
            return [s for v in value.values() for s in strings(v)]
        if isinstance(value, list):
            return [s for v in value for s in strings(v)]
        return [value] if isinstance(value, str) else []

    assert [s for s in strings(summary) if s.startswith("/")] == []
    report = (tmp_path / "out" / "report.md").read_text()
    assert str(tmp_path) not in report and str(ROOT) not in report

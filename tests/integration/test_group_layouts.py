"""Group layouts on vLLM's real managers: exact hits and findings of the
corpus entries for each public report (values from real runs)."""

from __future__ import annotations

import pytest

from differential.compare import compare_variants
from differential.corpus import finding_tag, load_entry
from differential.scenario import DraftGroups
from differential.variants import parse_variants
from tests.factories import CORPORA, ROOT

pytestmark = pytest.mark.vllm

CASES = CORPORA / "cases"
KNOWN = ROOT / "known-issues"


def replay(name: str) -> tuple[dict[str, list[int]], dict[str, list[str]], object]:
    path = CASES / f"{name}.json"
    entry = load_entry(path if path.exists() else KNOWN / f"{name}.json")
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed"))
    hits = {vr.variant.name: list(vr.run.hits) for vr in result.results}
    owners = ("unfixed", "fixed", "layout")
    tags = {o: sorted(finding_tag(f) for f in result.findings if f.owner == o) for o in owners}
    return hits, tags, result


def test_gemma4_eagle3_draft_group_drops_only_there() -> None:
    # vLLM PR #41640: the draft group (full attention, block 4) takes the
    # drop; the SWA group keeps its plain tails, so request 1 (D = 196)
    # reaches the periodic checkpoint 192 itself.
    hits, tags, result = replay("gemma4-eagle3-draft-group")
    assert result.scenario.draft_groups is DraftGroups.ANNOTATED  # type: ignore[attr-defined]
    assert hits == {"unfixed": [0, 192, 64, 248], "fixed": [0, 192, 64, 248]}
    # D = 130: the draft drop lands on 120 = 128 - A; the SWA tail kept for
    # 128 does not reach down to 120, and the seed fix only widens tails of
    # groups that drop: both variants fall back to 64.
    assert tags == {"unfixed": ["fallback@2"], "fixed": ["fallback@2"], "layout": []}


def test_gemma4_without_annotation_runs_the_fallback() -> None:
    hits, tags, result = replay("gemma4-eagle3-draft-group--fallback")
    assert result.scenario.draft_groups is DraftGroups.FALLBACK  # type: ignore[attr-defined]
    assert hits == {"unfixed": [0, 128, 64, 248], "fixed": [0, 184, 120, 248]}
    assert tags == {"unfixed": ["fallback@1", "fallback@2"], "fixed": [], "layout": []}


def test_deepseek_v4_flash_dspark_layout() -> None:
    # vLLM issue #51771: MLA 256 + SW-MLA 64 + SW-MLA 4 + SW 8, A = 256.
    hits, tags, _ = replay("dsv4-flash-dspark-mla-3swa")
    assert hits == {"unfixed": [0, 2048, 1536, 2048], "fixed": [0, 2048, 1536, 2048]}
    assert tags == {"unfixed": ["fallback@2"], "fixed": ["fallback@2"], "layout": []}


def test_alignment_blowup_1536_3456() -> None:
    # vLLM PR #52804: A = lcm(1536, 3456) = 13824.
    hits, tags, result = replay("alignment-blowup-1536-3456")
    assert hits == {"unfixed": [0, 13824, 13824, 13824], "fixed": [0, 13824, 13824, 13824]}
    assert tags == {"unfixed": [], "fixed": [], "layout": ["alignment-blowup@run"]}
    (blowup,) = [f for f in result.findings if f.owner == "layout"]  # type: ignore[attr-defined]
    assert "siblings lose [3456, 3456, 3456] tokens (total 10368)" in blowup.detail
    assert blowup.known_issue == "alignment-lcm-blowup"


def test_commensurate_near_miss() -> None:
    hits, tags, _ = replay("alignment-commensurate-1536-3072")
    assert hits == {"unfixed": [0, 18432, 18432, 18432], "fixed": [0, 18432, 18432, 18432]}
    assert tags == {"unfixed": [], "fixed": [], "layout": []}


def test_llama4_chunked_local_and_single_mla() -> None:
    hits, tags, _ = replay("llama4-chunked-local")
    assert hits == {"unfixed": [0, 240, 192, 96], "fixed": [0, 240, 192, 96]}
    assert tags == {"unfixed": [], "fixed": [], "layout": []}
    hits, tags, _ = replay("mla-single-group")
    assert hits == {"unfixed": [0, 448, 448], "fixed": [0, 448, 448]}
    assert tags == {"unfixed": [], "fixed": [], "layout": []}


def test_small_draft_block_under_multi_module_mtp_over_hits() -> None:
    # Only the marked draft group (2-token blocks) drops, one block: the hit
    # (8) keeps draft KV at positions 6 and 7, which read 4 tokens ahead,
    # past the divergence point 10 (ceiling 10 - 4 = 6).
    hits, tags, _ = replay("draft-group-multi-module-mtp-small-draft-block")
    assert hits == {"unfixed": [0, 8], "fixed": [0, 8]}
    assert tags == {"unfixed": ["over-hit@1"], "fixed": ["over-hit@1"], "layout": []}

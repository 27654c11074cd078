"""Exact hit lengths of the seed scenarios on vLLM 0.33.0's real KVCacheManager.

Values are those measured in the design note (``semantics.md``, "Numbers
measured on vLLM 0.33.0") and in the seed PR description.
"""

from __future__ import annotations

import pytest

from differential.compare import compare_variants
from differential.corpus import finding_tag, load_entry
from differential.findings import Policy
from differential.scenario import Scenario
from differential.variants import parse_variants
from tests.factories import CORPORA

pytestmark = pytest.mark.vllm

BOTH = parse_variants("unfixed,fixed")


def _run(name: str) -> dict[str, tuple[tuple[int, ...], list[str]]]:
    scenario: Scenario = load_entry(CORPORA / "seeds" / f"{name}.json").scenario
    result = compare_variants(scenario, BOTH)
    out = {}
    for vr in result.results:
        mine = [f for f in result.findings if f.owner == vr.variant.name]
        out[vr.variant.name] = (vr.run.hits, sorted(finding_tag(f) for f in mine))
    return out


def test_triton_seed() -> None:
    got = _run("triton-mtp3-swa16-fa32-r8192")
    assert got["unfixed"] == ((0, 8192, 16352, 16352), ["fallback@1"])
    assert got["fixed"] == ((0, 16352, 16352, 16352), [])


def test_triton_fallback_names_the_lost_checkpoint() -> None:
    scenario = load_entry(CORPORA / "seeds" / "triton-mtp3-swa16-fa32-r8192.json").scenario
    result = compare_variants(scenario, BOTH)
    (finding,) = result.findings
    assert (finding.request, finding.divergence_tokens) == (1, 16384)
    assert (finding.expected_tokens, finding.hit_tokens) == (16352, 8192)
    assert finding.fallback_checkpoint_tokens == 8192


def test_flashinfer_seed() -> None:
    got = _run("flashinfer-mtp3-swa64-fa128-r8192")
    assert got["unfixed"] == ((0, 8192, 16256, 16256), ["fallback@1"])
    assert got["fixed"] == ((0, 16256, 16256, 16256), [])


def test_flashinfer_with_short_suffix_hides_the_bug() -> None:
    got = _run("flashinfer-suffix64-bug-hides")
    assert got["unfixed"] == got["fixed"] == ((0, 16256, 16256, 16256), [])


def test_equal_block_and_alignment_seed() -> None:
    got = _run("equal-block-alignment-mtp3-swa16-fa16-r8192")
    assert got["unfixed"] == ((0, 8192, 16368, 16368), ["fallback@1"])
    assert got["fixed"] == ((0, 16368, 16368, 16368), [])


def test_kv_connector_seed() -> None:
    got = _run("kv-connector-mtp3-swa16-fa32-r8192")
    assert got["unfixed"] == ((0, 8192, 16352, 16352), ["fallback@1"])
    assert got["fixed"] == ((0, 16352, 16352, 16352), [])


def test_gemma4_mtp_seed() -> None:
    got = _run("gemma4-mtp3-swa16-fa32-r8192")
    assert got["unfixed"] == (
        (0, 8192, 16352, 16352),
        ["fallback@1", "fallback@2", "fallback@3", "needless-drop@run"],
    )
    assert got["fixed"] == ((0, 16384, 16384, 16384), [])


@pytest.mark.parametrize(
    ("name", "hits"),
    [
        ("dense-retention-mtp3-swa16-fa32", (0, 16352, 16352, 16352)),
        ("no-drafter-swa16-fa32-r8192", (0, 16384, 16384, 16384)),
        ("dflash-swa16-fa32-r8192", (0, 16384, 16384, 16384)),
    ],
)
def test_outside_the_fix_both_variants_agree(name: str, hits: tuple[int, ...]) -> None:
    got = _run(name)
    assert got["unfixed"] == got["fixed"] == (hits, [])


def test_toy_scale_reproduces_the_class() -> None:
    got = _run("toy-mtp1-swa4-fa8-r64")
    assert got["unfixed"] == ((0, 192, 248, 248), ["fallback@1"])
    assert got["fixed"] == ((0, 248, 248, 248), [])


def test_lookahead_hashes_seed_is_the_one_unit_class() -> None:
    # Lookahead hashes, no drop: the sibling is owed c - A = 16352 by the
    # one-unit rule, which vLLM 0.33.0 and the seed fix keep only under the
    # drop (the #57610 class); the candidate keeps it.
    scenario = load_entry(
        CORPORA / "seeds" / "lookahead-hashes-mtp3-swa16-fa32-r8192.json"
    ).scenario
    result = compare_variants(scenario, parse_variants("unfixed,fixed,candidate"))
    hits = {vr.variant.name: vr.run.hits for vr in result.results}
    assert hits["unfixed"] == hits["fixed"] == (0, 8192, 16352, 16352)
    assert hits["candidate"] == (0, 16352, 16352, 16352)
    labels = {(f.owner, finding_tag(f), f.known_issue) for f in result.findings}
    assert labels == {
        (name, "fallback@1", "unit-below-retained-boundary-falls-back")
        for name in ("unfixed", "fixed")
    }
    retained = compare_variants(scenario, BOTH, policy=Policy.RETAINED)
    assert retained.findings == ()

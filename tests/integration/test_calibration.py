"""The oracle in both directions: by-design misses are never flagged under the
``vllm`` policy, and each calibration mutant of vLLM is caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from differential.compare import compare_variants
from differential.corpus import finding_tag, load_entry
from differential.reports.calibration import mutation_table
from differential.scenario import DrafterKind, RequestSpec
from differential.variants import parse_variants
from tests.factories import CORPORA, hybrid

pytestmark = pytest.mark.vllm

BOTH = parse_variants("unfixed,fixed")
WRONG_KV_1_TO_3 = sorted(f"wrong-kv@{r}" for r in (1, 2, 3) for _ in range(2))


def _tags(scenario, variants) -> dict[str, list[str]]:
    result = compare_variants(scenario, variants)
    return {
        vr.variant.name: sorted(
            finding_tag(f) for f in result.findings if f.owner == vr.variant.name
        )
        for vr in result.results
    }


@pytest.mark.parametrize("shared", [1, 7, 15])
@pytest.mark.parametrize("retention", [None, 0, 64])
def test_shared_prefix_shorter_than_one_alignment_unit(shared: int, retention: int | None) -> None:
    # A = 16: a sibling sharing fewer than 16 tokens can never hit.
    scenario = hybrid(
        16,
        8,
        32,
        prefix=128,
        requests=(RequestSpec(128, 8), RequestSpec(shared, 40)),
        retention=retention,
        spec_tokens=1,
        chunk=32,
    )
    result = compare_variants(scenario, BOTH)
    assert [vr.run.hits for vr in result.results] == [(0, 0), (0, 0)]
    assert result.findings == ()


def test_one_unit_eagle_loss_is_by_design() -> None:
    # Dense retention, drop on: siblings get 16352, one unit below the shared
    # 16384, and that is no finding.
    entry = load_entry(CORPORA / "seeds" / "dense-retention-mtp3-swa16-fa32.json")
    assert _tags(entry.scenario, BOTH) == {"unfixed": [], "fixed": []}


@pytest.mark.parametrize("divergence", [40, 64, 80])
def test_retention_0_sibling_before_the_replay_boundary(divergence: int) -> None:
    # Retention 0 keeps the writer's replay boundaries only (88 and 96 for a
    # 104-token prompt with A = 8, drop on), and the one-unit rule promises 80
    # too: divergence points whose dense hit is below 80 are owed 0.
    scenario = hybrid(
        8,
        4,
        16,
        prefix=104,
        requests=(RequestSpec(104, 0), RequestSpec(divergence, 20)),
        retention=0,
        drafter=DrafterKind.EAGLE,
        spec_tokens=1,
        chunk=32,
    )
    result = compare_variants(scenario, BOTH)
    assert all(vr.run.hits == (0, 0) for vr in result.results)
    assert result.findings == ()


@pytest.mark.parametrize(
    ("mutant", "seed", "expected"),
    [
        ("mutant-no-peek", "seeds/triton-mtp3-swa16-fa32-r8192", ["fallback@1"]),
        (
            "mutant-double-drop",
            "seeds/toy-mtp1-swa4-fa8-r64",
            [
                "dense-mismatch@1",
                "dense-mismatch@2",
                "dense-mismatch@3",
                "fallback@1",
                "fallback@2",
                "fallback@3",
            ],
        ),
        (
            "mutant-no-junction",
            "seeds/junction-retention0-swa4-fa8",
            ["fallback@2"],
        ),
        (
            "mutant-no-replay-widening",
            "../known-issues/unit-below-replay-boundary-toy",
            ["fallback@1"],
        ),
        # Each sibling's lookup, in the run and in the dense cross-check run.
        ("mutant-null-in-window", "seeds/toy-mtp1-swa4-fa8-r64", WRONG_KV_1_TO_3),
        ("mutant-extra-block", "seeds/toy-mtp1-swa4-fa8-r64", WRONG_KV_1_TO_3),
    ],
)
def test_mutants_are_caught(mutant: str, seed: str, expected: list[str]) -> None:
    scenario = load_entry(CORPORA / f"{seed}.json").scenario
    base = parse_variants(mutant)[0].base
    got = _tags(scenario, parse_variants(f"{base},{mutant}"))
    assert got == {base: [], mutant: expected}


def test_block_mutants_are_caught_on_the_seeds_by_the_block_level_check_alone() -> None:
    # The hit length stays right, so only the block-level check can see them.
    entries = [load_entry(p) for p in sorted((CORPORA / "seeds").glob("*.json"))]
    rows, noisy = mutation_table(entries, ("mutant-null-in-window", "mutant-extra-block"))
    # The lookahead seed is the one-unit class on fixed itself: left out.
    assert [Path(n.partition(": ")[2]).stem for n in noisy] == [
        "lookahead-hashes-mtp3-swa16-fa32-r8192"
    ]
    caught = {row.mutant: {Path(path).stem for path, _ in row.caught_by} for row in rows}
    kinds = {tag.split("@")[0] for row in rows for _, found in row.caught_by for tag in found}
    # Both are block-level findings. The null block handed out inside the
    # window also stops vLLM's freeing of the blocks below it
    # (_remove_blocks_in_range walks down to the first null block), which the
    # step tables show on one seed.
    assert kinds == {"wrong-kv", "kept-skipped-block"}
    kept = {
        (row.mutant, Path(path).stem)
        for row in rows
        for path, found in row.caught_by
        if any(tag.startswith("kept-skipped-block") for tag in found)
    }
    assert kept == {("mutant-null-in-window", "junction-retention0-swa4-fa8")}
    judged = {p.stem for p in (CORPORA / "seeds").glob("*.json")} - {
        "lookahead-hashes-mtp3-swa16-fa32-r8192"
    }
    # A null block in the window is caught wherever a sibling hits in a
    # sliding-window group: every judged seed but the full-attention-only one.
    assert judged - caught["mutant-null-in-window"] == {"single-group-fa16-eagle-65"}
    # The extra block needs a cached block just past the hit (the EAGLE
    # drop's peek block, or a later sibling's): seeds without one hand out none.
    assert sorted(judged - caught["mutant-extra-block"]) == [
        "dflash-swa16-fa32-r8192",
        "gemma4-mtp3-swa16-fa32-r8192",
        "no-drafter-swa16-fa32-r8192",
        "single-group-swa16-w64-r0",
    ]


def test_mamba_margin_mutant_with_the_hash_block_equal_to_the_mamba_block() -> None:
    """FA 16 + Mamba 16 (hash block 16), EAGLE with the drop, dense retention,
    block-carved prefill: the margin the mutant gives back must stop at the
    hashed tokens (it raised IndexError inside vLLM's finder, a crash of its
    own making); the mutant is caught by what it breaks instead."""
    import dataclasses

    from differential.scenario import MambaPrefill

    proof = load_entry(CORPORA / "cases" / "mamba-state-above-attention-proof.json").scenario
    groups = tuple(dataclasses.replace(g, block_size_tokens=16) for g in proof.kv_cache_groups)
    scenario = dataclasses.replace(
        proof,
        kv_cache_groups=groups,
        hash_block_size_tokens=None,
        mamba_prefill=MambaPrefill.BLOCK,
        shared_prefix_tokens=40,
        requests=(RequestSpec(40, 0), RequestSpec(34, 6)),
    )
    assert [g.kind.value for g in scenario.kv_cache_groups] == ["full_attention", "mamba"]
    assert scenario.effective_hash_block_size_tokens == 16
    assert scenario.retention_interval_tokens is None
    got = _tags(scenario, parse_variants("fixed,mutant-mamba-eagle-margin"))
    # Full attention proves 32 and drops one block: 16. The mutant's Mamba
    # finder reaches the state at 32, past the proof, so the reconciled hit
    # also exceeds full attention's own (per-group-hit).
    assert got == {
        "fixed": [],
        "mutant-mamba-eagle-margin": [
            "dense-mismatch@1",
            "over-hit@1",
            "per-group-hit@1",
            "wrong-kv@1",
        ],
    }

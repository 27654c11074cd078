"""``kvfuzz mutate`` on real vLLM: a cosmic-ray mutant of the sliding-window
lookup is killed, and a mutant that kvfuzz's no-eviction pool makes
equivalent survives as equivalent-suspect; both run as tree variants."""

from __future__ import annotations

from pathlib import Path

import pytest

from differential.corpus import load_entry
from differential.variants.mutation import (
    MODULES,
    MutantStatus,
    enumerate_mutants,
    installed_vllm,
    run_mutation,
)
from tests.factories import CORPORA

pytestmark = pytest.mark.vllm

# Identities in vLLM 0.33.0 (module stem:operator:occurrence); each test also
# checks the diff, so a different vLLM fails loudly rather than testing another
# mutant.
KILLED = "single_type_kv_cache_manager:ReplaceBinaryOperator_Mul_Mod:12"
EQUIVALENT = "kv_cache_coordinator:ZeroIterationForLoop:1"


def test_a_real_mutant_is_killed_and_an_equivalent_one_survives(tmp_path: Path) -> None:
    root = installed_vllm()
    pool = enumerate_mutants(
        root,
        MODULES[:2],
        operators=["core/ReplaceBinaryOperator_Mul_Mod", "core/ZeroIterationForLoop"],
    )
    by_id = {m.ident: m for mutants in pool.values() for m in mutants}
    mutants = [by_id[KILLED], by_id[EQUIVALENT]]
    assert mutants[0].function == "SlidingWindowManager.find_longest_cache_hit"
    assert mutants[1].function == "KVCacheCoordinator.get_num_blocks_to_allocate"
    seed = CORPORA / "seeds" / "dense-retention-mtp3-swa16-fa32.json"
    scenarios = [(seed.name, load_entry(seed).scenario)]
    run = run_mutation(
        mutants,
        scenarios,
        vllm_root=root,
        work=tmp_path,
        seed=0,
        generated={m: len(v) for m, v in pool.items()},
        timeout_s=60.0,
    )
    killed, equivalent = run.outcomes
    assert "-                and len(computed_blocks[0]) * block_size % alignment_tokens" in (
        killed.diff
    )
    assert "+        for i, manager in []:" in equivalent.diff
    # The SWA alignment loop drops blocks while the hit is not a multiple of
    # A: with `%` for `*` it drops below the checkpoint; request 1 hits 16128
    # instead of stock's 16352.
    assert killed.status is MutantStatus.KILLED
    assert killed.evidence.startswith(f"disagreement@1 on {seed.name}: hits 16352 on unfixed")
    assert "16128 on mutant" in killed.evidence
    assert killed.scenarios_run == 1
    # get_num_blocks_to_allocate only gates admission against free blocks;
    # kvfuzz's pool never runs short, so skipping it changes nothing observable.
    assert equivalent.status is MutantStatus.EQUIVALENT_SUSPECT
    assert equivalent.reached
    assert run.score() == pytest.approx(0.5)
    assert run.score(MODULES[0].path) == 1.0 and run.score(MODULES[1].path) == 0.0

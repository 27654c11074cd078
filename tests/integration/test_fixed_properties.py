"""Property tests: the generator against the fixed and candidate variants.

The fixed variant must show no ``fallback``, ``over-hit`` or ``misaligned``
finding on any generated scenario, except the vLLM issues kvfuzz has already
explained (:mod:`differential.oracle.known`), which the seed PR does not touch, and
the seed class itself where a sliding-window group does not take the drop (only
the drafter's groups marked ``is_eagle_group`` do: the seed PR widens only tails
of groups that drop). The candidate must not show even the one-unit class it
closes.
Bounded and derandomized under the CI profile (``fuzz/profiles.py``).
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from differential.compare import compare_variants
from differential.findings import FindingKind
from differential.scenario import Scenario
from differential.triage.identity import RootCause, triage
from differential.variants import parse_variants
from fuzz.profiles import load_profile
from fuzz.strategies import scenarios
from tests.factories import triton

pytestmark = pytest.mark.vllm

load_profile()
FIXED = parse_variants("fixed")
FORBIDDEN = {FindingKind.FALLBACK, FindingKind.OVER_HIT, FindingKind.MISALIGNED}


CANDIDATE = parse_variants("candidate")
ONE_UNIT = "unit-below-retained-boundary-falls-back"
SEED_CLASS = RootCause("shortfall", group_kind="sliding_window", boundary="periodic", units_below=1)


def _outside_the_seed_fix(scenario: Scenario, cause: RootCause) -> bool:
    """The seed class where a sliding-window group does not take the drop
    (the drafter's groups marked ``is_eagle_group`` take it, the others do
    not): the seed PR widens a periodic tail only in a group that drops, so
    it leaves such a group's tails, and the hits they bind, as they were."""
    drops = scenario.drop_group_indices
    swa = [i for i, g in enumerate(scenario.kv_cache_groups) if g.kind.sliding_window_family]
    return cause == SEED_CLASS and any(i not in drops for i in swa)


def _unexplained(scenario: Scenario) -> list[str]:
    result = compare_variants(scenario, FIXED, dense_cross_check=False)
    return [
        t.finding.summary()
        for t in triage(result)
        if t.finding.kind in FORBIDDEN
        and t.finding.known_issue is None
        and not _outside_the_seed_fix(scenario, t.root_cause)
    ]


def _candidate_unexplained(scenario: Scenario) -> list[str]:
    result = compare_variants(scenario, CANDIDATE, dense_cross_check=False)
    return [
        f.summary()
        for f in result.findings
        if f.kind in FORBIDDEN and f.known_issue in (None, ONE_UNIT)
    ]


@given(scenarios(scale="toy"))
@example(triton())
@example(
    # Found by this test: a marked draft SWA group beside full attention that
    # skips the drop; vLLM pins full attention's undropped hit as a junction,
    # which the oracle does not promise (Scenario.pins_junctions).
    Scenario.from_json(
        '{"format":"kvfuzz.scenario","version":1,"kv_cache_groups":['
        '{"kind":"sliding_window","block_size_tokens":2,"sliding_window_tokens":2,'
        '"is_eagle_group":true},{"kind":"full_attention","block_size_tokens":2},'
        '{"kind":"full_attention","block_size_tokens":2},'
        '{"kind":"full_attention","block_size_tokens":2},'
        '{"kind":"full_attention","block_size_tokens":2}],'
        '"retention_interval_tokens":0,"drafter":{"kind":"mtp","num_speculative_tokens":1},'
        '"disable_lookahead_block_hashes":true,"prefill_chunk_tokens":2,"decode_steps":0,'
        '"shared_prefix_tokens":12,"requests":['
        '{"name":"writer","divergence_tokens":12,"suffix_tokens":1},'
        '{"divergence_tokens":11,"suffix_tokens":0},'
        '{"shares_with":0,"divergence_tokens":8,"suffix_tokens":0}]}'
    )
)
@example(
    # Found by this test: the seed class in a sliding-window group (block 8,
    # window 2) beside a marked draft SWA group that takes the drop; the seed
    # PR widens only the draft group's tails, so fixed falls back to 0 where
    # 8 is owed and the candidate does not.
    Scenario.from_json(
        '{"format":"kvfuzz.scenario","version":1,"kv_cache_groups":['
        '{"kind":"chunked_local_attention","block_size_tokens":8,'
        '"attention_chunk_size_tokens":8},'
        '{"kind":"sliding_window","block_size_tokens":2,"sliding_window_tokens":2,'
        '"is_eagle_group":true},'
        '{"kind":"sliding_window","block_size_tokens":8,"sliding_window_tokens":2},'
        '{"kind":"full_attention","block_size_tokens":2},'
        '{"kind":"full_attention","block_size_tokens":2}],'
        '"retention_interval_tokens":16,"drafter":{"kind":"mtp","num_speculative_tokens":1},'
        '"disable_lookahead_block_hashes":true,"prefill_chunk_tokens":8,"decode_steps":0,'
        '"shared_prefix_tokens":32,"requests":['
        '{"name":"writer","divergence_tokens":32,"suffix_tokens":0},'
        '{"shares_with":0,"divergence_tokens":10,"suffix_tokens":0}]}'
    )
)
def test_fixed_is_clean_at_toy_scale(scenario: Scenario) -> None:
    assert _unexplained(scenario) == [], scenario.to_json()


# Attention layouts at every scale (a fixed scale draws no Mamba group): the
# state oracle for Mamba hybrids still has open disagreements with vLLM on
# `fixed` that are not yet explained (docs/scenarios.md, "Mamba and linear-attention
# hybrids"), so they are not held to this property yet.
@given(st.sampled_from(("toy", "medium", "real")).flatmap(lambda scale: scenarios(scale=scale)))
def test_fixed_is_clean_across_scales(scenario: Scenario) -> None:
    assert _unexplained(scenario) == [], scenario.to_json()


@given(scenarios(scale="toy"))
def test_candidate_closes_the_one_unit_class_at_toy_scale(scenario: Scenario) -> None:
    assert _candidate_unexplained(scenario) == [], scenario.to_json()

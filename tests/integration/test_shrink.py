"""``kvfuzz shrink``: minimal reproducers that keep the finding's signature."""

from __future__ import annotations

import pytest

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.variants import parse_variants
from fuzz.minimize import shrink
from fuzz.signature import signature_of
from tests.factories import CORPORA

pytestmark = pytest.mark.vllm

BOTH = parse_variants("unfixed,fixed")


def test_triton_seed_shrinks_to_a_small_reproducer() -> None:
    scenario = load_entry(CORPORA / "seeds" / "triton-mtp3-swa16-fa32-r8192.json").scenario
    (finding,) = compare_variants(scenario, BOTH).findings
    signature = signature_of(scenario, finding)
    outcome = shrink(scenario, signature, BOTH, seconds=60)
    small = outcome.scenario
    assert not outcome.timed_out
    assert len(small.requests) <= 3
    retention = small.retention_interval_tokens
    assert retention and small.shared_prefix_tokens <= 2 * retention
    (swa,) = small.sliding_window_groups
    assert swa.sliding_window_tokens <= 4 * swa.block_size_tokens
    result = compare_variants(small, BOTH)
    assert [signature_of(small, f) for f in result.findings] == [signature]
    assert [vr.run.hits for vr in result.results] == [(0, 4), (0, 6)]
    # Deterministic: the same input gives the same reproducer.
    assert shrink(scenario, signature, BOTH, seconds=60).scenario == small


def test_committed_regression_is_the_shrunk_triton_seed() -> None:
    entry = load_entry(CORPORA / "regressions" / "fallback-unfixed-517c289c14.json")
    assert entry.expect.findings == {"unfixed": ("fallback@1",), "fixed": (), "candidate": ()}

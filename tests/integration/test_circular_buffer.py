"""Circular buffer groups on vLLM's real CircularBufferManager (DeepSeek-V4.1's
compressor ring beside MLA): exact hits from real runs, in both modes."""

from __future__ import annotations

import dataclasses

import pytest

from differential.compare import compare_variants
from differential.corpus import finding_tag
from differential.scenario import (
    Drafter,
    DrafterKind,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
)
from differential.variants import parse_variants

pytestmark = pytest.mark.vllm

K = GroupKind
G = KVCacheGroup
REQUESTS = (
    RequestSpec(256, 8),
    RequestSpec(256, 8),
    RequestSpec(200, 8),
    RequestSpec(100, 40, shares_with=2),
)


def ring_scenario(*groups: KVCacheGroup, **kwargs: object) -> Scenario:
    return Scenario(
        kv_cache_groups=groups,
        requests=REQUESTS,
        shared_prefix_tokens=256,
        prefill_chunk_tokens=64,
        **kwargs,  # type: ignore[arg-type]
    )


def replay(s: Scenario) -> tuple[list[int], list[tuple[int, ...]], list[str]]:
    result = compare_variants(s, parse_variants("unfixed"))
    (vr,) = result.results
    per_group = [r.per_group_hit_tokens for r in vr.run.requests]
    return list(vr.run.hits), per_group, sorted(finding_tag(f) for f in result.findings)


MTP_DROP = {"drafter": Drafter(DrafterKind.MTP, 1), "disable_lookahead_block_hashes": True}


def test_ring_beside_mla_hits_as_mla_alone() -> None:
    # An 8-token ring beside MLA 16 (A = 16): HybridKVCacheCoordinator
    # looks the ring up never; its per-group hit stays 0 and the hits are
    # MLA's alone, with the MTP drop one block lower.
    ring = ring_scenario(G(K.MLA, 16), G(K.CIRCULAR_BUFFER, 8))
    hits, per_group, tags = replay(ring)
    assert hits == [0, 256, 192, 96]
    assert per_group == [(0, 0), (256, 0), (192, 0), (96, 0)]
    assert tags == []
    alone = ring_scenario(G(K.MLA, 16))
    assert replay(alone)[0] == hits
    dropped, _, tags = replay(ring_scenario(G(K.MLA, 16), G(K.CIRCULAR_BUFFER, 8), **MTP_DROP))
    assert dropped == [0, 240, 176, 80]
    assert tags == []


def test_a_ring_larger_than_the_blocks_widens_the_scheduler_block() -> None:
    # A 24-token ring first, full attention 16, SWA 8 (window 32), R = 96:
    # resolve_kv_cache_block_sizes makes A = lcm(24, 16, 8) = 48 (the hash
    # block gcd(16, 8) = 8): hits land on multiples of 48.
    s = ring_scenario(
        G(K.CIRCULAR_BUFFER, 24),
        G(K.FULL_ATTENTION, 16),
        G(K.SLIDING_WINDOW, 8, 32),
        retention_interval_tokens=96,
    )
    hits, per_group, tags = replay(s)
    assert hits == [0, 240, 192, 96]
    assert [g[0] for g in per_group] == [0, 0, 0, 0]
    assert tags == ["alignment-blowup@run"]


def test_scheduler_mode_serves_the_ring() -> None:
    s = ring_scenario(G(K.MLA, 16), G(K.CIRCULAR_BUFFER, 8), **MTP_DROP)
    s = dataclasses.replace(s, workload=dataclasses.replace(s.workload, mode=DriveMode.SCHEDULER))
    hits, _, tags = replay(s)
    assert hits == [0, 240, 176, 80]
    assert tags == []

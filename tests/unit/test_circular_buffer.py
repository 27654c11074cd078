"""Circular buffer groups (vLLM ``CircularBufferSpec``, DeepSeek-V4.1's
compressor ring): the layout rules and what the oracle owes, hand-worked
(no vLLM)."""

from __future__ import annotations

import pytest

from differential.errors import ScenarioError
from differential.observation import BlockRecord, RequestObservation
from differential.oracle import dense_hit, drafter_model
from differential.oracle.blocks import GROUP_CHECKS, ViolationKind
from differential.oracle.per_group import wrong_per_group_hit
from differential.scenario import (
    Drafter,
    DrafterKind,
    DraftGroups,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
)
from tests.factories import layout_scenario

K = GroupKind
G = KVCacheGroup
MTP = Drafter(DrafterKind.MTP, 1)


scenario = layout_scenario


def test_the_ring_is_no_hashing_size_but_enters_the_scheduler_block() -> None:
    # resolve_kv_cache_block_sizes: LCM over every group (16, 24 -> 48), GCD
    # over the prefix-cacheable ones only (16, 8 -> 8; with the ring, 8 too,
    # but a 12-token ring would make it 4).
    s = scenario(G(K.CIRCULAR_BUFFER, 24), G(K.FULL_ATTENTION, 16), G(K.SLIDING_WINDOW, 8, 32))
    assert (s.scheduler_block_size_tokens, s.effective_hash_block_size_tokens) == (48, 8)
    assert s.cacheable_groups == s.kv_cache_groups[1:]
    odd = scenario(G(K.FULL_ATTENTION, 16), G(K.CIRCULAR_BUFFER, 12))
    assert (odd.scheduler_block_size_tokens, odd.effective_hash_block_size_tokens) == (48, 16)
    # A hash block that does not divide the ring is vLLM's to accept.
    assert scenario(G(K.FULL_ATTENTION, 16), G(K.CIRCULAR_BUFFER, 8), hash_block_size_tokens=16)
    assert Scenario.from_json(s.to_json()) == s
    assert s.group_mix == "full_attention+sliding_window+circular_buffer"


@pytest.mark.parametrize(
    ("groups", "field", "message"),
    [
        ((G(K.CIRCULAR_BUFFER, 8),), "kv_cache_groups", "at least one prefix-cacheable group"),
        (
            (G(K.CIRCULAR_BUFFER, 8), G(K.CIRCULAR_BUFFER, 16)),
            "kv_cache_groups",
            "at least one prefix-cacheable group",
        ),
        (
            (G(K.FULL_ATTENTION, 16), G(K.CIRCULAR_BUFFER, 8, is_eagle_group=True)),
            "kv_cache_groups[1].is_eagle_group",
            "no part in prefix caching",
        ),
        (
            (G(K.FULL_ATTENTION, 16), G(K.CIRCULAR_BUFFER, 8, sliding_window_tokens=8)),
            "kv_cache_groups[1].sliding_window_tokens",
            "null for a circular_buffer group",
        ),
    ],
)
def test_refused_ring_layouts(groups: tuple[KVCacheGroup, ...], field: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        scenario(*groups, drafter=MTP)
    assert info.value.field == field


def test_the_ring_never_takes_the_drop_nor_makes_a_junction_type() -> None:
    s = scenario(
        G(K.FULL_ATTENTION, 8),
        G(K.CIRCULAR_BUFFER, 16),
        drafter=MTP,
        disable_lookahead_block_hashes=True,
    )
    # KVCacheCoordinator.__init__ flags every group, but
    # verify_and_split_kv_cache_groups skips the ring before the flag counts.
    assert s.draft_groups is DraftGroups.FALLBACK
    assert s.drop_group_indices == frozenset({0})
    # One attention type left: no uncached common prefix, no junction.
    assert not s.pins_junctions


def test_dense_hit_ignores_the_ring() -> None:
    # Full attention 8 beside a 16-token ring: A = 16. A sibling sharing 40
    # tokens: full attention proves 40, drops its block -> 32, aligned -> 32.
    # Were the ring a group that drops, 40 // 16 * 16 - 16 = 16 would bound it.
    s = scenario(
        G(K.FULL_ATTENTION, 8),
        G(K.CIRCULAR_BUFFER, 16),
        drafter=MTP,
        disable_lookahead_block_hashes=True,
        requests=(RequestSpec(64, 4), RequestSpec(40, 20)),
    )
    assert s.effective_hit_alignment_tokens == 16
    assert dense_hit(s, drafter_model(s), 1, 0, 40) == 32
    # Without the drop the same sibling is owed 32 too (40 -> 32 at A = 16),
    # and 48 with 50 shared (48 // 16 * 16).
    plain = scenario(G(K.FULL_ATTENTION, 8), G(K.CIRCULAR_BUFFER, 16))
    assert dense_hit(plain, drafter_model(plain), 1, 0, 50) == 48


def test_per_group_rule_skips_the_ring() -> None:
    # find_longest_cache_hit_per_group leaves a ring's hit at 0: owed nothing.
    request = RequestObservation(
        index=1,
        prompt_tokens=60,
        hit_tokens=32,
        shared_prefix_boundary_tokens=0,
        per_group_hit_tokens=(32, 0),
        retained_blocks_per_group=(0, 0),
    )
    assert wrong_per_group_hit(request, 16, frozenset({1})) is None
    assert wrong_per_group_hit(request, 16) == (1, 0)


def test_a_ring_block_handed_to_a_hit_is_a_count_violation() -> None:
    check = GROUP_CHECKS[K.CIRCULAR_BUFFER]
    ring = G(K.CIRCULAR_BUFFER, 8)
    assert check(ring, 1, 32, [], 1, None) == []  # type: ignore[arg-type]
    record = BlockRecord(block_id=5, group=1, writer=0, writer_block_index=0, filled_tokens=8)
    (violation,) = check(ring, 1, 32, [record], 1, None)  # type: ignore[arg-type]
    assert (violation.kind, violation.group, violation.held) == (ViolationKind.COUNT, 1, record)
    assert "a circular buffer is not prefix-cacheable and owes none" in violation.detail

"""The oracle's prefix primitives: the copy-free and the pairwise common
prefix agree with a token-by-token count; the per-scenario memo is per object."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from differential.oracle.prefix import (
    common_prefix_packed,
    common_prefix_tokens,
    packed_tokens,
    pairwise_common_prefix_tokens,
    scenario_memo,
    shared_prefixes,
)
from tests.factories import triton


def _counted(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    shared = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        shared += 1
    return shared


_tokens = st.lists(st.integers(0, 3), max_size=24).map(tuple)


@given(st.lists(_tokens, max_size=8))
@example([(1, 2, 3), (1, 2), (1, 2, 3), (), (1, 2, 4, 5)])  # duplicates, a prefix, empty
@example([(2**70, 1), (2**70, 2), (5,)])  # too wide to pack: the slice search decides
def test_pairwise_prefixes_match_a_token_count(prompts: list[tuple[int, ...]]) -> None:
    rows = pairwise_common_prefix_tokens(prompts)
    assert [len(row) for row in rows] == list(range(len(prompts)))
    for j, row in enumerate(rows):
        for i, shared in enumerate(row):
            assert shared == _counted(prompts[i], prompts[j])
            assert common_prefix_tokens(prompts[i], prompts[j]) == shared


def test_packed_prefix_counts_tokens_not_bytes() -> None:
    # 256 and 0 agree in 7 of their 8 bytes: still different tokens.
    a, b = packed_tokens((7, 256, 9)), packed_tokens((7, 0, 9))
    assert a is not None and b is not None
    assert common_prefix_packed(a, b) == 1
    assert packed_tokens((2**63,)) is None


def test_scenario_memo_is_per_scenario_object() -> None:
    first, equal = triton(), triton()
    assert first == equal and first is not equal
    scenario_memo(first)["k"] = 1
    assert scenario_memo(first) == {"k": 1}
    assert "k" not in scenario_memo(equal)
    rows = shared_prefixes(first)
    assert shared_prefixes(first) is rows  # computed once
    assert rows == [[], [16384], [16384, 16384], [16384, 16384, 16384]]

"""Token-sequence primitives the oracle's modules share (no vLLM).

The lowest layer of :mod:`differential.oracle`: it imports no other oracle
module, so :mod:`~differential.oracle.core` and
:mod:`~differential.oracle.state` both build on it without importing each
other's internals in a circle.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["common_prefix_tokens"]


def common_prefix_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """Length, in tokens, of the longest common prefix of two token sequences."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search on slice equality (compared in C)
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo

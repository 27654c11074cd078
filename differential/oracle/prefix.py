"""Token-sequence primitives the oracle's modules share (no vLLM).

The lowest layer of :mod:`differential.oracle`: it imports no other oracle
module, so :mod:`~differential.oracle.core` and
:mod:`~differential.oracle.state` both build on it without importing each
other's internals in a circle. It also holds the per-scenario memo the
oracle keeps quantities in that depend on the scenario alone.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from itertools import accumulate, pairwise
from typing import Any

__all__ = [
    "common_prefix_packed",
    "common_prefix_tokens",
    "packed_tokens",
    "pairwise_common_prefix_tokens",
    "scenario_memo",
    "shared_prefixes",
    "written_contents",
]

_TOKEN_BYTES = 8  # array typecode "q"


def packed_tokens(tokens: Sequence[int]) -> bytes | None:
    """``tokens`` as native 64-bit integers (for :func:`common_prefix_packed`),
    or ``None`` if one does not fit."""
    try:
        return array("q", tokens).tobytes()
    except (OverflowError, TypeError):
        return None


def common_prefix_packed(a: bytes, b: bytes) -> int:
    """:func:`common_prefix_tokens` of two :func:`packed_tokens` sequences, in
    tokens: a binary search whose comparisons are ``memcmp`` on views
    (nothing copied)."""
    view = memoryview(b)
    lo, hi = 0, min(len(a), len(b)) // _TOKEN_BYTES
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(view[: mid * _TOKEN_BYTES]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_prefix_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """Length, in tokens, of the longest common prefix of two token sequences."""
    packed_a, packed_b = packed_tokens(a), packed_tokens(b)
    if packed_a is not None and packed_b is not None:
        return common_prefix_packed(packed_a, packed_b)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search on slice equality (compared in C)
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def pairwise_common_prefix_tokens(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Every pair's :func:`common_prefix_tokens`: row ``j`` holds, for each
    ``i < j``, the tokens ``prompts[i]`` and ``prompts[j]`` share (row 0 is empty).

    With the prompts in sorted order, two prompts share the minimum of the
    prefixes shared by the neighbours between them, so only ``n - 1``
    sequences are compared; the rest is integer minima (``n`` requests:
    ``n log n`` comparisons of sequences, ``n^2`` running minima taken in C).
    """
    n = len(prompts)
    order = sorted(range(n), key=lambda k: tuple(prompts[k]))
    packed = [packed_tokens(prompts[k]) for k in order]
    neighbours = [
        common_prefix_packed(a, b)
        if a is not None and b is not None
        else common_prefix_tokens(prompts[order[r]], prompts[order[r + 1]])
        for r, (a, b) in enumerate(pairwise(packed))
    ]
    position = [0] * n
    for rank, k in enumerate(order):
        position[k] = rank
    rows: list[list[int]] = []
    for j in range(n):
        # What sorted rank ``rank`` shares with every other rank: running
        # minima of the neighbours outwards from it (in C), then picked at
        # the earlier requests' ranks.
        rank = position[j]
        below = list(accumulate(reversed(neighbours[:rank]), min))
        below.reverse()
        shared = [*below, 0, *accumulate(neighbours[rank:], min)]
        rows.append(list(map(shared.__getitem__, position[:j])))
    return rows


# Scenarios are immutable: what depends on one alone is computed once and
# kept while it is among the most recent few (keyed by identity; the entry
# holds the scenario, so its id cannot be reused meanwhile).
_MEMO_SCENARIOS = 16
_memos: OrderedDict[int, tuple[object, dict[Hashable, Any]]] = OrderedDict()


def scenario_memo(scenario: object) -> dict[Hashable, Any]:
    """A dict for quantities that depend on ``scenario`` alone (and the key),
    the same dict for the same scenario object while it is among the last 16
    asked for."""
    key = id(scenario)
    entry = _memos.get(key)
    if entry is None or entry[0] is not scenario:
        entry = _memos[key] = (scenario, {})
        while len(_memos) > _MEMO_SCENARIOS:
            _memos.popitem(last=False)
    else:
        _memos.move_to_end(key)
    return entry[1]


def written_contents(scenario: Any) -> tuple[tuple[int, ...], ...]:
    """Per request of ``scenario`` (a :class:`~differential.scenario.Scenario`),
    the content of the tokens its KV was written for and that a later prompt
    can contain: its prompt (``Scenario.contents``) and, in a multi-turn chat
    (``workload.shares_output``), its ``decode_steps + 1`` sampled tokens
    after it (``Scenario.sampled_contents``), which the next turn copies.

    A request caches the blocks it completes while decoding as well as its
    prompt's (vllm/v1/core/kv_cache_manager.py ``KVCacheManager.allocate_slots``
    caches ``min(computed + new, request.num_tokens)`` tokens each step, and
    ``Scheduler.update_from_output`` calls ``cache_blocks`` again after each
    sampled token under speculative decoding; the block hashes of decoded
    tokens are computed as the tokens arrive,
    vllm/v1/core/kv_cache_utils.py ``request_block_hasher``). Without
    ``shares_output`` no prompt contains a sampled token (every sampled token
    id is the request's own, ``Scenario.output_token``), so the prompts
    alone decide what two requests share. Computed once per scenario.
    """
    memo = scenario_memo(scenario)
    written: tuple[tuple[int, ...], ...] | None = memo.get("written_contents")
    if written is None:
        contents = scenario.contents
        if scenario.workload.shares_output:
            written = tuple(p + scenario.sampled_contents(i) for i, p in enumerate(contents))
        else:
            written = tuple(contents)
        memo["written_contents"] = written
    return written


def shared_prefixes(scenario: Any) -> list[list[int]]:
    """Row ``j``: for each earlier request ``i``, the tokens of request ``j``'s
    prompt that continue request ``i``'s written content
    (:func:`written_contents`: its prompt, and its answer in a multi-turn
    chat), i.e. the longest common prefix of prompt ``j`` and what ``i``
    wrote, in tokens, computed once per scenario.

    Prompts are compared by content (``Scenario.contents``): the token id
    and, where an image lies, its identifier and offset in it, under the
    request's cache salt, as vLLM's block hashes compare them
    (vllm/v1/core/kv_cache_utils.py ``generate_block_hash_extra_keys``). Two
    prompts with the same placeholder tokens but different images share
    only the tokens before the first differing image; different salts share
    nothing.

    Computed over whole written contents (:func:`pairwise_common_prefix_tokens`)
    and capped at prompt ``j``'s length: request ``j``'s own sampled tokens
    are its own ids, so no earlier request's content continues past its
    prompt into them, and the cap only states it."""
    memo = scenario_memo(scenario)
    rows: list[list[int]] | None = memo.get("shared_prefixes")
    if rows is None:
        written = written_contents(scenario)
        rows = pairwise_common_prefix_tokens(written)
        if scenario.workload.shares_output:
            lengths = [len(p) for p in scenario.contents]
            rows = [[min(shared, lengths[j]) for shared in row] for j, row in enumerate(rows)]
        memo["shared_prefixes"] = rows
    return rows

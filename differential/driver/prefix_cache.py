"""The prefix cache's contents as block counts, and what changed between two reads.

Both driving modes and the KV event recorder read vLLM's prefix cache
(``BlockPool.cached_block_hash_to_block``, vllm/v1/core/block_pool.py) the
same way: per cache key (block hash with group id), how many cached blocks
it holds. Comparing two reads key by key in Python costs the whole cache on
every step; :func:`changed_counts` compares them in C and touches only the
keys that changed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from itertools import compress, repeat
from typing import Any

__all__ = ["cached_blocks", "changed_counts"]


def cached_blocks(manager: Any) -> Counter[bytes]:
    """Cached block keys (hash + group id) -> number of cached blocks, of
    ``manager``'s block pool (a ``KVCacheManager``'s)."""
    cache = manager.block_pool.cached_block_hash_to_block._cache
    # A key holds one block, or a dict of the blocks sharing its hash
    # (BlockHashToBlockMap.insert): every key counts 1, in C, and only the
    # few dict-valued ones are counted again.
    counts = dict.fromkeys(cache, 1)
    for key in compress(cache, map(isinstance, cache.values(), repeat(dict))):
        counts[key] = len(cache[key])
    return Counter(counts)


def changed_counts(
    before: Mapping[Any, int], after: Mapping[Any, int]
) -> list[tuple[Any, int, int]]:
    """``(key, count before, count after)`` for every key whose block count
    differs between two :func:`cached_blocks` reads (an absent key counts 0),
    in no particular order."""
    moved = {key for key, _ in before.items() ^ after.items()}
    return [(key, before.get(key, 0), after.get(key, 0)) for key in moved]

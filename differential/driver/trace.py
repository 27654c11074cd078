"""Record how vLLM's coordinator found a request's cache hit, group by group.

The root-cause identity of a finding (:mod:`differential.triage.identity`) needs to
know where the lookup came up short: which KV cache group's
``find_longest_cache_hit`` bound the hit, with which length cap, whether it
dropped the EAGLE block, and where its matched run starts. This module wraps
the single-type managers' ``find_longest_cache_hit`` for one
``KVCacheManager.get_computed_blocks`` call and records every call in order
(the hybrid coordinator's fixed-point loop may call a group more than once).

Modelled: ``vllm/v1/core/kv_cache_coordinator.py``
``HybridKVCacheCoordinator.find_longest_cache_hit`` (calls
``manager_cls.find_longest_cache_hit`` per attention group) and
``UnitaryKVCacheCoordinator.find_longest_cache_hit`` (calls its one manager).
Nothing of vLLM is changed: the wrapper calls whatever function is installed
(the variant's patches included) and returns its result untouched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from differential.observation import GroupLookup

__all__ = ["trace_lookups"]


def _run_start_block(blocks: Any) -> int:
    """Index, in blocks, of the first non-null block of the first group's hit."""
    first = blocks[0] if blocks else []
    for index, block in enumerate(first):
        if not getattr(block, "is_null", False):
            return index
    return len(first)


def _record(calls: list[GroupLookup], result: Any, kwargs: dict[str, Any]) -> None:
    blocks, hit = result
    group_ids = kwargs.get("kv_cache_group_ids", [0])
    calls.append(
        GroupLookup(
            group=int(group_ids[0]) if group_ids else 0,
            max_length_tokens=int(kwargs.get("max_length", 0)),
            drop_eagle_block=bool(kwargs.get("drop_eagle_block", False)),
            hit_tokens=int(hit),
            run_start_block=_run_start_block(blocks),
        )
    )


def _recorder(target: Any, calls: list[GroupLookup]) -> Any:
    """A ``find_longest_cache_hit`` with ``target``'s signature that records each call."""

    def find_longest_cache_hit(*args: Any, **kwargs: Any) -> Any:
        result = target(*args, **kwargs)
        _record(calls, result, kwargs)
        return result

    return find_longest_cache_hit


# The lists the traced subclasses append to: the innermost trace_lookups block's.
_sinks: list[list[GroupLookup]] = []
# Base manager class -> its traced subclass, made once per process.
_traced: dict[type, type] = {}


def _traced_class(base: type) -> type:
    """The subclass of ``base`` whose ``find_longest_cache_hit`` records into the
    innermost :func:`trace_lookups` block (made once per base class).

    It calls ``base.find_longest_cache_hit`` as installed at call time, so a
    variant's patch of the base class (installed around each run) is honoured.
    """
    subclass = _traced.get(base)
    if subclass is None:

        def find_longest_cache_hit(*args: Any, **kwargs: Any) -> Any:
            result = base.find_longest_cache_hit(*args, **kwargs)  # type: ignore[attr-defined]
            if _sinks:
                _record(_sinks[-1], result, kwargs)
            return result

        subclass = _traced[base] = type(
            f"Traced{base.__name__}",
            (base,),
            {"find_longest_cache_hit": staticmethod(find_longest_cache_hit)},
        )
    return subclass


@contextmanager
def trace_lookups(coordinator: Any) -> Iterator[list[GroupLookup]]:
    """Record every single-type lookup ``coordinator`` makes inside the block.

    Args:
        coordinator: ``KVCacheManager.coordinator`` (hybrid or unitary).

    Yields:
        The list the calls are appended to, in call order.

    Both coordinators call their managers with keyword arguments, which is
    what the recorder reads. A coordinator of another shape is left alone
    (nothing is recorded).
    """
    calls: list[GroupLookup] = []
    groups = getattr(coordinator, "attention_groups", None)
    if isinstance(groups, list) and groups and hasattr(groups[0], "manager_cls"):
        # Hybrid: swap each group's manager class for its subclass that records.
        coordinator.attention_groups = [
            group._replace(manager_cls=_traced_class(group.manager_cls)) for group in groups
        ]
        _sinks.append(calls)
        try:
            yield calls
        finally:
            _sinks.pop()
            coordinator.attention_groups = groups
        return
    managers: Sequence[Any] = getattr(coordinator, "single_type_managers", ())
    if len(managers) == 1:
        manager = managers[0]
        # An instance attribute shadows the classmethod for this one manager.
        manager.find_longest_cache_hit = _recorder(manager.find_longest_cache_hit, calls)
        try:
            yield calls
        finally:
            del manager.find_longest_cache_hit
        return
    yield calls

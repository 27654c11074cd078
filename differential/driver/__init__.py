"""The vLLM driver: the only part of kvfuzz that imports vLLM.

Importing this package imports nothing of vLLM: its names are loaded on first
use (``run_variant`` and ``VLLM_VERSION`` import vLLM, about 4.5 s; import
them once per process and reuse them across scenarios). Variant code (the
seed fix, mutants) is imported only when a variant that uses it runs, so a
tree worker running another vLLM release never imports it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from differential.errors import VariantError
from differential.observation import RunObservation
from differential.scenario import DriveMode, Scenario
from differential.variant import Variant

if TYPE_CHECKING:
    from differential.driver.fix_probes import FixStatus, fix_status
    from differential.driver.runner import VLLM_VERSION

__all__ = [
    "VLLM_VERSION",
    "FixStatus",
    "fix_status",
    "patch_context",
    "run_variant",
    "runs_as_stock",
]

_DENSE = None

# Names loaded on first use: name -> (module, attribute).
_LAZY = {
    "VLLM_VERSION": ("differential.driver.runner", "VLLM_VERSION"),
    "FixStatus": ("differential.driver.fix_probes", "FixStatus"),
    "fix_status": ("differential.driver.fix_probes", "fix_status"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _resolve(path: str) -> Any:
    """The function a ``"module:function"`` path names (a variant's ``patch``
    or ``stock_when``), importing its module."""
    module, _, function = path.partition(":")
    return getattr(importlib.import_module(module), function)


def _patch_factory(variant: Variant) -> Callable[[], AbstractContextManager[None]]:
    if not variant.patch:
        return nullcontext
    factory: Callable[[], AbstractContextManager[None]] = _resolve(variant.patch)
    return factory


def runs_as_stock(scenario: Scenario, variant: Variant, *, dense: bool = False) -> bool:
    """Whether ``variant`` runs ``scenario`` (``dense``: its dense cross-check,
    retention ``None``) exactly as the installed vLLM does: no patch, or a
    patch whose ``stock_when`` predicate holds for the run. Never for a
    tree, which is another vLLM."""
    if variant.tree is not None:
        return False
    if not variant.patch:
        return True
    if not variant.stock_when:
        return False
    predicate: Callable[[Scenario, int | None], bool] = _resolve(variant.stock_when)
    return predicate(scenario, None if dense else scenario.retention_interval_tokens)


def patch_context(variant: Variant) -> AbstractContextManager[None]:
    """A context manager that installs ``variant``'s patches (none for ``unfixed``)."""
    return _patch_factory(variant)()


def run_variant(
    scenario: Scenario,
    variant: Variant,
    *,
    dense: bool = False,
    record_cache_map: bool = False,
    record_blocks: bool = True,
    mode: DriveMode | None = None,
) -> RunObservation:
    """Run ``scenario`` on ``variant`` with its patches installed only for the run.

    The scenario's ``workload.mode`` picks the driver (manager-level
    :mod:`differential.driver.runner`, or vLLM's ``Scheduler`` in
    :mod:`differential.driver.scheduler_mode`); ``mode`` overrides it. Both
    run under the same patches.

    Args:
        scenario: the scenario.
        variant: the variant to run.
        dense: run with retention ``None`` instead of the scenario's own
            retention interval (the oracle's dense cross-check).
        record_cache_map: record which prompt blocks were cached at each
            lookup (see ``RequestObservation.cache_map``).
        mode: the driving mode, overriding the scenario's.

    Raises:
        InternalError: kvfuzz's driver failed (not vLLM).
        VariantError: ``variant`` is a tree variant, which runs in its own
            worker process (``differential.compare.run_any``), never here:
            this process's vLLM is the installed one.
    """
    if variant.tree is not None:
        raise VariantError(
            f"variant {variant.name!r} is a tree: it runs in its worker process "
            "(differential.compare.run_any), not in this one"
        )
    with _patch_factory(variant)():
        run = _run_variant(
            scenario,
            dense=dense,
            record_cache_map=record_cache_map,
            record_blocks=record_blocks,
            mode=mode,
            name=variant.name,
        )
        if scenario.model is None:
            return run
        from differential.driver.planner import with_kv_cache_plan

        return with_kv_cache_plan(scenario, run)


def _run_variant(
    scenario: Scenario,
    *,
    dense: bool,
    record_cache_map: bool,
    record_blocks: bool,
    mode: DriveMode | None,
    name: str,
) -> RunObservation:
    """:func:`run_variant`'s run, under the variant's patches."""
    from differential.driver.runner import run_scenario

    if (mode or scenario.workload.mode) is DriveMode.SCHEDULER:
        from differential.driver.scheduler_mode import run_scheduler_scenario

        if dense:
            return run_scheduler_scenario(
                scenario,
                name,
                retention_interval_tokens=_DENSE,
                record_cache_map=record_cache_map,
            )
        return run_scheduler_scenario(scenario, name, record_cache_map=record_cache_map)
    if dense:
        return run_scenario(
            scenario,
            name,
            retention_interval_tokens=_DENSE,
            record_cache_map=record_cache_map,
            record_blocks=record_blocks,
        )
    return run_scenario(
        scenario,
        name,
        record_cache_map=record_cache_map,
        record_blocks=record_blocks,
    )

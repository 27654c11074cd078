"""Record what vLLM reports about its own cache: statistics, usage, resets.

Both drivers build vLLM with ``log_stats=True`` (the engine's default unless
``--disable-log-stats``), so the prefix-cache statistics an operator's hit-rate
dashboard reads are kept (``PrefixCacheStats``, vllm/v1/metrics/stats.py).
The recorder sums every drain of them (``Scheduler.make_stats``, which
vLLM's own ``update_from_output`` calls each step, or
``KVCacheManager.make_prefix_cache_stats``), drains them itself at each
reset and after the run, and reads ``KVCacheManager.usage`` after each
scheduler step. It also calls ``reset_prefix_cache`` as an RLHF
weight update does: once while requests hold KV blocks (scheduler mode: after
the first step that admits a request still running after it; manager mode:
after the first request's prefill), which must be refused and change
nothing, and once after the run, which must empty the prefix cache, and,
with a KV connector, the connector's cache too (``reset_connector=True``).
In scheduler mode it reads every ``EngineCoreOutput.prefill_stats`` that
``Scheduler.update_from_output`` returns: the prompt, local and external
cached tokens a request's usage reports (``RequestOutput.num_cached_tokens``,
the OpenAI API's ``prompt_tokens_details.cached_tokens``).
The oracle judges it all (:mod:`differential.oracle.metrics`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from differential.driver.prefix_cache import cached_blocks
from differential.observation import CacheMetrics, PrefixCacheCounts, ResetCall

__all__ = ["MetricsRecorder"]

# The loggers of vLLM's reset path: a refused reset warns ("Failed to reset
# prefix cache because some blocks ... are not freed yet"), a granted one
# informs; both are the probe's expected answers, not news for the console.
_RESET_LOGGERS = ("vllm.v1.core.block_pool", "vllm.v1.core.sched.scheduler")


def _counts(stats: Any) -> PrefixCacheCounts:
    """A ``PrefixCacheStats`` as plain counts (an absent one: zeros)."""
    if stats is None:
        return PrefixCacheCounts()
    return PrefixCacheCounts(
        stats.requests,
        stats.queries,
        stats.hits,
        getattr(stats, "preempted_requests", 0),
        getattr(stats, "preempted_queries", 0),
        getattr(stats, "preempted_hits", 0),
    )


class MetricsRecorder:
    """Drains the prefix-cache statistics and probes ``reset_prefix_cache``
    (see the module docstring).

    Args:
        manager: vLLM's ``KVCacheManager`` (built with ``log_stats=True``).
        scheduler: vLLM's ``Scheduler`` driving it, or ``None`` (manager mode).
    """

    def __init__(self, manager: Any, scheduler: Any = None) -> None:
        self.manager = manager
        self.scheduler = scheduler
        self.stats = PrefixCacheCounts()
        # The KV connector's statistics (Scheduler.connector_prefix_cache_stats),
        # None without a connector.
        self.connector_stats: PrefixCacheCounts | None = None
        self.usage: list[float] = []
        self.usage_end: float | None = None
        self.resets: list[ResetCall] = []
        self._pending_flag: list[int] = []  # indices of resets whose flag is read next
        # Indices of connector resets whose connector-statistics flag is read next.
        self._pending_connector_flag: list[int] = []
        # (request id, prompt, local cached, external cached) per prefill_stats read.
        self._prefill: list[tuple[str, int, int, int]] = []
        if scheduler is not None:
            # update_from_output drains the statistics itself, into the
            # outputs it returns (EngineCoreOutputs.scheduler_stats): every
            # make_stats call is counted, the driver's own and vLLM's.
            make_stats = scheduler.make_stats

            def counted(*args: Any, **kwargs: Any) -> Any:
                made = make_stats(*args, **kwargs)
                self._add(None if made is None else made.prefix_cache_stats)
                connector = getattr(made, "connector_prefix_cache_stats", None)
                if connector is not None:
                    self.connector_stats = (self.connector_stats or PrefixCacheCounts()) + _counts(
                        connector
                    )
                    for k in self._pending_connector_flag:
                        self.resets[k] = dataclasses.replace(
                            self.resets[k], connector_flagged=bool(connector.reset)
                        )
                    self._pending_connector_flag.clear()
                return made

            scheduler.make_stats = counted
            update_from_output = scheduler.update_from_output

            def reported(*args: Any, **kwargs: Any) -> Any:
                outputs = update_from_output(*args, **kwargs)
                self._read_prefill_stats(outputs)
                return outputs

            scheduler.update_from_output = reported

    def _read_prefill_stats(self, outputs: Any) -> None:
        """Keep each ``EngineCoreOutput.prefill_stats`` in ``outputs`` (per
        client, ``EngineCoreOutputs``), in the order returned."""
        for client in (outputs or {}).values():
            for output in getattr(client, "outputs", ()):
                stats = getattr(output, "prefill_stats", None)
                if stats is not None:
                    self._prefill.append(
                        (
                            output.request_id,
                            stats.num_prompt_tokens,
                            stats.num_local_cached_tokens,
                            stats.num_external_cached_tokens,
                        )
                    )

    def _add(self, stats: Any) -> None:
        """Sum one read of the statistics; the first read after a reset
        carries its flag."""
        self.stats += _counts(stats)
        if self._pending_flag:
            flagged = None if stats is None else bool(stats.reset)
            for k in self._pending_flag:
                self.resets[k] = dataclasses.replace(self.resets[k], flagged=flagged)
            self._pending_flag.clear()

    def read_usage(self) -> None:
        """Read ``KVCacheManager.usage`` (after a step: in scheduler mode
        vLLM's own ``update_from_output`` drains the statistics, counted by
        the wrapped ``make_stats``)."""
        self.usage.append(float(self.manager.usage))

    def drain(self) -> None:
        """Read and sum the statistics since the last read (vLLM resets them
        on each read), and the usage."""
        if self.scheduler is not None:
            self.scheduler.make_stats()
        else:
            self._add(self.manager.make_prefix_cache_stats())
        self.read_usage()

    def reset(self, step: int | None, holding: int, reset_connector: bool = False) -> None:
        """Call ``reset_prefix_cache`` (the scheduler's, else the manager's;
        with ``reset_connector`` the scheduler's KV connector's cache too)
        and record what it returned and the cache it left; ``holding``: the
        requests holding KV blocks by the driver's count."""
        owner = self.scheduler if self.scheduler is not None else self.manager
        loggers = [logging.getLogger(name) for name in _RESET_LOGGERS]
        disabled = [logger.disabled for logger in loggers]
        for logger in loggers:
            logger.disabled = True
        try:
            if reset_connector:
                returned = bool(owner.reset_prefix_cache(reset_connector=True))
            else:
                returned = bool(owner.reset_prefix_cache())
        finally:
            for logger, was in zip(loggers, disabled, strict=True):
                logger.disabled = was
        cached = sum(cached_blocks(self.manager).values())
        held = getattr(getattr(owner, "connector", None), "held_tokens", None)
        call = ResetCall(step, holding, returned, cached)
        if reset_connector:
            call = dataclasses.replace(call, store_held_after=None if held is None else held())
            self._pending_connector_flag.append(len(self.resets))
        self.resets.append(call)
        self._pending_flag.append(len(self.resets) - 1)
        self.drain()

    def finish(self) -> None:
        """After the run, every request finished: drain, read the final
        usage, then reset the prefix cache, and a KV connector's cache with
        it as an RLHF weight update does (``reset_connector=True``)."""
        self.drain()
        self.usage_end = self.usage[-1]
        connector = getattr(self.scheduler, "connector", None) if self.scheduler else None
        self.reset(None, 0, reset_connector=connector is not None)

    def metrics(self, index_of: Mapping[str, int] | None = None) -> CacheMetrics:
        """What was recorded (:class:`~differential.observation.CacheMetrics`);
        ``index_of`` maps vLLM request ids to scenario indices for the prefill
        reports (``None``: manager mode, none read)."""
        prefill = None
        if self.scheduler is not None and index_of is not None:
            prefill = tuple(
                (index_of[rid], prompt, local, external)
                for rid, prompt, local, external in self._prefill
                if rid in index_of
            )
        return CacheMetrics(
            stats=self.stats,
            connector_stats=self.connector_stats,
            usage_min=min(self.usage, default=0.0),
            usage_max=max(self.usage, default=0.0),
            usage_end=self.usage_end,
            resets=tuple(self.resets),
            prefill_reports=prefill,
        )

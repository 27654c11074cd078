"""The smallest pool at which a variant still serves every hit of a workload.

A fix that keeps more blocks costs pool space; under memory pressure that
space is paid in hits (``pool-regression``). This module puts a number on it
for a scheduler-mode workload: per variant, the smallest
``workload.pool_blocks`` (in blocks, vLLM's null block included) at which the
variant still gives every request at least the hit it gives with a pool that
holds everything (:func:`differential.driver.specs.pool_blocks`, the pool a
scenario without ``pool_blocks`` runs with).

It is found by bisection over the pool with real runs (vLLM's ``Scheduler``,
``vllm/v1/core/sched/scheduler.py``): between a pool known to serve (the
roomy one) and one known not to (0), halve until they are one block apart.
Serving is not always monotone in the pool (which request's blocks are
evicted first moves with it), so the answer is a pool that serves whose next
smaller one does not, found in about ``log2(roomy pool)`` runs; on a
workload whose service only grows with the pool it is the smallest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from differential.errors import ScenarioError
from differential.observation import RunObservation
from differential.scenario import DriveMode, Scenario
from differential.variants import Variant

__all__ = ["PoolNeed", "pool_needs", "render_pool_needs", "smallest_serving_pool"]


@dataclass(frozen=True)
class PoolNeed:
    """What pool one variant needs to serve a workload's hits.

    Attributes:
        variant: the variant.
        owed_hit_tokens: per request the roomy run looked up, in index order,
            its hit there, in tokens.
        roomy_pool_blocks: the pool that holds everything, in blocks.
        smallest_pool_blocks: the smallest pool found serving every owed hit,
            in blocks; ``None`` when the roomy run itself failed.
        runs: the runs the bisection made, the roomy one included.
    """

    variant: str
    owed_hit_tokens: tuple[int, ...]
    roomy_pool_blocks: int
    smallest_pool_blocks: int | None
    runs: int

    def summary(self) -> str:
        """One line, e.g. ``candidate: 42 blocks serve every hit (224 tokens; roomy 130)``."""
        if self.smallest_pool_blocks is None:
            return f"{self.variant}: the roomy pool ({self.roomy_pool_blocks} blocks) did not run"
        return (
            f"{self.variant}: {self.smallest_pool_blocks} blocks serve every hit "
            f"({sum(self.owed_hit_tokens)} tokens; roomy pool {self.roomy_pool_blocks} blocks, "
            f"{self.runs} runs)"
        )

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "variant": self.variant,
            "owed_hit_tokens": list(self.owed_hit_tokens),
            "roomy_pool_blocks": self.roomy_pool_blocks,
            "smallest_pool_blocks": self.smallest_pool_blocks,
            "runs": self.runs,
        }


def _with_pool(scenario: Scenario, pool_blocks: int | None) -> Scenario:
    return dataclasses.replace(
        scenario, workload=dataclasses.replace(scenario.workload, pool_blocks=pool_blocks)
    )


def _serves(run: RunObservation, owed: Mapping[int, int]) -> bool:
    """Whether ``run`` looked up the requests the roomy run did (``owed``:
    request index to its hit there, in tokens), each hitting at least that."""
    if run.error is not None or run.unsupported is not None:
        return False
    hits = {r.index: r.hit_tokens for r in run.requests}
    return hits.keys() == owed.keys() and all(hits[i] >= h for i, h in owed.items())


def smallest_serving_pool(scenario: Scenario, variant: Variant) -> PoolNeed | None:
    """Bisect the pool for ``variant`` on ``scenario`` (see the module docstring).

    Args:
        scenario: a scheduler-mode scenario (its own ``pool_blocks`` is
            ignored: the roomy pool and the bisection replace it).
        variant: the variant to run.

    Returns:
        The variant's need, or ``None`` for a manager-mode scenario (that
        driver never evicts: a pool too small is bad input there) or when the
        variant does not support the scenario.

    Raises:
        InternalError: kvfuzz's driver failed in one of the runs.
    """
    from differential.compare import run_any

    if scenario.workload.mode is not DriveMode.SCHEDULER:
        return None
    roomy = run_any(_with_pool(scenario, None), variant)
    if roomy.unsupported is not None:
        return None
    runs = 1
    # Per request the roomy run looked up (not one its client aborted before
    # admission, nor one vLLM failed before it: RunObservation.errored).
    owed = {r.index: r.hit_tokens for r in sorted(roomy.requests, key=lambda r: r.index)}
    if roomy.error is not None or not owed:
        return PoolNeed(variant.name, tuple(owed.values()), roomy.pool_blocks, None, runs)
    serving, failing = roomy.pool_blocks, 0
    while serving - failing > 1:
        middle = (serving + failing) // 2
        try:
            ok = _serves(run_any(_with_pool(scenario, middle), variant), owed)
        except ScenarioError:
            ok = False  # a pool the scenario's own rules refuse
        runs += 1
        if ok:
            serving = middle
        else:
            failing = middle
    return PoolNeed(variant.name, tuple(owed.values()), roomy.pool_blocks, serving, runs)


def pool_needs(scenario: Scenario, variants: Sequence[Variant]) -> tuple[PoolNeed, ...]:
    """:func:`smallest_serving_pool` for each variant that supports the scenario."""
    needs = (smallest_serving_pool(scenario, v) for v in variants)
    return tuple(n for n in needs if n is not None)


def render_pool_needs(needs: Sequence[PoolNeed]) -> list[str]:
    """Text lines: a heading, then one :meth:`PoolNeed.summary` per variant."""
    if not needs:
        return []
    return [
        "smallest pool serving every hit (bisection over workload.pool_blocks):",
        *(f"  {n.summary()}" for n in needs),
    ]

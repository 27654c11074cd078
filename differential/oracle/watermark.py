"""The KV cache watermark: an admission beside running requests leaves it free.

vLLM PR #44594 ("Add kvcache watermark to reduce preemptions", after the
first engine's PR #11): ``SchedulerConfig.watermark`` is the fraction of the
pool's blocks "to reserve as buffer when allocating new request blocks",
which "does not apply to first new request when cache is empty".
``KVCacheManager.__init__`` (vllm/v1/core/kv_cache_manager.py) turns it into
``watermark_blocks = int(watermark * num_blocks)``, the "minimum number of KV
cache blocks to keep free when admitting waiting/preempted requests, to avoid
frequent preemptions", and ``allocate_slots`` applies it to a waiting or
preempted request when ``has_scheduled_reqs`` (``Scheduler.schedule`` passes
``bool(self.running)``). So, in scheduler mode, for every such admission:

    free blocks right after the admitting allocate_slots (blocks) >= int(w * pool blocks)

An admission that leaves fewer is a ``watermark`` finding naming the request,
the step and both counts: the request crowds out the headroom the running
ones were promised, the preemptions the watermark exists to prevent. The
driver records these admissions only when the scenario sets a watermark
(``RunObservation.watermark_admissions``). Nothing here imports vLLM.
"""

from __future__ import annotations

from differential.findings import Finding, FindingKind, Policy
from differential.observation import RunObservation
from differential.scenario import Scenario

__all__ = ["watermark_blocks", "watermark_findings"]


def watermark_blocks(scenario: Scenario, pool_blocks: int) -> int:
    """The blocks vLLM keeps free: ``int(workload.watermark * pool_blocks)``
    (``KVCacheManager.__init__``), in blocks."""
    return int(scenario.workload.watermark * pool_blocks)


def watermark_findings(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM
) -> list[Finding]:
    """One ``watermark`` finding per admission of a waiting or preempted
    request, made while others were scheduled, that left fewer free blocks
    than the watermark.

    Args:
        scenario: the scenario (its ``workload.watermark``, a fraction).
        run: a scheduler-mode run (its ``pool_blocks`` and
            ``watermark_admissions``: request, step, free blocks after).
        policy: the policy recorded on the findings (the rule holds under all).
    """
    keep = watermark_blocks(scenario, run.pool_blocks)
    return [
        Finding(
            FindingKind.WATERMARK,
            run.variant,
            request,
            f"step {step}: admitted beside scheduled requests, leaving {free} free blocks, "
            f"below the watermark of {keep} (int({scenario.workload.watermark} x "
            f"{run.pool_blocks} blocks))",
            policy=policy,
        )
        for request, step, free in run.watermark_admissions
        if free < keep
    ]

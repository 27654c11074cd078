"""What the seed and candidate fixes leave unchanged, asked without installing them.

The ``stock_when`` predicates of the ``fixed`` and ``candidate`` variants
(:func:`seed_pr_runs_as_stock`, :func:`candidate_runs_as_stock`) and the probe
of the installed vLLM for the seed fix (:func:`fix_status`). They read the
manager driver's settings (:func:`~differential.driver.settings.resolve_drafter`)
and run scenarios, so they live apart from the patches themselves
(:mod:`differential.driver.fixes`, :mod:`differential.driver.candidate`),
which vLLM's real engine imports in its own worker.
"""

from __future__ import annotations

import dataclasses

from differential.capabilities import Unsupported
from differential.driver.features import VllmCallError
from differential.driver.fixes import PATCH_LOCK
from differential.driver.settings import resolve_drafter
from differential.scenario import DrafterKind, Scenario

__all__ = ["FixStatus", "candidate_runs_as_stock", "fix_status", "seed_pr_runs_as_stock"]


def seed_pr_runs_as_stock(scenario: Scenario, retention_interval_tokens: int | None) -> bool:
    """Whether the seed PR's two changes leave a run exactly as the installed
    vLLM runs it: the drop wrapper changes only Gemma-4 MTP
    (``use_gemma4_mtp()``, the ``gemma4_mtp`` drafter kind), and the mask
    wrapper widens only under a positive retention interval and the EAGLE
    drop (:func:`~differential.driver.fixes.seed_pr_widens`), so a run of any
    other drafter is the stock run when its retention ``retention_interval_tokens`` is ``None``
    (the dense cross-check) or 0, or when vLLM's config does not drop the
    last matched block for the scenario's drafter
    (:func:`~differential.driver.settings.resolve_drafter`: no drafter,
    lookahead hashes, or the drop disabled). A drafter vLLM's config refuses
    proves nothing: the run is made."""
    if scenario.drafter.kind is DrafterKind.GEMMA4_MTP:
        return False
    if not retention_interval_tokens:
        return True
    try:
        return not resolve_drafter(scenario).use_eagle_block_drop
    except (VllmCallError, Unsupported):
        return False


def candidate_runs_as_stock(scenario: Scenario, retention_interval_tokens: int | None) -> bool:
    """Whether the candidate leaves a run exactly as the installed vLLM runs
    it: the seed PR's changes do (:func:`seed_pr_runs_as_stock`) and the
    one-unit widening is off, which needs retention
    ``retention_interval_tokens`` ``None`` (the candidate widens under any
    other retention: retention 0 keeps replay-boundary tails it widens)."""
    return retention_interval_tokens is None and seed_pr_runs_as_stock(scenario, None)


@dataclasses.dataclass(frozen=True)
class FixStatus:
    """Whether the installed vLLM already contains each part of the seed fix.

    Attributes:
        gemma4_no_drop: ``needs_eagle_block_drop()`` is already ``False`` for
            Gemma-4 MTP.
        widened_tails: ``reachable_block_mask`` already keeps the wider
            periodic tails.
    """

    gemma4_no_drop: bool
    widened_tails: bool

    @property
    def complete(self) -> bool:
        """Both parts are already in the installed vLLM."""
        return self.gemma4_no_drop and self.widened_tails


def fix_status() -> FixStatus:
    """Probe the installed, unpatched vLLM for the seed fix, by behaviour.

    * Gemma-4 MTP: does ``resolve_drafter`` still turn the EAGLE drop on?
    * Widened tails: a toy hybrid (full block 8, SWA block 4, window 8,
      retention 32, MTP with the drop) caches a 68-token writer, then a sibling
      diverging at token 33, right after the checkpoint at 32. With the wider
      periodic tail it hits at 24 (``32 - A``); stock 0.33.0 falls back to 0.
    """
    from differential.driver.runner import run_scenario
    from differential.scenario import Drafter, GroupKind, KVCacheGroup, RequestSpec

    def probe(kind: DrafterKind) -> Scenario:
        return Scenario(
            kv_cache_groups=(
                KVCacheGroup(GroupKind.FULL_ATTENTION, 8),
                KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, 8),
            ),
            requests=(RequestSpec(64, 4), RequestSpec(33, 4)),
            shared_prefix_tokens=64,
            retention_interval_tokens=32,
            drafter=Drafter(kind, 1),
            disable_lookahead_block_hashes=True,
            prefill_chunk_tokens=16,
        )

    with PATCH_LOCK:
        gemma4_no_drop = not resolve_drafter(probe(DrafterKind.GEMMA4_MTP)).use_eagle_block_drop
        sibling = run_scenario(probe(DrafterKind.MTP), "probe").hits[-1:]
        return FixStatus(gemma4_no_drop=gemma4_no_drop, widened_tails=sibling == (24,))

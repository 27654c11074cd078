"""The candidate fix kvfuzz proposes upstream: one unit below every retained boundary.

The ``candidate`` variant is ``fixed`` (the seed PR) plus one more thin
wrapper around ``SlidingWindowManager.reachable_block_mask``
(``vllm/v1/core/single_type_kv_cache_manager.py``): under sparse retention
(a retention interval other than ``None`` and the hit alignment ``A``) every
SWA tail the mask keeps, periodic, replay boundary or shared-prefix junction,
is kept ``A / B_swa`` blocks wider, whatever the drafter and protection. A
sibling whose hit lands one alignment unit below a retained boundary ``b``
then finds the run it needs: the tail for ``b - A`` ends ``A / B_swa`` blocks
lower than the one for ``b`` and is contained in the widened one.

It closes the whole one-unit class with one rule: the seed PR's periodic
widening under the EAGLE drop, vLLM PR #57613's replay-boundary widening
without a drafter (issue #57610), and the same for junctions and for periodic
checkpoints without the drop. Dense retention is unchanged (every multiple of
``A`` is a checkpoint already).

As in :mod:`differential.driver.fixes`, the widening is the union of vLLM's
own mask with vLLM's own mask for a window ``A`` tokens wider, so a change to
vLLM's mask moves the candidate too.

* ``mutant-no-replay-widening`` (calibration): the candidate with only the
  periodic tails widened, not the replay-boundary and junction tails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

from differential.driver.fixes import patched, seed_pr_fix, widening_mask

__all__ = ["candidate_fix", "mutant_no_replay_widening"]


def _one_unit_widens(retention: int | None, alignment: int | None, use_eagle: bool) -> bool:
    """Sparse retention (an interval other than ``None`` and the hit
    alignment), whatever the drafter."""
    return retention is not None and retention != alignment


def _installed_mask() -> Callable[..., list[bool] | None]:
    return SlidingWindowManager.__dict__["reachable_block_mask"].__func__  # type: ignore[no-any-return]


@contextmanager
def _seed_fix_widened(*, boundaries: bool) -> Iterator[None]:
    """The seed PR's fix with the one-unit widening installed over its mask."""
    original = _installed_mask()
    with seed_pr_fix():
        # ``original`` answers for the wider window, so the seed PR's periodic
        # widening is not applied twice.
        wider = widening_mask(
            _installed_mask(),
            original,
            widens=_one_unit_widens,
            boundaries=boundaries,
            final_segment=boundaries,
        )
        with patched(((SlidingWindowManager, "reachable_block_mask", classmethod(wider)),)):
            yield


def candidate_fix() -> AbstractContextManager[None]:
    """Context manager: the seed PR's fix plus the one-unit widening of every tail."""
    return _seed_fix_widened(boundaries=True)


def mutant_no_replay_widening() -> AbstractContextManager[None]:
    """The candidate with only periodic tails widened (replay and junction tails not)."""
    return _seed_fix_widened(boundaries=False)

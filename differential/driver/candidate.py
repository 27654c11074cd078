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

Where the drop is off (DSpark, DFlash, no drafter, or a drafter protected by
lookahead hashes) it keeps only what the one-unit rule needs there: for each
retained boundary ``b``, the tail a hit at ``b - A`` reads, which is vLLM's
own tail for ``b`` moved ``A / B_swa`` blocks lower. It does not keep the
blocks between the two tails (they serve no hit on a multiple of ``A`` when
the tail, ``ceil((W - 1) / B_swa)`` blocks, is shorter than ``A / B_swa``),
nor a wider tail at the end of the request's final segment (vLLM keeps that
one without the drop, ``final_segment_end_block``, but it is not a retained
boundary of the rule: ``differential/oracle/core.py`` ``checkpoints``). A
lower tail that falls inside blocks the request adopted from its hit costs
nothing: vLLM masks newly cached blocks only. Under the drop it is the seed
PR's contiguous widening, applied to every tail.

As in :mod:`differential.driver.fixes`, both are vLLM's own mask, for a
window ``A`` tokens wider (under the drop) or for the block range ``A /
B_swa`` blocks higher (without it), ORed with the installed one, so a change
to vLLM's mask moves the candidate too.

* ``mutant-no-replay-widening`` (calibration): the candidate with only the
  periodic tails widened, not the replay-boundary and junction tails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import KVCacheSpec

from differential.driver.fixes import installed_mask, patched, seed_pr_fix, widening_mask

__all__ = ["candidate_fix", "mutant_no_replay_widening"]


def _one_unit_widens(retention: int | None, alignment: int | None, use_eagle: bool) -> bool:
    """Sparse retention (an interval other than ``None`` and the hit
    alignment), whatever the drafter."""
    return retention is not None and retention != alignment


Mask = Callable[..., list[bool] | None]


def one_unit_mask(current: Mask, original: Mask, *, boundaries: bool) -> Mask:
    """The candidate's ``reachable_block_mask``: ``current``'s answer plus,
    under sparse retention, the tails a hit one unit below each retained
    boundary reads (see the module docstring).

    Under the drop, ``current``'s answer ORed with ``original``'s (vLLM's own)
    for a window ``A`` tokens wider (:func:`~differential.driver.fixes.widening_mask`).
    Without it, ORed with ``original``'s answer for the blocks ``[start +
    A / B, end + A / B)``, read ``A / B`` blocks lower, and without the final
    segment. ``boundaries``: also the replay-boundary and junction tails, not
    only the periodic ones.
    """
    wider = widening_mask(
        current, original, widens=_one_unit_widens, boundaries=boundaries, final_segment=boundaries
    )

    def mask(
        cls: type[SlidingWindowManager],
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        arguments = (
            cls,
            start_block,
            end_block,
            alignment_tokens,
            kv_cache_spec,
            use_eagle,
            retention_interval,
            reachable_boundaries,
            dcp_world_size,
            final_segment_end_block,
        )
        if use_eagle:
            return wider(*arguments)
        kept = current(*arguments)
        if (
            kept is None
            or alignment_tokens is None
            or not _one_unit_widens(retention_interval, alignment_tokens, use_eagle)
        ):
            return kept
        # vLLM's mask is None (every block) unless A is a multiple of the
        # (DCP-scaled) block size, so the shift is a whole number of blocks.
        shift = alignment_tokens // (kv_cache_spec.block_size * dcp_world_size)
        lower = original(
            cls,
            start_block + shift,
            end_block + shift,
            alignment_tokens,
            kv_cache_spec,
            use_eagle,
            retention_interval,
            reachable_boundaries if boundaries else (),
            dcp_world_size,
            None,
        )
        if lower is None:
            return None
        return [a or b for a, b in zip(kept, lower, strict=True)]

    return mask


@contextmanager
def _seed_fix_widened(*, boundaries: bool) -> Iterator[None]:
    """The seed PR's fix with the one-unit widening installed over its mask.

    Raises:
        Unsupported: on entry, the installed vLLM lacks a method the fixes wrap.
    """
    original = installed_mask()
    with seed_pr_fix():
        # ``original`` answers for the wider window, so the seed PR's periodic
        # widening is not applied twice.
        candidate = one_unit_mask(installed_mask(), original, boundaries=boundaries)
        with patched(((SlidingWindowManager, "reachable_block_mask", classmethod(candidate)),)):
            yield


def candidate_fix() -> AbstractContextManager[None]:
    """Context manager: the seed PR's fix plus the one-unit widening of every tail."""
    return _seed_fix_widened(boundaries=True)


def mutant_no_replay_widening() -> AbstractContextManager[None]:
    """The candidate with only periodic tails widened (replay and junction tails not)."""
    return _seed_fix_widened(boundaries=False)

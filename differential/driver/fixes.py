"""The seed PR's two changes, as thin wrappers around vLLM's own functions.

The ``fixed`` variant runs the installed vLLM with these wrappers in place:

1. ``SpeculativeConfig.needs_eagle_block_drop`` returns ``False`` for the
   Gemma-4 MTP drafter, which writes no draft KV (``use_gemma4_mtp()``), as it
   already does for DFlash and DSpark.
2. ``SlidingWindowManager.reachable_block_mask`` keeps each *periodic* SWA tail
   ``alignment_tokens // block_size`` blocks wider when the EAGLE drop is on
   and retention is sparse (a positive retention interval other than the hit
   alignment). Dense retention, retention 0 and runs without the drop are
   unchanged, and so are the replay-boundary and junction tails.

Both wrappers call the original vLLM function and only post-process its
answer. The widening is the union of vLLM's own mask with vLLM's own periodic
mask for a window ``alignment_tokens`` tokens wider: a tail of
``ceil((window - 1) / block) + 1`` blocks becomes one of
``ceil((window + A - 1) / block) + 1 = previous + A / block`` blocks, ending on
the same peek block.

Patching is process-global, so :func:`patched` serialises variants with a lock
and restores the originals on exit: no patch leaks into another variant.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vllm.config import SpeculativeConfig
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import KVCacheSpec, SlidingWindowSpec

from differential.capabilities import Unsupported
from differential.driver.features import VllmCallError
from differential.driver.settings import resolve_drafter
from differential.scenario import DrafterKind, Scenario

__all__ = [
    "FixStatus",
    "fix_status",
    "patched",
    "seed_pr_fix",
    "seed_pr_runs_as_stock",
    "union_with_wider_window",
    "widening_mask",
]

_LOCK = threading.RLock()

_original_needs_drop: Callable[[SpeculativeConfig], bool] = SpeculativeConfig.needs_eagle_block_drop
_original_mask: Callable[..., list[bool] | None] = (
    SlidingWindowManager.reachable_block_mask.__func__
)


def _needs_eagle_block_drop(self: SpeculativeConfig) -> bool:
    return _original_needs_drop(self) and not self.use_gemma4_mtp()


def widening_mask(
    current: Callable[..., list[bool] | None],
    original: Callable[..., list[bool] | None],
    *,
    widens: Callable[[int | None, int | None, bool], bool],
    boundaries: bool,
    final_segment: bool,
) -> Callable[..., list[bool] | None]:
    """A ``reachable_block_mask`` whose tails are ``A / B`` blocks wider where ``widens``.

    ``current`` is the mask answered first; where ``widens(retention_interval,
    alignment_tokens, use_eagle)`` holds, its answer is ORed with
    ``original``'s (vLLM's own) for a window ``A`` tokens wider
    (:func:`union_with_wider_window`). ``boundaries``: also widen the
    replay-boundary and junction tails (``reachable_boundaries``), not only
    the periodic ones; ``final_segment``: pass ``final_segment_end_block`` on
    to the wider call (else ``None``).
    """

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
        kept = current(
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
        if kept is None or alignment_tokens is None:
            return kept
        if not widens(retention_interval, alignment_tokens, use_eagle):
            return kept
        return union_with_wider_window(
            kept,
            original,
            cls,
            start_block,
            end_block,
            alignment_tokens,
            kv_cache_spec,
            use_eagle,
            retention_interval,
            reachable_boundaries if boundaries else (),
            dcp_world_size,
            final_segment_end_block if final_segment else None,
        )

    return mask


def seed_pr_runs_as_stock(scenario: Scenario, retention_interval_tokens: int | None) -> bool:
    """Whether the seed PR's two changes leave a run exactly as the installed
    vLLM runs it: the drop wrapper changes only Gemma-4 MTP
    (``use_gemma4_mtp()``, the ``gemma4_mtp`` drafter kind), and the mask
    wrapper widens only under a positive retention interval and the EAGLE
    drop (:func:`_seed_pr_widens`), so a run of any other drafter is the
    stock run when its retention ``retention_interval_tokens`` is ``None``
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


def _seed_pr_widens(retention: int | None, alignment: int | None, use_eagle: bool) -> bool:
    """The seed PR widens periodic tails under the EAGLE drop and sparse
    retention (a positive interval other than the hit alignment)."""
    return use_eagle and bool(retention) and retention != alignment


_widened_mask = widening_mask(
    _original_mask, _original_mask, widens=_seed_pr_widens, boundaries=False, final_segment=True
)


def union_with_wider_window(
    kept: list[bool],
    mask: Callable[..., list[bool] | None],
    cls: type[SlidingWindowManager],
    start_block: int,
    end_block: int,
    alignment_tokens: int,
    kv_cache_spec: KVCacheSpec,
    use_eagle: bool,
    retention_interval: int | None,
    reachable_boundaries: Sequence[int],
    dcp_world_size: int,
    final_segment_end_block: int | None,
) -> list[bool] | None:
    """``kept`` ORed with ``mask``'s answer for a window ``alignment_tokens`` wider.

    ``mask`` is vLLM's ``SlidingWindowManager.reachable_block_mask`` (its
    arguments follow it): each tail it keeps for the wider window ends on the
    same block and starts ``alignment_tokens / block_size`` blocks lower, so it
    also serves a hit one alignment unit below the boundary. Returns ``None``
    (keep every block) when the wider tails cover whole segments.
    """
    assert isinstance(kv_cache_spec, SlidingWindowSpec)
    wider_spec = dataclasses.replace(
        kv_cache_spec, sliding_window=kv_cache_spec.sliding_window + alignment_tokens
    )
    wider = mask(
        cls,
        start_block,
        end_block,
        alignment_tokens,
        wider_spec,
        use_eagle,
        retention_interval,
        reachable_boundaries,
        dcp_world_size,
        final_segment_end_block,
    )
    if wider is None:
        return None
    return [a or b for a, b in zip(kept, wider, strict=True)]


# (owner, attribute, replacement) triples of the seed PR's fix.
_SEED_PR_PATCHES: tuple[tuple[type, str, Any], ...] = (
    (SpeculativeConfig, "needs_eagle_block_drop", _needs_eagle_block_drop),
    (SlidingWindowManager, "reachable_block_mask", classmethod(_widened_mask)),
)


@contextmanager
def patched(patches: Sequence[tuple[type, str, Any]]) -> Iterator[None]:
    """Install ``patches`` for the duration of the block, then restore.

    Holds a process-wide lock so two variants never run interleaved.
    """
    with _LOCK:
        saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
        try:
            for owner, name, replacement in patches:
                setattr(owner, name, replacement)
            yield
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)


@contextmanager
def seed_pr_fix() -> Iterator[None]:
    """Context manager: the installed vLLM plus the seed PR's two changes."""
    with patched(_SEED_PR_PATCHES):
        yield


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
    from differential.driver.settings import resolve_drafter
    from differential.scenario import (
        Drafter,
        DrafterKind,
        GroupKind,
        KVCacheGroup,
        RequestSpec,
        Scenario,
    )

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

    with _LOCK:
        gemma4_no_drop = not resolve_drafter(probe(DrafterKind.GEMMA4_MTP)).use_eagle_block_drop
        sibling = run_scenario(probe(DrafterKind.MTP), "probe").hits[-1:]
        return FixStatus(gemma4_no_drop=gemma4_no_drop, widened_tails=sibling == (24,))

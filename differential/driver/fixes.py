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

The release decides where change 1 goes (:func:`_drop_hook`): vLLM 0.33's
scheduler asks ``SpeculativeConfig.needs_eagle_block_drop``, the method the
seed PR changes; vLLM 0.32 has no such method and its ``Scheduler.__init__``
(vllm/v1/core/sched/scheduler.py) reads ``use_eagle_block_drop`` alone, so
there the same exclusion wraps that method. A release with neither, without
``use_gemma4_mtp``, or whose ``reachable_block_mask`` takes other parameters
than the ones wrapped here cannot take the fix: entering :func:`seed_pr_fix`
raises :class:`~differential.capabilities.Unsupported` naming what is missing.

Patching is process-global, so :func:`patched` serialises variants with a lock
and restores the originals on exit: no patch leaks into another variant;
:func:`installed_patches` names the replacements in place. This module, like
:mod:`~differential.driver.candidate` and :mod:`~differential.driver.mutations`,
imports no manager driver, so vLLM's real engine (another release, in the
engine worker) can run under it; whether a fix leaves a run as stock is asked
in :mod:`differential.driver.fix_probes`.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vllm.config import SpeculativeConfig
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import KVCacheSpec, SlidingWindowSpec

from differential.capabilities import Unsupported

__all__ = [
    "MASK_PARAMETERS",
    "PATCH_LOCK",
    "installed_mask",
    "installed_patches",
    "patched",
    "seed_pr_fix",
    "seed_pr_widens",
    "union_with_wider_window",
    "widening_mask",
]

#: Held while a variant's patches are installed: two variants never run interleaved.
PATCH_LOCK = threading.RLock()

#: ``Owner.attribute`` of each replacement installed now, outermost first.
_INSTALLED: list[str] = []

#: The parameters of ``SlidingWindowManager.reachable_block_mask`` that the
#: mask wrappers take and pass on (vllm/v1/core/single_type_kv_cache_manager.py).
MASK_PARAMETERS = (
    "cls",
    "start_block",
    "end_block",
    "alignment_tokens",
    "kv_cache_spec",
    "use_eagle",
    "retention_interval",
    "reachable_boundaries",
    "dcp_world_size",
    "final_segment_end_block",
)


def _drop_hook() -> str:
    """The ``SpeculativeConfig`` method that decides the EAGLE drop:
    ``needs_eagle_block_drop`` where vLLM has it (0.33), else
    ``use_eagle_block_drop`` (vLLM 0.32's ``Scheduler.__init__`` reads it alone).

    Raises:
        Unsupported: neither method, or no ``use_gemma4_mtp``
            (vllm/config/speculative.py).
    """
    if not hasattr(SpeculativeConfig, "use_gemma4_mtp"):
        raise Unsupported(
            "the seed fix's SpeculativeConfig.use_gemma4_mtp (vllm/config/speculative.py)"
        )
    for name in ("needs_eagle_block_drop", "use_eagle_block_drop"):
        if name in SpeculativeConfig.__dict__:
            return name
    raise Unsupported(
        "the seed fix's SpeculativeConfig.needs_eagle_block_drop or use_eagle_block_drop "
        "(vllm/config/speculative.py)"
    )


def installed_mask() -> Callable[..., list[bool] | None]:
    """The function of the installed ``SlidingWindowManager.reachable_block_mask``.

    Raises:
        Unsupported: the release has none, or one whose parameters are not
            :data:`MASK_PARAMETERS`.
    """
    found = SlidingWindowManager.__dict__.get("reachable_block_mask")
    function = getattr(found, "__func__", None)
    if function is None or tuple(inspect.signature(function).parameters) != MASK_PARAMETERS:
        raise Unsupported(
            "the fixes' SlidingWindowManager.reachable_block_mask("
            + ", ".join(MASK_PARAMETERS[1:])
            + ") (vllm/v1/core/single_type_kv_cache_manager.py)"
        )
    return function  # type: ignore[no-any-return]


def installed_patches() -> tuple[str, ...]:
    """The replacements installed now, as ``Owner.attribute``, outermost first."""
    return tuple(_INSTALLED)


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


def seed_pr_widens(retention: int | None, alignment: int | None, use_eagle: bool) -> bool:
    """The seed PR widens periodic tails under the EAGLE drop and sparse
    retention (a positive interval other than the hit alignment)."""
    return use_eagle and bool(retention) and retention != alignment


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


def _seed_pr_patches() -> tuple[tuple[type, str, Any], ...]:
    """The seed PR's fix as ``(owner, attribute, replacement)`` triples, over
    what is installed now.

    Raises:
        Unsupported: the installed vLLM lacks a method the fix wraps
            (:func:`_drop_hook`, :func:`installed_mask`).
    """
    hook = _drop_hook()
    needs_drop: Callable[[SpeculativeConfig], bool] = SpeculativeConfig.__dict__[hook]
    mask = installed_mask()

    def no_drop_for_gemma4_mtp(self: SpeculativeConfig) -> bool:
        return needs_drop(self) and not self.use_gemma4_mtp()

    widened = widening_mask(mask, mask, widens=seed_pr_widens, boundaries=False, final_segment=True)
    return (
        (SpeculativeConfig, hook, no_drop_for_gemma4_mtp),
        (SlidingWindowManager, "reachable_block_mask", classmethod(widened)),
    )


@contextmanager
def patched(patches: Sequence[tuple[type, str, Any]]) -> Iterator[None]:
    """Install ``patches`` for the duration of the block, then restore.

    Holds a process-wide lock so two variants never run interleaved.
    """
    with PATCH_LOCK:
        saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
        depth = len(_INSTALLED)
        try:
            for owner, name, replacement in patches:
                setattr(owner, name, replacement)
                _INSTALLED.append(f"{owner.__name__}.{name}")
            yield
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)
            del _INSTALLED[depth:]


@contextmanager
def seed_pr_fix() -> Iterator[None]:
    """Context manager: the installed vLLM plus the seed PR's two changes.

    Raises:
        Unsupported: on entry, the installed vLLM lacks a method the fix wraps.
    """
    with patched(_seed_pr_patches()):
        yield

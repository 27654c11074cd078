"""What the importable vLLM has, read off its own code once, and where vLLM's calls start.

:func:`detect` inspects the running release's classes and signatures (no
version table): ``vllm/v1/core/kv_cache_manager.py`` ``KVCacheManager.__init__``
and ``get_computed_blocks``, ``vllm/v1/core/kv_cache_utils.py``
``get_request_block_hasher``, ``vllm/v1/kv_cache_interface.py``
``KVCacheConfig`` / ``SlidingWindowSpec``, ``vllm/config/speculative.py``
``SpeculativeConfig``, ``vllm/config/vllm.py`` ``VllmConfig`` and
``vllm/v1/core/kv_cache_coordinator.py``.

:func:`vllm_call` marks a call into vLLM: an exception raised inside it is
vLLM's (a ``crash`` finding naming the call); :func:`vllm_build` marks a
constructor, whose missing arguments and refusals make the run *unsupported*
(:class:`~differential.capabilities.Unsupported`); any other
exception in the driver is kvfuzz's own failure
(:class:`~differential.errors.InternalError`).
:func:`classified_run` sorts the exception that ends a driven run into those
classes, the same way for every driving mode.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from differential.capabilities import DESCRIPTIONS, Feature, Unsupported
from differential.errors import InternalError, ScenarioError

__all__ = [
    "RunEnd",
    "UnsupportedFeature",
    "VllmCallError",
    "classified_run",
    "describe",
    "detect",
    "has",
    "parameters",
    "takes",
    "vllm_build",
    "vllm_call",
]

P = ParamSpec("P")
T = TypeVar("T")


class VllmCallError(Exception):
    """vLLM raised inside one of its own calls.

    Attributes:
        call: the vLLM function or constructor called, e.g. ``KVCacheManager.allocate_slots``.
        error: the exception vLLM raised.
    """

    def __init__(self, call: str, error: BaseException) -> None:
        self.call = call
        self.error = error
        where = raised_in(error)
        suffix = f" [raised in {where[0]} ({where[1]})]" if where is not None else ""
        super().__init__(f"{call}: {type(error).__name__}: {error}{suffix}")


def raised_in(error: BaseException) -> tuple[str, str] | None:
    """The innermost vLLM frame of ``error``'s traceback: ``(qualified
    function name, file path from the ``vllm/`` package folder)``, e.g.
    ``("SlidingWindowManager.find_longest_cache_hit",
    "vllm/v1/core/single_type_kv_cache_manager.py")``; ``None`` when no
    frame lies in vLLM."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = code.co_filename.replace("\\", "/")
        marker = path.rfind("/vllm/")
        if marker >= 0:
            found = (code.co_qualname, path[marker + 1 :])
        tb = tb.tb_next
    return found


class UnsupportedFeature(Unsupported):
    """The scenario needs a feature the running vLLM lacks (no equivalent settings).

    Attributes:
        feature: the missing feature; ``reason`` is its description.
    """

    def __init__(self, feature: Feature) -> None:
        self.feature = feature
        super().__init__(DESCRIPTIONS[feature])


def vllm_call(call: str, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``function(*args, **kwargs)``, with an exception it raises attributed to vLLM.

    Raises:
        VllmCallError: the call raised (anything but :class:`InternalError`).
    """
    try:
        return function(*args, **kwargs)
    except (InternalError, Unsupported):
        raise
    except Exception as exc:
        raise VllmCallError(call, exc) from exc


def quiet_vllm_logging() -> None:
    """Keep vLLM's log lines below errors off kvfuzz's stderr.

    vLLM's notices (the CPU backend, the model runner's choice, the
    planner's "Add N padding layers" from
    ``_get_kv_cache_groups_uniform_page_size``) say nothing about the
    scenario, and a command's stderr is its one-line errors. Setting the
    ``vllm`` logger's level clears every logger's cache, so it is done once."""
    vllm_logger = logging.getLogger("vllm")
    if vllm_logger.level != logging.ERROR:
        vllm_logger.setLevel(logging.ERROR)


#: What a vLLM constructor raises to refuse a configuration it does not
#: support (e.g. ``KVCacheCoordinator.__init__``'s ``ValueError`` for
#: multi-module MTP with a small scheduler block, or
#: ``UnitaryKVCacheCoordinator``'s assertion on the hash block size).
REFUSALS: tuple[type[Exception], ...] = (ValueError, NotImplementedError, AssertionError)


@functools.lru_cache(maxsize=1024)
def _keywords(function: Callable[..., object]) -> frozenset[str] | None:
    """The keyword names ``function`` takes; ``None`` when it takes
    ``**kwargs`` or cannot be inspected. Cached: ``inspect.signature`` costs
    about as much as building a small manager."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return frozenset(signature.parameters)


def takes(function: Callable[..., object], name: str) -> bool:
    """Whether ``function`` takes a keyword argument ``name`` (``True`` when it
    takes ``**kwargs`` or cannot be inspected)."""
    try:
        keywords = _keywords(function)
    except TypeError:  # an unhashable callable: inspect it each time
        keywords = _keywords.__wrapped__(function)
    return keywords is None or name in keywords


def vllm_build(call: str, source: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Build one of vLLM's objects (``function(*args, **kwargs)``, a constructor).

    A keyword argument the running release does not take, or a configuration
    its constructor refuses (:data:`REFUSALS`), means the release cannot run
    the scenario: *unsupported*, naming the call and ``source``, the vLLM file
    (repository path). Any other exception is vLLM's (a ``crash``).

    Raises:
        Unsupported: an argument the release lacks, or a refusal.
        VllmCallError: the constructor raised anything else.
    """
    missing = [name for name in kwargs if not takes(function, name)]
    if missing:
        arguments = ", ".join(f"{name}=" for name in missing)
        raise Unsupported(f"{call}({arguments}) ({source})")
    try:
        return function(*args, **kwargs)
    except (InternalError, Unsupported):
        raise
    except REFUSALS as refused:
        raise Unsupported(
            f"{call} refuses this configuration ({source}): {type(refused).__name__}: {refused}"
        ) from refused
    except Exception as exc:
        raise VllmCallError(call, exc) from exc


@dataclass
class RunEnd:
    """How a driven run ended, filled in by :func:`classified_run`.

    Attributes:
        phase: one item, what the driver is doing; the driver updates
            ``phase[0]`` as it goes, and errors name it.
        error: ``"<phase>: <vLLM call>: <exception>"`` when vLLM raised (the
            run's ``crash`` finding); ``None`` otherwise.
        unsupported: what the running vLLM lacks, when the scenario needs it
            and nothing could run; ``None`` otherwise.
    """

    phase: list[str]
    error: str | None = None
    unsupported: str | None = None


@contextlib.contextmanager
def classified_run(driver: str, phase: list[str], vllm_version: str) -> Iterator[RunEnd]:
    """Run a driving mode's body and sort out the exception that ends it.

    :class:`~differential.capabilities.Unsupported` (a feature the
    release lacks, an argument it does not take, a layout it refuses) sets
    ``unsupported`` to its reason; :class:`VllmCallError`
    (vLLM raised) sets ``error``; both end the block normally, so the caller
    returns what ran.

    Args:
        driver: the driver's name in messages, e.g. ``"scheduler-mode driver"``.
        phase: the driver's phase cell (see :attr:`RunEnd.phase`).
        vllm_version: the running vLLM's version, for messages.

    Raises:
        InternalError: any other exception: kvfuzz's driver failed (never a
            finding), naming the phase.
    """
    end = RunEnd(phase)
    try:
        yield end
    except Unsupported as missing:
        end.unsupported = missing.reason
    except VllmCallError as exc:  # vLLM raised: a finding, not our failure.
        end.error = f"{phase[0]}: {exc}"
    except (InternalError, ScenarioError):
        raise  # kvfuzz's own failure, or bad input only running could show
    except Exception as exc:  # kvfuzz's driver failed: never a finding.
        raise InternalError(
            f"the {driver} failed at {phase[0]!r} on vLLM {vllm_version}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def parameters(function: Callable[..., object]) -> frozenset[str]:
    """Names of ``function``'s parameters (empty if it cannot be inspected)."""
    try:
        return frozenset(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _fields(cls: type) -> frozenset[str]:
    return frozenset(getattr(cls, "__dataclass_fields__", {}))


def _is_property(cls: type, name: str) -> bool:
    return isinstance(inspect.getattr_static(cls, name, None), property)


@functools.cache
def detect() -> dict[str, bool]:
    """Feature name -> whether the importable vLLM has it (see :class:`Feature`).

    Computed once per process from that release's own code.
    """
    from vllm.config import SpeculativeConfig, VllmConfig
    from vllm.v1.core import kv_cache_coordinator, kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, SlidingWindowSpec

    manager = parameters(KVCacheManager.__init__)
    hasher = parameters(kv_cache_utils.get_request_block_hasher)
    try:
        lookup_source = inspect.getsource(KVCacheManager.get_computed_blocks)
    except (OSError, TypeError):
        lookup_source = ""
    found = {
        Feature.SCHEDULER_BLOCK_SIZE: {"scheduler_block_size", "hash_block_size"} <= manager,
        Feature.PREFILL_LOOKAHEAD: "num_prefill_lookahead" in manager
        and hasattr(Scheduler, "_reserve_prefill_lookahead"),
        Feature.PREFILL_LOOKAHEAD_CONFIG: _is_property(VllmConfig, "num_prefill_lookahead_tokens"),
        Feature.LOOKAHEAD_SLOTS_CONFIG: _is_property(VllmConfig, "num_lookahead_tokens"),
        Feature.EAGLE_BLOCK_DROP_CONFIG: hasattr(SpeculativeConfig, "use_eagle_block_drop")
        and "disable_eagle_block_drop" in _fields(SpeculativeConfig),
        Feature.NEEDS_EAGLE_BLOCK_DROP: hasattr(SpeculativeConfig, "needs_eagle_block_drop"),
        Feature.LOOKAHEAD_HASHES: _is_property(VllmConfig, "num_hash_lookahead_tokens")
        and "num_hash_lookahead_tokens" in manager
        and "num_hash_lookahead_tokens" in hasher,
        Feature.RETENTION_INTERVAL: "prefix_cache_retention_interval" in _fields(KVCacheConfig),
        Feature.EXTRA_RETAINED_TOKENS: "extra_retained_tokens" in _fields(SlidingWindowSpec),
        Feature.JUNCTION_PINNING: "shared_prefix_boundary" in lookup_source,
        Feature.REPLAY_BOUNDARIES: hasattr(kv_cache_coordinator, "replay_boundaries"),
    }
    return {feature.value: bool(present) for feature, present in found.items()}


def has(feature: Feature) -> bool:
    """Whether the importable vLLM has ``feature``."""
    return detect()[feature.value]


def describe(feature: Feature) -> str:
    """The missing piece of vLLM, for an *unsupported* run."""
    return DESCRIPTIONS[feature]

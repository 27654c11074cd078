"""How campaign processes stop: signals, the parent's death, helper pools.

A campaign must stop promptly and keep what it found whatever stops it
(Ctrl-C, ``kill -TERM``, its parent dying), and must leave no process behind:
not its ``--jobs`` workers, not the background shrinker's process.

- :func:`stop_on_signals` turns the first SIGINT or SIGTERM into
  ``KeyboardInterrupt`` and records the request, so a loop that polls
  :func:`stop_requested` still stops when the exception was swallowed: Python
  drops exceptions raised while a ``__del__``, weakref or ``gc`` callback
  runs, and Hypothesis installs a ``gc`` callback
  (``hypothesis/internal/conjecture/junkdrawer.py``, ``gc_cumulative_time``)
  that swallowed the SIGTERM in 2 of 34 campaigns stopped that way.
- :func:`die_with_parent` (a ``multiprocessing`` initializer or first call)
  asks Linux to SIGTERM the process when its parent dies.
- :func:`terminate_pool` stops a ``ProcessPoolExecutor`` now, running work
  included: ``shutdown(wait=False)`` alone leaves running work to finish, and
  the interpreter waits for it at exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from types import FrameType
from typing import Any

__all__ = [
    "EXIT_WORKER_FAILED",
    "die_with_parent",
    "stop_on_signals",
    "stop_requested",
    "terminate_pool",
]

EXIT_WORKER_FAILED = 3
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_stop_requested = False


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to send this process SIGTERM when its parent dies.

    No-op elsewhere. Exits at once (status 3) if the parent is already gone.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(EXIT_WORKER_FAILED)


def stop_requested() -> bool:
    """Whether SIGINT or SIGTERM arrived inside :func:`stop_on_signals`."""
    return _stop_requested


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM is handled like Ctrl-C: the first SIGINT or SIGTERM raises
    ``KeyboardInterrupt`` and sets :func:`stop_requested`; later ones are
    ignored, so saving what was found is not itself interrupted."""
    global _stop_requested
    _stop_requested = False

    def handler(signum: int, frame: FrameType | None) -> None:
        global _stop_requested
        if not _stop_requested:
            _stop_requested = True
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        _stop_requested = False


def terminate_pool(pool: ProcessPoolExecutor) -> None:
    """Stop ``pool`` now: cancel queued work and SIGTERM its processes.

    Running work is lost (its future fails with ``BrokenProcessPool``).
    Uses ``ProcessPoolExecutor.terminate_workers`` where Python has it (3.14),
    else the pool's process table (``concurrent/futures/process.py``).
    """
    terminate = getattr(pool, "terminate_workers", None)
    if callable(terminate):
        terminate()
        return
    processes = dict(getattr(pool, "_processes", None) or {})
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes.values():
        with contextlib.suppress(ProcessLookupError, ValueError, AttributeError):
            process.terminate()
    for process in processes.values():
        with contextlib.suppress(ValueError, AttributeError, AssertionError):
            if not _ended(process, 5.0):
                process.kill()
                _ended(process, 5.0)


def _ended(process: Any, timeout: float) -> bool:
    """Whether ``process`` (a ``multiprocessing.Process``) ended within
    ``timeout`` seconds, its exit code recorded.

    The pool's manager thread reaps its processes too: when it wins the
    ``waitpid``, this thread's fails with ``ECHILD`` and ``multiprocessing``
    (``popen_fork.Popen.poll``) reports the process alive until the manager
    thread records the exit code, so wait for that as well.
    """
    deadline = time.monotonic() + timeout
    process.join(timeout)
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return process.exitcode is not None

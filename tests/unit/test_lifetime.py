"""How campaign processes stop (:mod:`fuzz.lifetime`), with real signals and
real spawned processes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import pytest

from fuzz.lifetime import stop_on_signals, stop_requested, terminate_pool


class _SignalInFinalizer:
    """Sends SIGTERM to this process from ``__del__``, where Python prints and
    drops any exception, the handler's ``KeyboardInterrupt`` included."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the Python-level handler runs here, inside __del__


def test_a_signal_whose_interrupt_is_swallowed_is_still_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dropped: list[type[BaseException] | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    with stop_on_signals():
        assert not stop_requested()
        _SignalInFinalizer()  # dropped at once: __del__ runs now
        assert stop_requested()
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal is ignored
        time.sleep(0.05)
    assert not stop_requested()
    assert dropped == [KeyboardInterrupt]  # what Python printed as "Exception ignored in"


def test_the_first_signal_raises_keyboard_interrupt() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) == before


def test_terminate_pool_stops_running_work_at_once() -> None:
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    future = pool.submit(time.sleep, 120)
    processes = list(pool._processes.values())
    deadline = time.monotonic() + 60
    while not future.running():  # the spawned process has taken the work
        assert time.monotonic() < deadline
        time.sleep(0.05)
    started = time.monotonic()
    terminate_pool(pool)
    assert time.monotonic() - started < 10
    assert processes and not any(p.is_alive() for p in processes)
    with pytest.raises(BrokenProcessPool):
        future.result(timeout=10)

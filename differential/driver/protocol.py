"""The JSON-lines protocol kvfuzz's worker processes serve (standard library only).

Two workers speak it: the tree worker (:mod:`differential.driver.worker`,
one vLLM source tree's ``KVCacheManager`` or ``Scheduler``) and the engine
worker (:mod:`differential.driver.engine_worker`, vLLM's real CPU engine in
its own environment). Each request is one line of JSON ``{"v": 1, "op":
..., ...}``; each answer is one line ``{"v": 1, ...}``. ``op`` ``exit`` (or
the end of stdin) ends the worker; the others are the worker's own.

A failure of the worker's own code is answered ``{"internal_error": MESSAGE,
"traceback": TEXT}`` and the worker serves on: it is kvfuzz's failure,
never a finding. This module imports nothing of vLLM or of kvfuzz, so either
worker can use it before it imports the vLLM it serves.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import IO, Any

__all__ = [
    "PARENT_ENV",
    "PROTOCOL_VERSION",
    "Handler",
    "ProtocolError",
    "die_with_parent",
    "serve",
    "take_protocol_stdout",
]

PROTOCOL_VERSION = 1

# One request -> (the answer, whether the worker stops after sending it).
Handler = Callable[[dict[str, Any]], tuple[dict[str, Any], bool]]


class ProtocolError(RuntimeError):
    """A request the protocol cannot take: another version, or an unknown ``op``."""


def serve(
    stdin: IO[str],
    stdout: IO[str],
    handle: Handler,
    *,
    describe_failure: Callable[[Exception], str],
) -> None:
    """Answer each request line on ``stdin`` with one line on ``stdout``.

    Args:
        stdin: request lines.
        stdout: the protocol stream (flushed after every answer).
        handle: the worker's own answer to a request other than ``exit``;
            raises :class:`ProtocolError` for an ``op`` it does not know.
        describe_failure: the one-line ``internal_error`` message for an
            exception ``handle`` (or the decoding of a line) raised.
    """

    def reply(message: dict[str, Any]) -> None:
        stdout.write(json.dumps({"v": PROTOCOL_VERSION, **message}) + "\n")
        stdout.flush()

    for line in stdin:
        try:
            request = json.loads(line)
            if request.get("v") != PROTOCOL_VERSION:
                raise ProtocolError(f"protocol version {request.get('v')!r} unsupported")
            if request["op"] == "exit":
                return
            answer, stop = handle(request)
            reply(answer)
            if stop:
                return
        except Exception as exc:  # kvfuzz's own failure: reported, never a finding
            reply({"internal_error": describe_failure(exc), "traceback": traceback.format_exc()})


def take_protocol_stdout() -> IO[str]:
    """The protocol's own stream: file descriptor 1 duplicated to a private one.

    From here on file descriptor 1 (and ``sys.stdout``) point at stderr, so a
    banner or any other print (Python or C, vLLM's included) cannot corrupt
    the protocol. Call it before importing vLLM.
    """
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


#: The pid of the process that started the worker, set by
#: :class:`differential.variants.tree.TreeWorker` (both workers' parent).
PARENT_ENV = "KVFUZZ_WORKER_PARENT"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the process that started it dies.

    A worker busy in a scenario (a hung one, an engine run) does not read its
    closed stdin, so without this a parent killed by SIGTERM or SIGKILL (a CI
    cancel) leaves it running. Exits at once (status 3) if the parent named
    in :data:`PARENT_ENV` is already gone (it died before the request took
    effect). Call it first, before importing vLLM. No-op off Linux.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit() and os.getppid() != int(parent):
        os._exit(3)

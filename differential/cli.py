"""The ``kvfuzz`` command line.

Exit codes: 0 when the variants under test are clean, 1 when anything is
found, 2 for bad input or usage (the message names the field or option and
what is allowed), 3 when kvfuzz itself failed (an unexpected exception, a
campaign worker that died without reporting, an output that cannot be
written): one line on stderr names the error and the file holding the full
traceback. A crash is never reported as success or as a finding.

Each subcommand lives in its own module of :mod:`differential.commands`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType

from differential.commands import COMMANDS, command_module
from differential.commands.options import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    internal_failure,
    one_line,
    save_traceback,
)
from differential.errors import InternalError, ScenarioError, VariantError

__all__ = ["internal_failure", "main", "save_traceback"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfuzz",
        description=(
            "Differential testing of vLLM's prefix-cache managers: run scenarios "
            "on vLLM's real KVCacheManager, unfixed and fixed side by side, and "
            "report hits that fall back to an earlier checkpoint or reuse KV they must not."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        command_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvfuzz`` console script; returns the exit code.

    0 clean, 1 findings, 2 bad input or usage, 3 kvfuzz's own failure,
    130 interrupted (Ctrl-C) and 143 terminated (SIGTERM) outside a campaign
    (a campaign keeps what it found).
    """
    args = _parser().parse_args(argv)
    if args.command not in COMMANDS:
        return internal_failure(InternalError(f"unhandled command {args.command!r}"), argv)
    command: Callable[[argparse.Namespace], int] = command_module(args.command).run
    previous = _terminate_by_unwinding()
    try:
        return command(args)
    except (ScenarioError, VariantError) as exc:
        print(f"kvfuzz: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvfuzz: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("kvfuzz: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
    except Exception as exc:
        return internal_failure(exc, argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """SIGTERM arrived: unwinds the command so its ``finally`` blocks and
    ``atexit`` hooks run (tree workers stopped, temporary folders removed)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one unwinding, not two
    raise Terminated


def _terminate_by_unwinding() -> signal.Handlers | Callable[..., object] | int | None:
    """Turn SIGTERM into :class:`Terminated` (main thread only); returns the
    handler to restore, or ``None`` where none was installed."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        return None  # someone (a test harness, an embedding program) handles it
    signal.signal(signal.SIGTERM, _raise_terminated)
    return previous


if __name__ == "__main__":
    sys.exit(main())

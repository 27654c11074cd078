"""The three kinds of failure kvfuzz keeps apart.

* :class:`ScenarioError` -- the user's mistake: a scenario field out of range,
  malformed JSON, an unknown variant. It names the field, the value and what
  is allowed, and the CLI answers it with exit code 2.
* :class:`InternalError` -- kvfuzz's own bug. It says so.
* A *finding* is data, never an exception: see :mod:`differential.findings`.
"""

from __future__ import annotations

__all__ = ["InternalError", "KvfuzzError", "ScenarioError", "VariantError"]


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
        where = f"{self.source}: " if self.source else ""
        return f"{where}{self.field} = {self.value!r} is invalid: allowed {self.allowed}"

    def with_source(self, source: str) -> ScenarioError:
        """Return a copy that also names the file the scenario came from."""
        return ScenarioError(self.field, self.value, self.allowed, source=source)


class VariantError(KvfuzzError, ValueError):
    """An unknown or unusable variant name was requested."""


class InternalError(KvfuzzError, RuntimeError):
    """A bug in kvfuzz itself (never in vLLM, never in the user's input)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"kvfuzz internal error (please report): {message}")

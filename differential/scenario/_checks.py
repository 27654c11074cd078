"""Shared value checks of the scenario model (each names the field on error)."""

from __future__ import annotations

from enum import StrEnum

from differential.errors import ScenarioError


def _allowed_enum(enum: type[StrEnum]) -> str:
    return "one of " + ", ".join(repr(m.value) for m in enum)


def _require_int(value: object, where: str, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ScenarioError(where, value, f"an integer >= {minimum}")

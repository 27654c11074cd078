"""Moved to :mod:`differential.scenario.bounds`; this name stays for the CLI
until its commands move to their own modules."""

from differential.scenario.bounds import (
    DEFAULT_LIMITS,
    Limits,
    ScenarioCost,
    check_cost,
    scenario_cost,
)

__all__ = ["DEFAULT_LIMITS", "Limits", "ScenarioCost", "check_cost", "scenario_cost"]

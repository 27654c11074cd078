"""The fuzz target: one Hypothesis test that every fuzzer drives.

:func:`build_target` wraps "generate a scenario, run it on the variants, judge
it" as a ``@given`` test. The campaign drives it through Hypothesis's
``fuzz_one_input`` with seeded random bytes, the atheris harness with
libFuzzer's bytes, and ``kvfuzz import-crash`` decodes a crash file through
the very same strategy. A finding raises a :class:`FindingRaised` subclass
unique to its signature, so Hypothesis (and libFuzzer) keep one failure per
signature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.database import ExampleDatabase

from differential.compare import ScenarioResult, compare_variants
from differential.findings import FindingKind, Policy
from differential.scenario import DriveMode, GroupKind, Scenario
from differential.variants import Variant
from fuzz.signature import Signature, signature_of
from fuzz.strategies import engine_scenarios, scenarios

__all__ = ["FindingRaised", "Target", "build_target", "decode"]

OnResult = Callable[[Scenario, ScenarioResult], None]
Target = Any  # a Hypothesis-wrapped test function with .hypothesis.fuzz_one_input


class FindingRaised(Exception):
    """Raised by the target when a scenario has findings (never by kvfuzz code)."""

    signature: Signature


_CLASSES: dict[Signature, type[FindingRaised]] = {}


def _exception_for(signature: Signature) -> type[FindingRaised]:
    cls = _CLASSES.get(signature)
    if cls is None:
        cls = type(f"Finding_{signature.slug.replace('-', '_')}", (FindingRaised,), {})
        cls.signature = signature
        _CLASSES[signature] = cls
    return cls


def build_target(
    variants: Sequence[Variant],
    *,
    policy: Policy = Policy.VLLM,
    on_result: OnResult | None = None,
    database: ExampleDatabase | None = None,
    dense_cross_check: bool = True,
    raise_on_finding: bool = True,
    raise_on_known: bool = False,
    phases: Sequence[Phase] | None = None,
    kinds: frozenset[GroupKind] = frozenset(),
    mode: DriveMode = DriveMode.MANAGER,
) -> Target:
    """A Hypothesis test over :func:`fuzz.strategies.scenarios`.

    Args:
        variants: the variants each scenario runs on.
        policy: the oracle's checkpoint policy.
        on_result: called with every scenario and its judged result.
        database: where ``fuzz_one_input`` saves failing inputs.
        dense_cross_check: also run the dense-retention cross-check.
        raise_on_finding: raise a per-signature :class:`FindingRaised` when
            the scenario has findings (the most severe one's signature).
        raise_on_known: also raise for findings a known vLLM issue explains
            (by default they are reported to ``on_result`` but do not fail).
        phases: Hypothesis phases when the test is called directly (``None``:
            Hypothesis's default); ``fuzz_one_input`` ignores them.
        kinds: KV cache group kinds every generated scenario contains
            (``kvfuzz fuzz --groups``; empty: any layout).
        mode: ``scheduler`` draws engine workloads
            (:func:`fuzz.strategies.engine_scenarios`, ``kinds`` pinned as
            there) run through vLLM's ``Scheduler``.
    """
    extra: dict[str, Any] = {} if phases is None else {"phases": tuple(phases)}

    @settings(
        database=database,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=True,
        **extra,
    )
    @given(
        engine_scenarios(kinds=kinds) if mode is DriveMode.SCHEDULER else scenarios(kinds=kinds)
    )
    def kvfuzz_target(scenario: Scenario) -> None:
        result = compare_variants(
            scenario, variants, policy=policy, dense_cross_check=dense_cross_check
        )
        if on_result is not None:
            on_result(scenario, result)
        failing = [f for f in result.findings if raise_on_known or f.known_issue is None]
        if raise_on_finding and failing:
            first = min(failing, key=lambda f: list(FindingKind).index(f.kind))
            signature = signature_of(scenario, first)
            raise _exception_for(signature)(f"{signature.text}: {first.summary()}")

    return kvfuzz_target


def decode(buffer: bytes, mode: DriveMode = DriveMode.MANAGER) -> Scenario | None:
    """The scenario a fuzzer's input bytes stand for (``None`` if they decode to none);
    ``mode`` ``scheduler`` decodes through the engine-workload strategy.

    Uses the same strategy and the same ``fuzz_one_input`` path as the
    campaign and the atheris harness, without running vLLM.
    """
    captured: list[Scenario] = []

    @settings(database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(engine_scenarios() if mode is DriveMode.SCHEDULER else scenarios())
    def capture(scenario: Scenario) -> None:
        captured.append(scenario)

    # @given sets .hypothesis on the test function, which its type does not declare.
    capture.hypothesis.fuzz_one_input(buffer)  # type: ignore[attr-defined]
    return captured[0] if captured else None

"""kvfuzz's pytest plugin (entry point ``pytest11: kvfuzz``).

Options (all off by default; without them the plugin imports nothing from vLLM):

* ``--kvfuzz-variant NAME``: run the whole session with a kvfuzz variant's
  patches installed, e.g. ``pytest --kvfuzz-variant fixed test_exported.py``
  for a test made by ``kvfuzz export-test``.
* ``--kvfuzz-corpus PATH`` (repeatable): every scenario file under PATH
  becomes a test item per variant, run on the vLLM importable here; any
  finding no known vLLM issue explains fails the item, with the findings and
  the ``kvfuzz explain`` diagram in the message.
* ``--kvfuzz-fuzz N``: N generated scenarios (seed ``--kvfuzz-seed``) as items,
  judged the same way.
* ``--kvfuzz-variants LIST``: variants for the items (default ``unfixed``,
  i.e. the installed vLLM as is).
* ``--kvfuzz-mode scheduler``: drive the items through vLLM's real
  ``Scheduler`` (corpus files in scheduler mode; ``--kvfuzz-fuzz`` draws
  engine workloads: sessions, arrivals, drafts, a pool that evicts); a
  failing scheduler-mode item shows its timeline of scheduler steps.

A maintainer adds kvfuzz to vLLM's test run with no code:
``pytest --kvfuzz-corpus path/to/kvfuzz/corpora``.
"""

from __future__ import annotations

import random
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

_ACTIVE: list[AbstractContextManager[None]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvfuzz")
    group.addoption(
        "--kvfuzz-variant",
        default=None,
        metavar="NAME",
        help="run the session with this kvfuzz variant's patches (e.g. fixed)",
    )
    group.addoption(
        "--kvfuzz-corpus",
        action="append",
        default=[],
        metavar="PATH",
        help="replay kvfuzz scenario files under PATH as test items",
    )
    group.addoption(
        "--kvfuzz-fuzz",
        type=int,
        default=0,
        metavar="N",
        help="add N generated kvfuzz scenarios as test items",
    )
    group.addoption("--kvfuzz-seed", type=int, default=0, help="seed for --kvfuzz-fuzz")
    group.addoption(
        "--kvfuzz-mode",
        choices=["manager", "scheduler"],
        default=None,
        help="driving mode for kvfuzz items (default: each scenario's own)",
    )
    group.addoption(
        "--kvfuzz-variants",
        default="unfixed",
        metavar="LIST",
        help="variants for kvfuzz items (default: unfixed, the installed vLLM)",
    )


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("--kvfuzz-variant")
    if not name:
        return
    from differential.driver import patch_context
    from differential.errors import VariantError
    from differential.variants import parse_variants

    try:
        (variant,) = parse_variants(name)
    except VariantError as exc:
        raise pytest.UsageError(str(exc)) from None
    context = patch_context(variant)
    context.__enter__()
    _ACTIVE.append(context)


def pytest_unconfigure(config: pytest.Config) -> None:
    while _ACTIVE:
        _ACTIVE.pop().__exit__(None, None, None)


class KvfuzzItem(pytest.Item):
    """One scenario judged on one variant."""

    def __init__(self, *, scenario: Any, variant: Any, source: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario
        self.variant = variant
        self.source = source

    def runtest(self) -> None:
        from differential.compare import compare_variants

        result = compare_variants(self.scenario, (self.variant,), source=self.source)
        failing = [f for f in result.findings if f.known_issue is None]
        if failing:
            raise KvfuzzFailure(self.scenario, result, failing)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, KvfuzzFailure):
            return excinfo.value.describe()
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return Path(self.source) if Path(self.source).exists() else Path("."), 0, self.name


class KvfuzzFailure(Exception):
    """A kvfuzz item's findings, rendered with the explain diagram."""

    def __init__(self, scenario: Any, result: Any, findings: list[Any]) -> None:
        super().__init__(findings[0].summary())
        self.scenario, self.result, self.findings = scenario, result, findings

    def describe(self) -> str:
        from differential.exports.explain import explain_request, render_text

        lines = [f"{self.result.source}:"] + [f"  {f.summary()}" for f in self.findings]
        requests = sorted(f.request for f in self.findings if f.request)
        if self.scenario.workload.mode.value == "scheduler":
            from differential.exports.explain import render_timeline

            last = len(self.scenario.requests) - 1
            lines += ["", render_timeline(self.result, requests[0] if requests else last)]
        if requests:
            exp = explain_request(self.result, requests[0], self.findings)
            if exp is not None:
                lines += ["", render_text(exp)]
        return "\n".join(lines)


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    corpora = config.getoption("--kvfuzz-corpus")
    examples = config.getoption("--kvfuzz-fuzz")
    if not corpora and not examples:
        return
    from differential.corpus import iter_scenario_files, load_entry
    from differential.errors import ScenarioError, VariantError
    from differential.variants import parse_variants

    try:
        variants = parse_variants(config.getoption("--kvfuzz-variants"))
        entries = [load_entry(path) for path in iter_scenario_files(corpora)]
    except (ScenarioError, VariantError) as exc:
        raise pytest.UsageError(f"kvfuzz: {exc}") from None
    mode_name = config.getoption("--kvfuzz-mode")
    scenarios = [(str(e.path), e.scenario) for e in entries]
    if mode_name is not None:
        from differential.compare import in_mode
        from differential.scenario import DriveMode

        mode = DriveMode(mode_name)
        try:
            scenarios = [(source, in_mode(s, mode)) for source, s in scenarios]
        except ScenarioError as exc:
            raise pytest.UsageError(f"kvfuzz: {exc}") from None
    if examples:
        from differential.scenario import DriveMode
        from fuzz.target import decode

        rng = random.Random(config.getoption("--kvfuzz-seed"))
        while len([s for s in scenarios if s[0].startswith("kvfuzz-fuzz")]) < examples:
            scenario = decode(rng.randbytes(2048), DriveMode(mode_name or "manager"))
            if scenario is not None:
                index = len([s for s in scenarios if s[0].startswith("kvfuzz-fuzz")])
                scenarios.append((f"kvfuzz-fuzz-{index}", scenario))
    for source, scenario in scenarios:
        for variant in variants:
            items.append(
                KvfuzzItem.from_parent(
                    session,
                    name=f"kvfuzz[{source}::{variant.name}]",
                    scenario=scenario,
                    variant=variant,
                    source=source,
                )
            )

"""A pytest plugin ``kvfuzz mutate --vllm-tests`` loads into a run of vLLM's own tests.

Loaded with ``-p differential.mutation.vllm_tests_plugin`` into ``python -m
pytest`` (:func:`differential.mutation.vllm_tests.run_pytest`); it does
nothing unless ``KVFUZZ_TESTS_REPORT`` names a file. It then writes one JSON
line per event to that file, as the tests run (so a run killed from outside
still says how far it got):

* ``{"start": NODEID}`` when a test starts;
* ``{"test": NODEID, "outcome": O, "message": M}`` when it ends, ``O`` one of
  ``passed``, ``failed``, ``error`` (setup or teardown failed), ``timeout``
  (pytest-timeout failed it), ``skipped``; ``M`` the first line of the
  failure (``""`` when it passed);
* ``{"collect_error": NODEID, "message": M}`` for a file that did not collect;
* last, with ``KVFUZZ_TESTS_COVER`` set (files, ``os.pathsep``-separated):
  ``{"coverage": {FILE: {LINE: [NODEID, ...]}}}``, the lines of those files
  each test executed (setup, call and teardown), measured by coverage.py with
  one dynamic context per test, as pytest-cov's ``--cov-context=test`` does.

Imports pytest, kvfuzz's own package (not vLLM) and, when measuring, coverage.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from typing import Any

import pytest

from differential.mutation.vllm_tests import COVER_ENV, REPORT_ENV

__all__: list[str] = []

_state: dict[str, Any] = {"cov": None, "outcome": {}, "message": {}}


def _write(record: dict[str, Any]) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    """Start coverage of ``KVFUZZ_TESTS_COVER``'s files (before any test module imports)."""
    files = [f for f in os.environ.get(COVER_ENV, "").split(os.pathsep) if f]
    if files and os.environ.get(REPORT_ENV):
        import coverage

        cov = coverage.Coverage(data_file=None, include=files, branch=False, config_file=False)
        cov.start()
        _state["cov"] = cov


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    """Name the test in the report and in coverage's context while it runs."""
    _write({"start": item.nodeid})
    cov = _state["cov"]
    if cov is not None:
        cov.switch_context(item.nodeid)
    try:
        return (yield)
    finally:
        if cov is not None:
            cov.switch_context("")


def _first_line(report: pytest.TestReport | pytest.CollectReport) -> str:
    text = report.longreprtext.strip()
    lines = [line for line in text.splitlines() if line.startswith("E ")]
    first = lines[0].removeprefix("E ") if lines else text.splitlines()[-1] if text else ""
    return " ".join(first.split())[:300]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Fold the setup, call and teardown reports into one outcome per test."""
    outcomes: dict[str, str] = _state["outcome"]
    messages: dict[str, str] = _state["message"]
    nodeid = report.nodeid
    if report.failed:
        if "from pytest-timeout" in report.longreprtext:
            outcome = "timeout"
        else:
            outcome = "failed" if report.when == "call" else "error"
        if outcomes.get(nodeid, "passed") in ("passed", "skipped"):
            outcomes[nodeid], messages[nodeid] = outcome, _first_line(report)
    elif report.skipped:
        outcomes.setdefault(nodeid, "skipped")
        messages.setdefault(nodeid, "")
    elif report.when == "call":
        outcomes.setdefault(nodeid, "passed")
        messages.setdefault(nodeid, "")
    if report.when == "teardown":
        _write(
            {
                "test": nodeid,
                "outcome": outcomes.pop(nodeid, "error"),
                "message": messages.pop(nodeid, ""),
            }
        )


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """Record a file that did not collect (an import error, a mutant that breaks it)."""
    if report.failed:
        _write({"collect_error": report.nodeid, "message": _first_line(report)})


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop coverage and write the lines each test executed."""
    cov = _state["cov"]
    if cov is None:
        return
    cov.stop()
    data = cov.get_data()
    by_file: dict[str, dict[str, list[str]]] = {}
    for path in data.measured_files():
        lines = data.contexts_by_lineno(path)
        by_file[os.path.realpath(path)] = {
            str(line): sorted(c for c in contexts if c) for line, contexts in lines.items()
        }
    _write({"coverage": by_file})

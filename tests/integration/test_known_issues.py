"""Known vLLM issues found by fuzzing: still reproduced, and labelled."""

from __future__ import annotations

import pytest

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.known import KNOWN_ISSUES
from differential.variants import parse_variants
from tests.factories import ROOT

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("issue", KNOWN_ISSUES, ids=lambda i: i.name)
def test_known_issue_example_reproduces_and_is_labelled(issue) -> None:
    entry = load_entry(ROOT / issue.example)
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed"))
    assert result.findings, (
        f"{issue.name} no longer reproduces on this vLLM: update {issue.example}"
    )
    assert {f.known_issue for f in result.findings} == {issue.name}


def test_short_run_issue_is_the_lookup_not_retention() -> None:
    # Same sibling, window 64 (a full-window run exists): 128 as the oracle says.
    entry = load_entry(ROOT / "known-issues/swa-short-run-align-before-drop.json")
    data = entry.scenario.to_dict()
    data["kv_cache_groups"][1]["sliding_window_tokens"] = 64
    from differential.scenario import Scenario

    result = compare_variants(Scenario.from_dict(data), parse_variants("unfixed"))
    assert result.results[0].run.hits == (0, 128)
    assert result.findings == ()

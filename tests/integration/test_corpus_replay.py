"""Replay every corpus file that records an expectation, on the installed vLLM.

A failure names the file, the variant, the request and what changed, so a
cache-manager refactor that brings a bug back (or loses the oracle's teeth)
is readable from the CI log alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from differential.compare import compare_variants
from differential.corpus import finding_tag, load_entry
from differential.variants import parse_variants
from tests.factories import CORPORA

pytestmark = pytest.mark.vllm

FILES = sorted(CORPORA.rglob("*.json"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(CORPORA)))
def test_corpus_entry(path: Path) -> None:
    entry = load_entry(path)
    expect = entry.expect
    # "layout" holds the layout findings (alignment-blowup), owned by no variant.
    names = sorted((set(expect.hits) | set(expect.findings)) - {"layout"})
    if not names:
        pytest.skip(f"{path.name} records no expectation")
    result = compare_variants(entry.scenario, parse_variants(",".join(names)))
    problems = []
    for vr in result.results:
        name = vr.variant.name
        if name in expect.hits and vr.run.hits != expect.hits[name]:
            problems.append(f"{name}: hits {list(vr.run.hits)}, expected {list(expect.hits[name])}")
        if name in expect.findings:
            mine = [f for f in result.findings if f.owner == name]
            got = sorted(finding_tag(f) for f in mine)
            if got != list(expect.findings[name]):
                detail = "; ".join(f.summary() for f in mine) or "none"
                problems.append(
                    f"{name}: findings {got}, expected {list(expect.findings[name])} ({detail})"
                )
    if "layout" in expect.findings:
        got = sorted(finding_tag(f) for f in result.findings if f.owner == "layout")
        if got != list(expect.findings["layout"]):
            problems.append(f"layout: findings {got}, expected {list(expect.findings['layout'])}")
    assert not problems, f"{path}:\n  " + "\n  ".join(problems)

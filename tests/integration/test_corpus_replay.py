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


def test_fixed_runs_the_installed_vllm_where_it_is_said_to() -> None:
    """Where ``fixed``'s (or ``candidate``'s) ``stock_when`` predicate holds (a comparison then runs
    stock vLLM once for both, ``differential.compare._run_shared``), its
    real patched run is the unfixed run, observation for observation: the
    dense cross-check of every corpus and known-issues scenario whose drafter
    is not Gemma-4 MTP, each retention-0 run, and each sparse run vLLM's
    config gives no EAGLE drop. And the predicate does not hold where the
    patches act (a Gemma-4 MTP drafter, a positive retention interval under
    the EAGLE drop)."""
    import dataclasses

    from differential.driver import run_variant, runs_as_stock
    from differential.driver.settings import resolve_drafter
    from differential.scenario import DrafterKind

    unfixed, fixed, candidate = parse_variants("unfixed,fixed,candidate")
    entries = [
        load_entry(p) for p in FILES + sorted((CORPORA.parent / "known-issues").glob("*.json"))
    ]
    checked = {"dense": 0, "retention 0": 0, "sparse": 0, "not shared": 0, "candidate": 0}
    for entry in entries:
        s = entry.scenario
        runs = [(True, s, "dense")]
        runs.append((False, dataclasses.replace(s, retention_interval_tokens=0), "retention 0"))
        if s.retention_interval_tokens:
            runs.append((False, s, "sparse"))
        for dense, scenario, what in runs:
            if not runs_as_stock(scenario, fixed, dense=dense):
                assert s.drafter.kind is DrafterKind.GEMMA4_MTP or (
                    what == "sparse" and resolve_drafter(s).use_eagle_block_drop
                ), (entry.name, what)
                checked["not shared"] += 1
                continue
            stock = run_variant(scenario, unfixed, dense=dense)
            patched = run_variant(scenario, fixed, dense=dense)
            assert dataclasses.replace(patched, variant="unfixed") == stock, (entry.name, what)
            checked[what] += 1
            if runs_as_stock(scenario, candidate, dense=dense):
                assert dense  # retention 0 widens the candidate's replay-boundary tails
                proposed = run_variant(scenario, candidate, dense=dense)
                assert dataclasses.replace(proposed, variant="unfixed") == stock, entry.name
                checked["candidate"] += 1
    assert checked["dense"] > 80 and checked["retention 0"] > 80 and checked["sparse"] > 5
    assert checked["not shared"] > 0
    assert checked["candidate"] == checked["dense"]
    sparse = next(
        e.scenario
        for e in entries
        if e.scenario.retention_interval_tokens and resolve_drafter(e.scenario).use_eagle_block_drop
    )
    assert not runs_as_stock(sparse, fixed) and not runs_as_stock(sparse, candidate)

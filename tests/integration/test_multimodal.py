"""Requests with images and cache salts on vLLM's real managers and Scheduler.

The corpus cases ``corpora/cases/multimodal-*.json`` pin the hits of both
driving modes (``test_corpus_replay.py``); here: the driver hands vLLM the
images and salts the scenario says, the same hits come from both modes, and
exported tests build the same requests.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.driver.runner import block_hasher, make_request
from differential.driver.settings import resolve_drafter
from differential.exports.manager_test import export_test
from differential.exports.scheduler_test import export_engine_test
from differential.findings import Finding, FindingKind
from differential.scenario import DriveMode, Scenario, Workload
from differential.variants import parse_variants
from tests.factories import CORPORA, ROOT, python_module

pytestmark = pytest.mark.vllm

UNFIXED = parse_variants("unfixed")
SWAP = CORPORA / "cases" / "multimodal-image-swap.json"


def _hits(scenario: Scenario) -> list[int]:
    (result,) = compare_variants(scenario, UNFIXED, dense_cross_check=False).results
    return list(result.run.hits)


def test_the_request_carries_the_images_and_the_salt() -> None:
    scenario = load_entry(SWAP).scenario
    hasher = block_hasher(scenario, resolve_drafter(scenario))
    swap = make_request(scenario, 2, scenario.prompts[2], hasher, 1)
    (feature,) = swap.mm_features
    assert (feature.mm_position.offset, feature.mm_position.length) == (24, 40)
    assert (feature.identifier, feature.modality) == ("dog", "image")
    assert swap.prompt_token_ids == list(scenario.prompts[0])
    salted = dataclasses.replace(
        scenario,
        requests=tuple(dataclasses.replace(r, cache_salt="t") for r in scenario.requests),
    )
    assert make_request(salted, 0, salted.prompts[0], hasher, 1).cache_salt == "t"
    assert make_request(scenario, 0, scenario.prompts[0], hasher, 1).cache_salt is None


def test_images_decide_the_hits_in_both_modes() -> None:
    scenario = load_entry(SWAP).scenario
    scheduler = dataclasses.replace(scenario, workload=Workload(mode=DriveMode.SCHEDULER))
    # Resend 96; the swapped image only the block before it (16); the same
    # image at the same place four blocks (64).
    assert _hits(scenario) == _hits(scheduler) == [0, 96, 16, 64]
    # The identifier alone decides: with 'cat' in place of 'dog', every token
    # and image of request 2 is request 0's, and it reuses six blocks.
    swap = scenario.requests[2]
    same = dataclasses.replace(
        swap, mm_inputs=(dataclasses.replace(swap.mm_inputs[0], identifier="cat"),)
    )
    resent = dataclasses.replace(scenario, requests=(*scenario.requests[:2], same))
    assert resent.prompts[2] == scenario.prompts[2]
    assert _hits(resent) == [0, 96, 96]


@pytest.mark.parametrize("mode", [DriveMode.MANAGER, DriveMode.SCHEDULER])
def test_an_exported_test_sends_the_images(tmp_path: Path, mode: DriveMode) -> None:
    """An over-hit of the swapped image (request 2 may reuse at most 16
    tokens) exports as a test that passes on stock vLLM: the test sends the
    images (with the same identifier as request 0's, request 2 would reuse
    96: see above), and the salted copy of request 3 reuses nothing."""
    scenario = load_entry(SWAP).scenario
    if mode is DriveMode.SCHEDULER:
        scenario = dataclasses.replace(
            scenario, workload=Workload(mode=DriveMode.SCHEDULER, pool_blocks=64)
        )
    scenario = dataclasses.replace(
        scenario,
        requests=(
            *scenario.requests,
            dataclasses.replace(scenario.requests[3], cache_salt="tenant-b", name="salted"),
        ),
    )
    (result,) = compare_variants(scenario, UNFIXED, dense_cross_check=False).results
    assert list(result.run.hits) == [0, 96, 16, 64, 0]
    finding = Finding(
        FindingKind.OVER_HIT, "unfixed", 2, "planted", expected_tokens=16, hit_tokens=96
    )
    if mode is DriveMode.MANAGER:
        source = export_test(
            scenario,
            finding,
            result.references[2],
            signature="planted",
            name="swapped image",
            fixed_hit_tokens=None,
        )
    else:
        source = export_engine_test(scenario, finding, signature="planted", name="swapped image")
    assert "mm_features=_mm_features(images[" in source
    assert "cache_salt=cache_salts[" in source
    assert "[(24, 40, 'dog')]" in source
    assert "assert hits[2] <= 16, (" in source
    test_file = tmp_path / "test_exported_images.py"
    test_file.write_text(source)
    lint = python_module(
        "ruff",
        "check",
        "--no-cache",
        "--config",
        str(ROOT / "pyproject.toml"),
        str(test_file),
        cwd=tmp_path,
    )
    assert lint.returncode == 0, lint.stdout[-2000:]
    run = python_module("pytest", "-q", "-p", "no:cacheprovider", str(test_file), cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:]
    if mode is DriveMode.SCHEDULER:
        return
    # The same test asserting less than stock gives fails: it ran the hits above.
    strict = source.replace("assert hits[2] <= 16, (", "assert hits[2] <= 15, (")
    test_file.write_text(strict)
    run = python_module("pytest", "-q", "-p", "no:cacheprovider", str(test_file), cwd=tmp_path)
    assert run.returncode == 1 and "hits per request: [0, 96, 16, 64, 0]" in run.stdout

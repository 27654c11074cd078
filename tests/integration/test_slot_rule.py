"""The slot rule on vLLM 0.33.0's real managers (manager mode): after each
``allocate_slots`` every attention table holds a slot for each token the
request will have computed. An allocation short of the step's tokens is a
``wrong-kv``; stock vLLM keeps the rule on every bundled case
(``test_corpus_replay``). The scheduler-mode form is in
``test_bounded_replay.py``."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.core.kv_cache_manager import KVCacheManager

from differential.corpus import finding_tag
from tests.factories import CORPORA, stock_result

pytestmark = pytest.mark.vllm

CASE = CORPORA / "cases" / "extension-of-aligned-prompt.json"


def test_an_allocation_short_of_the_step_is_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    # Full attention 8 and a sliding window 4 (manager mode, 32-token chunks):
    # every chunk allocated 16 tokens short.
    real = KVCacheManager.allocate_slots

    def short(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        return real(
            self,
            request,
            num_new_tokens - 16 if num_new_tokens > 16 else num_new_tokens,
            *args,
            **kwargs,
        )

    monkeypatch.setattr(KVCacheManager, "allocate_slots", short)
    run = stock_result(CASE)
    assert run.run.uncovered_steps[:3] == ((0, 1, 0, 32, 16), (0, 1, 1, 32, 16), (0, 2, 0, 64, 48))
    details = [f.detail for f in run.findings if finding_tag(f) == "wrong-kv@0"]
    assert details[0] == (
        "step 1 computes the request up to 32 tokens, but group 0 (full_attention, block 8) "
        "holds slots for 16: allocate_slots gave the step's tokens no block (+5 more)"
    )


def test_stock_allocations_cover_every_step() -> None:
    run = stock_result(CASE)
    assert run.run.uncovered_steps == ()
    assert run.findings == ()

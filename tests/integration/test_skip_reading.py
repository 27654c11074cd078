"""Requests that skip reading the prefix cache (``prompt_logprobs``:
vLLM's ``skip_reading_prefix_cache``, PRs #28194 and #57269) on vLLM
0.33.0's real managers and Scheduler: exact hits from real runs, and a
lookup that ignores the flag caught."""

from __future__ import annotations

import pytest
from vllm.v1.core.kv_cache_manager import KVCacheManager

from differential.corpus import finding_tag
from tests.factories import CORPORA, stock_result

pytestmark = pytest.mark.vllm

LOCAL = CORPORA / "cases" / "prompt-logprobs-skips-reading-the-cache.json"
STORE = CORPORA / "cases" / "prompt-logprobs-skips-the-store--scheduler.json"


def test_it_hits_nothing_and_its_blocks_serve_the_next_request() -> None:
    result = stock_result(LOCAL)
    assert list(result.run.hits) == [0, 0, 176]
    # Two lookups counted (148 + 190 tokens queried): not the skipping one.
    stats = result.run.metrics.stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 338, 176)
    assert result.findings == ()


def test_the_store_answers_but_nothing_is_adopted() -> None:
    run = stock_result(STORE).run
    assert list(run.hits) == [0, 0, 176]
    lookups = [r.connector for r in run.requests]
    assert [(c.matched_tokens, c.local_tokens, c.external_tokens) for c in lookups] == [
        (0, 0, 0),
        (128, 0, 0),
        (0, 176, 0),
    ]


def test_a_lookup_ignoring_the_flag_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # KVCacheManager.prefix_cache_lookup_enabled without its flag check: the
    # request hits the writer's 128 tokens.
    monkeypatch.setattr(
        KVCacheManager, "prefix_cache_lookup_enabled", lambda self, request: self.enable_caching
    )
    result = stock_result(LOCAL)
    assert list(result.run.hits) == [0, 128, 176]
    assert sorted(finding_tag(f) for f in result.findings) == [
        "cache-metrics@run",
        "dense-mismatch@1",
        "over-hit@1",
    ]
    over = next(f for f in result.findings if finding_tag(f) == "over-hit@1")
    assert over.detail == (
        "hit 128, but the request skips reading the prefix cache "
        "(skip_reading_prefix_cache, vLLM PR #28194): it computes every prompt token"
    )

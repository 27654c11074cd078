"""DeepSeek-V4.1's SWA bounded replay on vLLM 0.33.0's real Scheduler
(``SlidingWindowMLASpec(bounded_replay=True)``, vLLM PR #56227): exact
starts from real runs, and the rules catching a replay gone wrong."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler

from differential.corpus import finding_tag
from tests.factories import CORPORA, kvfuzz_cli, stock_result

pytestmark = pytest.mark.vllm

LOCAL = CORPORA / "cases" / "dsv41-bounded-replay--scheduler.json"
STORE = CORPORA / "cases" / "dsv41-bounded-replay-connector-store.json"


def test_a_local_hit_replays_its_last_window() -> None:
    result = stock_result(LOCAL)
    run = result.run
    assert list(run.hits) == [0, 512, 64, 256]
    # 512 -> 384 (its last 128 recomputed); 64, no longer than the window, not
    # adopted; 256 -> 128.
    assert [r.replay for r in run.requests] == [(0, 0), (384, 384), (0, 0), (128, 128)]
    # The statistics count the adopted hits only: 512 + 256.
    assert run.metrics.stats.hits == 768
    assert result.findings == ()


def test_a_store_answer_replays_its_last_window() -> None:
    run = stock_result(STORE).run
    assert [r.replay for r in run.requests] == [(0, 0), (192, 192), (0, 0)]
    assert [(c.matched_tokens, c.external_tokens) for c in (r.connector for r in run.requests)] == [
        (0, 0),
        (320, 320),
        (64, 0),
    ]


def test_a_replay_start_left_at_zero_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Scheduler._mark_prefix_replay

    def forgets_the_start(self: Any, request: Any, *args: Any, **kwargs: Any) -> int:
        replayed: int = real(self, request, *args, **kwargs)
        request.replay_start = 0
        return replayed

    monkeypatch.setattr(Scheduler, "_mark_prefix_replay", forgets_the_start)
    result = stock_result(LOCAL)
    # The worker, told of no replay, also rewrites the hit's cached KV.
    assert sorted(finding_tag(f) for f in result.findings) == [
        "replay@1",
        "replay@3",
        "wrong-kv@1",
        "wrong-kv@3",
    ]
    first = next(f for f in result.findings if finding_tag(f) == "replay@1")
    assert first.detail == (
        "first scheduled with 384 computed tokens and replay_start 0, owed 384 and 384 "
        "(a hit of 512 tokens replays its last 128)"
    )


def test_a_step_without_slots_is_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    # An admission that allocates for the store's tokens only, not for the
    # 256-token step (128 of it past the replayed range) that follows.
    real = KVCacheManager.allocate_slots

    def short(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("num_external_computed_tokens"):
            num_new_tokens = 0
        return real(self, request, num_new_tokens, *args, **kwargs)

    monkeypatch.setattr(KVCacheManager, "allocate_slots", short)
    result = stock_result(STORE)
    assert result.run.uncovered_steps == ((1, 3, 0, 370, 320), (1, 3, 1, 370, 320))
    (detail,) = [f.detail for f in result.findings if finding_tag(f) == "wrong-kv@1"]
    assert detail == (
        "step 3 computes the request up to 370 tokens, but group 0 (mla, block 64) holds "
        "slots for 320: allocate_slots gave the step's tokens no block (+1 more)"
    )


def test_explain_shows_where_each_request_starts() -> None:
    done = kvfuzz_cli("explain", str(LOCAL), "--request", "1", "--variants", "unfixed")
    assert done.returncode == 0, done.stderr
    admits = [line.strip() for line in done.stdout.splitlines() if "admit" in line]
    assert admits[1:] == [
        "step 11: arrive req-1; admit req-1 (hit 512, starts at 384); run req-1 +64 (prefill)",
        "step 16: arrive req-2; admit req-2 (hit 64, starts at 0); run req-2 +64 (prefill)",
        "step 21: arrive req-3; admit req-3 (hit 256, starts at 128); run req-3 +64 (prefill)",
    ]
    assert "unfixed g1 swmla+r64 ····  hit 512; ok" in done.stdout

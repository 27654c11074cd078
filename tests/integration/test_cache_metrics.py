"""The cache-metrics rules on vLLM 0.33.0's real Scheduler and managers.

Both drivers build vLLM with ``log_stats=True``, sum the prefix-cache
statistics every ``make_stats`` drains, read ``KVCacheManager.usage`` and
call ``reset_prefix_cache`` twice: while the first request holds its blocks
(refused) and after the run (the cache emptied). Stock vLLM keeps every
rule; a statistics recorder that counts a lookup twice, a usage read as a
ratio of free blocks, and a reset that never succeeds are each caught as
``cache-metrics``.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager

from differential.findings import FindingKind
from differential.observation import PrefixCacheCounts, ResetCall
from tests.factories import CORPORA, stock_result

pytestmark = pytest.mark.vllm

PREEMPTING = CORPORA / "cases" / "circular-buffer-preemption-pool12.json"
SEQUENTIAL = CORPORA / "cases" / "extension-of-aligned-prompt.json"


def _metrics_details(result: Any) -> list[str]:
    return [f.detail for f in result.findings if f.kind is FindingKind.CACHE_METRICS]


def test_the_scheduler_counts_each_admission_and_the_preempted_one_apart() -> None:
    result = stock_result(PREEMPTING)
    metrics = result.run.metrics
    # Three requests (184 prompt tokens, 64 hit); request 2 is preempted and
    # taken up again at 96 known tokens, hitting 64.
    assert metrics.stats == PrefixCacheCounts(3, 184, 64, 1, 96, 64)
    assert metrics.usage_end == 0.0
    assert metrics.resets == (
        ResetCall(0, 1, False, 2, False),
        ResetCall(None, 0, True, 0, True),
    )
    assert _metrics_details(result) == []


def test_manager_mode_records_the_statistics_and_both_resets() -> None:
    result = stock_result(SEQUENTIAL)
    metrics = result.run.metrics
    assert metrics.stats == PrefixCacheCounts(2, 222, 88, 0, 0, 0)
    assert metrics.resets == (
        ResetCall(2, 1, False, 17, False),
        ResetCall(None, 0, True, 0, True),
    )
    assert _metrics_details(result) == []


def test_a_lookup_counted_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    record = KVCacheManager.record_prefix_cache_stats

    def twice(self: Any, request: Any, num_hits: int) -> None:
        record(self, request, num_hits)
        record(self, request, num_hits)

    monkeypatch.setattr(KVCacheManager, "record_prefix_cache_stats", twice)
    assert _metrics_details(stock_result(PREEMPTING)) == [
        "prefix-cache statistics summed over the run: requests 6 (owed 3), queries 368 "
        "(owed 184), hits 128 (owed 64), preempted_requests 2 (owed 1), "
        "preempted_queries 192 (owed 96), preempted_hits 128 (owed 64)"
    ]


def test_usage_read_as_a_ratio_of_free_blocks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def ratio(self: Any) -> float:
        # A refactor's slip: 1.0 / share free instead of 1.0 - share free.
        return float(1.0 / (self.get_num_free_blocks() / (self.num_gpu_blocks - 1)))

    monkeypatch.setattr(BlockPool, "get_usage", ratio)
    details = _metrics_details(stock_result(SEQUENTIAL))
    # 47 blocks besides the null block: 35 free while the first request ran
    # (47 / 35), all 47 after the run.
    assert details == [
        "KV cache usage read 1 to 1.34286, outside 0.0 to 1.0",
        "KV cache usage 1 once every request had finished (owed 0.0)",
    ]


def test_a_reset_that_never_succeeds_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BlockPool, "reset_prefix_cache", lambda self: False)
    result = stock_result(PREEMPTING)
    # The cache the run left, as the driver counted it before the reset.
    assert result.run.cached_blocks == 8
    assert _metrics_details(result) == [
        "reset_prefix_cache() after the run refused with no request holding KV blocks "
        "(8 cached blocks kept)"
    ]


STORE = CORPORA / "cases" / "connector-divergent-hybrid-hit-truncated.json"
# What the store holds of the case's four requests after the run, their
# longest held prefixes summed (tokens): all of it is owed to go.
HELD = 1376


def test_a_connector_reset_empties_the_store_and_flags_its_statistics() -> None:
    # After the run reset_prefix_cache(reset_connector=True): the store
    # (vLLM's CPUOffloadingManager) holds nothing, both statistics flagged.
    result = stock_result(STORE)
    assert result.run.metrics.resets[-1] == ResetCall(None, 0, True, 0, True, True, 0)
    assert _metrics_details(result) == []


def test_a_connector_reset_that_keeps_the_store_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    monkeypatch.setattr(CPUOffloadingManager, "reset_cache", lambda self: None)
    result = stock_result(STORE)
    held = result.run.metrics.resets[-1].store_held_after
    assert held == HELD
    assert _metrics_details(result) == [
        "reset_prefix_cache(reset_connector=True) after the run returned true and the KV "
        f"connector's store still holds {HELD} tokens (owed none)"
    ]


_RESUMED_WITH_A_STORE = {
    "format": "kvfuzz.scenario",
    "version": 1,
    "name": "decode-instance-resumes-a-preempted-request",
    "description": "",
    "kv_cache_groups": [
        {"kind": "full_attention", "block_size_tokens": 64, "sliding_window_tokens": None},
        {"kind": "mamba", "block_size_tokens": 64, "sliding_window_tokens": None},
        {"kind": "mamba", "block_size_tokens": 64, "sliding_window_tokens": None},
        {"kind": "mamba", "block_size_tokens": 64, "sliding_window_tokens": None},
    ],
    "hash_block_size_tokens": 2,
    "hit_alignment_tokens": None,
    "retention_interval_tokens": None,
    "drafter": {"kind": "mtp", "num_speculative_tokens": 1},
    "kv_connector": True,
    "disable_lookahead_block_hashes": True,
    "disable_eagle_block_drop": False,
    "prefill_chunk_tokens": 2,
    "decode_steps": 6,
    "shared_prefix_tokens": 8,
    "requests": [
        {"name": "s0t1", "shares_with": None, "divergence_tokens": 8, "suffix_tokens": 11},
        {
            "name": "s0t2",
            "shares_with": 0,
            "divergence_tokens": 26,
            "suffix_tokens": 4,
            "skip_reading_prefix_cache": True,
        },
        {"name": "s0t3", "shares_with": 1, "divergence_tokens": 36, "suffix_tokens": 0},
    ],
    "workload": {
        "mode": "scheduler",
        "pool_blocks": 15,
        "arrival_steps": [0, 0, 0],
        "max_num_seqs": 4,
        "max_num_batched_tokens": 4,
        "shares_output": True,
        "accepted_drafts": [],
        "connector": {"kv_role": "kv_consumer"},
    },
}


def test_a_resumed_admission_beside_a_store_is_not_owed_its_local_hit() -> None:
    # FA 64 + three Mamba 64 on a decode instance, a 15-block pool: request 2
    # is preempted and resumed, its lookup hitting 28 locally, but vLLM
    # counts what the admission adopts from the local cache beside the
    # store's answer (num_new_local_computed_tokens), which the driver does
    # not observe: preempted_hits is not judged with a store.
    from differential.compare import compare_variants
    from differential.scenario import Scenario
    from differential.variants import parse_variants

    result = compare_variants(
        Scenario.from_dict(_RESUMED_WITH_A_STORE), parse_variants("unfixed")
    ).results[0]
    (resumed,) = result.run.requests[2].resumed
    assert resumed.hit_tokens == 28
    assert result.run.metrics is not None and result.run.metrics.stats.preempted_hits == 0
    assert _metrics_details(result) == []


def test_each_request_reports_its_first_admissions_cached_tokens() -> None:
    # (request, prompt, local cached, external cached): request 2 of the
    # preempting case hit 64 at its first admission and keeps reporting it.
    assert stock_result(PREEMPTING).run.metrics.prefill_reports == (
        (0, 80, 0, 0),
        (1, 8, 0, 0),
        (2, 96, 64, 0),
    )
    # With a store: request 3 adopted 320 local tokens and loaded 64.
    assert stock_result(STORE).run.metrics.prefill_reports == (
        (0, 300, 0, 0),
        (1, 400, 288, 0),
        (2, 256, 0, 0),
        (3, 450, 320, 64),
    )


def test_a_usage_report_never_filled_in_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.metrics.stats import PrefillStats

    monkeypatch.setattr(PrefillStats, "set", lambda self, **counts: None)
    assert _metrics_details(stock_result(PREEMPTING)) == [
        "usage reports (EngineCoreOutput.prefill_stats): request 0 reported prompt 0, "
        "cached 0 local + 0 external (owed prompt 80, cached 0 local + 0 external) "
        "(+2 more request(s))"
    ]

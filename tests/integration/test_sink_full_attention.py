"""Sink full attention groups on vLLM's real code: the KVCacheManager build
crash (a labelled known issue, exit code 1), and what vLLM's
SinkFullAttentionManager hands out once built: the static sink's blocks."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.single_type_kv_cache_manager import SinkFullAttentionManager
from vllm.v1.kv_cache_interface import SinkFullAttentionSpec

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.driver import run_variant
from differential.findings import FindingKind
from differential.oracle.blocks import check_blocks
from differential.scenario import GroupKind, KVCacheGroup, RequestSpec, Scenario
from differential.variants import parse_variants
from tests.factories import ROOT, kvfuzz_cli

pytestmark = pytest.mark.vllm

ISSUE = "sink-full-attention-manager-rejects-needs-kv-cache-zeroing"
EXAMPLE = f"known-issues/{ISSUE}.json"
CRASH = (
    "build KVCacheManager: KVCacheManager: TypeError: SinkFullAttentionManager.__init__() got "
    "an unexpected keyword argument 'needs_kv_cache_zeroing' [raised in "
    "get_manager_for_kv_cache_spec (vllm/v1/core/single_type_kv_cache_manager.py)]"
)


def test_the_manager_build_crash_is_a_labelled_finding() -> None:
    # One sink_full_attention group (block 16, a 32-token sink): the
    # coordinator passes needs_kv_cache_zeroing=, the manager takes none.
    entry = load_entry(ROOT / EXAMPLE)
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed"))
    for vr in result.results:
        assert vr.run.hits == () and vr.run.error == CRASH
        (crash,) = vr.findings
        assert (crash.kind, crash.request, crash.detail) == (FindingKind.CRASH, 0, CRASH)
        assert crash.known_issue == ISSUE


def test_replay_reports_the_crash_as_expected_with_exit_code_1() -> None:
    done = kvfuzz_cli("replay", EXAMPLE)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"{CRASH} [known vLLM issue: {ISSUE}]" in done.stdout
    assert "2 finding(s), as expected" in done.stdout


def test_the_built_manager_takes_no_sink_block_off_the_free_list() -> None:
    # Built as KVCacheCoordinator would without needs_kv_cache_zeroing=:
    # of 11 blocks only the null block is taken (PR #28775's popleft_n of the
    # sink's 2 blocks is gone), and a 17-token request gets blocks 1 and 2,
    # the ones static_sink_attention.py reads and writes as the sink.
    spec = SinkFullAttentionSpec(
        block_size=16, sink_len=32, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    pool = BlockPool(num_gpu_blocks=11, enable_caching=True, hash_block_size=16)
    manager = SinkFullAttentionManager(
        spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0, scheduler_block_size=16
    )
    assert pool.get_num_free_blocks() == 10
    assert [b.block_id for b in manager.allocate_new_blocks("r0", 17, 17)] == [1, 2]


def test_writes_into_the_sinks_blocks_are_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    # SinkFullAttentionManager allocates as FullAttentionManager (its
    # __init__ adds only an assertion), so a full-attention run with the
    # ledger watching a two-block sink is what the sink group runs once it
    # builds: request 0 (17 tokens) writes blocks 1 and 2; request 1 hits
    # block 1 (16 tokens) and writes its last token into block 2 again.
    monkeypatch.setattr(Scenario, "num_sink_blocks", property(lambda s: 2))
    scenario = Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
        requests=(RequestSpec(16, 1), RequestSpec(16, 1)),
        shared_prefix_tokens=16,
    )
    (unfixed,) = parse_variants("unfixed")
    run = run_variant(scenario, unfixed)
    assert run.hits == (0, 16)
    assert [
        [(w.block_index, w.block_id, w.sink) for w in r.unsafe_writes] for r in run.requests
    ] == [
        [(0, 1, True), (1, 2, True)],
        [(1, 2, True)],
    ]
    findings = check_blocks(scenario, run)
    assert [(f.kind, f.request) for f in findings] == [
        (FindingKind.WRONG_KV, 0),
        (FindingKind.WRONG_KV, 1),
    ]
    assert "(block 1), one of the static sink's blocks (physical blocks 1-2" in findings[0].detail

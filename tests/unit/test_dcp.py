"""Decode context parallelism as a scenario setting (hand-worked, no vLLM).

``dcp_world_size`` is vLLM's ``ParallelConfig.decode_context_parallel_size``;
every ``block_size_tokens`` stays the tokens a block spans across the ranks
(vLLM's ``resolve_dcp_kv_block_size``), so the derived sizes and the oracle's
units are the sharded ones.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from differential.errors import ScenarioError
from differential.oracle import attention_dense_hit, dense_hit, drafter_model
from differential.scenario import GroupKind, KVCacheGroup, RequestSpec, Scenario

G, K = KVCacheGroup, GroupKind
REQUESTS = (RequestSpec(40, 0), RequestSpec(40, 8))


def test_dcp_is_written_only_when_set() -> None:
    plain = Scenario(kv_cache_groups=(G(K.MLA, 512),), requests=REQUESTS, shared_prefix_tokens=40)
    assert "dcp_world_size" not in plain.to_dict()
    sharded = Scenario(
        kv_cache_groups=(G(K.MLA, 512),),
        requests=REQUESTS,
        shared_prefix_tokens=40,
        dcp_world_size=8,
    )
    data = sharded.to_dict()
    assert data["dcp_world_size"] == 8
    assert Scenario.from_dict(json.loads(json.dumps(data))) == sharded


def test_dcp_mamba_hybrid_derives_vllms_sizes() -> None:
    # Per-rank block 16 at dcp 4: the full-attention block spans 64 tokens,
    # the Mamba state block stays 16 (not sharded); the scheduler block is
    # their LCM 64, the hash block their GCD 16, and fine-grained hits are on
    # with a Mamba block equal to the hash block (only under DCP).
    s = Scenario(
        kv_cache_groups=(G(K.FULL_ATTENTION, 64), G(K.MAMBA, 16)),
        requests=REQUESTS,
        shared_prefix_tokens=40,
        dcp_world_size=4,
    )
    assert s.scheduler_block_size_tokens == 64
    assert s.effective_hash_block_size_tokens == 16
    assert s.partial_hash_hits
    assert s.effective_hit_alignment_tokens == 16
    # The 40-token writer's extension is owed 32: the writer's partial tail
    # key at its last usable hash boundary (39 // 16 * 16), inside the first
    # 64-token block.
    assert attention_dense_hit(s, False, 0, 40, 40, 48, 40) == 32


def test_dcp_full_attention_proves_no_block_its_lookup_length_cuts() -> None:
    # FA 32 (8 per rank) + Mamba 8 at dcp 4, hash block 8 (A = 8), dense
    # retention; a 67-token writer prefilled in chunks of 16 keeps states at
    # 16, 32, 48 and 64 (its resume position (67 - 1) // 8 * 8). Its first 64
    # tokens resent: full attention looks up once, at L - 1 = 63, and hits the
    # whole block [0, 32) only (no partial key lies in [32, 63]: the writer's,
    # 64, is a block boundary), so it proves 32 and the sibling is owed the
    # state at 32, not 48.
    from differential.oracle import judge_run, state_positions
    from differential.oracle.state import attention_dense_hit as proof
    from differential.scenario import Drafter, DrafterKind
    from tests.unit.test_mamba_model import observed

    s = Scenario(
        kv_cache_groups=(G(K.FULL_ATTENTION, 32), G(K.MAMBA, 8)),
        requests=(RequestSpec(64, 3), RequestSpec(64, 0)),
        shared_prefix_tokens=64,
        prefill_chunk_tokens=16,
        dcp_world_size=4,
    )
    assert (s.effective_hit_alignment_tokens, s.partial_hash_hits) == (8, True)
    assert state_positions(s, 0, 0, 0, False, 0, 0) == (16, 32, 48, 64)
    assert proof(s, False, 0, 67, 67, 64, 64) == 32
    refs, findings = judge_run(s, observed(s, [0, 32]))
    assert [(r.dense_tokens, r.expected_tokens) for r in refs] == [(0, 0), (32, 32)]
    assert findings == ()
    # Under the EAGLE drop the lookup reaches one hash unit further, to 64:
    # both blocks, less one hash unit, 56; the writer's steps stop at its
    # resume position 67 // 8 * 8 - 8 = 56, whose state serves.
    eagle = dataclasses.replace(
        s, drafter=Drafter(DrafterKind.EAGLE, 1), disable_lookahead_block_hashes=True
    )
    assert state_positions(eagle, 0, 0, 0, True, 0, 0) == (16, 32, 48, 56)
    assert proof(eagle, True, 0, 67, 67, 64, 64) == 56
    refs, findings = judge_run(eagle, observed(eagle, [0, 56]))
    assert [(r.dense_tokens, r.expected_tokens) for r in refs] == [(0, 0), (56, 56)]


def test_dcp_mla_hits_land_on_the_sharded_block() -> None:
    requests = (RequestSpec(2000, 0), RequestSpec(1600, 100))
    sharded = Scenario(
        kv_cache_groups=(G(K.MLA, 512),),
        requests=requests,
        shared_prefix_tokens=2000,
        dcp_world_size=8,
    )
    per_rank = Scenario(
        kv_cache_groups=(G(K.MLA, 64),), requests=requests, shared_prefix_tokens=2000
    )
    assert dense_hit(sharded, drafter_model(sharded), 1, 0, 1600) == 1536
    assert dense_hit(per_rank, drafter_model(per_rank), 1, 0, 1600) == 1600


@pytest.mark.parametrize(
    ("groups", "dcp", "field", "allowed"),
    [
        (
            (G(K.FULL_ATTENTION, 64), G(K.SLIDING_WINDOW, 16, 64)),
            4,
            "dcp_world_size",
            "1 with a sliding_window group (kv_cache_groups[1])",
        ),
        (
            (
                G(K.FULL_ATTENTION, 64),
                G(K.CHUNKED_LOCAL_ATTENTION, 64, attention_chunk_size_tokens=128),
            ),
            2,
            "dcp_world_size",
            "chunked_local_attention group",
        ),
        ((G(K.MAMBA, 16),), 2, "dcp_world_size", "without full_attention or mla groups"),
        ((G(K.MLA, 100),), 8, "kv_cache_groups[0].block_size_tokens", "multiple of dcp"),
        (
            (G(K.FULL_ATTENTION, 64), G(K.MAMBA, 64)),
            4,
            "kv_cache_groups",
            "scheduler block size 64 divided by dcp_world_size 4",
        ),
    ],
)
def test_dcp_refusals_name_the_field(
    groups: tuple[KVCacheGroup, ...], dcp: int, field: str, allowed: str
) -> None:
    with pytest.raises(ScenarioError) as info:
        Scenario(
            kv_cache_groups=groups,
            requests=REQUESTS,
            shared_prefix_tokens=40,
            dcp_world_size=dcp,
        )
    assert info.value.field == field
    assert allowed in str(info.value)


def test_dcp_out_of_range_is_refused_by_the_json_form() -> None:
    data = Scenario(
        kv_cache_groups=(G(K.MLA, 512),), requests=REQUESTS, shared_prefix_tokens=40
    ).to_dict()
    for bad in (0, 2048, True, 2.0):
        with pytest.raises(ScenarioError, match="dcp_world_size"):
            Scenario.from_dict({**data, "dcp_world_size": bad})


def test_generator_reaches_decode_context_parallel_layouts() -> None:
    from fuzz.strategies import engine_scenarios
    from tests.factories import reach

    mla = reach(lambda s: s.dcp_world_size == 8 and not s.mamba_groups)
    assert {g.kind for g in mla.kv_cache_groups} <= {K.FULL_ATTENTION, K.MLA}
    hybrid = reach(lambda s: s.dcp_world_size > 1 and bool(s.mamba_groups))
    block = hybrid.mamba_groups[0].block_size_tokens
    assert hybrid.scheduler_block_size_tokens == block * hybrid.dcp_world_size
    assert reach(lambda s: s.dcp_world_size > 1, engine_scenarios()).workload.mode.value == (
        "scheduler"
    )


def test_shrinker_tries_one_rank() -> None:
    from fuzz.minimize import _simplify

    hybrid = Scenario(
        kv_cache_groups=(G(K.FULL_ATTENTION, 64), G(K.MAMBA, 16)),
        requests=REQUESTS,
        shared_prefix_tokens=40,
        dcp_world_size=4,
    )
    steps = dict(_simplify(hybrid))
    one_rank = steps["no decode context parallelism"]
    assert one_rank is not None
    assert one_rank.dcp_world_size == 1
    # The same per-rank blocks: full attention 16, the Mamba state block 16.
    assert [g.block_size_tokens for g in one_rank.kv_cache_groups] == [16, 16]
    mla = Scenario(
        kv_cache_groups=(G(K.MLA, 512),),
        requests=REQUESTS,
        shared_prefix_tokens=40,
        dcp_world_size=8,
    )
    plain = dict(_simplify(mla))["no decode context parallelism"]
    assert plain is not None and plain.kv_cache_groups == mla.kv_cache_groups


def test_full_event_reports_under_dcp_are_a_known_issue() -> None:
    import dataclasses

    from differential.findings import Finding, FindingKind
    from differential.oracle.known import label_known
    from differential.scenario import KVEvents, Workload

    def mla(dcp: int, events: KVEvents) -> Scenario:
        return Scenario(
            kv_cache_groups=(G(K.MLA, 512),),
            requests=REQUESTS,
            shared_prefix_tokens=40,
            dcp_world_size=dcp,
            workload=Workload(kv_events=events),
        )

    crash = Finding(
        FindingKind.CRASH,
        "unfixed",
        1,
        "request 1: lookup: KVCacheManager.get_computed_blocks: AssertionError:  "
        "[raised in resolve_block_hashes (vllm/v1/core/kv_cache_utils.py)]",
    )
    name = "kv-events-full-report-dcp-block-size"
    assert label_known(mla(8, KVEvents.FULL), [crash])[0].known_issue == name
    report = dataclasses.replace(
        crash,
        kind=FindingKind.KV_EVENTS,
        detail="lookup: step 2: the lookup of request 1 (hit 32 tokens): its BlockStored ...",
    )
    assert label_known(mla(8, KVEvents.FULL), [report])[0].known_issue == name
    # Near misses: one rank, incremental reports, another crash.
    assert label_known(mla(1, KVEvents.FULL), [crash])[0].known_issue is None
    assert label_known(mla(8, KVEvents.INCREMENTAL), [crash])[0].known_issue is None
    other = dataclasses.replace(crash, detail="request 1: free: ValueError: no")
    assert label_known(mla(8, KVEvents.FULL), [other])[0].known_issue is None

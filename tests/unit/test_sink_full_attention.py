"""Sink full attention groups (vLLM ``SinkFullAttentionSpec``, openPangu's
static sink attention): the layout rules, what the oracle owes a sibling,
the sink-block write rule and the known crash's label, hand-worked (no vLLM)."""

from __future__ import annotations

import dataclasses

import pytest

from differential.errors import ScenarioError
from differential.findings import Finding, FindingKind
from differential.observation import BlockWrite, RequestObservation
from differential.oracle import dense_hit, drafter_model
from differential.oracle.blocks import GROUP_CHECKS, ViolationKind, request_violations
from differential.oracle.known import KNOWN_ISSUES, label_known
from differential.scenario import (
    Drafter,
    DrafterKind,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
)
from tests.factories import layout_scenario

K = GroupKind
G = KVCacheGroup
MTP = Drafter(DrafterKind.MTP, 1)
SINK = G(K.SINK_FULL_ATTENTION, 16, sink_len_tokens=32)
CRASH = (
    "build KVCacheManager: KVCacheManager: TypeError: SinkFullAttentionManager.__init__() got "
    "an unexpected keyword argument 'needs_kv_cache_zeroing' [raised in "
    "get_manager_for_kv_cache_spec (vllm/v1/core/single_type_kv_cache_manager.py)]"
)


scenario = layout_scenario


def test_the_sink_is_full_attention_with_its_own_blocks() -> None:
    s = scenario(SINK, G(K.SLIDING_WINDOW, 8, 32))
    assert K.SINK_FULL_ATTENTION.full_attention_family
    assert K.SINK_FULL_ATTENTION.prefix_cacheable
    # The sink does not enter the block sizes: LCM 16, GCD 8.
    assert (s.scheduler_block_size_tokens, s.effective_hash_block_size_tokens) == (16, 8)
    assert SINK.num_sink_blocks == 2 and s.num_sink_blocks == 2
    # Two sinks alias the same first blocks: the pool owes the larger one.
    two = scenario(SINK, G(K.SINK_FULL_ATTENTION, 8, sink_len_tokens=32))
    assert two.num_sink_blocks == 4
    assert scenario(G(K.FULL_ATTENTION, 16)).num_sink_blocks == 0
    # A sink length is part of the spec: two lengths are two specs.
    assert SINK.spec_key != G(K.SINK_FULL_ATTENTION, 16, sink_len_tokens=48).spec_key
    assert Scenario.from_json(s.to_json()) == s
    assert '"sink_len_tokens": 32' in s.to_json()
    assert "sink_len_tokens" not in scenario(G(K.FULL_ATTENTION, 16)).to_json()
    assert s.group_mix == "sliding_window+sink_full_attention"  # GroupKind order


@pytest.mark.parametrize(
    ("group", "field", "message"),
    [
        (G(K.SINK_FULL_ATTENTION, 16), "sink_len_tokens", "a positive multiple of the block size"),
        (
            G(K.SINK_FULL_ATTENTION, 16, sink_len_tokens=24),
            "sink_len_tokens",
            r"a positive multiple of the block size \(16\)",
        ),
        (
            G(K.FULL_ATTENTION, 16, sink_len_tokens=32),
            "sink_len_tokens",
            "null for a full_attention group",
        ),
        (
            G(K.SINK_FULL_ATTENTION, 16, sliding_window_tokens=32, sink_len_tokens=32),
            "sliding_window_tokens",
            "null for a sink_full_attention group",
        ),
    ],
)
def test_refused_sink_groups(group: KVCacheGroup, field: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        scenario(group)
    assert info.value.field == f"kv_cache_groups[0].{field}"


def test_dense_hit_is_full_attentions() -> None:
    # The sink is no request's prefix: a sibling is owed what full attention
    # owes it. A sibling sharing 50 tokens at A = 16: 48; under MTP's drop
    # (no lookahead hashes) 50 // 16 * 16 = 48, less its last block: 32.
    for drafter, owed in ((Drafter(), 48), (MTP, 32)):
        protect = drafter.kind is not DrafterKind.NONE
        sink = scenario(SINK, drafter=drafter, disable_lookahead_block_hashes=protect)
        full = scenario(
            G(K.FULL_ATTENTION, 16), drafter=drafter, disable_lookahead_block_hashes=protect
        )
        assert dense_hit(sink, drafter_model(sink), 1, 0, 50) == owed
        assert dense_hit(full, drafter_model(full), 1, 0, 50) == owed
    assert GROUP_CHECKS[K.SINK_FULL_ATTENTION] is GROUP_CHECKS[K.FULL_ATTENTION]


def _request(*writes: BlockWrite) -> RequestObservation:
    return RequestObservation(
        index=0,
        prompt_tokens=17,
        hit_tokens=0,
        shared_prefix_boundary_tokens=0,
        per_group_hit_tokens=(0,),
        retained_blocks_per_group=(0,),
        unsafe_writes=writes,
    )


def test_a_write_into_the_sinks_blocks_is_an_unsafe_write() -> None:
    # Sink of 32 tokens at block 16: physical blocks 1 and 2 hold it
    # (static_sink_attention.py). A 17-token prompt's two blocks, handed
    # out as 1 and 2 by a pool that reserved nothing, overwrite both.
    s = scenario(SINK, requests=(RequestSpec(16, 1),))
    writes = [BlockWrite(0, 0, k, k + 1, 1, cached=False, null=False, sink=True) for k in (0, 1)]
    violations = request_violations(s, _request(*writes), None)  # type: ignore[arg-type]
    assert [(v.kind, v.group, v.block_index) for v in violations] == [
        (ViolationKind.UNSAFE_WRITE, 0, 0),
        (ViolationKind.UNSAFE_WRITE, 0, 1),
    ]
    assert violations[1].detail == (
        "the step at 0 tokens writes group 0 block index 1 (block 2), one of the static "
        "sink's blocks (physical blocks 1-2, which the attention backend reads as the sink: "
        "never handed to a request, vLLM PR #28775)"
    )
    # Block 3 is past the sink: a write held by two requests says so instead.
    other = BlockWrite(0, 0, 2, 3, 2, cached=False, null=False)
    (v,) = request_violations(s, _request(other), None)  # type: ignore[arg-type]
    assert v.detail.endswith("(block 3), held by 2 request(s)")
    assert BlockWrite.from_dict(writes[0].to_dict()) == writes[0]
    assert writes[0].to_dict()["sink"] is True and "sink" not in other.to_dict()


def test_the_known_crash_is_labelled_only_on_a_sink_layout() -> None:
    (issue,) = [i for i in KNOWN_ISSUES if i.name.startswith("sink-full-attention")]
    assert issue.example.endswith(f"{issue.name}.json")
    s = scenario(SINK)
    crash = Finding(FindingKind.CRASH, "unfixed", 0, CRASH)
    assert [f.known_issue for f in label_known(s, [crash])] == [issue.name]
    # The same text on a layout without a sink, or another TypeError: unlabelled.
    plain = scenario(G(K.FULL_ATTENTION, 16))
    assert [f.known_issue for f in label_known(plain, [crash])] == [None]
    other = dataclasses.replace(crash, detail=CRASH.replace("SinkFullAttention", "FullAttention"))
    assert [f.known_issue for f in label_known(s, [other])] == [None]


def test_the_generator_draws_a_sink_only_when_pinned() -> None:
    from hypothesis import given, settings

    from fuzz.strategies import scenarios
    from tests.factories import reach

    # Pinned: beside an attention layout at its scheduler block with a
    # two-block sink, and beside a Mamba hybrid likewise.
    for kinds in ({K.SINK_FULL_ATTENTION}, {K.SINK_FULL_ATTENTION, K.MAMBA}):
        s = reach(lambda s: len(s.kv_cache_groups) > 1, scenarios(kinds=frozenset(kinds)))
        (sink,) = [g for g in s.kv_cache_groups if g.kind is K.SINK_FULL_ATTENTION]
        assert sink.sink_len_tokens == 2 * sink.block_size_tokens
        assert sink.block_size_tokens == s.scheduler_block_size_tokens

    @settings(max_examples=200, database=None, deadline=None)
    @given(scenarios())
    def unpinned(s: Scenario) -> None:
        assert s.num_sink_blocks == 0

    unpinned()


def test_engine_mode_builds_no_sink_model_and_scales_the_sink() -> None:
    from differential.driver.engine_mode import EngineUnsupported, engine_plan, scaled

    s = scenario(SINK)
    # The geometry scale keeps the sink a multiple of the block: x2 -> 64 of 32.
    (group,) = scaled(s, 2).kv_cache_groups
    assert (group.block_size_tokens, group.sink_len_tokens, group.num_sink_blocks) == (32, 64, 2)
    with pytest.raises(EngineUnsupported, match=r"^sink_full_attention groups: kvfuzz's engine"):
        engine_plan(s)


def test_an_exported_crash_test_builds_the_sink_spec() -> None:
    from differential.exports.manager_test import export_test

    s = scenario(SINK, requests=(RequestSpec(16, 1),))
    crash = Finding(FindingKind.CRASH, "unfixed", 0, CRASH)
    source = export_test(s, crash, None, signature="crash", name="t", fixed_hit_tokens=None)
    assert "from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, " in source
    assert "SinkFullAttentionSpec" in source.split("init_none_hash(sha256)")[0]
    assert "            kv_cache_spec=SinkFullAttentionSpec(\n" in source
    assert "                sink_len=32,\n" in source
    assert "Geometry: sink_full_attention block 16 sink 32;" in source
    compile(source, "exported.py", "exec")

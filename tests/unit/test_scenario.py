"""The scenario model: validation naming the field, exact JSON round trips."""

from __future__ import annotations

import json

import pytest

from differential.corpus import load_entry
from differential.errors import ScenarioError
from differential.oracle import common_prefix_tokens
from differential.scenario import (
    ConnectorStore,
    Drafter,
    DrafterKind,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    MultiModalInput,
    RequestSpec,
    Scenario,
    Workload,
)
from fuzz.minimize import _drop_requests
from tests.factories import CORPORA, hybrid, triton


def test_every_corpus_file_round_trips_exactly() -> None:
    files = sorted(CORPORA.rglob("*.json"))
    assert files, "the corpus is empty"
    for path in files:
        raw = json.loads(path.read_text())
        if "kv_cache_groups" not in raw:
            # A model-level file: vLLM's planner makes its groups, and the
            # resolved scenario (groups and model) round-trips.
            scenario = load_entry(path).scenario
            assert scenario.model is not None and scenario.kv_cache_groups, path.name
            assert Scenario.from_dict(scenario.to_dict()) == scenario, path.name
            continue
        scenario = Scenario.from_dict(raw)
        assert Scenario.from_dict(scenario.to_dict()) == scenario
        # expect, notes, finding and engine (how engine mode maps the geometry)
        # annotate the file; they are not part of the scenario value.
        body = {k: v for k, v in raw.items() if k not in ("expect", "notes", "finding", "engine")}
        assert scenario.to_dict() == body, path.name


def test_json_text_round_trip_is_byte_exact() -> None:
    scenario = triton()
    text = scenario.to_json()
    assert Scenario.from_json(text).to_json() == text


def test_derived_sizes_follow_vllm() -> None:
    scenario = triton()
    assert scenario.scheduler_block_size_tokens == 32  # lcm(32, 16)
    assert scenario.effective_hash_block_size_tokens == 16  # gcd(32, 16)
    assert scenario.effective_hit_alignment_tokens == 32
    odd = hybrid(12, 8, 64, prefix=48, requests=(RequestSpec(48, 1),), retention=None)
    assert odd.scheduler_block_size_tokens == 24
    assert odd.effective_hash_block_size_tokens == 4


def test_prompts_share_exactly_the_declared_prefix() -> None:
    scenario = hybrid(
        8,
        4,
        16,
        prefix=64,
        requests=(
            RequestSpec(64, 10),
            RequestSpec(40, 5),
            RequestSpec(70, 3, shares_with=0),
            RequestSpec(64, 0),
        ),
        retention=None,
    )
    p = scenario.prompts
    assert [len(x) for x in p] == [74, 45, 73, 64]
    assert common_prefix_tokens(p[0], p[1]) == 40
    assert common_prefix_tokens(p[0], p[2]) == 70  # copies 6 of request 0's own tokens
    assert common_prefix_tokens(p[1], p[2]) == 40
    assert common_prefix_tokens(p[0], p[3]) == 64
    assert p[3] == p[0][:64]


def test_a_rejoining_request_is_its_source_with_a_stretch_replaced() -> None:
    scenario = hybrid(
        8,
        4,
        16,
        prefix=64,
        requests=(
            RequestSpec(64, 10),
            RequestSpec(16, 8, rejoin_tokens=40),
            RequestSpec(20, 4, shares_with=1, rejoin_tokens=40),
        ),
        retention=None,
    )
    p = scenario.prompts
    assert [len(x) for x in p] == [74, 64, 64]
    # Request 1: the prefix's [0, 16), 8 tokens of its own, the prefix's [24, 64).
    assert p[1][:16] == p[0][:16] and p[1][24:] == p[0][24:64]
    assert not set(p[1][16:24]) & set(p[0])
    assert common_prefix_tokens(p[0], p[1]) == 16
    # Request 2 edits request 1's [20, 24), its own tokens, and rejoins them.
    assert common_prefix_tokens(p[1], p[2]) == 20 and p[2][24:] == p[1][24:]
    assert common_prefix_tokens(p[0], p[2]) == 16
    assert scenario.requests[1].source_tokens == 64
    # Written only when set; round trips.
    data = scenario.to_dict()
    assert "rejoin_tokens" not in data["requests"][0]
    assert data["requests"][1]["rejoin_tokens"] == 40
    assert Scenario.from_dict(data) == scenario


def _bad(field: str, **changes: object) -> None:
    data = triton().to_dict()
    for key, value in changes.items():
        data[key] = value
    with pytest.raises(ScenarioError) as info:
        Scenario.from_dict(data)
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)


def test_retention_must_be_a_multiple_of_the_scheduler_block() -> None:
    _bad("retention_interval_tokens", retention_interval_tokens=8200)
    _bad("retention_interval_tokens", retention_interval_tokens=-32)


def test_unknown_drafter_names_the_allowed_values() -> None:
    data = triton().to_dict()
    data["drafter"] = {"kind": "medusa", "num_speculative_tokens": 3}
    with pytest.raises(ScenarioError) as info:
        Scenario.from_dict(data)
    assert info.value.field == "drafter.kind"
    assert "'eagle3'" in info.value.allowed and "'gemma4_mtp'" in info.value.allowed


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("hit_alignment_tokens", {"hit_alignment_tokens": 16}),
        ("hash_block_size_tokens", {"hash_block_size_tokens": 3}),
        ("prefill_chunk_tokens", {"prefill_chunk_tokens": 0}),
        ("decode_steps", {"decode_steps": -1}),
        ("format", {"format": "something.else"}),
        ("version", {"version": 99}),
        ("colour", {"colour": "blue"}),
        (
            "drafter.num_speculative_tokens",
            {"drafter": {"kind": "mtp", "num_speculative_tokens": 0}},
        ),
        (
            "drafter.num_speculative_tokens",
            {"drafter": {"kind": "none", "num_speculative_tokens": 2}},
        ),
        ("kv_cache_groups", {"kv_cache_groups": []}),
        ("requests", {"requests": []}),
        (
            "requests[0].divergence_tokens",
            {"requests": [{"divergence_tokens": 20000, "suffix_tokens": 1}]},
        ),
        (
            "requests[0].shares_with",
            {"requests": [{"divergence_tokens": 1, "suffix_tokens": 1, "shares_with": 0}]},
        ),
        ("kv_connector", {"kv_connector": "yes"}),
        (
            "requests[1].rejoin_tokens",
            {
                "requests": [
                    {"divergence_tokens": 16384, "suffix_tokens": 64},
                    {"divergence_tokens": 8192, "suffix_tokens": 64, "rejoin_tokens": 8129},
                ]
            },
        ),
        (
            "requests[1].rejoin_tokens",
            {
                "requests": [
                    {"divergence_tokens": 16384, "suffix_tokens": 64},
                    {"divergence_tokens": 8192, "suffix_tokens": 0, "rejoin_tokens": 64},
                ]
            },
        ),
        (
            "requests[0].rejoin_tokens",
            {"requests": [{"divergence_tokens": 1, "suffix_tokens": 1, "rejoin_tokens": -1}]},
        ),
    ],
)
def test_invalid_fields_are_named(field: str, changes: dict[str, object]) -> None:
    _bad(field, **changes)


def test_group_rules() -> None:
    with pytest.raises(ScenarioError, match=r"kv_cache_groups\[1\].sliding_window_tokens"):
        Scenario(
            kv_cache_groups=(
                KVCacheGroup(GroupKind.FULL_ATTENTION, 16),
                KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, None),
            ),
            requests=(RequestSpec(1, 1),),
            shared_prefix_tokens=1,
        )
    # Any mix runs on vLLM's HybridKVCacheCoordinator, even with no
    # full-attention group.
    two_windows = Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, 64),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, 32),
        ),
        requests=(RequestSpec(1, 1),),
        shared_prefix_tokens=1,
    )
    assert two_windows.group_mix == "2xsliding_window"
    # A single group of any kind runs on vLLM's UnitaryKVCacheCoordinator.
    alone = Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, 64),),
        requests=(RequestSpec(1, 1),),
        shared_prefix_tokens=1,
        retention_interval_tokens=0,
    )
    assert alone.effective_hit_alignment_tokens == 16
    with pytest.raises(ScenarioError, match="retention only applies"):
        Scenario(
            kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
            requests=(RequestSpec(1, 1),),
            shared_prefix_tokens=1,
            retention_interval_tokens=32,
        )


def test_multi_module_mtp_constraints_mirror_vllm() -> None:
    with pytest.raises(ScenarioError, match="scheduler block size 8"):
        hybrid(
            8,
            4,
            16,
            prefix=8,
            requests=(RequestSpec(8, 1),),
            retention=None,
            drafter=DrafterKind.MULTI_MODULE_MTP,
            spec_tokens=9,
        )
    with pytest.raises(ScenarioError) as info:
        hybrid(
            8,
            4,
            16,
            prefix=8,
            requests=(RequestSpec(8, 1),),
            retention=None,
            drafter=DrafterKind.MULTI_MODULE_MTP,
            spec_tokens=4,
            chunk=3,
        )
    assert info.value.field == "prefill_chunk_tokens"


def test_malformed_json_names_the_position() -> None:
    with pytest.raises(ScenarioError) as info:
        Scenario.from_json('{"kv_cache_groups": [', source="x.json")
    assert info.value.field == "<json>"
    assert str(info.value).startswith("x.json: ")


def test_drafter_default_is_none() -> None:
    data = triton().to_dict()
    del data["drafter"]
    assert Scenario.from_dict(data).drafter == Drafter(DrafterKind.NONE, 0)


def test_an_unknown_field_of_a_nullable_object_lists_its_known_fields() -> None:
    # workload.connector is an object or null: the known fields are the object's.
    data = triton().to_dict()
    data["kv_connector"] = True
    data["workload"] = {"mode": "scheduler", "connector": {"lod": "sync"}}
    with pytest.raises(ScenarioError) as info:
        Scenario.from_dict(data)
    assert str(info.value) == (
        "workload.connector.lod = 'sync' is invalid: allowed no such field; known fields: "
        "capacity_chunks, chunk_tokens, divergent_hybrid_hits, failed_loads, "
        "kv_load_failure_policy, kv_role, load, prefix_caching, supports_hma"
    )


def _aborting(aborts: tuple[int | None, ...]) -> Scenario:
    """FA 16, scheduler mode: a writer and two readers, the given abort steps."""
    return Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
        requests=(RequestSpec(64, 0), RequestSpec(64, 8), RequestSpec(64, 8)),
        shared_prefix_tokens=64,
        workload=Workload(mode=DriveMode.SCHEDULER, abort_steps=aborts),
    )


def test_abort_steps_of_nulls_only_are_refused_and_the_shrinker_writes_null() -> None:
    # A list that aborts nothing would turn a sequential run's exact judgment
    # off (it is judged per lookup as scheduled): it is written null.
    with pytest.raises(ScenarioError) as info:
        _aborting((None, None, None))
    assert str(info.value) == (
        "workload.abort_steps = [None, None, None] is invalid: allowed null or a list with "
        "at least one step (a list of nulls aborts nothing: write null)"
    )
    dropped = dict(_drop_requests(_aborting((None, None, 3))))["drop request 2"]
    assert dropped is not None and dropped.workload.abort_steps is None
    assert dropped.workload.sequential


def test_a_pool_must_hold_the_longest_request_with_its_decoded_tokens() -> None:
    # FA 16: a 64-token prompt and 40 decode steps compute 104 tokens, 7
    # blocks, plus the null block. A pool of 6 passed (the prompt's 4 blocks)
    # and then ran out mid-decode (manager mode) or never scheduled the
    # request, reported as a vLLM crash (scheduler mode).
    def scenario(pool: int) -> Scenario:
        return Scenario(
            kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
            requests=(RequestSpec(64, 0),),
            shared_prefix_tokens=64,
            decode_steps=40,
            workload=Workload(mode=DriveMode.SCHEDULER, pool_blocks=pool),
        )

    assert scenario(8).workload.pool_blocks == 8
    with pytest.raises(ScenarioError) as info:
        scenario(7)
    assert str(info.value) == (
        "workload.pool_blocks = 7 is invalid: allowed null or at least 8 blocks (the null "
        "block, the longest prompt of 64 tokens and its 40 decoded tokens in each "
        "full-attention group's blocks, one block per other group)"
    )


def test_divergent_hybrid_hits_need_a_mamba_hybrid() -> None:
    # vLLM reads the flag only on Mamba hybrids with full attention: elsewhere
    # it silently did nothing.
    with pytest.raises(ScenarioError) as info:
        Scenario(
            kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
            requests=(RequestSpec(64, 0), RequestSpec(64, 8)),
            shared_prefix_tokens=64,
            kv_connector=True,
            workload=Workload(
                mode=DriveMode.SCHEDULER, connector=ConnectorStore(divergent_hybrid_hits=True)
            ),
        )
    assert str(info.value) == (
        "workload.connector.divergent_hybrid_hits = True is invalid: allowed false for a "
        "model without mamba groups beside a full_attention or mla group (vLLM shows a "
        "connector divergent hits on such Mamba hybrids only)"
    )


def test_the_generator_draws_no_divergent_hybrid_hits_without_full_attention() -> None:
    # A Mamba-only layout's store drew divergent hits, which the rule above
    # refuses: a scheduler-mode campaign on Mamba layouts stopped with exit 3.
    from hypothesis import HealthCheck, find, settings
    from hypothesis.errors import NoSuchExample

    from fuzz.strategies import _connector_stores

    quick = settings(
        max_examples=200,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    with pytest.raises(NoSuchExample):
        find(
            _connector_stores(3, True, False),
            lambda c: bool(c and c.divergent_hybrid_hits),
            settings=quick,
        )
    assert find(
        _connector_stores(3, True, True),
        lambda c: bool(c and c.divergent_hybrid_hits),
        settings=quick,
    )


@pytest.mark.parametrize(
    ("offset", "suffix", "message"),
    [
        (
            200,
            84,
            "requests[0].mm_inputs[0].suffix_offset_tokens = 200 is invalid: allowed 0..83 "
            "(an image starts among the request's 84 own tokens)",
        ),
        (
            80,
            84,
            "requests[0].mm_inputs[0].length_tokens = 40 is invalid: allowed at most 4 (an "
            "image lies among the request's 84 own tokens)",
        ),
        (
            0,
            0,
            "requests[0].mm_inputs = '1 image(s)' is invalid: allowed [] when suffix_tokens "
            "is 0 (an image lies among the request's own tokens)",
        ),
    ],
)
def test_an_image_past_the_own_tokens_names_its_offset(
    offset: int, suffix: int, message: str
) -> None:
    # An offset past the request's own tokens blamed the length ("at most 0").
    image = MultiModalInput(suffix_offset_tokens=offset, length_tokens=40, identifier="cat")
    with pytest.raises(ScenarioError) as info:
        Scenario(
            kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
            requests=(RequestSpec(16, suffix, mm_inputs=(image,)),),
            shared_prefix_tokens=16,
        )
    assert str(info.value) == message

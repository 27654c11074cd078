"""Group layouts: every kind, any mix, draft groups, chunked local attention,
and the alignment-blowup layout finding (hand-worked, no vLLM)."""

from __future__ import annotations

import pytest

from differential.errors import ScenarioError
from differential.findings import FindingKind
from differential.oracle import dense_hit, drafter_model
from differential.oracle.layout import alignment_blowup, alignment_losses
from differential.scenario import (
    Drafter,
    DrafterKind,
    DraftGroups,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
)
from tests.factories import layout_scenario

K = GroupKind
G = KVCacheGroup
NO_DRAFTER = Drafter()


scenario = layout_scenario


EAGLE = Drafter(DrafterKind.EAGLE3, 1)


def test_every_kind_round_trips_and_old_files_stay_identical() -> None:
    s = scenario(
        G(K.MLA, 16),
        G(K.SLIDING_WINDOW_MLA, 8, 32),
        G(K.CHUNKED_LOCAL_ATTENTION, 16, attention_chunk_size_tokens=32),
        G(K.FULL_ATTENTION, 4, is_eagle_group=True),
        drafter=EAGLE,
    )
    assert Scenario.from_json(s.to_json()) == s
    assert s.group_mix == ("mla+sliding_window_mla+chunked_local_attention+draft:full_attention")
    data = scenario(G(K.FULL_ATTENTION, 16)).to_dict()
    # Fields added for these kinds are absent when unset.
    assert set(data["kv_cache_groups"][0]) == {
        "kind",
        "block_size_tokens",
        "sliding_window_tokens",
    }


def test_any_mix_in_any_order() -> None:
    s = scenario(
        G(K.SLIDING_WINDOW, 4, 16),
        G(K.MLA, 256),
        G(K.SLIDING_WINDOW_MLA, 64, 128),
        G(K.FULL_ATTENTION, 8),
        G(K.FULL_ATTENTION, 32),
    )
    assert s.scheduler_block_size_tokens == 256
    assert s.effective_hash_block_size_tokens == 4
    assert s.full_attention_group == G(K.MLA, 256)
    assert len(s.sliding_window_groups) == 2


@pytest.mark.parametrize(
    ("groups", "drafter", "field", "message"),
    [
        ((G(K.MLA, 16, 32),), Drafter(), "kv_cache_groups[0].sliding_window_tokens", "null"),
        (
            (G(K.SLIDING_WINDOW_MLA, 16),),
            Drafter(),
            "kv_cache_groups[0].sliding_window_tokens",
            ">= 1",
        ),
        (
            (G(K.FULL_ATTENTION, 16), G(K.CHUNKED_LOCAL_ATTENTION, 16)),
            Drafter(),
            "kv_cache_groups[1].attention_chunk_size_tokens",
            ">= 1",
        ),
        (
            (G(K.FULL_ATTENTION, 16, attention_chunk_size_tokens=32),),
            Drafter(),
            "kv_cache_groups[0].attention_chunk_size_tokens",
            "null",
        ),
        (
            (
                G(K.FULL_ATTENTION, 32),
                G(K.CHUNKED_LOCAL_ATTENTION, 16, attention_chunk_size_tokens=64),
            ),
            Drafter(),
            "kv_cache_groups[1].block_size_tokens",
            "hit alignment 32",
        ),
        (
            (
                G(K.FULL_ATTENTION, 16),
                G(K.CHUNKED_LOCAL_ATTENTION, 16, attention_chunk_size_tokens=24),
            ),
            Drafter(),
            "kv_cache_groups[1].attention_chunk_size_tokens",
            "multiple of",
        ),
        (
            (G(K.CHUNKED_LOCAL_ATTENTION, 16, attention_chunk_size_tokens=64),),
            Drafter(),
            "kv_cache_groups",
            "full_attention or mla group beside",
        ),
        (
            (G(K.FULL_ATTENTION, 16, is_eagle_group=True),),
            Drafter(),
            "kv_cache_groups[0].is_eagle_group",
            "drafter",
        ),
        (
            (G(K.FULL_ATTENTION, 16, is_eagle_group=True),),
            Drafter(DrafterKind.DSPARK, 2),
            "kv_cache_groups[0].is_eagle_group",
            "drafter",
        ),
        (
            (G(K.FULL_ATTENTION, 16), G(K.MAMBA, 16, is_eagle_group=True)),
            EAGLE,
            "kv_cache_groups[1].is_eagle_group",
            "mamba",
        ),
    ],
)
def test_refused_layouts_name_the_field(
    groups: tuple[KVCacheGroup, ...], drafter: Drafter, field: str, message: str
) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        scenario(*groups, drafter=drafter)
    assert info.value.field == field


def test_chunked_local_refuses_the_eagle_drop_only_where_it_applies() -> None:
    groups = (
        G(K.FULL_ATTENTION, 16),
        G(K.CHUNKED_LOCAL_ATTENTION, 16, attention_chunk_size_tokens=64),
    )
    # Fallback + drop on: vLLM's ChunkedLocalAttentionManager asserts.
    with pytest.raises(ScenarioError, match="EAGLE block drop") as info:
        scenario(*groups, drafter=EAGLE, disable_lookahead_block_hashes=True)
    assert info.value.field == "kv_cache_groups"
    # Lookahead hashes clear the drop; a marked draft group keeps it off the chunked group.
    scenario(*groups, drafter=EAGLE)
    marked = scenario(
        *groups,
        G(K.FULL_ATTENTION, 8, is_eagle_group=True),
        drafter=EAGLE,
        disable_lookahead_block_hashes=True,
    )
    assert marked.drop_group_indices == frozenset({2})


def test_draft_groups_modes_and_spec_batching() -> None:
    plain = scenario(G(K.FULL_ATTENTION, 8), G(K.SLIDING_WINDOW, 4, 16))
    assert (plain.draft_groups, plain.drop_group_indices) == (DraftGroups.NONE, frozenset())
    fallback = scenario(G(K.FULL_ATTENTION, 8), G(K.SLIDING_WINDOW, 4, 16), drafter=EAGLE)
    assert fallback.draft_groups is DraftGroups.FALLBACK
    assert fallback.drop_group_indices == frozenset({0, 1})
    # A draft group whose spec equals a target group's is looked up with it
    # (HybridKVCacheCoordinator.verify_and_split_kv_cache_groups): both drop.
    shared = scenario(
        G(K.FULL_ATTENTION, 8),
        G(K.SLIDING_WINDOW, 4, 16),
        G(K.FULL_ATTENTION, 8, is_eagle_group=True),
        drafter=EAGLE,
    )
    assert shared.draft_groups is DraftGroups.ANNOTATED
    assert shared.drop_group_indices == frozenset({0, 2})


def test_dense_hit_drops_only_in_the_draft_group() -> None:
    # Prompts of 68 tokens sharing 50: full 8 and SWA 4 prove 48; the draft
    # group (block 4) proves 48 and drops one block -> 44 -> aligned to 8: 40.
    # Under the fallback every group drops its own block: full 48-8=40,
    # SWA 48-4=44, draft 44 -> 40 as well; with a 56-token share, the draft
    # drop alone gives 56-4=52 -> 48, the fallback 56-8=48 -> 48; with 52
    # shared: annotated min(48, 48, 52-4=48) = 48, fallback 48-8 = 40.
    def hit(annotated: bool, shared: int) -> int:
        s = scenario(
            G(K.FULL_ATTENTION, 8),
            G(K.SLIDING_WINDOW, 4, 16),
            G(K.FULL_ATTENTION, 4, is_eagle_group=annotated),
            drafter=EAGLE,
            disable_lookahead_block_hashes=True,
            requests=(RequestSpec(64, 4), RequestSpec(shared, 16)),
        )
        return dense_hit(s, drafter_model(s), 1, 0, shared)

    assert (hit(True, 52), hit(False, 52)) == (48, 40)
    assert (hit(True, 50), hit(False, 50)) == (40, 40)


def test_dense_hit_chunked_local_accepts_a_chunk_boundary() -> None:
    # Full attention bounds the hit at the shared prefix; the chunked group
    # (chunk 32) needs only the blocks of the chunk the hit ends in.
    s = scenario(
        G(K.FULL_ATTENTION, 16),
        G(K.CHUNKED_LOCAL_ATTENTION, 16, attention_chunk_size_tokens=32),
        requests=(RequestSpec(64, 4), RequestSpec(50, 30)),
    )
    assert dense_hit(s, drafter_model(s), 1, 0, 50) == 48


def test_alignment_blowup_1536_3456() -> None:
    s = Scenario(
        kv_cache_groups=(
            G(K.FULL_ATTENTION, 1536),
            G(K.FULL_ATTENTION, 3456, is_eagle_group=True),
        ),
        requests=(RequestSpec(20000, 100), RequestSpec(20000, 100), RequestSpec(19000, 100)),
        shared_prefix_tokens=20000,
        drafter=EAGLE,
    )
    assert s.effective_hit_alignment_tokens == 13824
    # Lookahead hashes (1 token) protect the draft KV: a sibling sharing
    # 20000 tokens proves 19999 -> 17280 at the 3456 block, 13824 at A.
    assert alignment_losses(s) == (0, 17280 - 13824, 17280 - 13824)
    finding = alignment_blowup(s)
    assert finding is not None
    assert finding.kind is FindingKind.ALIGNMENT_BLOWUP
    assert (finding.variant, finding.request) == ("layout", None)
    assert (finding.expected_tokens, finding.hit_tokens) == (3456, 13824)
    assert "group 1 draft full_attention block 3456" in finding.detail
    assert "[3456, 3456]" in finding.detail


def _scheduler_block_4096(*lengths: int) -> Scenario:
    # vllm-ascend issue #16270: a scheduler block (the hit alignment) of 4096
    # tokens, another group's block, beside a full-attention block of 128.
    return Scenario(
        kv_cache_groups=(G(K.FULL_ATTENTION, 128), G(K.SLIDING_WINDOW, 4096, 4096)),
        requests=tuple(
            RequestSpec(n, 0, shares_with=0 if i else None) for i, n in enumerate(lengths)
        ),
        shared_prefix_tokens=lengths[0],
        retention_interval_tokens=0,
    )


def test_a_scheduler_block_above_the_full_attention_block_starves_short_prompts() -> None:
    s = _scheduler_block_4096(3000, 3000, 2000)
    assert s.effective_hit_alignment_tokens == 4096  # the largest block: no LCM blowup
    finding = alignment_blowup(s)
    assert finding is not None
    assert (finding.expected_tokens, finding.hit_tokens) == (128, 4096)
    # A resend of 3000 tokens proves 2999 -> 2944 at the 128-token block and
    # a 2000-token sibling 1999 -> 1920; both get 0 at 4096.
    assert "requests [1, 2], shorter than 4096 tokens, get 0" in finding.detail
    assert "[2944, 1920]" in finding.detail


def test_prompts_above_the_scheduler_block_are_not_starved() -> None:
    # Near miss: every sibling is longer than the alignment.
    assert alignment_blowup(_scheduler_block_4096(9000, 9000)) is None


def test_commensurate_blocks_are_no_blowup() -> None:
    s = Scenario(
        kv_cache_groups=(G(K.FULL_ATTENTION, 1536), G(K.FULL_ATTENTION, 3072)),
        requests=(RequestSpec(20000, 100), RequestSpec(20000, 100)),
        shared_prefix_tokens=20000,
    )
    assert alignment_blowup(s) is None
    assert alignment_losses(s) == (0, 0)


def test_shrink_steps_keep_chunks_and_draft_marks() -> None:
    from fuzz.minimize import _scaled, _simplify

    s = scenario(
        G(K.MLA, 16),
        G(K.SLIDING_WINDOW, 8, 32),
        G(K.SLIDING_WINDOW_MLA, 8, 64),
        G(K.CHUNKED_LOCAL_ATTENTION, 16, attention_chunk_size_tokens=64),
        G(K.FULL_ATTENTION, 8, is_eagle_group=True),
        drafter=EAGLE,
        requests=(RequestSpec(64, 16), RequestSpec(48, 16)),
    )
    half = _scaled(s, 1, 2)
    assert half is not None
    assert half.kv_cache_groups == (
        G(K.MLA, 8),
        G(K.SLIDING_WINDOW, 4, 16),
        G(K.SLIDING_WINDOW_MLA, 4, 32),
        G(K.CHUNKED_LOCAL_ATTENTION, 8, attention_chunk_size_tokens=32),
        G(K.FULL_ATTENTION, 4, is_eagle_group=True),
    )
    steps = dict(_simplify(s))
    one = steps["one sliding-window group"]
    assert one is not None
    assert one.group_mix == "sliding_window+mla+chunked_local_attention+draft:full_attention"

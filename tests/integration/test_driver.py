"""The driver against vLLM's own config code, and variant isolation."""

from __future__ import annotations

import pytest

from differential.scenario import DrafterKind, RequestSpec
from differential.variants import parse_variants
from tests.factories import ROOT, triton

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("kind", "use_drop", "lookahead_slots", "prefill_lookahead"),
    [
        (DrafterKind.EAGLE, True, 3, 1),
        (DrafterKind.EAGLE3, True, 3, 1),
        (DrafterKind.MTP, True, 3, 1),
        (DrafterKind.MULTI_MODULE_MTP, True, 3, 3),
        (DrafterKind.GEMMA4_MTP, True, 3, 1),  # stock 0.33.0 still drops for it
        (DrafterKind.DFLASH, False, 4, 1),  # fill-in drafting: k + 1 slots
        (DrafterKind.DSPARK, False, 3, 1),
        (DrafterKind.DRAFT_MODEL, False, 3, 0),
        (DrafterKind.NGRAM, False, 0, 0),
        (DrafterKind.NONE, False, 0, 0),
    ],
)
def test_settings_come_from_vllm_config(
    kind: DrafterKind, use_drop: bool, lookahead_slots: int, prefill_lookahead: int
) -> None:
    from differential.driver.settings import resolve_drafter

    resolved = resolve_drafter(triton(kind))
    assert resolved.use_eagle_block_drop is use_drop
    assert resolved.num_lookahead_tokens == lookahead_slots
    assert resolved.num_prefill_lookahead_tokens == prefill_lookahead
    assert resolved.num_hash_lookahead_tokens == 0  # lookahead hashes disabled


def test_lookahead_hashes_clear_the_drop_unless_a_connector_is_set() -> None:
    from differential.driver.settings import resolve_drafter

    on = resolve_drafter(triton(disable_lookahead_block_hashes=False))
    assert (on.use_eagle_block_drop, on.num_hash_lookahead_tokens) == (False, 1)
    multi = resolve_drafter(
        triton(DrafterKind.MULTI_MODULE_MTP, disable_lookahead_block_hashes=False)
    )
    assert (multi.use_eagle_block_drop, multi.num_hash_lookahead_tokens) == (False, 3)
    connector = resolve_drafter(triton(disable_lookahead_block_hashes=False, kv_connector=True))
    assert (connector.use_eagle_block_drop, connector.num_hash_lookahead_tokens) == (True, 0)
    opted_out = resolve_drafter(triton(disable_eagle_block_drop=True))
    assert opted_out.use_eagle_block_drop is False


def test_fixed_variant_changes_gemma4_only_inside_its_context() -> None:
    from differential.driver.fixes import seed_pr_fix
    from differential.driver.settings import resolve_drafter

    gemma = triton(DrafterKind.GEMMA4_MTP)
    assert resolve_drafter(gemma).use_eagle_block_drop is True
    with seed_pr_fix():
        assert resolve_drafter(gemma).use_eagle_block_drop is False
        assert resolve_drafter(triton()).use_eagle_block_drop is True  # plain MTP keeps it
    assert resolve_drafter(gemma).use_eagle_block_drop is True


def test_no_patch_leaks_between_variants() -> None:
    from vllm.config import SpeculativeConfig
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    from differential.driver import run_variant

    originals = (
        SpeculativeConfig.__dict__["needs_eagle_block_drop"],
        SlidingWindowManager.__dict__["reachable_block_mask"],
    )
    unfixed, fixed = parse_variants("unfixed,fixed")
    scenario = triton()
    first = run_variant(scenario, unfixed).hits
    assert run_variant(scenario, fixed).hits == (0, 16352, 16352, 16352)
    assert run_variant(scenario, unfixed).hits == first == (0, 8192, 16352, 16352)
    assert (
        SpeculativeConfig.__dict__["needs_eagle_block_drop"],
        SlidingWindowManager.__dict__["reachable_block_mask"],
    ) == originals


def test_the_fixes_name_the_replacements_they_install() -> None:
    from differential.driver.candidate import candidate_fix
    from differential.driver.fixes import installed_patches, seed_pr_fix

    assert installed_patches() == ()
    with seed_pr_fix():
        # vLLM 0.33 decides the drop in needs_eagle_block_drop, the method the seed PR changes.
        assert installed_patches() == (
            "SpeculativeConfig.needs_eagle_block_drop",
            "SlidingWindowManager.reachable_block_mask",
        )
    with candidate_fix():
        assert installed_patches() == (
            "SpeculativeConfig.needs_eagle_block_drop",
            "SlidingWindowManager.reachable_block_mask",
            "SlidingWindowManager.reachable_block_mask",
        )
    assert installed_patches() == ()


def test_fix_status_of_stock_vllm() -> None:
    from differential.driver import fix_status
    from differential.driver.fixes import seed_pr_fix

    stock = fix_status()
    assert (stock.gemma4_no_drop, stock.widened_tails) == (False, False)
    with seed_pr_fix():
        assert fix_status().complete


def test_observation_details_triton() -> None:
    from differential.driver import run_variant

    unfixed, fixed = parse_variants("unfixed,fixed")
    base = run_variant(triton(), unfixed)
    assert base.settings is not None and base.settings.hit_alignment_tokens == 32
    assert base.evicted_blocks == 0 and base.error is None
    # Request 1 fell back, so it pins the full-attention hit as a junction.
    assert [r.shared_prefix_boundary_tokens for r in base.requests] == [0, 16352, 0, 0]
    assert base.requests[1].per_group_hit_tokens == (16352, 8192)
    # The writer keeps 2 SWA tails (8192, 16384) of 65 blocks plus replay
    # blocks: 132; the fix widens each periodic tail by A / B = 2 blocks.
    widened = run_variant(triton(), fixed)
    assert base.requests[0].retained_blocks_per_group == (514, 132)
    assert widened.requests[0].retained_blocks_per_group == (514, 136)


def test_the_junction_vllm_pins_is_full_attentions_own_hit() -> None:
    # FA 8 beside sliding-window groups of block 32 under the drop: request 1
    # shares 479 tokens, so full attention alone matches 59 blocks (472),
    # drops one (464) and aligns to 448, while the 32-token groups need a
    # peek block past the divergence: the dense hit is 416. vLLM pins the
    # longest single-group hit, 448, as the oracle now models.
    from differential.corpus import load_entry
    from differential.driver import run_variant
    from differential.oracle import drafter_model, references

    path = ROOT / "corpora/regressions/junction-at-full-attention-hit-swa32-above-fa8.json"
    scenario = load_entry(path).scenario
    (unfixed,) = parse_variants("unfixed")
    run = run_variant(scenario, unfixed)
    assert [r.hit_tokens for r in run.requests] == [0, 0, 0]
    assert [r.shared_prefix_boundary_tokens for r in run.requests] == [0, 448, 384]
    refs = references(scenario, drafter_model(scenario), [0, 0, 0])
    assert [(r.dense_tokens, r.junction_tokens) for r in refs] == [(0, 0), (416, 448), (384, 384)]
    # Through the junction at 448 request 2 (416 tokens, dense 384) is owed
    # nothing: 448 and 416 are above its dense hit.
    assert refs[2].expected_tokens == 0


def test_dense_cross_check_run_uses_no_retention() -> None:
    from differential.driver import run_variant

    (unfixed,) = parse_variants("unfixed")
    dense = run_variant(triton(), unfixed, dense=True)
    assert dense.retention_interval_tokens is None
    assert dense.hits == (0, 16352, 16352, 16352)


def test_effective_hash_block_size_is_reported() -> None:
    # A hash block finer than the scheduler block: vLLM hashes at 8 tokens but
    # serves no partial hits without a Mamba group, so hits align to 16.
    import dataclasses

    from differential.compare import compare_variants
    from differential.reports.table import render_json, render_text
    from differential.variants import parse_variants
    from tests.factories import hybrid

    scenario = dataclasses.replace(
        hybrid(
            16,
            8,
            32,
            prefix=64,
            requests=(RequestSpec(64, 8), RequestSpec(60, 8)),
            retention=None,
            drafter=DrafterKind.NONE,
        ),
        hash_block_size_tokens=8,
    )
    result = compare_variants(scenario, parse_variants("unfixed"))
    settings = result.results[0].run.settings
    assert settings is not None
    assert (settings.hash_block_size_tokens, settings.partial_hash_hits) == (8, False)
    assert settings.hit_alignment_tokens == 16
    assert result.results[0].run.hits == (0, 48)
    assert any("hash block size 8 tokens is used for hashing only" in n for n in result.notices)
    assert "hash block 8," in render_text([result], "test")
    report = render_json([result], "test", result.policy)
    assert report["scenarios"][0]["effective_hash_block_size_tokens"] == 8


def test_block_ledger_records_what_each_lookup_handed_out() -> None:
    from differential.corpus import load_entry
    from differential.driver import run_variant
    from differential.observation import RunObservation
    from differential.oracle.blocks import check_blocks
    from tests.factories import CORPORA

    scenario = load_entry(CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json").scenario
    (unfixed,) = parse_variants("unfixed")
    run = run_variant(scenario, unfixed)
    assert run.blocks_recorded
    assert run.hits == (0, 192, 248, 248)
    first, sibling = run.requests[0], run.requests[1]
    assert [len(g) for g in first.lookup_blocks] == [0, 0]
    # Hit 192: 24 full-attention blocks of 8 and 48 SWA blocks of 4; window
    # 16 reads the last ceil(15 / 4) = 4 SWA blocks, the rest are null.
    assert [len(g) for g in sibling.lookup_blocks] == [24, 48]
    full, swa = sibling.lookup_blocks
    assert all(b is not None for b in full)
    assert all(b is not None for b in swa[-4:])
    for gid, group in enumerate(sibling.lookup_blocks):
        for k, block in enumerate(group):
            if block is not None:  # request 0 wrote it, at the same index, in full
                size = scenario.kv_cache_groups[gid].block_size_tokens
                assert (block.group, block.writer, block.writer_block_index) == (gid, 0, k)
                assert block.filled_tokens == size
    assert all(not r.unsafe_writes for r in run.requests)
    assert check_blocks(scenario, run) == ()
    assert RunObservation.from_dict(run.to_dict()) == run
    off = run_variant(scenario, unfixed, record_blocks=False)
    assert off.hits == run.hits
    assert not off.blocks_recorded and off.requests[1].lookup_blocks == ()


def test_sampled_tokens_past_a_partial_tail_entry_are_no_unsafe_write() -> None:
    # A 153-token prompt, full block 16 over hash block 8: vLLM caches the
    # prompt tail as a partial entry covering 152 tokens of block 9
    # (FullAttentionManager._cache_partial_tail_block); decode then writes
    # tokens 153 and 154 into the same block, past what the entry covers.
    from differential.driver import run_variant
    from differential.oracle.blocks import check_blocks
    from differential.scenario import RequestSpec
    from tests.factories import hybrid

    scenario = hybrid(
        16,
        8,
        16,
        prefix=153,
        requests=(RequestSpec(153, 0), RequestSpec(150, 8)),
        retention=None,
        drafter=DrafterKind.NONE,
        chunk=64,
        decode_steps=2,
    )
    (unfixed,) = parse_variants("unfixed")
    run = run_variant(scenario, unfixed)
    assert run.error is None and run.blocks_recorded
    assert run.hits == (0, 144)
    assert [r.unsafe_writes for r in run.requests] == [(), ()]
    assert check_blocks(scenario, run) == ()


def _manager_arguments(hash_block_size: int) -> dict[str, object]:
    """``KVCacheManager`` arguments for one full-attention group of block 16."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from differential.driver.specs import attention_spec
    from differential.scenario import GroupKind

    group = KVCacheGroupSpec(["fa"], attention_spec(16, GroupKind.FULL_ATTENTION, None, 0))
    return {
        "kv_cache_config": KVCacheConfig(
            num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group]
        ),
        "max_model_len": 64,
        "scheduler_block_size": 16,
        "hash_block_size": hash_block_size,
        "enable_caching": True,
    }


def test_a_constructor_argument_the_release_lacks_is_unsupported() -> None:
    from differential.capabilities import Unsupported
    from differential.driver.features import VllmCallError, vllm_build
    from differential.driver.runner import KVCacheManager

    source = "vllm/v1/core/kv_cache_manager.py"
    arguments = _manager_arguments(16)
    with pytest.raises(Unsupported) as caught:
        vllm_build("KVCacheManager", source, KVCacheManager, **arguments, no_such_argument=1)
    assert caught.value.reason == (
        "KVCacheManager(no_such_argument=) (vllm/v1/core/kv_cache_manager.py)"
    )
    # vLLM refusing the configuration in its constructor: one full-attention
    # group runs on UnitaryKVCacheCoordinator, which asserts hash block ==
    # block (vllm/v1/core/kv_cache_coordinator.py).
    with pytest.raises(Unsupported) as caught:
        vllm_build("KVCacheManager", source, KVCacheManager, **_manager_arguments(8))
    assert caught.value.reason == (
        "KVCacheManager refuses this configuration (vllm/v1/core/kv_cache_manager.py): "
        "AssertionError: UnitaryKVCacheCoordinator assumes hash_block_size == block_size"
    )
    # Anything else vLLM raises is vLLM's: a crash naming the call.
    with pytest.raises(VllmCallError) as crashed:
        vllm_build("KVCacheManager", source, KVCacheManager, **{**arguments, "kv_cache_config": 7})
    assert crashed.value.call == "KVCacheManager"
    assert isinstance(crashed.value.error, AttributeError)
    built = vllm_build("KVCacheManager", source, KVCacheManager, **arguments)
    assert built.block_pool.hash_block_size == 16


def test_a_workload_pool_too_small_for_one_request_is_bad_input() -> None:
    """The manager-level driver does not preempt: a pool that cannot hold the
    longest request alone is refused when the scenario is built (exit 2 naming
    the field; it was kvfuzz's failure, exit 3). One that passes this check
    but still runs out is bad input too, found while running
    (tests/integration/test_hostile_environment.py)."""
    import dataclasses

    from differential.corpus import load_entry
    from differential.errors import ScenarioError
    from differential.scenario import Workload
    from tests.factories import CORPORA

    toy = load_entry(CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json").scenario
    with pytest.raises(ScenarioError) as refused:
        dataclasses.replace(toy, workload=Workload(pool_blocks=6))
    assert str(refused.value).startswith(
        "workload.pool_blocks = 6 is invalid: allowed null or at least"
    )


def test_the_ignored_hash_block_notice_names_why_beside_a_mamba_group() -> None:
    """FA 4 + SWA 4 + Mamba 4, hash block 2: the layout has a Mamba group in
    align mode, yet vLLM serves no partial hits, because the sliding-window
    manager needs block-aligned lookups (``partial_hash_hits_enabled`` in
    vllm/v1/core/kv_cache_utils.py). The notice says so, not "no Mamba group"."""
    import dataclasses

    from differential.compare import compare_variants
    from differential.corpus import load_entry
    from tests.factories import CORPORA

    case = load_entry(CORPORA / "cases" / "mamba-swa-peek-block-is-the-writers-own.json")
    groups = tuple(
        dataclasses.replace(g, block_size_tokens=4, sliding_window_tokens=8)
        if g.sliding_window_tokens
        else dataclasses.replace(g, block_size_tokens=4)
        for g in case.scenario.kv_cache_groups
    )
    scenario = dataclasses.replace(
        case.scenario, kv_cache_groups=groups, hash_block_size_tokens=2, prefill_chunk_tokens=4
    )
    assert [g.kind.value for g in scenario.kv_cache_groups] == [
        "full_attention",
        "sliding_window",
        "mamba",
    ]
    result = compare_variants(scenario, parse_variants("unfixed"), dense_cross_check=False)
    settings = result.results[0].run.settings
    assert settings is not None
    assert (settings.partial_hash_hits, settings.hit_alignment_tokens) == (False, 4)
    assert result.notices == (
        "hash block size 2 tokens is used for hashing only: vLLM serves no partial hits "
        "here (the sliding_window group of block 4 tokens needs block-aligned lookups, as "
        "its manager in vllm/v1/core/single_type_kv_cache_manager.py supports no "
        "fine-grained ones), so hits align to A = 4 tokens",
    )


@pytest.mark.parametrize("lookahead", [0, 1, 3])
def test_memoised_block_hashes_are_vllms_own(lookahead: int) -> None:
    """The driver's block hasher answers from a per-process memo; its hashes
    are those vLLM's ``request_block_hasher`` computes, at the prompt and as
    sampled tokens fill more blocks, and a second request with the same
    tokens is answered from the memo."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from differential.driver import runner

    def request(rid: str, hasher: object) -> Request:
        return Request(
            request_id=rid,
            prompt_token_ids=[(7 * k + lookahead) % 50 for k in range(37)],
            sampling_params=SamplingParams(max_tokens=16),
            pooling_params=None,
            block_hasher=hasher,  # type: ignore[arg-type]
        )

    vllm_hasher = get_request_block_hasher(4, sha256, lookahead)
    memoised = runner.memoised_hasher(vllm_hasher, 4, lookahead)
    plain, first, second = (
        request("plain", vllm_hasher),
        request("first", memoised),
        request("second", memoised),
    )
    assert len(plain.block_hashes) == (37 - lookahead) // 4 > 0
    assert first.block_hashes == second.block_hashes == plain.block_hashes
    for token in (3, 1, 4, 1, 5, 9, 2, 6):
        for r in (plain, first, second):
            r.append_output_token_ids(token)
        assert first.block_hashes == second.block_hashes == plain.block_hashes
    assert len(plain.block_hashes) == (45 - lookahead) // 4
    prompt = tuple(plain.prompt_token_ids or ())
    assert any(key[-1] == prompt for key in runner._HASHES)  # the prompt's hashes are kept
    before = dict(runner._HASHES)
    request("third", memoised)
    assert before == runner._HASHES  # answered from the memo


def test_per_group_hits_come_from_the_coordinators_own_per_group_lookup() -> None:
    from differential.corpus import load_entry
    from differential.driver import run_variant
    from differential.oracle import judge_run
    from tests.factories import CORPORA

    (unfixed,) = parse_variants("unfixed")
    scenario = load_entry(CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json").scenario
    run = run_variant(scenario, unfixed)
    # Request 1 falls back to 192 (the seed's bug): full attention alone would
    # hit 248, the sliding window alone only 192. Every per-group hit is at
    # least the reconciled one and on the 8-token grid, so only the fallback.
    assert [r.hit_tokens for r in run.requests] == [0, 192, 248, 248]
    assert [r.per_group_hit_tokens for r in run.requests] == [
        (0, 0),
        (248, 192),
        (248, 248),
        (248, 248),
    ]
    assert [f.kind.value for f in judge_run(scenario, run)[1]] == ["fallback"]

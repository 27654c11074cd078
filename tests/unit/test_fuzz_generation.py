"""The scenario generator and finding signatures (no vLLM)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from differential.findings import Finding, FindingKind
from differential.scenario import DrafterKind, GroupKind, Scenario
from fuzz.signature import signature_of
from fuzz.strategies import engine_scenarios, scenarios
from tests.factories import reach, triton


@settings(max_examples=150, suppress_health_check=list(HealthCheck), deadline=None)
@given(scenarios())
def test_generated_scenarios_are_valid_and_round_trip(scenario: Scenario) -> None:
    assert Scenario.from_json(scenario.to_json()) == scenario
    assert scenario.requests[0].divergence_tokens == scenario.shared_prefix_tokens


def test_generator_reaches_real_geometries() -> None:
    real = reach(
        lambda s: (
            bool(s.sliding_window_groups)
            and s.sliding_window_groups[0].block_size_tokens == 64
            and s.sliding_window_groups[0].sliding_window_tokens == 1024
            and s.shared_prefix_tokens >= 16384
        ),
        scenarios(scale="real"),
    )
    assert real.shared_prefix_tokens >= 16384


@pytest.mark.parametrize("kind", [GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW])
def test_generator_reaches_single_group_models(kind: GroupKind) -> None:
    single = reach(lambda s: [g.kind for g in s.kv_cache_groups] == [kind])
    assert len(single.kv_cache_groups) == 1


def test_generator_places_divergence_right_after_a_checkpoint() -> None:
    def after_checkpoint(s: Scenario) -> bool:
        r = s.retention_interval_tokens
        a = s.effective_hit_alignment_tokens
        return (
            bool(r)
            and r != a
            and any(
                0 < x.divergence_tokens % r <= a and x.divergence_tokens > r for x in s.requests[1:]
            )
        )

    assert after_checkpoint(reach(after_checkpoint))


@pytest.mark.parametrize("kind", [GroupKind.SLIDING_WINDOW, GroupKind.MAMBA])
def test_generator_reaches_a_rejoining_sibling_on_a_model_without_full_attention(
    kind: GroupKind,
) -> None:
    # Without a full-attention group nothing stops a lookup at the edit but
    # the chained block hashes: the layouts where a rejoin has teeth.
    # Pinned as `kvfuzz fuzz --groups KIND` pins it: such layouts come sooner.
    found = reach(
        lambda s: (
            [g.kind for g in s.kv_cache_groups] == [kind]
            and any(r.rejoin_tokens for r in s.requests)
        ),
        scenarios(kinds=frozenset({kind})),
    )
    edited = next(r for r in found.requests if r.rejoin_tokens)
    assert edited.suffix_tokens > 0 and found.prompts[found.requests.index(edited)]


def test_generator_covers_every_drafter() -> None:
    for kind in DrafterKind:
        assert reach(lambda s, k=kind: s.drafter.kind is k).drafter.kind is kind


def test_signature_of_the_triton_fallback() -> None:
    finding = Finding(
        FindingKind.FALLBACK,
        "unfixed",
        1,
        "x",
        divergence_tokens=16384,
        expected_tokens=16352,
        hit_tokens=8192,
    )
    signature = signature_of(triton(), finding)
    assert signature.text == "fallback | unfixed | eagle/drop | sparse | on checkpoint"
    assert signature.slug.startswith("fallback-unfixed-") and len(signature.slug) == 27
    after = Finding(FindingKind.FALLBACK, "unfixed", 1, "x", divergence_tokens=16385)
    assert signature_of(triton(), after).position == "<=A after checkpoint"
    lookahead = triton(disable_lookahead_block_hashes=False)
    assert signature_of(lookahead, finding).drafter == "eagle/lookahead"
    assert signature_of(triton(retention=None), finding).retention == "dense"


def test_known_findings_share_one_signature_per_issue() -> None:
    known = Finding(
        FindingKind.FALLBACK,
        "fixed",
        2,
        "x",
        divergence_tokens=513,
        known_issue="swa-short-run-align-before-drop",
    )
    signature = signature_of(triton(), known)
    assert signature.text == "fallback | fixed | * | * | * | known:swa-short-run-align-before-drop"
    assert signature_of(triton(retention=None), known) == signature


def test_mamba_hybrids_draw_no_one_token_window() -> None:
    # A hash block of 1 token makes a 1-token SWA block beside Mamba groups;
    # its window stays >= 2 tokens (a 1-token window needs no block, vLLM's
    # reachable_block_mask keeps none and every hit is 0: degenerate geometry
    # no model has). The block-1 window itself is still drawn.
    from hypothesis import HealthCheck, Phase, find
    from hypothesis.errors import NoSuchExample

    from differential.scenario import KVCacheGroup
    from fuzz.strategies import mamba_geometries

    search = settings(
        max_examples=3000,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,
        phases=[Phase.generate],
    )

    def windows(drawn: tuple[tuple[KVCacheGroup, ...], int | None]) -> list[int]:
        return [g.sliding_window_tokens for g in drawn[0] if g.sliding_window_tokens is not None]

    with pytest.raises(NoSuchExample):
        find(mamba_geometries("toy"), lambda d: 1 in windows(d), settings=search)
    groups, hash_block = find(
        mamba_geometries("toy"),
        lambda d: any(g.block_size_tokens == 1 for g in d[0] if g.sliding_window_tokens),
        settings=search,
    )
    assert hash_block == 1 and min(windows((groups, hash_block))) >= 2


def test_the_scheduler_generator_draws_a_circular_buffer_unpinned() -> None:
    from fuzz.signature import coverage_keys

    kind = GroupKind.CIRCULAR_BUFFER
    drawn = reach(lambda s: any(g.kind is kind for g in s.kv_cache_groups), engine_scenarios())
    # Beside attention groups only, and counted in the coverage table.
    assert not drawn.mamba_groups and drawn.dcp_world_size == 1
    assert any(g.kind.prefix_cacheable and g.kind is not kind for g in drawn.kv_cache_groups)
    assert kind.value in dict(k.split(":", 1) for k in coverage_keys(drawn))["group-mix"]


@settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(engine_scenarios())
def test_the_scheduler_generator_never_draws_a_sink_or_rswa_unpinned(s: Scenario) -> None:
    # Every release kvfuzz drives fails to build SinkFullAttentionManager, and
    # vLLM's one R-SWA model turns prefix caching off.
    unpinned = (GroupKind.SINK_FULL_ATTENTION, GroupKind.RSWA)
    assert all(g.kind not in unpinned for g in s.kv_cache_groups)


PINNED_IN_SCHEDULER_MODE = (
    frozenset({GroupKind.RSWA}),
    frozenset({GroupKind.SINK_FULL_ATTENTION}),
    frozenset({GroupKind.CIRCULAR_BUFFER}),
    frozenset({GroupKind.MAMBA, GroupKind.SLIDING_WINDOW}),
    frozenset({GroupKind.CHUNKED_LOCAL_ATTENTION}),
)


@pytest.mark.parametrize("kinds", PINNED_IN_SCHEDULER_MODE, ids=lambda k: "+".join(sorted(k)))
def test_the_scheduler_generator_pins_the_groups_it_is_given(kinds: frozenset[GroupKind]) -> None:
    # kvfuzz fuzz --mode scheduler --groups KINDS: every scenario holds them
    # (they were silently ignored in scheduler mode).
    @settings(
        max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(engine_scenarios(kinds=kinds))
    def every_scenario_holds(s: Scenario) -> None:
        assert kinds <= {g.kind for g in s.kv_cache_groups}

    every_scenario_holds()

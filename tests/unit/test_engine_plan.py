"""Engine mode's plans (``differential.driver.engine_mode.engine_plan``): what the
worker is told to send, checked without the engine."""

from __future__ import annotations

import dataclasses

import pytest

from differential.corpus import load_entry
from differential.driver.engine_mode import EngineUnsupported, engine_plan, scaled
from tests.factories import CORPORA


def test_a_turn_copying_the_previous_answer_is_planned_from_the_engines_own_answer() -> None:
    # Turn 2 copies turn 1's 80-token prompt and its 41 sampled tokens, then
    # 16 of its own: the worker appends the engine's real answer, so the plan
    # carries only the 16 own tokens after a 121-token divergence.
    scenario = load_entry(CORPORA / "cases" / "multi-turn-decoded-blocks.json").scenario
    plan = engine_plan(scenario)
    assert plan["shares_output"] is True
    first, second = plan["requests"]
    assert (first["source"], first["divergence"], len(first["own"])) == (None, 64, 16)
    assert (second["source"], second["divergence"], len(second["own"])) == (0, 121, 16)
    assert second["max_tokens"] == 41
    assert len(plan["prefix"]) == 64


def test_scaling_a_turn_that_copies_the_previous_answer_scales_the_answer_exactly() -> None:
    # Turn 1: 80 prompt tokens and 41 sampled ones (decode_steps 40, plus the
    # first token sampled with the prefill); turn 2 copies all 121. Scaled x2
    # every sequence is twice as long: turn 1 samples 82 tokens (decode_steps
    # 81) and turn 2 copies 242, the whole answer. Scaling decode_steps alone
    # (80) left turn 1 with 241 tokens to copy, and the scaled scenario was
    # refused (divergence 242, allowed 0..241).
    scenario = load_entry(CORPORA / "cases" / "multi-turn-decoded-blocks.json").scenario
    double = scaled(scenario, 2)
    assert double.decode_steps == 81
    assert [r.divergence_tokens for r in double.requests] == [128, 242]
    assert [r.suffix_tokens for r in double.requests] == [32, 32]
    first, second = engine_plan(double)["requests"]
    assert first["max_tokens"] == 82
    assert (second["source"], second["divergence"], len(second["own"])) == (0, 242, 32)
    assert [r.divergence_tokens for r in scaled(scenario, 1).requests] == [64, 121]


def test_a_rejoining_request_sends_its_own_tokens_then_the_sources_again() -> None:
    scenario = load_entry(CORPORA / "cases" / "rejoin-swa-only.json").scenario
    plan = engine_plan(scenario)
    writer, edited, again = plan["requests"]
    assert (writer["divergence"], len(writer["own"])) == (512, 32)
    # The edited sibling: the prefix's first 128 tokens, 64 of its own, then
    # the prefix's tokens 192 to 512 again.
    assert (edited["divergence"], len(edited["own"])) == (128, 64 + 320)
    assert edited["own"][64:] == plan["prefix"][192:512]
    # A 1024-token vocabulary repeats tokens; what must differ is the first
    # token after the divergence point.
    assert edited["own"][0] != plan["prefix"][128]
    # The second edit rejoins the first sibling's prompt.
    assert (again["source"], again["divergence"], len(again["own"])) == (1, 256, 32 + 224)


def test_images_and_salts_are_unsupported_naming_why() -> None:
    scenario = load_entry(CORPORA / "cases" / "multimodal-image-swap.json").scenario
    with pytest.raises(EngineUnsupported, match=r"^images \(requests' mm_inputs\): kvfuzz's"):
        engine_plan(scenario)
    salted = dataclasses.replace(
        scenario,
        requests=tuple(
            dataclasses.replace(r, mm_inputs=(), cache_salt="t") for r in scenario.requests
        ),
    )
    with pytest.raises(EngineUnsupported, match=r"^cache_salt: the engine worker sends"):
        engine_plan(salted)


def test_decode_context_parallelism_is_unsupported_naming_why() -> None:
    scenario = load_entry(CORPORA / "cases" / "dcp8-mla-hits-at-sharded-block.json").scenario
    with pytest.raises(EngineUnsupported) as info:
        engine_plan(scenario)
    assert str(info.value) == (
        "dcp_world_size 8: decode context parallelism shards KV over several ranks; "
        "the CPU engine runs one"
    )


def test_an_unsupported_engine_run_of_a_scenario_its_release_cannot_mean_is_not_judged() -> None:
    # Llama-4-style chunked local attention beside full attention, with an
    # EAGLE drafter, on an engine without lookahead block hashes (vLLM
    # 0.32.0): the drafter would take the EAGLE block drop, which vLLM
    # refuses for chunked local attention, so the release means no scenario
    # at all. Judging its unsupported run once raised Unsupported out of
    # `kvfuzz replay --mode engine` (kvfuzz's internal error, exit 3).
    from differential.capabilities import Feature, Unsupported, equivalent_scenario
    from differential.driver.engine_mode import EngineResult
    from differential.observation import RunObservation
    from differential.variants.engine import judge

    scenario = load_entry(CORPORA / "cases" / "llama4-chunked-local.json").scenario
    features = {Feature.LOOKAHEAD_HASHES.value: False}
    with pytest.raises(Unsupported, match=r"chunked_local_attention group taking the EAGLE"):
        equivalent_scenario(scenario, features)
    run = RunObservation("engine", "0.32.0 (engine)", None, (), unsupported="engine: why")
    result = EngineResult(scenario, 1, run, None, {}, {}, features, ())
    assert judge(result) == ((), ())

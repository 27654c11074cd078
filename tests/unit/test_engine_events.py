"""Engine mode's KV cache events (``differential.driver.engine_mode.event_log``):
the engine's ``BlockStored`` token ids put back into the scenario's, checked
without the engine on a plan's own token mapping."""

from __future__ import annotations

from differential.driver.engine_mode import engine_plan, event_log, observation
from differential.observation import (
    KVEvent,
    KVEventLog,
    KVEventStep,
    RunObservation,
    runs_of,
    tokens_of,
)
from differential.oracle.kv_events import kv_event_findings
from differential.scenario import GroupKind, KVCacheGroup, KVEvents, RequestSpec, Scenario, Workload


def _scenario() -> Scenario:
    # Two requests sharing 64 tokens, 32 of their own each, 2 sampled tokens.
    return Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 32),),
        requests=(RequestSpec(64, 32), RequestSpec(64, 32)),
        shared_prefix_tokens=64,
        decode_steps=1,
        workload=Workload(kv_events=KVEvents.INCREMENTAL),
    )


def _engine_sequences(scenario: Scenario) -> list[list[int]]:
    """Each request's tokens as the engine has them: the plan's mapped prompt,
    then an answer of the engine's own (ids the scenario never uses)."""
    plan = engine_plan(scenario)
    return [
        plan["prefix"][: spec["divergence"]] + spec["own"] + [900 + i, 901 + i]
        for i, spec in enumerate(plan["requests"])
    ]


def _stored(tokens: list[int], parent: int | None, hashes: tuple[int, ...]) -> KVEvent:
    return KVEvent(
        kind="stored",
        group=0,
        hashes=hashes,
        parent=parent,
        block_size=32,
        tokens=runs_of(tokens),
        spec_kind="full_attention",
    )


def test_stored_token_ids_become_the_scenarios_by_owner_and_position() -> None:
    scenario = _scenario()
    engine = _engine_sequences(scenario)
    ours = [list(scenario.prompts[i]) + list(scenario.sampled_tokens(i)) for i in range(2)]
    assert engine[0][:64] == engine[1][:64] and engine[0][64] != engine[1][64]
    # Labels: 0, 1 the shared blocks; 2 request 0's third block; 3 request 1's.
    log = KVEventLog(
        report_mode="incremental",
        steps=(
            KVEventStep(step=0, events=(_stored(engine[0][:96], None, (0, 1, 2)),)),
            KVEventStep(step=3, events=(_stored(engine[1][64:96], 1, (3,)),)),
            KVEventStep(step=4, events=(_stored([5, 6, 7], 3, (4,)),)),
        ),
        prefixes={0: (0, 32), 1: (0, 64), 2: (0, 96), 3: (1, 96)},
    )
    raw = {"kv_events": {"log": log.to_dict(), "sequences": engine}}
    translated = event_log(scenario, raw)
    assert translated is not None
    first, second, unknown = (step.events[0] for step in translated.steps)
    assert tokens_of(first.tokens) == ours[0][:96]
    # After the parent's 64 tokens, request 1's own block: request 1's tokens there.
    assert tokens_of(second.tokens) == ours[1][64:96]
    assert ours[1][64:96] != ours[0][64:96]
    # Ids no request has after that parent match no scenario token.
    assert tokens_of(unknown.tokens) == [-6, -7, -8]
    assert event_log(scenario, {}) is None


def test_the_oracle_judges_the_translated_stream_and_flags_foreign_tokens() -> None:
    scenario = _scenario()
    engine = _engine_sequences(scenario)
    block = _stored(engine[0][:32], None, (0,))
    clean = KVEventLog(
        report_mode="incremental",
        steps=(KVEventStep(step=0, events=(block,), pool=((0, 0, 1),)),),
        prefixes={0: (0, 32)},
    )
    run = _observation(scenario, clean, engine)
    assert kv_event_findings(scenario, run) == []
    foreign = KVEventLog(
        report_mode="incremental",
        steps=(
            KVEventStep(
                step=0,
                events=(_stored([3] * 32, None, (0,)),),
                pool=((0, 0, 1),),
            ),
        ),
        prefixes={0: (0, 32)},
    )
    (finding,) = kv_event_findings(scenario, _observation(scenario, foreign, engine))
    assert finding.detail.startswith("stored: step 0: BlockStored of group 0: its 32 token ids")


def _observation(scenario: Scenario, log: KVEventLog, engine: list[list[int]]) -> RunObservation:
    raw = {
        "requests": [],
        "kv_events": {"log": log.to_dict(), "sequences": engine},
    }
    return observation(scenario, raw, "0.32.0 (engine)")

"""KV cache events on real runs: exact event counts, the manager driver's
stream against the scheduler's own, and the watermark's admissions."""

from __future__ import annotations

import dataclasses

import pytest

from differential.compare import compare_variants
from differential.corpus import finding_tag, load_entry
from differential.driver import run_variant
from differential.oracle.engine import judge_engine_run
from differential.oracle.kv_events import kv_event_findings, kv_event_rule
from differential.scenario import DriveMode, KVEventsView
from differential.variants import parse_variants
from tests.factories import CORPORA

pytestmark = pytest.mark.vllm

CASES = CORPORA / "cases"


def _run(name: str, mode: DriveMode | None = None):
    scenario = load_entry(CASES / f"{name}.json").scenario
    if mode is not None:
        scenario = dataclasses.replace(
            scenario, workload=dataclasses.replace(scenario.workload, mode=mode)
        )
    (unfixed,) = parse_variants("unfixed")
    return scenario, run_variant(scenario, unfixed)


def _events(run):
    return [e for step in run.kv_events.steps for e in step.events]


def _replaced(run, old, new):
    """``run`` with its event ``old`` (the very object) replaced by ``new``."""
    steps = tuple(
        dataclasses.replace(step, events=tuple(new if e is old else e for e in step.events))
        for step in run.kv_events.steps
    )
    return dataclasses.replace(run, kv_events=dataclasses.replace(run.kv_events, steps=steps))


def test_full_report_mode_reannounces_reused_blocks_in_both_modes() -> None:
    scenario, manager = _run("kv-events-full-swa-reannounced")
    assert manager.hits == (0, 64, 32)
    # 4 blocks per group stored by request 0, 1 each by requests 1 and 2
    # (8); request 1 re-announces 4 blocks per group, request 2 two (4 events);
    # the driver's reset after the run clears the cache (one AllBlocksCleared).
    assert manager.kv_events.num_events == (12, 0, 1)
    again = [(e.group, len(e.hashes)) for e in _events(manager) if e.lookup is not None]
    assert again == [(0, 4), (1, 4), (0, 2), (1, 2)]
    assert [(s.step, len(s.events)) for s in manager.kv_events.steps] == [
        (0, 2),
        (1, 2),
        (4, 4),
        (7, 4),
        (8, 1),
    ]
    assert kv_event_findings(scenario, manager) == []
    # vLLM's Scheduler, draining at its own take_events call, publishes the
    # same stream, step by step, for the same sequential requests.
    _, scheduler = _run("kv-events-full-swa-reannounced", DriveMode.SCHEDULER)
    assert _events(scheduler) == _events(manager)
    assert [(s.step, len(s.events)) for s in scheduler.kv_events.steps] == [
        (s.step, len(s.events)) for s in manager.kv_events.steps
    ]


def test_an_evicted_duplicate_block_is_removed_once_per_copy() -> None:
    scenario, run = _run("kv-events-evicted-duplicate-block")
    assert run.hits == (0, 48, 0, 32)
    assert run.kv_events.num_events == (8, 6, 1)
    events = _events(run)
    stores = [h for e in events if e.kind == "stored" for h in e.hashes]
    removals = [h for e in events if e.kind == "removed" for h in e.hashes]
    # Request 0's fourth block (its 64-token prefix) is stored twice, once
    # per physical copy, and removed twice when both copies are evicted.
    fourth = next(label for label, named in run.kv_events.prefixes.items() if named == (0, 64))
    assert stores.count(fourth) == 3  # twice, then again by request 3
    assert removals.count(fourth) == 2
    assert all(e.lookup is None for e in events)  # incremental: lookups publish nothing
    assert judge_engine_run(scenario, run)[1] == ()


def test_the_router_view_drops_a_prefix_one_copy_of_which_stays_cached() -> None:
    # Request 2 (80 tokens, 10-block pool) evicts request 0's copy of the
    # 64-token prefix at step 9 and leaves request 1's copy cached: one
    # BlockRemoved of a hash the pool still holds. The per-copy replay holds;
    # a router's set lacks the hash from then on (vLLM PR #55092).
    from tests.factories import ROOT

    entry = load_entry(ROOT / "known-issues/kv-events-router-drops-a-cached-duplicate.json")
    (unfixed,) = parse_variants("unfixed")
    run = run_variant(entry.scenario, unfixed)
    assert run.hits == (0, 48, 0, 48)
    (finding,) = kv_event_findings(entry.scenario, run)
    assert kv_event_rule(finding) == "router"
    assert finding.detail == (
        "router: step 9: a router replaying the stream as a set holds 8 hashes, the pool 9; "
        "first difference: the router dropped the hash of request 0's first 64 tokens "
        "(group 0) while the pool still caches it in 1 block(s): it stops routing that "
        "prefix here"
    )
    per_copy = dataclasses.replace(
        entry.scenario,
        workload=dataclasses.replace(entry.scenario.workload, kv_events_view=KVEventsView.PER_COPY),
    )
    assert kv_event_findings(per_copy, run_variant(per_copy, unfixed)) == []
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed"))
    assert {(f.owner, f.known_issue) for f in result.findings} == {
        ("unfixed", "kv-events-removed-per-copy"),
        ("fixed", "kv-events-removed-per-copy"),
    }


def test_full_report_mode_reannounces_at_every_lookup_that_hits() -> None:
    scenario, run = _run("kv-events-full-readmission")
    assert run.kv_events.num_events == (11, 6, 1)
    lookups = [
        (step.step, u.request, u.hit_tokens, len([e for e in step.events if e.lookup == k]))
        for step in run.kv_events.steps
        for k, u in enumerate(step.lookups)
    ]
    # Request 3 looks up at step 12 (not admitted) and 13: two re-announcements.
    assert lookups == [(0, 0, 0, 0), (3, 1, 48, 1), (6, 2, 0, 0), (7, 2, 0, 0), (12, 3, 32, 1),
                       (13, 3, 32, 1)]  # fmt: skip
    assert judge_engine_run(scenario, run)[1] == ()


def test_a_real_stream_missing_one_removal_breaks_the_replay() -> None:
    scenario, run = _run("kv-events-evicted-duplicate-block")
    steps = list(run.kv_events.steps)
    k = next(i for i, s in enumerate(steps) if any(e.kind == "removed" for e in s.events))
    dropped = next(j for j, e in enumerate(steps[k].events) if e.kind == "removed")
    events = steps[k].events[:dropped] + steps[k].events[dropped + 1 :]
    steps[k] = dataclasses.replace(steps[k], events=events)
    broken = dataclasses.replace(
        run, kv_events=dataclasses.replace(run.kv_events, steps=tuple(steps))
    )
    (finding,) = kv_event_findings(scenario, broken)
    assert kv_event_rule(finding) == "replay"
    assert finding.detail.startswith(f"replay: step {steps[k].step}: replaying the stream gives")


def test_the_watermark_holds_a_waiting_request_back_and_prevents_the_preemption() -> None:
    scenario, held = _run("watermark-admission-pool10")
    assert held.hits == (0, 0, 64)
    assert [r.scheduled_step for r in held.requests] == [0, 2, 11]
    assert held.preemptions == 0
    # Request 1 is admitted beside request 0, leaving exactly the 3 blocks.
    assert held.watermark_admissions == ((1, 2, 3),)
    assert judge_engine_run(scenario, held)[1] == ()
    _, free = _run("watermark-off-preemption-pool10")
    assert [r.scheduled_step for r in free.requests] == [0, 2, 2]
    assert free.preemptions == 1
    assert free.watermark_admissions == ()  # recorded only with a watermark


def test_corpus_cases_replay_clean_on_every_variant() -> None:
    variants = parse_variants("unfixed,fixed,candidate")
    for name in ("kv-events-full-readmission", "watermark-admission-pool10"):
        result = compare_variants(load_entry(CASES / f"{name}.json").scenario, variants)
        assert [finding_tag(f) for f in result.findings] == []


def test_an_exported_scheduler_test_sets_the_watermark(tmp_path) -> None:
    from differential.exports.scheduler_test import export_engine_test
    from differential.findings import Finding, FindingKind

    scenario = load_entry(CASES / "watermark-admission-pool10.json").scenario
    owed = Finding(FindingKind.FALLBACK, "unfixed", 2, "owed 64", expected_tokens=64)
    source = export_engine_test(scenario, owed, signature="s", name="watermark")
    assert "    config.scheduler_config.watermark = 0.3\n" in source
    namespace: dict[str, object] = {}
    exec(compile(source, "exported.py", "exec"), namespace)
    namespace["test_kvfuzz_watermark"](tmp_path)  # type: ignore[operator]


def test_engine_mode_plans_events_and_refuses_the_watermark_naming_why() -> None:
    from differential.driver.engine_mode import EngineUnsupported, engine_plan
    from differential.scenario import (
        GroupKind,
        KVCacheGroup,
        KVEvents,
        RequestSpec,
        Scenario,
        Workload,
    )

    base = Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 32),),
        requests=(RequestSpec(64, 8), RequestSpec(64, 8)),
        shared_prefix_tokens=64,
    )
    events = dataclasses.replace(base, workload=Workload(kv_events=KVEvents.FULL))
    # The cache-on run subscribes to the engine's events; the cache-off run has none.
    assert engine_plan(events)["kv_events"] == "full"
    assert engine_plan(events, prefix_caching=False)["kv_events"] == "off"
    assert engine_plan(base)["kv_events"] == "off"
    held = dataclasses.replace(
        base, workload=Workload(mode=DriveMode.SCHEDULER, pool_blocks=12, watermark=0.25)
    )
    with pytest.raises(EngineUnsupported, match=r"^workload\.watermark: not mapped"):
        engine_plan(held)


def test_lookahead_token_ids_are_the_tokens_each_hash_covers() -> None:
    scenario, run = _run("kv-events-lookahead-token-ids")
    assert run.hits == (0, 48, 0, 48)
    assert run.settings is not None and run.settings.num_hash_lookahead_tokens == 1
    stored = [e for e in _events(run) if e.kind == "stored"]
    # Request 0's first two chunks: blocks 0 and 1 (token ids 1..32), then
    # block 2 (33..48); each hash covers the one token past its block.
    assert [(e.tokens, e.lookahead) for e in stored[:2]] == [
        (((1, 32),), ((17,), (33,))),
        (((33, 16),), ((49,),)),
    ]
    assert kv_event_findings(scenario, run) == []
    # One id off in the second list: the stored rule names the block and the due ids.
    shifted = [
        dataclasses.replace(e, lookahead=((50,),)) if e is stored[1] else e for e in _events(run)
    ]
    assert shifted != _events(run)
    steps = []
    events = iter(shifted)
    for step in run.kv_events.steps:
        steps.append(dataclasses.replace(step, events=tuple(next(events) for _ in step.events)))
    bad = dataclasses.replace(run, kv_events=dataclasses.replace(run.kv_events, steps=tuple(steps)))
    (finding,) = kv_event_findings(scenario, bad)
    assert kv_event_rule(finding) == "stored"
    assert finding.detail == (
        "stored: step 1: BlockStored of group 0: block hash 0's lookahead token ids are "
        "[50]; its hash covers the 1 tokens past its block at 48 tokens, [49]"
    )


def test_a_reannounced_block_carries_the_lookahead_token_ids_of_a_stored_one() -> None:
    scenario, run = _run("kv-events-full-lookahead-token-ids")
    assert run.hits == (0, 48, 0, 48)
    again = [e for e in _events(run) if e.lookup is not None]
    # Requests 1 and 3 hit 48 and re-announce blocks 0..2 (token ids 1..48).
    assert [(e.tokens, e.lookahead) for e in again] == [
        (((1, 48),), ((17,), (33,), (49,))),
        (((1, 48),), ((17,), (33,), (49,))),
    ]
    assert kv_event_findings(scenario, run) == []
    # The third list off by one: the lookup rule names the block and the due ids.
    first = again[0]
    wrong = dataclasses.replace(first, lookahead=((17,), (33,), (50,)))
    (finding,) = kv_event_findings(scenario, _replaced(run, first, wrong))
    assert kv_event_rule(finding) == "lookup"
    assert finding.detail.endswith(
        "its BlockStored: block hash 2's lookahead token ids are [50]; its hash covers the 1 "
        "tokens past its block at 48 tokens, [49]"
    )


@pytest.mark.parametrize("mode", [None, DriveMode.SCHEDULER])
def test_extra_keys_carry_each_blocks_image_offsets_and_the_salt(mode: DriveMode | None) -> None:
    scenario, run = _run("kv-events-extra-keys-image-and-salt", mode)
    assert run.hits == (0, 0, 96, 0, 96)
    stored = [e for e in _events(run) if e.kind == "stored"]
    # Tenant a's six blocks: the salt on block 0, the image (tokens 24..63)
    # at offsets 8, -8 and -24 from the first tokens of blocks 1, 2 and 3.
    assert stored[0].extra_keys == (
        ("tenant-a",),
        (("scan", 8),),
        (("scan", -8),),
        (("scan", -24),),
        None,
        None,
    )
    # The unsalted request's first block has no key.
    assert stored[2].extra_keys is not None and stored[2].extra_keys[0] is None
    assert kv_event_findings(scenario, run) == []
    # Offsets counted from token 0 instead: the stored rule names the block.
    wrong = dataclasses.replace(
        stored[0], extra_keys=(("tenant-a",), (("scan", 24),), *stored[0].extra_keys[2:])
    )
    (finding,) = kv_event_findings(scenario, _replaced(run, stored[0], wrong))
    assert finding.detail == (
        "stored: step 0: BlockStored of group 0: block hash 1's extra keys are "
        "[('scan', 24)]; request 0's block [16, 32) owes [('scan', 8)]"
    )
    # No list at all where keys are owed.
    bare = dataclasses.replace(stored[0], extra_keys=None)
    (finding,) = kv_event_findings(scenario, _replaced(run, stored[0], bare))
    assert "carries 0 extra-key entries for 6 block hashes" in finding.detail


def test_event_hashes_are_the_wire_form_kvfuzz_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The events carry each block hash's low 64 bits as an int (vLLM PR
    # #23673's compatibility form, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
    # kvfuzz puts the cache's and the requests' hashes in that form itself:
    # a vLLM whose events carry another form names no request's prefix.
    from vllm.v1.core import block_pool

    from differential.driver.kv_events import wire_block_hash

    assert wire_block_hash(bytes(range(40))) == int.from_bytes(bytes(range(32, 40)), "big")
    scenario, run = _run("kv-events-evicted-duplicate-block")
    assert judge_engine_run(scenario, run)[1] == ()
    monkeypatch.setattr(block_pool, "maybe_convert_block_hash", lambda h: h)
    scenario, raw = _run("kv-events-evicted-duplicate-block")
    assert raw.hits == run.hits
    breaches = {
        kv_event_rule(f): f.detail
        for f in judge_engine_run(scenario, raw)[1]
        if f.kind.value == "kv-events"
    }
    assert set(breaches) == {"stored", "replay"}
    assert breaches["stored"].startswith(
        "stored: step 0: BlockStored of group 0: block hash 0 of 2 is not the hash of "
        "request 0's prefix ending on a block boundary"
    )

"""The KV cache event rules and the watermark rule on hand-worked streams (no vLLM).

The model: a full-attention group and a sliding-window group (window 8), both
4-token blocks. The shared prefix is tokens 1..8; request 0 is it plus one own
token (1000000), request 1 the same prefix plus 2000000. Request 0 caches two
blocks per group: hash label 0 names the first 4 tokens, label 1 the first 8.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from differential.corpus import finding_tag
from differential.errors import ScenarioError
from differential.findings import Finding, FindingKind
from differential.observation import (
    KVEvent,
    KVEventLog,
    KVEventLookup,
    KVEventStep,
    RunObservation,
    runs_of,
    tokens_of,
)
from differential.oracle.kv_events import kv_event_findings, kv_event_rule
from differential.oracle.watermark import watermark_blocks, watermark_findings
from differential.scenario import (
    DriveMode,
    GroupKind,
    KVCacheGroup,
    KVEvents,
    KVEventsView,
    RequestSpec,
    Scenario,
    Workload,
)

PREFIXES = {0: (0, 4), 1: (0, 8)}
KIND = {0: ("full_attention", None), 1: ("sliding_window", 8)}


def scenario(
    mode: KVEvents = KVEvents.INCREMENTAL, view: KVEventsView = KVEventsView.PER_COPY
) -> Scenario:
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, sliding_window_tokens=8),
        ),
        requests=(RequestSpec(8, 1), RequestSpec(8, 1)),
        shared_prefix_tokens=8,
        workload=Workload(kv_events=mode, kv_events_view=view),
    )


def stored(group: int, hashes: tuple[int, ...], parent: int | None, tokens: list[int], **kw):
    kind, window = KIND[group]
    fields = {"spec_kind": kind, "sliding_window": window, **kw}
    return KVEvent("stored", group, hashes, parent, 4, runs_of(tokens), **fields)


FIRST = KVEventStep(
    step=1,
    events=(
        stored(0, (0, 1), None, list(range(1, 9))),
        stored(1, (0, 1), None, list(range(1, 9))),
    ),
    lookups=(KVEventLookup(0, 0, (0, 0)),),
    pool=((0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)),
)


def judged(
    *steps: KVEventStep,
    mode: KVEvents = KVEvents.INCREMENTAL,
    view: KVEventsView = KVEventsView.PER_COPY,
) -> list[Finding]:
    log = KVEventLog(mode.value, steps, dict(PREFIXES))
    run = RunObservation("v", "test", None, (), kv_events=log)
    return kv_event_findings(scenario(mode, view), run)


def test_a_stream_that_rebuilds_the_cache_passes() -> None:
    # Request 1's lookup hits 8 tokens (two blocks per group) and, in
    # incremental mode, publishes nothing; its prompt fills no third block.
    second = KVEventStep(step=2, lookups=(KVEventLookup(1, 8, (2, 2)),))
    assert judged(FIRST, second) == []


def test_a_cached_block_the_stream_never_announced_breaks_the_replay() -> None:
    # The pool holds a second block under label 1 in group 0; no event said so.
    second = KVEventStep(step=2, pool=((0, 1, 2),))
    (finding,) = judged(FIRST, second)
    assert finding_tag(finding) == "kv-events@run"
    assert kv_event_rule(finding) == "replay"
    assert finding.detail == (
        "replay: step 2: replaying the stream gives 4 cached blocks, the pool holds 5; "
        "first difference: group 0, the hash of request 0's first 8 tokens: 1 block(s) in "
        "the replay, 2 in the pool"
    )


def test_one_blockremoved_per_physical_copy_keeps_the_replay_exact() -> None:
    # Two copies of label 1 in group 0 (two BlockStored), one evicted: the
    # replay counts one left, as the pool does (vLLM PR #55092's case).
    second = KVEventStep(
        step=2,
        events=(stored(0, (1,), 0, list(range(5, 9))),),
        pool=((0, 1, 2),),
    )
    third = KVEventStep(step=3, events=(KVEvent("removed", 0, (1,)),), pool=((0, 1, 1),))
    assert judged(FIRST, second, third) == []


def test_the_router_view_loses_a_hash_one_of_two_copies_of_leaves() -> None:
    # The same stream under the router view: the one BlockRemoved drops label
    # 1 of group 0 from the router's set while the pool still holds a copy.
    second = KVEventStep(
        step=2,
        events=(stored(0, (1,), 0, list(range(5, 9))),),
        pool=((0, 1, 2),),
    )
    third = KVEventStep(step=3, events=(KVEvent("removed", 0, (1,)),), pool=((0, 1, 1),))
    assert judged(FIRST, second, view=KVEventsView.ROUTER) == []
    (finding,) = judged(FIRST, second, third, view=KVEventsView.ROUTER)
    assert kv_event_rule(finding) == "router"
    assert finding.detail == (
        "router: step 3: a router replaying the stream as a set holds 3 hashes, the pool 4; "
        "first difference: the router dropped the hash of request 0's first 8 tokens "
        "(group 0) while the pool still caches it in 1 block(s): it stops routing that "
        "prefix here"
    )
    # Removing the last copy too brings the router and the pool together again.
    fourth = KVEventStep(step=4, events=(KVEvent("removed", 0, (1,)),), pool=((0, 1, 0),))
    (finding,) = judged(FIRST, second, third, fourth, view=KVEventsView.ROUTER)
    assert "(and" not in finding.detail


def test_the_router_view_sees_a_hash_held_after_its_last_copy_is_gone() -> None:
    # A block evicted without its BlockRemoved: the router still holds it.
    second = KVEventStep(step=2, pool=((0, 1, 0),))
    (finding,) = judged(FIRST, second, view=KVEventsView.ROUTER)
    assert finding.detail.endswith(
        "the router holds the hash of request 0's first 8 tokens (group 0), which the pool "
        "no longer caches: it routes that prefix here to be recomputed"
    )


def test_removing_a_block_never_stored_is_a_removed_finding() -> None:
    second = KVEventStep(step=2, events=(KVEvent("removed", 1, (7,)),))
    (finding,) = judged(FIRST, second)
    assert kv_event_rule(finding) == "removed"
    assert "BlockRemoved of group 1 for a hash no earlier BlockStored" in finding.detail


def test_a_group_index_naming_no_group_is_a_finding() -> None:
    second = KVEventStep(step=2, events=(KVEvent("removed", 2, (0,)),))
    (finding,) = judged(FIRST, second)
    assert finding.detail.startswith("removed: step 2: BlockRemoved with group_idx 2")


@pytest.mark.parametrize(
    ("event", "says"),
    [
        # The second block's tokens announced with no parent: they are no
        # request's first tokens.
        (
            stored(0, (1,), None, list(range(5, 9))),
            "its 4 token ids are no request's tokens [0, 4)",
        ),
        # The hashes out of order: hash 0 names the 8-token prefix.
        (
            stored(0, (1, 0), None, list(range(1, 9))),
            "block hash 0 of 2 is not the hash of request 0's prefix",
        ),
        # The sliding-window group's event annotated as full attention.
        (
            stored(1, (0, 1), None, list(range(1, 9)), spec_kind="full_attention"),
            "carries kv_cache_spec_kind 'full_attention', sliding window 8; "
            "group 1 (sliding_window) has 'sliding_window', 8",
        ),
        # A block size the group does not have.
        (
            dataclasses.replace(stored(0, (0, 1), None, list(range(1, 9))), block_size=8),
            "has block_size 8 and 8 token ids; allowed a block size of [4]",
        ),
    ],
)
def test_a_misdescribed_block_is_a_stored_finding(event: KVEvent, says: str) -> None:
    first = dataclasses.replace(FIRST, events=(event, FIRST.events[1]))
    stored_findings = [f for f in judged(first) if kv_event_rule(f) == "stored"]
    assert len(stored_findings) == 1
    assert says in stored_findings[0].detail


def test_a_lookup_publishing_in_incremental_mode_is_a_lookup_finding() -> None:
    again = stored(0, (0, 1), None, list(range(1, 9)), lookup=0)
    second = KVEventStep(step=2, events=(again,), lookups=(KVEventLookup(1, 8, (2, 2)),))
    (finding,) = judged(FIRST, second)
    assert finding_tag(finding) == "kv-events@1"
    assert finding.detail.startswith(
        "lookup: step 2: the lookup of request 1 (hit 8 tokens) published 1 event(s) in "
        "kv_cache_report_mode 'incremental'"
    )


def reannounced(group: int, lookup: int = 0) -> KVEvent:
    return stored(group, (0, 1), None, list(range(1, 9)), lookup=lookup)


def test_full_mode_reannounces_each_groups_reused_blocks() -> None:
    lookup = KVEventLookup(1, 8, (2, 2))
    second = KVEventStep(step=2, events=(reannounced(0), reannounced(1)), lookups=(lookup,))
    assert judged(FIRST, second, mode=KVEvents.FULL) == []
    # Missing the sliding-window group's re-announcement.
    second = KVEventStep(step=2, events=(reannounced(0),), lookups=(lookup,))
    (finding,) = judged(FIRST, second, mode=KVEvents.FULL)
    assert finding.detail == (
        "lookup: step 2: the lookup of request 1 (hit 8 tokens) re-announced (group, "
        "blocks) [(0, 2)]; kv_cache_report_mode 'full' re-announces the blocks it "
        "returned: [(0, 2), (1, 2)]"
    )
    # A lookup that misses announces nothing, even in full mode.
    assert judged(FIRST, mode=KVEvents.FULL) == []


def test_a_reannouncement_with_a_parent_is_a_lookup_finding() -> None:
    wrong = dataclasses.replace(reannounced(1), parent=0)
    second = KVEventStep(
        step=2, events=(reannounced(0), wrong), lookups=(KVEventLookup(1, 8, (2, 2)),)
    )
    (finding,) = judged(FIRST, second, mode=KVEvents.FULL)
    assert "is not request 1's first 2 blocks of 4 tokens with no parent" in finding.detail


def test_all_blocks_cleared_empties_the_replay() -> None:
    cleared = KVEventStep(
        step=2,
        events=(KVEvent("cleared"),),
        pool=((0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)),
    )
    assert judged(FIRST, cleared) == []


def test_the_log_round_trips_through_json() -> None:
    log = KVEventLog("full", (FIRST,), dict(PREFIXES))
    run = RunObservation("v", "test", None, (), kv_events=log, watermark_admissions=((1, 2, 3),))
    again = RunObservation.from_dict(json.loads(json.dumps(run.to_dict())))
    assert again == run
    assert again.kv_events is not None and again.kv_events.num_events == (2, 0, 0)
    assert tokens_of(runs_of([5, 6, 7, 9, 1])) == [5, 6, 7, 9, 1]
    assert runs_of([5, 6, 7, 9, 1]) == ((5, 3), (9, 1), (1, 1))
    # A run without events writes no key (older observations unchanged).
    assert "kv_events" not in RunObservation("v", "test", None, ()).to_dict()
    # Lookahead token ids, per block hash, only where the event carries them.
    ahead = KVEvent("stored", 0, (1, 2), None, 16, ((1, 32),), lookahead=((17,), (33,)))
    assert ahead.to_dict()["lookahead"] == [[17], [33]]
    assert KVEvent.from_dict(ahead.to_dict()) == ahead
    assert "lookahead" not in KVEvent("stored", 0, (1,), None, 16, ((1, 16),)).to_dict()
    # Extra keys: a salt, an image's (identifier, offset) pair, or none.
    keyed = KVEvent(
        "stored", 0, (1, 2, 3), None, 16, ((1, 48),), extra_keys=(("s",), (("img", -8),), None)
    )
    assert keyed.to_dict()["extra_keys"] == [["s"], [["img", -8]], None]
    assert KVEvent.from_dict(json.loads(json.dumps(keyed.to_dict()))) == keyed
    recorded = KVEventLog("incremental", (FIRST,), dict(PREFIXES), extra_keys=True)
    assert KVEventLog.from_dict(json.loads(json.dumps(recorded.to_dict()))) == recorded
    # A log written before extra keys were recorded reads as not recording them.
    assert KVEventLog.from_dict(KVEventLog("full", (FIRST,)).to_dict()).extra_keys is False


def watermarked(watermark: float = 0.3) -> Scenario:
    return dataclasses.replace(
        scenario(),
        workload=Workload(mode=DriveMode.SCHEDULER, pool_blocks=10, watermark=watermark),
    )


def test_an_admission_below_the_watermark_is_a_watermark_finding() -> None:
    s = watermarked()
    assert watermark_blocks(s, 10) == 3  # int(0.3 x 10)
    run = RunObservation(
        "v", "test", None, (), mode="scheduler", pool_blocks=10,
        watermark_admissions=((1, 2, 3), (2, 2, 2)),
    )  # fmt: skip
    (finding,) = watermark_findings(s, run)
    assert finding_tag(finding) == "watermark@2"
    assert finding.detail == (
        "step 2: admitted beside scheduled requests, leaving 2 free blocks, below the "
        "watermark of 3 (int(0.3 x 10 blocks))"
    )


def test_workload_fields_are_written_only_when_set_and_checked() -> None:
    assert "kv_events" not in scenario(KVEvents.OFF).to_dict().get("workload", {})
    assert scenario(KVEvents.FULL).to_dict()["workload"]["kv_events"] == "full"
    assert watermarked().to_dict()["workload"]["watermark"] == 0.3
    assert Scenario.from_dict(watermarked().to_dict()) == watermarked()
    with pytest.raises(ScenarioError, match=r"allowed a number 0\.0 <= x < 1\.0"):
        watermarked(1.0)
    with pytest.raises(ScenarioError, match="'scheduler' when watermark is set"):
        dataclasses.replace(scenario(), workload=Workload(watermark=0.1))
    assert "kv_events_view" not in scenario().to_dict()["workload"]
    routed = scenario(view=KVEventsView.ROUTER)
    assert routed.to_dict()["workload"]["kv_events_view"] == "router"
    assert Scenario.from_dict(routed.to_dict()) == routed
    with pytest.raises(ScenarioError, match=r"workload\.kv_events_view.*'per-copy' when kv_events"):
        scenario(KVEvents.OFF, KVEventsView.ROUTER)
    data = scenario().to_dict()
    data["workload"]["kv_events"] = "yes"
    with pytest.raises(ScenarioError, match="one of 'off', 'incremental', 'full'"):
        Scenario.from_dict(data)


def test_the_full_report_crash_is_labelled_only_on_fine_grained_full_reports() -> None:
    from differential.oracle.known import label_known
    from differential.scenario import KVCacheGroup as Group

    crash = Finding(
        FindingKind.CRASH,
        "v",
        1,
        "request 1: lookup: KVCacheManager.get_computed_blocks: IndexError: list index out "
        "of range [raised in BlockHashListWithBlockSize._get_value_at "
        "(vllm/v1/core/kv_cache_utils.py)]",
    )

    def mamba(mode: KVEvents, hash_block: int | None = 16) -> Scenario:
        return Scenario(
            kv_cache_groups=(Group(GroupKind.FULL_ATTENTION, 64), Group(GroupKind.MAMBA, 64)),
            requests=(RequestSpec(100, 0), RequestSpec(100, 0, shares_with=0)),
            shared_prefix_tokens=100,
            hash_block_size_tokens=hash_block,
            workload=Workload(kv_events=mode),
        )

    name = "kv-events-full-report-partial-hit"
    assert label_known(mamba(KVEvents.FULL), [crash])[0].known_issue == name
    # Near misses: incremental reports, whole-block hits only, another crash.
    assert label_known(mamba(KVEvents.INCREMENTAL), [crash])[0].known_issue is None
    assert label_known(mamba(KVEvents.FULL, None), [crash])[0].known_issue is None
    other = dataclasses.replace(crash, detail="request 1: free: ValueError: no")
    assert label_known(mamba(KVEvents.FULL), [other])[0].known_issue is None


def test_a_broken_stream_is_triaged_by_the_rule_it_breaks() -> None:
    from differential.compare import ScenarioResult, VariantResult
    from differential.findings import Policy
    from differential.triage.identity import RootCause, triage
    from differential.variants import parse_variants

    (unfixed,) = parse_variants("unfixed")
    second = KVEventStep(step=2, events=(KVEvent("removed", 1, (7,)),))
    log = KVEventLog("incremental", (FIRST, second), dict(PREFIXES))
    run = RunObservation("unfixed", "test", None, (), kv_events=log)
    findings = tuple(kv_event_findings(scenario(), run))
    result = ScenarioResult(
        scenario(), None, Policy.VLLM, (VariantResult(unfixed, run, None, (), findings),)
    )
    (triaged,) = triage(result)
    assert triaged.root_cause == RootCause("kv-events", detail="removed")


@pytest.mark.parametrize("mode", [KVEvents.INCREMENTAL, KVEvents.FULL])
def test_generator_reaches_kv_cache_events(mode: KVEvents) -> None:
    from tests.factories import reach

    found = reach(lambda s: s.workload.kv_events is mode and len(s.kv_cache_groups) > 1)
    assert found.workload.kv_events is mode


def test_the_scheduler_mode_generator_reaches_the_router_view() -> None:
    from fuzz.strategies import engine_scenarios
    from tests.factories import reach

    found = reach(
        lambda s: (
            s.workload.kv_events_view is KVEventsView.ROUTER and s.workload.pool_blocks is not None
        ),
        engine_scenarios(),
    )
    assert found.workload.mode is DriveMode.SCHEDULER
    assert found.workload.kv_events is not KVEvents.OFF

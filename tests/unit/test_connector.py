"""A KV connector's remote store (``workload.connector``) and client aborts
(``workload.abort_steps``): the scenario fields, the oracle's connector rules
worked by hand, the comparison of variants, the shrinker and the generator."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings

from differential.compare import compare_unlabelled
from differential.errors import ScenarioError
from differential.findings import FindingKind
from differential.observation import ConnectorLookup, RequestObservation, RunObservation
from differential.oracle.connector import (
    adoption_owed,
    connector_findings,
    finish_findings,
    store_owed,
)
from differential.scenario import (
    ConnectorLoad,
    ConnectorStore,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    LoadFailurePolicy,
    RequestSpec,
    Scenario,
    Workload,
)
from fuzz.minimize import _connector_store, _drop_requests, _workload
from fuzz.strategies import engine_scenarios

FA16 = KVCacheGroup(GroupKind.FULL_ATTENTION, 16)
MAMBA64 = KVCacheGroup(GroupKind.MAMBA, 64)


def _store_scenario(store: ConnectorStore | None = None, **workload: object) -> Scenario:
    """FA 16: a 100-token writer, a reader of its prompt + 30, a third request."""
    return Scenario(
        kv_cache_groups=(FA16,),
        requests=(RequestSpec(100, 0), RequestSpec(100, 30, 0), RequestSpec(130, 20, 1)),
        shared_prefix_tokens=100,
        kv_connector=True,
        workload=Workload(
            mode=DriveMode.SCHEDULER,
            connector=ConnectorStore() if store is None else store,
            **workload,  # type: ignore[arg-type]
        ),
    )


# ------------------------------------------------------------------ scenario


def test_store_fields_are_written_only_when_not_default_and_round_trip() -> None:
    plain = _store_scenario()
    assert plain.to_dict()["workload"]["connector"] == {}
    assert "abort_steps" not in plain.to_dict()["workload"]
    store = ConnectorStore(load=ConnectorLoad.ASYNC, failed_loads=(1,), prefix_caching=False)
    s = _store_scenario(store, abort_steps=(None, 3, None))
    w = s.to_dict()["workload"]
    assert w["connector"] == {"load": "async", "failed_loads": [1], "prefix_caching": False}
    assert w["abort_steps"] == [None, 3, None]
    assert Scenario.from_json(s.to_json()) == s
    assert not s.prefix_caching and plain.prefix_caching
    assert not s.workload.sequential
    # Divergent hybrid hits need a Mamba hybrid (which needs prefix caching).
    hybrid = dataclasses.replace(
        s,
        kv_cache_groups=(FA16, MAMBA64),
        hash_block_size_tokens=16,
        workload=dataclasses.replace(
            s.workload, connector=ConnectorStore(divergent_hybrid_hits=True)
        ),
    )
    assert hybrid.to_dict()["workload"]["connector"] == {"divergent_hybrid_hits": True}
    assert Scenario.from_json(hybrid.to_json()) == hybrid


def test_a_scenario_without_a_store_keeps_its_json() -> None:
    s = dataclasses.replace(_store_scenario(), workload=Workload(mode=DriveMode.SCHEDULER))
    assert set(s.to_dict()["workload"]) == {
        "mode",
        "pool_blocks",
        "arrival_steps",
        "max_num_seqs",
        "max_num_batched_tokens",
        "shares_output",
        "accepted_drafts",
    }


@pytest.mark.parametrize(
    ("change", "field", "allowed"),
    [
        ({"mode": DriveMode.MANAGER}, "workload.connector", "null in manager mode"),
        (
            {"connector": ConnectorStore(failed_loads=(1,))},
            "workload.connector.failed_loads",
            "'async'",
        ),
        (
            {"connector": ConnectorStore(ConnectorLoad.ASYNC, failed_loads=(3,))},
            "workload.connector.failed_loads[0]",
            "a request index 0..2",
        ),
        (
            {"connector": ConnectorStore(ConnectorLoad.ASYNC, failed_loads=(1, 1))},
            "workload.connector.failed_loads[1]",
            "each request at most once",
        ),
        ({"abort_steps": (1, None)}, "workload.abort_steps", "a list of 3 steps"),
    ],
)
def test_invalid_store_and_aborts_are_refused_naming_the_field(
    change: dict[str, object], field: str, allowed: str
) -> None:
    base = _store_scenario()
    with pytest.raises(ScenarioError) as raised:
        dataclasses.replace(base, workload=dataclasses.replace(base.workload, **change))  # type: ignore[arg-type]
    assert raised.value.field == field
    assert allowed in str(raised.value)


def test_a_store_needs_a_configured_connector_and_mamba_needs_prefix_caching() -> None:
    with pytest.raises(ScenarioError, match="null unless kv_connector is true"):
        dataclasses.replace(_store_scenario(), kv_connector=False)
    with pytest.raises(ScenarioError) as raised:
        Scenario(
            kv_cache_groups=(FA16, MAMBA64),
            requests=(RequestSpec(100, 0),),
            shared_prefix_tokens=100,
            hash_block_size_tokens=16,
            kv_connector=True,
            workload=Workload(
                mode=DriveMode.SCHEDULER, connector=ConnectorStore(prefix_caching=False)
            ),
        )
    assert raised.value.field == "workload.connector.prefix_caching"


def test_aborts_are_refused_in_manager_mode() -> None:
    with pytest.raises(ScenarioError) as raised:
        Scenario(
            kv_cache_groups=(FA16,),
            requests=(RequestSpec(100, 0),),
            shared_prefix_tokens=100,
            workload=Workload(abort_steps=(1,)),
        )
    assert raised.value.field == "workload.abort_steps"


def test_an_unknown_store_field_is_named() -> None:
    data = _store_scenario().to_dict()
    data["workload"]["connector"] = {"loads": "async"}
    with pytest.raises(ScenarioError) as raised:
        Scenario.from_json(json.dumps(data))
    assert "workload.connector.loads" in str(raised.value)


# -------------------------------------------------------------------- oracle


def _lookup(
    hit: int, presented: int, matched: int, store: int, local: int, external: int, **kw: bool
) -> ConnectorLookup:
    return ConnectorLookup(hit, presented, matched, store, local, external, **kw)


@pytest.mark.parametrize(
    ("lookup", "owed"),
    [
        # FA only: a 48-token local hit, the store 96 past it (B = 16).
        (_lookup(48, 48, 48, 96, 48, 48), 96),
        # A sub-block local tail (hit 80, B = 64): the store's 32 past 64
        # strictly exceed the 16-token tail, so the tail is dropped: 64 + 32.
        (_lookup(80, 64, 32, 96, 64, 32), 96),
        # The store's 16 past 64 do not exceed the tail: the local 80 stays.
        (_lookup(80, 64, 16, 80, 80, 0), 80),
        # A divergent hit the store adds nothing to is reconciled: not judged.
        (_lookup(384, 384, 0, 384, 0, 0, diverged=True), None),
        # A divergent hit the store adds to is judged like any other.
        (_lookup(368, 320, 64, 384, 320, 64, diverged=True), 384),
    ],
)
def test_adoption_owed_by_hand(lookup: ConnectorLookup, owed: int | None) -> None:
    block = 64 if lookup.local_hit_tokens in (80, 368, 384) else 16
    assert adoption_owed(lookup, block) == owed


def _obs(index: int, step: int, finished: int | None, c: ConnectorLookup) -> RequestObservation:
    return RequestObservation(
        index=index,
        prompt_tokens=0,
        hit_tokens=c.local_hit_tokens,
        shared_prefix_boundary_tokens=0,
        per_group_hit_tokens=(c.local_hit_tokens,),
        retained_blocks_per_group=(0,),
        scheduled_step=step,
        lookup_order=index,
        finished_step=finished,
        connector=c,
    )


def _store_run(reader: ConnectorLookup, *, writer_finished: int | None = 0) -> RunObservation:
    nothing = _lookup(0, 0, 0, 0, 0, 0)
    return RunObservation(
        variant="unfixed",
        vllm_version="0.33.0",
        settings=None,
        requests=(_obs(0, 0, writer_finished, nothing), _obs(1, 1, 1, reader)),
        mode="scheduler",
    )


def test_the_store_owes_the_finished_writers_prefix() -> None:
    # Writer: 100 tokens computed (decode_steps 0); the reader shares them all.
    s = _store_scenario()
    owed = store_owed(s, _store_run(_lookup(0, 0, 96, 96, 0, 96)))
    assert owed[1].tokens == 96 and owed[1].writer == 0 and owed[1].shared_tokens == 100
    assert connector_findings(s, _store_run(_lookup(0, 0, 96, 96, 0, 96))) == []


def test_a_store_short_of_a_finished_writer_is_a_fallback() -> None:
    # The store answered 48 only: adoption matches the answer, but the
    # writer's 96 tokens are owed.
    s = _store_scenario()
    (finding,) = connector_findings(s, _store_run(_lookup(0, 0, 48, 48, 0, 48)))
    assert finding.kind is FindingKind.FALLBACK and finding.request == 1
    assert finding.expected_tokens == 96 and finding.hit_tokens == 48
    assert "since request 0 finished" in finding.detail


def test_a_writer_still_in_flight_promises_nothing() -> None:
    s = _store_scenario()
    run = _store_run(_lookup(0, 0, 48, 48, 0, 48), writer_finished=None)
    assert store_owed(s, run)[1].tokens == 0
    assert connector_findings(s, run) == []


def test_a_writer_its_client_aborted_promises_nothing() -> None:
    # Aborted from step 0 and finished at step 0 (under async scheduling the
    # output of its last step is applied after the abort): it saved only part
    # of its prompt, so the reader's 48 tokens owe nothing more.
    s = _store_scenario(abort_steps=(0, None, None))
    run = _store_run(_lookup(0, 0, 48, 48, 0, 48))
    assert run.requests[0].aborted_by_client(s.workload.abort_steps)
    assert store_owed(s, run)[1].tokens == 0
    assert connector_findings(s, run) == []
    # Aborted later than it finished: it finished by itself and is owed.
    late = _store_scenario(abort_steps=(1, None, None))
    assert store_owed(late, run)[1].tokens == 96


def test_adopting_more_or_less_than_the_answer_is_judged() -> None:
    s = _store_scenario()
    (over,) = connector_findings(s, _store_run(_lookup(0, 0, 96, 96, 0, 112)))
    assert over.kind is FindingKind.OVER_HIT and over.expected_tokens == 96
    (short,) = connector_findings(s, _store_run(_lookup(0, 0, 96, 96, 0, 80)))
    assert short.kind is FindingKind.FALLBACK and short.expected_tokens == 96
    assert "the larger of its local hit and what the store holds" in short.detail


def test_a_load_into_the_null_block_or_a_cached_block_is_wrong_kv() -> None:
    s = _store_scenario()
    # The writer's 96 tokens loaded into the reader's blocks 5..10 (16 tokens each).
    own = tuple((i, False, False) for i in range(5, 11))
    right = dataclasses.replace(_lookup(0, 0, 96, 96, 0, 96), load_targets=(own,))
    assert connector_findings(s, _store_run(right)) == []
    # Block 0 is the null block; block 3 holds a prefix-cache entry.
    bad = (*own[:4], (0, True, False), (3, False, True))
    wrong = dataclasses.replace(right, load_targets=(bad,))
    (finding,) = connector_findings(s, _store_run(wrong))
    assert finding.kind is FindingKind.WRONG_KV and finding.request == 1
    assert finding.detail == (
        "connector: group 0: the store's 96 tokens are loaded into block 0 (the null "
        "block), block 3 (a cached block) (get_unhashed_block_ids_all_groups names only "
        "the request's own uncached blocks)"
    )
    assert ConnectorLookup.from_dict(wrong.to_dict()) == wrong


def test_no_connector_rule_without_a_store() -> None:
    s = dataclasses.replace(_store_scenario(), workload=Workload(mode=DriveMode.SCHEDULER))
    assert connector_findings(s, _store_run(_lookup(0, 0, 0, 0, 0, 96))) == []


def test_a_synchronous_load_the_step_does_not_flag_is_wrong_kv() -> None:
    s = _store_scenario()
    flagged = dataclasses.replace(
        _store_run(_lookup(0, 0, 96, 96, 0, 96)),
        sync_kv_load_steps=((3, True, (1,)), (5, True, ())),
    )
    assert [f for f in connector_findings(s, flagged) if f.kind is FindingKind.WRONG_KV] == []
    unflagged = dataclasses.replace(flagged, sync_kv_load_steps=((3, False, (1, 2)),))
    wrong = [f for f in connector_findings(s, unflagged) if f.kind is FindingKind.WRONG_KV]
    assert [(f.request, f.detail) for f in wrong] == [
        (
            i,
            f"connector: step 3 loads request {i}'s KV synchronously (into that step's forward) "
            "but SchedulerOutput.has_sync_kv_loads is false, so the worker starts the load "
            "after the forward (vLLM PR #53333)",
        )
        for i in (1, 2)
    ]
    assert RunObservation.from_dict(unflagged.to_dict()).sync_kv_load_steps == ((3, False, (1, 2)),)


# ---------------------------------------------------------------- comparison


def test_variants_starting_a_request_differently_disagree() -> None:
    from differential.compare import VariantResult
    from differential.variants import parse_variants

    s = _store_scenario()
    a, b = parse_variants("unfixed,fixed")

    def result(variant: object, reader: ConnectorLookup) -> VariantResult:
        return VariantResult(variant, _store_run(reader), None, (), (), 0.0)  # type: ignore[arg-type]

    same = compare_unlabelled(
        s, result(a, _lookup(0, 0, 96, 96, 0, 96)), result(b, _lookup(0, 0, 96, 96, 0, 96))
    )
    assert same == []
    (split,) = compare_unlabelled(
        s, result(a, _lookup(0, 0, 96, 96, 0, 96)), result(b, _lookup(0, 0, 48, 48, 0, 48))
    )
    assert split.kind is FindingKind.DISAGREEMENT and split.request == 1
    assert "computed tokens 0 local + 96 external on unfixed vs 0 + 48 on fixed" in split.detail
    (held,) = compare_unlabelled(
        s, result(a, _lookup(80, 64, 16, 80, 80, 0)), result(b, _lookup(80, 64, 0, 64, 80, 0))
    )
    assert "store held 80 tokens of it on unfixed vs 64 on fixed" in held.detail


# ------------------------------------------------------------------ shrinker


def test_the_shrinker_plains_the_store_and_drops_a_failed_load_with_its_request() -> None:
    s = _store_scenario(
        ConnectorStore(ConnectorLoad.ASYNC, failed_loads=(1, 2), prefix_caching=False)
    )
    steps = {name: c for name, c in _connector_store(s)}
    assert list(steps) == [
        "no remote KV store",
        "request 2's load succeeds",
        "request 1's load succeeds",
        "prefix caching on",
    ]
    empty = steps["no remote KV store"]
    assert empty is not None and empty.kv_connector and empty.workload.connector is None
    kept = steps["request 2's load succeeds"]
    assert kept is not None and kept.workload.connector is not None
    assert kept.workload.connector.failed_loads == (1,)
    on = steps["prefix caching on"]
    assert on is not None and on.prefix_caching
    # Only the last request can go (each copies the one before it); its
    # failed load and its abort step go with it.
    aborted = dataclasses.replace(
        s, workload=dataclasses.replace(s.workload, abort_steps=(None, 4, 9))
    )
    drops = dict(_drop_requests(aborted))
    assert list(drops) == ["drop request 2"]
    last = drops["drop request 2"]
    assert last is not None and last.workload.connector is not None
    assert last.workload.connector.failed_loads == (1,)
    assert last.workload.abort_steps == (None, 4)
    workload_steps = dict(_workload(aborted))
    no_aborts = workload_steps["no aborts"]
    assert no_aborts is not None and no_aborts.workload.abort_steps is None


# ----------------------------------------------------------------- generator


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(engine_scenarios())
def test_generated_stores_are_valid_and_configured(s: Scenario) -> None:
    store = s.workload.connector
    if store is None:
        assert s.workload.abort_steps is None
        return
    assert s.kv_connector and s.workload.mode is DriveMode.SCHEDULER
    assert not store.failed_loads or store.load is ConnectorLoad.ASYNC
    assert store.prefix_caching or not s.mamba_groups
    assert store.failed_loads or store.kv_load_failure_policy is LoadFailurePolicy.RECOMPUTE
    assert Scenario.from_json(s.to_json()) == s


def test_the_generator_draws_the_fail_policy_for_failed_loads() -> None:
    # The policy is the last draw: a store with failed loads fails them one
    # time in two, so some examples of a fixed-seed sample do.
    policies = set()

    @settings(max_examples=400, deadline=None, derandomize=True, database=None)
    @given(engine_scenarios())
    def collect(s: Scenario) -> None:
        store = s.workload.connector
        if store is not None and store.failed_loads:
            policies.add(store.kv_load_failure_policy)

    collect()
    assert policies == {LoadFailurePolicy.RECOMPUTE, LoadFailurePolicy.FAIL}


# ------------------------------------------------------- engine mode, export


def test_engine_mode_refuses_a_store_and_aborts_naming_why() -> None:
    from differential.driver.engine_mode import EngineUnsupported, engine_plan

    fa32 = KVCacheGroup(GroupKind.FULL_ATTENTION, 32)  # a block the CPU kernels take
    store = dataclasses.replace(_store_scenario(), kv_cache_groups=(fa32,))
    with pytest.raises(EngineUnsupported, match=r"^workload.connector: .*no worker side"):
        engine_plan(store)
    aborted = Scenario(
        kv_cache_groups=(fa32,),
        requests=(RequestSpec(100, 0),),
        shared_prefix_tokens=100,
        workload=Workload(mode=DriveMode.SCHEDULER, abort_steps=(1,)),
    )
    with pytest.raises(EngineUnsupported, match=r"^workload.abort_steps: "):
        engine_plan(aborted)


def test_a_scheduler_export_refuses_a_store_naming_the_field() -> None:
    from differential.exports.scheduler_test import export_engine_test
    from differential.findings import Finding

    finding = Finding(FindingKind.FALLBACK, "unfixed", 1, "x", expected_tokens=96, hit_tokens=48)
    with pytest.raises(ScenarioError) as raised:
        export_engine_test(_store_scenario(), finding, signature="s", name="n")
    assert raised.value.field == "workload.connector"
    assert "a standalone test does not carry" in str(raised.value)
    aborted = Scenario(
        kv_cache_groups=(FA16,),
        requests=(RequestSpec(100, 0), RequestSpec(100, 30, 0)),
        shared_prefix_tokens=100,
        workload=Workload(mode=DriveMode.SCHEDULER, abort_steps=(None, 3)),
    )
    with pytest.raises(ScenarioError) as raised:
        export_engine_test(aborted, finding, signature="s", name="n")
    assert raised.value.field == "workload.abort_steps"


def test_the_timeline_promises_nothing_local_for_a_store_beside_a_sliding_window() -> None:
    from differential.oracle.engine import timeline_writers

    fa_only = _store_scenario()
    two = _store_run(_lookup(0, 0, 96, 96, 0, 96))
    third = _obs(2, 2, 2, _lookup(128, 128, 0, 128, 128, 0))
    run = dataclasses.replace(two, requests=(*two.requests, third))
    assert timeline_writers(fa_only, run) == [frozenset(), frozenset({0}), frozenset({0, 1})]
    windowed = dataclasses.replace(
        fa_only,
        kv_cache_groups=(FA16, KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, 32)),
    )
    assert timeline_writers(windowed, run) is None


def test_a_connector_without_the_hybrid_allocator_round_trips_on_one_group() -> None:
    data = {
        "kv_cache_groups": [{"kind": "full_attention", "block_size_tokens": 16}],
        "kv_connector": True,
        "shared_prefix_tokens": 64,
        "requests": [{"divergence_tokens": 64, "suffix_tokens": 8}],
        "workload": {"mode": "scheduler", "connector": {"supports_hma": False}},
    }
    legacy = Scenario.from_dict(data)
    assert legacy.workload.connector is not None
    assert legacy.workload.connector.supports_hma is False
    assert Scenario.from_dict(legacy.to_dict()) == legacy
    assert (
        "supports_hma"
        not in Scenario.from_dict(
            {**data, "workload": {"mode": "scheduler", "connector": {}}}
        ).to_dict()["workload"]["connector"]
    )
    two_groups = {
        **data,
        "kv_cache_groups": [
            {"kind": "full_attention", "block_size_tokens": 16},
            {"kind": "sliding_window", "block_size_tokens": 16, "sliding_window_tokens": 32},
        ],
    }
    with pytest.raises(ScenarioError) as caught:
        Scenario.from_dict(two_groups)
    assert caught.value.field == "workload.connector.supports_hma"
    assert "true with more than one KV cache group" in str(caught.value)


def test_the_shrinker_tries_the_hybrid_allocator() -> None:
    from fuzz.minimize import _connector_store

    legacy = Scenario.from_dict(
        {
            "kv_cache_groups": [{"kind": "full_attention", "block_size_tokens": 16}],
            "kv_connector": True,
            "shared_prefix_tokens": 64,
            "requests": [{"divergence_tokens": 64, "suffix_tokens": 8}],
            "workload": {"mode": "scheduler", "connector": {"supports_hma": False}},
        }
    )
    hma = dict(_connector_store(legacy))["a connector with the hybrid allocator"]
    assert hma is not None and hma.workload.connector is not None
    assert hma.workload.connector.supports_hma is True


# ------------------------------------------------- the load-failure policy


def _failing_scenario(policy: LoadFailurePolicy) -> Scenario:
    """The store scenario with asynchronous loads, request 1's failing."""
    return _store_scenario(
        ConnectorStore(load=ConnectorLoad.ASYNC, failed_loads=(1,), kv_load_failure_policy=policy)
    )


def _finished_run(
    *, errored: tuple[tuple[int, int], ...], lost: tuple[int, ...] = (1,)
) -> RunObservation:
    """Requests 0 and 2 looked up and finished by themselves (steps 2 and
    6); request 1's load failed (``lost``) before its admission was
    recorded, so it has no observation."""
    nothing = _lookup(0, 0, 0, 0, 0, 0)
    return RunObservation(
        variant="unfixed",
        vllm_version="0.33.0",
        settings=None,
        requests=(_obs(0, 0, 2, nothing), _obs(2, 4, 6, nothing)),
        mode="scheduler",
        failed_load_requests=lost,
        errored=errored,
    )


def test_the_policy_round_trips_and_is_written_only_when_fail() -> None:
    failing = _failing_scenario(LoadFailurePolicy.FAIL)
    assert failing.to_dict()["workload"]["connector"] == {
        "load": "async",
        "failed_loads": [1],
        "kv_load_failure_policy": "fail",
    }
    assert Scenario.from_dict(failing.to_dict()) == failing
    recompute = _failing_scenario(LoadFailurePolicy.RECOMPUTE).to_dict()
    assert "kv_load_failure_policy" not in recompute["workload"]["connector"]
    data = failing.to_dict()
    data["workload"]["connector"]["kv_load_failure_policy"] = "abort"
    with pytest.raises(ScenarioError) as caught:
        Scenario.from_dict(data)
    assert caught.value.field == "workload.connector.kv_load_failure_policy"
    assert "'recompute'" in str(caught.value) and "'fail'" in str(caught.value)


def test_under_fail_only_the_failed_load_errs() -> None:
    s = _failing_scenario(LoadFailurePolicy.FAIL)
    assert finish_findings(s, _finished_run(errored=((1, 3),))) == []
    # Every request the step scanned failed with it: two wrong finishes.
    wrong = finish_findings(s, _finished_run(errored=((0, 3), (1, 3), (2, 3))))
    assert [(f.kind, f.request) for f in wrong] == [
        (FindingKind.WRONG_FINISH, 0),
        (FindingKind.WRONG_FINISH, 2),
    ]
    assert "with an error after step 3, but none of its loads failed" in wrong[0].detail


def test_under_fail_a_failed_load_that_does_not_err_is_a_wrong_finish() -> None:
    s = _failing_scenario(LoadFailurePolicy.FAIL)
    (never,) = finish_findings(s, _finished_run(errored=()))
    assert never.kind is FindingKind.WRONG_FINISH and never.request == 1
    assert never.detail.endswith("but it never finished (vLLM PR #26813)")
    # Its client aborting it first owes no error.
    aborted = _store_scenario(
        ConnectorStore(
            load=ConnectorLoad.ASYNC,
            failed_loads=(1,),
            kv_load_failure_policy=LoadFailurePolicy.FAIL,
        ),
        abort_steps=(None, 2, None),
    )
    assert finish_findings(aborted, _finished_run(errored=())) == []


def test_under_recompute_no_request_errs() -> None:
    s = _failing_scenario(LoadFailurePolicy.RECOMPUTE)
    assert finish_findings(s, _finished_run(errored=())) == []
    (wrong,) = finish_findings(s, _finished_run(errored=((1, 3),)))
    assert wrong.request == 1
    assert "'recompute' owes its failed load a recompute" in wrong.detail


def test_the_finish_rule_needs_what_the_run_recorded() -> None:
    s = _failing_scenario(LoadFailurePolicy.FAIL)
    unrecorded = dataclasses.replace(_finished_run(errored=()), errored=None)
    assert finish_findings(s, unrecorded) == []
    crashed = dataclasses.replace(_finished_run(errored=()), error="step 3: RuntimeError: x")
    assert finish_findings(s, crashed) == []
    data = _finished_run(errored=((1, 3),)).to_dict()
    assert data["errored"] == [[1, 3]] and data["failed_load_requests"] == [1]
    assert RunObservation.from_dict(data) == _finished_run(errored=((1, 3),))


def test_the_shrinker_tries_recomputing_failed_loads() -> None:
    failing = _failing_scenario(LoadFailurePolicy.FAIL)
    recomputed = dict(_connector_store(failing))["failed loads recomputed"]
    assert recomputed is not None and recomputed.workload.connector is not None
    assert recomputed.workload.connector.kv_load_failure_policy is LoadFailurePolicy.RECOMPUTE
    assert "failed loads recomputed" not in dict(
        _connector_store(_failing_scenario(LoadFailurePolicy.RECOMPUTE))
    )

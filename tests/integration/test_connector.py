"""A KV connector with a remote store through vLLM's real Scheduler: what the
store held and what vLLM adopted, exactly, on every ``connector-`` corpus case."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.driver.scheduler_mode import run_scheduler_scenario
from differential.findings import FindingKind
from differential.oracle.connector import finish_findings
from differential.scenario import LoadFailurePolicy
from differential.variants import parse_variants
from tests.factories import ROOT

pytestmark = pytest.mark.vllm

CASES = ROOT / "corpora" / "cases"

# Per request: (local hit, store held, answered, adopted local, adopted
# external, async, divergent, a load failed), in tokens.
ADOPTED = {
    "connector-fail-policy-errors-only-the-failed-load--scheduler": [
        (0, 0, 0, 0, 0, False, False, False),
        (0, 0, 0, 0, 0, False, False, False),
    ],
    "connector-fail-policy-errors-a-lost-hybrid-load--scheduler": [
        (0, 0, 0, 0, 0, False, False, False),
        (0, 0, 0, 0, 0, False, False, False),
        (0, 128, 128, 0, 128, True, False, False),
    ],
    "connector-async-load-reservation-counts-lookahead-slots-pool20--scheduler": [
        (0, 0, 0, 0, 0, False, False, False),
        (0, 0, 0, 0, 0, False, False, False),
        (0, 8, 8, 0, 8, True, False, False),
        (0, 32, 32, 0, 32, True, False, False),
        (0, 16, 16, 0, 16, True, False, False),
        (0, 40, 40, 0, 40, True, False, False),
        (0, 32, 32, 0, 32, True, False, False),
        (0, 24, 24, 0, 24, True, False, False),
        (0, 48, 48, 0, 48, True, False, False),
    ],
    "connector-without-hybrid-allocator-saves-by-the-legacy-finish": [
        (0, 0, 0, 0, 0, False, False, False),
        (0, 96, 96, 0, 96, False, False, False),
    ],
    "connector-async-load-reservation-counts-draft-slots--scheduler": [
        (0, 0, 0, 0, 0, False, False, False),
        (0, 0, 0, 0, 0, False, False, False),
        (0, 8, 8, 0, 8, True, False, False),
        (0, 40, 40, 0, 40, True, False, False),
        (8, 16, 8, 8, 8, True, False, False),
        (32, 40, 8, 32, 8, True, False, False),
        (0, 40, 40, 0, 40, True, False, False),
        (16, 24, 8, 16, 8, True, False, False),
        (40, 48, 8, 40, 8, True, False, False),
    ],
    "connector-prefix-caching-off": [
        (0, 0, 0, 0, 0, False, False, False),
        (0, 96, 96, 0, 96, False, False, False),
    ],
    "connector-async-load-fails-last-block": [
        (0, 0, 0, 0, 0, False, False, False),
        (0, 96, 96, 0, 96, True, False, True),
        (0, 128, 128, 0, 128, True, False, False),
    ],
    "connector-async-load-fails-hybrid": [
        (0, 0, 0, 0, 0, False, False, False),
        (0, 128, 128, 0, 128, True, False, True),
    ],
    "connector-divergent-hybrid-hit-truncated": [
        (0, 0, 0, 0, 0, False, False, False),
        (288, 288, 32, 288, 0, False, False, False),
        (0, 0, 0, 0, 0, False, False, False),
        (368, 384, 64, 320, 64, False, True, False),
    ],
    "connector-divergent-hybrid-hit-reconciled": [
        (0, 0, 0, 0, 0, False, False, False),
        (288, 288, 32, 288, 0, False, False, False),
        (0, 0, 0, 0, 0, False, False, False),
        (384, 384, 0, 0, 0, False, True, False),
    ],
    "connector-divergent-hybrid-hit-reconciled--plain-connector": [
        (0, 0, 0, 0, 0, False, False, False),
        (288, 288, 32, 288, 0, False, False, False),
        (0, 0, 0, 0, 0, False, False, False),
        (0, 384, 384, 0, 384, False, False, False),
    ],
    "connector-divergent-resend": [
        (0, 0, 0, 0, 0, False, False, False),
        (112, 112, 48, 112, 0, False, False, False),
    ],
    "connector-sliding-window-store": [
        (0, 0, 0, 0, 0, False, False, False),
        (0, 192, 192, 0, 192, False, False, False),
    ],
    "connector-mamba-only-async-load-fails-last-block": [
        (0, 0, 0, 0, 0, False, False, False),
        (0, 0, 0, 0, 0, False, False, False),
        (0, 256, 256, 0, 256, True, False, True),
    ],
    "connector-bounded-lru-evicts-writer-tail": [
        (0, 0, 0, 0, 0, False, False, False),
        (0, 0, 0, 0, 0, False, False, False),
        (0, 32, 32, 0, 32, False, False, False),
    ],
    "connector-aborted-producer-partial-tail": [
        (0, 0, 0, 0, 0, False, False, False),
        (80, 80, 16, 80, 0, False, False, False),
    ],
    # Request 1, aborted before its admission was recorded, has no row; the
    # late turn (request 3) hits 4 of the blocks its load cached.
    "connector-aborted-load-serves-a-later-turn--scheduler": [
        (0, 0, 0, 0, 0, False, False, False),
        (0, 8, 8, 0, 8, True, False, False),
        (4, 8, 4, 4, 4, True, False, True),
        (12, 12, 0, 12, 0, False, False, False),
    ],
}


def test_every_connector_case_is_pinned_here() -> None:
    assert sorted(p.stem for p in CASES.glob("connector-*.json")) == sorted(ADOPTED)


@pytest.mark.parametrize("name", sorted(ADOPTED))
def test_what_the_store_held_and_vllm_adopted(name: str) -> None:
    entry = load_entry(CASES / f"{name}.json")
    run = run_scheduler_scenario(entry.scenario, "unfixed")
    assert run.error is None
    got = []
    for r in run.requests:
        c = r.connector
        assert c is not None
        got.append(
            (
                c.local_hit_tokens,
                c.store_tokens,
                c.matched_tokens,
                c.local_tokens,
                c.external_tokens,
                c.load_async,
                c.diverged,
                c.load_failed,
            )
        )
    assert got == ADOPTED[name]


def test_a_failed_last_block_is_recomputed_from_the_valid_prefix() -> None:
    # The reader's 96 loaded tokens lose their last 16-token block: vLLM
    # keeps 80 and computes the 50 after them (130 - 80) in the next step.
    entry = load_entry(CASES / "connector-async-load-fails-last-block.json")
    run = run_scheduler_scenario(entry.scenario, "unfixed", record_cache_map=True)
    assert run.timeline[1:3] == (
        "step 1: arrive req-1; req-1 loads [0, 96) async; req-1's load of [80, 96) fails; "
        "run nothing",
        "step 2: admit req-1 (hit 0); run req-1 +50; finish req-1",
    )


@pytest.mark.parametrize(
    ("name", "lost"),
    [
        ("connector-fail-policy-errors-only-the-failed-load--scheduler", "[80, 96)"),
        ("connector-fail-policy-errors-a-lost-hybrid-load--scheduler", "[0, 128)"),
    ],
)
def test_the_fail_policy_errs_the_failed_load_alone(name: str, lost: str) -> None:
    # kv_load_failure_policy 'fail': the reader's load fails at step 3 (its
    # last block, invalid_block_ids; or, on two groups, the whole load,
    # failed_recving) and vLLM finishes the reader with an error there,
    # while the writer and the bystander run to their end (steps 6 and 9).
    entry = load_entry(CASES / f"{name}.json")
    run = run_scheduler_scenario(entry.scenario, "unfixed", record_cache_map=True)
    assert run.error is None
    assert run.failed_load_requests == (2,)
    assert run.errored == ((2, 3),)
    assert [(r.index, r.finished_step) for r in run.requests[:2]] == [(0, 6), (1, 9)]
    assert run.timeline[3].endswith(
        f"req-2's load of {lost} fails; run req-0 +1, req-1 +60; finish req-2 (error)"
    )
    assert finish_findings(entry.scenario, run) == []
    # The same run, had vLLM failed every request the step scanned, is judged:
    everyone = dataclasses.replace(run, errored=((0, 3), (1, 3), (2, 3)))
    assert [(f.kind, f.request) for f in finish_findings(entry.scenario, everyone)] == [
        (FindingKind.WRONG_FINISH, 0),
        (FindingKind.WRONG_FINISH, 1),
    ]


def test_the_recompute_policy_errs_no_request() -> None:
    # The same workload recomputing its failed load: nothing errs, and the
    # reader is admitted after its failed load, computing from the valid 80.
    entry = load_entry(CASES / "connector-fail-policy-errors-only-the-failed-load--scheduler.json")
    store = entry.scenario.workload.connector
    assert store is not None
    recompute = dataclasses.replace(
        entry.scenario,
        workload=dataclasses.replace(
            entry.scenario.workload,
            connector=dataclasses.replace(
                store, kv_load_failure_policy=LoadFailurePolicy.RECOMPUTE
            ),
        ),
    )
    run = run_scheduler_scenario(recompute, "unfixed")
    assert run.error is None and run.errored == () and run.failed_load_requests == (2,)
    reader = run.requests[2].connector
    assert reader is not None and reader.load_failed


def test_a_synchronous_load_is_flagged_to_the_worker() -> None:
    # req-3 adopts the store's [320, 384) synchronously at step 14: the step's
    # SchedulerOutput tells the worker to load before the forward (vLLM PR
    # #53333); asynchronous loads, as in the failed-load case, flag nothing.
    entry = load_entry(CASES / "connector-divergent-hybrid-hit-truncated.json")
    run = run_scheduler_scenario(entry.scenario, "unfixed", record_cache_map=True)
    assert run.sync_kv_load_steps == ((14, True, (3,)),)
    assert "req-3 loads [320, 384) sync" in run.timeline[14]
    failing = load_entry(CASES / "connector-async-load-fails-last-block.json")
    assert run_scheduler_scenario(failing.scenario, "unfixed").sync_kv_load_steps == ()


def test_a_whole_failed_load_is_looked_up_again() -> None:
    # Several KV cache groups: the load fails as a whole (failed_recving),
    # vLLM frees the reader's blocks and its second lookup loads 128 again.
    entry = load_entry(CASES / "connector-async-load-fails-hybrid.json")
    run = run_scheduler_scenario(entry.scenario, "unfixed", record_cache_map=True)
    assert run.timeline[1:4] == (
        "step 1: arrive req-1; req-1 loads [0, 128) async; req-1's load of [0, 128) fails; "
        "run nothing",
        "step 2: req-1 loads [0, 128) async; run nothing",
        "step 3: admit req-1 (hit 0); run req-1 +40; finish req-1",
    )


def test_an_aborted_producer_hands_off_its_partial_tail() -> None:
    entry = load_entry(CASES / "connector-aborted-producer-partial-tail.json")
    run = run_scheduler_scenario(entry.scenario, "unfixed", record_cache_map=True)
    assert run.timeline[:3] == (
        "step 0: arrive req-0; admit req-0 (hit 0); run req-0 +64 (prefill)",
        "step 1: run req-0 +16 (prefill)",
        "step 2: abort req-0; run nothing",
    )
    assert run.requests[0].finished_step is None  # aborted, never finished


def test_the_plain_connector_gets_what_the_divergent_one_reconciles_away() -> None:
    # Same workload and pool: a connector declaring divergent hybrid hits is
    # shown the full-attention 384, the store holds nothing past it, and the
    # scheduler reconciles to 0; a plain connector is shown 0 and loads 384.
    hits = {}
    for name in (
        "connector-divergent-hybrid-hit-reconciled",
        "connector-divergent-hybrid-hit-reconciled--plain-connector",
    ):
        result = compare_variants(
            load_entry(CASES / f"{name}.json").scenario, parse_variants("unfixed")
        )
        (vr,) = result.results
        c = vr.run.requests[3].connector
        assert c is not None
        hits[name] = c.computed_tokens
        assert vr.findings == ()
    assert list(hits.values()) == [0, 384]


def test_a_mamba_load_failing_at_its_last_block_is_zeroed_and_recomputed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One Mamba group (64-token blocks): the reader's async load of 256 tokens
    # loses [192, 256); vLLM keeps 192, re-records the blocks after it for
    # zeroing (Mamba states are read before they are fully written) and
    # computes the 114 after 192 (306 - 192) in two steps.
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    zeroed: list[tuple[str, int]] = []
    real = KVCacheManager.record_blocks_for_zeroing

    def record(self: KVCacheManager, request_id: str, start_token: int) -> None:
        zeroed.append((request_id, start_token))
        real(self, request_id, start_token)

    monkeypatch.setattr(KVCacheManager, "record_blocks_for_zeroing", record)
    entry = load_entry(CASES / "connector-mamba-only-async-load-fails-last-block.json")
    run = run_scheduler_scenario(entry.scenario, "unfixed", record_cache_map=True)
    assert zeroed == [("req-2", 192)]
    assert run.timeline[16:19] == (
        "step 16: arrive req-2; req-2 loads [0, 256) async; req-2's load of [192, 256) fails; "
        "run nothing; 1 cached blocks evicted",
        "step 17: admit req-2 (hit 0); run req-2 +64 (prefill)",
        "step 18: run req-2 +50; finish req-2; 1 cached blocks evicted",
    )


def test_a_load_is_planned_into_the_requests_own_uncached_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """connector-bounded-lru-evicts-writer-tail: request 2 loads 128 store
    tokens into its 8 fresh blocks, none null or cached; a
    get_unhashed_block_ids_all_groups that keeps hashed blocks (``or`` for
    ``and``) names request 3's local hit blocks of
    connector-divergent-hybrid-hit-truncated as load targets: a wrong-kv."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import trim_null_head

    from differential.findings import FindingKind

    scenario = load_entry(CASES / "connector-bounded-lru-evicts-writer-tail.json").scenario
    run = run_scheduler_scenario(scenario, "unfixed")
    targets = run.requests[2].connector.load_targets
    assert targets == (tuple((i, False, False) for i in range(1, 9)),)

    def keeps_hashed(self: KVCacheBlocks) -> list[list[int]]:
        return [
            [b.block_id for b in trim_null_head(g) if b.block_hash is None or not b.is_null]
            for g in self.blocks
        ]

    truncated = load_entry(CASES / "connector-divergent-hybrid-hit-truncated.json").scenario
    (stock,) = compare_variants(truncated, parse_variants("unfixed")).results
    assert not [f for f in stock.findings if f.kind is FindingKind.WRONG_KV]
    monkeypatch.setattr(KVCacheBlocks, "get_unhashed_block_ids_all_groups", keeps_hashed)
    (broken,) = compare_variants(truncated, parse_variants("unfixed")).results
    wrong = [f.detail for f in broken.findings if f.kind is FindingKind.WRONG_KV]
    assert wrong[0].startswith(
        "connector: group 0: the store's 64 tokens are loaded into block 1 (a cached "
        "block), block 2 (a cached block), block 3 (a cached block) and "
    )
    assert {f.request for f in broken.findings if f.kind is FindingKind.WRONG_KV} == {3}


def test_a_connector_without_the_hybrid_allocator_finishes_by_the_legacy_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from differential.driver.connector import SingleGroupStoreConnector

    finished: list[tuple[str, int]] = []
    legacy = SingleGroupStoreConnector.request_finished

    def spy(self: Any, request: Any, block_ids: list[int]) -> Any:
        finished.append((request.request_id, len(block_ids)))
        return legacy(self, request, block_ids)

    monkeypatch.setattr(SingleGroupStoreConnector, "request_finished", spy)
    legacy_case = load_entry(
        CASES / "connector-without-hybrid-allocator-saves-by-the-legacy-finish.json"
    )
    run = run_scheduler_scenario(legacy_case.scenario, "unfixed")
    # Scheduler._connector_finished hands group 0's blocks: the writer's 100
    # tokens in 7 blocks, the reader's 130 in 9.
    assert [(rid[-1], n) for rid, n in finished] == [("0", 7), ("1", 9)]
    # The same store as with the hybrid allocator's finish: what the reader
    # was offered and adopted is identical.
    hma = run_scheduler_scenario(
        load_entry(CASES / "connector-prefix-caching-off.json").scenario, "unfixed"
    )
    assert [r.connector for r in hma.requests] == [r.connector for r in run.requests]


def test_the_injected_failure_log_line_is_dropped_and_no_other() -> None:
    import logging

    from differential.driver.scheduler_mode import _INJECTED_LOAD_FAILURE

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord(
            "vllm.v1.core.sched.scheduler", logging.ERROR, "", 0, msg, (), None
        )

    assert not _INJECTED_LOAD_FAILURE.filter(
        record(
            "Failing %d request(s) due to KV load failure "
            "(failure_policy=fail, %d tokens affected). Request IDs: %s"
        )
    )
    assert _INJECTED_LOAD_FAILURE.filter(record("Recovered from KV load failure: %d request(s)"))

"""The public Mamba-hybrid cases replay on vLLM's real MambaManager with exact hits."""

from __future__ import annotations

from typing import Any

import pytest

from differential.compare import compare_variants
from differential.corpus import finding_tag, load_entry
from differential.findings import Policy
from differential.variants import parse_variants
from tests.factories import CORPORA, ROOT, stock_result

pytestmark = pytest.mark.vllm


def _replay(rel: str, policy: Policy = Policy.VLLM):
    entry = load_entry(ROOT / rel)
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed"), policy=policy)
    hits = {vr.variant.name: list(vr.run.hits) for vr in result.results}
    return hits, result.findings


@pytest.mark.parametrize("length", [100, 112, 120, 127])
def test_pr57444_resend_and_extension_fall_back_to_zero(length: int) -> None:
    # Writer, identical resend, a second writer, its 60-token extension.
    hits, findings = _replay(f"known-issues/fine-grained-replay-state-discarded-L{length}.json")
    assert hits == {"unfixed": [0, 0, 0, 0], "fixed": [0, 0, 0, 0]}
    assert sorted((f.owner, f.kind.value, f.request, f.expected_tokens) for f in findings) == [
        (v, "fallback", r, 64) for v in ("fixed", "unfixed") for r in (1, 3)
    ]
    assert {f.known_issue for f in findings} == {"fine-grained-replay-state-discarded"}


@pytest.mark.parametrize(
    "rel",
    [
        "mamba-fine-grained-replay-L95",
        "mamba-fine-grained-replay-L128",
        "mamba-fine-grained-replay-L100--no-drafter",
        "mamba-fine-grained-replay-L100--dense-retention",
        "mamba-fine-grained-replay-L100--lookahead-hashes",
    ],
)
def test_pr57444_controls_hit_64(rel: str) -> None:
    hits, findings = _replay(f"corpora/cases/{rel}.json")
    assert hits == {"unfixed": [0, 64, 0, 64], "fixed": [0, 64, 0, 64]}
    assert findings == ()


def test_pr57444_geometry_under_vllm_scheduler_chunking() -> None:
    # Scheduler._mamba_block_aligned_split stops at the fine-grained checkpoint 80.
    hits, findings = _replay("corpora/cases/mamba-fine-grained-replay-L100--scheduler-prefill.json")
    assert hits == {"unfixed": [0, 80, 0, 80], "fixed": [0, 80, 0, 80]}
    assert findings == ()


def test_pr54713_resend_of_aligned_prompt() -> None:
    hits, findings = _replay("corpora/cases/mamba-eagle-resend-aligned-prompt.json")
    assert hits == {"unfixed": [0, 112], "fixed": [0, 112]}
    assert findings == ()


def test_issue45238_junction_state() -> None:
    hits, findings = _replay("corpora/cases/mamba-shared-prefix-junction.json")
    assert hits == {"unfixed": [0, 0, 32], "fixed": [0, 0, 32]}
    assert findings == ()
    _, ideal = _replay("corpora/cases/mamba-shared-prefix-junction.json", Policy.IDEAL)
    assert sorted((f.owner, f.kind.value, f.request) for f in ideal) == [
        ("fixed", "design-gap", 1),
        ("unfixed", "design-gap", 1),
    ]


def test_mamba_eagle_margin_mutant_is_caught() -> None:
    # The EAGLE margin given back to the Mamba group hits the writer's state
    # at 128, past the 112 full attention proves: over-hit.
    entry = load_entry(ROOT / "corpora/cases/mamba-state-above-attention-proof.json")
    result = compare_variants(entry.scenario, parse_variants("fixed,mutant-mamba-eagle-margin"))
    hits = {vr.variant.name: list(vr.run.hits) for vr in result.results}
    assert hits == {"fixed": [0, 112], "mutant-mamba-eagle-margin": [0, 128]}
    mine = [(f.owner, f.kind.value, f.request, f.expected_tokens) for f in result.findings]
    assert ("mutant-mamba-eagle-margin", "over-hit", 1, 112) in mine
    assert not [f for f in result.findings if f.owner == "fixed"]


@pytest.mark.parametrize("mode", ["manager", "scheduler"])
def test_state_blocks_hold_the_writers_state_at_the_hit(mode: str) -> None:
    # Request 2 hits 32 tokens of request 1's prompt; the one state block the
    # Mamba group hands it holds request 1's state after exactly 32 tokens
    # (the runner's running-state block of the prefill chunk ending at 32).
    from differential.compare import in_mode
    from differential.driver import run_variant
    from differential.scenario import DriveMode

    entry = load_entry(ROOT / "corpora/cases/mamba-shared-prefix-junction.json")
    run = run_variant(in_mode(entry.scenario, DriveMode(mode)), parse_variants("fixed")[0])
    assert run.hits == (0, 0, 32)
    mamba = run.requests[2].lookup_blocks[1]
    assert [(b.writer, b.state_tokens) for b in mamba if b is not None] == [(1, 32)]
    assert [b for b in mamba if b is None] == [None]


def test_a_state_copied_on_a_boundary_after_drafts_is_followed() -> None:
    # Turn 1 decodes with drafts; the state at 48 reaches its block by
    # vLLM's postprocess copy once the drafts are judged (BlockLedger.after_drafts).
    from differential.driver import run_variant

    entry = load_entry(ROOT / "corpora/cases/mamba-drafts-decoded-state.json")
    run = run_variant(entry.scenario, parse_variants("fixed")[0])
    assert run.hits == (0, 48)
    mamba = [b for b in run.requests[1].lookup_blocks[1] if b is not None]
    assert [(b.writer, b.writer_block_index, b.state_tokens) for b in mamba] == [(0, 2, 48)]


@pytest.mark.parametrize("mode", ["manager", "scheduler"])
def test_a_cached_state_changed_after_caching_is_wrong_kv(mode: str) -> None:
    # 100-token writers cache a fine-grained partial tail at 80 (hash block
    # 16, Mamba block 64); the mutant keeps them writing their running state
    # into that cached block instead of moving its cache entry to a
    # copy-on-write block. The hits are unchanged (80); only the content
    # check sees the write (requests 0 and 2) and the state after 100 tokens
    # handed to a sibling that needs the state after 80 (requests 1 and 3).
    from differential.compare import in_mode
    from differential.findings import FindingKind
    from differential.scenario import DriveMode

    entry = load_entry(
        ROOT / "corpora/cases/mamba-fine-grained-replay-L100--scheduler-prefill.json"
    )
    scenario = in_mode(entry.scenario, DriveMode(mode))
    result = compare_variants(scenario, parse_variants("fixed,mutant-mamba-state-no-cow"))
    assert [list(vr.run.hits) for vr in result.results] == [[0, 80, 0, 80]] * 2
    assert not [f for f in result.findings if f.owner == "fixed"]
    write = (
        "whose prefix-cache entry is the state after 80 tokens: "
        "a cached state changed after it was cached"
    )
    # Both modes hand the second writer block 7: manager mode frees the
    # blocks copy-on-write copies retain, as the Scheduler does.
    b = 7
    wrong = [
        (f.request, f.detail)
        for f in result.findings
        if f.kind is FindingKind.WRONG_KV and not f.detail.startswith("dense")
    ]
    assert wrong == [
        (0, f"the step at 80 tokens writes group 1 block index 1 (block 3), {write}"),
        (
            1,
            "group 1 block index 1 is block 3: request 0's group-1 state after 100 tokens, "
            "not the state after request 1's tokens 0..80",
        ),
        (2, f"the step at 80 tokens writes group 1 block index 1 (block {b}), {write}"),
        (
            3,
            f"group 1 block index 1 is block {b}: request 2's group-1 state after 100 tokens, "
            "not the state after request 3's tokens 0..80 (+1 more)",
        ),
    ]


def test_exported_mamba_test_drives_the_state_group(tmp_path) -> None:
    import subprocess

    from tests.factories import python_module

    def run(flag: str, module: str, *args: str, cwd) -> subprocess.CompletedProcess[str]:
        assert flag == "-m"
        return python_module(module, *args, cwd=cwd)

    rel = "known-issues/fine-grained-replay-state-discarded-L100.json"
    export = run("-m", "differential.cli", "export-test", str(ROOT / rel), cwd=ROOT)
    assert export.returncode == 0, export.stderr
    source = export.stdout
    assert 'mamba_cache_mode="align"' in source and "manager.new_step_starts()" in source
    assert "assert hits[1] >= 64, (" in source
    test_file = tmp_path / "test_exported_mamba.py"
    test_file.write_text(source)
    stock = run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file), cwd=tmp_path)
    assert stock.returncode == 1, stock.stdout[-1500:]
    assert "assert 0 >= 64" in stock.stdout


REGRESSIONS = ROOT / "corpora" / "regressions"


@pytest.mark.parametrize(
    ("name", "writer_steps"),
    [
        # Budget 8 (prefill_chunk_tokens 4): the 6-token writer's steps start
        # at 0 and at the block grid's resume position 5.
        ("mamba-scheduler-chunks-of-the-step-budget--periodic", [0, 5]),
        # Budget 2 (prefill_chunk_tokens 1): the 3-token writer's at 0 and 2.
        ("mamba-scheduler-chunks-of-the-step-budget--dense", [0, 2]),
    ],
)
def test_scheduler_chunks_mamba_prefill_by_the_step_budget(
    name: str, writer_steps: list[int]
) -> None:
    from differential.oracle import drafter_model, state_positions

    entry = load_entry(REGRESSIONS / f"{name}.json")
    s = entry.scenario
    result = compare_variants(s, parse_variants("unfixed,fixed"))
    assert result.findings == ()
    for vr in result.results:
        assert list(vr.run.hits) == [0, 0]
        assert vr.dense_run is None or list(vr.dense_run.hits) == [0, 0]
        assert [r.dense_tokens for r in vr.references] == [0, 0]
        # vLLM's Scheduler started the writer's steps where the oracle ends them.
        starts = sorted({t.start_tokens for t in vr.run.requests[0].step_tables})
        assert starts == writer_steps
    model = drafter_model(s)
    ends = state_positions(s, 0, 0, 0, model.drop, model.hash_lookahead_tokens, 0)
    assert [0, *ends[:-1]] == writer_steps


def test_a_one_token_window_beside_mamba_groups_hits_nothing() -> None:
    # The layout a 1-token hash block gives a Mamba hybrid's sliding window:
    # with window 2 (what the generator draws) vLLM's dense run hits the 8 the
    # oracle owes; with window 1 it keeps no sliding-window block and hits 0.
    import dataclasses

    entry = load_entry(REGRESSIONS / "mamba-hash-block-1-swa-block-1-window-2.json")
    s = entry.scenario
    result = compare_variants(s, parse_variants("unfixed"))
    assert result.findings == ()
    vr = result.results[0]
    assert vr.dense_run is not None and list(vr.dense_run.hits) == [0, 8]
    groups = list(s.kv_cache_groups)
    groups[1] = dataclasses.replace(groups[1], sliding_window_tokens=1)
    one = dataclasses.replace(s, kv_cache_groups=tuple(groups))
    result = compare_variants(one, parse_variants("unfixed"))
    vr = result.results[0]
    assert vr.dense_run is not None and list(vr.dense_run.hits) == [0, 0]
    assert [f.kind.value for f in result.findings] == ["dense-mismatch"]


@pytest.mark.parametrize(
    ("name", "dense_hits"),
    [
        # Full attention looks up at 63: one whole 32-token block, no partial key.
        ("dcp4-mamba-lookup-length-cuts-an-attention-block", [0, 32]),
        # Up to 8 under the drop, then the state at 4 trims the block to 4.
        ("dcp2-mamba-chat-hit-trimmed-inside-an-attention-block", [0, 4]),
    ],
)
def test_dcp_mamba_hybrid_full_attention_looks_up_once(name: str, dense_hits: list[int]) -> None:
    entry = load_entry(REGRESSIONS / f"{name}.json")
    result = compare_variants(entry.scenario, parse_variants("unfixed,fixed"))
    assert result.findings == ()
    for vr in result.results:
        assert vr.dense_run is not None and list(vr.dense_run.hits) == dense_hits
        assert [r.dense_tokens for r in vr.references] == dense_hits


def test_a_checkpoint_step_leaves_the_junction_state_unkeyed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """checkpoint-step-skips-junction-state on vLLM 0.33.0's real managers:
    request 1 pins its junction at 60 and its first prefill step ends there,
    but the state is never keyed, so request 2 (92 tokens shared with it)
    hits 0. The split prefill and retention 0 key it (60), and so does a
    ``MambaManager._cache_partial_tail_block`` that goes on to the junction
    after discarding the step's checkpoint: the cause is that early return."""
    import dataclasses

    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    from differential.scenario import MambaPrefill

    scenario = load_entry(ROOT / "known-issues/mamba-checkpoint-step-skips-junction-state.json")
    s = scenario.scenario
    result = compare_variants(s, parse_variants("unfixed"))
    assert result.results[0].run.hits == (0, 0, 0)
    assert {(f.kind.value, f.request, f.known_issue) for f in result.findings} == {
        ("fallback", 2, "checkpoint-step-skips-junction-state"),
        ("dense-mismatch", 2, "checkpoint-step-skips-junction-state"),
    }
    split = compare_variants(
        dataclasses.replace(s, mamba_prefill=MambaPrefill.SCHEDULER), parse_variants("unfixed")
    )
    assert split.results[0].run.hits == (0, 0, 60)
    assert split.findings == ()
    # Retention 0: only the final step publishes a checkpoint, so the
    # junction's state is keyed (60); the dense cross-check run still loses it.
    zero = compare_variants(
        dataclasses.replace(s, retention_interval_tokens=0), parse_variants("unfixed")
    )
    assert zero.results[0].run.hits == (0, 0, 60)
    assert [(f.kind.value, f.known_issue) for f in zero.findings] == [
        ("dense-mismatch", "checkpoint-step-skips-junction-state")
    ]
    real = MambaManager._cache_partial_tail_block

    def on_to_the_junction(self: MambaManager, request, num_tokens, retention_interval):  # type: ignore[no-untyped-def]
        keyed = real(self, request, num_tokens, retention_interval)
        checkpoint = self._checkpoints.get(request.request_id)
        if (
            keyed is None
            and checkpoint is not None
            and num_tokens == request.shared_prefix_boundary
        ):
            del self._checkpoints[request.request_id]
            try:
                keyed = real(self, request, num_tokens, retention_interval)
            finally:
                self._checkpoints[request.request_id] = checkpoint
        return keyed

    monkeypatch.setattr(MambaManager, "_cache_partial_tail_block", on_to_the_junction)
    mended = compare_variants(s, parse_variants("unfixed"))
    assert mended.results[0].run.hits == (0, 0, 60)


def test_a_checkpoint_at_a_replay_boundary_is_discarded_under_periodic_retention() -> None:
    """checkpoint-retention-ignores-replay-boundaries on vLLM 0.33.0's real
    managers: the writer's step 16..24 exports the state at 20 (its replay
    boundary below 24); under retention 8 it is discarded and the sibling
    hits 16, under dense retention it is kept (20), and the scheduler's split
    prefill makes no state at 20 (16, owed 16)."""
    import dataclasses

    from differential.scenario import MambaPrefill

    path = ROOT / "known-issues/mamba-checkpoint-retention-ignores-replay-boundaries.json"
    s = load_entry(path).scenario
    result = compare_variants(s, parse_variants("unfixed"))
    assert result.results[0].run.hits == (0, 16)
    assert [(f.kind.value, f.expected_tokens, f.known_issue) for f in result.findings] == [
        ("fallback", 20, "checkpoint-retention-ignores-replay-boundaries")
    ]
    dense = compare_variants(
        dataclasses.replace(s, retention_interval_tokens=None), parse_variants("unfixed")
    )
    assert dense.results[0].run.hits == (0, 20) and dense.findings == ()
    split = compare_variants(
        dataclasses.replace(s, mamba_prefill=MambaPrefill.SCHEDULER), parse_variants("unfixed")
    )
    assert split.results[0].run.hits == (0, 16) and split.findings == ()


def test_a_checkpoint_step_keys_the_block_it_started_in() -> None:
    """checkpoint-step-keys-start-state on vLLM 0.33.0's real managers:
    request 1 stops at its junction 11, then runs 11..17 in one
    checkpoint-exporting step; request 2's hit of 12 adopts, in both Mamba
    groups, request 1's block index 2 (tokens 8..12), which only the step
    ending at 11 wrote. With the scheduler's split prefill the step stops at
    12 first, and request 2 hits 28 (request 0's state), no finding."""
    import dataclasses

    from differential.scenario import MambaPrefill

    s = load_entry(ROOT / "known-issues/mamba-checkpoint-step-keys-start-state.json").scenario
    result = compare_variants(s, parse_variants("unfixed"))
    run = result.results[0].run
    assert run.hits == (0, 0, 12)
    assert {(f.kind.value, f.known_issue) for f in result.findings} == {
        ("over-hit", "checkpoint-step-keys-start-state"),
        ("dense-mismatch", "checkpoint-step-keys-start-state"),
    }
    mamba = [g for g, group in enumerate(s.kv_cache_groups) if group.kind.value == "mamba"]
    adopted = [run.requests[2].lookup_blocks[g][-1] for g in mamba]
    assert [(b.writer, b.writer_block_index) for b in adopted] == [(1, 2), (1, 2)]
    # Request 1's steps: to its junction 11, then 11..17 in one.
    starts = sorted({t.start_tokens for t in run.requests[1].step_tables})
    assert starts == [0, 11]
    split = compare_variants(
        dataclasses.replace(s, mamba_prefill=MambaPrefill.SCHEDULER), parse_variants("unfixed")
    )
    assert split.results[0].run.hits == (0, 0, 28) and split.findings == ()


SAME_STEP = CORPORA / "cases" / "mamba-same-step-state-deferred--scheduler.json"


def test_a_state_cached_in_the_current_step_defers_the_hit() -> None:
    # FA 16 + Mamba 16, both requests at step 0: request 0 caches its states
    # at 48 (step 0) and 64 (step 1); request 1 waits for a step after each.
    result = stock_result(SAME_STEP)
    assert list(result.run.hits) == [0, 64]
    assert [r.scheduled_step for r in result.run.requests] == [0, 2]
    assert result.findings == ()


def test_a_hit_on_a_state_the_same_step_writes_is_wrong_kv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM without its deferral: the hit's last Mamba block, cached this step,
    # is no longer found in cached_blocks_this_step.
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    real = MambaManager.get_num_blocks_to_allocate

    def undeferred(self: Any, *args: Any, **kwargs: Any) -> int:
        cached, self.cached_blocks_this_step = self.cached_blocks_this_step, set()
        try:
            return real(self, *args, **kwargs)
        finally:
            self.cached_blocks_this_step = cached

    monkeypatch.setattr(MambaManager, "get_num_blocks_to_allocate", undeferred)
    result = stock_result(SAME_STEP)
    assert list(result.run.hits) == [0, 48]
    assert [r.scheduled_step for r in result.run.requests] == [0, 0]
    (state,) = result.run.requests[1].lookup_blocks[1][-1:]
    assert state is not None and state.written_in_step_by == 0 and state.writer is None
    assert [finding_tag(f) for f in result.findings] == ["wrong-kv@1"]
    assert result.findings[0].detail.startswith(
        "group 1 block index 2 is block 4, never written in this run (request 0's step in "
        "the same scheduler step writes its state"
    )


_ASYNC_LOAD = {
    "format": "kvfuzz.scenario",
    "version": 1,
    "name": "same-step-state-read-after-an-async-load",
    "description": "",
    "kv_cache_groups": [
        {"kind": "full_attention", "block_size_tokens": 16, "sliding_window_tokens": None},
        {"kind": "mamba", "block_size_tokens": 16, "sliding_window_tokens": None},
    ],
    "hash_block_size_tokens": 4,
    "hit_alignment_tokens": None,
    "retention_interval_tokens": None,
    "drafter": {"kind": "none", "num_speculative_tokens": 0},
    "kv_connector": True,
    "disable_lookahead_block_hashes": False,
    "disable_eagle_block_drop": False,
    "prefill_chunk_tokens": 32,
    "decode_steps": 3,
    "shared_prefix_tokens": 0,
    "requests": [
        {"name": "s0t1", "shares_with": None, "divergence_tokens": 0, "suffix_tokens": 24},
        {"name": "s0t2", "shares_with": 0, "divergence_tokens": 28, "suffix_tokens": 8},
    ],
    "mamba_prefill": "checkpoint",
    "workload": {
        "mode": "scheduler",
        "pool_blocks": 26,
        "arrival_steps": [0, 0],
        "max_num_seqs": 4,
        "max_num_batched_tokens": None,
        "shares_output": True,
        "accepted_drafts": [],
        "connector": {
            "load": "async",
            "divergent_hybrid_hits": True,
            "chunk_tokens": 16,
            "kv_role": "kv_consumer",
        },
    },
}


def test_a_state_of_the_lookups_step_is_there_for_a_request_that_loads_first() -> None:
    # FA 16 + Mamba 16 (hash block 4, checkpoint-exporting layers) on a
    # decode instance with asynchronous loads. Request 1 looks up at step 0
    # and hits the state at 20 that request 0's step 0 exports, then waits
    # for its load and first runs at step 1, after step 0's forward: vLLM
    # need not defer it, and the block holds the state by then.
    from differential.driver.scheduler_mode import run_scheduler_scenario
    from differential.oracle.engine import judge_observed_run
    from differential.scenario import Scenario

    scenario = Scenario.from_dict(_ASYNC_LOAD)
    run = run_scheduler_scenario(scenario, "unfixed")
    assert list(run.hits) == [0, 20]
    assert run.requests[1].connector is not None and run.requests[1].connector.load_async
    (state,) = run.requests[1].lookup_blocks[1][-1:]
    assert state is not None and state.written_in_step_by is None
    # Request 0's step 0 wrote it (checkpoint-exporting layers: at a
    # position the ledger does not follow).
    assert (state.writer, state.group, state.state_tokens) == (0, 1, None)
    assert judge_observed_run(scenario, run)[1] == ()

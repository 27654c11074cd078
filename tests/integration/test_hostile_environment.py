"""Hostile sizes, corpus files and environments that need real runs.

Each case ends with the documented exit code and one line naming what
happened (the file, the field), never a traceback, and nothing already due
lost: a scenario that cannot run costs that scenario, not the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from differential import forkserver
from tests.factories import (
    CORPORA,
    ROOT,
    alive,
    forkserver_address,
    python_module,
    still_alive,
)

pytestmark = pytest.mark.vllm

TOY = CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json"

_MEMORY_BYTES = 4 << 30  # address space a run may take: a regression fails fast


def _kvfuzz(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return python_module(
        "differential.cli",
        *args,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
        address_space_bytes=_MEMORY_BYTES,
    )


def _toy(tmp: Path, name: str = "toy.json", **changes: object) -> Path:
    data = json.loads(TOY.read_text())
    data.pop("expect")
    data["requests"] = data["requests"][:2]
    data.update(changes)
    path = tmp / name
    path.write_text(json.dumps(data))
    return path


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kvfuzz:")]


def test_an_unused_shared_prefix_of_2_63_tokens_costs_nothing(tmp_path: Path) -> None:
    # 2 requests copy 256 tokens of a 2**63-token prefix: the limits count the
    # 544 tokens run, and only those are built (it used to exhaust memory).
    path = _toy(tmp_path, shared_prefix_tokens=2**63)
    proc = _kvfuzz("replay", str(path), "--variants", "unfixed", "--no-dense-check")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"{path}: 2 requests, 544 tokens, 217 pool blocks" in proc.stderr
    assert "1 scenario(s); findings: 1 fallback" in proc.stdout
    assert _error_lines(proc.stderr) == []


def test_a_pool_too_small_for_one_request_is_named_before_anything_runs(
    tmp_path: Path,
) -> None:
    # Longest prompt 272 tokens: 34 full-attention blocks of 8, one SWA block
    # and the null block.
    (tmp_path / "corpus").mkdir()
    good = _toy(tmp_path / "corpus", "a-good.json")
    bad = _toy(tmp_path / "corpus", "b-bad.json", workload={"pool_blocks": 2})
    message = (
        f"kvfuzz: error: {bad}: workload.pool_blocks = 2 is invalid: allowed null or at "
        "least 36 blocks (the null block, the longest prompt of 272 tokens in each "
        "full-attention group's blocks, one block per other group)"
    )
    assert good.exists()
    for args in (
        ["replay", str(tmp_path / "corpus"), "--junit-xml", str(tmp_path / "j.xml")],
        ["calibrate", str(tmp_path / "corpus")],
        ["diff", "unfixed", "fixed", "--corpus", str(tmp_path / "corpus"), "--seconds", "1"],
    ):
        proc = _kvfuzz(*args)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert _error_lines(proc.stderr) == [message], args
        assert "Traceback" not in proc.stderr


def test_a_pool_that_runs_out_costs_that_scenario_and_the_reports_are_written(
    tmp_path: Path,
) -> None:
    # 36 blocks pass the check but leave no room for the lookahead: the run
    # finds out, names the file, runs the next one and writes the reports.
    (tmp_path / "corpus").mkdir()
    bad = _toy(tmp_path / "corpus", "a-bad.json", workload={"pool_blocks": 36})
    good = _toy(tmp_path / "corpus", "b-good.json")
    junit = tmp_path / "j.xml"
    report = tmp_path / "r.json"
    proc = _kvfuzz(
        "replay",
        str(tmp_path / "corpus"),
        "--variants",
        "unfixed",
        "--no-dense-check",
        "--junit-xml",
        str(junit),
        "--report",
        str(report),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = _error_lines(proc.stderr)
    assert line.startswith(f"kvfuzz: error: {bad}: workload.pool_blocks = 36 is invalid: ")
    assert "ran out at 64 tokens of request 0" in line
    assert str(good) in junit.read_text()
    assert [s["source"] for s in json.loads(report.read_text())["scenarios"]] == [str(good)]
    assert "1 scenario(s); findings: 1 fallback" in proc.stdout


def test_a_model_of_a_billion_layers_is_rejected_before_one_is_built(tmp_path: Path) -> None:
    model = json.loads((ROOT / "models" / "gemma4-mtp.json").read_text())
    model["layers"][0]["count"] = 10**9
    (tmp_path / "big.json").write_text(json.dumps(model))
    scenario = json.loads((ROOT / "models" / "scenarios" / "gemma4-mtp.json").read_text())
    scenario["model"] = "big.json"
    path = tmp_path / "s.json"
    path.write_text(json.dumps(scenario))
    proc = _kvfuzz("replay", str(path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _error_lines(proc.stderr) == [
        f"kvfuzz: error: {tmp_path / 'big.json'}: model.layers[0].count = 1000000000 is invalid: "
        "allowed at most 4096 layers in all (0 before this entry)"
    ]


def test_a_corrupted_example_database_does_not_stop_the_campaign(tmp_path: Path) -> None:
    # Random bytes under a key of no target, and under an unreadable entry
    # name: the replay of earlier failures has nothing to run (it used to end
    # every later campaign with "SkipTest: Hypothesis has been told to run no
    # test cases", exit 3).
    database = tmp_path / "out" / "hypothesis-db"
    (database / "0123456789abcdef").mkdir(parents=True)
    (database / "0123456789abcdef" / "fedcba9876543210").write_bytes(os.urandom(64))
    (database / "fedcba9876543210").write_bytes(os.urandom(64))
    known = tmp_path / "known"
    known.mkdir()
    (known / "toy.json").write_text(TOY.read_text())
    proc = _kvfuzz(
        "fuzz",
        "--out",
        str(tmp_path / "out"),
        "--max-examples",
        "2",
        "--known-corpus",
        str(known),
        "--no-dense-check",
        "--no-shrink",
        "--quiet",
    )
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    assert _error_lines(proc.stderr) == []
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["examples"] == 2 and summary["failed_jobs"] == []


def _workers_of(parent: int) -> set[int]:
    """Tree workers (``python -m differential.driver.worker``) ``parent`` started
    that are alive now, from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z" and b"differential.driver.worker" in argv:
            found.add(int(stat.parent.name))
    return found


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1
    return int(fields[11]) + int(fields[12])  # utime + stime


def _idle_after_importing(pids: set[int]) -> bool:
    """Every process in ``pids`` has spent over a second of CPU (vLLM imported)
    and spends none now (asleep in the hung scenario)."""
    import time

    before = {pid: _cpu_ticks(pid) for pid in pids}
    time.sleep(1.0)
    hz = os.sysconf("SC_CLK_TCK")
    return all(ticks > hz and _cpu_ticks(pid) == ticks for pid, ticks in before.items())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [15, 9], ids=["sigterm", "sigkill"])
def test_a_tree_worker_in_a_hung_scenario_dies_with_its_replay(tmp_path: Path, signum: int) -> None:
    import signal
    import time

    from tests.trees import HANGING_LOOKUP, make_tree

    tree = make_tree(tmp_path / "hang", HANGING_LOOKUP)
    workers: set[int] = set()
    parent = subprocess.Popen(
        [
            *(sys.executable, "-m", "differential.cli", "replay", str(_toy(tmp_path))),
            *("--variants", f"tree:{tree}", "--timeout", "300", "--no-dense-check"),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the signal reaches the parent only, not its group
    )
    try:
        deadline = time.monotonic() + 240
        # Hung: the worker has imported vLLM and sleeps inside the scenario.
        while not ((workers := _workers_of(parent.pid)) and _idle_after_importing(workers)):
            assert parent.poll() is None, parent.communicate()
            assert time.monotonic() < deadline, "the worker never reached the hung scenario"
            time.sleep(0.5)
        os.kill(parent.pid, signum)
        _, stderr = parent.communicate(timeout=30)
        assert not still_alive(workers, 5.0), "a tree worker outlived its replay"
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
            parent.communicate()
    if signum == 15:
        assert parent.returncode == 143
        assert stderr.strip().splitlines()[-1] == "kvfuzz: terminated (SIGTERM)"
    assert not list(tmp_path.glob("kvfuzz-*")), "a temporary folder was left behind"


def test_a_reader_that_leaves_early_is_a_broken_pipe_not_a_crash(tmp_path: Path) -> None:
    # `kvfuzz replay ... | head -1`, with the reader gone before the table.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "differential.cli",
            "replay",
            str(_toy(tmp_path)),
            "--variants",
            "unfixed",
            "--no-dense-check",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    with proc.stderr:
        stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, stderr[-2000:]
    assert _error_lines(stderr) == [
        "kvfuzz: stdout was closed before the output was all written (broken pipe)"
    ]


def test_a_full_disk_loses_one_report_not_the_others_nor_the_table(tmp_path: Path) -> None:
    junit = tmp_path / "j.xml"
    proc = _kvfuzz(
        *("replay", str(_toy(tmp_path)), "--variants", "unfixed", "--no-dense-check"),
        *("--report", "/dev/full", "--junit-xml", str(junit)),
    )
    assert proc.returncode == 3, proc.stderr[-2000:]  # kvfuzz's failure: 2 said nothing ran
    assert _error_lines(proc.stderr) == [
        "kvfuzz: error: not written: --report /dev/full: No space left on device "
        "(everything else was written; free space or choose another path and rerun)"
    ]
    assert "1 scenario(s); findings: 1 fallback" in proc.stdout
    assert "<testsuites" in junit.read_text()


def _kvfuzz_into(stdout: str, *args: str, cwd: Path = ROOT) -> tuple[int, str]:
    """``kvfuzz ARGS > STDOUT``: the exit status and stderr (forked from the
    tests' fork server when it runs, as :func:`python_module` does)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with (
        open(stdout, "w") as out,
        tempfile.TemporaryFile() as err,
        open(os.devnull) as stdin,
    ):
        address = forkserver_address()
        if address is not None:
            env[forkserver.ENV] = address
            child = forkserver.spawn(
                address,
                "differential.cli",
                args,
                cwd=cwd,
                env=env,
                fds=(stdin.fileno(), out.fileno(), err.fileno()),
            )
            code = child.wait(300)
        else:
            code = subprocess.run(
                [sys.executable, "-m", "differential.cli", *args],
                stdin=stdin,
                stdout=out,
                stderr=err,
                cwd=cwd,
                env=env,
                timeout=300,
                check=False,
            ).returncode
        err.seek(0)
        return code, err.read().decode()


FULL_DISK = "No space left on device (the disk is full: free space and rerun)"
REGRESSION = "corpora/regressions/fallback-unfixed-517c289c14.json"


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("replay", REGRESSION, "--variants", "unfixed"), id="replay"),
        pytest.param(("export-test", REGRESSION), id="export-test"),
    ],
)
def test_a_full_disk_behind_stdout_is_an_output_not_written(args: tuple[str, ...]) -> None:
    """``kvfuzz replay > /dev/full``: exit 2 (bad input, nothing ran) with a
    line naming no file; an output not written is kvfuzz's failure."""
    code, stderr = _kvfuzz_into("/dev/full", *args)
    assert code == 3, stderr[-2000:]
    assert _error_lines(stderr) == [f"kvfuzz: error: could not write <stdout>: {FULL_DISK}"]
    assert "Exception ignored" not in stderr


def test_a_full_disk_under_an_svg_or_a_campaign_report_names_the_file(tmp_path: Path) -> None:
    code, stderr = _kvfuzz_into(os.devnull, "explain", REGRESSION, "--svg", "/dev/full")
    assert code == 3, stderr[-2000:]
    assert _error_lines(stderr) == [f"kvfuzz: error: could not write /dev/full: {FULL_DISK}"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").symlink_to("/dev/full")
    proc = _kvfuzz("fuzz", "--variants", "unfixed", "--max-examples", "1", "--out", str(out))
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert _error_lines(proc.stderr) == [
        f"kvfuzz: error: could not write {out / 'report.md'}: {FULL_DISK}"
    ]
    assert (out / "summary.json").is_file()  # written before the report


def test_a_reproducer_over_the_file_size_limit_is_named(tmp_path: Path) -> None:
    """``shrink --out``: the reproducer's write fails (here the file-size
    limit, EFBIG; a full disk, ENOSPC, alike): exit 3 naming it."""
    import resource

    limit = resource.RLIMIT_FSIZE
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "differential.cli", "shrink", REGRESSION),
            *("--out", str(tmp_path), "--seconds", "5"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
        preexec_fn=lambda: resource.setrlimit(limit, (1024, 1024)),
        timeout=300,
        check=False,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert _error_lines(proc.stderr) == [
        f"kvfuzz: error: could not write {tmp_path / 'fallback-unfixed-517c289c14.json'}: "
        "File too large (the file is over the file-size limit (ulimit -f): raise it and rerun)"
    ]


def test_a_megabyte_name_is_shown_cut_short(tmp_path: Path) -> None:
    """A scenario's ``name`` is free text: a 1 MB one was printed whole in the
    table's title line; it is cut to 200 characters, saying how long it was."""
    path = _toy(tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "name": "n" * 10**6}))
    proc = _kvfuzz("replay", path.name, "--variants", "unfixed", "--no-dense-check", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    longest = max(len(line) for line in (proc.stdout + proc.stderr).splitlines())
    assert longest < 300, f"a line of {longest} characters"
    title = proc.stdout.splitlines()[2]
    assert title == f"toy.json  [{'n' * 200}... (1000000 chars); A=8, hash block 4, policy vllm]"


def _model_scenario(tmp: Path, model: str) -> Path:
    scenario = json.loads((ROOT / "models" / "scenarios" / "gemma4-mtp.json").read_text())
    scenario["model"] = model
    path = tmp / "s.json"
    path.write_text(json.dumps(scenario))
    return path


def test_a_deeply_nested_model_file_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    proc = _kvfuzz("replay", str(_model_scenario(tmp_path, "deep.json")))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _error_lines(proc.stderr) == [
        f"kvfuzz: error: {tmp_path / 'deep.json'}: <json> = 'arrays or objects nested too "
        "deep to parse' is invalid: allowed JSON nested at most a few hundred levels (a "
        "scenario needs 3)"
    ]


def test_a_fifo_as_model_path_is_refused_not_waited_on(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.json")
    proc = _kvfuzz("replay", str(_model_scenario(tmp_path, "fifo.json")))
    assert proc.returncode == 2, proc.stderr[-2000:]
    # (a long temporary path is elided in the middle of the value)
    (line,) = _error_lines(proc.stderr)
    assert line.startswith(f"kvfuzz: error: {tmp_path / 's.json'}: model = '")
    assert line.endswith(
        "fifo.json' is invalid: allowed a regular file (not a pipe, device or folder)"
    )


def test_shrink_keeps_a_known_issue_the_fix_leaves_out_of_the_ci_corpus(tmp_path: Path) -> None:
    # The README's flow from a finding the fix does not repair: the reproducer
    # goes to known-issues/, so `scripts/kvfuzz-ci.sh` (which replays corpora/
    # on candidate and expects it clean) stays green.
    data = json.loads((ROOT / "known-issues" / "swa-short-run-align-before-drop.json").read_text())
    data.pop("expect")
    (tmp_path / "finding.json").write_text(json.dumps(data))
    proc = _kvfuzz("shrink", "finding.json", "--seconds", "20", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        proc.stdout.splitlines()[-1] == "reproducer: known-issues/fallback-unfixed-b5bb1560d8.json"
    )
    assert not (tmp_path / "corpora").exists()
    shrunk = json.loads(
        (tmp_path / "known-issues" / "fallback-unfixed-b5bb1560d8.json").read_text()
    )
    assert shrunk["expect"]["findings"]["fixed"] == ["dense-mismatch@1", "fallback@1"]


def test_no_dense_check_owes_no_dense_mismatch_the_expect_block_records() -> None:
    path = ROOT / "known-issues" / "window-one-multi-group-spiral.json"
    assert "dense-mismatch@1" in json.loads(path.read_text())["expect"]["findings"]["unfixed"]
    proc = _kvfuzz("replay", str(path), "--variants", "unfixed", "--no-dense-check", "--json")
    assert proc.returncode == 1, proc.stderr[-2000:]  # the fallback, a finding
    report = json.loads(proc.stdout)
    assert report["expectations_failed"] == []
    (scenario,) = report["scenarios"]
    (unfixed,) = scenario["variants"]
    assert [f["kind"] for f in unfixed["findings"]] == ["fallback"]

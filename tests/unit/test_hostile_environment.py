"""Hostile sizes and environments checked without vLLM: sizes that cost
memory are bounded before anything is built, and what a killed run left in
the temporary folder is cleaned up by the next one."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from differential.corpus import write_atomic
from differential.errors import ScenarioError
from differential.mutation.score import default_work_dir
from differential.scenario import RequestSpec, Workload
from differential.scenario.models import ModelDescription
from tests.factories import CORPORA, ROOT, dead_pid, triton

TOY = CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json"


def test_only_the_shared_prefix_requests_copy_is_built() -> None:
    # 2**63 prefix tokens, 16384 of them copied: the prompts are the same as
    # with a prefix of exactly 16384 tokens.
    seed = triton()
    huge = dataclasses.replace(seed, shared_prefix_tokens=2**63)
    assert huge.prompts == seed.prompts
    assert {len(p) for p in huge.prompts} == {16384 + 64}


def test_a_model_layer_count_is_bounded() -> None:
    data = {"layers": [{"kind": "full_attention", "count": 4000}, {"kind": "full_attention"}]}
    assert ModelDescription.from_dict(data).num_layers == 4001
    data["layers"][1]["count"] = 97
    with pytest.raises(ScenarioError) as raised:
        ModelDescription.from_dict(data)
    assert str(raised.value) == (
        "model.layers[1].count = 97 is invalid: allowed at most 4096 layers in all "
        "(4000 before this entry)"
    )


def test_a_pool_must_hold_the_longest_request() -> None:
    # Blocks 32 (full attention) and 16 (SWA); longest prompt 16448 tokens:
    # 514 full-attention blocks, one SWA block, the null block = 516.
    seed = triton()
    assert dataclasses.replace(seed, workload=Workload(pool_blocks=516)).workload.pool_blocks
    with pytest.raises(ScenarioError) as raised:
        dataclasses.replace(seed, workload=Workload(pool_blocks=515))
    assert str(raised.value) == (
        "workload.pool_blocks = 515 is invalid: allowed null or at least 516 blocks (the "
        "null block, the longest prompt of 16448 tokens in each full-attention group's "
        "blocks, one block per other group)"
    )
    # A shorter prompt needs fewer.
    short = dataclasses.replace(seed, requests=(RequestSpec(64, 1),))
    assert dataclasses.replace(short, workload=Workload(pool_blocks=5)).workload.pool_blocks == 5


def test_a_mutant_farm_left_by_a_killed_run_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"kvfuzz-mutants-{dead_pid()}"
    (stale / "m0000").mkdir(parents=True)
    (stale / "m0000" / "vllm").symlink_to(ROOT)
    alive = tmp_path / "kvfuzz-mutants-1"  # pid 1 is alive
    alive.mkdir()
    work = default_work_dir()
    assert work.parent == tmp_path and not stale.exists() and alive.exists()


def test_a_pipe_behind_a_descriptor_link_is_written_as_a_stream(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    link = tmp_path / "out.sarif"
    link.symlink_to(f"/proc/self/fd/{write_end}")
    try:
        write_atomic(link, "report\n")
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            assert pipe.read() == "report\n"
    finally:
        with contextlib.suppress(OSError):
            os.close(write_end)
    assert link.is_symlink() and os.readlink(link) == f"/proc/self/fd/{write_end}"


def test_a_fifo_is_written_as_a_stream_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "junit.xml"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    write_atomic(fifo, "<testsuites/>\n")
    reader.join(timeout=30)
    assert got == ["<testsuites/>\n"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_through_a_symlink_the_target_is_replaced_with_its_permissions(tmp_path: Path) -> None:
    target = tmp_path / "kept.json"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "report.json"
    link.symlink_to(target.name)
    write_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


@pytest.mark.parametrize("option", ["--report", "--junit-xml", "--sarif"])
def test_an_output_that_is_an_input_is_refused(tmp_path: Path, option: str) -> None:
    scenario = tmp_path / "s.json"
    scenario.write_text(TOY.read_text())
    alias = tmp_path / "alias.json"
    alias.symlink_to(scenario.name)
    proc = subprocess.run(
        # Names relative to the working folder: an absolute temporary path
        # can be long enough for the message to elide it.
        [sys.executable, "-m", "differential.cli", "replay", scenario.name, option, alias.name],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"kvfuzz: error: {option} = {alias.name!r} is invalid: allowed a file that is not "
        f"an input (it is {scenario.name})"
    ]
    assert scenario.read_text() == TOY.read_text()


def _kvfuzz(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "differential.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        check=False,
        timeout=120,
    )


def _digits(tmp: Path) -> list[str]:
    text = TOY.read_text().replace('"decode_steps": 0', '"decode_steps": ' + "9" * 5000)
    (tmp / "digits.json").write_text(text)
    return ["replay", "digits.json"]


def _earlier_runs_a_file(tmp: Path) -> list[str]:
    (tmp / "out").mkdir()
    (tmp / "out" / "summary.json").write_text("{}")
    (tmp / "out" / "earlier-runs").write_text("")
    return ["fuzz", "--out", "out", "--max-examples", "1"]


@pytest.mark.parametrize(
    ("build", "line"),
    [
        pytest.param(
            _digits,
            "kvfuzz: error: digits.json: <json> = 'an integer too long to read' is invalid: "
            "allowed numbers of at most 4300 digits (Exceeds the limit (4300 digits) for "
            "integer string conversion: value has 5000 digits; use "
            "sys.set_int_max_str_digits() to increase the limit)",
            id="5000-digit-integer",
        ),
        pytest.param(
            lambda t: ["replay", "a" * 5000 + ".json"],
            "kvfuzz: error: PATH = 'aaaaaaaa",
            id="5000-character-path",
        ),
        pytest.param(
            lambda t: ["replay", str(TOY), "--report", "r" * 5000 + ".json"],
            "kvfuzz: error: --report = 'rrrrrrrr",
            id="5000-character-output-path",
        ),
        pytest.param(
            _earlier_runs_a_file,
            "kvfuzz: error: --out (earlier-runs/) = 'out/earlier-runs' is invalid: allowed "
            "a folder (the path is a file)",
            id="earlier-runs-is-a-file",
        ),
    ],
)
def test_environment_and_size_problems_exit_2_in_one_line(
    tmp_path: Path, build: Callable[[Path], list[str]], line: str
) -> None:
    proc = _kvfuzz(*build(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (only,) = proc.stderr.splitlines()
    assert only.startswith(line)
    assert len(only) < 700


def test_vllm_not_installed_is_named_with_what_to_do(tmp_path: Path) -> None:
    # A vllm package that is not importable, first on the path: what Python
    # raises where vLLM is not installed.
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n"
    )
    proc = _kvfuzz(
        "replay", str(TOY), cwd=tmp_path, env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1] == (
        "kvfuzz: error: vllm is not importable (No module named 'vllm'): kvfuzz drives the "
        "vLLM installed beside it; install vllm==0.33.0 (on a CPU-only machine `make "
        "replay` sets up .venv with it) or run kvfuzz from that environment"
    )


def _malformed_known_corpus(tmp: Path) -> list[str]:
    (tmp / "known").mkdir()
    (tmp / "known" / "bad.json").write_text('{"format": "kvfuzz.scenario", "version": 1}')
    return ["fuzz", "--out", "out", "--known-corpus", "known", "--max-examples", "1"]


@pytest.mark.parametrize(
    ("build", "line"),
    [
        pytest.param(
            lambda t: ["diff", "unfixed", "fixed", "--corpus", "--seconds", "0"],
            "kvfuzz: error: --corpus with no PATH and --seconds 0 would compare nothing: "
            "give a corpus PATH, or a campaign budget (--seconds S > 0)",
            id="diff-of-nothing",
        ),
        pytest.param(
            lambda t: ["fuzz", "--groups", "", "--out", "out"],
            "kvfuzz: error: --groups '' names no group kind; allowed: full_attention, "
            "sliding_window, mamba, mla, sliding_window_mla, chunked_local_attention",
            id="groups-empty",
        ),
        pytest.param(
            lambda t: ["fuzz", "--shrink-seconds", "nan", "--out", "out"],
            "kvfuzz fuzz: error: argument --shrink-seconds: 'nan' is invalid: allowed a "
            "finite number of seconds > 0",
            id="shrink-seconds-nan",
        ),
        pytest.param(
            _malformed_known_corpus,
            "kvfuzz: error: known/bad.json: kv_cache_groups = None is invalid",
            id="malformed-known-corpus-file",
        ),
    ],
)
def test_options_that_would_mean_nothing_exit_2(
    tmp_path: Path, build: Callable[[Path], list[str]], line: str
) -> None:
    proc = _kvfuzz(*build(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [x for x in proc.stderr.splitlines() if not x.startswith(("usage:", " "))]
    assert len(errors) == 1 and errors[0].startswith(line), errors


def test_a_second_campaign_on_the_same_out_is_refused(tmp_path: Path) -> None:
    import fcntl

    (tmp_path / "out").mkdir()
    with open(tmp_path / "out" / ".kvfuzz-campaign.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242\n")
        held.flush()
        proc = _kvfuzz("fuzz", "--out", "out", "--max-examples", "1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        "kvfuzz: error: --out = 'out' is invalid: allowed a folder no other campaign is "
        "writing (pid 4242 is)"
    ]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("model", [False, True], ids=["scenario", "model"])
def test_schema_into_a_full_disk_is_an_output_not_written(tmp_path: Path, model: bool) -> None:
    """``kvfuzz schema > /dev/full`` was exit 2 (bad input: nothing ran), its
    line naming no file."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "differential.cli", "schema", *(["--model"] if model else [])],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )
    assert proc.returncode == 3
    assert proc.stderr.splitlines() == [
        "kvfuzz: error: could not write <stdout>: No space left on device (the disk is "
        "full: free space and rerun)"
    ]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_failed_write_names_the_file_written(tmp_path: Path) -> None:
    # A full disk fails a write() or an fsync(), whose OSError names no file.
    with pytest.raises(OSError) as raised:
        write_atomic(Path("/dev/full"), "x" * 10000)
    assert (raised.value.errno, raised.value.filename) == (28, "/dev/full")
    # A regular file over the file-size limit (EFBIG), in a process of its own.
    target = tmp_path / "r.json"
    code = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "from differential.corpus import write_atomic\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))\n"
        "try:\n"
        "    write_atomic(Path(sys.argv[1]), 'x' * 4096)\n"
        "except OSError as exc:\n"
        "    print(exc.errno, exc.filename)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(target)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert proc.stdout.split() == ["27", str(target)], proc.stderr
    assert list(tmp_path.iterdir()) == []  # no temporary file left beside it

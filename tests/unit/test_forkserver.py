"""The fork server: a forked child is ``python -m MODULE ARGS`` in every respect
the tests read (output, exit status, argv, cwd, environment, sys.path)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from differential import forkserver
from tests.factories import dead_pid, still_alive

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open")

PROBE = textwrap.dedent(
    """
    import json, os, sys
    if sys.argv[1:2] == ["raise"]:
        raise RuntimeError("probe failed")
    if sys.argv[1:2] == ["kill"]:
        os.kill(os.getpid(), 9)
    os.write(1, b"raw\\n")
    print(json.dumps({
        "name": __name__,
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "path": sys.path[:3],
        "x": os.environ.get("KVFUZZ_PROBE"),
        "stdin": sys.stdin.read(),
        "parent": os.getppid(),
    }))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
    """
)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary folder with a short path: a fork server's Unix socket path
    must fit in 108 bytes, and pytest's ``tmp_path`` under xdist
    (``/tmp/pytest-of-root/pytest-N/popen-gwN/test_...``) leaves too little
    room, so the server would fall back to ``/tmp`` itself."""
    folder = Path(tempfile.mkdtemp(prefix="kf-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[forkserver.ForkServer, Path]]:
    folder = tmp_path_factory.mktemp("probe")
    (folder / "kvfuzz_probe.py").write_text(PROBE)
    running = forkserver.ForkServer.start(["json", "textwrap"])
    yield running, folder
    running.close()


def _fresh(
    folder: Path, *args: str, env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfuzz_probe", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        input="",
        check=False,
    )


def test_a_forked_child_matches_a_fresh_interpreter(server, tmp_path: Path) -> None:
    running, folder = server
    env = dict(os.environ, PYTHONPATH=str(folder), KVFUZZ_PROBE="seen")
    forked = forkserver.run_module(
        running.address, "kvfuzz_probe", ["7", "--flag"], cwd=tmp_path, env=env
    )
    fresh = _fresh(folder, "7", "--flag", env=env, cwd=tmp_path)
    assert forked.returncode == fresh.returncode == 7
    assert forked.stderr == fresh.stderr == "to stderr\n"
    raw, line = forked.stdout.splitlines()
    assert raw == "raw"  # a C-level write on file descriptor 1 is captured too
    seen, expected = json.loads(line), json.loads(fresh.stdout.splitlines()[1])
    assert seen.pop("parent") == running.pid  # forked by the server indeed
    assert expected.pop("parent") == os.getpid()
    assert seen == expected
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(folder / "kvfuzz_probe.py"), "7", "--flag"]
    assert seen["cwd"] == str(tmp_path) and seen["path"][:2] == [str(tmp_path), str(folder)]
    assert seen["x"] == "seen"


def test_stdin_exceptions_and_signals_come_back_as_subprocess_reports_them(
    server, tmp_path: Path
) -> None:
    running, folder = server
    env = dict(os.environ, PYTHONPATH=str(folder))
    done = forkserver.run_module(running.address, "kvfuzz_probe", [], env=env, input_text="abc")
    assert done.returncode == 0 and json.loads(done.stdout.splitlines()[1])["stdin"] == "abc"
    raised = forkserver.run_module(running.address, "kvfuzz_probe", ["raise"], env=env)
    assert raised.returncode == 1
    assert raised.stderr.strip().endswith("RuntimeError: probe failed")
    killed = forkserver.run_module(running.address, "kvfuzz_probe", ["kill"], env=env)
    assert killed.returncode == -signal.SIGKILL


def test_a_start_up_only_variable_is_refused(server) -> None:
    running, folder = server
    env = dict(os.environ, PYTHONPATH=str(folder), PYTHONHASHSEED="4242")
    with pytest.raises(forkserver.Unservable, match="PYTHONHASHSEED"):
        forkserver.run_module(running.address, "kvfuzz_probe", [], env=env)


def test_an_address_space_limit_holds_in_the_child_only(server) -> None:
    running, folder = server
    (folder / "kvfuzz_limited.py").write_text(
        "import resource\n"
        "limit = resource.getrlimit(resource.RLIMIT_AS)\n"
        "print(limit)\n"
        "try:\n"
        "    block = bytearray(1 << 30) if limit[0] != resource.RLIM_INFINITY else None\n"
        "except MemoryError:\n"
        "    print('MemoryError')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(folder))
    limited = forkserver.run_module(
        running.address, "kvfuzz_limited", [], env=env, address_space_bytes=512 << 20
    )
    assert limited.returncode == 0, limited.stderr
    assert limited.stdout.splitlines() == [str((512 << 20, 512 << 20)), "MemoryError"]
    free = forkserver.run_module(running.address, "kvfuzz_limited", [], env=env)
    assert free.stdout.splitlines() == [str((-1, -1))]  # the server itself is not limited


def test_pytest_in_a_child_rewrites_a_plugin_package_the_server_imported(
    tmp_path: Path,
) -> None:
    pytest.importorskip("anyio")
    (tmp_path / "test_probe.py").write_text("def test_probe():\n    assert 1 + 1 == 2\n")
    running = forkserver.ForkServer.start(["anyio"])  # a pytest plugin's package
    try:
        done = forkserver.run_module(
            running.address,
            "pytest",
            ["-q", "-p", "no:cacheprovider", "-W", "error::pytest.PytestAssertRewriteWarning"],
            cwd=tmp_path,
        )
    finally:
        running.close()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_a_timeout_kills_the_child(server) -> None:
    running, folder = server
    (folder / "kvfuzz_sleeper.py").write_text("import time\ntime.sleep(600)\n")
    env = dict(os.environ, PYTHONPATH=str(folder))
    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run_module(running.address, "kvfuzz_sleeper", [], env=env, timeout_s=0.5)


def test_preload_leaves_out_vllm_and_kvfuzz() -> None:
    names = ["torch", "torch.nn", "vllm", "vllm.config", "differential.cli", "fuzz", "tests.x"]
    names += ["__main__", "_pytest.main", "pytest", "numpy"]
    assert forkserver.default_preload(names) == ["torch", "torch.nn", "numpy"]


def test_a_server_whose_owner_is_killed_leaves_no_folder(short_tmp: Path) -> None:
    """SIGKILL of the process that started the server (a CI cancel of
    ``kvfuzz mutate``) closes the server's stdin: the server exits and
    removes its socket and its folder from the temporary folder."""
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from differential import forkserver; "
            "s = forkserver.ForkServer.start(['json']); "
            "print(s.address, s.pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(short_tmp), "PYTHONPATH": str(Path.cwd())},
    )
    assert owner.stdout is not None
    address, pid = owner.stdout.readline().split()
    assert Path(address).parent.parent == short_tmp and Path(address).exists()
    owner.kill()
    owner.wait()
    owner.stdout.close()
    # The server is the owner's child, now re-parented: poll until it is gone.
    for _ in range(200):
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            break
        with contextlib.suppress(ChildProcessError):
            os.waitpid(int(pid), os.WNOHANG)
        time.sleep(0.05)
    for _ in range(100):
        if not Path(address).parent.exists():
            break
        time.sleep(0.05)
    assert list(short_tmp.iterdir()) == []


SLOW_IMPORT = textwrap.dedent(
    """
    import os, pathlib, time
    pathlib.Path(os.environ["KVFUZZ_PROBE_PID"]).write_text(str(os.getpid()))
    time.sleep(120)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal")
@pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["sigint", "sigterm", "sigkill"]
)
def test_a_server_whose_owner_stops_while_it_pre_imports_leaves_nothing(
    tmp_path: Path, signum: int
) -> None:
    """The owner stopped before the server is ready (Ctrl-C, a CI cancel a
    second after ``kvfuzz mutate`` started it): the server was left importing,
    then printed a BrokenPipeError traceback and left its folder behind."""
    modules, temp = tmp_path / "modules", tmp_path / "tmp"
    modules.mkdir()
    temp.mkdir()
    (modules / "kvfuzz_slow_import.py").write_text(SLOW_IMPORT)
    pid_file = tmp_path / "server.pid"
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            # Python's own SIGINT, whatever this test process left to its
            # children (an ignored SIGINT is inherited across exec).
            "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from differential import forkserver\n"
            "try:\n"
            "    forkserver.ForkServer.start(['json', 'kvfuzz_slow_import'])\n"
            "except KeyboardInterrupt:\n"
            "    sys.exit(130)\n",
        ],
        env={
            **os.environ,
            "TMPDIR": str(temp),
            "PYTHONPATH": os.pathsep.join([str(Path.cwd()), str(modules)]),
            "KVFUZZ_PROBE_PID": str(pid_file),
        },
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not pid_file.exists() or not pid_file.read_text():
            assert owner.poll() is None, owner.communicate()
            time.sleep(0.05)
        server_pid = int(pid_file.read_text())
        os.kill(owner.pid, signum)
        _, stderr = owner.communicate(timeout=60)
        assert not still_alive([server_pid], 10.0), "the server outlived its owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.communicate()
    assert list(temp.iterdir()) == []
    assert "Traceback" not in stderr
    if signum == signal.SIGINT:
        assert owner.returncode == 130


SPAWNER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.environ["KVFUZZ_PROBE_PID"], "w") as handle:
        handle.write(str(helper.pid))
    if sys.argv[1:] == ["wait"]:
        time.sleep(120)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_child_in_a_session_of_its_own_dies_with_what_it_started(tmp_path: Path) -> None:
    """``kvfuzz mutate --vllm-tests`` runs vLLM's tests in a session of their
    own: a test's own interpreter (``python -O -c`` in
    ``tests/v1/core/test_kv_cache_planning.py``) dies with them, when they end
    and when the server stops (the owner's SIGTERM); it was left running."""
    (tmp_path / "kvfuzz_spawner.py").write_text(SPAWNER)
    pid_file = tmp_path / "helper.pid"
    env = dict(os.environ, PYTHONPATH=str(tmp_path), KVFUZZ_PROBE_PID=str(pid_file))
    running = forkserver.ForkServer.start(["json"])
    try:
        done = forkserver.run_module(
            running.address, "kvfuzz_spawner", [], env=env, new_session=True
        )
        assert done.returncode == 0, done.stderr
        assert not still_alive([int(pid_file.read_text())], 10.0), "left running at its end"
        pid_file.unlink()
        child = forkserver.spawn(
            running.address,
            "kvfuzz_spawner",
            ["wait"],
            env=env,
            fds=(0, 2, 2),
            new_session=True,
        )
        while not pid_file.exists() or not pid_file.read_text():
            assert child.poll() is None
            time.sleep(0.05)
        helper = int(pid_file.read_text())
    finally:
        running.close()
    assert child.wait(10) == -signal.SIGKILL
    assert not still_alive([helper], 10.0), "left running when the server stopped"


def test_a_long_temporary_folder_falls_back_to_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Unix socket's path holds at most 107 bytes: under a long TMPDIR the
    server printed a raw ``AF_UNIX path too long`` traceback (and every
    worker started as a fresh interpreter)."""
    long = tmp_path / ("t" * 100)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    running = forkserver.ForkServer.start(["json"])
    try:
        assert Path(running.address).parent.parent == Path("/tmp")
        done = forkserver.run_module(running.address, "json.tool", ["--help"])
        assert done.returncode == 0, done.stderr
    finally:
        running.close()
    assert not Path(running.address).parent.exists()
    assert list(long.iterdir()) == []


def test_a_folder_left_by_a_dead_owner_is_removed_by_the_next_server(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = short_tmp / f"{forkserver.FOLDER_PREFIX}{dead_pid()}-abcdefgh"
    live = short_tmp / f"{forkserver.FOLDER_PREFIX}{os.getppid()}-abcdefgh"
    for folder in (stale, live):
        folder.mkdir()
        (folder / "socket").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    running = forkserver.ForkServer.start(["json"])
    try:
        folder = Path(running.address).parent
        assert folder.name.startswith(f"{forkserver.FOLDER_PREFIX}{os.getpid()}-")
        assert not stale.exists() and live.exists()
    finally:
        running.close()
    assert sorted(short_tmp.iterdir()) == [live]


def test_no_short_temporary_folder_is_one_os_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long = tmp_path / ("t" * 100)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    monkeypatch.setattr(forkserver, "_SHORT_TEMP", str(long))
    with pytest.raises(OSError, match="too long for a Unix socket path") as raised:
        forkserver.ForkServer.start(["json"])
    assert raised.value.filename == str(long)

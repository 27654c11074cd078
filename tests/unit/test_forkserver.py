"""The fork server: a forked child is ``python -m MODULE ARGS`` in every respect
the tests read (output, exit status, argv, cwd, environment, sys.path)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from differential import forkserver

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


def test_a_server_whose_owner_is_killed_leaves_no_folder(tmp_path: Path) -> None:
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
        env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(Path.cwd())},
    )
    assert owner.stdout is not None
    address, pid = owner.stdout.readline().split()
    assert Path(address).parent.parent == tmp_path and Path(address).exists()
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
    assert list(tmp_path.iterdir()) == []

"""A pre-imported fork server: ``python -m MODULE ARGS`` in 1 s instead of 7.

Importing kvfuzz's driver costs about 7 CPU-seconds, nearly all of it in
vLLM's dependencies (torch, transformers, sympy, ...), not in vLLM itself.
The server is a fresh interpreter that imports those dependencies once and
then forks a child per request; the child becomes ``python -m MODULE ARGS``
(its own stdin/stdout/stderr, working directory, environment, ``sys.path``
and ``sys.argv``, run by :mod:`runpy` exactly as ``-m`` does) and imports vLLM
itself, from whichever tree its ``PYTHONPATH`` names, in under a second.
vLLM itself is never pre-imported: a second vLLM cannot be imported into a
process holding one (torch refuses to register its custom ops twice).

Used by the tests (:func:`run_module`, through ``tests/factories.py``) and by
tree workers (:mod:`differential.variants.tree`) when ``KVFUZZ_FORKSERVER``
names a running server's socket.

A request whose environment differs from the server's in a variable Python
reads only at start-up (``PYTHON*`` other than ``PYTHONPATH``) cannot be
served (:class:`Unservable`); callers then start a real interpreter.

Protocol, one Unix-socket connection per child: the client sends an 8-byte
big-endian length with the child's three file descriptors (``SCM_RIGHTS``),
then that many bytes of JSON ``{"module", "args", "cwd", "env"}`` (and
``"address_space_bytes"``, the child's ``RLIMIT_AS``, when one is asked for); the server
answers one line ``{"pid": N}`` once forked and one line ``{"returncode": N}``
(``subprocess`` convention: ``-SIG`` when killed by a signal) once the child
has exited.

This module imports only the standard library: the server loads it by file
path, without importing the ``differential`` package.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import types
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any

__all__ = [
    "ENV",
    "Child",
    "ForkServer",
    "Unservable",
    "default_preload",
    "run_module",
    "spawn",
]

ENV = "KVFUZZ_FORKSERVER"
_HEADER_BYTES = 8
# Never pre-imported: the package whose versions differ between children, and
# kvfuzz's own code (imported fresh from the child's sys.path).
_EXCLUDED = ("vllm", "differential", "fuzz", "tests", "__main__", "__mp_main__")
# The test runner's own modules stay out of the server: a child running
# ``python -m pytest`` must import (and assertion-rewrite) them itself.
_EXCLUDED_TOOLS = ("pytest", "_pytest", "pluggy", "xdist", "execnet", "iniconfig")
_STARTUP_ONLY_PREFIX = "PYTHON"


class Unservable(RuntimeError):
    """The request cannot be served by a fork (e.g. a start-up-only variable differs)."""


def default_preload(modules: Iterable[str] | None = None) -> list[str]:
    """Module names worth pre-importing: ``modules`` (default: every module this
    process has imported) less vLLM, kvfuzz's packages and the test runner.

    Called after importing kvfuzz's driver, it lists exactly the dependencies
    vLLM's import pulls in (about 4,300 modules).
    """
    names = list(sys.modules) if modules is None else list(modules)
    excluded = _EXCLUDED + _EXCLUDED_TOOLS
    return [
        name
        for name in names
        if name.partition(".")[0] not in excluded and not name.startswith("__")
    ]


def _startup_env(env: Mapping[str, str]) -> dict[str, str]:
    return {
        key: value
        for key, value in env.items()
        if key.startswith(_STARTUP_ONLY_PREFIX) and key != "PYTHONPATH"
    }


class ForkServer:
    """A running server (the owner's handle): start with :meth:`start`, stop with :meth:`close`.

    Attributes:
        address: the server's Unix socket path (what ``KVFUZZ_FORKSERVER`` holds).
        pid: the server's process id (every forked child's parent).
    """

    def __init__(self, process: subprocess.Popen[bytes], address: str, folder: str) -> None:
        self._process = process
        self.address = address
        self.pid = process.pid
        self._folder = folder

    @classmethod
    def start(cls, preload: Sequence[str], *, env: Mapping[str, str] | None = None) -> ForkServer:
        """Start a server that pre-imports ``preload`` (names that fail to import are skipped).

        Blocks until the imports are done (about 6 CPU-seconds for vLLM's
        dependencies).

        Raises:
            RuntimeError: the server exited before it was ready.
        """
        folder = tempfile.mkdtemp(prefix="kvfuzz-forkserver-")
        address = os.path.join(folder, "socket")
        code = (
            "import importlib.util as u, sys; "
            "s = u.spec_from_file_location('_kvfuzz_forkserver', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); m.serve(sys.argv[2])"
        )
        process = subprocess.Popen(
            [sys.executable, "-c", code, __file__, address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(os.environ if env is None else env),
        )
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(("\n".join(preload) + "\n\n").encode())
        process.stdin.flush()
        if process.stdout.readline() != b"ready\n":
            process.kill()
            process.wait()
            raise RuntimeError("the fork server exited before it was ready")
        return cls(process, address, folder)

    def close(self) -> None:
        """Stop the server (its running children are killed) and reap it."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            with contextlib.suppress(OSError):
                self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self.address)
        with contextlib.suppress(OSError):
            os.rmdir(self._folder)


class Child:
    """A process forked by the server: the parts of ``subprocess.Popen`` kvfuzz uses.

    Attributes:
        pid: the child's process id (a child of the server, not of this process).
        returncode: ``None`` while running; the exit status, or ``-SIG`` if killed.
        args: the command it stands for (``[python, -m, MODULE, *ARGS]``).
        stdin, stdout, stderr: text streams of the pipes :func:`spawn` made, or ``None``.
    """

    def __init__(self, connection: socket.socket, pid: int, args: list[str]) -> None:
        self._connection = connection
        self._reader = connection.makefile("rb")
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.stdin: IO[str] | None = None
        self.stdout: IO[str] | None = None
        self.stderr: IO[str] | None = None

    def poll(self) -> int | None:
        """The exit status if the child has exited, else ``None``."""
        if self.returncode is None:
            ready, _, _ = select.select([self._connection], [], [], 0)
            if ready:
                self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to exit; its exit status.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        if self.returncode is None:
            ready, _, _ = select.select([self._connection], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._collect()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Signal the child if it is still running."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL the child if it is still running."""
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM the child if it is still running."""
        self.send_signal(signal.SIGTERM)

    def _collect(self) -> None:
        line = self._reader.readline()
        # A server that died without answering: report it like a killed child.
        self.returncode = int(json.loads(line)["returncode"]) if line else -signal.SIGKILL
        self._reader.close()
        self._connection.close()


def spawn(
    address: str,
    module: str,
    args: Sequence[str] = (),
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    fds: tuple[int, int, int] | None = None,
    address_space_bytes: int | None = None,
) -> Child:
    """Fork ``python -m MODULE ARGS`` from the server at ``address``.

    ``fds`` are the child's stdin, stdout and stderr (default: this process's
    own 0, 1, 2); ``cwd`` and ``env`` default to this process's.
    ``address_space_bytes``, when given, is the child's ``RLIMIT_AS`` (soft
    and hard, in bytes), set before its module runs, as a ``preexec_fn``
    calling ``resource.setrlimit`` sets it for a fresh interpreter. The
    child's own fresh processes inherit it; children it asks the server for
    do not, so a caller wanting the limit on every descendant leaves
    :data:`ENV` out of ``env``. A ``pytest`` child first drops the
    pre-imported packages of pytest's plugins, which it then imports and
    assertion-rewrites itself, as a fresh ``python -m pytest`` does.

    Raises:
        Unservable: ``env`` differs from the server's in a start-up-only variable.
        OSError: the server cannot be reached.
    """
    request: dict[str, Any] = {
        "module": module,
        "args": list(args),
        "cwd": os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd()),
        "env": dict(os.environ if env is None else env),
    }
    if address_space_bytes is not None:
        request["address_space_bytes"] = address_space_bytes
    body = json.dumps(request).encode()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(address)
        socket.send_fds(
            connection, [len(body).to_bytes(_HEADER_BYTES, "big")], list(fds or (0, 1, 2))
        )
        connection.sendall(body)
        reader = connection.makefile("rb")
        line = reader.readline()
        reader.close()
    except OSError:
        connection.close()
        raise
    if not line:
        connection.close()
        raise OSError(f"the fork server at {address} closed the connection")
    answer = json.loads(line)
    if "unservable" in answer:
        connection.close()
        raise Unservable(answer["unservable"])
    return Child(connection, int(answer["pid"]), [sys.executable, "-m", module, *args])


def run_module(
    address: str,
    module: str,
    args: Sequence[str] = (),
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    input_text: str | None = None,
    timeout_s: float | None = None,
    address_space_bytes: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, -m, MODULE, *ARGS], capture_output=True, text=True)``
    through the server: stdout and stderr captured (as files), stdin
    ``input_text`` or empty; ``address_space_bytes`` as for :func:`spawn`.

    Raises:
        Unservable, OSError: as :func:`spawn`.
        subprocess.TimeoutExpired: still running after ``timeout_s`` (the child is killed).
    """
    with (
        tempfile.TemporaryFile() as stdin,
        tempfile.TemporaryFile() as stdout,
        tempfile.TemporaryFile() as stderr,
    ):
        if input_text is not None:
            stdin.write(input_text.encode())
            stdin.seek(0)
        child = spawn(
            address,
            module,
            args,
            cwd=cwd,
            env=env,
            fds=(stdin.fileno(), stdout.fileno(), stderr.fileno()),
            address_space_bytes=address_space_bytes,
        )
        try:
            returncode = child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        texts = []
        for stream in (stdout, stderr):
            stream.seek(0)
            texts.append(stream.read().decode("utf-8", errors="replace"))
    return subprocess.CompletedProcess(child.args, returncode, texts[0], texts[1])


# The server side ---------------------------------------------------------------


def serve(address: str) -> None:
    """Run the server (in a fresh interpreter): read the preload list on stdin
    (one name a line, ended by an empty line), import it, print ``ready``,
    then fork a child per connection until stdin closes.

    Returns only in a forked child, after the child's module has run; the
    interpreter then exits as ``python -m`` would.
    """
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]  # ``-c`` put the server's working directory first
    names = []
    for line in sys.stdin.buffer:
        name = line.decode().strip()
        if not name:
            break
        names.append(name)
    _preload(names)
    gc.collect()
    gc.freeze()  # the children share the pre-imported objects' pages
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    request = _loop(listener)
    if request is not None:
        _become(*request)
        return
    # The owner closed stdin (or died, e.g. SIGKILLed): leave no socket or
    # folder behind in the temporary folder.
    listener.close()
    with contextlib.suppress(OSError):
        os.unlink(address)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(address))


def _preload(names: Sequence[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            if name in sys.modules:
                continue
            with contextlib.suppress(Exception):
                importlib.import_module(name)
    leaked = [name for name in sys.modules if name.partition(".")[0] in _EXCLUDED[:3]]
    if leaked:  # a dependency imported vLLM or kvfuzz: children would share it
        raise SystemExit(f"fork server: pre-importing dependencies imported {leaked[0]}")


def _loop(listener: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Serve until stdin closes (``None``); in a forked child, its request and fds."""
    control = sys.stdin.fileno()
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    while True:
        ready, _, _ = select.select([control, listener, *running], [], [])
        for fd in ready:
            if fd == control:
                if not os.read(control, 4096):
                    for pid, _ in running.values():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                    return None
            elif fd is listener:
                connection, _ = listener.accept()
                forked = _fork(connection, listener, running)
                if forked is not None:
                    return forked
            else:
                assert isinstance(fd, int)
                pid, connection = running.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    code = os.waitstatus_to_exitcode(status)
                    connection.sendall(json.dumps({"returncode": code}).encode() + b"\n")
                connection.close()


def _fork(
    connection: socket.socket,
    listener: socket.socket,
    running: dict[int, tuple[int, socket.socket]],
) -> tuple[dict[str, Any], list[int]] | None:
    try:
        header, fds, _, _ = socket.recv_fds(connection, _HEADER_BYTES, 3)
        size = int.from_bytes(header, "big")
        body = b""
        while len(body) < size:
            chunk = connection.recv(size - len(body))
            if not chunk:
                raise OSError("short request")
            body += chunk
        request = json.loads(body)
    except (OSError, ValueError):
        connection.close()
        return None
    differs = sorted(
        set(_startup_env(request["env"]).items()) ^ set(_startup_env(os.environ).items())
    )
    if differs:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            reason = f"{differs[0][0]} differs from the fork server's (read at start-up only)"
            connection.sendall(json.dumps({"unservable": reason}).encode() + b"\n")
        connection.close()
        return None
    pid = os.fork()
    if pid == 0:
        listener.close()
        connection.close()
        for pidfd, (_, other) in running.items():
            os.close(pidfd)
            other.close()
        return request, fds
    for fd in fds:
        os.close(fd)
    running[os.pidfd_open(pid)] = (pid, connection)
    with contextlib.suppress(OSError):
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return None


def _forget_pytest_plugins() -> None:
    """Drop the pre-imported packages of pytest's plugins (``anyio``, which
    vLLM's dependencies import, for one) from ``sys.modules``, so that
    ``python -m pytest`` in the child imports and assertion-rewrites them as in
    a fresh interpreter (pytest warns, and fails under ``-W error``, on a
    plugin package imported before it starts: ``_pytest/config/__init__.py``
    ``_mark_plugins_for_rewrite``). Modules imported earlier keep the objects
    they hold."""
    try:
        import importlib.metadata

        from _pytest.config import _iter_rewritable_modules
    except ImportError:  # a pytest without that helper: nothing to emulate
        return
    files = [
        str(file)
        for dist in importlib.metadata.distributions()
        if any(entry.group == "pytest11" for entry in dist.entry_points)
        for file in dist.files or []
    ]
    names = set(_iter_rewritable_modules(files))
    for module in [m for m in sys.modules if m.partition(".")[0] in names]:
        del sys.modules[module]


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """Turn this forked child into ``python -m MODULE ARGS`` as ``request`` describes."""
    import runpy

    encoding, errors = sys.stdin.encoding, sys.stdin.errors
    sys.stdin.close()  # the server's control pipe
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    sys.stdin = open(0, encoding=encoding, errors=errors, closefd=False)  # noqa: SIM115
    # sys.path as a fresh ``python -m`` builds it: the working directory, then
    # PYTHONPATH (made absolute), then the interpreter's own entries.
    inherited = [
        os.path.abspath(entry)
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry
    ]
    base = [entry for entry in sys.path if entry not in inherited]
    cwd = request["cwd"]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(request["env"])
    pythonpath = [
        os.path.abspath(entry)
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry
    ]
    sys.path[:] = [cwd, *pythonpath, *base]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    sys.argv = ["-m", *request["args"]]
    if request["module"] == "pytest":
        _forget_pytest_plugins()
    limit = request.get("address_space_bytes")
    if limit is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (int(limit), int(limit)))
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    runpy._run_module_as_main(request["module"], alter_argv=True)  # type: ignore[attr-defined]

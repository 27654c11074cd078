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
``"address_space_bytes"``, the child's ``RLIMIT_AS``, when one is asked for,
and ``"session": true`` for a child in a session of its own); the server
answers one line ``{"pid": N}`` once forked and one line ``{"returncode": N}``
(``subprocess`` convention: ``-SIG`` when killed by a signal) once the child
has exited.

Lifetime: the server lives as long as its owner (the process that started
it). It stops when its stdin closes (:meth:`ForkServer.close`, or the owner's
death: the kernel closes the pipe) or on SIGTERM, which Linux sends it when
the owner dies (``prctl(PR_SET_PDEATHSIG)``, as the tree workers ask for it:
the owner may die while the server is still pre-importing and not yet
reading stdin). Stopping kills the running children (a child in a session
of its own with every process of its group: ``python -m pytest`` and the
interpreters its tests start) and removes the socket and its folder. Ctrl-C
is left to the owner: the server ignores SIGINT, its children get Python's
usual handler. The folder, ``$TMPDIR/kvfuzz-forkserver-<owner pid>-*``, is
named by the owner's pid: one left by a server that could not clean up
(SIGKILLed itself) is removed by the next server started
(:mod:`differential.stale`).

This module imports only the standard library: the server loads it by file
path, without importing the ``differential`` package.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import types
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
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
#: The folder of a server's socket: ``PREFIX<owner pid>-<random>``.
FOLDER_PREFIX = "kvfuzz-forkserver-"
# A Unix socket's path fits ``sun_path`` (108 bytes on Linux, 104 on the BSDs
# and macOS, the terminating NUL included).
_MAX_SOCKET_PATH_BYTES = 107 if sys.platform.startswith("linux") else 103
# The socket's path below the temporary folder: "/PREFIX<pid>-<8 random>/socket".
_SOCKET_NAME_BYTES = len(f"/{FOLDER_PREFIX}4194304-abcdefgh/socket")
_SHORT_TEMP = "/tmp"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_REAP_S = 30.0  # longest wait for a killed child's exit status


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
        dependencies). The socket's folder is made in the temporary folder,
        or in ``/tmp`` when the temporary folder's path is too long for a
        Unix socket; folders of earlier servers whose owner is dead are
        removed first. The server dies with the thread that starts it (the
        parent-death signal is per thread): start it from the main thread.
        An exception here (Ctrl-C, SIGTERM turned into one) stops the server
        and removes its folder before it propagates.

        Raises:
            RuntimeError: the server exited before it was ready.
            OSError: no temporary folder short enough for a Unix socket path,
                or the folder cannot be made.
        """
        temp = _socket_parent()
        from differential.stale import remove_stale  # not in the server: standard library only

        remove_stale(Path(temp), FOLDER_PREFIX, "-")
        folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=temp)
        address = os.path.join(folder, "socket")
        code = (
            "import importlib.util as u, sys; "
            "s = u.spec_from_file_location('_kvfuzz_forkserver', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            "m.serve(sys.argv[2], int(sys.argv[3]))"
        )
        process: subprocess.Popen[bytes] | None = None
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", code, __file__, address, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=dict(os.environ if env is None else env),
            )
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(("\n".join(preload) + "\n\n").encode())
            process.stdin.flush()
            if process.stdout.readline() != b"ready\n":
                raise RuntimeError("the fork server exited before it was ready")
        except BaseException:
            if process is not None:
                process.kill()
                process.wait()
                for pipe in (process.stdin, process.stdout):
                    with contextlib.suppress(OSError):
                        if pipe is not None:
                            pipe.close()
            shutil.rmtree(folder, ignore_errors=True)
            raise
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
        shutil.rmtree(self._folder, ignore_errors=True)


def _socket_parent() -> str:
    """The folder to make the socket's folder in: the temporary folder, or
    ``/tmp`` when the temporary folder's path is too long for a Unix socket.

    Raises:
        OSError: neither is short enough and writable (``ENAMETOOLONG``).
    """
    temp = tempfile.gettempdir()
    for parent in (temp, _SHORT_TEMP):
        fits = len(os.fsencode(parent)) + _SOCKET_NAME_BYTES <= _MAX_SOCKET_PATH_BYTES
        if fits and os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
            return parent
    raise OSError(
        errno.ENAMETOOLONG,
        f"the temporary folder is too long for a Unix socket path (at most "
        f"{_MAX_SOCKET_PATH_BYTES - _SOCKET_NAME_BYTES} bytes) and {_SHORT_TEMP} is not "
        "writable: set TMPDIR to a shorter folder",
        temp,
    )


class Child:
    """A process forked by the server: the parts of ``subprocess.Popen`` kvfuzz uses.

    Attributes:
        pid: the child's process id (a child of the server, not of this process).
        returncode: ``None`` while running; the exit status, or ``-SIG`` if killed.
        args: the command it stands for (``[python, -m, MODULE, *ARGS]``).
        stdin, stdout, stderr: text streams of the pipes :func:`spawn` made, or ``None``.
        session: the child leads a session (and process group) of its own:
            signals reach every process of its group.
    """

    def __init__(
        self, connection: socket.socket, pid: int, args: list[str], *, session: bool = False
    ) -> None:
        self._connection = connection
        self._reader = connection.makefile("rb")
        self.pid = pid
        self.args = args
        self.session = session
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
        """Signal the child if it is still running (with its whole process
        group when it leads a session of its own)."""
        if self.poll() is None:
            _signal_child(self.pid, signum, group=self.session)

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


def _signal_child(pid: int, signum: int, *, group: bool) -> None:
    """Signal ``pid`` and, with ``group``, its process group (the child leads
    one once it has called ``setsid``, its first act after the fork)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)
    if group:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signum)


def spawn(
    address: str,
    module: str,
    args: Sequence[str] = (),
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    fds: tuple[int, int, int] | None = None,
    address_space_bytes: int | None = None,
    new_session: bool = False,
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
    ``new_session``: the child leads a session of its own (``setsid``, as
    ``subprocess.Popen(start_new_session=True)``), so that killing it
    (:meth:`Child.kill`, or the server stopping) kills every process it
    started, which would otherwise outlive it.

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
    if new_session:
        request["session"] = True
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
    args_run = [sys.executable, "-m", module, *args]
    return Child(connection, int(answer["pid"]), args_run, session=new_session)


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
    new_session: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, -m, MODULE, *ARGS], capture_output=True, text=True)``
    through the server: stdout and stderr captured (as files), stdin
    ``input_text`` or empty; ``address_space_bytes`` and ``new_session`` as
    for :func:`spawn`. The child is killed (with its group, in a session of
    its own) when the wait ends early: a timeout, Ctrl-C, any exception.

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
            new_session=new_session,
        )
        try:
            returncode = child.wait(timeout_s)
        except BaseException:
            child.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(_REAP_S)
            raise
        texts = []
        for stream in (stdout, stderr):
            stream.seek(0)
            texts.append(stream.read().decode("utf-8", errors="replace"))
    return subprocess.CompletedProcess(child.args, returncode, texts[0], texts[1])


# The server side ---------------------------------------------------------------


class _Stopped(BaseException):
    """SIGTERM reached the server (its owner died): stop. A ``BaseException``,
    so that no ``except Exception`` on the way (a pre-import) swallows it."""


# The server's children: pidfd -> (pid, connection, in a session of its own).
_Running = dict[int, tuple[int, socket.socket, bool]]


def _stop_on_sigterm(signum: int, frame: types.FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop, not two
    raise _Stopped


def _die_with_owner(owner: int | None) -> None:
    """Ask Linux to SIGTERM the server when its owner dies (SIGTERM stops it:
    :class:`_Stopped`), and stop at once if the owner is already gone. Ctrl-C
    is the owner's to handle: the server ignores SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    if owner is None:
        return
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != owner:  # died before the request took effect
        raise _Stopped


def serve(address: str, owner: int | None = None) -> None:
    """Run the server (in a fresh interpreter): read the preload list on stdin
    (one name a line, ended by an empty line), import it, print ``ready``,
    then fork a child per connection until stdin closes or SIGTERM arrives
    (sent by Linux when ``owner``, the pid of the process that started the
    server, dies). Either way the running children are killed and the
    socket's folder removed.

    Returns only in a forked child, after the child's module has run; the
    interpreter then exits as ``python -m`` would.
    """
    server = os.getpid()
    running: _Running = {}
    request = None
    try:
        _die_with_owner(owner)
        request = _serve(address, running)
    except _Stopped:
        pass
    finally:
        if os.getpid() == server:  # not in a forked child, which returns below
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            _kill_children(running)
            shutil.rmtree(os.path.dirname(address), ignore_errors=True)
    if request is not None:
        _become(*request)


def _serve(address: str, running: _Running) -> tuple[dict[str, Any], list[int]] | None:
    """Pre-import, listen, fork until stdin closes (``None``); in a forked
    child, its request and fds."""
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
    try:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
    except OSError:  # the owner is gone (a broken pipe): nothing to serve
        listener.close()
        return None
    request = _loop(listener, running)
    if request is None:
        listener.close()
    return request


def _kill_children(running: _Running) -> None:
    """SIGKILL every running child (with its group, in a session of its own)
    and reap it."""
    for pidfd, (pid, connection, session) in list(running.items()):
        _signal_child(pid, signal.SIGKILL, group=session)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            os.close(pidfd)
        connection.close()
    running.clear()


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


def _loop(listener: socket.socket, running: _Running) -> tuple[dict[str, Any], list[int]] | None:
    """Serve until stdin closes (``None``, the children still in ``running``);
    in a forked child, its request and fds."""
    control = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([control, listener, *running], [], [])
        for fd in ready:
            if fd == control:
                if not os.read(control, 4096):
                    return None
            elif fd is listener:
                connection, _ = listener.accept()
                forked = _fork(connection, listener, running)
                if forked is not None:
                    return forked
            else:
                assert isinstance(fd, int)
                pid, connection, session = running.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                if session:  # what the child started and left running dies with it
                    _signal_child(pid, signal.SIGKILL, group=True)
                with contextlib.suppress(OSError):
                    code = os.waitstatus_to_exitcode(status)
                    connection.sendall(json.dumps({"returncode": code}).encode() + b"\n")
                connection.close()


def _fork(
    connection: socket.socket,
    listener: socket.socket,
    running: _Running,
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
    session = bool(request.get("session"))
    pid = os.fork()
    if pid == 0:
        if session:
            os.setsid()
        listener.close()
        connection.close()
        for pidfd, (_, other, _) in running.items():
            os.close(pidfd)
            other.close()
        running.clear()
        return request, fds
    for fd in fds:
        os.close(fd)
    running[os.pidfd_open(pid)] = (pid, connection, session)
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

    # The signal handlers of a fresh interpreter (the server ignores Ctrl-C
    # and stops on SIGTERM).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
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

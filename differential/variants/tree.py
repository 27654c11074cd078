"""Tree variants: a vLLM source tree (a checkout or an unpacked wheel) at a path.

``tree:PATH`` names the folder that contains the ``vllm`` package;
``tree:PATH@REF`` checks REF of the git repository at PATH out into a worktree
kvfuzz manages (``PATH/.kvfuzz-worktrees/REF``), moved to REF's current commit
every time the variant is resolved. Two vLLM versions cannot share
a process, so each tree runs in its own long-lived worker process
(:mod:`differential.driver.worker`) that imports that tree's vLLM once and
serves many scenarios over JSON lines. A scenario that hangs is stopped at the
per-scenario timeout and a worker that dies is restarted; both come back as
runs the oracle reports as ``timeout`` / ``crash`` findings. The worker's
stderr is kept (its last lines) and shown when it dies. A worker that cannot
start (its vLLM raises on import, or hangs past the start-up timeout) or
reports a failure of kvfuzz's own driver raises ``InternalError``: kvfuzz's
failure, never a finding.

The start-up limit (importing the tree's vLLM) is ``KVFUZZ_TREE_START_TIMEOUT``
seconds (default 180), or the per-scenario timeout if that is longer. It
follows the time the start actually needs: a worker still using CPU when the
limit passes (a loaded machine slows an import, it does not stop it) is given
the limit again, up to :data:`MAX_START_WINDOWS` limits in all; one that used
no CPU over a whole limit (a hung import) is stopped. A worker that cannot
start raises :class:`WorkerStartFailed`, naming its variant, so a command can
go on without it or write what it has.

Nothing here imports vLLM.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from differential import forkserver
from differential.capabilities import Unsupported, equivalent_scenario
from differential.driver.protocol import PROTOCOL_VERSION
from differential.driver.worker import PARENT_ENV
from differential.errors import InternalError, KvfuzzError, VariantError
from differential.observation import RunObservation
from differential.scenario import Scenario

__all__ = [
    "MAX_START_WINDOWS",
    "TreeWorker",
    "TreeWorkerError",
    "WorkerDied",
    "WorkerStartFailed",
    "resolve_commit",
    "resolve_tree",
    "run_tree",
    "scenario_as_run",
    "shutdown_workers",
    "start_timeout_s",
]

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_START_TIMEOUT_S = 180.0
START_TIMEOUT_ENV = "KVFUZZ_TREE_START_TIMEOUT"
MAX_START_WINDOWS = 10  # a start still using CPU is given the limit again, this often in all
_START_PROGRESS_CPU_S = 0.05  # CPU seconds a start must use in one limit to count as progress
_STDERR_LINES = 40
_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the differential package


def start_timeout_s(timeout_s: float = 0.0) -> float:
    """Seconds a worker may take to import its vLLM and answer hello.

    ``KVFUZZ_TREE_START_TIMEOUT`` (default 180), or ``timeout_s`` if longer.

    Raises:
        VariantError: the environment variable is not a positive number.
    """
    text = os.environ.get(START_TIMEOUT_ENV)
    value = DEFAULT_START_TIMEOUT_S
    if text is not None:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise VariantError(
                f"{START_TIMEOUT_ENV} = {text[:40]!r} is invalid: allowed a positive "
                "number of seconds"
            )
    return max(value, timeout_s)


def resolve_tree(spec: str, *, folder: str | None = None) -> Path:
    """The folder holding ``vllm/`` for ``PATH`` or ``PATH@REF``.

    Args:
        spec: ``PATH`` or ``PATH@REF``.
        folder: the name of REF's worktree under ``PATH/.kvfuzz-worktrees``
            (default: REF, ``/`` replaced by ``_``); one name reused for
            changing refs keeps one worktree, moved to each.

    Raises:
        VariantError: a path without a ``vllm`` package, or a ref git cannot check out.
    """
    path_text, _, ref = spec.partition("@")
    path = Path(path_text).expanduser().resolve()
    if ref:
        path = _checkout(spec, path, ref, folder or ref.replace("/", "_"))
    if not (path / "vllm" / "__init__.py").is_file():
        raise VariantError(
            f"tree:{spec}: {path} has no vllm/__init__.py; allowed: a vLLM checkout or an "
            "unpacked wheel (the folder containing the vllm package)"
        )
    return path


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=False)


def resolve_commit(repo: Path, ref: str) -> str | None:
    """The full commit id REF names in the git repository at ``repo``, or
    ``None`` (not a repository, or a ref that does not resolve to a commit)."""
    resolved = _git(
        "-C", str(repo), "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"
    )
    if resolved.returncode != 0:
        return None
    return resolved.stdout.strip() or None


def _checkout(spec: str, repo: Path, ref: str, folder: str) -> Path:
    """The worktree of ``repo`` at REF's current commit (created or moved there)."""
    resolved = _git(
        "-C", str(repo), "rev-parse", "--verify", "--end-of-options", f"{ref}^{{commit}}"
    )
    if resolved.returncode != 0:
        raise VariantError(f"tree:{spec}: cannot check out {ref!r}: {resolved.stderr.strip()}")
    commit = resolved.stdout.strip()
    worktree = repo / ".kvfuzz-worktrees" / folder
    if not worktree.exists():
        done = _git("-C", str(repo), "worktree", "add", "--detach", str(worktree), commit)
    elif _commit(worktree, short=False) != commit:
        done = _git("-C", str(worktree), "checkout", "--quiet", "--force", "--detach", commit)
    else:
        return worktree
    if done.returncode != 0:
        raise VariantError(f"tree:{spec}: cannot check out {ref!r}: {done.stderr.strip()}")
    return worktree


def _commit(tree: Path, *, short: bool = True) -> str:
    done = _git("-C", str(tree), "rev-parse", *(["--short=12"] if short else []), "HEAD")
    return done.stdout.strip() if done.returncode == 0 else ""


def _exit_text(returncode: int | None) -> str:
    if returncode is None:
        return "closed its output but is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def _drain(pipe: IO[str], tail: collections.deque[str]) -> None:
    for line in pipe:
        tail.append(line.rstrip("\n"))


_TREE_WORKER = [sys.executable, "-m", "differential.driver.worker"]


def _launch(
    command: list[str], env: dict[str, str], cwd: Path
) -> subprocess.Popen[str] | forkserver.Child:
    """Start ``command`` in folder ``cwd`` with pipes on its stdin, stdout and
    stderr (text, UTF-8, line-buffered input). ``python -m`` puts its working
    folder first on ``sys.path``, so a tree worker runs in its tree's folder:
    started inside another vLLM checkout (``kvfuzz gate`` runs in the pull
    request's), it would import that checkout's ``vllm`` instead. The tree worker (``python -m
    differential.driver.worker`` on this Python) is forked from the fork
    server ``KVFUZZ_FORKSERVER`` names when it can serve it (about 1
    CPU-second, against 7 for a fresh interpreter); any other command, or a
    refusal, starts a fresh process."""
    address = os.environ.get(forkserver.ENV)
    if address and command == _TREE_WORKER:
        # A forked worker's parent is the fork server, not this process: the
        # worker's start-up check that its parent is alive would stop it.
        env = {k: v for k, v in env.items() if k != PARENT_ENV}
        pipes = [os.pipe() for _ in range(3)]  # (read, write) each
        ends = (pipes[0][0], pipes[1][1], pipes[2][1])
        try:
            child = forkserver.spawn(
                address, "differential.driver.worker", cwd=cwd, env=env, fds=ends
            )
        except (forkserver.Unservable, OSError):
            for read, write in pipes:
                os.close(read)
                os.close(write)
        else:
            for fd in ends:
                os.close(fd)
            utf8 = "utf-8"
            child.stdin = os.fdopen(pipes[0][1], "w", 1, utf8, "replace")
            child.stdout = os.fdopen(pipes[1][0], "r", -1, utf8, "replace")
            child.stderr = os.fdopen(pipes[2][0], "r", -1, utf8, "replace")
            return child
    return subprocess.Popen(
        command,
        cwd=cwd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        encoding="utf-8",
        errors="replace",
        bufsize=1,
    )


class WorkerDied(RuntimeError):
    """The worker process exited (or closed its output) unexpectedly."""


class TreeWorkerError(InternalError):
    """A tree's worker could not start, or kvfuzz's driver failed inside it.

    kvfuzz's failure (exit 3), never a finding; the message is the worker's own.

    Attributes:
        variant: the variant whose worker failed (``tree:...``, ``release:...``).
    """

    def __init__(self, message: str, variant: str = "") -> None:
        KvfuzzError.__init__(self, message)
        self.variant = variant


class WorkerStartFailed(TreeWorkerError):
    """A tree's worker could not start: its vLLM raised on import, or the
    import hung (no CPU used over a whole start limit) or outlasted
    :data:`MAX_START_WINDOWS` limits. Commands report the variant as not
    started, with what it would have run, and write every result they have."""


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user and system, its reaped children's included) process
    ``pid`` has used, read from ``/proc/PID/stat``; ``None`` where it cannot
    be read (not Linux, or the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        fields = text.rsplit(")", 1)[1].split()  # fields 3.. (the name may hold spaces)
        ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class _StartProgress:
    """Whether a starting worker is still making progress when its limit passes.

    It is when it has used at least :data:`_START_PROGRESS_CPU_S` CPU seconds
    since the limit last passed (a loaded machine gives it less CPU, not
    none) and has not yet had :data:`MAX_START_WINDOWS` limits. Where its
    CPU time cannot be read, a passed limit ends the start.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.windows = 1
        self.busy = False  # it used CPU since the limit last passed
        self._cpu = _cpu_seconds(pid)

    def still_working(self) -> bool:
        """Called when the limit passes: give the worker the limit again?"""
        cpu = _cpu_seconds(self.pid)
        previous, self._cpu = self._cpu, cpu
        self.busy = (
            cpu is not None and previous is not None and cpu - previous >= _START_PROGRESS_CPU_S
        )
        if not self.busy or self.windows >= MAX_START_WINDOWS:
            return False
        self.windows += 1
        return True


@dataclass
class TreeWorker:
    """One worker process serving one tree variant.

    Attributes:
        name: the variant name (``tree:...``).
        tree: the folder holding the tree's ``vllm`` package.
        timeout_s: per-scenario timeout, in seconds.
    """

    name: str
    tree: Path
    timeout_s: float = DEFAULT_TIMEOUT_S
    process: subprocess.Popen[str] | forkserver.Child | None = None
    vllm_version: str = ""
    capabilities: dict[str, bool] | None = None
    stderr_tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=_STDERR_LINES)
    )
    _reader: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> None:
        """Start the process and read its hello (vLLM version, capabilities).

        The start limit (:func:`start_timeout_s`) follows the time the start
        needs: while the worker keeps using CPU it is given the limit again,
        up to :data:`MAX_START_WINDOWS` limits in all.

        Raises:
            WorkerStartFailed: the worker died or hung while importing its
                vLLM (the message ends with the worker's stderr).
        """
        env = self.environment()
        env[PARENT_ENV] = str(os.getpid())  # the worker dies with this process
        self.stderr_tail.clear()
        self.process = _launch(self.command(), env, self.tree)
        assert self.process.stderr is not None
        self._reader = threading.Thread(
            target=_drain, args=(self.process.stderr, self.stderr_tail), daemon=True
        )
        self._reader.start()
        limit = start_timeout_s(self.timeout_s)
        started = time.monotonic()
        progress = _StartProgress(self.process.pid)
        try:
            hello = self._ask({"op": "hello"}, limit, patience=progress.still_working)
        except WorkerDied as exc:
            self.stop()
            raise WorkerStartFailed(
                f"{self.name}: the worker died while importing vLLM from {self.tree}: {exc}",
                self.name,
            ) from None
        if hello is None:
            tail = self._tail()
            self.stop()
            waited = time.monotonic() - started
            why = (
                f"still using CPU after {MAX_START_WINDOWS} times the limit"
                if progress.busy
                else f"it used no CPU in its last {limit:g} s"
            )
            raise WorkerStartFailed(
                f"{self.name}: the worker for {self.tree} did not start within {waited:.0f} s "
                f"(importing vLLM; {why}; {START_TIMEOUT_ENV} = {limit:g} s sets the limit){tail}",
                self.name,
            )
        self.vllm_version = self.version(hello)
        self.capabilities = hello["capabilities"]

    def command(self) -> list[str]:
        """The worker's command line: this Python running the tree worker."""
        return list(_TREE_WORKER)

    def environment(self) -> dict[str, str]:
        """The worker's environment: the tree, then kvfuzz, first on ``PYTHONPATH``."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.tree), str(_ROOT), *filter(None, [env.get("PYTHONPATH")])]
        )
        return env

    def version(self, hello: dict[str, Any]) -> str:
        """The version a run records: the hello's vLLM version and the tree's commit."""
        commit = _commit(self.tree)
        return str(hello["vllm_version"]) + (f" ({commit})" if commit else "")

    def stop(self, *, grace_s: float = 0.0) -> None:
        """Kill the process (if any), after ``grace_s`` seconds for it to end
        by itself once its stdin is closed (it then removes what it wrote in
        the temporary folder); a worker in a hung scenario is killed then."""
        if self.process is not None:
            if grace_s > 0 and self.process.stdin is not None:
                with contextlib.suppress(OSError):
                    self.process.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=grace_s)
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            if self._reader is not None:
                self._reader.join(timeout=5)  # the pipe ends with the process
                self._reader = None
            for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
                if pipe is not None:
                    pipe.close()
            self.process = None

    def _tail(self, lines: int = _STDERR_LINES) -> str:
        time.sleep(0.05)  # let the reader thread take the last lines
        kept = list(self.stderr_tail)[-lines:]
        return ("; its stderr ends with:\n" + "\n".join(kept)) if kept else ""

    def _died(self) -> WorkerDied:
        process = self.process
        assert process is not None
        try:
            returncode = process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            returncode = None
        return WorkerDied(f"{_exit_text(returncode)}{self._tail()}")

    def _ask(
        self,
        message: dict[str, Any],
        timeout_s: float,
        *,
        patience: Callable[[], bool] | None = None,
    ) -> dict[str, Any] | None:
        """Send ``message`` and read the reply; ``None`` when none came within
        ``timeout_s`` seconds (each time ``patience`` says so when they pass,
        ``timeout_s`` more)."""
        process = self.process
        assert process is not None and process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(json.dumps({"v": PROTOCOL_VERSION, **message}) + "\n")
            process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if patience is None or not patience():
                    return None
                deadline += timeout_s
                continue
            ready, _, _ = select.select([process.stdout], [], [], remaining)
            if ready:
                line = process.stdout.readline()
                if not line:
                    raise self._died()
                try:
                    reply = dict(json.loads(line))
                except ValueError:
                    raise TreeWorkerError(
                        f"{self.name}: the worker broke the protocol: {line[:200]!r}", self.name
                    ) from None
                if "internal_error" in reply:
                    error = TreeWorkerError(f"{self.name}: {reply['internal_error']}", self.name)
                    error.add_note(f"worker traceback:\n{reply.get('traceback', '')}")
                    raise error
                return reply

    def run(
        self,
        scenario: Scenario,
        *,
        dense: bool = False,
        record_cache_map: bool = False,
        scheduler: bool = False,
    ) -> RunObservation:
        """Run ``scenario`` in the worker; timeouts and deaths become runs, not errors.

        Raises:
            InternalError: the worker could not start, or kvfuzz's driver
                failed inside it (the worker's own message).
        """
        if self.process is None:
            self.start()
        request = {
            "op": "run",
            "variant": self.name,
            "scenario": scenario.to_dict(),
            "dense": dense,
            "record_cache_map": record_cache_map,
        }
        if scheduler:
            request["mode"] = "scheduler"
        retention = None if dense else scenario.retention_interval_tokens
        try:
            reply = self._ask(request, self.timeout_s)
        except WorkerDied as exc:
            self.stop()
            return RunObservation(
                self.name,
                self.vllm_version,
                None,
                (),
                error=f"the worker process {exc}",
                retention_interval_tokens=retention,
            )
        if reply is None:
            self.stop()  # restarted on the next run
            return RunObservation(
                self.name,
                self.vllm_version,
                None,
                (),
                timed_out=True,
                error=f"no answer within {self.timeout_s:g} s; the worker was restarted",
                retention_interval_tokens=retention,
            )
        # Every field as the worker's driver filled it (blocks recorded, the
        # driving mode, the pool, ...); only the version gains the tree's commit.
        return dataclasses.replace(
            RunObservation.from_dict(reply["run"]), vllm_version=self.vllm_version
        )


_WORKERS: dict[str, TreeWorker] = {}


def run_tree(
    name: str,
    tree: Path,
    scenario: Scenario,
    *,
    dense: bool = False,
    record_cache_map: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    scheduler: bool = False,
) -> RunObservation:
    """Run ``scenario`` on the tree variant ``name``, starting its worker once
    (``scheduler``: through that tree's vLLM ``Scheduler``, scheduler mode)."""
    worker = _WORKERS.get(name)
    if worker is None:
        worker = _WORKERS[name] = TreeWorker(name, tree, timeout_s)
    worker.timeout_s = timeout_s
    return worker.run(scenario, dense=dense, record_cache_map=record_cache_map, scheduler=scheduler)


def scenario_as_run(name: str, scenario: Scenario) -> Scenario:
    """The scenario tree variant ``name`` ran for ``scenario`` (its release's equivalent).

    See :func:`differential.capabilities.equivalent_scenario`; ``scenario``
    itself before the worker has started, or when the tree has no equivalent
    (its run is then *unsupported* and nothing is judged).
    """
    worker = _WORKERS.get(name)
    if worker is None or worker.capabilities is None:
        return scenario
    try:
        return equivalent_scenario(scenario, worker.capabilities)
    except Unsupported:
        return scenario


def shutdown_workers() -> None:
    """Stop every worker (also done at interpreter exit). A tree worker
    writes nothing to clean up, so it is killed at once (``kvfuzz mutate``
    stops one per mutant)."""
    while _WORKERS:
        _, worker = _WORKERS.popitem()
        worker.stop()


atexit.register(shutdown_workers)

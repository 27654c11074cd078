"""Tree variants: a vLLM source tree (a checkout or an unpacked wheel) at a path.

``tree:PATH`` names the folder that contains the ``vllm`` package;
``tree:PATH@REF`` checks REF of the git repository at PATH out into a worktree
kvfuzz manages (``PATH/.kvfuzz-worktrees/REF``). Two vLLM versions cannot share
a process, so each tree runs in its own long-lived worker process
(:mod:`differential.driver.worker`) that imports that tree's vLLM once and
serves many scenarios over JSON lines. A scenario that hangs is stopped at the
per-scenario timeout and a worker that dies is restarted; both come back as
runs the oracle reports as ``timeout`` / ``crash`` findings.

Nothing here imports vLLM.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from differential.errors import VariantError
from differential.observation import RunObservation
from differential.scenario import Scenario

__all__ = ["TreeWorker", "resolve_tree", "run_tree", "shutdown_workers"]

PROTOCOL_VERSION = 1
DEFAULT_TIMEOUT_S = 60.0
_START_TIMEOUT_S = 180.0
_ROOT = Path(__file__).resolve().parent.parent


def resolve_tree(spec: str) -> Path:
    """The folder holding ``vllm/`` for ``PATH`` or ``PATH@REF``.

    Raises:
        VariantError: a path without a ``vllm`` package, or a ref git cannot check out.
    """
    path_text, _, ref = spec.partition("@")
    path = Path(path_text).expanduser().resolve()
    if ref:
        worktree = path / ".kvfuzz-worktrees" / ref.replace("/", "_")
        if not worktree.exists():
            done = subprocess.run(
                ["git", "-C", str(path), "worktree", "add", "--detach", str(worktree), ref],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise VariantError(f"tree:{spec}: cannot check out {ref!r}: {done.stderr.strip()}")
        path = worktree
    if not (path / "vllm" / "__init__.py").is_file():
        raise VariantError(
            f"tree:{spec}: {path} has no vllm/__init__.py; allowed: a vLLM checkout or an "
            "unpacked wheel (the folder containing the vllm package)"
        )
    return path


def _commit(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else ""


class WorkerDied(RuntimeError):
    """The worker process exited (or closed its output) unexpectedly."""


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
    process: subprocess.Popen[str] | None = None
    vllm_version: str = ""
    capabilities: dict[str, bool] | None = None

    def start(self) -> None:
        """Start the process and read its hello (vLLM version, capabilities)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.tree), str(_ROOT), *filter(None, [env.get("PYTHONPATH")])]
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "differential.driver.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
        )
        hello = self._ask({"op": "hello"}, _START_TIMEOUT_S)
        if hello is None:
            self.stop()
            raise VariantError(f"{self.name}: the worker did not start within {_START_TIMEOUT_S} s")
        commit = _commit(self.tree)
        self.vllm_version = hello["vllm_version"] + (f" ({commit})" if commit else "")
        self.capabilities = hello["capabilities"]

    def stop(self) -> None:
        """Kill the process (if any)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            for pipe in (self.process.stdin, self.process.stdout):
                if pipe is not None:
                    pipe.close()
            self.process = None

    def _ask(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        process = self.process
        assert process is not None and process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(json.dumps({"v": PROTOCOL_VERSION, **message}) + "\n")
            process.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerDied(str(exc)) from None
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([process.stdout], [], [], remaining)
            if ready:
                line = process.stdout.readline()
                if not line:
                    raise WorkerDied(f"exit status {process.poll()}")
                return dict(json.loads(line))

    def run(
        self, scenario: Scenario, *, dense: bool = False, record_cache_map: bool = False
    ) -> RunObservation:
        """Run ``scenario`` in the worker; timeouts and deaths become runs, not errors."""
        if self.process is None:
            self.start()
        request = {
            "op": "run",
            "variant": self.name,
            "scenario": scenario.to_dict(),
            "dense": dense,
            "record_cache_map": record_cache_map,
        }
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
                error=f"worker process died: {exc}",
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
        run = RunObservation.from_dict(reply["run"])
        return RunObservation(
            run.variant,
            self.vllm_version,
            run.settings,
            run.requests,
            run.evicted_blocks,
            run.error,
            run.retention_interval_tokens,
            run.timed_out,
            run.unsupported,
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
) -> RunObservation:
    """Run ``scenario`` on the tree variant ``name``, starting its worker once."""
    worker = _WORKERS.get(name)
    if worker is None:
        worker = _WORKERS[name] = TreeWorker(name, tree, timeout_s)
    worker.timeout_s = timeout_s
    return worker.run(scenario, dense=dense, record_cache_map=record_cache_map)


def shutdown_workers() -> None:
    """Stop every worker (also done at interpreter exit)."""
    while _WORKERS:
        _, worker = _WORKERS.popitem()
        worker.stop()


atexit.register(shutdown_workers)

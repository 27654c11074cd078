"""Small scenario factories shared by the tests."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from differential import forkserver
from differential.observation import RequestObservation, RunObservation
from differential.scenario import (
    Drafter,
    DrafterKind,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
)

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

    from differential.compare import VariantResult

ROOT = Path(__file__).resolve().parent.parent
CORPORA = ROOT / "corpora"


def layout_scenario(
    *groups: KVCacheGroup,
    drafter: Drafter | None = None,
    requests: tuple[RequestSpec, ...] = (RequestSpec(64, 4), RequestSpec(50, 4)),
    **kwargs: object,
) -> Scenario:
    """A scenario of ``groups`` for layout tests: a 68-token writer and a
    sibling sharing 50 of its 64-token shared prefix (unless ``requests``
    says otherwise), no drafter unless ``drafter``."""
    return Scenario(
        kv_cache_groups=groups,
        requests=requests,
        shared_prefix_tokens=64,
        drafter=drafter or Drafter(),
        **kwargs,  # type: ignore[arg-type]
    )


def hybrid(
    full_block: int,
    swa_block: int,
    window: int,
    *,
    prefix: int,
    requests: tuple[RequestSpec, ...],
    retention: int | None,
    drafter: DrafterKind = DrafterKind.MTP,
    spec_tokens: int = 3,
    chunk: int = 2048,
    **kwargs: object,
) -> Scenario:
    """A full-attention + one sliding-window scenario, lookahead hashes off."""
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, full_block),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, swa_block, window),
        ),
        requests=requests,
        shared_prefix_tokens=prefix,
        retention_interval_tokens=retention,
        drafter=Drafter(drafter, 0 if drafter is DrafterKind.NONE else spec_tokens),
        disable_lookahead_block_hashes=bool(kwargs.pop("disable_lookahead_block_hashes", True)),
        prefill_chunk_tokens=chunk,
        **kwargs,  # type: ignore[arg-type]
    )


def triton(
    drafter: DrafterKind = DrafterKind.MTP, *, retention: int | None = 8192, **kwargs: object
) -> Scenario:
    """The Triton seed geometry: SWA 16, full 32, window 1024, 4 x (16384 + 64)."""
    return hybrid(
        32,
        16,
        1024,
        prefix=16384,
        requests=tuple(RequestSpec(16384, 64) for _ in range(4)),
        retention=retention,
        drafter=drafter,
        **kwargs,
    )


# Set to 0 to run every ``python -m`` of the tests in a fresh interpreter.
FORKSERVER_SWITCH = "KVFUZZ_TEST_FORKSERVER"
_server: forkserver.ForkServer | None = None
_server_failed = False


def reach(
    condition: Callable[[Scenario], bool], strategy: SearchStrategy[Scenario] | None = None
) -> Scenario:
    """An example of ``strategy`` (a Hypothesis strategy of scenarios; default
    :func:`fuzz.strategies.scenarios`) meeting ``condition``, as a reach test
    asks: does the generator reach this layout at all?

    The same search every run (derandomized, no example database), of at most
    3,000 examples, and without shrinking: a reach test needs an example, not
    the smallest, and shrinking was most of its time.

    Raises:
        hypothesis.errors.NoSuchExample: no example met ``condition``.
    """
    from hypothesis import HealthCheck, Phase, find, settings

    from fuzz.strategies import scenarios

    return find(
        scenarios() if strategy is None else strategy,
        condition,
        settings=settings(
            max_examples=3000,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,
            phases=(Phase.generate,),
        ),
    )


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does
    not), from ``/proc`` (Linux)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def still_alive(pids: Iterable[int], within_s: float) -> list[int]:
    """The processes of ``pids`` still :func:`alive` after ``within_s`` seconds:
    polled every 0.1 s, returning as soon as none is (a fixed sleep would idle
    a core)."""
    import time

    pending = list(pids)
    deadline = time.monotonic() + within_s
    while True:
        pending = [pid for pid in pending if alive(pid)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(0.1)


def dead_pid() -> int:
    """The pid of a process that has exited (a child started and reaped here):
    what a folder left by a killed run is named by."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    return int(gone.stdout)


def forkserver_address() -> str | None:
    """The address of this test process's fork server, started on first use
    (pre-importing what importing kvfuzz's driver imports); ``None`` when
    switched off or when it cannot start."""
    global _server, _server_failed
    if os.environ.get(FORKSERVER_SWITCH) == "0" or _server_failed:
        return None
    if _server is None:
        try:
            import differential.driver.features
            import differential.driver.runner
            import differential.driver.scheduler_mode  # noqa: F401

            _server = forkserver.ForkServer.start(forkserver.default_preload())
        except Exception:  # no vLLM, no pidfd_open: fresh interpreters, as before
            _server_failed = True
            return None
        atexit.register(_server.close)
    return _server.address


def python_module(
    module: str,
    *args: str,
    cwd: Path = ROOT,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    timeout: float | None = None,
    address_space_bytes: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` with stdout and stderr captured, as
    ``subprocess.run(..., capture_output=True, text=True)`` runs it.

    The process is forked from a fork server that has pre-imported vLLM's
    dependencies (:mod:`differential.forkserver`): a fresh ``python -m`` in
    every respect the tests see (the module run as ``__main__``, its own
    working directory, environment, ``sys.path``, file descriptors and exit
    status), in 1 CPU-second instead of 7. Its own tree workers are forked
    from the same server (``python -m pytest`` too: the child first drops the
    pre-imported packages of pytest's plugins, see
    :func:`differential.forkserver.spawn`). Everything with
    ``KVFUZZ_TEST_FORKSERVER=0``, or when the server cannot serve the request,
    runs in a fresh interpreter.

    ``address_space_bytes``: the process's ``RLIMIT_AS`` (bytes), inherited by
    everything it starts: its own workers are then fresh interpreters, never
    forked from the server (which would not inherit the limit).
    """
    environment = dict(os.environ if env is None else env)
    if address_space_bytes is not None:
        environment.pop(forkserver.ENV, None)
    address = forkserver_address()
    if address is not None:
        if address_space_bytes is None:
            environment[forkserver.ENV] = address
        try:
            return forkserver.run_module(
                address,
                module,
                args,
                cwd=cwd,
                env=environment,
                input_text=input,
                timeout_s=timeout,
                address_space_bytes=address_space_bytes,
            )
        except forkserver.Unservable:
            environment.pop(forkserver.ENV, None)
    limit = (
        None
        if address_space_bytes is None
        else functools.partial(
            resource.setrlimit, resource.RLIMIT_AS, (address_space_bytes, address_space_bytes)
        )
    )
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=environment,
        input=input,
        timeout=timeout,
        check=False,
        preexec_fn=limit,
    )


def kvfuzz_cli(*args: str, cwd: Path = ROOT, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run the ``kvfuzz`` command line (``python -m differential.cli``): see
    :func:`python_module`."""
    return python_module("differential.cli", *args, cwd=cwd, **kwargs)  # type: ignore[arg-type]


def scheduler_run(*requests: RequestObservation, **changes: object) -> RunObservation:
    """A scheduler-mode run of stock vLLM 0.33.0 (``unfixed``) observing
    ``requests``, with ``changes`` to its other fields, for hand-worked
    oracle cases."""
    run = RunObservation(
        variant="unfixed", vllm_version="0.33.0", settings=None, requests=requests, mode="scheduler"
    )
    return dataclasses.replace(run, **changes)  # type: ignore[arg-type]


def stock_result(path: Path) -> VariantResult:
    """The scenario file at ``path`` run and judged on stock vLLM alone
    (``unfixed``): its run, its findings (vLLM is imported on first use)."""
    from differential.compare import compare_variants
    from differential.corpus import load_entry
    from differential.variants import parse_variants

    return compare_variants(load_entry(path).scenario, parse_variants("unfixed")).results[0]

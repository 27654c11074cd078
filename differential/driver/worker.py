"""A long-lived worker that runs scenarios on one vLLM source tree.

Started by :mod:`differential.variants.tree` as ``python -m differential.driver.worker``
with the tree first on ``PYTHONPATH``, it imports that tree's vLLM once and
then serves requests, one JSON object per line (protocol version 1):

* in ``{"v": 1, "op": "hello"}`` -> out ``{"v": 1, "vllm_version": ..., "capabilities": {...}}``
* in ``{"v": 1, "op": "run", "variant": NAME, "scenario": {...}, "dense": bool,
  "record_cache_map": bool}`` -> out ``{"v": 1, "run": <RunObservation dict>}``;
  with ``"mode": "scheduler"`` the scenario runs through that vLLM's
  ``Scheduler`` (:mod:`differential.driver.scheduler_mode`), else the manager
  driver
* a failure of kvfuzz's own driver code -> out ``{"v": 1, "internal_error": MESSAGE,
  "traceback": TEXT}`` (the parent raises ``InternalError`` with MESSAGE)

Before vLLM is imported, the protocol's stdout is moved to a private file
descriptor and file descriptor 1 is pointed at stderr, so a banner or any
other print of vLLM (Python or C) cannot corrupt the protocol. The parent
keeps the tail of stderr and shows it when the worker dies.

A scenario with a model also has that vLLM plan the model's KV cache, as
an engine start does (:func:`differential.driver.planner.with_kv_cache_plan`).
Each run drives the scenario's own mode (``workload.mode``): vLLM's
``KVCacheManager`` (:func:`differential.driver.runner.run_scenario`) or its
``Scheduler`` (:func:`differential.driver.scheduler_mode.run_scheduler_scenario`),
the same calls the in-process variants make
(:func:`differential.driver.run_variant`). The scenario each run uses is the
one the release means for the scenario's intent
(:func:`differential.capabilities.equivalent_scenario`); one that
needs a feature the tree lacks, or whose equivalent is refused, is answered
with a run whose ``unsupported`` field names the missing piece (the driver
decides the rest, see :mod:`differential.driver.runner`). Only a failure of
kvfuzz's own code is an ``internal_error``.
"""

from __future__ import annotations

import sys
from typing import IO, TYPE_CHECKING, Any

from differential.driver.protocol import (
    PARENT_ENV,
    PROTOCOL_VERSION,
    ProtocolError,
    die_with_parent,
    serve,
    take_protocol_stdout,
)

if TYPE_CHECKING:
    from differential.observation import RunObservation
    from differential.scenario import Scenario

__all__ = ["PARENT_ENV", "PROTOCOL_VERSION", "capabilities", "main"]


def capabilities() -> dict[str, bool]:
    """Which prefix-cache features the importable vLLM has (feature name -> present)."""
    from differential.driver.features import detect

    return dict(detect())


def _serve(stdin: IO[str], stdout: IO[str]) -> None:
    import vllm

    from differential.capabilities import Unsupported, equivalent_scenario
    from differential.driver.runner import run_scenario
    from differential.errors import InternalError
    from differential.observation import RunObservation
    from differential.scenario import DriveMode, Scenario

    caps = capabilities()

    def run(request: dict[str, Any]) -> RunObservation:
        written = Scenario.from_dict(request["scenario"])
        kwargs: dict[str, Any] = {"record_cache_map": bool(request.get("record_cache_map"))}
        if request.get("dense"):
            kwargs["retention_interval_tokens"] = None
        try:
            scenario = equivalent_scenario(written, caps)
        except Unsupported as missing:  # this tree cannot run it: one run's cost
            return RunObservation(
                variant=request["variant"],
                vllm_version=vllm.__version__,
                settings=None,
                requests=(),
                retention_interval_tokens=kwargs.get(
                    "retention_interval_tokens", written.retention_interval_tokens
                ),
                unsupported=missing.reason,
            )
        # The scenario's own mode, or the caller's override, as
        # differential.driver.run_variant decides it in process.
        mode = request.get("mode")
        if mode == "scheduler" or (mode is None and scenario.workload.mode is DriveMode.SCHEDULER):
            from differential.driver.scheduler_mode import run_scheduler_scenario

            run = run_scheduler_scenario(scenario, request["variant"], **kwargs)
        else:
            run = run_scenario(scenario, request["variant"], **kwargs)
        return _with_plan(scenario, run)

    def handle(request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        if request["op"] == "hello":
            return {"vllm_version": vllm.__version__, "capabilities": caps}, False
        if request["op"] == "run":
            return {"run": run(request).to_dict()}, False
        raise ProtocolError(f"unknown op {request['op']!r}")

    def describe(exc: Exception) -> str:
        if isinstance(exc, InternalError):
            return str(exc)
        return (
            f"kvfuzz internal error (please report): the worker failed: {type(exc).__name__}: {exc}"
        )

    serve(stdin, stdout, handle, describe_failure=describe)


def _with_plan(scenario: Scenario, run: RunObservation) -> RunObservation:
    """``run`` with this tree's plan of ``scenario.model``
    (:func:`differential.driver.planner.with_kv_cache_plan`); unchanged
    without a model, or on a release whose planner kvfuzz cannot import
    (vLLM before ``vllm/v1/core/kv_cache_planning.py``): no plan to judge."""
    if scenario.model is None:
        return run
    try:
        from differential.driver.planner import with_kv_cache_plan
    except ImportError:
        return run
    return with_kv_cache_plan(scenario, run)


def main() -> None:
    """Serve requests on stdin until EOF or an ``exit`` request.

    Protocol messages go to the original stdout, duplicated to a private file
    descriptor; file descriptor 1 (and ``sys.stdout``) point at stderr from
    here on.
    """
    die_with_parent()
    _serve(sys.stdin, take_protocol_stdout())


if __name__ == "__main__":
    main()

"""A long-lived worker that runs scenarios on one vLLM source tree.

Started by :mod:`differential.tree` as ``python -m differential.driver.worker``
with the tree first on ``PYTHONPATH``, it imports that tree's vLLM once and
then serves requests, one JSON object per line (protocol version 1):

* in ``{"v": 1, "op": "hello"}`` -> out ``{"v": 1, "vllm_version": ..., "capabilities": {...}}``
* in ``{"v": 1, "op": "run", "variant": NAME, "scenario": {...}, "dense": bool,
  "record_cache_map": bool}`` -> out ``{"v": 1, "run": <RunObservation dict>}``

A scenario that needs a feature the tree lacks is answered with a run whose
``unsupported`` field names the missing piece; it is never run.
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any

PROTOCOL_VERSION = 1


def capabilities() -> dict[str, bool]:
    """Which prefix-cache features the importable vLLM has."""
    from vllm.config import SpeculativeConfig
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, SlidingWindowSpec

    manager = inspect.signature(KVCacheManager.__init__).parameters
    hasher = inspect.signature(kv_cache_utils.get_request_block_hasher).parameters
    return {
        "retention_interval": "prefix_cache_retention_interval"
        in getattr(KVCacheConfig, "__dataclass_fields__", {}),
        "lookahead_hashes": "num_hash_lookahead_tokens" in manager
        and "num_hash_lookahead_tokens" in hasher,
        "prefill_lookahead": "num_prefill_lookahead" in manager,
        "scheduler_block_size": "scheduler_block_size" in manager and "hash_block_size" in manager,
        "eagle_block_drop_config": hasattr(SpeculativeConfig, "use_eagle_block_drop"),
        "extra_retained_tokens": "extra_retained_tokens"
        in getattr(SlidingWindowSpec, "__dataclass_fields__", {}),
    }


_NEEDS = {
    "scheduler_block_size": "KVCacheManager(scheduler_block_size=, hash_block_size=)",
    "prefill_lookahead": "KVCacheManager(num_prefill_lookahead=)",
    "eagle_block_drop_config": "SpeculativeConfig.use_eagle_block_drop",
    "lookahead_hashes": "lookahead block hashes (num_hash_lookahead_tokens)",
    "retention_interval": "KVCacheConfig.prefix_cache_retention_interval",
    "extra_retained_tokens": "SlidingWindowSpec.extra_retained_tokens",
}


def missing_feature(scenario: Any, caps: dict[str, bool], dense: bool) -> str | None:
    """The first feature ``scenario`` needs that the tree lacks, or ``None``."""
    needed = ["scheduler_block_size", "prefill_lookahead", "eagle_block_drop_config"]
    if scenario.retention_interval_tokens is not None and not dense:
        needed.append("retention_interval")
    if scenario.drafter.kind.value != "none" and not scenario.disable_lookahead_block_hashes:
        needed.append("lookahead_hashes")
    if scenario.drafter.kind.value == "multi_module_mtp":
        needed.append("extra_retained_tokens")
    for feature in needed:
        if not caps.get(feature, False):
            return _NEEDS[feature]
    return None


def _serve(stdin: Any, stdout: Any) -> None:
    import vllm

    from differential.driver.runner import run_scenario
    from differential.observation import RunObservation
    from differential.scenario import Scenario

    caps = capabilities()

    def reply(message: dict[str, Any]) -> None:
        stdout.write(json.dumps({"v": PROTOCOL_VERSION, **message}) + "\n")
        stdout.flush()

    for line in stdin:
        request = json.loads(line)
        if request.get("v") != PROTOCOL_VERSION:
            reply({"error": f"protocol version {request.get('v')!r} unsupported"})
            continue
        if request["op"] == "hello":
            reply({"vllm_version": vllm.__version__, "capabilities": caps})
        elif request["op"] == "run":
            scenario = Scenario.from_dict(request["scenario"])
            dense = bool(request.get("dense"))
            lacking = missing_feature(scenario, caps, dense)
            if lacking is not None:
                run = RunObservation(
                    variant=request["variant"],
                    vllm_version=vllm.__version__,
                    settings=None,
                    requests=(),
                    unsupported=lacking,
                )
            else:
                kwargs: dict[str, Any] = {"record_cache_map": bool(request.get("record_cache_map"))}
                if dense:
                    kwargs["retention_interval_tokens"] = None
                run = run_scenario(scenario, request["variant"], **kwargs)
            reply({"run": run.to_dict()})
        elif request["op"] == "exit":
            return


def main() -> None:
    """Serve requests on stdin/stdout until EOF or an ``exit`` request."""
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # vLLM's own prints must not corrupt the protocol
    _serve(sys.stdin, real_stdout)


if __name__ == "__main__":
    main()

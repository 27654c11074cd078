"""What a scenario costs to run, and the limits kvfuzz enforces before running it.

A scenario file can ask for a 10^12-token shared prefix, 10^9 decode steps or
20000 requests; run as is, that hangs or exhausts memory with nothing on
screen. Every scenario's cost is computed from its shape alone (no vLLM) and
stated before it runs; a scenario over a limit is rejected as bad input
(exit 2) naming the limit, the cost and the flag that raises it.

Costs:

* ``requests``: sibling requests. The driver's and the oracle's work per
  request grows with the number of earlier requests (about quadratic overall).
* ``tokens``: tokens the managers process: every prompt plus every decode
  step (``sum(prompt_tokens) + requests * decode_steps``).
* ``pool_blocks``: blocks in the block pool the driver sizes so that nothing
  is evicted: per request and KV cache group, ``ceil((prompt_tokens +
  decode_steps + lookahead + 1) / block_size_tokens)``, plus the null block
  and 8 spare (as ``differential/driver/runner.py`` sizes it; the lookahead is
  bounded here by the drafter's ``num_speculative_tokens``). vLLM's
  ``BlockPool`` (vllm/v1/core/block_pool.py) builds one ``KVCacheBlock`` per
  block up front, so this is the memory cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from differential.errors import ScenarioError
from differential.scenario import Scenario

__all__ = ["DEFAULT_LIMITS", "Limits", "ScenarioCost", "check_cost", "scenario_cost"]


@dataclass(frozen=True)
class ScenarioCost:
    """A scenario's size.

    Attributes:
        requests: sibling requests.
        tokens: prompt plus decode tokens the managers process, in tokens.
        pool_blocks: block-pool size the driver allocates, in blocks.
    """

    requests: int
    tokens: int
    pool_blocks: int

    def describe(self) -> str:
        """``4 requests, 65792 tokens, 6203 pool blocks``."""
        return f"{self.requests} requests, {self.tokens} tokens, {self.pool_blocks} pool blocks"


@dataclass(frozen=True)
class Limits:
    """The largest scenario kvfuzz runs (each raised by the flag named).

    Attributes:
        max_requests: requests per scenario (``--max-requests``).
        max_tokens: prompt plus decode tokens per scenario (``--max-tokens``).
        max_pool_blocks: block-pool size per scenario, in blocks
            (``--max-pool-blocks``).
    """

    max_requests: int = 512
    max_tokens: int = 4_000_000
    max_pool_blocks: int = 1_000_000


DEFAULT_LIMITS = Limits()


def scenario_cost(scenario: Scenario) -> ScenarioCost:
    """The cost of running ``scenario`` once on one variant (no vLLM needed)."""
    prompt_tokens = sum(r.prompt_tokens for r in scenario.requests)
    decode_tokens = len(scenario.requests) * scenario.decode_steps
    extra = scenario.decode_steps + scenario.drafter.num_speculative_tokens + 1
    pool_blocks = 1 + 8
    for request in scenario.requests:
        for group in scenario.kv_cache_groups:
            pool_blocks += math.ceil((request.prompt_tokens + extra) / group.block_size_tokens)
    if scenario.workload.pool_blocks is not None:
        pool_blocks = scenario.workload.pool_blocks
    return ScenarioCost(len(scenario.requests), prompt_tokens + decode_tokens, pool_blocks)


def check_cost(
    scenario: Scenario, limits: Limits = DEFAULT_LIMITS, *, source: str | None = None
) -> ScenarioCost:
    """Reject a scenario over a limit before anything runs it.

    Returns:
        Its cost.

    Raises:
        ScenarioError: a limit is exceeded; the message names the cost, the
            limit and the flag that raises it.
    """
    cost = scenario_cost(scenario)
    checks = (
        ("cost.requests", cost.requests, limits.max_requests, "--max-requests"),
        ("cost.tokens", cost.tokens, limits.max_tokens, "--max-tokens"),
        ("cost.pool_blocks", cost.pool_blocks, limits.max_pool_blocks, "--max-pool-blocks"),
    )
    for name, value, limit, flag in checks:
        if value > limit:
            raise ScenarioError(
                name, value, f"at most {limit} (raise the limit with {flag} N)", source=source
            )
    return cost

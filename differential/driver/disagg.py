"""Disaggregated prefill and decode: the prefill instance beside the driven scheduler.

With ``workload.connector.kv_role`` ``kv_consumer`` the scheduler kvfuzz
drives is a decode instance; :class:`PrefillInstance` is the prefill
instance, a second real vLLM ``Scheduler`` (vllm/v1/core/sched/scheduler.py)
in the same process, whose KV connector (``kv_role`` ``kv_producer``,
:class:`differential.driver.connector.RemoteStoreConnector`) saves into the
store the decode instance's connector loads from.

Every request goes to the prefill instance first, as vLLM's P/D proxies
send it (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py): its
prompt with ``max_tokens`` 1 and ``kv_transfer_params``
``{"do_remote_decode": true}``. The prefill instance schedules it (its own
prefix cache, its own chunking), kvfuzz stands in for its model runner (one
sampled token when a request's prompt is computed; no drafts: the request
ends at its first token), and when the request finishes vLLM's
``Scheduler._connector_finished`` hands it to the connector, which saves
what it computed (and, as a producer, ``finalize_partial_tail_offloads``'s
Mamba partial tail) and returns the ``kv_transfer_params`` the proxy passes
on to the decode instance (``do_remote_prefill``). The proxy waits for the
prefill response before it sends the decode request, so the prefill
instance runs every request that arrives at a decode step to its end before
the decode instance sees it; its steps are its own clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from differential.driver.features import VllmCallError, vllm_call

__all__ = ["Prefill", "PrefillInstance"]


# Steps without progress after which the prefill instance is declared stuck.
_MAX_IDLE_STEPS = 64


@dataclass(frozen=True)
class Prefill:
    """What the prefill instance did with one request.

    Attributes:
        hit_tokens: its local prefix-cache hit at the first scheduling
            (``PrefillStats.num_local_cached_tokens`` of its output,
            vllm/v1/metrics/stats.py), in tokens.
        computed_tokens: the tokens it had computed when the request
            finished (``Request.num_computed_tokens``), in tokens.
        kv_transfer_params: what its ``Scheduler.update_from_output`` returned
            for the request (``EngineCoreOutput.kv_transfer_params``), for
            the decode instance.
        preemptions: how often the prefill instance preempted it
            (``Request.num_preemptions``).
    """

    hit_tokens: int
    computed_tokens: int
    kv_transfer_params: dict[str, Any] | None
    preemptions: int = 0


class PrefillInstance:
    """The prefill instance (see the module docstring).

    Args:
        scheduler: vLLM's ``Scheduler`` built with ``kv_role`` ``kv_producer``
            (its connector already sharing the decode instance's store).
        requests: vLLM's ``Request`` per scenario request, each with
            ``max_tokens`` 1 and ``kv_transfer_params`` ``do_remote_decode``.
        first_token: the token request ``i`` samples first (the scenario's
            output stream).
    """

    def __init__(
        self, scheduler: Any, requests: list[Any], first_token: Callable[[int], int]
    ) -> None:
        self.scheduler = scheduler
        self.requests = requests
        self.first_token = first_token
        self.index_of = {r.request_id: i for i, r in enumerate(requests)}
        #: Per scenario index, what the prefill instance did with it.
        self.done: dict[int, Prefill] = {}
        self.steps = 0

    def prefill(self, indices: list[int]) -> str:
        """Add requests ``indices`` and step the prefill instance until none
        is left; returns a timeline line (hits and computed tokens per
        request, the steps taken).

        Raises:
            VllmCallError: vLLM raised, or the prefill instance scheduled
                nothing for 64 steps while requests waited.
        """
        from vllm.v1.outputs import ModelRunnerOutput

        scheduler = self.scheduler
        for i in indices:
            vllm_call("Scheduler.add_request", scheduler.add_request, self.requests[i])
        first = self.steps
        idle = 0
        params: dict[int, dict[str, Any] | None] = {}
        hits: dict[int, int] = {}
        while scheduler.has_requests():
            out = vllm_call("Scheduler.schedule", scheduler.schedule)
            req_ids = list(out.num_scheduled_tokens)
            sampled = []
            for rid in req_ids:
                request = scheduler.requests[rid]
                done = request.num_computed_tokens >= request.num_tokens
                sampled.append([self.first_token(self.index_of[rid])] if done else [])
            output = ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={rid: k for k, rid in enumerate(req_ids)},
                sampled_token_ids=sampled,
            )
            outputs = vllm_call(
                "Scheduler.update_from_output", scheduler.update_from_output, out, output
            )
            for client in outputs.values():
                for o in client.outputs:
                    if o.prefill_stats is not None:
                        hits[self.index_of[o.request_id]] = o.prefill_stats.num_local_cached_tokens
                    if o.finish_reason is not None:
                        params[self.index_of[o.request_id]] = o.kv_transfer_params
            self.steps += 1
            idle = 0 if req_ids else idle + 1
            if idle > _MAX_IDLE_STEPS:
                raise VllmCallError(
                    "Scheduler.schedule",
                    RuntimeError(
                        f"the prefill instance scheduled nothing for {_MAX_IDLE_STEPS} steps "
                        f"with {len(scheduler.waiting)} request(s) waiting"
                    ),
                )
        words = []
        for i in indices:
            request = self.requests[i]
            self.done[i] = Prefill(
                hits.get(i, 0),
                request.num_computed_tokens,
                params.get(i),
                getattr(request, "num_preemptions", 0),
            )
            words.append(
                f"req-{i} (hit {self.done[i].hit_tokens}) computed {request.num_computed_tokens}"
            )
        return f"prefill instance, steps {first}..{self.steps - 1}: " + ", ".join(words)

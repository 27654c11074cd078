"""DeepSeek-V4.1's SWA bounded replay: where a request resumes after a hit.

vLLM PR #56227 ("Support encoder-side SWA-bounded replay for
DeepSeek-V4.1-Flash", merged) takes a model's sliding-window MLA caches out
of prefix caching (``SlidingWindowMLASpec(bounded_replay=True)``:
``prefix_cacheable`` false, ``prefix_replay_tokens`` its window ``W``) and
rebuilds them instead: "after a prefix hit ending at H the scheduler
recomputes the hit's last window [H-128, H) to rebuild them", and states
the scheduler's side as four promises: "a hit records
``Request.replay_start = H-128`` and rewinds the computed count by the
window; async KV-connector loads replay once the KV arrives; chunks ending
inside the replayed range allocate nothing new; hits no longer than the
window are not adopted." In vLLM 0.33.0 these are ``Scheduler.schedule``
and ``Scheduler._mark_prefix_replay`` / ``_update_waiting_for_remote_kv``
(vllm/v1/core/sched/scheduler.py).

So, in scheduler mode, for a model with a bounded-replay group, where ``H``
is what a request's admission adopted (its local hit, plus the tokens a KV
connector's store supplied; a store of prefix-cache blocks holds no window,
vLLM's default ``get_loaded_kv_cache_group_ids``), the rule ``replay``:

* ``0 < H <= W``: the hit is not adopted, so the request is first
  scheduled with nothing computed and ``replay_start`` 0; its lookup counts
  no hit in the prefix-cache statistics (:func:`adopted_hit_tokens`, read by
  :mod:`differential.oracle.metrics`);
* ``H > W``: it is first scheduled with ``H - W`` tokens computed and
  ``replay_start = H - W``;
* ``H = 0``: nothing computed, ``replay_start`` 0.

What the worker is told (``NewRequestData.num_computed_tokens`` and
``replay_start``, vllm/v1/core/sched/output.py) is recorded at the request's
first scheduling (``RequestObservation.replay``); anything else is a
``replay`` finding naming both. A request taken up again after a
preemption is not judged here. Nothing here imports vLLM.
"""

from __future__ import annotations

from differential.findings import Finding, FindingKind, Policy
from differential.observation import RequestObservation, RunObservation
from differential.scenario import Scenario

__all__ = ["adopted_hit_tokens", "owed_start", "replay_findings"]


def adopted_hit_tokens(scenario: Scenario, hit_tokens: int) -> int:
    """The tokens of a hit of ``hit_tokens`` tokens vLLM adopts, in tokens:
    none for a hit no longer than the replay window ("hits no longer than
    the window are not adopted", vLLM PR #56227), all of it otherwise or
    without a bounded-replay group."""
    window = scenario.prefix_replay_tokens
    return 0 if window and 0 < hit_tokens <= window else hit_tokens


def owed_start(scenario: Scenario, adopted_tokens: int) -> tuple[int, int]:
    """``(num_computed_tokens, replay_start)``, in tokens, owed at the first
    scheduling of a request whose admission adopted ``adopted_tokens`` (see
    the module docstring): ``(H - W, H - W)`` past the window, ``(0, 0)``
    otherwise."""
    window = scenario.prefix_replay_tokens
    if adopted_tokens > window:
        return adopted_tokens - window, adopted_tokens - window
    return 0, 0


def _adopted(scenario: Scenario, r: RequestObservation) -> int:
    if r.connector is not None:
        # Judged by the connector rules, the discard included.
        return r.connector.computed_tokens
    return adopted_hit_tokens(scenario, r.hit_tokens)


def replay_findings(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM
) -> list[Finding]:
    """One ``replay`` finding per request first scheduled with other
    computed tokens or another replay start than its adopted hit owes.

    Args:
        scenario: the scenario (its :attr:`Scenario.prefix_replay_tokens`).
        run: a scheduler-mode run (each request's ``replay`` record).
        policy: the policy recorded on the findings (the rule holds under all).
    """
    window = scenario.prefix_replay_tokens
    if not window or run.unsupported is not None:
        return []
    findings = []
    for r in run.requests:
        if r.replay is None:
            continue
        adopted = _adopted(scenario, r)
        owed = owed_start(scenario, adopted)
        if tuple(r.replay) == owed:
            continue
        computed, start = r.replay
        why = (
            f"a hit of {adopted} tokens replays its last {window}"
            if adopted > window
            else f"a hit of {r.hit_tokens} tokens, no longer than the {window}-token window, "
            "is not adopted"
            if r.hit_tokens
            else "no hit"
        )
        findings.append(
            Finding(
                FindingKind.REPLAY,
                run.variant,
                r.index,
                f"first scheduled with {computed} computed tokens and replay_start {start}, "
                f"owed {owed[0]} and {owed[1]} ({why})",
                expected_tokens=owed[0],
                hit_tokens=r.hit_tokens,
                policy=policy,
            )
        )
    return findings

"""What a bounded KV connector store keeps: vLLM's LRU offloading manager, replayed.

A bounded store (``workload.connector.capacity_chunks``) is vLLM's own
``CPUOffloadingManager`` with the ``"lru"`` cache policy
(vllm/v1/kv_offload/cpu/manager.py, vllm/v1/kv_offload/cpu/policies/lru.py),
driven by kvfuzz's stand-in connector as vLLM's offloading connector drives it
(:class:`differential.driver.connector.RemoteStoreConnector`); the driver
records every call (:class:`~differential.observation.StoreCall`). This module
replays the calls through its own statement of the policy, with no vLLM, and
says which chunks the store must still hold at each lookup:

* **room** (``CPUOffloadingManager.prepare_store``): an offered key already
  held is not stored again; the new ones take free chunks, and when fewer are
  free the manager evicts exactly the missing number of *evictable* chunks
  (stored, ``ref_cnt`` 0: not write-pending, not pinned by a load), never one
  of the offer's own keys, least recent first; if it cannot, it stores
  nothing (``prepare_store`` returns ``None``) and evicts nothing;
* **recency** (``LRUCachePolicy``): ranks are pairs; each request takes one
  rank from a shared counter at its first access (``_get_request_rank``); a
  chunk it stores is ranked ``(request rank, -end position)``
  (``insert``: "tails precede heads"), and one it reuses (offered again, or
  loaded: ``on_request_access``) is raised to that pair if lower; a lookup
  touches nothing (``CPUOffloadingManager.lookup``); when the request
  finishes (``on_request_finished``) every chunk it stored or reused that is
  still held gets a fresh rank from the counter, tail first, so its head is
  the most recent of all (``order_request_keys``: by end position, groups in
  index order); eviction takes the lowest rank, ties (one request's groups at
  one position: the same block hash) by group index (the key's bytes);
* **pins**: ``prepare_load`` pins a chunk (``ref_cnt`` + 1) until
  ``complete_load``; a stored chunk is write-pending until ``complete_store``.

The rule (:func:`lru_findings`): at each lookup the store's answer is owed
the longest prefix, on the lookup grid, whose keys the replay still holds
(every full-attention chunk before it, the sliding-window and Mamba chunks
it needs), within what the request may hit, and then past the local hit
shown to it unless that is less than a grid unit (vLLM's
``_lookup_complete_chunks``: "We can only load less than a chunk, so
skip."). An answer short of it is a ``fallback``: the store lost chunks LRU
over its capacity keeps. An answer past it is not judged: the chunks loaded
are what the writer computed, only another one was evicted instead.

The replay states vLLM 0.33.0's policy; vLLM 0.31 and 0.32 rank a chunk
by its insertion alone (no request rank), and the driver records no calls
on them, so a bounded store there is judged by adoption and the comparison
of variants only.

Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from differential.findings import Finding, FindingKind, Policy
from differential.observation import RunObservation, StoreCall
from differential.scenario import Scenario

__all__ = ["LRUReplay", "lru_findings", "owed_answer"]


@dataclass
class LRUReplay:
    """The store's chunks as the LRU policy keeps them (see the module docstring).

    Attributes:
        capacity: the store's capacity, in chunks.
        held: key id -> ``None`` while write-pending, else the loads pinning
            it (0: evictable).
        ranks: key id -> its recency rank (lowest evicted first).
        groups: key id -> its KV cache group.
    """

    capacity: int
    held: dict[int, int | None] = field(default_factory=dict)
    ranks: dict[int, tuple[int, int]] = field(default_factory=dict)
    groups: dict[int, int] = field(default_factory=dict)
    _counter: int = 0
    _request_ranks: dict[int, int] = field(default_factory=dict)
    # request -> key id -> end position, in first-access order
    _seen: dict[int, dict[int, int]] = field(default_factory=dict)

    def _request_rank(self, request: int) -> int:
        if request not in self._request_ranks:
            self._counter += 1
            self._request_ranks[request] = self._counter
        return self._request_ranks[request]

    def _access(self, request: int, keys: list[tuple[int, int, int]]) -> None:
        """A request's first access of each key raises a held one to the
        request's rank at its position (``on_request_access``)."""
        seen = self._seen.setdefault(request, {})
        new = [(k, p) for k, _, p in keys if k not in seen]
        if not new:
            return
        rank = self._request_rank(request)
        for k, p in new:
            seen[k] = p
            if k in self.held and self.ranks[k] < (rank, -p):
                self.ranks[k] = (rank, -p)

    def store(self, call: StoreCall) -> tuple[list[int], bool]:
        """Replay a ``prepare_store``: the keys it evicts, and whether it
        stored anything new or had nothing to store (false: refused)."""
        for k, g, _ in call.keys:
            self.groups[k] = g
        new = [(k, g, p) for k, g, p in call.keys if k not in self.held]
        ready = [t for t in call.keys if self.held.get(t[0], None) is not None]
        self._access(call.request, new + ready)
        if not new:
            return [], True
        missing = len(new) - (self.capacity - len(self.held))
        evicted: list[int] = []
        if missing > 0:
            offered = {k for k, _, _ in call.keys}
            candidates = sorted(
                (k for k, pins in self.held.items() if pins == 0 and k not in offered),
                key=lambda k: (self.ranks[k], self.groups[k]),
            )
            if len(candidates) < missing:
                return [], False
            evicted = candidates[:missing]
            for k in evicted:
                del self.held[k], self.ranks[k]
        rank = self._request_rank(call.request)
        for k, _, p in new:
            self.held[k] = None
            self.ranks[k] = (rank, -p)
        return evicted, True

    def finish(self, request: int) -> None:
        """Replay ``on_request_finished``: the request's held chunks become
        the most recent, tail first, head last."""
        seen = self._seen.pop(request, {})
        by_group = sorted(seen, key=lambda k: (self.groups.get(k, 0), seen[k]))
        ordered = sorted(by_group, key=lambda k: seen[k])
        for k in reversed(ordered):
            if k in self.held:
                self._counter += 1
                self.ranks[k] = (self._counter, 0)

    def replay(self, call: StoreCall) -> None:
        """Replay one call other than a lookup."""
        if call.op == "store":
            self.store(call)
        elif call.op == "stored":
            for k, _, _ in call.keys:
                if k in self.held and self.held[k] is None:
                    self.held[k] = 0
        elif call.op == "load":
            for k, _, _ in call.keys:
                self.held[k] = (self.held.get(k) or 0) + 1
            self._access(call.request, list(call.keys))
        elif call.op == "loaded":
            for k, _, _ in call.keys:
                if self.held.get(k):
                    self.held[k] = (self.held[k] or 1) - 1
        elif call.op == "finish":
            self.finish(call.request)

    def longest_prefix(self, call: StoreCall) -> int:
        """The longest prefix, in tokens, on the lookup's grid, whose keys are
        all held (see the module docstring)."""
        unit = call.unit_tokens
        held = 0
        for i, needs in enumerate(call.needs):
            n = (i + 1) * unit
            if not all(k in self.held for k, _, p in call.keys if n - unit < p <= n):
                break
            if all(k in self.held for k in needs):
                held = n
        return held


def owed_answer(held_tokens: int, presented_tokens: int, unit_tokens: int) -> int:
    """The tokens a store holding ``held_tokens`` owes past the
    ``presented_tokens`` local hit: none when less than a grid unit
    (``_lookup_complete_chunks``), in tokens."""
    matched = held_tokens - presented_tokens
    return matched if matched >= unit_tokens else 0


def lru_findings(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM
) -> list[Finding]:
    """``fallback`` per request whose store answered less than the LRU
    replay holds at one of its lookups (the first such lookup; see the
    module docstring); none unless the store is bounded."""
    store = scenario.workload.connector
    if store is None or store.capacity_chunks is None or run.unsupported is not None:
        return []
    replay = LRUReplay(store.capacity_chunks)
    findings: list[Finding] = []
    judged: set[int] = set()
    for call in run.store_calls:
        if call.op != "lookup":
            replay.replay(call)
            continue
        held = replay.longest_prefix(call)
        owed = owed_answer(held, call.presented_tokens, call.unit_tokens)
        if call.request in judged or (call.held_tokens >= held and call.matched_tokens >= owed):
            continue
        judged.add(call.request)
        findings.append(
            Finding(
                FindingKind.FALLBACK,
                run.variant,
                call.request,
                f"connector: the store held {call.held_tokens} tokens of it and answered "
                f"{call.matched_tokens} past {call.presented_tokens}, where LRU over its "
                f"{store.capacity_chunks} chunks keeps {held} and owes {owed}",
                expected_tokens=call.presented_tokens + owed,
                hit_tokens=call.presented_tokens + call.matched_tokens,
                policy=policy,
            )
        )
    return findings

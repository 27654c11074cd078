"""``kvfuzz shrink``: reduce a failing scenario while its finding signature holds.

A structured delta-debugging pass over the scenario's fields, in a fixed
order -- fewer requests first, then simpler switches, then smaller numbers --
repeated until nothing more can be removed or the time budget is spent:

1. drop requests (last first);
2. simplify: no decode steps, one prefill chunk, no KV connector (disabled
   lookahead hashes instead), one sliding-window group, one speculative token,
   one rank (no decode context parallelism), the plainest drafter of the
   same class;
3. halve every token quantity at once (block sizes, window, retention,
   prefix, divergence points, suffixes), keeping the geometry's shape;
4. shrink the sliding window, then the retention interval (positions keep
   their offset inside their retention period);
5. cut the shared prefix to what requests use, shrink each suffix, and pull
   each divergence point to the nearest alignment boundary;
6. a simpler workload: (scheduler mode) requests one at a time, no accepted
   drafts, one running sequence, no aborts (a dropped request takes its
   arrival step, abort step and failed load with it), no watermark,
   vLLM's default prefill policy (no long-prefill cap, prefill on every
   step), then a fixed cap rather than an adaptive one; KV
   cache events reported incrementally rather than in full, then off; then
   a plainer KV connector store: none, fewer failed loads, synchronous
   loads, no divergent hybrid hits, prefix caching on, an unbounded store,
   the store on the default grid;
7. fewer images and cache salts: none at all, then a request without its
   images (their placeholder tokens become tokens of its own) or without
   its cache salt, then each image alone dropped.

Every candidate is a valid :class:`~differential.scenario.Scenario`, run on the
real manager; a step is kept only if a finding with the *same signature*
(:mod:`fuzz.signature`) is still reported. Deterministic: the same input,
variants and vLLM give the same result.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from differential.compare import ScenarioResult, compare_variants
from differential.errors import ScenarioError
from differential.findings import FindingKind, Policy
from differential.scenario import (
    ConnectorLoad,
    ConnectorStore,
    Drafter,
    DrafterKind,
    GroupKind,
    KVEvents,
    KVEventsView,
    KVRole,
    LoadFailurePolicy,
    Scenario,
)
from differential.variants import Variant
from fuzz.signature import Signature, signature_of

__all__ = ["ShrinkResult", "shrink"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ShrinkResult:
    """The outcome of :func:`shrink`.

    Attributes:
        scenario: the smallest scenario found that still shows the signature.
        signature: the preserved signature.
        accepted: descriptions of the steps kept, in order.
        checks: candidate scenarios run.
        elapsed_s: wall time, in seconds.
        timed_out: whether the time budget ended the search.
    """

    scenario: Scenario
    signature: Signature
    accepted: tuple[str, ...]
    checks: int
    elapsed_s: float
    timed_out: bool


def _replace(scenario: Scenario, **changes: object) -> Scenario | None:
    try:
        return dataclasses.replace(scenario, **changes)  # type: ignore[arg-type]
    except ScenarioError:
        return None


def _drop_requests(s: Scenario) -> Iterator[tuple[str, Scenario | None]]:
    for index in range(len(s.requests) - 1, -1, -1):
        if len(s.requests) == 1 or any(r.shares_with == index for r in s.requests):
            continue
        kept = []
        for j, r in enumerate(s.requests):
            if j == index:
                continue
            shares = r.shares_with
            if shares is not None and shares > index:
                shares -= 1
            kept.append(dataclasses.replace(r, shares_with=shares))
        workload = s.workload
        if workload.arrival_steps is not None:
            arrivals = workload.arrival_steps[:index] + workload.arrival_steps[index + 1 :]
            workload = dataclasses.replace(workload, arrival_steps=arrivals)
        if workload.priorities is not None:
            priorities = workload.priorities[:index] + workload.priorities[index + 1 :]
            workload = dataclasses.replace(workload, priorities=priorities)
        if workload.abort_steps is not None:
            aborts = workload.abort_steps[:index] + workload.abort_steps[index + 1 :]
            # Null once the aborted request went: a list of nulls is refused.
            kept_aborts = aborts if any(step is not None for step in aborts) else None
            workload = dataclasses.replace(workload, abort_steps=kept_aborts)
        if workload.connector is not None and workload.connector.failed_loads:
            failed = tuple(k - (k > index) for k in workload.connector.failed_loads if k != index)
            connector = dataclasses.replace(workload.connector, failed_loads=failed)
            workload = dataclasses.replace(workload, connector=connector)
        yield f"drop request {index}", _replace(s, requests=tuple(kept), workload=workload)


def _workload(s: Scenario) -> Iterator[tuple[str, Scenario | None]]:
    w = s.workload
    if w.arrival_steps is not None:
        yield (
            "requests one at a time",
            _replace(s, workload=dataclasses.replace(w, arrival_steps=None)),
        )
    if w.accepted_drafts:
        yield "no drafts", _replace(s, workload=dataclasses.replace(w, accepted_drafts=()))
    if w.max_num_seqs is None or w.max_num_seqs > 1:
        yield "one running sequence", _replace(s, workload=dataclasses.replace(w, max_num_seqs=1))
    if w.watermark:
        yield "no watermark", _replace(s, workload=dataclasses.replace(w, watermark=0.0))
    if w.kv_events_view is not KVEventsView.PER_COPY:
        yield (
            "the per-copy KV event view",
            _replace(s, workload=dataclasses.replace(w, kv_events_view=KVEventsView.PER_COPY)),
        )
    if w.kv_events is KVEvents.FULL:
        yield (
            "incremental KV event reports",
            _replace(s, workload=dataclasses.replace(w, kv_events=KVEvents.INCREMENTAL)),
        )
    if w.kv_events is not KVEvents.OFF:
        yield (
            "no KV cache events",
            _replace(
                s,
                workload=dataclasses.replace(
                    w, kv_events=KVEvents.OFF, kv_events_view=KVEventsView.PER_COPY
                ),
            ),
        )
    if w.abort_steps is not None:
        yield "no aborts", _replace(s, workload=dataclasses.replace(w, abort_steps=None))
    if w.long_prefill_token_threshold or w.prefill_schedule_interval != 1:
        yield (
            "vLLM's default prefill policy",
            _replace(
                s,
                workload=dataclasses.replace(
                    w,
                    long_prefill_token_threshold=0,
                    long_prefill_token_threshold_adaptive=False,
                    prefill_schedule_interval=1,
                ),
            ),
        )
    if w.long_prefill_token_threshold_adaptive:
        yield (
            "a fixed long-prefill cap",
            _replace(
                s, workload=dataclasses.replace(w, long_prefill_token_threshold_adaptive=False)
            ),
        )
    if w.async_scheduling:
        yield (
            "synchronous scheduling",
            _replace(s, workload=dataclasses.replace(w, async_scheduling=False)),
        )
    if not w.prefix_caching:
        yield "prefix caching on", _replace(s, workload=dataclasses.replace(w, prefix_caching=True))
    if w.priorities is not None:
        yield (
            "first come, first served",
            _replace(s, workload=dataclasses.replace(w, priorities=None)),
        )
    if w.max_model_len_tokens is not None:
        yield (
            "the default model length",
            _replace(s, workload=dataclasses.replace(w, max_model_len_tokens=None)),
        )
    yield from _connector_store(s)


def _connector_store(s: Scenario) -> Iterator[tuple[str, Scenario | None]]:
    """(Scheduler mode) a plainer KV connector store: none at all, one
    engine instead of a prefill and a decode instance (``kv_role``
    ``kv_both``), no failed loads, synchronous loads, no divergent hybrid
    hits, prefix caching on, the hybrid allocator, no capacity, the default
    grid."""
    w = s.workload
    store = w.connector
    if store is None:
        return

    def with_store(**changes: object) -> Scenario | None:
        plainer = dataclasses.replace(store, **changes)  # type: ignore[arg-type]
        return _replace(s, workload=dataclasses.replace(w, connector=plainer))

    yield "no remote KV store", _replace(s, workload=dataclasses.replace(w, connector=None))
    if store.disaggregated:
        yield "one engine (no prefill instance)", with_store(kv_role=KVRole.KV_BOTH)
    for k in range(len(store.failed_loads) - 1, -1, -1):
        failed = store.failed_loads[:k] + store.failed_loads[k + 1 :]
        yield f"request {store.failed_loads[k]}'s load succeeds", with_store(failed_loads=failed)
    if store.load is not ConnectorLoad.SYNC and not store.failed_loads:
        yield "synchronous loads", with_store(load=ConnectorLoad.SYNC)
    if store.divergent_hybrid_hits:
        yield "no divergent hybrid hits", with_store(divergent_hybrid_hits=False)
    if not store.prefix_caching:
        yield "prefix caching on", with_store(prefix_caching=True)
    if not store.supports_hma:
        yield "a connector with the hybrid allocator", with_store(supports_hma=True)
    if store.kv_load_failure_policy is not LoadFailurePolicy.RECOMPUTE:
        yield (
            "failed loads recomputed",
            with_store(kv_load_failure_policy=LoadFailurePolicy.RECOMPUTE),
        )
    yield from _store_bounds(store, with_store)


def _store_bounds(
    store: ConnectorStore, with_store: Callable[..., Scenario | None]
) -> Iterator[tuple[str, Scenario | None]]:
    """A store without a capacity (unbounded, nothing evicted) and on the
    default grid (a key per group block, hits on the hit alignment)."""
    if store.capacity_chunks is not None:
        yield "an unbounded store", with_store(capacity_chunks=None)
    if store.chunk_tokens is not None:
        yield "the store on the default grid", with_store(chunk_tokens=None)


# Simpler KV cache event settings first (workload.kv_events).
_EVENTS_RANK = {KVEvents.OFF: 0, KVEvents.INCREMENTAL: 1, KVEvents.FULL: 2}

_PLAIN = {
    DrafterKind.EAGLE3: DrafterKind.EAGLE,
    DrafterKind.MTP: DrafterKind.EAGLE,
    DrafterKind.DSPARK: DrafterKind.DFLASH,
}


def _simplify(s: Scenario) -> Iterator[tuple[str, Scenario | None]]:
    if s.decode_steps:
        yield "no decode steps", _replace(s, decode_steps=0)
    longest = max(r.prompt_tokens for r in s.requests)
    if s.prefill_chunk_tokens < longest:
        yield "one prefill chunk", _replace(s, prefill_chunk_tokens=longest)
    if s.kv_connector and s.workload.connector is None:
        yield (
            "no KV connector (lookahead hashes disabled instead)",
            _replace(s, kv_connector=False, disable_lookahead_block_hashes=True),
        )
    swa = s.sliding_window_groups
    if len(swa) > 1:
        # Keep every other group (and the order); drop all sliding-window
        # groups but the first.
        first = next(i for i, g in enumerate(s.kv_cache_groups) if g.kind.sliding_window_family)
        groups = tuple(
            g
            for i, g in enumerate(s.kv_cache_groups)
            if i == first or not g.kind.sliding_window_family
        )
        yield "one sliding-window group", _replace(s, kv_cache_groups=groups)
    minimum = 2 if s.drafter.kind is DrafterKind.MULTI_MODULE_MTP else 1
    if s.drafter.num_speculative_tokens > minimum:
        yield (
            f"{minimum} speculative token(s)",
            _replace(s, drafter=Drafter(s.drafter.kind, minimum)),
        )
    dcp = s.dcp_world_size
    if dcp > 1:
        # One rank: the same per-rank blocks, which a Mamba state block (not
        # sharded) must then equal; without Mamba the blocks are kept.
        groups = tuple(
            dataclasses.replace(g, block_size_tokens=g.block_size_tokens // dcp)
            if s.mamba_groups and g.kind is not GroupKind.MAMBA
            else g
            for g in s.kv_cache_groups
        )
        yield "no decode context parallelism", _replace(s, dcp_world_size=1, kv_cache_groups=groups)
    plain = _PLAIN.get(s.drafter.kind)
    if plain is not None:
        yield (
            f"drafter {plain.value}",
            _replace(s, drafter=Drafter(plain, s.drafter.num_speculative_tokens)),
        )


def _scaled(s: Scenario, num: int, den: int) -> Scenario | None:
    def f(tokens: int) -> int:
        return tokens * num // den

    groups = []
    for g in s.kv_cache_groups:
        if g.block_size_tokens * num % den:
            return None
        window = None if g.sliding_window_tokens is None else max(2, f(g.sliding_window_tokens))
        chunk = g.attention_chunk_size_tokens
        groups.append(
            dataclasses.replace(
                g,
                block_size_tokens=f(g.block_size_tokens),
                sliding_window_tokens=window,
                attention_chunk_size_tokens=None if chunk is None else f(chunk),
            )
        )
    requests = tuple(
        dataclasses.replace(
            r,
            divergence_tokens=f(r.divergence_tokens),
            suffix_tokens=f(r.suffix_tokens),
            rejoin_tokens=f(r.rejoin_tokens),
            mm_inputs=tuple(
                dataclasses.replace(
                    m,
                    suffix_offset_tokens=f(m.suffix_offset_tokens),
                    length_tokens=max(1, f(m.length_tokens)),
                )
                for m in r.mm_inputs
            ),
        )
        for r in s.requests
    )
    retention = s.retention_interval_tokens
    workload = s.workload
    if workload.max_num_batched_tokens is not None:
        budget = max(1, f(workload.max_num_batched_tokens))
        seqs = workload.max_num_seqs
        workload = dataclasses.replace(
            workload,
            max_num_batched_tokens=budget,
            max_num_seqs=None if seqs is None else min(seqs, budget),
        )
    return _replace(
        s,
        workload=workload,
        kv_cache_groups=tuple(groups),
        requests=requests,
        shared_prefix_tokens=f(s.shared_prefix_tokens),
        retention_interval_tokens=None if retention is None else f(retention),
        prefill_chunk_tokens=max(1, f(s.prefill_chunk_tokens)),
        hash_block_size_tokens=None,
    )


def _scale_down(s: Scenario) -> Iterator[tuple[str, Scenario | None]]:
    yield "halve every token quantity", _scaled(s, 1, 2)


def _with_window(s: Scenario, index: int, window: int) -> Scenario | None:
    groups = list(s.kv_cache_groups)
    g = groups[index]
    groups[index] = dataclasses.replace(g, sliding_window_tokens=window)
    return _replace(s, kv_cache_groups=tuple(groups))


def _windows(s: Scenario) -> Iterator[tuple[str, Scenario | None]]:
    for index, g in enumerate(s.kv_cache_groups):
        if not g.kind.sliding_window_family or g.sliding_window_tokens is None:
            continue
        window, block = g.sliding_window_tokens, g.block_size_tokens
        # Windows stay >= 2 tokens: a 1-token window is degenerate (and has a
        # known issue of its own), not a reproducer a maintainer can use.
        candidates = [block * k for k in (1, 2, 3, 4) if 2 <= block * k < window]
        candidates += [window // 2] if window // 2 > block * 4 else []
        for smaller in candidates:
            yield f"group {index} window {smaller}", _with_window(s, index, smaller)


def _remap(position: int, old: int, new: int) -> int | None:
    offset = position % old
    if offset >= new:
        return None
    return position // old * new + offset


def _retention(s: Scenario) -> Iterator[tuple[str, Scenario | None]]:
    old = s.retention_interval_tokens
    alignment = s.effective_hit_alignment_tokens
    if not old or old <= 2 * alignment:
        return
    for new in (alignment * k for k in (2, 3, 4, 8, 16)):
        if new >= old:
            break
        positions = [s.shared_prefix_tokens] + [r.divergence_tokens for r in s.requests]
        remapped = [_remap(p, old, new) for p in positions]
        mapped = [m for m in remapped if m is not None]
        if len(mapped) < len(remapped):
            continue
        requests = tuple(
            dataclasses.replace(r, divergence_tokens=m)
            for r, m in zip(s.requests, mapped[1:], strict=True)
        )
        yield (
            f"retention {new}",
            _replace(
                s, retention_interval_tokens=new, shared_prefix_tokens=mapped[0], requests=requests
            ),
        )


def _numbers(s: Scenario) -> Iterator[tuple[str, Scenario | None]]:
    used = max((r.source_tokens for r in s.requests if r.shares_with is None), default=0)
    if used < s.shared_prefix_tokens:
        yield f"shared prefix {used}", _replace(s, shared_prefix_tokens=used)
    alignment = s.effective_hit_alignment_tokens
    for index, r in enumerate(s.requests):
        for suffix in sorted({0, 1, r.suffix_tokens // 2, r.suffix_tokens - alignment}):
            if 0 <= suffix < r.suffix_tokens:
                requests = list(s.requests)
                # The images that still fit among the request's own tokens stay.
                kept = tuple(
                    m for m in r.mm_inputs if m.suffix_offset_tokens + m.length_tokens <= suffix
                )
                requests[index] = dataclasses.replace(r, suffix_tokens=suffix, mm_inputs=kept)
                yield f"request {index} suffix {suffix}", _replace(s, requests=tuple(requests))
    for index, r in enumerate(s.requests):
        for rejoin in sorted({0, r.rejoin_tokens // 2, r.rejoin_tokens - alignment}):
            if 0 <= rejoin < r.rejoin_tokens:
                requests = list(s.requests)
                requests[index] = dataclasses.replace(r, rejoin_tokens=rejoin)
                yield f"request {index} rejoin {rejoin}", _replace(s, requests=tuple(requests))
    for index, r in enumerate(s.requests):
        d = r.divergence_tokens
        for target in (d - d % alignment, d - d % alignment + alignment):
            if target != d and target >= 0:
                requests = list(s.requests)
                requests[index] = dataclasses.replace(r, divergence_tokens=target)
                yield f"request {index} divergence {target}", _replace(s, requests=tuple(requests))


def _multimodal(s: Scenario) -> Iterator[tuple[str, Scenario | None]]:
    def with_request(index: int, **changes: object) -> Scenario | None:
        requests = list(s.requests)
        requests[index] = dataclasses.replace(requests[index], **changes)  # type: ignore[arg-type]
        return _replace(s, requests=tuple(requests))

    if sum(bool(r.mm_inputs) for r in s.requests) > 1:
        bare = tuple(dataclasses.replace(r, mm_inputs=()) for r in s.requests)
        yield "no images", _replace(s, requests=bare)
    if sum(r.cache_salt is not None for r in s.requests) > 1:
        unsalted = tuple(dataclasses.replace(r, cache_salt=None) for r in s.requests)
        yield "no cache salts", _replace(s, requests=unsalted)
    for index, r in enumerate(s.requests):
        if r.mm_inputs:
            yield f"request {index} without images", with_request(index, mm_inputs=())
        if r.cache_salt is not None:
            yield f"request {index} without a cache salt", with_request(index, cache_salt=None)
        if r.skip_reading_prefix_cache:
            yield (
                f"request {index} reading the prefix cache",
                with_request(index, skip_reading_prefix_cache=False),
            )
    for index, r in enumerate(s.requests):
        if len(r.mm_inputs) > 1:
            for k in range(len(r.mm_inputs)):
                kept = r.mm_inputs[:k] + r.mm_inputs[k + 1 :]
                yield f"request {index} without image {k}", with_request(index, mm_inputs=kept)


_PASSES = (
    _drop_requests,
    _simplify,
    _scale_down,
    _windows,
    _retention,
    _numbers,
    _workload,
    _multimodal,
)


def _size(s: Scenario) -> tuple[int, ...]:
    """Smaller is simpler: fewer requests, then fewer tokens and blocks."""
    return (
        len(s.requests),
        sum(r.prompt_tokens for r in s.requests) + s.shared_prefix_tokens,
        sum((g.sliding_window_tokens or 0) for g in s.kv_cache_groups),
        sum(g.block_size_tokens for g in s.kv_cache_groups),
        s.retention_interval_tokens or 0,
        s.decode_steps,
        len(s.kv_cache_groups),
        s.drafter.num_speculative_tokens,
        s.workload.arrival_steps is not None,
        len(s.workload.accepted_drafts),
        s.workload.max_num_seqs or 8,
        round(s.workload.watermark * 1000),
        s.workload.async_scheduling,
        s.workload.long_prefill_token_threshold > 0,
        s.workload.long_prefill_token_threshold_adaptive,
        s.workload.prefill_schedule_interval,
        _EVENTS_RANK[s.workload.kv_events],
        s.workload.kv_events_view is not KVEventsView.PER_COPY,
        sum(
            len(r.mm_inputs) + (r.cache_salt is not None) + r.skip_reading_prefix_cache
            for r in s.requests
        ),
        s.dcp_world_size,
    )


def shrink(
    scenario: Scenario,
    signature: Signature,
    variants: Sequence[Variant],
    *,
    policy: Policy = Policy.VLLM,
    seconds: float = 60.0,
    progress: Progress | None = None,
    keep: Callable[[ScenarioResult], bool] | None = None,
    dense_cross_check: bool | None = None,
) -> ShrinkResult:
    """Shrink ``scenario`` while a finding with ``signature`` is still reported.

    Args:
        keep: instead of the signature, keep a candidate when this holds for
            its result (e.g. a root cause of :mod:`differential.triage.identity` is
            still shown); ``signature`` then only labels the result.
        dense_cross_check: run the dense cross-check for every candidate;
            default: only when ``signature`` is a ``dense-mismatch``.

    Raises:
        ValueError: if ``scenario`` itself does not show ``signature``.
    """
    dense = (
        signature.kind == FindingKind.DENSE_MISMATCH.value
        if dense_cross_check is None
        else dense_cross_check
    )
    checks = 0
    started = time.perf_counter()

    def holds(candidate: Scenario) -> bool:
        nonlocal checks
        checks += 1
        result = compare_variants(candidate, variants, policy=policy, dense_cross_check=dense)
        if keep is not None:
            return keep(result)
        return any(signature_of(candidate, f) == signature for f in result.findings)

    if not holds(scenario):
        raise ValueError(f"the scenario does not show the finding {signature.text!r}")
    current = scenario
    accepted: list[str] = []
    timed_out = False
    improved = True
    while improved and not timed_out:
        improved = False
        for make in _PASSES:
            for description, candidate in make(current):
                if time.perf_counter() - started > seconds:
                    timed_out = True
                    break
                if candidate is None or _size(candidate) >= _size(current):
                    continue
                if holds(candidate):
                    current = candidate
                    accepted.append(description)
                    improved = True
                    if progress is not None:
                        elapsed = time.perf_counter() - started
                        progress(f"[{checks} checks, {elapsed:.1f} s] {description}")
                    break
            if improved or timed_out:
                break
    return ShrinkResult(
        scenario=current,
        signature=signature,
        accepted=tuple(accepted),
        checks=checks,
        elapsed_s=time.perf_counter() - started,
        timed_out=timed_out,
    )

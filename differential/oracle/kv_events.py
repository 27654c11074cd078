"""KV cache events: the published stream must rebuild the prefix cache exactly.

vLLM publishes KV cache events (vllm/distributed/kv_events.py, RFC #16669,
PR #16750): ``BlockStored`` when the block pool caches blocks,
``BlockRemoved`` when it drops a cached block, ``AllBlocksCleared`` when the
prefix cache is reset (vllm/v1/core/block_pool.py). External routers
(llm-d's KV-cache-aware routing, NVIDIA Dynamo's KV router) rebuild each
engine's prefix cache from this stream alone and route requests to the
engine that holds their prefix; RFC #20492 makes the events "the public
contract for any component emitting or consuming KV-Cache lifecycle
events". A stream that disagrees with the cache misroutes: a hash announced
and never removed sends requests to an engine that recomputes them, a hash
removed while still cached hides a hit (vLLM PR #55092's example).

The contract, rule by rule, judged after every drain of the event queue
(:class:`~differential.observation.KVEventStep`; nothing here imports vLLM):

``replay``
    Replaying the stream gives exactly the cache the pool holds. vLLM's
    events are per physical block: each ``BlockStored`` hash is one block
    newly cached, each ``BlockRemoved`` hash one cached block dropped (vLLM
    0.33.0 emits a ``BlockRemoved`` per physical copy, which a hash served by
    two blocks has after an identical block-aligned prompt recomputes its
    last block: PR #55092, open, would emit it only for the last copy). So
    the replay counts, per KV cache group (``group_idx``, vLLM PR #37688, so
    that a router tracks sliding-window blocks dropped while full attention
    keeps them) and hash, stores minus removals, and after every drain must
    equal the number of blocks ``BlockPool.cached_block_hash_to_block``
    holds under that group and hash; ``AllBlocksCleared`` empties the
    replay. The reused blocks a ``"full"`` report re-announces (below) are
    not new blocks and are not counted.
``router``
    Judged instead of ``replay`` under the router view
    (``workload.kv_events_view`` ``"router"``,
    :class:`~differential.scenario.KVEventsView`): a KV-cache-aware router
    keeps, per group, the set of hashes an engine holds, adding a hash on
    ``BlockStored`` and dropping it on ``BlockRemoved``. Replaying the stream
    that way must give, after every drain, exactly the hashes the pool still
    holds (RFC #20492: the events are "the public contract for any component
    ... consuming KV-Cache lifecycle events"). vLLM 0.33.0's per-copy stream
    breaks it when one of two copies of a hash is removed while the other is
    still cached: the router stops routing a prefix the engine still serves
    (vLLM PR #55092, open, removes a hash only with its last copy). A named
    policy a scenario asks for while upstream has not settled it.
``stored``
    Each ``BlockStored`` describes a real token prefix: its
    ``parent_block_hash`` is the hash of the prefix its ``token_ids`` extend
    (``None`` exactly when they start at token 0), its ``token_ids`` are a
    request's tokens right after that prefix, a whole number of
    ``block_size`` blocks, and each of its ``block_hashes`` is the chained
    hash of that request's prefix ending on one of those block boundaries,
    in order; for a full-attention-family group (which never skips a block)
    one hash per block. ``block_size`` is the group's block size (the
    manager's, vLLM PR #49971), or the hash block size for a fine-grained
    (partial) entry, which registers one hash block's prefix inside a larger
    block (``BlockPool.cache_partial_block``: a full-attention group's prompt
    tail when its block is larger than the hash block, a Mamba state at a
    fine-grained boundary). ``group_idx`` names a KV cache group and
    ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window`` are that
    group's spec kind and window (vLLM PR #40984: consumers "classify and
    filter groups as they are learned"). With ``k`` lookahead hash tokens
    (``num_hash_lookahead_tokens``) its ``lookahead_token_ids`` hold, per
    block hash, the ``k`` tokens past that block the hash covers ("Tokens
    beyond each block used in its hash", vllm/distributed/kv_events.py), so
    a consumer can recompute it; with none, no list. Its ``extra_keys`` hold,
    per block hash, the untagged keys that hash covers besides the token ids
    ("Extra keys used in block hash computation, one entry per block in
    block_hashes ... ``(mm_identifier, offset)`` pairs, the cache_salt
    string", ``BlockStored``; ``to_event_extra_keys`` in
    vllm/v1/core/kv_cache_utils.py, whose external consumers parse that
    shape): an ``(identifier, offset)`` pair for every image whose
    placeholder tokens overlap the block or its lookahead tokens, the offset
    counted from the block's first token (negative for an image begun in an
    earlier block), in prompt order, then the request's cache salt on the
    block starting at token 0; ``None`` for a block with none. A list of
    ``None`` may be left out (no block has keys).
``removed``
    A ``BlockRemoved`` removes only a block stored before in that group (the
    replay holds the hash), and names a KV cache group.
``lookup``
    With the default ``kv_cache_report_mode`` ``"incremental"`` a lookup
    (``KVCacheManager.get_computed_blocks``) publishes nothing. With
    ``"full"`` (vLLM PR #45261: "also emits BlockStored events for
    prefix-cache-reused blocks, so external consumers can observe the full
    prefix chain of a request") a lookup that hits publishes, for each group
    it returned blocks for, in group order, one ``BlockStored`` of those
    blocks: no parent, the request's first ``n * block_size`` tokens for its
    ``n`` blocks, their hashes in order, the group's block size and spec
    annotation, and the lookahead token ids and extra keys ``stored`` owes
    a newly cached block (``BlockPool.emit_cached_block_events`` builds them
    per block as ``cache_full_blocks`` does); a lookup that misses publishes
    nothing. The blocks counted
    are the lookup's own (a sliding window's null blocks below its window
    included, as vLLM 0.33.0 announces them; PR #57358, open, would skip
    them).

Every breach is a ``kv-events`` finding whose detail starts with the rule's
name; one finding per rule per run, naming the first breach and counting
the rest.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from differential.findings import Finding, FindingKind, Policy
from differential.observation import KVEvent, KVEventLog, KVEventLookup, RunObservation, tokens_of
from differential.oracle.prefix import pairwise_common_prefix_tokens, scenario_memo
from differential.scenario import GroupKind, KVCacheGroup, KVEventsView, Scenario
from differential.scenario.multimodal import PlacedInput, placed_inputs

__all__ = ["RULES", "SPEC_KIND", "kv_event_findings", "kv_event_rule"]

#: The rules, in the order findings are reported.
RULES = ("replay", "router", "stored", "removed", "lookup")

SPEC_KIND: dict[GroupKind, str] = {
    GroupKind.FULL_ATTENTION: "full_attention",
    GroupKind.MLA: "mla_attention",
    GroupKind.SLIDING_WINDOW: "sliding_window",
    GroupKind.SLIDING_WINDOW_MLA: "sliding_window_mla",
    GroupKind.MAMBA: "mamba",
    GroupKind.CHUNKED_LOCAL_ATTENTION: "chunked_local_attention",
    GroupKind.CIRCULAR_BUFFER: "unknown",  # get_kv_cache_spec_kind has no ring kind
    GroupKind.SINK_FULL_ATTENTION: "sink_full_attention",
    GroupKind.RSWA: "full_attention",  # an RSWASpec is a FullAttentionSpec
}
"""Group kind -> the ``kv_cache_spec_kind`` its events carry (vLLM's
``KVCacheSpecKind`` of the group's spec, vllm/v1/kv_cache_interface.py)."""


def _window(group: KVCacheGroup) -> int | None:
    """The ``kv_cache_spec_sliding_window`` a group's events carry, in tokens."""
    return group.sliding_window_tokens if group.kind.sliding_window_family else None


@dataclass
class _Judge:
    """One run's stream against its cache (see the module docstring)."""

    scenario: Scenario
    log: KVEventLog
    sequences: list[tuple[int, ...]]
    # Tokens past a block its hash covers (``num_hash_lookahead_tokens``);
    # ``None``: not recorded (the lookahead ids are not judged).
    lookahead_tokens: int | None = None
    breaches: dict[str, list[tuple[int | None, str]]] = field(
        default_factory=lambda: {rule: [] for rule in RULES}
    )
    # Row j: the common prefix of sequence j and each earlier one, in tokens.
    common: list[list[int]] = field(default_factory=list)
    # Per request, its images in prompt order (placed_inputs).
    images: tuple[tuple[PlacedInput, ...], ...] = ()

    def breach(self, rule: str, request: int | None, what: str) -> None:
        self.breaches[rule].append((request, what))

    def shared(self, a: int, b: int) -> int:
        """Common prefix of two requests' token sequences, in tokens."""
        if a == b:
            return len(self.sequences[a])
        return self.common[a][b] if b < a else self.common[b][a]

    def names(self, label: int, request: int, tokens: int) -> bool:
        """Whether hash ``label`` is the hash of ``request``'s first ``tokens`` tokens."""
        named = self.log.prefixes.get(label)
        if named is None or named[1] != tokens:
            return False
        return self.shared(named[0], request) >= tokens

    def annotation(self, where: str, event: KVEvent, group: KVCacheGroup) -> str | None:
        want = (SPEC_KIND[group.kind], _window(group))
        if (event.spec_kind, event.sliding_window) != want:
            return (
                f"{where} carries kv_cache_spec_kind {event.spec_kind!r}, sliding window "
                f"{event.sliding_window}; group {event.group} ({group.kind.value}) has "
                f"{want[0]!r}, {want[1]}"
            )
        return None

    def stored(self, step: int, event: KVEvent) -> None:
        """The ``stored`` rule for a newly cached block's event."""
        s = self.scenario
        assert event.group is not None  # run() checked it names a group
        group = s.kv_cache_groups[event.group]
        where = f"step {step}: BlockStored of group {event.group}"
        wrong = self.annotation(where, event, group)
        if wrong:
            self.breach("stored", None, wrong)
            return
        hash_block = s.effective_hash_block_size_tokens
        sizes = {group.block_size_tokens, hash_block}
        size = event.block_size
        tokens = tokens_of(event.tokens)
        if size not in sizes or len(tokens) % size or not tokens:
            self.breach(
                "stored",
                None,
                f"{where} has block_size {size} and {len(tokens)} token ids; allowed a block "
                f"size of {sorted(sizes)} and a positive multiple of it",
            )
            return
        start = 0
        parent_request = None
        if event.parent is not None:
            named = self.log.prefixes.get(event.parent)
            if named is None:
                self.breach("stored", None, f"{where}: its parent hash names no request's prefix")
                return
            parent_request, start = named
        end = start + len(tokens)
        written = tuple(tokens)
        owner = next(
            (
                r
                for r, seq in enumerate(self.sequences)
                if (parent_request is None or self.shared(r, parent_request) >= start)
                and seq[start:end] == written
            ),
            None,
        )
        if owner is None:
            self.breach(
                "stored",
                None,
                f"{where}: its {len(tokens)} token ids are no request's tokens "
                f"[{start}, {end}) after its parent's prefix of {start} tokens",
            )
            return
        ends = [start + size * (k + 1) for k in range(len(tokens) // size)]
        dense = group.kind.full_attention_family or size != group.block_size_tokens
        last = start
        boundaries = set(ends)
        for k, label in enumerate(event.hashes):
            # The first block boundary after the last whose prefix ``label``
            # names: ``names`` holds for one length at most, its own.
            named = self.log.prefixes.get(label)
            fits = (
                [named[1]]
                if named is not None
                and named[1] > last
                and named[1] in boundaries
                and self.names(label, owner, named[1])
                else []
            )
            if not fits or (dense and fits[0] != ends[k]):
                self.breach(
                    "stored",
                    owner,
                    f"{where}: block hash {k} of {len(event.hashes)} is not the hash of "
                    f"request {owner}'s prefix ending on a block boundary after the last "
                    f"({last} tokens; the event covers tokens [{start}, {end}))",
                )
                return
            last = fits[0]
        if dense and len(event.hashes) != len(ends):
            self.breach(
                "stored",
                owner,
                f"{where}: {len(event.hashes)} block hashes for {len(ends)} blocks of "
                f"{size} tokens (a full-attention group skips no block)",
            )
            return
        wrong = self.lookahead_ids(where, event) or self.extra_keys(where, event)
        if wrong:
            self.breach("stored", owner, wrong)

    def extra_keys(self, where: str, event: KVEvent) -> str | None:
        """The ``stored`` rule's extra-keys part: per block hash, the images
        overlapping the tokens it covers, as ``(identifier, offset from the
        block's first token)``, then the cache salt on a block starting at
        token 0 (module docstring). Judged when the log recorded them and
        the lookahead is known; the hashes are already known to name their
        prefixes (:meth:`stored`)."""
        if not self.log.extra_keys or self.lookahead_tokens is None:
            return None
        owed = [
            self.owed_extra_keys(*self.log.prefixes[label], event.block_size)
            for label in event.hashes
        ]
        if event.extra_keys is None and not any(owed):
            return None
        got = event.extra_keys or ()
        if len(got) != len(owed):
            return (
                f"{where} carries {len(got)} extra-key entries for {len(owed)} block hashes "
                f"(owed {[_keys(k) for k in owed]})"
            )
        for n, (label, keys, due) in enumerate(zip(event.hashes, got, owed, strict=True)):
            if keys != due:
                request, boundary = self.log.prefixes[label]
                return (
                    f"{where}: block hash {n}'s extra keys are {_keys(keys)}; request "
                    f"{request}'s block [{boundary - event.block_size}, {boundary}) owes "
                    f"{_keys(due)}"
                )
        return None

    def owed_extra_keys(self, request: int, boundary: int, size: int) -> tuple[Any, ...] | None:
        """The untagged extra keys of ``request``'s block of ``size`` tokens
        ending at ``boundary`` (tokens), its lookahead tokens included."""
        start, end = boundary - size, boundary + (self.lookahead_tokens or 0)
        keys: list[Any] = [
            (image.identifier, image.offset_tokens - start)
            for image in self.images[request]
            if image.offset_tokens < end and image.offset_tokens + image.length_tokens > start
        ]
        salt = self.scenario.requests[request].cache_salt
        if start == 0 and salt:
            keys.append(salt)
        return tuple(keys) or None

    def lookahead_ids(self, where: str, event: KVEvent) -> str | None:
        """The ``stored`` rule's lookahead part: with ``k`` lookahead tokens
        each block hash covers the ``k`` tokens past its block, and the event
        carries them, one list per hash, so a consumer can recompute the hash
        (``BlockStored.lookahead_token_ids``, vllm/distributed/kv_events.py:
        "Tokens beyond each block used in its hash"); without lookahead
        hashing it carries none. The hashes are already known to name their
        prefixes (:meth:`stored`)."""
        k = self.lookahead_tokens
        if k is None:
            return None
        if k == 0:
            if event.lookahead is not None:
                return f"{where} carries lookahead token ids; lookahead hashing is off"
            return None
        ahead = event.lookahead or ()
        if len(ahead) != len(event.hashes):
            return (
                f"{where} carries {len(ahead)} lookahead token id lists for "
                f"{len(event.hashes)} block hashes of {k} lookahead tokens each"
            )
        for n, (label, ids) in enumerate(zip(event.hashes, ahead, strict=True)):
            request, boundary = self.log.prefixes[label]
            due = self.sequences[request][boundary : boundary + k]
            if tuple(ids) != tuple(due):
                return (
                    f"{where}: block hash {n}'s lookahead token ids are {list(ids)}; its "
                    f"hash covers the {k} tokens past its block at {boundary} tokens, "
                    f"{list(due)}"
                )
        return None

    def lookup(self, step: int, lookup: KVEventLookup, emitted: list[KVEvent]) -> None:
        """The ``lookup`` rule for one ``get_computed_blocks`` call."""
        s = self.scenario
        r = lookup.request
        where = f"step {step}: the lookup of request {r} (hit {lookup.hit_tokens} tokens)"
        if self.log.report_mode != "full":
            if emitted:
                self.breach(
                    "lookup",
                    r,
                    f"{where} published {len(emitted)} event(s) in kv_cache_report_mode "
                    "'incremental' (a lookup stores nothing; reused blocks are announced "
                    "only in 'full' mode)",
                )
            return
        due = (
            [(g, n) for g, n in enumerate(lookup.blocks_per_group) if n > 0]
            if lookup.hit_tokens > 0
            else []
        )
        shown = [(e.group, len(e.hashes)) for e in emitted]
        if shown != due or any(e.kind != "stored" for e in emitted):
            self.breach(
                "lookup",
                r,
                f"{where} re-announced (group, blocks) {shown}; kv_cache_report_mode "
                f"'full' re-announces the blocks it returned: {due}",
            )
            return
        for event, (g, n) in zip(emitted, due, strict=True):
            group = s.kv_cache_groups[g]
            size = group.block_size_tokens
            wrong = self.annotation(f"{where}: its BlockStored", event, group)
            expected = list(self.sequences[r][: n * size])
            if wrong is None and (
                event.parent is not None
                or event.block_size != size
                or tokens_of(event.tokens) != expected
                or not all(
                    self.names(label, r, (k + 1) * size) for k, label in enumerate(event.hashes)
                )
            ):
                wrong = (
                    f"{where}: its BlockStored of group {g} is not request {r}'s first {n} "
                    f"blocks of {size} tokens with no parent (block_size {event.block_size}, "
                    f"{len(tokens_of(event.tokens))} token ids, parent "
                    f"{'none' if event.parent is None else 'set'})"
                )
            # A re-announced block carries what a newly stored one does
            # (BlockPool.emit_cached_block_events builds its lookahead token
            # ids and extra keys as cache_full_blocks does).
            wrong = (
                wrong
                or self.lookahead_ids(f"{where}: its BlockStored", event)
                or self.extra_keys(f"{where}: its BlockStored", event)
            )
            if wrong:
                self.breach("lookup", r, wrong)
                return

    def run(self) -> None:
        groups = len(self.scenario.kv_cache_groups)
        # Block counts per (group, label), positive counts only, so that
        # comparing the two is one dict comparison.
        replay: dict[tuple[int, int], int] = {}
        pool: dict[tuple[int, int], int] = {}
        # A router's view: the (group, hash) pairs announced and not removed since.
        router: set[tuple[int, int]] = set()
        for step in self.log.steps:
            emitted: dict[int, list[KVEvent]] = defaultdict(list)
            for event in step.events:
                if event.kind == "cleared":
                    replay.clear()
                    router.clear()
                    continue
                name = "BlockStored" if event.kind == "stored" else "BlockRemoved"
                if event.group is None or not 0 <= event.group < groups:
                    self.breach(
                        "stored" if event.kind == "stored" else "removed",
                        None,
                        f"step {step.step}: {name} with group_idx {event.group}, which names "
                        f"no KV cache group (0..{groups - 1})",
                    )
                    continue
                if event.lookup is not None:
                    emitted[event.lookup].append(event)
                    continue
                if event.kind == "removed":
                    for label in event.hashes:
                        key = (event.group, label)
                        router.discard(key)
                        held = replay.get(key, 0)
                        if held <= 0:
                            self.breach(
                                "removed",
                                None,
                                f"step {step.step}: BlockRemoved of group {event.group} for a "
                                "hash no earlier BlockStored of that group announced (or all "
                                "its blocks already removed)",
                            )
                        elif held == 1:
                            del replay[key]
                        else:
                            replay[key] = held - 1
                    continue
                self.stored(step.step, event)
                for label in event.hashes:
                    key = (event.group, label)
                    replay[key] = replay.get(key, 0) + 1
                    router.add(key)
            for index, lookup in enumerate(step.lookups):
                self.lookup(step.step, lookup, emitted.pop(index, []))
            for group, label, blocks in step.pool:
                if blocks > 0:
                    pool[(group, label)] = blocks
                else:
                    pool.pop((group, label), None)
            if self.scenario.workload.kv_events_view is KVEventsView.ROUTER:
                self.compare_router(step.step, router, pool)
            else:
                self.compare(step.step, replay, pool)

    def compare_router(
        self, step: int, router: set[tuple[int, int]], pool: dict[tuple[int, int], int]
    ) -> None:
        """The ``router`` rule after one drain: the hashes a router holds
        (``router``) are exactly those the pool caches (``pool``: blocks per
        (group, hash), positive counts only)."""
        if router == pool.keys():
            return
        keys = sorted(router ^ pool.keys())
        g, label = keys[0]
        named = self.log.prefixes.get(label)
        prefix = f"request {named[0]}'s first {named[1]} tokens" if named else "no request's prefix"
        held = pool.get((g, label), 0)
        what = (
            f"the router dropped the hash of {prefix} (group {g}) while the pool still "
            f"caches it in {held} block(s): it stops routing that prefix here"
            if held
            else f"the router holds the hash of {prefix} (group {g}), which the pool no "
            "longer caches: it routes that prefix here to be recomputed"
        )
        self.breach(
            "router",
            None,
            f"step {step}: a router replaying the stream as a set holds {len(router)} "
            f"hashes, the pool {len(pool)}; first difference: {what}",
        )

    def compare(
        self, step: int, replay: dict[tuple[int, int], int], pool: dict[tuple[int, int], int]
    ) -> None:
        if replay == pool:
            return
        keys = sorted(set(replay) | set(pool), key=lambda k: (k[0], k[1]))
        g, label = next(k for k in keys if replay.get(k, 0) != pool.get(k, 0))
        named = self.log.prefixes.get(label)
        prefix = f"request {named[0]}'s first {named[1]} tokens" if named else "no request's prefix"
        self.breach(
            "replay",
            None,
            f"step {step}: replaying the stream gives {sum(replay.values())} cached blocks, "
            f"the pool holds {sum(pool.values())}; first difference: group {g}, the hash of "
            f"{prefix}: {replay.get((g, label), 0)} block(s) in the replay, "
            f"{pool.get((g, label), 0)} in the pool",
        )


def kv_event_findings(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM, label: str = ""
) -> list[Finding]:
    """One ``kv-events`` finding per rule the run's stream breaks (see the
    module docstring), naming its first breach; none when the run recorded
    no events (``run.kv_events`` ``None``: events off).

    Args:
        scenario: the scenario the run served (its groups' kinds, block
            sizes in tokens and windows in tokens are what the events must
            carry; its prompts and sampled tokens, what they describe).
        run: the run's observation.
        policy: the policy recorded on the findings (the rules hold under all).
        label: prefixed to each finding's detail (``"dense cross-check run: "``).
    """
    log = run.kv_events
    if log is None:
        return []
    # The requests' token sequences, their pairwise common prefixes and their
    # images depend on the scenario alone: computed once for all its runs.
    memo = scenario_memo(scenario)
    known = memo.get("kv_event_sequences")
    if known is None:
        sequences = [
            scenario.prompts[i] + scenario.sampled_tokens(i) for i in range(len(scenario.requests))
        ]
        known = memo["kv_event_sequences"] = (
            sequences,
            pairwise_common_prefix_tokens(sequences),
            placed_inputs(scenario.requests),
        )
    lookahead = None if run.settings is None else run.settings.num_hash_lookahead_tokens
    judge = _Judge(
        scenario,
        log,
        known[0],
        lookahead_tokens=lookahead,
        common=known[1],
        images=known[2],
    )
    judge.run()
    findings = []
    for rule in RULES:
        breaches = judge.breaches[rule]
        if not breaches:
            continue
        request, what = breaches[0]
        more = f" (and {len(breaches) - 1} more)" if len(breaches) > 1 else ""
        findings.append(
            Finding(
                FindingKind.KV_EVENTS,
                run.variant,
                request,
                f"{rule}: {label}{what}{more}",
                policy=policy,
            )
        )
    return findings


def _keys(keys: tuple[Any, ...] | None) -> str:
    """One block's extra keys as a finding names them."""
    return "none" if keys is None else "[" + ", ".join(repr(k) for k in keys) + "]"


def kv_event_rule(finding: Finding) -> str:
    """The rule a ``kv-events`` finding breaks (the first word of its detail)."""
    rule = finding.detail.split(":", 1)[0]
    return rule if rule in RULES else "unknown"

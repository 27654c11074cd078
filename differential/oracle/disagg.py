"""What disaggregated prefill and decode owe (``workload.connector.kv_role`` ``kv_consumer``).

The driven scheduler is the decode instance; a prefill instance (a
``kv_producer``) computed every request first and saved it to the shared
store (:mod:`differential.driver.disagg`). Two rules, each per request of
the decode instance with a :class:`~differential.observation.ConnectorLookup`:

* **The prefill instance's store owes the decode instance what it computed**
  (:func:`prefill_owed`). The point of the producer's save is the consumer's
  load: vLLM's P/D proxies send the decode request only once the prefill
  request has finished (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py),
  and NIXL's consumer loads "all prompt blocks from remote"
  (vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py
  ``get_num_new_matched_tokens``). Through a prefix store the prefill
  instance's ``P`` computed tokens are its whole hash blocks ``P // H * H``
  for every full-attention-family group; with Mamba groups (align mode) the
  state the producer hands off at the end of its prompt is the one at the
  prompt's checkpoint ``c`` (``get_mamba_prefill_checkpoint_position``,
  vllm/v1/kv_cache_interface.py: the last hash boundary before the last
  token, one hash block lower under the EAGLE drop), which
  ``KVCacheManager.finalize_partial_tail_offloads`` ("Consume safe producer
  partial tails when a request finishes") and the copy-on-write hand-off of
  a producer's partial tail (``MambaManager.allocate_new_blocks``) exist to
  deliver. The decode request is owed, local and external together, the
  largest multiple of the store's grid within ``L - 1`` (one token is left
  to compute, vLLM PR #43494) and within those, or nothing past its shown
  local hit when that is less than a grid unit (``_lookup_complete_chunks``).
  A Mamba hybrid is owed ``c`` only when ``c`` is on the grid (off it the
  store keeps no key for the state), and not for a request the prefill
  instance preempted (``ConnectorLookup.prefill_preemptions``):
  ``MambaManager.pop_blocks_for_free`` drops the boundary states a freed
  request had pending for hand-off (the blocks may be reused before the
  copy), and the resumed request hits them locally, which hands nothing
  off; layouts with sliding-window or other groups are not judged here.
  A divergent hybrid hit is judged too:
  ``get_computed_blocks_for_connector`` reports it because the connector
  supplies the lagging Mamba state, so a shortfall where vLLM dropped a
  store answer ending exactly at that hit (:func:`equal_tail_dropped`)
  names it (:data:`EQUAL_TAIL_DROPPED`).
* **The decode instance's local cache owes later requests what it loaded**
  (:func:`local_owed`). After an asynchronous load completes,
  ``Scheduler._update_waiting_for_remote_kv`` (vllm/v1/core/sched/scheduler.py)
  caches the loaded blocks ("Now that the blocks are ready, actually cache
  them"), so a later request sharing the loaded prefix hits it in the local
  prefix cache instead of loading it again; a synchronous load's blocks are
  cached with the step's tokens (vLLM PR #44243, merged, on P/D with Mamba
  hybrids: "the last state of Mamba will always be transfer, but full
  attention will only transfer the prefix cache miss part"). Per group as
  its manager keeps it: a
  full-attention-family group every loaded block, so the later request is
  owed the largest multiple of the hit alignment ``A`` within the common
  prefix, the loaded end ``e`` and ``L - 1``; a Mamba group only the state
  at ``e`` (a load brings the state at its end, ``allocate_external_computed_blocks``),
  so on a Mamba hybrid the later request is owed ``e`` itself when it
  shares ``e`` tokens and ``e <= L - 1``, else nothing from that load.
  Under the EAGLE drop (a KV connector turns lookahead hashes off) a lookup
  gives back its last matched block: one alignment unit less on full
  attention, and nothing judged on a Mamba hybrid. Judged
  where nothing was evicted (an evicted loaded block owes nothing), for
  loaders that had finished before the later request was admitted, whose
  load did not fail, and on lookups that did not diverge (vLLM's divergent
  hybrid hits are a documented policy: :mod:`differential.oracle.connector`).

A shortfall is a ``fallback``. Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from differential.findings import Finding, FindingKind, Policy
from differential.observation import ConnectorLookup, RequestObservation, RunObservation
from differential.oracle.prefix import common_prefix_tokens
from differential.scenario import GroupKind, Scenario

__all__ = [
    "EQUAL_TAIL_DROPPED",
    "LOCAL_SHORTFALL",
    "LocalOwed",
    "disagg_findings",
    "equal_tail_dropped",
    "local_owed",
    "prefill_owed",
]

#: What a store-rule shortfall's detail adds when vLLM dropped the store's
#: answer because it ended exactly where a diverged local hit did
#: (:func:`equal_tail_dropped`).
EQUAL_TAIL_DROPPED = "the store's answer ending where the diverged local hit does was dropped"

#: How a local-rule shortfall's detail begins (:func:`local_owed`: a later
#: request's local hit short of what an earlier request loaded).
LOCAL_SHORTFALL = "disaggregated: local hit"


def _layout(scenario: Scenario) -> str | None:
    """``"attention"`` (every group full attention or MLA), ``"mamba"``
    (those and Mamba groups), or ``None`` (any other group: not judged)."""
    kinds = [g.kind for g in scenario.kv_cache_groups]
    if all(k.full_attention_family for k in kinds):
        return "attention"
    if all(k.full_attention_family or k is GroupKind.MAMBA for k in kinds):
        return "mamba"
    return None


def _grid(scenario: Scenario) -> int:
    """The store's lookup grid, in tokens: its own chunk, else the hit alignment."""
    store = scenario.workload.connector
    if store is not None and store.chunk_tokens is not None:
        return store.chunk_tokens
    return scenario.effective_hit_alignment_tokens


def prefill_owed(scenario: Scenario, run: RunObservation, r: RequestObservation) -> int | None:
    """The tokens, local and external, request ``r`` of the decode instance
    is owed at its admitting lookup for what the prefill instance computed
    (see the module docstring); ``None`` where not judged."""
    c = r.connector
    layout = _layout(scenario)
    if c is None or c.prefill_tokens is None or layout is None or c.load_failed:
        return None
    hash_block = scenario.effective_hash_block_size_tokens
    grid = _grid(scenario)
    length = r.prompt_tokens
    held = min(c.prefill_tokens // hash_block * hash_block, length - 1) // grid * grid
    if layout == "mamba":
        if c.prefill_preemptions:
            # The states handed off before a preemption are dropped with the
            # freed blocks, and the resumed request hands off none it hit.
            return None
        drop = run.settings is not None and run.settings.use_eagle_block_drop
        proof = length if drop else length - 1
        checkpoint = max(0, proof // hash_block * hash_block - (hash_block if drop else 0))
        held = checkpoint if checkpoint % grid == 0 and checkpoint <= held else 0
    if held - c.presented_tokens < grid:
        # Less than a grid unit past the shown hit is not loaded: the local
        # hit is judged by the scheduler-mode rules.
        return None
    return held


def equal_tail_dropped(c: ConnectorLookup) -> bool:
    """Whether vLLM dropped the store's answer to a diverged lookup because it
    ended exactly at the local hit: ``get_computed_blocks_for_connector``
    (vllm/v1/core/kv_cache_manager.py) reported the full-attention hit ``h``
    past a lagging Mamba group, the connector answered ``m`` equal to the
    sub-block tail ``h - a`` past the shown ``a``, ``Scheduler.schedule``
    (vllm/v1/core/sched/scheduler.py) keeps a local tail unless the remote
    hit strictly exceeds it (so no external tokens), and then reconciles the
    diverged hit to what every group holds."""
    tail = c.local_hit_tokens - c.presented_tokens
    return c.diverged and c.external_tokens == 0 and tail > 0 and c.matched_tokens == tail


@dataclass(frozen=True)
class LocalOwed:
    """What the decode instance's local cache owes one request.

    Attributes:
        tokens: the local hit owed, in tokens.
        loader: the earlier request whose load it is.
        loaded_tokens: the end of that request's load, in tokens.
    """

    tokens: int
    loader: int
    loaded_tokens: int


def local_owed(scenario: Scenario, run: RunObservation, r: RequestObservation) -> LocalOwed | None:
    """The largest local hit request ``r`` is owed for what earlier requests
    loaded (see the module docstring); ``None`` where nothing is owed or
    the rule does not judge."""
    layout = _layout(scenario)
    c = r.connector
    if (
        layout is None
        or c is None
        or c.diverged
        or r.scheduled_step is None
        or run.evicted_blocks
        or not scenario.prefix_caching
    ):
        return None
    prompts = scenario.prompts
    alignment = scenario.effective_hit_alignment_tokens
    limit = r.prompt_tokens - 1
    # Under the EAGLE drop a lookup gives back its last matched block
    # (vLLM's find_longest_cache_hit with use_eagle): one alignment unit
    # below a full-attention match, and no Mamba state hit at the end of
    # what was loaded, which proves no block past it.
    drop = run.settings is not None and run.settings.use_eagle_block_drop
    if drop and layout == "mamba":
        return None
    best: LocalOwed | None = None
    for q in run.requests:
        d = q.connector
        if (
            q.index == r.index
            or d is None
            or d.external_tokens == 0
            or d.load_failed
            or q.finished_step is None
            or q.finished_step >= r.scheduled_step
        ):
            continue
        end = d.computed_tokens
        shared = common_prefix_tokens(prompts[r.index], prompts[q.index])
        if layout == "attention":
            owed = min(shared, end, limit) // alignment * alignment
            owed = max(0, owed - (alignment if drop else 0))
        else:
            owed = end if end <= min(shared, limit) else 0
        if owed and (best is None or owed > best.tokens):
            best = LocalOwed(owed, q.index, end)
    return best


def disagg_findings(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM
) -> list[Finding]:
    """``fallback`` per decode request that starts with fewer computed tokens
    than the prefill instance's store owes it, or hits less in the local
    cache than earlier loads owe it (see the module docstring); none unless
    ``workload.connector.kv_role`` is ``kv_consumer``."""
    store = scenario.workload.connector
    if store is None or not store.disaggregated or run.unsupported is not None:
        return []
    findings: list[Finding] = []
    for r in run.requests:
        c = r.connector
        if c is None or not scenario.reads_prefix_cache(r.index):
            # A request skipping the prefix cache loads nothing (vLLM PR
            # #57269); the connector rules owe it nothing.
            continue
        owed = prefill_owed(scenario, run, r)
        if owed is not None and c.computed_tokens < owed:
            findings.append(
                Finding(
                    FindingKind.FALLBACK,
                    run.variant,
                    r.index,
                    f"disaggregated: starts with {c.computed_tokens} computed tokens "
                    f"({c.local_tokens} local + {c.external_tokens} external), owed {owed} "
                    f"the prefill instance computed ({c.prefill_tokens} tokens) and saved; "
                    f"the store held {c.store_tokens}"
                    + (
                        f" ({EQUAL_TAIL_DROPPED}: local hit {c.local_hit_tokens}, "
                        f"{c.matched_tokens} past {c.presented_tokens})"
                        if equal_tail_dropped(c)
                        else ""
                    ),
                    divergence_tokens=r.prompt_tokens,
                    hit_tokens=c.computed_tokens,
                    expected_tokens=owed,
                    policy=policy,
                )
            )
            continue
        local = local_owed(scenario, run, r)
        if local is not None and c.local_hit_tokens < local.tokens:
            findings.append(
                Finding(
                    FindingKind.FALLBACK,
                    run.variant,
                    r.index,
                    f"{LOCAL_SHORTFALL} {c.local_hit_tokens}, owed {local.tokens} of the "
                    f"{local.loaded_tokens} tokens request {local.loader} loaded into the decode "
                    f"instance's prefix cache (then loaded {c.external_tokens} from the store)",
                    divergence_tokens=local.tokens,
                    hit_tokens=c.local_hit_tokens,
                    expected_tokens=local.tokens,
                    policy=policy,
                )
            )
    return findings

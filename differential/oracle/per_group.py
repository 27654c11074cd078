"""Per-group hits: each KV cache group alone hits at least the reconciled hit, aligned.

vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``
(``vllm/v1/core/kv_cache_coordinator.py``) evaluates each KV cache group on
its own; ``KVCacheManager.get_computed_blocks_for_connector``
(``vllm/v1/core/kv_cache_manager.py``) hands the full-attention group's own
hit to a KV connector as the local prefix it builds on (vLLM PR #44243), and
takes the reconciled hit when a group lags (vLLM PR #48425, for issue
#46453). The reconciled hit (``find_longest_cache_hit``, what
``get_computed_blocks`` returns) is a prefix every group holds: vLLM 0.33.0's
``get_computed_blocks_for_connector`` calls it "the reconciled boundary that
every group agrees on", and its coordinator reads the groups' parting only
as "any attn. group cached a longer prefix than the reconciled hit"
(``HybridKVCacheCoordinator.find_longest_cache_hit``), never a shorter one.
So for every request and every group ``g``:

    per-group hit of ``g`` (tokens) >= the reconciled hit (tokens)

both looked up against the same cache, the per-group one with at least the
reconciled lookup's length bound. A shorter per-group hit makes a connector
recompute or transfer KV the local cache holds. And every per-group hit is a
multiple of the hit alignment ``A``, as every hit is (the one-unit rule's
grid; ``find_longest_cache_hit_per_group`` passes the coordinator's
``_cache_hit_alignment_tokens`` to each group's lookup): a connector resuming
from a misaligned local hit starts off the grid the other groups' blocks and
states lie on. Either is a ``per-group-hit`` finding naming the group, its
own hit and the reconciled one.

A lookup vLLM adopted as a connector's divergent hit (a Mamba group lagging
full attention, its state coming with the connector's load: vLLM PR #50344)
returns the full-attention hit, not the reconciled one, and is not judged
here.

The driver records the per-group hits right before each lookup
(``RequestObservation.per_group_hit_tokens``); a release or coordinator
without ``find_longest_cache_hit_per_group`` records the reconciled hit for
every group, which this check passes. Nothing here imports vLLM.
"""

from __future__ import annotations

from differential.findings import Finding, FindingKind, Policy
from differential.observation import RequestObservation, RunObservation
from differential.scenario import Scenario

__all__ = ["per_group_findings", "wrong_per_group_hit"]


def wrong_per_group_hit(
    request: RequestObservation, alignment: int, skipped: frozenset[int] = frozenset()
) -> tuple[int, int] | None:
    """The first group whose own hit breaks the rule for ``request``, as
    ``(group index, its hit in tokens)``, or ``None``.

    Args:
        request: one request's observation (``per_group_hit_tokens``, ``hit_tokens``).
        alignment: the hit alignment ``A``, in tokens.
        skipped: indices of groups that are not prefix-cacheable (circular
            buffers): ``find_longest_cache_hit_per_group`` leaves their hit
            at 0 and owes them nothing.
    """
    for gid, hit in enumerate(request.per_group_hit_tokens):
        if gid in skipped:
            continue
        # A per-group hit equal to a misaligned reconciled hit is that hit's
        # own ``misaligned`` finding, not a second one.
        if hit < request.hit_tokens or (hit % alignment and hit != request.hit_tokens):
            return gid, hit
    return None


def per_group_findings(
    scenario: Scenario, run: RunObservation, policy: Policy = Policy.VLLM, label: str = ""
) -> list[Finding]:
    """One ``per-group-hit`` finding per request with a per-group hit below its
    reconciled hit, or off the hit alignment where it differs from the
    reconciled hit (the first such group is named).

    Args:
        scenario: the scenario the run served (its groups name the finding's
            group; its effective hit alignment, in tokens, is the grid).
        run: the run's observation; each request's ``per_group_hit_tokens``
            (tokens, one per KV cache group, in group order) and
            ``hit_tokens`` (tokens) are compared.
        policy: the policy recorded on the findings (the rule holds under all).
        label: prefixed to each finding's detail (``"dense cross-check run: "``).
    """
    alignment = scenario.effective_hit_alignment_tokens
    skipped = frozenset(i for i, g in enumerate(scenario.kv_cache_groups) if not g.prefix_cacheable)
    findings = []
    for r in run.requests:
        if r.connector is not None and r.connector.divergent_hit_kept:
            continue  # the full-attention hit, not the reconciled one (PR #50344)
        wrong = wrong_per_group_hit(r, alignment, skipped)
        if wrong is None:
            continue
        gid, hit = wrong
        group = scenario.kv_cache_groups[gid]
        why = (
            f"below the reconciled hit {r.hit_tokens} every group holds"
            if hit < r.hit_tokens
            else f"not a multiple of the hit alignment {alignment}"
        )
        findings.append(
            Finding(
                FindingKind.PER_GROUP_HIT,
                run.variant,
                r.index,
                f"{label}group {gid} ({group.kind.value}, block {group.block_size_tokens}) "
                f"looked up alone hits {hit} tokens, {why} "
                f"(per-group hits {list(r.per_group_hit_tokens)}, reconciled {r.hit_tokens})",
                expected_tokens=r.hit_tokens
                if hit < r.hit_tokens
                else hit // alignment * alignment,
                hit_tokens=hit,
                policy=policy,
            )
        )
    return findings

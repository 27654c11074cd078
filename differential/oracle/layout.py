"""Layout findings: what a KV cache layout costs before any manager runs.

Nothing here imports vLLM. vLLM aligns every hybrid cache hit to the
scheduler block size, the LCM of the group block sizes
(``HybridKVCacheCoordinator._cache_hit_alignment_tokens`` in
vllm/v1/core/kv_cache_coordinator.py; ``resolve_kv_cache_block_sizes`` in
vllm/v1/core/kv_cache_utils.py). When the block sizes divide one another the
LCM is the largest block and nothing is lost; when they do not, the LCM
exceeds every block and each hit is rounded down to it. vLLM PR #52804: a
drafter KV block of 3456 tokens beside a target block of 1536 makes the
alignment 13824 tokens, about 7K tokens lost per request.

:func:`alignment_blowup` prices that on the scenario's own requests: per
sibling, the dense-reference hit at the granularity of the largest group
block against the dense-reference hit at the alignment, in tokens.

The alignment can also be a block vLLM chose for another group, far above
the full-attention block: vllm-ascend issue #16270, a scheduler block of
4096 tokens (a Mamba group's) beside a full-attention block of 128, where
every prompt shorter than 4096 tokens gets 0. That is flagged too, when the
alignment exceeds the full-attention block and a sibling whose prompt is
shorter than the alignment loses a hit the full-attention block would give
(priced over the full-attention groups alone: the other groups' blocks are
what is at issue).
"""

from __future__ import annotations

import dataclasses

from differential.errors import ScenarioError
from differential.findings import Finding, FindingKind
from differential.oracle.core import dense_hit, drafter_model
from differential.oracle.prefix import shared_prefixes
from differential.scenario import Scenario

__all__ = ["LAYOUT_VARIANT", "alignment_blowup", "alignment_losses"]

#: The ``variant`` of a layout finding: it belongs to the layout, not to a
#: manager, so it is reported once per scenario.
LAYOUT_VARIANT = "layout"


def alignment_losses(scenario: Scenario, granularity_tokens: int | None = None) -> tuple[int, ...]:
    """Tokens each request loses to the hit alignment, per request (0 for the first).

    For request ``j`` the best dense-reference hit over the earlier requests
    at the granularity of the largest group block (or ``granularity_tokens``),
    minus the same at the hit alignment ``A``
    (:func:`differential.oracle.core.dense_hit`), in tokens.
    """
    largest = granularity_tokens or max(g.block_size_tokens for g in scenario.kv_cache_groups)
    return _losses(scenario, scenario, largest)


def _losses(scenario: Scenario, at_block_scenario: Scenario, block_tokens: int) -> tuple[int, ...]:
    """Per request ``j`` (0 for the first): the best dense hit of
    ``at_block_scenario`` over the earlier requests at ``block_tokens``
    granularity, minus ``scenario``'s best at its hit alignment, in tokens."""
    model, block_model = drafter_model(scenario), drafter_model(at_block_scenario)
    # Shared tokens by content, an earlier turn's answer included in a
    # multi-turn chat (both scenarios have the same requests).
    rows = shared_prefixes(scenario)
    losses = [0]
    for j in range(1, len(rows)):
        at_block, at_alignment = 0, 0
        for i in range(j):
            shared = rows[j][i]
            at_block = max(
                at_block, dense_hit(at_block_scenario, block_model, j, i, shared, block_tokens)
            )
            at_alignment = max(at_alignment, dense_hit(scenario, model, j, i, shared))
        losses.append(max(0, at_block - at_alignment))
    return tuple(losses)


def _full_attention_losses(scenario: Scenario, block_tokens: int) -> tuple[int, ...]:
    """Per request, what the full-attention groups alone would give at their
    block's granularity minus the hit at the alignment, in tokens (0 for the
    first): the other groups' blocks are the alignment at issue."""
    groups = tuple(g for g in scenario.kv_cache_groups if g.kind.full_attention_family)
    try:
        alone = dataclasses.replace(
            scenario,
            kv_cache_groups=groups,
            hash_block_size_tokens=None,
            hit_alignment_tokens=None,
            retention_interval_tokens=None,
        )
    except ScenarioError:
        return alignment_losses(scenario, block_tokens)
    return _losses(scenario, alone, block_tokens)


def _describe(scenario: Scenario) -> str:
    return ", ".join(
        f"group {i} {'draft ' if g.is_eagle_group else ''}{g.kind.value} "
        f"block {g.block_size_tokens}"
        for i, g in enumerate(scenario.kv_cache_groups)
    )


def alignment_blowup(scenario: Scenario) -> Finding | None:
    """An ``alignment-blowup`` finding when the hit alignment exceeds the
    largest group block size, or exceeds the full-attention block while a
    sibling shorter than the alignment loses everything; else ``None``.

    The finding names the groups (index, kind, block size in tokens, draft
    mark), the alignment in tokens and the tokens each sibling loses to it
    (:func:`alignment_losses`); ``expected_tokens`` is the largest block
    (the full-attention block in the second form), ``hit_tokens`` the
    alignment. Fine-grained Mamba hits align to the hash block instead,
    which never exceeds a block: no finding.
    """
    alignment = scenario.effective_hit_alignment_tokens
    largest = max(g.block_size_tokens for g in scenario.kv_cache_groups)
    if alignment > largest:
        losses = alignment_losses(scenario)
        return Finding(
            FindingKind.ALIGNMENT_BLOWUP,
            LAYOUT_VARIANT,
            None,
            f"hit alignment {alignment} tokens (LCM of {_describe(scenario)}) exceeds the "
            f"largest block {largest}: siblings lose {list(losses[1:])} tokens "
            f"(total {sum(losses)}) against hits at the largest block's granularity",
            expected_tokens=largest,
            hit_tokens=alignment,
        )
    full = [g.block_size_tokens for g in scenario.kv_cache_groups if g.kind.full_attention_family]
    if not full or alignment <= min(full):
        return None
    block = min(full)
    losses = _full_attention_losses(scenario, block)
    prompts = [r.prompt_tokens for r in scenario.requests]
    starved = [j for j in range(1, len(losses)) if prompts[j] < alignment and losses[j] > 0]
    if not starved:
        return None
    return Finding(
        FindingKind.ALIGNMENT_BLOWUP,
        LAYOUT_VARIANT,
        None,
        f"hit alignment {alignment} tokens ({_describe(scenario)}) exceeds the "
        f"full-attention block {block}: requests {starved}, shorter than {alignment} "
        f"tokens, get 0 where the full-attention block gives "
        f"{[losses[j] for j in starved]} tokens; siblings lose {list(losses[1:])} tokens "
        f"(total {sum(losses)})",
        expected_tokens=block,
        hit_tokens=alignment,
    )

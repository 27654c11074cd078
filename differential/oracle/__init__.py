"""The oracle: what each sibling is owed, from first principles, and the verdicts.

Nothing in this package imports vLLM. One module per concern, so that a new
KV cache group kind adds one module here:

* :mod:`differential.oracle.core` -- the drafter model, the dense reference,
  the intended checkpoints under each policy (the one-unit rule by default)
  and the verdicts for attention groups (full attention, sliding window).
* :mod:`differential.oracle.blocks` -- the block-level check (``wrong-kv``):
  every block a lookup hands out, and every block a step writes.
* :mod:`differential.oracle.state` -- the rules for state groups (Mamba):
  where a writer's states exist, what a sibling is owed, the one-unit rule on
  states.
* :mod:`differential.oracle.per_group` -- each group's own hit
  (``find_longest_cache_hit_per_group``) against the reconciled hit
  (``per-group-hit``).
* :mod:`differential.oracle.kv_events` -- the KV cache event stream against
  the prefix cache it describes (``kv-events``).
* :mod:`differential.oracle.watermark` -- (scheduler mode) admissions beside
  scheduled requests leave the KV cache watermark free (``watermark``).
* :mod:`differential.oracle.layout` -- what a layout costs before any manager
  runs (``alignment-blowup``: a hit alignment above every block size).
* :mod:`differential.oracle.known` -- the known vLLM issues: findings that a
  recorded upstream issue explains, recognised from first principles and
  labelled wherever a finding is made (the comparison, engine mode).

Group kinds map onto the rules by the manager vLLM drives them with: MLA is
full attention for hits (``FullAttentionManager``), sliding-window MLA a
sliding window (``SlidingWindowManager``); chunked local attention needs only
the blocks of the chunk a hit ends in (``ChunkedLocalAttentionManager``). The
EAGLE drop applies per group: to the ``is_eagle_group`` groups when the
drafter's groups are marked, else to every group
(:attr:`differential.scenario.Scenario.drop_group_indices`).

The public names below are the package's face; the rest is internal.
"""

from __future__ import annotations

from differential.oracle.core import (
    DrafterModel,
    SiblingReference,
    checkpoints,
    cross_check_dense,
    dense_hit,
    divergence_points,
    drafter_model,
    judge_run,
    model_from_settings,
    needless_protection_model,
    promise_policy,
    references,
    replay_boundaries,
    writer_extent,
)
from differential.oracle.prefix import common_prefix_tokens
from differential.oracle.state import (
    attention_dense_hit,
    state_group_indices,
    state_positions,
    state_references,
)

__all__ = [
    "DrafterModel",
    "SiblingReference",
    "attention_dense_hit",
    "checkpoints",
    "common_prefix_tokens",
    "cross_check_dense",
    "dense_hit",
    "divergence_points",
    "drafter_model",
    "judge_run",
    "model_from_settings",
    "needless_protection_model",
    "promise_policy",
    "references",
    "replay_boundaries",
    "state_group_indices",
    "state_positions",
    "state_references",
    "writer_extent",
]

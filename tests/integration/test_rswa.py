"""R-SWA groups on vLLM's real RSWAManager (vLLM 0.33.0 ``RSWASpec``,
vllm/v1/core/single_type_kv_cache_manager.py): hits as full attention, and
decode blocks between the prompt and the last ``rswa_window`` tokens freed
(null) without a wrong-kv finding. Values from real runs."""

from __future__ import annotations

import pytest

from differential.compare import compare_variants
from differential.oracle.blocks import table_violations
from differential.scenario import GroupKind, KVCacheGroup, Scenario
from differential.variants import parse_variants

pytestmark = pytest.mark.vllm


def _scenario(kind: str, mode: str) -> Scenario:
    group = {"kind": kind, "block_size_tokens": 16}
    if kind == "rswa":
        group["sliding_window_tokens"] = 16
    return Scenario.from_dict(
        {
            "format": "kvfuzz.scenario",
            "version": 1,
            "kv_cache_groups": [{"kind": "full_attention", "block_size_tokens": 16}, group],
            "prefill_chunk_tokens": 64,
            "decode_steps": 64,
            "shared_prefix_tokens": 40,
            "requests": [
                {"name": "turn-1", "divergence_tokens": 40, "suffix_tokens": 0},
                {
                    "name": "turn-2",
                    "shares_with": 0,
                    "divergence_tokens": 105 if mode == "scheduler" else 40,
                    "suffix_tokens": 16,
                },
            ],
            "workload": {"mode": mode, "shares_output": mode == "scheduler"},
        }
    )


def test_rswa_beside_full_attention_hits_as_full_attention_in_scheduler_mode() -> None:
    # Turn 2 copies turn 1's 40-token prompt and 65 decoded tokens: the
    # decoded gap blocks were freed (null in turn 1's table) but stay cached
    # in the pool, so vLLM 0.33.0 hits 96 as full attention alone does.
    rswa = compare_variants(_scenario("rswa", "scheduler"), parse_variants("unfixed"))
    full = compare_variants(_scenario("mla", "scheduler"), parse_variants("unfixed"))
    assert [list(r.run.hits) for r in rswa.results] == [[0, 96]]
    assert [list(r.run.hits) for r in full.results] == [[0, 96]]
    assert rswa.findings == ()
    # RSWAManager did free turn 1's decode gap: null blocks past the prompt.
    tables = [t for t in rswa.results[0].run.requests[0].step_tables if t.group == 1]
    # The last step, 104 computed: window start max(40, 104 - 16) = 88, so
    # blocks 3 and 4 (tokens 48..80) are null.
    assert max(t.null_end for t in tables) == 5
    assert min(t.first_real for t in tables) == 0  # the prompt's blocks stay


def test_a_null_prompt_block_or_window_block_is_still_wrong_kv() -> None:
    from differential.observation import StepTable

    s = _scenario("rswa", "manager")
    group = s.kv_cache_groups[1]
    assert group == KVCacheGroup(GroupKind.RSWA, 16, 16)
    # Prompt 40 tokens, the step at 100: blocks wholly in [40, 84) may be null
    # (blocks 3 and 4, null_end 5); null_end 6 reaches the window's block.
    ok = StepTable(99, 100, 1, 7, 0, 5)
    bad = StepTable(99, 100, 1, 7, 0, 6)
    assert table_violations(s, [ok], 0, 40) == ([], [])
    freed, _ = table_violations(s, [bad], 0, 40)
    assert [(v.group, v.block_index) for v in freed] == [(1, 5)]
    # Without the prompt, the manager's freeing is judged as full attention's.
    freed, _ = table_violations(s, [ok], 0)
    assert [(v.group, v.block_index) for v in freed] == [(1, 4)]


def test_a_decode_gap_block_still_held_is_a_kept_skipped_block() -> None:
    from differential.observation import StepTable

    s = _scenario("rswa", "manager")
    # Prompt 40 tokens, 99 processed: the gap is blocks 3 and 4 (tokens
    # 48..80, below max(40, 99 - 16) = 83); its top block must be null.
    assert table_violations(s, [StepTable(99, 100, 1, 7, 0, 5)], 0, 40) == ([], [])
    _, kept = table_violations(s, [StepTable(99, 100, 1, 7, 0, 4)], 0, 40)
    assert [(v.group, v.block_index) for v in kept] == [(1, 4)]
    # The gap's first whole block, 3 (tokens 48..64; blocks 0..2 hold the
    # prompt), is owed back once 80 are processed (64 = 80 - 16), not at 79.
    _, kept = table_violations(s, [StepTable(80, 81, 1, 6, 0, 0)], 0, 40)
    assert [(v.group, v.block_index) for v in kept] == [(1, 3)]
    assert table_violations(s, [StepTable(79, 80, 1, 5, 0, 0)], 0, 40) == ([], [])


def test_rswa_manager_mode_hits() -> None:
    result = compare_variants(_scenario("rswa", "manager"), parse_variants("unfixed,fixed"))
    assert [list(r.run.hits) for r in result.results] == [[0, 32]] * 2
    assert result.findings == ()

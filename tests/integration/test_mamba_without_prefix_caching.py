"""A Mamba hybrid with prefix caching off on vLLM 0.33.0's real Scheduler.

vLLM then runs Mamba in ``mamba_cache_mode="none"``: the state block is the
whole model length and each request holds its running state plus one block
per speculative token (``MambaManager.allocate_new_blocks``). The two
bundled cases hold exactly that at every step and hit nothing; a manager
that forgets the speculative blocks is caught as ``wrong-kv``.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from differential.findings import FindingKind
from tests.factories import CORPORA, stock_result

pytestmark = pytest.mark.vllm

CASES = CORPORA / "cases"
ONE = CASES / "mamba-speculative-state-block-without-prefix-caching--scheduler.json"
TWO = CASES / "mamba-two-speculative-state-blocks-without-prefix-caching--scheduler.json"


def _mamba_tables(result: Any) -> dict[int, list[tuple[int, int]]]:
    """Per request, (first token of the step, Mamba blocks held) after each step."""
    return {
        o.index: [(t.start_tokens, t.num_blocks) for t in o.step_tables if t.group == 1]
        for o in result.run.requests
    }


def test_one_speculative_token_holds_two_whole_length_state_blocks() -> None:
    result = stock_result(ONE)
    assert result.run.hits == (0, 0)
    # max_model_len 64 (56-token prompt + 4 decodes + 1 lookahead + 1 draft
    # + 2): the Mamba block, and the Scheduler's block the LCM with 16.
    assert result.run.settings is not None
    assert result.run.settings.hash_block_size_tokens == 64
    assert _mamba_tables(result) == {
        0: [(0, 2), (32, 2), (56, 2), (58, 2), (59, 2)],
        1: [(0, 2), (8, 2), (38, 2), (49, 2), (50, 2), (52, 2)],
    }
    assert result.findings == ()


def test_two_speculative_tokens_hold_three() -> None:
    result = stock_result(TWO)
    assert result.run.hits == (0, 0)
    assert _mamba_tables(result) == {
        0: [(0, 3), (32, 3), (56, 3), (59, 3)],
        1: [(0, 3), (8, 3), (37, 3), (49, 3), (51, 3)],
    }
    assert result.findings == ()


def test_a_manager_without_its_speculative_blocks_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    init = MambaManager.__init__

    def forgetful(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.num_speculative_blocks = 0

    monkeypatch.setattr(MambaManager, "__init__", forgetful)
    result = stock_result(ONE)
    assert [(f.kind, f.request) for f in result.findings] == [
        (FindingKind.WRONG_KV, 0),
        (FindingKind.WRONG_KV, 1),
    ]
    assert result.findings[0].detail == (
        "after the step at 0 tokens Mamba group 1 (no prefix caching, mamba_cache_mode "
        "'none') holds 1 block(s); it owes 2 real ones, the running state and one per "
        "speculative token (1): a state the worker writes has no block of its own"
    )


def test_the_replay_table_says_prefix_caching_is_off() -> None:
    from differential.compare import compare_variants
    from differential.corpus import load_entry
    from differential.reports.table import render_text
    from differential.variants import parse_variants

    result = compare_variants(load_entry(ONE).scenario, parse_variants("unfixed"))
    title = render_text([result], "0.33.0").splitlines()[2]
    assert title.endswith("; A=16, hash block 64, policy vllm, prefix caching off]")

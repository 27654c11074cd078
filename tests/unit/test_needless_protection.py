"""The oracle judges reuse with the protection a run used (no vLLM).

Hand-worked from a campaign's false ``over-hit``: FA 4 + Mamba 4 (A = 4),
retention 0, Gemma-4 MTP, whose drafter writes no draft KV; stock vLLM 0.33.0
protects it anyway, with 1-token lookahead block hashes.
"""

from __future__ import annotations

from differential.findings import FindingKind
from differential.observation import ManagerSettings
from differential.oracle import drafter_model, judge_run, needless_protection_model, references
from differential.scenario import (
    Drafter,
    DrafterKind,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
)
from tests.unit.test_oracle import run

LOOKAHEAD_1 = ManagerSettings(False, 1, 1, 1, 4, 4)
NONE = ManagerSettings(False, 0, 0, 0, 4, 4)


def _gemma4_mamba() -> Scenario:
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 4),
            KVCacheGroup(GroupKind.MAMBA, 4),
        ),
        requests=(
            RequestSpec(20, 0, name="writer"),
            RequestSpec(16, 4, shares_with=0),
            RequestSpec(15, 2, shares_with=1),
        ),
        shared_prefix_tokens=20,
        retention_interval_tokens=0,
        drafter=Drafter(DrafterKind.GEMMA4_MTP, 1),
        prefill_chunk_tokens=8,
    )


def test_the_protection_a_run_used() -> None:
    model = drafter_model(_gemma4_mamba())
    assert (model.drop, model.hash_lookahead_tokens, model.dependency_tokens) == (False, 0, 0)
    as_run = needless_protection_model(model, LOOKAHEAD_1)
    assert as_run is not None
    assert (as_run.drop, as_run.hash_lookahead_tokens, as_run.dependency_tokens) == (False, 1, 0)
    assert needless_protection_model(model, NONE) is None


def test_needless_lookahead_hashes_make_no_over_hit() -> None:
    scenario = _gemma4_mamba()
    hits = [0, 0, 12]
    # Without lookahead hashes (the drafter's own model): request 1 proves
    # 16 (the writer's replay boundary, (20 - 1) // 4 * 4, holds a state), so
    # it would not pin a junction; request 2 (sharing 15) proves 12 and the
    # highest state at or below it is the writer's step end 8.
    model = drafter_model(scenario)
    assert [r.dense_tokens for r in references(scenario, model, hits)] == [0, 16, 8]
    # With the 1-token lookahead hashes the run used: request 1 proves only
    # 15 -> 12, where the writer has no state (its highest below is 8; vLLM
    # gives 0), so it pins its junction at 12 and keeps the state at 12 (the
    # scheduler stops its prefill there); request 2 proves 14 -> 12 and hits
    # that state legitimately.
    as_run = needless_protection_model(model, LOOKAHEAD_1)
    assert as_run is not None
    assert [r.dense_tokens for r in references(scenario, as_run, hits)] == [0, 8, 12]
    _, findings = judge_run(scenario, run(hits, settings=LOOKAHEAD_1))
    assert [(f.kind, f.request) for f in findings] == [(FindingKind.FALLBACK, 1)]
    assert (findings[0].expected_tokens, findings[0].hit_tokens) == (16, 0)
    # The same hits from a run that used no protection would be an over-hit:
    # nothing made the state at 12.
    _, unprotected = judge_run(scenario, run(hits, settings=NONE))
    assert (FindingKind.OVER_HIT, 2) in [(f.kind, f.request) for f in unprotected]

"""Prefix caching off (``workload.prefix_caching`` false): the JSON form, the
one-line errors, what every request is owed, and the whole-sequence state
rule on hand-worked block tables (no vLLM)."""

from __future__ import annotations

import pytest

from differential.errors import ScenarioError
from differential.observation import StepTable
from differential.oracle.blocks import ViolationKind, table_violations
from differential.scenario import (
    ConnectorStore,
    Drafter,
    DrafterKind,
    DriveMode,
    GroupKind,
    KVCacheGroup,
    KVEvents,
    RequestSpec,
    Scenario,
    Workload,
)


def _scenario(
    speculative: int = 1,
    retention: int | None = None,
    kv_connector: bool = False,
    **workload: object,
) -> Scenario:
    """Full attention 16 + Mamba 16, a 48-token writer and a reader of 40 + 9."""
    fields: dict[str, object] = {"mode": DriveMode.SCHEDULER, "prefix_caching": False}
    fields.update(workload)
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 16),
            KVCacheGroup(GroupKind.MAMBA, 16),
        ),
        requests=(RequestSpec(48, 8), RequestSpec(40, 9, 0)),
        shared_prefix_tokens=48,
        drafter=Drafter(DrafterKind.MTP, speculative),
        retention_interval_tokens=retention,
        kv_connector=kv_connector,
        workload=Workload(**fields),  # type: ignore[arg-type]
    )


def test_the_switch_round_trips_and_is_written_only_when_off() -> None:
    off = _scenario()
    assert off.to_dict()["workload"]["prefix_caching"] is False
    assert Scenario.from_dict(off.to_dict()) == off
    on = _scenario(prefix_caching=True)
    assert "prefix_caching" not in on.to_dict()["workload"]


def test_nothing_is_read_or_owed_and_the_run_is_not_sequential() -> None:
    off = _scenario(arrival_steps=None)
    assert off.prefix_caching is False
    assert [off.reads_prefix_cache(i) for i in range(2)] == [False, False]
    # The manager-level driver runs with caching on: no mode cross-check.
    assert off.workload.sequential is False
    on = _scenario(prefix_caching=True, arrival_steps=None)
    assert [on.reads_prefix_cache(i) for i in range(2)] == [True, True]
    assert on.workload.sequential is True


@pytest.mark.parametrize(
    ("changes", "field", "allowed"),
    [
        ({"mode": DriveMode.MANAGER}, "workload.prefix_caching", "true in manager mode"),
        (
            {"connector": ConnectorStore()},
            "workload.prefix_caching",
            "true with a connector store (set workload.connector.prefix_caching instead)",
        ),
        ({"kv_events": KVEvents.INCREMENTAL}, "workload.kv_events", "'off' when"),
    ],
)
def test_a_switch_vllm_would_not_honour_is_one_line_naming_the_field(
    changes: dict[str, object], field: str, allowed: str
) -> None:
    with pytest.raises(ScenarioError) as caught:
        _scenario(kv_connector="connector" in changes, **changes)
    assert caught.value.field == field
    assert allowed in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_retention_interval_is_refused_without_a_prefix_cache() -> None:
    # 0 (junctions and replay boundaries only) and null retain nothing here.
    assert _scenario(retention=0).retention_interval_tokens == 0
    with pytest.raises(ScenarioError) as caught:
        _scenario(retention=16)
    assert caught.value.field == "retention_interval_tokens"
    assert "null or 0 when workload.prefix_caching is false" in str(caught.value)


def _table(num_blocks: int, first_real: int = 0, null_end: int = 0) -> StepTable:
    # A step from 32 to 56 tokens on the Mamba group (index 1).
    return StepTable(32, 32, 1, num_blocks, first_real, null_end)


@pytest.mark.parametrize(
    ("speculative", "table", "freed", "kept"),
    [
        # The running state and one block per speculative token: clean.
        (1, _table(2), [], []),
        (2, _table(3), [], []),
        # One block short: the draft token's state has no block.
        (1, _table(1), [(ViolationKind.COUNT, 0)], []),
        (2, _table(2), [(ViolationKind.COUNT, 0)], []),
        # A null block among them is no block of its own either.
        (1, _table(2, 1, 1), [(ViolationKind.COUNT, 0)], []),
        # One block too many: held from the pool, never written.
        (1, _table(3), [], [(ViolationKind.KEPT_SKIPPED, 2)]),
    ],
)
def test_a_whole_sequence_state_group_owes_one_block_per_speculative_token_plus_one(
    speculative: int,
    table: StepTable,
    freed: list[tuple[ViolationKind, int]],
    kept: list[tuple[ViolationKind, int]],
) -> None:
    got_freed, got_kept = table_violations(_scenario(speculative), [table], 0, 57)
    assert [(v.kind, v.block_index) for v in got_freed] == freed
    assert [(v.kind, v.block_index) for v in got_kept] == kept
    for v in got_freed + got_kept:
        assert v.group == 1
        assert f"holds {table.num_blocks} block(s)" in v.detail
        assert f"it owes {1 + speculative} real ones" in v.detail


def test_only_the_first_violation_per_group_is_named() -> None:
    freed, _ = table_violations(_scenario(1), [_table(1), _table(1)], 0, 57)
    assert len(freed) == 1


def test_mamba_checkpoints_are_refused_without_a_prefix_cache() -> None:
    on = _scenario(prefix_caching=True)
    with pytest.raises(ScenarioError) as caught:
        Scenario.from_dict(
            {
                **on.to_dict(),
                "mamba_prefill": "checkpoint",
                "workload": {**on.to_dict()["workload"], "prefix_caching": False},
            }
        )
    assert caught.value.field == "mamba_prefill"
    assert "allowed 'scheduler' when workload.prefix_caching is false" in str(caught.value)


def test_the_shrinker_tries_prefix_caching_on() -> None:
    from fuzz.minimize import _workload

    steps = dict(_workload(_scenario()))
    on = steps["prefix caching on"]
    assert on is not None
    assert on.workload.prefix_caching is True
    assert "prefix caching on" not in dict(_workload(_scenario(prefix_caching=True)))


def test_the_generator_turns_prefix_caching_off_only_for_mamba_hybrids() -> None:
    from differential.mutation.score import campaign_scenarios

    drawn = campaign_scenarios(53, 300, scheduler=True)
    off = [s for s in drawn if not s.workload.prefix_caching]
    assert off, "no scenario of 300 turned prefix caching off"
    for s in off:
        assert s.mamba_groups
        assert s.workload.connector is None
        assert s.workload.kv_events is KVEvents.OFF

"""The combined calibration table of the engine fidelity benchmark
(``benchmarks/engine_fidelity.py --calibration-table``): its cells, its
summary row and its exit status, from rows shaped as ``--out`` writes them."""

from __future__ import annotations

from typing import Any

from benchmarks.engine_fidelity import calibration_summary, combined_calibration_table


def _row(file: str, broken: list[int], flagged: list[int]) -> dict[str, Any]:
    return {
        "file": file,
        "status": "engine only",
        "engine_hits": [0, 64],
        "broken_requests": broken,
        "wrong_output_requests": flagged,
    }


def _not_applicable(file: str) -> dict[str, Any]:
    return {"file": file, "status": "not applicable", "why": "no MambaSpec group"}


def test_every_breakage_caught_and_stock_clean_exits_0() -> None:
    runs = {
        "stock": [_row("a.json", [], []), _row("b.json", [], [])],
        "wrong-block": [_row("a.json", [1], [1]), _row("b.json", [], [])],
        "stale-swa-block": [_row("a.json", [1], []), _not_applicable("b.json")],
        "wrong-mamba-ssm": [_not_applicable("a.json"), _row("b.json", [1], [1])],
    }
    table, status = combined_calibration_table(runs)
    assert status == 0
    lines = table.splitlines()
    assert lines[0] == (
        "| scenario | engine hits | `stock` | `wrong-block` | `stale-swa-block` (control) "
        "| `wrong-mamba-ssm` |"
    )
    assert lines[2] == "| `a.json` | [0, 64] | clean | 1 / 1 | 1 / none | n/a |"
    assert lines[3] == "| `b.json` | [0, 64] | clean | - | n/a | 1 / 1 |"
    assert lines[4] == (
        "| **summary** | | **2 of 2 clean** | **caught 1 of 1 in 1; other flagged 0** "
        "| **applied 1, flagged 0** | **caught 1 of 1 in 1; other flagged 0** |"
    )


def test_a_miss_a_flagged_control_or_a_flagged_stock_run_exits_1() -> None:
    missed = {"wrong-block": [_row("a.json", [1, 3], [1])]}
    assert combined_calibration_table(missed)[1] == 1
    control = {"stale-swa-block": [_row("a.json", [1], [1])]}
    assert combined_calibration_table(control)[1] == 1
    stock = {"stock": [_row("a.json", [], [2])]}
    assert combined_calibration_table(stock)[1] == 1
    never_applied = {"wrong-mamba-conv": [_row("a.json", [], [])]}
    assert combined_calibration_table(never_applied)[1] == 1


def test_the_summary_counts_requests_not_scenarios() -> None:
    rows = [_row("a.json", [1, 3], [1, 3]), _row("b.json", [2], [2, 4]), _not_applicable("c.json")]
    assert calibration_summary(rows, "wrong-block") == {
        "ran": 2,
        "applied": 2,
        "broken": 3,
        "caught": 3,
        "other": 1,
        "status": 1,
    }

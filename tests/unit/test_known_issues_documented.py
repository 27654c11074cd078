"""The manual's table of known vLLM issues names every issue kvfuzz labels (no vLLM).

The table lives in ``docs/triage.md`` under the heading "Known vLLM issues".
"""

from __future__ import annotations

from pathlib import Path

from differential.oracle.known import KNOWN_FIX_COSTS, KNOWN_ISSUES

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "triage.md"
HEADING = "## Known vLLM issues"
COSTS_HEADING = "## Known costs of kvfuzz's fixes"


def _table_rows(heading: str = HEADING) -> set[str]:
    """First-column names of the table under ``heading``, up to the next heading."""
    lines = PAGE.read_text().splitlines()
    start = lines.index(heading)
    rows: set[str] = set()
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("| `"):
            rows.add(line.split("|")[1].strip().strip("`"))
    return rows


def test_every_known_issue_has_a_row_in_the_manual() -> None:
    rows = _table_rows()
    assert {issue.name for issue in KNOWN_ISSUES} <= rows
    for issue in KNOWN_ISSUES:
        assert (ROOT / issue.example).is_file(), issue.example


def test_every_row_names_a_known_issue() -> None:
    assert _table_rows() <= {issue.name for issue in KNOWN_ISSUES}


def test_every_known_cost_of_a_fix_has_a_row_and_a_documented_example() -> None:
    assert _table_rows(COSTS_HEADING) == {cost.name for cost in KNOWN_FIX_COSTS}
    for cost in KNOWN_FIX_COSTS:
        assert cost.fix_scope is not None, cost.name
        page, _, anchor = cost.example.partition("#")
        text = (ROOT / page).read_text()
        headings = {
            line.lstrip("#").strip().lower().replace(" ", "-")
            for line in text.splitlines()
            if line.startswith("#")
        }
        assert anchor in headings, cost.example

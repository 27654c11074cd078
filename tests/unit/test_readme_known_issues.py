"""The README's table of known vLLM issues names every issue kvfuzz labels (no vLLM)."""

from __future__ import annotations

from pathlib import Path

from differential.triage.known import KNOWN_ISSUES

README = Path(__file__).parents[2] / "README.md"


def test_every_known_issue_has_a_readme_row() -> None:
    rows = {
        line.split("|")[1].strip().strip("`")
        for line in README.read_text().splitlines()
        if line.startswith("| `")
    }
    assert {issue.name for issue in KNOWN_ISSUES} <= rows
    for issue in KNOWN_ISSUES:
        assert (README.parent / issue.example).is_file(), issue.example

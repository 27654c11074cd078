"""Every relative link in the README and the manual names a file that exists, and a heading in it.

Anchors follow GitHub's heading slugs: lower case, punctuation other than
``-`` dropped, spaces as ``-``. Headings inside fenced code blocks (shell
comments) are not headings.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks."""
    lines: list[str] = []
    in_fence = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence:
            lines.append(line)
    return lines


def anchors(page: Path) -> set[str]:
    return {
        slug(line.lstrip("#")) for line in prose(page.read_text()) if re.match(r"#{1,6} ", line)
    }


def links(page: Path) -> list[str]:
    return [
        target
        for line in prose(page.read_text())
        for target in LINK.findall(line)
        if not re.match(r"[a-z]+:", target)  # https:, mailto:
    ]


CASES = [
    pytest.param(page, target, id=f"{page.relative_to(ROOT)}->{target}")
    for page in PAGES
    for target in links(page)
]


def test_slugs_follow_github() -> None:
    assert slug("Guarding across releases: `release:X.Y.Z` and `kvfuzz diff`") == (
        "guarding-across-releases-releasexyz-and-kvfuzz-diff"
    )
    assert slug("vLLM issue #48435: eviction collapse") == "vllm-issue-48435-eviction-collapse"


def test_the_readme_links_into_the_manual() -> None:
    targets = {target.split("#")[0] for target in links(ROOT / "README.md")}
    pages = {f"docs/{page.name}" for page in PAGES if page.parent.name == "docs"}
    assert pages - {"docs/mutation-report.md"} <= targets


@pytest.mark.parametrize(("page", "target"), CASES)
def test_link_resolves(page: Path, target: str) -> None:
    path, _, anchor = target.partition("#")
    destination = (page.parent / path).resolve() if path else page
    assert destination.is_file(), f"{page.name}: {target}: no such file"
    if anchor and destination.suffix == ".md":
        assert anchor in anchors(destination), f"{page.name}: {target}: no such heading"

"""``kvfuzz export-test``: the exported pytest fails on stock vLLM, passes with the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import CORPORA, ROOT

pytestmark = pytest.mark.vllm


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, check=False
    )


@pytest.mark.parametrize(
    ("corpus_file", "assertion"),
    [
        ("regressions/fallback-unfixed-517c289c14.json", "assert hits[1] == 6, hits"),
        ("seeds/gemma4-mtp3-swa16-fa32-r8192.json", "assert hits[1] == 16384, hits"),
    ],
)
def test_exported_test_fails_stock_and_passes_fixed(
    tmp_path: Path, corpus_file: str, assertion: str
) -> None:
    export = _run("-m", "differential.cli", "export-test", str(CORPORA / corpus_file), cwd=ROOT)
    assert export.returncode == 0, export.stderr
    source = export.stdout
    assert "kvfuzz" not in "".join(
        line for line in source.splitlines() if line.startswith(("import", "from"))
    )
    assert assertion in source
    test_file = tmp_path / "test_exported.py"
    test_file.write_text(source)
    stock = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file), cwd=tmp_path)
    assert stock.returncode == 1, stock.stdout[-1500:]
    assert "AssertionError" in stock.stdout
    fixed = _run(
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "2",  # under pytest-xdist too: every worker installs the variant's patches
        "--kvfuzz-variant",
        "fixed",
        str(test_file),
        cwd=tmp_path,
    )
    assert fixed.returncode == 0, fixed.stdout[-1500:]

"""``kvfuzz export-test``: the exported pytest fails on stock vLLM, passes with the fix."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.factories import CORPORA, ROOT, python_module

pytestmark = pytest.mark.vllm


def _run(flag: str, module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` (see :func:`tests.factories.python_module`)."""
    assert flag == "-m"
    return python_module(module, *args, cwd=cwd)


@pytest.mark.parametrize(
    ("corpus_file", "assertion", "xdist"),
    [
        (
            "regressions/fallback-unfixed-517c289c14.json",
            'assert hits[1] == 6, (\n        f"request 1 must hit the checkpoint at 6 tokens; '
            'hits per request: {hits}"\n    )',
            True,
        ),
        (
            "seeds/gemma4-mtp3-swa16-fa32-r8192.json",
            'assert hits[1] == 16384, (\n        f"request 1 must hit the checkpoint at 16384 '
            'tokens; hits per request: {hits}"\n    )',
            False,  # the plugin under pytest-xdist is the first case's: 40 CPU-s a run
        ),
    ],
)
def test_exported_test_fails_stock_and_passes_fixed(
    tmp_path: Path, corpus_file: str, assertion: str, xdist: bool
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
    # The failure says what was owed, not a bare "AssertionError: [0, 4, ...]".
    assert "AssertionError: request 1 must hit the checkpoint at " in stock.stdout
    fixed = _run(
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        # under pytest-xdist too: every worker installs the variant's patches
        *(("-n", "2") if xdist else ()),
        "--kvfuzz-variant",
        "fixed",
        str(test_file),
        cwd=tmp_path,
    )
    assert fixed.returncode == 0, fixed.stdout[-1500:]


@pytest.mark.parametrize("mutant", ["mutant-null-in-window", "mutant-extra-block"])
def test_exported_wrong_kv_test_asserts_blocks_per_group(tmp_path: Path, mutant: str) -> None:
    seed = CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json"
    export = _run(
        "-m",
        "differential.cli",
        "export-test",
        str(seed),
        "--variants",
        f"fixed,{mutant}",
        cwd=ROOT,
    )
    assert export.returncode == 0, export.stderr
    source = export.stdout
    assert "wrong-kv on request 1" in source
    # As vLLM's test_prefix_caching.py: blocks per group = hit / block size.
    assert "assert block_counts[1] == [hits[1] // 8, hits[1] // 4], (\n" in source
    assert "assert all(k < max(0, hits[1] - 16 + 1) // 4 for k in null_blocks[1][1])" in source
    test_file = tmp_path / "test_exported.py"
    test_file.write_text(source)
    results = {}
    for variant in ("fixed", mutant):
        proc = _run(
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--kvfuzz-variant",
            variant,
            str(test_file),
            cwd=tmp_path,
        )
        results[variant] = proc.returncode
    assert results == {"fixed": 0, mutant: 1}


@pytest.mark.parametrize(
    ("mode", "comment"),
    [
        (
            "manager",
            "at request 0, KVCacheManager.get_computed_blocks raises IndexError",
        ),
        ("scheduler", "Scheduler.schedule raises IndexError"),
    ],
)
def test_an_exported_crash_test_fails_on_stock_with_vllms_exception(
    tmp_path: Path, mode: str, comment: str
) -> None:
    """A ``crash`` finding exports as a test that every request runs: on
    stock vLLM it fails with the IndexError vLLM raises in its lookup (in
    scheduler mode, inside ``Scheduler.schedule``)."""
    known = ROOT / "known-issues" / "single-swa-group-lookahead-hashes-index-error.json"
    if mode == "scheduler":
        # Its 2-token prefill chunk is the step budget there, which vLLM's
        # VllmConfig refuses beside 2 lookahead tokens: a 4-token budget.
        document = json.loads(known.read_text())
        document["prefill_chunk_tokens"] = 4
        del document["expect"]
        known = tmp_path / "lookahead-index-error-budget-4.json"
        known.write_text(json.dumps(document))
    export = _run(
        "-m",
        "differential.cli",
        "export-test",
        str(known),
        "--variants",
        "unfixed",
        "--mode",
        mode,
        cwd=ROOT,
    )
    assert export.returncode == 0, export.stderr
    source = export.stdout
    # The comment quotes vLLM's message and where it was raised (the lookup's
    # innermost vLLM frame), then the assertion follows.
    found = f"    # Every request ran. Found by kvfuzz on unfixed: {comment} (list index out of"
    assert found in source
    assert (
        '\n    assert len(hits) == 1, f"{len(hits)} of 1 requests ran"\n'
        in source[source.index(found) :]
    )
    test_file = tmp_path / "test_exported_crash.py"
    test_file.write_text(source)
    stock = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file), cwd=tmp_path)
    assert stock.returncode == 1, stock.stdout[-1500:]
    assert re.search(r"^E\s+IndexError: list index out of range$", stock.stdout, re.M)
    assert "vllm/v1/core/single_type_kv_cache_manager.py" in stock.stdout


def test_exported_tests_are_ruff_clean_without_dead_code(tmp_path: Path) -> None:
    """Exports of each shape (manager mode with an MTP drafter, a Mamba
    hybrid, MLA groups, scheduler mode) pass ``ruff check`` with kvfuzz's own
    config, outside tests/ (whose per-file ignores would hide ANN), and carry
    no code that cannot run (``if False``, ``range(0)``, a constant test)."""
    pytest.importorskip("ruff")
    files = [
        CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json",
        ROOT / "known-issues" / "fine-grained-replay-state-discarded-L100.json",
        CORPORA / "cases" / "dsv4-flash-dspark-mla-3swa.json",
        CORPORA / "cases" / "gemma4-mtp-53670-concurrency2.json",
    ]
    out = tmp_path / "exported"
    out.mkdir()
    for index, path in enumerate(files):
        export = _run("-m", "differential.cli", "export-test", str(path), cwd=ROOT)
        assert export.returncode == 0, export.stderr
        source = export.stdout
        for dead in (
            "if False",
            "if True",
            "range(0)",
            "if None",
            "False and",
            "if method is None",
        ):
            assert dead not in source, (path.name, dead)
        (out / f"exported_{index}.py").write_text(source)
    lint = _run(
        "-m",
        "ruff",
        "check",
        "--no-cache",
        "--config",
        str(ROOT / "pyproject.toml"),
        str(out),
        cwd=tmp_path,
    )
    assert lint.returncode == 0, lint.stdout[-3000:]

"""``kvfuzz explain`` on the Triton seed: the two SWA blocks the fix keeps."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.factories import CORPORA, ROOT, kvfuzz_cli

pytestmark = pytest.mark.vllm


def test_explain_shows_the_two_missing_swa_blocks(tmp_path: Path) -> None:
    svg = tmp_path / "triton.svg"
    proc = kvfuzz_cli(
        "explain",
        str(CORPORA / "seeds" / "triton-mtp3-swa16-fa32-r8192.json"),
        "--svg",
        str(svg),
        cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("request 1: divergence point 16384, expected checkpoint 16352")
    rows = {line.split()[0]: line.split()[3] for line in lines if " g1 swa16 " in line}
    unfixed_gap = len(rows["unfixed"]) - len(rows["unfixed"].lstrip("·"))
    fixed_gap = len(rows["fixed"]) - len(rows["fixed"].lstrip("·"))
    assert unfixed_gap - fixed_gap == 2  # A / B_swa = 32 / 16 blocks
    assert "hit 8192 (left of the view); fallback" in proc.stdout
    assert "hit 16352; ok" in proc.stdout
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    assert sum(1 for e in root.iter() if e.tag.endswith("rect")) > 200


def test_explain_lists_the_blocks_of_a_wrong_kv_lookup() -> None:
    proc = kvfuzz_cli(
        "explain",
        str(CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json"),
        "--variants",
        "fixed,mutant-null-in-window",
        cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stderr
    assert "hit 248; wrong-kv" in proc.stdout
    lists = {
        line.split(":")[0].strip(): line.split("[")[1].rstrip("]").split(", ")
        for line in proc.stdout.splitlines()
        if "blocks for hit 248 (" in line
    }
    # 248 tokens: 31 full-attention blocks of 8, 62 SWA blocks of 4.
    assert "fixed g0: 31 blocks for hit 248 (31 owed)" in proc.stdout
    assert "fixed g1: 62 blocks for hit 248 (62 owed)" in proc.stdout
    # Window 16 reads tokens 233..247: SWA blocks 58..61, the last four.
    assert lists["fixed g1"][-5:] == ["null", *lists["fixed g1"][-4:]]
    assert "null" not in lists["fixed g1"][-4:]
    assert lists["mutant-null-in-window g1"][-4:] == [*lists["fixed g1"][-4:-1], "null"]


def _crash_after_writer(tmp_path: Path) -> Path:
    """The known single-SWA-group IndexError, behind a writer that runs: the
    sibling's 19-token lookup raises inside vLLM with the writer's blocks cached."""
    import json

    known = ROOT / "known-issues" / "single-swa-group-lookahead-hashes-index-error.json"
    data = json.loads(known.read_text())
    del data["expect"]
    data["name"] = "swa-crash-after-writer"
    data["shared_prefix_tokens"] = 20
    data["requests"] = [
        {"name": "writer", "shares_with": None, "divergence_tokens": 20, "suffix_tokens": 0},
        {"name": "sibling", "shares_with": None, "divergence_tokens": 18, "suffix_tokens": 1},
    ]
    path = tmp_path / "crash.json"
    path.write_text(json.dumps(data))
    return path


def test_explain_draws_a_crash_with_the_blocks_up_to_it(tmp_path: Path) -> None:
    svg = tmp_path / "crash.svg"
    proc = kvfuzz_cli(
        "explain",
        str(_crash_after_writer(tmp_path)),
        "--variants",
        "unfixed",
        "--svg",
        str(svg),
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == (
        "request 1: divergence point 18, expected checkpoint 16, dense reference 16 (A = 2, R = 4)"
    )
    # The writer's 20 tokens left blocks 3, 5, 7 (tokens 6..19) cached under
    # retention 4 and window 2: what the sibling's lookup found before vLLM raised.
    assert "unfixed g0 swa2    █·█·█·  crashed; crash" in lines
    assert lines[-2] == (
        "unfixed crashed on request 1 (blocks as cached when its lookup started): "
        "request 1: lookup: KVCacheManager.get_computed_blocks: IndexError: list index out "
        "of range [raised in SlidingWindowManager.find_longest_cache_hit "
        "(vllm/v1/core/single_type_kv_cache_manager.py)]"
    )
    assert lines[-1] == f"SVG: {svg}"
    texts = [e.text or "" for e in ET.parse(svg).getroot().iter() if e.tag.endswith("text")]
    assert "crashed: crash" in texts

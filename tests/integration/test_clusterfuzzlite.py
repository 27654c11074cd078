"""The ClusterFuzzLite / OSS-Fuzz layout, checked without Docker."""

from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.factories import CORPORA, ROOT

pytestmark = pytest.mark.vllm


def test_layout_builds_and_each_fuzzer_runs(tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    assert (ROOT / ".clusterfuzzlite" / "project.yaml").read_text().strip() == "language: python"
    dockerfile = (ROOT / ".clusterfuzzlite" / "Dockerfile").read_text()
    assert "base-builder-python" in dockerfile and "build.sh" in dockerfile
    env = dict(os.environ, KVFUZZ_FUZZ_SECONDS="5")
    proc = subprocess.run(
        [str(ROOT / "scripts" / "check-clusterfuzzlite.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    # The fixed fuzzer draws Mamba hybrids too, where the state oracle still
    # has unexplained disagreements with vLLM: it must run; clean or not.
    assert (
        "kvfuzz_fixed_fuzzer: clean" in proc.stdout
        or "kvfuzz_fixed_fuzzer: finding saved to" in proc.stdout
    )
    # Stock 0.33.0 has the bug, but whether 5 s of libFuzzer (the seed corpus
    # alone on a loaded machine) reaches an unexplained finding depends on
    # how the corpus bytes decode: the fuzzer must run, either way.
    assert (
        "kvfuzz_installed_fuzzer: finding saved to" in proc.stdout
        or "kvfuzz_installed_fuzzer: clean" in proc.stdout
    )
    with zipfile.ZipFile(tmp_path / "kvfuzz_fixed_fuzzer_seed_corpus.zip") as archive:
        assert len(archive.namelist()) == len(list(CORPORA.rglob("*.json")))

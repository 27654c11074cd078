"""Engine features without the engine environment: exit 2, one line saying how to get it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.factories import CORPORA

ROOT = Path(__file__).resolve().parents[2]
EAGLE = CORPORA / "cases" / "engine-seed-class-eagle1-swa64-fa32-r256.json"


def test_engine_features_without_the_environment_exit_2_saying_how(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "differential.cli", "replay", "--mode", "engine", str(EAGLE)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "KVFUZZ_ENGINE_VENV": str(tmp_path)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1
    assert "run scripts/engine-setup.sh" in errors[0]


def test_confirm_without_the_environment_exits_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "differential.cli", "confirm", str(EAGLE)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "KVFUZZ_ENGINE_VENV": str(tmp_path)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "run scripts/engine-setup.sh" in done.stderr

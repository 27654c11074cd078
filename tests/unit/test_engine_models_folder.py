"""The engine worker's model folder (``differential.driver.engine_worker``):
its own is new and named by its pid; one a killed worker left is removed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from differential.driver.engine_worker import models_folder
from tests.factories import dead_pid


def test_a_killed_workers_folder_is_removed_and_a_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"kvfuzz-engine-models-{dead_pid()}-abcd"
    (stale / "0123abcd").mkdir(parents=True)
    (stale / "0123abcd" / "config.json").write_text("{}")
    alive = tmp_path / "kvfuzz-engine-models-1-efgh"  # pid 1 is alive
    alive.mkdir()
    older = tmp_path / "kvfuzz-engine-models-xyz"  # no pid: not this scheme's, kept
    older.mkdir()
    mine = models_folder()
    assert mine.parent == tmp_path and mine.is_dir()
    assert mine.name.startswith(f"kvfuzz-engine-models-{os.getpid()}-")
    assert not stale.exists() and alive.exists() and older.exists()

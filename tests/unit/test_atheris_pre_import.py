"""The atheris harness's uninstrumented pre-import refuses to hide a module
that must be instrumented (``fuzz.atheris_harness._pre_import``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fuzz import atheris_harness


def _package(root: Path, name: str, body: str) -> None:
    (root / f"{name}.py").write_text(body)


def test_a_pre_import_that_pulls_an_instrumented_module_exits_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _package(tmp_path, "kvfuzz_probe_core", "")
    _package(tmp_path, "kvfuzz_probe_config", "import kvfuzz_probe_core  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(atheris_harness, "INSTRUMENTED", ("kvfuzz_probe_core",))
    monkeypatch.setattr(atheris_harness, "PRE_IMPORTED", ("kvfuzz_probe_config",))
    try:
        with pytest.raises(SystemExit) as stopped:
            atheris_harness._pre_import()
    finally:
        sys.modules.pop("kvfuzz_probe_core", None)
        sys.modules.pop("kvfuzz_probe_config", None)
    assert stopped.value.code == 3
    assert capsys.readouterr().err.strip() == (
        "kvfuzz: error: pre-importing kvfuzz_probe_config imported kvfuzz_probe_core, "
        "which would then not be instrumented"
    )


def test_a_pre_import_that_leaves_instrumented_modules_alone_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _package(tmp_path, "kvfuzz_probe_other", "")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(atheris_harness, "INSTRUMENTED", ("kvfuzz_probe_core",))
    monkeypatch.setattr(atheris_harness, "PRE_IMPORTED", ("kvfuzz_probe_other",))
    try:
        atheris_harness._pre_import()
        assert "kvfuzz_probe_other" in sys.modules
        assert "kvfuzz_probe_core" not in sys.modules
    finally:
        sys.modules.pop("kvfuzz_probe_other", None)


def test_a_pre_import_a_vllm_lacks_is_left_to_the_instrumented_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _package(tmp_path, "kvfuzz_probe_present", "")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(atheris_harness, "INSTRUMENTED", ("kvfuzz_probe_core",))
    monkeypatch.setattr(
        atheris_harness, "PRE_IMPORTED", ("kvfuzz_probe_absent", "kvfuzz_probe_present")
    )
    try:
        atheris_harness._pre_import()
        assert "kvfuzz_probe_present" in sys.modules
        assert "kvfuzz_probe_absent" not in sys.modules
    finally:
        sys.modules.pop("kvfuzz_probe_present", None)

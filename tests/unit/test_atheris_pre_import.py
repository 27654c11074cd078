"""The atheris harness's uninstrumented pre-import refuses to hide a module
that must be instrumented (``fuzz.atheris_harness._pre_import``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fuzz import atheris_harness

Probes = Callable[..., None]


@pytest.fixture
def probes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Probes]:
    """``probes(pre_imported, name=source, ...)``: modules ``kvfuzz_probe_<name>``
    in ``tmp_path``, ``kvfuzz_probe_core`` the one instrumented, ``pre_imported``
    (short names) what the harness pre-imports; the modules are forgotten after."""

    def setup(pre_imported: tuple[str, ...], **sources: str) -> None:
        for name, source in sources.items():
            (tmp_path / f"kvfuzz_probe_{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setattr(atheris_harness, "INSTRUMENTED", ("kvfuzz_probe_core",))
        monkeypatch.setattr(
            atheris_harness, "PRE_IMPORTED", tuple(f"kvfuzz_probe_{n}" for n in pre_imported)
        )

    yield setup
    for name in [n for n in sys.modules if n.startswith("kvfuzz_probe_")]:
        del sys.modules[name]


def test_a_pre_import_that_pulls_an_instrumented_module_exits_3(
    probes: Probes, capsys: pytest.CaptureFixture[str]
) -> None:
    probes(("config",), core="", config="import kvfuzz_probe_core  # noqa: F401\n")
    with pytest.raises(SystemExit) as stopped:
        atheris_harness._pre_import()
    assert stopped.value.code == 3
    assert capsys.readouterr().err.strip() == (
        "kvfuzz: error: pre-importing kvfuzz_probe_config imported kvfuzz_probe_core, "
        "which would then not be instrumented"
    )


def test_a_pre_import_that_leaves_instrumented_modules_alone_returns(probes: Probes) -> None:
    probes(("other",), other="")
    atheris_harness._pre_import()
    assert "kvfuzz_probe_other" in sys.modules
    assert "kvfuzz_probe_core" not in sys.modules


def test_a_pre_import_a_vllm_lacks_is_left_to_the_instrumented_imports(probes: Probes) -> None:
    probes(("absent", "present"), present="")
    atheris_harness._pre_import()
    assert "kvfuzz_probe_present" in sys.modules
    assert "kvfuzz_probe_absent" not in sys.modules

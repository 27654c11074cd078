"""The floors of the code: ``docs/layout.md``'s table, the import contracts in
``pyproject.toml`` (``[tool.importlinter]``), and what breaks them.

The contracts run in ``make test`` (``lint-imports``); here they are held to
the documented table, every module is held to a floor, and a copy of the code
with one upward import, or one cycle, added inside a function is shown to
fail them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(
    not LINT_IMPORTS.exists(), reason="import-linter is not installed (requirements/test.txt)"
)


def _contracts() -> dict[str, dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def _contract_floors() -> list[list[str]]:
    layers = _contracts()["floors"]["layers"]
    assert isinstance(layers, list)
    return [[m.strip() for m in re.split(r"[:|]", layer)] for layer in layers]


def _documented_floors() -> list[list[str]]:
    text = (ROOT / "docs" / "layout.md").read_text()
    section = text.split("## The floors", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][2:]
    return [re.findall(r"`([\w.]+)`", row.split("|")[2]) for row in rows]


def _modules() -> list[str]:
    names = []
    for package in ("differential", "fuzz"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join(parts))
    return names


def test_the_documented_floors_are_the_contracts_floors() -> None:
    documented = _documented_floors()
    commands = ["differential.cli", "differential.commands", "differential.pytest_plugin"]
    assert documented[0] == commands
    assert documented == _contract_floors()


def test_every_module_is_on_exactly_one_floor_but_the_public_face() -> None:
    floors = [m for floor in _contract_floors() for m in floor]
    for name in _modules():
        on = [f for f in floors if name == f or name.startswith(f + ".")]
        if name == "differential":
            assert on == [], "the public face is on no floor"
        else:
            assert len(on) == 1, f"{name} is on {len(on)} floors: {on}"


def test_only_the_driver_may_import_vllm() -> None:
    forbidden = _contracts()["vllm-in-driver-only"]
    floors = [m for floor in _contract_floors() for m in floor]
    assert sorted(forbidden["source_modules"]) == sorted(  # type: ignore[arg-type]
        m for m in floors if m != "differential.driver"
    )
    assert forbidden["forbidden_modules"] == ["vllm", "torch"]


def _copy_of_the_code(tmp_path: Path) -> Path:
    for package in ("differential", "fuzz"):
        shutil.copytree(
            ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-logo", "--no-cache"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _add_function(path: Path, body: str) -> None:
    path.write_text(path.read_text() + f"\n\ndef _added() -> None:\n{body}\n")


def test_the_contracts_hold_on_the_code_as_it_is(tmp_path: Path) -> None:
    result = _lint(_copy_of_the_code(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 6 kept, 0 broken." in result.stdout


def test_an_upward_import_inside_a_function_breaks_the_floors(tmp_path: Path) -> None:
    # The oracle reaching up to the comparison, lazily, as the loops this
    # contract removed were written.
    tree = _copy_of_the_code(tmp_path)
    _add_function(
        tree / "differential" / "oracle" / "state.py",
        "    from differential.compare import compare_variants  # noqa: F401",
    )
    result = _lint(tree)
    assert result.returncode == 1
    assert "The floors: a module imports only its own floor" in result.stdout
    assert "BROKEN" in result.stdout
    assert "differential.oracle.state -> differential.compare" in result.stdout


def test_vllm_imported_outside_the_driver_breaks_a_contract(tmp_path: Path) -> None:
    tree = _copy_of_the_code(tmp_path)
    _add_function(
        tree / "differential" / "compare.py",
        "    import vllm.v1.core.kv_cache_manager  # noqa: F401",
    )
    result = _lint(tree)
    assert result.returncode == 1
    assert "Only the driver imports vLLM and torch BROKEN" in result.stdout
    assert "differential.compare -> vllm" in result.stdout


def test_a_cycle_between_siblings_breaks_a_contract(tmp_path: Path) -> None:
    # Two modules of one floor (':' siblings may import each other) that
    # import each other: the floors allow it, the cycle contract does not.
    tree = _copy_of_the_code(tmp_path)
    capabilities = (tree / "differential" / "capabilities.py").read_text()
    assert "from differential.scenario import" in capabilities
    _add_function(
        tree / "differential" / "scenario" / "model.py",
        "    from differential.capabilities import Feature  # noqa: F401",
    )
    result = _lint(tree)
    assert result.returncode == 1
    assert "No import cycle among the siblings of any package BROKEN" in result.stdout

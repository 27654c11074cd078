"""Bad input to the CLI: exit 2, a message naming the field, vLLM not imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from differential.cli import main
from tests.factories import triton


def _write(tmp_path: Path, name: str, data: object) -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _replay(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["replay", *args])
    return code, capsys.readouterr().err


def test_malformed_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "broken.json", '{"kv_cache_groups": [}')
    code, err = _replay(capsys, str(path))
    assert code == 2
    assert "broken.json" in err and "<json>" in err and "line 1" in err


def test_unknown_drafter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = triton().to_dict()
    data["drafter"]["kind"] = "medusa"
    code, err = _replay(capsys, str(_write(tmp_path, "d.json", data)))
    assert code == 2
    assert "drafter.kind = 'medusa'" in err and "'multi_module_mtp'" in err


def test_retention_not_a_multiple(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = triton().to_dict()
    data["retention_interval_tokens"] = 8200
    code, err = _replay(capsys, str(_write(tmp_path, "r.json", data)))
    assert code == 2
    assert "retention_interval_tokens = 8200" in err
    assert "multiple of the scheduler block size 32" in err


def test_bad_file_among_good_ones_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path, "a-good.json", triton().to_dict())
    _write(tmp_path, "b-bad.json", {"requests": []})
    code, err = _replay(capsys, str(tmp_path))
    assert code == 2 and "b-bad.json" in err and "kv_cache_groups" in err
    assert capsys.readouterr().out == ""


def test_missing_path_and_unknown_variant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _replay(capsys, str(tmp_path / "nope.json"))
    assert code == 2 and "nope.json" in err
    good = _write(tmp_path, "g.json", triton().to_dict())
    code, err = _replay(capsys, str(good), "--variants", "unfixed,patched")
    assert code == 2 and "'patched'" in err and "unfixed, fixed" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["replay"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["replay", "x.json", "--policy", "lenient"])
    assert info.value.code == 2
    assert "--policy" in capsys.readouterr().err


def test_input_errors_do_not_import_vllm(tmp_path: Path) -> None:
    bad = _write(tmp_path, "x.json", "{")
    code = (
        "import sys\n"
        "from differential.cli import main\n"
        f"assert main(['replay', {str(bad)!r}]) == 2\n"
        "assert 'vllm' not in sys.modules, 'bad input imported vLLM'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "<json>" in proc.stderr


def test_a_folder_replay_skips_what_is_not_a_scenario(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Model descriptions and other JSON in a scenario folder are left out,
    one stderr line each; a broken scenario is still an error (exit 2)."""
    from differential.corpus import iter_scenario_files

    root = Path(__file__).parents[2]
    scenario = _write(tmp_path, "a-scenario.json", triton().to_dict())
    model = tmp_path / "b-model.json"
    model.write_text((root / "models" / "gemma4-mtp.json").read_text())
    _write(tmp_path, "c-report.json", {"format": "kvfuzz.replay", "version": 1})
    _write(tmp_path, "d-list.json", [1, 2])
    _write(tmp_path, "e-package.json", {"name": "x", "version": "1.0"})
    assert iter_scenario_files([tmp_path]) == [scenario]
    assert capsys.readouterr().err.splitlines() == [
        f"kvfuzz: skipped {model}: a model description (format 'kvfuzz.model'); a "
        "scenario names it with 'model'",
        f"kvfuzz: skipped {tmp_path / 'c-report.json'}: not a scenario (format "
        "'kvfuzz.replay', not 'kvfuzz.scenario')",
        f"kvfuzz: skipped {tmp_path / 'd-list.json'}: not a scenario (a JSON list, not an object)",
        f"kvfuzz: skipped {tmp_path / 'e-package.json'}: not a scenario (no format, "
        "kv_cache_groups, model or requests)",
    ]
    # Named explicitly, a model description is loaded (and refused) as a scenario.
    assert iter_scenario_files([model], skipped=None) == [model]
    # A folder of nothing but model descriptions holds no scenario: exit 2.
    models = tmp_path / "models"
    models.mkdir()
    (models / "m.json").write_text(model.read_text())
    code, err = _replay(capsys, str(models))
    assert code == 2
    # (a long temporary path is elided in the middle of the message)
    assert err.startswith("kvfuzz: error: PATH = '")
    assert f"{models.name}' is invalid: allowed a folder containing *.json" in err
    # A broken scenario among them is still the user's mistake, not skipped.
    _write(tmp_path, "f-broken.json", {"requests": []})
    code, err = _replay(capsys, str(tmp_path))
    assert code == 2 and "f-broken.json" in err and "kv_cache_groups" in err


def test_an_unreadable_subfolder_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subfolder that cannot be listed is exit 2 naming it, as an
    unreadable file is; Path.rglob skipped it without a word, and its
    scenarios went unreplayed."""
    import os

    _write(tmp_path, "a.json", triton().to_dict())
    hidden = tmp_path / "more"
    hidden.mkdir()
    _write(hidden, "b.json", triton().to_dict())
    hidden.chmod(0)
    if os.geteuid() == 0:  # root lists any folder: refuse this one as the kernel would
        listing = os.scandir

        def scandir(path: str | os.PathLike[str]) -> object:
            if Path(path) == hidden:
                raise PermissionError(13, "Permission denied", str(path))
            return listing(path)

        monkeypatch.setattr(os, "scandir", scandir)
    try:
        code, err = _replay(capsys, str(tmp_path))
    finally:
        hidden.chmod(0o755)
    assert code == 2
    assert err.splitlines() == [
        f"kvfuzz: error: PATH = '{hidden}' is invalid: allowed a readable folder "
        "(Permission denied)"
    ]


def test_file_names_print_escaped_on_every_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newline or an ANSI escape in a file name is printed escaped, in the
    skipped-file lines, error lines and campaign progress notes alike."""
    import io

    from fuzz.progress import CampaignStats, Progress

    evil = "red\x1b[31m\nline"
    folder = tmp_path / "c"
    folder.mkdir()
    _write(folder, f"a-{evil}.json", triton().to_dict())
    _write(folder, f"b-{evil}.json", [1, 2])
    from differential.corpus import iter_scenario_files

    assert len(iter_scenario_files([folder])) == 1
    assert capsys.readouterr().err == (
        f"kvfuzz: skipped {folder}/b-red\\x1b[31m\\nline.json: not a scenario "
        "(a JSON list, not an object)\n"
    )
    broken = _write(tmp_path, f"{evil}.json", "{")
    code, err = _replay(capsys, str(broken))
    assert code == 2
    assert err.startswith(f"kvfuzz: error: {tmp_path}/red\\x1b[31m\\nline.json: <json> = ")
    assert "\x1b" not in err and err.count("\n") == 1
    stream = io.StringIO()
    Progress(CampaignStats(), stream=stream).note(f"new finding -> {folder}/{evil}.json")
    assert stream.getvalue() == f"new finding -> {folder}/red\\x1b[31m\\nline.json\n"

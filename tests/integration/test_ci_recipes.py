"""The CI recipes: the workflow parses and names real commands; the plain
script runs end to end and leaves the reports where the workflow uploads them."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from differential.cli import _parser
from tests.factories import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "kvfuzz.yml"
SCRIPT = ROOT / "scripts" / "kvfuzz-ci.sh"
yaml = pytest.importorskip("yaml")


def test_workflow_runs_the_script_and_uploads_its_folder() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    steps = workflow["jobs"]["kvfuzz"]["steps"]
    runs = [s["run"] for s in steps if "run" in s]
    assert runs == ["scripts/kvfuzz-ci.sh"]
    assert os.access(SCRIPT, os.X_OK)
    uploads = [s["with"]["path"] for s in steps if s.get("uses", "").startswith("actions/upload")]
    assert uploads == ["kvfuzz-ci-out/"]
    assert True in workflow and "schedule" in workflow[True]  # YAML reads `on:` as True


def test_workflow_installs_cpu_torch_and_publishes_every_sarif_the_script_writes() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    job = workflow["jobs"]["kvfuzz"]
    assert job["permissions"]["security-events"] == "write"  # upload-sarif needs it
    (script,) = [s for s in job["steps"] if s.get("run") == "scripts/kvfuzz-ci.sh"]
    assert script["env"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert script["env"]["KVFUZZ_TORCH"].endswith("+cpu")
    written = {
        path.replace("$out", "kvfuzz-ci-out")
        for path in re.findall(r'--sarif "([^"]+)"', SCRIPT.read_text())
    }
    uploaded = {
        s["with"]["sarif_file"]
        for s in job["steps"]
        if s.get("uses", "").startswith("github/codeql-action/upload-sarif")
    }
    assert (
        written == uploaded == {"kvfuzz-ci-out/replay.sarif", "kvfuzz-ci-out/campaign/kvfuzz.sarif"}
    )


def test_script_uses_only_real_kvfuzz_options() -> None:
    text = SCRIPT.read_text()
    parser = _parser()
    commands = parser._subparsers._group_actions[0].choices
    calls = re.findall(r'"\$kvfuzz" (\w[\w-]*)(.*?)(?:\n\n|\n[^ ])', text, re.S)
    assert [command for command, _ in calls] == ["replay", "fuzz"]
    for command, options in calls:
        known = {o for a in commands[command]._actions for o in a.option_strings}
        used = set(re.findall(r"(--[a-z-]+)", options))
        assert used <= known, (command, used - known)


@pytest.mark.vllm
def test_script_runs_end_to_end(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        KVFUZZ_CI_OUT=str(tmp_path),
        KVFUZZ_CI_SECONDS="5",
        KVFUZZ_CI_JOBS="1",
        KVFUZZ_CI_SEED="7",
    )
    env.pop("GITHUB_ACTIONS", None)
    proc = subprocess.run(
        [str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, env=env, check=False
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for name in ("replay-junit.xml", "replay.sarif", "replay.json"):
        assert (tmp_path / name).is_file()
    campaign = tmp_path / "campaign"
    for name in ("summary.json", "report.md", "junit.xml", "kvfuzz.sarif"):
        assert (campaign / name).is_file()
    assert list((campaign / "findings").glob("fallback-unfixed-*.json"))

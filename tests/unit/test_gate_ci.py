"""The pull-request gate's CI files: the GitHub Actions workflow and the
Buildkite step have the shape their CI systems read, run `kvfuzz gate` with
real options, keep Hypothesis's own example database and publish the SARIF."""

from __future__ import annotations

import json
import shlex

import pytest

from differential.cli import _parser
from tests.factories import ROOT

yaml = pytest.importorskip("yaml")

WORKFLOW = ROOT / ".github" / "workflows" / "kvfuzz-gate.yml"
BUILDKITE = ROOT / ".buildkite" / "kvfuzz-gate.yml"
CACHE_CODE = "vllm/v1/core/**"
BUILDKITE_SCHEMA = ROOT / "tests" / "data" / "buildkite-pipeline.schema.json"


def _gate_options(command: str) -> tuple[list[str], set[str]]:
    """The words after ``kvfuzz gate`` in ``command``, and the options the
    gate's parser knows."""
    words = shlex.split(command.replace("\\\n", " "))
    start = next(i for i, w in enumerate(words) if w.endswith("kvfuzz") and words[i + 1] == "gate")
    argv = words[start + 2 :]
    gate = _parser()._subparsers._group_actions[0].choices["gate"]
    known = {o for action in gate._actions for o in action.option_strings}
    return argv, known


def test_the_workflow_runs_the_gate_on_pull_requests_touching_the_cache_code() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    # `on:` is True
    assert set(workflow) == {"name", True, "permissions", "env", "concurrency", "jobs"}
    # Where kvfuzz is checked out from: the workflow's env, for a maintainer to set.
    assert set(workflow["env"]) == {"KVFUZZ_REPOSITORY", "KVFUZZ_REF"}
    paths = workflow[True]["pull_request"]["paths"]
    assert CACHE_CODE in paths and "vllm/v1/kv_cache_interface.py" in paths
    (job,) = workflow["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest" and job["timeout-minutes"] == 45
    assert job["permissions"]["security-events"] == "write"  # upload-sarif needs it
    steps = job["steps"]
    assert all(set(s) <= {"name", "uses", "with", "run", "env", "if"} for s in steps)
    assert all(("uses" in s) != ("run" in s) for s in steps)
    uses = [s["uses"].split("@")[0] for s in steps if "uses" in s]
    assert uses == [
        "actions/checkout",
        "actions/checkout",
        "actions/setup-python",
        "actions/cache",
        "actions/upload-artifact",
        "github/codeql-action/upload-sarif",
    ]
    pull_request, kvfuzz = steps[0], steps[1]
    assert pull_request["with"]["fetch-depth"] == 0  # the base is in the history
    assert kvfuzz["with"]["path"] == ".kvfuzz"
    assert kvfuzz["with"]["repository"] == "${{ env.KVFUZZ_REPOSITORY }}"
    assert kvfuzz["with"]["ref"] == "${{ env.KVFUZZ_REF }}"
    (install,) = [s for s in steps if s.get("run", "").startswith(".kvfuzz/scripts/")]
    assert install["run"] == ".kvfuzz/scripts/bootstrap.sh"
    assert install["env"]["KVFUZZ_TORCH"].endswith("+cpu")


def test_the_workflow_gates_against_the_base_and_publishes_what_it_writes() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    (job,) = workflow["jobs"].values()
    steps = job["steps"]
    (gate,) = [s for s in steps if "kvfuzz gate" in s.get("run", "")]
    argv, known = _gate_options(gate["run"])
    assert argv[0] == "."
    options = {w for w in argv if w.startswith("--")}
    assert options <= known, options - known
    values = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert values["--base"] == "$BASE_SHA"
    assert gate["env"]["BASE_SHA"] == "${{ github.event.pull_request.base.sha }}"
    # Hypothesis's own example database folder, restored and saved by actions/cache.
    (cache,) = [s for s in steps if s.get("uses", "").startswith("actions/cache")]
    assert cache["with"]["path"] == ".hypothesis/"
    assert "--database" not in options  # the gate's default: .hypothesis/examples
    (sarif,) = [s for s in steps if s.get("uses", "").startswith("github/codeql-action")]
    assert sarif["with"]["sarif_file"] == values["--sarif"] == "kvfuzz-gate/kvfuzz.sarif"
    (upload,) = [s for s in steps if s.get("uses", "").startswith("actions/upload-artifact")]
    assert upload["with"]["path"] == values["--out"] + "/" == "kvfuzz-gate/"
    assert upload["if"] == "always()"


def test_the_buildkite_step_has_the_pipeline_shape() -> None:
    pipeline = yaml.safe_load(BUILDKITE.read_text())
    assert set(pipeline) == {"steps"}
    (step,) = pipeline["steps"]
    assert isinstance(step["label"], str) and isinstance(step["command"], str)
    documented = {
        "label", "key", "if", "if_changed", "command", "timeout_in_minutes",
        "artifact_paths", "soft_fail", "env", "agents", "plugins",
    }  # fmt: skip
    assert set(step) <= documented, set(step) - documented
    assert CACHE_CODE in step["if_changed"]
    assert isinstance(step["timeout_in_minutes"], int)
    assert step["artifact_paths"] == ["kvfuzz-gate/**/*"]
    assert step["soft_fail"] == [{"exit_status": 3}]
    (line,) = [ln for ln in step["command"].split("\n") if "bin/kvfuzz gate" in ln]
    command = line + " " + step["command"].split(line)[1].split("\n")[1]
    argv, known = _gate_options(command.replace("$$", "$"))
    options = {w for w in argv if w.startswith("--")}
    assert options <= known, options - known
    assert {"--base", "--database", "--out", "--sarif", "--junit-xml"} <= options


def test_the_buildkite_step_keeps_buildkites_published_pipeline_schema() -> None:
    # Buildkite's own schema (tests/data/README.md): a command step takes no
    # key it does not define (additionalProperties false), if_changed included.
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(BUILDKITE_SCHEMA.read_text())
    assert schema["definitions"]["commandStep"]["additionalProperties"] is False
    assert "if_changed" in schema["definitions"]["commandStep"]["properties"]
    validator = jsonschema.validators.validator_for(schema)(schema)
    pipeline = yaml.safe_load(BUILDKITE.read_text())
    assert [e.message for e in validator.iter_errors(pipeline)] == []
    broken = {"steps": [{**pipeline["steps"][0], "timeout_in_minutes": "45 minutes"}]}
    assert list(validator.iter_errors(broken)) != []


def test_the_self_test_workflow_says_what_it_runs() -> None:
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "kvfuzz.yml").read_text())
    assert workflow["name"] == "kvfuzz self-test: replay and fuzz kvfuzz's own variants"

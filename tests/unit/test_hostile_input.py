"""Hostile input to the ``kvfuzz`` command line, checked before any work starts.

One parametrized case per kind of bad input: each must end with exit 2 and a
single ``kvfuzz: error:`` line (or argparse's usage error) naming the field or
option, without importing vLLM (so nothing ran and nothing was lost). Then
kvfuzz's own failures: exit 3, one line, the traceback saved to a file; and
the exit codes of ``make replay`` and ``scripts/kvfuzz-ci.sh``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from differential.errors import ScenarioError
from differential.findings import FindingKind
from differential.scenario import RequestSpec, Scenario
from differential.scenario.bounds import DEFAULT_LIMITS, Limits, check_cost, scenario_cost
from differential.variants import parse_variants
from fuzz.campaign import CampaignConfig
from fuzz.parallel import run_parallel
from tests.factories import ROOT, triton

# Runs the CLI in a fresh interpreter and reports whether vLLM got imported.
_RUN = (
    "import sys\n"
    "from differential.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "sys.stderr.write('\\nVLLM_IMPORTED=%s\\n' % ('vllm' in sys.modules))\n"
    "sys.exit(rc)\n"
)


def _cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _RUN, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        check=False,
    )


def _scenario(tmp: Path, name: str = "s.json", **changes: object) -> Path:
    data = triton().to_dict()
    data.update(changes)
    path = tmp / name
    path.write_text(json.dumps(data))
    return path


def _finding_file(tmp: Path) -> Path:
    data = triton().to_dict()
    data["finding"] = "fallback | unfixed"
    path = tmp / "finding.json"
    path.write_text(json.dumps(data))
    return path


def _file(tmp: Path) -> Path:
    path = tmp / "a-file"
    path.write_text("x")
    return path


def _non_utf8(tmp: Path) -> list[str]:
    path = tmp / "zz.json"
    path.write_bytes(b'{"name":"caf\xe9"}')
    return ["replay", str(path)]


def _deep_json(tmp: Path) -> list[str]:
    path = tmp / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    return ["replay", str(path)]


def _huge_value(tmp: Path) -> list[str]:
    data = triton().to_dict()
    data["drafter"]["kind"] = "m" * 5_000_000
    path = tmp / "huge.json"
    path.write_text(json.dumps(data))
    return ["replay", str(path)]


def _requests(n: int) -> list[dict[str, object]]:
    return [
        {"name": None, "shares_with": None, "divergence_tokens": 8, "suffix_tokens": 8}
        for _ in range(n)
    ]


def _read_only_findings(tmp: Path) -> list[str]:
    out = tmp / "out"
    (out / "findings").mkdir(parents=True)
    (out / "findings").chmod(0o555)
    return ["fuzz", "--out", str(out), "--max-examples", "1"]


def _unwritable_findings(tmp: Path) -> list[str]:
    # A findings folder no one can create files in, root included (sysfs):
    # the same check as a read-only folder, without needing a non-root user.
    out = tmp / "out"
    out.mkdir()
    (out / "findings").symlink_to("/sys/kernel")
    return ["fuzz", "--out", str(out), "--max-examples", "1"]


def _shrunk_is_a_file(tmp: Path) -> list[str]:
    (tmp / "out").mkdir()
    (tmp / "out" / "shrunk").write_text("x")
    return ["fuzz", "--out", "out", "--max-examples", "1"]


def _duplicate_key(tmp: Path) -> list[str]:
    # Plain json keeps the last of two equal keys: the file would run with
    # decode_steps 7 although its author may have meant 0.
    text = json.dumps(triton().to_dict()).replace(
        '"decode_steps": 0', '"decode_steps": 0, "decode_steps": 7'
    )
    path = tmp / "dup.json"
    path.write_text(text)
    return ["replay", str(path)]


def _huge_block(tmp: Path) -> list[str]:
    # Unbounded, it made the scheduler block 2**64 and was reported as a
    # retention interval that is no multiple of it.
    data = triton().to_dict()
    data["kv_cache_groups"][0]["block_size_tokens"] = 2**64
    path = tmp / "block.json"
    path.write_text(json.dumps(data))
    return ["replay", str(path)]


def _model_level(tmp: Path, model: str, **changes: object) -> list[str]:
    # Checked before vLLM's planner is imported (it was imported first).
    data = triton().to_dict()
    del data["kv_cache_groups"]
    data.update(model=model, **changes)
    path = tmp / "m.json"
    path.write_text(json.dumps(data))
    return ["replay", str(path)]


def _model_file(tmp: Path, **layer: object) -> str:
    """A copy of models/gemma4-mtp.json, its global layers changed by ``layer``."""
    data = json.loads((ROOT / "models" / "gemma4-mtp.json").read_text())
    data["layers"][1].update(layer)
    (tmp / "heads.json").write_text(json.dumps(data))
    return "heads.json"


def _scheduler_export(tmp: Path, **workload: object) -> list[str]:
    # Refused whatever the run finds, so before it runs (it took a whole
    # replay first, and the line named no file).
    connector = "connector" in workload
    path = _scenario(tmp, kv_connector=connector, workload={"mode": "scheduler", **workload})
    return ["export-test", str(path)]


def _case(name: str, build: Callable[[Path], list[str]], named: str, **kw: object) -> object:
    return pytest.param(build, named, id=name, **kw)


# (id, build the arguments in a temporary folder, what the error line must name)
CASES = [
    _case("non-utf8-bytes", _non_utf8, "allowed UTF-8 text"),
    _case("json-nested-200000-deep", _deep_json, "nested too deep"),
    _case("huge-rejected-value", _huge_value, "drafter.kind"),
    _case(
        "shared-prefix-1e12",
        lambda t: [
            "replay",
            str(
                _scenario(
                    t,
                    shared_prefix_tokens=10**12,
                    requests=[
                        {
                            "name": None,
                            "shares_with": None,
                            "divergence_tokens": 10**12,
                            "suffix_tokens": 64,
                        }
                    ],
                )
            ),
        ],
        "cost.tokens",
    ),
    _case(
        "decode-steps-1e9",
        lambda t: ["replay", str(_scenario(t, decode_steps=10**9))],
        "--max-tokens",
    ),
    _case(
        "suffix-3e8",
        lambda t: [
            "replay",
            str(
                _scenario(
                    t,
                    requests=[
                        {
                            "name": None,
                            "shares_with": None,
                            "divergence_tokens": 64,
                            "suffix_tokens": 3 * 10**8,
                        }
                    ],
                )
            ),
        ],
        "--max-tokens",
    ),
    _case(
        "20000-requests",
        lambda t: ["replay", str(_scenario(t, shared_prefix_tokens=8, requests=_requests(20000)))],
        "cost.requests = 20000",
    ),
    _case(
        "pool-blocks-over-a-lowered-limit",
        lambda t: ["replay", str(_scenario(t)), "--max-pool-blocks", "100"],
        "--max-pool-blocks",
    ),
    _case("duplicate-key", _duplicate_key, "dup.json: <json> key 'decode_steps'"),
    _case("version-1.0", lambda t: ["replay", str(_scenario(t, version=1.0))], "version = 1.0"),
    _case("version-true", lambda t: ["replay", str(_scenario(t, version=True))], "version = True"),
    _case(
        "expect-misspelt-kind",
        lambda t: [
            "replay",
            # relative to the cwd: a long temporary path would elide the
            # message's middle (it lists every finding kind)
            _scenario(t, expect={"findings": {"unfixed": ["fallback@1", "fallbak@1"]}}).name,
        ],
        "expect.findings.unfixed[1] = 'fallbak@1' is invalid: allowed 'kind@N' (N a request "
        "index) or 'kind@run', kind one of wrong-output, wrong-kv, over-hit",
    ),
    _case(
        "expect-request-not-a-number",
        lambda t: ["replay", str(_scenario(t, expect={"findings": {"fixed": ["crash@one"]}}))],
        "expect.findings.fixed[0] = 'crash@one' is invalid",
    ),
    _case(
        "block-size-2**64",
        _huge_block,
        "kv_cache_groups[0].block_size_tokens = 18446744073709551616 is invalid: "
        "allowed an integer 1..16777216",
    ),
    _case(
        "first-request-shares-with-0",
        lambda t: [
            "replay",
            str(
                _scenario(
                    t,
                    requests=[
                        {"name": None, "shares_with": 0, "divergence_tokens": 8, "suffix_tokens": 8}
                    ],
                )
            ),
        ],
        "requests[0].shares_with = 0 is invalid: allowed null (the first request has no "
        "earlier request to share with; it shares shared_prefix_tokens)",
    ),
    _case("seconds-nan", lambda t: ["fuzz", "--seconds", "nan", "--out", str(t)], "--seconds"),
    _case(
        "shrink-seconds-nan",
        lambda t: ["fuzz", "--shrink-seconds", "nan", "--out", str(t)],
        "--shrink-seconds: 'nan' is invalid",
    ),
    _case(
        "diff-seconds-inf",
        lambda t: ["diff", "unfixed", "fixed", "--seconds", "inf"],
        "--seconds: 'inf' is invalid",
    ),
    _case(
        "diff-timeout-nan",
        lambda t: ["diff", "unfixed", "fixed", "--timeout", "nan"],
        "--timeout: 'nan' is invalid",
    ),
    _case("mutate-timeout-nan", lambda t: ["mutate", "--timeout", "nan"], "--timeout: 'nan'"),
    _case(
        "mutate-fail-under-nan",
        lambda t: ["mutate", "--fail-under", "nan"],
        "--fail-under: 'nan' is invalid: allowed a finite percentage 0..100",
    ),
    _case("timeout-0", lambda t: ["replay", str(_scenario(t)), "--timeout", "0"], "--timeout"),
    _case("jobs-1e9", lambda t: ["fuzz", "--jobs", "1000000000", "--out", str(t)], "--jobs"),
    _case("out-under-a-file", lambda t: ["fuzz", "--out", str(_file(t) / "sub")], "--out"),
    _case(
        "report-is-a-folder",
        lambda t: ["replay", str(_scenario(t)), "--report", str(t)],
        "--report",
    ),
    _case(
        "junit-under-a-file",
        lambda t: ["replay", str(_scenario(t)), "--junit-xml", str(_file(t) / "j.xml")],
        "--junit-xml",
    ),
    _case(
        "sarif-is-a-folder", lambda t: ["fuzz", "--out", str(t / "o"), "--sarif", str(t)], "--sarif"
    ),
    _case(
        "svg-under-a-file",
        lambda t: ["explain", str(_scenario(t)), "--svg", str(_file(t) / "p.svg")],
        "--svg",
    ),
    _case(
        # Judged per lookup as scheduled, it has no picture: the SVG was
        # silently not written, exit 0.
        "svg-of-a-scheduler-run-with-arrivals",
        lambda t: [
            "explain",
            str(_scenario(t, workload={"mode": "scheduler", "arrival_steps": [0, 0, 0, 0]})),
            "--svg",
            str(t / "p.svg"),
        ],
        "p.svg' is invalid: allowed no --svg for a scheduler-mode run with arrivals, drafts, "
        "a store or aborts (judged per lookup as scheduled: the timeline is its picture)",
    ),
    _case(
        "shrink-out-under-a-file",
        lambda t: ["shrink", str(_scenario(t)), "--out", str(_file(t) / "r")],
        "--out",
    ),
    _case(
        "import-crash-out-under-a-file",
        lambda t: ["import-crash", str(_file(t)), "--out", str(_file(t) / "r")],
        "--out",
    ),
    _case(
        # It overwrote the first shard's file with the merged run (exit 0).
        "mutate-merge-json-is-an-input",
        lambda t: ["mutate", "--merge", _file(t).name, "s2.json", "--json", _file(t).name],
        "--json = 'a-file' is invalid: allowed a file that is not an input (it is a-file)",
    ),
    _case(
        # --shard was ignored: the merged run was written as if not given.
        "mutate-merge-with-shard",
        lambda t: ["mutate", "--merge", "s1.json", "s2.json", "--shard", "1/2"],
        "--merge and --shard 1/2: give one; allowed: run one shard, or merge the --json "
        "files of every shard",
    ),
    _case(
        "mutate-shard-of-1e20",
        lambda t: ["mutate", "--shard", "1/99999999999999999999"],
        "--shard '1/99999999999999999999': allowed: I/N with 1 <= I <= N <= 1000000 (e.g. 1/2)",
    ),
    _case(
        "mutate-json-and-markdown-on-one-file",
        lambda t: ["mutate", "--json", "run.out", "--markdown", "run.out"],
        "--markdown = 'run.out' is invalid: allowed a path no other output is written to "
        "(--json is)",
    ),
    _case(
        # The JUnit XML replaced the report, written first (exit 1).
        "report-and-junit-on-one-file",
        lambda t: ["replay", _scenario(t).name, "--report", "r.out", "--junit-xml", "r.out"],
        "--junit-xml = 'r.out' is invalid: allowed a path no other output is written to "
        "(--report is)",
    ),
    _case(
        "sarif-is-the-campaigns-report",
        lambda t: ["fuzz", "--out", "o", "--sarif", "o/report.md"],
        "--sarif = 'o/report.md' is invalid: allowed a path no other output is written to "
        "(--out (report.md) is)",
    ),
    _case(
        # Found only when the background shrinker first wrote there.
        "campaign-shrunk-folder-is-a-file",
        _shrunk_is_a_file,
        "--out (shrunk/) = 'out/shrunk' is invalid: allowed a folder (the path is a file)",
    ),
    _case(
        "model-file-missing",
        lambda t: _model_level(t, "no-such-model.json"),
        "no-such-model.json' is invalid: allowed a readable file (No such file or directory)",
    ),
    _case(
        # Passed its check, then was blamed 68 s later on a group vLLM's planner
        # derived from it (kv_cache_groups[0].block_size_tokens = 2**65).
        "model-num-kv-heads-2**64",
        lambda t: _model_level(t, _model_file(t, num_kv_heads=2**64)),
        "heads.json: model.layers[1].num_kv_heads = 18446744073709551616 is invalid: allowed "
        "an integer 1..65536",
    ),
    _case(
        "model-head-size-2**20",
        lambda t: _model_level(t, _model_file(t, head_size=2**20)),
        "heads.json: model.layers[1].head_size = 1048576 is invalid: allowed an integer 1..65536",
    ),
    _case(
        # Resolved to the scenario's own folder: "model = '/tmp/...' is invalid".
        "model-empty-path",
        lambda t: _model_level(t, ""),
        "m.json: model = '' is invalid: allowed a model description's file path (relative to "
        "the scenario file's folder), not empty, or the description itself",
    ),
    _case(
        # Reported as the document itself: "scenario = 1 is invalid".
        "empty-key",
        lambda t: ["replay", _scenario(t, **{"": 1}).name],
        's.json: "" = 1 is invalid: allowed no such field; known fields: ',
    ),
    _case(
        "empty-key-in-a-request",
        lambda t: [
            "replay",
            _scenario(t, requests=[{**_requests(1)[0], "": 1}]).name,
        ],
        's.json: requests[0]."" = 1 is invalid: allowed no such field; known fields: ',
    ),
    _case(
        "dcp-with-a-model",
        lambda t: _model_level(
            t, str(ROOT / "models" / "gpt-oss-20b-eagle3.json"), dcp_world_size=2
        ),
        "m.json: dcp_world_size = 2 is invalid: allowed 1 with a model (vLLM's planner is run "
        "at one rank: give kv_cache_groups, with the sharded block sizes, for decode context "
        "parallelism)",
    ),
    _case("shrink-finding-is-a-string", lambda t: ["shrink", str(_finding_file(t))], "finding = "),
    _case(
        "scheduler-export-of-a-remote-store",
        lambda t: _scheduler_export(t, connector={}),
        "s.json: workload.connector = 'a remote store' is invalid: allowed null for a "
        "scheduler-mode export (the store is kvfuzz's own connector, "
        "differential/driver/connector.py, which a standalone test does not carry)",
    ),
    _case(
        "scheduler-export-of-an-abort",
        lambda t: _scheduler_export(t, abort_steps=[None, 3, None, None]),
        "s.json: workload.abort_steps = [None, 3, None, None] is invalid: allowed null for a "
        "scheduler-mode export (the exported test runs every request to its end)",
    ),
    _case(
        "read-only-findings-folder",
        _read_only_findings,
        "not writable",
        marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only folders"),
    ),
    _case(
        "unwritable-findings-folder",
        _unwritable_findings,
        "not writable",
        marks=pytest.mark.skipif(
            not Path("/sys/kernel").is_dir(), reason="needs sysfs, which no one can write"
        ),
    ),
]


@pytest.mark.parametrize(("build", "named"), CASES)
def test_hostile_input_exits_2_before_work(
    tmp_path: Path, build: Callable[[Path], list[str]], named: str
) -> None:
    proc = _cli(*build(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "VLLM_IMPORTED=True" not in proc.stderr, "bad input imported vLLM (work started)"
    lines = [
        line
        for line in proc.stderr.splitlines()
        if line and not line.startswith(("usage:", " ", "VLLM_IMPORTED"))
    ]
    assert len(lines) == 1, lines
    assert named in lines[0]
    assert len(proc.stderr) < 2000  # never the whole rejected value
    assert "Traceback" not in proc.stderr


def test_limits_are_adjustable() -> None:
    big = Scenario(
        kv_cache_groups=triton().kv_cache_groups,
        requests=(RequestSpec(1, 1),) * 600,
        shared_prefix_tokens=8,
    )
    assert scenario_cost(big).requests == 600
    with pytest.raises(ScenarioError, match="--max-requests"):
        check_cost(big)
    assert check_cost(big, Limits(max_requests=600)).tokens == 1200
    # The Triton seed: 4 x (16384 + 64) tokens; pool per request 16448+4 tokens
    # over blocks 32 and 16 = 515 + 1029 blocks, plus the null block and 8 spare.
    cost = check_cost(triton(), DEFAULT_LIMITS)
    assert (cost.requests, cost.tokens, cost.pool_blocks) == (4, 65792, 4 * (515 + 1029) + 9)


def test_unexpected_exception_exits_3_with_one_line_and_saved_traceback(tmp_path: Path) -> None:
    code = (
        "import sys, differential.corpus as corpus\n"
        "def boom(path):\n"
        "    raise RuntimeError('boom ' + 'x' * 100000)\n"
        "corpus.load_entry = boom\n"
        "from differential.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "replay", str(_scenario(tmp_path))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        check=False,
    )
    assert proc.returncode == 3
    (line,) = proc.stderr.splitlines()
    assert line.startswith("kvfuzz: internal error (please report): RuntimeError: boom xxx")
    assert len(line) < 800
    (saved,) = tmp_path.glob("kvfuzz-traceback-*.txt")
    assert f"[full traceback in {saved}]" in line
    text = saved.read_text()
    assert "Traceback (most recent call last)" in text and "in boom" in text


def campaign_that_dies(config: CampaignConfig, *, quiet: bool) -> None:
    raise RuntimeError(f"job {config.summary_name} broke")


def test_parallel_job_death_is_reported(tmp_path: Path) -> None:
    config = CampaignConfig(out=tmp_path, variants=parse_variants("unfixed"), seed=1)
    summary = run_parallel(config, 2, quiet=True, campaign=campaign_that_dies)
    assert [(j["job"], j["exit_status"]) for j in summary["failed_jobs"]] == [(0, 3), (1, 3)]
    for job in summary["failed_jobs"]:
        assert job["traceback"] == f"job-{job['job']}-traceback.txt"  # named from OUT
        assert "RuntimeError: job summary-job-" in (tmp_path / job["traceback"]).read_text()
    assert (
        json.loads((tmp_path / "summary.json").read_text())["failed_jobs"] == summary["failed_jobs"]
    )


def _stub_checkout(tmp: Path, kvfuzz_script: str) -> Path:
    """A copy of the Makefile and the CI script over a stub kvfuzz and bootstrap."""
    (tmp / "scripts").mkdir()
    shutil.copy(ROOT / "Makefile", tmp / "Makefile")
    shutil.copy(ROOT / "scripts" / "kvfuzz-ci.sh", tmp / "scripts" / "kvfuzz-ci.sh")
    (tmp / "scripts" / "bootstrap.sh").write_text("#!/bin/sh\nexit 0\n")
    (tmp / ".venv" / "bin").mkdir(parents=True)
    (tmp / ".venv" / "bin" / "kvfuzz").write_text("#!/bin/sh\n" + kvfuzz_script)
    for path in (tmp / "scripts" / "bootstrap.sh", tmp / ".venv" / "bin" / "kvfuzz"):
        path.chmod(0o755)
    return tmp


@pytest.mark.parametrize(("code", "make_fails"), [(0, False), (1, False), (2, True), (3, True)])
def test_make_replay_fails_on_2_and_3(tmp_path: Path, code: int, make_fails: bool) -> None:
    checkout = _stub_checkout(tmp_path, f"exit {code}\n")
    proc = subprocess.run(
        ["make", "-s", "replay"], cwd=checkout, capture_output=True, text=True, check=False
    )
    assert (proc.returncode != 0) is make_fails, proc.stderr
    if make_fails:
        assert f"Error {code}" in proc.stderr


@pytest.mark.parametrize(
    ("replay", "campaign", "expected"),
    [(0, 0, 0), (0, 1, 0), (1, 0, 1), (0, 3, 3), (3, 0, 3), (1, 2, 2), (2, 3, 3)],
)
def test_ci_script_propagates_exit_codes(
    tmp_path: Path, replay: int, campaign: int, expected: int
) -> None:
    checkout = _stub_checkout(
        tmp_path, f'case "$1" in replay) exit {replay};; fuzz) exit {campaign};; esac\n'
    )
    proc = subprocess.run(
        ["scripts/kvfuzz-ci.sh"],
        cwd=checkout,
        capture_output=True,
        text=True,
        env={**os.environ, "KVFUZZ_CI_OUT": str(tmp_path / "out")},
        check=False,
    )
    assert proc.returncode == expected, proc.stdout + proc.stderr


def test_version_names_kvfuzz_and_vllm_without_importing_vllm(tmp_path: Path) -> None:
    probe = (
        "import sys\n"
        "from differential.cli import main\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit as exc:\n"
        "    print('EXIT', exc.code, 'vllm' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    line, status = proc.stdout.splitlines()
    assert status == "EXIT 0 False", proc.stderr
    python = ".".join(str(part) for part in sys.version_info[:3])
    assert line.startswith("kvfuzz ") and line.endswith(f"(vLLM 0.33.0, Python {python})")


def test_version_without_vllm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.metadata

    from differential.cli import main

    real = importlib.metadata.version

    def version(name: str) -> str:
        if name.startswith("vllm"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.endswith(
        "(vLLM not installed, Python {}.{}.{})\n".format(*sys.version_info[:3])
    )


def test_bootstrap_says_each_step(tmp_path: Path) -> None:
    """The first set-up (about 4 minutes) prints one line per step on stderr;
    here over a stub interpreter that accepts every pip call."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts" / "bootstrap.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\nexit 0\n')
    python.chmod(0o755)
    proc = subprocess.run(
        ["bash", "scripts/bootstrap.sh"],
        cwd=tmp_path,
        env={**{k: v for k, v in os.environ.items() if k != "KVFUZZ_TORCH"}, "KVFUZZ_VENV": "venv"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    steps = [line for line in proc.stderr.splitlines() if line.startswith("kvfuzz: [")]
    assert [line.split("]")[0] for line in steps] == [f"kvfuzz: [{i}/8" for i in range(1, 9)]
    assert "CPU torch (torch==2.13.0" in steps[2]
    assert proc.stderr.splitlines()[-1] == "kvfuzz: venv is ready"
    assert len((python.parent / "calls").read_text().splitlines()) == 7  # 6 pip calls, 1 import


@pytest.mark.parametrize(
    ("found", "why"),
    [
        ((), "this one shows no finding on unfixed, fixed"),
        (
            (FindingKind.KV_EVENTS, FindingKind.NEEDLESS_DROP),
            "this one shows only kv-events, needless-drop, which an exported test does not "
            "assert: replay the file instead",
        ),
    ],
)
def test_export_test_with_nothing_to_export_says_what_the_run_found(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    found: tuple[FindingKind, ...],
    why: str,
) -> None:
    # It blamed a kv-events finding whatever the run found, none included.
    import differential.compare
    from differential.cli import main

    findings = tuple(SimpleNamespace(kind=kind, request=None) for kind in found)
    result = SimpleNamespace(
        results=(
            SimpleNamespace(variant=SimpleNamespace(name="unfixed"), findings=findings),
            SimpleNamespace(variant=SimpleNamespace(name="fixed"), findings=()),
        ),
        findings=findings,
    )
    monkeypatch.setattr(differential.compare, "compare_variants", lambda *a, **k: result)
    _scenario(tmp_path)
    monkeypatch.chdir(tmp_path)  # a short path: long values are elided in the message
    assert main(["export-test", "s.json"]) == 2
    assert capsys.readouterr().err == (
        "kvfuzz: error: FINDING = 's.json' is invalid: allowed a scenario with a "
        f"per-request finding to assert on hits; {why}\n"
    )


def test_a_request_aborted_before_admission_has_a_row_saying_so() -> None:
    # Aborted at step 0, it has no lookup: its row was missing without a word.
    from differential.compare import ScenarioResult, VariantResult
    from differential.findings import Policy
    from differential.observation import RequestObservation, RunObservation
    from differential.reports.table import render_text
    from differential.scenario import DriveMode, GroupKind, KVCacheGroup, Workload

    scenario = Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, 16),),
        requests=(RequestSpec(64, 0), RequestSpec(64, 8)),
        shared_prefix_tokens=64,
        workload=Workload(mode=DriveMode.SCHEDULER, abort_steps=(0, None)),
    )
    reader = RequestObservation(
        index=1,
        prompt_tokens=72,
        hit_tokens=0,
        shared_prefix_boundary_tokens=0,
        per_group_hit_tokens=(0,),
        retained_blocks_per_group=(0,),
        scheduled_step=1,
    )
    run = RunObservation(
        variant="unfixed",
        vllm_version="0.33.0",
        settings=None,
        requests=(reader,),
        mode="scheduler",
    )
    (variant,) = parse_variants("unfixed")
    result = ScenarioResult(
        scenario, "s.json", Policy.VLLM, (VariantResult(variant, run, None, (), (), 0.0),)
    )
    rows = render_text([result], "0.33.0").splitlines()[4:6]
    assert rows == [
        "  unfixed      1          -         -         0         -  ok",
        "  unfixed      0 aborted from step 0 before it was admitted",
    ]


def test_full_report_crashes_are_known_in_scheduler_mode_too() -> None:
    # The scheduler makes the lookup inside Scheduler.schedule, so its crash
    # names that call: the two known issues' labels read only the manager
    # driver's get_computed_blocks, and scheduler-mode campaigns filed them new.
    from differential.findings import Finding
    from differential.oracle.known import label_known
    from differential.scenario import DriveMode, GroupKind, KVCacheGroup, KVEvents, Workload

    def crash(error: str, where: str) -> Finding:
        detail = f"step 2: schedule: Scheduler.schedule: {error} [raised in {where}]"
        return Finding(FindingKind.CRASH, "unfixed", 0, detail)

    dcp = Scenario(
        kv_cache_groups=(KVCacheGroup(GroupKind.MLA, 512),),
        requests=(RequestSpec(2000, 0), RequestSpec(2000, 0)),
        shared_prefix_tokens=2000,
        prefill_chunk_tokens=1024,
        dcp_world_size=8,
        workload=Workload(mode=DriveMode.SCHEDULER, kv_events=KVEvents.FULL),
    )
    assertion = crash("AssertionError: ", "resolve_block_hashes (vllm/v1/core/kv_cache_utils.py)")
    (labelled,) = label_known(dcp, [assertion])
    assert labelled.known_issue == "kv-events-full-report-dcp-block-size"
    partial = Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 64),
            KVCacheGroup(GroupKind.MAMBA, 64),
        ),
        requests=(RequestSpec(100, 0), RequestSpec(100, 0)),
        shared_prefix_tokens=100,
        hash_block_size_tokens=16,
        workload=Workload(mode=DriveMode.SCHEDULER, kv_events=KVEvents.FULL),
    )
    index = crash(
        "IndexError: list index out of range",
        "BlockHashListWithBlockSize._get_value_at (vllm/v1/core/kv_cache_utils.py)",
    )
    (labelled,) = label_known(partial, [index])
    assert labelled.known_issue == "kv-events-full-report-partial-hit"
    # Another scheduler-mode crash stays new.
    other = crash("RuntimeError: scheduled nothing for 64 steps", "Scheduler.schedule")
    assert label_known(dcp, [other])[0].known_issue is None

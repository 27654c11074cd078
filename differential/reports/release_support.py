"""Which bundled scenarios run on earlier vLLM releases: a table generated from real replays.

One replay, ``kvfuzz replay corpora known-issues --variants
release:0.31.0,release:0.32.0,unfixed --json``, runs every release beside
``unfixed`` (once, not once per release), and every scenario's run on each
release is sorted into one status: it *runs* (every request completed), *crash*
(vLLM raised; the scenario ran up to there), *timeout*, or *unsupported* (the
release cannot run it; the reason names the missing piece and its vLLM file).
:func:`render` writes that as ``docs/release-support.md`` and
:func:`readme_claim` as the sentence docs/variants.md states;
``tests/integration/test_releases.py`` replays the releases and compares both.

Regenerate (fetches the wheels into the release cache once)::

    python -m differential.reports.release_support --write

Nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

__all__ = [
    "DOC",
    "RELEASES",
    "SCENARIO_FOLDERS",
    "ReleaseRun",
    "Status",
    "readme_claim",
    "release_runs",
    "render",
    "replay_command",
    "replay_releases",
    "statuses",
]

ROOT = Path(__file__).resolve().parents[2]
#: The generated table, relative to the repository root.
DOC = Path("docs") / "release-support.md"
#: The releases the table covers: the earliest supported one and the previous one.
RELEASES = ("0.31.0", "0.32.0")
#: The bundled scenario folders every release replays.
SCENARIO_FOLDERS = ("corpora", "known-issues")


class Status(StrEnum):
    """How one scenario's run on a release ended."""

    RUNS = "runs"
    CRASH = "crash"
    TIMEOUT = "timeout"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class ReleaseRun:
    """One release's replay of the bundled scenarios.

    Attributes:
        version: the release, e.g. ``0.32.0``.
        exit_code: the replay's exit code (one replay runs every release).
        report: the replay's ``--json`` output (``format: kvfuzz.replay``).
    """

    version: str
    exit_code: int
    report: Mapping[str, Any]

    @property
    def variant(self) -> str:
        """The release's variant name, ``release:X.Y.Z``."""
        return f"release:{self.version}"


def replay_command(versions: Sequence[str] = RELEASES) -> list[str]:
    """The replay :func:`replay_releases` runs (arguments after ``kvfuzz``): the
    bundled scenarios on every release of ``versions`` and on ``unfixed``."""
    variants = ",".join([*(f"release:{v}" for v in versions), "unfixed"])
    return ["replay", *SCENARIO_FOLDERS, "--variants", variants, "--json"]


def release_runs(
    exit_code: int, report: Mapping[str, Any], versions: Sequence[str] = RELEASES
) -> list[ReleaseRun]:
    """One :class:`ReleaseRun` per release of ``versions`` from the report of
    :func:`replay_command`'s replay (``--json``) and its exit code."""
    return [ReleaseRun(version, exit_code, report) for version in versions]


def replay_releases(versions: Sequence[str] = RELEASES, *, cwd: Path = ROOT) -> list[ReleaseRun]:
    """Replay the bundled scenarios on ``versions`` and ``unfixed``, in one fresh interpreter.

    Raises:
        RuntimeError: the replay printed no report (its exit code and stderr's
            last line are named).
    """
    command = replay_command(versions)
    done = subprocess.run(
        [sys.executable, "-m", "differential.cli", *command],
        capture_output=True,
        text=True,
        cwd=cwd,
        check=False,
    )
    try:
        report = json.loads(done.stdout)
    except ValueError:
        last = (done.stderr.strip().splitlines() or [""])[-1]
        raise RuntimeError(
            f"kvfuzz {' '.join(command)} exited {done.returncode} without a report: {last}"
        ) from None
    return release_runs(done.returncode, report, versions)


def statuses(run: ReleaseRun) -> dict[str, tuple[Status, str]]:
    """Scenario file -> (status, detail) of the release's run, in replay order.

    ``detail`` is the unsupported reason, the crash message, or ``""``.

    Raises:
        ValueError: a scenario has no run of the release variant.
    """
    out: dict[str, tuple[Status, str]] = {}
    for scenario in run.report["scenarios"]:
        ran = [v["run"] for v in scenario["variants"] if v["name"] == run.variant]
        if not ran:
            raise ValueError(f"{scenario['source']}: no run of {run.variant}")
        observed = ran[0]
        if observed["unsupported"] is not None:
            out[scenario["source"]] = (Status.UNSUPPORTED, observed["unsupported"])
        elif observed["timed_out"]:
            out[scenario["source"]] = (Status.TIMEOUT, observed["error"] or "")
        elif observed["error"] is not None:
            out[scenario["source"]] = (Status.CRASH, observed["error"])
        else:
            out[scenario["source"]] = (Status.RUNS, "")
    return out


def _counts(table: Mapping[str, tuple[Status, str]]) -> dict[Status, int]:
    return {s: sum(1 for status, _ in table.values() if status is s) for s in Status}


def readme_claim(runs: Sequence[ReleaseRun]) -> str:
    """The sentence docs/variants.md states on what the releases run, one clause per release."""
    clauses = []
    for run in runs:
        table = statuses(run)
        counts = _counts(table)
        runs_text = f"{counts[Status.RUNS]} of the {len(table)} bundled scenarios run"
        clause = f"on {run.version}, {runs_text}"
        others = [
            f"{counts[s]} {'is' if counts[s] == 1 else 'are'} *{s.value}*"
            for s in (Status.UNSUPPORTED, Status.CRASH, Status.TIMEOUT)
            if counts[s]
        ]
        if others:
            clause += " and " + ", ".join(others)
        clauses.append(clause)
    text = "; ".join(clauses)
    return text[0].upper() + text[1:] + f" (`{DOC.as_posix()}` lists which, and why)."


def render(runs: Sequence[ReleaseRun]) -> str:
    """``docs/release-support.md``: counts per release, then every scenario
    that does not simply run, with its reason."""
    lines = [
        "# Bundled scenarios on earlier vLLM releases",
        "",
        "Generated by `python -m differential.reports.release_support --write` from a real",
        f"replay (`kvfuzz {' '.join(replay_command([r.version for r in runs])[:-1])}`);",
        "`tests/integration/test_releases.py` replays the releases again and compares",
        "this file. A scenario *runs* when every request completed on the release; it is",
        "*unsupported* when the release cannot run it (the reason names the missing",
        "piece and its vLLM file); *crash* when vLLM raised (a finding).",
        "",
        "| release | scenarios | run | unsupported | crash | timeout | replay exit code |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        counts = _counts(statuses(run))
        total = sum(counts.values())
        lines.append(
            f"| {run.version} | {total} | {counts[Status.RUNS]} | {counts[Status.UNSUPPORTED]} "
            f"| {counts[Status.CRASH]} | {counts[Status.TIMEOUT]} | {run.exit_code} |"
        )
    lines += ["", "| scenario | release | status | reason |", "| --- | --- | --- | --- |"]
    listed = 0
    for run in runs:
        for source, (status, detail) in statuses(run).items():
            if status is not Status.RUNS:
                cell = detail.replace("|", "\\|").replace("\n", " ")
                lines.append(f"| `{source}` | {run.version} | {status.value} | {cell} |")
                listed += 1
    if not listed:
        lines.append("| (none) | | | |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Replay :data:`RELEASES`, print the table (``--write``: write :data:`DOC`)."""
    parser = argparse.ArgumentParser(
        prog="python -m differential.reports.release_support", description=__doc__
    )
    parser.add_argument("--write", action="store_true", help=f"write {DOC} (default: print)")
    args = parser.parse_args(argv)
    runs = replay_releases()
    text = render(runs)
    if args.write:
        (ROOT / DOC).write_text(text, encoding="utf-8")
        print(f"wrote {DOC}")
    else:
        sys.stdout.write(text)
    print(f"docs/variants.md: {readme_claim(runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

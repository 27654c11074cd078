"""``kvfuzz fuzz --jobs N``: one campaign over N worker processes.

Each worker is a spawned process that imports vLLM once and runs an ordinary
:class:`~fuzz.campaign.Campaign` with its own seed (``seed`` for one job,
``seed * 1000 + index`` for more) and its share of the example budget. All
workers share the output folder: finding files are created once across
processes (:func:`differential.corpus.write_once`), Hypothesis's directory
database is shared, and each worker keeps ``summary-job-<i>.json``, which the
parent merges into ``summary.json`` (counts summed per signature).

Workers die with their parent (Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``);
SIGTERM or SIGINT to the parent stops every worker, which saves its summary
first; a worker that raises writes its traceback to ``OUT/job-<i>-traceback.txt``
and exits 3, and the merged summary lists it under ``failed_jobs``, so the
campaign's exit code says kvfuzz failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from differential.corpus import write_atomic
from fuzz.campaign import CampaignConfig, fix_cost_entries, run_campaign, shown_path
from fuzz.lifetime import EXIT_WORKER_FAILED, die_with_parent, stop_on_signals, stop_requested

__all__ = [
    "merge_summaries",
    "run_parallel",
    "worker_configs",
]

_STOP_GRACE_S = 3.0  # how long stopped workers get to save their summaries


def worker_configs(config: CampaignConfig, jobs: int) -> list[CampaignConfig]:
    """The per-worker configurations (deterministic for a given seed and N)."""
    if jobs == 1:
        return [config]
    share = None if config.max_examples is None else math.ceil(config.max_examples / jobs)
    # Only the first worker replays the database, and only what was there
    # before the campaign: failures the workers save meanwhile are not replayed.
    db_path = config.out / "hypothesis-db"
    had_database = db_path.is_dir() and any(db_path.iterdir())
    return [
        dataclasses.replace(
            config,
            seed=config.seed * 1000 + index,
            max_examples=share,
            summary_name=f"summary-job-{index}.json",
            summary_interval_s=2.0,
            replay_database=had_database and index == 0,
        )
        for index in range(jobs)
    ]


def traceback_path(config: CampaignConfig) -> Path:
    """Where a worker saves its traceback if it fails: ``OUT/job-<i>-traceback.txt``."""
    job = config.summary_name.removeprefix("summary-").removesuffix(".json")
    return config.out / f"{job}-traceback.txt"


def _worker(
    config: CampaignConfig, parent_pid: int, campaign: Callable[..., object] = run_campaign
) -> None:
    die_with_parent(parent_pid)
    try:
        with stop_on_signals():
            campaign(config, quiet=True)
    except KeyboardInterrupt:
        pass  # the campaign has already saved what it found
    except BaseException as exc:
        with contextlib.suppress(OSError):
            traceback_path(config).write_text("".join(traceback.format_exception(exc)))
        print(f"kvfuzz job failed: {type(exc).__name__}: {exc}"[:500], file=sys.stderr)
        sys.exit(EXIT_WORKER_FAILED)


def merge_summaries(summaries: list[dict[str, Any]], config: CampaignConfig) -> dict[str, Any]:
    """One summary for the whole campaign from the workers' summaries."""
    distinct: dict[str, dict[str, Any]] = {}
    causes: dict[str, dict[str, Any]] = {}
    kinds: dict[str, int] = {}
    coverage: dict[str, int] = {}
    engine: dict[str, int] = {}
    costs: dict[str, list[int]] = {}
    for summary in summaries:
        for entry in summary.get("fix_costs", ()):
            totals = costs.setdefault(entry["pair"], [0, 0, 0])
            totals[0] += entry["scenarios"]
            totals[1] += entry["extra_swa_blocks"]
            totals[2] += entry["retained_boundaries"]
        for kind, n in summary["findings_by_kind"].items():
            kinds[kind] = kinds.get(kind, 0) + n
        for key, n in summary.get("coverage", {}).items():
            coverage[key] = coverage.get(key, 0) + n
        for key, n in summary.get("engine", {}).items():
            engine[key] = engine.get(key, 0) + n
        for entry in summary["distinct"]:
            seen = distinct.get(entry["signature"])
            if seen is None:
                distinct[entry["signature"]] = dict(entry)
            else:
                seen["count"] += entry["count"]
                if entry["first_seen_s"] < seen["first_seen_s"]:
                    seen["first_seen_s"] = entry["first_seen_s"]
        for entry in summary.get("root_causes", ()):
            _merge_root_cause(causes, entry)
    firsts = [s["first_finding_s"] for s in summaries if s["first_finding_s"] is not None]
    elapsed = max((s["elapsed_s"] for s in summaries), default=0.0)
    examples = sum(s["examples"] for s in summaries)
    return {
        "format": "kvfuzz.campaign",
        "version": 1,
        "seed": config.seed,
        "jobs": len(summaries),
        "variants": summaries[0]["variants"] if summaries else [],
        "policy": config.policy.value,
        "vllm_version": summaries[0]["vllm_version"] if summaries else "",
        "examples": examples,
        "elapsed_s": elapsed,
        "executions_per_s": round(examples / elapsed, 2) if elapsed else 0.0,
        "first_finding_s": min(firsts) if firsts else None,
        "interrupted": any(s["interrupted"] for s in summaries),
        "findings_by_kind": dict(sorted(kinds.items())),
        "coverage": dict(sorted(coverage.items())),
        "engine": dict(sorted(engine.items())),
        "fix_costs": fix_cost_entries(costs),
        # Ordered by what the seed decides (example index, then name), not by
        # which worker's clock ran first: the same seed lists them alike.
        "root_causes": sorted(
            causes.values(),
            key=lambda e: (e["status"] != "new", e.get("first_example", 0), e["root_cause"]),
        ),
        "distinct": sorted(
            distinct.values(), key=lambda e: (e.get("first_example", 0), e["signature"])
        ),
        "failed_jobs": [],
    }


def _merge_root_cause(causes: dict[str, dict[str, Any]], entry: dict[str, Any]) -> None:
    """Add one worker's root-cause entry: counts summed, the first reproducer kept."""
    seen = causes.get(entry["root_cause"])
    if seen is None:
        causes[entry["root_cause"]] = {
            **entry,
            "facets": dict(entry["facets"]),
            "count_by_variant": dict(entry.get("count_by_variant", {})),
        }
        return
    seen["count"] += entry["count"]
    seen["consequences"] += entry["consequences"]
    for kind, n in entry["facets"].items():
        seen["facets"][kind] = seen["facets"].get(kind, 0) + n
    seen["variants"] = sorted(set(seen["variants"]) | set(entry["variants"]))
    by_variant = dict(seen.get("count_by_variant", {}))
    for variant, n in entry.get("count_by_variant", {}).items():
        by_variant[variant] = by_variant.get(variant, 0) + n
    seen["count_by_variant"] = dict(sorted(by_variant.items()))
    seen["signatures"] = sorted(set(seen["signatures"]) | set(entry["signatures"]))
    if seen["shrunk"] is None and entry["shrunk"] is not None:
        seen["shrunk"] = entry["shrunk"]
        if seen["status"] == "new":
            seen["reproducer"] = entry["shrunk"]
    if entry["first_seen_s"] < seen["first_seen_s"]:
        seen["first_seen_s"] = entry["first_seen_s"]


def _read(paths: list[Path]) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError):
            continue  # not written yet
    return out


def _add_unlisted_findings(merged: dict[str, Any], out: Path, since: float) -> None:
    """List finding files this run wrote that no worker's last summary lists.

    A worker stopped by a signal may be killed after its grace period before
    it saves its final summary; its findings are on disk all the same (each
    file is written once, atomically), so the merged summary lists them, each
    once, with the example and signature the file records.
    """
    listed = {Path(entry["file"]).name for entry in merged["distinct"]}
    folder = out / "findings"
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        if path.name in listed or path.stat().st_mtime < since:
            continue
        try:
            finding = json.loads(path.read_text(encoding="utf-8"))["finding"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a finding file of this run
        merged["distinct"].append(
            {
                "signature": finding.get("signature", path.stem),
                "file": shown_path(path, out),
                "first_example": finding.get("example", -1),
                "first_seen_s": merged["elapsed_s"],
                "count": 1,
            }
        )


def _stop(workers: list[Any]) -> None:
    """SIGTERM to live workers, a grace period to save, then SIGKILL."""
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()


def run_parallel(
    config: CampaignConfig,
    jobs: int,
    *,
    quiet: bool = False,
    campaign: Callable[..., object] = run_campaign,
) -> dict[str, Any]:
    """Run the campaign on ``jobs`` worker processes and merge their results.

    ``campaign`` is what each worker runs (``campaign(config, quiet=True)``;
    a module-level function, as spawned processes import it).

    SIGINT or SIGTERM stops every worker (each saves its summary first) and
    the merged summary is still written, marked ``interrupted``.

    Returns:
        The merged summary; ``failed_jobs`` lists each worker that died
        without finishing (``job``, ``exit_status``, ``traceback`` file).
    """
    if jobs == 1:
        with stop_on_signals():
            return run_campaign(config, quiet=quiet)
    config.out.mkdir(parents=True, exist_ok=True)
    configs = worker_configs(config, jobs)
    paths = [config.out / c.summary_name for c in configs]
    for path in paths + [traceback_path(c) for c in configs]:
        path.unlink(missing_ok=True)
    started = time.time()
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_worker, args=(c, os.getpid(), campaign)) for c in configs]
    interrupted = False
    with stop_on_signals():
        try:
            for process in workers:
                process.start()
            shown = time.monotonic()
            while any(w.is_alive() for w in workers):
                time.sleep(0.25)
                if stop_requested():  # a signal whose KeyboardInterrupt was swallowed
                    raise KeyboardInterrupt
                if not quiet and time.monotonic() - shown >= 2.0:
                    shown = time.monotonic()
                    partial = _read(paths)
                    if partial:
                        merged = merge_summaries(partial, config)
                        print(
                            f"{merged['examples']} examples, "
                            f"{merged['executions_per_s']:.1f}/s on {jobs} jobs, "
                            f"{len(merged['distinct'])} distinct",
                            file=sys.stderr,
                            flush=True,
                        )
        except KeyboardInterrupt:
            interrupted = True
        finally:
            _stop(workers)
    failed = [
        {
            "job": index,
            "exit_status": process.exitcode,
            "traceback": shown_path(traceback_path(configs[index]), config.out)
            if traceback_path(configs[index]).exists()
            else None,
        }
        for index, process in enumerate(workers)
        # Stopped by a signal after an interruption is not a failure.
        if process.exitcode != 0 and not (interrupted and (process.exitcode or 0) < 0)
    ]
    merged = merge_summaries(_read(paths), config)
    if interrupted:
        _add_unlisted_findings(merged, config.out, started)
    merged["jobs"] = jobs
    merged["interrupted"] = merged["interrupted"] or interrupted
    merged["failed_jobs"] = failed
    write_atomic(config.out / "summary.json", json.dumps(merged, indent=2) + "\n")
    return merged

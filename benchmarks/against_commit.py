"""This tree against an earlier commit of kvfuzz, on identical work.

Run: ``.venv/bin/python benchmarks/against_commit.py [--commit REV]``
(default ``2b42a68``: main when the speed issue was filed, whose ratios
``benchmarks/throughput-previous.json`` records).

The commit is exported (``git archive``) to a temporary folder, and one
worker process per tree imports that tree's kvfuzz and the installed vLLM
once; the workers then take turns, measurement by measurement, for
``--rounds`` rounds, so load from other processes hits both alike. Each
figure is CPU time inside the worker (``time.process_time``), import
excluded. Measured, on work both trees do identically:

* one manager-mode run of ``unfixed`` (``run_variant``) of the bundled toy
  seed (``corpora/seeds/toy-mtp1-swa4-fa8-r64.json``: 4 requests, 1088
  tokens) and of the Triton seed (``triton-mtp3-swa16-fa32-r8192.json``:
  4 requests, 65792 tokens), the earlier commit's copy of each file;
* a judged pair (``compare_variants`` on unfixed + fixed, dense cross-check
  on, as a campaign judges) of the same two scenarios;
* a campaign on identical work: ``--examples`` scenarios drawn by the
  earlier commit's own generator (``fuzz.strategies.scenarios``, derandomized
  Hypothesis, seed ``--seed``), the time that generator takes per example
  added to both sides (measured once per round, beside that round's
  judging), and each tree judging every one of them as a pair.
  The generator of this tree draws other (richer) scenarios, so a campaign
  of each tree with its own generator does other work; its figure is
  printed too, as ``own generators``.

Prints each ratio (this tree's rate over the commit's) and nothing fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# The worker: reads one JSON command per line, answers one JSON line. Runs
# with its tree's folder first on sys.path (the tree's kvfuzz, not the
# installed one).
_WORKER = r"""
import json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.driver import run_variant
from differential.variants import parse_variants
import differential.driver.runner  # noqa: F401  (vLLM imported before any clock)
unfixed, fixed = parse_variants("unfixed,fixed")
scenarios = {}

def scenario(path):
    if path not in scenarios:
        scenarios[path] = load_entry(Path(path)).scenario
    return scenarios[path]

def rate(fn, seconds):
    fn()  # warm: memos filled, lazy imports done
    count, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        fn()
        count += 1
    return {"count": count, "cpu": time.process_time() - start}

def generate(folder, examples, seed):
    from hypothesis import HealthCheck, given, settings, seed as hseed
    from fuzz.strategies import scenarios as strategy
    written = []
    @hseed(seed)
    @settings(max_examples=examples, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), derandomize=True)
    @given(strategy())
    def draw(s):
        written.append(s)
    start = time.process_time()
    draw()
    cpu = time.process_time() - start
    for k, s in enumerate(written if folder else ()):
        (Path(folder) / f"g{k:05d}.json").write_text(s.to_json())
    return {"count": len(written), "cpu": cpu}

def judge(folder):
    loaded = [load_entry(p).scenario for p in sorted(Path(folder).glob("*.json"))]
    start = time.process_time()
    for s in loaded:
        compare_variants(s, (unfixed, fixed))
    return {"count": len(loaded), "cpu": time.process_time() - start}

def campaign(seconds, seed):
    from fuzz.campaign import CampaignConfig, run_campaign
    with tempfile.TemporaryDirectory() as out:
        start = time.process_time()
        summary = run_campaign(CampaignConfig(out=Path(out), variants=(unfixed, fixed),
                                              seed=seed, seconds=seconds), quiet=True)
        return {"count": summary["examples"], "cpu": time.process_time() - start}

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    c = json.loads(line)
    what = c["what"]
    if what == "run":
        s = scenario(c["path"])
        out = rate(lambda: run_variant(s, unfixed), c["seconds"])
    elif what == "pair":
        s = scenario(c["path"])
        out = rate(lambda: compare_variants(s, (unfixed, fixed)), c["seconds"])
    elif what == "generate":
        out = generate(c["folder"], c["examples"], c["seed"])
    elif what == "judge":
        out = judge(c["folder"])
    else:
        out = campaign(c["seconds"], c["seed"])
    print(json.dumps(out), flush=True)
"""


class Worker:
    """One tree's worker process (see the module docstring)."""

    def __init__(self, tree: Path) -> None:
        self.tree = tree
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(tree)],
            cwd=tree,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ask_raw()  # the ready line: kvfuzz and vLLM imported

    def ask_raw(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the worker for {self.tree} died (its error is above)")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.ask_raw()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def resolve(commit: str) -> str | None:
    """The full hash of ``commit`` in this repository, or ``None``."""
    found = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return found.stdout.strip() if found.returncode == 0 else None


def export(full: str, folder: Path) -> None:
    """Writes the files of commit ``full`` (a full hash) into ``folder``."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", full], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")


def _totals(
    workers: dict[str, Worker],
    rounds: int,
    each_round: Callable[[], None] | None = None,
    **command: Any,
) -> dict[str, tuple[int, float]]:
    """Per worker, the count and CPU-seconds ``command`` took over ``rounds``
    rounds, the workers alternating which goes first; ``each_round`` runs
    after every round."""
    totals = {name: (0, 0.0) for name in workers}
    for k in range(rounds):
        order = list(workers) if k % 2 == 0 else list(reversed(workers))
        for name in order:
            out = workers[name].ask(**command)
            count, cpu = totals[name]
            totals[name] = (count + out["count"], cpu + out["cpu"])
        if each_round is not None:
            each_round()
    return totals


def _paired(workers: dict[str, Worker], rounds: int, **command: Any) -> dict[str, float]:
    """Rates (count per CPU-second) of both workers, alternating rounds."""
    return {name: count / cpu for name, (count, cpu) in _totals(workers, rounds, **command).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", default="2b42a68", help="the earlier commit (default 2b42a68)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="CPU-seconds per fixed-scenario round"
    )
    parser.add_argument(
        "--examples", type=int, default=600, help="generated scenarios (default 600)"
    )
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument(
        "--campaign-seconds",
        type=float,
        default=20.0,
        help="seconds per round of each tree's own campaign (0: skip; default 20)",
    )
    args = parser.parse_args()
    for name in ("rounds", "seconds", "examples"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name}: must be positive")
    full = resolve(args.commit)
    if full is None:
        parser.error(f"--commit: {args.commit!r} names no commit of this repository")

    with tempfile.TemporaryDirectory(prefix="kvfuzz-against-") as tmp:
        earlier = Path(tmp) / "earlier"
        earlier.mkdir()
        export(full, earlier)
        workers = {"earlier": Worker(earlier), "this": Worker(ROOT)}
        try:
            print(f"this tree against {full[:12]} (rates per CPU-second; ratio this / earlier)")

            def show(label: str, rates: dict[str, float], unit: str) -> None:
                print(
                    f"  {label:<34} {rates['earlier']:9.2f} -> {rates['this']:9.2f} {unit}: "
                    f"{rates['this'] / rates['earlier']:.2f}x"
                )

            for scale, name in (
                ("toy", "toy-mtp1-swa4-fa8-r64.json"),
                ("seed scale", "triton-mtp3-swa16-fa32-r8192.json"),
            ):
                path = str(earlier / "corpora" / "seeds" / name)
                for what, label in (("run", "one run"), ("pair", "judged unfixed+fixed pair")):
                    rates = _paired(
                        workers, args.rounds, what=what, path=path, seconds=args.seconds
                    )
                    show(f"{scale}, {label}", rates, f"{'runs' if what == 'run' else 'pairs'}")

            folder = Path(tmp) / "generated"
            folder.mkdir()
            drawn = workers["earlier"].ask(
                what="generate", folder=str(folder), examples=args.examples, seed=args.seed
            )
            draws = [drawn["count"], drawn["cpu"]]

            def draw_again() -> None:
                # The generator's time measured in every round too, under the
                # same load as that round's judging.
                again = workers["earlier"].ask(
                    what="generate", folder="", examples=args.examples, seed=args.seed
                )
                draws[0] += again["count"]
                draws[1] += again["cpu"]

            judged = _totals(workers, args.rounds, draw_again, what="judge", folder=str(folder))
            per_example = draws[1] / draws[0]
            rates = {
                name: count / (cpu + count * per_example) for name, (count, cpu) in judged.items()
            }
            show(
                f"campaign, {drawn['count']} identical examples",
                rates,
                "examples",
            )
            alone = {name: count / cpu for name, (count, cpu) in judged.items()}
            print(
                f"    (the earlier generator takes {per_example * 1000:.1f} ms per example, "
                f"counted on both sides; judging alone: {alone['this'] / alone['earlier']:.2f}x)"
            )
            if args.campaign_seconds > 0:
                rates = _paired(
                    workers,
                    2,
                    what="campaign",
                    seconds=args.campaign_seconds,
                    seed=args.seed,
                )
                show("campaign, own generators", rates, "examples")
        finally:
            for worker in workers.values():
                worker.close()


if __name__ == "__main__":
    main()

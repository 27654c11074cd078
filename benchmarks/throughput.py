"""Scenario executions per second, and the share of time inside vLLM.

Run: ``.venv/bin/python benchmarks/throughput.py [--seconds S]``

Prints, for a toy-scale scenario (block 4 / 8, window 16, retention 64,
256-token prefix), the same requests on a toy Mamba hybrid (full attention 8
+ Mamba 8, hash block 4: fine-grained hits, vLLM's Mamba chunking) and the
Triton seed (block 16 / 32, window 1024, retention 8192, 16384-token prefix):

* executions per second of one variant run (``run_variant``), and of a full
  judged comparison (unfixed + fixed, each with its dense cross-check run);
* the cost of the block-level check (``wrong-kv``): one run judged by the
  oracle with the driver recording blocks (``record_blocks=True``, the
  default) against the same without (``record_blocks=False``), measured in
  alternating rounds so that load from other processes hits both alike;
* the share of the run's time spent in vLLM's own code, from a cProfile of
  the same loop (self time of functions defined in the ``vllm`` package);
* the oracle's CPU time on one toy-geometry run of 512 requests (each
  sharing a random part of the first one's prompt) and its dense cross-check;
* a ``kvfuzz fuzz`` campaign's own executions per second (generated,
  mostly toy-scale scenarios on unfixed + fixed with the dense cross-check),
  to compare with the fixed-scenario figures above, and one restricted to
  Mamba hybrids (``--groups mamba``);
* scheduler mode beside manager mode at toy scale: one run of the same
  scenario through vLLM's real ``Scheduler`` (``--mode scheduler``), vLLM
  issue #48435's four round-robin chat sessions (pool 130 blocks) in both
  modes, and a ``kvfuzz fuzz --mode scheduler`` campaign (generated engine
  workloads: concurrent multi-turn sessions, drafts, eviction).

Each fixed-scenario figure is also given as a ratio:

* against a bare driver doing the same vLLM calls (``KVCacheManager``
  built the same way, then per request ``get_computed_blocks``, the same
  prefill chunks through ``Scheduler._reserve_prefill_lookahead`` and
  ``allocate_slots``, the decode steps with their sampled tokens and
  ``cache_blocks``, ``free``) and nothing else: no recording, no per-group
  lookup, no error classification. It is the limit this machine allows;
  measured in alternating rounds of CPU time in this process, so load from
  other processes hits both alike;
* against the previous figures (``--previous FILE``, default
  ``benchmarks/throughput-previous.json``; ``--save FILE`` writes this run's).
  The figures compared are the ratios to the bare driver, which cancel most
  of the machine's speed and load; raw rates from two runs on a shared
  machine are not comparable.

These are figures to read, not assertions: nothing here fails.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _rate(fn: Callable[[], object], seconds: float) -> tuple[float, int]:
    fn()  # warm up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        count += 1
    return count / (time.perf_counter() - start), count


def _vllm_share(fn: Callable[[], object], repeats: int) -> float:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = inside = 0.0
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += tottime
        if "/vllm/" in filename:
            inside += tottime
    return inside / total if total else 0.0


def _paired_rates(
    on: Callable[[], object], off: Callable[[], object], seconds: float, rounds: int = 8
) -> tuple[float, float]:
    """Executions per CPU second of ``on`` and ``off``, in alternating rounds.

    CPU time of this process (``time.process_time``), so that other processes
    on a shared machine do not skew one side of the comparison.
    """
    on(), off()  # warm up
    counts, spent = [0, 0], [0.0, 0.0]
    for _ in range(rounds):
        for slot, fn in enumerate((on, off)):
            start = time.process_time()
            while time.process_time() - start < seconds / rounds:
                fn()
                counts[slot] += 1
            spent[slot] += time.process_time() - start
    return counts[0] / spent[0], counts[1] / spent[1]


def bare_run(scenario: Any) -> list[int]:
    """The vLLM calls of one manager-mode run and nothing else; the hits, in tokens.

    Attention-only scenarios without a custom pool (what this benchmark
    drives); the same calls as :func:`differential.driver.runner.run_scenario`
    in the same order.
    """
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    from differential.driver import runner
    from differential.driver.settings import resolve_drafter
    from differential.driver.specs import kv_cache_config, pool_blocks

    resolved = resolve_drafter(scenario)
    longest = max(r.prompt_tokens for r in scenario.requests)
    manager = KVCacheManager(
        kv_cache_config=kv_cache_config(
            scenario,
            resolved,
            pool_blocks(scenario, resolved),
            scenario.retention_interval_tokens,
        ),
        max_model_len=longest + scenario.decode_steps + resolved.num_lookahead_tokens + 1,
        scheduler_block_size=scenario.scheduler_block_size_tokens,
        hash_block_size=scenario.effective_hash_block_size_tokens,
        enable_caching=True,
        use_eagle=resolved.use_eagle_block_drop,
        num_hash_lookahead_tokens=resolved.num_hash_lookahead_tokens,
        num_prefill_lookahead=resolved.num_prefill_lookahead_tokens,
    )
    view = SimpleNamespace(num_prefill_lookahead=resolved.num_prefill_lookahead_tokens)
    # vLLM's own hasher, every prompt hashed in every run (kvfuzz's driver
    # memoises the hashes; the bare driver stays what it was).
    hasher = get_request_block_hasher(
        scenario.effective_hash_block_size_tokens, sha256, resolved.num_hash_lookahead_tokens
    )
    lookahead = resolved.num_lookahead_tokens
    spec = scenario.drafter.num_speculative_tokens
    hits = []
    for index, (request_spec, prompt) in enumerate(
        zip(scenario.requests, scenario.prompts, strict=True)
    ):
        request = runner.make_request(scenario, index, prompt, hasher, scenario.decode_steps + 1)
        manager.new_step_starts()
        blocks, hit, junction = manager.get_computed_blocks(request)
        request.shared_prefix_boundary = junction
        hits.append(hit)
        computed, first = hit, True
        while computed < request_spec.prompt_tokens:
            num_new = min(scenario.step_budget_tokens, request_spec.prompt_tokens - computed)
            if not first:
                manager.new_step_starts()
            num_new = Scheduler._reserve_prefill_lookahead(view, request, computed, num_new)  # type: ignore[arg-type]
            if first:
                manager.allocate_slots(
                    request,
                    num_new,
                    num_new_computed_tokens=hit,
                    new_computed_blocks=blocks,
                    num_lookahead_tokens=lookahead,
                )
                request.status = RequestStatus.RUNNING
                first = False
            else:
                manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            computed += num_new
            request.num_computed_tokens = computed
        for step in range(scenario.decode_steps + 1):
            last = step == scenario.decode_steps  # the last sampled token: no step follows
            if not last:
                manager.new_step_starts()
            request.append_output_token_ids(scenario.output_token(index, step))
            if spec:
                manager.cache_blocks(request, request.num_computed_tokens)
            if last:
                break
            manager.allocate_slots(request, 1, num_lookahead_tokens=lookahead)
            computed += 1
            request.num_computed_tokens = computed
        manager.free(request)
    return hits


def _previous(path: Path) -> dict[str, float]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _against(figures: dict[str, float], previous: dict[str, float], key: str, value: float) -> str:
    """``value`` recorded under ``key``, and its ratio to the previous figure."""
    figures[key] = value
    if key not in previous:
        return ""
    return f"; previous {previous[key]:.2f}: {value / previous[key]:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    parser.add_argument(
        "--previous",
        type=Path,
        default=ROOT / "benchmarks" / "throughput-previous.json",
        help="figures to compare with (default: benchmarks/throughput-previous.json)",
    )
    parser.add_argument("--save", type=Path, help="write this run's figures there (JSON)")
    args = parser.parse_args()
    previous = _previous(args.previous)
    figures: dict[str, float] = {}

    started = time.perf_counter()
    from differential.compare import compare_variants
    from differential.corpus import load_entry
    from differential.driver import VLLM_VERSION, run_variant, runs_as_stock
    from differential.oracle import judge_run
    from differential.variants import parse_variants

    print(f"vLLM {VLLM_VERSION} imported in {time.perf_counter() - started:.1f} s")
    unfixed, fixed = parse_variants("unfixed,fixed")
    seeds = ROOT / "corpora" / "seeds"
    import dataclasses

    from differential.scenario import DriveMode, GroupKind, KVCacheGroup

    toy = load_entry(seeds / "toy-mtp1-swa4-fa8-r64.json").scenario
    mamba_toy = dataclasses.replace(
        toy,
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, 8),
            KVCacheGroup(GroupKind.MAMBA, 8),
        ),
        hash_block_size_tokens=4,
        name="toy-mtp1-mamba8-fa8-h4-r64",
    )
    for label, name, scenario in (
        ("toy scale", "toy-mtp1-swa4-fa8-r64", toy),
        ("mamba toy", mamba_toy.name, mamba_toy),
        (
            "seed scale",
            "triton-mtp3-swa16-fa32-r8192",
            load_entry(seeds / "triton-mtp3-swa16-fa32-r8192.json").scenario,
        ),
    ):
        tokens = sum(r.prompt_tokens for r in scenario.requests)
        run_rate, _ = _rate(lambda s=scenario: run_variant(s, unfixed), args.seconds)
        bare = ""
        if not scenario.mamba_groups:
            assert bare_run(scenario) == list(run_variant(scenario, unfixed).hits)
            kvfuzz_rate, bare_rate = _paired_rates(
                lambda s=scenario: run_variant(s, unfixed),
                lambda s=scenario: bare_run(s),
                args.seconds * 2,
            )
            _, judged_cpu_rate = _paired_rates(
                lambda s=scenario: bare_run(s),
                lambda s=scenario: compare_variants(s, (unfixed, fixed)),
                args.seconds * 2,
            )
            run_ratio = kvfuzz_rate / bare_rate
            pair_ratio = judged_cpu_rate / bare_rate
            bare = (
                f"\n  bare driver, same calls:   {bare_rate:8.1f} executions/CPU-s; one run "
                f"{run_ratio:.2f} of it"
                + _against(figures, previous, f"{label}: run / bare", run_ratio)
                + f"\n  judged pair / bare run:    {pair_ratio:8.3f}"
                + _against(figures, previous, f"{label}: judged pair / bare", pair_ratio)
            )
        judged_rate, _ = _rate(
            lambda s=scenario: compare_variants(s, (unfixed, fixed)), args.seconds
        )
        share = _vllm_share(lambda s=scenario: run_variant(s, unfixed), max(3, int(run_rate)))
        checked, unchecked = _paired_rates(
            lambda s=scenario: judge_run(s, run_variant(s, unfixed, record_blocks=True)),
            lambda s=scenario: judge_run(s, run_variant(s, unfixed, record_blocks=False)),
            args.seconds * 2,
        )
        engine = ""
        if label != "seed scale":
            sched_rate, _ = _rate(
                lambda s=scenario: run_variant(s, unfixed, mode=DriveMode.SCHEDULER), args.seconds
            )
            engine = (
                f"\n  one run, scheduler mode:   {sched_rate:8.1f} executions/s (vLLM's Scheduler)"
            )
        # Both variants and their dense cross-checks, less fixed's runs
        # where they are stock's (differential.compare._run_shared).
        stock = [
            what
            for what, dense in (("fixed's run", False), ("fixed's dense cross-check", True))
            if runs_as_stock(scenario, fixed, dense=dense)
        ]
        runs = 4 - len(stock)
        shared = (
            f": {' and '.join(stock)} {'is' if len(stock) == 1 else 'are'} stock's, run once"
            if stock
            else ""
        )
        print(
            f"{label:<11} {name}: {tokens} prompt tokens in {len(scenario.requests)} requests\n"
            f"  one variant run:           {run_rate:8.1f} executions/s\n"
            f"  judged unfixed+fixed pair: {judged_rate:8.1f} scenarios/s "
            f"({runs} runs each{shared})\n"
            f"  time inside vLLM's code:   {share:8.0%} (cProfile self time)\n"
            f"  judged run, block check on:  {checked:8.1f} executions/CPU-s\n"
            f"  judged run, block check off: {unchecked:8.1f} executions/CPU-s "
            f"(the check costs {1 - checked / unchecked:.0%})" + bare + engine
        )

    sessions = load_entry(ROOT / "known-issues" / "eviction-collapse-48435-pool130-dense.json")
    for mode in (DriveMode.MANAGER, DriveMode.SCHEDULER):
        rate, _ = _rate(
            lambda m=mode: run_variant(sessions.scenario, unfixed, mode=m), args.seconds
        )
        print(
            f"#48435 sessions (12 requests, pool 130 blocks), {mode.value} mode: "
            f"{rate:8.1f} executions/s"
        )

    # The oracle at 512 requests: each shares a random part of request 0's
    # prompt (toy geometry); the time to judge the run and its dense cross-check.
    import random

    from differential.oracle.core import cross_check_dense

    rng = random.Random(0)
    first = toy.requests[0]
    many = dataclasses.replace(
        toy,
        requests=(
            first,
            *(
                dataclasses.replace(first, shares_with=0, divergence_tokens=rng.randrange(257))
                for _ in range(511)
            ),
        ),
    )
    run = run_variant(many, unfixed)
    dense_run = run_variant(many, unfixed, dense=True)
    cpu = time.process_time()
    judge_run(many, run)
    cross_check_dense(many, dense_run)
    print(
        f"oracle      {len(many.requests)} requests (toy geometry): judged in "
        f"{time.process_time() - cpu:.2f} CPU-s (the run and its dense cross-check)"
    )

    import tempfile

    from fuzz.campaign import CampaignConfig, run_campaign

    for label, kinds, mode in (
        ("campaign", frozenset(), DriveMode.MANAGER),
        ("mamba only", frozenset({GroupKind.MAMBA}), DriveMode.MANAGER),
        ("scheduler", frozenset(), DriveMode.SCHEDULER),
    ):
        with tempfile.TemporaryDirectory() as out:
            summary = run_campaign(
                CampaignConfig(
                    out=Path(out),
                    variants=(unfixed, fixed),
                    seed=0,
                    seconds=args.seconds * 3,
                    group_kinds=kinds,
                    mode=mode,
                ),
                quiet=True,
            )
        print(
            f"{label:<11} seed 0, {summary['examples']} generated scenarios: "
            f"{summary['executions_per_s']:.1f} judged unfixed+fixed pairs/s"
        )
    if args.save is not None:
        args.save.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
        print(f"figures written to {args.save}")


if __name__ == "__main__":
    main()

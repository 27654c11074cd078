"""kvfuzz's mutation score on vLLM's cache-manager code, and its cost per mutant.

Run: ``.venv/bin/python benchmarks/mutation_score.py [--sample N] [--seed S]
[--campaign-examples K] [--scheduler-examples J] [--scope cache|managers]
[--vllm-tests PATH] [PATH...]``

By default a small sampled run, fast enough to run by hand (8 mutants of the
``cache`` scope, drawn in proportion to each module's mutants, seed 0, the
seed corpus plus 10 campaign and 4 scheduler-mode campaign scenarios: a few
minutes on 2 cores). The figure the report in ``docs/mutation-report.md``
gives comes from ``--sample 60 --campaign-examples 40 corpora``. Prints:

* mutants generated per module (cosmic-ray operators, in scope) and how many
  were sampled;
* the score (killed, timeouts included, over sampled) per module and overall,
  with the killed / timed out / survived / equivalent-suspect counts;
* seconds per mutant (worker start, i.e. one ``import vllm`` of the mutant
  tree, included), the seconds of the stock runs (judged once, reused by
  every mutant) and of the unmutated-tree check, the scenarios that check
  excluded, and the share of survivors that no scenario reaches;
* with ``--vllm-tests PATH`` (e.g. ``../shared/vllm-0.33.0-tests``), the
  cost of vLLM's own tests too: their stock run (once, under coverage) and,
  per mutant, seconds and tests selected (by coverage), next to kvfuzz's
  seconds per mutant, and both scores with the union.

A change to the generator, the oracle or the corpus is compared by these
figures at the same seed and sample. Nothing here fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=[str(ROOT / "corpora" / "seeds")])
    parser.add_argument("--sample", type=int, default=8, help="mutants (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument(
        "--campaign-examples", type=int, default=10, help="campaign scenarios (default: 10)"
    )
    parser.add_argument(
        "--scheduler-examples", type=int, default=4, help="scheduler-mode campaign scenarios"
    )
    parser.add_argument("--scope", default="cache", help="cache or managers (default: cache)")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-scenario timeout, s")
    parser.add_argument("--vllm-tests", type=Path, default=None, help="vLLM's tests' root")
    parser.add_argument("--test-timeout", type=float, default=60.0, help="per-test timeout, s")
    args = parser.parse_args()

    import differential.driver.runner  # noqa: F401  (vLLM's dependencies, for the fork server)
    from differential import forkserver
    from differential.mutation.mutants import (
        SCOPES,
        enumerate_mutants,
        installed_vllm,
        sample_mutants,
    )
    from differential.mutation.score import (
        MutantStatus,
        default_work_dir,
        draw_scenarios,
        run_mutation,
    )

    started = time.perf_counter()
    root = installed_vllm()
    scope = SCOPES[args.scope]
    generated = enumerate_mutants(root, scope.modules)
    mutants = sample_mutants(generated, args.sample, args.seed, proportional=scope.proportional)
    scenarios = draw_scenarios(
        args.paths, args.seed, args.campaign_examples, args.scheduler_examples
    )
    print(f"generation: {time.perf_counter() - started:.1f} s")
    work = default_work_dir()
    server = forkserver.ForkServer.start(forkserver.default_preload())
    os.environ[forkserver.ENV] = server.address
    try:
        run = run_mutation(
            mutants,
            scenarios,
            vllm_root=root,
            work=work,
            seed=args.seed,
            generated={m: len(v) for m, v in generated.items()},
            timeout_s=args.timeout,
            vllm_tests=None if args.vllm_tests is None else args.vllm_tests.resolve(),
            test_timeout_s=args.test_timeout,
            modules=scope.modules,
        )
    finally:
        os.environ.pop(forkserver.ENV, None)
        server.close()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"vLLM {run.vllm_version}, seed {run.seed}, {len(scenarios)} scenarios, "
        f"{len(run.outcomes)} of {sum(run.generated.values())} mutants"
    )
    print(
        f"{'module':<42} {'generated':>9} {'sampled':>7} {'killed':>6} {'t/o':>4} "
        f"{'surv':>5} {'equiv?':>6} {'score':>6}"
    )
    for module in run.generated:
        c = run.counts(module)
        score = run.score(module)
        print(
            f"{module:<42} {run.generated[module]:>9} {sum(c.values()):>7} "
            f"{c[MutantStatus.KILLED]:>6} {c[MutantStatus.TIMED_OUT]:>4} "
            f"{c[MutantStatus.SURVIVED]:>5} {c[MutantStatus.EQUIVALENT_SUSPECT]:>6} "
            f"{'-' if score is None else f'{100 * score:.0f}%':>6}"
        )
    survivors = [o for o in run.outcomes if o.status is MutantStatus.SURVIVED]
    unreached = sum(not o.reached for o in survivors)
    per_mutant = [o.elapsed_s for o in run.outcomes]
    print(f"mutation score: {100 * (run.score() or 0.0):.1f}%")
    print(
        f"seconds per mutant: mean {sum(per_mutant) / len(per_mutant):.1f}, "
        f"max {max(per_mutant):.1f}; whole run {run.elapsed_s:.0f} s"
    )
    print(
        f"stock runs (once, under coverage): {run.stock_s:.1f} s; unmutated-tree check: "
        f"{run.check_s:.1f} s, {len(run.excluded)} of {len(scenarios)} scenarios excluded"
    )
    for one in run.excluded:
        print(f"  excluded {one.name} ({one.module}): {one.difference}")
    print(f"survivors not reached by any scenario: {unreached} of {len(survivors)}")
    if run.tests_baseline is None:
        return
    b = run.tests_baseline
    tests = [o.tests for o in run.outcomes if o.tests is not None]
    ran = [t for t in tests if t.selected]
    print(
        f"vLLM's tests: {b.passed} of {b.collected} pass on stock; stock run (once, under "
        f"coverage) {b.elapsed_s:.1f} s; {len(b.tree_sensitive)} left out (fail on an "
        "unmutated tree)"
    )
    print(f"{'mutant':<62} {'kvfuzz s':>8} {'tests s':>8} {'selected':>8}  kvfuzz / tests")
    for o in run.outcomes:
        t = o.tests
        assert t is not None
        print(
            f"{o.mutant.ident:<62} {o.elapsed_s:>8.1f} {t.elapsed_s:>8.1f} {t.selected:>8}  "
            f"{o.status.value} / {t.verdict.value}"
        )
    n = len(run.outcomes)
    print(
        f"seconds per mutant: kvfuzz {sum(per_mutant) / n:.1f}, vLLM's tests "
        f"{sum(t.elapsed_s for t in tests) / n:.1f} ({sum(t.selected for t in ran)} tests over "
        f"{len(ran)} mutants that ran any; selection by coverage)"
    )
    print(
        f"scores: kvfuzz {100 * (run.score() or 0.0):.1f}%, vLLM's tests "
        f"{100 * (run.tests_score() or 0.0):.1f}%, union {100 * (run.union_score() or 0.0):.1f}%"
    )


if __name__ == "__main__":
    main()

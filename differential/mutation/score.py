"""``kvfuzz mutate``: the mutation score of kvfuzz on vLLM's cache-manager code.

Mutants of vLLM's prefix-cache logic are generated mechanically, each is run
as a tree variant (:mod:`differential.variants.tree`) next to the installed, stock vLLM
(``unfixed``) on the corpus and on the first scenarios of a seeded campaign,
and kvfuzz's own pairwise comparison decides: a mutant is **killed** when any
finding appears on it that stock does not have, or any ``disagreement``,
``cost-change``, ``kv-cache-plan`` (a model planned otherwise) or ``crash``
between the two; **timed out** when its worker
stops answering on a scenario twice in a row (the worker restarted
between). A mutant that is never told apart **survived**, and is sorted
further by what the stock runs tell:

* *not reached*: no scenario executes the mutated statement (coverage of the
  stock runs, by coverage.py): a scenario kvfuzz should generate;
* *observed, not judged*: the raw observation differs (per-group hits, the
  shared-prefix junction, the resolved settings) but no verdict does: the
  oracle is blind there;
* *equivalent-suspect*: the statement runs and every observation (hits,
  per-group hits, junctions, blocks kept, on both the retention and the dense
  run) is identical on every scenario.

Before any mutant, an **unmutated tree** (built exactly as a mutant's, by
:func:`build_mutant_tree` with the module's stock source, one per module the
sample mutates) runs every scenario and must equal stock in every
observation the verdicts read (:func:`check_unmutated`): a scenario where it
does not is kvfuzz's own difference between a tree worker and the in-process
vLLM, not a mutant's; it is reported (named, with the differing observation)
and left out, never counted as a kill. Stock's results are judged once (under
coverage) and reused for every mutant: stock never changes.

The mutants themselves (the scope, cosmic-ray's operators, the trees) are
:mod:`differential.mutation.mutants`; vLLM's own tests as the peer score are
:mod:`differential.mutation.vllm_tests`.

Nothing here imports vLLM; the comparison imports it on first use.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from differential.errors import VariantError, short_repr
from differential.findings import Finding, FindingKind, Policy
from differential.mutation.mutants import (
    MODULES,
    OUT_OF_SCOPE,
    ModuleScope,
    Mutant,
    build_mutant_tree,
    enumerate_mutants,
    installed_vllm,
    mutant_diff,
    mutant_source,
    sample_mutants,
    select_mutants,
)
from differential.mutation.vllm_tests import (
    VllmTests,
    VllmTestsBaseline,
    VllmTestsOutcome,
    VllmTestsVerdict,
)
from differential.scenario import Scenario

__all__ = [
    "MODULES",
    "OUT_OF_SCOPE",
    "ExcludedScenario",
    "ModuleScope",
    "Mutant",
    "MutantOutcome",
    "MutantStatus",
    "MutationRun",
    "RecordedTests",
    "build_mutant_tree",
    "campaign_scenarios",
    "check_unmutated",
    "draw_scenarios",
    "enumerate_mutants",
    "installed_vllm",
    "judge_stock",
    "mutant_source",
    "reached_statements",
    "recorded_scope",
    "recorded_tests",
    "render_markdown",
    "run_mutant",
    "run_mutation",
    "sample_mutants",
    "scenario_digest",
    "select_mutants",
    "stock_difference",
]

REPORT_FORMAT = "kvfuzz.mutation"
REPORT_VERSION = 2


class MutantStatus(StrEnum):
    """What kvfuzz made of one mutant."""

    KILLED = "killed"
    TIMED_OUT = "timed-out"
    SURVIVED = "survived"
    EQUIVALENT_SUSPECT = "equivalent-suspect"


@dataclass(frozen=True)
class MutantOutcome:
    """One mutant's verdict.

    Attributes:
        mutant: the mutant.
        status: killed, timed out, survived or equivalent-suspect.
        evidence: for a killed or timed-out mutant the first telling finding
            and scenario; for a survivor why it is filed as it is.
        reached: whether the stock runs execute the mutated statement.
        scenarios_run: scenarios run before the verdict (a kill stops early).
        elapsed_s: wall time for this mutant, worker start included, in seconds
            (kvfuzz's side only: vLLM's tests are timed in ``tests``).
        diff: the unified diff of the mutation.
        tests: vLLM's tests' verdict (``kvfuzz mutate --vllm-tests``), or
            ``None`` when they were not run.
    """

    mutant: Mutant
    status: MutantStatus
    evidence: str
    reached: bool
    scenarios_run: int
    elapsed_s: float
    diff: str
    tests: VllmTestsOutcome | None = None

    @property
    def killed(self) -> bool:
        """Whether kvfuzz killed it (a timeout counts)."""
        return self.status in (MutantStatus.KILLED, MutantStatus.TIMED_OUT)

    @property
    def killed_by_tests(self) -> bool:
        """Whether vLLM's tests killed it."""
        return self.tests is not None and self.tests.verdict is VllmTestsVerdict.KILLED

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``tests`` only when vLLM's tests ran)."""
        data = {
            "id": self.mutant.ident,
            **self.mutant.to_dict(),
            "status": self.status.value,
            "evidence": self.evidence,
            "reached": self.reached,
            "scenarios_run": self.scenarios_run,
            "elapsed_s": round(self.elapsed_s, 2),
            "diff": self.diff,
        }
        if self.tests is not None:
            data["tests"] = self.tests.to_dict()
        return data


@dataclass(frozen=True)
class ExcludedScenario:
    """A scenario on which an unmutated tree does not equal stock.

    Attributes:
        name: the scenario's name in the run (file path or campaign example).
        module: the module whose unmutated tree differed (``v1/core/...``).
        difference: the first differing observation, tree against stock.
    """

    name: str
    module: str
    difference: str

    def to_dict(self) -> dict[str, str]:
        """JSON-ready form."""
        return {"scenario": self.name, "module": self.module, "difference": self.difference}


@dataclass(frozen=True)
class MutationRun:
    """A whole mutation run.

    Attributes:
        vllm_version: the stock vLLM the mutants were made from.
        seed: the sampling seed (also the campaign seed).
        generated: mutants generated per module, before sampling.
        outcomes: one per sampled mutant, in run order.
        scenarios: the name of every scenario drawn, in run order (excluded
            ones included).
        elapsed_s: wall time of the whole run, in seconds.
        notes: free-form remarks for the report.
        scenario_sha256: per drawn scenario, :func:`scenario_digest`.
        excluded: scenarios an unmutated tree does not run as stock does,
            left out of every mutant's run.
        stock_s: wall time of the stock runs (under coverage), in seconds.
        check_s: wall time of the unmutated-tree check, in seconds.
        command: what drew the scenarios: ``paths`` and ``campaign_examples``
            (``seed`` is above), for :func:`draw_scenarios`.
        tests_baseline: the stock run of vLLM's tests (``--vllm-tests``), or
            ``None`` when they were not run.
    """

    vllm_version: str
    seed: int
    generated: dict[str, int]
    outcomes: tuple[MutantOutcome, ...]
    scenarios: tuple[str, ...]
    elapsed_s: float
    notes: tuple[str, ...] = field(default=())
    scenario_sha256: tuple[str, ...] = field(default=())
    excluded: tuple[ExcludedScenario, ...] = field(default=())
    stock_s: float = 0.0
    check_s: float = 0.0
    command: dict[str, Any] = field(default_factory=dict)
    tests_baseline: VllmTestsBaseline | None = None

    def counts(self, module: str | None = None) -> Counter[MutantStatus]:
        """Outcomes per status (for one module, or all)."""
        return Counter(
            o.status for o in self.outcomes if module is None or o.mutant.module == module
        )

    def score(self, module: str | None = None) -> float | None:
        """Killed (timeouts included) over all mutants, as a fraction; ``None`` if none ran."""
        counts = self.counts(module)
        total = sum(counts.values())
        if not total:
            return None
        return (counts[MutantStatus.KILLED] + counts[MutantStatus.TIMED_OUT]) / total

    def _share(self, module: str | None, killed: Callable[[MutantOutcome], bool]) -> float | None:
        items = [o for o in self.outcomes if module is None or o.mutant.module == module]
        return sum(map(killed, items)) / len(items) if items else None

    def tests_score(self, module: str | None = None) -> float | None:
        """Killed by vLLM's tests over all mutants, as a fraction; ``None`` if none ran."""
        return self._share(module, lambda o: o.killed_by_tests)

    def union_score(self, module: str | None = None) -> float | None:
        """Killed by kvfuzz or by vLLM's tests over all mutants; ``None`` if none ran."""
        return self._share(module, lambda o: o.killed or o.killed_by_tests)

    @property
    def mutant_s(self) -> tuple[float, ...]:
        """Wall time per mutant, in run order, in seconds."""
        return tuple(o.elapsed_s for o in self.outcomes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``format: kvfuzz.mutation``)."""
        per_mutant = self.mutant_s
        data: dict[str, Any] = {
            "format": REPORT_FORMAT,
            "version": REPORT_VERSION,
            "vllm_version": self.vllm_version,
            "seed": self.seed,
            "command": self.command,
            "score": self.score(),
            "score_per_module": {m: self.score(m) for m in self.generated},
            "generated": self.generated,
            "scenarios": list(self.scenarios),
            "scenario_sha256": list(self.scenario_sha256),
            "excluded": [e.to_dict() for e in self.excluded],
            "elapsed_s": round(self.elapsed_s, 1),
            "stock_s": round(self.stock_s, 1),
            "unmutated_check_s": round(self.check_s, 1),
            "mean_mutant_s": round(sum(per_mutant) / len(per_mutant), 1) if per_mutant else None,
            "notes": list(self.notes),
            "mutants": [o.to_dict() for o in self.outcomes],
        }
        if self.tests_baseline is not None:
            data["vllm_tests"] = self.tests_baseline.to_dict()
            data["vllm_tests_score"] = self.tests_score()
            data["vllm_tests_score_per_module"] = {m: self.tests_score(m) for m in self.generated}
            data["union_score"] = self.union_score()
        return data


def campaign_scenarios(seed: int, count: int, *, scheduler: bool = False) -> list[Scenario]:
    """The first ``count`` scenarios a ``kvfuzz fuzz --seed SEED`` campaign runs
    (``scheduler``: a ``kvfuzz fuzz --mode scheduler --seed SEED`` campaign's,
    engine workloads through vLLM's ``Scheduler``).

    The same bytes (``random.Random(seed)``, the campaign's buffer sizes)
    through the same decoder (:func:`fuzz.target.decode`).
    """
    from differential.scenario import DriveMode
    from fuzz.campaign import _BUFFER_SIZES
    from fuzz.target import decode

    mode = DriveMode.SCHEDULER if scheduler else DriveMode.MANAGER
    rng = random.Random(seed)
    scenarios: list[Scenario] = []
    while len(scenarios) < count:
        buffer = rng.randbytes(rng.choice(_BUFFER_SIZES))
        scenario = decode(buffer, mode)
        if scenario is not None:
            scenarios.append(scenario)
    return scenarios


def draw_scenarios(
    paths: Sequence[str | Path],
    seed: int,
    campaign_examples: int,
    scheduler_examples: int = 0,
) -> list[tuple[str, Scenario]]:
    """The scenarios ``kvfuzz mutate PATH... --seed SEED --campaign-examples K
    --scheduler-examples J`` runs.

    ``(name, scenario)`` in run order: every scenario file under ``paths``
    (sorted, named by its path as given), then the first ``campaign_examples``
    of the seeded campaign (:func:`campaign_scenarios`), named ``campaign seed
    SEED example I``, then the first ``scheduler_examples`` of the seeded
    scheduler-mode campaign, named ``scheduler campaign seed SEED example I``:
    the scenarios that drive vLLM's ``Scheduler`` (and so reach
    ``vllm/v1/core/sched/scheduler.py``) besides the corpus's scheduler-mode
    files.

    Raises:
        ScenarioError: a path that does not exist or an invalid scenario file.
    """
    from differential.corpus import iter_scenario_files, load_entry

    drawn = [(str(p), load_entry(p).scenario) for p in iter_scenario_files(paths)] if paths else []
    drawn += [
        (f"campaign seed {seed} example {i}", s)
        for i, s in enumerate(campaign_scenarios(seed, campaign_examples))
    ]
    drawn += [
        (f"scheduler campaign seed {seed} example {i}", s)
        for i, s in enumerate(campaign_scenarios(seed, scheduler_examples, scheduler=True))
    ]
    return drawn


def scenario_digest(scenario: Scenario) -> str:
    """The first 16 hex digits of the SHA-256 of the scenario's JSON form
    (:meth:`Scenario.to_dict`, keys sorted): what a recorded run names each
    scenario by, so a generator or corpus change that draws another
    scenario under the same name is seen."""
    import hashlib

    text = json.dumps(scenario.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def reached_statements(
    scenarios: Sequence[Scenario], vllm_root: Path, modules: Sequence[ModuleScope] = MODULES
) -> dict[str, set[int]]:
    """Lines of ``modules`` the stock (``unfixed``) runs of ``scenarios`` execute.

    Measured with coverage.py around the in-process stock runs (retention and
    dense); lines that run at import time are not in it (module and class
    bodies are treated as reached by the caller).
    """
    return judge_stock(scenarios, vllm_root, modules)[1]


def judge_stock(
    scenarios: Sequence[Scenario],
    vllm_root: Path,
    modules: Sequence[ModuleScope] = MODULES,
    *,
    policy: Policy = Policy.VLLM,
) -> tuple[list[Any], dict[str, set[int]]]:
    """Stock's judged result of every scenario, and the lines of ``modules`` they execute.

    One in-process ``unfixed`` run per scenario
    (:func:`differential.compare.judge_variant`: the retention run, the
    dense cross-check and the scheduler-mode cross-checks), measured with
    coverage.py; import-time lines are not in the coverage.

    Returns:
        ``(results, reached)``: a ``VariantResult`` per scenario, in order,
        and module path -> executed line numbers.
    """
    import coverage

    import differential.driver  # noqa: F401  (vLLM imported before measuring)
    from differential.compare import judge_variant
    from differential.variants import parse_variants

    files = {str((vllm_root / m.path).resolve()): m.path for m in modules}
    cov = coverage.Coverage(data_file=None, include=list(files), branch=False)
    (stock,) = parse_variants("unfixed")
    results = []
    cov.start()
    try:
        for scenario in scenarios:
            results.append(judge_variant(scenario, stock, policy=policy)[0])
    finally:
        cov.stop()
    data = cov.get_data()
    reached = {module: set(data.lines(path) or ()) for path, module in files.items()}
    return results, reached


def _observation_key(run: Any) -> tuple[Any, ...]:
    settings = None if run.settings is None else tuple(sorted(run.settings.to_dict().items()))
    return (
        settings,
        tuple(_request_key(r) for r in run.requests),
        run.evicted_blocks,
        run.error,
        run.unsupported,
        run.timed_out,
    )


def _request_key(request: Any) -> tuple[Any, ...]:
    return (
        request.hit_tokens,
        request.shared_prefix_boundary_tokens,
        request.per_group_hit_tokens,
        request.retained_blocks_per_group,
    )


def _tags(findings: Iterable[Finding]) -> set[str]:
    from differential.corpus import finding_tag

    return {finding_tag(f) for f in findings}


def _difference(stock: Any, other: Any, label: str = "mutant") -> str | None:
    """What differs between two runs' observations (``label`` names ``other``), or ``None``."""
    if _observation_key(stock) == _observation_key(other):
        return None
    if stock.settings != other.settings:
        return f"settings {stock.settings} vs {other.settings}"
    for a, b in zip(stock.requests, other.requests, strict=False):
        if _request_key(a) != _request_key(b):
            fields = ("hit", "junction", "per-group hits", "blocks kept")
            return f"request {a.index}: " + ", ".join(
                f"{name} {x} on stock vs {y} on {label}"
                for name, x, y in zip(fields, _request_key(a), _request_key(b), strict=True)
                if x != y
            )
    parts = [
        f"{what} {x} on stock vs {y} on {label}"
        for what, x, y in (
            ("requests", len(stock.requests), len(other.requests)),
            ("evicted blocks", stock.evicted_blocks, other.evicted_blocks),
            ("error", stock.error, other.error),
            ("unsupported", stock.unsupported, other.unsupported),
            ("timed out", stock.timed_out, other.timed_out),
        )
        if x != y
    ]
    return "; ".join(parts) or "runs differ"


#: Runs of one scenario on one tree before a timeout counts: a run past the
#: per-scenario timeout on a loaded machine is the machine's, not the tree's,
#: unless it repeats on the restarted worker with :data:`_RETRY_TIMEOUT_FACTOR`
#: times the time (a load that slows every run does not time out twice).
_TIMEOUT_ATTEMPTS = 2
_RETRY_TIMEOUT_FACTOR = 4.0


def _attempt_variants(tree: Path, timeout_s: float) -> list[Any]:
    """The tree's variant for each attempt at a scenario: the per-scenario
    timeout, then :data:`_RETRY_TIMEOUT_FACTOR` times it (one worker, keyed
    by the tree)."""
    from differential.variants import parse_variants

    return [
        parse_variants(f"tree:{tree}", timeout_s=timeout_s * _RETRY_TIMEOUT_FACTOR**attempt)[0]
        for attempt in range(_TIMEOUT_ATTEMPTS)
    ]


#: The runs of a judged result, with the names reports give them.
_RUNS = (
    ("run", "retention run"),
    ("dense_run", "dense run"),
    ("manager_run", "manager-mode run"),
    ("retention0_run", "retention-0 run"),
    ("sync_run", "synchronous run"),
)


#: What :func:`differential.compare.compare_unlabelled` finds between two
#: trees: hits or a store's answers (``disagreement``), blocks kept
#: (``cost-change``), the KV cache plan of a model (``kv-cache-plan``).
_COMPARED = (FindingKind.DISAGREEMENT, FindingKind.COST_CHANGE, FindingKind.KV_CACHE_PLAN)


def _kill_evidence(
    name: str, stock: Any, other: Any, comparison: Sequence[Finding], label: str = "mutant"
) -> tuple[MutantStatus, str] | None:
    """Whether ``other`` (a tree's judged result) is told apart from ``stock``'s
    on scenario ``name``: ``(killed or timed out, evidence)``, or ``None``.
    The evidence calls the tree ``label``.

    Reads what a kill is decided by: a timed-out run, a run unsupported on
    the tree only, a finding on one side only, and the ``disagreement`` /
    ``cost-change`` / ``kv-cache-plan`` between the two (``comparison``,
    :data:`_COMPARED`).
    """
    runs = [getattr(other, attr) for attr, _ in _RUNS if getattr(other, attr) is not None]
    if any(r.timed_out for r in runs):
        return MutantStatus.TIMED_OUT, f"timeout on {name}"
    if other.run.unsupported is not None and stock.run.unsupported is None:
        return MutantStatus.KILLED, f"unsupported ({other.run.unsupported}) on {name}"
    new = sorted(_tags(other.findings) - _tags(stock.findings))
    gone = sorted(_tags(stock.findings) - _tags(other.findings))
    compared = [f for f in comparison if f.kind in _COMPARED]
    if not (new or gone or compared):
        return None

    def detail(finding: Finding) -> str:
        return finding.detail.replace(other.variant.name, label)[:160]

    crash = next((f for f in other.findings if f.kind is FindingKind.CRASH), None)
    # A sibling's hits or blocks first, then the oracle's verdicts, then a
    # plan that differs (the verdict on a plan says more than the difference).
    siblings = [f for f in compared if f.kind is not FindingKind.KV_CACHE_PLAN]
    if crash is not None:
        text = f"crash on {name}: {detail(crash)}"
    elif siblings:
        f = siblings[0]
        text = f"{f.kind.value}@{f.request} on {name}: {detail(f)}"
    elif new:
        text = f"new finding(s) {', '.join(new)} on {name}"
    elif gone:
        text = f"finding(s) {', '.join(gone)} of stock gone on {name}"
    else:
        text = f"kv-cache-plan@None on {name}: {detail(compared[0])}"
    return MutantStatus.KILLED, text


def _observed_difference(stock: Any, other: Any, label: str) -> str | None:
    """The first raw observation of any run that differs, or ``None``."""
    for attr, run_name in _RUNS:
        a, b = getattr(stock, attr), getattr(other, attr)
        if a is None and b is None:
            continue
        if a is None or b is None:
            return f"{run_name} made on {'stock' if b is None else label} only"
        diffs = _difference(a, b, label)
        if diffs is not None:
            return f"{run_name}: {diffs}"
    return None


def stock_difference(
    stock: Any, tree: Any, comparison: Sequence[Finding], name: str = "the scenario"
) -> str | None:
    """What an unmutated tree's judged result of scenario ``name`` shows that
    stock's does not, or ``None`` when they are equal.

    Equal means: every verdict a mutant's kill is decided by
    (:func:`_kill_evidence`: timeouts, unsupported runs, the findings of
    each side, the ``disagreement`` / ``cost-change`` / ``kv-cache-plan``
    between the two) and
    every raw observation a survivor is sorted by (settings, hits, per-group
    hits, junctions, blocks kept, evictions, errors of the retention, dense,
    manager-mode and retention-0 runs), plus the driving mode and whether
    blocks were recorded.

    Args:
        stock: stock's ``VariantResult`` (in-process ``unfixed``).
        tree: the tree's ``VariantResult`` of the same scenario.
        comparison: ``compare_results`` of the two (stock first).
        name: the scenario's name, for the message.
    """
    verdict = _kill_evidence(name, stock, tree, comparison, "the tree")
    if verdict is not None:
        return verdict[1]
    observed = _observed_difference(stock, tree, "the tree")
    if observed is not None:
        return f"{observed} on {name}"
    for attr, run_name in _RUNS:
        a, b = getattr(stock, attr), getattr(tree, attr)
        if (
            a is not None
            and b is not None
            and (a.mode, a.blocks_recorded)
            != (
                b.mode,
                b.blocks_recorded,
            )
        ):
            return (
                f"{run_name}: mode {a.mode}, blocks recorded {a.blocks_recorded} on stock vs "
                f"{b.mode}, {b.blocks_recorded} on the tree on {name}"
            )
    return None


def _judge_on(variant: Any, scenario: Scenario, stock: Any, policy: Policy) -> tuple[Any, Any]:
    """``variant``'s judged result of ``scenario`` and its comparison with ``stock``'s."""
    from differential.compare import compare_results, judge_variant

    result, _ = judge_variant(scenario, variant, policy=policy)
    compared = compare_results(scenario, [stock, result], policy=policy)
    return result, compared.comparison_findings


def _stock_results(scenarios: Sequence[tuple[str, Scenario]], policy: Policy) -> list[Any]:
    from differential.compare import judge_variant
    from differential.variants import parse_variants

    (stock,) = parse_variants("unfixed")
    return [judge_variant(s, stock, policy=policy)[0] for _, s in scenarios]


def check_unmutated(
    scenarios: Sequence[tuple[str, Scenario]],
    stock: Sequence[Any],
    *,
    vllm_root: Path,
    work: Path,
    modules: Sequence[str],
    timeout_s: float = 10.0,
    policy: Policy = Policy.VLLM,
    on_excluded: Callable[[ExcludedScenario], None] | None = None,
) -> list[ExcludedScenario]:
    """Run every scenario on an unmutated tree per module and keep what differs from stock.

    Each tree is built exactly as a mutant's (:func:`build_mutant_tree`, with
    the module's stock source written in place of a mutation) and runs in a
    tree worker as a mutant does; :func:`stock_difference` compares its
    judged result with stock's (a timeout counts only when the rerun on the
    restarted worker times out too). A scenario that differs is kvfuzz's own
    difference between a tree and the in-process vLLM: it could only ever
    give false kills, so it is excluded (from every mutant) and reported.

    Args:
        scenarios: ``(name, scenario)`` in run order.
        stock: stock's ``VariantResult`` per scenario (same order).
        vllm_root: the installed ``vllm`` package folder.
        work: a folder for the trees (removed when done).
        modules: module paths relative to ``vllm_root`` (one tree each).
        timeout_s: per-scenario timeout of the tree's worker, in seconds.
        policy: the checkpoint policy stock was judged with.
        on_excluded: called with each exclusion as it is found.

    Returns:
        The excluded scenarios, in scenario order (first differing module).

    Raises:
        InternalError: a tree's worker cannot start, or kvfuzz's driver
            failed inside it: kvfuzz's failure, not a scenario's.
    """
    from differential.variants.tree import shutdown_workers

    excluded: dict[str, ExcludedScenario] = {}
    for module in modules:
        original = (vllm_root / module).read_text(encoding="utf-8")
        tree = build_mutant_tree(
            vllm_root, module, original, work / f"unmutated-{Path(module).stem}"
        )
        attempts = _attempt_variants(tree, timeout_s)
        try:
            for (name, scenario), base in zip(scenarios, stock, strict=True):
                if name in excluded:
                    continue
                for variant in attempts:
                    result, comparison = _judge_on(variant, scenario, base, policy)
                    timed_out = _kill_evidence(name, base, result, comparison)
                    if timed_out is None or timed_out[0] is not MutantStatus.TIMED_OUT:
                        break
                difference = stock_difference(base, result, comparison, name)
                if difference is not None:
                    one = ExcludedScenario(name, module, difference)
                    excluded[name] = one
                    if on_excluded is not None:
                        on_excluded(one)
        finally:
            shutdown_workers()
            shutil.rmtree(tree, ignore_errors=True)
    order = {name: i for i, (name, _) in enumerate(scenarios)}
    return sorted(excluded.values(), key=lambda e: order[e.name])


def run_mutant(
    mutant: Mutant,
    scenarios: Sequence[tuple[str, Scenario]],
    *,
    vllm_root: Path,
    work: Path,
    reached: dict[str, set[int]],
    timeout_s: float,
    policy: Policy = Policy.VLLM,
    stock: Sequence[Any] | None = None,
) -> MutantOutcome:
    """Build the mutant's tree, run every scenario on it, and judge it against stock.

    ``stock`` is stock's judged result per scenario (``VariantResult``, same
    order), judged here when not given. Stops at the first scenario that
    kills the mutant; a scenario that times out is run once more (on the
    restarted worker) and times the mutant out only if it does again. Leaves
    no worker running.
    """
    from differential.variants.tree import shutdown_workers

    started = time.perf_counter()
    original, mutated = mutant_source(vllm_root, mutant)
    diff = mutant_diff(mutant, original, mutated)
    if stock is None:
        stock = _stock_results(scenarios, policy)
    tree = build_mutant_tree(vllm_root, mutant.module, mutated, work / "tree")
    covered = reached.get(mutant.module, set())
    first, last = mutant.statement_lines
    reached_here = mutant.at_import or any(line in covered for line in range(first, last + 1))
    attempts = _attempt_variants(tree, timeout_s)
    variant = attempts[0]

    def outcome(status: MutantStatus, evidence: str, ran: int) -> MutantOutcome:
        shutdown_workers()
        evidence = evidence.replace(variant.name, "mutant")
        return MutantOutcome(
            mutant, status, evidence, reached_here, ran, time.perf_counter() - started, diff
        )

    first_difference: str | None = None
    for ran, ((name, scenario), base) in enumerate(zip(scenarios, stock, strict=True), start=1):
        for attempt in attempts:
            try:
                result, comparison = _judge_on(attempt, scenario, base, policy)
            except (VariantError, RuntimeError) as exc:  # the worker could not start
                return outcome(
                    MutantStatus.KILLED,
                    f"crash: the tree's worker failed ({type(exc).__name__}: {exc}) on {name}",
                    ran,
                )
            verdict = _kill_evidence(name, base, result, comparison)
            if verdict is None or verdict[0] is not MutantStatus.TIMED_OUT:
                break
        if verdict is not None:
            if verdict[0] is MutantStatus.TIMED_OUT:
                verdict = (verdict[0], f"{verdict[1]} ({_TIMEOUT_ATTEMPTS} times in a row)")
            return outcome(*verdict, ran)
        if first_difference is None:
            diffs = _observed_difference(base, result, "mutant")
            if diffs is not None:
                first_difference = f"{name}: {diffs}"
    count = len(scenarios)
    if first_difference is not None:
        return outcome(
            MutantStatus.SURVIVED,
            f"observed, not judged: {first_difference[:300]}",
            count,
        )
    if not reached_here:
        return outcome(
            MutantStatus.SURVIVED, "not reached: no scenario executes the mutated statement", count
        )
    return outcome(
        MutantStatus.EQUIVALENT_SUSPECT,
        "reached; hits, per-group hits, junctions and blocks kept identical on every scenario",
        count,
    )


def run_mutation(
    mutants: Sequence[Mutant],
    scenarios: Sequence[tuple[str, Scenario]],
    *,
    vllm_root: Path,
    work: Path,
    seed: int,
    generated: dict[str, int],
    timeout_s: float = 10.0,
    policy: Policy = Policy.VLLM,
    progress: Callable[[MutantOutcome, int, int], None] | None = None,
    on_excluded: Callable[[ExcludedScenario], None] | None = None,
    command: dict[str, Any] | None = None,
    vllm_tests: Path | None = None,
    test_timeout_s: float = 60.0,
    modules: Sequence[ModuleScope] = MODULES,
) -> MutationRun:
    """Judge stock once, check an unmutated tree, then run every mutant in turn.

    Stock's results (one in-process run of each scenario, under coverage)
    serve every mutant; :func:`check_unmutated` excludes the scenarios an
    unmutated tree of a sampled module does not run as stock does; each
    mutant then runs the rest (one tree worker at a time).

    With ``vllm_tests`` (a folder holding ``tests/v1/core``), vLLM's own
    tests run once on stock first (:meth:`VllmTests.prepare`), then after
    each mutant's kvfuzz verdict on the same tree (:meth:`VllmTests.judge`:
    the stock-passing tests that execute the mutated statement).

    Args:
        command: recorded in the run (``paths``, ``campaign_examples``).
        vllm_tests: the tests' root, or ``None`` to judge by kvfuzz alone.
        test_timeout_s: per-test timeout of vLLM's tests, in seconds.
        modules: the scope's modules: the files whose lines the stock runs
            and vLLM's tests are measured on (each mutant's module among them).

    Raises:
        InternalError: the unmutated tree's worker cannot start (kvfuzz's
            failure: no mutant could be judged), or vLLM's tests could not run.
    """
    import differential.driver

    started = time.perf_counter()
    tests = None
    if vllm_tests is not None:
        tests = VllmTests.prepare(
            vllm_tests,
            vllm_root,
            [m.path for m in modules],
            cwd=work / "vllm-tests-cwd",
            timeout_s=test_timeout_s,
        )
    stock_started = time.perf_counter()
    stock, reached = judge_stock([s for _, s in scenarios], vllm_root, modules, policy=policy)
    stock_s = time.perf_counter() - stock_started
    excluded = check_unmutated(
        scenarios,
        stock,
        vllm_root=vllm_root,
        work=work,
        modules=list(dict.fromkeys(m.module for m in mutants)),
        timeout_s=timeout_s,
        policy=policy,
        on_excluded=on_excluded,
    )
    check_s = time.perf_counter() - stock_started - stock_s
    left_out = {e.name for e in excluded}
    kept = [i for i, (name, _) in enumerate(scenarios) if name not in left_out]
    outcomes = _run_mutants(
        mutants,
        [scenarios[i] for i in kept],
        [stock[i] for i in kept],
        reached,
        tests,
        vllm_root=vllm_root,
        work=work,
        timeout_s=timeout_s,
        policy=policy,
        progress=progress,
    )
    return MutationRun(
        vllm_version=differential.driver.VLLM_VERSION,
        seed=seed,
        generated=generated,
        outcomes=tuple(outcomes),
        scenarios=tuple(name for name, _ in scenarios),
        elapsed_s=time.perf_counter() - started,
        scenario_sha256=tuple(scenario_digest(s) for _, s in scenarios),
        excluded=tuple(excluded),
        stock_s=stock_s,
        check_s=check_s,
        command=dict(command or {}),
        tests_baseline=None if tests is None else tests.baseline,
    )


def _run_mutants(
    mutants: Sequence[Mutant],
    scenarios: Sequence[tuple[str, Scenario]],
    stock: Sequence[Any],
    reached: dict[str, set[int]],
    tests: VllmTests | None,
    *,
    vllm_root: Path,
    work: Path,
    timeout_s: float,
    policy: Policy,
    progress: Callable[[MutantOutcome, int, int], None] | None,
) -> list[MutantOutcome]:
    """Every mutant in turn on the scenarios ``stock`` judged (one tree worker
    at a time, each mutant's tree removed after it), then, with ``tests``,
    vLLM's tests on the same tree."""
    outcomes: list[MutantOutcome] = []
    for i, mutant in enumerate(mutants):
        one = run_mutant(
            mutant,
            scenarios,
            vllm_root=vllm_root,
            work=work / f"m{i:04d}",
            reached=reached,
            timeout_s=timeout_s,
            policy=policy,
            stock=stock,
        )
        if tests is not None:
            verdict = tests.judge(
                mutant.module,
                mutant.statement_lines,
                mutant.at_import,
                work / f"m{i:04d}" / "tree",
                work,
            )
            one = dataclasses.replace(one, tests=verdict)
        shutil.rmtree(work / f"m{i:04d}", ignore_errors=True)
        outcomes.append(one)
        if progress is not None:
            progress(one, i + 1, len(mutants))
    return outcomes


@dataclass(frozen=True)
class RecordedTests:
    """vLLM's tests' side of a recorded run (``kvfuzz mutate --vllm-tests-from FILE``).

    vLLM's tests judge a mutant by the mutant alone: while vLLM and the
    mutants are the same, their verdicts do not change when kvfuzz's
    scenarios, oracle or driver do, so a run that changes only kvfuzz can
    take them from a run that ran the tests (minutes instead of an hour on
    2 cores) and print the same side-by-side report.

    Attributes:
        path: the recorded run's file.
        run: the recorded run.
    """

    path: Path
    run: MutationRun

    def _by_id(self) -> dict[str, MutantOutcome]:
        return {o.mutant.ident: o for o in self.run.outcomes}

    def check(self, mutants: Sequence[Mutant], vllm_root: Path, vllm_version: str) -> None:
        """Refuse, before any work, a record that cannot answer for ``mutants``
        (made from the vLLM ``vllm_version`` installed at ``vllm_root``).

        Raises:
            VariantError: the record ran no tests, holds another vLLM release,
                lacks one of ``mutants`` or records another diff for it.
        """
        if self.run.tests_baseline is None:
            raise VariantError(
                f"--vllm-tests-from {self.path}: the run has no vLLM tests' verdicts; allowed: "
                "the --json file of a kvfuzz mutate run with --vllm-tests"
            )
        if self.run.vllm_version != vllm_version:
            raise VariantError(
                f"--vllm-tests-from {self.path}: recorded on vLLM {self.run.vllm_version}, "
                f"this is {vllm_version}; allowed: a run on the same vLLM"
            )
        recorded = self._by_id()
        for mutant in mutants:
            one = recorded.get(mutant.ident)
            if one is None or one.tests is None:
                raise VariantError(
                    f"--vllm-tests-from {self.path}: mutant {mutant.ident} has no recorded "
                    "verdict of vLLM's tests; allowed: mutants the recorded run ran"
                )
            if one.diff != mutant_diff(mutant, *mutant_source(vllm_root, mutant)):
                raise VariantError(
                    f"--vllm-tests-from {self.path}: mutant {mutant.ident} was recorded with "
                    "another diff; allowed: a run on the same vLLM source"
                )

    def attach(self, run: MutationRun) -> MutationRun:
        """``run`` (kvfuzz's verdicts) with the recorded tests' verdicts and
        stock baseline, and a note saying where they come from."""
        recorded = self._by_id()
        outcomes = tuple(
            dataclasses.replace(o, tests=recorded[o.mutant.ident].tests) for o in run.outcomes
        )
        note = (
            f"vLLM's tests' verdicts taken from {self.path} (--vllm-tests-from), recorded on "
            f"vLLM {self.run.vllm_version}; only kvfuzz's side ran"
        )
        return dataclasses.replace(
            run,
            outcomes=outcomes,
            tests_baseline=self.run.tests_baseline,
            notes=(*run.notes, note),
            command={**run.command, "vllm_tests_from": str(self.path)},
        )


def recorded_tests(path: Path) -> RecordedTests:
    """The recorded run at ``path`` for ``--vllm-tests-from``.

    Raises:
        VariantError: unreadable, not a ``kvfuzz mutate --json`` file.
    """
    return RecordedTests(path, load_run(path, "--vllm-tests-from"))


def recorded_scope(command: dict[str, Any]) -> str:
    """The ``--scope`` a run's recorded ``command`` was made with (runs
    recorded before ``--scope`` existed mutated the ``managers`` scope)."""
    return str(command.get("scope", "managers"))


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def render_markdown(run: MutationRun) -> str:
    """The report: score per module and per function, then every survivor's diff."""
    lines = [
        f"# Mutation score of kvfuzz on vLLM {run.vllm_version}",
        "",
        f"Score: **{pct(run.score())}** killed ({len(run.outcomes)} mutants "
        + ("given by id" if "mutants" in run.command else f"sampled with seed {run.seed}")
        + f" from {sum(run.generated.values())} generated; "
        f"{len(run.scenarios)} scenarios; {run.elapsed_s:.0f} s, "
        f"{run.elapsed_s / max(1, len(run.outcomes)):.1f} s per mutant).",
        "",
        f"Scope: `{recorded_scope(run.command)}` "
        f"({len(run.generated)} modules; `differential/mutation/mutants.py`).",
        "",
        f"Unmutated-tree check: {len(run.scenarios) - len(run.excluded)} of "
        f"{len(run.scenarios)} scenarios equal stock on an unmutated tree, "
        f"{len(run.excluded)} excluded ({run.check_s:.0f} s; stock judged once, "
        f"{run.stock_s:.0f} s).",
        "",
        *(f"Note: {note}\n" for note in run.notes),
        "| module | generated | sampled | killed | timed out | survived | equivalent-suspect "
        "| score |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for module in run.generated:
        c = run.counts(module)
        lines.append(
            f"| `{module}` | {run.generated[module]} | {sum(c.values())} "
            f"| {c[MutantStatus.KILLED]} | {c[MutantStatus.TIMED_OUT]} "
            f"| {c[MutantStatus.SURVIVED]} | {c[MutantStatus.EQUIVALENT_SUSPECT]} "
            f"| {pct(run.score(module))} |"
        )
    lines += [
        "",
        "## Per function",
        "",
        "| module | function | killed / sampled |",
        "| --- | --- | ---: |",
    ]
    per: dict[tuple[str, str], list[MutantOutcome]] = {}
    for o in run.outcomes:
        per.setdefault((o.mutant.module, o.mutant.function or "(module)"), []).append(o)
    for (module, function), items in sorted(per.items()):
        killed = sum(o.status in (MutantStatus.KILLED, MutantStatus.TIMED_OUT) for o in items)
        lines.append(f"| {Path(module).stem} | `{function}` | {killed} / {len(items)} |")
    if run.excluded:
        lines += ["", "## Excluded scenarios (an unmutated tree differs from stock)", ""]
        lines += [f"- `{e.name}` ({e.module}): {e.difference}" for e in run.excluded]
    if run.tests_baseline is not None:
        lines += _side_by_side(run, run.tests_baseline)
    lines += ["", "## Killed", ""]
    for o in run.outcomes:
        if o.status in (MutantStatus.KILLED, MutantStatus.TIMED_OUT):
            lines.append(
                f"- `{o.mutant.ident}` ({o.mutant.function}, line {o.mutant.line}): "
                f"{o.evidence} [{o.scenarios_run} scenario(s), {o.elapsed_s:.1f} s]"
            )
    lines += ["", "## Survivors", ""]
    for o in run.outcomes:
        if o.status in (MutantStatus.SURVIVED, MutantStatus.EQUIVALENT_SUSPECT):
            lines += [
                f"### `{o.mutant.ident}`: {o.status.value}",
                "",
                f"{o.mutant.function or '(module level)'}, line {o.mutant.line}: {o.evidence}",
                "",
                "```diff",
                o.diff.rstrip("\n"),
                "```",
                "",
            ]
    return "\n".join(lines) + "\n"


def _diff_line(diff: str) -> str:
    """The first added line of a mutant's diff, stripped of ``+`` and indentation."""
    for line in diff.splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            return line[1:].strip()
    return ""


def _split(items: Sequence[MutantOutcome]) -> tuple[int, int, int, int, int]:
    """``(kvfuzz only, tests only, both, neither, tests not run)`` counts
    (:func:`_reach` counts what each side reaches)."""
    kvfuzz = sum(o.killed and not o.killed_by_tests for o in items)
    tests = sum(o.killed_by_tests and not o.killed for o in items)
    both = sum(o.killed and o.killed_by_tests for o in items)
    not_run = sum(
        o.tests is not None and o.tests.verdict is VllmTestsVerdict.NOT_RUN for o in items
    )
    return kvfuzz, tests, both, len(items) - kvfuzz - tests - both, not_run


def _reach(items: Sequence[MutantOutcome]) -> str:
    """``"R / T"``: the mutants kvfuzz's stock runs reach and those some
    stock-passing test of vLLM's executes (the tests ran: not ``not run``)."""
    tests = sum(
        o.tests is not None and o.tests.verdict is not VllmTestsVerdict.NOT_RUN for o in items
    )
    return f"{sum(o.reached for o in items)} / {tests}"


def _side_by_side_per_function(run: MutationRun) -> list[str]:
    """The side-by-side table per function: who kills, who reaches."""
    lines = [
        "",
        "### Per function",
        "",
        "| module | function | sampled | kvfuzz only | tests only | both | neither "
        "| reached (kvfuzz / tests) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    per: dict[tuple[str, str], list[MutantOutcome]] = {}
    for o in run.outcomes:
        per.setdefault((o.mutant.module, o.mutant.function or "(module)"), []).append(o)
    for (module, function), items in sorted(per.items()):
        k, t, b, neither, _ = _split(items)
        lines.append(
            f"| {Path(module).stem} | `{function}` | {len(items)} | {k} | {t} | {b} | {neither} "
            f"| {_reach(items)} |"
        )
    return lines


def _side_by_side(run: MutationRun, baseline: VllmTestsBaseline) -> list[str]:
    """The report's comparison with vLLM's own tests (``kvfuzz mutate --vllm-tests``)."""
    timed = [o.tests for o in run.outcomes if o.tests is not None]
    ran = [t for t in timed if t.verdict is not VllmTestsVerdict.NOT_RUN]
    n = max(1, len(run.outcomes))
    lines = [
        "",
        "## Side by side with vLLM's own tests",
        "",
        f"vLLM's tests: `{baseline.path}`, `tests/v1/core`: {baseline.collected} tests ran "
        f"on stock, {baseline.passed} passed ({baseline.elapsed_s:.0f} s once, under "
        f"coverage; each test under a {baseline.timeout_s:g} s timeout). A mutant is killed "
        "by the tests when a test that passes on stock fails, errors or times out on it.",
        "",
        "**Selection is by coverage**: each mutant runs only the stock-passing tests that "
        "execute the mutated statement on stock (coverage.py, one context per test); a "
        "mutant evaluated at import time runs those that execute any line of its module. A "
        "mutant no stock-passing test executes is *not run* and counts as not killed by the "
        "tests. A test that fails on an unmutated tree too is left out"
        + (
            f" ({len(baseline.tree_sensitive)}: "
            + ", ".join(f"`{t}`" for t in baseline.tree_sensitive)
            + ")."
            if baseline.tree_sensitive
            else " (none was)."
        ),
        "",
        f"Scores: kvfuzz **{pct(run.score())}**, vLLM's tests **{pct(run.tests_score())}**, "
        f"union **{pct(run.union_score())}** ({len(run.outcomes)} mutants). Per mutant: "
        f"kvfuzz {sum(o.elapsed_s for o in run.outcomes) / n:.1f} s, vLLM's tests "
        f"{sum(t.elapsed_s for t in timed) / n:.1f} s ({len(ran)} mutant(s) ran tests, "
        f"{sum(t.selected for t in ran) / max(1, len(ran)):.0f} tests selected on average).",
        "",
        "Reached: the mutants kvfuzz's stock runs execute the mutated statement of / "
        "those some stock-passing test executes it of.",
        "",
        "| module | sampled | kvfuzz only | tests only | both | neither | tests not run "
        "| reached (kvfuzz / tests) | kvfuzz | tests | union |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for path in [*run.generated, None]:
        items = [o for o in run.outcomes if path is None or o.mutant.module == path]
        if not items and path is not None:
            continue
        k, t, b, neither, not_run = _split(items)
        lines.append(
            f"| {'all' if path is None else f'`{path}`'} | {len(items)} | {k} | {t} | {b} "
            f"| {neither} | {not_run} | {_reach(items)} | {pct(run.score(path))} "
            f"| {pct(run.tests_score(path))} "
            f"| {pct(run.union_score(path))} |"
        )
    lines += _side_by_side_per_function(run)
    lines += ["", "### Killed by kvfuzz only", ""]
    only = [o for o in run.outcomes if o.killed and not o.killed_by_tests]
    lines += [
        f"- `{o.mutant.ident}` ({o.mutant.function or '(module level)'}, line "
        f"{o.mutant.line}): `{_diff_line(o.diff)}`: {o.evidence[:200]}"
        + (
            ""
            if o.tests is None or o.tests.verdict is VllmTestsVerdict.SURVIVED
            else f" (tests: {o.tests.verdict.value})"
        )
        for o in only
    ] or ["(none)"]
    lines += ["", "### Killed by vLLM's tests only", ""]
    only = [o for o in run.outcomes if o.killed_by_tests and not o.killed]
    lines += [
        f"- `{o.mutant.ident}` ({o.mutant.function or '(module level)'}, line "
        f"{o.mutant.line}): `{_diff_line(o.diff)}`: `{o.tests.test}` "
        f"({o.tests.detail[:160]}); kvfuzz: {o.status.value}"
        + (
            f"; out of kvfuzz's scope: {OUT_OF_SCOPE[o.mutant.function]}"
            if o.mutant.function in OUT_OF_SCOPE
            else ""
        )
        for o in only
        if o.tests is not None
    ] or ["(none)"]
    scoped = sum(o.mutant.function in OUT_OF_SCOPE for o in only if o.tests is not None)
    if scoped:
        lines += [
            "",
            f"{scoped} of these {len(only)} lie in code kvfuzz does not reach by design "
            "(`OUT_OF_SCOPE` in `differential/mutation/mutants.py`).",
        ]
    return lines


def load_run(path: Path, option: str = "--merge") -> MutationRun:
    """Read a run written by :func:`write_json` (``kvfuzz mutate --json``);
    ``option`` names the flag that gave ``path`` in error messages.

    Raises:
        VariantError: not a ``kvfuzz.mutation`` version-2 file, or a field missing.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise VariantError(f"{option} {path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(data, dict) or (data.get("format"), data.get("version")) != (
        REPORT_FORMAT,
        REPORT_VERSION,
    ):
        raise VariantError(
            f"{option} {path}: format/version is not {REPORT_FORMAT} {REPORT_VERSION}; "
            "allowed: a kvfuzz mutate --json file"
        )
    try:
        outcomes = tuple(_outcome_from_dict(m) for m in data["mutants"])
        tests = data.get("vllm_tests")
        baseline = None
        if tests is not None:
            baseline = VllmTestsBaseline(
                tests["path"],
                tests["collected"],
                tests["passed"],
                tests["elapsed_s"],
                tests["timeout_s"],
                tuple(tests["tree_sensitive"]),
            )
        return MutationRun(
            vllm_version=data["vllm_version"],
            seed=data["seed"],
            generated=dict(data["generated"]),
            outcomes=outcomes,
            scenarios=tuple(data["scenarios"]),
            elapsed_s=data["elapsed_s"],
            notes=tuple(data["notes"]),
            scenario_sha256=tuple(data["scenario_sha256"]),
            excluded=tuple(
                ExcludedScenario(e["scenario"], e["module"], e["difference"])
                for e in data["excluded"]
            ),
            stock_s=data["stock_s"],
            check_s=data["unmutated_check_s"],
            command=dict(data["command"]),
            tests_baseline=baseline,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise VariantError(f"{option} {path}: field {exc} missing or malformed") from exc


def _outcome_from_dict(m: dict[str, Any]) -> MutantOutcome:
    mutant = Mutant(
        m["module"],
        m["operator"],
        m["occurrence"],
        m["line"],
        m["function"],
        (m["statement_lines"][0], m["statement_lines"][1]),
        m["at_import"],
    )
    t = m.get("tests")
    tests = (
        None
        if t is None
        else VllmTestsOutcome(
            VllmTestsVerdict(t["verdict"]), t["test"], t["detail"], t["selected"], t["elapsed_s"]
        )
    )
    return MutantOutcome(
        mutant,
        MutantStatus(m["status"]),
        m["evidence"],
        m["reached"],
        m["scenarios_run"],
        m["elapsed_s"],
        m["diff"],
        tests,
    )


def merge_runs(runs: Sequence[tuple[Path, MutationRun]]) -> MutationRun:
    """One run from the shards of one (``kvfuzz mutate --shard I/N``, then ``--merge``).

    The shards must share the vLLM release, seed, generated counts and
    scenarios (by digest) and, when any ran vLLM's tests, the tests' root;
    mutants come back in sample order (shard ``I`` of ``N`` holds sample
    positions ``I-1``, ``I-1+N``, ...); times are added (machine-seconds).

    Raises:
        VariantError: shards of different runs, a shard given twice or missing.
    """
    if not runs:
        raise VariantError("--merge: no files given; allowed: two or more --json files")
    first_path, first = runs[0]
    shards: dict[int, MutationRun] = {}
    total = None
    for path, run in runs:
        for what, mine, theirs in (
            ("vllm_version", run.vllm_version, first.vllm_version),
            ("seed", run.seed, first.seed),
            ("generated", run.generated, first.generated),
            ("scenario_sha256", run.scenario_sha256, first.scenario_sha256),
            (
                "vllm_tests",
                None if run.tests_baseline is None else run.tests_baseline.path,
                None if first.tests_baseline is None else first.tests_baseline.path,
            ),
        ):
            if mine != theirs:
                raise VariantError(
                    f"--merge {path}: {what} differs from {first_path}'s; allowed: shards of "
                    "one run (same command but --shard)"
                )
        index, count = parse_shard(str(run.command.get("shard", "1/1")))
        if total is not None and count != total:
            raise VariantError(f"--merge {path}: shard {index}/{count} of another split")
        total = count
        if index in shards:
            raise VariantError(f"--merge {path}: shard {index}/{count} given twice")
        shards[index] = run
    assert total is not None
    missing = sorted(set(range(1, total + 1)) - set(shards))
    if missing:
        raise VariantError(f"--merge: shard {missing[0]}/{total} missing")
    ordered: list[MutantOutcome] = []
    for k in range(max(len(r.outcomes) for r in shards.values())):
        ordered += [shards[i].outcomes[k] for i in sorted(shards) if k < len(shards[i].outcomes)]
    excluded = {e.name: e for r in shards.values() for e in r.excluded}
    order = {name: i for i, name in enumerate(first.scenarios)}
    baseline = first.tests_baseline
    baselines = [r.tests_baseline for r in shards.values() if r.tests_baseline is not None]
    if baseline is not None:
        baseline = dataclasses.replace(
            baseline,
            elapsed_s=sum(b.elapsed_s for b in baselines),
            tree_sensitive=tuple(sorted({t for b in baselines for t in b.tree_sensitive})),
        )
    command = {k: v for k, v in first.command.items() if k != "shard"}
    command["merged_shards"] = total
    return dataclasses.replace(
        first,
        outcomes=tuple(ordered),
        elapsed_s=sum(r.elapsed_s for r in shards.values()),
        excluded=tuple(sorted(excluded.values(), key=lambda e: order.get(e.name, 0))),
        stock_s=sum(r.stock_s for r in shards.values()),
        check_s=sum(r.check_s for r in shards.values()),
        command=command,
        tests_baseline=baseline,
    )


#: The most shards one run is split into (more is a typo, not a farm).
MAX_SHARDS = 10**6


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)``, ``1 <= I <= N <= MAX_SHARDS``.

    Raises:
        VariantError: anything else.
    """
    match = re.fullmatch(r"([0-9]{1,7})/([0-9]{1,7})", text)
    if match is not None and 1 <= int(match[1]) <= int(match[2]) <= MAX_SHARDS:
        return int(match[1]), int(match[2])
    raise VariantError(
        f"--shard {short_repr(text)}: allowed: I/N with 1 <= I <= N <= {MAX_SHARDS} (e.g. 1/2)"
    )


def write_json(run: MutationRun, path: Path) -> None:
    """Write the run as JSON, atomically."""
    from differential.corpus import write_atomic

    write_atomic(path, json.dumps(run.to_dict(), indent=2) + "\n")


def default_work_dir() -> Path:
    """Where mutant trees are built (``$TMPDIR/kvfuzz-mutants-<pid>``).

    A run removes its folder when it ends, SIGTERM included; one left by a
    run that was SIGKILLed (its pid no longer alive) is removed here.
    """
    import tempfile

    from differential.stale import remove_stale

    temp = Path(tempfile.gettempdir())
    remove_stale(temp, "kvfuzz-mutants-")
    return temp / f"kvfuzz-mutants-{os.getpid()}"

"""``kvfuzz gate``'s runs: a pull request's tree against its base, two tree variants.

:func:`gate_trees` reads the git repository (the base: ``--base REF`` or the
merge base with the default branch; the head: the working tree or ``--head
REF``), :func:`gate_variants` makes them two tree variants (``base`` and
``head``: the base checked out into ``PATH/.kvfuzz-worktrees/gate-base``,
see :mod:`differential.variants.tree`), and :func:`run_gate` runs a corpus and
a bounded campaign on both (:func:`fuzz.diff.run_pair`), sorts what differs
(:func:`differential.reports.gate.gate_items`) and writes one reproducer per
group into the output folder. Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis.database import ExampleDatabase

from differential.compare import ScenarioResult
from differential.corpus import write_atomic
from differential.errors import VariantError
from differential.findings import Policy
from differential.reports.gate import (
    BASE,
    HEAD,
    GateItem,
    GateReport,
    Reproducer,
    Section,
    gate_items,
    shared_tags,
)
from differential.scenario import Scenario
from differential.variants import Variant, VariantRole
from differential.variants.tree import resolve_commit, resolve_tree
from fuzz.campaign import finding_document
from fuzz.diff import Progress, run_pair
from fuzz.signature import signature_of

__all__ = ["DEFAULT_BRANCHES", "GateRun", "GateTrees", "gate_trees", "gate_variants", "run_gate"]

DEFAULT_BRANCHES = ("origin/HEAD", "main", "master")
"""Where the default base's merge base is taken from: the first that resolves."""


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
    )


@dataclass(frozen=True)
class GateTrees:
    """The two sides of a pull request in one git repository.

    Attributes:
        repo: the repository's top folder (it holds the ``vllm`` package).
        base: the base's full commit id.
        base_why: how the base was chosen (``--base main``, ``the merge
            base with origin/HEAD``).
        head: the head's full commit id (for the working tree: ``HEAD``'s).
        head_ref: ``--head REF``, or ``None`` for the working tree.
        dirty: the working tree has changes ``HEAD`` does not (head
            ``None`` only).
    """

    repo: Path
    base: str
    base_why: str
    head: str
    head_ref: str | None = None
    dirty: bool = False

    def describe_base(self) -> str:
        """``1a2b3c4d5e6f (the merge base with main)``."""
        return f"{self.base[:12]} ({self.base_why})"

    def describe_head(self) -> str:
        """``the working tree of /repo (HEAD 1a2b3c4d5e6f + uncommitted changes)``."""
        if self.head_ref is not None:
            return f"{self.head[:12]} (--head {self.head_ref})"
        changes = " + uncommitted changes" if self.dirty else ""
        return f"the working tree of {self.repo} (HEAD {self.head[:12]}{changes})"

    def variant_spec(self, side: str) -> str:
        """The ``--variants`` name that runs ``side`` (``base``/``head``) in
        other kvfuzz commands: ``tree:REPO@COMMIT``, or ``tree:REPO`` for a
        working tree."""
        if side == HEAD and self.head_ref is None:
            return f"tree:{self.repo}"
        return f"tree:{self.repo}@{self.base if side == BASE else self.head}"


def gate_trees(path: Path, base: str | None = None, head: str | None = None) -> GateTrees:
    """Read the base and head of the git repository at ``path``.

    Args:
        path: a vLLM checkout (its top folder holds the ``vllm`` package).
        base: the base ref; default: the merge base of the head with the
            first of :data:`DEFAULT_BRANCHES` that resolves.
        head: the head ref; default: the working tree (uncommitted changes
            included).

    Raises:
        VariantError: ``path`` is not a git repository's top folder, holds
            no ``vllm`` package, or a ref does not resolve (bad input: exit 2).
    """
    top = _git(path, "rev-parse", "--show-toplevel")
    if not path.is_dir() or top.returncode != 0:
        raise VariantError(
            f"PATH = {str(path)!r} is invalid: allowed the top folder of a vLLM git checkout "
            "(git rev-parse finds no repository there)"
        )
    repo = Path(top.stdout.strip()).resolve()
    if repo != path.resolve():
        raise VariantError(
            f"PATH = {str(path)!r} is invalid: allowed the top folder of a vLLM git checkout "
            f"({repo}, which holds the vllm package)"
        )
    if not (repo / "vllm" / "__init__.py").is_file():
        raise VariantError(
            f"PATH = {str(path)!r} is invalid: allowed a vLLM git checkout (no "
            "vllm/__init__.py there)"
        )
    head_commit = _resolve(repo, head or "HEAD", "--head")
    if base is not None:
        return GateTrees(
            repo, _resolve(repo, base, "--base"), f"--base {base}", head_commit, head,
            _dirty(repo, head),
        )  # fmt: skip
    for branch in DEFAULT_BRANCHES:
        if resolve_commit(repo, branch) is None:
            continue
        merge_base = _git(repo, "merge-base", branch, head_commit)
        if merge_base.returncode == 0 and merge_base.stdout.strip():
            why = f"the merge base with {branch}"
            base_commit = merge_base.stdout.strip()
            return GateTrees(repo, base_commit, why, head_commit, head, _dirty(repo, head))
    raise VariantError(
        "--base is needed: the repository has none of "
        f"{', '.join(DEFAULT_BRANCHES)} sharing history with the head; allowed: --base REF "
        "(a branch, tag or commit)"
    )


def _resolve(repo: Path, ref: str, option: str) -> str:
    commit = resolve_commit(repo, ref)
    if commit is None:
        raise VariantError(
            f"{option} = {ref!r} is invalid: allowed a ref of {repo} that names a commit "
            "(a branch, tag or commit id)"
        )
    return commit


def _dirty(repo: Path, head: str | None) -> bool:
    if head is not None:
        return False
    status = _git(repo, "status", "--porcelain", "--untracked-files=no", "--", "vllm")
    return bool(status.stdout.strip())


def gate_variants(trees: GateTrees, *, timeout_s: float = 60.0) -> tuple[Variant, Variant]:
    """The base and the head as tree variants named ``base`` and ``head``.

    The base (and a ``--head REF``) is checked out into
    ``REPO/.kvfuzz-worktrees/gate-base`` (``gate-head``), one worktree each,
    moved to the commit every run; the working tree runs as it is.

    Raises:
        VariantError: git cannot check a commit out.
    """
    repo = trees.repo
    base_tree = resolve_tree(f"{repo}@{trees.base}", folder="gate-base")
    head_tree = (
        repo if trees.head_ref is None else resolve_tree(f"{repo}@{trees.head}", folder="gate-head")
    )
    return (
        Variant(
            BASE,
            f"the base, {trees.describe_base()}",
            VariantRole.BASELINE,
            tree=str(base_tree),
            timeout_s=timeout_s,
        ),
        Variant(
            HEAD,
            f"the head, {trees.describe_head()}",
            VariantRole.BASELINE,
            tree=str(head_tree),
            timeout_s=timeout_s,
        ),
    )


@dataclass
class GateRun:
    """A gate's report and what the CI reports are written from.

    Attributes:
        report: the review.
        head_results: the head's side of every scenario where it has a
            finding (one variant each, ``source`` = the scenario's label).
        on_base: label -> the head's findings (``kind@request``) the base
            has too.
    """

    report: GateReport
    head_results: list[ScenarioResult] = field(default_factory=list)
    on_base: dict[str, frozenset[str]] = field(default_factory=dict)


def run_gate(
    trees: GateTrees,
    variants: tuple[Variant, Variant],
    corpus: Sequence[tuple[str, Scenario]],
    out: Path,
    *,
    seconds: float,
    max_examples: int | None = None,
    seed: int = 1,
    policy: Policy = Policy.VLLM,
    progress: Progress | None = None,
    database: ExampleDatabase | None = None,
) -> GateRun:
    """Run the corpus and a bounded campaign on the base and the head, sort
    what differs and write each group's reproducer under ``out``.

    Args:
        trees: the two sides (for the report and the reproducers' commands).
        variants: :func:`gate_variants` of ``trees``.
        corpus: (label, scenario) pairs to replay.
        out: the output folder (reproducers in ``out/new``, ``out/resolved``,
            ... ; earlier runs' reproducers there are removed first).
        seconds: the campaign's budget, in seconds (0: no campaign).
        max_examples: also stop the campaign after this many inputs.
        seed: the campaign's seed.
        policy: the oracle's checkpoint policy.
        progress: called with each progress line.
        database: Hypothesis's example database (see :func:`fuzz.diff.run_pair`).

    Raises:
        InternalError: kvfuzz failed (its driver in a worker, a file not written).
    """
    started = time.perf_counter()
    run = GateRun(
        GateReport(trees.describe_base(), trees.describe_head(), {}, 0, 0, seconds, seed, ())
    )
    items: list[GateItem] = []
    examples: dict[tuple[Section, str], tuple[ScenarioResult, GateItem]] = {}

    def collect(label: str, result: ScenarioResult) -> None:
        for vr in result.results:
            if vr.run.vllm_version:
                run.report.versions.setdefault(vr.variant.name, vr.run.vllm_version)
        found = gate_items(result, label)
        items.extend(found)
        for item in found:
            examples.setdefault((item.section, item.cause), (result, item))
        head = result.results[1]
        if head.findings:
            run.head_results.append(
                dataclasses.replace(
                    result, results=(head,), comparison_findings=(), costs=(), source=label
                )
            )
            run.on_base[label] = shared_tags(found)

    runs = run_pair(
        variants,
        corpus,
        collect,
        seconds=seconds,
        max_examples=max_examples,
        seed=seed,
        policy=policy,
        progress=progress,
        database=database,
    )
    report = dataclasses.replace(
        run.report,
        corpus_scenarios=runs.corpus_scenarios,
        generated_scenarios=runs.generated,
        items=tuple(items),
        not_started=runs.not_started,
        rejected=tuple(runs.rejected),
    )
    report.reproducers = _write_reproducers(trees, report, examples, out)
    report.elapsed_s = time.perf_counter() - started
    run.report = report
    return run


_FOLDERS = {section: section.value for section in Section}


def _write_reproducers(
    trees: GateTrees,
    report: GateReport,
    examples: dict[tuple[Section, str], tuple[ScenarioResult, GateItem]],
    out: Path,
) -> dict[tuple[Section, str], Reproducer]:
    """One scenario file per group (its first example) in ``out/SECTION/``,
    named ``NN-KIND.json``; earlier runs' files of that form are removed."""
    for folder in _FOLDERS.values():
        for stale in sorted((out / folder).glob("[0-9][0-9]-*.json")):
            stale.unlink(missing_ok=True)
    written: dict[tuple[Section, str], Reproducer] = {}
    numbers: dict[Section, int] = {}
    for section, cause, _items in report.groups():
        result, item = examples[(section, cause)]
        numbers[section] = numbers.get(section, 0) + 1
        kind = item.finding.kind.value if item.finding is not None else section.value
        path = out / _FOLDERS[section] / f"{numbers[section]:02d}-{kind}.json"
        write_atomic(path, json.dumps(_document(result, item), indent=2) + "\n")
        written[(section, cause)] = Reproducer(str(path), _command(trees, path, item))
    return written


def _document(result: ScenarioResult, item: GateItem) -> dict[str, Any]:
    """The reproducer's content: a finding file for a finding, else the
    scenario with both sides' hits as its ``expect`` block."""
    scenario = result.scenario
    if item.finding is not None:
        version = next(
            (vr.run.vllm_version for vr in result.results if vr.variant.name == item.side), ""
        )
        document = finding_document(
            scenario,
            result,
            signature_of(scenario, item.finding),
            seed=None,
            example=None,
            vllm_version=version,
        )
    else:
        document = scenario.to_dict()
        document["expect"] = {"hits": {vr.variant.name: list(vr.run.hits) for vr in result.results}}
    document["notes"] = f"kvfuzz gate, {item.section.value}: {item.scenario}: {item.cause}"
    return document


def _command(trees: GateTrees, path: Path, item: GateItem) -> str:
    """The command a reviewer runs on a reproducer: the exported test of
    the side that has the finding, else a replay on both sides."""
    if item.finding is not None:
        return f"kvfuzz export-test {path} --variants {trees.variant_spec(item.side)}"
    return f"kvfuzz replay {path} --variants {trees.variant_spec(BASE)},{trees.variant_spec(HEAD)}"

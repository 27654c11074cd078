"""``kvfuzz diff A B``'s runs: a corpus and a bounded campaign on two variants.

Runs every scenario of a corpus and a bounded campaign (the fuzz generator,
:func:`fuzz.strategies.scenarios`, driven by bytes from ``random.Random(seed)``
as in ``kvfuzz fuzz``) on both variants, each judged by the oracle, and
collects what differs (:func:`differential.reports.diff.changes_of`) into a
:class:`~differential.reports.diff.DiffReport`. Both variants take part as
baselines (neither is labelled fixed). Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterable, Sequence

from differential.compare import ScenarioResult, compare_variants
from differential.findings import Policy
from differential.reports.diff import Change, DiffReport, changes_of
from differential.scenario import Scenario
from differential.variants import Variant, VariantRole
from fuzz.target import build_target

__all__ = ["run_diff"]

_BUFFER_SIZES = (512, 2048, 8192)


def run_diff(
    a: Variant,
    b: Variant,
    corpus: Iterable[tuple[str, Scenario]],
    *,
    seconds: float = 0.0,
    max_examples: int | None = None,
    seed: int = 1,
    policy: Policy = Policy.VLLM,
    on_scenario: Callable[[str], None] | None = None,
) -> DiffReport:
    """Run the corpus and a bounded campaign on ``a`` and ``b`` and collect what differs.

    Args:
        a, b: the variants ("before" and "after").
        corpus: (label, scenario) pairs to replay.
        seconds: wall-time budget of the campaign, in seconds (0: no campaign
            unless ``max_examples`` is given).
        max_examples: the campaign's number of generated inputs, if bounded so.
        seed: the campaign's seed (same seed and versions: same scenarios).
        policy: the oracle's checkpoint policy.
        on_scenario: called with each scenario's label before it runs (progress).

    Raises:
        InternalError: kvfuzz failed (e.g. a tree's worker could not start).
    """
    pair = tuple(dataclasses.replace(v, role=VariantRole.BASELINE) for v in (a, b))
    changes: list[Change] = []
    versions: dict[str, str] = {}

    def collect(label: str, result: ScenarioResult) -> None:
        for vr in result.results:
            if vr.run.vllm_version:
                versions.setdefault(vr.variant.name, vr.run.vllm_version)
        changes.extend(changes_of(result, label))

    count = 0
    for label, scenario in corpus:
        if on_scenario is not None:
            on_scenario(label)
        collect(label, compare_variants(scenario, pair, policy=policy, dense_cross_check=False))
        count += 1
    generated = 0
    if seconds > 0 or max_examples is not None:
        generated = _campaign(pair, collect, seconds, max_examples, seed, policy, on_scenario)
    return DiffReport(a.name, b.name, versions, count, generated, seed, tuple(changes))


def _campaign(
    pair: Sequence[Variant],
    collect: Callable[[str, ScenarioResult], None],
    seconds: float,
    max_examples: int | None,
    seed: int,
    policy: Policy,
    on_scenario: Callable[[str], None] | None,
) -> int:
    generated = [0]

    def on_result(scenario: Scenario, result: ScenarioResult) -> None:
        generated[0] += 1
        label = f"generated #{generated[0]}"
        if on_scenario is not None:
            on_scenario(label)
        collect(label, result)

    target = build_target(
        pair, policy=policy, on_result=on_result, dense_cross_check=False, raise_on_finding=False
    )
    rng = random.Random(seed)
    started = time.perf_counter()
    examples = 0
    while True:
        if max_examples is not None and examples >= max_examples:
            break
        if seconds > 0 and time.perf_counter() - started >= seconds:
            break
        target.hypothesis.fuzz_one_input(rng.randbytes(rng.choice(_BUFFER_SIZES)))
        examples += 1
    return generated[0]

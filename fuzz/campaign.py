"""``kvfuzz fuzz``: a reproducible campaign over the whole scenario space.

The campaign drives the fuzz target (:mod:`fuzz.target`) through Hypothesis's
``fuzz_one_input`` with bytes from ``random.Random(seed)``: the same seed and
versions give the same scenarios and the same findings, byte for byte.

Output folder layout::

    OUT/findings/<slug>.json   one file per distinct signature, written once,
                               atomically: the scenario, an ``expect`` block
                               (so ``kvfuzz replay`` and the corpus replay
                               reproduce it) and the verdicts
    OUT/hypothesis-db/         Hypothesis's example database: a rerun into
                               the same folder replays earlier failures first
    OUT/summary.json           counts per signature, executions per second,
                               time to the first finding (rewritten atomically)

Ctrl-C stops after the current scenario and keeps everything found so far.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import Phase
from hypothesis.database import DirectoryBasedExampleDatabase

from differential.compare import ScenarioResult
from differential.corpus import finding_tag, write_atomic, write_once
from differential.findings import Policy
from differential.scenario import GroupKind, Scenario
from differential.variants import Variant
from fuzz.progress import CampaignStats, Progress
from fuzz.signature import Signature, coverage_keys, signature_of
from fuzz.target import FindingRaised, build_target

__all__ = ["Campaign", "CampaignConfig", "FindingRecord", "finding_document"]

FINDING_FORMAT = "kvfuzz.finding"
FINDING_VERSION = 1
_BUFFER_SIZES = (512, 2048, 8192)


@dataclass(frozen=True)
class CampaignConfig:
    """What a campaign runs.

    Attributes:
        out: the output folder.
        variants: the variants every scenario runs on.
        seed: the seed of the input bytes.
        seconds: wall-time budget in seconds (``None``: no limit).
        max_examples: example budget (``None``: no limit).
        policy: the oracle's checkpoint policy.
        dense_cross_check: run the dense-retention cross-check too.
        summary_name: the summary's file name in ``out`` (parallel jobs each
            write their own and the parent merges them).
        summary_interval_s: seconds between summary rewrites while running.
        replay_database: replay the example database before fuzzing; ``None``
            decides by whether it holds entries when the campaign starts.
        group_kinds: KV cache group kinds every scenario contains
            (``--groups``; empty: any layout).
    """

    out: Path
    variants: tuple[Variant, ...]
    seed: int
    seconds: float | None = 60.0
    max_examples: int | None = None
    policy: Policy = Policy.VLLM
    dense_cross_check: bool = True
    summary_name: str = "summary.json"
    summary_interval_s: float = 10.0
    replay_database: bool | None = None
    group_kinds: frozenset[GroupKind] = frozenset()


@dataclass
class FindingRecord:
    """One distinct signature seen by the campaign.

    Attributes:
        signature: the signature.
        path: its finding file.
        first_example: index of the example that first showed it.
        first_seen_s: seconds from the campaign start to that example.
        count: how many findings had it, duplicates included.
    """

    signature: Signature
    path: Path
    first_example: int
    first_seen_s: float
    count: int = 1


def finding_document(
    scenario: Scenario,
    result: ScenarioResult,
    signature: Signature,
    *,
    seed: int | None,
    example: int | None,
    vllm_version: str,
) -> dict[str, Any]:
    """A self-contained, replayable finding: the scenario plus its verdicts."""
    document = scenario.to_dict()
    document["expect"] = {
        "hits": {vr.variant.name: list(vr.run.hits) for vr in result.results},
        "findings": {
            vr.variant.name: sorted(
                finding_tag(f) for f in result.findings if f.owner == vr.variant.name
            )
            for vr in result.results
        },
    }
    document["finding"] = {
        "format": FINDING_FORMAT,
        "version": FINDING_VERSION,
        "signature": signature.text,
        "signature_fields": {
            "kind": signature.kind,
            "variant": signature.variant,
            "drafter": signature.drafter,
            "retention": signature.retention,
            "position": signature.position,
            "known_issue": signature.known_issue,
        },
        "policy": result.policy.value,
        "vllm_version": vllm_version,
        "vllm_versions": {vr.variant.name: vr.run.vllm_version for vr in result.results},
        "seed": seed,
        "example": example,
        "findings": [f.to_dict() for f in result.findings],
    }
    return document


@dataclass
class Campaign:
    """A running campaign; :meth:`run` does the work."""

    config: CampaignConfig
    stats: CampaignStats = field(default_factory=CampaignStats)
    records: dict[Signature, FindingRecord] = field(default_factory=dict)
    interrupted: bool = False
    _progress: Progress | None = None
    _example: int = 0
    _vllm_version: str = ""
    _last_summary_s: float = 0.0

    @property
    def findings_dir(self) -> Path:
        """``OUT/findings``."""
        return self.config.out / "findings"

    def _on_result(self, scenario: Scenario, result: ScenarioResult) -> None:
        self.stats.examples += 1
        self.stats.coverage.update(coverage_keys(scenario))
        for finding in result.findings:
            self.stats.findings_by_kind[finding.kind.value] += 1
            signature = signature_of(scenario, finding)
            record = self.records.get(signature)
            if record is not None:
                record.count += 1
                continue
            if self.stats.first_finding_s is None:
                self.stats.first_finding_s = self.stats.elapsed_s
            path = self.findings_dir / f"{signature.slug}.json"
            # Kept if an earlier run (or another job of this one) wrote it first.
            document = finding_document(
                scenario,
                result,
                signature,
                seed=self.config.seed,
                example=self._example,
                vllm_version=self._vllm_version,
            )
            write_once(path, json.dumps(document, indent=2) + "\n")
            self.records[signature] = FindingRecord(
                signature, path, self._example, self.stats.elapsed_s
            )
            self.stats.distinct = len(self.records)
            if self._progress is not None:
                self._progress.note(f"new finding [{self._example}]: {signature.text} -> {path}")
        if self._progress is not None:
            self._progress.tick()
        if self.stats.elapsed_s - self._last_summary_s >= self.config.summary_interval_s:
            self._write_summary()  # a killed campaign still leaves its counts
            self._last_summary_s = self.stats.elapsed_s

    def summary(self) -> dict[str, Any]:
        """The campaign summary (also written to ``OUT/summary.json``)."""
        stats = self.stats
        return {
            "format": "kvfuzz.campaign",
            "version": 1,
            "seed": self.config.seed,
            "variants": [v.name for v in self.config.variants],
            "policy": self.config.policy.value,
            "vllm_version": self._vllm_version,
            "examples": stats.examples,
            "elapsed_s": round(stats.elapsed_s, 3),
            "executions_per_s": round(stats.executions_per_s, 2),
            "first_finding_s": None
            if stats.first_finding_s is None
            else round(stats.first_finding_s, 3),
            "interrupted": self.interrupted,
            "findings_by_kind": dict(sorted(stats.findings_by_kind.items())),
            "coverage": dict(sorted(stats.coverage.items())),
            "distinct": [
                {
                    "signature": r.signature.text,
                    "file": str(r.path),
                    "first_example": r.first_example,
                    "first_seen_s": round(r.first_seen_s, 3),
                    "count": r.count,
                }
                for r in sorted(self.records.values(), key=lambda r: r.first_example)
            ],
        }

    def _write_summary(self) -> None:
        write_atomic(
            self.config.out / self.config.summary_name,
            json.dumps(self.summary(), indent=2) + "\n",
        )

    def _replay_database(self, database: DirectoryBasedExampleDatabase) -> None:
        replay = build_target(
            self.config.variants,
            policy=self.config.policy,
            on_result=self._on_result,
            database=database,
            dense_cross_check=self.config.dense_cross_check,
            phases=[Phase.reuse],
            kinds=self.config.group_kinds,
        )
        with contextlib.suppress(FindingRaised, BaseExceptionGroup):
            replay()

    def run(self, progress: Progress | None = None) -> dict[str, Any]:
        """Run until the time or example budget is spent, or Ctrl-C.

        Returns:
            The summary (see :meth:`summary`).
        """
        from differential.driver import VLLM_VERSION

        self._vllm_version = VLLM_VERSION
        self._progress = progress
        config = self.config
        config.out.mkdir(parents=True, exist_ok=True)
        database = DirectoryBasedExampleDatabase(config.out / "hypothesis-db")
        self.stats.started = time.perf_counter()
        try:
            db_path = config.out / "hypothesis-db"
            replay = config.replay_database
            if replay is None:
                replay = db_path.is_dir() and any(db_path.iterdir())
            if replay:
                if progress is not None:
                    progress.note("replaying earlier failures from the example database first")
                self._example = -1
                self._replay_database(database)
            target = build_target(
                config.variants,
                policy=config.policy,
                on_result=self._on_result,
                database=database,
                dense_cross_check=config.dense_cross_check,
                kinds=config.group_kinds,
            )
            rng = random.Random(config.seed)
            self._example = 0
            while True:
                if config.max_examples is not None and self._example >= config.max_examples:
                    break
                if config.seconds is not None and self.stats.elapsed_s >= config.seconds:
                    break
                buffer = rng.randbytes(rng.choice(_BUFFER_SIZES))
                with contextlib.suppress(FindingRaised):
                    target.hypothesis.fuzz_one_input(buffer)
                self._example += 1
        except KeyboardInterrupt:
            self.interrupted = True
        finally:
            self._write_summary()
            if progress is not None:
                progress.tick(force=True)
        return self.summary()


def run_campaign(config: CampaignConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Import vLLM, then run a campaign with the default progress display.

    The clock (time budget, time to first finding) starts after the import.
    """
    import differential.driver  # noqa: F401  (import vLLM before the clock starts)

    campaign = Campaign(config)
    if quiet:
        return campaign.run()
    with Progress(campaign.stats) as progress:
        return campaign.run(progress)

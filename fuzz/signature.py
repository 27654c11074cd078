"""Finding signatures: one identity per structural cause, for deduplication.

A signature is the finding kind plus what caused it structurally: the
variant, the drafter class, the retention class and where the divergence
point sits relative to the checkpoint. A finding a known vLLM issue explains
(:mod:`differential.oracle.known`) has one signature per issue, kind and variant.
Two findings with the same signature are duplicates.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from differential.findings import Finding
from differential.oracle import drafter_model
from differential.scenario import ConnectorLoad, DrafterKind, DriveMode, KVEvents, Scenario
from differential.variants import file_label

__all__ = ["Signature", "coverage_keys", "signature_of"]

_DRAFTER_CLASS = {
    DrafterKind.EAGLE: "eagle",
    DrafterKind.EAGLE3: "eagle",
    DrafterKind.MTP: "eagle",
    DrafterKind.MULTI_MODULE_MTP: "multi-module-mtp",
    DrafterKind.GEMMA4_MTP: "gemma4-mtp",
    DrafterKind.DFLASH: "target-state-drafter",
    DrafterKind.DSPARK: "target-state-drafter",
    DrafterKind.DRAFT_MODEL: "draft-model",
    DrafterKind.NGRAM: "ngram",
    DrafterKind.NONE: "none",
}


@dataclass(frozen=True, order=True)
class Signature:
    """The deduplication identity of a finding.

    Attributes:
        kind: the finding kind.
        variant: the variant (or ``"a vs b"`` pair).
        drafter: drafter class and protection, e.g. ``"eagle/drop"``.
        retention: ``dense``, ``zero``, ``alignment`` or ``sparse``.
        position: where the divergence point sits relative to the nearest
            checkpoint at or below it, e.g. ``"<=A after checkpoint"``.
        known_issue: the known vLLM issue that explains it, or ``""``.
    """

    kind: str
    variant: str
    drafter: str
    retention: str
    position: str
    known_issue: str = ""

    @property
    def text(self) -> str:
        """The signature as one line."""
        parts = [self.kind, self.variant, self.drafter, self.retention, self.position]
        if self.known_issue:
            parts.append(f"known:{self.known_issue}")
        return " | ".join(parts)

    @property
    def slug(self) -> str:
        """A file-name-safe, stable name: readable prefix plus a short hash."""
        label = file_label(self.variant)
        readable = re.sub(r"[^a-z0-9]+", "-", f"{self.kind} {label}".lower())[:80].strip("-")
        digest = hashlib.sha256(self.text.encode()).hexdigest()[:10]
        return f"{readable}-{digest}"


def _retention_class(scenario: Scenario) -> str:
    retention = scenario.retention_interval_tokens
    if retention is None:
        return "dense"
    if retention == 0:
        return "zero"
    if retention == scenario.effective_hit_alignment_tokens:
        return "alignment"
    return "sparse"


def _position(scenario: Scenario, divergence: int | None) -> str:
    if divergence is None:
        return "run"
    alignment = scenario.effective_hit_alignment_tokens
    retention = scenario.retention_interval_tokens
    period = retention if retention else alignment
    if divergence < period:
        return "before first checkpoint"
    offset = divergence % period
    if offset == 0:
        return "on checkpoint"
    if offset <= alignment:
        return "<=A after checkpoint"
    if period - offset <= alignment:
        return "<=A before checkpoint"
    return "between checkpoints"


def signature_of(scenario: Scenario, finding: Finding) -> Signature:
    """The signature of ``finding``, found on ``scenario``."""
    if finding.known_issue:
        # An explained finding: one identity per issue, kind and variant.
        return Signature(finding.kind.value, finding.variant, "*", "*", "*", finding.known_issue)
    model = drafter_model(scenario)
    protection = "drop" if model.drop else ("lookahead" if model.hash_lookahead_tokens else "none")
    return Signature(
        kind=finding.kind.value,
        variant=finding.variant,
        drafter=f"{_DRAFTER_CLASS[scenario.drafter.kind]}/{protection}",
        retention=_retention_class(scenario),
        position=_position(scenario, finding.divergence_tokens),
        known_issue=finding.known_issue or "",
    )


def _geometry_class(scenario: Scenario) -> str:
    largest = max(g.block_size_tokens for g in scenario.kv_cache_groups)
    longest = max(r.prompt_tokens for r in scenario.requests)
    if largest <= 8 and longest <= 1024:
        return "toy"
    if longest <= 4096:
        return "medium"
    return "real"


def coverage_keys(scenario: Scenario) -> tuple[str, ...]:
    """The scenario-space classes a scenario covers, as ``class:value`` keys
    (``group-mix``: :attr:`Scenario.group_mix`; ``draft-groups``: whether the
    EAGLE drop is annotated, falls back to every group, or never applies,
    :attr:`Scenario.draft_groups`; ``connector-store``: :func:`_store_class`;
    with KV cache events on, ``kv-events-view``: ``per-copy`` or ``router``;
    in scheduler mode only, ``scheduling``: ``async`` under
    ``workload.async_scheduling``, else ``sync``)."""
    model = drafter_model(scenario)
    protection = "drop" if model.drop else ("lookahead" if model.hash_lookahead_tokens else "none")
    keys: tuple[str, ...] = (
        f"drafter:{scenario.drafter.kind.value}",
        f"protection:{protection}",
        f"retention:{_retention_class(scenario)}",
        f"geometry:{_geometry_class(scenario)}",
        f"swa-groups:{len(scenario.sliding_window_groups)}",
        f"group-mix:{scenario.group_mix}",
        f"draft-groups:{scenario.draft_groups.value}",
        f"connector-store:{_store_class(scenario)}",
    )
    workload = scenario.workload
    if workload.kv_events is not KVEvents.OFF:
        keys = (*keys, f"kv-events-view:{workload.kv_events_view.value}")
    if workload.mode is not DriveMode.SCHEDULER:
        return keys
    return (*keys, f"scheduling:{'async' if workload.async_scheduling else 'sync'}")


def _store_class(scenario: Scenario) -> str:
    """A KV connector's remote store (``workload.connector``): ``none``,
    ``unbounded`` or ``bounded`` (a capacity, in chunks), ``+grid`` when it
    keeps its own chunk grid (``chunk_tokens``), ``+disagg`` when a prefill
    instance feeds it (``kv_role`` ``kv_consumer``), ``+disagg+sync`` when
    that decode instance loads synchronously."""
    store = scenario.workload.connector
    if store is None:
        return "none"
    kind = "bounded" if store.bounded else "unbounded"
    kind += "+grid" if store.chunk_tokens is not None else ""
    if not store.disaggregated:
        return kind
    return kind + ("+disagg+sync" if store.load is ConnectorLoad.SYNC else "+disagg")

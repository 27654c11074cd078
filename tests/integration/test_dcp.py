"""Decode context parallelism on vLLM 0.33.0's real managers and Scheduler.

A scenario's ``dcp_world_size`` reaches ``KVCacheManager`` as vLLM's engine
hands it over (``Scheduler.__init__`` from ``ParallelConfig``), with the
per-rank spec blocks and the block sizes vLLM's ``resolve_kv_cache_block_sizes``
resolves; hits land on the sharded block; exported tests rebuild the same
manager and pass on stock.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.kv_cache_manager import KVCacheManager

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.exports.manager_test import export_test
from differential.exports.scheduler_test import export_engine_test
from differential.findings import Finding, FindingKind
from differential.variants import parse_variants
from tests.factories import CORPORA, python_module

pytestmark = pytest.mark.vllm

CASES = CORPORA / "cases"


@pytest.fixture
def managers_built(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Each ``KVCacheManager`` built: its DCP size, block sizes and per-group
    (manager block, spec block), read after vLLM built it."""
    built: list[dict[str, Any]] = []
    real = KVCacheManager.__init__

    @functools.wraps(real)  # the driver reads the constructor's parameters
    def init(self: KVCacheManager, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        built.append(
            {
                "dcp": kwargs.get("dcp_world_size", 1),
                "scheduler_block": kwargs["scheduler_block_size"],
                "hash_block": kwargs["hash_block_size"],
                "blocks": [
                    (m.block_size, m.kv_cache_spec.block_size)
                    for m in self.coordinator.single_type_managers
                ],
            }
        )

    monkeypatch.setattr(KVCacheManager, "__init__", init)
    return built


@pytest.mark.parametrize(
    "name",
    ["dcp8-mla-hits-at-sharded-block.json", "dcp8-mla-hits-at-sharded-block--scheduler.json"],
)
def test_mla_under_dcp8_hits_on_the_sharded_block(
    name: str, managers_built: list[dict[str, Any]]
) -> None:
    result = compare_variants(load_entry(CASES / name).scenario, parse_variants("unfixed"))
    assert result.results[0].run.hits == (0, 1536, 1536)
    assert result.findings == ()
    # Per-rank block 64, sharded 512, as EngineCore's resolver gives it.
    assert managers_built[0] == {
        "dcp": 8,
        "scheduler_block": 512,
        "hash_block": 512,
        "blocks": [(512, 64)],
    }


def test_mamba_hybrid_under_dcp4_keeps_the_state_block(
    managers_built: list[dict[str, Any]],
) -> None:
    entry = load_entry(CASES / "dcp4-mamba-prompt-shorter-than-a-block.json")
    result = compare_variants(entry.scenario, parse_variants("unfixed"))
    assert result.results[0].run.hits == (0, 32, 32)
    # Full attention sharded (16 per rank, 64 across), the Mamba state not.
    assert managers_built[0] == {
        "dcp": 4,
        "scheduler_block": 64,
        "hash_block": 16,
        "blocks": [(64, 16), (16, 16)],
    }


def _run_pytest(tmp_path: Path, source: str) -> str:
    path = tmp_path / "test_exported.py"
    path.write_text(source)
    done = python_module("pytest", "-q", "-p", "no:cacheprovider", str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:]
    return source


def test_exported_tests_build_the_dcp_manager_and_pass_on_stock(tmp_path: Path) -> None:
    # A hit assertion the stock run meets: the exports must rebuild the same
    # sharded manager (and Scheduler) to pass.
    entry = load_entry(CASES / "dcp4-mamba-prompt-shorter-than-a-block.json")
    result = compare_variants(entry.scenario, parse_variants("unfixed"))
    owed = result.results[0].references[1]
    finding = Finding(FindingKind.FALLBACK, "unfixed", 1, "", expected_tokens=32, hit_tokens=32)
    source = export_test(
        entry.scenario, finding, owed, signature="dcp", name="dcp-manager", fixed_hit_tokens=32
    )
    assert "dcp_world_size=4," in source
    assert "block_size=16," in source
    _run_pytest(tmp_path, source)
    scheduler = load_entry(CASES / "dcp8-mla-hits-at-sharded-block--scheduler.json").scenario
    # The pool the run used, as export-test fills it in (a null pool is sized by the driver).
    pool = compare_variants(scheduler, parse_variants("unfixed")).results[0].run.pool_blocks
    scheduler = dataclasses.replace(
        scheduler, workload=dataclasses.replace(scheduler.workload, pool_blocks=pool)
    )
    mode = Finding(FindingKind.MODE_MISMATCH, "unfixed", 2, "", expected_tokens=1536)
    source = export_engine_test(scheduler, mode, signature="dcp", name="dcp-scheduler")
    assert "config.parallel_config.decode_context_parallel_size = 8" in source
    _run_pytest(tmp_path, source)

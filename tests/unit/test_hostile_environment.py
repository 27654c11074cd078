"""Hostile sizes and environments checked without vLLM: sizes that cost
memory are bounded before anything is built, and what a killed run left in
the temporary folder is cleaned up by the next one."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from differential.errors import ScenarioError
from differential.models import ModelDescription
from differential.scenario import RequestSpec, Workload
from differential.variants.mutation import default_work_dir
from tests.factories import ROOT, triton


def test_only_the_shared_prefix_requests_copy_is_built() -> None:
    # 2**63 prefix tokens, 16384 of them copied: the prompts are the same as
    # with a prefix of exactly 16384 tokens.
    seed = triton()
    huge = dataclasses.replace(seed, shared_prefix_tokens=2**63)
    assert huge.prompts == seed.prompts
    assert {len(p) for p in huge.prompts} == {16384 + 64}


def test_a_model_layer_count_is_bounded() -> None:
    data = {"layers": [{"kind": "full_attention", "count": 4000}, {"kind": "full_attention"}]}
    assert ModelDescription.from_dict(data).num_layers == 4001
    data["layers"][1]["count"] = 97
    with pytest.raises(ScenarioError) as raised:
        ModelDescription.from_dict(data)
    assert str(raised.value) == (
        "model.layers[1].count = 97 is invalid: allowed at most 4096 layers in all "
        "(4000 before this entry)"
    )


def test_a_pool_must_hold_the_longest_request() -> None:
    # Blocks 32 (full attention) and 16 (SWA); longest prompt 16448 tokens:
    # 514 full-attention blocks, one SWA block, the null block = 516.
    seed = triton()
    assert dataclasses.replace(seed, workload=Workload(pool_blocks=516)).workload.pool_blocks
    with pytest.raises(ScenarioError) as raised:
        dataclasses.replace(seed, workload=Workload(pool_blocks=515))
    assert str(raised.value) == (
        "workload.pool_blocks = 515 is invalid: allowed null or at least 516 blocks (the "
        "null block, the longest prompt of 16448 tokens in each full-attention group's "
        "blocks, one block per other group)"
    )
    # A shorter prompt needs fewer.
    short = dataclasses.replace(seed, requests=(RequestSpec(64, 1),))
    assert dataclasses.replace(short, workload=Workload(pool_blocks=5)).workload.pool_blocks == 5


def test_a_mutant_farm_left_by_a_killed_run_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    stale = tmp_path / f"kvfuzz-mutants-{int(gone.stdout)}"
    (stale / "m0000").mkdir(parents=True)
    (stale / "m0000" / "vllm").symlink_to(ROOT)
    alive = tmp_path / "kvfuzz-mutants-1"  # pid 1 is alive
    alive.mkdir()
    work = default_work_dir()
    assert work.parent == tmp_path and not stale.exists() and alive.exists()

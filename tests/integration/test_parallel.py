"""``kvfuzz fuzz --jobs 2``: shared folder, one file per finding, merged counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from differential.variants import parse_variants
from fuzz.campaign import CampaignConfig
from fuzz.parallel import run_parallel, worker_configs

pytestmark = pytest.mark.vllm


def test_two_jobs_share_findings_without_duplicates(tmp_path: Path) -> None:
    config = CampaignConfig(
        out=tmp_path,
        variants=parse_variants("unfixed,fixed"),
        seed=3,
        seconds=None,
        max_examples=60,
        dense_cross_check=False,
    )
    assert [c.seed for c in worker_configs(config, 2)] == [3000, 3001]
    summary = run_parallel(config, 2, quiet=True)
    assert summary["jobs"] == 2 and summary["examples"] == 60
    files = sorted((tmp_path / "findings").glob("*.json"))
    assert len(files) == len(summary["distinct"])
    assert {Path(d["file"]).name for d in summary["distinct"]} == {f.name for f in files}
    per_job = [json.loads((tmp_path / f"summary-job-{i}.json").read_text()) for i in range(2)]
    for entry in summary["distinct"]:
        parts = [
            d["count"]
            for s in per_job
            for d in s["distinct"]
            if d["signature"] == entry["signature"]
        ]
        assert entry["count"] == sum(parts)
    assert any(d["signature"].startswith("fallback | unfixed") for d in summary["distinct"])

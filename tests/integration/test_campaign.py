"""``kvfuzz fuzz`` campaigns and the atheris harness, on real vLLM."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
from pathlib import Path

import pytest

from differential.variants import parse_variants
from fuzz.campaign import CampaignConfig, run_campaign
from fuzz.target import FindingRaised, build_target
from tests.factories import CORPORA, ROOT, kvfuzz_cli, python_module

pytestmark = pytest.mark.vllm


def _campaign(out: Path, seed: int, examples: int, variants: str = "unfixed,fixed") -> dict:
    return run_campaign(
        CampaignConfig(
            out=out,
            variants=parse_variants(variants),
            seed=seed,
            seconds=None,
            max_examples=examples,
            dense_cross_check=False,
        ),
        quiet=True,
    )


def test_cold_start_finds_the_fallback_and_reproduces_byte_for_byte(tmp_path: Path) -> None:
    first = _campaign(tmp_path / "a", seed=11, examples=40)
    signatures = [d["signature"] for d in first["distinct"]]
    # The seed class, in these 40 examples beside a drafter's group marked
    # is_eagle_group: on both variants, named as the seed fix's known limit.
    for variant in ("unfixed", "fixed"):
        assert (
            f"fallback | {variant} | * | * | * | known:seed-fix-limit-marked-draft-group"
            in signatures
        )
    second = _campaign(tmp_path / "b", seed=11, examples=40)
    files_a = sorted((tmp_path / "a" / "findings").iterdir())
    files_b = sorted((tmp_path / "b" / "findings").iterdir())
    assert [f.name for f in files_a] == [f.name for f in files_b]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(files_a, files_b, strict=True))
    assert [(d["signature"], d["count"]) for d in first["distinct"]] == [
        (d["signature"], d["count"]) for d in second["distinct"]
    ]


def test_finding_files_replay_with_the_same_verdict(tmp_path: Path) -> None:
    _campaign(tmp_path, seed=12, examples=30, variants="unfixed")
    finding = next((tmp_path / "findings").glob("fallback-unfixed-*.json"))
    proc = kvfuzz_cli("replay", str(finding), "--variants", "unfixed")
    assert proc.returncode == 1
    assert "fallback on unfixed" in proc.stdout
    document = json.loads(finding.read_text())
    assert document["finding"]["signature"].startswith("fallback | unfixed")
    assert document["finding"]["seed"] == 12


def test_rerun_replays_the_example_database_first(tmp_path: Path) -> None:
    _campaign(tmp_path, seed=13, examples=30, variants="unfixed")
    assert any((tmp_path / "hypothesis-db").rglob("*")), "no failure saved to the database"
    again = _campaign(tmp_path, seed=99, examples=1, variants="unfixed")
    # The one generated example cannot explain all findings: the replay did.
    assert again["examples"] > 1 and again["distinct"]


def _harness(*args: str) -> subprocess.CompletedProcess[str]:
    return python_module("fuzz.atheris_harness", *args, cwd=ROOT, timeout=300)


def test_atheris_harness_on_fixed_exits_cleanly(tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    proc = _harness(
        "--variants",
        "fixed",
        "--no-dense-check",
        str(corpus),
        str(CORPORA / "seeds"),
        "-runs=40",
        "-seed=1",
        f"-artifact_prefix={tmp_path}/",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not list(tmp_path.glob("crash-*"))


def _crashing_input(variants: str, limit: int = 200) -> bytes:
    """The first of 8192-byte inputs drawn from ``random.Random(0)``
    whose scenario has a finding on ``variants`` that no known issue explains.

    libFuzzer's own search is not reproducible across machines: it orders
    equal-sized corpus files as the folder lists them, and every later
    mutation follows from that order.
    """
    target = build_target(parse_variants(variants), dense_cross_check=False)
    rng = random.Random(0)
    for _ in range(limit):
        buffer = rng.randbytes(8192)
        try:
            target.hypothesis.fuzz_one_input(buffer)
        except FindingRaised:
            return buffer
    raise AssertionError(f"none of {limit} seeded inputs has a finding on {variants}")


def test_atheris_crash_on_unfixed_converts_to_a_fallback(tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    crashing = _crashing_input("unfixed")
    (seeds / "seed").write_bytes(crashing)
    proc = _harness(
        "--variants",
        "unfixed",
        "--no-dense-check",
        str(corpus),
        str(seeds),
        "-runs=200",
        "-seed=1",
        f"-artifact_prefix={tmp_path}/",
    )
    crashes = list(tmp_path.glob("crash-*"))
    assert crashes, proc.stderr[-2000:]
    # libFuzzer names the artefact by the input's SHA-1: the seed itself crashed.
    assert [c.name for c in crashes] == [f"crash-{hashlib.sha1(crashing).hexdigest()}"]
    assert crashes[0].read_bytes() == crashing
    out = tmp_path / "imported"
    converted = kvfuzz_cli(
        "import-crash", str(crashes[0]), "--variants", "unfixed", "--out", str(out)
    )
    assert converted.returncode == 1, converted.stderr
    (scenario_file,) = out.glob("*.json")
    replay = kvfuzz_cli("replay", str(scenario_file), "--variants", "unfixed")
    assert replay.returncode == 1
    assert "fallback on unfixed" in replay.stdout


def test_a_layout_finding_file_replays_with_every_expect_block_holding(tmp_path: Path) -> None:
    # An alignment-blowup belongs to the layout, not to a variant: the file a
    # campaign writes for it records it under expect.findings.layout, so
    # replaying the campaign's own output holds it to its expect block.
    from differential.compare import compare_variants
    from differential.corpus import load_entry
    from fuzz.campaign import finding_document
    from fuzz.signature import signature_of

    scenario = load_entry(ROOT / "known-issues/alignment-blowup-1536-3456.json").scenario
    result = compare_variants(scenario, parse_variants("unfixed,fixed"))
    (blowup,) = [f for f in result.findings if f.owner == "layout"]
    document = finding_document(
        scenario,
        result,
        signature_of(scenario, blowup),
        seed=7,
        example=0,
        vllm_version="0.33.0",
    )
    assert document["expect"]["findings"] == {
        "unfixed": [],
        "fixed": [],
        "layout": ["alignment-blowup@run"],
    }
    path = tmp_path / "alignment-blowup.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    proc = kvfuzz_cli("replay", str(path), "--variants", "unfixed,fixed")
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        "1 finding(s), as expected: each is recorded in its file's expect block "
        "(layout: 1, all known vLLM issues the fix does not cover (alignment-lcm-blowup))"
    )

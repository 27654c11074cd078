"""Release variants on real vLLM wheels: the earliest supported release runs, every
bundled scenario runs or is unsupported on 0.31.0 and 0.32.0 (the generated
``docs/release-support.md`` and the README say which), and ``kvfuzz diff``
shows what changed between 0.32.0 and the installed 0.33.0.

The wheels are fetched once (``pip download --no-deps``) into the release
cache (``KVFUZZ_RELEASE_CACHE``, default ``~/.cache/kvfuzz/releases``); when
neither the cache nor the package index has them, the tests are skipped with
the reason, unless ``KVFUZZ_REQUIRE_RELEASES=1`` (set by ``make test``), which
makes a release that cannot be fetched a failure.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import pytest

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.errors import VariantError
from differential.reports.diff import ChangeKind
from differential.reports.release_support import (
    DOC,
    RELEASES,
    SCENARIO_FOLDERS,
    ReleaseRun,
    Status,
    readme_claim,
    release_runs,
    render,
    replay_command,
    statuses,
)
from differential.variants import Variant, parse_variants
from differential.variants.tree import _WORKERS, shutdown_workers
from fuzz.diff import run_diff
from tests.factories import CORPORA, ROOT, kvfuzz_cli

pytestmark = pytest.mark.vllm

#: The earliest vLLM release kvfuzz supports (docs/variants.md: "Guarding across releases").
EARLIEST = "0.31.0"
PREVIOUS = "0.32.0"

SEEDS = CORPORA / "seeds"


def _release(version: str) -> Variant:
    """The release variant, its wheel fetched into the release cache once."""
    try:
        (variant,) = parse_variants(f"release:{version}", timeout_s=120.0)
    except VariantError as exc:
        reason = f"vLLM {version} is neither cached nor on the package index: {exc}"
        if os.environ.get("KVFUZZ_REQUIRE_RELEASES") == "1":
            pytest.fail(f"KVFUZZ_REQUIRE_RELEASES=1: {reason}")
        pytest.skip(reason)
    return variant


@pytest.fixture(scope="module", autouse=True)
def _workers() -> Iterator[None]:
    yield
    shutdown_workers()


def test_the_earliest_supported_release_runs_a_scenario() -> None:
    earliest = _release(EARLIEST)
    (unfixed,) = parse_variants("unfixed")
    scenario = load_entry(SEEDS / "toy-mtp1-swa4-fa8-r64.json").scenario
    result = compare_variants(scenario, (earliest, unfixed), dense_cross_check=False)
    old, new = result.results
    assert old.run.vllm_version == EARLIEST
    assert old.run.error is None and old.run.unsupported is None
    # The seed bug was already there: request 1 falls back from 248 to 192.
    assert old.run.hits == new.run.hits == (0, 192, 248, 248)
    assert [(f.kind.value, f.request) for f in old.findings] == [("fallback", 1)]
    # No lookahead hashes in 0.31.0: the drafter is protected by the drop alone.
    capabilities = _WORKERS[earliest.name].capabilities
    assert capabilities is not None
    assert not capabilities["lookahead_hashes"] and not capabilities["needs_eagle_block_drop"]
    assert capabilities["retention_interval"] and capabilities["prefill_lookahead_config"]
    assert old.run.settings is not None and old.run.settings.use_eagle_block_drop
    assert old.run.settings.num_hash_lookahead_tokens == 0


def test_diff_of_the_previous_release_against_the_installed_one() -> None:
    previous = _release(PREVIOUS)
    (unfixed,) = parse_variants("unfixed")
    corpus = [
        (name, load_entry(SEEDS / name).scenario)
        for name in (
            "dflash-swa16-fa32-r8192.json",
            "lookahead-hashes-mtp3-swa16-fa32-r8192.json",
            "kv-connector-mtp3-swa16-fa32-r8192.json",
        )
    ]
    report = run_diff(previous, unfixed, corpus)
    assert report.versions == {previous.name: PREVIOUS, "unfixed": "0.33.0"}
    groups = {(kind, cause): changes for kind, cause, changes in report.groups()}
    # 0.32.0 drops the last matched block for DFlash; 0.33.0 does not
    # (SpeculativeConfig.needs_eagle_block_drop): three siblings lose hits.
    dflash = groups[
        (
            ChangeKind.HITS,
            "EAGLE drop on release:0.32.0, no drop on unfixed: hits higher on "
            "unfixed; the oracle blames release:0.32.0 (fallback)",
        )
    ]
    assert [(c.scenario, c.request, c.drafter) for c in dflash] == [
        ("dflash-swa16-fa32-r8192.json", 1, "dflash"),
        ("dflash-swa16-fa32-r8192.json", 2, "dflash"),
        ("dflash-swa16-fa32-r8192.json", 3, "dflash"),
    ]
    assert dflash[0].detail.startswith("hits 8192 on release:0.32.0, 16384 on unfixed (tokens)")
    # Lookahead hashes (0.33.0) replace the drop: the same hits, and under
    # the one-unit rule both releases owe c - A and miss it (the #57610
    # class), so no hit or finding changes there.
    assert not any(
        c.scenario.startswith("lookahead-hashes")
        for (kind, _cause), changes in groups.items()
        if kind in (ChangeKind.HITS, ChangeKind.FINDINGS)
        for c in changes
    )
    # With a KV connector both releases drop (legacy hashes): the same hits.
    assert not any(
        c.scenario.startswith("kv-connector") and c.kind is not ChangeKind.COST
        for c in report.changes
    )
    assert not any(c.kind is ChangeKind.UNSUPPORTED for c in report.changes)


@pytest.fixture(scope="module")
def bundled_replays() -> list[ReleaseRun]:
    """``kvfuzz replay corpora known-issues --variants release:A,release:B,unfixed
    --json``, the generated table's one replay of its releases, through the
    command line."""
    for version in RELEASES:
        _release(version)  # fetched into the cache (or skipped) first
    done = kvfuzz_cli(*replay_command())
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return release_runs(done.returncode, json.loads(done.stdout))


def _bundled_files() -> list[str]:
    return sorted(
        p.relative_to(ROOT).as_posix()
        for folder in SCENARIO_FOLDERS
        for p in (ROOT / folder).rglob("*.json")
    )


def test_every_bundled_scenario_runs_or_is_unsupported_on_the_releases(
    bundled_replays: list[ReleaseRun],
) -> None:
    """One scenario, one cost: no scenario ends a release's replay, each is a
    row, and one the release cannot run says why, naming the vLLM file. A
    release may crash only where the installed vLLM crashes too: a known
    issue's reproducer the release shares (the padded-draft stall)."""
    for run in bundled_replays:
        table = statuses(run)
        assert sorted(table) == _bundled_files(), run.version
        scenarios = {s["source"]: s for s in run.report["scenarios"]}
        for source, (status, detail) in table.items():
            if status is Status.CRASH:
                (stock,) = [v for v in scenarios[source]["variants"] if v["name"] == "unfixed"]
                assert stock["run"]["error"] == detail, (run.version, source, detail)
                continue
            assert status in (Status.RUNS, Status.UNSUPPORTED), (run.version, source, detail)
            if status is Status.UNSUPPORTED:
                assert re.search(r"\(vllm/[\w/]+\.py", detail), (run.version, source, detail)
        for source, (status, _detail) in table.items():
            if status is Status.CRASH:
                continue
            (release,) = [
                v for v in scenarios[source]["variants"] if v["name"] == f"release:{run.version}"
            ]
            # A request vLLM failed before its admission (a failed KV load
            # under the fail policy, RunObservation.errored) has no lookup.
            observed = {r["index"] for r in release["run"]["requests"]}
            erred = {i for i, _ in release["run"].get("errored") or () if i not in observed}
            expected_requests = len(scenarios[source]["scenario"]["requests"]) - len(erred)
            ran = len(release["run"]["requests"])
            assert ran == (expected_requests if status is Status.RUNS else 0), source
    # Llama-4's chunked local attention needs lookahead hashes, which neither
    # release has: the drop its drafter falls back to is refused there.
    for run in bundled_replays:
        status, detail = statuses(run)["corpora/cases/llama4-chunked-local.json"]
        assert status is Status.UNSUPPORTED
        assert detail.startswith("lookahead block hashes: VllmConfig.num_hash_lookahead_tokens")
        assert "chunked_local_attention group taking the EAGLE block drop" in detail


def test_the_release_table_and_the_readme_claim_match_the_replays(
    bundled_replays: list[ReleaseRun],
) -> None:
    regenerate = "regenerate with: python -m differential.reports.release_support --write"
    assert (ROOT / DOC).read_text(encoding="utf-8") == render(bundled_replays), regenerate
    readme = " ".join(
        (ROOT / "docs" / "variants.md").read_text(encoding="utf-8").split()
    )  # the manual's page on releases states the claim
    assert readme_claim(bundled_replays) in readme, regenerate


def test_explain_says_why_a_release_draws_no_row() -> None:
    """``kvfuzz explain`` on a scenario the release cannot run: the other
    variant's picture, and one line saying why the release has none."""
    _release(PREVIOUS)
    done = kvfuzz_cli(
        "explain",
        str(CORPORA / "cases" / "llama4-chunked-local.json"),
        "--variants",
        f"release:{PREVIOUS},unfixed",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "unfixed g1 chunk16 ████··  hit 96; ok" in lines
    assert not any(line.startswith(f"release:{PREVIOUS} g") for line in lines)
    assert lines[-1].startswith(
        f"release:{PREVIOUS}: unsupported: lookahead block hashes: "
        "VllmConfig.num_hash_lookahead_tokens"
    )

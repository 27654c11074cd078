"""Release variants on real vLLM wheels: the earliest supported release runs, and
``kvfuzz diff`` shows what changed between 0.32.0 and the installed 0.33.0.

The wheels are fetched once (``pip download --no-deps``) into the release
cache (``KVFUZZ_RELEASE_CACHE``, default ``~/.cache/kvfuzz/releases``); when
neither the cache nor the package index has them, the tests are skipped with
the reason.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from differential.compare import compare_variants
from differential.corpus import load_entry
from differential.errors import VariantError
from differential.reports.diff import ChangeKind, run_diff
from differential.variants import Variant, parse_variants
from differential.variants.tree import _WORKERS, shutdown_workers
from tests.factories import CORPORA

pytestmark = pytest.mark.vllm

#: The earliest vLLM release kvfuzz supports (docs/variants.md: "Guarding across releases").
EARLIEST = "0.31.0"
PREVIOUS = "0.32.0"

SEEDS = CORPORA / "seeds"


def _release(version: str) -> Variant:
    try:
        (variant,) = parse_variants(f"release:{version}", timeout_s=120.0)
    except VariantError as exc:
        pytest.skip(f"vLLM {version} is neither cached nor on the package index: {exc}")
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

"""Release and tree variants without vLLM: names, the cache folder, short file labels,
what a scenario means on a release without lookahead hashes, ``kvfuzz diff`` usage errors."""

from __future__ import annotations

import dataclasses
import zipfile
from pathlib import Path

import pytest

from differential.capabilities import (
    DESCRIPTIONS,
    Feature,
    Unsupported,
    equivalent_scenario,
)
from differential.cli import main
from differential.corpus import load_entry
from differential.errors import VariantError
from differential.findings import Finding, FindingKind
from differential.observation import ManagerSettings, RequestObservation, RunObservation
from differential.scenario import Drafter, DrafterKind
from differential.variants import file_label, parse_variants
from differential.variants.releases import CACHE_ENV, cache_dir, release_tree
from fuzz.signature import signature_of
from tests.factories import CORPORA, triton


def test_release_versions_are_checked_before_anything_runs() -> None:
    for bad in ("latest", "0.32", "0.32.0; rm -rf /", "../0.32.0", ""):
        with pytest.raises(VariantError, match=r"allowed release:X\.Y\.Z"):
            release_tree(bad)


def test_cache_folder_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "releases"))
    assert cache_dir() == tmp_path / "releases"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kvfuzz" / "releases"


def test_a_pre_filled_cache_needs_no_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline use: a wheel in the cache folder is unpacked (no ``*.so``), nothing fetched."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    wheel = tmp_path / "vllm-9.8.7-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm/__init__.py", "__version__ = '9.8.7'\n")
        archive.writestr("vllm/v1/core/kv_cache_manager.py", "# manager\n")
        archive.writestr("vllm/_C.abi3.so", b"\x7fELF")
        archive.writestr("vllm-9.8.7.dist-info/METADATA", "Name: vllm\n")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/unreachable")
    tree = release_tree("9.8.7")
    assert tree == tmp_path / "9.8.7"
    assert (tree / "vllm" / "__init__.py").read_text() == "__version__ = '9.8.7'\n"
    assert (tree / "vllm" / "v1" / "core" / "kv_cache_manager.py").is_file()
    assert not (tree / "vllm" / "_C.abi3.so").exists()
    assert not (tree / "vllm-9.8.7.dist-info").exists()
    (variant,) = parse_variants("release:9.8.7", timeout_s=5.0)
    assert variant.name == "release:9.8.7" and variant.tree == str(tree)
    assert variant.timeout_s == 5.0
    with pytest.raises(VariantError, match=r"listed twice"):
        parse_variants("release:9.8.7,release:9.8.7")


def test_an_unreachable_release_names_the_cache_to_fill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/unreachable")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    with pytest.raises(VariantError) as caught:
        release_tree("0.0.99")
    message = str(caught.value)
    assert message.startswith("release:0.0.99: cannot fetch the vllm==0.0.99 wheel")
    assert f"{CACHE_ENV}={tmp_path}" in message and "vllm-0.0.99-*.whl" in message


def test_tree_paths_stay_out_of_finding_file_names() -> None:
    long_path = "/" + "/".join(["d" * 50] * 5)[:253]
    assert len(long_path) == 254
    name = f"tree:{long_path}"
    label = file_label(name)
    assert label == file_label(name) and label.startswith("tree-") and len(label) == 13
    assert file_label(f"{name} vs unfixed") == f"{label} vs unfixed"
    assert file_label("release:0.32.0 vs unfixed") == "release:0.32.0 vs unfixed"
    finding = Finding(FindingKind.CRASH, f"{name} vs {name}@main", 1, "boom")
    slug = signature_of(triton(), finding).slug
    assert long_path.strip("/")[:10] not in slug
    assert slug.startswith("crash-tree-") and len(slug) < 100


def test_without_lookahead_hashes_a_drafter_means_the_drop() -> None:
    scenario = dataclasses.replace(triton(), disable_lookahead_block_hashes=False)
    old = {Feature.LOOKAHEAD_HASHES.value: False}
    assert equivalent_scenario(scenario, old) == dataclasses.replace(
        scenario, disable_lookahead_block_hashes=True
    )
    # With the feature, with no drafter, or already disabled: unchanged.
    assert equivalent_scenario(scenario, {Feature.LOOKAHEAD_HASHES.value: True}) is scenario
    no_drafter = dataclasses.replace(scenario, drafter=Drafter(DrafterKind.NONE, 0))
    assert equivalent_scenario(no_drafter, old) is no_drafter
    connector = dataclasses.replace(scenario, kv_connector=True)
    assert equivalent_scenario(connector, old).kv_connector


def test_a_refused_equivalent_is_unsupported_naming_both_pieces() -> None:
    """Llama-4's chunked local attention with EAGLE runs on lookahead hashes;
    without them the drafter would take the drop, which chunked local
    attention refuses: unsupported on that release, not a scenario error."""
    scenario = load_entry(CORPORA / "cases" / "llama4-chunked-local.json").scenario
    assert not scenario.disable_lookahead_block_hashes
    with pytest.raises(Unsupported) as caught:
        equivalent_scenario(scenario, {Feature.LOOKAHEAD_HASHES.value: False})
    reason = caught.value.reason
    assert reason.startswith(DESCRIPTIONS[Feature.LOOKAHEAD_HASHES])
    assert "vllm/config/vllm.py" in reason
    assert reason.endswith(
        "without them the drafter takes the EAGLE block drop, and then kv_cache_groups = "
        "'full_attention+chunked_local_attention' is refused: allowed no "
        "chunked_local_attention group taking the EAGLE block drop (vLLM does not support "
        "EAGLE with chunked local attention)"
    )
    assert equivalent_scenario(scenario, {Feature.LOOKAHEAD_HASHES.value: True}) is scenario


def test_diff_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", "unfixed", "nonesuch", "--seconds", "0"]) == 2
    assert "unknown variant 'nonesuch'" in capsys.readouterr().err
    assert main(["diff", "unfixed", "unfixed", "--seconds", "0"]) == 2
    assert "listed twice" in capsys.readouterr().err
    # A bad float is refused while parsing (argparse's exit 2).
    with pytest.raises(SystemExit) as exited:
        main(["diff", "unfixed", "fixed", "--seconds", "nan"])
    assert exited.value.code == 2
    assert "argument --seconds: 'nan' is invalid" in capsys.readouterr().err


def _run(
    name: str, hits: tuple[int, ...], kept: tuple[tuple[int, int], ...], drop: bool
) -> RunObservation:
    settings = ManagerSettings(
        use_eagle_block_drop=drop,
        num_hash_lookahead_tokens=0 if drop else 1,
        num_lookahead_tokens=3,
        num_prefill_lookahead_tokens=1,
        hit_alignment_tokens=32,
    )
    requests = tuple(
        RequestObservation(
            index=i,
            prompt_tokens=16448,
            hit_tokens=hit,
            shared_prefix_boundary_tokens=0,
            per_group_hit_tokens=(hit, hit),
            retained_blocks_per_group=blocks,
        )
        for i, (hit, blocks) in enumerate(zip(hits, kept, strict=True))
    )
    return RunObservation(name, "x", settings, requests, retention_interval_tokens=8192)


def test_diff_groups_hits_cost_findings_and_unsupported_by_cause() -> None:
    from differential.compare import ScenarioResult, VariantResult
    from differential.findings import Policy
    from differential.reports.diff import ChangeKind, DiffReport, changes_of

    (old,) = parse_variants("unfixed")
    old = dataclasses.replace(old, name="old")
    new = dataclasses.replace(old, name="new")
    scenario = triton()
    fallback = Finding(FindingKind.FALLBACK, "old", 1, "fell back", policy=Policy.VLLM)
    run_old = _run("old", (0, 8192, 16352, 16352), ((514, 132), (258, 70), (3, 5), (3, 5)), True)
    run_new = _run("new", (0, 16352, 16352, 16352), ((514, 130), (3, 2), (3, 5), (3, 5)), False)
    result = ScenarioResult(
        scenario,
        "seed.json",
        Policy.VLLM,
        (
            VariantResult(old, run_old, None, (), (fallback,)),
            VariantResult(new, run_new, None, (), ()),
        ),
    )
    changes = changes_of(result, "seed.json")
    assert [(c.kind, c.request, c.extra_blocks) for c in changes] == [
        (ChangeKind.COST, 0, -2),
        (ChangeKind.HITS, 1, -323),
    ]
    assert changes[1].cause == (
        "EAGLE drop on old, lookahead hashes on new: hits higher on new; "
        "the oracle blames old (fallback)"
    )
    assert changes[1].detail.startswith("hits 8192 on old, 16352 on new (tokens)")
    lacking = RunObservation("old", "x", None, (), unsupported="SpeculativeConfig.thing")
    unsupported = changes_of(
        dataclasses.replace(
            result,
            results=(VariantResult(old, lacking, None, (), ()), result.results[1]),
        ),
        "seed.json",
    )
    assert [(c.kind, c.cause) for c in unsupported] == [
        (ChangeKind.UNSUPPORTED, "old lacks SpeculativeConfig.thing")
    ]
    report = DiffReport("old", "new", {"old": "1", "new": "2"}, 1, 0, 1, (*changes, *unsupported))
    text = report.render()
    assert "hits that differ: 1 sibling(s) in 1 scenario(s)" in text
    assert "scenarios one side cannot run: 1 scenario(s)" in text
    assert "2 fewer blocks kept on new in all: more on 0 sibling(s), fewer on 1" in text
    assert [g["kind"] for g in report.to_dict()["groups"]] == ["hits", "cost", "unsupported"]

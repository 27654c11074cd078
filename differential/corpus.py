"""Scenario files and folders: loading, expectations, atomic writing.

A corpus file is a scenario's JSON form, optionally with an ``expect`` block
recording what a replay must observe::

    "expect": {
      "hits": {"unfixed": [0, 8192, 16352, 16352], "fixed": [0, 16352, 16352, 16352]},
      "findings": {"unfixed": ["fallback@1"], "fixed": []}
    }

``findings`` lists ``kind@request`` (``kind@run`` for whole-run findings) per
variant under the ``vllm`` policy; a variant listed there must report exactly
those findings. ``notes`` is free text.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from differential.errors import ScenarioError, short_repr
from differential.findings import Finding, FindingKind, Policy
from differential.scenario import Scenario

if TYPE_CHECKING:
    from differential.compare import ScenarioResult

__all__ = [
    "CorpusEntry",
    "Expectation",
    "expectation_problems",
    "finding_tag",
    "iter_scenario_files",
    "load_entry",
    "not_a_scenario",
    "write_atomic",
]


def finding_tag(finding: Finding) -> str:
    """``kind@request`` (``kind@run`` for whole-run findings)."""
    where = "run" if finding.request is None else str(finding.request)
    return f"{finding.kind.value}@{where}"


@dataclass(frozen=True)
class Expectation:
    """What replaying a corpus entry must observe.

    Attributes:
        hits: variant name -> hit tokens per request.
        findings: variant name -> sorted ``kind@request`` tags.
        notes: free text.
    """

    hits: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    findings: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    notes: str = ""


@dataclass(frozen=True)
class CorpusEntry:
    """A scenario file and its expectation.

    Attributes:
        path: the file.
        scenario: its scenario.
        expect: its ``expect`` block (empty when absent).
        signature: the ``finding.signature`` a campaign finding file records
            (``None`` for a plain scenario).
        plan: for a model-level scenario (a ``model`` instead of
            ``kv_cache_groups``), the groups and block sizes vLLM's planner
            chose (:mod:`differential.driver.planner`); empty otherwise.
    """

    path: Path
    scenario: Scenario
    expect: Expectation
    signature: str | None = None
    plan: str = ""


def _expectation(raw: object, source: str) -> Expectation:
    if raw is None:
        return Expectation()
    if not isinstance(raw, dict) or set(raw) - {"hits", "findings"}:
        raise ScenarioError(
            "expect", raw, "an object with keys 'hits' and/or 'findings'", source=source
        )
    hits: dict[str, tuple[int, ...]] = {}
    for variant, values in (raw.get("hits") or {}).items():
        if not isinstance(values, list) or not all(isinstance(v, int) for v in values):
            raise ScenarioError(
                f"expect.hits.{variant}", values, "a list of integers", source=source
            )
        hits[variant] = tuple(values)
    findings: dict[str, tuple[str, ...]] = {}
    for variant, tags in (raw.get("findings") or {}).items():
        if not isinstance(tags, list) or not all(isinstance(t, str) and "@" in t for t in tags):
            raise ScenarioError(
                f"expect.findings.{variant}",
                tags,
                "a list of 'kind@request' strings",
                source=source,
            )
        findings[variant] = tuple(sorted(tags))
    return Expectation(hits=hits, findings=findings)


def load_entry(path: Path) -> CorpusEntry:
    """Load one scenario file.

    Raises:
        ScenarioError: unreadable file, malformed JSON or an invalid scenario;
            the message names the file and the field.
    """
    source = str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ScenarioError("<file>", source, f"a readable file ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(
            "<file>",
            f"byte 0x{raw[exc.start]:02x} at offset {exc.start}",
            "UTF-8 text",
            source=source,
        ) from None
    plan = ""
    model_level = _model_level(text)
    if model_level is not None:
        # A model description instead of groups: vLLM's planner lays it out
        # (imports vLLM).
        from differential.driver.planner import resolve_model_scenario

        try:
            scenario, layout = resolve_model_scenario(model_level, path.parent)
        except ScenarioError as exc:
            raise exc.with_source(source) from None
        plan = layout.describe()
    else:
        scenario = Scenario.from_json(text, source=source)
    data: dict[str, Any] = json.loads(text)  # parsed once already: cannot fail
    expect = _expectation(data.get("expect"), source)
    notes = data.get("notes", "")
    if not isinstance(notes, str):
        raise ScenarioError("notes", notes, "a string", source=source)
    record = data.get("finding")
    if record is not None and not isinstance(record, dict):
        raise ScenarioError(
            "finding", record, "an object (a campaign finding's record) or absent", source=source
        )
    signature = (record or {}).get("signature")
    if signature is not None and not isinstance(signature, str):
        raise ScenarioError("finding.signature", signature, "a string", source=source)
    return CorpusEntry(
        path, scenario, Expectation(expect.hits, expect.findings, notes), signature, plan
    )


def _model_level(text: str) -> dict[str, Any] | None:
    """The JSON object of a model-level scenario (``model``, no groups), else ``None``."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None  # Scenario.from_json names the problem
    if isinstance(data, dict) and "model" in data and "kv_cache_groups" not in data:
        return data
    return None


_COMPARISON_TAGS = (
    f"{FindingKind.VARIANT_REGRESSION.value}@",
    f"{FindingKind.POOL_REGRESSION.value}@",
    f"{FindingKind.VARIANT_DRIFT.value}@",
)


def expectation_problems(entry: CorpusEntry, result: ScenarioResult) -> list[str]:
    """How a replay of ``entry`` contradicts its ``expect`` block.

    Hits are checked for every variant that ran and has recorded hits;
    findings only under the ``vllm`` policy (the one they are recorded for),
    per variant and, under the pseudo-variant ``layout``, the layout findings
    (``alignment-blowup``); comparisons between variants only when every
    variant recorded in the block ran.

    Returns:
        One line per contradiction, naming the variant, the observed and the
        expected values; empty when the replay agrees (or nothing is recorded).
    """
    expect = entry.expect
    problems: list[str] = []
    ran = {vr.variant.name for vr in result.results}
    # Comparisons between variants (regression, drift) exist only when the
    # variants recorded beside it ran too.
    compared = set(expect.hits) <= ran

    def judged(tags: Sequence[str]) -> list[str]:
        return sorted(t for t in tags if compared or not t.startswith(_COMPARISON_TAGS))

    if "layout" in expect.findings and result.policy is Policy.VLLM:
        # Layout findings (differential.oracle.layout) belong to no variant.
        got = sorted(finding_tag(f) for f in result.findings if f.owner == "layout")
        if got != list(expect.findings["layout"]):
            problems.append(f"layout: findings {got}, expected {list(expect.findings['layout'])}")
    for vr in result.results:
        name = vr.variant.name
        if name in expect.hits and tuple(vr.run.hits) != tuple(expect.hits[name]):
            problems.append(f"{name}: hits {list(vr.run.hits)}, expected {list(expect.hits[name])}")
        if name in expect.findings and result.policy is Policy.VLLM:
            got = judged([finding_tag(f) for f in result.findings if f.owner == name])
            if got != judged(expect.findings[name]):
                problems.append(f"{name}: findings {got}, expected {list(expect.findings[name])}")
    return problems


#: ``format`` of a scenario file (``differential.scenario``'s JSON form).
_SCENARIO_FORMAT = "kvfuzz.scenario"
#: The scenario keys of which an object without ``format`` needs one to be
#: taken for a scenario.
_SCENARIO_KEYS = frozenset({"kv_cache_groups", "model", "requests"})


def not_a_scenario(path: Path) -> str | None:
    """Why the JSON file ``path`` is not a scenario, or ``None`` if it may be one.

    Not a scenario: JSON whose top level is not an object, an object whose
    ``format`` is another one (``kvfuzz.model``: a model description, which
    scenarios name with ``model``; a replay report, ...), or an object
    without ``format`` and without any scenario key. Unreadable or malformed
    JSON may be a broken scenario: ``None`` (loading it names the problem).
    """
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return f"not a scenario (a JSON {type(data).__name__}, not an object)"
    fmt = data.get("format")
    if fmt == "kvfuzz.model":
        return "a model description (format 'kvfuzz.model'); a scenario names it with 'model'"
    if fmt is not None and fmt != _SCENARIO_FORMAT:
        return f"not a scenario (format {short_repr(fmt)}, not {_SCENARIO_FORMAT!r})"
    if fmt is None and not _SCENARIO_KEYS & data.keys():
        return "not a scenario (no format, kv_cache_groups, model or requests)"
    return None


def _say_skipped(path: Path, why: str) -> None:
    print(f"kvfuzz: skipped {path}: {why}", file=sys.stderr)


def iter_scenario_files(
    paths: Iterable[str | Path], *, skipped: Callable[[Path, str], None] | None = _say_skipped
) -> list[Path]:
    """Expand files and folders (recursively, ``*.json``) into sorted files.

    A folder's JSON files that are not scenarios (:func:`not_a_scenario`:
    model descriptions, reports, other JSON) are left out, each reported to
    ``skipped`` (default: one line on stderr; ``None``: silently). A file
    named explicitly is always kept (loading it names what is wrong).

    Raises:
        ScenarioError: a path that does not exist, or a folder with no
            scenario file.
    """
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.json") if p.is_file())
            if not found:
                raise ScenarioError("PATH", str(path), "a folder containing *.json scenario files")
            kept = [p for p in found if not_a_scenario(p) is None]
            if not kept:
                raise ScenarioError(
                    "PATH", str(path), "a folder containing *.json scenario files (it holds none)"
                )
            if skipped is not None:
                for candidate in found:
                    why = not_a_scenario(candidate)
                    if why is not None:
                        skipped(candidate, why)
            files.extend(kept)
        elif path.is_file():
            files.append(path)
        else:
            raise ScenarioError("PATH", str(path), "an existing scenario file or folder")
    return files


def _synced_temp(path: Path, text: str) -> Path:
    """A fully written, fsynced temporary file beside ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file, fsync, rename)."""
    tmp = _synced_temp(path, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_once(path: Path, text: str) -> bool:
    """Create ``path`` with ``text`` atomically unless it already exists.

    Safe against concurrent writers (another process of a parallel campaign):
    the complete file appears at once, and only the first writer wins.

    Returns:
        ``True`` if this call created the file.
    """
    tmp = _synced_temp(path, text)
    try:
        os.link(tmp, path)  # fails if the path exists: first writer wins
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True

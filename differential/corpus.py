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

import errno
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from differential.errors import ScenarioError, printable, short_repr
from differential.files import json_data, read_regular_file
from differential.findings import Finding, FindingKind, Policy
from differential.scenario import Scenario
from differential.scenario.finding_form import FindingRecordDocument, parse_finding_record
from differential.scenario.json_form import parse_engine_block
from differential.scenario.models import model_scenario_parts

if TYPE_CHECKING:
    from differential.compare import ScenarioResult

__all__ = [
    "CorpusEntry",
    "Expectation",
    "expectation_problems",
    "finding_tag",
    "is_stream",
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
        finding: the file's ``finding`` block, checked
            (:mod:`differential.scenario.finding_form`); ``None`` for a plain
            scenario.
    """

    path: Path
    scenario: Scenario
    expect: Expectation
    signature: str | None = None
    plan: str = ""
    finding: FindingRecordDocument | None = None


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
        if not isinstance(tags, list):
            raise ScenarioError(
                f"expect.findings.{variant}",
                tags,
                "a list of 'kind@request' strings",
                source=source,
            )
        for index, tag in enumerate(tags):
            if not _valid_tag(tag):
                raise ScenarioError(
                    f"expect.findings.{variant}[{index}]",
                    tag,
                    "'kind@N' (N a request index) or 'kind@run', kind one of "
                    + ", ".join(k.value for k in FindingKind),
                    source=source,
                )
        findings[variant] = tuple(sorted(tags))
    return Expectation(hits=hits, findings=findings)


def _valid_tag(tag: object) -> bool:
    """Whether ``tag`` is a :func:`finding_tag`: a finding kind, ``@``, then a
    request index or ``run`` (a misspelt kind would never match a finding)."""
    if not isinstance(tag, str):
        return False
    kind, at, where = tag.partition("@")
    kinds = {k.value for k in FindingKind}
    return (
        bool(at) and kind in kinds and (where == "run" or (where.isdecimal() and where.isascii()))
    )


def load_entry(path: Path) -> CorpusEntry:
    """Load one scenario file.

    Raises:
        ScenarioError: unreadable file, malformed JSON, an invalid scenario,
            or an invalid ``expect``, ``notes``, ``finding`` or ``engine``
            block (the last two checked by the models that write and publish
            them); the message names the file and the field.
    """
    source = str(path)
    raw = read_regular_file(path, "<file>")
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
    data: Any = json_data(text, source=source)
    if isinstance(data, dict) and "model" in data and "kv_cache_groups" not in data:
        # A model description instead of groups: vLLM's planner lays it out
        # (imports vLLM), after what can be checked without it.
        try:
            model_scenario_parts(data, path.parent)
        except ScenarioError as exc:  # named by the file at fault: this one or its model's
            raise (exc if exc.source else exc.with_source(source)) from None
        from differential.driver.planner import resolve_model_scenario

        try:
            scenario, layout = resolve_model_scenario(data, path.parent)
        except ScenarioError as exc:  # named by the file at fault: this one or its model's
            raise (exc if exc.source else exc.with_source(source)) from None
        plan = layout.describe()
    else:
        try:
            scenario = Scenario.from_dict(data)
        except ScenarioError as exc:
            raise exc.with_source(source) from None
    expect = _expectation(data.get("expect"), source)
    notes = data.get("notes", "")
    if not isinstance(notes, str):
        raise ScenarioError("notes", notes, "a string", source=source)
    try:
        record = (
            None
            if data.get("finding") is None
            else parse_finding_record(data["finding"], requests=len(scenario.requests))
        )
        if data.get("engine") is not None:
            parse_engine_block(data["engine"])
    except ScenarioError as exc:
        raise exc.with_source(source) from None
    return CorpusEntry(
        path,
        scenario,
        Expectation(expect.hits, expect.findings, notes),
        None if record is None else record.signature,
        plan,
        record,
    )


_COMPARISON_TAGS = (
    f"{FindingKind.VARIANT_REGRESSION.value}@",
    f"{FindingKind.POOL_REGRESSION.value}@",
    f"{FindingKind.VARIANT_DRIFT.value}@",
)


def expectation_problems(
    entry: CorpusEntry, result: ScenarioResult, *, dense_checked: bool = True
) -> list[str]:
    """How a replay of ``entry`` contradicts its ``expect`` block.

    Hits are checked for every variant that ran and has recorded hits;
    findings only under the ``vllm`` policy (the one they are recorded for),
    per variant and, under the pseudo-variant ``layout``, the layout findings
    (``alignment-blowup``); comparisons between variants only when every
    variant recorded in the block ran; ``dense-mismatch`` findings only when
    the replay ran the dense cross-check (``dense_checked``; ``replay
    --no-dense-check`` skips it, so none can be owed).

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

    skipped = () if dense_checked else (f"{FindingKind.DENSE_MISMATCH.value}@",)

    def judged(tags: Sequence[str]) -> list[str]:
        return sorted(
            t
            for t in tags
            if (compared or not t.startswith(_COMPARISON_TAGS))
            and not (skipped and t.startswith(skipped))
        )

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
    print(f"kvfuzz: skipped {printable(str(path))}: {why}", file=sys.stderr)


def _json_files(folder: Path) -> list[Path]:
    """The ``*.json`` files under ``folder`` (recursively, symlinked folders
    not followed), sorted.

    Raises:
        ScenarioError: a folder under ``folder`` that cannot be listed,
            naming it (``Path.rglob`` skips it silently: its scenarios would
            go unreplayed without a word), as an unreadable file is.
    """

    def unreadable(exc: OSError) -> None:
        raise ScenarioError(
            "PATH", exc.filename or str(folder), f"a readable folder ({exc.strerror})"
        )

    found = [
        Path(top) / name
        for top, _folders, names in os.walk(folder, onerror=unreadable)
        for name in names
        if name.endswith(".json")
    ]
    return sorted(p for p in found if p.is_file())


def iter_scenario_files(
    paths: Iterable[str | Path], *, skipped: Callable[[Path, str], None] | None = _say_skipped
) -> list[Path]:
    """Expand files and folders (recursively, ``*.json``) into sorted files.

    A folder's JSON files that are not scenarios (:func:`not_a_scenario`:
    model descriptions, reports, other JSON) are left out, each reported to
    ``skipped`` (default: one line on stderr; ``None``: silently). A file
    named explicitly is always kept (loading it names what is wrong).

    Raises:
        ScenarioError: a path that does not exist, a folder (or subfolder)
            that cannot be listed, or a folder with no scenario file.
    """
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):  # a name too long, a loop
                raise ScenarioError(
                    "PATH", str(path), f"a path the file system accepts ({exc.strerror})"
                ) from None
        if path.is_dir():
            found = _json_files(path)
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


def _synced_temp(path: Path, text: str, mode: int | None = None) -> Path:
    """A fully written, fsynced temporary file beside ``path`` (``mode``: its
    permission bits; ``None``: the umask's default for a new file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def is_stream(path: Path) -> bool:
    """Whether ``path`` is written as a stream, never replaced: a device, pipe
    or socket (``/dev/null``, a FIFO, a terminal), or a file descriptor link
    (``/dev/stdout``, ``/proc/self/fd/1``), possibly through symlinks."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return not stat.S_ISDIR(st.st_mode)
    # A regular file reached through a descriptor link is the file behind a
    # redirection: replacing it would detach the shell's descriptor.
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on a symlink chain
        if current.startswith(("/dev/fd/", "/dev/stdout", "/dev/stderr", "/proc/")):
            return True
        if not os.path.islink(current):
            return False
        current = os.path.join(os.path.dirname(current), os.readlink(current))
    return False


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, replacing only regular files.

    A regular file (or a new one) is written atomically: a temporary file
    beside it, fsync, rename, with the old file's permissions; through a
    symlink, the link's target is replaced, not the link. A device, pipe or
    file descriptor link (:func:`is_stream`) is written as a stream (appended:
    ``--sarif /dev/stdout`` adds to what stdout already holds).

    Raises:
        OSError: the write failed (the old file, if any, is left whole); its
            ``filename`` is ``path``, whatever call failed (a full disk fails
            a write or an fsync, which name no file).
    """
    try:
        if is_stream(path):
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(text)
            return
        target = Path(os.path.realpath(path)) if path.is_symlink() else path
        try:
            mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
        except OSError:
            mode = None
        tmp = _synced_temp(target, text, mode)
        try:
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise _naming(exc, path) from exc


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` as an ``OSError`` of the same errno naming ``path``."""
    return OSError(exc.errno, exc.strerror or str(exc), str(path))


def write_once(path: Path, text: str) -> bool:
    """Create ``path`` with ``text`` atomically unless it already exists.

    Safe against concurrent writers (another process of a parallel campaign):
    the complete file appears at once, and only the first writer wins.

    Returns:
        ``True`` if this call created the file.

    Raises:
        OSError: the write failed, naming ``path``.
    """
    try:
        tmp = _synced_temp(path, text)
    except OSError as exc:
        raise _naming(exc, path) from exc
    try:
        os.link(tmp, path)  # fails if the path exists: first writer wins
    except FileExistsError:
        return False
    except OSError as exc:
        raise _naming(exc, path) from exc
    finally:
        tmp.unlink(missing_ok=True)
    return True

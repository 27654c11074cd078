"""Reports where CI users look: JUnit XML, SARIF and GitHub annotations.

* JUnit XML (the Ant/Jenkins schema every CI system reads): one ``testsuite``
  per scenario, one ``testcase`` per variant, each finding of that variant a
  ``failure`` whose message names the root cause, the request and the lost
  checkpoint.
* SARIF 2.1.0 (GitHub code scanning): one result per finding, rule = kind,
  located at the scenario file, with the root cause
  (:mod:`differential.triage.identity`) as its ``partialFingerprints`` so code
  scanning groups the findings of one cause.

Known findings (a known vLLM issue, :mod:`differential.oracle.known`, or a
root cause a campaign's known corpus already holds) are not failures that
never go away: a test case whose findings are all known is ``skipped``
(its message names them), a known finding beside new ones is listed in the
case's ``system-out``, SARIF gives it level ``note`` and an annotation is a
``::notice``; ``known_as_failures`` (``--known-as-failures``) reports them
like new ones. ``on_base`` (``kvfuzz gate``) names, per scenario, the
findings (``kind@request``) the pull request's base has too: they are known
the same way.

Entries come in the order of ``results`` (a campaign passes its root causes'
reproducers, new ones first); within a scenario, each root cause's primary
finding comes before its facets and consequences.
* GitHub workflow commands: one ``::error`` line per finding.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from differential.compare import ScenarioResult
from differential.corpus import finding_tag
from differential.findings import Finding, FindingKind
from differential.triage.identity import Role, RootCause, Triaged, triage

__all__ = ["github_annotations", "junit_xml", "sarif"]


def _name(result: ScenarioResult) -> str:
    return result.source or result.scenario.label


_ROLE_ORDER = {Role.PRIMARY: 0, Role.FACET: 1, Role.CONSEQUENCE: 2}


def _ordered(result: ScenarioResult) -> list[Triaged]:
    """The findings with their root causes: per root cause, primary first."""
    triaged = list(triage(result))
    first: dict[RootCause, int] = {}
    for index, t in enumerate(triaged):
        first.setdefault(t.root_cause, index)
    return sorted(triaged, key=lambda t: (first[t.root_cause], _ROLE_ORDER[t.role]))


def _line(t: Triaged) -> str:
    role = "" if t.role is Role.PRIMARY else f" ({t.role.value})"
    return f"[{t.root_cause.text}]{role} {t.finding.summary()}"


def _fingerprint(t: Triaged) -> dict[str, str]:
    return {"kvfuzzRootCause/v1": t.root_cause.slug}


def _finding_properties(t: Triaged) -> dict[str, object]:
    finding: Finding = t.finding
    return {**finding.to_dict(), "root_cause": t.root_cause.text, "role": t.role.value}


def _known(
    t: Triaged, known_causes: Collection[RootCause], on_base: Collection[str] = ()
) -> str | None:
    """Why ``t`` is known (the known issue's name, ``known root cause``, or
    ``on the base too``: its tag is in ``on_base``), else ``None``."""
    if t.finding.known_issue:
        return f"{t.finding.known_kind} {t.finding.known_issue}"
    if finding_tag(t.finding) in on_base:
        return "on the base too"
    return "known root cause" if t.root_cause in known_causes else None


def junit_xml(
    results: Sequence[ScenarioResult],
    *,
    suite_name: str = "kvfuzz",
    known_causes: Collection[RootCause] = frozenset(),
    known_as_failures: bool = False,
    on_base: Mapping[str, Collection[str]] | None = None,
) -> str:
    """JUnit XML text for ``results`` (known findings: see the module docstring)."""
    base = on_base or {}
    root = ET.Element("testsuites", name=suite_name)
    total = failures = skips = 0
    for result in results:
        suite = ET.SubElement(root, "testsuite", name=_name(result))
        cases = failed = skipped = 0
        for vr in result.results:
            cases += 1
            case = ET.SubElement(
                suite,
                "testcase",
                classname=_name(result),
                name=f"{vr.variant.name} (policy {result.policy.value})",
                time=f"{vr.elapsed_s:.3f}",
            )
            mine = [t for t in _ordered(result) if t.owner == vr.variant.name]
            shared = base.get(_name(result), ())
            known = (
                [] if known_as_failures else [t for t in mine if _known(t, known_causes, shared)]
            )
            new = [t for t in mine if t not in known]
            if new:
                failed += 1
                failure = ET.SubElement(
                    case,
                    "failure",
                    message="; ".join(_line(t) for t in new)[:1000],
                    type=",".join(dict.fromkeys(t.finding.kind.value for t in new)),
                )
                failure.text = "\n".join(_line(t) for t in new)
            elif known:
                skipped += 1
                ET.SubElement(
                    case,
                    "skipped",
                    message=(
                        "known: "
                        + "; ".join(
                            f"{_line(t)} ({_known(t, known_causes, shared)})" for t in known
                        )
                    )[:1000],
                )
            out = ET.SubElement(case, "system-out")
            out.text = f"hits {list(vr.run.hits)}" + "".join(
                f"\nknown ({_known(t, known_causes, shared)}): {_line(t)}" for t in known
            )
        suite.set("tests", str(cases))
        suite.set("failures", str(failed))
        suite.set("errors", "0")
        suite.set("skipped", str(skipped))
        total += cases
        failures += failed
        skips += skipped
    root.set("tests", str(total))
    root.set("failures", str(failures))
    root.set("errors", "0")
    root.set("skipped", str(skips))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


_LEVEL = {
    FindingKind.WRONG_OUTPUT: "error",
    FindingKind.WRONG_KV: "error",
    FindingKind.OVER_HIT: "error",
    FindingKind.CRASH: "error",
    FindingKind.WRONG_FINISH: "error",
    FindingKind.MISALIGNED: "error",
    FindingKind.FALLBACK: "error",
    FindingKind.PER_GROUP_HIT: "warning",
    FindingKind.KEPT_SKIPPED_BLOCK: "warning",
    FindingKind.KV_EVENTS: "warning",
    FindingKind.KV_CACHE_PLAN: "error",
    FindingKind.WATERMARK: "warning",
    FindingKind.REPLAY: "error",
    FindingKind.CACHE_METRICS: "warning",
    FindingKind.VARIANT_REGRESSION: "warning",
    FindingKind.POOL_REGRESSION: "warning",
    FindingKind.VARIANT_DRIFT: "warning",
    FindingKind.NEEDLESS_DROP: "warning",
    FindingKind.DENSE_MISMATCH: "warning",
    FindingKind.MODE_MISMATCH: "warning",
    FindingKind.ASYNC_MISMATCH: "warning",
    FindingKind.DRIVER_MISMATCH: "warning",
    FindingKind.FREE_ORDER: "warning",
    FindingKind.EVICTION_COLLAPSE: "warning",
    FindingKind.DESIGN_GAP: "note",
    FindingKind.ALIGNMENT_BLOWUP: "note",
    FindingKind.EVICTION: "note",
}


def sarif(
    results: Sequence[ScenarioResult],
    *,
    tool_version: str = "0.1.0",
    known_causes: Collection[RootCause] = frozenset(),
    known_as_failures: bool = False,
    on_base: Mapping[str, Collection[str]] | None = None,
) -> dict[str, Any]:
    """A SARIF 2.1.0 log with one result per finding (a known one: level
    ``note``, its ``properties.known`` saying why; see the module docstring)."""
    rules = [
        {
            "id": kind.value,
            "name": kind.name.title().replace("_", ""),
            "shortDescription": {"text": kind.value},
        }
        for kind in FindingKind
    ]
    sarif_results = []
    for result in results:
        shared = (on_base or {}).get(_name(result), ())
        for t in _ordered(result):
            finding = t.finding
            known = None if known_as_failures else _known(t, known_causes, shared)
            properties = _finding_properties(t) | ({"known": known} if known else {})
            sarif_results.append(
                {
                    "ruleId": finding.kind.value,
                    "level": "note" if known else _LEVEL[finding.kind],
                    "message": {"text": _line(t)},
                    "partialFingerprints": _fingerprint(t),
                    "locations": [
                        {
                            "physicalLocation": {
                                "artifactLocation": {"uri": _name(result)},
                                "region": {"startLine": 1},
                            }
                        }
                    ],
                    "properties": properties,
                }
            )
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "kvfuzz",
                        "version": tool_version,
                        "rules": rules,
                    }
                },
                "results": sarif_results,
            }
        ],
    }


def _escape_data(text: str) -> str:
    """A workflow command's message, escaped as GitHub's toolkit does."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    """A workflow command's property value (``file=``), escaped as GitHub's toolkit does."""
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(
    results: Sequence[ScenarioResult],
    *,
    known_causes: Collection[RootCause] = frozenset(),
    known_as_failures: bool = False,
    on_base: Mapping[str, Collection[str]] | None = None,
) -> str:
    """GitHub Actions ``::error``/``::warning`` lines, one per finding (a
    known one: ``::notice``).

    File names and messages are escaped (``%``, CR, LF, and ``:`` / ``,`` in
    properties), so a file name can never start a command line of its own.
    """
    lines = []
    for result in results:
        shared = (on_base or {}).get(_name(result), ())
        for t in _ordered(result):
            finding = t.finding
            level = "error" if _LEVEL[finding.kind] == "error" else "warning"
            if not known_as_failures and _known(t, known_causes, shared):
                level = "notice"
            message = _escape_data(finding.summary())
            file = _escape_property(_name(result))
            lines.append(f"::{level} file={file},title=kvfuzz {finding.kind.value}::{message}")
    return "\n".join(lines) + ("\n" if lines else "")


def dumps_sarif(
    results: Sequence[ScenarioResult],
    *,
    known_causes: Collection[RootCause] = frozenset(),
    known_as_failures: bool = False,
    on_base: Mapping[str, Collection[str]] | None = None,
) -> str:
    """:func:`sarif` as JSON text."""
    log = sarif(
        results, known_causes=known_causes, known_as_failures=known_as_failures, on_base=on_base
    )
    return json.dumps(log, indent=2) + "\n"

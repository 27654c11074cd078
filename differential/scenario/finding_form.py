"""A scenario file's ``finding`` block: a campaign finding's record (``format`` ``kvfuzz.finding``).

``kvfuzz fuzz``, ``kvfuzz shrink`` and ``kvfuzz import-crash`` write it
(:func:`finding_record`, from ``fuzz/campaign.py``'s ``finding_document``);
the loader (:mod:`differential.corpus`) checks it with the same models
(:func:`parse_finding_record`), and the published JSON Schema embeds them
(:class:`~differential.scenario.json_form.ScenarioFileDocument`), so what is
written, what is read and what is published cannot disagree.

Units: fields ending in ``_tokens`` are tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from differential.errors import ScenarioError
from differential.findings import FindingKind, Policy
from differential.scenario._errors import scenario_error
from differential.scenario.models import FormatVersion

__all__ = [
    "FINDING_FORMAT",
    "FINDING_VERSION",
    "FindingDocument",
    "FindingRecordDocument",
    "RootCauseDocument",
    "ShrinkDocument",
    "SignatureFieldsDocument",
    "finding_record",
    "parse_finding_record",
]

FINDING_FORMAT: Final = "kvfuzz.finding"
FINDING_VERSION: Final = 1

_Count = Annotated[StrictInt, Field(ge=0)]
_CONFIG = ConfigDict(extra="forbid", frozen=True)


def _is_none(value: object) -> bool:
    return value is None


class SignatureFieldsDocument(BaseModel):
    """The parts of the finding's signature (``fuzz/signature.py`` ``Signature``)."""

    model_config = _CONFIG

    kind: FindingKind = Field(description="The finding kind the file was filed under.")
    variant: StrictStr = Field(description="The variant, or 'a vs b' for a comparison.")
    drafter: StrictStr = Field(description="Drafter class and protection, e.g. 'eagle/drop'.")
    retention: StrictStr = Field(description="'dense', 'zero', 'alignment' or 'sparse'.")
    position: StrictStr = Field(
        description="Where the divergence point sits relative to the nearest checkpoint."
    )
    known_issue: StrictStr = Field(
        default="",
        description="The known vLLM issue (or, on a comparison of a fix with a baseline, "
        "the fix's known cost) that explains it, or ''.",
    )


class FindingDocument(BaseModel):
    """One finding (``differential/findings.py`` ``Finding.to_dict``)."""

    model_config = _CONFIG

    kind: FindingKind = Field(description="The finding kind (docs/oracle.md).")
    variant: StrictStr = Field(description="The variant it was found on ('a vs b': comparisons).")
    request: _Count | None = Field(
        description="The request's index in the file's requests; null: a whole-run finding."
    )
    divergence_tokens: _Count | None = Field(
        default=None, description="The request's divergence point, in tokens."
    )
    expected_tokens: _Count | None = Field(
        default=None, description="The checkpoint (or reference hit) that was due, in tokens."
    )
    hit_tokens: _Count | None = Field(default=None, description="The hit observed, in tokens.")
    fallback_checkpoint_tokens: _Count | None = Field(
        default=None,
        description="The highest promised checkpoint at or below the hit, in tokens "
        "(fallbacks only).",
    )
    policy: Policy = Field(default=Policy.VLLM, description="The policy that judged it.")
    detail: StrictStr = Field(description="One readable sentence.")
    known_issue: StrictStr | None = Field(
        default=None,
        description="The known vLLM issue (or, on a comparison of a fix with a baseline, "
        "the fix's known cost) that explains it, or null.",
    )
    blocks_per_group: tuple[tuple[_Count | None, ...], ...] = Field(
        default=(),
        exclude_if=lambda v: v == (),
        description="(wrong-kv only) the block ids the request's lookup returned, per KV "
        "cache group (null: the null block). Written only when set.",
    )


class RootCauseDocument(BaseModel):
    """The finding's root cause (``differential/triage/identity.py`` ``RootCause.to_dict``)."""

    model_config = _CONFIG

    text: StrictStr = Field(description="The root cause as one line.")
    family: StrictStr = Field(description="The cause's class: 'shortfall', 'over-hit', ...")
    known_issue: StrictStr = Field(
        default="", description="The known vLLM issue or fix cost, or ''."
    )
    group_kind: StrictStr = Field(default="", description="The binding group's manager family.")
    branch: StrictStr = Field(default="", description="Where that group's lookup stopped.")
    boundary: StrictStr = Field(default="", description="The boundary of the missing retained run.")
    units_below: _Count = Field(
        default=0, description="Hit-alignment units the owed checkpoint sits below it."
    )
    detail: StrictStr = Field(default="", description="Other families' distinguishing words.")


class ShrinkDocument(BaseModel):
    """How a campaign's background shrinker reduced the finding."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    source: StrictStr = Field(alias="from", description="The file it was shrunk from.")
    steps: tuple[StrictStr, ...] = Field(description="The reductions kept, in order.")
    checks: _Count = Field(description="Scenarios run while shrinking.")
    elapsed_s: Annotated[float, Field(ge=0.0, strict=True)] = Field(
        description="Seconds spent shrinking."
    )
    timed_out: StrictBool = Field(description="The time budget ended the shrink.")


class FindingRecordDocument(BaseModel):
    """A campaign finding's record (``format`` ``kvfuzz.finding``): the signature
    it was filed under and every finding of the file's scenario."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="kvfuzz finding record")

    format: Literal["kvfuzz.finding"] = Field(description="Always 'kvfuzz.finding'.")
    version: FormatVersion = Field(description="The record's format version.")
    signature: StrictStr = Field(description="The signature the finding was filed under.")
    signature_fields: SignatureFieldsDocument = Field(description="The signature's parts.")
    policy: Policy = Field(description="The policy the scenario was judged under.")
    vllm_version: StrictStr = Field(description="kvfuzz's vLLM when the file was written.")
    vllm_versions: dict[str, StrictStr] | None = Field(
        default=None,
        exclude_if=_is_none,
        description="Variant name -> the vLLM version it ran. Written by campaigns since "
        "version 1 shipped; absent in older files.",
    )
    seed: StrictInt | None = Field(default=None, description="The campaign's seed, or null.")
    example: StrictInt | None = Field(
        default=None,
        description="The campaign example that found it (negative: Hypothesis's example "
        "database), or null.",
    )
    findings: tuple[FindingDocument, ...] = Field(
        description="Every finding of the file's scenario on the variants it was judged on."
    )
    root_cause: RootCauseDocument | None = Field(
        default=None,
        exclude_if=_is_none,
        description="The root cause (a campaign's root-causes/ file). Written only when set.",
    )
    shrink: ShrinkDocument | None = Field(
        default=None,
        exclude_if=_is_none,
        description="How the campaign shrank it. Written only when set.",
    )


@cache
def _schema() -> dict[str, Any]:
    return FindingRecordDocument.model_json_schema()


def finding_record(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON form of a finding record with ``fields`` (a finding file's ``finding``).

    Args:
        fields: the record's fields by their JSON names (``format`` and
            ``version`` may be left out).

    Raises:
        pydantic.ValidationError: a field kvfuzz filled wrongly (kvfuzz's own
            failure, never the user's input).
    """
    document = FindingRecordDocument.model_validate(
        {"format": FINDING_FORMAT, "version": FINDING_VERSION, **fields}
    )
    return document.model_dump(mode="json", by_alias=True)


def parse_finding_record(data: object, *, requests: int) -> FindingRecordDocument:
    """A scenario file's ``finding`` block, checked.

    Args:
        data: the block as read from JSON.
        requests: the number of requests of the file's scenario (a finding's
            ``request`` indexes them).

    Raises:
        ScenarioError: a wrong format or version, an unknown or missing key,
            a value of the wrong type or range, or a finding's request the
            scenario does not have, naming the field path (``finding.findings[0].kind``)
            and the allowed values.
    """
    try:
        document = FindingRecordDocument.model_validate(data)
    except ValidationError as exc:
        raise scenario_error(exc, _schema(), prefix="finding", root="finding") from None
    for index, finding in enumerate(document.findings):
        if finding.request is not None and finding.request >= requests:
            raise ScenarioError(
                f"finding.findings[{index}].request",
                finding.request,
                f"null or a request index 0..{requests - 1} (the scenario has {requests} requests)",
            )
    return document

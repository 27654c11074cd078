"""The scenario's JSON form: format, version, parsing and writing.

The canonical form (:func:`scenario_to_dict`) writes every field except the
ones added after version 1 shipped, which are written only when not their
default, so older files stay byte-identical.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from differential.errors import ScenarioError
from differential.scenario._checks import _allowed_enum
from differential.scenario.drafter import Drafter, DrafterKind
from differential.scenario.groups import GroupKind, KVCacheGroup, MambaPrefill
from differential.scenario.workload import DriveMode, RequestSpec, Workload

if TYPE_CHECKING:
    from differential.scenario.model import Scenario

__all__ = [
    "SCENARIO_FORMAT",
    "SCENARIO_VERSION",
    "json_data",
    "scenario_fields",
    "scenario_to_dict",
]

SCENARIO_FORMAT = "kvfuzz.scenario"
SCENARIO_VERSION = 1

_E = TypeVar("_E", bound=StrEnum)

_WORKLOAD_KEYS = frozenset(
    {
        "mode",
        "pool_blocks",
        "arrival_steps",
        "max_num_seqs",
        "max_num_batched_tokens",
        "shares_output",
        "accepted_drafts",
    }
)


def _workload_from(raw: object) -> Workload:
    obj = _expect_mapping(raw, "workload")
    _reject_unknown(obj, _WORKLOAD_KEYS, "workload.")
    arrivals = obj.get("arrival_steps")
    if arrivals is not None:
        arrivals = tuple(_expect_list(arrivals, "workload.arrival_steps"))
    return Workload(
        mode=_enum(DriveMode, obj.get("mode", "manager"), "workload.mode"),
        pool_blocks=obj.get("pool_blocks"),
        arrival_steps=arrivals,
        max_num_seqs=obj.get("max_num_seqs"),
        max_num_batched_tokens=obj.get("max_num_batched_tokens"),
        shares_output=obj.get("shares_output", False),
        accepted_drafts=tuple(
            _expect_list(obj.get("accepted_drafts", []), "workload.accepted_drafts")
        ),
    )


_TOP_KEYS = frozenset(
    {
        "format",
        "version",
        "name",
        "description",
        "kv_cache_groups",
        "hash_block_size_tokens",
        "hit_alignment_tokens",
        "retention_interval_tokens",
        "drafter",
        "kv_connector",
        "disable_lookahead_block_hashes",
        "disable_eagle_block_drop",
        "enable_mamba_shared_prefix_checkpoint",
        "mamba_prefill",
        "prefill_chunk_tokens",
        "decode_steps",
        "shared_prefix_tokens",
        "requests",
        "workload",
        # Documents that embed a scenario (corpus entries, campaign findings)
        # may carry these; they are not part of the scenario value.
        "expect",
        "notes",
        "finding",
    }
)


def _require_int(value: object, where: str, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ScenarioError(where, value, f"an integer >= {minimum}")


def _expect_mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ScenarioError(where, value, "a JSON object")
    return value


def _expect_list(value: object, where: str) -> Sequence[Any]:
    if not isinstance(value, list):
        raise ScenarioError(where, value, "a JSON list")
    return value


def _required(obj: Mapping[str, Any], key: str, prefix: str) -> Any:
    if key not in obj:
        raise ScenarioError(f"{prefix}{key}", None, "a value (the field is required)")
    return obj[key]


def _reject_unknown(obj: Mapping[str, Any], known: frozenset[str] | set[str], prefix: str) -> None:
    for key in obj:
        if key not in known:
            raise ScenarioError(
                f"{prefix}{key}",
                obj[key],
                f"no such field; known fields: {', '.join(sorted(known))}",
            )


def _enum(enum: type[_E], value: object, where: str) -> _E:
    try:
        return enum(value)  # type: ignore[arg-type]  # any JSON value: a wrong one raises
    except ValueError:
        raise ScenarioError(where, value, _allowed_enum(enum)) from None


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ScenarioError(where, value, "a string")
    return value


_GROUP_KEYS = frozenset(
    {
        "kind",
        "block_size_tokens",
        "sliding_window_tokens",
        "attention_chunk_size_tokens",
        "is_eagle_group",
    }
)


def _group_dict(g: KVCacheGroup) -> dict[str, Any]:
    """A group's JSON form; the chunk size and the draft mark only when set,
    so files written before those fields existed stay byte-identical."""
    data: dict[str, Any] = {
        "kind": g.kind.value,
        "block_size_tokens": g.block_size_tokens,
        "sliding_window_tokens": g.sliding_window_tokens,
    }
    if g.attention_chunk_size_tokens is not None:
        data["attention_chunk_size_tokens"] = g.attention_chunk_size_tokens
    if g.is_eagle_group:
        data["is_eagle_group"] = True
    return data


def _group_from(raw: object, where: str) -> KVCacheGroup:
    obj = _expect_mapping(raw, where)
    _reject_unknown(obj, _GROUP_KEYS, f"{where}.")
    return KVCacheGroup(
        kind=_enum(GroupKind, _required(obj, "kind", f"{where}."), f"{where}.kind"),
        block_size_tokens=_required(obj, "block_size_tokens", f"{where}."),
        sliding_window_tokens=obj.get("sliding_window_tokens"),
        attention_chunk_size_tokens=obj.get("attention_chunk_size_tokens"),
        is_eagle_group=obj.get("is_eagle_group", False),
    )


def _request_from(raw: object, where: str) -> RequestSpec:
    obj = _expect_mapping(raw, where)
    _reject_unknown(obj, {"name", "shares_with", "divergence_tokens", "suffix_tokens"}, f"{where}.")
    return RequestSpec(
        divergence_tokens=_required(obj, "divergence_tokens", f"{where}."),
        suffix_tokens=_required(obj, "suffix_tokens", f"{where}."),
        shares_with=obj.get("shares_with"),
        name=obj.get("name"),
    )


def scenario_to_dict(s: Scenario) -> dict[str, Any]:
    """The canonical, versioned JSON-ready form (every field present, except
    ``enable_mamba_shared_prefix_checkpoint``, written only when true)."""
    data: dict[str, Any] = {
        "format": SCENARIO_FORMAT,
        "version": SCENARIO_VERSION,
        "name": s.name,
        "description": s.description,
        "kv_cache_groups": [_group_dict(g) for g in s.kv_cache_groups],
        "hash_block_size_tokens": s.hash_block_size_tokens,
        "hit_alignment_tokens": s.hit_alignment_tokens,
        "retention_interval_tokens": s.retention_interval_tokens,
        "drafter": {
            "kind": s.drafter.kind.value,
            "num_speculative_tokens": s.drafter.num_speculative_tokens,
        },
        "kv_connector": s.kv_connector,
        "disable_lookahead_block_hashes": s.disable_lookahead_block_hashes,
        "disable_eagle_block_drop": s.disable_eagle_block_drop,
        "prefill_chunk_tokens": s.prefill_chunk_tokens,
        "decode_steps": s.decode_steps,
        "shared_prefix_tokens": s.shared_prefix_tokens,
        "requests": [
            {
                "name": r.name,
                "shares_with": r.shares_with,
                "divergence_tokens": r.divergence_tokens,
                "suffix_tokens": r.suffix_tokens,
            }
            for r in s.requests
        ],
    }
    if s.enable_mamba_shared_prefix_checkpoint:
        data["enable_mamba_shared_prefix_checkpoint"] = True
    if s.mamba_prefill is not MambaPrefill.SCHEDULER:
        data["mamba_prefill"] = s.mamba_prefill.value
    if s.workload != Workload():
        data["workload"] = s.workload.to_dict()
    return data


def scenario_fields(data: object) -> dict[str, Any]:
    """The keyword arguments of :class:`Scenario` a JSON form gives.

    Raises:
        ScenarioError: on a wrong format or version, an unknown or missing
            key, a value of the wrong type, or an invalid combination.
    """
    obj = _expect_mapping(data, "scenario")
    _reject_unknown(obj, _TOP_KEYS, "")
    fmt = obj.get("format", SCENARIO_FORMAT)
    if fmt != SCENARIO_FORMAT:
        raise ScenarioError("format", fmt, repr(SCENARIO_FORMAT))
    version = obj.get("version", SCENARIO_VERSION)
    if version != SCENARIO_VERSION:
        raise ScenarioError("version", version, str(SCENARIO_VERSION))
    groups_raw = _expect_list(_required(obj, "kv_cache_groups", ""), "kv_cache_groups")
    groups = tuple(_group_from(g, f"kv_cache_groups[{i}]") for i, g in enumerate(groups_raw))
    drafter_raw = _expect_mapping(obj.get("drafter", {"kind": "none"}), "drafter")
    _reject_unknown(drafter_raw, {"kind", "num_speculative_tokens"}, "drafter.")
    drafter = Drafter(
        kind=_enum(DrafterKind, drafter_raw.get("kind", "none"), "drafter.kind"),
        num_speculative_tokens=drafter_raw.get("num_speculative_tokens", 0),
    )
    requests_raw = _expect_list(_required(obj, "requests", ""), "requests")
    requests = tuple(_request_from(r, f"requests[{i}]") for i, r in enumerate(requests_raw))
    return dict(
        kv_cache_groups=groups,
        requests=requests,
        shared_prefix_tokens=_required(obj, "shared_prefix_tokens", ""),
        retention_interval_tokens=obj.get("retention_interval_tokens"),
        hash_block_size_tokens=obj.get("hash_block_size_tokens"),
        hit_alignment_tokens=obj.get("hit_alignment_tokens"),
        drafter=drafter,
        kv_connector=obj.get("kv_connector", False),
        disable_lookahead_block_hashes=obj.get("disable_lookahead_block_hashes", False),
        disable_eagle_block_drop=obj.get("disable_eagle_block_drop", False),
        prefill_chunk_tokens=obj.get("prefill_chunk_tokens", 2048),
        decode_steps=obj.get("decode_steps", 0),
        name=_string(obj.get("name", ""), "name"),
        description=_string(obj.get("description", ""), "description"),
        enable_mamba_shared_prefix_checkpoint=obj.get(
            "enable_mamba_shared_prefix_checkpoint", False
        ),
        mamba_prefill=_enum(MambaPrefill, obj.get("mamba_prefill", "scheduler"), "mamba_prefill"),
        workload=_workload_from(obj.get("workload", {})),
    )


def json_data(text: str, *, source: str | None = None) -> object:
    """Parse JSON text; ``source`` (a file name) is added to error messages.

    Raises:
        ScenarioError: malformed or absurdly deeply nested JSON (field
            ``<json>``).
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScenarioError(
            "<json>",
            f"line {exc.lineno} column {exc.colno}",
            f"valid JSON ({exc.msg})",
            source=source,
        ) from None
    except RecursionError:
        raise ScenarioError(
            "<json>",
            "arrays or objects nested too deep to parse",
            "JSON nested at most a few hundred levels (a scenario needs 3)",
            source=source,
        ) from None

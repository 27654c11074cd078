"""Model descriptions: a model's attention layers, for model-level scenarios.

Instead of listing KV cache groups, a scenario may name a model description
(``"model": "<path>"``, relative to the scenario file). kvfuzz then builds one
vLLM ``KVCacheSpec`` per layer and lets vLLM's own planner group the layers,
unify their page sizes and choose the block sizes, hash block size and hit
alignment, as an engine start does (:mod:`differential.driver.planner`).

A description holds numbers only (layer counts, KV heads, head sizes, dtypes,
windows, chunk sizes, Mamba state shapes), written from a model's public
config; nothing is downloaded. This module does not import vLLM.

JSON form (``format`` ``kvfuzz.model``, ``version`` 1)::

    {"format": "kvfuzz.model", "version": 1, "name": "...",
     "description": "...", "block_size_tokens": 16,
     "kv_cache_layout": "LBNHC", "mamba_block_size_tokens": null,
     "tensor_parallel_size": 1,
     "layers": [{"kind": "sliding_window", "count": 5, "num_kv_heads": 8,
                 "head_size": 256, "dtype": "bfloat16",
                 "sliding_window_tokens": 1024}, ...]}

Units: ``_tokens`` fields are tokens; ``head_size`` is elements per head;
Mamba state shapes are elements.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from differential.errors import ScenarioError
from differential.scenario._errors import scenario_error
from differential.scenario.groups import GroupKind

__all__ = [
    "DTYPES",
    "KV_CACHE_LAYOUTS",
    "MAX_HEADS",
    "MAX_LAYERS",
    "MODEL_FORMAT",
    "LayerDocument",
    "LayerSpec",
    "ModelDescription",
    "ModelDocument",
    "model_scenario_parts",
    "model_schema",
]

MODEL_FORMAT: Final = "kvfuzz.model"

#: Most layers a description may list, target and drafter together (the
#: largest public models have a few hundred).
MAX_LAYERS: Final = 4096

_Dtype = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "uint8"]
_Layout = Literal["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]

#: dtype names a layer may use (``torch`` attribute names).
DTYPES: tuple[str, ...] = get_args(_Dtype)

#: vLLM ``KVCacheLayout`` names (vllm/v1/kv_cache_layout.py): ``LB...``
#: layouts keep layers outermost (the planner unifies page sizes by scaling
#: block sizes); ``BL...``/``BH...`` are block-outermost (the planner packs
#: mixed page sizes, as DeepSeek-V4 runs by default).
KV_CACHE_LAYOUTS: tuple[str, ...] = get_args(_Layout)

_Positive = Annotated[StrictInt, Field(ge=1)]

#: The most KV heads, and elements per head, a layer may have (2**16).
#: vLLM's planner takes any positive int (vllm/v1/kv_cache_interface.py,
#: ``AttentionSpec``), but a layer's page is their product, and unifying the
#: page sizes multiplies block sizes by the ratio of pages: a 2**64-head layer
#: surfaced as a 2**65-token block of a derived group, blamed on the scenario
#: file after vLLM's import. Real models have at most a few hundred of each
#: (MLA's 576 elements per head).
MAX_HEADS: Final = 1 << 16
_Heads = Annotated[StrictInt, Field(ge=1, le=MAX_HEADS)]

#: The largest size in tokens a file may give a block, window, chunk,
#: interval or drafter (2**24, four times the default --max-tokens): a larger
#: one is refused naming its own field, not a rule it breaks downstream (a
#: 2**64-token block made every retention interval "not a multiple").
MAX_SIZE_TOKENS: Final = 1 << 24
#: A size in tokens, 1..MAX_SIZE_TOKENS.
Size = Annotated[StrictInt, Field(ge=1, le=MAX_SIZE_TOKENS)]
#: A size in tokens that may be 0, 0..MAX_SIZE_TOKENS.
SizeOrZero = Annotated[StrictInt, Field(ge=0, le=MAX_SIZE_TOKENS)]


def _exact_int(value: object) -> object:
    """Refuse what only compares equal to an integer (``1.0``, ``true``)."""
    if isinstance(value, (bool, float)):
        raise ValueError("an integer, not a float or boolean")
    return value


#: A format's ``version``: exactly the integer 1 (``1.0`` and ``true``, equal
#: to 1 in Python, are refused).
FormatVersion = Annotated[Literal[1], BeforeValidator(_exact_int)]
_CONFIG = ConfigDict(extra="forbid", frozen=True, from_attributes=True)


class LayerDocument(BaseModel):
    """``count`` consecutive identical layers of a model (one JSON layer entry)."""

    model_config = _CONFIG

    kind: GroupKind = Field(description="The layers' attention type.")
    count: _Positive = Field(default=1, description="How many such layers.")
    num_kv_heads: _Heads = Field(
        default=1, description="KV heads per layer (MLA: 1), at most 65536."
    )
    head_size: _Heads = Field(
        default=128,
        description="Elements per head (MLA: latent rank plus rope dimension), at most 65536.",
    )
    dtype: _Dtype = Field(default="bfloat16", description="The KV cache dtype (torch name).")
    sliding_window_tokens: Size | None = Field(
        default=None,
        description="The window, in tokens (sliding-window kinds; rswa: its rswa_window).",
    )
    attention_chunk_size_tokens: Size | None = Field(
        default=None, description="The chunk, in tokens (chunked_local_attention only)."
    )
    block_size_tokens: Size | None = Field(
        default=None,
        description="The layer's own block size, in tokens, when its attention backend fixes "
        "one; null: the model's block_size_tokens.",
    )
    tokens_per_state: Size = Field(
        default=1, description="Tokens one stored state covers (compressed MLA); 1 otherwise."
    )
    mamba_state_shapes: tuple[tuple[_Positive, ...], ...] = Field(
        default=(), description="Mamba / linear-attention state shapes, in elements (mamba only)."
    )
    mamba_state_dtypes: tuple[_Dtype, ...] = Field(
        default=(), description="One dtype per state shape (mamba only)."
    )
    draft: StrictBool = Field(
        default=False, description="The layers belong to the drafter (vLLM KVCacheSpec.is_draft)."
    )
    hidden_state: StrictBool = Field(
        default=False,
        description="The layers cache hidden states, not KV (vLLM's extract_hidden_states: "
        "HiddenStateCacheSpec, one num_kv_heads x head_size entry per token, planned in a "
        "group of its own); mla only.",
    )


class ModelDocument(BaseModel):
    """A kvfuzz model description: a model's attention layers, target and
    drafter, as vLLM's planner sees them."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, from_attributes=True, title="kvfuzz model description"
    )

    format: Literal["kvfuzz.model"] = Field(
        default=MODEL_FORMAT, description="Always 'kvfuzz.model'."
    )
    version: FormatVersion = Field(default=1, description="The format version.")
    name: StrictStr = Field(default="", description="A short identifier.")
    description: StrictStr = Field(default="", description="What the numbers are taken from.")
    block_size_tokens: Size = Field(
        default=16,
        description="CacheConfig.block_size, in tokens (before the planner unifies page sizes).",
    )
    kv_cache_layout: _Layout = Field(
        default="LBNHC", description="CacheConfig.kv_cache_layout (vLLM KVCacheLayout)."
    )
    mamba_block_size_tokens: Size | None = Field(
        default=None,
        description="The Mamba block size, in tokens; null: the model's block_size_tokens.",
    )
    tensor_parallel_size: Annotated[StrictInt, Field(ge=1, le=1024)] = Field(
        default=1,
        description="ParallelConfig.tensor_parallel_size: the planner plans one rank of that "
        "many; the layers' numbers are one rank's (KV heads after the split).",
    )
    layers: Annotated[tuple[LayerDocument, ...], Field(min_length=1)] = Field(
        description="The layers, target and drafter, in order."
    )


@cache
def model_schema() -> dict[str, Any]:
    """The JSON Schema of a model description file."""
    return ModelDocument.model_json_schema()


@cache
def _layer_schema() -> dict[str, Any]:
    return LayerDocument.model_json_schema()


@dataclass(frozen=True)
class LayerSpec:
    """``count`` consecutive identical layers of a model.

    Attributes:
        kind: the layer's attention type (:class:`GroupKind`).
        count: how many such layers, >= 1.
        num_kv_heads: KV heads per layer (MLA: 1 latent head), 1..``MAX_HEADS``.
        head_size: elements per head (MLA: latent rank plus rope dimension),
            1..``MAX_HEADS``.
        dtype: KV cache dtype name (:data:`DTYPES`).
        sliding_window_tokens: the window (sliding-window kinds only).
        attention_chunk_size_tokens: the chunk (chunked local attention only).
        block_size_tokens: the layer's own block size when its attention
            backend fixes one (e.g. DeepSeek-V4's compressed caches);
            ``None``: the model's ``block_size_tokens``.
        tokens_per_state: tokens one stored state covers (compressed MLA);
            1 for plain attention.
        mamba_state_shapes: Mamba / linear-attention state shapes, elements
            (Mamba only).
        mamba_state_dtypes: one dtype name per state (Mamba only).
        draft: the layer belongs to the drafter (vLLM ``KVCacheSpec.is_draft``).
        hidden_state: the layer caches hidden states for vLLM's hidden-state
            extraction (``CacheOnlyAttentionLayer``,
            vllm/model_executor/models/extract_hidden_states.py: a
            ``HiddenStateCacheSpec``, an MLA spec of ``num_kv_heads`` (the
            layers extracted) x ``head_size`` (the hidden size) elements a
            token); ``kind`` must be MLA.
    """

    kind: GroupKind
    count: int = 1
    num_kv_heads: int = 1
    head_size: int = 128
    dtype: str = "bfloat16"
    sliding_window_tokens: int | None = None
    attention_chunk_size_tokens: int | None = None
    block_size_tokens: int | None = None
    tokens_per_state: int = 1
    mamba_state_shapes: tuple[tuple[int, ...], ...] = ()
    mamba_state_dtypes: tuple[str, ...] = ()
    draft: bool = False
    hidden_state: bool = False

    def validate(self, where: str) -> None:
        """Check the layer: each field's type and range (:class:`LayerDocument`),
        then the rules between fields.

        Raises:
            ScenarioError: naming ``where`` and the field.
        """
        try:
            LayerDocument.model_validate(self, from_attributes=True, strict=True)
        except ValidationError as exc:
            raise scenario_error(exc, _layer_schema(), prefix=where, python=True) from None
        self._check_kind(where)

    def _check_kind(self, where: str) -> None:
        """The fields each kind needs, and those it must leave empty."""
        if self.kind is GroupKind.SINK_FULL_ATTENTION:
            raise ScenarioError(
                f"{where}.kind",
                self.kind.value,
                "a kind other than sink_full_attention (a layer has no sink length here: "
                "write the scenario's kv_cache_groups with sink_len_tokens instead)",
            )
        if self.kind.windowed:
            if self.sliding_window_tokens is None:
                raise ScenarioError(f"{where}.sliding_window_tokens", None, "an integer >= 1")
        elif self.sliding_window_tokens is not None:
            raise ScenarioError(
                f"{where}.sliding_window_tokens", self.sliding_window_tokens, "null"
            )
        if self.kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
            if self.attention_chunk_size_tokens is None:
                raise ScenarioError(f"{where}.attention_chunk_size_tokens", None, "an integer >= 1")
        elif self.attention_chunk_size_tokens is not None:
            raise ScenarioError(
                f"{where}.attention_chunk_size_tokens", self.attention_chunk_size_tokens, "null"
            )
        if self.hidden_state and (self.kind is not GroupKind.MLA or self.tokens_per_state != 1):
            raise ScenarioError(
                f"{where}.hidden_state",
                True,
                "false, or true on an mla layer with tokens_per_state 1 (vLLM's "
                "HiddenStateCacheSpec is an MLA spec)",
            )
        if self.kind is GroupKind.MAMBA:
            if not self.mamba_state_shapes or len(self.mamba_state_shapes) != len(
                self.mamba_state_dtypes
            ):
                raise ScenarioError(
                    f"{where}.mamba_state_shapes",
                    [list(s) for s in self.mamba_state_shapes],
                    "one or more shapes, one per mamba_state_dtypes entry",
                )
            if self.draft:
                raise ScenarioError(f"{where}.draft", True, "false for mamba layers")
        elif self.mamba_state_shapes or self.mamba_state_dtypes:
            raise ScenarioError(f"{where}.mamba_state_shapes", "set", "empty for attention layers")


@dataclass(frozen=True)
class ModelDescription:
    """A model's attention layers, target and drafter, as vLLM's planner sees them.

    Attributes:
        name: short identifier.
        description: what the numbers are taken from.
        block_size_tokens: ``CacheConfig.block_size``, in tokens (the
            engine's block size before the planner unifies page sizes).
        kv_cache_layout: ``CacheConfig.kv_cache_layout`` (:data:`KV_CACHE_LAYOUTS`).
        mamba_block_size_tokens: the Mamba block size in tokens (align mode:
            vLLM sets it to the attention block size); ``None``: the model's
            ``block_size_tokens``.
        tensor_parallel_size: ``ParallelConfig.tensor_parallel_size``: the
            planner plans one rank of that many (the layers' numbers are one
            rank's); it decides ``KVCacheConfig.kv_tp_replicas``.
        layers: the layers, target and drafter, in order.
    """

    name: str
    layers: tuple[LayerSpec, ...]
    block_size_tokens: int = 16
    kv_cache_layout: str = "LBNHC"
    mamba_block_size_tokens: int | None = None
    description: str = ""
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        try:
            ModelDocument.model_validate(self, from_attributes=True, strict=True)
        except ValidationError as exc:
            raise scenario_error(exc, model_schema(), prefix="model", python=True) from None
        total = 0
        for i, layer in enumerate(self.layers):
            layer._check_kind(f"model.layers[{i}]")
            # Every layer becomes a vLLM KVCacheSpec before any scenario limit
            # is checked: the layer count is bounded here, before one is built.
            total += layer.count
            if total > MAX_LAYERS:
                raise ScenarioError(
                    f"model.layers[{i}].count",
                    layer.count,
                    f"at most {MAX_LAYERS} layers in all ({total - layer.count} before this entry)",
                )

    @property
    def num_layers(self) -> int:
        """Total layers, target and drafter."""
        return sum(layer.count for layer in self.layers)

    def named_layers(self) -> tuple[tuple[str, LayerSpec], ...]:
        """Every layer with the name its KV cache spec is registered under,
        in order: target layers ``model.layers.N``, drafter layers
        ``drafter.layers.N`` (each counted from 0)."""
        named: list[tuple[str, LayerSpec]] = []
        target = draft = 0
        for layer in self.layers:
            for _ in range(layer.count):
                if layer.draft:
                    named.append((f"drafter.layers.{draft}", layer))
                    draft += 1
                else:
                    named.append((f"model.layers.{target}", layer))
                    target += 1
        return tuple(named)

    @classmethod
    def from_dict(cls, data: object) -> ModelDescription:
        """Build a description from its JSON form.

        Raises:
            ScenarioError: a wrong format or version, an unknown key or an
                invalid value, naming the field (``model.layers[2].dtype``)
                and the allowed values.
        """
        try:
            doc = ModelDocument.model_validate(data)
        except ValidationError as exc:
            raise scenario_error(exc, model_schema(), prefix="model", root="model") from None
        return cls.from_document(doc)

    @classmethod
    def from_document(cls, doc: ModelDocument) -> ModelDescription:
        """The description a checked document gives."""
        return cls(
            name=doc.name,
            description=doc.description,
            block_size_tokens=doc.block_size_tokens,
            kv_cache_layout=doc.kv_cache_layout,
            mamba_block_size_tokens=doc.mamba_block_size_tokens,
            tensor_parallel_size=doc.tensor_parallel_size,
            layers=tuple(LayerSpec(**dict(layer)) for layer in doc.layers),
        )

    @classmethod
    def load(cls, path: Path) -> ModelDescription:
        """Read a description file.

        Raises:
            ScenarioError: unreadable or invalid file, naming it.
        """
        from differential.files import json_data, read_regular_file

        raw = read_regular_file(path, "model")  # a FIFO is refused, not waited on
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ScenarioError(
                "model", str(path), f"a readable model description ({exc})"
            ) from None
        data = json_data(text, source=str(path))
        try:
            return cls.from_dict(data)
        except ScenarioError as exc:
            raise exc.with_source(str(path)) from None


def model_scenario_parts(
    data: Mapping[str, Any], base: Path
) -> tuple[ModelDescription, dict[str, Any]]:
    """A model-level scenario's description and its other fields, checked as
    far as they can be before vLLM's planner lays out the groups (so a
    missing description file or a refused field is named before vLLM is
    imported).

    ``data["model"]`` is a description file path relative to ``base`` (the
    scenario file's folder) or an inline description.

    Raises:
        ScenarioError: an empty path (it would name the scenario's own
            folder), an unreadable or invalid description, groups beside
            it, or a ``dcp_world_size`` other than 1 (the planner runs at one
            rank).
    """
    raw_model = data["model"]
    if raw_model == "":
        raise ScenarioError(
            "model",
            raw_model,
            "a model description's file path (relative to the scenario file's folder), "
            "not empty, or the description itself",
        )
    if isinstance(raw_model, str):
        model = ModelDescription.load(base / raw_model)
    else:
        model = ModelDescription.from_dict(raw_model)
    body = {k: v for k, v in data.items() if k != "model"}
    if "kv_cache_groups" in body:
        raise ScenarioError("kv_cache_groups", body["kv_cache_groups"], "absent with a model")
    if body.get("dcp_world_size", 1) != 1:
        # The planner runs at one rank here; a sharded layout is given as groups.
        raise ScenarioError(
            "dcp_world_size",
            body["dcp_world_size"],
            "1 with a model (vLLM's planner is run at one rank: give kv_cache_groups, "
            "with the sharded block sizes, for decode context parallelism)",
        )
    return model, body

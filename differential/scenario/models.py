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
     "layers": [{"kind": "sliding_window", "count": 5, "num_kv_heads": 8,
                 "head_size": 256, "dtype": "bfloat16",
                 "sliding_window_tokens": 1024}, ...]}

Units: ``_tokens`` fields are tokens; ``head_size`` is elements per head;
Mamba state shapes are elements.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from differential.errors import ScenarioError
from differential.scenario import GroupKind

__all__ = ["DTYPES", "KV_CACHE_LAYOUTS", "MODEL_FORMAT", "LayerSpec", "ModelDescription"]

MODEL_FORMAT = "kvfuzz.model"

#: dtype names a layer may use (``torch`` attribute names).
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "uint8")

#: vLLM ``KVCacheLayout`` names (vllm/v1/kv_cache_layout.py): ``LB...``
#: layouts keep layers outermost (the planner unifies page sizes by scaling
#: block sizes); ``BL...``/``BH...`` are block-outermost (the planner packs
#: mixed page sizes, as DeepSeek-V4 runs by default).
KV_CACHE_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")

_LAYER_KEYS = frozenset(
    {
        "kind",
        "count",
        "num_kv_heads",
        "head_size",
        "dtype",
        "sliding_window_tokens",
        "attention_chunk_size_tokens",
        "block_size_tokens",
        "tokens_per_state",
        "mamba_state_shapes",
        "mamba_state_dtypes",
        "draft",
    }
)
_MODEL_KEYS = frozenset(
    {
        "format",
        "version",
        "name",
        "description",
        "block_size_tokens",
        "kv_cache_layout",
        "mamba_block_size_tokens",
        "layers",
    }
)


@dataclass(frozen=True)
class LayerSpec:
    """``count`` consecutive identical layers of a model.

    Attributes:
        kind: the layer's attention type (:class:`GroupKind`).
        count: how many such layers, >= 1.
        num_kv_heads: KV heads per layer (MLA: 1 latent head).
        head_size: elements per head (MLA: latent rank plus rope dimension).
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

    def validate(self, where: str) -> None:
        """Raise :class:`ScenarioError` naming ``where`` if the layer is invalid."""
        if not isinstance(self.kind, GroupKind):
            raise ScenarioError(f"{where}.kind", self.kind, "a group kind")
        for name in ("count", "num_kv_heads", "head_size", "tokens_per_state"):
            _positive(getattr(self, name), f"{where}.{name}")
        if self.block_size_tokens is not None:
            _positive(self.block_size_tokens, f"{where}.block_size_tokens")
        if self.dtype not in DTYPES:
            raise ScenarioError(f"{where}.dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        if self.kind.sliding_window_family:
            _positive(self.sliding_window_tokens, f"{where}.sliding_window_tokens")
        elif self.sliding_window_tokens is not None:
            raise ScenarioError(
                f"{where}.sliding_window_tokens", self.sliding_window_tokens, "null"
            )
        if self.kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
            _positive(self.attention_chunk_size_tokens, f"{where}.attention_chunk_size_tokens")
        elif self.attention_chunk_size_tokens is not None:
            raise ScenarioError(
                f"{where}.attention_chunk_size_tokens", self.attention_chunk_size_tokens, "null"
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
            for shape in self.mamba_state_shapes:
                for n in shape:
                    _positive(n, f"{where}.mamba_state_shapes")
            for dtype in self.mamba_state_dtypes:
                if dtype not in DTYPES:
                    raise ScenarioError(
                        f"{where}.mamba_state_dtypes", dtype, f"one of {', '.join(DTYPES)}"
                    )
            if self.draft:
                raise ScenarioError(f"{where}.draft", True, "false for mamba layers")
        elif self.mamba_state_shapes or self.mamba_state_dtypes:
            raise ScenarioError(f"{where}.mamba_state_shapes", "set", "empty for attention layers")
        if not isinstance(self.draft, bool):
            raise ScenarioError(f"{where}.draft", self.draft, "true or false")


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
        layers: the layers, target and drafter, in order.
    """

    name: str
    layers: tuple[LayerSpec, ...]
    block_size_tokens: int = 16
    kv_cache_layout: str = "LBNHC"
    mamba_block_size_tokens: int | None = None
    description: str = ""

    def __post_init__(self) -> None:
        _positive(self.block_size_tokens, "model.block_size_tokens")
        if self.mamba_block_size_tokens is not None:
            _positive(self.mamba_block_size_tokens, "model.mamba_block_size_tokens")
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ScenarioError(
                "model.kv_cache_layout",
                self.kv_cache_layout,
                f"one of {', '.join(KV_CACHE_LAYOUTS)}",
            )
        if not self.layers:
            raise ScenarioError("model.layers", [], "a non-empty list of layers")
        for i, layer in enumerate(self.layers):
            layer.validate(f"model.layers[{i}]")

    @property
    def num_layers(self) -> int:
        """Total layers, target and drafter."""
        return sum(layer.count for layer in self.layers)

    @classmethod
    def from_dict(cls, data: object) -> ModelDescription:
        """Build a description from its JSON form.

        Raises:
            ScenarioError: a wrong format or version, an unknown key or an
                invalid value, naming the field.
        """
        if not isinstance(data, Mapping):
            raise ScenarioError("model", data, "a JSON object")
        for key in data:
            if key not in _MODEL_KEYS:
                raise ScenarioError(
                    f"model.{key}", data[key], f"no such field; known: {sorted(_MODEL_KEYS)}"
                )
        if data.get("format", MODEL_FORMAT) != MODEL_FORMAT or data.get("version", 1) != 1:
            raise ScenarioError("model.format", data.get("format"), f"{MODEL_FORMAT!r} version 1")
        layers_raw = data.get("layers")
        if not isinstance(layers_raw, list):
            raise ScenarioError("model.layers", layers_raw, "a JSON list")
        return cls(
            name=str(data.get("name", "")),
            description=str(data.get("description", "")),
            block_size_tokens=data.get("block_size_tokens", 16),
            kv_cache_layout=data.get("kv_cache_layout", "LBNHC"),
            mamba_block_size_tokens=data.get("mamba_block_size_tokens"),
            layers=tuple(
                _layer_from(raw, f"model.layers[{i}]") for i, raw in enumerate(layers_raw)
            ),
        )

    @classmethod
    def load(cls, path: Path) -> ModelDescription:
        """Read a description file.

        Raises:
            ScenarioError: unreadable or invalid file, naming it.
        """
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ScenarioError(
                "model", str(path), f"a readable model description ({exc})"
            ) from None
        try:
            return cls.from_dict(data)
        except ScenarioError as exc:
            raise exc.with_source(str(path)) from None


def _positive(value: object, where: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ScenarioError(where, value, "an integer >= 1")


def _layer_from(raw: object, where: str) -> LayerSpec:
    if not isinstance(raw, Mapping):
        raise ScenarioError(where, raw, "a JSON object")
    for key in raw:
        if key not in _LAYER_KEYS:
            raise ScenarioError(
                f"{where}.{key}", raw[key], f"no such field; known: {sorted(_LAYER_KEYS)}"
            )
    try:
        kind = GroupKind(raw.get("kind"))  # type: ignore[arg-type]  # a non-string raises
    except ValueError:
        raise ScenarioError(
            f"{where}.kind", raw.get("kind"), ", ".join(k.value for k in GroupKind)
        ) from None
    shapes: Any = raw.get("mamba_state_shapes", [])
    if not isinstance(shapes, list) or not all(isinstance(s, list) for s in shapes):
        raise ScenarioError(f"{where}.mamba_state_shapes", shapes, "a list of shapes (lists)")
    return LayerSpec(
        kind=kind,
        count=raw.get("count", 1),
        num_kv_heads=raw.get("num_kv_heads", 1),
        head_size=raw.get("head_size", 128),
        dtype=raw.get("dtype", "bfloat16"),
        sliding_window_tokens=raw.get("sliding_window_tokens"),
        attention_chunk_size_tokens=raw.get("attention_chunk_size_tokens"),
        block_size_tokens=raw.get("block_size_tokens"),
        tokens_per_state=raw.get("tokens_per_state", 1),
        mamba_state_shapes=tuple(tuple(s) for s in shapes),
        mamba_state_dtypes=tuple(raw.get("mamba_state_dtypes", [])),
        draft=raw.get("draft", False),
    )

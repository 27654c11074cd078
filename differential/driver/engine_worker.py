"""A long-lived worker that runs scenarios on vLLM's real engine (``vllm.LLM``).

Started by :mod:`differential.driver.engine_mode` with the engine
environment's Python (``.engine-venv``, vLLM's CPU build), it serves plans
over JSON lines exactly like the tree worker (:mod:`differential.driver.worker`,
protocol version 1, the same envelope):

* in ``{"v": 1, "op": "hello"}`` -> out ``{"v": 1, "vllm_version": ...,
  "torch_version": ..., "capabilities": {...}}``
* in ``{"v": 1, "op": "run", "plan": {...}}`` -> out ``{"v": 1, "run": {...}}``
  (the plan and the run are described by :func:`run_plan`)
* a failure of kvfuzz's own worker code -> out ``{"v": 1, "internal_error":
  MESSAGE, "traceback": TEXT}``

This module imports nothing of kvfuzz at import time and no kvfuzz module
that imports kvfuzz's own vLLM (0.33.0): the plan is plain data built by the
parent. Only ``hello`` imports :mod:`differential.driver.features` to detect,
from the engine's own vLLM code, the features the oracle needs to know, and
a plan with a ``variant`` imports that variant's patch module
(:mod:`~differential.driver.fixes`, :mod:`~differential.driver.candidate`,
:mod:`~differential.driver.mutations`: thin wrappers around the engine's own
vLLM classes, which import no manager driver) and runs the engine, built and
served, inside its context (:func:`_variant_patches`).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): an
``LLMEngine`` stepped one ``EngineCore.step`` at a time, so a scenario's
arrival steps are engine steps. Prompts are token ids (``TokensPrompt``,
``skip_tokenizer_init=True``), weights are dummy (``load_format="dummy"``)
then re-drawn deterministically per parameter name (:func:`_redraw_weights`:
vLLM's dummy weights, uniform in +-1e-3, make every next-token distribution
uniform and greedy outputs ties), and sampling is greedy with logprobs.
Engines are kept (at most two, e.g. cache on and cache off) and reused across
plans with the same engine arguments after ``LLM.reset_prefix_cache()``.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import inspect
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from differential.driver.engine_breakages import MAMBA_BREAKAGES, MambaBreakage
from differential.driver.protocol import (
    ProtocolError,
    die_with_parent,
    serve,
    take_protocol_stdout,
)
from differential.stale import remove_stale

_MAX_ENGINES = 2

#: Steps in a row that schedule no token, with requests unfinished, after
#: which a run is a stall (the scheduler-mode driver's limit).
_MAX_IDLE_STEPS = 64

#: The engine's own settings, before vLLM is imported.
_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

_VOCAB = 1024


class PlanError(Exception):
    """The plan asks for something this engine cannot run (an *unsupported* run)."""


class RetryInFreshWorker(Exception):
    """Starting an engine failed in a worker that had started others: the
    parent reruns the plan in a fresh worker."""


class EngineStartError(Exception):
    """``vllm.LLM(...)`` raised in a fresh worker: the run's error (a crash)."""


# ------------------------------------------------------------------ model configs


def _llama_config(layer_types: list[str], sliding_window: int | None) -> dict[str, Any]:
    """A tiny Llama target (vocab 1024, hidden 64, head dim 32, one KV head).

    vLLM's ``LlamaForCausalLM`` reads ``layer_types`` and ``sliding_window``
    (vllm/model_executor/models/llama.py), so each scenario group becomes one
    layer of its kind and vLLM's planner makes one KV cache group per layer.
    """
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if "sliding_attention" in layer_types:
        config["sliding_window"] = sliding_window
        config["layer_types"] = layer_types
    return config


def _mimo_v2_config(
    layer_types: list[str], sliding_window: int, kv_heads: dict[str, int]
) -> dict[str, Any]:
    """A tiny dense MiMo-V2-Flash (vllm/model_executor/models/mimo_v2.py): one
    layer per entry of ``layer_types`` (``hybrid_layer_pattern`` 1 for
    ``sliding_attention``, window ``sliding_window`` tokens), head size 32,
    ``kv_heads[layer type]`` KV heads (``swa_num_key_value_heads`` /
    ``num_key_value_heads``; as many query heads, at least two), no MoE layer
    (``moe_layer_freq`` all 0). Layers with fewer KV bytes per token get a
    proportionally larger block from vLLM's planner."""
    full, sliding = kv_heads["full_attention"], kv_heads["sliding_attention"]
    return {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "llama",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": max(2, full),
        "num_key_value_heads": full,
        "head_dim": 32,
        "swa_num_attention_heads": max(2, sliding),
        "swa_num_key_value_heads": sliding,
        "swa_head_dim": 32,
        "sliding_window_size": sliding_window,
        "hybrid_layer_pattern": [int(t == "sliding_attention") for t in layer_types],
        "moe_layer_freq": [0] * len(layer_types),
        "hidden_act": "silu",
        "layernorm_epsilon": 1e-05,
        "attention_bias": False,
        "rope_theta": 10000.0,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _llama4_config(layer_types: list[str], attention_chunk_size: int) -> dict[str, Any]:
    """A tiny dense Llama-4 text model (vllm/model_executor/models/llama4.py,
    ``Llama4ForCausalLM``; vocab 1024, hidden 64, head dim 32, one KV head):
    one layer per entry of ``layer_types``, a ``chunked_attention`` layer
    using RoPE and ``ChunkedLocalAttention`` of ``attention_chunk_size``
    tokens, a ``full_attention`` layer NoPE and full attention
    (``no_rope_layers`` 1 / 0), no MoE layer (``interleave_moe_layer_step``
    above the layer count)."""
    config = _llama_config(["full_attention"] * len(layer_types), None)
    config.update(
        architectures=["Llama4ForCausalLM"],
        model_type="llama4_text",
        intermediate_size_mlp=128,
        attention_chunk_size=attention_chunk_size,
        no_rope_layers=[int(t == "chunked_attention") for t in layer_types],
        interleave_moe_layer_step=len(layer_types) + 1,
        moe_layers=[],
        num_local_experts=1,
        num_experts_per_tok=1,
        use_qk_norm=False,
        attn_temperature_tuning=False,
    )
    return config


def _plamo3_config(layer_types: list[str], windows: list[int | None]) -> dict[str, Any]:
    """A tiny Plamo 3 (vllm/model_executor/models/plamo3.py) on the tiny Llama's
    shape (:func:`_llama_config`): layer ``i`` of type ``layer_types[i]``
    with sliding window ``windows[i]`` tokens (``None`` on full-attention
    layers), which vLLM's ``Plamo3AttentionMixer`` reads from
    ``config.interleaved_sliding_window``; the sliding layers' RoPE base is
    ``rope_local_theta``."""
    config = _llama_config(layer_types, None)
    config["architectures"] = ["Plamo3ForCausalLM"]
    config["interleaved_sliding_window"] = windows
    config["rope_local_theta"] = 10000.0
    return config


def _gemma4_config(
    layer_types: list[str], sliding_window: int, kv_heads: list[int]
) -> dict[str, Any]:
    """A tiny dense Gemma 4 (vllm/model_executor/models/gemma4.py): one layer per
    entry of ``layer_types`` (window ``sliding_window`` tokens on
    ``sliding_attention`` layers; the last must be ``full_attention``, which
    ``Gemma4TextConfig`` forces), head size 32 on every layer, ``kv_heads[i]``
    KV heads on layer ``i`` through ``per_layer_config`` (which
    ``Gemma4DecoderLayer`` reads), as many query heads as the least common
    multiple of them (at least two), no MoE block, no per-layer inputs, no
    KV-shared layers, no bidirectional attention (which would halve the
    window). One head size keeps vLLM's CPU attention backend
    (vllm/model_executor/models/config.py, ``Gemma4Config`` picks another
    backend for mixed head sizes); layers with fewer KV bytes per token get a
    proportionally larger block from vLLM's planner."""
    per_layer = {str(i): {"head_dim": 32, "num_key_value_heads": h} for i, h in enumerate(kv_heads)}
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": _VOCAB,
        "vocab_size_per_layer_input": _VOCAB,
        "hidden_size": 64,
        "hidden_size_per_layer_input": 0,
        "intermediate_size": 128,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": max(2, math.lcm(*kv_heads)),
        "num_key_value_heads": 1,
        "head_dim": 32,
        "per_layer_config": per_layer,
        "layer_types": layer_types,
        "sliding_window": sliding_window,
        "use_bidirectional_attention": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"sliding_attention": rope, "full_attention": dict(rope)},
        "attention_k_eq_v": False,
        "num_kv_shared_layers": 0,
        "enable_moe_block": False,
        "final_logit_softcapping": None,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _nemotron_h_config(pattern: str) -> dict[str, Any]:
    """A tiny NemotronH (Mamba2 hybrid): ``pattern`` is vLLM's
    ``hybrid_override_pattern`` (``M`` Mamba2, ``*`` attention, ``-`` MLP;
    vllm/model_executor/models/nemotron_h.py)."""
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": _VOCAB,
        "hidden_size": 128,
        "hybrid_override_pattern": pattern,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 65536,
        "intermediate_size": 256,
        "mlp_hidden_act": "relu2",
        "ssm_state_size": 16,
        "mamba_num_heads": 4,
        "mamba_head_dim": 32,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 1,
        "chunk_size": 128,
        "use_conv_bias": True,
        "mamba_proj_bias": False,
        "mamba_hidden_act": "silu",
        "layer_norm_epsilon": 1e-05,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def _eagle_config(num_target_layers: int, eagle3: bool, kv_heads: int = 1) -> dict[str, Any]:
    """A one-layer EAGLE (or EAGLE-3) draft model for the tiny target.

    EAGLE-3 reads three auxiliary hidden states of the target; with a tiny
    target vLLM's default layer ids collapse (llama_eagle3.py
    ``combine_hidden_states`` then fails), so they are given explicitly. The
    draft layer has ``kv_heads`` KV heads of size 32, the target's
    full-attention layers' shape, so that it joins their KV cache group.
    """
    config = _llama_config(["full_attention"], None)
    if kv_heads != 1:
        config["num_key_value_heads"] = kv_heads
        config["num_attention_heads"] = max(2, kv_heads)
    if eagle3:
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        config["draft_vocab_size"] = _VOCAB
        last = num_target_layers - 1
        config["eagle_aux_hidden_state_layer_ids"] = [1, num_target_layers // 2, last]
    return config


def _write_model(folder: Path, config: dict[str, Any]) -> str:
    """Write ``config.json`` into a folder named by its hash; returns the folder."""
    text = json.dumps(config, indent=1, sort_keys=True)
    path = folder / hashlib.sha256(text.encode()).hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(text)
    return str(path)


def _mimo_config(
    layer_types: list[str], sliding_window: int | None, mtp_modules: int
) -> dict[str, Any]:
    """A tiny MiMo (vllm/model_executor/models/mimo.py, Qwen2 layers: vocab 1024,
    hidden 64, head size 32, one KV head) with ``mtp_modules`` MTP modules
    (``num_nextn_predict_layers``). ``SpeculativeConfig.hf_config_override``
    (vllm/config/speculative.py) makes its ``method="mtp"`` draft
    ``MiMoMTPModel`` (vllm/model_executor/models/mimo_mtp.py), one Qwen2 layer
    per module with the target's KV shape. Qwen2 slides every layer or none
    (vllm/model_executor/models/qwen2.py), so the layers are all
    ``sliding_attention`` (window ``sliding_window`` tokens) or all full
    attention, and the MTP layers join them."""
    config = _llama_config(["full_attention"] * len(layer_types), None)
    config.update(
        architectures=["MiMoForCausalLM"],
        model_type="qwen2",
        rope_theta=10000.0,
        num_nextn_predict_layers=mtp_modules,
    )
    del config["rope_parameters"], config["head_dim"]
    if "sliding_attention" in layer_types:
        config.update(
            use_sliding_window=True,
            sliding_window=sliding_window,
            max_window_layers=len(layer_types),
            layer_types=layer_types,
        )
    return config


def _target_model(engine: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The tiny target's ``config.json`` for a plan's ``engine`` block and the KV
    heads an EAGLE draft layer gets to join the full-attention group with the
    smallest block (see :func:`engine_arguments`). The plan gives every
    layer: an EAGLE-3 target already has at least four (three distinct
    auxiliary layers), and the layers are balanced so that the drafter's join
    the planned groups (``_balanced_layers`` in
    differential/driver/engine_mode.py).

    Raises:
        PlanError: an architecture this worker does not build.
    """
    arch = engine["architecture"]
    drafter = engine.get("drafter") or {}
    layer_types = list(engine.get("layer_types") or [])
    if arch == "llama":
        return _llama_config(layer_types, engine.get("sliding_window")), 1
    if arch == "mimo_v2":
        target = _mimo_v2_config(layer_types, engine["sliding_window"], engine["kv_heads"])
        if drafter.get("method") == "mtp":
            # One MTP layer (vllm/model_executor/models/mimo_v2_mtp.py), a
            # sliding-window layer with the sliding-window heads.
            target["num_nextn_predict_layers"] = 1
        return target, int(engine["kv_heads"]["full_attention"])
    if arch == "mimo":
        modules = int(drafter.get("modules", 1))
        return _mimo_config(layer_types, engine["sliding_window"], modules), 1
    if arch == "gemma4":
        kv_heads = [int(h) for h in engine["kv_heads"]]
        target = _gemma4_config(layer_types, engine["sliding_window"], kv_heads)
        return target, int(engine["draft_kv_heads"])
    if arch == "plamo3":
        return _plamo3_config(layer_types, list(engine["sliding_windows"])), 1
    if arch == "llama4":
        return _llama4_config(layer_types, engine["attention_chunk_size"]), 1
    if arch == "nemotron_h":
        return _nemotron_h_config(engine["pattern"]), 1
    raise PlanError(f"no tiny model for architecture {arch!r}")


def _speculative_config(
    drafter: dict[str, Any], engine: dict[str, Any], folder: Path, draft_kv_heads: int
) -> dict[str, Any]:
    """``speculative_config`` for a plan's ``drafter``: EAGLE and EAGLE-3 with a
    one-layer draft model written beside the target, MTP with none (vLLM
    builds it from the target's config), n-gram prompt lookup.

    Raises:
        PlanError: a method this worker does not build, or MTP on a target
            without MTP layers.
    """
    method = drafter["method"]
    n = drafter["num_speculative_tokens"]
    if method in ("eagle", "eagle3"):
        num_layers = len(engine.get("layer_types") or engine.get("pattern") or "")
        draft = _write_model(folder, _eagle_config(num_layers, method == "eagle3", draft_kv_heads))
        config: dict[str, Any] = {"method": method, "model": draft, "num_speculative_tokens": n}
    elif method == "mtp":
        if engine["architecture"] not in ("mimo", "mimo_v2"):
            raise PlanError(f"no MTP layers in the tiny {engine['architecture']} model")
        config = {"method": "mtp", "num_speculative_tokens": n}
    elif method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": n,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    else:
        raise PlanError(f"no tiny drafter for method {method!r}")
    if drafter.get("disable_eagle_block_drop"):
        config["disable_eagle_block_drop"] = True
    return config


def engine_arguments(plan: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The ``vllm.LLM(...)`` keyword arguments for a plan's ``engine`` block.

    The block: ``architecture`` (``llama``, ``mimo_v2``, ``mimo``, ``gemma4``,
    ``plamo3``, ``llama4`` or ``nemotron_h``), ``layer_types`` (every
    architecture but NemotronH: ``sliding_attention`` / ``full_attention``, or
    Llama-4's ``chunked_attention``, per layer) or ``pattern`` (NemotronH),
    ``sliding_window`` (tokens), ``sliding_windows`` (Plamo 3: per layer,
    tokens or null), ``attention_chunk_size`` (Llama-4, tokens), ``kv_heads``
    (MiMo-V2-Flash: KV heads per layer type; Gemma 4: per layer) and
    ``draft_kv_heads`` (Gemma 4: the EAGLE draft layer's), ``groups`` and
    ``hash_block_size`` (the groups and hash block vLLM must make, checked by
    :func:`_check_groups`),
    ``block_size`` (tokens), ``retention`` (``prefix_cache_retention_interval``; absent:
    vLLM's default), ``prefix_match_unit`` (tokens or null), ``drafter``
    (null or ``{"method": "eagle"|"eagle3"|"mtp"|"ngram", "num_speculative_tokens": n,
    "modules": MTP modules}``), ``enable_prefix_caching``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``num_gpu_blocks_override`` (blocks or null),
    ``max_model_len`` (tokens).

    Raises:
        PlanError: an architecture or drafter this worker does not build.
    """
    engine = plan["engine"]
    target, draft_kv_heads = _target_model(engine)
    kwargs: dict[str, Any] = {
        "model": _write_model(folder, target),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "enable_prefix_caching": bool(engine["enable_prefix_caching"]),
        "block_size": engine["block_size"],
        "max_model_len": engine["max_model_len"],
        "dtype": "float32",
        "seed": 0,
        "max_num_seqs": engine["max_num_seqs"],
        "disable_log_stats": True,
    }
    if "retention" in engine:
        kwargs["prefix_cache_retention_interval"] = engine["retention"]
    if engine.get("prefix_match_unit"):
        kwargs["prefix_match_unit"] = engine["prefix_match_unit"]
    if engine.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = engine["max_num_batched_tokens"]
    if engine.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = engine["num_gpu_blocks_override"]
    kwargs.update(_kv_events_arguments(plan))
    drafter = engine.get("drafter")
    if drafter:
        kwargs["speculative_config"] = _speculative_config(drafter, engine, folder, draft_kv_heads)
    return kwargs


# ----------------------------------------------------------------------- engines


def _redraw_weights(model: Any) -> None:
    """Re-draw every weight of ``model`` from a generator seeded by its name.

    vLLM's dummy loader (vllm/model_executor/model_loader/dummy_loader.py,
    ``DummyModelLoader.load_weights``) draws uniform values in +-1e-3: RMSNorm
    weights of 1e-3 shrink every hidden state and each next-token distribution
    is uniform (logprob -ln 1024 = -6.93 for every token), so greedy outputs
    are ties and cannot show wrong KV. Here matrices get N(0, 1/fan_in)
    (embeddings N(0, 1), the LM head N(0, 9/fan_in): peaked distributions),
    norm weights 1, other vectors 0. Mamba2 layers
    (vllm/model_executor/layers/mamba/mamba_mixer2.py, ``MambaMixer2``) get
    per-head values whose memories span 10 to 10,000 tokens
    (:func:`_mamba_parameter`): their dummy values (``A`` about 0,
    convolution weights about 1e-3) left the layer's output about 0, so a
    wrong cached state moved nothing.
    The dummy loader also draws persistent buffers: Gemma 4's ``layer_scalar``
    (a checkpoint value each decoder layer's output is multiplied by,
    ``torch.ones(1)`` in vllm/model_executor/models/gemma4.py) is set back to
    1. Gemma 4's ``v_norm`` has no weight, and its ``q_norm``, ``k_norm`` and
    four layer norms multiply by their weight (``RMSNorm``), so 1 is neutral.
    It runs inside the loader, before ``process_weights_after_loading``
    repacks the weights for the CPU kernels. The same model class and
    parameter names give the same weights in every engine.
    """
    import torch

    owner = type(model).__name__
    with torch.no_grad():
        for name, param in model.named_parameters():
            seed = zlib.crc32(f"{owner}:{name}".encode())
            generator = torch.Generator().manual_seed(seed)
            mamba = _mamba_parameter(name, tuple(param.shape), generator)
            if mamba is not None:
                values = mamba
            elif param.dim() >= 2:
                fan_in = param.shape[-1]
                if "embed" in name:
                    std = 1.0
                elif "lm_head" in name:
                    std = 3.0 / fan_in**0.5
                else:
                    std = 1.0 / fan_in**0.5
                values = torch.randn(param.shape, generator=generator) * std
            elif "norm" in name:
                values = torch.ones(param.shape)
            else:
                values = torch.zeros(param.shape)
            param.data.copy_(values.to(param.dtype))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.fill_(1.0)


def _mamba_parameter(name: str, shape: tuple[int, ...], generator: Any) -> Any:
    """The value of a ``MambaMixer2`` per-head parameter named ``name``
    (vllm/model_executor/layers/mamba/mamba_mixer2.py), drawn from
    ``generator``, or ``None`` for any other parameter (drawn as a matrix,
    a norm or a bias). A head's state decays by ``exp(dt * A)`` per token and
    takes in each token scaled by ``dt``. The step ``dt`` (``dt_bias`` is its
    inverse softplus) is log-uniform in [1e-2, 1e-1] (the Mamba2 reference
    initialisation's upper decade); ``A`` (vLLM keeps ``-exp(A_log)``) spreads
    the heads' memories: head ``h`` of ``H`` gets ``A = -10 ** (-2 + 2h / (H -
    1))``, from -0.01 to -1, so the decay rates ``dt * |A|`` run from 1e-4 to
    1e-1 per token and the heads forget over about 10 to 10,000 tokens. (The
    reference's ``A`` in [-16, -1] forgets within about 100 tokens in every
    head: a wrong convolution state three tokens long then moved nothing a
    hundred tokens on.) ``D`` (the skip connection) is 1. The depthwise
    convolution ``conv1d.weight`` (kernel of ``shape[-1]`` tokens) is a
    matrix: N(0, 1/kernel)."""
    import torch

    if name.endswith(".A"):
        heads = shape[0]
        exponents = torch.linspace(-2.0, 0.0, heads) if heads > 1 else torch.zeros(1)
        return -torch.pow(10.0, exponents)
    if name.endswith(".dt_bias"):
        low, high = math.log(1e-2), math.log(1e-1)
        dt = torch.exp(low + (high - low) * torch.rand(shape, generator=generator))
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith(".D"):
        return torch.ones(shape)
    return None


def _install_weight_redraw() -> None:
    """Make vLLM's dummy loader call :func:`_redraw_weights` after its own draw."""
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    original = DummyModelLoader.load_weights
    if getattr(original, "kvfuzz_redraw", False):
        return

    def load_weights(self: Any, model: Any, model_config: Any) -> None:
        original(self, model, model_config)
        _redraw_weights(model)

    load_weights.kvfuzz_redraw = True  # type: ignore[attr-defined]
    DummyModelLoader.load_weights = load_weights


_MODELS_PREFIX = "kvfuzz-engine-models-"


def models_folder() -> Path:
    """A new folder for this worker's model files
    (``$TMPDIR/kvfuzz-engine-models-<pid>-XXXX``), removed when the worker
    exits; one left by a worker that was killed (its pid no longer alive,
    e.g. SIGKILLed after a timeout) is removed here first."""
    remove_stale(Path(tempfile.gettempdir()), _MODELS_PREFIX, "-")
    return Path(tempfile.mkdtemp(prefix=f"{_MODELS_PREFIX}{os.getpid()}-"))


class _Engines:
    """The engines this worker keeps, by their ``LLM`` keyword arguments."""

    def __init__(self) -> None:
        self.folder = models_folder()
        self.engines: dict[str, Any] = {}
        self.created = 0

    def get(self, kwargs: dict[str, Any], variant: str | None = None) -> tuple[Any, float]:
        """The engine for ``kwargs`` built under the patch ``variant`` (started if
        new, inside the patch's context) and its start-up seconds (0 when reused)."""
        from vllm import LLM

        key = json.dumps([kwargs, variant], sort_keys=True)
        if key in self.engines:
            llm = self.engines.pop(key)
            self.engines[key] = llm  # most recently used last
            if not llm.reset_prefix_cache():
                raise RuntimeError("LLM.reset_prefix_cache() refused (requests in flight)")
            return llm, 0.0
        while len(self.engines) >= _MAX_ENGINES:
            oldest = next(iter(self.engines))
            del self.engines[oldest]
            gc.collect()
        started = time.perf_counter()
        _install_weight_redraw()
        try:
            llm = LLM(**_with_event_publisher(kwargs))
        except Exception as exc:
            if self.created:
                # vLLM's CPU platform re-registers its kernel overrides for every
                # engine, which can fail after other engines' imports: a fresh
                # worker retries the plan.
                raise RetryInFreshWorker(f"{type(exc).__name__}: {exc}") from exc
            raise EngineStartError(f"{type(exc).__name__}: {exc}") from exc
        self.created += 1
        elapsed = time.perf_counter() - started
        self.engines[key] = llm
        return llm, elapsed


# ------------------------------------------------------------- KV cache events

#: Seconds to wait for a batch the scheduler handed its publisher to arrive
#: on the subscriber socket.
_EVENT_WAIT_S = 10.0

_endpoints = itertools.count()


def _kv_events_arguments(plan: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for the plan's ``kv_events``
    (``"off"``/absent, ``"incremental"`` or ``"full"``): KV cache events on,
    published by vLLM's ZMQ publisher (vllm/distributed/kv_events.py,
    ``ZmqEventPublisher``); :func:`_with_event_publisher` gives each engine
    its own endpoint."""
    if plan.get("kv_events", "off") == "off":
        return {}
    return {"kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq"}}


def _with_event_publisher(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with its ``kv_events_config`` (a dict) made vLLM's
    ``KVEventsConfig`` (vllm/config/kv_events.py) on an in-process endpoint of
    its own (``inproc://``: the engine runs in this process, and vLLM's
    publisher binds its PUB socket in the process-wide ZMQ context), so that
    engines of this worker never share one; ``kwargs`` itself is unchanged
    (it keys the engine)."""
    config = kwargs.get("kv_events_config")
    if config is None:
        return kwargs
    from vllm.config import KVEventsConfig

    endpoint = f"inproc://kvfuzz-kv-events-{os.getpid()}-{next(_endpoints)}"
    return {**kwargs, "kv_events_config": KVEventsConfig(**config, endpoint=endpoint)}


class _EventStream:
    """A run's KV cache events as the engine publishes them, judged beside
    the prefix cache (:class:`differential.driver.kv_events.EventRecorder`).

    The scheduler drains its ``KVCacheManager``'s event queue once per step
    and hands the batch to its publisher (``Scheduler.update_from_output``,
    vllm/v1/core/sched/scheduler.py), whose thread sends it, msgpack-encoded
    with a sequence number, on its PUB socket (``ZmqEventPublisher``,
    vllm/distributed/kv_events.py). A SUB socket on that endpoint receives
    every batch of the run; after each engine step the batches that step
    published (counted at the publisher's ``publish``) are received, decoded
    as a router decodes them (``KVEventBatch``) and recorded as that step's
    drain, with the lookups made since the last one (and the events each
    emitted: the queue's span, for ``kv_cache_report_mode`` ``"full"``) and
    the cache's changes. A batch missing after :data:`_EVENT_WAIT_S` seconds,
    or a gap in the sequence numbers, is an error of the run.

    A reused engine's ``LLM.reset_prefix_cache()`` (the worker's, between
    plans) queues an ``AllBlocksCleared`` (``BlockPool.reset_prefix_cache``)
    that the next step would publish with this run's first events: it is
    taken off the queue before the run (:attr:`reset`) and not recorded, so
    no plan's stream carries another's. The subscriber connects when the run
    starts, after every batch of earlier runs was received.
    """

    def __init__(self, core: Any, report_mode: str, hash_block_size: int) -> None:
        from differential.driver.kv_events import EventRecorder

        scheduler = core.scheduler
        self.manager = scheduler.kv_cache_manager
        self.publisher = scheduler.kv_event_publisher
        self.endpoint = scheduler.get_kv_event_publisher_config().endpoint
        self.recorder = EventRecorder(self.manager, report_mode, hash_block_size)
        self.requests: dict[int, Any] = {}
        self.reset: list[str] = []
        self.handed = 0  # batches handed to the publisher since the last drain
        self.received: list[int] = []  # sequence numbers, in order
        self._saved: list[tuple[Any, str, Any]] = []
        self._socket: Any = None

    def __enter__(self) -> _EventStream:
        import zmq

        self.reset = [type(e).__name__ for e in self.manager.take_events()]
        # The publisher binds in the process-wide context; inproc needs the same.
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(self.endpoint)
        manager, publisher, recorder = self.manager, self.publisher, self.recorder
        lookup, publish = manager.get_computed_blocks, publisher.publish

        def get_computed_blocks(request: Any) -> Any:
            start = recorder.queue_length()
            result = lookup(request)
            index = _index(request.request_id)
            self.requests.setdefault(index, request)
            recorder.lookup(index, result[1], result[0], start)
            return result

        def counted(batch: Any) -> None:
            publish(batch)
            self.handed += 1

        for obj, name, fn in (
            (manager, "get_computed_blocks", get_computed_blocks),
            (publisher, "publish", counted),
        ):
            # An instance attribute (another wrapper, _Instruments') is put back.
            self._saved.append((obj, name, vars(obj).get(name)))
            setattr(obj, name, fn)
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, name, below in reversed(self._saved):
            if below is None:
                delattr(obj, name)  # the class's method shows through again
            else:
                setattr(obj, name, below)
        self._saved.clear()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def drain(self, step: int) -> None:
        """Receive the batches engine step ``step`` published and record them
        as that step's drain.

        Raises:
            RuntimeError: a batch did not arrive, or sequence numbers skip.
        """
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        events: list[Any] = []
        for _ in range(self.handed):
            if not self._socket.poll(int(_EVENT_WAIT_S * 1000)):
                raise RuntimeError(
                    f"KV cache events: a batch engine step {step} handed vLLM's ZMQ "
                    f"publisher did not arrive at {self.endpoint} within {_EVENT_WAIT_S:g} s"
                )
            _topic, seq_bytes, payload = self._socket.recv_multipart(zmq.NOBLOCK)
            seq = int.from_bytes(seq_bytes, "big")
            if self.received and seq != self.received[-1] + 1:
                raise RuntimeError(
                    f"KV cache events: batch {seq} arrived after batch {self.received[-1]}"
                )
            self.received.append(seq)
            events.extend(decoder.decode(payload).events)
        self.handed = 0
        self.recorder.drain(step, events)

    def reply(self, prompts: list[list[int] | None], outputs: dict[int, Any]) -> dict[str, Any]:
        """The run's ``kv_events`` block (:func:`run_plan`): the log
        (:class:`~differential.observation.KVEventLog` as a dict, token ids the
        engine's), each request's tokens (prompt, then sampled), the batches'
        sequence numbers, what the reset queued, and the events left on the
        queue unpublished."""
        from types import SimpleNamespace

        count = len(prompts)
        made = [self.requests.get(i, SimpleNamespace(block_hashes=[])) for i in range(count)]
        sequences = [
            list(prompts[i] or []) + (list(outputs[i].outputs[0].token_ids) if i in outputs else [])
            for i in range(count)
        ]
        return {
            "log": self.recorder.log(made).to_dict(),
            "sequences": sequences,
            "batches": list(self.received),
            "reset": list(self.reset),
            "unpublished": len(self.manager.block_pool.kv_event_queue),
            "pending": bool(self._socket is not None and self._socket.poll(0)),
        }


def _event_stream(plan: dict[str, Any], core: Any, cache_config: Any) -> _EventStream | None:
    """The run's :class:`_EventStream` when the plan turns KV cache events on."""
    mode = plan.get("kv_events", "off")
    if mode == "off":
        return None
    hash_block = getattr(cache_config, "hash_block_size", None) or cache_config.block_size
    return _EventStream(core, mode, hash_block)


# ----------------------------------------------------------------------- running


def _index(request_id: str) -> int:
    """The request index in a request id ``RUN-INDEX`` (vLLM's engine may
    append its own ``-SUFFIX`` to the ids it schedules)."""
    return int(request_id.split("-")[1])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _group_layout(core: Any) -> list[dict[str, Any]]:
    """The engine's KV cache groups: spec class, block size, window, layers."""
    out = []
    for group in core.scheduler.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        out.append(
            {
                "spec": type(spec).__name__,
                "block_size": spec.block_size,
                "sliding_window": getattr(spec, "sliding_window", None),
                "is_eagle_group": bool(getattr(group, "is_eagle_group", False)),
                "layers": list(group.layer_names),
            }
        )
    return out


def _check_groups(engine: dict[str, Any], core: Any, cache_config: Any) -> None:
    """Check that the engine's KV cache groups are the plan's ``groups`` (spec
    class, block size and window in tokens, ``is_eagle_group``: the groups
    that take the EAGLE drop; as many groups of each), and its
    hash block the plan's ``hash_block_size`` (with prefix caching on); a plan
    without ``groups`` is refused.

    vLLM's planner splits the layers of one spec into groups of equal layer
    counts (``_get_kv_cache_groups_uniform_page_size``,
    vllm/v1/core/kv_cache_utils.py), a drafter's layers counted with the
    target's; every group takes its own blocks from the pool, so a group more
    or fewer is another layout even where it hits alike.

    Raises:
        PlanError: naming both layouts, so the run is unsupported, never one
            on other groups than the scenario's.
    """
    if "groups" not in engine:
        raise PlanError("the plan names no KV cache groups to check the engine's against")

    def key(g: dict[str, Any]) -> tuple[str, int, int, bool]:
        window = int(g["sliding_window"] or 0)
        return (str(g["spec"]), int(g["block_size"]), window, bool(g["is_eagle_group"]))

    planned = sorted(key(g) for g in engine["groups"])
    made = sorted(key(g) for g in _group_layout(core))
    hash_block = getattr(cache_config, "hash_block_size", None) or cache_config.block_size
    caching = bool(engine["enable_prefix_caching"])
    if made != planned or (caching and hash_block != engine["hash_block_size"]):
        raise PlanError(
            f"the engine's KV cache groups came out as {made} (spec, block, window in "
            f"tokens, is_eagle_group; hash block {hash_block}), not the scenario's "
            f"{planned} (hash block {engine['hash_block_size']}): vLLM's planner "
            "(vllm/v1/core/kv_cache_utils.py, get_kv_cache_groups) gave the tiny "
            f"{engine['architecture']} model other groups"
        )


#: The calibration breakages a plan may name (:meth:`_Instruments._slot`; the
#: Mamba state breakages: :class:`~differential.driver.engine_breakages.MambaBreakage`).
BREAKAGES = (
    "wrong-block",
    "wrong-block-anywhere",
    "wrong-swa-block",
    "stale-swa-block",
    "wrong-mamba-state",
    *MAMBA_BREAKAGES,
)

#: The KV cache spec (class name) of the groups each breakage acts on: a
#: scenario with no such group cannot be broken by it.
BREAKAGE_SPECS = {
    "wrong-block": "FullAttentionSpec",
    "wrong-block-anywhere": "FullAttentionSpec",
    "wrong-swa-block": "SlidingWindowSpec",
    "stale-swa-block": "SlidingWindowSpec",
    **{name: "MambaSpec" for name in ("wrong-mamba-state", *MAMBA_BREAKAGES)},
}


class _Instruments:
    """Counters and per-request records taken off the engine's own objects
    during one run: the last ``KVCacheManager.get_computed_blocks`` result per
    request (hit, shared-prefix junction, step), evicted cached blocks
    (``BlockPool._maybe_evict_cached_block`` returning true), and the
    calibration breakage (``plan["breakage"]``)."""

    def __init__(self, core: Any, breakage: str | None) -> None:
        self.core = core
        self.manager = core.scheduler.kv_cache_manager
        self.pool = self.manager.block_pool
        self.step = 0
        self.lookups: dict[int, tuple[int, int, int]] = {}
        self.evicted = 0
        self.broken: list[int] = []
        self.replaced: list[list[int]] = []  # [request, group, block slot]
        self.contents: dict[bytes, tuple[int, tuple[int, ...]]] = {}
        if breakage is not None and breakage not in BREAKAGES:
            raise PlanError(f"unknown breakage {breakage!r}: known {', '.join(BREAKAGES)}")
        self.breakage = breakage
        self.mamba: MambaBreakage | None = None
        if breakage in MAMBA_BREAKAGES:
            self.mamba = MambaBreakage(breakage, core)
            self.mamba.broken, self.mamba.replaced = self.broken, self.replaced
        self.scheduled_tokens = 0  # in the last step
        self._saved: list[tuple[Any, str]] = []
        self._restore_module: tuple[Any, Any] | None = None

    def __enter__(self) -> _Instruments:
        manager, pool, scheduler = self.manager, self.pool, self.core.scheduler
        lookup = manager.get_computed_blocks
        evict = pool._maybe_evict_cached_block
        schedule = scheduler.schedule

        def scheduled(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            self.scheduled_tokens = int(out.total_num_scheduled_tokens)
            if self.mamba is not None:
                # The model runner's layers (the engine core's own VllmConfig).
                context = self.core.vllm_config.compilation_config.static_forward_context
                self.mamba.scheduled(out, context)
            return out

        def get_computed_blocks(request: Any) -> Any:
            blocks, hit, boundary = lookup(request)
            if self.mamba is not None and hit:
                self.mamba.looked_up(request, blocks)
            elif self.breakage is not None:
                self._record_contents(request)
                if hit:
                    blocks = self._break(request, blocks, hit)
            self.lookups[_index(request.request_id)] = (hit, boundary, self.step)
            return blocks, hit, boundary

        def maybe_evict(block: Any) -> bool:
            evicted = bool(evict(block))
            self.evicted += evicted
            if evicted and self.mamba is not None:
                self.mamba.evicted(block)
            return evicted

        for obj, name, fn in (
            (manager, "get_computed_blocks", get_computed_blocks),
            (pool, "_maybe_evict_cached_block", maybe_evict),
            (scheduler, "schedule", scheduled),
        ):
            self._saved.append((obj, name))
            setattr(obj, name, fn)
        if self.mamba is not None:
            self._install_mamba(self.mamba)
        return self

    def _install_mamba(self, mamba: MambaBreakage) -> None:
        """Wrap ``BlockPool.cache_full_blocks``, ``cache_partial_block`` and
        ``move_block_hashes`` (who cached each state block)
        and vLLM's ``preprocess_mamba`` (vllm/v1/worker/mamba_utils.py, looked
        up on its module by the model runner at every step) for a
        :class:`MambaBreakage`."""
        from vllm.v1.worker import mamba_utils

        cache = self.pool.cache_full_blocks

        signature = inspect.signature(cache)

        def cache_full_blocks(*args: Any, **kwargs: Any) -> Any:
            out = cache(*args, **kwargs)
            a = signature.bind(*args, **kwargs).arguments
            mamba.cached(
                a["request"],
                a["blocks"],
                a["num_cached_blocks"],
                a["num_full_blocks"],
                a["kv_cache_group_id"],
            )
            return out

        partial = self.pool.cache_partial_block
        partial_signature = inspect.signature(partial)

        def cache_partial_block(*args: Any, **kwargs: Any) -> Any:
            # A prompt tail cached inside a block (the state at a fine-grained
            # checkpoint): SingleTypeKVCacheManager._cache_partial_tail_block.
            out = partial(*args, **kwargs)
            a = partial_signature.bind(*args, **kwargs).arguments
            mamba.cached(a["request"], [a["block"]], 0, 1, a["kv_cache_group_id"])
            return out

        move = self.pool.move_block_hashes

        def move_block_hashes(src_block: Any, dst_block: Any) -> Any:
            out = move(src_block, dst_block)
            mamba.moved(src_block, dst_block)
            return out

        self._saved += [
            (self.pool, "cache_full_blocks"),
            (self.pool, "cache_partial_block"),
            (self.pool, "move_block_hashes"),
        ]
        self.pool.cache_full_blocks = cache_full_blocks
        self.pool.cache_partial_block = cache_partial_block
        self.pool.move_block_hashes = move_block_hashes
        original = mamba_utils.preprocess_mamba
        mamba_utils.preprocess_mamba = mamba.wrap_preprocess(original, lambda: self.step)
        self._restore_module = (mamba_utils, original)

    def after_step(self) -> None:
        """Called after each engine step (:class:`MambaBreakage.after_step`)."""
        if self.mamba is not None:
            self.mamba.after_step()

    def __exit__(self, *exc: object) -> None:
        for obj, name in self._saved:
            delattr(obj, name)  # the class's method shows through again
        self._saved.clear()
        if self._restore_module is not None:
            module, original = self._restore_module
            module.preprocess_mamba = original
            self._restore_module = None

    def _break(self, request: Any, blocks: Any, hit: int) -> Any:
        """The calibration breakage (:data:`BREAKAGES`) applied to one
        ``KVCacheManager.get_computed_blocks`` result (vllm/v1/core/kv_cache_manager.py:
        per KV cache group the hit's blocks, ``hit`` tokens): one block of each
        group it applies to is replaced by another cached block, the hit length
        unchanged. The request's index goes to :attr:`broken` when a block was
        replaced.

        """
        index = _index(request.request_id)
        groups = self.core.scheduler.kv_cache_config.kv_cache_groups
        new_groups = []
        for gi, group_blocks in enumerate(blocks.blocks):
            group_blocks = list(group_blocks)
            spec = groups[gi].kv_cache_spec
            slot = self._slot(type(spec).__name__, spec, group_blocks, hit, request)
            if slot is not None:
                held = {b.block_id for g in blocks.blocks for b in g}
                if self.breakage == "wrong-block":  # as first calibrated
                    held = {b.block_id for b in group_blocks}
                    other = self._other_cached_block(held, None, None)
                else:
                    start, end = slot * spec.block_size, (slot + 1) * spec.block_size
                    read = tuple(request.all_token_ids[: min(end, hit)])
                    other = self._other_cached_block(held, gi, (start, end, read))
                if other is not None:
                    group_blocks[slot] = other
                    self.broken.append(index)
                    self.replaced.append([index, gi, slot])
            new_groups.append(group_blocks)
        return type(blocks)(tuple(new_groups))

    def _slot(
        self, kind: str, spec: Any, group_blocks: list[Any], hit: int, request: Any
    ) -> int | None:
        """Which of a group's hit blocks (index into ``group_blocks``, one block
        of ``spec.block_size`` tokens each) the breakage replaces, or ``None``
        when it does not apply to the group (``kind``: the spec's class).

        * ``wrong-block``: the last block of a full-attention group;
        * ``wrong-block-anywhere``: a full-attention block drawn from the
          request's index (crc32), not the last where there are several;
        * ``wrong-swa-block``: a sliding-window hit block the first sampled
          token's logits read (the last prompt token, position ``P - 1`` of a
          ``P``-token prompt, attends to ``[P - sliding_window, P - 1]``),
          drawn from the request's index; none when the hit ends before that
          window. (A block only the prompt tokens after the hit read changes
          no output where no later layer mixes positions: a model whose last
          layer slides.)
        * ``stale-swa-block``: the null slot of a sliding-window group just
          before the window (every position below ``hit - sliding_window +
          1``: ``SlidingWindowManager.get_num_skipped_tokens``,
          vllm/v1/core/single_type_kv_cache_manager.py), which attention never
          reads: a negative control;
        * ``wrong-mamba-state``: a Mamba group's hit state (its one non-null
          block, ``MambaManager.find_longest_cache_hit``).
        """
        real = [j for j, b in enumerate(group_blocks) if not b.is_null]
        draw = zlib.crc32(f"{self.breakage}:{_index(request.request_id)}".encode())
        if kind == "FullAttentionSpec" and real:
            if self.breakage == "wrong-block":
                return real[-1]
            if self.breakage == "wrong-block-anywhere":
                return real[draw % (len(real) - 1)] if len(real) > 1 else real[0]
        if kind == "SlidingWindowSpec" and self.breakage in ("wrong-swa-block", "stale-swa-block"):
            size, first_read = spec.block_size, hit - spec.sliding_window + 1
            if self.breakage == "wrong-swa-block":
                sampled_read = request.num_prompt_tokens - spec.sliding_window
                inside = [j for j in real if (j + 1) * size - 1 >= sampled_read and j * size < hit]
                return inside[draw % len(inside)] if inside else None
            outside = [
                j for j, b in enumerate(group_blocks) if b.is_null and (j + 1) * size <= first_read
            ]
            return outside[-1] if outside else None
        if kind == "MambaSpec" and self.breakage == "wrong-mamba-state" and real:
            return real[-1]
        return None

    def _record_contents(self, request: Any) -> None:
        """Remember what each of ``request``'s hashed blocks holds: per block
        hash (``Request.block_hashes``, one per ``BlockPool.hash_block_size``
        tokens) the end of its hash block (tokens) and the request's tokens
        over the largest group block before it. A group block of ``k`` hash
        blocks is cached under the hash of its last hash block
        (``BlockHashListWithBlockSize``, vllm/v1/core/kv_cache_utils.py), and
        a partial entry under the hash at its prefix boundary
        (``BlockPool.cache_partial_block``), so this covers the tokens of the
        group block it is cached under, whatever the group's block size."""
        size = self.pool.hash_block_size
        groups = self.core.scheduler.kv_cache_config.kv_cache_groups
        span = max(g.kv_cache_spec.block_size for g in groups)
        tokens = request.all_token_ids
        for j, block_hash in enumerate(request.block_hashes):
            end = (j + 1) * size
            self.contents[bytes(block_hash)] = (end, tuple(tokens[max(0, end - span) : end]))

    def _other_cached_block(
        self, held: set[int], group: int | None, same: tuple[int, int, tuple[int, ...]] | None
    ) -> Any:
        """The first block of the pool (by block id) that is cached (has a
        block hash), not the null block, held by no request (``ref_cnt`` 0)
        and not among ``held``; with ``group`` set, one cached for that KV
        cache group (``get_group_id``, vllm/v1/core/kv_cache_utils.py), so it
        holds that group's layers' KV (or state) for other tokens. A block
        that would give the request the same KV is passed over: ``same`` is
        the replaced block's first and end positions (tokens) and the
        request's tokens up to the end of what it reads there (the block's
        end, or the hit's inside a block), and a block cached at an end inside
        the same block, at or after that read end, after the same tokens
        holds the same tokens at every position read (:meth:`_holds_same`)."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        for candidate in self.pool.blocks:
            if (
                candidate.block_id not in held
                and not candidate.is_null
                and candidate.block_hash is not None
                and candidate.ref_cnt == 0
                and (group is None or get_group_id(candidate.block_hash) == group)
                and (
                    same is None
                    or not self._holds_same(
                        self.contents.get(bytes(get_block_hash(candidate.block_hash))), same
                    )
                )
            ):
                return candidate
        return None

    @staticmethod
    def _holds_same(
        known: tuple[int, tuple[int, ...]] | None, same: tuple[int, int, tuple[int, ...]]
    ) -> bool:
        """Whether a block cached under a hash that ``known`` describes (the
        hash block's end and the tokens before it: :meth:`_record_contents`;
        ``None``: not known) holds what ``same`` (first and end positions of
        the replaced block, in tokens, and the request's tokens up to the end
        read there) reads: its hash ends inside ``(first, end]``, not before
        the read end, and it holds the same tokens at the same positions from
        ``first`` to the read end. After the same whole prefix that is the
        same KV and state; after another prefix, the same KV of the first
        attention layer (all of it in a one-layer model), so such a block is
        passed over too (a rejoin's blocks of another hash)."""
        if known is None:
            return False
        known_end, tokens = known
        first, end, read = same
        low = known_end - len(tokens)  # the position of tokens[0]
        return (
            first < known_end <= end
            and known_end >= len(read)
            and low <= first
            and tokens[first - low : len(read) - low] == read[first:]
        )


class _PlanRequests:
    """A plan's requests as the engine serves them: each request's prompt
    (token ids: its source's tokens up to the divergence point, then its
    own), the engine step it arrived at and finished at, and its output."""

    def __init__(self, engine: Any, plan: dict[str, Any], instruments: _Instruments) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.sampling_params = SamplingParams
        self.tokens_prompt = TokensPrompt
        self.engine = engine
        self.instruments = instruments
        self.shares_output = bool(plan.get("shares_output"))
        self.top_logprobs = int(plan.get("logprobs") or 2)
        self.prefix: list[int] = plan["prefix"]
        self.specs: list[dict[str, Any]] = plan["requests"]
        self.sequential = all(s["arrival"] is None for s in self.specs)
        self.run_id = f"{time.monotonic_ns()}"
        self.prompts: list[list[int] | None] = [None] * len(self.specs)
        self.outputs: dict[int, Any] = {}
        self.finished_at: dict[int, int] = {}
        self.added: list[int] = []
        self.rows: dict[int, dict[str, Any]] = {}
        self.idle_steps = 0  # steps in a row that scheduled no token
        # kv_cache_report_mode "full" (vllm/v1/request.py reads it from extra_args).
        full = plan.get("kv_events") == "full"
        self.extra = {"extra_args": {"kv_cache_report_mode": "full"}} if full else {}
        self.events: _EventStream | None = None

    def source_tokens(self, i: int) -> list[int] | None:
        """The tokens request ``i`` copies its first ``divergence`` tokens
        from: the shared prefix, or its source's prompt (followed by the
        source's sampled tokens when the plan shares outputs); ``None`` while
        the source has not been added, or its answer is not there yet."""
        source = self.specs[i]["source"]
        if source is None:
            return self.prefix
        if self.prompts[source] is None:
            return None
        tokens = list(self.prompts[source] or [])
        if self.shares_output:
            if source not in self.outputs:
                return None  # its answer is not there yet
            tokens += list(self.outputs[source].outputs[0].token_ids)
        return tokens

    def add(self, i: int) -> None:
        """Add request ``i`` to the engine at the current engine step, with
        greedy sampling, and start its row (prompt tokens, arrival step, the
        tokens it shares with every request added before it)."""
        specs, prompts, outputs = self.specs, self.prompts, self.outputs
        base = self.source_tokens(i)
        assert base is not None
        prompt = base[: specs[i]["divergence"]] + list(specs[i]["own"])
        prompts[i] = prompt
        earlier = [
            (prompts[k] or []) + (list(outputs[k].outputs[0].token_ids) if k in outputs else [])
            for k in self.added
        ]
        shared = max((_common_prefix(prompt, e) for e in earlier), default=0)
        params = self.sampling_params(
            max_tokens=specs[i]["max_tokens"],
            temperature=0.0,
            ignore_eos=True,
            logprobs=self.top_logprobs,
            **self.extra,
        )
        self.engine.add_request(
            f"{self.run_id}-{i}", self.tokens_prompt(prompt_token_ids=prompt), params
        )
        self.added.append(i)
        self.rows[i] = {
            "index": i,
            "prompt_tokens": len(prompt),
            "arrival_step": self.instruments.step,
            "shared_tokens": shared,
        }

    def step(self) -> None:
        """One engine step; keeps the outputs of the requests it finished.

        Raises:
            RuntimeError: the scheduler scheduled no token for
                :data:`_MAX_IDLE_STEPS` steps in a row with requests
                unfinished (vLLM's scheduler leaves them waiting for good:
                an engine would hang), as kvfuzz's scheduler-mode driver
                reports it.
        """
        self.instruments.scheduled_tokens = 0
        outputs = self.engine.step()
        self.instruments.after_step()
        for out in outputs:
            if out.finished:
                self.outputs[_index(out.request_id)] = out
                self.finished_at[_index(out.request_id)] = self.instruments.step
        if self.events is not None:
            self.events.drain(self.instruments.step)
        self.instruments.step += 1
        busy = self.instruments.scheduled_tokens or not self.engine.has_unfinished_requests()
        self.idle_steps = 0 if busy else self.idle_steps + 1
        if self.idle_steps >= _MAX_IDLE_STEPS:
            waiting = len(self.added) - len(self.outputs)
            raise RuntimeError(
                f"Scheduler.schedule scheduled nothing for {_MAX_IDLE_STEPS} steps with "
                f"{waiting} request(s) unfinished"
            )

    def serve(self) -> None:
        """Serve every request: one after another when no request has an
        arrival step, else each at its arrival step (engine steps; a request
        waits for its source's answer), stepping the engine until all finished."""
        specs, engine, instruments = self.specs, self.engine, self.instruments
        if self.sequential:
            for i in range(len(specs)):
                self.add(i)
                while i not in self.outputs:
                    self.step()
            return
        pending = list(range(len(specs)))
        while pending or engine.has_unfinished_requests():
            while pending and (specs[pending[0]]["arrival"] or 0) <= instruments.step:
                if self.source_tokens(pending[0]) is None:
                    break  # waits for its source's answer
                self.add(pending.pop(0))
            if not engine.has_unfinished_requests() and pending:
                if self.source_tokens(pending[0]) is None:
                    raise RuntimeError("a request's source never finished")
                instruments.step = max(instruments.step, specs[pending[0]]["arrival"])
                continue
            self.step()

    def request_rows(self) -> list[dict[str, Any]]:
        """The finished requests' rows, by index: the lookup the instruments
        saw (hit and junction, tokens; step), the cached tokens vLLM reports,
        the finishing step, the sampled tokens and their logprobs."""
        requests: list[dict[str, Any]] = []
        for i in sorted(self.outputs):
            out = self.outputs[i]
            completion = out.outputs[0]
            logprobs, runner_up, top = _sampled_logprobs(completion, self.top_logprobs)
            hit, boundary, lookup_step = self.instruments.lookups.get(i, (0, 0, 0))
            row = self.rows[i]
            row.update(
                num_cached_tokens=out.num_cached_tokens,
                lookup_hit_tokens=hit,
                boundary_tokens=boundary,
                lookup_step=lookup_step,
                finished_step=self.finished_at.get(i),
                output_token_ids=list(completion.token_ids),
                logprobs=logprobs,
                runner_up_logprobs=runner_up,
                top_logprobs=top,
            )
            requests.append(row)
        return requests


def _sampled_logprobs(
    completion: Any, k: int
) -> tuple[list[float], list[float | None], list[list[list[float]]]]:
    """Per sampled token of ``completion`` (a ``CompletionOutput``): its
    logprob, the best other token's (``None`` when the engine returned no
    other), and the ``k`` most likely tokens as ``[token, logprob]`` pairs by
    rank (``Logprob.rank`` 1 to ``k``; vLLM's ``SamplingParams.logprobs``
    returns them and the sampled token, vllm/v1/engine/logprobs.py)."""
    logprobs: list[float] = []
    runner_up: list[float | None] = []
    top: list[list[list[float]]] = []
    for token, entry in zip(completion.token_ids, completion.logprobs or [], strict=False):
        logprobs.append(entry[token].logprob)
        others = [v.logprob for t, v in entry.items() if t != token]
        runner_up.append(max(others) if others else None)
        ranked = sorted(
            ((v.rank, t, v.logprob) for t, v in entry.items() if v.rank is not None),
            key=lambda item: (item[0], -item[2]),
        )
        top.append([[t, lp] for rank, t, lp in ranked if rank <= k])
    return logprobs, runner_up, top


def _engine_report(
    engine: Any,
    kwargs: dict[str, Any],
    start_s: float,
    started: float,
    instruments: _Instruments,
) -> dict[str, Any]:
    """The run's ``engine`` block (:func:`run_plan`): the engine's vLLM, block
    sizes and hash block size (tokens), KV cache groups, drafter, number of
    blocks, lookahead tokens, start-up and run seconds, engine steps, evicted
    cached blocks and ``vllm.LLM`` keyword arguments."""
    import vllm

    core = engine.engine_core.engine_core
    cache_config = engine.vllm_config.cache_config
    spec_config = engine.vllm_config.speculative_config
    return {
        "vllm_version": vllm.__version__,
        "block_size": cache_config.block_size,
        "hash_block_size": getattr(cache_config, "hash_block_size", None),
        "groups": _group_layout(core),
        "use_eagle": bool(getattr(core.scheduler.kv_cache_manager, "use_eagle", False)),
        "speculative_method": None if spec_config is None else spec_config.method,
        "num_blocks": core.scheduler.kv_cache_config.num_blocks,
        "num_hash_lookahead_tokens": getattr(engine.vllm_config, "num_hash_lookahead_tokens", 0),
        "num_lookahead_tokens": getattr(engine.vllm_config, "num_lookahead_tokens", 0),
        "num_prefill_lookahead_tokens": getattr(
            engine.vllm_config, "num_prefill_lookahead_tokens", 0
        ),
        "start_s": round(start_s, 3),
        "run_s": round(time.perf_counter() - started, 3),
        "steps": instruments.step,
        "evicted_blocks": instruments.evicted,
        "kwargs": {k: v for k, v in kwargs.items() if k not in ("model",)},
    }


def run_plan(engines: _Engines, plan: dict[str, Any]) -> dict[str, Any]:
    """Run one plan on the engine and report what it served.

    The plan: ``engine`` (see :func:`engine_arguments`), ``prefix`` (the
    shared prefix, token ids), ``requests`` (per request ``source``: null for
    the prefix or an earlier request's index; ``divergence``: tokens copied
    from the source; ``own``: the request's own token ids; ``arrival``: the
    engine step it is added at, null for after the previous request
    finished; ``max_tokens``), ``shares_output`` (a request with a source
    copies the source's prompt followed by its sampled tokens),
    ``breakage`` (null, or one of :data:`BREAKAGES`: :meth:`_Instruments._break`),
    ``logprobs`` (the top logprobs sampled per position, default 2),
    ``kv_events`` (``"off"``, or ``"incremental"`` / ``"full"``: KV cache
    events on and every request's ``kv_cache_report_mode``, recorded by
    :class:`_EventStream` off vLLM's ZMQ publisher) and ``variant`` (null,
    or a variant's patch ``"module:function"``, such
    as ``"differential.driver.fixes:seed_pr_fix"``: the engine is built and
    run inside it, :func:`_variant_patches`; an engine is reused only under
    the same patch).

    Returns:
        ``{"engine": {vllm_version, block_size, hash_block_size, groups,
        use_eagle, speculative_method, num_blocks, num_hash_lookahead_tokens,
        num_lookahead_tokens, num_prefill_lookahead_tokens, start_s, run_s, steps, evicted_blocks,
        kwargs}, "requests": [per request: index, prompt_tokens,
        num_cached_tokens, boundary_tokens, lookup_step, finished_step (the
        engine step at whose end it finished), arrival_step,
        shared_tokens (longest common prefix with the tokens of every request
        added before it), output_token_ids, logprobs (the sampled token's),
        runner_up_logprobs (the best other token's, or null), top_logprobs
        (per position the plan's ``logprobs`` most likely tokens, ``[token,
        logprob]`` by rank)], "broken": request indices the breakage changed,
        "broken_blocks": ``[request, group, block slot]`` per block replaced
        (or, for the Mamba state breakages of
        :mod:`~differential.driver.engine_breakages`, per hit state block read
        broken), "state_writes": ``[writer request, group, block id, engine
        step]`` per cached state block ``state-written-after-cache`` overwrote,
        "error": null or the engine's exception, "variant": {"patch": the
        plan's variant, "applied": the replacements it installed,
        ``Owner.attribute``}, "kv_events": null (events off) or :meth:`_EventStream.reply`}``.

    Raises:
        PlanError: the plan's variant patch cannot apply (an *unsupported* run).
    """
    kwargs = engine_arguments(plan, engines.folder)
    variant = plan.get("variant")
    with _variant_patches(variant) as applied:
        run = _run_engine(engines, plan, kwargs, variant)
    run["variant"] = {"patch": variant, "applied": list(applied)}
    return run


#: The variants' patch modules the worker may enter, by module path.
_PATCH_MODULES = (
    "differential.driver.fixes",
    "differential.driver.candidate",
    "differential.driver.mutations",
)


def _patch_module(module: str) -> Any:
    """The patch module ``module`` (one of :data:`_PATCH_MODULES`), imported.

    Raises:
        PlanError: another module, or one that cannot be imported on this vLLM.
    """
    try:
        if module == "differential.driver.fixes":
            from differential.driver import fixes

            return fixes
        if module == "differential.driver.candidate":
            from differential.driver import candidate

            return candidate
        if module == "differential.driver.mutations":
            from differential.driver import mutations

            return mutations
    except (ImportError, AttributeError) as exc:
        raise PlanError(
            f"variant patch module {module} cannot be imported with this engine's vLLM: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    raise PlanError(f"variant patch module {module!r}: allowed {', '.join(_PATCH_MODULES)}")


@contextlib.contextmanager
def _variant_patches(path: str | None) -> Iterator[tuple[str, ...]]:
    """Enter the variant patch ``path`` (``"module:function"``, a context
    manager factory; ``None``: no patch) and yield the replacements it
    installed (``Owner.attribute``, :func:`differential.driver.fixes.installed_patches`).

    Raises:
        PlanError: the module or function is not a variant patch, the patch
            cannot apply to this vLLM (it lacks a method the patch wraps:
            :class:`~differential.capabilities.Unsupported`), or it installed
            nothing. The run is then *unsupported*, never an unpatched one.
    """
    if path is None:
        yield ()
        return
    module_name, _, function = path.partition(":")
    module = _patch_module(module_name)
    factory = getattr(module, function, None)
    if factory is None or function.startswith("_"):
        raise PlanError(f"variant patch {path!r}: {module_name} has no patch {function!r}")
    from differential.capabilities import Unsupported
    from differential.driver.fixes import installed_patches

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(factory())
        except Unsupported as exc:
            raise PlanError(
                f"variant patch {path} cannot apply to this engine's vLLM: it lacks {exc.reason}"
            ) from exc
        applied = installed_patches()
        if not applied:
            raise PlanError(f"variant patch {path} installed nothing")
        yield applied


def _run_engine(
    engines: _Engines, plan: dict[str, Any], kwargs: dict[str, Any], variant: str | None
) -> dict[str, Any]:
    """:func:`run_plan` inside the variant's patches: the engine built (or
    reused) for ``kwargs`` and ``variant``, the plan's requests served."""
    llm, start_s = engines.get(kwargs, variant)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    _check_groups(plan["engine"], core, engine.vllm_config.cache_config)
    error: str | None = None
    started = time.perf_counter()
    instruments = _Instruments(core, plan.get("breakage"))
    requests = _PlanRequests(engine, plan, instruments)
    requests.events = _event_stream(plan, core, engine.vllm_config.cache_config)
    events: dict[str, Any] | None = None
    with instruments, requests.events or contextlib.nullcontext():
        try:
            requests.serve()
        except Exception as exc:  # the engine raised: a crash of the run
            error = f"engine step {instruments.step}: {type(exc).__name__}: {exc}"
            # vLLM's process-wide state (kernel registrations) does not survive a
            # failed engine: the parent restarts this worker before the next plan.
            engines.engines.clear()
            gc.collect()
        if requests.events is not None:
            events = requests.events.reply(requests.prompts, requests.outputs)
    rows = requests.request_rows()
    return {
        "engine": _engine_report(engine, kwargs, start_s, started, instruments),
        "requests": rows,
        "broken": sorted(set(instruments.broken)),
        "broken_blocks": instruments.replaced,
        "state_writes": [] if instruments.mamba is None else instruments.mamba.writes,
        "error": error,
        "restart": error is not None,
        "kv_events": events,
    }


# ---------------------------------------------------------------------- protocol


def _serve(stdin: IO[str], stdout: IO[str]) -> None:
    import torch
    import vllm

    engines = _Engines()

    def handle(request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        if request["op"] == "hello":
            from differential.driver.features import detect

            return {
                "vllm_version": vllm.__version__,
                "torch_version": torch.__version__,
                "capabilities": dict(detect()),
            }, False
        if request["op"] != "run":
            raise ProtocolError(f"unknown op {request['op']!r}")
        try:
            return {"run": run_plan(engines, request["plan"])}, False
        except PlanError as exc:
            return {"run": {"unsupported": str(exc)}}, False
        except RetryInFreshWorker as exc:
            return {"run": {"retry": str(exc), "restart": True, "requests": []}}, True
        except EngineStartError as exc:
            return {"run": {"error": f"engine start: {exc}", "restart": True, "requests": []}}, True

    try:
        serve(
            stdin,
            stdout,
            handle,
            describe_failure=lambda exc: (
                "kvfuzz internal error (please report): the engine "
                f"worker failed: {type(exc).__name__}: {exc}"
            ),
        )
    finally:  # the model files go with the worker (a killed one's: models_folder)
        shutil.rmtree(engines.folder, ignore_errors=True)


def main() -> None:
    """Serve plans on stdin until EOF or an ``exit`` request.

    Protocol messages go to the original stdout, duplicated to a private file
    descriptor; file descriptor 1 (and ``sys.stdout``) point at stderr from
    here on, before vLLM is imported.
    """
    die_with_parent()  # a SIGKILLed kvfuzz takes its engine with it
    for key, value in _ENV.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # The engine's vLLM keeps its caches in its own environment: vLLM keys its
    # model-info cache by file name and source hash, so two releases sharing
    # one folder (this one and kvfuzz's own vLLM) evict each other's entries,
    # and every miss inspects the model class in a fresh subprocess
    # (vllm/model_executor/models/registry.py, _LazyRegisteredModel.inspect_model_cls).
    # A VLLM_CACHE_ROOT the user set is kept.
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(sys.prefix, "vllm-cache"))
    _serve(sys.stdin, take_protocol_stdout())


if __name__ == "__main__":
    main()

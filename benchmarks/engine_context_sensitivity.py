"""How strongly the engine's tiny models' next token depends on distant context.

Engine mode's output check (``wrong-output``) compares top-k logprob vectors
with the prefix cache on and off; a wrong cached block can only show where
the KV of the tokens it covers moves the output. This measures that: on the
tiny Llama with a sliding-window and a full-attention layer (window 64 tokens,
blocks of 32), on the tiny NemotronH (a Mamba2 layer and an attention
layer) and the tiny Mamba-only NemotronH (one Mamba2 layer: what its state
alone carries), all with the weights engine mode draws
(``engine_worker._redraw_weights``), it changes ONE prompt token at distance
``d`` tokens before the end of a 600-token prompt and prints how far the top-8
logprob vector of the next token moves
(:func:`differential.variants.engine.top_logprob_difference`, nats): the
median, smallest and largest over ``--prompts`` random prompts, per ``d``,
beside how far the sampled token's logprob alone moves (the one number the
check compared before).

Runs in the engine environment, on vLLM's CPU engine, prefix cache off::

    PYTHONPATH=. .engine-venv/bin/python benchmarks/engine_context_sensitivity.py

About a minute and a half on 2 cores (three engine starts).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

DISTANCES = (1, 8, 32, 128, 512)
PROMPT_TOKENS = 600
TOP_K = 8

MODELS: dict[str, dict[str, Any]] = {
    "llama swa64+fa": {
        "architecture": "llama",
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 64,
        "block_size": 32,
    },
    "nemotron_h M*": {"architecture": "nemotron_h", "pattern": "M*", "block_size": 32},
    "nemotron_h M": {"architecture": "nemotron_h", "pattern": "M", "block_size": 32},
}


def _prompts(count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of :data:`PROMPT_TOKENS` token ids in 3..1023."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def _changed(prompt: list[int], distance: int) -> list[int]:
    """``prompt`` with the token ``distance`` tokens before its end replaced."""
    out = list(prompt)
    position = len(prompt) - distance
    out[position] = 3 + (out[position] - 3 + 517) % 1021
    return out


def measure(
    engine: dict[str, Any], prompts: list[list[int]]
) -> dict[int, list[tuple[float, float]]]:
    """Per distance (tokens), for each prompt, how far its next token's top-8
    logprob vector moves (nats) when one token at that distance changes, and
    how far the base run's sampled token's logprob alone moves (nats; the
    sampled token is in both top-8 sets, else NaN), on the model ``engine``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from differential.driver.engine_worker import _install_weight_redraw, engine_arguments
    from differential.variants.engine import top_logprob_difference

    plan = {"engine": {**engine, "enable_prefix_caching": False, "max_num_seqs": 8}}
    plan["engine"]["max_model_len"] = 2048
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "kvfuzz-context-sensitivity"
    kwargs = engine_arguments(plan, folder)
    _install_weight_redraw()
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP_K, ignore_eos=True)
    batch = []
    for prompt in prompts:
        batch.append(prompt)
        batch += [_changed(prompt, d) for d in DISTANCES]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params)

    def top(output: Any) -> list[list[float]]:
        entry = output.outputs[0].logprobs[0]
        return [[t, v.logprob] for t, v in entry.items() if v.rank is not None and v.rank <= TOP_K]

    moved: dict[int, list[tuple[float, float]]] = {d: [] for d in DISTANCES}
    per = 1 + len(DISTANCES)
    for p in range(len(prompts)):
        base = top(outputs[p * per])
        sampled, logprob = base[0]
        for j, d in enumerate(DISTANCES):
            other = top(outputs[p * per + 1 + j])
            same = dict((int(t), lp) for t, lp in other).get(int(sampled))
            alone = math.nan if same is None else abs(same - logprob)
            moved[d].append((top_logprob_difference(base, other)[0], alone))
    del llm
    return moved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="random prompts per distance")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(MODELS), action="append")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    prompts = _prompts(args.prompts, args.seed)
    rows = [
        "| model | d (tokens before the end) | top-8 move: median | smallest | largest "
        "| sampled logprob alone: median | smallest |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in args.model or list(MODELS):
        for d, values in measure(MODELS[name], prompts).items():
            vector = [v for v, _ in values]
            alone = [a for _, a in values if not math.isnan(a)]
            shown = (
                f"{statistics.median(alone):.1e} | {min(alone):.1e}"
                if alone
                else "- (the sampled token left the top 8) | -"
            )
            rows.append(
                f"| {name} | {d} | {statistics.median(vector):.1e} | {min(vector):.1e} "
                f"| {max(vector):.1e} | {shown} |"
            )
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

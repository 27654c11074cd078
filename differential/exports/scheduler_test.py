"""``kvfuzz export-test`` for scheduler-mode scenarios: a standalone pytest
that drives vLLM's real ``Scheduler``.

The generated test imports only vLLM and the standard library: it writes a
tiny HF-style ``config.json`` to pytest's ``tmp_path`` (no hub, no weights),
builds ``VllmConfig`` (``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``,
CPU ``DeviceConfig``) and ``Scheduler`` with the scenario's KV cache groups
and pool, adds the requests at their arrival steps, and plays the model
runner (``ModelRunnerOutput`` with the sampled tokens, drafts handed back with
``update_draft_token_ids``), as kvfuzz's scheduler mode does
(differential/driver/scheduler_mode.py). It records each request's admitting
lookup and asserts what the oracle expects.

Scenarios with a KV connector are not exported (the connector kvfuzz uses,
an empty remote store, is kvfuzz's own code).
"""

from __future__ import annotations

from collections.abc import Sequence

from differential.errors import ScenarioError
from differential.exports._source import literal
from differential.exports.manager_test import (
    _groups,
    _layout_text,
    _speculative_config_source,
    _test_name,
    docstring_lines,
    hit_check,
    with_imports,
    with_mm_inputs,
    with_skipped_reads,
)
from differential.findings import Finding, FindingKind
from differential.scenario import Scenario

__all__ = ["check_exportable", "export_engine_test"]

_TEMPLATE = '''\
# SPDX-License-Identifier: Apache-2.0
"""{title}

{details}
"""

@@IMPORTS@@

init_none_hash(sha256)


{speculative_config}

def _tokens(runs: list[tuple[int, int]]) -> list[int]:
    """Token ids from (first, count) runs of consecutive ids."""
    return [first + k for first, count in runs for k in range(count)]


def _sampled(index: int, n: int) -> int:
    """The n-th token request `index` samples (a deterministic stream)."""
    return 1_000_000 + index * 1_000_000 + 500_000 + n


def {name}(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
        intermediate_size=128, num_attention_heads=1, num_key_value_heads=1,
        num_hidden_layers=2, vocab_size=32000, max_position_embeddings=1 << 20,
        torch_dtype="float16",
    )))
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(tmp_path), skip_tokenizer_init=True,
            max_model_len={max_model_len}, dtype="float16",
        ),
        cache_config=CacheConfig(block_size={scheduler_block_size}, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens={budget}, max_num_seqs={max_num_seqs},
            max_model_len={max_model_len}, enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    config.cache_config.num_gpu_blocks = {pool}
    config.scheduler_config.long_prefill_token_threshold = 0
    config.scheduler_config.async_scheduling = False
{mamba_config}    object.__setattr__(config, "speculative_config", _speculative_config())
{extra_retained}    groups = [
{groups}
    ]
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=KVCacheConfig(
            num_blocks={pool}, kv_cache_tensors=[], kv_cache_groups=groups,
            prefix_cache_retention_interval={retention},
        ),
        structured_output_manager=StructuredOutputManager(config),
        block_size={scheduler_block_size},
        hash_block_size={hash_block_size},
    )
    manager = scheduler.kv_cache_manager
    lookups = {{}}
    real_lookup = manager.get_computed_blocks

    def get_computed_blocks(
        request: Request, *args: object, **kwargs: object
    ) -> tuple[object, int]:
        result = real_lookup(request, *args, **kwargs)
        lookups[request.request_id] = result[1]
        return result

    manager.get_computed_blocks = get_computed_blocks
    hasher = get_request_block_hasher(
        {hash_block_size}, sha256, config.num_hash_lookahead_tokens
    )
    prompts = [_tokens(runs) for runs in {prompts}]
    requests = [
        Request(
            request_id=f"req-{{i}}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens={max_tokens}),
            pooling_params=None,
            block_hasher=hasher,
        )
        for i, prompt in enumerate(prompts)
    ]
    # Arrival steps (None: each request once the previous one finished).
    arrivals = {arrivals}
    # Drafts accepted per decode step, cycled.
    accepted = {accepted}
    num_spec = {num_spec}
    hits = {{}}
    added = step = decode_count = 0
    while added < len(requests) or scheduler.has_requests():
        if arrivals is None:
            if added < len(requests) and not scheduler.get_num_unfinished_requests():
                scheduler.add_request(requests[added])
                added += 1
        else:
            while added < len(requests) and arrivals[added] <= step:
                scheduler.add_request(requests[added])
                added += 1
        out = scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        sampled, drafts = [], []
        for rid in req_ids:
            index = int(rid.split("-")[1])
            hits.setdefault(index, lookups.get(rid, 0))
            request = scheduler.requests[rid]
            spec = out.scheduled_spec_decode_tokens.get(rid) or []
            if request.num_computed_tokens < request.num_tokens and not spec:
                sampled.append([])
                drafts.append([])
                continue
            n = len(request.output_token_ids)
            take = 1
            if spec:
                take += min(len(spec), accepted[decode_count % len(accepted)] if accepted else 0)
                decode_count += 1
            sampled.append([_sampled(index, n + k) for k in range(take)])
            drafts.append([_sampled(index, n + take + k) for k in range(num_spec)])
        scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={{rid: k for k, rid in enumerate(req_ids)}},
                sampled_token_ids=sampled,
            ),
        )
        if num_spec:
            scheduler.update_draft_token_ids(
                DraftTokenIds(req_ids=req_ids, draft_token_ids=drafts)
            )
        step += 1
        assert step < {max_steps}, "the scheduler did not finish in {max_steps} steps"
    hits = [hits[i] for i in range(len(requests))]

{assertion}
'''


def _runs(tokens: Sequence[int]) -> list[tuple[int, int]]:
    """(first, count) runs of consecutive token ids."""
    runs: list[tuple[int, int]] = []
    for token in tokens:
        if runs and runs[-1][0] + runs[-1][1] == token:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((token, 1))
    return runs


def _assertion(scenario: Scenario, finding: Finding) -> tuple[str, str]:
    """The assertion lines and the sentence saying what they expect."""
    alignment = scenario.effective_hit_alignment_tokens
    request = finding.request
    if finding.kind is FindingKind.EVICTION_COLLAPSE:
        later = [i for i, r in enumerate(scenario.requests) if r.shares_with is not None]
        return (
            f"    # Later turns {later}: retention 0 at this pool keeps some of them hitting.\n"
            f"    assert any(hits[i] for i in {later}), (\n"
            f'        f"no later turn {later} hits at all; hits per request: {{hits}}"\n'
            "    )",
            "dense retention must not lose every later turn's hit at this pool size "
            "while retention 0 keeps some (vLLM issue #48435).",
        )
    if request is None:
        raise ScenarioError(
            "FINDING", finding.kind.value, "a per-request finding or eviction-collapse"
        )
    if finding.kind is FindingKind.CRASH:
        from differential.exports.manager_test import crash_parts

        total = len(scenario.requests)
        parts = crash_parts(finding.detail)
        raised = (
            f"the run did not finish ({finding.detail})"
            if parts is None
            else f"{parts[0]} raises {parts[1]} ({parts[2].strip()[:200]})"
        )
        return (
            f"    # Every request ran. Found by kvfuzz on {finding.variant}: {raised}.\n"
            f'    assert len(hits) == {total}, f"{{len(hits)}} of {total} requests ran"',
            f"all {total} requests run without an exception; on {finding.variant}, {raised}, "
            "so this test fails there with that exception.",
        )
    if finding.kind is FindingKind.MISALIGNED:
        return (
            f"    assert hits[{request}] % {alignment} == 0, (\n"
            f'        f"request {request} must hit a multiple of {alignment} tokens; '
            'hits per request: {{hits}}"\n'
            "    )",
            f"request {request}'s hit is a multiple of the hit alignment {alignment}.",
        )
    if finding.kind is FindingKind.OVER_HIT:
        ceiling = finding.expected_tokens or 0
        return (
            hit_check(request, "<=", ceiling, f"may reuse at most {ceiling} tokens"),
            f"request {request} must not reuse more than {ceiling} tokens.",
        )
    expected = finding.expected_tokens or 0
    operator = "==" if finding.kind is FindingKind.MODE_MISMATCH else ">="
    owed = "must hit" if operator == "==" else "must hit at least"
    return (
        hit_check(request, operator, expected, f"{owed} {expected} tokens"),
        f"request {request} hits {expected} tokens"
        + (" (as the manager-level run does)." if operator == "==" else " at least."),
    )


def check_exportable(scenario: Scenario) -> None:
    """What a scheduler-mode export refuses whatever the finding, checked
    before anything runs.

    Raises:
        ScenarioError: the scenario has a KV connector (a remote store, named
            ``workload.connector``, or an empty one), client aborts, async
            scheduling or prefix caching off.
    """
    if scenario.workload.connector is not None:
        raise ScenarioError(
            "workload.connector",
            "a remote store",
            "null for a scheduler-mode export (the store is kvfuzz's own connector, "
            "differential/driver/connector.py, which a standalone test does not carry)",
        )
    if scenario.kv_connector:
        raise ScenarioError(
            "kv_connector", True, "false for a scheduler-mode export (kvfuzz's own connector)"
        )
    if scenario.workload.abort_steps is not None:
        raise ScenarioError(
            "workload.abort_steps",
            list(scenario.workload.abort_steps),
            "null for a scheduler-mode export (the exported test runs every request to its end)",
        )
    if scenario.workload.async_scheduling:
        raise ScenarioError(
            "workload.async_scheduling",
            True,
            "false for a scheduler-mode export (the exported test applies each step's "
            "output before the next schedule())",
        )
    if not scenario.workload.prefix_caching:
        raise ScenarioError(
            "workload.prefix_caching",
            False,
            "true for a scheduler-mode export (the exported test's CacheConfig and specs "
            "are those of prefix caching)",
        )
    if scenario.workload.priorities is not None:
        raise ScenarioError(
            "workload.priorities",
            list(scenario.workload.priorities),
            "null for a scheduler-mode export (the exported test's Scheduler is first come, "
            "first served)",
        )


def _scheduler_settings(scenario: Scenario) -> str:
    """The exported test's lines setting the workload's ``SchedulerConfig``
    fields that are not vLLM's defaults (the watermark, the prefill policy);
    none for a default (the template sets no long-prefill cap)."""
    w = scenario.workload
    fields = (
        ("watermark", w.watermark, 0.0),
        ("long_prefill_token_threshold", w.long_prefill_token_threshold, 0),
        ("long_prefill_token_threshold_adaptive", w.long_prefill_token_threshold_adaptive, False),
        ("prefill_schedule_interval", w.prefill_schedule_interval, 1),
    )
    return "".join(
        f"    config.scheduler_config.{field} = {value!r}\n"
        for field, value, default in fields
        if value != default
    )


def _pool(scenario: Scenario) -> int:
    """The pool in blocks: the workload's, else the one kvfuzz's scheduler
    mode sizes so that nothing is evicted (``pool_blocks`` in
    differential/driver/specs.py, which imports vLLM)."""
    if scenario.workload.pool_blocks is not None:
        return scenario.workload.pool_blocks
    from differential.driver.settings import resolve_drafter
    from differential.driver.specs import pool_blocks

    return pool_blocks(scenario, resolve_drafter(scenario))


def export_engine_test(scenario: Scenario, finding: Finding, *, signature: str, name: str) -> str:
    """The pytest source asserting ``finding``'s expectation through vLLM's
    ``Scheduler`` (see the module docstring).

    Raises:
        ScenarioError: what :func:`check_exportable` refuses, or the finding
            is whole-run and not ``eviction-collapse``.
    """
    check_exportable(scenario)
    check, expectation = _assertion(scenario, finding)
    longest = max(r.prompt_tokens for r in scenario.requests)
    max_model_len = (
        longest + scenario.decode_steps + 3 * scenario.drafter.num_speculative_tokens + 2
    )
    w = scenario.workload
    if w.max_model_len_tokens is not None:
        max_model_len = w.max_model_len_tokens
    pool = _pool(scenario)
    geometry = (
        f"{_layout_text(scenario)}; retention {scenario.retention_interval_tokens}; drafter "
        f"{scenario.drafter.kind.value} x{scenario.drafter.num_speculative_tokens}; pool "
        f"{pool} blocks; {len(scenario.requests)} requests"
    )
    total = sum(r.prompt_tokens for r in scenario.requests)
    budget = scenario.step_budget_tokens
    dcp = scenario.dcp_world_size
    per_rank_block = scenario.scheduler_block_size_tokens // dcp
    mamba_config = (
        '    config.cache_config.mamba_cache_mode = "align"\n'
        f"    config.cache_config.mamba_block_size = {per_rank_block}\n"
        if scenario.mamba_groups
        else ""
    )
    if dcp > 1:  # decode context parallelism, as the driver sets it
        mamba_config = (
            f"    config.parallel_config.decode_context_parallel_size = {dcp}\n"
            f"    config.cache_config.block_size = {per_rank_block}\n" + mamba_config
        )
    extra_retained = (  # a sliding-window spec's extra_retained_tokens
        "    extra_retained = max(0, config.num_prefill_lookahead_tokens - 1)\n"
        if scenario.sliding_window_groups
        else ""
    )
    scheduler_settings = _scheduler_settings(scenario)
    source = _TEMPLATE.format(
        extra_retained=extra_retained,
        title=f"Engine-level prefix-cache regression: {finding.kind.value}.",
        details=docstring_lines(
            f"Exported by kvfuzz ({signature}), scheduler mode.",
            f"Geometry: {geometry}.",
            f"Expected: {expectation}",
        ),
        mamba_config=scheduler_settings + mamba_config,
        speculative_config=_speculative_config_source(scenario),
        num_spec=(
            f"{scenario.drafter.num_speculative_tokens} if accepted else 0"
            if scenario.drafter.num_speculative_tokens
            else "0"
        ),
        name=_test_name(name),
        max_model_len=max_model_len,
        scheduler_block_size=scenario.scheduler_block_size_tokens,
        hash_block_size=scenario.effective_hash_block_size_tokens,
        budget=budget,
        max_num_seqs=w.max_num_seqs or min(8, budget),
        pool=pool,
        groups=_groups(scenario),
        retention=scenario.retention_interval_tokens,
        prompts=literal([_runs(p) for p in scenario.prompts], column=41),
        max_tokens=scenario.decode_steps + 1,
        arrivals=literal(None if w.arrival_steps is None else list(w.arrival_steps), column=15),
        accepted=literal(list(w.accepted_drafts), column=15),
        max_steps=1_000 + 8 * (total + len(scenario.requests) * (scenario.decode_steps + 1)),
        assertion=check,
    )
    if scenario.has_mm_inputs or scenario.has_cache_salts:
        source = with_mm_inputs(
            source, scenario, before="    prompts = [_tokens(runs)", after_prompt=None, index="i"
        )
    source = with_skipped_reads(source, scenario, index="i")
    if scenario.has_mm_inputs:
        image_tokens = sum(p.length_tokens for placed in scenario.mm_placements for p in placed)
        budget_line = "    manager = scheduler.kv_cache_manager\n"
        if source.count(budget_line) != 1:
            raise ValueError("export template changed: cannot place the encoder budget")
        source = source.replace(
            budget_line,
            "    # The tiny text model gives the scheduler no encoder budget: one for the\n"
            "    # scenario's images that never cuts a step, as vLLM's scheduler tests set it.\n"
            f"    scheduler.max_num_encoder_input_tokens = {image_tokens}\n"
            "    scheduler.encoder_cache_manager = "
            f"EncoderCacheManager(cache_size={image_tokens})\n" + budget_line,
        )
    return with_imports(source)

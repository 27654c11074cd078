"""``kvfuzz export-test``: a standalone pytest in the style of vLLM's own tests.

The generated test imports only vLLM (no kvfuzz): it builds the KV cache
config and ``KVCacheManager`` with vLLM's public constructors, resolves the
drafter's ``use_eagle`` / lookahead settings with vLLM's own config classes,
sends the scenario's requests as the scheduler does (lookup, pinned junction,
chunked ``allocate_slots`` with lookahead slots, free) and asserts the hit the
oracle expects for the failing request. Modelled on
``tests/v1/core/test_prefix_caching.py`` in vLLM.
"""

from __future__ import annotations

import re

from differential.exports._source import import_block, literal, wrapped
from differential.findings import Finding, FindingKind
from differential.oracle import SiblingReference
from differential.scenario import (
    MM_PLACEHOLDER_TOKEN_ID,
    DrafterKind,
    GroupKind,
    MambaPrefill,
    Scenario,
)

__all__ = [
    "IMPORTABLE",
    "crash_parts",
    "docstring_lines",
    "export_test",
    "hit_check",
    "with_imports",
    "with_mm_inputs",
]

_METHOD = {
    DrafterKind.EAGLE: ("eagle", "eagle", 1),
    DrafterKind.EAGLE3: ("eagle3", "eagle", 1),
    DrafterKind.MTP: ("mtp", "deepseek_mtp", 1),
    DrafterKind.MULTI_MODULE_MTP: ("mtp", "deepseek_mtp", None),
    DrafterKind.GEMMA4_MTP: ("mtp", "gemma4_mtp", 1),
    DrafterKind.DFLASH: ("dflash", "dflash", 1),
    DrafterKind.DSPARK: ("dspark", "dspark", 1),
    DrafterKind.DRAFT_MODEL: ("draft_model", "llama", 1),
    DrafterKind.NGRAM: ("ngram", None, 1),
}

# The generated helper both exported tests share (this module's and
# differential/exports/scheduler_test.py's), filled in by speculative_config_source.
_SPECULATIVE_CONFIG = '''\
def _speculative_config() -> SpeculativeConfig:
    """A real SpeculativeConfig, its validators (which load the draft model)
    skipped."""
    spec = object.__new__(SpeculativeConfig)
    draft = {draft}
    for name, value in dict(
        method={method!r},
        num_speculative_tokens={num_spec},
        num_speculative_tokens_per_batch_size=None,
        disable_eagle_block_drop={disable_drop},
        disable_lookahead_block_hashes={disable_lookahead},
        parallel_drafting=False,
        draft_model_config=draft,
    ).items():
        object.__setattr__(spec, name, value)
    return spec
'''

_DRAFT_MODEL = """SimpleNamespace(
        model="draft",
        architectures=[],
        hf_config=SimpleNamespace(
            model_type={model_type!r}, num_nextn_predict_layers={modules}, sample_from_anchor=True
        ),
    )"""

_NO_DRAFTER = '''\
def _speculative_config() -> None:
    """No drafter: vLLM's speculative_config is None."""
    return None
'''

_TEMPLATE = '''\
# SPDX-License-Identifier: Apache-2.0
"""{title}

{details}
"""

@@IMPORTS@@

init_none_hash(sha256)


{speculative_config}

def _drafter_settings() -> tuple[bool, int, int, int]:
    """(use_eagle, num_hash_lookahead_tokens, num_lookahead_tokens,
    num_prefill_lookahead) as vLLM's config code resolves them."""
    spec = _speculative_config()
    config = object.__new__(VllmConfig)
    connector = {connector}
    for name, value in dict(
        speculative_config=spec,
        cache_config=CacheConfig(enable_prefix_caching=True),
        kv_transfer_config=connector,
        diffusion_config=None,
    ).items():
        object.__setattr__(config, name, value)
    use_eagle = {use_eagle}
    num_hash_lookahead = config.num_hash_lookahead_tokens
    if num_hash_lookahead:
        use_eagle = False  # lookahead hashes prove the boundary token
    return (
        use_eagle,
        num_hash_lookahead,
        config.num_lookahead_tokens,
        config.num_prefill_lookahead_tokens,
    )


def {name}() -> None:
    use_eagle, num_hash_lookahead, num_lookahead, num_prefill_lookahead = _drafter_settings()
{extra_retained}    groups = [
{groups}
    ]
    manager = KVCacheManager(
        KVCacheConfig(
            num_blocks={num_blocks},
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval={retention},
        ),
        max_model_len={max_model_len},
        scheduler_block_size={scheduler_block_size},
        hash_block_size={hash_block_size},
        enable_caching=True,
        use_eagle=use_eagle,
        num_hash_lookahead_tokens=num_hash_lookahead,
        num_prefill_lookahead=num_prefill_lookahead,
    )
    hasher = get_request_block_hasher({hash_block_size}, sha256, num_hash_lookahead)

    # Requests share a prefix, then diverge into tokens of their own, then may
    # rejoin their source at the same positions: (source request or None for
    # the shared prefix, divergence point, own tokens, rejoined tokens).
    shapes = {shapes}
    prefix = [1 + p % 50000 for p in range({prefix_tokens})]
    prompts = []
    for index, (source, divergence, own, rejoin) in enumerate(shapes):
        base = prefix if source is None else prompts[source]
        own_base = 1_000_000 * (index + 1)
        rejoined = base[divergence + own : divergence + own + rejoin]
        prompts.append(base[:divergence] + [own_base + k for k in range(own)] + rejoined)

    hits = []
    block_counts = []  # per request, blocks the lookup returned per KV cache group
    null_blocks = []  # per request and group, indices of null blocks among them
    for index, prompt in enumerate(prompts):
        request = Request(
            request_id=str(index),
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens={max_tokens}),
            pooling_params=None,
            block_hasher=hasher,
        )
        blocks, hit, junction = manager.get_computed_blocks(request)
        request.shared_prefix_boundary = junction
        hits.append(hit)
        block_counts.append([len(group) for group in blocks.blocks])
        null_blocks.append(
            [[k for k, b in enumerate(group) if b.is_null] for group in blocks.blocks]
        )
        computed, first = hit, True
        while computed < len(prompt):
            # Prefill chunk, never ending within the prefill lookahead of the end.
            num_new = min({chunk}, len(prompt) - computed)
            remaining = len(prompt) - computed - num_new
            if 0 < remaining < num_prefill_lookahead:
                num_new -= num_prefill_lookahead - remaining
            if first:
                new_blocks = manager.allocate_slots(
                    request,
                    num_new,
                    num_new_computed_tokens=hit,
                    new_computed_blocks=blocks,
                    num_lookahead_tokens=num_lookahead,
                )
                request.status = RequestStatus.RUNNING
                first = False
            else:
                new_blocks = manager.allocate_slots(
                    request, num_new, num_lookahead_tokens=num_lookahead
                )
            assert new_blocks is not None, f"request {{index}}: no room for its prefill"
            computed += num_new
            request.num_computed_tokens = computed
{decode}        manager.free(request)

{assertion}
'''


def _speculative_config_source(scenario: Scenario) -> str:
    """The generated ``_speculative_config()`` helper for ``scenario``'s drafter
    (no drafter: one that returns ``None``)."""
    if scenario.drafter.kind not in _METHOD:
        return _NO_DRAFTER
    method, model_type, modules = _METHOD[scenario.drafter.kind]
    draft = (
        "None"
        if model_type is None
        else _DRAFT_MODEL.format(
            model_type=model_type,
            modules=scenario.drafter.num_speculative_tokens if modules is None else modules,
        )
    )
    return _SPECULATIVE_CONFIG.format(
        method=method,
        draft=draft,
        num_spec=scenario.drafter.num_speculative_tokens,
        disable_drop=scenario.disable_eagle_block_drop,
        disable_lookahead=scenario.disable_lookahead_block_hashes,
    )


#: Every name an exported test may import, and its module ("": ``import name``);
#: :func:`differential.exports._source.import_block` keeps those used.
IMPORTABLE = {
    "json": "",
    "torch": "",
    "Path": "pathlib",
    "SimpleNamespace": "types",
    "CacheConfig": "vllm.config",
    "DeviceConfig": "vllm.config",
    "ModelConfig": "vllm.config",
    "SchedulerConfig": "vllm.config",
    "SpeculativeConfig": "vllm.config",
    "VllmConfig": "vllm.config",
    "KVTransferConfig": "vllm.config.kv_transfer",
    "SamplingParams": "vllm.sampling_params",
    "sha256": "vllm.utils.hashing",
    "MultiModalFeatureSpec": "vllm.multimodal.inputs",
    "MultiModalKwargsItem": "vllm.multimodal.inputs",
    "PlaceholderRange": "vllm.multimodal.inputs",
    "EncoderCacheManager": "vllm.v1.core.encoder_cache_manager",
    "KVCacheManager": "vllm.v1.core.kv_cache_manager",
    "get_request_block_hasher": "vllm.v1.core.kv_cache_utils",
    "init_none_hash": "vllm.v1.core.kv_cache_utils",
    "Scheduler": "vllm.v1.core.sched.scheduler",
    "ChunkedLocalAttentionSpec": "vllm.v1.kv_cache_interface",
    "FullAttentionSpec": "vllm.v1.kv_cache_interface",
    "KVCacheConfig": "vllm.v1.kv_cache_interface",
    "KVCacheGroupSpec": "vllm.v1.kv_cache_interface",
    "MambaSpec": "vllm.v1.kv_cache_interface",
    "MLAAttentionSpec": "vllm.v1.kv_cache_interface",
    "SinkFullAttentionSpec": "vllm.v1.kv_cache_interface",
    "SlidingWindowMLASpec": "vllm.v1.kv_cache_interface",
    "SlidingWindowSpec": "vllm.v1.kv_cache_interface",
    "DraftTokenIds": "vllm.v1.outputs",
    "ModelRunnerOutput": "vllm.v1.outputs",
    "Request": "vllm.v1.request",
    "RequestStatus": "vllm.v1.request",
    "StructuredOutputManager": "vllm.v1.structured_output",
}


def with_imports(source: str) -> str:
    """``source`` with its ``@@IMPORTS@@`` line replaced by the imports it uses."""
    head, marker, body = source.partition("@@IMPORTS@@")
    if not marker:
        raise ValueError("export template changed: no @@IMPORTS@@ line")
    return head + import_block(body, IMPORTABLE) + body


def docstring_lines(*sentences: str) -> str:
    """The exported test's docstring lines after its title, each wrapped."""
    return "\n".join(wrapped(text) for text in sentences)


def _layout_text(scenario: Scenario) -> str:
    """The KV cache groups in words, for a docstring: ``full_attention block 16, ...``."""
    return ", ".join(
        f"{g.kind.value} block {g.block_size_tokens}"
        + (f" window {g.sliding_window_tokens}" if g.sliding_window_tokens else "")
        + (f" sink {g.sink_len_tokens}" if g.sink_len_tokens else "")
        for g in scenario.kv_cache_groups
    )


def _groups(scenario: Scenario) -> str:
    """The ``KVCacheGroupSpec`` lines; a Mamba group is vLLM's ``MambaSpec`` in
    align mode, as the driver builds it. Under decode context parallelism an
    attention spec holds the per-rank block (``block_size_tokens /
    dcp_world_size``), as :func:`differential.driver.specs.group_spec`."""
    lines = []
    for index, g in enumerate(scenario.kv_cache_groups):
        common = [
            f"block_size={g.block_size_tokens // scenario.dcp_world_size}",
            "num_kv_heads=1",
            "head_size=8",
            "dtype=torch.float16",
        ]
        if g.kind.sliding_window_family:
            cls = (
                "SlidingWindowMLASpec"
                if g.kind is GroupKind.SLIDING_WINDOW_MLA
                else "SlidingWindowSpec"
            )
            args = [
                *common,
                f"sliding_window={g.sliding_window_tokens}",
                "extra_retained_tokens=extra_retained",
                *(["bounded_replay=True"] if g.bounded_replay else []),
            ]
        elif g.kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
            cls = "ChunkedLocalAttentionSpec"
            args = [*common, f"attention_chunk_size={g.attention_chunk_size_tokens}"]
        elif g.kind is GroupKind.MLA:
            cls, args = "MLAAttentionSpec", common
        elif g.kind is GroupKind.SINK_FULL_ATTENTION:
            cls, args = "SinkFullAttentionSpec", [*common, f"sink_len={g.sink_len_tokens}"]
        elif g.kind is GroupKind.MAMBA:
            cls = "MambaSpec"
            args = [
                f"block_size={g.block_size_tokens}",
                "shapes=((8,),)",
                "dtypes=(torch.float16,)",
                'mamba_cache_mode="align"',
                f"num_speculative_blocks={scenario.drafter.num_speculative_tokens}",
            ]
            if scenario.mamba_prefill is MambaPrefill.CHECKPOINT:
                # As MambaMixer2.get_kv_cache_spec declares them.
                args += ["num_prefill_checkpoint_blocks=1", "prefill_checkpoint_alignment=1"]
        else:
            cls, args = "FullAttentionSpec", common
        spec = "".join(f"                {a},\n" for a in args)
        eagle = "            is_eagle_group=True,\n" if g.is_eagle_group else ""
        lines.append(
            "        KVCacheGroupSpec(\n"
            f'            layer_names=["layer.{index}"],\n'
            f"            kv_cache_spec={cls}(\n{spec}            ),\n{eagle}"
            "        ),"
        )
    return "\n".join(lines)


def _wrong_kv_check(scenario: Scenario, request: int) -> tuple[str, str]:
    """Assertions on the blocks ``request``'s lookup returns, per KV cache group.

    As vLLM's ``tests/v1/core/test_prefix_caching.py`` does: the block count per
    group is the hit over the group's block size, and no null block lies
    where attention reads (all of full attention; the window of a sliding
    window group).
    """
    sizes = [g.block_size_tokens for g in scenario.kv_cache_groups]
    counts = ", ".join(f"hits[{request}] // {b}" for b in sizes)
    lines = [
        f"    # Request {request}'s lookup: one block per {sizes} tokens of its hit, per group.",
        f"    assert block_counts[{request}] == [{counts}], (\n"
        f'        f"request {request}: one block per block of its hit {{{{hits[{request}]}}}} in '
        f'each group, got {{{{block_counts[{request}]}}}}"\n'
        "    )",
    ]
    for gid, g in enumerate(scenario.kv_cache_groups):
        if g.kind.sliding_window_family:
            window, size = g.sliding_window_tokens, g.block_size_tokens
            first = f"max(0, hits[{request}] - {window} + 1) // {size}"
            lines.append(
                f"    # Group {gid} (window {g.sliding_window_tokens}): "
                "no null block inside the window below the hit."
            )
            lines.append(
                f"    assert all(k < {first} for k in null_blocks[{request}][{gid}]), (\n"
                f'        f"request {request}, group {gid}: a null block inside the window, at "\n'
                f'        f"{{{{null_blocks[{request}][{gid}]}}}}"\n'
                "    )"
            )
        else:
            lines.append(f"    # Group {gid} (full attention): no null block at all.")
            lines.append(
                f"    assert null_blocks[{request}][{gid}] == [], (\n"
                f'        f"request {request}, group {gid}: null blocks at '
                f'{{{{null_blocks[{request}][{gid}]}}}}"\n'
                "    )"
            )
    expectation = (
        f"request {request}'s lookup returns exactly one real block per block of its hit "
        "in every group (no extra block, no null block where attention reads)."
    )
    return "\n".join(lines), expectation


#: ``"<phase>: <vLLM call>: <exception type>: <message>"``, as the driver
#: writes a crash (:class:`differential.driver.features.VllmCallError`).
_CRASH = re.compile(r"(?P<call>[A-Za-z_][\w.]*): (?P<type>[A-Z]\w*): (?P<message>.*)", re.DOTALL)


def crash_parts(error: str) -> tuple[str, str, str] | None:
    """(vLLM call, exception type, message) of a crash's error text, or
    ``None`` when the error is not an exception vLLM raised (a worker that
    died, a timeout)."""
    match = _CRASH.search(error)
    if match is None:
        return None
    return match["call"], match["type"], match["message"]


def _crash_check(scenario: Scenario, finding: Finding) -> tuple[str, str]:
    """The assertion and expectation for a ``crash`` finding: every request
    runs to the end. On the vLLM that crashed, the test fails with vLLM's own
    exception, raised from the call the finding names."""
    request = finding.request if finding.request is not None else 0
    total = len(scenario.requests)
    parts = crash_parts(finding.detail)
    if parts is None:
        raised = f"the run did not finish ({finding.detail})"
    else:
        call, kind, message = parts
        raised = f"{call} raises {kind} ({message.strip()[:200]})"
    check = (
        f"    # Every request ran. Found by kvfuzz on {finding.variant}: at request {request}, "
        f"{raised}.\n"
        f'    assert len(hits) == {total}, f"{{len(hits)}} of {total} requests ran"'
    )
    expectation = (
        f"all {total} requests run without an exception; on {finding.variant}, at request "
        f"{request}, {raised}, so this test fails there with that exception."
    )
    return check, expectation


def hit_check(request: int, operator: str, tokens: int, owed: str) -> str:
    """``assert hits[request] <op> tokens`` with a message saying what was
    owed and what every request hit (not a bare ``AssertionError: [0, 4]``)."""
    return (
        f"    assert hits[{request}] {operator} {tokens}, (\n"
        f'        f"request {request} {owed}; hits per request: {{hits}}"\n'
        "    )"
    )


def _test_name(text: str) -> str:
    return "test_kvfuzz_" + re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def export_test(
    scenario: Scenario,
    finding: Finding,
    reference: SiblingReference | None,
    *,
    signature: str,
    name: str,
    fixed_hit_tokens: int | None,
) -> str:
    """The pytest source for ``finding`` on ``scenario``.

    Args:
        scenario: the (preferably shrunk) scenario.
        finding: the finding to assert against (its request is checked).
        reference: what the oracle says that request is owed (``None`` for
            a ``crash`` finding, whose test asserts that every request runs).
        signature: the finding's signature text, for the docstring.
        name: a name for the test function.
        fixed_hit_tokens: the request's hit on the fixed variant, if known:
            the assertion is exact when it equals the expected checkpoint.
    """
    request = finding.request if finding.request is not None else len(scenario.requests) - 1
    check, expectation = _finding_check(scenario, finding, reference, request, fixed_hit_tokens)
    expectation += _fix_note(finding, reference, fixed_hit_tokens)
    longest = max(r.prompt_tokens for r in scenario.requests)
    drafter = scenario.drafter.kind in _METHOD
    extra_retained = (  # a sliding-window spec's extra_retained_tokens
        "    extra_retained = max(0, num_prefill_lookahead - 1)\n"
        if scenario.sliding_window_groups
        else ""
    )
    source = _TEMPLATE.format(
        extra_retained=extra_retained,
        title=f"Prefix-cache regression: {finding.kind.value} on request {request}.",
        details=docstring_lines(
            f"Exported by kvfuzz ({signature}).",
            f"Geometry: {_geometry_text(scenario)}.",
            f"Expected: {expectation}",
        ),
        speculative_config=_speculative_config_source(scenario),
        connector=(
            'KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")'
            if scenario.kv_connector
            else "None"
        ),
        use_eagle="spec.use_eagle_block_drop()" if drafter else "False",
        decode=_decode_source(scenario),
        name=_test_name(name),
        groups=_groups(scenario),
        num_blocks=_pool_blocks(scenario),
        retention=scenario.retention_interval_tokens,
        max_model_len=longest + scenario.decode_steps + scenario.drafter.num_speculative_tokens + 2,
        scheduler_block_size=scenario.scheduler_block_size_tokens,
        hash_block_size=scenario.effective_hash_block_size_tokens,
        shapes=literal(_request_shapes(scenario), column=13),
        # Only the prefix some request copies (an unused tail costs memory, tests nothing).
        prefix_tokens=max(
            (r.divergence_tokens for r in scenario.requests if r.shares_with is None), default=0
        ),
        max_tokens=scenario.decode_steps + 1,
        chunk=scenario.prefill_chunk_tokens,
        assertion=check,
    )
    return with_imports(_with_scenario_features(source, scenario))


def _finding_check(
    scenario: Scenario,
    finding: Finding,
    reference: SiblingReference | None,
    request: int,
    fixed_hit_tokens: int | None,
) -> tuple[str, str]:
    """The assertion on ``request`` and the expectation in words, by the
    finding's kind: every request runs (``crash``), the blocks its lookup
    returns (``wrong-kv``), a ceiling on its hit in tokens (``over-hit``), or
    the checkpoint it is owed in tokens (exact when the fixed variant hits it).

    Raises:
        ValueError: a finding other than ``crash`` without the request's reference.
    """
    if finding.kind is FindingKind.CRASH:
        return _crash_check(scenario, finding)
    if reference is None:
        raise ValueError(f"a {finding.kind.value} finding needs the request's reference")
    if finding.kind is FindingKind.WRONG_KV:
        return _wrong_kv_check(scenario, request)
    if finding.kind is FindingKind.OVER_HIT:
        ceiling = (
            finding.expected_tokens
            if finding.expected_tokens is not None
            else reference.expected_tokens
        )
        check = hit_check(request, "<=", ceiling, f"may reuse at most {ceiling} tokens")
        expectation = (
            f"request {request} must not reuse more than {ceiling} tokens "
            f"(divergence point {reference.divergence_tokens})."
        )
        return check, expectation
    expected = reference.expected_tokens
    operator = "==" if fixed_hit_tokens == expected else ">="
    owed = "must hit" if operator == "==" else "must hit at least"
    check = hit_check(request, operator, expected, f"{owed} the checkpoint at {expected} tokens")
    expectation = (
        f"request {request} diverges at token {reference.divergence_tokens} and must hit the "
        f"checkpoint at {expected} tokens"
        + (
            f"; the {finding.owner} variant gives {finding.hit_tokens}."
            if finding.hit_tokens is not None
            else "."
        )
    )
    return check, expectation


def _fix_note(
    finding: Finding, reference: SiblingReference | None, fixed_hit_tokens: int | None
) -> str:
    """The expectation's closing sentence when the test fails with the seed fix
    too: a known vLLM issue, or a fixed-variant hit (in tokens) below the
    expected checkpoint; otherwise empty."""
    if finding.known_issue is not None:
        return (
            f" Known vLLM issue {finding.known_issue}: the seed fix does not repair it,"
            " so this test fails with the fix too."
        )
    if (
        finding.kind is not FindingKind.CRASH
        and reference is not None
        and fixed_hit_tokens is not None
        and fixed_hit_tokens < reference.expected_tokens
    ):
        return f" With the fix: {fixed_hit_tokens}, so this test fails with the fix too."
    return ""


def _pool_blocks(scenario: Scenario) -> int:
    """The exported manager's pool, in blocks: room for every request's prompt,
    decode steps and speculative slots in every KV cache group at once, plus
    a margin of 2 blocks per request and group and 16 overall, and a static
    sink's blocks (vLLM PR #28775 takes them off the free list)."""
    return 16 + scenario.num_sink_blocks + sum(
        (
            r.prompt_tokens
            + scenario.decode_steps
            + 2 * max(1, scenario.drafter.num_speculative_tokens)
        )
        // g.block_size_tokens
        + 2
        for r in scenario.requests
        for g in scenario.kv_cache_groups
    )


def _geometry_text(scenario: Scenario) -> str:
    """The scenario's geometry in words, for the docstring: KV cache groups and
    their block sizes, hit alignment and retention interval (tokens), drafter."""
    return (
        f"{_layout_text(scenario)}; hit alignment {scenario.effective_hit_alignment_tokens}; "
        f"retention {scenario.retention_interval_tokens}; drafter {scenario.drafter.kind.value} "
        f"x{scenario.drafter.num_speculative_tokens}"
    )


def _request_shapes(scenario: Scenario) -> list[tuple[int | None, int, int, int]]:
    """Per request: (the request it shares a prefix with, or ``None`` for the
    shared prefix; divergence point; own tokens; rejoined tokens), in tokens."""
    return [
        (r.shares_with, r.divergence_tokens, r.suffix_tokens, r.rejoin_tokens)
        for r in scenario.requests
    ]


def _decode_source(scenario: Scenario) -> str:
    """The test's decode lines after each request's prefill: a multi-turn chat's
    sampled answer, else ``decode_steps`` steps of one token each (none: empty)."""
    if scenario.workload.shares_output:
        return _answer_decode(scenario)
    if not scenario.decode_steps:
        return ""
    return (
        f"        for step in range({scenario.decode_steps}):\n"
        "            request.append_output_token_ids(500_000_000 + 1_000 * index + step)\n"
        "            assert manager.allocate_slots("
        "request, 1, num_lookahead_tokens=num_lookahead), (\n"
        '                f"request {index}: no room for decode step {step}"\n'
        "            )\n"
        "            computed += 1\n"
        "            request.num_computed_tokens = computed\n"
    )


def _with_scenario_features(source: str, scenario: Scenario) -> str:
    """``source`` with the lines the scenario's features need: a multi-turn
    chat's answers, Mamba state steps, the decode context parallel world size
    on the manager, and multimodal inputs or cache salts on each request.

    Raises:
        ValueError: the template lost the line the manager's DCP size goes before.
    """
    if scenario.workload.shares_output:
        source = _with_answers(source, scenario)
    source = _with_mamba_steps(source, scenario) if scenario.mamba_groups else source
    if scenario.dcp_world_size > 1:
        # The manager as the Scheduler builds it under decode context parallelism.
        caching = "        enable_caching=True,\n"
        if source.count(caching) != 1:
            raise ValueError("the manager-test template lost its enable_caching line")
        source = source.replace(
            caching, f"        dcp_world_size={scenario.dcp_world_size},\n{caching}"
        )
    if scenario.has_mm_inputs or scenario.has_cache_salts:
        source = with_mm_inputs(
            source,
            scenario,
            before="    prefix = [1 + p % 50000",
            after_prompt="        prompts.append(base[:divergence]",
            index="index",
        )
    return with_skipped_reads(source, scenario, index="index")


def _answer_decode(scenario: Scenario) -> str:
    """The decode lines of a multi-turn chat's exported test: each request
    samples its answer (``decode_steps + 1`` tokens, kvfuzz's stream
    ``Scenario.output_token``), ``decode_steps`` of them computed one step
    each, as the driver does (differential/driver/runner.py ``_decode`` and
    ``_sample``): a sampled token is appended, then under speculative
    decoding the request's blocks are cached up to its computed tokens
    (``Scheduler.update_from_output`` calls ``KVCacheManager.cache_blocks``),
    so the blocks whose lookahead hash needs that token are cached; the last
    sampled token is appended too, and its KV never computed."""
    cache = (
        "            manager.cache_blocks(request, computed)\n"
        if scenario.drafter.num_speculative_tokens
        else ""
    )
    return (
        f"        for step in range({scenario.decode_steps}):\n"
        "            request.append_output_token_ids(answers[index][step])\n"
        f"{cache}"
        "            assert manager.allocate_slots("
        "request, 1, num_lookahead_tokens=num_lookahead), (\n"
        '                f"request {index}: no room for decode step {step}"\n'
        "            )\n"
        "            computed += 1\n"
        "            request.num_computed_tokens = computed\n"
        f"        request.append_output_token_ids(answers[index][{scenario.decode_steps}])\n"
        + cache.replace("            ", "        ", 1)
    )


def _with_answers(source: str, scenario: Scenario) -> str:
    """``source`` (an exported manager-mode test) building a multi-turn chat
    (``workload.shares_output``): each request's answer is listed, and a
    request with a source copies the source's prompt followed by its answer,
    as ``Scenario.prompts`` builds it.

    Raises:
        ValueError: if the template no longer has the lines this edits.
    """
    answers = (
        "    # Each request's answer, the decode_steps + 1 tokens it samples; a later\n"
        "    # turn copies its source's prompt and answer (a multi-turn chat).\n"
        "    answers = [\n"
        f"        [1_500_000 + 1_000_000 * index + k for k in range({scenario.decode_steps + 1})]\n"
        "        for index in range(len(shapes))\n"
        "    ]\n"
    )
    edits = (
        ("    prefix = [1 + p % 50000", answers + "    prefix = [1 + p % 50000"),
        (
            "        base = prefix if source is None else prompts[source]\n",
            "        base = prefix if source is None else prompts[source] + answers[source]\n",
        ),
    )
    for old, new in edits:
        if source.count(old) != 1:
            raise ValueError(f"export template changed: cannot place {old.strip()!r}")
        source = source.replace(old, new)
    return source


_MM_HELPER = '''

def _mm_features(images: list[tuple[int, int, str]]) -> list[MultiModalFeatureSpec] | None:
    """A request's images as the engine core receives them, as vLLM's own
    tests build them (tests/v1/core/utils.py): (offset, length, identifier)."""
    return [
        MultiModalFeatureSpec(
            data=MultiModalKwargsItem.dummy(),
            mm_position=PlaceholderRange(offset=offset, length=length),
            identifier=identifier,
            modality="image",
        )
        for offset, length, identifier in images
    ] or None
'''


def with_skipped_reads(source: str, scenario: Scenario, *, index: str) -> str:
    """``source`` (an exported test) building each ``Request`` whose scenario
    request skips reading the prefix cache with
    ``SamplingParams(skip_reading_prefix_cache=True)``, as kvfuzz's driver
    does (differential/driver/runner.py ``make_request``); ``index`` names
    the request's index where ``Request`` is built.

    Raises:
        ValueError: if the template no longer has the line this edits.
    """
    skips = [i for i, r in enumerate(scenario.requests) if r.skip_reading_prefix_cache]
    if not skips:
        return source
    line = "SamplingParams(max_tokens="
    if source.count(line) != 1:
        raise ValueError("export template changed: cannot place skip_reading_prefix_cache")
    return source.replace(
        line,
        f"SamplingParams(skip_reading_prefix_cache={index} in {literal(skips, column=60)}, "
        "max_tokens=",
    )


def with_mm_inputs(
    source: str, scenario: Scenario, *, before: str, after_prompt: str | None, index: str
) -> str:
    """``source`` (an exported test) sending each request's images
    (``MultiModalFeatureSpec`` with its ``PlaceholderRange``) and
    ``cache_salt`` as kvfuzz's driver does
    (differential/driver/runner.py ``make_request``).

    Args:
        before: the start of the line the per-request lists go before.
        after_prompt: the start of the line that appends a prompt built from
            its shape, after which the images' placeholder tokens are
            written; ``None`` when the prompts are given token by token.
        index: the name of the request's index where ``Request`` is built.

    Raises:
        ValueError: if the template no longer has the lines this edits.
    """
    images = [
        [(p.offset_tokens, p.length_tokens, p.identifier) for p in placed]
        for placed in scenario.mm_placements
    ]
    salts = [r.cache_salt for r in scenario.requests]
    lists = (
        "    # Per request: its images (prompt offset, length, identifier), runs of the\n"
        f"    # placeholder token {MM_PLACEHOLDER_TOKEN_ID}, and its cache salt.\n"
        f"    images = {literal(images, column=13)}\n"
        f"    cache_salts = {literal(salts, column=18)}\n"
    )
    edits: list[tuple[str, str]] = [
        ("init_none_hash(sha256)\n", "init_none_hash(sha256)\n" + _MM_HELPER),
        (before, lists + before),
        (
            "            block_hasher=hasher,\n",
            f"            mm_features=_mm_features(images[{index}]),\n"
            f"            cache_salt=cache_salts[{index}],\n"
            "            block_hasher=hasher,\n",
        ),
    ]
    for old, new in edits:
        if source.count(old) != 1:
            raise ValueError(f"export template changed: cannot place {old.strip()!r}")
        source = source.replace(old, new)
    if after_prompt is not None:
        start = source.find(after_prompt)
        end = source.find("\n", start) + 1
        if start < 0 or source.count(after_prompt) != 1:
            raise ValueError(f"export template changed: cannot place {after_prompt.strip()!r}")
        overlay = (
            "        for offset, length, _ in images[index]:\n"
            "            prompts[-1][offset : offset + length] = "
            f"[{MM_PLACEHOLDER_TOKEN_ID}] * length\n"
        )
        source = source[:end] + overlay + source[end:]
    return source


# Mamba hybrids: every step starts with new_step_starts and every prefill
# chunk is clipped as vLLM's Scheduler clips it (a state exists only where a
# chunk ended), as the driver does (differential/driver/runner.py).
_MAMBA_HELPER = '''

def _mamba_chunk(manager: KVCacheManager, request: Request, num_new: int, local_hit: int) -> int:
    """Clip a prefill chunk with Scheduler._mamba_block_aligned_split."""
    view = SimpleNamespace(
        cache_config=SimpleNamespace(block_size={block}),
        block_size={scheduler_block_size},
        hash_block_size={hash_block_size},
        mamba_partial_cache_hit={partial},
        mamba_shared_prefix_checkpoint={shared_checkpoint},
        use_eagle_block_drop=manager.use_eagle,
        num_hash_lookahead_tokens=manager.block_pool.num_hash_lookahead_tokens,
        mamba_has_prefill_checkpoint_blocks={checkpoint},
        mamba_prefill_checkpoint_alignment={checkpoint_alignment},
        max_num_scheduled_tokens={chunk},
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
    )
    return Scheduler._mamba_block_aligned_split(view, request, num_new, local_hit)
'''

_BLOCK_HELPER = '''

def _mamba_chunk(manager: KVCacheManager, request: Request, num_new: int, local_hit: int) -> int:
    """A block-carved prefill step: end at the next Mamba block boundary."""
    start = request.num_computed_tokens + local_hit
    return min(num_new, (start // {block} + 1) * {block} - start)
'''


def _with_mamba_steps(source: str, scenario: Scenario) -> str:
    """``source`` with Mamba groups driven as the driver drives them.

    Raises:
        ValueError: if the template no longer has the lines this edits.
    """
    helper = _BLOCK_HELPER if scenario.mamba_prefill is MambaPrefill.BLOCK else _MAMBA_HELPER
    # As Scheduler.__init__ compares: the hash block against the scheduler block
    # (the Mamba block, or dcp_world_size times it under DCP).
    partial = (
        scenario.partial_hash_hits
        and scenario.effective_hash_block_size_tokens < scenario.scheduler_block_size_tokens
    )
    helper = helper.format(
        block=scenario.mamba_groups[0].block_size_tokens,
        scheduler_block_size=scenario.scheduler_block_size_tokens,
        hash_block_size=scenario.effective_hash_block_size_tokens,
        partial=partial,
        shared_checkpoint="manager.mamba_shared_prefix_checkpoint" if partial else False,
        chunk=scenario.prefill_chunk_tokens,
        checkpoint=scenario.mamba_prefill is MambaPrefill.CHECKPOINT,
        checkpoint_alignment=1 if scenario.mamba_prefill is MambaPrefill.CHECKPOINT else None,
    )
    chunk_line = (
        f"            num_new = min({scenario.prefill_chunk_tokens}, len(prompt) - computed)\n"
    )
    edits: tuple[tuple[str, str], ...] = (
        ("init_none_hash(sha256)\n", "init_none_hash(sha256)\n" + helper),
        (
            "        blocks, hit, junction = manager.get_computed_blocks(request)",
            "        manager.new_step_starts()\n"
            "        blocks, hit, junction = manager.get_computed_blocks(request)",
        ),
        (
            chunk_line,
            chunk_line + "            if not first:\n"
            "                manager.new_step_starts()\n"
            "            num_new = _mamba_chunk(manager, request, num_new, hit if first else 0)\n",
        ),
    )
    if scenario.decode_steps:
        edits += (
            (
                "            request.append_output_token_ids(",
                "            manager.new_step_starts()\n"
                "            request.append_output_token_ids(",
            ),
        )
    if scenario.enable_mamba_shared_prefix_checkpoint:
        edits += (
            (
                "        num_prefill_lookahead=num_prefill_lookahead,\n    )",
                "        num_prefill_lookahead=num_prefill_lookahead,\n"
                "        enable_mamba_shared_prefix_checkpoint=True,\n    )",
            ),
        )
    for old, new in edits:
        if source.count(old) != 1:
            raise ValueError(f"export template changed: cannot place {old.strip()!r}")
        source = source.replace(old, new)
    return source

"""The mutants of ``kvfuzz mutate``: which vLLM code is in scope, the mutations, the trees.

Mutation library: **cosmic-ray** (``cosmic_ray.plugins``,
``cosmic_ray.mutating.mutate_code``). Its operators are public classes that
enumerate mutation positions and rewrite one occurrence of a source string
(parso keeps the formatting, so a survivor's diff is one readable line), with
no test runner involved: kvfuzz runs the mutants itself. mutmut 3 rewrites
every function of a file into a trampoline that picks the mutant through its
own runner's state at call time; that couples the mutated vLLM to mutmut's
runner and changes every function of the file under test, which is wrong for
a tree that must otherwise be stock vLLM.

Two scopes (``kvfuzz mutate --scope``):

**cache** (the default, :data:`MODULES`): all of vLLM's prefix-cache code,
function by function where a file mixes it with other work.

* ``vllm/v1/core/single_type_kv_cache_manager.py``: every manager (full
  attention, sliding window, RSWA, chunked local, circular buffer, Mamba,
  cross-attention, sink, HiSparse) and the spec -> manager registry;
* ``vllm/v1/core/block_pool.py``: all of it (the cached-hash map, the free
  queue's eviction order, ``touch``, KV cache events);
* ``vllm/v1/core/kv_cache_coordinator.py``: everything but
  ``KVCacheCoordinatorNoPrefixCache`` (prefix caching off);
* ``vllm/v1/core/kv_cache_manager.py``: everything;
* ``vllm/v1/core/kv_cache_utils.py``: all but the memory-capacity reporting
  (``get_max_concurrency_for_kv_cache_config``, ``get_kv_cache_capacity``,
  ``update_kv_cache_capacity``, ``_kv_cache_device_name``) and
  ``KVCacheBlock.__repr__``: the block hasher, ``KVCacheBlock``,
  ``FreeKVCacheBlockQueue``, the hit granularity (``partial_hash_hits_enabled``,
  ``resolve_kv_cache_block_sizes``, ``resolve_cache_hit_alignment_tokens``),
  ``eagle_proof_margin``, the event keys;
* ``vllm/v1/core/kv_cache_planning.py`` (vLLM 0.33.0's name for the grouping
  code): all but the memory checks and the max-model-length estimates
  (:data:`_PLANNING_MEMORY`) and the warning ``_warn_if_unannotated_eagle_mamba``:
  grouping, page-size unification, packing, draft-group marking
  (``get_global_kv_cache_groups``), the config from groups;
* ``vllm/v1/core/kv_cache_config_builder.py``: all of it (the builder interface);
* ``vllm/v1/core/sched/scheduler.py``: the ``Scheduler`` methods that call
  the KV cache manager, the block pool or the KV connector, or decide
  admission and preemption (:data:`SCHEDULER_CACHE_METHODS`, each with why);
  its output processing, encoder cache, structured output, drafts, stats and
  shutdown stay out.

**managers** (:data:`MANAGER_MODULES`): the scope of the first recorded
runs (``docs/mutation-run.json``, ``docs/mutation-side-by-side-run.json``,
``docs/mutation-vllm-tests-run.json``): the full-attention and
sliding-window managers, the coordinators, ``KVCacheManager`` and the block
hasher of ``kv_cache_utils.py``, sampled evenly over its four modules as
those runs were.

Mutations inside type annotations and ``logger`` calls are not generated
(they cannot change what the manager does). A mutant's identifier names its
file and its cosmic-ray occurrence in the whole file, so the same mutant has
the same id in both scopes.

A mutant's tree (:func:`build_mutant_tree`) is the installed vLLM package
with one module's source replaced, run as a tree variant.

Nothing here imports vLLM.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import random
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from differential.errors import VariantError

__all__ = [
    "MANAGER_MODULES",
    "MODULES",
    "OUT_OF_SCOPE",
    "SCHEDULER_CACHE_METHODS",
    "SCOPES",
    "ModuleScope",
    "Mutant",
    "MutationScope",
    "build_mutant_tree",
    "enumerate_mutants",
    "installed_vllm",
    "mutant_diff",
    "mutant_source",
    "sample_mutants",
    "select_modules",
    "select_mutants",
]


# Sampled functions whose mutants kvfuzz cannot reach by design: the report
# says so beside every mutant only vLLM's own tests kill there. Each reason
# names the vLLM 0.33.0 code that makes it so.
OUT_OF_SCOPE: dict[str, str] = {
    "KVCacheManager.get_num_common_prefix_blocks": "deprecated in vLLM 0.33.0: cascade "
    "attention was removed, it returns zeros and the scheduler no longer calls it "
    "(vllm/v1/core/kv_cache_manager.py)",
    "KVCacheManager.record_blocks_for_zeroing": "its loop body runs only for a group whose "
    "new blocks are zeroed (attention beside Mamba layers, or mixed precisions) of a request "
    "a failed KV load left partly valid, which vLLM 0.33.0 reports by block id for a single "
    "KV cache group only (Scheduler._handle_invalid_blocks, "
    "vllm/v1/core/sched/scheduler.py): such a group is never zeroed",
}


@dataclass(frozen=True)
class ModuleScope:
    """One vLLM module to mutate and the part of it kvfuzz is meant to guard.

    Attributes:
        path: the file, relative to the ``vllm`` package folder.
        include: qualified names (``Class``, ``Class.method``, ``function``)
            whose code is mutated; empty for the whole module.
        exclude: qualified names left out even when ``include`` covers them.
    """

    path: str
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @property
    def short(self) -> str:
        """The file name without ``.py``."""
        return Path(self.path).stem

    def covers(self, qualname: str) -> bool:
        """Whether code in ``qualname`` (``""`` for module level) is in scope."""

        def under(names: tuple[str, ...]) -> bool:
            return any(qualname == n or qualname.startswith(n + ".") for n in names)

        if self.include and not under(self.include):
            return False
        return not under(self.exclude)


#: The scope of the first recorded runs (``--scope managers``): the managers
#: kvfuzz modelled first, sampled evenly over these four modules.
MANAGER_MODULES: tuple[ModuleScope, ...] = (
    ModuleScope(
        "v1/core/single_type_kv_cache_manager.py",
        include=(
            "SingleTypeKVCacheManager",
            "FullAttentionManager",
            "SlidingWindowManager",
            "get_manager_for_kv_cache_spec",
        ),
    ),
    ModuleScope("v1/core/kv_cache_coordinator.py", exclude=("KVCacheCoordinatorNoPrefixCache",)),
    ModuleScope("v1/core/kv_cache_manager.py"),
    ModuleScope(
        "v1/core/kv_cache_utils.py",
        include=(
            "make_block_hash_with_group_id",
            "get_block_hash",
            "get_group_id",
            "generate_block_hash_extra_keys",
            "hash_block_tokens",
            "get_request_block_hasher",
            "generate_lookahead_block_hash_extra_keys",
            "BlockHashListWithBlockSize",
            "resolve_block_hashes",
        ),
    ),
)

#: The ``Scheduler`` methods of ``vllm/v1/core/sched/scheduler.py`` in the
#: ``cache`` scope, each with why: they call the KV cache manager, the block
#: pool or the KV connector, or decide admission and preemption.
SCHEDULER_CACHE_METHODS: dict[str, str] = {
    "__init__": "builds the KVCacheManager and the KV connector, sets the watermark and "
    "the admission caps (running requests, tokens per step, in-flight prefills)",
    "_mamba_block_aligned_split": "cuts a prefill chunk at Mamba block boundaries, "
    "which decides the states the cache keeps",
    "_get_local_prefix_cache_hit": "the prefix-cache lookup (get_computed_blocks) "
    "and the connector's matched tokens",
    "_reserve_prefill_lookahead": "sizes a prefill chunk for an MTP drafter's lookahead "
    "(the tokens a step computes and caches)",
    "schedule": "admission and its caps, the watermark, allocate_slots, preemption "
    "and resume, connector loads",
    "_get_new_block_ids_to_zero": "the KV cache manager's new blocks to zero",
    "_preempt_request": "preemption: frees the request's blocks, tells the connector",
    "_update_after_schedule": "advances computed tokens and the in-flight prefill set "
    "the reservations read",
    "update_from_output": "caches and frees blocks of finished and stopped requests, "
    "reads the connector's output",
    "_is_blocked_waiting_status": "which waiting requests admission skips",
    "_holds_kv_blocks": "whether a waiting request holds KV blocks (its queue)",
    "_enqueue_waiting_request": "the waiting queue admission reads",
    "add_request": "queues a request for admission, registers it with the connector",
    "finish_requests": "frees a finished request's blocks",
    "_free_request": "frees blocks, or defers them to the connector",
    "_free_blocks": "frees a request's blocks in the KV cache manager",
    "_request_blocks_can_be_freed": "whether the connector still holds a request's blocks",
    "_free_request_blocks": "the KV cache manager's free",
    "_free_cow_retained_blocks": "frees blocks kept for copy-on-write (block pool)",
    "_drain_deferred_frees": "frees deferred under async scheduling (block pool)",
    "_drain_deferred_loads": "connector loads deferred to the next step",
    "reset_prefix_cache": "resets the prefix cache, preempting running requests",
    "reset_connector_cache": "resets the connector's cache",
    "_connector_finished": "the connector's end of a request: delayed frees",
    "_request_remaining_blocks": "blocks a request still needs (admission caps)",
    "_set_kv_fetch_stage": "a remote-prefill request's fetch stage (admission)",
    "_inflight_prefill_reserved_blocks": "blocks reserved for in-flight prefills",
    "_load_restores_replay_window": "whether a connector load restores the replay window",
    "_mark_prefix_replay": "marks a request's prefix replay after a load",
    "_update_waiting_for_remote_kv": "a finished remote KV load: caches the loaded blocks",
    "_handle_blocked_waiting_request": "resumes a request blocked on a remote KV load",
    "_update_from_kv_xfer_finished": "the connector's finished sends and receives",
    "_update_requests_with_invalid_blocks": "a failed load: recompute from the first invalid block",
    "_handle_failed_recving": "a failed receive frees or recomputes",
    "_handle_invalid_blocks": "the connector's invalid block ids",
}

#: Memory checks and max-model-length estimates of
#: ``vllm/v1/core/kv_cache_planning.py``: sizing, not what the cache keeps.
_PLANNING_MEMORY: tuple[str, ...] = (
    "_check_enough_kv_cache_memory",
    "max_memory_usage_bytes",
    "estimate_max_model_len",
    "check_enough_kv_cache_memory",
    "_max_memory_usage_bytes_from_groups",
    "_estimate_max_model_len_from_groups",
    "_auto_fit_max_model_len",
    "_warn_if_unannotated_eagle_mamba",
)

#: The ``cache`` scope: all of vLLM's prefix-cache code (the module docstring
#: lists what each file contributes).
MODULES: tuple[ModuleScope, ...] = (
    ModuleScope("v1/core/single_type_kv_cache_manager.py"),
    ModuleScope("v1/core/block_pool.py"),
    ModuleScope("v1/core/kv_cache_coordinator.py", exclude=("KVCacheCoordinatorNoPrefixCache",)),
    ModuleScope("v1/core/kv_cache_manager.py"),
    ModuleScope(
        "v1/core/kv_cache_utils.py",
        exclude=(
            "KVCacheBlock.__repr__",
            "get_max_concurrency_for_kv_cache_config",
            "get_kv_cache_capacity",
            "_kv_cache_device_name",
            "update_kv_cache_capacity",
        ),
    ),
    ModuleScope("v1/core/kv_cache_planning.py", exclude=_PLANNING_MEMORY),
    ModuleScope("v1/core/kv_cache_config_builder.py"),
    ModuleScope(
        "v1/core/sched/scheduler.py",
        include=tuple(f"Scheduler.{name}" for name in SCHEDULER_CACHE_METHODS),
    ),
)


@dataclass(frozen=True)
class MutationScope:
    """A named set of module scopes and how a sample is spread over them.

    Attributes:
        name: what ``kvfuzz mutate --scope`` calls it.
        modules: the modules and the part of each in scope.
        proportional: ``True``: a sample is drawn in proportion to the
            mutants each module has in scope (every mutant of the scope
            equally likely); ``False``: evenly over the modules.
    """

    name: str
    modules: tuple[ModuleScope, ...]
    proportional: bool


#: ``kvfuzz mutate --scope NAME``; the first is the default.
SCOPES: dict[str, MutationScope] = {
    "cache": MutationScope("cache", MODULES, proportional=True),
    "managers": MutationScope("managers", MANAGER_MODULES, proportional=False),
}


@dataclass(frozen=True)
class Mutant:
    """One mechanical change to one vLLM module.

    Attributes:
        module: the module's path relative to the ``vllm`` package folder.
        operator: the cosmic-ray operator name (``core/NumberReplacer``, ...).
        occurrence: which of the operator's positions in the module it
            mutates (cosmic-ray's occurrence index).
        line: the first line of the mutated code (1-based).
        function: the qualified name of the enclosing definition
            (``SlidingWindowManager.find_longest_cache_hit``; ``""`` for
            module level).
        statement_lines: ``(first, last)`` lines of the innermost statement
            holding the mutation (for a compound statement, its header only):
            the lines coverage is checked on.
        at_import: the mutated code runs when the module is imported (module
            and class bodies, decorators, default values), not in a call.
    """

    module: str
    operator: str
    occurrence: int
    line: int
    function: str
    statement_lines: tuple[int, int]
    at_import: bool = False

    @property
    def ident(self) -> str:
        """A stable identifier: ``<module stem>:<operator>:<occurrence>``."""
        return f"{Path(self.module).stem}:{self.operator.removeprefix('core/')}:{self.occurrence}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "module": self.module,
            "operator": self.operator,
            "occurrence": self.occurrence,
            "line": self.line,
            "function": self.function,
            "statement_lines": list(self.statement_lines),
            "at_import": self.at_import,
        }


def installed_vllm() -> Path:
    """The folder of the importable ``vllm`` package (found without importing it).

    Raises:
        VariantError: when no ``vllm`` package is importable.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise VariantError("kvfuzz mutate needs an importable vllm package; none found")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def _qualnames(tree: ast.Module) -> list[tuple[int, int, str]]:
    """``(first line, last line, qualified name)`` of every def and class."""
    spans: list[tuple[int, int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                spans.append((first, child.end_lineno or child.lineno, name))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return spans


def _innermost(spans: Iterable[tuple[int, int, str]], line: int) -> str:
    best = ""
    best_width = None
    for first, last, name in spans:
        if first <= line <= last and (best_width is None or last - first < best_width):
            best, best_width = name, last - first
    return best


def _excluded_ranges(tree: ast.Module) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Source ranges of annotations and ``logger.*(...)`` calls."""
    nodes: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            nodes.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns:
            nodes.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            nodes.append(node.annotation)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "logger"
        ):
            nodes.append(node)
    return [
        ((n.lineno, n.col_offset), (n.end_lineno or n.lineno, n.end_col_offset or 0))
        for n in nodes
        if hasattr(n, "lineno")
    ]


def _statement_lines(tree: ast.Module) -> list[tuple[int, int, int, int]]:
    """``(first, last, header first, header last)`` lines of every statement.

    The header of a compound statement (``if``, ``for``, ``while``, ``with``,
    ``try``, a ``def``) ends before its body; a simple statement is all header.
    """
    spans = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.stmt):
            continue
        last = n.end_lineno or n.lineno
        body = getattr(n, "body", None)
        header_last = max(n.lineno, body[0].lineno - 1) if isinstance(body, list) and body else last
        spans.append((n.lineno, last, n.lineno, header_last))
    return spans


def _function_bodies(tree: ast.Module) -> list[tuple[int, int]]:
    """``(first, last)`` lines of every function body (run at call time)."""
    return [
        (n.body[0].lineno, n.end_lineno or n.body[0].lineno)
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def _statement_span(statements: Sequence[tuple[int, int, int, int]], line: int) -> tuple[int, int]:
    best, width = (line, line), None
    for first, last, header_first, header_last in statements:
        if first <= line <= last and (width is None or last - first < width):
            best, width = (header_first, header_last), last - first
    return best


def _operators(only: Sequence[str] | None = None) -> list[tuple[str, Any]]:
    """Cosmic-ray operators that take no arguments (or those in ``only``), by name."""
    import cosmic_ray.plugins

    operators = []
    for name in cosmic_ray.plugins.operator_names():
        cls = cosmic_ray.plugins.get_operator(name)
        if not cls.arguments() and (only is None or name in only):
            operators.append((name, cls()))
    return operators


def enumerate_mutants(
    vllm_root: Path,
    modules: Sequence[ModuleScope] = MODULES,
    *,
    operators: Sequence[str] | None = None,
) -> dict[str, list[Mutant]]:
    """Every in-scope mutant of ``modules``, per module path, in cosmic-ray's order.

    Positions come from cosmic-ray's operators walking cosmic-ray's parse of
    the file (the same walk ``mutate_code`` repeats), so each mutant's
    ``occurrence`` reproduces it. ``operators`` restricts the operator names
    (``core/NumberReplacer``, ...); occurrences stay those of the full run.
    """
    from cosmic_ray.ast import ast_nodes, get_ast

    operators_used = _operators(operators)
    result: dict[str, list[Mutant]] = {}
    for scope in modules:
        source = (vllm_root / scope.path).read_text(encoding="utf-8")
        tree = ast.parse(source)
        spans = _qualnames(tree)
        excluded = _excluded_ranges(tree)
        statements = _statement_lines(tree)
        bodies = _function_bodies(tree)
        parsed = get_ast(source)
        nodes = list(ast_nodes(parsed))
        mutants: list[Mutant] = []
        for name, operator in operators_used:
            occurrence = 0
            for node in nodes:
                for start, _end in operator.mutation_positions(node):
                    line, col = start
                    qualname = _innermost(spans, line)
                    inside = any(a <= (line, col) < b for a, b in excluded)
                    if scope.covers(qualname) and not inside:
                        mutants.append(
                            Mutant(
                                scope.path,
                                name,
                                occurrence,
                                line,
                                qualname,
                                _statement_span(statements, line),
                                at_import=not any(a <= line <= b for a, b in bodies),
                            )
                        )
                    occurrence += 1
        result[scope.path] = mutants
    return result


def sample_mutants(
    mutants: dict[str, list[Mutant]], count: int, seed: int, *, proportional: bool = False
) -> list[Mutant]:
    """``count`` mutants drawn with ``random.Random(seed)``, module by module.

    Evenly (``proportional`` false): each module gets ``count // modules``
    (the remainder going to the modules with the most mutants). In
    proportion (``proportional`` true): each module gets its share of
    ``count`` by its number of mutants in scope, rounded by largest
    remainder (ties to the earlier module), so every mutant of the scope is
    equally likely and the shares add up to ``count``. Either way a module
    with fewer gives all it has. The same seed and mutants give the same
    sample, in the same order.

    Raises:
        VariantError: ``count`` below 1.
    """
    if count < 1:
        raise VariantError(f"--sample must be >= 1, got {count}")
    rng = random.Random(seed)
    modules = [m for m in mutants if mutants[m]]
    share = _proportional_shares(mutants, modules, count) if proportional else {}
    if not proportional:
        share = {m: count // len(modules) for m in modules} if modules else {}
        for m in sorted(modules, key=lambda m: -len(mutants[m]))[: count % max(1, len(modules))]:
            share[m] += 1
    picked: list[Mutant] = []
    for m in modules:
        pool = mutants[m]
        picked += rng.sample(pool, min(share[m], len(pool)))
    return picked


def _proportional_shares(
    mutants: dict[str, list[Mutant]], modules: Sequence[str], count: int
) -> dict[str, int]:
    """Each module's share of ``count`` by its mutants, by largest remainder
    (Hamilton's method; ties to the earlier module), never above what it has."""
    total = sum(len(mutants[m]) for m in modules)
    if total == 0:
        return {}
    count = min(count, total)
    exact = {m: count * len(mutants[m]) / total for m in modules}
    share = {m: int(exact[m]) for m in modules}
    order = sorted(modules, key=lambda m: (-(exact[m] - share[m]), modules.index(m)))
    for m in order[: count - sum(share.values())]:
        share[m] += 1
    return share


def select_mutants(mutants: dict[str, list[Mutant]], text: str) -> list[Mutant]:
    """The mutants named in ``text`` (comma-separated :attr:`Mutant.ident`), in that order.

    Raises:
        VariantError: an empty list, an id given twice, or one no generated
            mutant has (naming it and where the ids are listed).
    """
    by_id = {m.ident: m for module in mutants.values() for m in module}
    wanted = [part.strip() for part in text.split(",") if part.strip()]
    if not wanted:
        raise VariantError("--mutants is empty; allowed: comma-separated mutant ids")
    picked: list[Mutant] = []
    for ident in wanted:
        mutant = by_id.get(ident)
        if mutant is None:
            raise VariantError(
                f"--mutants {ident!r} is not a mutant of the selected modules; allowed: an id "
                "as a report prints it (<module stem>:<operator>:<occurrence>)"
            )
        if mutant in picked:
            raise VariantError(f"--mutants {ident!r} is given twice; allowed: each id once")
        picked.append(mutant)
    return picked


def mutant_source(vllm_root: Path, mutant: Mutant) -> tuple[str, str]:
    """``(stock source, mutated source)`` of the mutant's module.

    Raises:
        VariantError: when the occurrence no longer exists (a different vLLM).
    """
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    original = (vllm_root / mutant.module).read_text(encoding="utf-8")
    operator = cosmic_ray.plugins.get_operator(mutant.operator)()
    mutated = mutate_code(original, operator, mutant.occurrence)
    if mutated is None:
        raise VariantError(
            f"mutant {mutant.ident}: {mutant.operator} has no occurrence {mutant.occurrence} "
            f"in {mutant.module} of this vLLM"
        )
    return original, mutated


def mutant_diff(mutant: Mutant, original: str, mutated: str) -> str:
    """The unified diff (3 lines of context) of a mutant."""
    path = f"vllm/{mutant.module}"
    return "".join(
        difflib.unified_diff(
            original.splitlines(keepends=True),
            mutated.splitlines(keepends=True),
            fromfile=f"a/{path}",
            tofile=f"b/{path}",
            n=2,
        )
    )


def build_mutant_tree(vllm_root: Path, module: str, source: str, dest: Path) -> Path:
    """A tree folder whose ``vllm`` is the installed package with ``module`` replaced.

    ``dest/vllm`` is a symlink farm: every entry links to the installed
    package except the folders on the way to ``module``, which are real
    folders of links, and ``module`` itself, written with ``source``. The
    mutated module's folder gets its own ``__pycache__`` (links to the stock
    bytecode of its siblings), so the installed package is never written to.
    Building it takes milliseconds.

    Returns:
        ``dest`` (the folder to name as ``tree:dest``).
    """
    if dest.exists():
        shutil.rmtree(dest)
    parts = Path(module).parts
    src = vllm_root
    here = dest / "vllm"
    for depth in range(len(parts)):
        here.mkdir(parents=True)
        for entry in src.iterdir():
            if entry.name == parts[depth] or entry.name == "__pycache__":
                continue
            (here / entry.name).symlink_to(entry)
        if depth == len(parts) - 1:
            break
        src, here = src / parts[depth], here / parts[depth]
    (here / parts[-1]).write_text(source, encoding="utf-8")
    cache = src / "__pycache__"
    if cache.is_dir():
        mine = here / "__pycache__"
        mine.mkdir()
        stem = Path(parts[-1]).stem + "."
        for entry in cache.iterdir():
            if not entry.name.startswith(stem):
                (mine / entry.name).symlink_to(entry)
    return dest


def select_modules(text: str | None, scope: str = "cache") -> tuple[ModuleScope, ...]:
    """Parse ``--modules`` (comma-separated file stems; ``None``: every module
    of ``scope``, a :data:`SCOPES` name) into that scope's module scopes.

    Raises:
        VariantError: an unknown scope, or an unknown or empty module name.
    """
    chosen = SCOPES.get(scope)
    if chosen is None:
        raise VariantError(f"--scope {scope!r} is unknown; allowed: {', '.join(SCOPES)}")
    if text is None:
        return chosen.modules
    names = [n.strip().removesuffix(".py") for n in text.split(",") if n.strip()]
    by_stem = {m.short: m for m in chosen.modules}
    unknown = [n for n in names if n not in by_stem]
    if not names or unknown:
        raise VariantError(
            f"--modules: unknown module {', '.join(unknown) or repr(text)} in --scope {scope}; "
            f"allowed: {', '.join(by_stem)}"
        )
    return tuple(by_stem[n] for n in dict.fromkeys(names))

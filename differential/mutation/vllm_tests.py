"""vLLM's own tests as the peer of kvfuzz's mutation score (``kvfuzz mutate --vllm-tests``).

The same mutants kvfuzz judges are judged a second time by vLLM's own unit
tests for the same code: the ``tests/v1/core`` folder of a vLLM checkout (or
of a folder laid out like one). Per run, once:

1. **Stock.** Every test under ``tests/v1/core`` runs once on the installed,
   stock vLLM (``python -m pytest``, each test under pytest-timeout's
   per-test timeout), with coverage.py measuring, per test, which lines of
   the mutated modules it executes (:mod:`differential.mutation.vllm_tests_plugin`
   switches coverage's context per test). The tests that pass are the ones
   a mutant is held to.

Per mutant, after kvfuzz's own verdict, against the same mutant tree
(``PYTHONPATH`` naming the tree first, so its ``vllm`` wins):

2. **Selection by coverage.** Only the stock-passing tests that execute the
   mutated statement on stock run (a mutant of a line no test executes
   cannot change any test's outcome); for a mutant evaluated at import time
   (a default value, a class attribute) every stock-passing test that
   executes any line of the module runs.
3. **Verdict.** The mutant is *killed* by the tests when a selected test
   fails, errors or times out (pytest stops at the first); *survived* when
   all pass; *not run* when no test is selected. A failing test is rerun
   alone on an unmutated tree of the module (built as a mutant's is): one
   that fails there too is the tree's, not the mutant's; it is left out for
   the rest of the run and the mutant's selection runs again without it.

The tests run as a subprocess, forked from kvfuzz's fork server when one is
running (:func:`differential.forkserver.run_module`; pytest itself is never
pre-imported) or a fresh interpreter otherwise, with a working directory
holding stand-in Hugging Face model folders (``config.json`` and a tiny
tokenizer, no weights) for every ``org/name`` the tests mention: vLLM's
``ModelConfig`` treats such a name as a local folder when one exists.

Nothing here imports vLLM.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from differential import forkserver
from differential.errors import VariantError

__all__ = [
    "COVER_ENV",
    "REPORT_ENV",
    "PytestRun",
    "VllmTests",
    "VllmTestsBaseline",
    "VllmTestsOutcome",
    "VllmTestsVerdict",
    "check_tests_folder",
    "run_pytest",
    "write_model_folders",
]

#: The file the plugin writes its JSON lines to, and the files it measures
#: (:mod:`differential.mutation.vllm_tests_plugin`).
REPORT_ENV = "KVFUZZ_TESTS_REPORT"
COVER_ENV = "KVFUZZ_TESTS_COVER"
TESTS_SUBDIR = Path("tests") / "v1" / "core"
PYTEST_TIMEOUT_PIN = "pytest-timeout==2.4.0"
_PLUGIN = "differential.mutation.vllm_tests_plugin"
# Extra seconds a pytest process gets beyond its tests' timeouts (start-up,
# collection) before it is killed from outside.
_PROCESS_SLACK_S = 300.0
#: The stock run's limit as a whole, in seconds (each test has its own timeout).
STOCK_RUN_LIMIT_S = 6 * 3600.0
_KILLED = -9
#: Rounds of "a failing test fails on an unmutated tree too: leave it out, rerun".
_CONFIRM_ROUNDS = 3


class VllmTestsVerdict(StrEnum):
    """What vLLM's tests made of one mutant."""

    KILLED = "killed"
    SURVIVED = "survived"
    NOT_RUN = "not run"


@dataclass(frozen=True)
class VllmTestsOutcome:
    """vLLM's tests' verdict on one mutant.

    Attributes:
        verdict: killed, survived or not run (no stock-passing test executes
            the mutated statement).
        test: the first selected test that failed, errored or timed out
            (a pytest node id relative to the tests' root), or ``None``.
        detail: its outcome and first failure line (``"failed: E  assert ..."``).
        selected: stock-passing tests selected by coverage for this mutant.
        elapsed_s: wall time of the mutant's test runs, in seconds.
    """

    verdict: VllmTestsVerdict
    test: str | None
    detail: str
    selected: int
    elapsed_s: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "verdict": self.verdict.value,
            "test": self.test,
            "detail": self.detail,
            "selected": self.selected,
            "elapsed_s": round(self.elapsed_s, 2),
        }


@dataclass(frozen=True)
class VllmTestsBaseline:
    """The once-per-run stock run of vLLM's tests.

    Attributes:
        path: the tests' root (holding ``tests/v1/core``).
        collected: tests that ran on stock.
        passed: tests that passed on stock (the ones mutants are held to).
        elapsed_s: wall time of the stock run (under coverage), in seconds.
        timeout_s: the per-test timeout, in seconds.
        tree_sensitive: stock-passing tests that failed on an unmutated tree
            and were left out.
    """

    path: str
    collected: int
    passed: int
    elapsed_s: float
    timeout_s: float
    tree_sensitive: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "path": self.path,
            "collected": self.collected,
            "passed": self.passed,
            "elapsed_s": round(self.elapsed_s, 1),
            "timeout_s": self.timeout_s,
            "selection": "per mutant, the stock-passing tests that execute the mutated "
            "statement on stock (coverage.py, one context per test)",
            "tree_sensitive": list(self.tree_sensitive),
        }


@dataclass(frozen=True)
class PytestRun:
    """One ``python -m pytest`` run, as the plugin reported it.

    Attributes:
        outcomes: node id -> ``(outcome, first failure line)``.
        collect_errors: node id of each file that did not collect -> message.
        unfinished: the test running when the process was killed from
            outside (its overall timeout), or ``None``.
        coverage: real path of a measured file -> line -> node ids.
        returncode: pytest's exit status (-9 when killed past its limit).
        elapsed_s: wall time, in seconds.
    """

    outcomes: dict[str, tuple[str, str]]
    collect_errors: dict[str, str]
    unfinished: str | None
    coverage: dict[str, dict[int, set[str]]]
    returncode: int
    elapsed_s: float
    output_tail: str = ""


def check_tests_folder(path: Path) -> Path:
    """Validate ``--vllm-tests PATH`` and that pytest-timeout is installed; the resolved path.

    Raises:
        VariantError: ``PATH`` holds no ``tests/v1/core`` folder, or
            pytest-timeout is missing (with the install command).
    """
    if not (path / TESTS_SUBDIR).is_dir():
        raise VariantError(
            f"--vllm-tests {path}: no {TESTS_SUBDIR} folder there; allowed: a vLLM checkout "
            f"or a folder laid out like one"
        )
    if importlib.util.find_spec("pytest_timeout") is None:
        raise VariantError(
            f"--vllm-tests runs each test under pytest-timeout, which is not installed: "
            f"pip install {PYTEST_TIMEOUT_PIN}"
        )
    return path.resolve()


# A tokenizers-library serialisation of a three-token word-level tokenizer:
# what a test that initialises a model's tokenizer needs, without a download.
_TOKENIZER = (
    '{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],'
    '"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,'
    '"decoder":null,"model":{"type":"WordLevel","vocab":{"<unk>":0,"<s>":1,"</s>":2},'
    '"unk_token":"<unk>"}}'
)
_TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "unk_token": "<unk>",
    "bos_token": "<s>",
    "eos_token": "</s>",
}
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def write_model_folders(root: Path, dest: Path) -> list[str]:
    """Write a stand-in model folder under ``dest`` for every ``org/name`` string
    literal in the ``.py`` files under ``root/tests/v1/core``.

    Each holds kvfuzz's tiny Llama ``config.json``
    (``differential/driver/tiny_model``, with 8 attention and KV heads so
    tensor-parallel sizes up to 8 divide them) and a three-token tokenizer;
    vLLM's ``ModelConfig`` reads a name as a local folder when one exists
    relative to the working directory. No weights; no layer is ever built.

    Returns:
        The names written, sorted.
    """
    names: set[str] = set()
    for file in sorted((root / TESTS_SUBDIR).rglob("*.py")):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and _MODEL_NAME.match(node.value)
                and node.value.split("/")[0] not in ("tests", "vllm", ".", "..")
            ):
                names.add(node.value)
    tiny = Path(__file__).resolve().parent.parent / "driver" / "tiny_model" / "config.json"
    config = json.loads(tiny.read_text(encoding="utf-8"))
    config.update(num_attention_heads=8, num_key_value_heads=8, bos_token_id=1, eos_token_id=2)
    for name in sorted(names):
        folder = dest / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (folder / "tokenizer.json").write_text(_TOKENIZER + "\n")
        (folder / "tokenizer_config.json").write_text(json.dumps(_TOKENIZER_CONFIG) + "\n")
    return sorted(names)


def _parse_report(
    path: Path,
) -> tuple[dict[str, tuple[str, str]], dict[str, str], str | None, dict[str, dict[int, set[str]]]]:
    outcomes: dict[str, tuple[str, str]] = {}
    errors: dict[str, str] = {}
    started: str | None = None
    coverage: dict[str, dict[int, set[str]]] = {}
    if not path.exists():
        return outcomes, errors, None, coverage
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if "start" in record:
            started = record["start"]
        elif "test" in record:
            outcomes[record["test"]] = (record["outcome"], record["message"])
            started = None
        elif "collect_error" in record:
            errors[record["collect_error"]] = record["message"]
        elif "coverage" in record:
            coverage = {
                file: {int(n): set(ids) for n, ids in lines.items()}
                for file, lines in record["coverage"].items()
            }
    return outcomes, errors, started, coverage


def run_pytest(
    root: Path,
    targets: Sequence[str],
    *,
    cwd: Path,
    timeout_s: float,
    tree: Path | None = None,
    cover: Sequence[Path] = (),
    stop_at_first: bool = False,
    process_timeout_s: float | None = None,
) -> PytestRun:
    """Run vLLM's tests ``targets`` (node ids or paths relative to ``root``) as
    ``python -m pytest`` and read back each test's outcome.

    The process: forked from the fork server ``KVFUZZ_FORKSERVER`` names when
    one is running and can serve it, else a fresh interpreter; working
    directory ``cwd`` (the model folders of :func:`write_model_folders`,
    and a link ``cwd/tests`` to ``root/tests``: the working directory comes
    first on a ``python -m`` path, so ``tests.v1.core.utils`` imports from
    the checkout whatever else is on the path); ``PYTHONPATH`` = ``tree``
    (when given, so its ``vllm`` wins) then this process's own; pytest with
    ``--rootdir root``, ``--confcutdir root/tests/v1/core``,
    ``--import-mode=append`` (a checkout's own ``vllm/`` source folder never
    shadows the tree or the installed package), each test under
    ``--timeout timeout_s`` (pytest-timeout), kvfuzz's own plugin and the
    cache provider off, collection errors not fatal. The tests' report is
    written in a folder beside ``cwd`` (in ``kvfuzz mutate``'s work folder,
    which a later run removes if this one is SIGKILLed).

    Args:
        cover: files whose lines to measure per test (coverage.py).
        stop_at_first: stop at the first failing test (``-x``).
        process_timeout_s: kill the process after this many seconds
            (default: ``timeout_s`` per target plus 300 s).

    Raises:
        InternalError: pytest could not start or reported nothing at all.
    """
    from differential.errors import InternalError

    with tempfile.TemporaryDirectory(prefix="kvfuzz-vllm-tests-", dir=cwd.parent) as scratch:
        report = Path(scratch) / "report.jsonl"
        _link_tests(root, cwd)
        env = dict(os.environ)
        paths = [str(tree)] if tree is not None else []
        paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env[REPORT_ENV] = str(report)
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        if cover:
            env[COVER_ENV] = os.pathsep.join(str(p) for p in cover)
        else:
            env.pop(COVER_ENV, None)
        args = [
            "-p",
            "no:kvfuzz",
            "-p",
            "no:cacheprovider",
            "-p",
            _PLUGIN,
            f"--rootdir={root}",
            f"--confcutdir={root / TESTS_SUBDIR}",
            "--continue-on-collection-errors",
            "--import-mode=append",
            f"--timeout={timeout_s:g}",
            "-W",
            "ignore::pytest.PytestAssertRewriteWarning",
            "-q",
            "--no-header",
        ]
        if stop_at_first:
            args.append("-x")
        args += [str(root / t) for t in targets]
        limit = (
            process_timeout_s
            if process_timeout_s is not None
            else timeout_s * max(1, len(targets)) + _PROCESS_SLACK_S
        )
        started = time.perf_counter()
        completed = _run_module("pytest", args, cwd=cwd, env=env, timeout_s=limit)
        elapsed = time.perf_counter() - started
        outcomes, errors, unfinished, coverage = _parse_report(report)
    returncode = _KILLED if completed is None else completed.returncode
    tail = "" if completed is None else (completed.stdout + completed.stderr)[-2000:]
    if completed is not None and not outcomes and not errors and returncode not in (0, 1, 5):
        raise InternalError(f"vLLM's tests did not run (pytest exit {returncode}): {tail[-500:]}")
    return PytestRun(outcomes, errors, unfinished, coverage, returncode, elapsed, tail)


def _link_tests(root: Path, cwd: Path) -> None:
    """Make ``cwd/tests`` a link to ``root/tests`` (replacing another link)."""
    link = cwd / "tests"
    target = root / "tests"
    if link.is_symlink() and link.resolve() == target.resolve():
        return
    if link.is_symlink():
        link.unlink()
    link.symlink_to(target, target_is_directory=True)


def _run_module(
    module: str, args: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str] | None:
    """``python -m module args`` in a session of its own: forked when a fork
    server runs, else fresh; ``None`` when it ran past ``timeout_s``. Killed
    with every process it started (vLLM's tests start interpreters of their
    own, e.g. ``python -O -c`` in ``tests/v1/core/test_kv_cache_planning.py``)
    when it runs past ``timeout_s`` or the wait ends early (Ctrl-C, SIGTERM)."""
    address = os.environ.get(forkserver.ENV)
    if address:
        try:
            return forkserver.run_module(
                address, module, args, cwd=cwd, env=env, timeout_s=timeout_s, new_session=True
            )
        except subprocess.TimeoutExpired:
            return None
        except (forkserver.Unservable, OSError):
            pass  # a fresh interpreter below
    with subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            if isinstance(exc, subprocess.TimeoutExpired):
                return None
            raise
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # what the tests left running
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@dataclass
class VllmTests:
    """vLLM's tests prepared for one mutation run: the stock run, then a verdict per mutant.

    Build with :meth:`prepare`; call :meth:`judge` per mutant.

    Attributes:
        root: the tests' root (holding ``tests/v1/core``).
        cwd: the working directory with the model folders.
        timeout_s: per-test timeout, in seconds.
        vllm_root: the installed ``vllm`` package folder (stock).
        passed: node ids that pass on stock, in stock's run order.
        covering: module path (``v1/core/...``) -> line -> stock-passing node ids
            that execute it.
        baseline: the stock run's figures.
    """

    root: Path
    cwd: Path
    timeout_s: float
    vllm_root: Path
    passed: list[str]
    covering: dict[str, dict[int, set[str]]]
    baseline: VllmTestsBaseline
    tree_sensitive: set[str] = field(default_factory=set)
    _unmutated: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def prepare(
        cls, root: Path, vllm_root: Path, modules: Sequence[str], *, cwd: Path, timeout_s: float
    ) -> VllmTests:
        """Write the model folders into ``cwd`` and run every test under
        ``root/tests/v1/core`` once on stock, measuring ``modules`` per test.

        Raises:
            InternalError: pytest could not run at all, or ran past
                ``STOCK_RUN_LIMIT_S`` (each test has its own timeout besides).
        """
        from differential.errors import InternalError

        cwd.mkdir(parents=True, exist_ok=True)
        write_model_folders(root, cwd)
        files = {str((vllm_root / m).resolve()): m for m in modules}
        stock = run_pytest(
            root,
            [str(TESTS_SUBDIR)],
            cwd=cwd,
            timeout_s=timeout_s,
            cover=[Path(f) for f in files],
            process_timeout_s=STOCK_RUN_LIMIT_S,
        )
        if stock.returncode == _KILLED:
            raise InternalError(
                f"vLLM's tests under {root / TESTS_SUBDIR} ran past {STOCK_RUN_LIMIT_S:.0f} s on "
                f"stock (stopped in {stock.unfinished}); no mutant can be judged by them"
            )
        passed = [t for t, (outcome, _) in stock.outcomes.items() if outcome == "passed"]
        keep = set(passed)
        covering: dict[str, dict[int, set[str]]] = {m: {} for m in modules}
        for file, lines in stock.coverage.items():
            module = files.get(file)
            if module is not None:
                covering[module] = {n: ids & keep for n, ids in lines.items() if ids & keep}
        baseline = VllmTestsBaseline(
            str(root), len(stock.outcomes), len(passed), stock.elapsed_s, timeout_s
        )
        return cls(root, cwd, timeout_s, vllm_root, passed, covering, baseline)

    def select(self, module: str, lines: tuple[int, int], at_import: bool) -> list[str]:
        """The stock-passing tests a mutant of ``module`` at ``lines`` (first, last) is held
        to, in stock's run order: those executing a line of the statement, or for a
        mutant evaluated at import time, those executing any line of the module."""
        by_line = self.covering.get(module, {})
        if at_import:
            chosen = set().union(*by_line.values()) if by_line else set()
        else:
            chosen = set()
            for n in range(lines[0], lines[1] + 1):
                chosen |= by_line.get(n, set())
        chosen -= self.tree_sensitive
        return [t for t in self.passed if t in chosen]

    def judge(
        self,
        module: str,
        lines: tuple[int, int],
        at_import: bool,
        tree: Path,
        work: Path,
    ) -> VllmTestsOutcome:
        """Run the selected tests on the mutant ``tree`` (its ``vllm`` first on the path).

        A test that fails is rerun alone on an unmutated tree of ``module``
        (built under ``work`` once per module); failing there too, it is left
        out for the rest of the run (``tree_sensitive``) and the selection
        runs again without it.
        """
        started = time.perf_counter()
        selected = self.select(module, lines, at_import)
        if not selected:
            why = "no stock-passing test executes it"
            return VllmTestsOutcome(VllmTestsVerdict.NOT_RUN, None, why, 0, 0.0)
        for _round in range(_CONFIRM_ROUNDS):
            run = run_pytest(
                self.root,
                selected,
                cwd=self.cwd,
                timeout_s=self.timeout_s,
                tree=tree,
                stop_at_first=True,
            )
            failing = _first_failing(selected, run)
            if failing is None:
                return VllmTestsOutcome(
                    VllmTestsVerdict.SURVIVED,
                    None,
                    "",
                    len(selected),
                    time.perf_counter() - started,
                )
            test, detail = failing
            if not self._fails_unmutated(module, test, work):
                return VllmTestsOutcome(
                    VllmTestsVerdict.KILLED,
                    test,
                    detail,
                    len(selected),
                    time.perf_counter() - started,
                )
            self.tree_sensitive.add(test)
            self.baseline = _with_sensitive(self.baseline, self.tree_sensitive)
            selected = [t for t in selected if t != test]
            if not selected:
                break
        return VllmTestsOutcome(
            VllmTestsVerdict.SURVIVED, None, "", len(selected), time.perf_counter() - started
        )

    def _fails_unmutated(self, module: str, test: str, work: Path) -> bool:
        from differential.mutation.mutants import build_mutant_tree

        tree = self._unmutated.get(module)
        if tree is None:
            source = (self.vllm_root / module).read_text(encoding="utf-8")
            tree = build_mutant_tree(
                self.vllm_root, module, source, work / f"unmutated-tests-{Path(module).stem}"
            )
            self._unmutated[module] = tree
        run = run_pytest(self.root, [test], cwd=self.cwd, timeout_s=self.timeout_s, tree=tree)
        return run.outcomes.get(test, ("missing", ""))[0] != "passed"


def _with_sensitive(baseline: VllmTestsBaseline, tests: set[str]) -> VllmTestsBaseline:
    from dataclasses import replace

    return replace(baseline, tree_sensitive=tuple(sorted(tests)))


def _first_failing(selected: Sequence[str], run: PytestRun) -> tuple[str, str] | None:
    """The first selected test that did not pass, in run order, with ``"outcome: message"``.

    A test with no outcome is one the process never finished: the one it was
    running when killed from outside timed out; one never started because its
    file did not collect errored (the first collection error is named).
    """
    wanted = set(selected)
    for test, (outcome, message) in run.outcomes.items():
        if test in wanted and outcome != "passed":
            return test, f"{outcome}: {message}" if message else outcome
    if run.unfinished is not None:
        return run.unfinished, "timeout: the test process ran past its limit"
    missing = [t for t in selected if t not in run.outcomes]
    if missing and (run.returncode not in (0, 1) or run.collect_errors):
        where = next(iter(run.collect_errors.items()), None)
        why = f" ({where[0]}: {where[1]})" if where else f" (pytest exit {run.returncode})"
        return missing[0], f"error: not run{why}"[:300]
    return None

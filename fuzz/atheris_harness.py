"""atheris harness: coverage-guided fuzzing of the same target, under libFuzzer.

libFuzzer's bytes go through Hypothesis's ``fuzz_one_input`` into the very
same scenario strategy the campaign uses (:mod:`fuzz.target`); there is no
second generator. Findings that a known vLLM issue explains do not crash the
target unless ``--include-known`` is given. vLLM's ``vllm/v1/core`` (the
managers, the coordinator, the block pool, the scheduler) and kvfuzz's own
modules are instrumented for coverage: nothing of them is imported before
``atheris.instrument_imports``, and the instrumented modules are listed on
stderr before fuzzing starts. atheris instruments by top-level package, so
the rest of vLLM that the driver imports inside that block (``vllm.v1.request``,
``vllm.sampling_params``, ...) is instrumented too; vLLM's config, multimodal
and distributed packages, which do not import ``vllm.v1.core``, are imported
before it (:data:`PRE_IMPORTED`), which shortens the start-up by a third
(23 s instead of 33 s on 2 cores). A finding raises, so
libFuzzer saves the input as ``crash-<sha1>`` and stops; ``kvfuzz
import-crash`` turns it into a scenario file that ``kvfuzz replay`` reproduces.

Usage (everything after the kvfuzz options goes to libFuzzer; the first
folder receives new corpus entries and is created if missing, later ones are
read only; an ``-artifact_prefix`` ending in ``/`` is created too)::

    python -m fuzz.atheris_harness [--variants unfixed,fixed] [--no-dense-check] \\
        kvfuzz-out/atheris-corpus corpora -max_total_time=60 -artifact_prefix=kvfuzz-out/
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["INSTRUMENTED", "PRE_IMPORTED", "main"]

# Module prefixes atheris instruments for coverage feedback.
INSTRUMENTED = ("vllm.v1.core", "differential", "fuzz")
# Imported before instrumenting: about half of the vLLM modules the driver
# needs, none of them importing vllm.v1.core (checked by _pre_import), so
# atheris need not rewrite them.
PRE_IMPORTED = ("vllm.config", "vllm.multimodal", "vllm.distributed", "vllm.v1.kv_cache_interface")


def _pre_import() -> None:
    """Import :data:`PRE_IMPORTED`, uninstrumented; one a vLLM lacks is left
    to the instrumented imports.

    Raises:
        SystemExit: (exit 3) one of them imported a module under
            :data:`INSTRUMENTED` (a vLLM that does would hide it from coverage).
    """
    import importlib

    before = set(sys.modules)
    for name in PRE_IMPORTED:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    early = sorted(
        name
        for name in set(sys.modules) - before
        if any(name == p or name.startswith(p + ".") for p in INSTRUMENTED)
    )
    if early:
        print(
            f"kvfuzz: error: pre-importing {', '.join(PRE_IMPORTED)} imported "
            f"{', '.join(early)}, which would then not be instrumented",
            file=sys.stderr,
        )
        sys.exit(3)


def _prepare_folders(libfuzzer_args: Sequence[str]) -> None:
    """Create the output corpus folder and an artifact folder, as a fresh clone lacks them.

    Raises:
        SystemExit: (exit 2) a read-only corpus folder that does not exist.
    """
    folders = [arg for arg in libfuzzer_args if not arg.startswith("-")]
    if folders:
        Path(folders[0]).mkdir(parents=True, exist_ok=True)
    for folder in folders[1:]:
        if not Path(folder).exists():
            print(f"kvfuzz: error: corpus folder {folder} does not exist", file=sys.stderr)
            sys.exit(2)
    for arg in libfuzzer_args:
        if arg.startswith("-artifact_prefix=") and arg.endswith("/"):
            Path(arg.split("=", 1)[1]).mkdir(parents=True, exist_ok=True)


def _instrumented(names: set[str]) -> list[str]:
    """The modules of ``names`` atheris instrumented: those of INSTRUMENTED's
    top-level packages (atheris includes whole top-level packages)."""
    packages = {prefix.split(".")[0] for prefix in INSTRUMENTED}
    return sorted(name for name in names if name.split(".")[0] in packages)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse kvfuzz's options, hand the rest to libFuzzer, and fuzz."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m fuzz.atheris_harness",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--variants", default="unfixed,fixed")
    parser.add_argument("--policy", default="vllm", choices=("vllm", "retained", "ideal"))
    parser.add_argument("--no-dense-check", action="store_true")
    parser.add_argument(
        "--include-known",
        action="store_true",
        help="also crash on findings a known vLLM issue explains",
    )
    args, libfuzzer_args = parser.parse_known_args(argv)

    try:
        import atheris
    except ImportError:
        print("kvfuzz: error: atheris is not installed: pip install atheris", file=sys.stderr)
        sys.exit(2)
    _prepare_folders(libfuzzer_args)
    _pre_import()

    # Nothing under INSTRUMENTED is imported before this block (only the empty
    # `fuzz` package): every module under it is instrumented on import.
    before = set(sys.modules)
    with atheris.instrument_imports(include=list(INSTRUMENTED)):
        # The driver imports vLLM lazily; import the modules under test here,
        # through the driver (the only kvfuzz code importing vLLM): the
        # manager driver imports vLLM's KVCacheManager and Scheduler.
        import differential.driver.runner  # noqa: F401  (vllm.v1.core's managers)
        from differential.errors import VariantError
        from differential.findings import Policy
        from differential.variants import parse_variants
        from fuzz.target import build_target

        try:
            variants = parse_variants(args.variants)
        except VariantError as exc:
            print(f"kvfuzz: error: {exc}", file=sys.stderr)
            sys.exit(2)
        target = build_target(
            variants,
            policy=Policy(args.policy),
            database=None,
            dense_cross_check=not args.no_dense_check,
            raise_on_known=args.include_known,
        )

    modules = _instrumented(set(sys.modules) - before)
    core = [m for m in modules if m.startswith("vllm.v1.core")]
    print(
        f"kvfuzz: {len(modules)} modules instrumented "
        f"({sum(m.startswith('vllm') for m in modules)} of vLLM); "
        f"vllm.v1.core: {', '.join(core)}",
        file=sys.stderr,
        flush=True,
    )
    fuzz_one_input = target.hypothesis.fuzz_one_input

    def test_one_input(data: bytes) -> None:
        fuzz_one_input(data)

    atheris.Setup([sys.argv[0], *libfuzzer_args], test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

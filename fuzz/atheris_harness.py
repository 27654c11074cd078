"""atheris harness: coverage-guided fuzzing of the same target, under libFuzzer.

libFuzzer's bytes go through Hypothesis's ``fuzz_one_input`` into the very
same scenario strategy the campaign uses (:mod:`fuzz.target`); there is no
second generator. Findings that a known vLLM issue explains do not crash the
target unless ``--include-known`` is given. vLLM's ``vllm/v1/core`` and kvfuzz's own modules are
instrumented for coverage. A finding raises, so libFuzzer saves the input as
``crash-<sha1>`` and stops; ``kvfuzz import-crash`` turns it into a scenario
file that ``kvfuzz replay`` reproduces.

Usage (everything after the kvfuzz options goes to libFuzzer; the first
folder receives new corpus entries, later ones are read only)::

    python -m fuzz.atheris_harness [--variants unfixed,fixed] [--no-dense-check] \\
        kvfuzz-out/atheris-corpus corpora -max_total_time=60 -artifact_prefix=kvfuzz-out/
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse kvfuzz's options, hand the rest to libFuzzer, and fuzz."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m fuzz.atheris_harness",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--variants", default="unfixed,fixed")
    parser.add_argument("--policy", default="vllm", choices=("vllm", "ideal"))
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
        sys.exit("atheris is not installed: pip install atheris")

    from differential.variants import parse_variants

    variants = parse_variants(args.variants)
    with atheris.instrument_imports(include=["vllm.v1.core", "differential", "fuzz"]):
        from differential.findings import Policy
        from fuzz.target import build_target

        target = build_target(
            variants,
            policy=Policy(args.policy),
            database=None,
            dense_cross_check=not args.no_dense_check,
            raise_on_known=args.include_known,
        )

    fuzz_one_input = target.hypothesis.fuzz_one_input

    def test_one_input(data: bytes) -> None:
        fuzz_one_input(data)

    atheris.Setup([sys.argv[0], *libfuzzer_args], test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

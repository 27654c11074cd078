"""The ``kvfuzz`` command line.

Exit codes: 0 when the variants under test are clean, 1 when anything is
found, 2 for bad input or usage (the message names the field or option and
what is allowed), 3 when kvfuzz itself failed (an unexpected exception, a
campaign worker that died without reporting, an output that cannot be
written): one line on stderr names the error and the file holding the full
traceback. A crash is never reported as success or as a finding.

Each subcommand lives in its own module of :mod:`differential.commands`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from differential.commands import COMMANDS, command_module
from differential.commands.options import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    internal_failure,
    one_line,
    save_traceback,
)
from differential.errors import InternalError, ScenarioError, VariantError

__all__ = ["internal_failure", "main", "save_traceback"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfuzz",
        description=(
            "Differential testing of vLLM's prefix-cache managers: run scenarios "
            "on vLLM's real KVCacheManager, unfixed and fixed side by side, and "
            "report hits that fall back to an earlier checkpoint or reuse KV they must not."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        command_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvfuzz`` console script; returns the exit code.

    0 clean, 1 findings, 2 bad input or usage, 3 kvfuzz's own failure,
    130 interrupted outside a campaign (a campaign keeps what it found).
    """
    args = _parser().parse_args(argv)
    if args.command not in COMMANDS:
        return internal_failure(InternalError(f"unhandled command {args.command!r}"), argv)
    command: Callable[[argparse.Namespace], int] = command_module(args.command).run
    try:
        return command(args)
    except (ScenarioError, VariantError) as exc:
        print(f"kvfuzz: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvfuzz: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        return internal_failure(exc, argv)


if __name__ == "__main__":
    sys.exit(main())

"""The ``kvfuzz`` subcommands, one module each.

Each module has ``add_parser(sub)`` (registers the subcommand and its
options on the top-level parser's subparsers) and ``run(args) -> int`` (the
exit code). :mod:`differential.commands.options` holds what they share.
Importing a command module imports no vLLM; ``run`` imports it when needed.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Subcommand name -> module, in the order ``kvfuzz --help`` lists them.
COMMANDS: dict[str, str] = {
    "gate": "gate",
    "replay": "replay",
    "calibrate": "calibrate",
    "fuzz": "fuzz",
    "import-crash": "import_crash",
    "explain": "explain",
    "shrink": "shrink",
    "mutate": "mutate",
    "export-test": "export",
    "diff": "diff",
    "schema": "schema",
    "confirm": "confirm",
}

__all__ = ["COMMANDS", "command_module"]


def command_module(name: str) -> ModuleType:
    """The module implementing subcommand ``name`` (a key of :data:`COMMANDS`).

    Raises:
        KeyError: ``name`` is not a subcommand.
    """
    return importlib.import_module(f"differential.commands.{COMMANDS[name]}")

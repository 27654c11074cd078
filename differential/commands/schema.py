"""``kvfuzz schema``: the JSON Schema of scenario files (or of model descriptions).

The output is what ``schema/scenario.schema.json`` and
``schema/model.schema.json`` publish (a test keeps them equal), so editors
can complete and check scenario files. Imports no vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from differential.commands.options import EXIT_CLEAN

__all__ = ["add_parser", "run", "schema_text"]


def add_parser(sub: Any) -> None:
    """``kvfuzz schema [--model]``."""
    schema = sub.add_parser(
        "schema",
        help="print the JSON Schema of scenario files",
        description=(
            "Print the JSON Schema (draft 2020-12) of a scenario file: every field "
            "with its unit and allowed values, as published in "
            "schema/scenario.schema.json. With --model, the schema of a model "
            "description (schema/model.schema.json)."
        ),
    )
    schema.add_argument(
        "--model",
        action="store_true",
        help="the schema of a model description file instead of a scenario file",
    )


def schema_text(*, model: bool = False) -> str:
    """The schema as published: 2-space indented JSON with a trailing newline."""
    from differential.scenario.json_form import JSON_SCHEMA_DIALECT, scenario_file_schema
    from differential.scenario.models import model_schema

    schema = {"$schema": JSON_SCHEMA_DIALECT, **model_schema()} if model else scenario_file_schema()
    return json.dumps(schema, indent=2) + "\n"


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(schema_text(model=args.model))
    return EXIT_CLEAN

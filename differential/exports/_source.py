"""Helpers that keep exported tests ruff-clean under kvfuzz's own config
(``[tool.ruff]`` in pyproject.toml): imports sorted as isort sorts them and
only those the body uses, docstring lines within the line length.
"""

from __future__ import annotations

import pprint
import re
import textwrap
from collections.abc import Mapping

__all__ = ["LINE_LENGTH", "import_block", "literal", "wrapped"]

#: The exported tests' line length (kvfuzz's own).
LINE_LENGTH = 100

# Standard-library modules the exported tests import from.
_STDLIB = frozenset({"json", "pathlib", "types"})


def _member_key(name: str) -> tuple[int, str]:
    """isort's ``order-by-type``: constants, then classes, then the rest,
    each case-insensitively."""
    kind = 0 if name.isupper() else (1 if name[:1].isupper() else 2)
    return kind, name.lower()


def import_block(body: str, names: Mapping[str, str]) -> str:
    """The import statements for the names of ``names`` (name -> module;
    ``""``: ``import name``) that ``body`` uses, in isort's order: the
    standard library, then third-party, ``import x`` before ``from x
    import``, modules and members sorted, a ``from`` line wrapped one member
    per line when it would pass :data:`LINE_LENGTH`."""
    used = [n for n in names if re.search(rf"(?<![\w.]){re.escape(n)}\b", body)]
    sections: list[list[str]] = []
    for stdlib in (True, False):
        plain = sorted(
            (n for n in used if not names[n] and (n in _STDLIB) is stdlib), key=str.lower
        )
        modules: dict[str, list[str]] = {}
        for n in used:
            module = names[n]
            if module and (module.split(".")[0] in _STDLIB) is stdlib:
                modules.setdefault(module, []).append(n)
        lines = [f"import {n}" for n in plain]
        for module in sorted(modules, key=str.lower):
            members = sorted(modules[module], key=_member_key)
            line = f"from {module} import {', '.join(members)}"
            if len(line) > LINE_LENGTH:
                line = f"from {module} import (\n" + "".join(f"    {m},\n" for m in members) + ")"
            lines.append(line)
        if lines:
            sections.append(lines)
    return "\n\n".join("\n".join(lines) for lines in sections)


def wrapped(text: str, *, indent: str = "") -> str:
    """``text`` as lines of at most :data:`LINE_LENGTH` characters (a docstring's)."""
    return textwrap.fill(
        text,
        width=LINE_LENGTH - 4,
        initial_indent=indent,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    )


def literal(value: object, *, column: int) -> str:
    """``repr(value)`` for a line that starts it at ``column``: wrapped
    within :data:`LINE_LENGTH` (``pprint``'s compact form) when too long."""
    text = repr(value)
    if column + len(text) <= LINE_LENGTH:
        return text
    lines = pprint.pformat(value, width=LINE_LENGTH - column, compact=True).splitlines()
    return ("\n" + " " * column).join(lines)

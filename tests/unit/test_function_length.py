"""No function a reader must scroll: every function in ``differential/`` and
``fuzz/`` is at most 100 lines, from its first decorator to its last line
(docstring included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT_LINES = 100


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, length in lines)`` of every function in ``source``."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    assert child.end_lineno is not None
                    found.append((name, first, child.end_lineno - first + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_the_measure_counts_decorators_docstrings_and_nested_functions() -> None:
    source = (
        "@decorator\n"
        "def outer():\n"
        '    """Doc."""\n'
        "    def inner():\n"
        "        return 1\n"
        "    return inner\n"
        "class C:\n"
        "    def method(self):\n"
        "        pass\n"
    )
    assert function_lengths(source) == [
        ("outer", 1, 6),
        ("outer.inner", 4, 2),
        ("C.method", 8, 2),
    ]


def test_no_function_is_longer_than_the_limit() -> None:
    long = [
        f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for package in ("differential", "fuzz")
        for path in sorted((ROOT / package).rglob("*.py"))
        for name, line, length in function_lengths(path.read_text())
        if length > LIMIT_LINES
    ]
    assert long == []

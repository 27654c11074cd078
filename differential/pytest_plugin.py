"""kvfuzz's pytest plugin (entry point ``pytest11: kvfuzz``).

``--kvfuzz-variant NAME`` runs the whole test session with a kvfuzz variant's
patches installed, e.g. ``pytest --kvfuzz-variant fixed test_exported.py``
runs a test exported by ``kvfuzz export-test`` against the installed vLLM
plus the seed fix. Without the option the plugin does nothing and imports
nothing from vLLM.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import pytest

_ACTIVE: list[AbstractContextManager[None]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvfuzz")
    group.addoption(
        "--kvfuzz-variant",
        default=None,
        metavar="NAME",
        help="run the session with this kvfuzz variant's patches (e.g. fixed)",
    )


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("--kvfuzz-variant")
    if not name:
        return
    from differential.driver import patch_context
    from differential.errors import VariantError
    from differential.variants import parse_variants

    try:
        (variant,) = parse_variants(name)
    except VariantError as exc:
        raise pytest.UsageError(str(exc)) from None
    context = patch_context(variant)
    context.__enter__()
    _ACTIVE.append(context)


def pytest_unconfigure(config: pytest.Config) -> None:
    while _ACTIVE:
        _ACTIVE.pop().__exit__(None, None, None)

"""Output paths, checked before any work starts.

A report, picture or findings folder that cannot be written must be noticed
before vLLM is imported and scenarios run, not after (the results would be
lost). Each check raises :class:`~differential.errors.ScenarioError` naming
the option, the path and what is allowed, which the CLI answers with exit 2.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from differential.errors import ScenarioError

__all__ = ["check_output_file", "check_output_folder"]


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists."""
    current = path.absolute()
    while not os.path.lexists(current) and current != current.parent:
        current = current.parent
    return current


def _writable_folder(folder: Path) -> bool:
    """Whether a file can be created in ``folder`` (tried, not guessed)."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".kvfuzz-write-check-"):
            return True
    except OSError:
        return False


def check_output_folder(path: Path, option: str) -> None:
    """``path`` is, or can be created as, a writable folder.

    Raises:
        ScenarioError: ``path`` (or an ancestor) is a file, or the folder
            (or the ancestor it would be created in) is not writable.
    """
    existing = _nearest_existing(path)
    if not existing.is_dir():
        what = "is a file" if existing == path.absolute() else f"is under the file {existing}"
        raise ScenarioError(option, str(path), f"a folder (the path {what})")
    if not _writable_folder(existing):
        raise ScenarioError(option, str(path), f"a writable folder ({existing} is not writable)")


def check_output_file(path: Path, option: str) -> None:
    """``path`` can be written as a file (atomically: a temporary file beside it).

    Raises:
        ScenarioError: ``path`` is a folder, lies under a file, or its folder
            is not writable.
    """
    if path.is_dir():
        raise ScenarioError(option, str(path), "a file path (the path is a folder)")
    existing = _nearest_existing(path.parent)
    if not existing.is_dir():
        raise ScenarioError(
            option, str(path), f"a file path (the path is under the file {existing})"
        )
    if not _writable_folder(existing):
        raise ScenarioError(option, str(path), f"a writable location ({existing} is not writable)")

"""Output paths, checked before any work starts.

A report, picture or findings folder that cannot be written must be noticed
before vLLM is imported and scenarios run, not after (the results would be
lost). Each check raises :class:`~differential.errors.ScenarioError` naming
the option, the path and what is allowed, which the CLI answers with exit 2.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from differential.errors import ScenarioError

__all__ = [
    "check_distinct_outputs",
    "check_not_an_input",
    "check_output_file",
    "check_output_folder",
]


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


def _accepted(path: Path, option: str) -> None:
    """The file system accepts the name (not too long, no symlink loop)."""
    try:
        os.lstat(path)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise ScenarioError(
                option, str(path), f"a path the file system accepts ({exc.strerror})"
            ) from None


def check_output_folder(path: Path, option: str) -> None:
    """``path`` is, or can be created as, a writable folder.

    Raises:
        ScenarioError: ``path`` (or an ancestor) is a file, or the folder
            (or the ancestor it would be created in) is not writable, or the
            file system refuses the name (too long).
    """
    _accepted(path, option)
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
            is not writable, or the file system refuses the name (too long).
    """
    _accepted(path, option)
    if path.is_dir():
        raise ScenarioError(option, str(path), "a file path (the path is a folder)")
    from differential.corpus import is_stream

    if is_stream(path):  # a device, pipe or descriptor link: written as a stream
        if not os.access(path, os.W_OK):
            raise ScenarioError(option, str(path), "a writable file, device or pipe")
        return
    if path.is_symlink():  # the link's target is what gets replaced
        path = Path(os.path.realpath(path))
    existing = _nearest_existing(path.parent)
    if not existing.is_dir():
        raise ScenarioError(
            option, str(path), f"a file path (the path is under the file {existing})"
        )
    if not _writable_folder(existing):
        raise ScenarioError(option, str(path), f"a writable location ({existing} is not writable)")


def check_not_an_input(path: Path, option: str, inputs: Iterable[Path]) -> None:
    """``path`` is not one of the ``inputs`` (writing it would destroy one).

    Raises:
        ScenarioError: ``path`` names an input file (the same file, whatever
            the spelling: links and relative paths are resolved).
    """
    if not os.path.lexists(path) or not path.is_file():
        return
    for source in inputs:
        with contextlib.suppress(OSError):
            if os.path.samefile(path, source):
                raise ScenarioError(
                    option, str(path), f"a file that is not an input (it is {source})"
                )


def check_distinct_outputs(outputs: Iterable[tuple[str, Path | None]]) -> None:
    """No two of ``outputs`` (``(option, path)``; ``None``: not given) name
    one file: the later would replace the earlier (``--report r.json
    --junit-xml r.json``). A stream (``/dev/stdout``, a pipe, ``/dev/null``)
    is appended to, not replaced, and may be shared.

    Raises:
        ScenarioError: naming the later option, its path and the earlier option.
    """
    from differential.corpus import is_stream

    seen: dict[object, str] = {}
    for option, path in outputs:
        if path is None or is_stream(path):
            continue
        try:
            st = os.stat(path)
            key: object = (st.st_dev, st.st_ino)  # the same file, however named
        except OSError:
            key = os.path.realpath(path)
        if key in seen:
            raise ScenarioError(
                option, str(path), f"a path no other output is written to ({seen[key]} is)"
            )
        seen[key] = option

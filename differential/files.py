"""Reading the files a user names: regular files only, bounded in size, strict JSON.

The scenario files (:mod:`differential.corpus`) and the model descriptions
(:mod:`differential.scenario.models`) are read and parsed through here, so a
pipe, a device, a huge file or a key given twice is refused the same way for
both; :func:`project_root` says where the project's own files lie. Nothing
here imports another kvfuzz module but the errors.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from differential.errors import ScenarioError

__all__ = ["json_data", "project_root", "read_regular_file"]


def project_root() -> Path:
    """The folder holding the ``differential`` package: the project checkout
    (or, for an installed wheel, its site-packages folder), where the
    project's ``corpora/`` and ``known-issues/`` lie and the paths a known
    issue names (``KnownIssue.example``) start."""
    return Path(__file__).resolve().parents[1]


def read_regular_file(path: Path, field: str, *, limit_bytes: int = 64 << 20) -> bytes:
    """The bytes of the regular file ``path``, read without blocking.

    A FIFO, device or socket is refused before it is opened (reading a FIFO
    waits for a writer forever), and so is a file over ``limit_bytes``.

    Raises:
        ScenarioError: not a readable regular file, naming ``field`` and the path.
    """
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ScenarioError(field, str(path), "a regular file (not a pipe, device or folder)")
        if st.st_size > limit_bytes:
            raise ScenarioError(
                field, str(path), f"a file of at most {limit_bytes} bytes ({st.st_size})"
            )
        return path.read_bytes()
    except OSError as exc:
        raise ScenarioError(field, str(path), f"a readable file ({exc.strerror})") from None


class _DuplicateKey(ValueError):
    """A key given twice in one JSON object."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook``: an object, each key once."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKey(key)
        data[key] = value
    return data


def json_data(text: str, *, source: str | None = None) -> object:
    """Parse JSON text; ``source`` (a file name) is added to error messages.

    Raises:
        ScenarioError: malformed or absurdly deeply nested JSON, an integer
            too long to convert (Python's 4300-digit limit), field
            ``<json>``; a key given twice in one object (plain ``json``
            keeps the last silently), naming the key.
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise ScenarioError(
            f"<json> key {exc.key!r}",
            "given twice in one object",
            "each key at most once per object",
            source=source,
        ) from None
    except json.JSONDecodeError as exc:
        raise ScenarioError(
            "<json>",
            f"line {exc.lineno} column {exc.colno}",
            f"valid JSON ({exc.msg})",
            source=source,
        ) from None
    except RecursionError:
        raise ScenarioError(
            "<json>",
            "arrays or objects nested too deep to parse",
            "JSON nested at most a few hundred levels (a scenario needs 3)",
            source=source,
        ) from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise ScenarioError(
            "<json>",
            "an integer too long to read",
            f"numbers of at most 4300 digits ({exc})",
            source=source,
        ) from None

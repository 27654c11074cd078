"""Temporary folders named by the pid of the process that owns them
(``$TMPDIR/PREFIX<pid>...``): one whose owner is gone (SIGKILLed, so it could
not clean up) is removed by the next process that makes one. Standard
library only: the engine worker uses it in vLLM's CPU build environment.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["alive", "remove_stale"]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    return True


def remove_stale(temp: Path, prefix: str, separator: str = "") -> None:
    """Remove every ``temp/PREFIX<pid>[SEPARATOR...]`` folder whose pid is not
    this process's and is no longer alive; names without a pid are kept."""
    for stale in temp.glob(f"{prefix}*"):
        rest = stale.name.removeprefix(prefix)
        pid = rest.partition(separator)[0] if separator else rest
        if pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)

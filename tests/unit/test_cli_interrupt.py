"""Ctrl-C (SIGINT) to the ``kvfuzz`` command line: exit 130 and one line, never
a traceback, whenever it comes; and taken even where kvfuzz was started with
SIGINT ignored (a script's background job, ``kvfuzz confirm F & kill -INT $!``).

The signal is sent by the process to itself as a given module starts being
imported (an import hook), so it arrives at a known point of the start-up,
not after a guessed delay.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import CORPORA, ROOT

# argv: the module whose import sends SIGINT, "ignored" or "default", then
# kvfuzz's own arguments. Runs differential.cli as ``python -m`` does.
_SCRIPT = """
import os, runpy, signal, sys
target, start, *argv = sys.argv[1:]
if start == "ignored":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
else:
    # Python's own start, whatever the test process left to its children (an
    # ignored SIGINT is inherited across exec).
    signal.signal(signal.SIGINT, signal.default_int_handler)

class CtrlC:
    sent = False

    def find_spec(self, name, path=None, module=None):
        if name == target and not CtrlC.sent:
            CtrlC.sent = True
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["kvfuzz", *argv]
runpy.run_module("differential.cli", run_name="__main__", alter_sys=True)
"""


def _interrupted(
    target: str, start: str, *args: str, cwd: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT, target, start, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


@pytest.mark.parametrize(
    "target",
    [
        "differential.scenario",  # the first module of kvfuzz's own that loads anything
        "differential.commands.options",  # the command line's own imports
        "differential.commands.schema",  # building the parser: every command's module
    ],
)
def test_ctrl_c_while_kvfuzz_starts_is_one_line_and_exit_130(tmp_path: Path, target: str) -> None:
    done = _interrupted(target, "default", "schema", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "kvfuzz: interrupted\n")


def test_sigint_is_taken_where_kvfuzz_started_with_it_ignored(tmp_path: Path) -> None:
    # Sent as the run imports kvfuzz's driver, before vLLM: ignored, the
    # replay would go on to its verdict (exit 1).
    seed = CORPORA / "seeds" / "toy-mtp1-swa4-fa8-r64.json"
    done = _interrupted("differential.driver", "ignored", "replay", str(seed), cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "kvfuzz: interrupted\n")

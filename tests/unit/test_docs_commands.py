"""Every ``kvfuzz ...`` command line in the README and the manual parses with the current CLI.

The lines come from the fenced code blocks of ``README.md`` and
``docs/*.md``; each is split with :mod:`shlex` (``#`` starts a comment) and
handed to ``differential.cli._parser().parse_args``, which must not exit
with an error. No vLLM is imported (parsing imports no command's ``run``).

* Fences tagged ``text`` or ``json`` hold output or data, not commands, and
  are not read; every other fence is (``sh``, or untagged).
* A line ending in ``\\`` continues on the next line.
* Shell syntax after the command (``> FILE``, ``| CMD``, ``&&``, ``;``) is
  cut off; shell globs stay literal words, which argparse takes as paths.
* No command line is skipped: a placeholder such as ``FILE.json`` is a
  path argparse accepts, so every line is parsed as written. Synopsis
  notation (``[--json]``, ``<signature>``) would parse as paths too, so a
  word in it fails the test: the docs show commands one can run.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from differential.cli import _parser
from differential.commands import COMMANDS

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Fence info strings whose blocks hold output or data, never commands.
NOT_COMMANDS = frozenset({"text", "json"})

#: Shell tokens that end the command's own arguments.
SHELL_STOPS = frozenset({">", ">>", "|", "&&", "||", ";", "2>", "2>&1", "&"})


def command_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, command)`` for every ``kvfuzz`` line in ``text``'s command fences.

    Line numbers are 1-based and name the command's first line; continuation
    lines (a trailing backslash) are joined with a space.
    """
    found: list[tuple[int, str]] = []
    lines = text.splitlines()
    in_fence = False
    reads = False
    index = 0
    while index < len(lines):
        line = lines[index]
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
            reads = in_fence and stripped[3:].strip() not in NOT_COMMANDS
            index += 1
            continue
        if reads and stripped.startswith("kvfuzz "):
            start = index
            command = stripped
            while command.endswith("\\") and index + 1 < len(lines):
                index += 1
                command = command[:-1].rstrip() + " " + lines[index].strip()
            found.append((start + 1, command))
        index += 1
    return found


def argv_of(command: str) -> list[str]:
    """The arguments after ``kvfuzz``, up to the first shell operator."""
    words = shlex.split(command, comments=True)
    assert words[0] == "kvfuzz", command
    argv: list[str] = []
    for word in words[1:]:
        if word in SHELL_STOPS:
            break
        argv.append(word)
    return argv


CASES = [
    pytest.param(command, id=f"{page.relative_to(ROOT)}:{number}")
    for page in PAGES
    for number, command in command_lines(page.read_text())
]


def test_the_reader_finds_commands_and_skips_output() -> None:
    text = "\n".join(
        [
            "kvfuzz replay outside-a-fence",
            "```sh",
            "kvfuzz replay corpora  # a comment",
            "kvfuzz mutate corpora --sample 4 \\",
            "    --seed 1",
            "```",
            "```text",
            "kvfuzz diff release:0.32.0 -> unfixed: 39 corpus scenario(s)",
            "```",
            "```",
            "  kvfuzz export-test f.json > test_f.py",
            "```",
        ]
    )
    assert command_lines(text) == [
        (3, "kvfuzz replay corpora  # a comment"),
        (4, "kvfuzz mutate corpora --sample 4 --seed 1"),
        (11, "kvfuzz export-test f.json > test_f.py"),
    ]
    assert argv_of("kvfuzz replay corpora  # a comment") == ["replay", "corpora"]
    assert argv_of("kvfuzz export-test f.json > test_f.py") == ["export-test", "f.json"]


def test_a_wrong_command_line_does_not_parse() -> None:
    with pytest.raises(SystemExit) as raised:
        _parser().parse_args(argv_of("kvfuzz replay corpora --policy vllm|ideal"))
    assert raised.value.code == 2


def test_every_subcommand_has_an_example() -> None:
    shown = {argv_of(param.values[0])[0] for param in CASES}
    assert set(COMMANDS) <= shown, sorted(set(COMMANDS) - shown)


@pytest.mark.parametrize("command", CASES)
def test_command_line_parses(command: str) -> None:
    argv = argv_of(command)
    synopsis = [word for word in argv if word.startswith("[") or "<" in word]
    assert not synopsis, f"`{command}`: synopsis notation {synopsis}, not a command line"
    try:
        _parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code != 0:  # 0: ``--help`` printed and exited
            pytest.fail(f"`{command}` does not parse with the current CLI (exit {exc.code})")

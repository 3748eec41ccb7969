"""README's command table lists every subcommand and every flag ``vacancyd --help`` offers,
so a user reading it can find each option without running ``--help``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from vacancyd.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Long option strings of ``parser`` and of its own subcommands (``profiles export``)."""
    out = {
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    for sub in _subcommands(parser).values():
        out |= _flags(sub)
    return out


def _command_rows() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    return [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]


COMMANDS = sorted(_subcommands(build_parser()).items())


@pytest.mark.parametrize(("name", "parser"), COMMANDS, ids=[name for name, _ in COMMANDS])
def test_the_readme_command_table_lists_every_flag(
    name: str, parser: argparse.ArgumentParser
) -> None:
    rows = [r for r in _command_rows() if f"vacancyd {name}" in r or f"`{name} " in r]
    assert rows, f"README's command table has no row for `vacancyd {name}`"
    cell = " ".join(rows)
    missing = sorted(flag for flag in _flags(parser) if flag not in cell)
    assert not missing, f"README's row for `vacancyd {name}` omits {missing}"


def test_the_table_names_the_top_level_flags() -> None:
    assert any("vacancyd --version" in r for r in _command_rows())

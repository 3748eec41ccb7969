"""Every reason and error code vacancyd emits is spelled once, in ``vacancyd/core/reasons.py``:
no other module writes one as a string literal (it uses the enum member), so a code cannot be
misspelt in one place or renamed in only some."""

from __future__ import annotations

import ast
from enum import StrEnum
from pathlib import Path

from vacancyd.core import reasons

PACKAGE = Path(reasons.__file__).resolve().parents[1]
HOME = Path(reasons.__file__).resolve()

ENUMS: tuple[type[StrEnum], ...] = (
    reasons.Reason,
    reasons.ErrorType,
    reasons.ErrorCode,
    reasons.CreditCode,
    reasons.HoldReason,
    reasons.JobOutcome,
    reasons.GuardReason,
    reasons.AuthOutcome,
    reasons.PublishReason,
)
# ReclaimOutcome is left out: its words are also a reclaim phase (``stood_down``) and an
# unload's outcome (``timed_out``), which are other vocabularies. So is PowerLimitProblem:
# ``not_supported`` is also an upstream call's outcome (control/upstreamcalls.py).
#: Codes that are compound words (``owner_active``, ``not_loaded``): a literal with one of
#: these values is a code. Single words (``busy``, ``unknown``) are also ordinary words and
#: values of other enums, so they are not searched for.
CODES = {member.value for enum in ENUMS for member in enum if "_" in member.value}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings or bare comments-as-strings."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            out.add(id(node.value))
    return out


def _literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if node.value in CODES:
                found.append((node.lineno, node.value))
    return found


def test_the_search_knows_the_codes() -> None:
    assert {"owner_active", "resource_busy", "invalid_token", "not_loaded"} <= CODES


def test_no_module_spells_a_code_outside_reasons() -> None:
    stragglers = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {value!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.resolve() != HOME
        for line, value in _literals(path)
    ]
    assert not stragglers, "use the enum member from vacancyd/core/reasons.py:\n" + "\n".join(
        stragglers
    )


def test_the_search_finds_a_straggler(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('"""owner_active in a docstring is prose."""\nREASON = "owner_active"\n')
    assert _literals(sample) == [(2, "owner_active")]

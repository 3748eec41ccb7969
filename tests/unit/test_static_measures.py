"""Static measures of the code under ``vacancyd/`` (issue 20's guide): no function over
:data:`MAX_FUNCTION_LINES` lines.

A function's length is counted from its first decorator (or its ``def``) to its last line,
comments and docstring included; nested functions and methods count on their own, and also
as part of the function that holds them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import vacancyd

MAX_FUNCTION_LINES = 100

#: Functions known to be longer than the limit, as "path relative to vacancyd/:qualified
#: name" -> why they are still long. This list may only shrink: an entry is removed as soon as
#: its function is split (the test below fails on an entry that no longer needs to be here),
#: and a new long function is split rather than added.
ALLOWED_LONG_FUNCTIONS: dict[str, str] = {}

PACKAGE = Path(vacancyd.__file__).resolve().parent


def _functions(path: Path) -> Iterator[tuple[str, int, int]]:
    """(qualified name, first line, length in lines) of every function in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                last = child.end_lineno or child.lineno
                yield name, first, last - first + 1
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _long_functions() -> dict[str, tuple[int, int]]:
    """ "path:qualified name" -> (first line, length) of every function over the limit."""
    found: dict[str, tuple[int, int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for name, first, length in _functions(path):
            if length > MAX_FUNCTION_LINES:
                found[f"{rel}:{name}"] = (first, length)
    return found


def test_the_walk_sees_functions_methods_and_nested_ones(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import functools\n"
        "@functools.cache\n"
        "def top():\n"
        "    def inner():\n"
        "        return 1\n"
        "    return inner\n"
        "class C:\n"
        "    async def method(self):\n"
        "        pass\n"
    )
    assert sorted(_functions(source)) == [
        ("C.method", 8, 2),
        ("top", 2, 5),
        ("top.inner", 4, 2),
    ]


def test_no_function_over_the_limit() -> None:
    long = {k: v for k, v in _long_functions().items() if k not in ALLOWED_LONG_FUNCTIONS}
    listing = "\n".join(
        f"  vacancyd/{key.split(':')[0]}:{first} {key.split(':')[1]} ({length} lines)"
        for key, (first, length) in sorted(long.items())
    )
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n{listing}"
    )


def test_the_allow_list_only_names_functions_still_too_long() -> None:
    stale = sorted(set(ALLOWED_LONG_FUNCTIONS) - set(_long_functions()))
    assert not stale, f"no longer over {MAX_FUNCTION_LINES} lines: remove from the list: {stale}"

"""Static measures of the code under ``vacancyd/`` (issue 20's guide): no function over
:data:`MAX_FUNCTION_LINES` lines, no module over :data:`MAX_MODULE_LINES`, no class with more
than :data:`MAX_PUBLIC_METHODS` public methods, and no callback slot filled from outside
(``x.on_name = ...`` where ``x`` is not ``self``): collaborators are wired by construction.

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
MAX_MODULE_LINES = 700
MAX_PUBLIC_METHODS = 25

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


def test_no_module_over_the_limit() -> None:
    long = {
        path.relative_to(PACKAGE).as_posix(): n
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"


def _classes() -> Iterator[tuple[str, ast.ClassDef]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                yield f"{path.relative_to(PACKAGE).as_posix()}:{node.name}", node


def test_no_class_with_too_many_public_methods() -> None:
    wide = {}
    for name, node in _classes():
        public = [
            f.name
            for f in node.body
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and not f.name.startswith("_")
        ]
        if len(public) > MAX_PUBLIC_METHODS:
            wide[name] = len(public)
    assert not wide, f"classes with over {MAX_PUBLIC_METHODS} public methods: {wide}"


def test_no_callback_slot_is_filled_from_outside() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr.startswith("on_")
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self")
                ):
                    rel = path.relative_to(PACKAGE).as_posix()
                    found.append(f"{rel}:{node.lineno} {ast.unparse(target)}")
    assert not found, f"callback slots set from outside (pass them at construction): {found}"

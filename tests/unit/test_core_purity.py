"""vacancyd/core is pure decision logic: no event loop, clock, sockets, processes, threads
or file I/O. import-linter (``tools/dev lint``) checks the third-party side and the layers;
this checks the standard library, which import-linter does not see."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "vacancyd" / "core"

#: Standard-library modules that do I/O, read a clock or run concurrently.
FORBIDDEN = frozenset(
    {
        "asyncio",
        "concurrent",
        "http",
        "io",
        "logging",
        "multiprocessing",
        "os",
        "pathlib",
        "select",
        "selectors",
        "shutil",
        "signal",
        "socket",
        "ssl",
        "subprocess",
        "sys",
        "tempfile",
        "threading",
        "time",
        "urllib.request",
    }
)
#: Builtins that do I/O.
FORBIDDEN_CALLS = frozenset({"open", "input", "print", "breakpoint"})


def violations(source: str) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
            hit = sorted(prefixes & FORBIDDEN)
            if hit:
                found.append(f"line {getattr(node, 'lineno', 0)}: imports {hit[0]}")
                break
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in FORBIDDEN_CALLS
        ):
            found.append(f"line {node.lineno}: calls {node.func.id}()")
    return found


def core_modules() -> list[Path]:
    modules = sorted(CORE.glob("*.py"))
    assert len(modules) > 10, f"expected the core modules under {CORE}"
    return modules


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: p.name)
def test_core_module_does_no_io(path: Path) -> None:
    assert violations(path.read_text()) == []


def test_the_check_catches_what_it_forbids() -> None:
    assert violations("import asyncio") == ["line 1: imports asyncio"]
    assert violations("from time import monotonic") == ["line 1: imports time"]
    assert violations("import os.path") == ["line 1: imports os"]
    assert violations("from urllib import request") == ["line 1: imports urllib.request"]
    assert violations("x = open('f')") == ["line 1: calls open()"]
    assert violations("from urllib.parse import unquote\nimport math") == []

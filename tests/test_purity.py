"""The core is pure: no module under ``meshkit/core`` imports I/O, clocks or threads."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import meshkit.core

CORE = Path(meshkit.core.__file__).parent
FORBIDDEN = frozenset(
    {
        "socket",
        "asyncio",
        "threading",
        "time",
        "httpx",
        "httpx2",
        "aiohttp",
        "anyio",
        "concurrent",
        "selectors",
        "subprocess",
    }
)
MODULES = sorted(CORE.rglob("*.py"))


def imported_roots(tree: ast.AST) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name | ast.Attribute)
            and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr)
            in ("__import__", "import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            roots.add(node.args[0].value.split(".")[0])
    return roots


def test_core_modules_found() -> None:
    names = {p.relative_to(CORE).as_posix() for p in MODULES}
    assert {"endpoints.py", "requests.py", "forward.py", "policies/base.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(CORE).as_posix())
def test_core_module_is_pure(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bad = imported_roots(tree) & FORBIDDEN
    assert not bad, f"{path.relative_to(CORE)} imports {sorted(bad)}"


@pytest.mark.parametrize(
    "source",
    [
        "import socket",
        "import time as t",
        "from asyncio import sleep",
        "from concurrent.futures import ThreadPoolExecutor",
        "import httpx._client",
        "def f():\n    import threading",
        "importlib.import_module('subprocess')",
        "__import__('selectors')",
    ],
)
def test_checker_catches_forbidden_imports(source: str) -> None:
    assert imported_roots(ast.parse(source)) & FORBIDDEN

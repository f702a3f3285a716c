"""The compiled build (``hatch_build.py``): what it compiles, when, and that the
suite ran the build it was meant to.

CI installs meshkit as a wheel (``scripts/install-test-deps``) and sets
``MESHKIT_EXPECT_COMPILED=1``: a compilation that fell back to pure Python then
fails here instead of passing unnoticed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.resources
import importlib.resources.abc
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import meshkit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import hatch_build  # noqa: E402


def _module(path: str) -> str:
    return path.removeprefix("src/").removesuffix(".py").replace("/", ".")


def _is_extension(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, name
    return spec.origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_every_listed_module_exists() -> None:
    for path in hatch_build.COMPILED:
        assert (ROOT / path).is_file(), path
    assert len(set(hatch_build.COMPILED)) == len(hatch_build.COMPILED)


def test_the_build_is_what_ci_expects() -> None:
    if os.environ.get("MESHKIT_EXPECT_COMPILED") == "1":
        assert meshkit.compiled(), "the wheel was built without its compiled modules"


def test_compiled_means_exactly_the_listed_modules() -> None:
    listed = {_module(p) for p in hatch_build.COMPILED}
    if not meshkit.compiled():
        assert not any(_is_extension(m) for m in listed)
        return
    assert all(_is_extension(m) for m in listed)
    # what stays interpreted: the msgspec shapes, the policy base plugins subclass
    for name in ("meshkit.core.shapes", "meshkit.core.policies.base"):
        assert not _is_extension(name), name


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_build_reads_every_runtime_dependency() -> None:
    """mypy types the compiled modules' calls from what the build environment holds."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runtime = _names(project["project"]["dependencies"])
    build = _names(project["build-system"]["requires"])
    assert runtime <= build, runtime - build
    assert "mypy" in build


class _Hook(hatch_build.CustomBuildHook):
    """The hook without hatchling's builder around it."""

    def __init__(self, target: str = "wheel") -> None:
        self._target = target
        self._root = str(ROOT)

    @property
    def target_name(self) -> str:
        return self._target

    @property
    def root(self) -> str:
        return self._root


def _build_data() -> dict[str, Any]:
    return {"pure_python": True, "infer_tag": False, "force_include": {}}


def _recorded(called: list[Path]) -> Callable[[Path, Path], dict[str, str]]:
    """A ``_compile`` that records the root it was asked to build and builds nothing."""

    def compile_(root: Path, out: Path) -> dict[str, str]:
        called.append(root)
        return {}

    return compile_


def test_an_editable_install_is_never_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[Path] = []
    monkeypatch.setattr(hatch_build, "_compile", _recorded(called))
    monkeypatch.setenv("MESHKIT_COMPILE", "1")
    data = _build_data()
    _Hook().initialize("editable", data)
    _Hook("sdist").initialize("standard", data)
    assert called == [] and data == _build_data()


def test_compile_0_builds_the_pure_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[Path] = []
    monkeypatch.setattr(hatch_build, "_compile", _recorded(called))
    monkeypatch.setenv("MESHKIT_COMPILE", "0")
    data = _build_data()
    _Hook().initialize("standard", data)
    assert called == [] and data == _build_data()


def _failing(root: Path, out: Path) -> dict[str, str]:
    (out / "half-built.c").write_text("")
    raise RuntimeError("no C compiler")


def test_a_failed_compilation_falls_back_unless_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hatch_build, "_compile", _failing)
    monkeypatch.delenv("MESHKIT_COMPILE", raising=False)
    made = _build_dirs(monkeypatch)
    data = _build_data()
    with pytest.warns(UserWarning, match="pure-Python wheel"):
        _Hook().initialize("standard", data)
    assert data == _build_data()
    monkeypatch.setenv("MESHKIT_COMPILE", "1")
    with pytest.raises(RuntimeError, match="no C compiler"):
        _Hook().initialize("standard", _build_data())
    # what the failed builds left is gone, either way
    assert len(made) == 2 and not any(p.exists() for p in made)


def _build_dirs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record the build directories the hook makes."""
    made: list[Path] = []
    mkdtemp = tempfile.mkdtemp

    def recorded(prefix: str) -> str:
        made.append(Path(mkdtemp(prefix=prefix)))
        return str(made[-1])

    monkeypatch.setattr(tempfile, "mkdtemp", recorded)  # the module hatch_build calls
    return made


def test_the_build_directory_goes_once_the_wheel_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def compiled(root: Path, out: Path) -> dict[str, str]:
        (out / "lib").mkdir()
        so = out / "lib" / "router.so"
        so.write_bytes(b"\x7fELF")
        return {str(so): "meshkit/router.so"}

    monkeypatch.setattr(hatch_build, "_compile", compiled)
    monkeypatch.delenv("MESHKIT_COMPILE", raising=False)
    made = _build_dirs(monkeypatch)
    hook, data = _Hook(), _build_data()
    hook.initialize("standard", data)
    # the wheel is written from these paths: they must last until finalize
    assert all(Path(p).is_file() for p in data["force_include"])
    hook.finalize("standard", data, "dist/meshkit.whl")
    assert len(made) == 1 and not made[0].exists()
    hook.finalize("standard", data, "dist/meshkit.whl")  # twice is harmless


def test_each_extension_gets_the_flags_once() -> None:
    from setuptools import Extension

    shared = ["-O3"]  # mypycify hands every extension this same list
    exts = [Extension(name, ["a.c"], extra_compile_args=shared) for name in ("a", "b", "c")]
    for ext in exts:
        ext.extra_link_args = shared
    hatch_build.add_flags(exts, ["-fno-plt"], ["-Wl,-Bsymbolic-functions"])
    assert [e.extra_compile_args for e in exts] == [["-O3", "-fno-plt"]] * 3
    assert [e.extra_link_args for e in exts] == [["-O3", "-Wl,-Bsymbolic-functions"]] * 3
    assert shared == ["-O3"]


def test_an_extensions_c_files_compile_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """mypyc's group library is one extension of many C files: they compile two at a
    time here (a barrier of two times out if they go one by one), never more than
    ``_jobs()``, and the objects come back in the sources' order."""
    monkeypatch.setattr(hatch_build, "_jobs", lambda: 2)
    lock = threading.Lock()
    barrier = threading.Barrier(2, timeout=30)
    running = [0, 0]  # now, most at once

    class Compiler:
        def compile(self, sources: list[str], output_dir: str = "", **_: Any) -> list[str]:
            with lock:
                running[0] += 1
                running[1] = max(running)
            try:
                barrier.wait()
            finally:
                with lock:
                    running[0] -= 1
            return [f"{output_dir}/{src}.o" for src in sources]

    class BuildExt:
        def __init__(self) -> None:
            self.compiler = Compiler()
            self.objects: list[str] = []

        def build_extensions(self) -> None:
            sources = ["a.c", "b.c", "c.c", "d.c"]
            self.objects = self.compiler.compile(sources, output_dir="tmp")

    cmd = hatch_build._side_by_side(BuildExt)()
    cmd.build_extensions()
    assert cmd.objects == ["tmp/a.c.o", "tmp/b.c.o", "tmp/c.c.o", "tmp/d.c.o"]
    assert running == [0, 2]
    assert cmd.compiler.compile.__func__ is Compiler.compile  # put back after the build


def test_a_compiled_wheel_is_platform_specific(monkeypatch: pytest.MonkeyPatch) -> None:
    built = {"/tmp/x/meshkit/router.so": "meshkit/router.so"}
    monkeypatch.setattr(hatch_build, "_compile", lambda root, out: built)
    monkeypatch.delenv("MESHKIT_COMPILE", raising=False)
    hook, data = _Hook(), _build_data()
    hook.initialize("standard", data)
    assert data == {"pure_python": False, "infer_tag": True, "force_include": built}
    hook.finalize("standard", data, "dist/meshkit.whl")


def test_the_flags_for_local_calls_are_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CC", raising=False)
    # (sysconfig and sys: the very modules hatch_build reads them from)
    if sys.platform.startswith("linux") and shutil.which("cc"):
        monkeypatch.setattr(sysconfig, "get_config_var", lambda name: "cc")
        assert hatch_build.local_calls() == tuple(map(list, hatch_build.LOCAL_CALLS))
    # a compiler that refuses them (here: one that refuses everything) builds without
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: "false")
    assert hatch_build.local_calls() == ([], [])
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: "/no/such/cc")
    assert hatch_build.local_calls() == ([], [])
    # $CC, which build_ext runs instead when it is set, is the one asked
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: "cc")
    monkeypatch.setenv("CC", "false")
    assert hatch_build.local_calls() == ([], [])
    monkeypatch.setattr(sys, "platform", "darwin")
    assert hatch_build.local_calls() == ([], [])


def _elf_table(lib: str, option: str) -> list[list[str]]:
    out = subprocess.run(["readelf", "-W", option, lib], capture_output=True, text=True, check=True)
    return [line.split() for line in out.stdout.splitlines()]


def _build_record() -> importlib.resources.abc.Traversable:
    """Where the installed build keeps ``hatch_build.BUILD_RECORD``."""
    package, name = hatch_build.BUILD_RECORD.split("/")
    return importlib.resources.files(package).joinpath(name)


def _recorded_build() -> dict[str, Any]:
    """How the installed compiled build was built."""
    record: dict[str, Any] = json.loads(_build_record().read_text())
    return record


def test_a_compiled_build_records_its_flags() -> None:
    if not meshkit.compiled():
        assert not _build_record().is_file()
        return
    record = _recorded_build()
    assert set(record) == {"opt_level", "compile_args", "link_args"}
    # the flags for local calls, all or none (local_calls probes them as one set)
    compile_args, link_args = hatch_build.LOCAL_CALLS
    assert (record["compile_args"], record["link_args"]) in [
        (list(compile_args), list(link_args)),
        ([], []),
    ]


def test_the_compiled_modules_call_each_other_directly() -> None:
    """No call from one compiled module to another goes through the PLT
    (``hatch_build.local_calls``: what a one-client request's misses owe to it)."""
    if not meshkit.compiled() or not sys.platform.startswith("linux"):
        pytest.skip("a compiled build on Linux")
    if shutil.which("readelf") is None:
        pytest.skip("readelf")
    if not _recorded_build()["link_args"]:
        pytest.skip("this build's compiler refused the flags (its record says so)")
    spec = importlib.util.find_spec(f"{hatch_build.GROUP}__mypyc")
    assert spec is not None and spec.origin is not None
    # readelf --dyn-syms: Num Value Size Type Bind Vis Ndx Name
    defined = {
        row[7].split("@")[0]
        for row in _elf_table(spec.origin, "--dyn-syms")
        if len(row) >= 8 and row[3] == "FUNC" and row[6] != "UND"
    }
    assert any(name.startswith("CPyDef_") for name in defined)
    # readelf --relocs: Offset Info Type Symbol-value Symbol-name + Addend
    through_plt = {
        row[4].split("@")[0]
        for row in _elf_table(spec.origin, "--relocs")
        if len(row) >= 5 and row[2].endswith("JUMP_SLOT")
    }
    assert not through_plt & defined, sorted(through_plt & defined)[:5]


# Module-level names a compiled module rebinds on purpose or a test swaps:
# they stay dict lookups. streams._decode: tests/core/test_streams.py counts
# its calls by patching it.
_NOT_FINAL = {("src/meshkit/core/streams.py", "_decode")}


def _non_final_constants(path: str) -> list[str]:
    """Module-level names bound once, read inside functions (or public and
    upper-case: other compiled modules import them), and not ``Final``.

    Type aliases and type variables are not constants (mypyc does not read them
    at run time), nor are names a ``global`` statement rebinds.
    """
    import ast

    tree = ast.parse((ROOT / path).read_text())
    bound: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.value is not None and "Final" not in ast.unparse(node.annotation):
                bound[node.target.id] = bound.get(node.target.id, 0) + 1
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                for name in names:
                    if not isinstance(name, ast.Name):
                        continue
                    value = node.value
                    # a type alias is CamelCase (Headers, _Serving); constants are not
                    alias = name.id.lstrip("_")[:1].isupper() and not name.id.isupper()
                    typevar = (
                        isinstance(value, ast.Call)
                        and isinstance(value.func, ast.Name)
                        and value.func.id == "TypeVar"
                    )
                    if not (alias or typevar):
                        bound[name.id] = bound.get(name.id, 0) + 1
    rebound = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    read = {
        n.id
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for n in ast.walk(fn)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }
    return sorted(
        name
        for name, times in bound.items()
        if times == 1
        and (name in read or (name.isupper() and not name.startswith("_")))
        and name not in rebound
        and not name.startswith("__")
        and name not in ("log", "access_log")
        and (path, name) not in _NOT_FINAL
    )


def test_compiled_modules_read_their_constants_as_final() -> None:
    """A module constant without ``Final`` is a dict lookup in compiled code at
    every read (``docs/architecture.md``, "Compiled and interpreted")."""
    missing = {p: names for p in hatch_build.COMPILED if (names := _non_final_constants(p))}
    assert missing == {}

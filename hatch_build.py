"""
The compiled build: the request path through mypyc
==================================================

A wheel of meshkit (``pip install .``, ``python -m build``) compiles the modules of
the request path (:data:`COMPILED`) with mypyc: the same Python source, type-checked
by ``mypy --strict`` as it always is, turned into C extension modules. Measured on
the gateway's proxy benchmark, the compiled gateway spends about half the CPU per
request of the interpreted one at 16-64 clients (``benchmarks/RESULTS.md``), which
is what puts the gateway level with vllm-router's CPU per request there.

* An **editable** install (``pip install -e .``, ``scripts/install-test-deps
  --editable``: the development set-up) is never compiled: an edited ``.py`` file
  is what runs, there is no extension module beside it to shadow it. The README's
  commands install the wheel, compiled.
* ``MESHKIT_COMPILE=0`` builds a pure-Python wheel; ``MESHKIT_COMPILE=1`` makes a
  failed compilation an error. Unset (the default), a compilation that fails (no C
  compiler, an interpreter mypyc does not support) warns and builds the pure wheel:
  meshkit behaves the same either way, only slower.
* ``meshkit.compiled()`` says which build runs.

Only modules whose classes and functions mypyc compiles faithfully are listed: a
module that defines msgspec ``Struct`` types, runtime-checkable protocols, or
classes that plugins subclass and name by class attributes (the policies) stays
interpreted
(``tests/test_compiled.py`` checks the list against what is installed).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

#: compiled in a wheel: the modules a proxied request runs through, in every mode
COMPILED = (
    "src/meshkit/accounting.py",
    "src/meshkit/core/credentials.py",
    "src/meshkit/core/endpoints.py",
    "src/meshkit/core/forward.py",
    "src/meshkit/core/lifecycle.py",
    "src/meshkit/core/payload.py",
    "src/meshkit/core/placement.py",
    "src/meshkit/core/policies/context.py",
    "src/meshkit/core/relay.py",
    "src/meshkit/core/requests.py",
    "src/meshkit/core/states.py",
    "src/meshkit/core/streams.py",
    "src/meshkit/core/workers.py",
    "src/meshkit/frontends/asgi.py",
    "src/meshkit/frontends/routed.py",
    "src/meshkit/frontends/wsgi.py",
    "src/meshkit/http1.py",
    "src/meshkit/mesh.py",
    "src/meshkit/metrics.py",
    "src/meshkit/prepare/pipeline.py",
    "src/meshkit/router.py",
    "src/meshkit/server/h1/conn.py",
    "src/meshkit/upstream/blocking.py",
    "src/meshkit/upstream/drive.py",
    "src/meshkit/upstream/fast.py",
)

#: the shared runtime library of the compiled modules (top level in the wheel)
GROUP = "meshkit"


class CustomBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        wanted = os.environ.get("MESHKIT_COMPILE", "")
        if wanted == "0":
            return
        try:
            built = _compile(Path(self.root))
        except Exception as exc:
            if wanted == "1":
                raise
            warnings.warn(
                f"meshkit: building the pure-Python wheel, mypyc failed: {exc}", stacklevel=1
            )
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["force_include"].update(built)


def _compile(root: Path) -> dict[str, str]:
    """Compile :data:`COMPILED`; the extension files as ``{built path: wheel path}``."""
    from mypyc.build import mypycify
    from setuptools import Distribution
    from setuptools.command.build_ext import build_ext

    out = Path(tempfile.mkdtemp(prefix="meshkit-mypyc-"))
    cwd = os.getcwd()
    os.chdir(root)  # mypy reads [tool.mypy] from pyproject.toml here
    try:
        extensions = mypycify(
            # the optional extras (uvloop, pyzmq, grpc...) may be absent where the
            # wheel is built: what mypy cannot find it reads as Any
            ["--ignore-missing-imports", *COMPILED],
            opt_level=os.environ.get("MESHKIT_COMPILE_OPT", "3"),
            multi_file=True,  # several C files: built in parallel
            target_dir=str(out / "c"),
            group_name=GROUP,
        )
        dist = Distribution({"ext_modules": extensions, "package_dir": {"": "src"}})
        cmd = build_ext(dist)
        cmd.build_lib = str(out / "lib")
        cmd.build_temp = str(out / "tmp")
        cmd.parallel = os.cpu_count() or 1
        cmd.ensure_finalized()
        cmd.run()
    finally:
        os.chdir(cwd)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    lib = out / "lib"
    built = {str(p): str(p.relative_to(lib)) for p in lib.rglob(f"*{suffix}")}
    expected = len(COMPILED) + 1  # and the shared runtime
    if len(built) != expected:
        shutil.rmtree(out, ignore_errors=True)
        raise RuntimeError(f"mypyc built {len(built)} extension files, expected {expected}")
    print(f"meshkit: compiled {len(COMPILED)} modules with mypyc", file=sys.stderr)
    return built

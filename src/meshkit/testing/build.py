"""
Which meshkit runs
==================

The test suite and the benchmarks run the meshkit the interpreter imports: the
tree's ``src/`` (an editable install, or ``PYTHONPATH=src``), or a wheel installed
from it, compiled (``hatch_build.py``). A wheel is a copy: after an edit it is the
*older* code, and a run would test or measure what the tree no longer holds.
:func:`stale_files` tells, so both can refuse to start.
"""

from __future__ import annotations

from pathlib import Path

import meshkit

__all__ = ["stale_files"]


def stale_files(tree_src: Path) -> list[str]:
    """The modules of ``tree_src`` (a checkout's ``src/meshkit``) that the imported
    meshkit does not hold byte for byte; empty when it is that tree itself."""
    tree_src = tree_src.resolve()
    installed = Path(meshkit.__file__).resolve().parent
    if installed == tree_src:
        return []
    out = []
    for f in sorted(tree_src.rglob("*.py")):
        copy = installed / f.relative_to(tree_src)
        if not copy.is_file() or copy.read_bytes() != f.read_bytes():
            out.append(str(f.relative_to(tree_src)))
    return out

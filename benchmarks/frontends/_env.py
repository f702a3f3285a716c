"""
Configuration of the benchmark frontends, from the environment
===============================================================

The launchers run under ``uvicorn --app-dir benchmarks/frontends module:app``, so
their settings come from environment variables set by ``run.py``:

* ``MESHBENCH_WORKERS``: comma-separated worker base URLs;
* ``MESHBENCH_WORKLOAD``: ``proxy`` or ``chat`` (round robin; the load differs, the
  frontend does not) or ``tokenize`` (prefix hash over the first 256 tokens of the
  prompt);
* ``MESHBENCH_TOKENIZER``: path to the Qwen ``tokenizer.json`` (tokenize workload);
* ``MESHBENCH_PROBES=0``: no health or engine-load probes (``instructions.py
  --no-probes``: under valgrind the probes' share of a run grows with its slowed
  wall-clock time, not with its requests).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["PREFIX_TOKENS", "mesh_kwargs", "tokenizer_path", "worker_urls", "workload"]

PREFIX_TOKENS = 256


def worker_urls() -> list[str]:
    urls = [u.strip().rstrip("/") for u in os.environ.get("MESHBENCH_WORKERS", "").split(",")]
    urls = [u for u in urls if u]
    if not urls:
        raise SystemExit("MESHBENCH_WORKERS is not set")
    return urls


def workload() -> str:
    w = os.environ.get("MESHBENCH_WORKLOAD", "proxy")
    if w not in ("proxy", "chat", "tokenize"):
        raise SystemExit(f"unknown MESHBENCH_WORKLOAD {w!r}")
    return w


def tokenizer_path() -> str | None:
    if workload() != "tokenize":
        return None
    path = os.environ.get("MESHBENCH_TOKENIZER")
    if not path:
        raise SystemExit("the tokenize workload needs MESHBENCH_TOKENIZER")
    return path


def mesh_kwargs() -> dict[str, Any]:
    """``Mesh(**mesh_kwargs())`` for the selected workload."""
    kw: dict[str, Any] = {"workers": worker_urls()}
    if workload() == "tokenize":
        kw["policy"] = "prefix_hash"
        kw["tokenizer"] = tokenizer_path()
        kw["policies"] = {"prefix_hash": {"prefix_token_count": PREFIX_TOKENS}}
    else:
        kw["policy"] = "round_robin"
    if os.environ.get("MESHBENCH_PROBES", "1") == "0":
        kw["lifecycle"] = {"probe": False}
    return kw

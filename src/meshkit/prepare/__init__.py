"""
Request preparation
===================

Everything that costs CPU before a request can be placed — parsing a large body,
rendering a chat template, tokenizing — runs here, bounded and measured:

:mod:`~meshkit.prepare.pipeline`
    :class:`Preparer`: a request's headers, body and prefix ids, into a view.
:mod:`~meshkit.prepare.pool`
    :class:`PreparePool`, a fixed set of named threads with admission control
    (503), one deadline per job (504), cancellation, exactly-once outcomes and a
    bounded shutdown.
:mod:`~meshkit.prepare.tokenizers`
    :class:`TokenizerRegistry` and :class:`LoadedTokenizer`: local
    ``tokenizer.json`` files, copies per group of pool threads, GIL-free encoding
    and exact bounded-prefix tokenization; :mod:`~meshkit.prepare.fastbpe`, the
    tiktoken fast path.
:mod:`~meshkit.prepare.templates`
    HF-compatible chat templates in a sandbox with a render budget.
:mod:`~meshkit.prepare.jobs`
    ``/v1/tokenize`` and ``/v1/detokenize`` answered in vLLM's shapes.

The names below import on first use: the tokenizer and template libraries load
with the first tokenizer, not with ``import meshkit``.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "Job": "pool",
    "JobCancelled": "pool",
    "PoolConfig": "pool",
    "PreparePool": "pool",
    "Preparer": "pipeline",
    "LoadedTokenizer": "tokenizers",
    "TokenizerRegistry": "tokenizers",
    "TokenizerSpec": "tokenizers",
    "RenderBudget": "templates",
    "render_chat_template": "templates",
    "detokenize_job": "jobs",
    "tokenize_job": "jobs",
}


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'meshkit.prepare' has no attribute {name!r}")
    return getattr(importlib.import_module(f"meshkit.prepare.{module}"), name)


__all__ = sorted(_NAMES)

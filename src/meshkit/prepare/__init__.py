"""
Request preparation
===================

Everything that costs CPU before a request can be placed — parsing a large body,
rendering a chat template, tokenizing — runs here, off the event loop, bounded
and measured:

:mod:`~meshkit.prepare.pool`
    :class:`PreparePool`, a fixed set of named threads with admission control
    (503), one deadline per job (504), cancellation, exactly-once outcomes and a
    bounded shutdown.
:mod:`~meshkit.prepare.metrics`
    :class:`PrepareMetrics`, the ``mesh_prepare_*`` Prometheus series.
:mod:`~meshkit.prepare.tokenizers`
    :class:`TokenizerRegistry` and :class:`LoadedTokenizer`: local
    ``tokenizer.json`` files, copies per group of pool threads, GIL-free encoding
    and exact bounded-prefix tokenization.
:mod:`~meshkit.prepare.templates`
    HF-compatible chat templates in a sandbox with a render budget.
:mod:`~meshkit.prepare.jobs`
    ``/v1/tokenize`` and ``/v1/detokenize`` answered in vLLM's shapes.
"""

from __future__ import annotations

from meshkit.prepare.jobs import detokenize_job, tokenize_job
from meshkit.prepare.metrics import PrepareMetrics
from meshkit.prepare.pool import Job, JobCancelled, PoolConfig, PreparePool
from meshkit.prepare.templates import RenderBudget, render_chat_template
from meshkit.prepare.tokenizers import LoadedTokenizer, TokenizerRegistry, TokenizerSpec

__all__ = [
    "Job",
    "JobCancelled",
    "LoadedTokenizer",
    "PoolConfig",
    "PrepareMetrics",
    "PreparePool",
    "RenderBudget",
    "TokenizerRegistry",
    "TokenizerSpec",
    "detokenize_job",
    "render_chat_template",
    "tokenize_job",
]

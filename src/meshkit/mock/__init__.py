"""
meshkit.mock: a fast mock inference worker
==========================================

An OpenAI (chat, completions, Responses, Conversations) + Anthropic (messages) + SGLang
(``/generate``) + vLLM (tokenize, sleep mode, adapters loaded at run time) compatible
worker for meshkit's tests, demo and benchmarks. It runs on a raw asyncio protocol
with ``httptools`` (uvloop when available) and answers non-stream requests from
pre-built bytes.

* :class:`MockConfig` — behaviour (APIs, latencies, faults, cache model, sleep mode);
* :class:`MockWorker` — the server, inside a running event loop;
* :class:`MockWorkerThread` — the same on its own thread, for synchronous tests;
* :class:`MockStats` — what the worker saw (``worker.stats``);
* :func:`run_mock_worker` — the CLI (``python -m meshkit.mock``).
"""

from __future__ import annotations

from meshkit.mock.cli import run_mock_worker
from meshkit.mock.config import API_NAMES, MockConfig, MockStats
from meshkit.mock.server import MockWorker
from meshkit.mock.thread import MockWorkerThread

__all__ = [
    "API_NAMES",
    "MockConfig",
    "MockStats",
    "MockWorker",
    "MockWorkerThread",
    "run_mock_worker",
]

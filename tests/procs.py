"""Run the ``meshkit`` command as a subprocess, the way an operator does (the
``spawn`` and ``meshkit_run`` fixtures, for the suites that import them)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

MESHKIT = [sys.executable, "-m", "meshkit"]
_URL = re.compile(r"listening on (\S+)")


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without MESHKIT_* (they would change what serve loads)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
    env.update(extra)
    return env


def run_meshkit(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MESHKIT, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(**env),
        check=False,
    )


class Proc:
    """A long-running ``meshkit`` subprocess that prints ``... listening on <url>``."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []
        #: stderr so far (read while it runs: logs are checked before it exits)
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self._err = threading.Thread(target=self._pump_err, daemon=True)
        self._err.start()
        self.url = self._wait_for_url()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _pump_err(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.stderr.append(line)

    def _wait_for_url(self, timeout: float = 30) -> str:
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                break
            if line is None:
                break
            self.stdout.append(line)
            m = _URL.search(line)
            if m:
                return m.group(1)
        self.popen.kill()
        self.popen.wait(timeout=10)
        self._err.join(10)
        err = "".join(self.stderr)
        raise AssertionError(f"no 'listening on' line; rc={self.popen.returncode}; stderr:\n{err}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.popen.send_signal(sig)

    def wait(self, timeout: float = 30) -> tuple[int, str]:
        """Exit code and stderr."""
        rc = self.popen.wait(timeout=timeout)
        self._err.join(10)
        return rc, "".join(self.stderr)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)


@pytest.fixture
def meshkit_run() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``meshkit_run("serve", "--config", path)``: run to completion, capture output."""
    return run_meshkit


@pytest.fixture
def spawn() -> Iterator[Callable[..., Proc]]:
    """``spawn("serve", "--worker", url, env={...})``: a running meshkit subprocess."""
    procs: list[Proc] = []

    def start(*args: str, env: dict[str, Any] | None = None, prefix: tuple[str, ...] = ()) -> Proc:
        # prefix: a command that execs meshkit (same pid), e.g. into namespaces
        p = Proc([*prefix, *MESHKIT, *args], clean_env(**(env or {})))
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()

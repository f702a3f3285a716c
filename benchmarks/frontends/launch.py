"""
How each frontend is installed, started and probed
==================================================

``run.py`` asks :func:`command` for the command line of a frontend (pinned with
``taskset`` when a CPU list is given) and the environment it needs. The Rust routers
are installed by :func:`ensure_router` into their own virtual environments under
``benchmarks/.venvs/`` and started with retries, the circuit breaker and health
checks off, round robin, as in :func:`command`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "FRONTENDS",
    "Frontend",
    "Launch",
    "command",
    "ensure_router",
]

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Frontend:
    key: str
    label: str
    kind: str  # "python" | "rust" | "direct"
    workloads: tuple[str, ...]
    module: str = ""  # python: the module holding ``app``
    package: str = ""  # rust: the PyPI requirement
    dist: str = ""  # rust: the distribution name (for its version)
    meshkit: bool = False


FRONTENDS: dict[str, Frontend] = {
    f.key: f
    for f in (
        Frontend(
            "meshkit",
            "meshkit standalone (meshkit serve: built-in server)",
            "python",
            ("proxy", "chat", "tokenize"),
            module="meshkit_builtin",
            meshkit=True,
        ),
        # The same gateway from the tree's sources (PYTHONPATH=src): interpreted,
        # beside an installed compiled build (hatch_build.py) in the same rounds.
        Frontend(
            "meshkit-interpreted",
            "meshkit standalone, interpreted (the tree's src/, not compiled)",
            "python",
            ("proxy", "chat", "tokenize"),
            module="meshkit_builtin",
            meshkit=True,
        ),
        # The same gateway as two processes on the frontend's CPUs (issue 21).
        Frontend(
            "meshkit-p2",
            "meshkit serve --processes 2 (built-in server)",
            "python",
            ("proxy", "chat", "tokenize"),
            module="meshkit_builtin",
            meshkit=True,
        ),
        Frontend(
            "meshkit-uvicorn",
            "meshkit standalone on uvicorn (MeshMiddleware)",
            "python",
            ("proxy", "chat", "tokenize"),
            module="meshkit_standalone",
            meshkit=True,
        ),
        Frontend(
            "meshkit-fastapi",
            "meshkit MeshMiddleware inside FastAPI",
            "python",
            ("proxy", "chat", "tokenize"),
            module="meshkit_fastapi",
            meshkit=True,
        ),
        Frontend(
            "fastapi",
            "FastAPI baseline (pydantic + run_in_executor(encode) + aiohttp)",
            "python",
            ("proxy", "tokenize"),
            module="fastapi_baseline",
        ),
        Frontend(
            "sglang-router",
            "sglang-router 0.3.2",
            "rust",
            ("proxy", "chat"),
            package="sglang-router==0.3.2",
            dist="sglang-router",
        ),
        Frontend("smg", "smg", "rust", ("proxy", "chat"), package="smg", dist="smg"),
        Frontend(
            "vllm-router",
            "vllm-router",
            "rust",
            ("proxy", "chat"),
            package="vllm-router",
            dist="vllm-router",
        ),
        Frontend(
            "direct",
            "direct to the backends (the limit)",
            "direct",
            ("proxy", "chat", "tokenize"),
        ),
        # Not a router: the least a uvloop + httptools proxy spends (issue 21's floor).
        Frontend(
            "python-floor",
            "bare uvloop + httptools proxy, round robin (no routing: the CPython floor)",
            "python",
            ("proxy", "chat"),
            module="floor_proxy",
        ),
        # --base DIR: the same gateway from another checkout (its own .venv), measured
        # beside this one in the same rounds: a before/after A/B of a change.
        Frontend(
            "meshkit-base",
            "meshkit standalone at the --base checkout",
            "python",
            ("proxy", "chat", "tokenize"),
            module="meshkit_builtin",
            meshkit=True,
        ),
    )
}


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def _pin(cpus: str | None) -> list[str]:
    if cpus and shutil.which("taskset"):
        return ["taskset", "-c", cpus]
    return []


def command(
    fe: Frontend,
    *,
    port: int,
    workers: list[str],
    workload: str,
    cpus: str | None,
    processes: int,
    tokenizer: str | None,
    venvs: Path,
    prometheus_port: int,
) -> Launch:
    """The command line starting ``fe`` on ``port`` in front of ``workers``."""
    env = {"MESHBENCH_WORKERS": ",".join(workers), "MESHBENCH_WORKLOAD": workload}
    if tokenizer:
        env["MESHBENCH_TOKENIZER"] = tokenizer
    if fe.key == "meshkit-base":
        base = Path(os.environ["MESHBENCH_BASE"])
        script = str(base / "benchmarks" / "frontends" / "meshkit_builtin.py")
        python = str(base / ".venv" / "bin" / "python")
        return Launch([*_pin(cpus), python, script, "--port", str(port)], env)
    if fe.module == "meshkit_builtin":
        script = str(HERE / "meshkit_builtin.py")
        argv = [*_pin(cpus), sys.executable, script, "--port", str(port)]
        if fe.key == "meshkit-p2":
            argv += ["--processes", "2"]
        if fe.key == "meshkit-interpreted":
            env["PYTHONPATH"] = str(HERE.parents[1] / "src")
        return Launch(argv, env)
    if fe.module == "floor_proxy":
        script = str(HERE / "floor_proxy.py")
        return Launch([*_pin(cpus), sys.executable, script, "--port", str(port)], env)
    if fe.kind == "python":
        argv = [
            *_pin(cpus),
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            str(HERE),
            f"{fe.module}:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--loop",
            "uvloop",
            "--http",
            "httptools",
            "--no-access-log",
            "--log-level",
            "warning",
            "--lifespan",
            "on",
        ]
        if fe.key == "fastapi":
            # the seed's way: one worker process per core of the allotment
            argv += ["--workers", str(processes)]
        return Launch(argv, env)
    if fe.kind == "rust":
        venv = venvs / fe.key
        if fe.key == "sglang-router":
            head = [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router"]
        elif fe.key == "smg":
            head = [str(venv / "bin" / "smg"), "launch"]
        else:
            head = [str(venv / "bin" / "vllm-router")]
        flags = [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *workers,
            "--policy",
            "round_robin",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(prometheus_port),
            "--disable-retries",
            "--disable-circuit-breaker",
            "--health-check-interval-secs",
            "3600",
        ]
        if fe.key == "smg":
            flags += ["--disable-load-monitoring", "--disable-tokenizer-autoload"]
        return Launch([*_pin(cpus), *head, *flags])
    raise ValueError(f"{fe.key} is not started")


def _version(python: Path, dist: str) -> str | None:
    try:
        out = subprocess.run(
            [
                str(python),
                "-c",
                f"import importlib.metadata as m; print(m.version({dist!r}))",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def ensure_router(fe: Frontend, venvs: Path, log: Path) -> tuple[str | None, str]:
    """Install ``fe`` into ``venvs/<key>`` unless it is there: (version, reason)."""
    venv = venvs / fe.key
    python = venv / "bin" / "python"
    if python.exists():
        v = _version(python, fe.dist)
        if v is not None:
            return v, ""
    venvs.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        try:
            if not python.exists():
                subprocess.run(
                    [sys.executable, "-m", "venv", str(venv)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    check=True,
                    timeout=300,
                )
            env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
            subprocess.run(
                [str(python), "-m", "pip", "install", "-q", fe.package],
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=900,
                env=env,
            )
        except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            return None, f"install failed ({exc}); see {log}"
    v = _version(python, fe.dist)
    if v is None:
        return None, f"installed but its version cannot be read; see {log}"
    return v, ""

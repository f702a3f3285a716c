"""
CPU per request at one client, with a load side in C
====================================================

``python benchmarks/one_client.py [--frontends meshkit,vllm-router] [--base DIR]
[--api chat] [--size 1024 | --shape NAME] [--clients 1] [--rounds 20] [--duration 8]
[--windows 16]``

Issue 21's one-client point, measured apart. At one client a request's CPU is
mostly the wake-ups around it, and ``run.py``'s Python load side (~80 µs per
request, on the other core) adds its own noise to every round. Here the load
generator and the workers are ``scaling.py``'s C programs (``benchmarks/native/``,
built with ``cc`` on every run, ~20 to 30 µs per request), the frontend is pinned to
CPU 0 and the load side to CPU 1, and every round starts each frontend afresh
and gives it ``--warmup`` seconds of load, then ``--duration`` seconds measured.
``--windows W`` cuts that into W windows, the frontends loaded in turns (the order
alternating from window to window and from round to round): both then meet the
host's slower drifts alike, which a window of several seconds each apart does not
(a round's ratio on this VM moved from 0.81 to 1.29 with one window of 8 s).

Reported: per frontend the median CPU per request over the rounds, user and
system apart (``/proc``: all the frontend's processes and threads); per round the
first frontend's CPU over each other's, the median of those ratios and a bootstrap
95 % interval of that median (how far the median can be trusted on a noisy host).
``--shape NAME`` sends one of ``prepare_shapes.py``'s chat bodies (an agent's
session, say) in place of the one-message body of ``--size`` bytes.
``meshkit-base`` is the gateway of another checkout (``--base``, with its own
compiled ``.venv``), as in ``run.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import (  # noqa: E402
    API_PATHS,
    bodies,
    free_port,
    require_current_install,
    user_system_seconds,
)
from frontends.launch import FRONTENDS, command, ensure_router  # noqa: E402
from prepare_shapes import SHAPES  # noqa: E402
from scaling import _load, build, failed, pinned  # noqa: E402

_WORKLOAD = {"chat": "chat", "completions": "proxy"}


@dataclass
class Round:
    frontend: str
    round: int
    user_us: float
    system_us: float
    rps: float
    errors: int
    requests: int = 0  # answered in the window(s)

    @property
    def cpu_us(self) -> float:
        return self.user_us + self.system_us


def _ready(port: int, proc: subprocess.Popen[bytes], within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a frontend exited at start (code {proc.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"a frontend did not answer /health on port {port}")


class Running:
    """A frontend started for a round, pinned to CPU 0, answering on ``port``."""

    def __init__(self, key: str, urls: list[str], api: str) -> None:
        self.key = key
        self.port = free_port()
        launch = command(
            FRONTENDS[key],
            port=self.port,
            workers=urls,
            workload=_WORKLOAD[api],
            cpus="0",
            processes=1,
            tokenizer=None,
            venvs=HERE / ".venvs",
            prometheus_port=free_port(),
        )
        env = dict(os.environ, **launch.env)
        self.proc = subprocess.Popen(
            launch.argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _ready(self.port, self.proc)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def window(
    ns: argparse.Namespace, fe: Running, rnd: int, seconds: float, loadgen: Path, body: Path
) -> Round:
    """``fe`` under load for ``seconds``: its CPU over that window."""
    user0, system0 = user_system_seconds(fe.proc.pid)
    got = _load(loadgen, fe.port, ns.clients, seconds, API_PATHS[ns.api], body, cpus="1")
    user1, system1 = user_system_seconds(fe.proc.pid)
    done = max(1, int(got["ok"]))
    return Round(
        frontend=fe.key,
        round=rnd,
        user_us=1e6 * (user1 - user0) / done,
        system_us=1e6 * (system1 - system0) / done,
        rps=got["ok_in_window"] / got["window_s"],
        errors=failed(got),
        requests=done,
    )


def measure_round(
    ns: argparse.Namespace, keys: list[str], rnd: int, loadgen: Path, urls: list[str], body: Path
) -> list[Round]:
    """One round: every frontend started afresh and warmed up, then ``--windows``
    measured windows each, taken in turns (the order alternates from window to
    window and from round to round), so the frontends share the host's slower
    drifts; per frontend the round's CPU per request is over all its windows."""
    running: list[Running] = []
    try:
        for key in keys:
            fe = Running(key, urls, ns.api)
            running.append(fe)
            _load(loadgen, fe.port, ns.clients, ns.warmup, API_PATHS[ns.api], body, cpus="1")
        got: dict[str, list[Round]] = {key: [] for key in keys}
        for w in range(ns.windows):
            order = running if (rnd + w) % 2 == 0 else running[::-1]
            for fe in order:
                got[fe.key].append(window(ns, fe, rnd, ns.duration / ns.windows, loadgen, body))
    finally:
        for fe in running:
            fe.stop()
    return [_merged(parts) for parts in got.values()]


def _merged(parts: list[Round]) -> Round:
    """The round's windows as one: CPU over all their requests."""
    n = sum(p.requests for p in parts)
    return Round(
        frontend=parts[0].frontend,
        round=parts[0].round,
        user_us=sum(p.user_us * p.requests for p in parts) / n,
        system_us=sum(p.system_us * p.requests for p in parts) / n,
        rps=sum(p.rps for p in parts) / len(parts),
        errors=sum(p.errors for p in parts),
        requests=n,
    )


def median_interval(ratios: list[float], draws: int = 10_000) -> tuple[float, float]:
    """A percentile bootstrap 95 % interval of the median of ``ratios`` (seeded)."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def report(rounds: list[Round], keys: list[str]) -> str:
    lines = [
        "| frontend | CPU µs/req | user | system | req/s | errors |",
        "|---|---|---|---|---|---|",
    ]
    for key in keys:
        mine = [r for r in rounds if r.frontend == key]
        lines.append(
            f"| {key} | {statistics.median(r.cpu_us for r in mine):.1f} "
            f"| {statistics.median(r.user_us for r in mine):.1f} "
            f"| {statistics.median(r.system_us for r in mine):.1f} "
            f"| {statistics.median(r.rps for r in mine):,.0f} | {sum(r.errors for r in mine)} |"
        )
    first = {r.round: r for r in rounds if r.frontend == keys[0]}
    for key in keys[1:]:
        ratios = [first[r.round].cpu_us / r.cpu_us for r in rounds if r.frontend == key]
        low, high = median_interval(ratios)
        under = sum(x <= 1.0 for x in ratios)
        lines.append("")
        lines.append(
            f"{keys[0]} / {key}, CPU per request: median {statistics.median(ratios):.3f} "
            f"(rounds {min(ratios):.2f} to {max(ratios):.2f}, {under} of {len(ratios)} ≤ 1.0; "
            f"95 % interval of the median {low:.3f} to {high:.3f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1] if __doc__ else None)
    ap.add_argument("--frontends", default="meshkit,vllm-router", help="the first is compared")
    ap.add_argument("--base", help="the checkout meshkit-base runs (its own .venv)")
    ap.add_argument("--api", choices=sorted(_WORKLOAD), default="chat")
    ap.add_argument("--size", type=int, default=1024, help="request body bytes")
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), help="a chat body of prepare_shapes.py instead"
    )
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2, help="C worker processes")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument(
        "--duration", type=float, default=8.0, help="seconds measured per frontend and round"
    )
    ap.add_argument(
        "--windows",
        type=int,
        default=16,
        help="the round's --duration cut into this many windows, the frontends in turns "
        "(1: each measured whole, one after the other)",
    )
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each")
    ap.add_argument("--json", help="also write the rounds here")
    ns = ap.parse_args(argv)
    if ns.shape and ns.api != "chat":
        ap.error("--shape is a chat body: --api chat")
    if ns.windows < 1:
        ap.error("--windows is at least 1")
    require_current_install()
    keys = [k.strip() for k in ns.frontends.split(",") if k.strip()]
    unknown = [k for k in keys if k not in FRONTENDS]
    if unknown or len(keys) < 2:
        ap.error(f"two or more of {sorted(FRONTENDS)} (unknown: {unknown})")
    if "meshkit-base" in keys:
        if not ns.base:
            ap.error("meshkit-base needs --base")
        os.environ["MESHBENCH_BASE"] = str(Path(ns.base).resolve())
    for key in keys:
        if FRONTENDS[key].kind == "rust":
            version, why = ensure_router(FRONTENDS[key], HERE / ".venvs", HERE / "install.log")
            if version is None:
                raise SystemExit(f"{key}: {why}")
    with tempfile.TemporaryDirectory(prefix="one-client-") as tmp:
        out = Path(tmp)
        loadgen, backend = build(out)
        body = out / "body.json"
        if ns.shape:
            body.write_bytes(SHAPES[ns.shape]())
        else:
            body.write_bytes(bodies(ns.size, 1, api=ns.api)[0])
        ports = [free_port() for _ in range(ns.workers)]
        workers = [subprocess.Popen([*pinned("1"), str(backend), str(p)]) for p in ports]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        rounds: list[Round] = []
        try:
            time.sleep(0.3)
            for rnd in range(ns.rounds):
                for r in measure_round(ns, keys, rnd, loadgen, urls, body):
                    rounds.append(r)
                    print(
                        f"round {rnd} {r.frontend}: {r.cpu_us:.1f} µs/req (user {r.user_us:.1f}, "
                        f"system {r.system_us:.1f}), {r.rps:,.0f} req/s, {r.errors} errors",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            for w in workers:
                w.kill()
                w.wait()
    print(report(rounds, keys))
    if ns.json:
        Path(ns.json).write_text(json.dumps([asdict(r) for r in rounds], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

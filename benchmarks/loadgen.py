"""
Closed-loop HTTP/1.1 load generator
===================================

``python benchmarks/loadgen.py --url http://127.0.0.1:8000 --size 1024 --clients 16``
runs one measurement and prints it as JSON; ``--serve`` reads one JSON command per
line on stdin and answers one JSON line each (how ``run.py`` drives it, so the
process, its imports and its pinning are set up once).

Each client is one keep-alive connection that sends the next request as soon as
the previous response is complete (closed loop). It is a raw uvloop protocol:
the request bytes (head + body) are built once per body variant, responses are
parsed by ``httptools`` (C) and their bodies discarded, so the generator costs a
few tens of µs of CPU per request (reported as ``loadgen_cpu_us_per_req``; a
pooled aiohttp client costs ~200 µs) and is not the bottleneck.

Prompts (``"prompts"`` in a command, ``--prompts`` on the command line):
``repeated`` cycles 8 bodies per size (:func:`_common.bodies`); ``distinct`` gives
every request of a measurement its own prompt head (:func:`_common.distinct_bodies`:
body ``i`` for the ``i``-th request sent, warm-up included, so every frontend gets
the same sequence), written as the HTTP head, the JSON before the prompt, the
unique prompt head and the rest with one ``writelines`` (no copy of the body per
request). ``distinct_repeats`` counts the
requests that went past the pool of unique heads (0 unless a window is very long).

One measurement: a warm-up (connections opened, not counted), then a window of
``duration`` seconds in which completed responses are counted and timed, then a
drain: no new requests, in-flight ones are awaited (up to ``drain_timeout``) so
the next measurement starts on an idle frontend. The CPU of the process trees
given in ``watch`` (the frontend), ``backends`` and of this process are read from
``/proc`` at both ends of the window.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import httptools
from _common import (
    API_PATHS,
    PROMPT_VARIANTS,
    DistinctBodies,
    bodies,
    cpu_seconds,
    distinct_bodies,
    tree_cpu_seconds,
)

__all__ = ["measure"]

_perf = time.perf_counter


class _Gen:
    """State shared by the connections of one measurement."""

    def __init__(self) -> None:
        self.running = True
        self.measuring = False
        self.ok = 0
        self.errors = 0
        self.statuses: dict[int, int] = {}
        self.latencies: list[float] = []
        self.inflight = 0
        self.first_error = ""
        self.idle: asyncio.Future[None] | None = None
        self.seq = 0  # requests sent (the index of the next distinct prompt)

    def completed(self, status: int, started: float) -> None:
        self.inflight -= 1
        if self.measuring:
            if status == 200:
                self.ok += 1
                self.latencies.append(_perf() - started)
            else:
                self.errors += 1
                self.statuses[status] = self.statuses.get(status, 0) + 1
                if not self.first_error:
                    self.first_error = f"HTTP {status}"
        self._check_idle()

    def failed(self, what: str) -> None:
        self.inflight -= 1
        if self.measuring:
            self.errors += 1
        if not self.first_error:
            self.first_error = what
        self._check_idle()

    def _check_idle(self) -> None:
        if not self.running and self.inflight == 0 and self.idle and not self.idle.done():
            self.idle.set_result(None)


class _Target:
    """What one frontend URL is sent: repeated requests, or distinct ones."""

    __slots__ = ("distinct", "head", "host", "port", "reqs")

    def __init__(
        self,
        url: str,
        repeated: list[bytes] | None,
        distinct: DistinctBodies | None,
        path: str | None = None,
    ) -> None:
        self.host, self.port, _ = _request_bytes(url, b"", path)
        self.reqs = [_request_bytes(url, b, path)[2] for b in repeated or ()]
        self.distinct = distinct
        self.head = b""
        if distinct is not None:
            body = distinct.body(0)
            self.head = _request_bytes(url, body, path)[2][: -len(body)]


class _Conn(asyncio.Protocol):
    """One closed-loop client on one keep-alive connection."""

    def __init__(self, gen: _Gen, target: _Target, start: int) -> None:
        self.gen = gen
        self.target = target
        self.reqs = target.reqs
        self.next = start
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.started = 0.0
        self.busy = False
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- asyncio callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.send()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.busy:
                self.busy = False
                self.gen.failed(f"bad response: {exc}")
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy:
            self.busy = False
            self.gen.failed(f"connection lost: {exc!r}")
        self.transport = None
        if not self.lost.done():
            self.lost.set_result(None)

    # -- httptools callbacks -------------------------------------------------

    def on_message_complete(self) -> None:
        self.busy = False
        self.gen.completed(self.parser.get_status_code(), self.started)
        if not self.parser.should_keep_alive():
            if self.transport is not None:
                self.transport.close()
            return
        self.send()

    # -- ---------------------------------------------------------------------

    def send(self) -> None:
        gen = self.gen
        if not gen.running or self.transport is None:
            return
        self.busy = True
        gen.inflight += 1
        distinct = self.target.distinct
        if distinct is None:
            reqs = self.reqs
            req = reqs[self.next % len(reqs)]
            self.next += 1
            self.started = _perf()
            self.transport.write(req)
            return
        i = gen.seq
        gen.seq += 1
        heads = distinct.heads
        self.started = _perf()
        self.transport.writelines(
            (self.target.head, distinct.prefix, heads[i % len(heads)], distinct.tail)
        )


def _request_bytes(url: str, body: bytes, path: str | None = None) -> tuple[str, int, bytes]:
    """Host, port and the request's bytes: to ``path``, else the URL's own path, else
    ``/v1/completions``."""
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    path = path or (u.path if u.path and u.path != "/" else "/v1/completions")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return host, port, head + body


async def _client(gen: _Gen, target: _Target, index: int, stop: asyncio.Event) -> None:
    """Keeps one client connection going (reconnects while the run lasts)."""
    loop = asyncio.get_running_loop()
    start = index
    while gen.running:
        try:
            _, conn = await loop.create_connection(
                functools.partial(_Conn, gen, target, start), target.host, target.port
            )
        except OSError as exc:
            if not gen.first_error:
                gen.first_error = f"connect: {exc!r}"
            if gen.measuring:
                gen.errors += 1
            await asyncio.sleep(0.05)
            continue
        waiter: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        await asyncio.wait([conn.lost, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if stop.is_set():
            if conn.transport is not None:
                conn.transport.close()
            return
        start += 1
        await asyncio.sleep(0.01)


async def measure(cmd: dict[str, Any]) -> dict[str, Any]:
    """One measurement (see the module documentation for ``cmd``'s keys)."""
    urls: list[str] = cmd["urls"]
    clients = int(cmd["clients"])
    warmup = float(cmd.get("warmup", 0.5))
    duration = float(cmd.get("duration", 3.0))
    drain_timeout = float(cmd.get("drain_timeout", 30.0))
    watch: list[int] = list(cmd.get("watch", []))
    backends: list[int] = list(cmd.get("backends", []))
    raw_bodies: list[bytes] | None = cmd.get("_bodies")
    distinct: DistinctBodies | None = cmd.get("_distinct")
    path = API_PATHS[cmd["api"]] if "api" in cmd else None
    targets = [_Target(u, raw_bodies, distinct, path) for u in urls]

    gen = _Gen()
    loop = asyncio.get_running_loop()
    gen.idle = loop.create_future()
    stop = asyncio.Event()
    tasks = []
    for i in range(clients):
        tasks.append(asyncio.ensure_future(_client(gen, targets[i % len(targets)], i, stop)))
    await asyncio.sleep(warmup)
    me = os.getpid()
    f0, b0, l0, t0 = tree_cpu_seconds(watch), tree_cpu_seconds(backends), cpu_seconds(me), _perf()
    gen.measuring = True
    await asyncio.sleep(duration)
    gen.measuring = False
    t1 = _perf()
    f1, b1, l1 = tree_cpu_seconds(watch), tree_cpu_seconds(backends), cpu_seconds(me)
    gen.running = False
    gen._check_idle()
    drained = True
    try:
        await asyncio.wait_for(asyncio.shield(gen.idle), drain_timeout)
    except TimeoutError:
        drained = False
    stop.set()
    await asyncio.wait(tasks, timeout=5.0)
    for t in tasks:
        t.cancel()
    wall = t1 - t0
    lat = sorted(gen.latencies)
    n = gen.ok

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, round(q * (len(lat) - 1)))] * 1e3 if lat else float("nan")

    return {
        "ok": n,
        "errors": gen.errors,
        "statuses": {str(k): v for k, v in gen.statuses.items()},
        "first_error": gen.first_error,
        "wall_s": wall,
        "rps": n / wall if wall > 0 else 0.0,
        "lat_mean_ms": (sum(lat) / len(lat) * 1e3) if lat else float("nan"),
        "lat_p50_ms": pct(0.50),
        "lat_p99_ms": pct(0.99),
        "lat_max_ms": lat[-1] * 1e3 if lat else float("nan"),
        "frontend_cpu_s": f1 - f0,
        "backend_cpu_s": b1 - b0,
        "loadgen_cpu_s": l1 - l0,
        "frontend_util": (f1 - f0) / wall if wall > 0 else 0.0,
        "load_side_util": ((b1 - b0) + (l1 - l0)) / wall if wall > 0 else 0.0,
        "drained": drained,
        "prompts": "distinct" if distinct is not None else "repeated",
        "distinct_repeats": max(0, gen.seq - len(distinct.heads)) if distinct else 0,
    }


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()


def serve() -> int:
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    cache: dict[tuple[int, int, str], list[bytes]] = {}
    distinct: dict[tuple[int, str], DistinctBodies] = {}
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        size = int(cmd["size"])
        api = cmd.get("api", "completions")
        if cmd.get("prompts", "repeated") == "distinct":
            if (size, api) not in distinct:
                distinct[size, api] = distinct_bodies(size, api=api)
            cmd["_distinct"] = distinct[size, api]
        else:
            key = (size, int(cmd.get("variants", 8)), api)
            if key not in cache:
                cache[key] = bodies(*key)
            cmd["_bodies"] = cache[key]
        try:
            out = loop.run_until_complete(measure(cmd))
        except Exception as exc:
            out = {"ok": 0, "errors": 1, "first_error": f"loadgen: {exc!r}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    loop.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/loadgen.py")
    p.add_argument("--serve", action="store_true", help="JSON commands on stdin")
    p.add_argument("--url", action="append", help="target base URL (repeat to spread)")
    p.add_argument("--size", type=int, default=1024, help="request body bytes")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--watch", type=int, action="append", default=[], help="PID tree to time")
    p.add_argument("--prompts", choices=PROMPT_VARIANTS, default="repeated")
    p.add_argument("--api", choices=list(API_PATHS), default="completions")
    ns = p.parse_args(argv)
    if ns.serve:
        return serve()
    if not ns.url:
        p.error("--url is required")
    cmd = {
        "urls": ns.url,
        "clients": ns.clients,
        "duration": ns.duration,
        "warmup": ns.warmup,
        "watch": ns.watch,
        "api": ns.api,
    }
    if ns.prompts == "distinct":
        cmd["_distinct"] = distinct_bodies(ns.size, api=ns.api)
    else:
        cmd["_bodies"] = bodies(ns.size, api=ns.api)
    loop = _new_loop()
    try:
        out = loop.run_until_complete(measure(cmd))
    finally:
        loop.close()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

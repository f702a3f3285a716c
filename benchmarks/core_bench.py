"""
The mesh core's CPU per request, in-process
===========================================

``python benchmarks/core_bench.py [--size 1024] [--policy round_robin] [--profile]``

What every mode pays on top of its sockets: ``Mesh.prepare`` (parse), the forward
flow driven by ``drive_sync`` (place, lease, the attempt), accounting (feed, end)
and the response headers, against a fake worker exchange that answers a fixed
non-streamed completion at once. No socket, no thread hop: the figure is the
core's own Python. Best of 5 rounds of 20,000 requests (``time.process_time``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Iterator
from typing import Any

from _common import bodies

from meshkit import Mesh
from meshkit.core.credentials import response_headers
from meshkit.core.forward import Attempt
from meshkit.upstream.drive import Relayed, drive_sync

ANSWER = (
    b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"mock-model",'
    b'"choices":[{"index":0,"text":"hello world","finish_reason":"length","logprobs":null}],'
    b'"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12}}'
)
ANSWER_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", b"%d" % len(ANSWER)),
    (b"date", b"Mon, 30 Nov 2026 00:00:00 GMT"),
    (b"server", b"mock"),
]
WORKERS = [f"http://127.0.0.1:{port}" for port in (1, 2, 3, 4)]


class _Exchange:
    status = 200
    headers = ANSWER_HEADERS

    def chunks(self) -> Iterator[bytes]:
        yield ANSWER

    def read(self, limit: int) -> bytes:
        return ANSWER

    def close(self) -> None:
        pass


def _send(attempt: Attempt) -> _Exchange:
    return _Exchange()


def run(size: int, policy: str, rounds: int = 5, n: int = 20_000, profile: bool = False) -> float:
    mesh = Mesh(workers=WORKERS, policy=policy, lifecycle={"probe": False})
    body = bodies(size, 1)[0]
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"user-agent", b"bench"),
    ]
    match = mesh.resolve("POST", "/v1/completions")
    assert match is not None

    def one() -> None:
        view = mesh.prepare(match, body, headers, "")
        final: Any = drive_sync(mesh.forward(view, headers, "POST"), _send)
        assert isinstance(final, Relayed)
        exchange = final.exchange
        acct = mesh.account(view, final.attempt.lease, exchange.status)
        response_headers(exchange.headers)
        for chunk in exchange.chunks():
            acct.feed(chunk)
        acct.end()

    try:
        for _ in range(2_000):
            one()
        best = float("inf")
        for _ in range(rounds):
            t0 = time.process_time()
            for _ in range(n):
                one()
            best = min(best, (time.process_time() - t0) / n)
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                one()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return best * 1e6
    finally:
        mesh.close()


def main() -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/core_bench.py")
    ap.add_argument("--size", type=int, default=1024, help="request body bytes")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile table")
    ns = ap.parse_args()
    print(f"mesh core: {run(ns.size, ns.policy, profile=ns.profile):.2f} µs/request (best of 5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

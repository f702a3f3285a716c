"""
The mesh core's CPU per request, in-process
===========================================

``python benchmarks/core_bench.py [--size 1024] [--api completions|chat]
[--policy round_robin] [--profile]``

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

from _common import best_us, bodies

from meshkit import Mesh
from meshkit.core.credentials import response_headers
from meshkit.core.forward import Attempt
from meshkit.upstream.drive import Relayed, drive_sync

ANSWER = (
    b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"mock-model",'
    b'"choices":[{"index":0,"text":"hello world","finish_reason":"length","logprobs":null}],'
    b'"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12}}'
)
CHAT_ANSWER = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"mock-model",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"hello world"},'
    b'"finish_reason":"length","logprobs":null}],'
    b'"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12}}'
)
ANSWER_HEADERS = [
    (b"content-type", b"application/json"),
    (b"date", b"Mon, 30 Nov 2026 00:00:00 GMT"),
    (b"server", b"mock"),
]
WORKERS = [f"http://127.0.0.1:{port}" for port in (1, 2, 3, 4)]


class _Exchange:
    status = 200

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.headers = [*ANSWER_HEADERS, (b"content-length", b"%d" % len(answer))]

    def chunks(self) -> Iterator[bytes]:
        yield self.answer

    def read(self, limit: int) -> bytes:
        return self.answer

    def whole(self) -> bytes | None:
        return None  # SyncExchange's "cannot know" (drive_sync and account never ask)

    def close(self) -> None:
        pass


def run(
    size: int,
    policy: str,
    rounds: int = 5,
    n: int = 20_000,
    profile: bool = False,
    api: str = "completions",
) -> float:
    mesh = Mesh(workers=WORKERS, policy=policy, lifecycle={"probe": False})
    body = bodies(size, 1, api)[0]
    answer = _Exchange(CHAT_ANSWER if api == "chat" else ANSWER)

    def _send(attempt: Attempt) -> _Exchange:
        return answer

    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"user-agent", b"bench"),
    ]
    match = mesh.resolve("POST", "/v1/chat/completions" if api == "chat" else "/v1/completions")
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
        best = best_us(one, rounds, n)
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                one()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return best
    finally:
        mesh.close()


def kv_index(workers: int = 8, prompt_tokens: int = 4096, n: int = 20_000) -> dict[str, float]:
    """The KV index's cost per request (µs, best of 5) for a 16 KiB prompt (~4,096
    tokens at 4 bytes a token) against ``workers`` workers that each hold other
    4,096-token prompts, with the keys prepare computes off the lock: the prompt
    all cached on one worker, 512 tokens of it cached, none; and computing those
    keys (on the prepare pool, not under the routing lock)."""
    import random

    from meshkit.core.kv_events import Batch, BlockStored
    from meshkit.core.kv_index import KvIndex, chain

    rng = random.Random(1)
    idx = KvIndex(10_000_000)
    ids = [f"w{i}" for i in range(workers)]
    prompts = [[rng.randrange(150_000) for _ in range(prompt_tokens)] for _ in range(2 * workers)]
    h = 1
    for i, p in enumerate(prompts):
        blocks = len(p) // 16
        event = BlockStored(tuple(range(h, h + blocks)), None, tuple(p), 16)
        idx.apply(ids[i % workers], Batch(0.0, (event,)))
        h += blocks
    cases = {
        "all cached": prompts[1],
        "512 cached": prompts[-1][:512] + [7] * max(0, prompt_tokens - 512),
        "none cached": [9] * prompt_tokens,
    }
    out: dict[str, float] = {}
    for name, toks in cases.items():
        keys = {16: chain(toks, 16)}
        best = min(_timed(lambda: idx.match(toks, ids, keys), n) for _ in range(5))  # noqa: B023
        out[name] = best
    out["keys (prepare)"] = min(
        _timed(lambda: chain(prompts[0], 16), max(1, n // 20)) for _ in range(5)
    )
    return out


def _timed(fn: Any, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def kv_memory(workers: int = 64, blocks: int = 1_000_000) -> tuple[float, int]:
    """Bytes per index entry (tracemalloc) with ``blocks`` entries over ``workers``
    workers, half of each worker's blocks shared with another worker (common
    system prompts)."""
    import random
    import tracemalloc

    from meshkit.core.kv_events import Batch, BlockStored
    from meshkit.core.kv_index import KvIndex

    rng = random.Random(2)
    tracemalloc.start()
    idx = KvIndex(blocks)
    base = tracemalloc.get_traced_memory()[0]
    per = blocks // workers
    shared = [tuple(rng.randrange(150_000) for _ in range(16 * (per // 2))) for _ in range(8)]
    h = 1
    for w in range(workers):
        own = tuple(rng.randrange(150_000) for _ in range(16 * (per - per // 2)))
        for tokens in (shared[w % 8], own):
            n = len(tokens) // 16
            event = BlockStored(tuple(range(h, h + n)), None, tokens, 16)
            idx.apply(f"http://10.0.{w // 250}.{w % 250}:8000", Batch(0.0, (event,)))
            h += n
    del shared, own, event
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / max(1, len(idx)), len(idx)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/core_bench.py")
    ap.add_argument("--size", type=int, default=1024, help="request body bytes")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--api", choices=("completions", "chat"), default="completions")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile table")
    ap.add_argument(
        "--kv-index", action="store_true", help="the KV index instead: match cost and memory"
    )
    ns = ap.parse_args()
    if ns.kv_index:
        for workers in (8, 64):
            for name, us in kv_index(workers).items():
                print(f"kv index, {workers} workers, 16 KiB prompt, {name}: {us:.1f} µs")
        per, n = kv_memory()
        print(f"kv index memory: {per:.0f} bytes per entry ({n} entries, 64 workers)")
        return 0
    us = run(ns.size, ns.policy, profile=ns.profile, api=ns.api)
    print(f"mesh core ({ns.api}): {us:.2f} µs/request (best of 5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

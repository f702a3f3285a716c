"""``meshkit kv-relay`` (:mod:`meshkit.lifecycle.kv_relay`) between real ZeroMQ
publishers and routers with ``[kv] relay``: routers that never subscribe to an
engine follow its cache, each takes only its own workers' topics, a lost engine
clears its worker and the routers start again, a router that falls behind sees a
gap, malformed messages stop at the relay, and the command's exits."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

zmq = pytest.importorskip("zmq")

from conformance.test_kv_routing import TOKENIZER, TOPICS, first_turn, publishing_fleet  # noqa: E402
from harness import MODE_CLASSES, reusable_port  # noqa: E402
from lifecycle.test_kv_subscriber import URL, Publisher, until  # noqa: E402
from meshkit import Mesh  # noqa: E402
from meshkit.config import KvConfig, KvRelayConfig  # noqa: E402
from meshkit.core.kv_events import relay_topic  # noqa: E402
from meshkit.core.workers import Worker  # noqa: E402
from meshkit.lifecycle.kv_relay import KvRelay, followable, relay_registry  # noqa: E402
from meshkit.mock.thread import MockWorkerThread  # noqa: E402
from meshkit.testing.commands import start_kv_relay  # noqa: E402


@contextmanager
def running(relay: KvRelay) -> Iterator[KvRelay]:
    stop = threading.Event()
    thread = threading.Thread(target=relay.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield relay
    finally:
        stop.set()
        thread.join()
        relay.close()


@pytest.fixture
def publisher() -> Iterator[Callable[..., Publisher]]:
    """``publisher(endpoint=..., replay=False)``: a vLLM-like publisher (with its
    replay endpoint), closed at teardown (a
    context left open would hang the interpreter's exit)."""
    made: list[Publisher] = []

    def make(endpoint: str = "tcp://127.0.0.1:*", replay: bool = False) -> Publisher:
        p = Publisher(replay=replay, endpoint=endpoint)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def relay_of(
    *publishers: str,
    send_hwm: int = 10_000,
    kv: KvConfig | None = None,
    replay_bytes: int = 16 * 1024 * 1024,
    engine_replay: str | None = None,
    follow_routers: bool = True,
    max_followed: int = 1024,
) -> KvRelay:
    """A relay of ``publishers`` (the first with ``engine_replay``, its engine's)."""
    return KvRelay(
        {p: engine_replay if i == 0 else None for i, p in enumerate(publishers)},
        KvRelayConfig(
            bind="tcp://127.0.0.1:*",
            send_hwm=send_hwm,
            replay_bind="tcp://127.0.0.1:*",
            replay_bytes=replay_bytes,
            follow_routers=follow_routers,
            max_followed=max_followed,
        ),
        kv or KvConfig(),
    )


@pytest.fixture
def relayed() -> Iterator[Callable[..., Mesh]]:
    """``relayed(endpoint, kv, url=URL)``: a started Mesh with one worker whose events
    (published on ``endpoint``) come as its ``[kv]`` table says; closed at teardown."""
    made: list[Mesh] = []

    def make(
        endpoint: str, kv: dict[str, object], url: str = URL, replay: str | None = None
    ) -> Mesh:
        w = Worker(url, kv_events=endpoint, kv_replay=replay)
        mesh = Mesh(workers=[w], policy="cache_aware", lifecycle={"probe": False}, kv=kv)
        made.append(mesh)
        mesh.lifecycle.start()
        return mesh

    yield make
    for mesh in made:
        mesh.close()


@pytest.fixture
def router(relayed: Callable[..., Mesh]) -> Callable[..., Mesh]:
    """``router(relay, endpoint, url=URL, replays=False)``: :func:`relayed` through
    ``relay`` (and, with ``replays``, its replays)."""

    def make(relay: KvRelay, endpoint: str, url: str = URL, replays: bool = False) -> Mesh:
        kv: dict[str, object] = {"relay": relay.endpoint}
        if replays:
            kv["relay_replay"] = relay.replay_endpoint or ""
        return relayed(endpoint, kv, url)

    return make


def replay(relay: KvRelay, start: int, topic: bytes) -> list[int]:
    """What the relay's replay endpoint answers, as a DEALER asking it: the
    sequence numbers up to the end marker (-2: it kept nothing of that engine)."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        dealer.connect(relay.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big"), topic])
        got: list[int] = []
        while True:
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                return got
            assert frames[1] == topic
            got.append(seq)
    finally:
        dealer.close(linger=0)
        ctx.destroy(linger=0)


def blocks(mesh: Mesh, url: str = URL) -> int:
    return int(mesh.router.fleet.kv.blocks_of(url))


def store_until_seen(mesh: Mesh, pub: Publisher) -> None:
    """Publish root blocks until the router has one (the slow joiner, twice over)."""
    deadline = time.monotonic() + 20
    while not blocks(mesh):
        assert time.monotonic() < deadline, "the router never received a batch through the relay"
        pub.store([pub.seq + 10_000], None, [0, 0, 0, pub.seq])
        time.sleep(0.05)


def test_relay_topics_are_prefix_free() -> None:
    a, b = relay_topic("tcp://10.0.0.1:5557"), relay_topic("tcp://10.0.0.1:55570")
    assert not b.startswith(a) and not a.startswith(b)


def test_routers_behind_a_relay_follow_the_engines_cache(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    fleet = publishing_fleet(mock_factory)
    relay = start_kv_relay(
        [
            "--bind",
            "tcp://127.0.0.1:*",
            "--replay-bind",
            "tcp://127.0.0.1:*",
            "--metrics-port",
            "0",
            # (cast: every worker of a publishing fleet has an endpoint)
            *[arg for w in fleet for arg in ("--publisher", cast(str, w.kv_events_endpoint))],
        ]
    )
    proc, endpoint, replays = relay.proc, relay.endpoint, relay.replay_endpoint
    try:

        def make() -> Mesh:
            # No router asks an engine anything: events and replays come from the relay.
            workers = [Worker(w.url, kv_events=w.kv_events_endpoint) for w in fleet]
            mesh = mesh_factory(
                workers=workers,
                policy="cache_aware",
                tokenizer=TOKENIZER,
                lifecycle={"probe": False},
                kv={"relay": endpoint, "relay_replay": replays},
            )
            mesh.lifecycle.start()
            return mesh

        r1, r2 = make(), make()
        firsts: dict[str, tuple[str, str]] = {}
        mode = MODE_CLASSES["transport"](r1)  # routing in the client's own process
        try:
            client = mode.openai(max_retries=0)
            for topic in TOPICS:
                raw = client.chat.completions.with_raw_response.create(
                    model="tiny",
                    messages=cast("list[ChatCompletionMessageParam]", first_turn(topic)),
                    max_tokens=4,
                )
                reply = raw.parse().choices[0].message.content or ""
                firsts[topic] = (raw.headers["x-mock-worker"], reply)
        finally:
            mode.close()
        # Router 2 never subscribed to an engine: it hears them through the relay.
        deadline = time.monotonic() + 20
        expected = sum(r1.fleet.kv.blocks_of(w.url) for w in fleet)
        assert expected > 0
        while sum(r2.fleet.kv.blocks_of(w.url) for w in fleet) < expected:
            assert time.monotonic() < deadline, "router 2's index stayed behind router 1's"
            time.sleep(0.05)
        assert [row["prefix_match"] for row in r2.router.describe()] == ["events", "events"]
        mode = MODE_CLASSES["transport"](r2)
        try:
            client = mode.openai(max_retries=0)
            for topic, (worker, reply) in firsts.items():
                follow = [
                    *first_turn(topic),
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": "and tomorrow?"},
                ]
                raw = client.chat.completions.with_raw_response.create(
                    model="tiny",
                    messages=cast("list[ChatCompletionMessageParam]", follow),
                    max_tokens=4,
                )
                assert raw.headers["x-mock-worker"] == worker, topic
                details = raw.parse().usage.prompt_tokens_details  # type: ignore[union-attr]
                assert details is not None and (details.cached_tokens or 0) > 0
        finally:
            mode.close()
        assert len(set(firsts.values())) == 2  # both workers took conversations
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_a_router_takes_only_its_own_workers_messages(
    tmp_path: Path, publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    # Endpoints one of which starts with the other: a topic that were a bare
    # prefix would hand the first worker's router both engines' blocks.
    short = publisher(f"ipc://{tmp_path}/kv")
    long = publisher(f"ipc://{tmp_path}/kv0")
    with running(relay_of(short.endpoint, long.endpoint)) as relay:
        mesh = router(relay, short.endpoint)
        store_until_seen(mesh, short)
        before = blocks(mesh)
        for i in range(20):
            long.store([50_000 + i], None, [9, 9, 9, i])
        until(lambda: relay.sources[1].forwarded >= 20, "the long endpoint's messages")
        short.store([60_000], None, [1, 2, 3, 4])
        until(lambda: blocks(mesh) == before + 1, "the short endpoint's block")
        time.sleep(0.2)  # room for a stray message to arrive
        assert blocks(mesh) == before + 1


def test_a_lost_engine_clears_its_worker_and_the_router_starts_again(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    endpoint = pub.endpoint
    with running(relay_of(endpoint)) as relay:
        mesh = router(relay, endpoint)
        store_until_seen(mesh, pub)
        until(lambda: relay.sources[0].connected, "the relay's connection")
        pub.close()  # the engine goes away
        until(lambda: blocks(mesh) == 0, "the worker's entries dropped")
        assert relay.sources[0].lost == 1
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in relay_registry(relay).collect()
            for s in family.samples
        }
        assert samples[("mesh_kv_relay_lost_total", (("publisher", endpoint),))] == 1
        # The engine comes back on the same endpoint: the router hears it again.
        store_until_seen(mesh, publisher(endpoint))


def test_the_relay_replays_what_it_kept_and_says_when_it_kept_nothing(
    publisher: Callable[..., Publisher],
) -> None:
    pub = publisher()
    topic = relay_topic(pub.endpoint)
    with running(relay_of(pub.endpoint, replay_bytes=2_000)) as relay:
        assert replay(relay, 0, topic) == [-2]  # nothing kept yet: it does not know
        until(lambda: relay.sources[0].connected, "the relay's connection")
        time.sleep(0.3)  # the subscription reaches the publisher
        for i in range(10):
            pub.store([80_000 + i], None, [1, 1, 1, i])
        until(lambda: relay.sources[0].last_seq == pub.seq - 1, "the relay's messages")
        kept = replay(relay, 0, topic)
        # Within replay_bytes (~200 B a message here, and a count per message): the newest.
        assert 0 < len(kept) < 10 and kept == list(range(pub.seq - len(kept), pub.seq))
        assert replay(relay, pub.seq - 2, topic) == [pub.seq - 2, pub.seq - 1]
        assert replay(relay, 0, relay_topic("tcp://elsewhere:5557")) == [-2]


def test_a_router_joining_through_the_relay_gets_what_was_published_before_it(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    with running(relay_of(pub.endpoint)) as relay:
        until(lambda: relay.sources[0].connected, "the relay's connection")
        time.sleep(0.3)
        for i in range(5):
            pub.store([90_000 + i], None, [2, 2, 2, i])
        until(lambda: relay.sources[0].last_seq == pub.seq - 1, "the relay's messages")
        # The worker names no kv_replay: the engine is never asked, the relay is.
        mesh = router(relay, pub.endpoint, replays=True)
        until(lambda: blocks(mesh) == 5, "the blocks stored before the router joined")


def test_a_relay_that_kept_nothing_is_not_a_gap_from_zero(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    for i in range(7):
        pub.store([95_000 + i], None, [3, 3, 3, i])  # before any relay: heard by none
    with running(relay_of(pub.endpoint)) as relay:
        mesh = router(relay, pub.endpoint, replays=True)
        until(lambda: relay.replays == 1, "the router's joining replay")
        store_until_seen(mesh, pub)
        gaps = mesh.metrics.registry.get_sample_value(
            "mesh_kv_gaps_total", {"worker": URL, "outcome": "cleared"}
        )
        assert gaps in (None, 0.0)


def test_a_relay_started_after_the_engine_asks_the_engine_for_its_history(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher(replay=True)
    for i in range(6):
        pub.store([97_000 + i], None, [4, 4, 4, i])  # before the relay: only kept
    with running(relay_of(pub.endpoint, engine_replay=pub.replay_endpoint)) as relay:
        mesh = router(relay, pub.endpoint, replays=True)
        until(lambda: blocks(mesh) == 6, "the engine's history, through the relay")
        assert pub.replays == 1  # asked once, by the relay: the router asked it
        assert relay.replays >= 1


def test_a_relay_joining_a_busy_engine_keeps_its_history_without_a_hole(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    """Batches published while the relay connects are in the engine's replay or come
    live: a router that joins later gets all of them from the relay."""
    pub = publisher(replay=True)
    stop = threading.Event()
    lock = threading.Lock()

    def publish() -> None:
        i = 0
        while not stop.is_set():
            with lock:
                pub.store([98_000 + i], None, [5, 5, 5, i])
            i += 1
            time.sleep(0.002)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        with running(relay_of(pub.endpoint, engine_replay=pub.replay_endpoint)) as relay:
            until(lambda: relay.sources[0].joining is None and pub.replays == 1, "the join")
            time.sleep(0.2)
            stop.set()
            thread.join()
            until(lambda: relay.sources[0].last_seq == pub.seq - 1, "the last batch")
            mesh = router(relay, pub.endpoint, replays=True)
            until(lambda: blocks(mesh) == pub.seq, "every batch, from the relay")
    finally:
        stop.set()
        thread.join()


def test_an_idle_engine_that_said_so_is_matched_on_events_through_the_relay(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    """An empty replay from the engine is an answer: the relay passes it on, and the
    router matches that worker on events before its first batch, as it would
    asking the engine itself."""
    pub = publisher(replay=True)
    with running(relay_of(pub.endpoint, engine_replay=pub.replay_endpoint)) as relay:
        until(lambda: pub.replays == 1 and relay.sources[0].joining is None, "the join")
        mesh = router(relay, pub.endpoint, replays=True)
        until(lambda: relay.replays == 1, "the router's joining replay")
        until(
            lambda: mesh.router.describe()[0]["prefix_match"] == "events",
            "the worker matched on events",
        )
        assert blocks(mesh) == 0


def test_an_engine_replay_that_never_ends_holds_the_routers_no_longer_than_the_timeout(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # takes the relay's request, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    quiet = silent.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        kv = KvConfig(replay_timeout_s=0.5)
        with running(relay_of(pub.endpoint, engine_replay=quiet, kv=kv)) as relay:
            mesh = router(relay, pub.endpoint, replays=True)
            until(lambda: relay.sources[0].joining is None, "the relay giving up")
            store_until_seen(mesh, pub)  # live batches flow all the same
    finally:
        silent.close(linger=0)
        ctx.destroy(linger=0)


def test_the_relay_follows_a_changed_list_of_publishers(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    # The list alone (kv_relay.follow_routers off): what routers ask adds nothing.
    a, b = publisher(), publisher()
    with running(relay_of(a.endpoint, follow_routers=False)) as relay:
        on_a = router(relay, a.endpoint)
        on_b = router(relay, b.endpoint, url="http://127.0.0.1:10")
        store_until_seen(on_a, a)
        for i in range(10):
            b.store([b.seq + 30_000 + i], None, [7, 7, 7, i])
        time.sleep(0.3)
        assert blocks(on_b, "http://127.0.0.1:10") == 0  # b is not relayed
        assert [src.endpoint for src in relay.sources] == [a.endpoint]
        store_until_seen(on_a, a)
        relay.request({a.endpoint: None, b.endpoint: None})  # b joins the fleet
        deadline = time.monotonic() + 20
        while not blocks(on_b, "http://127.0.0.1:10"):
            assert time.monotonic() < deadline, "b's batches never came through"
            b.store([b.seq + 20_000], None, [7, 7, 7, b.seq])
            time.sleep(0.05)
        relay.request({b.endpoint: None})  # a leaves: its routers start again
        until(lambda: blocks(on_a) == 0, "a's entries dropped")
        assert [src.endpoint for src in relay.sources] == [b.endpoint]


def test_an_engine_no_list_names_is_relayed_while_a_router_asks_for_it(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    # A worker an admin added, or one a router's own discovery found: the relay's
    # list does not name its engine, and its routers subscribe to it all the same.
    a, b, c = publisher(), publisher(), publisher()
    with running(relay_of(a.endpoint, max_followed=1)) as relay:
        on_b = router(relay, b.endpoint, url="http://127.0.0.1:10")
        deadline = time.monotonic() + 20
        while not blocks(on_b, "http://127.0.0.1:10"):
            assert time.monotonic() < deadline, "b's batches never came through"
            b.store([b.seq + 20_000], None, [7, 7, 7, b.seq])
            time.sleep(0.05)
        assert {src.endpoint for src in relay.sources} == {a.endpoint, b.endpoint}
        # Past kv_relay.max_followed, a router's ask is refused (and counted).
        on_c = router(relay, c.endpoint, url="http://127.0.0.1:11")
        until(lambda: relay.refused == 1, "c refused")
        for i in range(10):
            c.store([c.seq + 30_000 + i], None, [8, 8, 8, i])
        time.sleep(0.3)
        assert blocks(on_c, "http://127.0.0.1:11") == 0
        # The last router to b leaves: b is no longer relayed; a, listed, stays.
        on_b.close()
        until(lambda: [s.endpoint for s in relay.sources] == [a.endpoint], "b dropped")


def test_a_router_joining_an_engine_the_relay_kept_nothing_of_asks_the_engine(
    publisher: Callable[..., Publisher], relayed: Callable[..., Mesh]
) -> None:
    # The relay follows b only once a router asks (no list names it), so it kept
    # none of what b published before: the router asks b's own replay endpoint.
    a, b = publisher(), publisher(replay=True)
    for i in range(3):
        b.store([50 + i], None if i == 0 else 49 + i, [5, 5, 5, i])
    with running(relay_of(a.endpoint)) as relay:
        kv = {"relay": relay.endpoint, "relay_replay": relay.replay_endpoint or ""}
        mesh = relayed(b.endpoint, kv, replay=b.replay_endpoint)
        until(lambda: blocks(mesh) == 3, "b's history from its own replay")
        assert b.replays == 1


def test_a_message_over_the_bound_costs_the_engine_its_routers_not_the_relay_its_engine(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    # libzmq drops a connection that sent a message over MAXMSGSIZE and never
    # connects it again: the relay opens a new one, and the routers start afresh.
    pub = publisher()
    with running(relay_of(pub.endpoint, kv=KvConfig(max_message_bytes=4096))) as relay:
        mesh = router(relay, pub.endpoint)
        store_until_seen(mesh, pub)
        pub.send(os.urandom(8192))
        until(lambda: relay.sources[0].lost == 1, "the relay's lost connection")
        until(lambda: blocks(mesh) == 0, "the worker's entries dropped")
        store_until_seen(mesh, pub)  # heard again over the new connection


def test_a_router_behind_by_send_hwm_sees_a_gap_and_the_relay_does_not_wait(
    publisher: Callable[..., Publisher],
) -> None:
    pub = publisher()
    payload = os.urandom(32 * 1024)
    with running(relay_of(pub.endpoint, send_hwm=4)) as relay:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 4)
        sub.setsockopt(zmq.RCVBUF, 64 * 1024)
        sub.setsockopt(zmq.SUBSCRIBE, relay_topic(pub.endpoint))
        sub.connect(relay.endpoint)
        try:
            # Joined once a message comes through.
            deadline = time.monotonic() + 20
            while not sub.poll(50):
                assert time.monotonic() < deadline
                pub.send(b"join")
            sub.recv_multipart()
            until(lambda: relay.sources[0].last_seq == pub.seq - 1, "the joining messages")
            start, before = pub.seq, relay.sources[0].forwarded
            for i in range(1, 1001):
                pub.send(payload)  # the subscriber reads none of these yet
                if i % 100 == 0:  # the relay keeps up (the publisher's own bound aside)
                    until(
                        cast(
                            Callable[[], bool], lambda i=i: relay.sources[0].forwarded == before + i
                        ),
                        "the relay",
                    )
            seqs = []
            while sub.poll(200):
                seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
            seqs = [s for s in seqs if s >= start]
            assert seqs and len(seqs) < 1000
            assert any(b - a > 1 for a, b in itertools.pairwise(seqs)) or seqs[0] > start
        finally:
            sub.close(linger=0)
            ctx.destroy(linger=0)


def gap_count(mesh: Mesh, outcome: str) -> float:
    value = mesh.metrics.registry.get_sample_value(
        "mesh_kv_gaps_total", {"worker": URL, "outcome": outcome}
    )
    return value or 0.0


def test_batches_the_relay_missed_are_filled_from_the_engine_and_no_router_clears(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    """The relay misses three batches (the engine published them to nobody): it asks
    the engine's replay, and a router that sees the same jump gets them from the
    relay, without asking the engine (its worker names no kv_replay) or clearing."""
    pub = publisher(replay=True)
    with running(relay_of(pub.endpoint, engine_replay=pub.replay_endpoint)) as relay:
        mesh = router(relay, pub.endpoint, replays=True)
        store_until_seen(mesh, pub)
        until(lambda: blocks(mesh) == pub.seq, "the batches before the jump")
        asked = pub.replays
        for i in range(3):
            pub.store([60_000 + i], None, [6, 6, 6, i], publish=False)
        pub.store([60_003], None, [6, 6, 6, 3])
        until(lambda: relay.sources[0].filled == 1, "the relay's fill")
        until(lambda: blocks(mesh) == pub.seq, "every batch, the missed ones too")
        assert pub.replays == asked + 1  # once, by the relay
        assert relay.sources[0].unfilled == 0
        assert gap_count(mesh, "replayed") == 1 and gap_count(mesh, "cleared") == 0
        # Later batches pass as before.
        pub.store([60_004], None, [6, 6, 6, 4])
        until(lambda: blocks(mesh) == pub.seq, "the next batch")


@pytest.mark.parametrize("why", ["no engine replay", "the engine no longer has them"])
def test_batches_neither_the_relay_nor_the_engine_has_are_a_gap_for_the_routers(
    why: str, publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher(replay=True)
    engine_replay = pub.replay_endpoint if why != "no engine replay" else None
    with running(relay_of(pub.endpoint, engine_replay=engine_replay)) as relay:
        mesh = router(relay, pub.endpoint, replays=True)
        store_until_seen(mesh, pub)
        for i in range(3):
            pub.store([61_000 + i], None, [7, 7, 7, i], publish=False)
        pub.kept = pub.kept[:-3]  # gone from the engine's buffer as well
        pub.store([61_003], None, [7, 7, 7, 3])
        until(lambda: relay.sources[0].unfilled == 1, "the relay's unfilled jump")
        until(lambda: gap_count(mesh, "cleared") == 1, "the router's own gap handling")
        assert relay.sources[0].filled == 0
        until(lambda: blocks(mesh) == 1, "the entries rebuilt from the next batch")


def test_messages_not_in_three_frames_stop_at_the_relay(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    with running(relay_of(pub.endpoint)) as relay:
        mesh = router(relay, pub.endpoint)
        store_until_seen(mesh, pub)
        before = blocks(mesh)
        pub.pub.send_multipart([b"kv", b"half"])
        until(lambda: relay.sources[0].malformed == 1, "the malformed count")
        pub.store([70_000], None, [5, 6, 7, 8])
        until(lambda: blocks(mesh) == before + 1, "the next batch")
        assert mesh.metrics.registry.get_sample_value("mesh_kv_errors_total", {"worker": URL}) in (
            None,
            0.0,
        )


def _relay_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshkit", "kv-relay", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "MESHKIT_CONFIG": ""},
    )


def test_kv_relay_without_a_publisher_or_with_a_bad_endpoint_exits_2(tmp_path: Path) -> None:
    # Without a publisher, it relays only what routers ask: that needs follow_routers.
    config = tmp_path / "relay.toml"
    config.write_text("[kv_relay]\nfollow_routers = false\n")
    done = _relay_cli("--config", str(config), "--bind", "tcp://127.0.0.1:*")
    assert done.returncode == 2
    assert "no publisher to relay" in done.stderr
    done = _relay_cli("--publisher", "tcp://*:5557")
    assert done.returncode == 2 and "--publisher" in done.stderr
    done = _relay_cli("--publisher", "tcp://127.0.0.1:5557", "--bind", "http://x")
    assert done.returncode == 2 and "kv_relay.bind" in done.stderr
    for bad in ("tcp://127.0.0.1:5557,udp://x", "tcp://a:1,tcp://a:2,tcp://a:3", ",tcp://a:2"):
        done = _relay_cli("--publisher", bad)
        assert done.returncode == 2 and "--publisher" in done.stderr, bad


def test_a_publisher_named_with_its_replay_endpoint_is_asked_for_its_history(
    publisher: Callable[..., Publisher], relayed: Callable[..., Mesh]
) -> None:
    """``--publisher EVENTS,REPLAY``: no worker config needed for the relay to ask
    an engine what it stored before the relay started."""
    pub = publisher(replay=True)
    for i in range(6):
        pub.store([96_000 + i], None, [4, 4, 4, i], publish=False)  # before the relay
    started = start_kv_relay(
        [
            *("--publisher", f"{pub.endpoint},{pub.replay_endpoint}"),
            *("--bind", "tcp://127.0.0.1:*", "--replay-bind", "tcp://127.0.0.1:*"),
        ]
    )
    try:
        kv = {"relay": started.endpoint, "relay_replay": started.replay_endpoint}
        mesh = relayed(pub.endpoint, kv)
        until(lambda: blocks(mesh) == 6, "the engine's history, from the relay")
        assert pub.replays == 1  # the relay asked; the router asked the relay
    finally:
        started.proc.terminate()
        assert started.proc.wait(10) == 0


class RelayProcess:
    """``meshkit kv-relay --config <path>`` with its metrics on a free port."""

    def __init__(self, config: Path) -> None:
        # Below the ephemeral range: a free ephemeral port may be taken before the
        # relay binds it, by the relay's own "tcp://127.0.0.1:*" socket (CI saw
        # "Address already in use").
        self.port = reusable_port()
        started = start_kv_relay(["--config", str(config), "--metrics-port", str(self.port)])
        self.proc = started.proc
        #: where routers subscribe, and where they ask replays ("" without)
        self.endpoint, self.replay_endpoint = started.endpoint, started.replay_endpoint

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def connected(self, pub: Publisher) -> bool:
        return f'mesh_kv_relay_connected{{publisher="{pub.endpoint}"}} 1.0' in self.metrics()

    def stop(self) -> str:
        """SIGTERM: it exits 0; what it wrote on stderr."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=10) == 0
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


def relay_config(path: Path, *pubs: Publisher) -> None:
    workers = "".join(
        f'[[workers]]\nurl = "http://127.0.0.1:{9 + i}"\nkv_events = "{p.endpoint}"\n\n'
        for i, p in enumerate(pubs)
    )
    path.write_text(workers + '[kv_relay]\nbind = "tcp://127.0.0.1:*"\nreplay_bind = ""\n')


def test_kv_relay_serves_its_metrics(tmp_path: Path, publisher: Callable[..., Publisher]) -> None:
    pub = publisher()
    relay_config(tmp_path / "meshkit.toml", pub)
    relay = RelayProcess(tmp_path / "meshkit.toml")
    try:
        assert relay.endpoint.startswith("tcp://127.0.0.1:") and not relay.replay_endpoint

        def forwarded() -> bool:
            pub.store([pub.seq + 1], None, [1, 1, 1, 1])
            return bool(
                re.search(
                    rf'mesh_kv_relay_messages_total{{outcome="forwarded",'
                    rf'publisher="{re.escape(pub.endpoint)}"}} [1-9]',
                    relay.metrics(),
                )
            )

        until(forwarded, "a forwarded message in the relay's metrics")
        assert relay.connected(pub)
    finally:
        relay.stop()


def test_sighup_reads_the_workers_again(
    tmp_path: Path, publisher: Callable[..., Publisher]
) -> None:
    a, b = publisher(), publisher()
    config = tmp_path / "meshkit.toml"
    relay_config(config, a)
    relay = RelayProcess(config)
    try:
        assert relay.endpoint
        until(lambda: relay.connected(a), "the first publisher")
        relay_config(config, a, b)
        relay.proc.send_signal(signal.SIGHUP)
        until(lambda: relay.connected(b), "the publisher the reload added")
        config.write_text("[kv_relay]\nsend_hwm = 0\n")  # refused: the relay goes on
        relay.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert relay.proc.poll() is None and relay.connected(b)
    finally:
        errors = relay.stop()
    assert "reload refused" in errors


def test_the_relay_finds_publishers_as_routers_find_workers(tmp_path: Path) -> None:
    """dns:// entries (looked up) and the workers file (read again) give the relay
    the same publishers they give the routers their workers."""
    from meshkit.config import MeshConfig
    from meshkit.lifecycle.kv_relay import RelayFleet

    listed = tmp_path / "workers.toml"
    listed.write_text('[[workers]]\nurl = "http://gpu-9:8000"\nkv_events = "tcp://{host}:5557"\n')
    config = tmp_path / "meshkit.toml"
    config.write_text(
        'workers_file = "workers.toml"\n\n'
        '[[workers]]\nurl = "dns://localhost:8000"\nkv_events = "tcp://{host}:5557"\n'
        'kv_replay = "tcp://{host}:5558"\n\n'
        '[kv_relay]\npublishers = ["tcp://other:6000"]\n'
    )
    fleet = RelayFleet(MeshConfig.from_file(str(config)), ["tcp://extra:7000"])
    assert fleet.publishers() == {
        "tcp://gpu-9:5557": None,
        "tcp://other:6000": None,
        "tcp://extra:7000": None,
    }  # the name not looked up yet
    asyncio.run(fleet.refresh())
    found = fleet.publishers()
    assert found["tcp://127.0.0.1:5557"] == "tcp://127.0.0.1:5558"  # localhost's address
    listed.write_text('[[workers]]\nurl = "http://gpu-8:8000"\nkv_events = "tcp://{host}:5557"\n')
    asyncio.run(fleet.refresh())
    assert "tcp://gpu-8:5557" in fleet.publishers()
    assert "tcp://gpu-9:5557" not in fleet.publishers()
    listed.write_text("not toml [")  # a bad read keeps the last workers
    asyncio.run(fleet.refresh())
    assert "tcp://gpu-8:5557" in fleet.publishers()


def test_the_relays_lookup_that_hangs_is_given_up_after_resolve_timeout_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay looks names up as the routers' discovery does (one ``look_up``):
    a resolver that does not answer costs ``discovery.resolve_timeout_s``, the
    other names are found, and the name keeps its last publishers."""
    import logging
    import socket

    from meshkit.config import MeshConfig
    from meshkit.lifecycle.kv_relay import RelayFleet

    release = threading.Event()
    real = socket.getaddrinfo

    def lookup(host: object, *args: object, **kw: object) -> object:
        if host == "hangs.test":
            release.wait(30)
            raise OSError("answered late")
        return real(host, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    caplog.set_level(logging.WARNING, "meshkit.kv_relay")
    config = tmp_path / "meshkit.toml"
    config.write_text(
        "[discovery]\nresolve_timeout_s = 0.3\n\n"
        '[[workers]]\nurl = "dns://hangs.test:8000"\nkv_events = "tcp://{host}:5557"\n\n'
        '[[workers]]\nurl = "dns://localhost:8001"\nkv_events = "tcp://{host}:6557"\n'
    )
    fleet = RelayFleet(MeshConfig.from_file(str(config)))
    try:
        with asyncio.Runner() as runner:
            runner.run(fleet.refresh())
            assert "tcp://127.0.0.1:6557" in fleet.publishers()
            release.set()
    finally:
        release.set()
    assert any(
        "dns://hangs.test: lookup failed (timed out)" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize(
    ("endpoint", "ok"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://", False),  # no host
        ("tcp://*:5557", False),  # a bind address
        ("ipc:///tmp/engine.sock", False),  # not the relay host's paths
        ("inproc://engine", False),
        (" tcp://127.0.0.1:5557", False),  # not the endpoint the topic names
        ("udp://127.0.0.1:5557", False),
    ],
)
def test_what_a_router_may_ask_a_relay_to_follow(endpoint: str, ok: bool) -> None:
    assert followable(endpoint) is ok

"""Routers with several ``[kv] relay`` entries (:mod:`meshkit.lifecycle.kv`): when
the relay in use goes away, stops answering (``kv.heartbeat_s``), cannot be
reached, or loses the engine, the next one takes over where it left off, the
batches missed in the move replayed from it and the worker's entries kept; an
engine that every relay lost has its worker's entries dropped."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import pytest

zmq = pytest.importorskip("zmq")

from lifecycle.test_kv_relay import (  # noqa: E402
    RelayProcess,
    blocks,
    publisher,
    relay_of,
    relayed,
    running,
)
from lifecycle.test_kv_subscriber import URL, Publisher, until  # noqa: E402
from meshkit import Mesh  # noqa: E402
from meshkit.config import KvConfig  # noqa: E402
from meshkit.core.workers import Worker  # noqa: E402
from meshkit.lifecycle.kv_relay import KvRelay  # noqa: E402
from meshkit.testing.ports import free_port  # noqa: E402

__all__ = ["publisher", "relayed"]  # the fixtures, found by name


@pytest.fixture
def router(relayed: Callable[..., Mesh]) -> Callable[..., Mesh]:
    """``router(endpoint, relays, replays, heartbeat_s=10)``: a Mesh with one worker
    whose events come through ``relays`` in turn."""

    def make(
        endpoint: str, relays: list[str], replays: list[str], heartbeat_s: float = 10.0
    ) -> Mesh:
        kv: dict[str, object] = {"relay": relays, "heartbeat_s": heartbeat_s}
        if replays:
            kv["relay_replay"] = replays
        return relayed(endpoint, kv)

    return make


def sample(mesh: Mesh, name: str, **labels: str) -> float:
    return mesh.metrics.registry.get_sample_value(name, {"worker": URL, **labels}) or 0.0


def moves(mesh: Mesh, outcome: str) -> float:
    return sample(mesh, "mesh_kv_relay_moves_total", outcome=outcome)


def cleared(mesh: Mesh) -> float:
    return sample(mesh, "mesh_kv_gaps_total", outcome="cleared") + sample(
        mesh, "mesh_kv_gaps_total", outcome="restart"
    )


def store_one(pub: Publisher) -> None:
    """A root block of its own (tokens the block size of the mock publisher)."""
    pub.store([500_000 + pub.seq], None, [7, 7, 7, pub.seq])


def store_until(mesh: Mesh, pub: Publisher, count: int) -> None:
    """Publish a block at a time until the router holds ``count`` blocks (a
    subscription that has not reached its relay yet misses the first ones)."""
    deadline = time.monotonic() + 20
    while blocks(mesh) < count:
        assert time.monotonic() < deadline, f"the router holds {blocks(mesh)} of {count} blocks"
        store_one(pub)
        time.sleep(0.05)


def settled(relay: KvRelay, pub: Publisher) -> None:
    """``relay`` has the publisher's newest batch (its subscription holds)."""
    until(lambda: relay.sources[0].connected, "the relay's connection")

    def caught_up() -> bool:
        store_one(pub)
        time.sleep(0.05)
        return relay.sources[0].last_seq == pub.seq - 1

    until(caught_up, "the relay's subscription")


@contextmanager
def two_relays(
    pub: Publisher, router: Callable[..., Mesh], a_kv: KvConfig | None = None, replays: bool = True
) -> Iterator[tuple[KvRelay, KvRelay, Mesh]]:
    """Relays a (with ``a_kv``) and b of ``pub``, both settled, and a router on
    them in that order (with their replay endpoints unless not ``replays``) that
    holds two blocks."""
    a, b = relay_of(pub.endpoint, kv=a_kv), relay_of(pub.endpoint)
    with running(a), running(b):
        settled(a, pub)
        settled(b, pub)
        at = [a.replay_endpoint or "", b.replay_endpoint or ""] if replays else []
        mesh = router(pub.endpoint, [a.endpoint, b.endpoint], at)
        store_until(mesh, pub, 2)
        yield a, b, mesh


def test_a_router_moves_to_the_next_relay_when_its_relay_goes_and_keeps_its_entries(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    a, b = relay_of(pub.endpoint), relay_of(pub.endpoint)
    with running(b):
        with running(a):
            settled(a, pub)
            settled(b, pub)
            mesh = router(
                pub.endpoint,
                [a.endpoint, b.endpoint],
                [a.replay_endpoint or "", b.replay_endpoint or ""],
            )
            store_until(mesh, pub, 3)
            held = blocks(mesh)
        # relay a is gone (its sockets closed): b carries on from where a left off
        until(lambda: moves(mesh, "replayed") == 1, "the move to relay b")
        store_until(mesh, pub, held + 3)
        assert cleared(mesh) == 0 and moves(mesh, "cleared") == 0
        assert blocks(mesh) >= held + 3  # nothing the router held was dropped


def test_a_relay_lost_is_one_warning_whatever_the_number_of_workers_behind_it(
    publisher: Callable[..., Publisher], caplog: pytest.LogCaptureFixture
) -> None:
    pubs = [publisher() for _ in range(3)]
    urls = [f"http://127.0.0.1:{9100 + i}" for i in range(3)]
    ends = [p.endpoint for p in pubs]
    a, b = relay_of(*ends), relay_of(*ends)
    caplog.set_level(logging.INFO, "meshkit.kv")
    with running(b):
        with running(a):
            for relay in (a, b):
                until(
                    cast(Callable[[], bool], lambda r=relay: all(s.connected for s in r.sources)),
                    "the relays",
                )
            mesh = Mesh(
                workers=[Worker(u, kv_events=e) for u, e in zip(urls, ends, strict=True)],
                policy="cache_aware",
                lifecycle={"probe": False},
                kv={
                    "relay": [a.endpoint, b.endpoint],
                    "relay_replay": [a.replay_endpoint, b.replay_endpoint],
                },
            )
            mesh.lifecycle.start()
            try:

                def all_heard() -> bool:
                    for p in pubs:
                        store_one(p)
                    time.sleep(0.05)
                    kv = mesh.router.fleet.kv
                    return all(kv.blocks_of(u) for u in urls)

                until(all_heard, "every worker's events through relay a")
            except BaseException:
                mesh.close()
                raise
        try:
            moved = mesh.metrics.registry.get_sample_value

            def all_moved() -> bool:
                return all(
                    moved("mesh_kv_relay_moves_total", {"worker": u, "outcome": "replayed"})
                    for u in urls
                )

            until(all_moved, "every worker's move to relay b")
            about_a = [r for r in caplog.records if a.endpoint in r.getMessage()]
            warnings = [r for r in about_a if r.levelno == logging.WARNING]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]
            moves_logged = [r for r in caplog.records if "move to the relay at" in r.getMessage()]
            assert len(moves_logged) == 2 and all(r.levelno == logging.INFO for r in moves_logged)
        finally:
            mesh.close()


def test_a_relay_that_stops_answering_is_left_after_heartbeat_s_and_what_was_missed_replayed(
    tmp_path: Path, publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    config = tmp_path / "meshkit.toml"
    config.write_text(
        f'[[workers]]\nurl = "{URL}"\nkv_events = "{pub.endpoint}"\n\n'
        '[kv_relay]\nbind = "tcp://127.0.0.1:*"\nreplay_bind = "tcp://127.0.0.1:*"\n'
    )
    a = RelayProcess(config)
    try:
        assert a.endpoint and a.replay_endpoint
        with running(relay_of(pub.endpoint)) as b:
            settled(b, pub)
            mesh = router(
                pub.endpoint,
                [a.endpoint, b.endpoint],
                [a.replay_endpoint, b.replay_endpoint or ""],
                heartbeat_s=1.0,
            )
            store_until(mesh, pub, 2)
            held = blocks(mesh)
            a.proc.send_signal(signal.SIGSTOP)  # its connections stay open; it answers nothing
            try:
                for _ in range(3):
                    store_one(pub)  # relay b forwards them to nobody: missed by the router
                until(lambda: moves(mesh, "replayed") == 1, "the move after kv.heartbeat_s")
                store_until(mesh, pub, held + 4)
            finally:
                a.proc.send_signal(signal.SIGCONT)
            # the three missed batches came from relay b's replay, and nothing was dropped
            assert blocks(mesh) >= held + 4 and cleared(mesh) == 0
    finally:
        a.stop()


def test_a_relay_not_reached_is_passed_for_the_next(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    with running(relay_of(pub.endpoint)) as b:
        settled(b, pub)
        mesh = router(
            pub.endpoint,
            [nowhere, b.endpoint],
            [f"tcp://127.0.0.1:{free_port()}", b.replay_endpoint or ""],
            heartbeat_s=0.5,
        )
        # joined through relay b: what it kept before the router came is there too
        store_until(mesh, pub, pub.seq + 1)
        assert cleared(mesh) == 0


def test_without_a_heartbeat_a_relay_not_reached_is_waited_for(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    with running(relay_of(pub.endpoint)) as b:
        settled(b, pub)
        mesh = router(
            pub.endpoint, [f"tcp://127.0.0.1:{free_port()}", b.endpoint], [], heartbeat_s=0
        )
        for _ in range(20):
            store_one(pub)
            time.sleep(0.05)
        assert blocks(mesh) == 0  # kv.heartbeat_s = 0: it never gives up on the first


def test_a_relay_that_lost_the_engine_hands_over_to_the_next_without_a_clear(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    # Relay a refuses a message over 4 KiB (libzmq drops its engine connection and it
    # says so to its routers); relay b takes it.
    with two_relays(pub, router, KvConfig(max_message_bytes=4096)) as (a, _, mesh):
        held = blocks(mesh)
        big = 600  # blocks in one batch: about 5 KB
        pub.store(list(range(700_000, 700_000 + big)), None, [9] * (4 * big))
        until(lambda: a.sources[0].lost == 1, "relay a's lost engine connection")
        until(lambda: moves(mesh, "replayed") == 1, "the move to relay b")
        store_until(mesh, pub, held + big + 1)
        assert cleared(mesh) == 0 and moves(mesh, "cleared") == 0


def test_an_engine_every_relay_lost_has_its_entries_dropped(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    with two_relays(pub, router) as (a, b, mesh):
        pub.close()  # the engine goes away: both relays say so
        until(lambda: blocks(mesh) == 0, "the worker's entries dropped")
        until(lambda: a.sources[0].lost == 1 and b.sources[0].lost == 1, "both relays' word")


def test_without_replay_endpoints_a_move_off_a_relay_that_lost_the_engine_clears(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    with two_relays(pub, router, KvConfig(max_message_bytes=4096), replays=False) as (_, _, mesh):
        big = 600
        pub.store(list(range(800_000, 800_000 + big)), None, [9] * (4 * big))
        # nothing can say the engine did not restart: what the router held goes (the
        # big batch is there if relay b's copy reached it), and new blocks come again
        until(lambda: moves(mesh, "cleared") == 1, "the move to relay b")
        assert blocks(mesh) in (0, big)
        store_until(mesh, pub, blocks(mesh) + 1)


def test_a_relay_whose_engine_stops_answering_says_so_after_heartbeat_s() -> None:
    # The engine in a process of its own, so that it can be stopped whole (libzmq's
    # threads too): its connection stays open and answers nothing.
    import subprocess
    import sys

    script = (
        "import sys, time, zmq\n"
        "pub = zmq.Context().socket(zmq.PUB)\n"
        "pub.bind('tcp://127.0.0.1:*')\n"
        "print(pub.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)\n"
        "time.sleep(60)\n"
    )
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None
        endpoint = engine.stdout.readline().strip()
        with running(relay_of(endpoint, kv=KvConfig(heartbeat_s=0.6))) as relay:
            until(lambda: relay.sources[0].connected, "the relay's connection")
            engine.send_signal(signal.SIGSTOP)
            until(lambda: relay.sources[0].lost == 1, "the relay's word on its engine")
            engine.send_signal(signal.SIGCONT)
            until(lambda: relay.sources[0].connected, "the connection opened again")
    finally:
        engine.kill()
        engine.wait()


class SteeredRelay:
    """A relay the test steers: a PUB carrying the batches the test hands it under
    the engine's topic, and a replay endpoint that says it kept nothing (the
    relay's ``PUBLISHER_LOST``), as a relay that missed them would."""

    def __init__(self, engine: str) -> None:
        from meshkit.core.kv_events import relay_topic

        self.topic = relay_topic(engine)
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replays = self.ctx.socket(zmq.ROUTER)
        self.replays.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.replays.getsockopt_string(zmq.LAST_ENDPOINT)
        self.asked = 0
        self._stop = False
        self._thread = threading.Thread(target=self._answer, daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        lost, end = (-2).to_bytes(8, "big", signed=True), (-1).to_bytes(8, "big", signed=True)
        while not self._stop:
            if not self.replays.poll(50):
                continue
            ident = self.replays.recv_multipart()[0]
            self.asked += 1
            self.replays.send_multipart([ident, b"", self.topic, lost, b""])
            self.replays.send_multipart([ident, b"", b"", end, b""])

    def carry(self, seq: int, payload: bytes) -> None:
        self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.ctx.destroy(linger=0)


def test_a_gap_the_relay_in_use_cannot_fill_is_replayed_from_the_next(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    pub = publisher()
    a = SteeredRelay(pub.endpoint)
    try:
        with running(relay_of(pub.endpoint)) as b:
            settled(b, pub)
            first = pub.seq
            for _ in range(8):
                store_one(pub)  # relay b keeps them all
            until(lambda: b.sources[0].last_seq == pub.seq - 1, "relay b's messages")
            kept = dict(pub.kept)
            mesh = router(
                pub.endpoint, [a.endpoint, b.endpoint], [a.replay_endpoint, b.replay_endpoint or ""]
            )
            deadline = time.monotonic() + 20
            while not blocks(mesh):  # its later copies are skipped
                assert time.monotonic() < deadline, "the router never heard relay a"
                a.carry(first, kept[first])
                time.sleep(0.05)
            for seq in range(first + 1, first + 5):
                a.carry(seq, kept[seq])
            a.carry(first + 7, kept[first + 7])  # relay a missed two
            until(lambda: blocks(mesh) == 8, "the two missed batches, from relay b")
            assert sample(mesh, "mesh_kv_gaps_total", outcome="replayed") == 1
            assert cleared(mesh) == 0 and a.asked >= 2  # its join, and the gap
    finally:
        a.close()


def test_a_lone_relay_gone_leaves_its_workers_to_the_tree_until_it_is_back(
    publisher: Callable[..., Publisher], router: Callable[..., Mesh]
) -> None:
    """Its engines may well be fine: what they hold is unknown, not nothing, so the
    router matches them on its own tree (a lost engine, by contrast, holds nothing:
    test_kv_relay's lost-engine test)."""
    from meshkit.config import KvRelayConfig

    def match_kind(mesh: Mesh) -> str:
        return str(mesh.router.describe(URL)[0]["prefix_match"])

    pub = publisher()
    a = relay_of(pub.endpoint)
    at, replay_at = a.endpoint, a.replay_endpoint or ""
    with running(a):
        settled(a, pub)
        mesh = router(pub.endpoint, [at], [replay_at])
        store_until(mesh, pub, 2)
        assert match_kind(mesh) == "events"
    until(lambda: match_kind(mesh) == "approximate", "the tree's turn")
    assert blocks(mesh) == 0
    # The relay back on its endpoints: events again.
    back = KvRelay({pub.endpoint: None}, KvRelayConfig(bind=at, replay_bind=replay_at), KvConfig())
    with running(back):
        store_until(mesh, pub, 1)
        assert match_kind(mesh) == "events"

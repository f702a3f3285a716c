"""The KV-event subscriber (:mod:`meshkit.lifecycle.kv`) against a real ZeroMQ
publisher in vLLM's wire format: batches reach the index, a gap is replayed or
forgotten, a restarted publisher is seen, a bad payload drops what it may have
changed, a removed worker's task and entries go."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

if TYPE_CHECKING:
    import zmq
else:
    zmq = pytest.importorskip("zmq")

from meshkit import Mesh
from meshkit.core.workers import Worker
from meshkit.demo import TOKENIZER
from meshkit.mock.kv_publisher import BlockStored, KVEventBatch

URL = "http://127.0.0.1:9"  # never called: probes are off
BLOCK = 4


def free_endpoint(
    ctx: zmq.SyncContext, kind: int, where: str = "tcp://127.0.0.1:*"
) -> tuple[zmq.SyncSocket, str]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(where)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


class Publisher:
    """A vLLM-like publisher the test steers: it can skip sequence numbers, start
    again from 0, and answer replays from what it kept."""

    def __init__(self, replay: bool, endpoint: str = "tcp://127.0.0.1:*") -> None:
        self.ctx = zmq.Context()
        self.pub, self.endpoint = free_endpoint(self.ctx, zmq.PUB, endpoint)
        self.kept: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replays = 0
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            self.router, self.replay_endpoint = free_endpoint(self.ctx, zmq.ROUTER)
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            ident, _, start = self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.kept):
                if seq >= first:
                    self.router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def payload(
        self, hashes: list[int], parent: int | None, tokens: list[int], ts: float | None = None
    ) -> bytes:
        event = BlockStored(hashes, parent, tokens, BLOCK, None, "GPU", None)
        return msgspec.msgpack.encode(KVEventBatch(time.time() if ts is None else ts, [event], 0))

    def send(self, payload: bytes, *, publish: bool = True) -> None:
        self.kept.append((self.seq, payload))
        if publish:
            self.pub.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def store(self, hashes: list[int], parent: int | None, tokens: list[int], **kw: bool) -> None:
        self.send(self.payload(hashes, parent, tokens), **kw)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.ctx.destroy(linger=0)


class ApplyStandin:
    """The router as the subscribers see it, its ``kv_apply`` replaced (a stand-in,
    not a patch: a compiled Router's methods are fixed)."""

    def __init__(self, router: Any, kv_apply: Callable[..., Any]) -> None:
        self.router = router
        self.kv_apply = kv_apply

    def __getattr__(self, name: str) -> Any:
        return getattr(self.router, name)


def until(check: Callable[[], bool], what: str) -> None:
    """Wait for ``check``: the subscriber runs on the lifecycle thread."""
    deadline = time.monotonic() + 20
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(params=[False, True], ids=["no-replay", "replay"])
def pub(request: pytest.FixtureRequest) -> Iterator[Publisher]:
    p = Publisher(replay=request.param)
    yield p
    p.close()


def mesh_for(pub: Publisher) -> Mesh:
    w = Worker(URL, kv_events=pub.endpoint, kv_replay=pub.replay_endpoint)
    mesh = Mesh(workers=[w], policy="cache_aware", lifecycle={"probe": False})
    mesh.lifecycle.start()
    return mesh


def connected(mesh: Mesh, pub: Publisher) -> None:
    """Publish a root block until the subscriber has it (the slow-joiner wait)."""
    kv = mesh.router.fleet.kv
    deadline = time.monotonic() + 20
    while not kv.blocks_of(URL):
        if time.monotonic() > deadline:
            raise AssertionError("the subscriber never received a batch")
        pub.store([pub.seq + 10_000], None, [0, 0, 0, pub.seq])
        time.sleep(0.05)


def holds(mesh: Mesh, tokens: list[int]) -> int:
    return mesh.router.fleet.kv.match(tokens, [URL])[URL]


def gaps(mesh: Mesh, outcome: str) -> float:
    value = mesh.metrics.registry.get_sample_value(
        "mesh_kv_gaps_total", {"worker": URL, "outcome": outcome}
    )
    return value or 0.0


def test_batches_reach_the_index_and_chain(pub: Publisher) -> None:
    with mesh_for(pub) as mesh:
        connected(mesh, pub)
        pub.store([1, 2], None, [1, 2, 3, 4, 5, 6, 7, 8])
        pub.store([3], 2, [9, 10, 11, 12])
        until(lambda: holds(mesh, list(range(1, 13))) == 12, "the chained blocks")
        row = mesh.router.describe(URL)[0]
        assert row["prefix_match"] == "events" and row["kv_blocks"] >= 3
        assert 0 <= row["kv_heard_s"] < 20  # the last batch, seconds ago
        time.sleep(0.3)
        assert mesh.router.describe(URL)[0]["kv_heard_s"] >= 0.3 > row["kv_heard_s"]
        text = mesh.metrics.render().decode()
        assert f'mesh_worker_prefix_match{{kind="events",worker="{URL}"}} 1.0' in text


def age_buckets(mesh: Mesh) -> dict[str, float]:
    return {
        le: mesh.metrics.registry.get_sample_value(
            "mesh_kv_event_age_seconds_bucket", {"worker": URL, "le": le}
        )
        or 0.0
        for le in ("0.5", "2.0", "5.0", "+Inf")
    }


def test_the_index_age_is_measured_from_the_engines_stamp(pub: Publisher) -> None:
    with mesh_for(pub) as mesh:
        connected(mesh, pub)
        before = age_buckets(mesh)
        assert before["0.5"] == before["+Inf"]  # live batches arrive fresh
        pub.send(pub.payload([7], None, [7, 7, 7, 7], ts=time.time() - 3.0))
        pub.send(pub.payload([8], None, [8, 8, 8, 8], ts=time.time() + 60.0))  # skewed
        until(lambda: holds(mesh, [8, 8, 8, 8]) == 4, "the stamped batches")
        after = age_buckets(mesh)
        # The old batch lies between 2 and 5 s; the one from a clock ahead reads 0.
        assert after["+Inf"] - before["+Inf"] == 2
        assert after["0.5"] - before["0.5"] == 1
        assert after["2.0"] - before["2.0"] == 1
        assert after["5.0"] - before["5.0"] == 2


def test_a_gap_is_replayed_or_forgotten(pub: Publisher) -> None:
    with mesh_for(pub) as mesh:
        connected(mesh, pub)
        pub.store([1], None, [1, 2, 3, 4])
        until(lambda: holds(mesh, [1, 2, 3, 4]) == 4, "the first block")
        pub.store([2], 1, [5, 6, 7, 8], publish=False)  # lost on the way
        pub.store([3], 2, [9, 10, 11, 12])
        if pub.replay_endpoint:
            until(lambda: holds(mesh, list(range(1, 13))) == 12, "the replayed chain")
            assert gaps(mesh, "replayed") == 1 and gaps(mesh, "cleared") == 0
        else:
            # Without replay the worker's entries go: it may have dropped anything.
            until(lambda: gaps(mesh, "cleared") == 1, "the gap")
            assert holds(mesh, [1, 2, 3, 4]) == 0
            assert mesh.router.fleet.kv.unchained >= 1  # block 3's parent is unknown now
            pub.store([4], None, [1, 2, 3, 4])  # the index rebuilds from what follows
            until(lambda: holds(mesh, [1, 2, 3, 4]) == 4, "the rebuilt block")


def test_a_restarted_publisher_clears_the_worker(pub: Publisher) -> None:
    with mesh_for(pub) as mesh:
        connected(mesh, pub)
        pub.store([1], None, [1, 2, 3, 4])
        until(lambda: holds(mesh, [1, 2, 3, 4]) == 4, "the block")
        pub.seq = 0  # the engine came back: its cache is empty, its counter too
        pub.kept.clear()
        pub.store([7], None, [5, 5, 5, 5])
        until(lambda: gaps(mesh, "restart") == 1, "the restart")
        until(lambda: holds(mesh, [5, 5, 5, 5]) == 4, "the new block")
        assert holds(mesh, [1, 2, 3, 4]) == 0


def test_a_restarted_engine_whose_counter_ran_past_ours_is_still_a_restart(
    pub: Publisher,
) -> None:
    """The engine process restarts (its PUB socket goes away and comes back on the
    same port) and has published more batches than meshkit saw before meshkit
    hears the first: by its sequence alone that is a gap, which a replay of the new
    engine's batches would fill, the old engine's blocks kept. The dropped
    connection says restart: the old entries go."""
    with mesh_for(pub) as mesh:
        connected(mesh, pub)
        pub.store([1], None, [1, 2, 3, 4])
        until(lambda: holds(mesh, [1, 2, 3, 4]) == 4, "the block")
        pub.pub.close(linger=0)  # the engine process ends
        pub.pub = pub.ctx.socket(zmq.PUB)
        pub.pub.setsockopt(zmq.LINGER, 0)
        bound = False
        for _ in range(100):  # the port comes free at once, or nearly
            try:
                pub.pub.bind(pub.endpoint)
                bound = True
                break
            except zmq.ZMQError:
                time.sleep(0.05)
        assert bound
        # The new engine counts from 0 and, before meshkit hears it, has published
        # (and kept for replay) past the number meshkit expects next.
        ahead = pub.seq + 20
        pub.seq = 0
        pub.kept.clear()
        while pub.seq < ahead:
            pub.store([pub.seq + 300], None, [6, 6, 6, pub.seq], publish=False)
        deadline = time.monotonic() + 20
        while not holds(mesh, [5, 5, 5, 5]):
            assert time.monotonic() < deadline, "the new engine's blocks never arrived"
            pub.store([pub.seq + 700], None, [5, 5, 5, 5])
            time.sleep(0.1)
        assert holds(mesh, [1, 2, 3, 4]) == 0


def test_a_bad_payload_drops_the_workers_entries(pub: Publisher) -> None:
    with mesh_for(pub) as mesh:
        connected(mesh, pub)
        pub.store([1], None, [1, 2, 3, 4])
        until(lambda: holds(mesh, [1, 2, 3, 4]) == 4, "the block")
        pub.send(b"\xc1 not msgpack")
        errors: Callable[[], float | None] = lambda: mesh.metrics.registry.get_sample_value(  # noqa: E731
            "mesh_kv_errors_total", {"worker": URL}
        )
        until(lambda: errors() == 1, "the error")
        assert holds(mesh, [1, 2, 3, 4]) == 0


def test_first_subscription_replays_what_the_publisher_kept() -> None:
    pub = Publisher(replay=True)
    try:
        # Stored before meshkit subscribed: only a replay can tell it.
        pub.store([1], None, [1, 2, 3, 4], publish=False)
        with mesh_for(pub) as mesh:
            connected(mesh, pub)
            until(lambda: holds(mesh, [1, 2, 3, 4]) == 4, "the block stored before")
            assert pub.replays >= 1
    finally:
        pub.close()


def test_a_removed_worker_is_forgotten(pub: Publisher) -> None:
    with mesh_for(pub) as mesh:
        connected(mesh, pub)
        mesh.remove_worker(URL)
        assert mesh.router.fleet.kv.blocks_of(URL) == 0
        assert not mesh.router.fleet.kv.covers(URL)


def test_a_batch_missed_while_joining_an_idle_publisher_is_replayed() -> None:
    pub = Publisher(replay=True)
    try:
        with mesh_for(pub) as mesh:
            until(lambda: pub.replays >= 1, "the first replay")  # nothing buffered yet
            # Published before the subscription reached the publisher: the SUB misses it.
            pub.store([1], None, [1, 2, 3, 4], publish=False)
            connected(mesh, pub)
            until(lambda: holds(mesh, [1, 2, 3, 4]) == 4, "the missed batch")
            assert gaps(mesh, "replayed") == 1
    finally:
        pub.close()


def test_a_subscribed_idle_worker_is_matched_on_its_events() -> None:
    pub = Publisher(replay=True)
    try:
        with mesh_for(pub) as mesh:
            # Nothing stored yet: the replay answered, so the worker is known to hold
            # nothing (not left to this router's own guesses).
            until(lambda: mesh.router.describe(URL)[0]["prefix_match"] == "events", "events")
            assert mesh.router.describe(URL)[0]["kv_blocks"] == 0
    finally:
        pub.close()


def test_a_subscriber_that_fails_is_started_again(pub: Publisher) -> None:
    with mesh_for(pub) as mesh:
        connected(mesh, pub)
        failed: list[bool] = []
        router = mesh.router

        def fails_once(*args: Any) -> None:
            if not failed:
                failed.append(True)
                raise RuntimeError("a bug in applying")
            router.kv_apply(*args)

        mesh.lifecycle.kv.router = ApplyStandin(router, fails_once)  # type: ignore[assignment]
        pub.store([5], None, [5, 6, 7, 8])
        until(lambda: bool(failed), "the failure")
        # Started again on the next sync: what follows is applied.
        deadline = time.monotonic() + 20
        while not holds(mesh, [9, 9, 9, 9]):
            assert time.monotonic() < deadline, "the subscriber never came back"
            pub.store([pub.seq + 500], None, [9, 9, 9, 9])
            time.sleep(0.1)


def test_kv_max_blocks_bounds_the_index_and_keeps_the_hot_prompt(pub: Publisher) -> None:
    # kv.max_blocks_per_model under what the engine holds: conversations under one
    # hot prompt come and go (the engine drops the older ones), and new prompts
    # arrive. The prompt, stored once, stays matched and its turns keep chaining.
    from meshkit.mock.kv_publisher import BlockRemoved

    def removed(hashes: list[int]) -> None:
        event = BlockRemoved(hashes, "GPU")
        pub.send(msgspec.msgpack.encode(KVEventBatch(time.time(), [event], 0)))

    w = Worker(URL, kv_events=pub.endpoint, kv_replay=pub.replay_endpoint)
    budget = 8
    with Mesh(
        workers=[w],
        policy="cache_aware",
        lifecycle={"probe": False},
        kv={"max_blocks_per_model": budget},
    ) as mesh:
        mesh.lifecycle.start()
        connected(mesh, pub)
        prompt = [1, 2, 3, 4, 5, 6, 7, 8]
        pub.store([1, 2], None, prompt)
        for n in range(12):
            h = 100 + 2 * n
            pub.store([h, h + 1], 2, [n, n, n, n, n, -n, -n, -n])
            pub.store([500 + n], None, [50, n, n, n])  # a new one-block prompt
            if n >= 2:
                removed([h - 4, h - 3, 500 + n - 2])  # the engine drops old ones
        # the newest prompt replaced the last turn's blocks (the newest entries)
        until(lambda: holds(mesh, [50, 11, 11, 11]) == 4, "the last prompt")
        kv = mesh.router.fleet.kv
        assert kv.unchained == 0 and len(kv) <= budget
        assert holds(mesh, prompt) == 8
        sample = mesh.metrics.registry.get_sample_value
        assert (sample("mesh_kv_index_evicted_total") or 0) > 0
        assert (sample("mesh_kv_index_entries", {"model": ""}) or 0) <= budget


def silent_gauge(mesh: Mesh, url: str) -> float | None:
    return mesh.metrics.registry.get_sample_value("mesh_kv_silent", {"worker": url})


def placed_request(mesh: Mesh, content: str = "hi " * 40, model: str = "mock-model") -> None:
    import httpx

    from meshkit import MeshTransport

    with httpx.Client(transport=MeshTransport(mesh), base_url="http://mesh") as client:
        body = {"model": model, "messages": [{"role": "user", "content": content}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize("answers", [False, True], ids=["silent", "answers"])
def test_a_publisher_silent_after_a_request_gives_way_to_the_tree(
    answers: bool, mock_factory: Callable[..., Any]
) -> None:
    """vLLM with a named host in its endpoint connects instead of binding, and its
    replay still answers: the router must not match that worker on an index that
    never fills. Past ``kv.silence_s`` after a request, the tree speaks for it,
    until the publisher is heard again."""
    pub = Publisher(replay=False)
    worker = mock_factory(name="m")  # it serves; the test's publisher speaks for it
    url = worker.url
    w = Worker(url, kv_events=pub.endpoint)
    silence = 0.3
    try:
        with Mesh(
            workers=[w], policy="cache_aware", lifecycle={"probe": False}, kv={"silence_s": silence}
        ) as mesh:
            mesh.lifecycle.start()
            kv = mesh.router.fleet.kv
            deadline = time.monotonic() + 20
            while not kv.blocks_of(url):  # publish until the subscriber has joined
                assert time.monotonic() < deadline, "the subscriber never received a batch"
                pub.store([pub.seq + 10_000], None, [0, 0, 0, pub.seq])
                time.sleep(0.05)
            placed_request(mesh)
            if answers:
                pub.store([1], None, [1, 2, 3, 4])  # the request's blocks
                until(lambda: kv.blocks_of(url) >= 2, "the request's block")
                time.sleep(4 * silence)  # what a silence would take, and more
                row = mesh.router.describe(url)[0]
                assert row["prefix_match"] == "events" and not row["kv_silent"]
                assert not silent_gauge(mesh, url)
                return
            until(lambda: mesh.router.describe(url)[0]["kv_silent"], "the silence")
            row = mesh.router.describe(url)[0]
            assert row["prefix_match"] == "approximate" and row["kv_blocks"] == 0
            assert silent_gauge(mesh, url) == 1
            pub.store([1], None, [1, 2, 3, 4])  # it publishes again
            until(lambda: mesh.router.describe(url)[0]["prefix_match"] == "events", "events")
            assert not mesh.router.describe(url)[0]["kv_silent"]
            until(lambda: silent_gauge(mesh, url) == 0, "the gauge back at 0")
            assert kv.blocks_of(url) == 1
    finally:
        pub.close()


TINY = str(TOKENIZER)


#: the kv.silence_s of the two tests below: well above an event's way back, even on
#: a loaded machine
SILENCE_S = 1.0


@contextmanager
def publishing_worker(mock_factory: Callable[..., Any], name: str) -> Iterator[tuple[Mesh, str]]:
    """A mock worker with 64-token blocks that publishes, a mesh subscribed to it
    (``kv.silence_s`` = :data:`SILENCE_S`), once a long prompt's blocks arrived (so
    the worker's block size is known): (the mesh, the worker's URL)."""
    worker = mock_factory(
        name=name,
        cache_tokens=100_000,
        block_size=64,
        tokenizer=TINY,
        kv_events="tcp://127.0.0.1:0",
    )
    url = worker.url
    w = Worker(url, kv_events=worker.kv_events_endpoint)
    with Mesh(
        workers=[w],
        policy="cache_aware",
        tokenizer=TINY,
        lifecycle={"probe": False},
        kv={"silence_s": SILENCE_S},
    ) as mesh:
        mesh.lifecycle.start()
        kv = mesh.router.fleet.kv
        deadline = time.monotonic() + 20
        sent = 0
        while not kv.blocks_of(url):  # the subscriber may join after the first store
            assert time.monotonic() < deadline, "no block of a long prompt arrived"
            # a new prompt each time: a cached one would store (and publish) nothing
            placed_request(mesh, f"{sent} tell me about the weather in the valley " * 20, "tiny")
            sent += 1
            time.sleep(0.05)
        assert kv.block_sizes.get(url) == 64
        yield mesh, url


def assert_trusted(mesh: Mesh, url: str) -> None:
    row = mesh.router.describe(url)[0]
    assert row["prefix_match"] == "events" and not row["kv_silent"]
    assert not silent_gauge(mesh, url)


def test_short_prompts_alone_do_not_make_a_live_publisher_silent(
    mock_factory: Callable[..., Any],
) -> None:
    """A worker that serves only prompts shorter than one of its blocks stores
    nothing and publishes nothing: that is not a silent publisher. Once its block
    size is known (a long prompt's blocks), such requests do not start the wait."""
    with publishing_worker(mock_factory, "short") as (mesh, url):
        deadline = time.monotonic() + 3 * SILENCE_S
        while time.monotonic() < deadline:  # short prompts, well past kv.silence_s
            placed_request(mesh, "hi", "tiny")
            time.sleep(0.05)
        assert_trusted(mesh, url)


def test_prompts_the_worker_holds_do_not_make_a_live_publisher_silent(
    mock_factory: Callable[..., Any],
) -> None:
    """A prompt the engine holds whole is a prefix hit: it stores (and publishes)
    nothing. A worker that serves one cached prompt over and over (a load test
    cycling a fixed prompt set) is not a silent publisher."""
    with publishing_worker(mock_factory, "held") as (mesh, url):
        kv = mesh.router.fleet.kv
        held = "the one prompt of this load test, about rivers and their banks " * 20
        match = mesh.resolve("POST", "/v1/chat/completions")
        assert match is not None
        body = {"model": "tiny", "messages": [{"role": "user", "content": held}]}
        keys = mesh.prepare(match, json.dumps(body).encode(), []).kv_keys
        assert keys and keys.get(64)
        placed_request(mesh, held, "tiny")
        deadline = time.monotonic() + 20
        # Its blocks are in the index (and, published before them, every earlier one's).
        while kv.match((), [url], keys)[url] < 64 * len(keys[64]):
            assert time.monotonic() < deadline, "the held prompt's blocks did not arrive"
            time.sleep(0.05)
        stored = kv.blocks_of(url)
        deadline = time.monotonic() + 3 * SILENCE_S
        while time.monotonic() < deadline:  # the same prompt, well past kv.silence_s
            placed_request(mesh, held, "tiny")
            time.sleep(0.05)
        assert_trusted(mesh, url)
        assert kv.blocks_of(url) == stored  # nothing new was stored: every one a hit


def test_deeply_nested_msgpack_is_a_bad_payload_not_a_dead_subscriber(pub: Publisher) -> None:
    """~1,000 nested arrays in a kilobyte made the decoder raise RecursionError, which
    killed the subscriber (in a replay reply, again at every restart). It is a bad
    payload: counted, the worker's entries dropped, later batches indexed."""
    with mesh_for(pub) as mesh:
        connected(mesh, pub)
        pub.send(b"\x91" * 5000 + b"\xc0")  # fixarray(1) nested 5000 deep
        errors: Callable[[], float | None] = lambda: mesh.metrics.registry.get_sample_value(  # noqa: E731
            "mesh_kv_errors_total", {"worker": URL}
        )
        until(lambda: errors() == 1, "the error")
        pub.store([7], None, [7, 7, 7, 7])
        until(lambda: holds(mesh, [7, 7, 7, 7]) == 4, "a later batch")


def test_a_worker_given_another_publisher_keeps_nothing_of_the_old_one() -> None:
    """Its entry replaced (a workers file or DNS change names another publisher):
    the old subscriber runs on until the next sync, and what it still applied
    stayed in the index for good. Batches of a publisher the worker no longer
    names are dropped."""
    old, new = Publisher(replay=False), Publisher(replay=False)
    try:
        with mesh_for(old) as mesh:
            connected(mesh, old)
            old.store([1], None, [1, 1, 1, 1])
            until(lambda: holds(mesh, [1, 1, 1, 1]) == 4, "the old publisher's block")
            assert mesh.router.replace(Worker(URL, kv_events=new.endpoint))
            assert holds(mesh, [1, 1, 1, 1]) == 0
            for i in range(10):  # the old subscriber is still connected meanwhile
                old.store([100 + i], None, [2, 2, 2, i])
                time.sleep(0.02)
            connected(mesh, new)  # the new subscriber's batches arrive
            assert all(holds(mesh, [2, 2, 2, i]) == 0 for i in range(10))
            assert holds(mesh, [1, 1, 1, 1]) == 0
    finally:
        old.close()
        new.close()


def republish(pub: Publisher, seqs: range) -> None:
    """Send the kept batches ``seqs`` again, as they were (their live copies)."""
    kept = dict(pub.kept)
    for seq in seqs:
        pub.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), kept[seq]])


def joined_on_a_replay(trail: int) -> tuple[Publisher, Mesh]:
    """A router whose first replay brought batches 0-9 (root blocks 1-10), then
    live batches from 10 on."""
    pub = Publisher(replay=True)
    for i in range(10):
        pub.store([1 + i], None, [1, 1, 1, i], publish=False)
    w = Worker(URL, kv_events=pub.endpoint, kv_replay=pub.replay_endpoint)
    mesh = Mesh(
        workers=[w], policy="cache_aware", lifecycle={"probe": False}, kv={"trail_batches": trail}
    )
    mesh.lifecycle.start()
    until(lambda: holds(mesh, [1, 1, 1, 9]) == 4, "the replayed blocks")
    deadline = time.monotonic() + 20
    while not holds(mesh, [4, 4, 4, 4]):  # live batches from 10 on: the subscription holds
        assert time.monotonic() < deadline, "the subscriber never received a live batch"
        pub.store([50 + pub.seq], None, [4, 4, 4, 4])
        time.sleep(0.05)
    return pub, mesh


def test_live_copies_of_replayed_batches_are_skipped_not_taken_for_a_restart() -> None:
    pub, mesh = joined_on_a_replay(trail=1024)
    try:
        before = mesh.router.fleet.kv.blocks_of(URL)
        republish(pub, range(5, 10))  # a relay that trails, or the replay's live twins
        pub.store([99], None, [3, 3, 3, 3])
        until(lambda: holds(mesh, [3, 3, 3, 3]) == 4, "the batch after the copies")
        assert holds(mesh, [1, 1, 1, 0]) == 4 and gaps(mesh, "restart") == 0
        assert mesh.router.fleet.kv.blocks_of(URL) == before + 1
    finally:
        mesh.close()
        pub.close()


def test_a_copy_older_than_trail_batches_is_taken_for_a_restart() -> None:
    # kv.trail_batches = 4 remembers the last four live batches only
    pub, mesh = joined_on_a_replay(trail=4)
    try:
        republish(pub, range(2, 3))
        until(lambda: gaps(mesh, "restart") == 1, "a restart")
        assert holds(mesh, [1, 1, 1, 0]) == 0
    finally:
        mesh.close()
        pub.close()


def test_a_restart_right_after_the_first_replay_is_seen_as_one() -> None:
    """The first replay brought batches 0-4; before any live batch the engine
    restarts (numbers from 0 again, an empty cache). Its batches 0-4 are not the
    replayed ones (another ts): the worker's entries start afresh, where they were
    skipped as copies and the old blocks stayed matched for good."""
    pub = Publisher(replay=True)
    try:
        for i in range(5):
            pub.store([1 + i], None if i == 0 else i, [1, 1, 1, i], publish=False)
        with mesh_for(pub) as mesh:
            until(lambda: holds(mesh, [1, 1, 1, 0]) == 4, "the replayed blocks")
            pub.kept.clear()  # the restart: numbers from 0, nothing cached
            pub.seq = 0
            deadline = time.monotonic() + 20
            while not holds(mesh, [2, 2, 2, 2]):  # until the SUB hears the new engine
                assert time.monotonic() < deadline, "the restarted publisher was never heard"
                pub.store([900 + pub.seq], None, [2, 2, 2, 2])
                time.sleep(0.05)
            assert holds(mesh, [1, 1, 1, 0]) == 0
            assert gaps(mesh, "restart") == 1
    finally:
        pub.close()


def test_a_long_batch_or_a_replayed_gap_is_applied_in_bounded_pieces(pub: Publisher) -> None:
    """``kv.apply_blocks`` bounds what one hold of the routing lock applies: one
    event of 600 blocks, and (with replay) a gap of 5 batches replayed at once."""
    w = Worker(URL, kv_events=pub.endpoint, kv_replay=pub.replay_endpoint)
    mesh = Mesh(
        workers=[w], policy="cache_aware", lifecycle={"probe": False}, kv={"apply_blocks": 50}
    )
    holds_per_call: list[int] = []
    router = mesh.router

    def counted(worker_id: str, batches: Any, source: str | None = None) -> bool:
        holds_per_call.append(sum(len(e.block_hashes) for b in batches for e in b.events))
        return bool(router.kv_apply(worker_id, batches, source))

    mesh.lifecycle.kv.router = ApplyStandin(router, counted)  # type: ignore[assignment]
    mesh.lifecycle.start()
    with mesh:
        connected(mesh, pub)
        tokens = list(range(1, 600 * BLOCK + 1))
        pub.store(list(range(1, 601)), None, tokens)
        until(lambda: holds(mesh, tokens) == len(tokens), "the long chain")
        head = tokens[-BLOCK:]
        for i in range(5):  # missed by the SUB: a gap of 5 batches of 100 blocks
            more = [t + 1000 * (i + 1) for t in tokens[: 100 * BLOCK]]
            hashes = list(range(1000 * (i + 1), 1000 * (i + 1) + 100))
            pub.store(hashes, 600 if i == 0 else 1000 * i + 99, more, publish=False)
            head += more
        pub.store([9999], 1000 * 5 + 99, [7] * BLOCK)
        if pub.replay_endpoint is not None:
            until(lambda: gaps(mesh, "replayed") == 1, "the replayed gap")
            chained = tokens + head[BLOCK:] + [7] * BLOCK
            until(lambda: holds(mesh, chained) == len(chained), "the replayed chain")
        else:
            until(lambda: gaps(mesh, "cleared") == 1, "the forgotten gap")
        assert max(holds_per_call) <= 50
        assert sum(1 for n in holds_per_call if n == 50) >= 12  # the 600 blocks, cut


def test_a_message_over_the_bound_drops_the_connection_and_the_subscriber_starts_again(
    pub: Publisher,
) -> None:
    """``kv.max_message_bytes``: libzmq drops a connection that sends a bigger
    message and does not connect again; the subscriber starts over (entries
    dropped, replayed or rebuilt) and follows the publisher as before."""
    w = Worker(URL, kv_events=pub.endpoint, kv_replay=pub.replay_endpoint)
    mesh = Mesh(
        workers=[w],
        policy="cache_aware",
        lifecycle={"probe": False},
        kv={"max_message_bytes": 64 * 1024},
    )
    mesh.lifecycle.start()
    with mesh:
        connected(mesh, pub)
        pub.store([1], None, [1, 2, 3, 4])
        until(lambda: holds(mesh, [1, 2, 3, 4]) == 4, "the first block")
        big = list(range(1, 40_001))  # ~100 KB of msgpack, over 64 KiB
        pub.store(list(range(100, 100 + len(big) // BLOCK)), None, big)
        deadline = time.monotonic() + 20
        while not holds(mesh, [9, 9, 9, 9]):
            assert time.monotonic() < deadline, "the subscriber never came back"
            pub.store([pub.seq + 500], None, [9, 9, 9, 9])
            time.sleep(0.1)
        assert holds(mesh, big) == 0  # never applied: it was never received

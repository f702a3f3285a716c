"""Several gateway processes answering as one (``meshkit serve --processes``).

Each "process" here is a real gateway: its own Mesh over the same mock workers, its
public server on TCP and ``peer_app(gateway)`` on its Unix socket in one run dir;
the processes talk over those sockets as the children of ``serve --processes`` do.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import quote

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import wait_until
from lifecycle.conftest import CHAT, FAST, PATH, SLEEPY
from meshkit import Mesh, MeshMiddleware, Worker
from meshkit.core.lifecycle import State
from meshkit.server import ServeApp, build_gateway
from meshkit.server.merged_metrics import merge_metrics
from meshkit.server.merged_workers import merge_rows
from meshkit.server.peer_admin import gate_lifecycle
from meshkit.server.peers import MAX_REPLY_BYTES, Peers, copy_fleet, fleet_spec, peer_app
from meshkit.server.runner import GatewayThread
from meshkit.server.supervisor import RELAY_INDEX

ADMIN = "admin-key-xyz"
AUTH = {"authorization": f"Bearer {ADMIN}"}
SECRET = "sk-worker-secret-42"
#: a stream that outlives any check made while it runs (closed early by the test)
LONG = {"output_tokens": 4000, "per_token_ms": 5}


def unix_listener(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(64)
    return s


@dataclass
class Proc:
    """One gateway process: public (TCP) and private (Unix socket) servers."""

    mesh: Mesh
    peers: Peers
    public: GatewayThread
    private: GatewayThread | None
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.public.url, headers=AUTH, timeout=30)

    def local(self) -> httpx.Client:
        """A client of this process's own socket: what a sibling asks (never fanned out)."""
        transport = httpx.HTTPTransport(uds=self.peers.path(self.peers.index))
        return httpx.Client(transport=transport, base_url="http://p", headers=AUTH, timeout=30)

    def local_rows(self) -> list[dict[str, Any]]:
        with self.local() as c:
            r = c.get("/workers")
        assert r.status_code == 200, r.text
        assert "processes" not in r.json()  # a peer request is answered locally
        rows: list[dict[str, Any]] = r.json()["workers"]
        return rows

    def down(self) -> None:
        """This process stops answering its siblings."""
        if self.private is not None:
            self.private.stop()
            self.private = None

    def close(self) -> None:
        """This process stops (once: a test may stop it before the teardown does)."""
        if self.client.is_closed:
            return
        self.client.close()
        self.down()
        self.public.stop()


@pytest.fixture
def run_dir() -> Iterator[str]:
    # Short on purpose: an AF_UNIX path is at most ~100 bytes (pytest's tmp_path is long).
    d = tempfile.mkdtemp(prefix="mk", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def processes(run_dir: str, mesh_factory: Any) -> Iterator[Callable[..., list[Proc]]]:
    made: list[Proc] = []

    def start(n: int, workers: list[Worker], *, gates: bool = False, **kw: Any) -> list[Proc]:
        """``gates``: idle sleeps and wakes decided across the processes, as ``serve`` does."""
        kw.setdefault("lifecycle", {"probe": False})
        procs = []
        for i in range(n):
            mesh = mesh_factory(workers=list(workers), admin_key=ADMIN, **kw)
            peers = Peers(run_dir, i, n)
            gate = gate_lifecycle(mesh, peers) if gates else None
            gateway = build_gateway(mesh, peers=peers)
            public = GatewayThread(gateway=gateway)
            public.start()
            if gate is not None:
                public.call(
                    cast(Callable[[], None], lambda g=gate: g.bind(asyncio.get_running_loop()))
                )
            private = GatewayThread(gateway=peer_app(gateway), sock=unix_listener(peers.path(i)))
            private.start()
            procs.append(Proc(mesh, peers, public, private))
        made.extend(procs)
        return procs

    yield start
    for p in made:
        p.close()


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    ]


def requests_ok(text: str) -> float:
    return sum(
        v for labels, v in samples(text, "mesh_router_requests_total") if labels["status"] == "200"
    )


def wid(url: str) -> str:
    return quote(Worker(url).id, safe="")


# -- /metrics -------------------------------------------------------------------------


def test_counters_are_summed_over_the_processes(processes: Any, mock_factory: Any) -> None:
    w = mock_factory(name="w")
    p0, p1 = processes(2, [Worker(w.url)])
    for _ in range(3):
        assert p0.client.post(PATH, json=CHAT).status_code == 200
    for _ in range(2):
        assert p1.client.post(PATH, json=CHAT).status_code == 200
    for p in (p0, p1):
        r = p.client.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert requests_ok(r.text) == 5
        counts = samples(r.text, "mesh_router_request_duration_seconds_count")
        assert sum(v for _, v in counts) == 5
        inf = [
            v
            for labels, v in samples(r.text, "mesh_router_request_duration_seconds_bucket")
            if labels["le"] == "+Inf"
        ]
        assert sum(inf) == 5
        assert "_created" not in r.text  # per-process start times: not summable
        assert samples(r.text, "mesh_gateway_processes") == [({}, 2.0)]
        assert samples(r.text, "mesh_gateway_processes_up") == [({}, 2.0)]
    # A sibling's own scrape is its own numbers only.
    with p1.local() as c:
        own = c.get("/metrics").text
    assert requests_ok(own) == 2
    assert "mesh_gateway_processes" not in own


def test_gauges_keep_one_sample_per_process(processes: Any, mock_factory: Any) -> None:
    w = mock_factory(name="w")
    procs = processes(3, [Worker(w.url)])
    text = procs[1].client.get("/metrics").text
    live = samples(text, "mesh_prepare_live_workers")
    assert sorted(labels["process"] for labels, _ in live) == ["0", "1", "2"]
    active = samples(text, "mesh_worker_requests_active")
    assert {labels["process"] for labels, _ in active} == {"0", "1", "2"}
    assert all("worker" in labels for labels, _ in active)
    # A counter carries no process label: it is one series for the gateway.
    assert all("process" not in labels for labels, _ in samples(text, "mesh_router_requests_total"))


def test_a_sibling_that_is_gone_is_left_out_and_the_scrape_still_answers(
    processes: Any, mock_factory: Any
) -> None:
    w = mock_factory(name="w")
    p0, _, p2 = processes(3, [Worker(w.url)])
    assert p2.client.post(PATH, json=CHAT).status_code == 200
    assert p0.client.post(PATH, json=CHAT).status_code == 200
    assert requests_ok(p0.client.get("/metrics").text) == 2
    p2.down()
    r = p0.client.get("/metrics")
    assert r.status_code == 200
    assert samples(r.text, "mesh_gateway_processes") == [({}, 3.0)]
    assert samples(r.text, "mesh_gateway_processes_up") == [({}, 2.0)]
    assert requests_ok(r.text) == 1  # process 2's count is missing until it is back
    health = p0.client.get("/health").json()
    assert (health["processes"], health["processes_up"]) == (3, 2)


def test_health_counts_the_processes_that_answer(processes: Any, mock_factory: Any) -> None:
    w = mock_factory(name="w")
    procs = processes(3, [Worker(w.url)])
    r = procs[0].client.get("/health")
    assert r.status_code == 200
    assert (r.json()["process"], r.json()["processes"], r.json()["processes_up"]) == (0, 3, 3)
    with procs[0].local() as c:
        assert "processes" not in c.get("/health").json()  # a sibling's view is its own


# -- GET /workers ---------------------------------------------------------------------


def test_the_listing_sums_in_flight_requests_and_leases(processes: Any, mock_factory: Any) -> None:
    w = mock_factory(name="w", **LONG)
    p0, p1 = processes(2, [Worker(w.url, api_key=SECRET)])
    body = {**CHAT, "stream": True}
    with (
        p0.client.stream("POST", PATH, json=body) as s0,
        p1.client.stream("POST", PATH, json=body) as s1,
    ):
        # Kept: an iterator dropped would close its response, ending the request.
        chunks = [s0.iter_raw(), s1.iter_raw()]
        for it in chunks:
            next(it)
        assert wait_until(lambda: all(p.mesh.total_load() == 1 for p in (p0, p1)))
        r = p0.client.get("/workers")
        assert r.status_code == 200
        assert SECRET not in r.text
        (row,) = r.json()["workers"]
        assert (row["load"], row["leases"]) == (2, 2)
        assert row["activity"] == {"kind": "active"}
        assert set(row["processes"]) == {"0", "1"}
        assert {k: row["processes"]["1"][k] for k in ("load", "leases", "state")} == {
            "load": 1,
            "leases": 1,
            "state": "ready",
        }
        assert r.json()["processes"] == {"answered": 2, "failed": []}
        (mine,) = p1.local_rows()
        assert (mine["load"], mine["leases"]) == (1, 1)
    assert wait_until(lambda: all(p.mesh.total_load() == 0 for p in (p0, p1)))


def test_the_listing_needs_the_admin_key_before_asking_anyone(
    processes: Any, mock_factory: Any
) -> None:
    w = mock_factory(name="w")
    p0, _ = processes(2, [Worker(w.url)])
    r = httpx.get(p0.public.url + "/workers")
    assert r.status_code == 401
    assert "processes" not in r.json()


# -- admin writes ---------------------------------------------------------------------


def test_a_drain_through_one_process_drains_it_in_every_process(
    processes: Any, mock_factory: Any
) -> None:
    a, b = mock_factory(name="a"), mock_factory(name="b")
    procs = processes(3, [Worker(a.url), Worker(b.url)])
    r = procs[0].client.post("/workers/0/drain", params={"timeout_s": 5})  # by index
    assert r.status_code == 200, r.text
    assert r.json()["drained"] is True
    assert r.json()["processes"] == {"applied": 3, "failed": []}
    assert set(r.json()["worker"]["processes"]) == {"0", "1", "2"}
    for p in procs:
        rows = {row["url"]: row["state"] for row in p.local_rows()}
        assert rows == {Worker(a.url).url: "draining", Worker(b.url).url: "ready"}
    for p in procs:  # no process places on it any more
        assert p.client.post(PATH, json=CHAT).headers["x-mock-worker"] == "b"


def test_an_added_worker_is_added_in_every_process(processes: Any, mock_factory: Any) -> None:
    a, extra = mock_factory(name="a"), mock_factory(name="extra", api_key=SECRET)
    procs = processes(3, [Worker(a.url)])
    r = procs[1].client.post(
        "/workers", json={"url": extra.url, "api_key": SECRET, "labels": {"mesh.model": "mx"}}
    )
    assert r.status_code == 201, r.text
    assert SECRET not in r.text
    assert r.json()["processes"] == {"applied": 3, "failed": []}
    for p in procs:
        added = p.mesh.router.get(Worker(extra.url).id)
        assert added is not None
        assert added.api_key == SECRET
        assert added.labels == {"mesh.model": "mx"}
    # A duplicate is refused here and sent nowhere.
    again = procs[0].client.post("/workers", json={"url": extra.url})
    assert again.status_code == 409
    assert "processes" not in again.json()


def test_an_add_over_the_admin_body_bound_is_refused_and_sent_nowhere(
    processes: Any, mock_factory: Any
) -> None:
    a, extra = mock_factory(name="a"), mock_factory(name="extra")
    procs = processes(2, [Worker(a.url)], bounds={"max_admin_body_bytes": 200})
    big = {"url": extra.url, "labels": {"note": "x" * 200}}
    r = procs[0].client.post("/workers", json=big)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "too_large"
    assert "bounds.max_admin_body_bytes (200 bytes)" in r.json()["error"]["message"]
    # The key is checked first, whatever the body's size.
    r = httpx.post(procs[0].public.url + "/workers", json=big)
    assert r.status_code == 401, r.text
    assert all(p.mesh.router.get(Worker(extra.url).id) is None for p in procs)
    r = procs[0].client.post("/workers", json={"url": extra.url})
    assert r.status_code == 201, r.text
    assert all(p.mesh.router.get(Worker(extra.url).id) is not None for p in procs)


def test_a_removal_reaches_every_process(processes: Any, mock_factory: Any) -> None:
    a, b = mock_factory(name="a"), mock_factory(name="b")
    procs = processes(2, [Worker(a.url), Worker(b.url)])
    r = procs[0].client.delete(f"/workers/{wid(a.url)}", params={"timeout_s": 5})
    assert r.status_code == 200, r.text
    assert r.json()["removed"] is True
    assert r.json()["processes"] == {"applied": 2, "failed": []}
    for p in procs:
        assert [w.url for w in p.mesh.workers] == [Worker(b.url).url]


def test_a_sibling_that_is_down_is_listed_in_failed(processes: Any, mock_factory: Any) -> None:
    a, b, c = mock_factory(name="a"), mock_factory(name="b"), mock_factory(name="c")
    p0, p1, p2 = processes(3, [Worker(a.url), Worker(b.url)])
    p2.down()
    r = p0.client.post(f"/workers/{wid(a.url)}/drain", params={"timeout_s": 5})
    assert r.status_code == 200
    assert r.json()["processes"] == {"applied": 2, "failed": [2]}
    r = p0.client.post("/workers", json={"url": c.url})
    assert r.status_code == 201
    assert r.json()["processes"] == {"applied": 2, "failed": [2]}
    listing = p0.client.get("/workers").json()
    assert listing["processes"] == {"answered": 2, "failed": [2]}
    assert p1.mesh.router.get(Worker(c.url).id) is not None
    assert p2.mesh.router.get(Worker(c.url).id) is None  # it missed it


def test_a_write_the_local_process_refuses_is_sent_nowhere(
    processes: Any, mock_factory: Any
) -> None:
    a = mock_factory(name="a")
    p0, p1 = processes(2, [Worker(a.url)])
    assert p0.client.post("/workers/7/drain").status_code == 404
    assert (
        p0.client.post(f"/workers/{wid(a.url)}/drain", params={"timeout_s": "x"}).status_code == 400
    )
    for verb in ("drain", "sleep", "wake"):  # no admin key: 401, before anything else
        r = httpx.post(p0.public.url + f"/workers/{wid(a.url)}/{verb}")
        assert r.status_code == 401, (verb, r.text)
        assert "processes" not in r.json()
    assert httpx.post(p0.public.url + "/workers/7/sleep").status_code == 401  # not its 404
    assert all(row["state"] == "ready" for p in (p0, p1) for row in p.local_rows())


# -- sleep and wake: one engine call for the whole gateway ---------------------------------


def _sleepy(processes: Any, mock_factory: Any, n: int, **mock_kw: Any) -> tuple[list[Proc], Any]:
    mock = mock_factory(name="sleepy", sleep_mode=True, wake_ms=50, **mock_kw)
    procs = processes(n, [Worker(mock.url, labels=SLEEPY)], lifecycle=FAST)
    for p in procs:
        p.mesh.start_lifecycle()
    wid_ = procs[0].mesh.workers[0].id

    def states() -> list[State]:
        return [p.mesh.router.states.machines[wid_].state for p in procs]

    assert wait_until(lambda: states() == [State.READY] * n)
    return procs, mock


def test_sleep_and_wake_call_the_engine_once_and_every_process_follows(
    processes: Any, mock_factory: Any
) -> None:
    procs, mock = _sleepy(processes, mock_factory, 3)
    ident = wid(mock.url)
    r = procs[0].client.post(f"/workers/{ident}/sleep")
    assert r.status_code == 200, r.text
    assert r.json()["processes"] == {"applied": 3, "failed": []}
    assert mock.worker.stats.sleep_calls == 1
    assert [p.local_rows()[0]["state"] for p in procs] == ["sleeping"] * 3
    r = procs[2].client.post(f"/workers/{ident}/wake")
    assert r.status_code == 200, r.text
    assert r.json()["ready"] is True
    assert r.json()["processes"] == {"applied": 3, "failed": []}
    assert mock.worker.stats.wake_calls == 1
    assert [p.local_rows()[0]["state"] for p in procs] == ["ready"] * 3
    assert mock.worker.stats.sleep_calls == 1


def test_a_lease_in_any_process_vetoes_the_sleep(processes: Any, mock_factory: Any) -> None:
    procs, mock = _sleepy(processes, mock_factory, 3, **LONG)
    ident = wid(mock.url)
    with procs[1].client.stream("POST", PATH, json={**CHAT, "stream": True}) as s:
        chunks = s.iter_raw()  # kept: dropped, it would close the response
        next(chunks)
        r = procs[0].client.post(f"/workers/{ident}/sleep")
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "invalid_state"
        assert r.json()["processes"]["failed"] == [1]
        assert mock.worker.stats.sleep_calls == 0  # the engine was never asked
        # Process 2 had agreed (state only) and was rolled back.
        assert [p.local_rows()[0]["state"] for p in procs] == ["ready"] * 3
    assert wait_until(lambda: procs[1].mesh.total_load() == 0)


# -- the fleet a restarted process copies --------------------------------------------


def test_the_fleet_route_is_only_on_the_private_socket(processes: Any, mock_factory: Any) -> None:
    a = mock_factory(name="a")
    p0, _ = processes(2, [Worker(a.url, api_key=SECRET)])
    r = p0.client.get("/_peer/fleet")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "unknown_endpoint"
    assert SECRET not in r.text
    with p0.local() as c:
        spec = c.get("/_peer/fleet").json()
    assert spec["workers"][0]["api_key"] == SECRET  # siblings need it; nobody else sees it


def test_copy_fleet_makes_a_fresh_process_match_its_siblings(
    processes: Any, mock_factory: Any, mesh_factory: Any, run_dir: str
) -> None:
    a, b, c = mock_factory(name="a"), mock_factory(name="b"), mock_factory(name="c")
    configured = [Worker(a.url), Worker(c.url)]
    p0, p1 = processes(2, configured)
    assert p0.client.post("/workers", json={"url": b.url, "api_key": SECRET}).status_code == 201
    assert p0.client.delete(f"/workers/{wid(c.url)}", params={"timeout_s": 5}).status_code == 200
    assert (
        p0.client.post(f"/workers/{wid(a.url)}/drain", params={"timeout_s": 5}).status_code == 200
    )
    # Process 1 restarts: a new mesh from the configuration, then the copy.
    p1.close()
    fresh = mesh_factory(workers=configured, lifecycle={"probe": False})
    peers = Peers(run_dir, 1, 2)
    assert asyncio.run(_copy(peers, fresh)) is True
    assert sorted(w.url for w in fresh.workers) == sorted([Worker(a.url).url, Worker(b.url).url])
    states = {row["url"]: row["state"] for row in fresh.router.describe()}
    assert states == {Worker(a.url).url: "draining", Worker(b.url).url: "ready"}
    copied = fresh.router.get(Worker(b.url).id)
    assert copied is not None and copied.api_key == SECRET
    # Nobody to copy from: the configured fleet stays.
    p0.down()
    alone = mesh_factory(workers=configured, lifecycle={"probe": False})
    assert asyncio.run(_copy(Peers(run_dir, 1, 2), alone)) is False
    assert [w.url for w in alone.workers] == [w.url for w in configured]


def test_a_fresh_process_with_probes_copies_a_sleeping_worker_as_asleep(
    processes: Any, mock_factory: Any, mesh_factory: Any, run_dir: str
) -> None:
    mock = mock_factory(name="sleepy", sleep_mode=True)
    configured = [Worker(mock.url, labels=SLEEPY)]
    p0, p1 = processes(2, configured)
    assert p0.client.post(f"/workers/{wid(mock.url)}/sleep").status_code == 200
    p1.close()
    # Its probes have not run yet: the worker is not verified, and routable. Left
    # so, requests would go to the sleeping engine until the first probe round.
    fresh = mesh_factory(workers=configured)
    assert [row["state"] for row in fresh.router.describe()] == ["unverified"]
    assert asyncio.run(_copy(Peers(run_dir, 1, 2), fresh)) is True
    assert [row["state"] for row in fresh.router.describe()] == ["sleeping"]


def _resolved(mesh: Mesh, name: str, addresses: list[str]) -> None:
    """``name`` resolves to ``addresses`` in ``mesh``'s discovery, as a lookup would say."""
    discovery = mesh.lifecycle.discovery
    assert discovery is not None

    async def looked_up() -> None:
        discovery.sources.set_addresses(name, addresses)
        discovery.apply()

    mesh.lifecycle.submit(looked_up).result(10)


def _applied(discovery: Any) -> Callable[[], Awaitable[None]]:
    async def apply() -> None:
        discovery.apply()

    return apply


def test_a_copied_worker_that_dns_found_is_removed_when_dns_drops_it(
    processes: Any, mesh_factory: Any, run_dir: str
) -> None:
    configured = ["dns://svc:80"]
    one, two = "http://10.0.0.1:80", "http://10.0.0.2:80"
    p0, p1 = processes(2, configured)
    _resolved(p0.mesh, "svc", ["10.0.0.1", "10.0.0.2"])
    assert sorted(w.url for w in p0.mesh.workers) == [one, two]
    spec = fleet_spec(p0.mesh)
    assert [w["discovered"] for w in spec["workers"]] == [True, True]
    # Process 1 restarts and copies them before its own lookup has answered.
    p1.close()
    fresh = mesh_factory(workers=configured, lifecycle={"probe": False})
    assert fresh.workers == ()
    assert asyncio.run(_copy(Peers(run_dir, 1, 2), fresh)) is True
    assert sorted(w.url for w in fresh.workers) == [one, two]
    # Its own lookups fail ("svc" is no real name): it keeps the sibling's answer,
    # as a process keeps its last answer when a lookup fails.
    failures = fresh.metrics.discovery_failures.labels("dns")
    assert wait_until(lambda: failures._value.get() >= 1)
    discovery = fresh.lifecycle.discovery
    assert discovery is not None
    fresh.lifecycle.submit(_applied(discovery)).result(10)
    assert sorted(w.url for w in fresh.workers) == [one, two]
    # The name now has one address: the copy goes as its siblings' do (it is
    # discovery's, not an admin's worker that discovery must leave alone).
    _resolved(fresh, "svc", ["10.0.0.1"])
    assert wait_until(lambda: [w.url for w in fresh.workers] == [one])
    # One an admin added is never discovery's, copied or not.
    assert p0.client.post("/workers", json={"url": "http://10.0.0.9:80"}).status_code == 201
    spec = fleet_spec(p0.mesh)
    assert {w["url"]: w["discovered"] for w in spec["workers"]}["http://10.0.0.9:80"] is False


async def _copy(peers: Peers, mesh: Mesh) -> bool:
    try:
        return await copy_fleet(peers, mesh)
    finally:
        await peers.aclose()


# -- the transport ----------------------------------------------------------------------


async def _big_app(scope: Any, receive: Any, send: Any) -> None:
    size = MAX_REPLY_BYTES + 1 if scope["path"] == "/big" else MAX_REPLY_BYTES
    body = b"x" * size
    headers = [(b"content-length", str(size).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def test_replies_are_bounded_and_a_missing_sibling_is_an_answer(
    mesh_factory: Any, run_dir: str
) -> None:
    mesh = mesh_factory(workers=["http://127.0.0.1:9"])
    peers = Peers(run_dir, 0, 3)  # 1 serves, 2 has no socket at all
    server = GatewayThread(
        gateway=MeshMiddleware(_big_app, mesh=mesh), sock=unix_listener(peers.path(1))
    )
    server.start()
    try:

        async def ask() -> tuple[list[Any], list[Any]]:
            try:
                return await peers.ask("GET", "/big"), await peers.ask("GET", "/fits")
            finally:
                await peers.aclose()

        big, fits = asyncio.run(ask())
    finally:
        server.stop()
    assert [r.index for r in big] == [1, 2]
    assert (big[0].status, big[0].body) == (None, b"")
    assert "MAX_REPLY_BYTES" in (big[0].error or "")
    assert fits[0].status == 200 and len(fits[0].body) == MAX_REPLY_BYTES
    assert fits[1].status is None and (fits[1].error or "").startswith("unreachable")


def test_peer_app_marks_a_copy_of_the_scope() -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)

    scope = {"type": "http", "path": "/x"}
    asyncio.run(peer_app(app)(scope, None, None))
    assert seen[0]["meshkit.peer"] is True
    assert "meshkit.peer" not in scope


def test_peers_knows_where_its_siblings_listen(run_dir: str) -> None:
    peers = Peers(run_dir, 1, 3)
    assert peers.others() == [0, 2]
    assert peers.path(2) == f"{run_dir}/p2.sock"
    with pytest.raises(ValueError, match="index"):
        Peers(run_dir, 3, 3)
    with pytest.raises(ValueError, match="too long"):
        Peers("/tmp/" + "d" * 120, 0, 2)


def test_without_peers_nothing_changes(mesh_factory: Any) -> None:
    gateway = build_gateway(mesh_factory(workers=["http://127.0.0.1:9"]))
    assert cast(ServeApp, gateway.app).peers is None  # (build_gateway: gateway.app is one)
    with GatewayThread(gateway=gateway) as url:
        assert "mesh_gateway_processes" not in httpx.get(url + "/metrics").text
        assert "processes" not in httpx.get(url + "/health").json()
        assert (
            json.loads(httpx.get(url + "/_peer/fleet").text)["error"]["code"] == "unknown_endpoint"
        )


def test_a_text_that_does_not_parse_is_left_out(mesh_factory: Any) -> None:
    mesh = mesh_factory(workers=["http://127.0.0.1:9"])
    mesh.metrics.retries.labels("failover").inc()
    own = mesh.metrics.render()
    text = merge_metrics([(1, b'mesh_x{a="1" 2\n'), (0, own), (2, own)], 3).decode()
    assert samples(text, "mesh_gateway_processes_up") == [({}, 2.0)]
    assert samples(text, "mesh_router_retries_total") == [({"reason": "failover"}, 2.0)]


def test_the_relay_childs_text_is_merged_apart_from_the_routers(mesh_factory: Any) -> None:
    own = mesh_factory(workers=["http://127.0.0.1:9"]).metrics.render()
    relay = (
        b"# TYPE mesh_kv_relay_connected gauge\n"
        b'mesh_kv_relay_connected{publisher="tcp://e:1"} 1.0\n'
        b"# TYPE mesh_kv_relay_replays_total counter\n"
        b"mesh_kv_relay_replays_total 3.0\n"
    )
    text = merge_metrics([(0, own), (RELAY_INDEX, relay), (1, own)], 2, relay=True).decode()
    assert samples(text, "mesh_gateway_processes_up") == [({}, 2.0)]
    assert samples(text, "mesh_gateway_kv_relay_up") == [({}, 1.0)]
    assert samples(text, "mesh_kv_relay_connected") == [
        ({"publisher": "tcp://e:1", "process": "kv-relay"}, 1.0)
    ]
    assert samples(text, "mesh_kv_relay_replays_total") == [({}, 3.0)]
    # the relay did not answer: said so, and the routers' text is whole
    down = merge_metrics([(0, own), (1, own)], 2, relay=True).decode()
    assert samples(down, "mesh_gateway_kv_relay_up") == [({}, 0.0)]
    assert samples(down, "mesh_gateway_processes_up") == [({}, 2.0)]


def test_a_worker_only_a_sibling_lists_is_listed_without_an_index() -> None:
    mine = [{"id": "a", "index": 0, "load": 1, "leases": 1, "breaker_trips": 0, "state": "ready"}]
    theirs = [
        {"id": "a", "index": 1, "load": 2, "leases": 2, "breaker_trips": 1, "state": "draining"},
        {"id": "b", "index": 0, "load": 3, "leases": 3, "breaker_trips": 0, "state": "ready"},
    ]
    rows = merge_rows(mine, 0, [(2, theirs)])
    assert [(r["id"], r["index"], r["load"], r["breaker_trips"]) for r in rows] == [
        ("a", 0, 3, 1),
        ("b", None, 3, 0),
    ]
    assert rows[0]["state"] == "ready"  # this process's
    assert rows[0]["processes"]["2"]["state"] == "draining"


def test_the_wake_gate_falls_back_to_a_local_wake_when_process_0_is_gone() -> None:
    from meshkit.server.peer_admin import PeerSleepGate

    run_dir = tempfile.mkdtemp(prefix="mk-")
    try:
        gate = PeerSleepGate(Peers(run_dir, 1, 2), wake_timeout_s=1.0)
        worker = Worker("http://127.0.0.1:9")

        async def unbound() -> bool | None:
            return await gate.wake(worker)

        assert asyncio.run(unbound()) is None  # not bound to a server loop yet

        async def bound() -> bool | None:
            gate.bind(asyncio.get_running_loop())
            # The lifecycle asks from its own thread and loop.
            return await asyncio.to_thread(asyncio.run, gate.wake(worker))

        assert asyncio.run(bound()) is None  # no socket for process 0: wake here
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

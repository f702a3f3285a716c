"""The pure half of discovery: dns:// entries, the sources, the plan."""

from __future__ import annotations

import pytest

from meshkit.core.discovery import DnsWorkers, FleetSources, plan, same_worker
from meshkit.core.workers import Candidate, Fleet, Worker
from meshkit.errors import ConfigError


def test_a_dns_entry_names_host_port_and_path() -> None:
    e = DnsWorkers.parse("dns://svc.ns.svc.cluster.local:8000/v1x/", labels={"zone": "a"})
    assert (e.name, e.port, e.base_path) == ("svc.ns.svc.cluster.local", 8000, "/v1x")
    assert e.source == "dns://svc.ns.svc.cluster.local:8000"
    (w,) = e.workers(["10.0.0.7"], limit=10)
    assert w.url == "http://10.0.0.7:8000/v1x" and w.labels == {"zone": "a"}


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("dns://svc", "needs the workers' port"),
        ("dns://svc:99999", "bad port"),
        ("dns://svc:80?x=1", "no query"),
        ("dns://user:pw@svc:80", "no query, fragment or user info"),
        ("http://svc:80", "not a dns://name:port entry"),
    ],
)
def test_a_bad_dns_entry_is_a_config_error(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"workers\.url") as info:
        DnsWorkers.parse(url)
    assert says in str(info.value)
    assert "pw" not in str(info.value)


def test_a_dns_entry_checks_its_labels_at_once() -> None:
    with pytest.raises(ConfigError, match=r"mesh\.role"):
        DnsWorkers.parse("dns://svc:80", labels={"mesh.role": "chef"})


def test_addresses_become_workers_in_one_order_each_once_bounded() -> None:
    e = DnsWorkers.parse("dns://svc:80", api_key="k")
    answer = ["10.0.0.10", "fe80::1%eth0", "10.0.0.9", "not-an-ip", "10.0.0.10", "::1"]
    ws = e.workers(answer, limit=10)
    assert [w.url for w in ws] == [
        "http://10.0.0.9:80",
        "http://10.0.0.10:80",
        "http://[::1]:80",
        "http://[fe80::1]:80",
    ]
    assert all(w.api_key == "k" for w in ws)
    # Every router that gets the same answer in another order builds the same list.
    assert [w.url for w in e.workers(list(reversed(answer)), limit=10)] == [w.url for w in ws]
    assert [w.url for w in e.workers(answer, limit=2)] == [w.url for w in ws[:2]]


def test_same_worker_compares_labels_key_and_tls() -> None:
    a = Worker("http://h:1", labels={"x": "1"})
    assert same_worker(a, Worker("http://h:1", labels={"x": "1"}))
    assert not same_worker(a, Worker("http://h:1", labels={"x": "2"}))
    assert not same_worker(a, Worker("http://h:1", api_key="k", labels={"x": "1"}))
    assert not same_worker(Worker("https://h:1"), Worker("https://h:1", tls_ca_file="/etc/ca.pem"))


def test_plan_adds_updates_and_removes_only_what_the_sources_own() -> None:
    keep, change, gone, admin = (
        Worker("http://k:1"),
        Worker("http://c:1"),
        Worker("http://g:1"),
        Worker("http://a:1"),
    )
    fleet = {w.id: w for w in (keep, change, gone, admin)}
    managed = {keep.id, change.id, gone.id}
    new = Worker("http://n:1")
    changed = Worker("http://c:1", labels={"zone": "b"})
    p = plan(fleet, managed, [keep, changed, new])
    assert p.add == (new,)
    assert [w.labels for w in p.update] == [{"zone": "b"}]
    assert p.remove == (gone.id,)  # the admin-added worker stays
    assert p.summary() == "1 added, 1 updated, 1 removed"
    assert not plan(fleet, managed, [keep, change, gone])


def test_plan_leaves_draining_workers_alone_until_they_are_gone() -> None:
    w = Worker("http://w:1")
    # Draining out and back in the sources: not re-added, updated or removed again.
    assert not plan({w.id: w}, {w.id}, [Worker("http://w:1", labels={"a": "b"})], leaving={w.id})
    assert not plan({w.id: w}, {w.id}, [], leaving={w.id})


def test_sources_add_up_static_first_then_the_file_then_names() -> None:
    s = FleetSources(max_addresses=8)
    static = Worker("http://10.0.0.1:80", labels={"from": "static"})
    e = DnsWorkers.parse("dns://svc:80", labels={"from": "dns"})
    s.configure([static], [e])
    assert s.unresolved() == ("svc",)
    assert s.desired() == (static,)  # nothing looked up yet: no dns workers
    s.set_addresses("svc", ["10.0.0.2", "10.0.0.1"])
    s.set_file([Worker("http://10.0.0.3:80")], [DnsWorkers.parse("dns://svc:80")])
    got = {w.url: w.labels for w in s.desired()}
    assert got == {
        "http://10.0.0.1:80": {"from": "static"},  # named twice: the static entry's
        "http://10.0.0.3:80": {},
        "http://10.0.0.2:80": {"from": "dns"},
    }
    assert s.names() == ("svc",) and not s.unresolved()
    # A name no entry uses any more is forgotten (bounded by the entries).
    s.configure([static], [])
    s.set_file([], [])
    assert s.resolved == {} and s.desired() == (static,)


def test_a_worker_swapped_in_place_keeps_its_load() -> None:
    old = Worker("http://h:1", labels={"mesh.dp_size": "2"})
    fleet = Fleet([old])
    c0, c1 = fleet.candidates_of(old)
    fleet.acquire(c0)
    fleet.acquire(c1)
    fleet.learn(old.id, frozenset({"m"}))
    new = Worker("http://h:1", labels={"mesh.model": "n"})  # one rank, labelled
    assert fleet.replace(new)
    assert fleet.get(old.id) is new
    assert fleet.candidates_of(new) == (Candidate(new),)
    assert fleet.models_of(new) == frozenset({"n"}) and old.id not in fleet.learned
    assert fleet.worker_load[old.id] == 2
    fleet.release(c0)
    fleet.release(c1)  # the rank that went away releases into its own count
    assert fleet.worker_load[old.id] == 0 and fleet.in_flight == 0
    assert not fleet.replace(Worker("http://other:1"))

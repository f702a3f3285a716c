"""Table tests for :mod:`meshkit.core.workers`: labels, URLs, secrecy, the fleet, load."""

from __future__ import annotations

from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.core.endpoints import Api
from meshkit.core.workers import Candidate, Fleet, Worker
from meshkit.errors import ConfigError

P = pytest.param
KEY = "sk-worker-SECRET-123"

# --------------------------------------------------------------------------------------
# labels
# --------------------------------------------------------------------------------------

APIS = [
    P(None, None, id="absent-is-all"),
    P("", None, id="empty-is-all"),
    P("*", None, id="star-is-all"),
    P("chat", {Api.CHAT}, id="one"),
    P("chat,completions", {Api.CHAT, Api.COMPLETIONS}, id="two"),
    P(" Chat , RESPONSES ,", {Api.CHAT, Api.RESPONSES}, id="spaces-case-trailing-comma"),
    P("chat_completions", {Api.CHAT}, id="alias-chat_completions"),
    P("completion", {Api.COMPLETIONS}, id="alias-completion"),
    P("message", {Api.MESSAGES}, id="alias-message"),
    P(
        "chat,completions,messages,responses,generate,tokenize,models,"
        "embeddings,rerank,score,pooling,classify",
        set(Api),
        id="every-api",
    ),
]


@pytest.mark.parametrize(("raw", "apis"), APIS)
def test_mesh_apis(raw: str | None, apis: set[Api] | None) -> None:
    labels = {} if raw is None else {"mesh.apis": raw}
    w = Worker("http://h:1", labels=labels)
    if apis is None:
        assert w.apis is None
        assert all(w.serves(a) for a in Api)
        assert not any(w.declares(a) for a in Api)
    else:
        assert w.apis == frozenset(apis)
        for a in Api:
            # every worker lists its models, whatever mesh.apis declares
            assert w.serves(a) is (a in apis or a is Api.MODELS)
            assert w.declares(a) is (a in apis)


@pytest.mark.parametrize(
    "raw",
    [P("chat,embedding", id="embedding"), P("chatt", id="typo"), P("all", id="all-word")],
)
def test_unknown_api_is_config_error(raw: str) -> None:
    with pytest.raises(ConfigError) as ei:
        Worker("http://h:1", labels={"mesh.apis": raw})
    assert ei.value.key == "workers.labels.mesh.apis"


@pytest.mark.parametrize(
    ("raw", "role"),
    [
        P(None, "regular", id="default"),
        P("", "regular", id="empty"),
        P("regular", "regular", id="regular"),
        P("prefill", "prefill", id="prefill"),
        P("decode", "decode", id="decode"),
        P(" decode ", "decode", id="spaces"),
    ],
)
def test_role(raw: str | None, role: str) -> None:
    labels = {} if raw is None else {"mesh.role": raw}
    assert Worker("http://h:1", labels=labels).role == role


@pytest.mark.parametrize("raw", ["leader", "Prefill", "worker"])
def test_unknown_role_is_config_error(raw: str) -> None:
    with pytest.raises(ConfigError) as ei:
        Worker("http://h:1", labels={"mesh.role": raw})
    assert ei.value.key == "workers.labels.mesh.role"


@pytest.mark.parametrize(
    ("raw", "model"), [P(None, None, id="absent"), P("", None, id="empty"), P("qwen", "qwen")]
)
def test_model_label(raw: str | None, model: str | None) -> None:
    labels = {} if raw is None else {"mesh.model": raw}
    assert Worker("http://h:1", labels=labels).model == model


@pytest.mark.parametrize(
    ("raw", "size"),
    [P(None, 1, id="default"), P("", 1, id="empty"), P("1", 1), P("8", 8), P("1024", 1024)],
)
def test_dp_size(raw: str | None, size: int) -> None:
    labels = {} if raw is None else {"mesh.dp_size": raw}
    assert Worker("http://h:1", labels=labels).dp_size == size


@pytest.mark.parametrize("raw", ["0", "-1", "1025", "two", "1.5", "8x"])
def test_dp_size_out_of_bounds_is_config_error(raw: str) -> None:
    with pytest.raises(ConfigError) as ei:
        Worker("http://h:1", api_key=KEY, labels={"mesh.dp_size": raw})
    assert ei.value.key == "workers.labels.mesh.dp_size"
    assert KEY not in str(ei.value)


@pytest.mark.parametrize(
    ("raw", "shared"),
    [P(None, False, id="absent"), P("shared", True), P("local", False), P("Shared", False)],
)
def test_responses_state(raw: str | None, shared: bool) -> None:
    labels = {} if raw is None else {"mesh.responses_state": raw}
    assert Worker("http://h:1", labels=labels).responses_state_shared is shared


@pytest.mark.parametrize("raw", ["0", "65536", "x"])
def test_bootstrap_port_bounds(raw: str) -> None:
    with pytest.raises(ConfigError):
        Worker("http://h:1", labels={"mesh.bootstrap_port": raw})


# --------------------------------------------------------------------------------------
# URLs
# --------------------------------------------------------------------------------------

URLS = [
    # url, origin, url (normalised)
    P("http://10.0.0.5:8000", "http://10.0.0.5:8000", "http://10.0.0.5:8000", id="ip-port"),
    P("http://host", "http://host:80", "http://host:80", id="default-http-port"),
    P("https://host", "https://host:443", "https://host:443", id="default-https-port"),
    P("http://HOST:1/", "http://host:1", "http://host:1", id="lowercase-trailing-slash"),
    P("http://h:1/base/", "http://h:1", "http://h:1/base", id="path-prefix"),
    P("  http://h:1  ", "http://h:1", "http://h:1", id="spaces"),
    P("http://[::1]:8000", "http://[::1]:8000", "http://[::1]:8000", id="ipv6"),
    P("http://[fe80::1]", "http://[fe80::1]:80", "http://[fe80::1]:80", id="ipv6-default-port"),
]


@pytest.mark.parametrize(("url", "origin", "norm"), URLS)
def test_urls(url: str, origin: str, norm: str) -> None:
    w = Worker(url)
    assert w.origin == origin
    assert w.url == norm
    assert w.id == norm


@pytest.mark.parametrize(
    "url",
    [
        P("", id="empty"),
        P("h:8000", id="no-scheme"),
        P("localhost:8000", id="host-port-only"),
        P("ftp://h:21", id="ftp"),
        P("http://", id="no-host"),
        P("http://h:99999", id="port-too-big"),
        P("http://h:port", id="port-not-int"),
        P("http://h:1?x=1", id="query"),
        P("http://h:1#frag", id="fragment"),
        P("http://user:pw@h:1", id="userinfo"),
        P("unix:///tmp/sock", id="unix"),
    ],
)
def test_bad_url_is_config_error(url: str) -> None:
    with pytest.raises(ConfigError) as ei:
        Worker(url, api_key=KEY)
    assert ei.value.key == "workers.url"
    assert KEY not in str(ei.value)


def test_userinfo_password_is_not_echoed() -> None:
    with pytest.raises(ConfigError) as ei:
        Worker("http://user:hunter2@h:1")
    assert "hunter2" not in str(ei.value)


# --------------------------------------------------------------------------------------
# secrecy
# --------------------------------------------------------------------------------------


def test_repr_never_shows_the_key() -> None:
    w = Worker("http://h:1", api_key=KEY, labels={"mesh.apis": "chat"})
    assert KEY not in repr(w)
    assert KEY not in str(w)
    assert "api_key=<set>" in repr(w)
    assert w.api_key == KEY
    assert KEY not in repr(Candidate(w))
    assert KEY not in repr(Candidate(w, 1))
    assert KEY not in repr(Fleet([w]).candidates)


def test_repr_without_key() -> None:
    w = Worker("http://h:1")
    assert "api_key" not in repr(w)
    assert w.api_key is None
    assert Worker("http://h:1", api_key="").api_key is None


@pytest.mark.parametrize(
    "labels",
    [
        P({"mesh.apis": "bogus"}, id="apis"),
        P({"mesh.role": "bogus"}, id="role"),
        P({"mesh.dp_size": "0"}, id="dp"),
        P({"mesh.bootstrap_port": "x"}, id="bootstrap"),
    ],
)
def test_config_error_for_bad_worker_never_contains_key(labels: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as ei:
        Worker("http://h:1", api_key=KEY, labels=labels)
    assert KEY not in str(ei.value)
    assert KEY not in repr(ei.value)
    assert all(KEY not in str(a) for a in ei.value.args)


# --------------------------------------------------------------------------------------
# the fleet
# --------------------------------------------------------------------------------------


def test_worker_equality_by_id() -> None:
    assert Worker("http://h:1/") == Worker("http://H:1")
    assert hash(Worker("http://h:1/")) == hash(Worker("http://H:1"))
    assert Worker("http://h:1") != Worker("http://h:2")


def test_fleet_add_remove_duplicate() -> None:
    a, b = Worker("http://a:1"), Worker("http://b:1")
    fleet = Fleet([a])
    v0 = fleet.version
    fleet.add(b)
    assert fleet.workers == (a, b)
    assert fleet.version > v0
    with pytest.raises(ConfigError) as ei:
        fleet.add(Worker("http://A:1/"))
    assert ei.value.key == "workers.url"
    assert fleet.workers == (a, b)
    assert fleet.get(a.id) is a
    v1 = fleet.version
    assert fleet.remove(a.id) is a
    assert fleet.version > v1
    # (the cast drops what mypy keeps from the assert above: remove changed them)
    assert cast(tuple[Worker, ...], fleet.workers) == (b,)
    assert fleet.get(a.id) is None
    assert fleet.remove(a.id) is None
    assert [c.worker for c in fleet.candidates] == [b]
    assert fleet.candidates_of(a) == ()


def test_remove_clears_unhealthy_mark() -> None:
    a = Worker("http://a:1")
    fleet = Fleet([a])
    fleet.unhealthy.add(a.id)
    assert not fleet.healthy(a)
    fleet.remove(a.id)
    assert a.id not in fleet.unhealthy


def test_dp_ranks_are_candidates_sharing_an_origin() -> None:
    w = Worker("http://h:8000", labels={"mesh.dp_size": "4"})
    plain = Worker("http://p:8000")
    fleet = Fleet([w, plain])
    cands = fleet.candidates_of(w)
    assert [c.rank for c in cands] == [0, 1, 2, 3]
    assert {c.origin for c in cands} == {"http://h:8000"}
    assert len({c.key for c in cands}) == 4
    assert all(c.worker is w for c in cands)
    assert fleet.candidates_of(plain) == (Candidate(plain),)
    assert fleet.candidates_of(plain)[0].rank is None
    assert fleet.candidates == (*cands, Candidate(plain))
    assert set(fleet.load) == {c.key for c in fleet.candidates}


def test_candidate_keys() -> None:
    w = Worker("http://h:1")
    assert Candidate(w).key == w.id
    assert Candidate(w, 3).key == w.id + "#dp3"
    assert Candidate(w, 3) == Candidate(w, 3)
    assert Candidate(w, 3) != Candidate(w, 2)


def test_acquire_release_weights() -> None:
    w = Worker("http://h:1")
    fleet = Fleet([w])
    c = fleet.candidates[0]
    fleet.acquire(c, 100)
    fleet.acquire(c, 50)
    assert (fleet.load[c.key], fleet.weight[c.key]) == (2, 150)
    fleet.release(c, 100)
    assert (fleet.load[c.key], fleet.weight[c.key]) == (1, 50)
    fleet.release(c, 50)
    assert (fleet.load[c.key], fleet.weight[c.key]) == (0, 0)


def test_double_release_never_goes_negative() -> None:
    w = Worker("http://h:1")
    fleet = Fleet([w])
    c = fleet.candidates[0]
    fleet.acquire(c, 10)
    fleet.release(c, 10)
    fleet.release(c, 10)
    fleet.release(c, 10)
    assert fleet.load[c.key] == 0
    assert fleet.weight[c.key] == 0
    fleet.acquire(c, 5)
    assert fleet.load[c.key] == 1  # a double release did not credit a free slot


def test_removed_worker_counts_drop_at_zero() -> None:
    w = Worker("http://h:1", labels={"mesh.dp_size": "2"})
    other = Worker("http://o:1")
    fleet = Fleet([w, other])
    c0, c1 = fleet.candidates_of(w)
    fleet.acquire(c0, 7)
    fleet.acquire(c0, 7)
    fleet.remove(w.id)
    # idle rank: dropped at once; busy rank: kept while responses are in flight
    assert c1.key not in fleet.load
    assert c1.key not in fleet.weight
    assert fleet.load[c0.key] == 2
    fleet.release(c0, 7)
    assert fleet.load[c0.key] == 1
    fleet.release(c0, 7)
    assert c0.key not in fleet.load
    assert c0.key not in fleet.weight
    fleet.release(c0, 7)  # a late double release does not resurrect the key
    assert c0.key not in fleet.load
    assert set(fleet.load) == {Candidate(other).key}


def test_re_added_worker_keeps_in_flight_count() -> None:
    w = Worker("http://h:1")
    fleet = Fleet([w])
    c = fleet.candidates[0]
    fleet.acquire(c)
    fleet.remove(w.id)
    fleet.add(Worker("http://h:1"))
    assert fleet.load[c.key] == 1
    fleet.release(c)
    assert fleet.load[c.key] == 0  # live again: kept at zero, not dropped


_OPS = st.lists(
    st.tuples(st.sampled_from(["acq", "rel", "remove", "add"]), st.integers(0, 2)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=_OPS)
def test_load_never_negative_and_bounded(ops: list[tuple[str, int]]) -> None:
    workers = [Worker(f"http://w{i}:1", labels={"mesh.dp_size": "2"}) for i in range(3)]
    fleet = Fleet(workers)
    every = [c for w in workers for c in fleet.candidates_of(w)]
    for op, i in ops:
        w = workers[i]
        if op == "acq" and fleet.get(w.id):
            fleet.acquire(fleet.candidates_of(w)[0], 3)
        elif op == "rel":
            fleet.release(Candidate(w, 0), 3)
        elif op == "remove":
            fleet.remove(w.id)
        elif op == "add" and fleet.get(w.id) is None:
            fleet.add(w)
        assert all(n >= 0 for n in fleet.load.values())
        assert all(n >= 0 for n in fleet.weight.values())
        live = {c.key for c in fleet.candidates}
        # keys of removed workers only while they still have requests in flight
        for key, n in fleet.load.items():
            assert key in live or n > 0
        assert set(fleet.load) <= {c.key for c in every}


@pytest.mark.parametrize(
    "url", [P("ftp://user:hunter2@h:1", id="bad-scheme"), P("http://user:hunter2@:1", id="no-host")]
)
def test_userinfo_password_is_not_echoed_with_other_errors(url: str) -> None:
    with pytest.raises(ConfigError) as ei:
        Worker(url)
    assert "hunter2" not in str(ei.value)


def test_port_zero_is_config_error() -> None:
    with pytest.raises(ConfigError):
        Worker("http://h:0")


# --------------------------------------------------------------------------------------
# in-flight counters and admission limits (upstream.max_in_flight*)
# --------------------------------------------------------------------------------------


def test_worker_and_fleet_in_flight_follow_the_ranks() -> None:
    w = Worker("http://h:1", labels={"mesh.dp_size": "2"})
    other = Worker("http://o:1")
    fleet = Fleet([w, other], max_in_flight=10, max_in_flight_per_worker=3)
    c0, c1 = fleet.candidates_of(w)
    fleet.acquire(c0)
    fleet.acquire(c1)
    fleet.acquire(fleet.candidates_of(other)[0])
    assert (fleet.worker_load[w.id], fleet.worker_load[other.id], fleet.in_flight) == (2, 1, 3)
    fleet.release(c0)
    fleet.release(c0)  # a double release changes nothing
    assert (fleet.worker_load[w.id], fleet.in_flight) == (1, 2)


def test_admits_at_the_bounds() -> None:
    a, b = Worker("http://a:1"), Worker("http://b:1")
    fleet = Fleet([a, b], max_in_flight=3, max_in_flight_per_worker=2)
    ca, cb = fleet.candidates
    fleet.acquire(ca)  # a: cap - 1
    assert fleet.admits(a)
    fleet.acquire(ca)  # a: at its cap
    assert not fleet.admits(a) and fleet.admits(b)
    fleet.acquire(cb)  # fleet: at its cap
    assert not fleet.admits(b)
    fleet.release(ca)
    assert fleet.admits(a) and fleet.admits(b)


def test_zero_limits_mean_none() -> None:
    w = Worker("http://h:1")
    fleet = Fleet([w])
    for _ in range(10_000):
        fleet.acquire(fleet.candidates[0])
    assert fleet.admits(w)


def test_removed_worker_in_flight_drops_at_zero() -> None:
    w = Worker("http://h:1")
    fleet = Fleet([w])
    c = fleet.candidates[0]
    fleet.acquire(c)
    fleet.remove(w.id)
    assert fleet.worker_load[w.id] == 1
    fleet.release(c)
    assert w.id not in fleet.worker_load
    assert fleet.in_flight == 0


def test_hold_time_is_a_moving_average() -> None:
    fleet = Fleet([Worker("http://h:1")])
    c = fleet.candidates[0]
    assert fleet.hold_s == 0.0
    fleet.acquire(c)
    fleet.release(c, held_s=2.0)
    assert fleet.hold_s == 2.0  # the first sample is taken as is
    fleet.acquire(c)
    fleet.release(c, held_s=12.0)
    assert fleet.hold_s == pytest.approx(3.0)

"""Session affinity and the Responses owner map, on a fake clock."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from meshkit.core.policies import (
    BasePolicy,
    Completion,
    PlacementContext,
    PowerOfTwo,
    ResponsesAffinity,
    SessionAffinity,
    create_policy,
)
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Worker
from meshkit.errors import ConfigError

# -- SessionAffinity -------------------------------------------------------------


def test_same_key_same_worker_whatever_the_prompt(kit: SimpleNamespace) -> None:
    cs = kit.cands(5)
    p = create_policy("session")
    assert isinstance(p, SessionAffinity)
    assert isinstance(p.inner, PowerOfTwo)
    picks = {p.select(kit.ctx(cs, kit.view(f"turn {i}", routing_key="sess-42"))) for i in range(30)}
    assert len(picks) == 1
    spread = Counter(
        p.select(kit.ctx(cs, kit.view("hi", routing_key=f"user-{i}"))).key for i in range(1000)
    )
    assert len(spread) == 5
    assert max(spread.values()) <= 1.3 * 200


def test_a_single_candidate_takes_every_session(kit: SimpleNamespace) -> None:
    cs = kit.cands(1)
    assert SessionAffinity().select(kit.ctx(cs, kit.view(routing_key="k"))) == cs[0]


def test_strict_by_default_bounded_on_request(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    v = kit.view(routing_key="sess-1")
    home = SessionAffinity().select(kit.ctx(cs, v))
    load = {home.key: 50}
    assert SessionAffinity().select(kit.ctx(cs, v, load=load)) == home
    assert SessionAffinity(load_factor=1.25).select(kit.ctx(cs, v, load=load)) != home


def test_session_survives_its_worker_being_ineligible(kit: SimpleNamespace) -> None:
    fleet = kit.cands(4)
    p = SessionAffinity()
    v = kit.view(routing_key="sess-7")
    home = p.select(kit.ctx(fleet, v))
    rest = [c for c in fleet if c != home]
    assert p.select(kit.ctx(rest, v, fleet=fleet)) in rest
    assert p.select(kit.ctx(fleet, v, fleet=fleet)) == home


class _Recorder(BasePolicy):
    name = "recorder"

    def __init__(self) -> None:
        self.events: list[str] = []

    def select(self, ctx: PlacementContext) -> Candidate:
        self.events.append("select")
        return ctx.candidates[-1]

    def on_placed(self, cand: Candidate, view: RequestView, now: float) -> None:
        self.events.append("placed")

    def on_complete(self, cand: Candidate, view: RequestView, done: Completion, now: float) -> None:
        self.events.append("complete")

    def on_removed(self, worker: Worker) -> None:
        self.events.append("removed")


def test_keyless_requests_use_the_inner_policy_and_hooks_reach_it(kit: SimpleNamespace) -> None:
    cs = kit.cands(3)
    inner = _Recorder()
    p = SessionAffinity(inner=inner)
    v = kit.view("no key")
    assert p.select(kit.ctx(cs, v)) == cs[-1]
    p.select(kit.ctx(cs, kit.view(routing_key="k")))
    p.on_placed(cs[0], v, 1.0)
    p.on_complete(cs[0], v, Completion(status=200, ok=True), 2.0)
    p.on_removed(cs[0].worker)
    assert inner.events == ["select", "placed", "complete", "removed"]


def test_inner_by_name_with_options_and_its_needs(kit: SimpleNamespace) -> None:
    p = SessionAffinity(inner="prefix_hash", inner_options={"prefix_token_count": 32})
    assert p.needs.prefix_tokens == 32
    with pytest.raises(ConfigError, match="session"):
        SessionAffinity(inner="session")
    with pytest.raises(ConfigError, match="load_factor"):
        SessionAffinity(load_factor=0.5)
    with pytest.raises(ConfigError, match="virtual_nodes"):
        SessionAffinity(virtual_nodes=0)
    with pytest.raises(ConfigError, match="unknown policy"):
        SessionAffinity(inner="nope")


# -- ResponsesAffinity -----------------------------------------------------------


def test_owner_expires_on_the_callers_clock() -> None:
    owners = ResponsesAffinity(ttl_s=60)
    owners.remember("resp_1", "http://127.0.0.1:9001", now=1000.0)
    assert owners.owner("resp_1", now=1000.0) == "http://127.0.0.1:9001"
    assert owners.owner("resp_1", now=1059.9) == "http://127.0.0.1:9001"
    assert owners.owner("resp_1", now=1060.0) is None
    assert owners.owner("never", now=1060.0) is None


def test_a_clock_going_back_does_not_resurrect_entries() -> None:
    owners = ResponsesAffinity(ttl_s=10)
    owners.remember("r", "http://a:1", now=100.0)
    assert owners.owner("r", now=200.0) is None
    assert owners.owner("r", now=105.0) is None


def test_entries_are_bounded() -> None:
    owners = ResponsesAffinity(max_entries=100, ttl_s=3600)
    for i in range(1000):
        owners.remember(f"resp_{i}", f"http://w{i % 3}:8000", now=float(i))
    assert len(owners) == 100
    assert owners.owner("resp_999", now=1000.0) == "http://w0:8000"
    assert owners.owner("resp_0", now=1000.0) is None


def test_expire_drops_everything_past_its_ttl() -> None:
    owners = ResponsesAffinity(ttl_s=5)
    for i in range(10):
        owners.remember(f"r{i}", "http://a:1", now=float(i))
    owners.expire(now=9.5)
    assert len(owners) == 5  # r5..r9 expire at 10..14


def test_forget_origin_and_forget() -> None:
    owners = ResponsesAffinity()
    for i in range(10):
        owners.remember(f"r{i}", "http://a:1" if i % 2 else "http://b:1", now=0.0)
    assert owners.forget_origin("http://a:1") == 5
    assert owners.owner("r1", now=0.0) is None
    assert owners.owner("r2", now=0.0) == "http://b:1"
    owners.forget("r2")
    owners.forget("missing")
    assert owners.owner("r2", now=0.0) is None
    assert len(owners) == 4


@pytest.mark.parametrize(
    ("kwargs", "key"), [({"max_entries": 0}, "max_entries"), ({"ttl_s": 0}, "ttl_s")]
)
def test_bad_options(kwargs: dict[str, float], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        ResponsesAffinity(**kwargs)  # type: ignore[arg-type]

"""Table tests for :mod:`meshkit.core.placement`: eligibility, refusals, state domains."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

import pytest

from meshkit.core.endpoints import resolve
from meshkit.core.placement import configured_for, eligible, overloaded, place, state_owner_origin
from meshkit.core.policies.base import BasePolicy, PlacementContext
from meshkit.core.policies.simple import RoundRobin
from meshkit.core.requests import RequestView, parse_request
from meshkit.core.workers import Candidate, Fleet, Worker
from meshkit.errors import (
    MeshError,
    NoAvailableWorkers,
    Overloaded,
    StatefulRoutingUnsupported,
    UnsupportedApi,
)

P = pytest.param

CHAT = ("POST", "/v1/chat/completions")
COMPLETIONS = ("POST", "/v1/completions")
MESSAGES = ("POST", "/v1/messages")
RESPONSES = ("POST", "/v1/responses")
GENERATE = ("POST", "/generate")
TOKENIZE = ("POST", "/v1/tokenize")
MODELS = ("GET", "/v1/models")
RETRIEVE = ("GET", "/v1/responses/resp_1")

PREV = {"input": "x", "previous_response_id": "resp_0"}
CONV = {"input": "x", "conversation": {"id": "conv_0"}}
ITEM_REF = {"input": [{"id": "msg_0"}]}


def view(req: tuple[str, str], body: Mapping[str, Any] | None = None) -> RequestView:
    m = resolve(*req)
    assert m is not None
    raw = json.dumps(dict(body or {})).encode() if m.endpoint.has_body else b""
    return parse_request(m, raw)


def W(host: str, **labels: str) -> Worker:
    """A worker at http://<host>:8000 (``host`` may carry a path: "h/x")."""
    name, _, path = host.partition("/")
    url = f"http://{name}:8000" + (f"/{path}" if path else "")
    return Worker(url, labels={f"mesh.{k}": v for k, v in labels.items()})


def hosts(cands: list[Candidate]) -> list[str]:
    out = []
    for c in cands:
        h = c.worker.host + c.worker.base_path
        out.append(h if c.rank is None else f"{h}#{c.rank}")
    return out


# --------------------------------------------------------------------------------------
# eligibility table
# --------------------------------------------------------------------------------------

# workers, unhealthy hosts, request, body, expected hosts (in fleet order) or error class
TABLE = [
    # -- API filter (mesh.apis)
    P([W("a", apis="chat"), W("b", apis="messages")], (), CHAT, {}, ["a"], id="api-chat"),
    P([W("a", apis="chat"), W("b", apis="messages")], (), MESSAGES, {}, ["b"], id="api-msgs"),
    P([W("a"), W("b", apis="chat")], (), COMPLETIONS, {}, ["a"], id="api-unlabelled-all"),
    P([W("a"), W("b", apis="chat")], (), CHAT, {}, ["a", "b"], id="api-both"),
    P(
        [W("a", apis="chat"), W("b", apis="messages")],
        (),
        RESPONSES,
        {"input": "x"},
        UnsupportedApi,
        id="api-none-configured",
    ),
    P([W("a", apis="chat")], (), TOKENIZE, {}, UnsupportedApi, id="api-tokenize-none"),
    P([W("a", apis="chat,models")], (), MODELS, None, ["a"], id="api-models-declared"),
    P([W("a", apis="generate")], (), GENERATE, {"text": "x"}, ["a"], id="api-generate"),
    P([], (), CHAT, {}, UnsupportedApi, id="empty-fleet"),
    # -- model filter (mesh.model): labelled serve only theirs, unlabelled serve any
    P(
        [W("a", model="m1"), W("b", model="m2"), W("c")],
        (),
        CHAT,
        {"model": "m1"},
        ["a", "c"],
        id="model-m1",
    ),
    P(
        [W("a", model="m1"), W("b", model="m2"), W("c")],
        (),
        CHAT,
        {"model": "m3"},
        ["c"],
        id="model-unknown-unlabelled-take-it",
    ),
    P(
        [W("a", model="m1"), W("b", model="m2")],
        (),
        CHAT,
        {},
        ["a", "b"],
        id="model-absent-any",
    ),
    P(
        [W("a", model="m1"), W("b", model="m2")],
        (),
        CHAT,
        {"model": "m3"},
        UnsupportedApi,
        id="model-nobody",
    ),
    P(
        [W("a", model="m1", apis="messages"), W("b", model="m2", apis="chat")],
        (),
        CHAT,
        {"model": "m1"},
        UnsupportedApi,
        id="model-and-api-disjoint",
    ),
    P(
        [W("a", model="m1", apis="chat,models"), W("b", model="m2", apis="chat,models")],
        (),
        MODELS,
        None,
        ["a", "b"],
        id="model-list-asks-all",
    ),
    # -- role filter (PD workers are placed by the PD path)
    P(
        [W("p", role="prefill"), W("d", role="decode"), W("r")],
        (),
        CHAT,
        {},
        ["r"],
        id="role-regular-only",
    ),
    P(
        [W("p", role="prefill"), W("d", role="decode")],
        (),
        CHAT,
        {},
        UnsupportedApi,
        id="role-pd-only",
    ),
    # -- health
    P([W("a"), W("b")], ("a",), CHAT, {}, ["b"], id="health-one-down"),
    P([W("a"), W("b")], ("a", "b"), CHAT, {}, NoAvailableWorkers, id="health-all-down"),
    P(
        [W("a", apis="chat"), W("b", apis="messages")],
        ("a",),
        CHAT,
        {},
        NoAvailableWorkers,
        id="health-configured-one-down",
    ),
    P(
        [W("a", model="m1"), W("b", model="m2")],
        ("a",),
        CHAT,
        {"model": "m1"},
        NoAvailableWorkers,
        id="health-model-owner-down",
    ),
    # -- DP ranks
    P([W("a", dp_size="3")], (), CHAT, {}, ["a#0", "a#1", "a#2"], id="dp-ranks"),
    P([W("a", dp_size="2")], ("a",), CHAT, {}, NoAvailableWorkers, id="dp-down"),
    # -- state domain: stateful requests need one origin or all-shared
    P([W("a"), W("b")], (), RESPONSES, PREV, StatefulRoutingUnsupported, id="state-prev-2"),
    P([W("a"), W("b")], (), RESPONSES, CONV, StatefulRoutingUnsupported, id="state-conv-2"),
    P([W("a"), W("b")], (), RESPONSES, ITEM_REF, StatefulRoutingUnsupported, id="state-ref-2"),
    P([W("a"), W("b")], (), RESPONSES, {"input": "x"}, ["a", "b"], id="stateless-2"),
    P([W("a")], (), RESPONSES, PREV, ["a"], id="state-single"),
    P(
        [W("a", dp_size="2")],
        (),
        RESPONSES,
        PREV,
        ["a#0", "a#1"],
        id="state-dp-ranks-one-origin",
    ),
    P(
        [W("a", responses_state="shared"), W("b", responses_state="shared")],
        (),
        RESPONSES,
        PREV,
        ["a", "b"],
        id="state-all-shared",
    ),
    P(
        [W("a", responses_state="shared"), W("b")],
        (),
        RESPONSES,
        PREV,
        StatefulRoutingUnsupported,
        id="state-one-not-shared",
    ),
    P(
        [W("a"), W("b")],
        ("b",),
        RESPONSES,
        PREV,
        StatefulRoutingUnsupported,
        id="state-unhealthy-worker-still-counts",
    ),
    P(
        [W("a", responses_state="shared"), W("b", responses_state="shared")],
        ("b",),
        RESPONSES,
        PREV,
        ["a"],
        id="state-shared-one-down",
    ),
    P(
        [W("a", apis="responses"), W("b", apis="chat")],
        (),
        RESPONSES,
        PREV,
        ["a"],
        id="state-other-api-does-not-count",
    ),
    P(
        [W("a", model="m1"), W("b", model="m2")],
        (),
        RESPONSES,
        {**PREV, "model": "m1"},
        ["a"],
        id="state-other-model-does-not-count",
    ),
    P(
        [W("a"), W("p", role="prefill")],
        (),
        RESPONSES,
        PREV,
        ["a"],
        id="state-pd-does-not-count",
    ),
    P([W("a")], ("a",), RESPONSES, PREV, NoAvailableWorkers, id="state-single-down"),
]


@pytest.mark.parametrize(("workers", "down", "req", "body", "expected"), TABLE)
def test_eligibility(
    workers: list[Worker],
    down: tuple[str, ...],
    req: tuple[str, str],
    body: Mapping[str, Any] | None,
    expected: list[str] | type[MeshError],
) -> None:
    fleet = Fleet(workers)
    fleet.unhealthy.update(w.id for w in workers if w.host in down)
    v = view(req, body)
    if isinstance(expected, list):
        cands = eligible(fleet, v)
        assert hosts(cands) == expected
        chosen = place(fleet, RoundRobin(), v, random.Random(0))
        assert chosen in cands
        return
    with pytest.raises(expected) as ei:
        eligible(fleet, v)
    with pytest.raises(expected):
        place(fleet, RoundRobin(), v, random.Random(0))
    err = ei.value
    assert type(err) is expected
    codes = {
        UnsupportedApi: (501, "unsupported_api"),
        StatefulRoutingUnsupported: (501, "stateful_routing_unsupported"),
        NoAvailableWorkers: (503, "no_available_workers"),
    }
    assert (err.status, err.code) == codes[expected]
    if expected is NoAvailableWorkers:
        assert err.retry_after_s is not None
        assert dict(err.headers())[b"retry-after"] == b"1"


def test_unsupported_model_names_the_model() -> None:
    fleet = Fleet([W("a", model="m1")])
    with pytest.raises(UnsupportedApi) as ei:
        eligible(fleet, view(CHAT, {"model": "m9"}))
    assert "m9" in ei.value.message


# --------------------------------------------------------------------------------------
# exclusion, admission, owner
# --------------------------------------------------------------------------------------


def test_exclude_drops_tried_candidates() -> None:
    fleet = Fleet([W("a", dp_size="2"), W("b")])
    v = view(CHAT)
    keys = [c.key for c in fleet.candidates]
    assert hosts(eligible(fleet, v, exclude={keys[0]})) == ["a#1", "b"]
    with pytest.raises(NoAvailableWorkers):
        eligible(fleet, v, exclude=set(keys))


def test_admit_gate() -> None:
    a, b = W("a"), W("b")
    fleet = Fleet([a, b])
    assert hosts(eligible(fleet, view(CHAT), admit=lambda w: w is not a)) == ["b"]
    with pytest.raises(NoAvailableWorkers):
        eligible(fleet, view(CHAT), admit=lambda w: False)


def test_admit_refused_worker_still_counts_for_state() -> None:
    a, b = W("a"), W("b")
    fleet = Fleet([a, b])
    with pytest.raises(StatefulRoutingUnsupported):
        eligible(fleet, view(RESPONSES, PREV), admit=lambda w: w is a)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        P(PREV, ["a#0", "a#1"], id="stateful-owner-only"),
        P(CONV, ["a#0", "a#1"], id="conversation-owner-only"),
        P({"input": "x"}, ["a#0", "a#1", "b"], id="stateless-ignores-owner"),
    ],
)
def test_known_owner(body: Mapping[str, Any], expected: list[str]) -> None:
    a, b = W("a", dp_size="2"), W("b")
    fleet = Fleet([a, b])
    cands = eligible(fleet, view(RESPONSES, body), owner=a.origin)
    assert hosts(cands) == expected
    for _ in range(5):
        c = place(fleet, RoundRobin(), view(RESPONSES, body), random.Random(0), owner=a.origin)
        assert c in cands


def test_known_owner_gone_is_501() -> None:
    fleet = Fleet([W("a"), W("b")])
    with pytest.raises(StatefulRoutingUnsupported):
        eligible(fleet, view(RESPONSES, PREV), owner="http://gone:8000")


def test_known_owner_unhealthy_is_503_not_failover() -> None:
    a, b = W("a"), W("b")
    fleet = Fleet([a, b])
    fleet.unhealthy.add(a.id)
    with pytest.raises(NoAvailableWorkers):
        eligible(fleet, view(RESPONSES, PREV), owner=a.origin)


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        P([W("a")], "http://a:8000", id="one"),
        P([W("a", dp_size="4")], "http://a:8000", id="dp"),
        P([W("a"), W("b")], None, id="two-origins"),
        P([W("a", responses_state="shared"), W("b", responses_state="shared")], True, id="sh"),
        P([W("a", responses_state="shared"), W("b")], None, id="mixed"),
        P([], None, id="none"),
    ],
)
def test_state_owner_origin(workers: list[Worker], expected: object) -> None:
    assert state_owner_origin(workers) == expected


def test_configured_for_includes_unhealthy() -> None:
    a, b = W("a"), W("b", apis="messages")
    fleet = Fleet([a, b])
    fleet.unhealthy.add(a.id)
    assert configured_for(fleet, view(CHAT)) == [a]
    assert configured_for(fleet, view(CHAT), role="prefill") == []


def test_round_robin_alternates_over_eligible() -> None:
    fleet = Fleet([W("a"), W("b"), W("c", apis="messages")])
    policy = RoundRobin()
    rng = random.Random(0)
    picks = [place(fleet, policy, view(CHAT), rng).worker.host for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]


class _Rogue(BasePolicy):
    name = "rogue"

    def __init__(self, pick: Candidate) -> None:
        self.pick = pick

    def select(self, ctx: PlacementContext) -> Candidate:
        return self.pick


def test_policy_choosing_an_ineligible_worker_is_refused() -> None:
    a, b = W("a"), W("b")
    fleet = Fleet([a, b])
    fleet.unhealthy.add(b.id)
    with pytest.raises(MeshError):
        place(fleet, _Rogue(Candidate(b)), view(CHAT), random.Random(0))


def test_placement_context_carries_fleet_state() -> None:
    seen: list[PlacementContext] = []

    class Spy(BasePolicy):
        name = "spy"

        def select(self, ctx: PlacementContext) -> Candidate:
            seen.append(ctx)
            return ctx.candidates[-1]

    a, b = W("a"), W("b")
    fleet = Fleet([a, b])
    fleet.unhealthy.add(a.id)
    fleet.acquire(fleet.candidates[1], 5)
    c = place(fleet, Spy(), view(CHAT), random.Random(0), now=12.5, attempt=2, exclude=())
    assert c.worker is b
    ctx = seen[0]
    assert ctx.now == 12.5
    assert ctx.attempt == 2
    assert ctx.fleet == fleet.candidates  # the whole fleet, healthy or not
    assert ctx.load_of(fleet.candidates[1]) == 1
    assert ctx.weight[fleet.candidates[1].key] == 5
    assert ctx.fleet_version == fleet.version


def test_retrieve_view_routes_by_api() -> None:
    # resource operations carry no body: only API/role filtering applies
    fleet = Fleet([W("a", apis="responses"), W("b", apis="chat")])
    assert hosts(eligible(fleet, view(RETRIEVE))) == ["a"]


def test_models_served_by_any_openai_worker() -> None:
    fleet = Fleet([W("a", apis="chat,completions,responses")])
    assert hosts(eligible(fleet, view(MODELS))) == ["a"]


# --------------------------------------------------------------------------------------
# admission: upstream.max_in_flight_per_worker and upstream.max_in_flight
# --------------------------------------------------------------------------------------


def _fill(fleet: Fleet, host: str, n: int) -> None:
    cands = [c for c in fleet.candidates if c.worker.host == host]
    for i in range(n):
        fleet.acquire(cands[i % len(cands)])


@pytest.mark.parametrize(
    ("in_flight", "expected"),
    [
        P(1, ["a", "b"], id="cap-1-eligible"),
        P(2, ["b"], id="cap-not-eligible"),
        P(3, ["b"], id="cap+1-not-eligible"),
    ],
)
def test_per_worker_cap_at_the_bound(in_flight: int, expected: list[str]) -> None:
    fleet = Fleet([W("a"), W("b")], max_in_flight_per_worker=2)
    _fill(fleet, "a", in_flight)
    assert hosts(eligible(fleet, view(CHAT))) == expected


def test_per_worker_cap_counts_dp_ranks_together() -> None:
    fleet = Fleet([W("a", dp_size="2"), W("b")], max_in_flight_per_worker=2)
    _fill(fleet, "a", 2)  # one request on each rank: the worker is at its cap
    assert hosts(eligible(fleet, view(CHAT))) == ["b"]


@pytest.mark.parametrize(
    ("in_flight", "refused"),
    [P(2, False, id="cap-1"), P(3, True, id="cap"), P(4, True, id="cap+1")],
)
def test_global_cap_at_the_bound(in_flight: int, refused: bool) -> None:
    fleet = Fleet([W("a"), W("b")], max_in_flight=3)
    _fill(fleet, "a", in_flight)
    if not refused:
        assert hosts(eligible(fleet, view(CHAT))) == ["a", "b"]
        return
    with pytest.raises(Overloaded) as ei:
        eligible(fleet, view(CHAT))
    assert ei.value.status == 503 and ei.value.code == "overloaded"
    assert "3 requests in flight" in ei.value.message


def test_every_worker_at_its_cap_is_overloaded_not_no_available_workers() -> None:
    fleet = Fleet([W("a"), W("b"), W("c")], max_in_flight_per_worker=1)
    fleet.unhealthy.add(W("c").id)
    _fill(fleet, "a", 1)
    _fill(fleet, "b", 1)
    with pytest.raises(Overloaded):
        eligible(fleet, view(CHAT))
    # unhealthy only (nobody at a cap): the old refusal
    fleet.unhealthy.update({W("a").id, W("b").id})
    with pytest.raises(NoAvailableWorkers) as ei:
        eligible(fleet, view(CHAT))
    assert type(ei.value) is NoAvailableWorkers


def test_a_full_worker_and_a_tried_one_is_overloaded() -> None:
    """A retry: the other worker was tried, this one is full: come back later."""
    fleet = Fleet([W("a"), W("b")], max_in_flight_per_worker=1)
    _fill(fleet, "b", 1)
    with pytest.raises(Overloaded):
        eligible(fleet, view(CHAT), exclude={W("a").id})


def test_refusals_of_configuration_come_before_admission() -> None:
    fleet = Fleet([W("a", apis="chat")], max_in_flight=1, max_in_flight_per_worker=1)
    _fill(fleet, "a", 1)
    with pytest.raises(UnsupportedApi):
        eligible(fleet, view(MESSAGES))
    with pytest.raises(Overloaded):
        eligible(fleet, view(CHAT))


def test_the_policy_only_sees_workers_below_their_cap() -> None:
    fleet = Fleet([W("a"), W("b")], max_in_flight_per_worker=1)
    _fill(fleet, "a", 1)
    picks = {place(fleet, RoundRobin(), view(CHAT), random.Random(0)).worker.host for _ in range(4)}
    assert picks == {"b"}


@pytest.mark.parametrize(
    ("hold_s", "slots", "hint"),
    [
        P(0.0, 8, 1.0, id="no-request-ended-yet"),
        P(3.0, 8, 0.375, id="hold-over-slots"),
        P(0.001, 8, 0.05, id="floor"),
        P(600.0, 1, 60.0, id="clamped-to-60"),
    ],
)
def test_overloaded_retry_hint(hold_s: float, slots: int, hint: float) -> None:
    fleet = Fleet([W("a")])
    fleet.hold_s = hold_s
    err = overloaded(fleet, slots, "why")
    assert err.retry_after_s == pytest.approx(hint)
    assert "why" in err.message


def test_labels_restrict_and_learned_lists_steer() -> None:
    """A label's models are the only ones a worker gets; an unlabelled worker's own
    list steers a model to the workers that list it, and when none does, every
    unlabelled worker may take it (the engine decides). Fleet order is kept."""
    lab = Worker("http://lab:1", labels={"mesh.model": "a, x"})
    la, lb, unknown = Worker("http://la:1"), Worker("http://lb:1"), Worker("http://u:1")
    fleet = Fleet([la, lab, lb, unknown])
    assert fleet.learn(la.id, frozenset({"a"}))
    assert fleet.learn(lb.id, frozenset({"b"}))
    assert not fleet.learn(lab.id, frozenset({"zzz"}))  # a label wins over a list

    def serving(model: str) -> list[Worker]:
        return configured_for(fleet, view(CHAT, {"model": model, "messages": []}))

    assert serving("a") == [la, lab]
    assert serving("b") == [lb]
    assert serving("x") == [la, lab, lb, unknown]  # labelled for it; nobody lists it
    assert serving("nobody-lists-it") == [la, lb, unknown]
    assert fleet.models_of(lab) == frozenset({"a", "x"})
    assert fleet.models_of(unknown) is None
    assert fleet.learn(la.id, None)  # the list went away: any model again
    assert serving("a") == [la, lab, lb, unknown]


def test_a_lease_weighs_the_prompt_part_the_engine_does_not_hold() -> None:
    from meshkit.core.kv_events import Batch, BlockStored
    from meshkit.core.kv_index import chain
    from meshkit.core.placement import uncached_weight

    a, b, c = W("a"), W("b"), W("c")
    fleet = Fleet([a, b, c])
    ids = list(range(1, 65))  # 4 blocks of 16
    fleet.kv.apply(a.id, Batch(0.0, (BlockStored((1, 2, 3), None, tuple(ids[:48]), 16),)))
    fleet.kv.apply(b.id, Batch(0.0, (BlockStored((9,), None, tuple([7] * 16), 16),)))
    v = view(CHAT, {"messages": [{"role": "user", "content": "x"}]})
    v.prompt_ids, v.prompt_weight = ids, 256
    ca, cb, cc = fleet.candidates
    assert uncached_weight(fleet, ca, v) == 64  # a holds 48 of 64 tokens
    assert uncached_weight(fleet, cb, v) == 256  # b publishes, holds none of it
    assert uncached_weight(fleet, cc, v) == 256  # c publishes nothing: the whole prompt
    v.kv_keys = {16: chain(ids, 16)}  # prepare's precomputed keys: the same answer
    assert uncached_weight(fleet, ca, v) == 64
    v.prompt_ids = None  # no token ids: the estimate as it is
    assert uncached_weight(fleet, ca, v) == 256


def test_the_eligibility_cache_has_room_for_every_model_the_fleet_names() -> None:
    """300 LoRA adapters listed by a worker: each model's eligible workers are
    computed once, not again every few requests as with a fixed 256 entries; names
    no worker lists (clients make them up) still start the cache over at 256."""
    from meshkit.core.workers import DERIVED_BASE, DERIVED_PER_MODEL

    lora, other = W("lora"), W("other", model="base")
    fleet = Fleet([lora, other])
    assert fleet.derived_limit == DERIVED_BASE + DERIVED_PER_MODEL * 1
    adapters = frozenset(f"adapter-{i}" for i in range(300))
    assert fleet.learn(lora.id, adapters)
    assert fleet.derived_limit == DERIVED_BASE + DERIVED_PER_MODEL * 301
    for name in sorted(adapters):
        assert configured_for(fleet, view(CHAT, {"model": name})) == [lora]
    kept = dict(fleet.derived)
    assert len(kept) == 300  # nothing was dropped on the way
    for name in sorted(adapters):
        configured_for(fleet, view(CHAT, {"model": name}))
    assert all(fleet.derived[k] is kept[k] for k in kept)  # each computed once
    fleet.learn(lora.id, None)  # the list is gone: back to the base
    assert fleet.derived_limit == DERIVED_BASE + DERIVED_PER_MODEL * 1

"""
Placement
=========

Eligibility first, then the policy:

1. **API**: workers whose ``mesh.apis`` serve the endpoint's API (absent = all).
2. **Topology**: regular workers (prefill/decode pairs are placed by the PD path).
3. **Model**: workers labelled ``mesh.model`` serve only that model; unlabelled
   workers serve any.
4. **Responses state**: a request that references stored state
   (``previous_response_id``, ``conversation``, ``item_reference``) is routed only
   when its owner is known (Responses affinity: the answer that created the
   response or conversation, or the forward flow's lookup of it), or when every
   candidate shares one backend or all are labelled ``mesh.responses_state=shared``.
   Unhealthy workers count in this check, so failover cannot quietly move a
   conversation to a backend that does not hold it.
5. **Health**: unhealthy workers and excluded (already tried) candidates drop out.
6. **Admission**: a worker with ``upstream.max_in_flight_per_worker`` requests in
   flight (its DP ranks together) drops out; with ``upstream.max_in_flight`` in
   flight in the whole fleet, every worker does. Two integer comparisons, on
   counters the fleet keeps as leases start and end.

No configured worker for the API/model is 501 ``unsupported_api``; some configured
but none available is 503 ``no_available_workers``; some available but all at
their admission limit is 503 ``overloaded`` (:func:`overloaded`), refused at once,
before any byte goes upstream: past the limit a request would only wait for a
pooled connection, then fail.

Lifecycle (``docs/lifecycle.md``) reaches placement only through data: workers that must not
take new requests (failed, asleep, draining, breaker open) are in
``fleet.unhealthy``, so the hot path costs nothing extra; ``prefer`` pins an
``Idempotency-Key`` join to the candidate its running twin holds.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from typing import Final

from meshkit.core.endpoints import Api
from meshkit.core.policies.base import PlacementContext, Policy
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Fleet, Worker
from meshkit.errors import (
    NoAvailableWorkers,
    Overloaded,
    StatefulRoutingUnsupported,
    UnsupportedApi,
)

__all__ = [
    "admission_refusal",
    "configured_for",
    "eligible",
    "overloaded",
    "place",
    "state_owner_origin",
    "uncached_weight",
]

#: retry hint of an admission refusal before any request has ended (seconds)
_FIRST_HINT_S: Final = 1.0
#: the shortest retry hint of an admission refusal (seconds)
_MIN_HINT_S: Final = 0.05

#: origin -> True when that origin may take new requests (lifecycle states)
Admit = Callable[[Worker], bool]


def configured_for(fleet: Fleet, view: RequestView, role: str = "regular") -> list[Worker]:
    """Workers that serve this API, topology and model — healthy or not."""
    return [w for w, _ in _serving(fleet, view.api, view.model, role)]


# how a worker serves a request's model: by label or any model, by its own list,
# or maybe (unlabelled, and its list does not name it or is not known yet)
_SERVES: Final = 0
_LISTS: Final = 1
_MAY: Final = 2
_Serving = tuple[tuple[Worker, tuple[Candidate, ...]], ...]


def _serving(fleet: Fleet, api: Api, model: str | None, role: str) -> _Serving:
    """(worker, its candidates) of :func:`configured_for`, computed once per fleet version."""
    key = (api, model, role)
    got: _Serving | None = fleet.derived.get(key)
    if got is None:
        # Labels restrict; a worker's own list only steers: the unlabelled workers
        # that list the model get it, and when none does, every unlabelled one does
        # (llama.cpp and SGLang serve any name; vLLM answers its own 404). Fleet
        # order is kept: policies index into it.
        tagged: list[tuple[tuple[Worker, tuple[Candidate, ...]], int]] = []
        for w in fleet.workers:
            if w.role != role and api is not Api.MODELS:  # every role lists its models
                continue
            if not w.serves(api):
                continue
            if not model or api is Api.MODELS:
                tag = _SERVES
            elif w.models is not None:
                if model not in w.models:
                    continue
                tag = _SERVES
            else:
                tag = _LISTS if model in fleet.learned.get(w.id, ()) else _MAY
            tagged.append(((w, fleet.candidates_of(w)), tag))
        skip = _MAY if any(tag == _LISTS for _, tag in tagged) else -1
        got = tuple(entry for entry, tag in tagged if tag != skip)
        if len(fleet.derived) >= fleet.derived_limit:
            fleet.derived.clear()
        fleet.derived[key] = got
    return got


def state_owner_origin(workers: Sequence[Worker]) -> str | bool | None:
    """The single state domain of ``workers``.

    :returns: the one origin they all share, ``True`` when all are labelled shared,
        or ``None`` when there is no single state domain.
    """
    origins = {w.origin for w in workers}
    if len(origins) == 1:
        return next(iter(origins))
    if workers and all(w.responses_state_shared for w in workers):
        return True
    return None


def eligible(
    fleet: Fleet,
    view: RequestView,
    *,
    exclude: Collection[str] = (),
    owner: str | None = None,
    admit: Admit | None = None,
    role: str = "regular",
) -> list[Candidate]:
    """The candidates a policy may choose from, or the right refusal.

    :param exclude: candidate keys already tried for this request.
    :param owner: the origin known (by Responses affinity) to hold the referenced state.
    :param admit: lifecycle gate: False for workers that must not take new requests.
    """
    entries = _serving(fleet, view.api, view.model, role)
    if not entries:
        what = f"model {view.model!r} on " if view.model and _labelled(fleet) else ""
        raise UnsupportedApi(f"no configured worker serves {what}{view.match.endpoint.template}")
    only = view.only
    if only is not None:
        entries = tuple(e for e in entries if e[0].id in only)
        if not entries:
            raise NoAvailableWorkers(
                "none of the workers this request may go to serves it", retry_after_s=1.0
            )
    if view.stateful:
        if owner is not None:
            entries = tuple(e for e in entries if e[0].origin == owner)
            if not entries:
                raise StatefulRoutingUnsupported(
                    "the worker holding the referenced Responses state is no longer configured"
                )
        elif state_owner_origin([w for w, _ in entries]) is None:
            raise StatefulRoutingUnsupported(_no_owner(view))
    full_fleet = _fleet_refusal(fleet)
    if full_fleet is not None:
        raise full_fleet
    per = fleet.max_in_flight_per_worker
    unhealthy = fleet.unhealthy  # Fleet.healthy(), without the call
    worker_load = fleet.worker_load
    full = 0
    out: list[Candidate] = []
    for w, cands in entries:
        if w.id in unhealthy or (admit is not None and not admit(w)):
            continue
        if per and worker_load.get(w.id, 0) >= per:
            full += 1
            continue
        if exclude:
            out += [c for c in cands if c.key not in exclude]
        else:
            out += cands
    if not out:
        if full:
            raise overloaded(
                fleet, per * full, f"every available worker has {per} requests in flight"
            )
        raise NoAvailableWorkers(
            f"no healthy worker is available for {view.match.endpoint.template}",
            retry_after_s=1.0,
        )
    return out


def _no_owner(view: RequestView) -> str:
    """Why a stateful request has nowhere to go. With an id, the forward flow asked
    every origin before placing (``GET /v1/responses/{id}`` or the conversation's),
    so the answer is that none holds it; an ``item_reference`` alone names no object
    that could be looked up."""
    if view.previous_response_id:
        what = "the previous_response_id"
    elif view.conversation:
        what = "the conversation"
    else:
        return (
            "this request references stored Responses items (item_reference) and the "
            "workers do not share one state store; label them mesh.responses_state=shared"
        )
    return (
        f"no worker holds {what} this request continues (each origin was asked); "
        "workers that share one state store can be labelled mesh.responses_state=shared"
    )


def _fleet_refusal(fleet: Fleet) -> Overloaded | None:
    cap = fleet.max_in_flight
    if cap and fleet.in_flight >= cap:
        return overloaded(fleet, cap, f"the fleet has {cap} requests in flight")
    return None


def admission_refusal(fleet: Fleet, worker: Worker) -> Overloaded | None:
    """The 503 ``overloaded`` one more request on ``worker`` would get (None: admitted)."""
    full_fleet = _fleet_refusal(fleet)
    if full_fleet is not None:
        return full_fleet
    per = fleet.max_in_flight_per_worker
    if per and fleet.worker_load.get(worker.id, 0) >= per:
        return overloaded(fleet, per, f"the worker has {per} requests in flight")
    return None


def overloaded(fleet: Fleet, slots: int, why: str) -> Overloaded:
    """The 503 ``overloaded`` refusal, with a retry hint: the expected time until one
    of the ``slots`` full slots frees (how long requests hold one, on average,
    divided by their number), at least 50 ms; 1 s before any request ended."""
    hold = fleet.hold_s
    hint = max(_MIN_HINT_S, hold / max(1, slots)) if hold > 0 else _FIRST_HINT_S
    message = f"meshkit is at its admission limit: {why}; retry shortly"
    return Overloaded(message, retry_after_s=hint)


def _labelled(fleet: Fleet) -> bool:
    return any(w.models for w in fleet.workers)


def place(
    fleet: Fleet,
    policy: Policy,
    view: RequestView,
    rng: random.Random,
    *,
    now: float = 0.0,
    attempt: int = 0,
    exclude: Collection[str] = (),
    owner: str | None = None,
    admit: Admit | None = None,
    prefer: str | None = None,
) -> Candidate:
    """Pick a candidate for ``view`` (eligibility, then the policy).

    :param prefer: a candidate key to take without asking the policy when it is
        eligible (an idempotent retry joins the worker its original runs on).
    """
    cands = eligible(fleet, view, exclude=exclude, owner=owner, admit=admit)
    if prefer is not None:
        for c in cands:
            if c.key == prefer:
                return c
    ctx = PlacementContext(
        cands,
        view,
        fleet.placement_load(),
        fleet.weight,
        rng,
        fleet.candidates,
        fleet.version,
        now,
        attempt,
        fleet.kv if view.prompt_ids else None,
    )
    chosen = policy.select(ctx)
    for c in cands:  # by identity first: Candidate.__eq__ is slow
        if c is chosen:
            return chosen
    if chosen not in cands:
        raise UnsupportedApi(f"policy {policy.name!r} chose an ineligible worker")
    return chosen


def uncached_weight(fleet: Fleet, cand: Candidate, view: RequestView) -> int:
    """The part of ``view``'s prompt weight ``cand``'s engine still has to compute.

    A prompt whose prefix the worker's KV events say it holds costs the engine only
    its uncached tail, so that is what its lease weighs (``least_load`` reads it);
    a worker without events is charged the whole prompt.
    """
    weight = view.prompt_weight
    ids = view.prompt_ids
    if not weight or not ids:
        return weight
    wid = cand.worker.id
    kv = fleet.kv
    if not kv.covers(wid):
        return weight
    held = kv.match(ids, (wid,), view.kv_keys, view.model).get(wid, 0)
    return weight - weight * min(held, len(ids)) // len(ids)

"""
A multi-tenant, multi-turn chat workload
========================================

What prefix-cache placement is for: several tenants, each with a long system
prompt of its own, each with a few users holding multi-turn conversations.
Every request of a tenant starts with the same ~1k tokens, and every turn of a
conversation extends the previous one, so an engine that served the tenant (or
the conversation) before computes only the new tail.

:func:`make_tenants` writes deterministic system prompts (no tokenizer needed:
about 4 characters per SmolLM2 token). :func:`replay` sends the
conversations through a :class:`~meshkit.Mesh` (an ``httpx`` client on
:class:`~meshkit.MeshTransport`), or through gateways (``meshkit serve``: a base
URL each), as streamed chat completions with ``stream_options.include_usage``,
``temperature`` 0, and records, per request:

* the engine that answered (the ``model`` of the response: each engine of an
  :class:`~meshkit.testing.EngineFleet` serves its own alias);
* the engine-reported ``prompt_tokens`` and
  ``prompt_tokens_details.cached_tokens``;
* the client-measured time to the first content token and to the end;
* the engine's own prefill time, where it reports one (llama.cpp: ``timings``
  ``prompt_ms`` in the last chunk): what the engine spent on the prompt, without
  the client's and the routers' share of the TTFT.

Turns are replayed in rounds: round *t* sends turn *t* of every conversation
(tenants interleaved) over ``concurrency`` client threads, and a conversation's
next turn carries the engine's actual reply in its history.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx

from meshkit.frontends.transport import MeshTransport
from meshkit.mesh import Mesh

__all__ = [
    "Conversation",
    "Outcome",
    "Summary",
    "Tenant",
    "make_conversations",
    "make_tenants",
    "replay",
    "stream_chat",
    "summarize",
]

_BUSINESSES = (
    ("Velo Garage", "bicycle repair shop", ("city bikes", "e-bikes", "inner tubes", "brake pads")),
    ("Crumb & Co", "bakery", ("sourdough loaves", "croissants", "birthday cakes", "rye bread")),
    ("Bright Smile", "dental practice", ("check-ups", "cleanings", "fillings", "night guards")),
    ("Paper Trail", "bookshop", ("novels", "atlases", "comics", "gift cards")),
    ("Green Thumb", "garden centre", ("seedlings", "compost", "clay pots", "hedge trimmers")),
    (
        "Harbour Lights",
        "seaside hotel",
        ("double rooms", "breakfasts", "bike rentals", "boat tours"),
    ),
)
_RULES = (
    "Customers ask about {item}; answer with the price list and the opening hours.",
    "Never promise {item} by a date you have not checked in the calendar.",
    "When {item} are out of stock, offer to reserve them and to call back.",
    "Discounts on {item} apply to members only and never to sale items.",
    "Payment for {item} is by card or cash; invoices go out by email.",
    "Complaints about {item} go to the manager, who answers within two days.",
    "Do not share the personal data of other customers who bought {item}.",
    "If a question about {item} is unclear, ask one short question back.",
)
_QUESTIONS = (
    "Hello! Are you open on Saturday?",
    "How much does it cost?",
    "Can I pay by card?",
    "Thanks. Anything else I should know?",
    "Can I book for next week?",
    "Who do I call about a complaint?",
)


@dataclass(frozen=True)
class Tenant:
    """One tenant: a name and its long system prompt."""

    name: str
    system: str


@dataclass
class Conversation:
    """One user's conversation with a tenant's assistant."""

    tenant: Tenant
    user: int
    questions: tuple[str, ...]
    #: the chat so far, without the system prompt (grows by two per turn)
    history: list[dict[str, str]] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": self.tenant.system},
            *self.history,
            {"role": "user", "content": self.questions[turn]},
        ]


@dataclass
class Outcome:
    """One request of a replay, as the client and the engine saw it."""

    tenant: str
    user: int
    turn: int
    status: int
    engine: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    #: the engine's prefill time in seconds, when it reports one
    prefill: float | None = None
    latency: float = 0.0
    text: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def make_tenants(n: int, *, target_tokens: int = 1000) -> list[Tenant]:
    """``n`` tenants with distinct system prompts of about ``target_tokens`` tokens."""
    chars = int(target_tokens * 4.0)
    tenants = []
    for i in range(n):
        name, kind, items = _BUSINESSES[i % len(_BUSINESSES)]
        if i >= len(_BUSINESSES):
            name = f"{name} {i // len(_BUSINESSES) + 1}"
        # The tenant's name comes first: prompts differ from the first character,
        # as real tenants' do, so a prefix hash can tell them apart.
        parts = [f"You are the assistant of {name}, a {kind}. Follow these house rules."]
        k = 0
        while sum(len(p) + 1 for p in parts) < chars:
            rule = _RULES[k % len(_RULES)].format(item=items[(k // len(_RULES)) % len(items)])
            parts.append(f"Rule {k + 1}: {rule}")
            k += 1
        tenants.append(Tenant(name=name, system=" ".join(parts)))
    return tenants


def make_conversations(
    tenants: Sequence[Tenant], *, users: int = 1, turns: int = 3
) -> list[Conversation]:
    """``users`` conversations of ``turns`` questions per tenant, tenants interleaved."""
    if turns > len(_QUESTIONS):
        raise ValueError(f"at most {len(_QUESTIONS)} turns")
    convs = []
    for u in range(users):
        for t in tenants:
            # Users of one tenant ask in a different order, so their histories differ.
            qs = _QUESTIONS[u % len(_QUESTIONS) :] + _QUESTIONS[: u % len(_QUESTIONS)]
            convs.append(Conversation(tenant=t, user=u, questions=tuple(qs[:turns])))
    return convs


def _sse_data(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        obj = json.loads(data)
        if isinstance(obj, dict):
            yield obj


def stream_chat(
    client: httpx.Client,
    messages: list[dict[str, str]],
    *,
    max_tokens: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Outcome, str]:
    """One streamed chat completion; returns the outcome (no tenant filled) and the text."""
    body = {
        "model": "default",  # the engines ignore it; meshkit passes it on
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = Outcome(tenant="", user=0, turn=0, status=0)
    parts: list[str] = []
    start = clock()
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            out.error = resp.read().decode("utf-8", "replace")[:200]
            out.latency = clock() - start
            return out, ""
        for chunk in _sse_data(resp.iter_lines()):
            out.engine = str(chunk.get("model") or out.engine)
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if out.ttft is None:
                        out.ttft = clock() - start
                    parts.append(piece)
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                out.completion_tokens = int(usage.get("completion_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                out.cached_tokens = int(details.get("cached_tokens") or 0)
            timings = chunk.get("timings")
            if isinstance(timings, dict) and isinstance(timings.get("prompt_ms"), int | float):
                out.prefill = timings["prompt_ms"] / 1000.0
            if "error" in chunk:
                out.error = json.dumps(chunk["error"])[:200]
    out.latency = clock() - start
    text = "".join(parts)
    out.text = text
    return out, text


def replay(
    mesh: Mesh | Sequence[Mesh | str],
    conversations: Sequence[Conversation],
    *,
    turns: int,
    max_tokens: int = 16,
    concurrency: int = 1,
    on_result: Callable[[Outcome], None] | None = None,
    shuffle_seed: int | None = None,
    timeout: float = 600.0,
    routes: Sequence[Sequence[int]] | None = None,
) -> list[Outcome]:
    """Replay ``conversations`` through ``mesh``, turn by turn; every outcome, in order ended.

    :param on_result: called (from a client thread, one call at a time) as each
        request ends: the demo prints from it.
    :param shuffle_seed: send each round in a seeded random order instead of the
        given one. A fixed cyclic order can line up with round robin's cycle (an
        even number of tenants on two engines gives round robin perfect tenant
        affinity), which real arrivals never do.
    :param mesh: one router, or several independent ones (K routers over one fleet):
        each a :class:`~meshkit.Mesh` in this process or a gateway's base URL.
    :param routes: with several routers, ``routes[turn][i]`` is the router that
        sends turn ``turn`` of conversation ``i`` (default: the first).
    """
    routers = [mesh] if isinstance(mesh, Mesh) else list(mesh)
    transports = [MeshTransport(m) for m in routers if isinstance(m, Mesh)]
    made = iter(transports)
    # Through a transport the client's host is ignored: it places every request.
    clients = [
        httpx.Client(base_url=r, timeout=timeout, trust_env=False)
        if isinstance(r, str)
        else httpx.Client(transport=next(made), base_url="http://mesh.invalid", timeout=timeout)
        for r in routers
    ]
    lock = threading.Lock()
    results: list[Outcome] = []
    # Fresh histories: the caller's conversations can be replayed again.
    convs = [Conversation(c.tenant, c.user, c.questions) for c in conversations]

    def one(i: int, turn: int) -> Outcome:
        conv = convs[i]
        client = clients[routes[turn][i] if routes is not None else 0]
        try:
            out, text = stream_chat(client, conv.messages(turn), max_tokens=max_tokens)
        except httpx.HTTPError as exc:
            out, text = Outcome(tenant="", user=0, turn=0, status=0, error=repr(exc)), ""
        out.tenant, out.user, out.turn = conv.tenant.name, conv.user, turn
        if out.ok:
            conv.history += [
                {"role": "user", "content": conv.questions[turn]},
                {"role": "assistant", "content": text},
            ]
        with lock:
            results.append(out)
            if on_result is not None:
                on_result(out)
        return out

    rng = random.Random(shuffle_seed)
    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            for turn in range(turns):
                order = list(range(len(convs)))
                if shuffle_seed is not None:
                    rng.shuffle(order)
                # A barrier per round: turn t+1 needs turn t's reply in its history.
                list(pool.map(partial(one, turn=turn), order))
    finally:
        for c in clients:
            c.close()
        for t in transports:
            t.close()
    return results


@dataclass(frozen=True)
class Summary:
    """Aggregates of one replay."""

    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    mean_ttft: float
    p90_ttft: float
    mean_latency: float
    p90_latency: float
    per_engine: dict[str, int]
    #: mean TTFT of turns 2 and later: a tenant's first turn is cold whatever the
    #: policy, the later ones show what placement kept warm
    later_mean_ttft: float = 0.0
    #: the engines' own mean prefill time of turns 2 and later (0: none reported)
    later_mean_prefill: float = 0.0

    @property
    def cached_ratio(self) -> float:
        """Engine-reported cached prompt tokens / prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _p90(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return xs[0] if xs else 0.0
    return statistics.quantiles(xs, n=10, method="inclusive")[-1]


def summarize(results: Sequence[Outcome], engines: Sequence[str] = ()) -> Summary:
    """Sum the successful requests of a replay; ``engines`` lists zero-request engines too."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    later = [r.ttft for r in ok if r.ttft is not None and r.turn > 0]
    prefills = [r.prefill for r in ok if r.prefill is not None and r.turn > 0]
    lats = [r.latency for r in ok]
    per_engine = dict.fromkeys(engines, 0)
    for r in ok:
        per_engine[r.engine] = per_engine.get(r.engine, 0) + 1
    return Summary(
        requests=len(results),
        failed=len(results) - len(ok),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        cached_tokens=sum(r.cached_tokens for r in ok),
        mean_ttft=statistics.fmean(ttfts) if ttfts else 0.0,
        p90_ttft=_p90(ttfts),
        mean_latency=statistics.fmean(lats) if lats else 0.0,
        p90_latency=_p90(lats),
        per_engine=per_engine,
        later_mean_ttft=statistics.fmean(later) if later else 0.0,
        later_mean_prefill=statistics.fmean(prefills) if prefills else 0.0,
    )

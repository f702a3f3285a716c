"""prefix_hash: token or character prefixes on a bounded-load ring."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import textwrap
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.core.endpoints import resolve
from meshkit.core.policies import Needs, PrefixHash, create_policy
from meshkit.core.policies.prefix_hash import conversation_head
from meshkit.core.policies.ring import HashRing, bounded_load_pick
from meshkit.core.requests import RequestView, parse_request
from meshkit.core.workers import Candidate
from meshkit.errors import ConfigError


def test_needs_tokens_and_a_character_fallback() -> None:
    p = PrefixHash(prefix_token_count=64, prefix_chars=512, conversation_chars=4096)
    # The text is read up to the conversation's head, at most conversation_chars.
    assert p.needs == Needs(text=True, prefix_tokens=64, prefix_chars=4096)
    assert create_policy("prefix_hash").needs.prefix_tokens == 256
    assert PrefixHash(prefix_chars=9000, conversation_chars=100).needs.prefix_chars == 9000


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("prefix_token_count", 0),
        ("virtual_nodes", 0),
        ("load_factor", 0.9),
        ("prefix_chars", 0),
        ("first_turn_load_factor", 0),
        ("first_turn_load_factor", 1.3),  # above the default load_factor 1.25
        ("spill_memory", -1),
        ("conversation_chars", 0),
        ("owner_share", -0.1),
        ("owner_share", 1.5),
        ("share_half_life_s", 0),
        ("share_memory", 0),
        ("burst_factor", 1.0),
        ("own_turns", 0),
        ("own_turns", 1.5),
    ],
)
def test_bad_options_name_the_key(option: str, value: float) -> None:
    with pytest.raises(ConfigError, match=option):
        create_policy("prefix_hash", {option: value})


def test_same_token_prefix_same_worker_beyond_the_prefix(kit: SimpleNamespace) -> None:
    cs = kit.cands(6)
    p = PrefixHash(prefix_token_count=8, owner_share=0)
    head = list(range(100, 108))
    first = p.select(kit.ctx(cs, kit.view(token_ids=[*head, 1, 2, 3])))
    # Tokens past the prefix and the text do not matter when tokens are present.
    for tail in ([9], [4, 5, 6, 7], []):
        v = kit.view("unrelated text", token_ids=head + tail)
        assert p.select(kit.ctx(cs, v)) == first


def test_character_prefix_when_there_are_no_tokens(kit: SimpleNamespace) -> None:
    cs = kit.cands(6)
    p = PrefixHash(prefix_chars=32, owner_share=0)
    system = "You are a helpful assistant. " * 2  # > 32 characters
    picks = {p.select(kit.ctx(cs, kit.view(system + f"question {i}"))) for i in range(50)}
    assert len(picks) == 1
    # Different prefixes spread over the fleet.
    spread = Counter(p.select(kit.ctx(cs, kit.view(f"{i:04d} hello"))).key for i in range(600))
    assert len(spread) == 6
    assert max(spread.values()) / 100 <= 1.4


def test_token_and_character_keys_live_in_separate_spaces(kit: SimpleNamespace) -> None:
    p = PrefixHash()
    a = p.key_point(kit.ctx(kit.cands(2), kit.view("1,2,3")))
    b = p.key_point(kit.ctx(kit.cands(2), kit.view(token_ids=[1, 2, 3])))
    assert a is not None
    assert b is not None
    assert a != b


def test_no_prefix_at_all_balances_by_load(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = PrefixHash()
    load: dict[str, int] = {}
    for seed in range(40):
        got = p.select(kit.ctx(cs, kit.view(""), load=load, seed=seed))
        load[got.key] = load.get(got.key, 0) + 1
    assert max(load.values()) <= 13  # ceil(1.25 * 40 / 4) = 13


def test_hot_prefix_spills_to_the_next_worker_on_the_ring(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = PrefixHash(load_factor=1.25, owner_share=0)
    v = kit.view("the one hot system prompt")
    load: dict[str, int] = {}
    for _ in range(100):
        got = p.select(kit.ctx(cs, v, load=load))
        load[got.key] = load.get(got.key, 0) + 1
    # Every request in flight at once: the bound keeps everyone near the mean.
    assert max(load.values()) <= -(-1.25 * 100 // 4)
    ring = HashRing([c.key for c in cs])
    point = p.key_point(kit.ctx(cs, v))
    assert point is not None
    owner = ring.owner(point)
    assert owner is not None
    assert load[owner] == max(load.values())


def test_ineligible_owner_is_skipped_and_keys_return(kit: SimpleNamespace) -> None:
    fleet = kit.cands(5)
    p = PrefixHash()
    v = kit.view("a conversation prefix")
    home = p.select(kit.ctx(fleet, v, fleet=fleet, version=7))
    others = [c for c in fleet if c != home]
    away = p.select(kit.ctx(others, v, fleet=fleet, version=7))
    assert away != home
    # The ring is over the whole fleet, so the key returns home when it recovers.
    assert p.select(kit.ctx(fleet, v, fleet=fleet, version=7)) == home


def test_ring_is_rebuilt_only_when_the_fleet_version_changes(kit: SimpleNamespace) -> None:
    fleet = kit.cands(4)
    p = PrefixHash()
    rings = []
    for i in range(20):
        ctx = kit.ctx(fleet[: 2 + i % 3], kit.view(f"x{i}"), fleet=fleet, version=3)
        p.select(ctx)
        rings.append(p._rings.get(ctx))  # the ring select used, unless it rebuilds
    ring = rings[0]
    assert all(r is ring for r in rings)
    assert len(ring.keys) == 4
    bigger = [*fleet, *kit.cands(1, start=9)]
    ctx = kit.ctx(bigger, kit.view("y"), fleet=bigger, version=4)
    p.select(ctx)
    rebuilt = p._rings.get(ctx)
    assert rebuilt is not ring and len(rebuilt.keys) == 5


def test_single_candidate_short_circuits(kit: SimpleNamespace) -> None:
    cs = kit.cands(1)
    assert PrefixHash().select(kit.ctx(cs, kit.view("x"))) == cs[0]


_CHILD = textwrap.dedent(
    """
    import random
    from meshkit.core.endpoints import resolve
    from meshkit.core.policies import PlacementContext, create_policy
    from meshkit.core.requests import RequestView
    from meshkit.core.workers import Candidate, Worker

    chat = resolve("POST", "/v1/chat/completions")
    fleet = [Candidate(Worker(f"http://127.0.0.1:{9000 + i}")) for i in range(1, 8)]
    policies = {
        "prefix_hash": create_policy("prefix_hash", {"prefix_token_count": 16}),
        "session": create_policy("session"),
        "cache_aware": create_policy("cache_aware"),
    }
    out = []
    for i in range(1500):
        r = random.Random(i)
        if i % 3 == 1:
            view = RequestView(match=chat, token_ids=[r.randrange(150_000) for _ in range(24)])
        elif i % 3 == 2:
            # Chats: 40 conversations of 1-4 turns behind 2 system prompts, so that
            # spills, their memory and the first-turn bound all take part.
            system = f"system\\n{i % 2} " + "be helpful " * 150
            turns = [f"user\\nconversation {i % 40} turn {k}" for k in range(r.randrange(1, 5))]
            text = system + "\\n" + "\\nassistant\\nok\\n".join(turns)
            view = RequestView(match=chat, routing_text=text, routing_key=text[:12])
        else:
            text = "".join(r.choice("abcdefgh ") for _ in range(r.randrange(1, 1500)))
            view = RequestView(match=chat, routing_text=text, routing_key=text[:12])
        load = {c.key: r.randrange(6) for c in fleet}
        for name, p in policies.items():
            ctx = PlacementContext(
                candidates=fleet, view=view, load=load, weight={},
                rng=random.Random(i), fleet=fleet, fleet_version=1,
            )
            out.append(p.select(ctx).key[-4:])
    print(",".join(out))
    """
)


def test_placement_is_identical_across_processes_and_hash_seeds() -> None:
    outputs = []
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", _CHILD],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]
    picks = outputs[0].strip().split(",")
    assert len(picks) == 4500
    assert len(set(picks)) == 7  # and they actually spread


def test_without_a_fleet_the_candidates_form_the_ring(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = PrefixHash()
    v = kit.view("some prompt")
    first = p.select(kit.ctx(cs, v, fleet=[]))
    assert p.select(kit.ctx(cs, v, fleet=[])) == first
    assert p.select(kit.ctx(cs, v, fleet=cs)) == first


# -- conversations ---------------------------------------------------------------------

SYSTEM = "system\nYou are the support assistant of ACME. " + "Policy text. " * 120  # > 1024


def chat(system: str, *turns: str, answers: int | None = None) -> str:
    """A chat routing text as requests.py builds it: ``role\\ncontent`` joined by newlines.

    Every user turn but the last is followed by an answer (or the first ``answers``).
    """
    parts = [system] if system else []
    done = len(turns) - 1 if answers is None else answers
    for i, turn in enumerate(turns):
        parts.append("user\n" + turn)
        if i < done:
            parts.append(f"assistant\nanswer {i} to {turn}")
    return "\n".join(parts)


def test_conversation_head_is_the_same_for_every_turn() -> None:
    one = chat(SYSTEM, "hello, my order 123 is late")
    two = chat(SYSTEM, "hello, my order 123 is late", "where is it now?")
    three = chat(SYSTEM, "hello, my order 123 is late", "where is it now?", "thanks")
    end, first = conversation_head(one, 32768) or (0, False)
    assert (end, first) == (len(one), True)
    assert conversation_head(two, 32768) == (end, False)
    assert conversation_head(three, 32768) == (end, False)
    assert two[:end] == one


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("user\nhi", (7, True)),  # no system prompt
        ("user\nhi\nassistant\nhello\nuser\nmore", (7, False)),
        ('[{"type":"function"}]\nuser\nhi', (29, True)),  # tools come first
        ("system\nbe brief", None),  # no user message
        ("a plain completion prompt", None),
        ("", None),
    ],
)
def test_conversation_head_shapes(text: str, expected: tuple[int, bool] | None) -> None:
    assert conversation_head(text, 32768) == expected


def test_a_head_longer_than_the_window_is_cut_the_same_way_every_turn() -> None:
    one = chat("system\nshort", "x" * 500)
    two = chat("system\nshort", "x" * 500, "next")
    assert conversation_head(one, 100) == (100, False)  # unknown: maybe not the first turn
    assert conversation_head(two, 100) == (100, False)
    assert conversation_head("system\n" + "s" * 200 + "\nuser\nhi", 100) is None


def _hot(kit: SimpleNamespace, p: PrefixHash, cs: list[Candidate], text: str) -> dict[str, int]:
    """Loads that put the prefix's owner at the bound and everyone else at 2."""
    owner = p._rings.get(kit.ctx(cs)).owner(p.key_point(kit.ctx(cs, kit.view(text))) or 0)
    load = {c.key: 2 for c in cs}
    load[owner or ""] = 6  # the bound is at most ceil(1.25 * 17 / 4) = 6: the owner is full
    return load


def test_a_spilled_conversation_keeps_its_worker(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = PrefixHash(owner_share=0)
    turns = ["my order 123 is late", "where is it now?", "and the refund?", "thanks"]
    first_text = chat(SYSTEM, turns[0])
    hot = _hot(kit, p, cs, first_text)
    owner = max(hot, key=lambda k: hot[k])
    spilled = p.select(kit.ctx(cs, kit.view(first_text), load=hot))
    assert spilled.key != owner
    # The owner has room again, but the conversation's history is elsewhere.
    for n in range(2, len(turns) + 1):
        text = chat(SYSTEM, *turns[:n])
        assert p.select(kit.ctx(cs, kit.view(text))) == spilled
    # Another conversation of the same prefix still goes to the owner.
    other = chat(SYSTEM, "a different question", "and a follow-up")
    assert p.select(kit.ctx(cs, kit.view(other))).key == owner


def test_a_turn_taken_by_another_router_sends_the_next_back_to_the_ring(
    kit: SimpleNamespace,
) -> None:
    cs = kit.cands(4)
    turns = ["my order 123 is late", "where is it now?", "and the refund?", "thanks"]
    texts = [chat(SYSTEM, *turns[:n], answers=n - 1) for n in range(1, 5)]
    a, b = PrefixHash(owner_share=0), PrefixHash(owner_share=0)
    hot = _hot(kit, a, cs, texts[0])
    owner = max(hot, key=lambda k: hot[k])
    spilled = a.select(kit.ctx(cs, kit.view(texts[0]), load=hot)).key
    assert spilled != owner
    # The second turn went through router b, which never saw the spill: the owner.
    assert b.select(kit.ctx(cs, kit.view(texts[1]))).key == owner
    # Router a sees two answers since its turn: the history is where b sent it.
    assert a.select(kit.ctx(cs, kit.view(texts[2]))).key == owner
    assert (a._turns.own, a._turns.seen) == (0.0, 1.0)
    # Had a taken the second turn too, the conversation would stay where it spilled.
    c = PrefixHash(owner_share=0)
    assert c.select(kit.ctx(cs, kit.view(texts[0]), load=hot)).key == spilled
    assert [c.select(kit.ctx(cs, kit.view(t))).key for t in texts[1:]] == [spilled] * 3
    assert (c._turns.own, c._turns.seen) == (3.0, 3.0)


def test_without_memory_the_conversation_returns_to_the_owner(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = PrefixHash(spill_memory=0, owner_share=0)
    text = chat(SYSTEM, "my order 123 is late")
    hot = _hot(kit, p, cs, text)
    owner = max(hot, key=lambda k: hot[k])
    assert p.select(kit.ctx(cs, kit.view(text), load=hot)).key != owner
    later = chat(SYSTEM, "my order 123 is late", "where is it now?")
    assert p.select(kit.ctx(cs, kit.view(later))).key == owner


def test_a_conversation_spills_to_the_same_worker_in_every_process(kit: SimpleNamespace) -> None:
    cs = kit.cands(6)
    text = chat(SYSTEM, "question", "follow-up")  # a running conversation: no two-choice
    a, b = PrefixHash(owner_share=0), PrefixHash(owner_share=0)
    hot = _hot(kit, a, cs, text)
    assert a.select(kit.ctx(cs, kit.view(text), load=hot)) == b.select(
        kit.ctx(cs, kit.view(text), load=hot)
    )
    # ... and different conversations of one hot prefix spread over the fleet.
    spread = Counter(
        a.select(kit.ctx(cs, kit.view(chat(SYSTEM, f"question {i}", "more")), load=hot)).key
        for i in range(200)
    )
    owner = max(hot, key=lambda k: hot[k])
    assert owner not in spread
    assert len(spread) == 5


def test_a_new_conversation_leaves_the_owner_headroom(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = PrefixHash(first_turn_load_factor=1.0, spill_memory=0, owner_share=0)
    new = chat(SYSTEM, "first question")
    running = chat(SYSTEM, "first question", "second question")
    point = p.key_point(kit.ctx(cs, kit.view(new)))
    owner = p._rings.get(kit.ctx(cs)).owner(point or 0)
    # Total 15: a new conversation may bring the owner to ceil(1.0 * 16 / 4) = 4,
    # a running one to ceil(1.25 * 16 / 4) = 5; the owner holds 4.
    others = iter([4, 4, 3])
    load = {c.key: 4 if c.key == owner else next(others) for c in cs}
    assert p.select(kit.ctx(cs, kit.view(new), load=load)).key != owner
    assert p.select(kit.ctx(cs, kit.view(running), load=load)).key == owner
    # With the factor at load_factor, the new conversation stays too.
    q = PrefixHash(first_turn_load_factor=1.25, spill_memory=0, owner_share=0)
    assert q.select(kit.ctx(cs, kit.view(new), load=load)).key == owner


def test_spill_memory_is_bounded_and_least_recently_used(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = PrefixHash(spill_memory=2, owner_share=0)
    texts = [chat(SYSTEM, f"question {i}", "more") for i in range(3)]
    hot = _hot(kit, p, cs, texts[0])
    for t in texts:
        p.select(kit.ctx(cs, kit.view(t), load=hot))
    point = p.key_point(kit.ctx(cs, kit.view(texts[0])))
    assert point is not None
    convs = [p.conversation_point(kit.view(t), point) for t in texts]
    assert list(p._memory) == [c[0] for c in convs[1:] if c is not None]


def test_a_removed_worker_is_forgotten(kit: SimpleNamespace) -> None:
    cs = kit.cands(3, dp=2)
    p = PrefixHash(owner_share=0)
    hot = _hot(kit, p, cs, chat(SYSTEM, "q"))
    for i in range(40):
        p.select(kit.ctx(cs, kit.view(chat(SYSTEM, f"q{i}", "more")), load=hot))
    keys = {key for key, _ in p._memory.values()}
    assert len(keys) >= 2
    gone = next(c.worker for c in cs if c.key in keys)
    p.on_removed(gone)
    assert p._memory
    assert all(not k.startswith(gone.id) for k, _ in p._memory.values())


@given(
    loads=st.lists(st.integers(0, 30), min_size=2, max_size=8),
    conv=st.integers(0, 50),
    turns=st.integers(1, 4),
    chatty=st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_the_load_bound_always_holds(
    kit: SimpleNamespace, loads: list[int], conv: int, turns: int, chatty: bool
) -> None:
    cs = kit.cands(len(loads))
    p = PrefixHash(spill_memory=4, owner_share=0)
    load = {c.key: n for c, n in zip(cs, loads, strict=True)}
    bound = math.ceil(1.25 * (sum(loads) + 1) / len(loads))
    for k in range(turns):
        text = chat(SYSTEM, *[f"conversation {conv} turn {i}" for i in range(k + 1)])
        if not chatty:
            text = text.replace("user\n", "u:")
        got = p.select(kit.ctx(cs, kit.view(text), load=load))
        assert load[got.key] + 1 <= bound
        # The next turn finds the loads changed: the pick is one request busier.
        load[got.key] += 1
        bound = math.ceil(1.25 * (sum(load.values()) + 1) / len(loads))


def test_requests_that_are_not_chats_are_placed_as_before(kit: SimpleNamespace) -> None:
    cs = kit.cands(5)
    p = PrefixHash(owner_share=0)
    ring = p._rings.get(kit.ctx(cs))
    r = random.Random(3)
    for i in range(300):
        load = {c.key: r.randrange(6) for c in cs}
        v = kit.view(f"prompt {i % 7} " * 100) if i % 2 else kit.view(token_ids=[i % 5] * 300)
        point = p.key_point(kit.ctx(cs, v))
        assert point is not None
        want = bounded_load_pick(ring, point, cs, load, 1.25)
        assert p.select(kit.ctx(cs, v, load=load)) == want


def test_with_token_ids_the_conversation_still_comes_from_the_text(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = PrefixHash(prefix_token_count=8)
    head = list(range(100, 108))  # every request of the tenant: the same first 8 tokens
    owner = p._rings.get(kit.ctx(cs)).owner(p.key_point(kit.ctx(cs, kit.view(token_ids=head))) or 0)
    hot = {c.key: 2 for c in cs}
    hot[owner or ""] = 6
    # Every conversation has the same token ids; the ones placed off the prefix's
    # owner (by the plan's pool or the burst bound) are found again from the text.
    off = 0
    where = set()
    for n in range(12):
        first = kit.view(chat(SYSTEM, f"order {n}"), token_ids=head)
        spilled = p.select(kit.ctx(cs, first, load=hot))
        off += spilled.key != owner
        where.add(spilled.key)
        later = kit.view(chat(SYSTEM, f"order {n}", "and now?"), token_ids=head)
        assert p.select(kit.ctx(cs, later)) == spilled
    assert off >= 3 and len(where) >= 3  # the text, not the ids, spreads them


_Q1 = [{"role": "user", "content": "Q1"}]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"}, *_Q1]}),
        ("/v1/messages", {"system": "be brief", "messages": _Q1}),
        ("/v1/responses", {"instructions": "be brief", "input": _Q1}),
    ],
)
def test_the_head_is_found_in_the_routing_text_meshkit_builds(
    path: str, body: dict[str, Any]
) -> None:
    """The coupling with requests.py: its routing text has ``role\\ncontent`` messages."""
    match = resolve("POST", path)
    assert match is not None
    first = parse_request(match, json.dumps({"model": "m", **body}).encode(), want_text=True)
    later_body = json.loads(json.dumps(body))
    key = "input" if "input" in body else "messages"
    later_body[key] += [{"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]
    later = parse_request(match, json.dumps({"model": "m", **later_body}).encode(), want_text=True)
    head = conversation_head(first.routing_text, 32768)
    assert head == (len(first.routing_text), True)
    assert first.routing_text.endswith("Q1")
    assert conversation_head(later.routing_text, 32768) == (head[0], False)


def test_a_subclass_is_heard_also_in_the_compiled_build(kit: SimpleNamespace) -> None:
    """``PrefixHash`` is compiled in a wheel with interpreted subclasses allowed: a
    plugin's subclass keeps its name, its attributes and its overrides."""
    seen: list[str] = []

    class Logged(PrefixHash):
        name = "logged_prefix_hash"

        def on_placed(self, cand: Candidate, view: RequestView, now: float) -> None:
            seen.append(cand.key)
            super().on_placed(cand, view, now)

    p = Logged()
    p.note = "plugins may keep their own state"  # type: ignore[attr-defined]
    assert p.name == "logged_prefix_hash" and PrefixHash().name == "prefix_hash"
    cs = kit.cands(3)
    v = kit.view("x")
    got = p.select(kit.ctx(cs, v))
    p.on_placed(got, v, 0.0)
    assert seen == [got.key]


def test_every_turn_of_a_chat_with_a_short_first_message_has_one_key(
    kit: SimpleNamespace,
) -> None:
    # Keyed on the first 1,024 characters, turn 2 would take in the first answer
    # and have another owner; a router that did not place turn 1 follows the ring.
    p = PrefixHash()
    cs = kit.cands(8)
    head = "system\nYou are a helpful assistant.\nuser\nhow do tides work?"
    answer = "\nassistant\n" + "the moon pulls the sea. " * 10
    turns = [head, head + answer + "\nuser\nand the sun?"]
    turns.append(turns[1] + answer + "\nuser\n" + "and in a lake? " * 60)
    # (a tokenizer's ids of each turn do not change that)
    points = {p.key_point(kit.ctx(cs, kit.view(t, token_ids=[ord(c) for c in t]))) for t in turns}
    assert len(points) == 1
    ids = list(range(300))
    # each turn through a fresh router: the same worker
    assert len({PrefixHash().select(kit.ctx(cs, kit.view(t), fleet=cs)).key for t in turns}) == 1
    # A head past the key's reach (a long system prompt) keys as before: the token
    # ids when there are some, else the first prefix_chars characters.
    long = "system\n" + "policy " * 200 + "\nuser\nhi"
    assert p.key_point(kit.ctx(cs, kit.view(long, token_ids=ids))) == p.key_point(
        kit.ctx(cs, kit.view("other text", token_ids=ids))
    )
    assert p.key_point(kit.ctx(cs, kit.view(long))) == p.key_point(
        kit.ctx(cs, kit.view(long[:1024] + " and more"))
    )


def test_a_chat_keyed_by_its_own_head_goes_to_its_ring_owner_whatever_the_plan(
    kit: SimpleNamespace,
) -> None:
    # Each such chat is its own prefix: it shares nothing the plan could spread,
    # and routers whose estimates differ would place it apart. However hot it looks
    # to this router, its turns go to the ring's owner.
    cs = kit.cands(4)
    p = PrefixHash()
    head = "user\nwhat is a ring?"
    turns = [head + "\nassistant\nan answer\nuser\nmore " + str(i) for i in range(60)]
    owner = p._rings.get(kit.ctx(cs, fleet=cs)).owner(p.key_point(kit.ctx(cs, kit.view(head))) or 0)
    got = {
        p.select(kit.ctx(cs, kit.view(t), fleet=cs, now=float(i))).key for i, t in enumerate(turns)
    }
    assert got == {owner}


def _short_chat(conv: int, turn: int) -> str:
    parts = ["system\nYou are a helpful assistant."]
    for j in range(turn):
        parts.append(f"user\nchat {conv} question {j}")
        if j < turn - 1:
            parts.append(f"assistant\nanswer {j}")
    return "\n".join(parts)


@pytest.mark.parametrize("routers", [1, 2])
def test_short_chats_stay_put_and_one_router_balances_their_starts(
    kit: SimpleNamespace, routers: int
) -> None:
    """64 chats of 4 turns, four running at a time, their turns dealt over the
    routers in turn. One router places each new one on the less started of two
    ring draws (its memory finds it again); two follow the ring's owner, the one
    draw both make. Neither moves a running chat."""
    ps = [PrefixHash() for _ in range(routers)]
    cs = kit.cands(4)
    starts: Counter[str] = Counter()
    where: dict[int, str] = {}
    moved, now = 0, 0.0
    for batch in range(16):
        for conv in range(batch * 4, batch * 4 + 4):
            for turn in range(1, 5):
                p = ps[(conv + turn) % routers]
                key = p.select(
                    kit.ctx(cs, kit.view(_short_chat(conv, turn)), fleet=cs, now=now)
                ).key
                now += 1.0
                if turn == 1:
                    starts[key] += 1
                moved += turn > 1 and where[conv] != key
                where[conv] = key
    assert moved == 0
    if routers == 1:
        assert max(starts.values()) <= 1.1 * 16


def test_a_first_message_ending_just_under_the_key_keeps_one_key(kit: SimpleNamespace) -> None:
    # Its second turn's "\nassistant\n" starts under prefix_chars and ends past it:
    # the head still ends where the first turn did.
    p = PrefixHash()
    cs = kit.cands(4)
    first = "user\n" + "x" * (1020 - len("user\n"))
    second = first + "\nassistant\nok\nuser\nand then?"
    assert len(first) == 1020
    a = p.key_point(kit.ctx(cs, kit.view(first)))
    assert a == p.key_point(kit.ctx(cs, kit.view(second)))

"""prefix_hash: token or character prefixes on a bounded-load ring."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from types import SimpleNamespace

import pytest

from meshkit.core.policies import Needs, PrefixHash, create_policy
from meshkit.core.policies.ring import HashRing
from meshkit.errors import ConfigError


def test_needs_tokens_and_a_character_fallback() -> None:
    p = PrefixHash(prefix_token_count=64, prefix_chars=512)
    assert p.needs == Needs(text=True, prefix_tokens=64, prefix_chars=512)
    assert create_policy("prefix_hash").needs.prefix_tokens == 256


@pytest.mark.parametrize(
    ("option", "value"),
    [("prefix_token_count", 0), ("virtual_nodes", 0), ("load_factor", 0.9), ("prefix_chars", 0)],
)
def test_bad_options_name_the_key(option: str, value: float) -> None:
    with pytest.raises(ConfigError, match=option):
        create_policy("prefix_hash", {option: value})


def test_same_token_prefix_same_worker_beyond_the_prefix(kit: SimpleNamespace) -> None:
    cs = kit.cands(6)
    p = PrefixHash(prefix_token_count=8)
    head = list(range(100, 108))
    first = p.select(kit.ctx(cs, kit.view(token_ids=[*head, 1, 2, 3])))
    # Tokens past the prefix and the text do not matter when tokens are present.
    for tail in ([9], [4, 5, 6, 7], []):
        v = kit.view("unrelated text", token_ids=head + tail)
        assert p.select(kit.ctx(cs, v)) == first


def test_character_prefix_when_there_are_no_tokens(kit: SimpleNamespace) -> None:
    cs = kit.cands(6)
    p = PrefixHash(prefix_chars=32)
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
    p = PrefixHash(load_factor=1.25)
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


def test_ring_is_rebuilt_only_when_the_fleet_version_changes(
    kit: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    import meshkit.core.policies.prefix_hash as mod

    built: list[int] = []
    real = mod.HashRing

    def counting(keys: list[str], vnodes: int) -> HashRing:
        built.append(len(keys))
        return real(keys, vnodes)

    monkeypatch.setattr(mod, "HashRing", counting)
    fleet = kit.cands(4)
    p = PrefixHash()
    for i in range(20):
        p.select(kit.ctx(fleet[: 2 + i % 3], kit.view(f"x{i}"), fleet=fleet, version=3))
    assert built == [4]
    bigger = [*fleet, *kit.cands(1, start=9)]
    p.select(kit.ctx(bigger, kit.view("y"), fleet=bigger, version=4))
    assert built == [4, 5]


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
    for i in range(1000):
        r = random.Random(i)
        if i % 2:
            view = RequestView(match=chat, token_ids=[r.randrange(150_000) for _ in range(24)])
        else:
            text = "".join(r.choice("abcdefgh ") for _ in range(r.randrange(1, 1500)))
            view = RequestView(match=chat, routing_text=text, routing_key=text[:12])
        load = {c.key: r.randrange(4) for c in fleet}
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
    assert len(picks) == 3000
    assert len(set(picks)) == 7  # and they actually spread


def test_without_a_fleet_the_candidates_form_the_ring(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = PrefixHash()
    v = kit.view("some prompt")
    first = p.select(kit.ctx(cs, v, fleet=[]))
    assert p.select(kit.ctx(cs, v, fleet=[])) == first
    assert p.select(kit.ctx(cs, v, fleet=cs)) == first

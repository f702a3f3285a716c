"""cache_aware without KV events when other routers place the turns between: it
notices, and places chats as ``prefix_hash`` does, alike in every router."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from meshkit.config import MeshConfig
from meshkit.core.policies import CacheAware, PrefixHash
from meshkit.core.policies.cache_aware import _saw_turn_before
from meshkit.core.policies.registry import create_policy
from meshkit.core.workers import Candidate
from meshkit.errors import ConfigError

SYSTEM = "system\nYou are assistant {}. " + "Policy text. " * 20


def _chat(conv: int, turn: int) -> str:
    """Conversation ``conv`` at its ``turn``-th turn (1: new); three tenants."""
    parts = [SYSTEM.format(conv % 3)]
    for k in range(turn):
        parts.append(f"user\nconversation {conv} question {k}: " + "details " * 12)
        if k < turn - 1:
            parts.append(f"assistant\nanswer {k}: " + "explained " * 20)
    return "\n".join(parts)


def _deal(
    kit: SimpleNamespace, routers: list[CacheAware], convs: int = 40, turns: int = 6
) -> tuple[int, list[str]]:
    """Each conversation's turns dealt in turn over the routers, each router seeing
    its own requests in flight (a different worker looks idle to each). Returns the
    follow-ups of the later half of the conversations that moved, and every choice."""
    cs: list[Candidate] = kit.cands(4)
    views = [{c.key: 0 if i == r else 2 for i, c in enumerate(cs)} for r in range(len(routers))]
    where: dict[int, str] = {}
    moved, chosen, now = 0, [], 0.0
    for conv in range(convs):
        for turn in range(1, turns + 1):
            r = (conv + turn) % len(routers)
            v = kit.view(_chat(conv, turn))
            c = routers[r].select(kit.ctx(cs, v, fleet=cs, load=views[r], now=now))
            routers[r].on_placed(c, v, now)
            now += 1.0
            if conv >= convs // 2 and conv in where and where[conv] != c.key:
                moved += 1
            where[conv] = c.key
            chosen.append(c.key)
    return moved, chosen


def test_routers_that_see_every_other_turn_stop_placing_by_their_own_trees(
    kit: SimpleNamespace,
) -> None:
    trees = [CacheAware(own_turns=0), CacheAware(own_turns=0)]
    moved_by_trees, _ = _deal(kit, trees)
    routers = [CacheAware(), CacheAware()]
    moved, _ = _deal(kit, routers)
    # each saw the turn before of none of its conversations' turns
    assert all(r._turns is not None and r._turns.fails() for r in routers)
    # Each tree sends a follow-up it did not see where its own load view points;
    # the ring is the same in both routers.
    assert moved_by_trees >= 50
    assert moved * 2 < moved_by_trees


def test_one_router_keeps_its_tree(kit: SimpleNamespace) -> None:
    one = CacheAware()
    _, chosen = _deal(kit, [one])
    _, by_tree = _deal(kit, [CacheAware(own_turns=0)])
    assert chosen == by_tree
    assert one._turns is not None and one._turns.holds()


def test_what_counts_as_the_turn_before() -> None:
    before, now = _chat(7, 2), _chat(7, 3)
    head_end = now.index("\nassistant\n")
    # the tree holds the previous turn's text: this router placed it
    assert _saw_turn_before(now, head_end, {"w": len(before)}) is True
    # it holds the turn before that one only: another router placed the last
    assert _saw_turn_before(now, head_end, {"w": len(_chat(7, 1))}) is False
    # it holds the tenant's system prompt only: never saw the conversation
    assert _saw_turn_before(now, head_end, {"w": len(SYSTEM.format(1))}) is False
    assert _saw_turn_before(now, head_end, {}) is False
    # it holds the whole text (the same turn sent again): nothing to judge
    assert _saw_turn_before(now, head_end, {"w": len(now)}) is None


def test_the_ring_takes_its_options(kit: SimpleNamespace) -> None:
    opts: dict[str, Any] = {"prefix_chars": 64, "owner_share": 0.5}
    routers = [CacheAware(ring_options=opts) for _ in range(2)]
    _deal(kit, routers)
    assert all(r.ring_placement for r in routers)
    shared = routers[0]._shared
    assert shared is not None and shared.owner_share == 0.5
    cs = kit.cands(4)
    ctx = kit.ctx(cs, kit.view(_chat(1, 1)), fleet=cs)
    # keyed by 64 characters (the chats' heads are longer), as prefix_hash with them
    assert shared.key_point(ctx) == PrefixHash(**opts).key_point(ctx)
    assert shared.key_point(ctx) != PrefixHash().key_point(ctx)
    # the key is the text's: the policy asks for no token ids, in either mode
    assert all(r.needs.prefix_tokens is None for r in routers)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"load_factor": 0.5}, "policies.cache_aware.ring_options.load_factor"),
        ({"no_such_option": 1}, "policies.cache_aware.ring_options"),
        ("prefix_token_count=8", "policies.cache_aware.ring_options"),
    ],
)
def test_bad_ring_options_name_their_key(options: Any, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        CacheAware(ring_options=options)
    assert err.value.key == key


def test_ring_options_from_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "meshkit.toml"
    path.write_text(
        'policy = "cache_aware"\n[policies.cache_aware]\n'
        "ring_options = { prefix_token_count = 512, owner_share = 0.5 }\n",
        encoding="utf-8",
    )
    config = MeshConfig.from_file(path)
    policy = create_policy(config.policy, config.policies["cache_aware"])
    assert isinstance(policy, CacheAware) and policy._shared is not None
    assert (policy._shared.prefix_token_count, policy._shared.owner_share) == (512, 0.5)


def test_a_lone_router_back_on_its_own_turns_returns_to_its_tree(kit: SimpleNamespace) -> None:
    """A client that rewrites an earlier answer of its history sends a follow-up whose
    turn before this router never saw: two such of six counted turns flip a lone
    router to the ring; its own turns after that bring it back to its tree."""
    router = CacheAware()
    cs = kit.cands(4)
    now = 0.0

    def send(text: str) -> None:
        nonlocal now
        v = kit.view(text)
        c = router.select(kit.ctx(cs, v, fleet=cs, now=now))
        router.on_placed(c, v, now)
        now += 1.0

    edited = "answer 0 (edited):"
    for conv in range(2):  # each rewrites its first answer at its fourth turn
        for turn in (1, 2, 3):
            send(_chat(conv, turn))
        # two answers back: the tree holds this turn's history up to its first
        # answer only, as if another router had placed the turns between
        send(_chat(conv, 4).replace("answer 0:", edited))
    assert router.ring_placement
    turn = 5
    while router.ring_placement and turn < 12:
        for conv in range(2):
            send(_chat(conv, turn).replace("answer 0:", edited))
        turn += 1
    assert not router.ring_placement

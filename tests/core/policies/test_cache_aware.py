"""cache_aware: match threshold, per-candidate spill gate, spread misses, shared budget."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from meshkit.core.policies import CacheAware, Needs, create_policy
from meshkit.core.workers import Candidate
from meshkit.errors import ConfigError

SYSTEM_A = "You are the billing assistant of ACME. Answer in one sentence. " * 4
SYSTEM_B = "Tu es un assistant qui parle de cuisine. Reponds en francais. " * 4


def _place(
    p: CacheAware, cand: Candidate, text: str, kit: SimpleNamespace, now: float = 0.0
) -> None:
    p.on_placed(cand, kit.view(text), now)


def test_defaults_and_needs() -> None:
    p = create_policy("cache_aware")
    assert isinstance(p, CacheAware)
    assert p.needs == Needs(text=True, kv_events=True)
    assert (p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold) == (0.3, 4, 1.2)
    assert p.max_tree_size == 8_000_000
    assert CacheAware(match_chars=65536).needs == Needs(
        text=True, prefix_chars=65536, kv_events=True
    )


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("cache_threshold", 1.5),
        ("balance_abs_threshold", -1),
        ("balance_rel_threshold", 0.5),
        ("max_tree_size", 0),
        ("match_chars", 0),
        ("match_slack_chars", -1),
        ("max_models", 0),
        ("ttl_s", 0),
        ("own_turns", -0.1),
        ("own_turns", 1.5),
    ],
)
def test_bad_options_name_the_key(option: str, value: float) -> None:
    with pytest.raises(ConfigError, match=option):
        create_policy("cache_aware", {option: value})


def test_a_good_match_beats_a_small_load_difference(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = CacheAware()
    _place(p, cs[2], SYSTEM_A + "user: first question", kit)
    v = kit.view(SYSTEM_A + "user: second question")
    load = {cs[2].key: 3}
    assert p.select(kit.ctx(cs, v, load=load)) == cs[2]


def test_below_the_threshold_the_least_loaded_wins(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = CacheAware(cache_threshold=0.5)
    _place(p, cs[2], "short shared", kit)
    v = kit.view("short shared" + " and a much longer, entirely new question" * 3)
    load = {cs[0].key: 2, cs[1].key: 1, cs[2].key: 1, cs[3].key: 0}
    assert p.select(kit.ctx(cs, v, load=load)) == cs[3]


def test_spill_gate_is_per_candidate(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = CacheAware()
    _place(p, cs[0], SYSTEM_A, kit)
    _place(p, cs[1], SYSTEM_B, kit)
    # mean = 35: cs[0] is hot (100 > 52.5 and 100 > 67); cs[1] at 40 is not.
    load = {cs[0].key: 100, cs[1].key: 40, cs[2].key: 0, cs[3].key: 0}
    hot = p.select(kit.ctx(cs, kit.view(SYSTEM_A + "user: hi"), load=load))
    assert hot in (cs[2], cs[3])
    warm = p.select(kit.ctx(cs, kit.view(SYSTEM_B + "user: salut"), load=load))
    assert warm == cs[1]


def test_both_gates_must_trip(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = CacheAware()
    _place(p, cs[0], SYSTEM_A, kit)
    # 4x the mean but only 3 above it: the absolute gate keeps the match.
    load = {cs[0].key: 4, cs[1].key: 0, cs[2].key: 0, cs[3].key: 0}
    assert p.select(kit.ctx(cs, kit.view(SYSTEM_A + "x"), load=load)) == cs[0]
    assert p.is_hot(100, 35)
    assert not p.is_hot(40, 35)  # 5 above the mean but under 1.2x
    assert not p.is_hot(4, 1)  # 4x the mean but only 3 above


def test_a_hot_best_match_spills_to_the_next_best_match(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = CacheAware()
    _place(p, cs[0], SYSTEM_A + "user: the long conversation so far", kit)
    _place(p, cs[1], SYSTEM_A, kit)
    load = {cs[0].key: 100, cs[1].key: 10, cs[2].key: 0, cs[3].key: 0}
    v = kit.view(SYSTEM_A + "user: the long conversation so far, continued")
    assert p.select(kit.ctx(cs, v, load=load)) == cs[1]


def test_equal_matches_go_to_the_least_loaded(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = CacheAware()
    for c in cs[:3]:
        _place(p, c, SYSTEM_A, kit)
    load = {cs[0].key: 5, cs[1].key: 2, cs[2].key: 4, cs[3].key: 0}
    assert p.select(kit.ctx(cs, kit.view(SYSTEM_A + "new user"), load=load)) == cs[1]


def test_a_few_more_matching_characters_do_not_beat_a_shorter_queue(
    kit: SimpleNamespace,
) -> None:
    # Two workers hold the tenant's system prompt; one also saw "user: H...".
    cs = kit.cands(3)
    p = CacheAware()
    _place(p, cs[0], SYSTEM_A + "user: Hello there", kit)
    _place(p, cs[1], SYSTEM_A + "user: What is", kit)
    load = {cs[0].key: 6, cs[1].key: 2, cs[2].key: 0}
    v = kit.view(SYSTEM_A + "user: Help me")
    assert p.select(kit.ctx(cs, v, load=load)) == cs[1]
    # Without slack the longest match wins whatever its queue.
    strict = CacheAware(match_slack_chars=0)
    _place(strict, cs[0], SYSTEM_A + "user: Hello there", kit)
    _place(strict, cs[1], SYSTEM_A + "user: What is", kit)
    assert strict.select(kit.ctx(cs, v, load=load)) == cs[0]


def test_a_much_longer_match_beats_a_shorter_queue(kit: SimpleNamespace) -> None:
    cs = kit.cands(3)
    p = CacheAware()
    history = SYSTEM_A + "user: " + "a long earlier turn of this conversation. " * 10
    _place(p, cs[0], history, kit)
    _place(p, cs[1], SYSTEM_A, kit)
    load = {cs[0].key: 6, cs[1].key: 0, cs[2].key: 0}
    assert p.select(kit.ctx(cs, kit.view(history + "user: next"), load=load)) == cs[0]


def test_misses_spread_over_idle_replicas(kit: SimpleNamespace) -> None:
    # sglang#32983: a fleet-wide rule sent every miss to the same replica.
    cs = kit.cands(4)
    p = CacheAware()
    _place(p, cs[0], SYSTEM_A, kit)
    picks = Counter(
        p.select(kit.ctx(cs, kit.view(f"{SYSTEM_B[:20]} unseen request {i}"))).key
        for i in range(400)
    )
    assert len(picks) == 4
    assert max(picks.values()) < 160
    # ... and deterministically: the same miss goes to the same replica.
    v = kit.view("the same unseen request")
    assert len({p.select(kit.ctx(cs, v, seed=s)) for s in range(10)}) == 1


def test_routers_agree_where_the_misses_of_one_head_go(kit: SimpleNamespace) -> None:
    # Two routers that know nothing of a prompt (a miss everywhere, equal loads)
    # send prompts of one head (a tenant's first 256 characters) to one worker, so
    # that worker's cache serves the rest; a head it has not seen goes elsewhere.
    cs = kit.cands(4)
    routers = [CacheAware(), CacheAware()]
    head = SYSTEM_B + SYSTEM_A + "user: "
    assert len(head) > routers[0].spill_prefix_chars
    picks = {
        p.select(kit.ctx(cs, kit.view(head + f"question {i} " * (i + 1)))).key
        for i in range(20)
        for p in routers
    }
    assert len(picks) == 1
    others = {
        routers[0].select(kit.ctx(cs, kit.view(f"tenant {i}: " + SYSTEM_A))).key for i in range(40)
    }
    assert len(others) == 4  # different heads still spread over the idle workers


def test_the_tree_budget_is_shared_by_all_workers(kit: SimpleNamespace) -> None:
    cs = kit.cands(8)
    p = CacheAware(max_tree_size=5_000)
    for i in range(2_000):
        _place(p, cs[i % 8], f"conversation {i:05d} " + "lorem ipsum " * 10, kit, now=float(i))
    tree = p.tree(None)
    assert tree is not None
    assert tree.size <= 5_000
    # Recent conversations are still matched, old ones are gone.
    assert tree.match("conversation 01999 lorem")
    old = tree.match("conversation 00001 " + "lorem ipsum " * 10)
    assert max(old.values(), default=0) < len("conversation 00001 ")


def test_dp_ranks_share_their_origins_cache(kit: SimpleNamespace) -> None:
    cs = kit.cands(2, dp=2)
    p = CacheAware()
    _place(p, cs[0], SYSTEM_A, kit)
    load = {cs[0].key: 3, cs[1].key: 1, cs[2].key: 0, cs[3].key: 0}
    # Rank 1 of the same worker holds the same cache and is less loaded.
    assert p.select(kit.ctx(cs, kit.view(SYSTEM_A + "x"), load=load)) == cs[1]


def test_removed_worker_is_forgotten(kit: SimpleNamespace) -> None:
    cs = kit.cands(3)
    p = CacheAware()
    _place(p, cs[0], SYSTEM_A, kit)
    _place(p, cs[1], SYSTEM_B, kit)
    p.on_removed(cs[0].worker)
    tree = p.tree(None)
    assert tree is not None
    assert cs[0].origin not in tree.tenants()
    p.on_removed(cs[1].worker)
    assert p.tree(None) is None


def test_models_have_separate_trees_and_a_bounded_count(kit: SimpleNamespace) -> None:
    cs = kit.cands(3)
    p = CacheAware(max_models=2)
    p.on_placed(cs[0], kit.view(SYSTEM_A, model="a"), 0.0)
    load = {cs[0].key: 1}
    # Model b has never seen SYSTEM_A: a miss, least loaded.
    assert p.select(kit.ctx(cs, kit.view(SYSTEM_A, model="b"), load=load)) != cs[0]
    assert p.select(kit.ctx(cs, kit.view(SYSTEM_A, model="a"), load=load)) == cs[0]
    p.on_placed(cs[1], kit.view("x", model="b"), 0.0)
    p.on_placed(cs[1], kit.view("x", model="c"), 0.0)
    assert p.tree("a") is None
    assert p.tree("b") is not None
    assert p.tree("c") is not None


def test_match_chars_caps_what_is_read_and_stored(kit: SimpleNamespace) -> None:
    cs = kit.cands(2)
    p = CacheAware(match_chars=100)
    p.on_placed(cs[0], kit.view("a" * 1000), 0.0)
    tree = p.tree(None)
    assert tree is not None
    assert tree.size == 100
    load = {cs[0].key: 1}
    assert p.select(kit.ctx(cs, kit.view("a" * 100 + "b" * 900), load=load)) == cs[0]


def test_sweep_enforces_ttl_and_budget(kit: SimpleNamespace) -> None:
    cs = kit.cands(2)
    p = CacheAware(ttl_s=60)
    p.on_placed(cs[0], kit.view("old prompt"), 0.0)
    p.on_placed(cs[1], kit.view("new prompt"), 100.0)
    freed = p.sweep(now=100.0)
    assert freed == len("old prompt")
    tree = p.tree(None)
    assert tree is not None
    assert tree.tenants() == {cs[1].origin}
    assert p.sweep(now=1000.0) == len("new prompt")
    assert p.tree(None) is None


def test_empty_text_and_single_candidate(kit: SimpleNamespace) -> None:
    cs = kit.cands(3)
    p = CacheAware()
    p.on_placed(cs[0], kit.view(""), 0.0)
    assert p.tree(None) is None
    load = {cs[0].key: 2, cs[1].key: 0, cs[2].key: 1}
    assert p.select(kit.ctx(cs, kit.view(""), load=load)) == cs[1]
    assert p.select(kit.ctx(cs[:1], kit.view("x"))) == cs[0]


def test_a_removed_workers_recent_work_is_forgotten_on_every_rank(kit: SimpleNamespace) -> None:
    cs = kit.cands(2, dp=2)  # two workers, two ranks each
    p = CacheAware()
    for c in cs:
        p.on_placed(c, kit.view("x"), 0.0)
    p.on_removed(cs[0].worker)
    assert p._recent.values([c.key for c in cs], 0.0) == [0.0, 0.0, 1.0, 1.0]


# -- recent work ----------------------------------------------------------------------

CHAT_SYSTEM = "system\nYou are the billing assistant of ACME. " + "Policy text. " * 20


def _turns(conv: int, n: int) -> str:
    """A chat routing text: conversation ``conv`` at its ``n``-th turn (1: new)."""
    parts = [CHAT_SYSTEM]
    for k in range(n):
        parts.append(f"user\nconversation {conv} question {k}: " + "details " * 12)
        if k < n - 1:
            parts.append(f"assistant\nanswer {k}: " + "explained " * 20)
    return "\n".join(parts)


def _run(
    p: CacheAware, cs: list[Candidate], kit: SimpleNamespace, texts: list[str]
) -> Counter[str]:
    """Place each text with nothing in flight (1-4 requests at once look like this)."""
    placed: Counter[str] = Counter()
    for i, text in enumerate(texts):
        v = kit.view(text)
        c = p.select(kit.ctx(cs, v, now=float(i)))
        p.on_placed(c, v, float(i))
        placed[c.key] += 1
    return placed


def test_a_hot_tenant_spreads_on_recent_work_not_in_flight(kit: SimpleNamespace) -> None:
    # One-turn requests of one tenant, none in flight: the tree alone pins them all.
    cs = kit.cands(4)
    texts = [_turns(i, 1) for i in range(80)]
    pinned = _run(CacheAware(load_factor=None), cs, kit, texts)
    assert max(pinned.values()) == 80
    spread = _run(CacheAware(), cs, kit, texts)
    assert len(spread) == 4
    assert max(spread.values()) <= 1.25 * 20 + 4


def test_long_conversations_are_balanced_by_their_starts(kit: SimpleNamespace) -> None:
    # 16 conversations of 12 turns of one tenant, four running at a time: every
    # first turn matches the system prompt on the worker that took the first one.
    cs = kit.cands(4)
    texts = [
        _turns(c, t)
        for batch in range(4)
        for t in range(1, 13)
        for c in range(batch * 4, batch * 4 + 4)
    ]

    def per_worker(p: CacheAware) -> list[int]:
        placed = _run(p, cs, kit, texts)
        return sorted(placed.get(c.key, 0) for c in cs)

    by_requests = per_worker(CacheAware(conversation_slack=1e9))
    by_starts = per_worker(CacheAware())
    mean = len(texts) / 4
    assert max(by_starts) / mean <= 1.25
    assert max(by_requests) / mean > max(by_starts) / mean
    # A conversation's later turns stay with their history: 16 starts, nothing moved.
    p = CacheAware()
    where: dict[int, set[str]] = {}
    for i, text in enumerate(texts):
        v = kit.view(text)
        c = p.select(kit.ctx(cs, v, now=float(i)))
        p.on_placed(c, v, float(i))
        where.setdefault(int(text.split("conversation ")[1].split()[0]), set()).add(c.key)
    assert all(len(keys) == 1 for keys in where.values())


def test_conversation_slack_is_validated() -> None:
    with pytest.raises(ConfigError, match="conversation_slack"):
        create_policy("cache_aware", {"conversation_slack": -1})


def test_a_subclass_is_heard_also_in_the_compiled_build(kit: SimpleNamespace) -> None:
    """``CacheAware`` is compiled in a wheel (``hatch_build.py``) with interpreted
    subclasses allowed: a plugin's subclass names itself and its override of the
    spill gate decides, as in the interpreted build."""
    gates: list[tuple[int, float]] = []

    class NeverHot(CacheAware):
        name = "never_hot"

        def is_hot(self, load: int, mean: float) -> bool:
            gates.append((load, mean))
            return False

    cs = kit.cands(4)
    p = NeverHot()
    assert p.name == "never_hot" and CacheAware().name == "cache_aware"
    _place(p, cs[0], SYSTEM_A, kit)
    # cs[0] is hot for CacheAware's own gate (see test_spill_gate_is_per_candidate)
    load = {cs[0].key: 100, cs[1].key: 40, cs[2].key: 0, cs[3].key: 0}
    assert p.select(kit.ctx(cs, kit.view(SYSTEM_A + "user: hi"), load=load)) == cs[0]
    assert gates == [(100, 35.0)]
    assert create_policy(p) is p

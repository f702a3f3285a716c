"""The approximate radix tree: matches, LRU budget, tenants."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.core.policies.radix import RadixTree


def _lcp(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _stored_chars(tree: RadixTree) -> tuple[int, int]:
    """Recount (characters, nodes) by walking the tree (checks the bookkeeping)."""
    chars = nodes = 0
    stack = list(tree._root.children.values())
    while stack:
        node = stack.pop()
        chars += len(node.label)
        nodes += 1
        for child in node.children.values():
            assert child.parent is node
            # Tenants below are a subset of tenants above.
            assert set(child.tenants) <= set(node.tenants)
        stack.extend(node.children.values())
    return chars, nodes


def test_match_reports_each_tenants_longest_prefix() -> None:
    tree = RadixTree(max_size=None)
    tree.insert("system: be brief\nuser: hi", "A", now=1.0)
    tree.insert("system: be brief\nuser: bye", "B", now=2.0)
    tree.insert("system: other", "C", now=3.0)
    got = tree.match("system: be brief\nuser: hello")
    assert got == {"A": 24, "B": 23, "C": 8}
    assert tree.match("system: be brief\nuser: hello", tenants={"B"}) == {"B": 23}
    assert tree.match("zzz") == {}
    assert tree.match("") == {}
    assert tree.tenants() == {"A", "B", "C"}


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.text("abc", max_size=12), st.sampled_from("XYZ")),
        max_size=40,
    ),
    st.lists(st.text("abc", max_size=14), min_size=1, max_size=10),
)
def test_match_lengths_equal_a_brute_force_reference(
    inserts: list[tuple[str, str]], queries: list[str]
) -> None:
    tree = RadixTree(max_size=None)
    seen: dict[str, list[str]] = {}
    for i, (text, tenant) in enumerate(inserts):
        tree.insert(text, tenant, now=float(i))
        if text:
            seen.setdefault(tenant, []).append(text)
    for q in queries:
        want = {t: max(_lcp(q, s) for s in texts) for t, texts in seen.items()}
        want = {t: n for t, n in want.items() if n > 0}
        assert tree.match(q) == want
    chars, nodes = _stored_chars(tree)
    assert (chars, nodes) == (tree.size, tree.node_count)


def test_budget_holds_under_100k_random_inserts() -> None:
    rng = random.Random(7)
    tree = RadixTree(max_size=50_000)
    prefixes = [
        "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(5, 60))) for _ in range(300)
    ]
    for i in range(100_000):
        text = rng.choice(prefixes) + "".join(
            rng.choice("abcd") for _ in range(rng.randrange(0, 40))
        )
        tree.insert(text, f"w{rng.randrange(8)}", now=float(i))
        assert tree.size <= 50_000
    chars, nodes = _stored_chars(tree)
    assert (chars, nodes) == (tree.size, tree.node_count)
    assert tree.size > 40_000  # evictions free what they must, not everything
    assert len(tree._heap) <= 2 * tree.node_count + 64  # stale LRU entries are compacted


def test_lru_heap_stays_bounded_without_evictions() -> None:
    tree = RadixTree(max_size=None)
    for i in range(5_000):
        tree.insert("the same hot prompt", "w", now=float(i))
        tree.insert(f"prompt {i % 10}", "w", now=float(i))
    assert len(tree._heap) <= 2 * tree.node_count + 64
    # Compaction kept the LRU order right.
    tree.evict_to(tree.size - 1)
    assert tree.match("the same hot prompt") == {"w": 19}


def test_eviction_is_least_recently_used_first() -> None:
    tree = RadixTree(max_size=30)
    tree.insert("a" * 10, "w", now=1.0)
    tree.insert("b" * 10, "w", now=2.0)
    tree.insert("c" * 10, "w", now=3.0)
    tree.insert("a" * 10, "w", now=4.0)  # touch a: b is now the oldest
    tree.insert("d" * 10, "w", now=5.0)
    assert tree.match("b" * 10) == {}
    assert set(tree.match("a" * 10)) == {"w"}
    assert set(tree.match("c" * 10)) == {"w"}
    tree.insert("e" * 10, "w", now=6.0)
    assert tree.match("c" * 10) == {}
    assert tree.size == 30


def test_eviction_trims_the_tail_of_a_path_first() -> None:
    tree = RadixTree(max_size=None)
    tree.insert("shared-prefix|one", "w1", now=1.0)
    tree.insert("shared-prefix|two", "w2", now=2.0)
    assert tree.size == len("shared-prefix|") + 6
    freed = tree.evict_to(tree.size - 1)
    assert freed == 3  # the older leaf "one"
    assert tree.match("shared-prefix|one") == {"w1": 14, "w2": 14}
    tree.evict_to(len("shared-prefix|"))
    # The inner node became a leaf and is evicted only when still over budget.
    assert tree.match("shared-prefix|") == {"w1": 14, "w2": 14}
    tree.evict_to(0)
    assert tree.size == 0
    assert tree.node_count == 0
    assert tree.match("shared") == {}


def test_remove_tenant_drops_its_private_branches_only() -> None:
    tree = RadixTree(max_size=None)
    tree.insert("common prefix A-only tail", "A", now=1.0)
    tree.insert("common prefix B tail", "B", now=1.0)
    freed = tree.remove_tenant("A")
    assert freed == len("A-only tail")
    assert tree.match("common prefix A-only tail") == {"B": 14}
    assert tree.tenants() == {"B"}
    assert _stored_chars(tree) == (tree.size, tree.node_count)
    tree.remove_tenant("B")
    assert tree.size == 0
    assert tree.node_count == 0
    # The tree still works after everything left.
    tree.insert("again", "C", now=2.0)
    assert tree.match("again") == {"C": 5}


def test_sweep_forgets_idle_tenancies() -> None:
    tree = RadixTree(max_size=None)
    tree.insert("shared old", "A", now=1.0)
    tree.insert("shared new", "B", now=100.0)
    tree.insert("shared", "A", now=100.0)
    tree.sweep(older_than=50.0)
    # A kept only what it touched at 100: "shared", not the old " old" branch.
    assert tree.match("shared old") == {"A": 6, "B": 7}
    assert tree.match("shared new") == {"A": 6, "B": 10}
    assert _stored_chars(tree) == (tree.size, tree.node_count)


def test_insert_larger_than_the_budget_keeps_the_tree_in_budget() -> None:
    tree = RadixTree(max_size=10)
    tree.insert("x" * 25, "w", now=1.0)
    assert tree.size <= 10
    with pytest.raises(ValueError, match="max_size"):
        RadixTree(max_size=0)


def test_clear() -> None:
    tree = RadixTree()
    tree.insert("abc", "w", 1.0)
    tree.clear()
    assert len(tree) == 0
    assert tree.size == 0
    assert tree.match("abc") == {}


def test_one_text_longer_than_the_budget_keeps_the_others() -> None:
    # A single client prompt over the budget used to evict every tenant's prefixes,
    # then itself: the tree ended empty.
    t = RadixTree(max_size=1000)
    for i in range(20):
        t.insert(f"prompt {i:02d} " + "x" * 30, f"w{i % 4}", float(i))
    before = t.size
    t.insert("G" * 1200, "w9", 30.0)
    assert 0 < t.size <= 1000
    assert t.match("G" * 1200, {"w9"})["w9"] == 500  # its head, half the budget
    kept = sum(
        t.match(f"prompt {i:02d} " + "x" * 30, {f"w{i % 4}"})[f"w{i % 4}"] > 0 for i in range(20)
    )
    assert kept >= 10
    assert before <= 1000

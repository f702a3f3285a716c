"""
Approximate radix tree
======================

A character-level radix tree (compressed edges) that remembers which *tenants*
(worker origins) were recently sent which prompt prefixes. It is approximate: it
records what meshkit routed, not what the workers actually keep, so it may
believe a prefix is cached after the worker evicted it, and it does not know the
tokens a worker generated.

Each node stores the tenants that hold the prefix ending at it, with the
caller's ``now`` of their last access. Inserting a text for a tenant marks every
node on its path, so a tenant present at a node is present at all its ancestors;
one walk down the tree therefore yields every tenant's match length.

Memory is bounded by ``max_size`` characters *for the whole tree*, shared by all
tenants (a per-worker budget grows with the fleet, smg#2137; an unbounded trie
ran routers out of memory, production-stack#687). When an insert takes the tree
over budget, the least recently used leaves are evicted until it fits. Leaves
wait in a heap keyed by a global access counter; stale heap entries are skipped
and the heap is compacted when they pile up, so it stays ``O(nodes)``.

Matching and inserting cost ``O(len(text))``: edges are compared with
:meth:`str.startswith` (and a binary search for the point where they diverge),
so the per-character work runs in C and Python only loops once per edge.

Usage::

    tree = RadixTree(max_size=2_000_000)
    tree.insert("system: be brief\\nuser: hi", "http://w1:8000", now=12.0)
    tree.match("system: be brief\\nuser: bye")   # {"http://w1:8000": 23}

.. autoclass:: RadixTree
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection
from typing import Final

__all__ = ["RadixTree"]

#: one text holds at most 1/_ONE_TEXT of the tree's budget
_ONE_TEXT: Final = 2


class _Node:
    __slots__ = ("children", "label", "parent", "tenants", "tick")

    def __init__(self, label: str, parent: _Node | None) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, _Node] = {}
        #: tenant -> the caller's ``now`` at its last insert through this node
        self.tenants: dict[str, float] = {}
        #: global access order (the LRU key)
        self.tick = 0


def _common_len(text: str, pos: int, label: str) -> int:
    """Length of the common prefix of ``text[pos:]`` and ``label``."""
    if text.startswith(label, pos):
        return len(label)
    # Binary search over prefix lengths: each probe is one C-level comparison.
    lo, hi = 0, min(len(label), len(text) - pos)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(label[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixTree:
    """Prefix tree of routed texts with per-tenant stamps and an LRU budget.

    :param max_size: the budget in characters of edge labels (``None``: unbounded,
        for tests). Every node holds at least one character, so this also bounds
        the node count.
    """

    __slots__ = ("_heap", "_root", "_seq", "_tick", "max_size", "node_count", "size")

    def __init__(self, max_size: int | None = 2_000_000) -> None:
        if max_size is not None and max_size < 1:
            raise ValueError("max_size must be >= 1")
        self.max_size = max_size
        self._root = _Node("", None)
        #: characters stored (sum of edge label lengths)
        self.size = 0
        #: nodes below the root
        self.node_count = 0
        self._tick = 0
        self._seq = itertools.count()
        self._heap: list[tuple[int, int, _Node]] = []

    # -- queries -----------------------------------------------------------------

    def match(self, text: str, tenants: Collection[str] | None = None) -> dict[str, int]:
        """Matched characters per tenant (only tenants with a match > 0 appear).

        :param tenants: restrict the answer to these tenants (the eligible origins).
        """
        out: dict[str, int] = {}
        node = self._root
        pos, n = 0, len(text)
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                break
            k = _common_len(text, pos, child.label)
            pos += k
            # Tenants deeper down are a subset of those above: overwriting with the
            # deeper position gives each tenant its longest match.
            if tenants is None:
                for t in child.tenants:
                    out[t] = pos
            else:
                for t in child.tenants:
                    if t in tenants:
                        out[t] = pos
            if k < len(child.label):
                break
            node = child
        return out

    def tenants(self) -> set[str]:
        """Every tenant with at least one prefix in the tree."""
        return set(self._root.tenants)

    def __len__(self) -> int:
        return self.node_count

    # -- updates -----------------------------------------------------------------

    def insert(self, text: str, tenant: str, now: float) -> None:
        """Record that ``tenant`` was sent ``text`` at ``now``; evict LRU leaves if over budget."""
        if not text:
            return
        if self.max_size is not None and len(text) > self.max_size // _ONE_TEXT:
            # One prompt longer than the budget would evict every other tenant's
            # prefixes and then itself: keep its head, the part later requests share.
            text = text[: self.max_size // _ONE_TEXT]
            if not text:
                return
        self._tick += 1
        tick = self._tick
        node = self._root
        node.tenants[tenant] = now
        node.tick = tick
        pos, n = 0, len(text)
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node)
                leaf.tenants[tenant] = now
                leaf.tick = tick
                node.children[text[pos]] = leaf
                self.size += n - pos
                self.node_count += 1
                node = leaf
                break
            k = _common_len(text, pos, child.label)
            if k < len(child.label):
                child = self._split(node, child, k)
            child.tenants[tenant] = now
            child.tick = tick
            node = child
            pos += k
        if not node.children and node is not self._root:
            heapq.heappush(self._heap, (tick, next(self._seq), node))
        if self.max_size is not None and self.size > self.max_size:
            self.evict_to(self.max_size)
        elif len(self._heap) > 2 * self.node_count + 64:
            self._rebuild_heap()

    def _split(self, parent: _Node, child: _Node, k: int) -> _Node:
        """Cut ``child``'s edge after ``k`` characters; return the new upper node."""
        mid = _Node(child.label[:k], parent)
        mid.tenants = dict(child.tenants)
        mid.tick = child.tick
        parent.children[mid.label[0]] = mid
        child.label = child.label[k:]
        child.parent = mid
        mid.children[child.label[0]] = child
        self.node_count += 1
        return mid

    def evict_to(self, max_size: int) -> int:
        """Evict least recently used leaves until at most ``max_size`` characters remain.

        :returns: the number of characters evicted.
        """
        freed = 0
        heap = self._heap
        while self.size > max_size and heap:
            tick, _, node = heapq.heappop(heap)
            if node.parent is None or node.children or node.tick != tick:
                continue  # stale: detached, grew children, or touched since
            freed += self._detach(node)
            parent = node.parent
            node.parent = None
            if parent is not self._root and parent is not None and not parent.children:
                heapq.heappush(heap, (parent.tick, next(self._seq), parent))
        if self.size > max_size:  # pragma: no cover - the heap always covers every leaf
            self._rebuild_heap()
        return freed

    def _detach(self, node: _Node) -> int:
        """Unlink ``node`` and its subtree; return the characters freed."""
        parent = node.parent
        if parent is not None:
            del parent.children[node.label[0]]
        freed, count = 0, 0
        stack = [node]
        while stack:
            cur = stack.pop()
            freed += len(cur.label)
            count += 1
            stack.extend(cur.children.values())
            if cur is not node:
                cur.parent = None
        self.size -= freed
        self.node_count -= count
        return freed

    def remove_tenant(self, tenant: str) -> int:
        """Forget ``tenant`` everywhere (a worker left); drop nodes nobody holds.

        :returns: the number of characters freed.
        """
        return self._prune(lambda tenants: tenants.pop(tenant, None))

    def sweep(self, older_than: float) -> int:
        """Forget tenancies last accessed before ``older_than``; drop nodes nobody holds.

        :returns: the number of characters freed.
        """

        def expire(tenants: dict[str, float]) -> None:
            for t in [t for t, at in tenants.items() if at < older_than]:
                del tenants[t]

        return self._prune(expire)

    def _prune(self, edit: Callable[[dict[str, float]], object]) -> int:
        edit(self._root.tenants)
        freed = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                edit(child.tenants)
                if child.tenants:
                    stack.append(child)
                else:
                    # Tenants below are a subset of these: the whole subtree is empty.
                    freed += self._detach(child)
                    child.parent = None
        self._rebuild_heap()
        return freed

    def _rebuild_heap(self) -> None:
        heap: list[tuple[int, int, _Node]] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                heap.append((node.tick, next(self._seq), node))
        heapq.heapify(heap)
        self._heap = heap

    def clear(self) -> None:
        self._root = _Node("", None)
        self.size = 0
        self.node_count = 0
        self._heap = []

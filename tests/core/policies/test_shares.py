"""Traffic shares: decayed counts, jump hash, the plan, and prefix_hash on it."""

from __future__ import annotations

import math
import random
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.core.policies import PrefixHash
from meshkit.core.policies.ring import HashRing
from meshkit.core.policies.shares import SLOT_FRACTION, Decayed, TrafficShares, jump_hash


def _system(tenant: int) -> str:
    return f"system\nYou are the assistant of tenant {tenant}. " + "Rules and facts. " * 80


def _turn(tenant: int, conv: int, k: int) -> str:
    """Turn ``k`` of a conversation: its history, then the new question."""
    parts = [_system(tenant)]
    for i in range(k + 1):
        parts.append(f"user\nconversation {conv} of tenant {tenant}, question {i}")
        if i < k:
            parts.append("assistant\nan answer")
    return "\n".join(parts)


def _zipf_stream(seed: int, tenants: int, n_convs: int) -> list[tuple[int, int, int]]:
    """(tenant, conversation, turn) in the order sent: conversations interleaved."""
    rng = random.Random(seed)
    weights = [1 / (t + 1) ** 1.1 for t in range(tenants)]
    convs = [
        (rng.choices(range(tenants), weights)[0], c, rng.randrange(1, 6)) for c in range(n_convs)
    ]
    out: list[tuple[int, int, int]] = []
    active: list[list[int]] = []  # [tenant, conv, next turn, turns]
    pending = list(convs)
    while pending or active:
        while len(active) < 8 and pending:
            t, c, turns = pending.pop(0)
            active.append([t, c, 0, turns])
        a = rng.choice(active)
        out.append((a[0], a[1], a[2]))
        a[2] += 1
        if a[2] >= a[3]:
            active.remove(a)
    return out


# -- the parts ------------------------------------------------------------------------


def test_jump_hash_moves_only_to_the_new_bucket() -> None:
    keys = [random.Random(i).getrandbits(64) for i in range(4000)]
    for buckets in range(1, 9):
        before = [jump_hash(k, buckets) for k in keys]
        after = [jump_hash(k, buckets + 1) for k in keys]
        assert all(0 <= b < buckets for b in before)
        moved = [a for b, a in zip(before, after, strict=True) if a != b]
        assert set(moved) <= {buckets}  # a key only ever moves to the new bucket
        assert abs(len(moved) / len(keys) - 1 / (buckets + 1)) < 0.03
        spread = Counter(after)
        assert min(spread.values()) > 0.7 * len(keys) / (buckets + 1)


def test_decayed_values_halve_per_half_life_and_keep_the_largest() -> None:
    d: Decayed[int] = Decayed(10.0)
    d.add(1, 8.0, 0.0)
    d.add(2, 2.0, 0.0)
    assert d.values([1, 2], 10.0) == pytest.approx([4.0, 1.0])
    assert d.values([1], 1000.0)[0] == pytest.approx(8.0 * 2**-100)
    d.add(3, 5.0, 1000.0)
    d.keep_largest(1)
    assert len(d) == 1
    assert d.values([3], 1000.0) == [5.0]


def test_tracked_prefixes_are_bounded_by_share_memory() -> None:
    shares = TrafficShares(fit=1.1, half_life_s=300.0, max_prefixes=100)
    hot = 12345
    for i in range(5000):
        shares.observe(hot if i % 2 else i, float(i) / 100)
        assert len(shares) <= 100
    ring = HashRing(["a", "b", "c", "d"])
    # The hot prefix survives the evictions and keeps its slots.
    assert len(shares.plan(ring, ring.keys, 50.0).workers_for(hot, ring)) > 1


def test_a_prefix_gets_slots_in_proportion_to_its_share() -> None:
    ring = HashRing([f"w{i}" for i in range(4)])
    shares = TrafficShares(fit=1.1, half_life_s=300.0, max_prefixes=1000)
    mix = {1: 0.40, 2: 0.10, 3: 0.02}  # and 48 % of one-off prefixes
    rng = random.Random(3)
    for i in range(4000):
        r, acc, point = rng.random(), 0.0, 1_000_000 + i
        for p, s in mix.items():
            acc += s
            if r < acc:
                point = p
                break
        shares.observe(point, 0.0)
    plan = shares.plan(ring, ring.keys, 0.0)
    unit = 1.1 / 4 * SLOT_FRACTION
    assert len(plan.workers_for(1, ring)) == 4  # ceil(0.40 / 0.069) capped at n
    assert len(plan.workers_for(2, ring)) == math.ceil(0.10 / unit)
    walk = list(ring.walk(2))
    assert plan.workers_for(2, ring) == tuple(walk[: math.ceil(0.10 / unit)])
    # A small prefix is background: one worker, on its walk.
    (only,) = plan.workers_for(3, ring)
    assert only == next(k for k in ring.walk(3) if k not in plan.full)
    assert abs(sum(plan.planned.values()) - 1.0) < 1e-6


def test_a_small_prefix_avoids_a_worker_the_plan_filled() -> None:
    ring = HashRing([f"w{i}" for i in range(4)])
    shares = TrafficShares(fit=1.1, half_life_s=300.0, max_prefixes=1000)
    points = [random.Random(i).getrandbits(64) for i in range(2000)]
    hot = [p for p in points if ring.owner(p) == "w0"][:2]
    for i in range(1000):
        # two prefixes of 12 % each, both first on w0; the rest one-off
        shares.observe(hot[i % 2] if i % 25 < 6 else 10**9 + i, 0.0)
    plan = shares.plan(ring, ring.keys, 0.0)
    assert plan.full == {"w0"}  # planned past 1 / n by the two
    cold = next(p for p in points if ring.owner(p) == "w0" and p not in hot)
    (there,) = plan.workers_for(cold, ring)
    assert there == next(k for k in ring.walk(cold) if k != "w0")


# -- prefix_hash on the plan ----------------------------------------------------------


def test_every_turn_of_a_conversation_keeps_its_worker(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = PrefixHash()
    last: dict[int, str] = {}
    moved = follow_ups = 0
    workers_of_tenant: dict[int, set[str]] = {}
    for step, (t, c, k) in enumerate(_zipf_stream(1, 6, 300)):
        got = p.select(kit.ctx(cs, kit.view(_turn(t, c, k)), now=step * 0.01)).key
        if step >= 200:  # once the plan is made, only a replan may move one
            workers_of_tenant.setdefault(t, set()).add(got)
            if c in last:
                follow_ups += 1
                moved += last[c] != got
        last[c] = got
    assert follow_ups > 300
    assert moved / follow_ups <= 0.03
    # The hottest tenant (> 1 / n of the traffic) is spread over several workers.
    assert len(workers_of_tenant[0]) >= 2


def test_the_plan_balances_at_low_concurrency_where_the_ring_cannot(
    kit: SimpleNamespace,
) -> None:
    cs = kit.cands(4)
    stream = _zipf_stream(2, 12, 600)

    def imbalance(policy: PrefixHash) -> float:
        per: Counter[str] = Counter()
        for step, (t, c, k) in enumerate(stream):
            # Nothing in flight at placement: one request at a time.
            per[policy.select(kit.ctx(cs, kit.view(_turn(t, c, k)), now=step * 0.01)).key] += 1
        return max(per.values()) / (len(stream) / len(cs))

    planned, ring_only = imbalance(PrefixHash()), imbalance(PrefixHash(share_fit=0))
    assert planned <= 1.25 < ring_only


def test_routers_that_see_different_quarters_of_the_traffic_agree(
    kit: SimpleNamespace,
) -> None:
    cs = kit.cands(4)
    routers = [PrefixHash() for _ in range(4)]
    rng = random.Random(5)
    stream = _zipf_stream(3, 12, 2000)
    for step, (t, c, k) in enumerate(stream):
        rng.choice(routers).select(kit.ctx(cs, kit.view(_turn(t, c, k)), now=step * 0.01))
    # Every router places the next turn of each conversation: how often do all agree?
    final = {c: (t, k + 1) for t, c, k in stream}
    agree = 0
    for c, (t, k) in final.items():
        view = kit.view(_turn(t, c, k))
        picks = {r.select(kit.ctx(cs, view, now=len(stream) * 0.01)).key for r in routers}
        agree += len(picks) == 1
    assert agree / len(final) >= 0.85


def test_without_fleet_changes_the_plan_is_stable_across_replans(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    p = PrefixHash()
    stream = _zipf_stream(4, 8, 1500)
    for step, (t, c, k) in enumerate(stream):
        p.select(kit.ctx(cs, kit.view(_turn(t, c, k)), now=step * 0.01))
    probe = [kit.view(_turn(t, c, 0)) for t, c, _ in stream[:200]]
    first = [p.select(kit.ctx(cs, v, now=20.0)).key for v in probe]
    second = [p.select(kit.ctx(cs, v, now=20.0)).key for v in probe]  # 200 more: a replan
    assert sum(a == b for a, b in zip(first, second, strict=True)) / len(first) >= 0.95


@given(
    loads=st.lists(st.integers(0, 30), min_size=2, max_size=8),
    conv=st.integers(0, 50),
    tenant=st.integers(0, 3),
)
@settings(max_examples=200, deadline=None)
def test_the_burst_guard_always_holds(
    kit: SimpleNamespace, loads: list[int], conv: int, tenant: int
) -> None:
    cs = kit.cands(len(loads))
    p = PrefixHash()
    for i in range(40):  # a plan with a hot tenant 0
        p.select(kit.ctx(cs, kit.view(_turn(i % 2 and tenant, i, 0))))
    load = {c.key: n for c, n in zip(cs, loads, strict=True)}
    n = len(loads)
    for k in range(3):
        bound = math.ceil(2.0 * (sum(load.values()) + n) / n)
        got = p.select(kit.ctx(cs, kit.view(_turn(tenant, conv, k)), load=load))
        assert load[got.key] + 1 <= bound
        load[got.key] += 1


def test_the_plan_is_made_after_8_16_32_64_128_then_every_128_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ring = HashRing(["a", "b"])
    shares = TrafficShares(fit=1.1, half_life_s=300.0, max_prefixes=10)
    made: list[int] = []
    make = shares._make

    def counted(*args: object) -> object:
        made.append(len(made) and shares._seen)
        return make(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(shares, "_make", counted)
    for _ in range(600):
        shares.observe(1, 0.0)
        shares.plan(ring, ring.keys, 0.0)
    assert made == [0, 8, 16, 32, 64, 128, 256, 384, 512]
    shares.plan(ring, ("a",), 0.0)  # the fleet changed: at once
    assert len(made) == 10

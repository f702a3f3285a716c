"""The lease table with a hand-advanced clock (pure)."""

from __future__ import annotations

from meshkit.core.lifecycle import Active, Idle, LeaseKind, LeaseTable, Unknown


def table(**kw: float) -> LeaseTable:
    return LeaseTable(ttl_s=kw.get("ttl", 60.0), max_finished=int(kw.get("max", 100)), grace_s=0.5)


def test_plain_leases_count_per_worker() -> None:
    t = table()
    t.touch("w", 0.0)
    a, ka = t.start("w", "w", 1.0)
    b, kb = t.start("w", "w", 1.0)
    assert ka is kb is LeaseKind.STARTED and a is not b
    assert t.count("w") == 2 and t.total == 2
    assert t.end(a, 2.0) is True
    assert t.activity("w", 2.0) == Active(1)
    assert t.end(b, 3.0) is True
    assert t.count("w") == 0
    assert t.activity("w", 10.0) == Idle(3.0)


def test_a_running_key_is_joined_and_counted_once() -> None:
    t = table()
    first, k1 = t.start("w", "w", 1.0, key="K", weight=7)
    second, k2 = t.start("w", "w", 1.5, key="K", weight=9)
    assert (k1, k2) == (LeaseKind.STARTED, LeaseKind.JOINED)
    assert second is first and first.refs == 2
    assert t.count("w") == 1  # one lease
    assert t.end(first, 2.0) is False  # the join still runs: the lease lives on
    assert t.activity("w", 2.0) == Active(1)
    assert t.end(second, 3.0) is True
    assert t.count("w") == 0
    assert (t.started_total, t.joined_total, t.replayed_total) == (1, 1, 0)


def test_a_finished_key_is_a_replay_within_the_ttl() -> None:
    t = table(ttl=10.0)
    e, _ = t.start("w", "w", 0.0, key="K")
    t.end(e, 1.0)
    r, kind = t.start("w", "w", 5.0, key="K")
    assert kind is LeaseKind.REPLAYED
    assert t.count("w") == 1  # a replay is real work: it holds a lease
    t.end(r, 6.0)
    late, kind = t.start("w", "w", 17.0, key="K")  # 11 s after it finished: forgotten
    assert kind is LeaseKind.STARTED
    t.end(late, 18.0)
    assert (t.started_total, t.replayed_total) == (2, 1)


def test_the_finished_map_is_bounded() -> None:
    t = table(ttl=1e9, max=3)
    for i in range(10):
        e, _ = t.start("w", "w", float(i), key=f"k{i}")
        t.end(e, float(i))
    assert t.finished_keys() == 3
    assert t.start("w", "w", 20.0, key="k0")[1] is LeaseKind.STARTED  # evicted
    assert t.start("w", "w", 20.0, key="k9")[1] is LeaseKind.REPLAYED


def test_a_key_on_another_candidate_is_an_ordinary_lease() -> None:
    t = table()
    first, _ = t.start("a", "a", 0.0, key="K")
    other, kind = t.start("b", "b", 0.0, key="K")
    assert kind is LeaseKind.STARTED and other.key is None
    assert t.joinable("K") == "a"
    t.end(other, 1.0)
    assert t.joinable("K") == "a"
    t.end(first, 2.0)
    assert t.joinable("K") is None


def test_a_placement_is_activity_until_the_grace_ends() -> None:
    t = table()
    t.touch("w", 0.0)
    t.placed_at["w"] = 10.0
    assert t.activity("w", 10.2) == Active(0)  # its lease is about to be taken
    assert t.activity("w", 10.6) == Idle(10.0)


def test_untracked_and_never_seen_workers_are_unknown_never_idle() -> None:
    t = table()
    t.touch("w", 0.0)
    assert t.activity("w", 1e6, tracked=False) == Unknown()
    assert t.activity("never-touched", 1e6) == Unknown()


def test_touch_does_not_hide_live_leases() -> None:
    t = table()
    e, _ = t.start("w", "w", 0.0)
    t.touch("w", 5.0)
    assert t.activity("w", 5.0) == Active(1)
    t.end(e, 6.0)
    assert t.activity("w", 7.0) == Idle(6.0)

"""least_load: in-flight requests weighted by in-flight prompt size."""

from __future__ import annotations

from types import SimpleNamespace

from meshkit.core.policies import LeastLoad, create_policy


def test_fewest_in_flight_requests_wins(kit: SimpleNamespace) -> None:
    cs = kit.cands(3)
    load = {cs[0].key: 3, cs[1].key: 1, cs[2].key: 2}
    assert create_policy("least_load").select(kit.ctx(cs, load=load)) == cs[1]


def test_prompt_weight_counts(kit: SimpleNamespace) -> None:
    cs = kit.cands(2)
    load = {cs[0].key: 1, cs[1].key: 1}
    # One long prompt in flight weighs more than a short one.
    weight = {cs[0].key: 40_000, cs[1].key: 100}
    assert LeastLoad().select(kit.ctx(cs, load=load, weight=weight)) == cs[1]
    # 2 short requests (score 2.0) vs 1 request with 8k characters (score 1 + 2 = 3.0).
    load = {cs[0].key: 2, cs[1].key: 1}
    weight = {cs[0].key: 200, cs[1].key: 8192}
    assert LeastLoad().select(kit.ctx(cs, load=load, weight=weight)) == cs[0]
    assert (
        LeastLoad(chars_per_request=1 << 20).select(kit.ctx(cs, load=load, weight=weight)) == cs[1]
    )


def test_ties_go_to_fleet_order_and_unknown_keys_are_idle(kit: SimpleNamespace) -> None:
    cs = kit.cands(4)
    assert LeastLoad().select(kit.ctx(cs)) == cs[0]
    load = {cs[0].key: 1, cs[1].key: 1}
    assert LeastLoad().select(kit.ctx(cs, load=load)) == cs[2]
    assert LeastLoad(chars_per_request=0).chars_per_request == 1


def test_it_balances_a_stream_of_placements(kit: SimpleNamespace) -> None:
    cs = kit.cands(5)
    p = LeastLoad()
    load: dict[str, int] = {}
    for _ in range(50):
        got = p.select(kit.ctx(cs, load=load))
        load[got.key] = load.get(got.key, 0) + 1
    assert sorted(load.values()) == [10] * 5


def test_with_kv_events_the_uncached_work_is_what_counts(kit: SimpleNamespace) -> None:

    from meshkit.core.kv_events import Batch, BlockStored
    from meshkit.core.kv_index import KvIndex

    a, b, c = kit.cands(3)
    ids = list(range(1, 65))
    idx = KvIndex(1000)
    idx.apply(b.worker.id, Batch(0.0, (BlockStored((1, 2, 3, 4), None, tuple(ids), 16),)))
    idx.apply(a.worker.id, Batch(0.0, ()))
    v = kit.view("x" * 8192, prompt_ids=ids)
    p = LeastLoad()
    assert p.needs.kv_events
    load = {a.key: 1, b.key: 1, c.key: 0}
    # c is idle but would compute all 8k characters; b holds the whole prompt.
    assert p.select(kit.ctx([a, b, c], v, load=load, kv=idx)) == b
    # Without the index the request's own cost is the same everywhere.
    assert p.select(kit.ctx([a, b, c], v, load=load)) == c
    # A worker that holds the prompt but is busy enough still loses.
    load = {a.key: 1, b.key: 4, c.key: 0}
    assert p.select(kit.ctx([a, b, c], v, load=load, kv=idx)) == c

"""When a KV-event publisher that should have spoken has not (core/kv_silence.py),
and which placements make it expected to (core/states.py)."""

from __future__ import annotations

from meshkit.core.endpoints import resolve
from meshkit.core.kv_events import Batch, BlockStored
from meshkit.core.kv_index import KvIndex, chain
from meshkit.core.kv_silence import KvSilence
from meshkit.core.requests import parse_request


def test_silent_once_a_placed_request_goes_unanswered_for_after_s() -> None:
    s = KvSilence(10.0)
    s.heard("w", 0.0)  # subscribed
    assert not s.check("w", 100.0)  # never placed on: an idle engine says nothing
    s.expect("w", 5.0)
    assert not s.check("w", 14.0)  # placed at 5: 9 s without a batch
    s.expect("w", 13.0)  # a later placement does not restart the wait
    assert not s.check("w", 14.9)
    assert s.check("w", 15.0)  # 10 s after the first one: silent
    assert s.silent("w")
    s.expect("w", 20.0)
    assert not s.check("w", 40.0)  # said once
    assert s.heard("w", 41.0)  # it publishes again: it was silent
    assert not s.silent("w")
    assert not s.heard("w", 42.0)


def test_a_batch_after_the_placement_keeps_it_trusted() -> None:
    s = KvSilence(10.0)
    s.heard("w", 0.0)
    s.expect("w", 5.0)
    assert not s.check("w", 6.0)
    s.heard("w", 7.0)  # the request's blocks arrived
    assert not s.check("w", 100.0)  # nothing placed since
    s.expect("w", 50.0)
    assert not s.check("w", 59.0)
    assert s.check("w", 60.0)


def test_an_unheard_worker_and_zero_are_never_silent() -> None:
    s = KvSilence(10.0)
    s.expect("w", 1.0)  # no subscription caught up: not matched on events
    assert not s.check("w", 100.0)
    s.heard("w", 200.0)
    assert not s.check("w", 1e9)  # and the placement before it does not count
    off = KvSilence(0.0)
    off.heard("w", 0.0)
    off.expect("w", 1.0)
    assert not off.check("w", 1e9)


def test_forget_drops_a_worker() -> None:
    s = KvSilence(1.0)
    s.heard("w", 0.0)
    s.expect("w", 0.5)
    assert s.check("w", 2.0)
    s.forget("w")
    assert not s.silent("w")
    s.expect("w", 3.0)
    assert not s.check("w", 10.0)  # gone until heard again


def test_only_a_prompt_that_fills_a_block_of_the_workers_size_is_expected() -> None:
    kv = KvIndex(1000)
    kv.attach("a")
    kv.attach("b")
    kv.apply("b", Batch(0.0, (BlockStored((1,), None, (1, 2, 3, 4), 4),)))
    match = resolve("POST", "/v1/chat/completions")
    assert match is not None
    v = parse_request(match, b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
    assert kv.would_store("b", v.kv_keys)  # keys not computed: unknown counts
    v.kv_keys = {4: [11, 12], 16: []}
    assert kv.would_store("b", v.kv_keys)  # two 4-token blocks
    v.kv_keys = {4: [], 16: []}
    assert not kv.would_store("b", v.kv_keys)  # shorter than one block: nothing to publish
    assert not kv.would_store("a", v.kv_keys)  # size not seen yet: no size's block either
    v.kv_keys = {4: [11], 16: []}
    assert kv.would_store("a", v.kv_keys)  # size not seen yet: some size's block


def test_a_prompt_the_worker_holds_whole_is_not_expected_to_publish() -> None:
    """A prefix hit stores no block: a worker that serves only prompts it holds
    (a load test cycling a fixed prompt set) must not be taken for silent."""
    kv = KvIndex(1000)
    kv.attach("a")
    kv.attach("b")
    held = chain((1, 2, 3, 4, 5, 6, 7, 8), 4)
    kv.apply("b", Batch(0.0, (BlockStored((1, 2), None, (1, 2, 3, 4, 5, 6, 7, 8), 4),)))
    kv.apply("a", Batch(0.0, (BlockStored((3,), None, (1, 2, 3, 4), 4),)))
    assert not kv.would_store("b", {4: held})  # both blocks held
    assert not kv.would_store("b", {4: held[:1]})  # a shorter prompt of the same prefix
    longer = chain((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), 4)
    assert kv.would_store("b", {4: longer})  # a third block, new to it
    assert kv.would_store("a", {4: held})  # holds the first block only
    assert not kv.would_store("a", {4: held[:1]})

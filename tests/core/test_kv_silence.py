"""When a KV-event publisher that should have spoken has not (core/kv_silence.py)."""

from __future__ import annotations

from meshkit.core.kv_silence import KvSilence


def test_silent_once_a_placed_request_goes_unanswered_for_after_s() -> None:
    s = KvSilence(10.0)
    s.heard("w", 0.0)  # subscribed
    assert not s.check("w", None, 100.0)  # never placed on: an idle engine says nothing
    assert not s.check("w", 5.0, 14.0)  # placed at 5: 9 s without a batch
    assert not s.check("w", 13.0, 14.9)  # a later placement does not restart the wait
    assert s.check("w", 13.0, 15.0)  # 10 s after the first one: silent
    assert s.silent("w")
    assert not s.check("w", 20.0, 40.0)  # said once
    assert s.heard("w", 41.0)  # it publishes again: it was silent
    assert not s.silent("w")
    assert not s.heard("w", 42.0)


def test_a_batch_after_the_placement_keeps_it_trusted() -> None:
    s = KvSilence(10.0)
    s.heard("w", 0.0)
    assert not s.check("w", 5.0, 6.0)
    s.heard("w", 7.0)  # the request's blocks arrived
    assert not s.check("w", 5.0, 100.0)  # nothing placed since
    assert not s.check("w", 50.0, 59.0)
    assert s.check("w", 50.0, 60.0)


def test_an_unheard_worker_and_zero_are_never_silent() -> None:
    s = KvSilence(10.0)
    assert not s.check("w", 1.0, 100.0)  # no subscription caught up: not matched on events
    off = KvSilence(0.0)
    off.heard("w", 0.0)
    assert not off.check("w", 1.0, 1e9)


def test_forget_drops_a_worker() -> None:
    s = KvSilence(1.0)
    s.heard("w", 0.0)
    assert s.check("w", 0.5, 2.0)
    s.forget("w")
    assert not s.silent("w")
    assert not s.check("w", 3.0, 10.0)  # gone until heard again

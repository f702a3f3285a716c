"""``BatchStream``: a copy is told from a restarted publisher by its stamp, within
``kv.trail_batches`` numbers; a jump clears what it remembers."""

from __future__ import annotations

from dataclasses import dataclass

from meshkit.core.kv_stream import BatchStream


@dataclass
class B:
    ts: float


def test_a_number_behind_with_the_stamp_taken_is_a_copy_and_with_another_is_not() -> None:
    s = BatchStream(trail=8)
    for seq in range(5):
        s.took(seq, 100.0 + seq)
    assert s.expected == 5
    assert s.copy(3, 103.0) and s.copy(4, 104.0)
    assert not s.copy(3, 999.0)  # a restarted publisher's batch 3
    assert not s.copy(5, 105.0)  # not taken yet


def test_only_the_last_trail_batches_are_remembered() -> None:
    s = BatchStream(trail=4)
    for seq in range(10):
        s.took(seq, float(seq))
    assert len(s.seen) == 4
    assert [s.copy(seq, float(seq)) for seq in range(10)] == [False] * 6 + [True] * 4


def test_a_jump_forgets_what_came_before_it() -> None:
    s = BatchStream(trail=8)
    for seq in range(4):
        s.took(seq, float(seq))
    s.took(9, 9.0)  # a gap that was not filled
    assert s.expected == 10 and s.copy(9, 9.0) and not s.copy(3, 3.0)


def test_a_first_replay_is_remembered_and_an_empty_one_sets_where_it_starts() -> None:
    s = BatchStream(trail=8)
    s.joined(40, [B(1.0), B(2.0), B(3.0)])
    assert s.expected == 43 and s.copy(40, 1.0) and s.copy(42, 3.0)
    s.joined(7, [])
    assert s.expected == 7 and not s.copy(6, 3.0)


def test_a_reset_expects_nothing_and_knows_no_copy() -> None:
    s = BatchStream(trail=8)
    s.took(0, 1.0)
    s.reset()
    assert s.expected is None and not s.copy(0, 1.0)
    s.took(5, 2.0)
    assert s.expected == 6 and s.copy(5, 2.0)


def test_a_replayed_run_is_taken_in_its_numbers() -> None:
    s = BatchStream(8)
    s.took(0, 0.5)
    s.took_run(1, [B(1.5), B(2.5)])
    assert s.expected == 3 and s.copy(2, 2.5) and s.copy(0, 0.5) and not s.copy(2, 9.0)

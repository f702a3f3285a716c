"""The KV index (:mod:`meshkit.core.kv_index`): own chained block keys, events
applied, matches, the bound."""

from __future__ import annotations

from meshkit.core.kv_events import AllBlocksCleared, Batch, BlockRemoved, BlockStored
from meshkit.core.kv_index import ROOT, KvIndex, chain


def stored(hashes: list[int], parent: int | None, tokens: list[int], size: int = 2) -> Batch:
    return Batch(0.0, (BlockStored(tuple(hashes), parent, tuple(tokens), size),))


def test_keys_are_chained_and_the_same_everywhere() -> None:
    keys = chain([1, 2, 3, 4, 5], 2)
    assert len(keys) == 2  # the partial last block has no key
    assert keys == chain([1, 2, 3, 4], 2)
    assert chain([9, 9, 3, 4], 2)[1] != keys[1]  # a block's key depends on its parents
    assert chain([3, 4], 2, parent=keys[0]) == keys[1:]
    # pinned: another process (or a later release) must compute the same keys
    assert keys[0] == 0x1E5D25A6CE314DB8  # CPython's tuple hash: no seed for ints
    assert chain([], 2) == [] and ROOT == 0


def test_keys_do_not_depend_on_the_hash_seed() -> None:
    import subprocess
    import sys

    code = "from meshkit.core.kv_index import chain; print(chain(list(range(64)), 16))"
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**__import__("os").environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("0", "1", "4242")
    }
    assert len(seen) == 1 and str(chain(list(range(64)), 16)) in seen.pop()


def test_stored_blocks_match_the_request_prefix() -> None:
    idx = KvIndex(max_blocks=100)
    idx.apply("a", stored([101, 102], None, [1, 2, 3, 4]))
    idx.apply("a", stored([103], 102, [5, 6]))  # chained onto its parent's key
    idx.apply("b", stored([201], None, [1, 2]))
    got = idx.match([1, 2, 3, 4, 5, 6, 7], ["a", "b", "c"])
    assert got == {"a": 6, "b": 2, "c": 0}
    assert idx.match([9, 9, 3, 4], ["a", "b"]) == {"a": 0, "b": 0}


def test_removed_and_cleared_blocks_stop_matching() -> None:
    idx = KvIndex(max_blocks=100)
    idx.apply("a", stored([101, 102, 103], None, [1, 2, 3, 4, 5, 6]))
    idx.apply("a", Batch(0.0, (BlockRemoved((102,)),)))
    assert idx.match([1, 2, 3, 4, 5, 6], ["a"]) == {"a": 2}  # the chain breaks at 102
    idx.apply("a", Batch(0.0, (AllBlocksCleared(),)))
    assert idx.match([1, 2], ["a"]) == {"a": 0} and len(idx) == 0


def test_an_unknown_parent_or_a_bad_length_is_skipped_and_counted() -> None:
    idx = KvIndex(max_blocks=100)
    idx.apply("a", stored([103], 999, [5, 6]))
    idx.apply("a", stored([104, 105], None, [1, 2, 3]))  # 3 tokens for 2 blocks of 2
    assert idx.unchained == 3 and len(idx) == 0


def test_a_new_block_size_clears_what_the_worker_held() -> None:
    idx = KvIndex(max_blocks=100)
    idx.apply("a", stored([1], None, [1, 2]))
    idx.apply("a", stored([2], None, [1, 2, 3, 4], size=4))
    assert idx.block_sizes["a"] == 4 and idx.blocks_of("a") == 1
    assert idx.match([1, 2, 3, 4], ["a"]) == {"a": 4}


def test_a_worker_takes_at_most_its_share_of_the_budget() -> None:
    idx = KvIndex(max_blocks=4)
    idx.attach("a")
    idx.attach("b")
    idx.apply("a", stored([1, 2, 3], None, [1, 1, 2, 2, 3, 3]))  # a's share is 2
    assert idx.blocks_of("a") == 2 and idx.evicted == 1
    assert idx.match([1, 1, 2, 2, 3, 3], ["a"]) == {"a": 4}
    idx.apply("b", stored([4, 5], None, [4, 4, 5, 5]))
    assert idx.blocks_of("b") == 2 and len(idx) == 4
    # a worker that leaves gives its share back
    idx.forget("b")
    idx.apply("a", stored([3], 2, [3, 3]))
    assert idx.match([1, 1, 2, 2, 3, 3], ["a"]) == {"a": 6}


def test_a_joining_worker_waits_for_room_while_the_others_hold_the_old_shares() -> None:
    idx = KvIndex(max_blocks=4)
    idx.apply("a", stored([1, 2, 3, 4], None, [1, 1, 2, 2, 3, 3, 4, 4]))  # alone: all 4
    idx.apply("b", stored([5], None, [5, 5]))  # b's share is 2, but the group is full
    assert idx.blocks_of("b") == 0 and len(idx) == 4
    idx.apply("a", Batch(0.0, (BlockRemoved((4, 3)),)))
    idx.apply("a", stored([3], 2, [3, 3]))  # a is at its new share: turned away
    idx.apply("b", stored([5], None, [5, 5]))
    assert idx.blocks_of("a") == 2 and idx.blocks_of("b") == 1


def test_every_router_holds_the_same_blocks_whatever_the_order_of_the_workers() -> None:
    # Two routers get the same events per worker, interleaved differently (each
    # worker's stream is its own subscription). A budget taken first-come would
    # leave them holding different blocks; shares leave them the same.
    streams = {
        w: [stored([100 * i + n], None, [i, n]) for n in range(6)] for i, w in enumerate("abc")
    }
    one, two = KvIndex(max_blocks=9), KvIndex(max_blocks=9)
    for idx in (one, two):
        for w in "abc":
            idx.attach(w)
    for n in range(6):
        for w in "abc":
            one.apply(w, streams[w][n])
    for w in "cab":
        for batch in streams[w]:
            two.apply(w, batch)
    for i, w in enumerate("abc"):
        assert one.blocks_of(w) == two.blocks_of(w) == 3
        for n in range(6):
            assert one.match([i, n], [w]) == two.match([i, n], [w])


def test_the_hottest_prompt_keeps_chaining_when_the_index_is_full() -> None:
    # An engine stores a shared prompt once and then only hits it (no events), while
    # conversations under it come and go. Dropping the least recently stored would
    # drop the prompt's blocks first, and every later conversation under it would
    # be skipped as unchained: the index would empty while the engine holds it all.
    idx = KvIndex(max_blocks=6)
    idx.apply("a", stored([1, 2], None, [1, 1, 2, 2]))  # the shared prompt
    for n in range(50):
        h = 100 + 2 * n
        idx.apply("a", stored([h, h + 1], 2, [n, n, n, -n]))
        if n >= 3:  # the engine holds the last three conversations (8 blocks > 6)
            idx.apply("a", Batch(0.0, (BlockRemoved((h - 6, h - 5)),)))
    assert idx.unchained == 0 and idx.evicted > 0
    assert idx.match([1, 1, 2, 2, 5, 5], ["a"]) == {"a": 4}
    assert idx.match([1, 1, 2, 2, 49, 49, 49, -49], ["a"])["a"] in (4, 8)
    assert 2 < idx.blocks_of("a") <= 6


def test_past_its_share_a_new_block_replaces_the_workers_newest_leaf() -> None:
    idx = KvIndex(max_blocks=4)
    idx.attach("a")
    idx.attach("b")  # a's share is 2
    idx.apply("a", stored([1, 2], None, [1, 1, 2, 2]))  # a prompt
    idx.apply("a", stored([3], None, [3, 3]))  # another prompt: replaces block 2
    assert idx.blocks_of("a") == 2 and idx.evicted == 1
    assert idx.match([1, 1, 2, 2], ["a"]) == {"a": 2}  # the first prompt's root stays
    assert idx.match([3, 3], ["a"]) == {"a": 2}
    # a block hanging from the newest entry cannot replace it: it stays out, and
    # what the engine stores under it later cannot be chained
    idx.apply("a", stored([4], 3, [4, 4]))
    assert idx.match([3, 3, 4, 4], ["a"]) == {"a": 2} and idx.evicted == 2
    idx.apply("a", stored([5], 4, [5, 5]))
    assert idx.unchained == 1
    # a block stored again keeps its place and takes no room
    idx.apply("a", stored([1], None, [1, 1]))
    assert idx.blocks_of("a") == 2 and idx.evicted == 2
    # the other worker's share is its own
    idx.apply("b", stored([6, 7], None, [6, 6, 7, 7]))
    assert idx.blocks_of("b") == 2 and len(idx) == 4


def test_replacing_newest_first_keeps_the_older_chains_whole() -> None:
    idx = KvIndex(max_blocks=6)
    idx.apply("a", stored([1, 2, 3], None, [1, 1, 2, 2, 3, 3]))  # a prompt
    idx.apply("a", stored([4, 5], 3, [4, 4, 5, 5]))  # a turn under it: 5 of 6
    idx.apply("a", stored([6, 7, 8], None, [6, 6, 7, 7, 8, 8]))  # a new prompt
    # one block fits; the turn's two blocks make room for the others, last first
    assert idx.evicted == 2 and idx.blocks_of("a") == 6
    assert idx.match([1, 1, 2, 2, 3, 3, 4, 4], ["a"]) == {"a": 6}
    assert idx.match([6, 6, 7, 7, 8, 8], ["a"]) == {"a": 6}


def test_an_event_that_names_held_blocks_again_does_not_make_room_with_them() -> None:
    idx = KvIndex(max_blocks=3)
    idx.apply("a", stored([1], None, [1, 1]))
    idx.apply("a", stored([2, 3], None, [2, 2, 3, 3]))  # full; 3 is the newest
    # a replay names 2 and 3 again and adds 4 under them: 3 cannot make the room
    idx.apply("a", stored([2, 3, 4], None, [2, 2, 3, 3, 4, 4]))
    assert idx.match([2, 2, 3, 3, 4, 4], ["a"]) == {"a": 4} and idx.evicted == 1


def test_a_publisher_that_never_reports_removals_ages_out_its_oldest_blocks() -> None:
    idx = KvIndex(max_blocks=4)
    idx.apply("a", stored([1, 2, 3, 4], None, [1, 1, 2, 2, 3, 3, 4, 4]))
    for n in range(4):  # a whole budget of blocks needed room, and no removal came
        idx.apply("a", stored([10 + n], None, [10 + n, 10 + n]))
    assert idx.match([1, 1, 2, 2, 3, 3], ["a"]) == {"a": 6}  # the newest went so far
    idx.apply("a", stored([20], None, [20, 20]))  # now the oldest goes
    assert idx.match([1, 1], ["a"]) == {"a": 0} and idx.match([20, 20], ["a"]) == {"a": 2}
    # a removal: the newest make room again
    idx.apply("a", Batch(0.0, (BlockRemoved((20,)),)))
    idx.apply("a", stored([21, 22], None, [21, 21, 22, 22]))
    assert idx.match([13, 13], ["a"]) == {"a": 0}
    assert idx.match([21, 21, 22, 22], ["a"]) == {"a": 4} and idx.blocks_of("a") == 4


def test_engines_filling_up_together_do_not_look_like_a_publisher_without_removals() -> None:
    # Four engines warm up: each stores more than its share, none has evicted yet.
    # Together they needed room for more than the budget, each one alone for less:
    # no publisher is missing its removals, so the hot roots (the oldest) stay.
    idx = KvIndex(max_blocks=8)
    for w in "abcd":
        idx.attach(w)
    for i, w in enumerate("abcd"):
        idx.apply(w, stored([100 * i], None, [i, i]))  # each engine's hot root
        for n in range(1, 5):  # then four new prompts, no removal: 3 find no room
            idx.apply(w, stored([100 * i + n], None, [i, -n]))
    for i, w in enumerate("abcd"):
        assert idx.match([i, i], [w]) == {w: 2}
        assert idx.blocks_of(w) == 2


def test_a_silent_publisher_beside_reporting_ones_still_ages_out_its_oldest() -> None:
    idx = KvIndex(max_blocks=4)
    idx.attach("a")
    idx.attach("b")  # shares of 2
    idx.apply("a", stored([1, 2], None, [1, 1, 2, 2]))
    for n in range(5):  # a needs room again and again and never reports a removal,
        idx.apply("a", stored([10 + n], None, [10 + n, 10 + n]))
        # while b's engine reports its own evictions
        idx.apply("b", stored([50 + n], None, [50 + n, 50 + n]))
        idx.apply("b", Batch(0.0, (BlockRemoved((50 + n,)),)))
    assert idx.match([1, 1], ["a"]) == {"a": 0}  # a's oldest went
    assert idx.match([14, 14], ["a"]) == {"a": 2}


def test_removals_of_blocks_the_index_never_held_still_count_as_reported() -> None:
    idx = KvIndex(max_blocks=4)
    idx.apply("a", stored([1, 2, 3, 4], None, [1, 1, 2, 2, 3, 3, 4, 4]))
    for n in range(12):  # three budgets of blocks needed room...
        idx.apply("a", stored([10 + n], None, [10 + n, 10 + n]))
        idx.apply("a", Batch(0.0, (BlockRemoved((900 + n,)),)))  # ...but removals came
    assert idx.match([1, 1, 2, 2, 3, 3], ["a"]) == {"a": 6}  # no fallback: 1-3 stay


def test_forget_drops_a_worker() -> None:
    idx = KvIndex(max_blocks=10)
    idx.apply("a", stored([1], None, [1, 2]))
    idx.forget("a")
    assert len(idx) == 0 and "a" not in idx.block_sizes


def test_each_model_group_has_its_own_budget() -> None:
    idx = KvIndex(max_blocks=2)
    idx.apply("a", stored([1, 2], None, [1, 2, 3, 4]), group="big")
    idx.apply("b", stored([3, 4], None, [5, 6, 7, 8]), group="small")
    idx.apply("a", stored([5], 2, [9, 9]), group="big")  # over "big"'s budget only
    assert idx.group_sizes() == {"big": 2, "small": 2} and idx.evicted == 1
    assert idx.match([5, 6, 7, 8], ["b"]) == {"b": 4}
    assert idx.match([1, 2, 3, 4, 9, 9], ["a"]) == {"a": 4}
    # b now lists "big"'s models: its entries move there, within b's share of it
    idx.apply("a", Batch(0.0, (BlockRemoved((2,)),)), group="big")  # room in "big"
    idx.apply("b", stored([6], None, [1, 2]), group="big")
    assert idx.blocks_of("b") == 1 and idx.group_sizes()["small"] == 0
    assert idx.group_sizes()["big"] == 2


def test_a_worker_whose_models_change_keeps_its_entries_within_the_new_budget() -> None:
    # A worker's models are learnt by a probe, often after its events began (the
    # replay on joining), and an adapter loaded at run time joins its list: its
    # engine holds what it held.
    idx = KvIndex(max_blocks=6)
    idx.apply("a", stored([1, 2, 3], None, [1, 2, 3, 4, 5, 6]))  # models unknown yet
    idx.apply("a", stored([4], 3, [7, 8]), group="m")
    assert idx.match([1, 2, 3, 4, 5, 6, 7, 8], ["a"]) == {"a": 8}
    assert idx.group_sizes() == {"": 0, "m": 4} and idx.unchained == 0 and idx.evicted == 0
    # Into a group the others fill: past the budget its newest entries (leaves) go,
    # and what it keeps still chains from the root.
    idx.apply("b", stored([9, 10, 11], None, [9, 9, 8, 8, 7, 7]), group="n")
    idx.attach("b", "m")
    assert idx.group_sizes()["m"] == 6 and idx.evicted == 1
    assert idx.match([9, 9, 8, 8, 7, 7], ["b"]) == {"b": 4}
    idx.apply("a", Batch(0.0, (BlockRemoved((4,)),)), group="m")  # room in "m"
    idx.apply("b", stored([12], 10, [6, 6]), group="m")
    assert idx.blocks_of("b") == 3 and idx.match([9, 9, 8, 8, 6, 6], ["b"]) == {"b": 6}


def test_bytes_hashes_and_signed_ints_name_blocks() -> None:
    idx = KvIndex(max_blocks=10)
    digest = bytes(range(32))
    idx.apply("a", stored([digest], None, [1, 2]))  # type: ignore[list-item]
    idx.apply("a", stored([-5], digest, [3, 4]))  # type: ignore[arg-type]
    assert idx.match([1, 2, 3, 4], ["a"]) == {"a": 4}
    idx.apply("a", Batch(0.0, (BlockRemoved((-5,)),)))
    assert idx.match([1, 2, 3, 4], ["a"]) == {"a": 2}


def test_keys_computed_beforehand_match_alike() -> None:
    idx = KvIndex(max_blocks=100)
    idx.apply("a", stored([1, 2, 3], None, [1, 2, 3, 4, 5, 6]))
    idx.apply("b", stored([4], None, [1, 2]))
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    assert idx.match(ids, ["a", "b"], {2: chain(ids, 2)}) == idx.match(ids, ["a", "b"])
    assert idx.match(ids, ["a", "b"]) == {"a": 6, "b": 2}


def test_a_forgotten_workers_bit_is_reused_without_its_blocks() -> None:
    idx = KvIndex(max_blocks=100)
    idx.apply("a", stored([1], None, [1, 2]))
    idx.forget("a")
    idx.apply("b", stored([2], None, [3, 4]))  # takes a's bit
    assert idx.match([1, 2], ["a", "b"]) == {"a": 0, "b": 0}
    assert idx.match([3, 4], ["b"]) == {"b": 2} and idx.covers("b") and not idx.covers("a")


def test_clearing_one_worker_leaves_the_others_shared_blocks() -> None:
    idx = KvIndex(max_blocks=100)
    for w, h in (("a", 1), ("b", 2)):
        idx.apply(w, stored([h], None, [1, 2]))
    idx.clear("a")
    assert idx.match([1, 2], ["a", "b"]) == {"a": 0, "b": 2}
    assert idx.blocks_of("a") == 0 and idx.covers("a")  # it holds nothing: known


def test_bisection_agrees_with_the_block_walk_on_cached_prefixes() -> None:
    import random

    rng = random.Random(5)
    for _ in range(50):
        idx = KvIndex(max_blocks=10_000)
        ids = [rng.randrange(1000) for _ in range(2 * rng.randrange(0, 40))]
        workers = [f"w{i}" for i in range(rng.randrange(1, 9))]
        h = 1
        for w in workers:  # each holds a prefix of its own depth, as an engine does
            depth = rng.randrange(0, len(ids) // 2 + 1)
            if depth:
                idx.apply(w, stored(list(range(h, h + depth)), None, ids[: 2 * depth]))
                h += depth
        walked = idx.match(ids, workers)
        assert idx.match(ids, workers, {2: chain(ids, 2)}) == walked


def test_the_candidate_sets_remembered_are_bounded_by_max_worker_sets() -> None:
    sets = [["a"], ["b"], ["c"], ["a", "b"], ["b", "c"]]
    for bound, held in ((2, 2), (256, len(sets))):  # a start-over at the bound
        idx = KvIndex(max_blocks=100, max_worker_sets=bound)
        for wid, first in (("a", 101), ("b", 201), ("c", 301)):
            idx.apply(wid, stored([first], None, [1, 2]))
        for _ in range(2):  # and again: each set is answered alike after a start-over
            for ids in sets:
                assert idx.match([1, 2, 3], ids) == dict.fromkeys(ids, 2)
        assert 0 < len(idx._masks) <= held
        assert bound == 2 or len(idx._masks) == held  # under the bound: every set kept

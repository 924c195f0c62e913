"""fork() and copy-on-write: parallel sampling shares the whole table."""

import pytest

from kvservice.core import Request
from kvservice.core.invariants import check_invariants
from tests.core_helpers import admit, full_manager, pool_state, ref_cnts, tokens


def step(m, r, token):
    r.append_output_token_ids(token)
    new = m.allocate_slots(r, 1)
    if new is not None:
        r.num_computed_tokens += 1
    return new


def test_fork_shares_every_block_and_copies_the_partial_tail_on_write():
    m = full_manager(20, block_size=4)
    p = Request("p", tokens(0, 6), 4)
    assert admit(m, p)[0].get_block_ids() == ([1, 2],)
    c = m.fork(p, "c")
    assert (c.num_tokens, c.num_computed_tokens, c.block_hashes) == (6, 6, p.block_hashes)
    assert m.get_block_ids("c") == ([1, 2],) and ref_cnts(m) == {1: 2, 2: 2}
    check_invariants(m)
    # The parent writes position 6 into shared block 2 (2 tokens computed): fresh block 3 + copy.
    assert step(m, p, 100).get_block_ids() == ([],)
    assert m.get_block_ids("p") == ([1, 3],)
    assert ref_cnts(m) == {1: 2, 2: 2, 3: 1}  # block 2: the child + one pin
    check_invariants(m)
    # The child is now block 2's only holder (pins do not count): it writes in place.
    assert step(m, c, 200).get_block_ids() == ([],)
    assert m.get_block_ids("c") == ([1, 2],)
    assert m.take_block_copies() == [(2, 3)]
    assert m.take_block_copies() == []
    assert ref_cnts(m) == {1: 2, 2: 1, 3: 1}
    check_invariants(m)
    # Both blocks fill with different tokens and are cached under different hashes.
    for t in (101,):
        step(m, p, t)
    step(m, c, 201)
    assert p.block_hashes[1] != c.block_hashes[1]
    assert m.get_blocks("p").blocks[0][1].block_hash != m.get_blocks("c").blocks[0][1].block_hash
    m.free(p)
    m.free(c)
    assert m.block_pool.get_num_free_blocks() == 19
    check_invariants(m)


def test_full_shared_blocks_are_never_copied():
    m = full_manager(20, block_size=4)
    p = Request("p", tokens(0, 8), 4)
    admit(m, p)
    c = m.fork(p, "c")
    assert step(m, p, 1).get_block_ids() == ([3],)
    assert step(m, c, 2).get_block_ids() == ([4],)
    assert m.take_block_copies() == []
    assert m.get_block_ids("p") == ([1, 2, 3],) and m.get_block_ids("c") == ([1, 2, 4],)


def test_a_shared_full_block_cached_by_one_sibling_is_not_cached_again_by_the_other():
    # Both hold block 2 (tokens 4..7, full, not computed yet, so not cached). The parent caches it;
    # the child, reaching the same point, finds it cached under the same hash and leaves it.
    m = full_manager(20, block_size=4, enable_events=True)
    p = Request("p", tokens(0, 8), 4)
    admit(m, p, 6)
    m.take_events()
    c = m.fork(p, "c")
    for r, t in ((p, 100), (c, 200)):
        r.append_output_token_ids(t)
        r.num_computed_tokens = 8
        assert m.allocate_slots(r, 1) is not None
    assert m.get_block_ids("p") == ([1, 2, 3],) and m.get_block_ids("c") == ([1, 2, 4],)
    assert m.coordinator.managers[0].num_cached_block == {"p": 2, "c": 2}
    stored = m.take_events()
    assert [e.block_ids for e in stored] == [[2]]  # stored once, by the parent
    check_invariants(m)


def test_copy_source_stays_pinned_after_its_last_holder_leaves():
    m = full_manager(20, block_size=4)
    p = Request("p", tokens(0, 6), 4)
    admit(m, p)
    c = m.fork(p, "c")
    step(m, c, 5)  # the child copies: c holds 3, p holds 2, 2 pinned
    assert m.get_block_ids("c") == ([1, 3],)
    m.free(p)
    assert ref_cnts(m)[2] == 1  # only the pin: not free, not reusable before the copy ran
    assert 2 not in [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    check_invariants(m)
    assert m.take_block_copies() == [(2, 3)]
    assert m.block_pool.free_block_queue.get_all_free_blocks()[0].block_id == 2  # unhashed -> head
    m.free(c)
    assert m.block_pool.get_num_free_blocks() == 19
    check_invariants(m)


def test_copy_block_counts_in_the_fit_check():
    m = full_manager(4, block_size=4)  # 3 usable
    p = Request("p", tokens(0, 6), 4)
    admit(m, p)  # 1, 2
    c = m.fork(p, "c")
    filler = Request("f", tokens(50, 4), 4)
    admit(m, filler)  # 3: pool full
    before = pool_state(m)
    c.append_output_token_ids(9)
    assert m.allocate_slots(c, 1) is None
    assert pool_state(m) == before
    m.free(filler)
    assert m.allocate_slots(c, 1).get_block_ids() == ([],)
    assert m.get_block_ids("c") == ([1, 3],)
    check_invariants(m)


def test_n_way_fork_then_free_all_drains():
    m = full_manager(40, block_size=4)
    p = Request("p", tokens(0, 10), 4)
    admit(m, p)
    children = [m.fork(p, f"c{i}") for i in range(3)]
    assert ref_cnts(m) == {1: 4, 2: 4, 3: 4}
    for i, r in enumerate([p, *children]):
        step(m, r, 1000 + i)
        check_invariants(m)
    copies = m.take_block_copies()
    assert [src for src, _ in copies] == [3, 3, 3]  # three writers copy; the last owns block 3
    assert len({dst for _, dst in copies}) == 3
    for r in [p, *children]:
        m.free(r)
    assert m.block_pool.get_num_free_blocks() == 39
    check_invariants(m)


def test_fork_rejects_existing_child_id():
    m = full_manager(20, block_size=4)
    p = Request("p", tokens(0, 6), 4)
    admit(m, p)
    with pytest.raises(ValueError, match="already exists"):
        m.fork(p, "p")


def test_allocate_slots_reports_the_entries_copy_on_write_swapped():
    m = full_manager(20, block_size=4)
    p = Request("p", tokens(0, 6), 4)
    admit(m, p)
    m.fork(p, "c")
    p.append_output_token_ids(9)
    new = m.allocate_slots(p, 1)
    assert new.get_block_ids() == ([],) and new.replaced == [(0, 1, 3)]  # group 0, index 1 -> block 3
    assert m.take_block_copies() == [(2, 3)]


def test_a_write_into_the_writers_own_cached_blocks_copies_nothing():
    """vLLM's bounded replay recomputes a hit's last window: the request writes into shared blocks cached under
    its own hashes. Their KV is already its own, so nothing is copied (as vLLM copies nothing); a fork child
    whose tokens differ from a shared block's still gets a copy (the tests above)."""
    m = full_manager(20, block_size=4)
    a = Request("a", tokens(0, 16), 4)
    admit(m, a)
    b = Request("b", tokens(0, 20), 4)
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 16
    assert m.allocate_slots(b, 4, num_hit, hits) is not None
    held = m.get_block_ids("b")
    b.num_computed_tokens = 8  # replayed from the window's first block: blocks 2 and 3 are written again
    assert m.allocate_slots(b, 12) is not None
    assert m.get_block_ids("b") == held and m.take_block_copies() == []
    assert ref_cnts(m)[held[0][2]] == 2 and ref_cnts(m)[held[0][3]] == 2  # still shared with a
    check_invariants(m)

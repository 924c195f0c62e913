"""KVCacheManager scenarios with full attention: exact ids, order, ref counts and a drained pool."""

import pytest

from kvservice.core import KVCacheBlocks, Request
from kvservice.core.invariants import check_invariants
from kvservice.hashing import hash_prompt
from tests.core_helpers import admit, free_ids, full_manager, pool_state, ref_cnts, tokens


def test_prefill_with_shared_prefix():
    m = full_manager(11, block_size=4)
    a = Request("a", tokens(0, 10), 4)
    new, hit = admit(m, a)
    assert hit == 0 and new.get_block_ids() == ([1, 2, 3],)
    assert [b.block_hash is not None for b in m.get_blocks("a").blocks[0]] == [True, True, False]
    b = Request("b", tokens(0, 10), 4)
    new, hit = admit(m, b)
    assert hit == 8 and new.get_block_ids() == ([4],)
    assert m.get_block_ids("b") == ([1, 2, 4],)
    assert ref_cnts(m) == {1: 2, 2: 2, 3: 1, 4: 1}
    check_invariants(m)
    m.free(a)
    m.free(b)
    assert free_ids(m) == [4, 3, 5, 6, 7, 8, 9, 10, 2, 1]
    check_invariants(m)


def test_last_token_always_recomputed():
    m = full_manager(20, block_size=4)
    admit(m, Request("a", tokens(0, 12), 4))
    # 12 cached tokens: a 12-token repeat may reuse only 8 (its last token is recomputed)...
    assert admit(m, Request("b", tokens(0, 12), 4))[1] == 8
    # ...a 13-token prompt with that prefix reuses all 12.
    assert admit(m, Request("c", tokens(0, 13), 4))[1] == 12


def test_decode_across_block_boundary():
    m = full_manager(11, block_size=4)
    r = Request("r", tokens(0, 7), 4)
    assert admit(m, r)[0].get_block_ids() == ([1, 2],)
    r.append_output_token_ids(100)
    assert m.allocate_slots(r, 1).get_block_ids() == ([],)
    r.num_computed_tokens += 1
    # Block 2 became full and was cached.
    assert m.get_blocks("r").blocks[0][1].block_hash is not None
    r.append_output_token_ids(101)
    assert m.allocate_slots(r, 1).get_block_ids() == ([3],)
    r.num_computed_tokens += 1
    assert m.get_block_ids("r") == ([1, 2, 3],)
    m.free(r)
    assert m.block_pool.get_num_free_blocks() == 10
    check_invariants(m)


def test_eviction_is_lru_with_tail_blocks_first():
    m = full_manager(7, block_size=4)  # blocks 1..6
    a = Request("a", tokens(0, 12), 4)
    admit(m, a)  # [1, 2, 3], all cached
    m.free(a)
    assert free_ids(m) == [4, 5, 6, 3, 2, 1]
    b = Request("b", tokens(100, 20), 4)
    new, _ = admit(m, b)  # 5 blocks: 4, 5, 6, then evicts 3 and 2 (a's tail first)
    assert new.get_block_ids() == ([4, 5, 6, 3, 2],)
    # a's first block survives: a repeat hits exactly one block.
    assert admit(m, Request("a2", tokens(0, 12), 4))[1] == 4
    check_invariants(m)


def test_held_blocks_are_never_evicted():
    m = full_manager(5, block_size=4)  # blocks 1..4
    a = Request("a", tokens(0, 8), 4)
    admit(m, a)  # holds 1, 2 (cached, ref 1)
    b = Request("b", tokens(50, 8), 4)
    admit(m, b)  # 3, 4
    c = Request("c", tokens(90, 4), 4)
    before = pool_state(m)
    assert m.allocate_slots(c, 4) is None
    assert pool_state(m) == before
    assert admit(m, Request("a2", tokens(0, 9), 4))[1] == 8


def test_not_enough_blocks_changes_nothing():
    m = full_manager(6, block_size=4)  # 5 usable
    a = Request("a", tokens(0, 8), 4)
    admit(m, a)
    m.free(a)  # 1, 2 cached and free
    b = Request("b", tokens(0, 30), 4)  # hits 2 blocks (ref 0: they count as consuming free blocks)
    hits, n = m.get_computed_blocks(b)
    assert n == 8
    before = pool_state(m)
    assert m.allocate_slots(b, 22, n, hits) is None  # needs 6 new + 2 rescued > 5 free
    assert pool_state(m) == before
    # It fits with fewer tokens: 2 hits rescued + 3 new = 5.
    assert m.allocate_slots(b, 12, n, hits).get_block_ids() == ([3, 4, 5],)
    assert m.get_block_ids("b") == ([1, 2, 3, 4, 5],)
    assert m.block_pool.get_num_free_blocks() == 0
    check_invariants(m)


def test_lookahead_slots_are_allocated_but_not_cached():
    m = full_manager(20, block_size=4)
    r = Request("r", tokens(0, 8), 4)
    new = m.allocate_slots(r, 8, num_lookahead_tokens=5)
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    assert [b.block_hash is not None for b in m.get_blocks("r").blocks[0]] == [True, True, False, False]


def test_delay_cache_blocks_then_cache():
    m = full_manager(20, block_size=4)
    r = Request("r", tokens(0, 8), 4)
    m.allocate_slots(r, 8, delay_cache_blocks=True)
    assert all(b.block_hash is None for b in m.get_blocks("r").blocks[0])
    m.cache_blocks(r, 8)
    assert all(b.block_hash is not None for b in m.get_blocks("r").blocks[0])


def test_max_model_len_caps_slots():
    m = full_manager(20, block_size=4, max_model_len=10)
    r = Request("r", tokens(0, 8), 4)
    assert m.allocate_slots(r, 8, num_lookahead_tokens=8).get_block_ids() == ([1, 2, 3],)


def test_salt_and_lora_isolate_prefixes():
    m = full_manager(40, block_size=4)
    admit(m, Request("plain", tokens(0, 12), 4))
    assert admit(m, Request("salted", tokens(0, 12), 4, cache_salt="s"))[1] == 0
    assert admit(m, Request("salted2", tokens(0, 12), 4, cache_salt="s"))[1] == 8
    assert admit(m, Request("other-salt", tokens(0, 12), 4, cache_salt="t"))[1] == 0
    assert admit(m, Request("lora", tokens(0, 12), 4, lora_name="l"))[1] == 0
    assert admit(m, Request("ns", tokens(0, 12), 4, namespace=b"tenant-b"))[1] == 0
    assert admit(m, Request("ns2", tokens(0, 12), 4, namespace=b"tenant-b"))[1] == 8
    check_invariants(m)


def test_request_by_hashes_hits_like_tokens():
    m = full_manager(40, block_size=4, enable_events=True)
    admit(m, Request("tok", tokens(0, 12), 4))
    hashes = hash_prompt(tokens(0, 12), block_size=4)
    r = Request.from_block_hashes("hashed", hashes, 12, 4)
    new, hit = admit(m, r)
    assert hit == 8 and new.get_block_ids() == ([4],)
    m.take_events()
    # Appending: one more token completes nothing; four more complete block 3 (hash required).
    r.append_block_hashes([], 1)
    with pytest.raises(ValueError, match="need 1 new block hashes"):
        r.append_block_hashes([], 3)
    nxt = hash_prompt(tokens(0, 16), block_size=4)[3]
    r.append_block_hashes([nxt], 3)
    assert r.num_tokens == 16 and r.block_hashes[-1] == nxt


def test_prefix_cache_stats():
    m = full_manager(40, block_size=4)
    admit(m, Request("a", tokens(0, 12), 4))
    admit(m, Request("b", tokens(0, 12), 4))
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 24, 8)
    assert m.make_prefix_cache_stats().requests == 0
    assert m.prefix_cache_totals.hit_rate == pytest.approx(8 / 24)


def test_caching_disabled_never_hits_and_frees_to_head():
    m = full_manager(10, block_size=4, enable_caching=False)
    a = Request("a", tokens(0, 12), 4)
    admit(m, a)
    m.free(a)
    assert free_ids(m) == [3, 2, 1, 4, 5, 6, 7, 8, 9]
    assert admit(m, Request("b", tokens(0, 12), 4))[1] == 0


def test_bad_arguments_rejected_without_change():
    m = full_manager(10, block_size=4)
    r = Request("r", tokens(0, 8), 4)
    before = pool_state(m)
    for kwargs in ({"num_new_tokens": 0}, {"num_new_tokens": -1}, {"num_new_tokens": 4, "num_lookahead_tokens": -2}):
        with pytest.raises(ValueError):
            m.allocate_slots(r, **kwargs)
    with pytest.raises(ValueError, match="hash_block_size 4"):
        m.allocate_slots(Request("x", tokens(0, 8), 8), 8)
    assert pool_state(m) == before
    admit(m, r)
    hits, _ = m.get_computed_blocks(Request("y", tokens(0, 9), 4))
    with pytest.raises(ValueError, match="running"):
        m.allocate_slots(r, 1, 0, hits)
    assert isinstance(m.get_blocks("r"), KVCacheBlocks)

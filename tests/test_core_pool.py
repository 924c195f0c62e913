"""FreeBlockQueue and BlockPool: exact order, exact ids, exact ref counts."""

import pytest

from kvservice.core import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeBlockQueue,
    KVCacheBlock,
    Request,
)
from kvservice.core.invariants import check_invariants
from tests.core_helpers import free_ids, full_manager, tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_order_and_prepend():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks[:1])
    q.prepend_n([blocks[4], blocks[5]])
    q.prepend_n([blocks[1], blocks[2]])
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5, 0]
    assert q.num_free_blocks == 5
    q.remove(blocks[4])
    assert ids(q.get_all_free_blocks()) == [1, 2, 5, 0]
    assert ids(q.popleft_n(2)) == [1, 2]
    q.append_n([blocks[3], blocks[1]])
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [5, 0, 3, 1, 2]
    assert q.popleft().block_id == 5
    assert ids(q.popleft_n(4)) == [0, 3, 1, 2]
    assert q.num_free_blocks == 0
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(blocks[3])


def test_pool_null_block_and_allocation_order():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(3)
    assert ids(got) == [1, 2, 3] and [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.get_usage() == pytest.approx(0.75)
    with pytest.raises(ValueError, match="Cannot get 2 free blocks"):
        pool.get_new_blocks(2)
    pool.free_blocks(reversed(got))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1, 4]
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_free_order_unhashed_to_head_hashed_to_tail():
    """The reference example: a request holds [1,2,3,4] with 1 and 2 hashed, queue [5]."""
    m = full_manager(6, block_size=4)
    r = Request("r", tokens(0, 14), 4)
    m.allocate_slots(r, 14)  # blocks 1..4; 3 full blocks would be cached...
    # ...so un-cache block 3 to match the example exactly: only 1 and 2 hashed.
    pool = m.block_pool
    b3 = pool.blocks[3]
    pool.cached_block_hash_to_block.pop(b3.block_hash, 3)
    b3.reset_hash()
    assert free_ids(m) == [5]
    m.free(r)
    assert free_ids(m) == [4, 3, 5, 2, 1]
    check_invariants(m)


def test_touch_rescues_free_cached_block_and_reallocation_evicts():
    m = full_manager(5, block_size=4, enable_events=True)
    a = Request("a", tokens(0, 8), 4)
    m.allocate_slots(a, 8)
    stored = m.take_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    assert stored[0].block_hashes == a.block_hashes[:2] and stored[0].parent_block_hash is None
    assert stored[0].token_ids.tolist() == tokens(0, 8) and stored[0].block_ids == [1, 2]
    m.free(a)
    assert free_ids(m) == [3, 4, 2, 1]
    # A new request with another prompt takes 3, 4, then the LRU cached block 2 (evicting its hash).
    b = Request("b", tokens(100, 12), 4)
    assert m.allocate_slots(b, 12).get_block_ids() == ([3, 4, 2],)
    events = m.take_events()
    assert isinstance(events[0], BlockRemoved) and events[0].block_hashes == [a.block_hashes[1]]
    assert isinstance(events[1], BlockStored) and events[1].block_hashes == b.block_hashes
    assert free_ids(m) == [1]
    # a's first block is still cached: a repeat of a gets it (touch removes it from the queue).
    a2 = Request("a2", tokens(0, 8), 4)
    hits, n = m.get_computed_blocks(a2)
    assert n == 4 and hits.get_block_ids() == ([1],)
    check_invariants(m)


def test_reset_prefix_cache_refused_while_in_use():
    m = full_manager(5, block_size=4, enable_events=True)
    a = Request("a", tokens(0, 8), 4)
    m.allocate_slots(a, 8)
    assert m.reset_prefix_cache() is False
    m.free(a)
    m.take_events()
    assert m.reset_prefix_cache() is True
    assert isinstance(m.take_events()[0], AllBlocksCleared)
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    assert m.get_computed_blocks(Request("again", tokens(0, 8), 4))[1] == 0
    assert m.make_prefix_cache_stats().reset is True

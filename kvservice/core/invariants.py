"""The block-pool invariants, checked by tests after every operation and by the server on demand."""

from __future__ import annotations

from collections import Counter

from kvservice.core.kv_cache_manager import KVCacheManager


class InvariantError(AssertionError):
    pass


def check_invariants(manager: KVCacheManager) -> None:
    """Raises InvariantError naming the first broken invariant.

    - every non-null block is in the free queue xor has ref_cnt > 0;
    - a block's ref_cnt equals the tables holding it plus its pending copy-on-write pins and the references
      held outside any table (`manager.held`);
    - no non-null block appears twice in one request's table for a group;
    - the null block is never in the free queue;
    - every index entry points to a block whose hash (or one of its partial keys) is the key;
    - the free-queue count matches its length.
    """
    pool = manager.block_pool
    coordinator = manager.coordinator
    free = pool.free_block_queue.get_all_free_blocks()
    if len(free) != pool.free_block_queue.num_free_blocks:
        raise InvariantError(f"free queue holds {len(free)} blocks but counts {pool.free_block_queue.num_free_blocks}")
    free_ids = {b.block_id for b in free}
    if len(free_ids) != len(free):
        raise InvariantError("a block is in the free queue twice")
    if pool.null_block.block_id in free_ids:
        raise InvariantError("the null block is in the free queue")
    holders: Counter[int] = Counter()
    for manager_ in coordinator.managers:
        for request_id, blocks in manager_.req_to_blocks.items():
            ids = [b.block_id for b in blocks if not b.is_null]
            if len(ids) != len(set(ids)):
                raise InvariantError(f"request {request_id!r} holds a block twice in group "
                                     f"{manager_.kv_cache_group_id}: {ids}")
            holders.update(ids)
    pins = Counter(coordinator.cow.pins)
    pins.update(manager.held.counts)  # a vLLM scheduler's copy retentions and direct takes
    for manager_ in coordinator.managers:  # a partial hit's pending copy retains both ends
        for src, dst in manager_._pending_cow_copies:
            pins[src.block_id] += 1
            pins[dst.block_id] += 1
    for block in pool.blocks[1:]:
        expected = holders[block.block_id] + pins[block.block_id]
        if block.ref_cnt != expected:
            raise InvariantError(f"block {block.block_id} has ref_cnt {block.ref_cnt}, "
                                 f"but {holders[block.block_id]} tables and {pins[block.block_id]} pins hold it")
        if (block.block_id in free_ids) == (block.ref_cnt > 0):
            raise InvariantError(f"block {block.block_id} (ref_cnt {block.ref_cnt}) is "
                                 f"{'in' if block.block_id in free_ids else 'not in'} the free queue")
    for key, block in pool.cached_block_hash_to_block.items():
        if block.block_hash != key and key not in pool.cached_block_hashes_by_block.get(block.block_id, ()):
            raise InvariantError(f"index entry {key.hex()} points to block {block.block_id} "
                                 f"whose hash is {block.block_hash!r}")
    num_hashed = sum(1 for b in pool.blocks if b.block_hash is not None)
    num_hashed += sum(len(keys) for keys in pool.cached_block_hashes_by_block.values())
    num_indexed = sum(1 for _ in pool.cached_block_hash_to_block.items())
    if num_hashed != num_indexed:
        raise InvariantError(f"{num_hashed} blocks carry a hash but the index holds {num_indexed} entries")

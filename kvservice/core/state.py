"""Exact export/import of a KVCacheManager's state (for snapshots): ref counts, free-queue order,
the prefix index in insertion order, every block table and pending copies. Packed arrays, so a
pool of a million blocks exports and imports in about a second."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from kvservice.core.free_queue import FreeBlockQueue
from kvservice.core.held_blocks import MAX_HELD_PER_BLOCK
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.stats import PrefixCacheStats

_STATS_FIELDS = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")


@dataclass(slots=True)
class GroupTables:
    request_keys: list[str] = field(default_factory=list)
    num_blocks: array = field(default_factory=lambda: array("I"))
    block_ids: array = field(default_factory=lambda: array("I"))
    running_keys: list[str] = field(default_factory=list)
    num_cached_block: array = field(default_factory=lambda: array("I"))
    cached_this_step: list[bytes] = field(default_factory=list)  # a Mamba group's states cached in this step
    # A Mamba group's per-request bookkeeping (MambaManager's): where the running state was last, the blocks
    # retired below, the requests allocated past their speculative blocks.
    last_state_block_idx: dict[str, int] = field(default_factory=dict)
    num_retired_blocks: dict[str, int] = field(default_factory=dict)
    allocated_block_reqs: list[str] = field(default_factory=list)
    checkpoints: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (position, block index)
    partial_hits: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (block index, block id)
    partial_tails: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (block id, tokens)
    # Partial hits' copies made and not yet taken by the scheduler (take_held_block_copies): (src, dst)
    pending_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class ManagerState:
    ref_cnts: array  # int32 per block id
    free_order: array  # block ids, head to tail
    index_keys: list[bytes]  # prefix index entries in insertion order...
    index_block_ids: array  # ...and the block each one maps to
    groups: list[GroupTables]
    copies: list[tuple[int, int]]
    evictions: int
    totals: tuple[int, int, int]  # queries, hits, requests
    interval: tuple[int, ...]
    interval_reset: bool
    # Per index entry: the prefix tokens its primary key covers, 0 for a block's extra (partial)
    # keys; None in snapshots that predate partial keys (then a block's first key is its primary).
    index_num_tokens: array | None = None
    # References held outside any table (a vLLM scheduler's copy retentions, direct takes, a connector's
    # touches): (block id, times held) pairs, flattened.
    held: array = field(default_factory=lambda: array("I"))


def export_manager_state(m: KVCacheManager) -> ManagerState:
    pool = m.block_pool
    ref_cnts = array("i", [b.ref_cnt for b in pool.blocks])
    free_order = array("I", [b.block_id for b in pool.free_block_queue.get_all_free_blocks()])
    keys: list[bytes] = []
    ids = array("I")
    num_tokens = array("I")
    for key, block in pool.cached_block_hash_to_block.items():
        keys.append(key)
        ids.append(block.block_id)
        num_tokens.append((block.block_hash_num_tokens or 1) if block.block_hash == key else 0)
    groups = []
    for manager in m.coordinator.managers:
        g = GroupTables()
        for key, blocks in manager.req_to_blocks.items():
            g.request_keys.append(key)
            g.num_blocks.append(len(blocks))
            g.block_ids.extend(b.block_id for b in blocks)
        for key, n in manager.num_cached_block.items():
            g.running_keys.append(key)
            g.num_cached_block.append(n)
        g.cached_this_step = sorted(getattr(manager, "cached_blocks_this_step", ()))
        g.last_state_block_idx = dict(getattr(manager, "last_state_block_idx", {}))
        g.num_retired_blocks = dict(getattr(manager, "_num_retired_blocks", {}))
        g.allocated_block_reqs = sorted(getattr(manager, "_allocated_block_reqs", ()))
        g.checkpoints = dict(getattr(manager, "_checkpoints", {}))
        g.partial_hits = {k: (i, b.block_id) for k, (i, b) in manager._partial_hit_reqs.items()}
        g.partial_tails = {k: (b.block_id, n) for k, (b, n) in getattr(manager, "_producer_partial_tail_reqs",
                                                                       {}).items()}
        g.pending_copies = [(src.block_id, dst.block_id) for src, dst in manager._pending_cow_copies]
        groups.append(g)
    totals = m.prefix_cache_totals
    stats = m.prefix_cache_stats
    return ManagerState(ref_cnts, free_order, keys, ids, groups,
                        [(s.block_id, d.block_id) for s, d in m.coordinator.cow.pairs], pool.num_evictions,
                        (totals.queries, totals.hits, totals.requests),
                        tuple(getattr(stats, f) for f in _STATS_FIELDS), stats.reset, num_tokens,
                        array("I", [n for pair in m.held.pairs() for n in pair]))


def import_manager_state(m: KVCacheManager, state: ManagerState) -> None:
    """Overwrites a freshly built manager (same config) with `state`.

    Raises:
        ValueError: when the state does not fit the manager (another config, a corrupt snapshot).
    """
    pool = m.block_pool
    blocks = pool.blocks
    n = len(blocks)
    if len(state.ref_cnts) != n:
        raise ValueError(f"snapshot has {len(state.ref_cnts)} blocks, the pool config {n}")
    if len(state.groups) != len(m.coordinator.managers):
        raise ValueError(f"snapshot has {len(state.groups)} KV-cache groups, the pool config "
                         f"{len(m.coordinator.managers)}")
    if state.free_order and max(state.free_order) >= n or state.index_block_ids and max(state.index_block_ids) >= n:
        raise ValueError("snapshot names block ids beyond the pool")
    if pool.get_num_free_blocks() != n - 1 or pool.cached_block_hash_to_block:
        raise ValueError("import_manager_state needs a freshly built manager")
    # A fresh pool has every block free, unhashed and linked: set only what differs.
    ref_cnts = np.frombuffer(state.ref_cnts, dtype=np.int32)
    for i in np.flatnonzero(ref_cnts[1:]).tolist():
        block = blocks[i + 1]
        block.ref_cnt = int(ref_cnts[i + 1])
        block.prev_free_block = block.next_free_block = None
    pool.free_block_queue = FreeBlockQueue([blocks[i] for i in state.free_order])
    cache = pool.cached_block_hash_to_block._cache
    insert = pool.cached_block_hash_to_block.insert
    extra = pool.cached_block_hashes_by_block
    num_tokens = state.index_num_tokens
    for i, (key, block_id) in enumerate(zip(state.index_keys, state.index_block_ids)):
        block = blocks[block_id]
        if block._block_hash is None if num_tokens is None else num_tokens[i] > 0:  # its primary key
            block._block_hash = key
            block._block_hash_num_tokens = num_tokens[i] if num_tokens is not None else None
        else:
            extra.setdefault(block_id, set()).add(key)
        if key in cache:
            insert(key, block)  # several blocks under one hash: keep their order
        else:
            cache[key] = block
    for manager, g in zip(m.coordinator.managers, state.groups):
        pos = 0
        for key, count in zip(g.request_keys, g.num_blocks):
            manager.req_to_blocks[key] = [blocks[i] for i in g.block_ids[pos:pos + count]]
            pos += count
        manager.num_cached_block.update(zip(g.running_keys, g.num_cached_block))
        if g.cached_this_step:
            if not hasattr(manager, "cached_blocks_this_step"):
                raise ValueError(f"snapshot has states cached this step in a {type(manager).__name__} group")
            manager.cached_blocks_this_step.update(g.cached_this_step)
        named = [b for _, b in g.partial_hits.values()] + [b for b, _ in g.partial_tails.values()]
        named += [b for pair in g.pending_copies for b in pair]
        if named and max(named) >= n:
            raise ValueError("snapshot's partial hits name block ids beyond the pool")
        manager._partial_hit_reqs.update((k, (i, blocks[b])) for k, (i, b) in g.partial_hits.items())
        manager._pending_cow_copies.extend((blocks[src], blocks[dst]) for src, dst in g.pending_copies)
        if g.last_state_block_idx or g.num_retired_blocks or g.allocated_block_reqs or g.checkpoints \
                or g.partial_tails:
            if not hasattr(manager, "last_state_block_idx"):
                raise ValueError(f"snapshot has Mamba request state in a {type(manager).__name__} group")
            manager.last_state_block_idx.update(g.last_state_block_idx)
            manager._num_retired_blocks.update(g.num_retired_blocks)
            manager._allocated_block_reqs.update(g.allocated_block_reqs)
            manager._checkpoints.update(g.checkpoints)
            manager._producer_partial_tail_reqs.update((k, (blocks[b], n)) for k, (b, n) in g.partial_tails.items())
    for src, dst in state.copies:
        m.coordinator.cow.add(blocks[src], blocks[dst])
    held = state.held
    if len(held) % 2 or any(held[i] >= n or not 0 < held[i + 1] <= MAX_HELD_PER_BLOCK for i in range(0, len(held), 2)):
        raise ValueError("snapshot's held blocks are not (block id, times held) pairs of this pool")
    m.held.restore(zip(held[::2], held[1::2]))
    pool.num_evictions = state.evictions
    totals = m.prefix_cache_totals
    totals.queries, totals.hits, totals.requests = state.totals
    stats = PrefixCacheStats(*state.interval, reset=state.interval_reset)
    m.prefix_cache_stats = stats

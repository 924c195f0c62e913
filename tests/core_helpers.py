"""Helpers for core tests: exact state snapshots and short constructors."""

from __future__ import annotations

from kvservice.core import FullAttentionSpec, KVCacheConfig, KVCacheManager, Request


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(manager: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in manager.block_pool.blocks[1:] if b.ref_cnt}


def pool_state(manager: KVCacheManager) -> tuple:
    """Everything allocation can change, for 'nothing changed' assertions (an empty table is no table:
    vLLM's managers create one on a read)."""
    pool = manager.block_pool
    coordinator = manager.coordinator
    return (
        tuple(free_ids(manager)),
        tuple((b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks),
        tuple(sorted((k, b.block_id) for k, b in pool.cached_block_hash_to_block.items())),
        tuple(tuple(sorted((r, tuple(b.block_id for b in blocks)) for r, blocks in m.req_to_blocks.items() if blocks))
              for m in coordinator.managers),
        tuple(tuple(sorted(m.num_cached_block.items())) for m in coordinator.managers),
        tuple((s.block_id, d.block_id) for s, d in coordinator.cow.pairs),
    )


def full_manager(num_blocks: int, block_size: int = 4, max_model_len: int = 4096, **kw) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks, [FullAttentionSpec(block_size)]), max_model_len, **kw)


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None, **kw):
    """Looks up the prefix cache and allocates the rest of the prompt (or `num_new_tokens`), as a
    scheduler admitting a waiting request would. Returns (new blocks or None, num hit tokens)."""
    hits, num_hit = manager.get_computed_blocks(request)
    n = request.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    new = manager.allocate_slots(request, n, num_hit, hits, **kw)
    if new is not None:
        request.num_computed_tokens = num_hit + n
    return new, num_hit


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))

"""The coordinator: drives one manager per KV-cache group and agrees on one prefix-hit length.

Unitary (one group) looks up directly; hybrid runs a fixed-point loop in which every spec group
can only shrink the hit; without caching nothing ever hits.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.core.block import KVCacheBlock
from kvservice.core.block_pool import BlockPool
from kvservice.core.managers import MANAGER_TYPES, CopyOnWrite, SingleTypeManager
from kvservice.core.request import Request
from kvservice.core.specs import FullAttentionSpec, KVCacheConfig, lcm_block_size
from kvservice.hashing import BlockHash


class KVCacheCoordinator:
    def __init__(self, config: KVCacheConfig, block_pool: BlockPool, hash_block_size: int,
                 dcp_world_size: int = 1) -> None:
        self.config = config
        self.block_pool = block_pool
        self.hash_block_size = hash_block_size
        self.cow = CopyOnWrite()
        self.managers: list[SingleTypeManager] = [
            MANAGER_TYPES[type(spec)](spec, block_pool, i, hash_block_size, self.cow, dcp_world_size)
            for i, spec in enumerate(config.groups)
        ]
        self.scheduler_block_size = lcm_block_size(config, dcp_world_size)
        # Groups with equal specs are looked up together; full attention first (it only shrinks).
        batches: dict[object, list[int]] = {}
        for i, spec in enumerate(config.groups):
            batches.setdefault(spec, []).append(i)
        self.spec_groups = sorted(batches.items(), key=lambda kv: not isinstance(kv[0], FullAttentionSpec))

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        if not self.block_pool.enable_caching:
            return tuple([] for _ in self.managers), 0
        if len(self.managers) == 1:
            manager = self.managers[0]
            hit = manager.find_longest_cache_hit(block_hashes, max_length, [0], manager.block_size)
            return hit, len(hit[0]) * manager.block_size
        return self._find_hybrid_hit(block_hashes, max_length)

    def _find_hybrid_hit(self, block_hashes, max_length):
        hits: list[list[KVCacheBlock] | None] = [None] * len(self.managers)
        align = self.scheduler_block_size
        # Full attention plus exactly one other type settles in one pass.
        one_pass = len(self.spec_groups) == 2 and isinstance(self.spec_groups[0][0], FullAttentionSpec)
        hit_length = max_length
        while True:
            length = hit_length
            for spec, group_ids in self.spec_groups:
                manager = self.managers[group_ids[0]]
                if isinstance(spec, FullAttentionSpec) and hits[group_ids[0]] is not None:
                    # Downward closed: a shorter hit is a prefix of the one already found.
                    num_blocks = length // manager.block_size
                    length = num_blocks * manager.block_size
                    for g in group_ids:
                        del hits[g][num_blocks:]
                else:
                    found = manager.find_longest_cache_hit(block_hashes, length, group_ids, align)
                    length = len(found[0]) * manager.block_size
                    for g, blocks in zip(group_ids, found):
                        hits[g] = blocks
            if length >= hit_length:
                break
            hit_length = length
            if one_pass:
                break
        spec, group_ids = self.spec_groups[0]
        if isinstance(spec, FullAttentionSpec):
            num_blocks = hit_length // self.managers[group_ids[0]].block_size
            for g in group_ids:
                del hits[g][num_blocks:]
        return tuple(h if h is not None else [] for h in hits), hit_length

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
                                   total_computed_tokens: int) -> int:
        """Free blocks the allocation consumes: new ones, rescued hits and copy-on-write copies."""
        total = 0
        for i, m in enumerate(self.managers):
            total += m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i],
                                                  total_computed_tokens)
            total += len(m.cow_indices(request_id, total_computed_tokens, num_tokens))
        return total

    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
                                     num_computed_tokens: int) -> None:
        for i, m in enumerate(self.managers):
            m.allocate_new_computed_blocks(request_id, new_computed_blocks[i], num_computed_tokens)

    def apply_copy_on_write(self, request_id: str, total_computed_tokens: int,
                            num_tokens: int) -> list[tuple[int, int, int]]:
        """(group, index, new block id) of every table entry swapped by copy-on-write."""
        swapped: list[tuple[int, int, int]] = []
        for g, m in enumerate(self.managers):
            for index, block_id in m.apply_copy_on_write(request_id, total_computed_tokens, num_tokens):
                swapped.append((g, index, block_id))
        return swapped

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        if len(self.managers) == 1:
            return (self.managers[0].allocate_new_blocks(request_id, num_tokens),)
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.managers)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if len(self.managers) > 1:
            # Hybrid hits are scheduler-block aligned: a block past the last aligned boundary could
            # never be hit, so it is not cached (yet).
            num_tokens = num_tokens // self.scheduler_block_size * self.scheduler_block_size
        for m in self.managers:
            m.cache_blocks(request, num_tokens)

    def fork(self, parent_id: str, child_id: str) -> None:
        for m in self.managers:
            m.fork(parent_id, child_id)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def take_block_copies(self) -> list[tuple[int, int]]:
        if not self.cow.pairs:  # the common step: nothing copied, nothing pinned
            return []
        pairs, self.cow.pairs = self.cow.pairs, []
        self.cow.pins.clear()
        # The pins drop only now: a source whose holders all left returns to the free queue.
        self.block_pool.free_blocks(src for src, _ in pairs)
        return [(src.block_id, dst.block_id) for src, dst in pairs]

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.managers)

    def is_running(self, request_id: str) -> bool:
        return request_id in self.managers[0].num_cached_block

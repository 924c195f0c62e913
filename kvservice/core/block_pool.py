"""BlockPool: the mechanism. Owns every physical block, the free queue and the prefix index.

Policy (which blocks a request needs, what hits) lives in the managers above it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvservice.core.block import BlockHashWithGroupId, KVCacheBlock, make_block_hash_with_group_id
from kvservice.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvservice.core.free_queue import FreeBlockQueue
from kvservice.hashing import BlockHash

if TYPE_CHECKING:
    from kvservice.core.request import Request

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def gc_paused():
    """Pauses the cyclic garbage collector while building many long-lived objects at once."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class BlockHashToBlockMap:
    """Prefix index: key -> block, or {block_id: block} when several blocks carry one hash.

    There is no de-duplication on insert (two requests may cache identical blocks), because block
    tables are append-only: a request never swaps a block it already holds for an equal one.
    """

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def get_cached_prefix(self, block_hashes: Sequence[BlockHash], group_suffix: bytes,
                          max_blocks: int) -> list[KVCacheBlock]:
        """The blocks cached under block_hashes[0], [1], ... (the first block of each), up to the first
        miss or `max_blocks`: one group's prefix lookup in one loop (the fast path's admission)."""
        get = self._cache.get
        out: list[KVCacheBlock] = []
        append = out.append
        for i in range(max_blocks):
            entry = get(block_hashes[i] + group_suffix)
            if entry is None:
                break
            append(entry if type(entry) is KVCacheBlock else next(iter(entry.values())))
        return out

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = block
        elif isinstance(entry, KVCacheBlock):
            self._cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Removes the entry of `block_id` under `key` only (other blocks with that hash stay)."""
        entry = self._cache.pop(key, None)
        if entry is None:
            return None
        if isinstance(entry, KVCacheBlock):
            if entry.block_id == block_id:
                return entry
            self._cache[key] = entry
            return None
        block = entry.pop(block_id, None)
        if len(entry) == 1:
            self._cache[key] = next(iter(entry.values()))
        elif entry:
            self._cache[key] = entry
        return block

    def items(self) -> Iterable[tuple[BlockHashWithGroupId, KVCacheBlock]]:
        for key, entry in self._cache.items():
            if isinstance(entry, KVCacheBlock):
                yield key, entry
            else:
                for block in entry.values():
                    yield key, block

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """`num_blocks` includes the null block (block 0), which is never free, handed out or cached."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_events: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (the null block plus at least one), "
                             f"got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        with gc_paused():  # a million new objects would otherwise trigger ever longer collections
            self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVCacheEvent] = []
        self.num_evictions = 0

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for `block_hash`, or None unless every group has one."""
        out = []
        lookup = self.cached_block_hash_to_block.get_one_block
        for group_id in kv_cache_group_ids:
            block = lookup(block_hash + group_id.to_bytes(4, "big"))
            if block is None:
                return None
            out.append(block)
        return out

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> None:
        """Caches blocks[num_cached_blocks:num_full_blocks] under the request's hashes.

        Args:
            block_hashes: the request's hashes at `block_size` granularity (default: its own list,
                which is at the hash block size).
        """
        if num_cached_blocks >= num_full_blocks:
            return
        if block_hashes is None:
            block_hashes = request.block_hashes
        if len(block_hashes) < num_full_blocks:
            raise RuntimeError(f"request {request.request_id!r} has {len(block_hashes)} block hashes, "
                               f"{num_full_blocks} needed to cache its full blocks")
        suffix = kv_cache_group_id.to_bytes(4, "big")
        insert = self.cached_block_hash_to_block.insert
        run_start = num_cached_blocks  # events: one BlockStored per run of newly cached blocks
        stored: list[BlockHash] = []
        stored_ids: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:  # skipped by a window: nothing to cache
                continue
            block_hash = block_hashes[i]
            key = BlockHashWithGroupId(block_hash + suffix)
            if block._block_hash is not None:
                # Already cached by another table holding it (a fork's sibling): same tokens, same hash.
                if block._block_hash != key:
                    raise RuntimeError(f"block {block.block_id} is cached under another hash than "
                                       f"request {request.request_id!r}'s block {i}")
                self._stored_event(request, stored, stored_ids, block_hashes, run_start, i, block_size,
                                   kv_cache_group_id)
                stored, stored_ids, run_start = [], [], i + 1
                continue
            block.block_hash = key
            insert(key, block)
            stored.append(block_hash)
            stored_ids.append(block.block_id)
        self._stored_event(request, stored, stored_ids, block_hashes, run_start, num_full_blocks, block_size,
                           kv_cache_group_id)

    def _stored_event(self, request: Request, stored: list[BlockHash], stored_ids: list[int],
                      block_hashes: Sequence[BlockHash], start: int, end: int, block_size: int,
                      kv_cache_group_id: int) -> None:
        """One BlockStored for blocks start..end of the request, when events are on and any were stored."""
        if self.enable_events and stored:
            parent = block_hashes[start - 1] if start > 0 else None
            token_ids = request.token_ids_between(start * block_size, end * block_size)
            self.kv_event_queue.append(BlockStored(
                block_hashes=stored, parent_block_hash=parent, token_ids=token_ids, block_size=block_size,
                group_idx=kv_cache_group_id, lora_name=request.lora_name, block_ids=stored_ids))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops `num_blocks` from the head of the free queue, evicting any that are still cached."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                             f"({self.free_block_queue.num_free_blocks} free)")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            for block in blocks:
                if block._block_hash is not None:
                    self._evict(block)
                block.ref_cnt += 1
        else:
            for block in blocks:
                block.ref_cnt += 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> bool:
        key = block._block_hash
        if self.cached_block_hash_to_block.pop(key, block.block_id) is None:
            return False
        block.reset_hash()
        self.num_evictions += 1
        if self.enable_events:
            self.kv_event_queue.append(BlockRemoved([key[:-4]], int.from_bytes(key[-4:], "big")))
        return True

    def touch(self, blocks: Iterable[Sequence[KVCacheBlock]]) -> None:
        """Takes a reference on cache-hit blocks (one sequence per group), rescuing free ones."""
        remove = self.free_block_queue.remove
        for group_blocks in blocks:
            for block in group_blocks:
                if block.ref_cnt == 0:  # the null block's count stays 0: one test for a shared hit
                    if block.is_null:
                        continue
                    remove(block)
                block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each; blocks reaching 0 go to the head if unhashed (reused first) or
        to the tail if cached (LRU). Callers pass a request's blocks tail first."""
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if caching and block._block_hash is not None:
                    hashed.append(block)
                else:
                    unhashed.append(block)
        self.free_block_queue.prepend_n(unhashed)
        if hashed:
            self.free_block_queue.append_n(hashed)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use."""
        num_used = self.num_blocks - self.get_num_free_blocks()
        if num_used != 1:  # the null block always counts as used
            logger.warning("reset_prefix_cache refused: %d blocks are still in use", num_used - 1)
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.reset_hash()
        if self.enable_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def release(self) -> None:
        """Breaks the free queue's reference cycles so a discarded pool is freed by reference counting
        alone (its blocks may have been frozen out of the cyclic GC)."""
        for block in self.blocks:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = FreeBlockQueue([])
        self.cached_block_hash_to_block = BlockHashToBlockMap()

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def take_events(self) -> list[KVCacheEvent]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events


__all__ = ["BlockPool", "BlockHashToBlockMap", "make_block_hash_with_group_id"]

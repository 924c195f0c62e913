"""BlockPool: the mechanism. Owns every physical block, the free queue and the prefix index.

Policy (which blocks a request needs, what hits) lives in the managers above it. A block may carry
several index keys: its primary hash (`block.block_hash`) and partial-prefix entries registered at
boundaries inside it (`cached_block_hashes_by_block`); eviction drops them all.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvservice.core.block import BlockHashWithGroupId, KVCacheBlock, make_block_hash_with_group_id
from kvservice.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvservice.core.free_queue import FreeBlockQueue
from kvservice.core.hash_map import BlockHashToBlockMap
from kvservice.core.hash_views import resolve_block_hashes
from kvservice.hashing import BlockHash

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


class BlockPool:
    """`num_blocks` includes the null block (block 0), which is never free, handed out or cached.

    Args:
        hash_block_size: the granularity of requests' `block_hashes` (None: every group's block size).
        num_hash_lookahead_tokens: tokens after each block its hash covers (EAGLE lookahead hashes).
        metrics_collector: optional residency tracker (`on_block_allocated/accessed/evicted`, `reset`).
    """

    # Whether a cache_full_blocks call that stores nothing (every block null or masked) still emits
    # a BlockStored, as vLLM's does (the drop-in turns it on).
    emit_empty_stored_events = False

    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_events: bool = False, *,
                 hash_block_size: int | None = None, num_hash_lookahead_tokens: int = 0, medium: str = "GPU",
                 metrics_collector: Any = None) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (the null block plus at least one), "
                             f"got {num_blocks!r}")
        self.num_blocks = self.num_gpu_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = self.enable_kv_cache_events = enable_events
        self.hash_block_size = hash_block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.medium = medium
        self.metrics_collector = metrics_collector
        with gc_paused():  # a million new objects would otherwise trigger ever longer collections
            self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Extra (partial-prefix) keys of blocks that also carry a primary hash.
        self.cached_block_hashes_by_block: dict[int, set[BlockHashWithGroupId]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVCacheEvent] = []
        self.num_evictions = 0
        # Blocks released by `unpin_blocks` stay readable until handed out again.
        self._reuse_watchers: dict[int, Callable[[KVCacheBlock], None]] = {}

    # ---- lookups -----------------------------------------------------------------------------
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

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        """Whether its sole owner may overwrite it (not shared, not cached)."""
        return not block.is_null and block.ref_cnt == 1 and block._block_hash is None

    # ---- caching -----------------------------------------------------------------------------
    def _hashes_at(self, request, block_size: int) -> Sequence[BlockHash]:
        hash_bs = self.hash_block_size or block_size
        return resolve_block_hashes(request.block_hashes, hash_bs, block_size)

    def cache_full_blocks(self, request, blocks: Sequence[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: Sequence[bool] | None = None) -> None:
        """Caches blocks[num_cached_blocks:num_full_blocks] under the request's hashes, skipping null
        blocks and those `block_mask` (aligned with that range) marks False: blocks no hit can use.
        A block already cached under the same key (a fork's sibling cached it) is left as it is; one
        keyed at a boundary inside it (a partial entry) is re-keyed at its full boundary."""
        if num_cached_blocks >= num_full_blocks:
            return
        if block_mask is not None and len(block_mask) != num_full_blocks - num_cached_blocks:
            raise AssertionError(f"block_mask has {len(block_mask)} entries for "
                                 f"{num_full_blocks - num_cached_blocks} blocks")
        block_hashes = self._hashes_at(request, block_size)
        if len(block_hashes) < num_full_blocks:
            raise RuntimeError(f"request {request.request_id!r} has {len(block_hashes)} block hashes, "
                               f"{num_full_blocks} needed to cache its full blocks")
        suffix = kv_cache_group_id.to_bytes(4, "big")
        insert = self.cached_block_hash_to_block.insert
        events = self.enable_events
        stored: list[BlockHash] = []
        stored_ids: list[int] = []
        starts: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or (block_mask is not None and not block_mask[i - num_cached_blocks]):
                continue
            block_hash = block_hashes[i]
            key = BlockHashWithGroupId(block_hash + suffix)
            num_tokens = (i + 1) * block_size
            current = block._block_hash
            if current is None:  # the common case: a fresh block, no key anywhere yet
                block.set_block_hash(key, num_tokens)
                insert(key, block)
            elif current == key:  # a fork's sibling cached it: the same prefix, the same key
                continue
            else:  # keyed at a boundary inside it (a partial entry): re-keyed at its end
                if block._block_hash_num_tokens is None or block._block_hash_num_tokens >= num_tokens:
                    # Cached whole under another prefix: only a client that counted tokens computed which
                    # it never had slots for gets here (a block it shares was filled by the other holder).
                    # Shared, the other holder's key stands; held by this request alone, whose KV it holds
                    # is unknown: it leaves the prefix cache, cached under neither.
                    if block.ref_cnt > 1:
                        continue
                    logger.warning("block %d was cached under another prefix than request %r's block %d: "
                                   "uncached", block.block_id, request.request_id, i)
                    self._emit_block_removed_events(self._remove_cached_block_hashes(block))
                    continue
                self._emit_block_removed_events(self._remove_cached_block_hashes(block))
                self._insert_block_hash(key, block, num_tokens)
            if events:
                stored.append(block_hash)
                stored_ids.append(block.block_id)
                starts.append(i * block_size)
        if events and (stored or self.emit_empty_stored_events):
            parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            self.kv_event_queue.append(self._stored_event(
                request, stored, parent, num_cached_blocks * block_size, num_full_blocks * block_size, block_size,
                kv_cache_group_id, stored_ids, starts))

    def emit_cached_block_events(self, request, num_cached_blocks: int, block_size: int,
                                 kv_cache_group_id: int) -> None:
        """BlockStored for a request's prefix-cache hits (already cached; nothing changes), for
        consumers that learn a prefix only from events."""
        if not self.enable_events or num_cached_blocks == 0:
            return
        block_hashes = self._hashes_at(request, block_size)
        hashes = [block_hashes[i] for i in range(num_cached_blocks)]
        self.kv_event_queue.append(self._stored_event(
            request, hashes, None, 0, num_cached_blocks * block_size, block_size, kv_cache_group_id, [],
            [i * block_size for i in range(num_cached_blocks)]))

    def cache_partial_block(self, request, block: KVCacheBlock, num_tokens: int, kv_cache_group_id: int,
                            block_size: int, replace_existing_hashes: bool = False) -> BlockHashWithGroupId | None:
        """Makes `block` reachable from the prefix boundary `num_tokens` (a multiple of the hash block
        size inside it): a sub-block prefix entry, no new block.

        Returns:
            The key registered (or already there), None for the null block.
        """
        if block.is_null:
            return None
        hash_bs = self.hash_block_size or block_size
        if block_size % hash_bs != 0 or num_tokens % hash_bs != 0:
            raise AssertionError(f"partial entry at {num_tokens} tokens is not on the hash block size {hash_bs}")
        num_hash_blocks = num_tokens // hash_bs
        if not 0 < num_hash_blocks <= len(request.block_hashes):
            raise AssertionError(f"request {request.request_id!r} has no hash at {num_tokens} tokens")
        block_hash = request.block_hashes[num_hash_blocks - 1]
        key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
        cached = block._block_hash == key or self.cached_block_hash_to_block.contain(key, block.block_id)
        if replace_existing_hashes:
            self._emit_block_removed_events(self._remove_cached_block_hashes(block))
            cached = False
        elif not cached and block._block_hash is not None and (
                block._block_hash_num_tokens is None or block._block_hash_num_tokens < num_tokens):
            # A later boundary supersedes an earlier partial key of the same block.
            self._emit_block_removed_events(self._remove_cached_block_hashes(block))
        self._insert_block_hash(key, block, num_hash_blocks * hash_bs)
        if self.enable_events and not cached:
            parent = request.block_hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None
            start = (num_hash_blocks - 1) * hash_bs
            self.kv_event_queue.append(self._stored_event(
                request, [block_hash], parent, start, num_tokens, num_tokens - start, kv_cache_group_id,
                [block.block_id], [start]))
        return key

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        """Drops every index key of `block` and its hash; returns the keys that were indexed."""
        keys: list[BlockHashWithGroupId] = []
        if block._block_hash is not None:
            keys.append(block._block_hash)
        if self.cached_block_hashes_by_block:
            keys.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))
        if not keys:
            return keys
        pop = self.cached_block_hash_to_block.pop
        removed = [key for key in keys if pop(key, block.block_id) is not None]
        block.reset_hash()
        return removed

    def _emit_block_removed_events(self, keys: list[BlockHashWithGroupId]) -> None:
        if self.enable_events:
            for key in keys:
                self.kv_event_queue.append(self._removed_event(key[:-4], int.from_bytes(key[-4:], "big")))

    def _insert_block_hash(self, key: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int | None) -> None:
        if block._block_hash == key or self.cached_block_hash_to_block.contain(key, block.block_id):
            return
        if block._block_hash is None:
            block.set_block_hash(key, num_tokens)
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
        self.cached_block_hash_to_block.insert(key, block)

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Re-points `src_block`'s index entries at `dst_block` (a private copy keeps them while the
        owner overwrites the source); no events: the entries stay live."""
        if dst_block._block_hash is not None or dst_block.block_id in self.cached_block_hashes_by_block:
            raise AssertionError(f"block {dst_block.block_id} already carries hashes")
        num_tokens = src_block._block_hash_num_tokens
        for key in self._remove_cached_block_hashes(src_block):
            self._insert_block_hash(key, dst_block, num_tokens)

    # ---- allocation --------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops `num_blocks` from the head of the free queue, evicting any that are still cached."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                             f"({self.free_block_queue.num_free_blocks} free)")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        collector = self.metrics_collector
        if self.enable_caching:
            for block in blocks:
                if block._block_hash is not None:  # partial keys exist only beside a primary one
                    self._evict(block)
                elif collector is not None:
                    collector.on_block_evicted(block)
                block.ref_cnt += 1
        else:
            for block in blocks:
                block.ref_cnt += 1
        if collector is not None:
            for block in blocks:
                collector.on_block_allocated(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> bool:
        if self.metrics_collector is not None:
            self.metrics_collector.on_block_evicted(block)
        removed = self._remove_cached_block_hashes(block)
        if not removed:
            return False
        self.num_evictions += 1
        self._emit_block_removed_events(removed)
        return True

    _maybe_evict_cached_block = _evict  # vLLM's name

    def _notify_reuse(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            watcher = self._reuse_watchers.pop(block.block_id, None)
            if watcher is not None:
                watcher(block)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[[KVCacheBlock], None]) -> None:
        """Releases references to blocks that stay readable until reused: they join the free queue's
        tail (last to be reused) and `on_reuse` fires when one is handed out again (or on reset)."""
        released = []
        for block in blocks:
            if block.ref_cnt <= 0 or block.is_null:
                raise AssertionError(f"unpin_blocks: block {block.block_id} is not pinned")
            block.ref_cnt -= 1
            self._reuse_watchers[block.block_id] = on_reuse
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on cache-hit blocks, rescuing free ones from the queue."""
        remove = self.free_block_queue.remove
        collector = self.metrics_collector
        for block in blocks:
            if block.ref_cnt == 0:  # the null block's count stays 0: one test for a shared hit
                if block.is_null:
                    continue
                remove(block)
            block.ref_cnt += 1
            if collector is not None:
                collector.on_block_accessed(block)

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

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drops these blocks from the prefix index (held blocks stay held, just uncached)."""
        for block_id in block_ids:
            if not 0 <= block_id < len(self.blocks):
                raise ValueError(f"block id {block_id} is not in this pool of {len(self.blocks)} blocks")
            self._evict(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use."""
        num_used = self.num_blocks - self.get_num_free_blocks()
        if num_used != 1:  # the null block always counts as used
            logger.warning("reset_prefix_cache refused: %d blocks are still in use", num_used - 1)
            return False
        self.cached_block_hash_to_block.clear()  # (in place: whoever listens to it is told)
        self.cached_block_hashes_by_block.clear()
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        for block in self.blocks:
            block.reset_hash()
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.enable_events:
            self.kv_event_queue.append(self._cleared_event())
        return True

    def release(self) -> None:
        """Breaks the free queue's and blocks' reference cycles so a discarded pool is freed by
        reference counting alone (its blocks may have been frozen out of the cyclic GC)."""
        for block in self.blocks:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = FreeBlockQueue([])
        self.cached_block_hash_to_block.clear()

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        total = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total if total else 0.0

    def take_events(self) -> list[KVCacheEvent]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    # ---- event records (the vLLM drop-in builds vLLM's own) -----------------------------------
    def _stored_event(self, request, block_hashes: list[BlockHash], parent_block_hash: BlockHash | None,
                      start_token: int, end_token: int, block_size: int, group_id: int, block_ids: list[int],
                      block_starts: list[int]) -> KVCacheEvent:
        token_ids = request.token_ids_between(start_token, end_token) if hasattr(request, "token_ids_between") \
            else array("I", request.all_token_ids[start_token:end_token])
        return BlockStored(block_hashes=block_hashes, parent_block_hash=parent_block_hash, token_ids=token_ids,
                           block_size=block_size, group_idx=group_id, lora_name=getattr(request, "lora_name", None),
                           medium=self.medium, block_ids=block_ids, session_id=getattr(request, "session_id", None))

    def _removed_event(self, block_hash: BlockHash, group_id: int) -> KVCacheEvent:
        return BlockRemoved([block_hash], group_id, self.medium)

    def _cleared_event(self) -> KVCacheEvent:
        return AllBlocksCleared(self.medium)


__all__ = ["BlockPool", "BlockHashToBlockMap", "make_block_hash_with_group_id"]

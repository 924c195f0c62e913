"""Managers whose blocks, once written, are read until the request ends (full attention and its
variants: reference sliding window, attention sinks), plus the two that never prefix-cache (a
circular buffer, cross attention)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvservice.core.block import KVCacheBlock
from kvservice.core.block_pool import BlockPool
from kvservice.core.hash_views import CoarseBlockHashes, resolve_block_hashes
from kvservice.core.managers.base import SingleTypeManager, cdiv
from kvservice.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheSpec, RSWASpec
from kvservice.hashing import BlockHash


class FullAttentionManager(SingleTypeManager):
    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        """Left to right: a miss means every later block misses too (chained hashes). With a
        fine-grained alignment (finer than the block), the first block past the full run is probed at
        its interior hash boundaries, longest first. EAGLE drops one alignment unit (at most a block)."""
        if not isinstance(kv_cache_spec, (FullAttentionSpec, ChunkedLocalAttentionSpec)):
            raise AssertionError("FullAttentionManager serves full (and chunked local) attention groups only")
        block_size = kv_cache_spec.block_size * (dcp_world_size if dcp_world_size > 1 else 1)
        hash_bs = block_pool.hash_block_size or block_size
        hashes = resolve_block_hashes(block_hashes, hash_bs, block_size,
                                      supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup,
                                      alignment_tokens=alignment_tokens)
        fine_grained = alignment_tokens < block_size and block_size % alignment_tokens == 0
        full_hashes = CoarseBlockHashes(hashes, alignment_tokens, block_size) if fine_grained else hashes
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        get_cached = block_pool.get_cached_block
        for i in range(min(max_length // block_size, len(full_hashes))):
            cached = get_cached(full_hashes[i], kv_cache_group_ids)
            if cached is None:
                break
            for out, block in zip(computed, cached):
                out.append(block)
        hit_length = len(computed[0]) * block_size
        if fine_grained:
            scale = block_size // alignment_tokens
            first = len(computed[0]) * scale
            last = min(first + scale - 1, max_length // alignment_tokens, len(hashes))
            for fine in range(last - 1, first - 1, -1):
                cached = get_cached(hashes[fine], kv_cache_group_ids)
                if cached is None:
                    continue
                for out, block in zip(computed, cached):
                    out.append(block)
                hit_length = (fine + 1) * alignment_tokens
                break
        if drop_eagle_block and hit_length > 0:
            hit_length -= min(alignment_tokens, block_size)
        hit_length -= hit_length % alignment_tokens
        num_blocks = cdiv(hit_length, block_size)
        for out in computed:
            del out[num_blocks:]
        return computed, hit_length

    def cache_blocks(self, request, num_tokens: int, retention_interval: int | None = None, *,
                     replay_boundaries: Sequence[int] = ()) -> None:
        # Every full block can serve a hit: no reachability mask (the decode path calls this often).
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = min(num_tokens, len(request.block_hashes) * self.hash_block_size) // self.block_size
        if num_cached < num_full:
            self.block_pool.cache_full_blocks(request, self.req_to_blocks[request_id], num_cached, num_full,
                                              self.block_size, self.kv_cache_group_id)
            self.num_cached_block[request_id] = num_full
        if self.partial_tails and self.block_size != self.hash_block_size:
            self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request, num_tokens: int) -> None:
        """Registers the prompt's last hash boundary when it ends inside a block, so a resend hits it."""
        hash_bs = self.hash_block_size
        limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        boundary = min(limit // hash_bs, len(request.block_hashes)) * hash_bs
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks[request.request_id]
        block_idx = boundary // self.block_size
        if block_idx < len(blocks):
            self.block_pool.cache_partial_block(request, blocks[block_idx], boundary, self.kv_cache_group_id,
                                                self.block_size)


class RSWAManager(FullAttentionManager):
    """Reference sliding window: with the prompt length given, frees the gap between the prompt's
    blocks and the decode window (per-request KV bounded by prompt + window)."""

    def __init__(self, kv_cache_spec: RSWASpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.rswa_window = kv_cache_spec.rswa_window

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is None:
            super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
            return
        window_start = max(num_prompt_tokens, processed_computed_tokens - self.rswa_window)
        self._remove_blocks_in_range(request_id, cdiv(num_prompt_tokens, self.block_size),
                                     window_start // self.block_size)


class SinkFullAttentionManager(FullAttentionManager):
    def __init__(self, kv_cache_spec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        sink_len = kv_cache_spec.sink_len
        if not sink_len or sink_len % self.block_size != 0:
            raise AssertionError(f"sink_len {sink_len} must be a positive multiple of the block size {self.block_size}")


class CircularBufferManager(FullAttentionManager):
    """One ring block per request for its whole life; never prefix cached."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    def _claim_ring_block(self, request_id: str, record_for_zeroing: bool = True) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks[request_id]
        if req_blocks:
            return []
        new_blocks = self.block_pool.get_new_blocks(1)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int | None = None) -> list[KVCacheBlock]:
        return self._claim_ring_block(request_id)

    def allocate_external_computed_blocks(self, request_id, num_local_computed_tokens, num_external_computed_tokens,
                                          record_for_zeroing=True) -> None:
        self._claim_ring_block(request_id, record_for_zeroing)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        return tuple([] for _ in kv_cache_group_ids), 0

    def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries=()) -> None:
        return

    def add_local_computed_blocks(self, request_id, new_computed_blocks, num_local_computed_tokens,
                                  num_external_computed_tokens) -> None:
        return

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None) -> None:
        return


class CrossAttentionManager(SingleTypeManager):
    """Encoder-decoder cross attention: allocated once for the encoder tokens, never cached."""

    def add_local_computed_blocks(self, request_id, new_computed_blocks, num_local_computed_tokens,
                                  num_external_computed_tokens) -> None:
        if new_computed_blocks:
            raise AssertionError("cross-attention blocks are never prefix-cache hits")

    def allocate_external_computed_blocks(self, request_id, num_local_computed_tokens, num_external_computed_tokens,
                                          record_for_zeroing=True) -> None:
        return

    def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries=()) -> None:
        raise ValueError("cross-attention blocks are never cached (prefix caching is off for them)")

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int, kv_cache_group_ids,
                               block_pool: BlockPool, kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1, pcp_world_size: int = 1):
        raise NotImplementedError("CrossAttentionManager does not support caching")

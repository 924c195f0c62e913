"""Managers whose tokens stop being read: a sliding window and chunked local attention. Blocks that
leave the window are freed (the null block keeps the table's indices) and a hit needs only the
blocks the window still covers."""

from __future__ import annotations

from kvservice.core.block import KVCacheBlock
from kvservice.core.hash_views import resolve_block_hashes
from kvservice.core.managers.base import SingleTypeManager, cdiv
from kvservice.core.specs import ChunkedLocalAttentionSpec, SlidingWindowSpec


class SlidingWindowManager(SingleTypeManager):
    def __init__(self, kv_cache_spec: SlidingWindowSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window
        self.extra_retained_tokens = kv_cache_spec.extra_retained_tokens

    @staticmethod
    def _contiguous_blocks_for_hit(window_size: int, block_size: int, use_eagle: bool) -> int:
        """Contiguous cached blocks a hit needs to cover the window before its end (EAGLE drops
        the last, so one more)."""
        return cdiv(window_size - 1, block_size) + (1 if use_eagle else 0)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        """Right to left: the first run of enough contiguous cached blocks whose end is aligned wins;
        without one, a run from block 0 is a hit on its own (it needs no earlier tokens)."""
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise AssertionError("SlidingWindowManager serves sliding-window groups only")
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise AssertionError("context parallelism does not support sliding-window attention")
        bs = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size or bs, bs,
                                      supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup,
                                      alignment_tokens=alignment_tokens)
        needed = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window, bs, drop_eagle_block)
        max_blocks = min(max_length // bs, len(hashes))
        null = block_pool.null_block
        computed = tuple([null] * max_blocks for _ in kv_cache_group_ids)
        get_cached = block_pool.get_cached_block
        run = 0
        found = False
        for i in range(max_blocks - 1, -1, -1):
            cached = get_cached(hashes[i], kv_cache_group_ids)
            if cached is None:
                run = 0
                continue
            if run == 0 and bs != alignment_tokens:
                end_blocks = i if drop_eagle_block else i + 1
                if end_blocks * bs % alignment_tokens != 0:
                    continue  # a run must end on the alignment (after EAGLE's drop)
            for out, block in zip(computed, cached):
                out[i] = block
            run += 1
            if run >= needed:
                for out in computed:
                    del out[i + run:]
                found = True
                break
        if not found:
            for out in computed:
                del out[run:]
            cls._align(computed, bs, alignment_tokens)
        if drop_eagle_block and computed[0]:
            for out in computed:
                out.pop()
            cls._align(computed, bs, alignment_tokens)
        return computed, len(computed[0]) * bs

    @staticmethod
    def _align(computed: tuple[list[KVCacheBlock], ...], bs: int, alignment_tokens: int) -> None:
        while bs != alignment_tokens and len(computed[0]) * bs % alignment_tokens != 0:
            for out in computed:
                out.pop()

    @classmethod
    def reachable_block_mask(cls, start_block, end_block, alignment_tokens, kv_cache_spec, use_eagle,
                             retention_interval=None, reachable_boundaries=(), dcp_world_size=1,
                             final_segment_end_block=None):
        """Only blocks in the window-sized tail before a hit boundary can serve a hit; the rest stay
        unhashed scratch (freed to the queue's head, reused first). Boundaries: every
        `alignment_tokens` (dense), one per `retention_interval` (sparse), plus the given reachable
        ones (replays, shared-prefix junctions) under sparse retention."""
        if alignment_tokens is None:
            return None
        bs = kv_cache_spec.block_size * dcp_world_size
        if alignment_tokens % bs != 0:
            return None  # a sub-block alignment cannot be masked per block: cache densely
        need = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window, bs, use_eagle)
        shift = 1 if use_eagle else 0  # EAGLE's run ends one block past the boundary
        mask = [False] * (end_block - start_block)
        if retention_interval is None:
            segment = alignment_tokens
        else:
            segment = retention_interval or None
        if segment is not None:
            per_segment = segment // bs
            if need >= per_segment:
                return None  # every block is in some boundary's tail
            for i in range(start_block, end_block):
                if i >= shift and (i - shift) % per_segment >= per_segment - need:
                    mask[i - start_block] = True
            if final_segment_end_block is not None and not use_eagle:
                final_size = final_segment_end_block % per_segment
                if final_size:
                    tail_start = max(final_segment_end_block - final_size, final_segment_end_block - need)
                    for i in range(max(start_block, tail_start), min(end_block, final_segment_end_block)):
                        mask[i - start_block] = True
        if retention_interval is not None:
            for boundary in reachable_boundaries:
                end = boundary // alignment_tokens * alignment_tokens // bs + shift
                for j in range(max(start_block, end - need), min(end_block, end)):
                    mask[j - start_block] = True
        return mask

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens)


class ChunkedLocalAttentionManager(SingleTypeManager):
    def __init__(self, kv_cache_spec: ChunkedLocalAttentionSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        """Blocks before the current chunk are never read again: they count as (null) hits; the
        chunk's own blocks are looked up left to right. (vLLM 0.33.0 refuses EAGLE and groups of
        other block sizes here; kvservice drops the last block and trims to the alignment.)"""
        if not isinstance(kv_cache_spec, ChunkedLocalAttentionSpec):
            raise AssertionError("ChunkedLocalAttentionManager serves chunked local attention groups only")
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise AssertionError("context parallelism does not support chunked local attention")
        bs = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size or bs, bs)
        max_blocks = min(max_length // bs, len(hashes))
        chunk = kv_cache_spec.attention_chunk_size
        first = (max_length // chunk * chunk if max_length > 0 else 0) // bs
        null = block_pool.null_block
        computed = tuple([null] * first for _ in kv_cache_group_ids)
        get_cached = block_pool.get_cached_block
        for i in range(first, max_blocks):
            cached = get_cached(hashes[i], kv_cache_group_ids)
            if cached is None:
                break
            for out, block in zip(computed, cached):
                out.append(block)
        if drop_eagle_block and computed[0]:
            for out in computed:
                out.pop()
        SlidingWindowManager._align(computed, bs, alignment_tokens)
        return computed, len(computed[0]) * bs

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

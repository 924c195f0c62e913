"""The Mamba manager: recurrent state blocks.

In "align" mode (the one that prefix-caches) the state after token (i + 1) * block_size is written in
block i; a chunk needs only the block it ends in (earlier positions are null padding) plus the running
state it reads, `num_speculative_blocks` scratch states for speculative decoding and, with prefill
checkpoints, one block for an interior checkpoint state. States behind the last committed one are
retired (freed) as the request advances. Other modes allocate like attention (plus speculative
blocks) and never cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvservice.core.block import BlockHashWithGroupId, KVCacheBlock
from kvservice.core.hash_views import resolve_block_hashes
from kvservice.core.managers.base import SingleTypeManager, cdiv
from kvservice.core.managers.checkpoints import (
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)
from kvservice.core.specs import MambaSpec


class MambaManager(SingleTypeManager):
    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    def __init__(self, kv_cache_spec: MambaSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        if self.mamba_cache_mode != "align" and self.enable_caching:
            raise AssertionError("Mamba prefix caching requires mamba_cache_mode='align'")
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        self.has_prefill_checkpoint_blocks = (self.mamba_cache_mode == "align"
                                              and kv_cache_spec.num_prefill_checkpoint_blocks > 0)
        self.drop_eagle_checkpoint_block = False  # checkpoints follow EAGLE's replay boundary
        # vLLM 0.32's way: a prompt tail already keyed at its boundary is cached again (so marked cached this step)
        self.recache_keyed_tails = False
        # States cached this step: a hit on one would read a state not written yet.
        self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()
        self.last_state_block_idx: dict[str, int] = {}
        self._num_retired_blocks: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()
        self._checkpoints: dict[str, tuple[int, int]] = {}  # request -> (position, reserved index)
        self._producer_partial_tail_reqs: dict[str, tuple[KVCacheBlock, int]] = {}

    @property
    def has_positionally_stable_blocks(self) -> bool:
        return self.mamba_cache_mode != "align"

    @property
    def _align(self) -> bool:
        return self.mamba_cache_mode == "align"

    # ---- hit search ----------------------------------------------------------------------------
    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        """The last cached state at or below `max_length` (right to left), on the alignment; with a
        fine-grained alignment a state keyed at a boundary inside its block counts too."""
        if not isinstance(kv_cache_spec, MambaSpec):
            raise AssertionError("MambaManager serves Mamba groups only")
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise AssertionError("context parallelism does not shard Mamba states")
        bs = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size or bs, bs,
                                      supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup,
                                      alignment_tokens=alignment_tokens)
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        null = block_pool.null_block
        get_cached = block_pool.get_cached_block
        if alignment_tokens < bs and bs % alignment_tokens == 0:
            scale = bs // alignment_tokens
            for fine in range(min(max_length // alignment_tokens, len(hashes)) - 1, -1, -1):
                cached = get_cached(hashes[fine], kv_cache_group_ids)
                if cached is not None:
                    for out, block in zip(computed, cached):
                        out.extend([null] * (fine // scale))
                        out.append(block)
                    return computed, (fine + 1) * alignment_tokens
            return computed, 0
        for i in range(min(max_length // bs, len(hashes)) - 1, -1, -1):
            cached = get_cached(hashes[i], kv_cache_group_ids)
            if cached is None:
                continue
            if bs != alignment_tokens and (i + 1) * bs % alignment_tokens != 0:
                continue
            for out, block in zip(computed, cached):
                out.extend([null] * i)
                out.append(block)
            return computed, (i + 1) * bs
        return computed, 0

    @classmethod
    def reachable_block_mask(cls, start_block, end_block, alignment_tokens, kv_cache_spec, use_eagle,
                             retention_interval=None, reachable_boundaries=(), dcp_world_size=1,
                             final_segment_end_block=None):
        """Sparse state retention: one state per `retention_interval` (0: none) plus the states at the
        reachable boundaries (replays, shared-prefix junctions); None (dense) by default."""
        if retention_interval is None or alignment_tokens is None:
            return None
        bs = kv_cache_spec.block_size
        mask = [False] * (end_block - start_block)
        if retention_interval:
            per_segment = retention_interval // bs
            if per_segment <= 1:
                return None
            first = (start_block + per_segment) // per_segment * per_segment - 1
            for i in range(first - start_block, len(mask), per_segment):
                mask[i] = True
        for boundary in reachable_boundaries:
            block = boundary // alignment_tokens * alignment_tokens // bs - 1
            if start_block <= block < end_block:
                mask[block - start_block] = True
        return mask

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1  # only the last computed token's state is read

    # ---- freeing -------------------------------------------------------------------------------
    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        if not self._align:
            super()._remove_blocks_in_range(request_id, first_block, last_block)
            return
        blocks = self.req_to_blocks.get(request_id, [])
        first_block = max(first_block, self._num_retired_blocks.get(request_id, 0))
        last_block = min(last_block, len(blocks))
        if first_block >= last_block:
            return
        null = self._null_block
        freed = []
        for i in range(last_block - 1, first_block - 1, -1):  # prefill leaves null gaps between states
            if blocks[i].is_null:
                continue
            freed.append(blocks[i])
            blocks[i] = null
        if freed:
            self.block_pool.free_blocks(freed)
        self._num_retired_blocks[request_id] = last_block

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        if not self._align:
            return
        # The state block of two steps ago: the previous one was copied into the current one.
        last = self.last_state_block_idx.get(request_id)
        if last is not None and last < cdiv(processed_computed_tokens, self.block_size) - 1:
            blocks = self.req_to_blocks[request_id]
            if blocks[last] is not self._null_block:
                self.block_pool.free_blocks([blocks[last]])
                blocks[last] = self._null_block

    def pop_blocks_for_free(self, request_id: str) -> Sequence[KVCacheBlock]:
        if self._align:
            self._allocated_block_reqs.discard(request_id)
            self.last_state_block_idx.pop(request_id, None)
            self._num_retired_blocks.pop(request_id, None)
            self._checkpoints.pop(request_id, None)
            self._producer_partial_tail_reqs.pop(request_id, None)
            # Hand-offs of a freed request could name blocks another request is handed next.
            self._pending_boundary_state_offloads = [
                e for e in self._pending_boundary_state_offloads if e[0] != request_id]
        return super().pop_blocks_for_free(request_id)

    # ---- allocation ----------------------------------------------------------------------------
    def _checkpoint_position(self, num_tokens: int) -> int:
        return get_mamba_prefill_checkpoint_position(num_tokens, self.cache_hit_alignment_tokens,
                                                     self.drop_eagle_checkpoint_block,
                                                     self.block_pool.num_hash_lookahead_tokens)

    def _needs_internal_checkpoint(self, request_id: str, query_start: int, query_end: int,
                                   checkpoint_position: int, prefill_end: int) -> bool:
        index = cdiv(query_end, self.block_size) - 2
        blocks = self.req_to_blocks[request_id]
        return (self.has_prefill_checkpoint_blocks and query_end >= prefill_end
                and is_mamba_prefill_checkpoint_valid(query_start, query_end, checkpoint_position,
                                                      self.hash_block_size, self.block_size,
                                                      self.spec.prefill_checkpoint_alignment)
                and index >= 0
                and (index >= len(blocks) or blocks[index].is_null
                     or (request_id in self._allocated_block_reqs
                         and index >= len(blocks) - self.num_speculative_blocks)))

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        if new_computed_blocks and new_computed_blocks[-1].block_hash in self.cached_blocks_this_step:
            # A state cached this step is written by this step's forward: defer the request (too many
            # blocks to fit) to the next step.
            return self.block_pool.num_blocks + 1
        if not self._align:
            if self.num_speculative_blocks:
                num_tokens += self.spec.block_size * self.num_speculative_blocks
            return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                      total_computed_tokens, num_local_computed_tokens,
                                                      num_tokens_main_model, apply_admission_cap, prefill_end)
        # Lookahead (draft) tokens are ignored: drafters have no Mamba layers, and they would break
        # the alignment.
        num_tokens = num_tokens_main_model
        num_required = cdiv(num_tokens, self.block_size) + self.num_speculative_blocks
        num_new = num_required - len(new_computed_blocks) - len(self.req_to_blocks[request_id])
        has_partial_hit = (self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens)
                           or request_id in self._partial_hit_reqs)
        if has_partial_hit:
            num_new = max(num_new, 0) + 1
        position = self._checkpoint_position(num_tokens)
        if not self._needs_internal_checkpoint(request_id, total_computed_tokens, num_tokens, position, prefill_end):
            position = 0
        checkpoint_block = int(position > 0)
        if not apply_admission_cap:
            if position > 0:
                self._checkpoints[request_id] = (position, cdiv(num_tokens, self.block_size) - 2)
            else:
                self._checkpoints.pop(request_id, None)
        if num_new > 0:
            cap = 1 + int(has_partial_hit) + checkpoint_block
            if request_id not in self._allocated_block_reqs:
                cap += self.num_speculative_blocks
            num_new = min(num_new, cap)
        return num_new + self._get_num_evictable_blocks(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int | None = None) -> list[KVCacheBlock]:
        if not self._align:
            if self.num_speculative_blocks:
                num_tokens += self.block_size * self.num_speculative_blocks
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        num_tokens = num_tokens if num_tokens_main_model is None else num_tokens_main_model
        req_blocks = self.req_to_blocks[request_id]
        num_required = cdiv(num_tokens, self.block_size) + self.num_speculative_blocks
        checkpoint_block = int(request_id in self._checkpoints)
        partial_hit = self._partial_hit_reqs.get(request_id)
        if num_required <= len(req_blocks) and partial_hit is None and not checkpoint_block:
            self._allocated_block_reqs.add(request_id)  # over-allocated last time (rejected drafts)
            return []
        prev_len = len(req_blocks)
        allocated = request_id in self._allocated_block_reqs
        if allocated:  # the running state sits before the speculative blocks
            self.last_state_block_idx[request_id] = prev_len - 1 - self.num_speculative_blocks
        elif prev_len > 0:  # a hit's last block holds the state it resumes from
            self.last_state_block_idx[request_id] = prev_len - 1
        num_skipped = num_required - self.num_speculative_blocks - 1
        if prev_len < num_skipped:  # null padding up to the chunk's block (not over the checkpoint's)
            req_blocks.extend([self._null_block] * (num_skipped - checkpoint_block - prev_len))
        if allocated:
            # Exclusively owned scratch blocks this step leaves behind move to the end; in a
            # checkpoint step one stays at the checkpoint index (the worker exports into it).
            for index in range(prev_len - self.num_speculative_blocks, prev_len):
                if index >= num_skipped - checkpoint_block:
                    break
                self._relocate_speculative_block(req_blocks, index)
        num_new = max(num_required - len(req_blocks), 0) + (1 if partial_hit is not None else 0)
        cap = 1 + int(partial_hit is not None) + checkpoint_block + (0 if allocated else self.num_speculative_blocks)
        if num_new > cap:
            raise AssertionError(f"request {request_id!r}: {num_new} new Mamba blocks exceed the step's {cap}")
        new_blocks = self.block_pool.get_new_blocks(num_new)
        returned = req_blocks[prev_len:]
        if partial_hit is not None:
            block_idx, source = partial_hit
            cow_block, new_blocks = new_blocks[0], new_blocks[1:]
            if allocated:
                self._copy_running_partial_tail(request_id, block_idx, source, cow_block)
            else:
                self._apply_cow(request_id, block_idx, source, cow_block)
                returned = [cow_block, *returned]
        req_blocks.extend(new_blocks)
        self._allocated_block_reqs.add(request_id)
        self._partial_hit_reqs.pop(request_id, None)
        returned.extend(new_blocks)
        return returned

    def _copy_running_partial_tail(self, request_id: str, block_idx: int, source: KVCacheBlock,
                                   cow_block: KVCacheBlock) -> None:
        """A running request's table is append-only, so it stays on `source`; the cache entry moves
        to the copy, which this step's copy fills before the forward overwrites the source."""
        if self.req_to_blocks[request_id][block_idx] is not source:
            raise AssertionError(f"request {request_id!r}: block {block_idx} is not the partial tail")
        self.block_pool.move_block_hashes(source, cow_block)
        self._pending_cow_copies.append((source, cow_block))
        source.ref_cnt += 1
        producer = self._producer_partial_tail_reqs.pop(request_id, None)
        if producer is not None:
            if producer[0] is not source:
                raise AssertionError(f"request {request_id!r}: the producer's tail is another block")
            self._pending_boundary_state_offloads.append((request_id, self.kv_cache_group_id, cow_block, producer[1]))
        if cow_block.block_hash is not None:
            self.cached_blocks_this_step.add(cow_block.block_hash)

    def _relocate_speculative_block(self, req_blocks: list[KVCacheBlock], block_idx: int) -> None:
        block = req_blocks[block_idx]
        if not self.block_pool.is_block_writable(block):
            raise AssertionError("Speculative Mamba blocks must be exclusively owned and unhashed before relocation")
        req_blocks.append(block)
        req_blocks[block_idx] = self._null_block

    def finalize_partial_tail_offload(self, request_id: str, num_computed_tokens: int,
                                      num_in_flight_tokens: int) -> tuple[int, KVCacheBlock, int] | None:
        if not self._align:
            return None
        producer = self._producer_partial_tail_reqs.pop(request_id, None)
        if producer is None:
            return None
        source, boundary = producer
        if num_in_flight_tokens != 0 or num_computed_tokens != boundary:
            return None
        return self.kv_cache_group_id, source, boundary

    # ---- caching -------------------------------------------------------------------------------
    def cache_blocks(self, request, num_tokens: int, retention_interval: int | None = None, *,
                     replay_boundaries: Sequence[int] = ()) -> None:
        request_id = request.request_id
        before = self.num_cached_block.get(request_id, 0)
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries=replay_boundaries)
        after = self.num_cached_block.get(request_id, 0)
        if self._align:
            key = self._cache_partial_tail_block(request, num_tokens, retention_interval)
            if key is not None:
                self.cached_blocks_this_step.add(key)
        if after > before:
            blocks = self.req_to_blocks[request_id]
            for idx in range(before, after):
                block = blocks[idx]
                if block.is_null or block.block_hash is None:  # skipped, or left out by sparse retention
                    continue
                self.cached_blocks_this_step.add(block.block_hash)
                if self._align:
                    self._pending_boundary_state_offloads.append(
                        (request_id, self.kv_cache_group_id, block, block.block_hash_num_tokens))

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()

    def _cache_partial_tail_block(self, request, num_tokens: int,
                                  retention_interval: int | None) -> BlockHashWithGroupId | None:
        """Keys a state at a boundary inside its block: the reserved checkpoint block at its exported
        position, or the state at the prompt's last hash boundary (or a shared-prefix junction)."""
        request_id = request.request_id
        checkpoint = self._checkpoints.get(request_id)
        if checkpoint is not None:
            return self._cache_checkpoint(request, checkpoint, retention_interval)
        hash_bs = self.hash_block_size
        if num_tokens <= 0 or num_tokens % hash_bs != 0:
            return None
        prompt_boundary = get_mamba_prefill_checkpoint_position(
            request.num_prompt_tokens, hash_bs, self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens)
        junction = getattr(request, "shared_prefix_boundary", 0)
        if num_tokens != prompt_boundary and not (
                self.shared_prefix_checkpoint and num_tokens == junction
                and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens):
            return None
        block_idx = cdiv(num_tokens, self.block_size) - 1
        blocks = self.req_to_blocks[request_id]
        if block_idx >= len(blocks):
            return None
        source = blocks[block_idx]
        if source.is_null or (source.block_hash_num_tokens == num_tokens and not self.recache_keyed_tails):
            return None  # already keyed here (by a hit or an earlier step)
        key = self.block_pool.cache_partial_block(request, source, num_tokens, self.kv_cache_group_id,
                                                  self.block_size)
        if key is not None and num_tokens % self.block_size:
            # The next forward overwrites this state: the upcoming copy-on-write keeps it.
            self._partial_hit_reqs[request_id] = (block_idx, source)
            self.num_cached_block[request_id] = block_idx
            self._producer_partial_tail_reqs[request_id] = (source, num_tokens)
        return key

    def _cache_checkpoint(self, request, checkpoint: tuple[int, int],
                          retention_interval: int | None) -> BlockHashWithGroupId | None:
        position, index = checkpoint
        blocks = self.req_to_blocks[request.request_id]
        if not 0 <= index < len(blocks):
            raise AssertionError(f"request {request.request_id!r}: checkpoint index {index} is outside its table")
        block = blocks[index]
        is_prompt_checkpoint = position == get_mamba_prefill_checkpoint_position(
            request.num_prompt_tokens, self.cache_hit_alignment_tokens, self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens)
        retained = False
        if position % self.block_size == 0:
            block_idx = position // self.block_size - 1
            mask = self.reachable_block_mask(block_idx, block_idx + 1, self.cache_hit_alignment_tokens,
                                             self.spec, self.drop_eagle_checkpoint_block,
                                             retention_interval=retention_interval)
            retained = mask is None or mask[0]
        if not is_prompt_checkpoint and not retained and position != getattr(request, "shared_prefix_boundary", 0):
            # A transient state overwrites this slot: neither it nor a full-block key from this step is reusable.
            self.block_pool._maybe_evict_cached_block(block)
            return None
        if block.block_hash_num_tokens == position:
            return None
        return self.block_pool.cache_partial_block(request, block, position, self.kv_cache_group_id,
                                                   self.block_size, replace_existing_hashes=True)

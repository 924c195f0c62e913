"""The single-type manager: block tables of one KV-cache group (vLLM's SingleTypeKVCacheManager).

Subclasses define the hit search (`find_longest_cache_hit`, a classmethod so the coordinator can ask
a spec group at once), the skipped tokens and which full blocks are worth caching
(`reachable_block_mask`). Two kinds of copy-on-write meet here: a prefix hit that ends inside a block
(vLLM's partial hit: the shared tail is redirected to a private copy, here) and a write into a block a
fork's sibling holds (kvservice's fork: forks.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import ClassVar

from kvservice.core.block import KVCacheBlock, trim_null_head
from kvservice.core.block_pool import BlockPool
from kvservice.core.managers.forks import CopyOnWrite, Forks
from kvservice.core.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    effective_block_size,
)
from kvservice.hashing import BlockHash

ATTENTION_SPECS = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, CrossAttentionSpec)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeManager(Forks):
    """Block tables of one KV-cache group."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = False
    # Fork copy-on-write (cow_indices); off in a pool with vLLM's semantics, which has no forks and whose
    # writes into shared blocks vLLM makes in place.
    copy_on_write: bool = True
    retains_longer_hit: ClassVar[bool] = False

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool = True,
                 kv_cache_group_id: int = 0, scheduler_block_size: int | None = None, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, needs_kv_cache_zeroing: bool = False,
                 max_admission_blocks_per_request: int | None = None, *, cow: CopyOnWrite | None = None) -> None:
        # `spec` is what the core reads; `kv_cache_spec` is the public one (the vLLM drop-in's is vLLM's).
        self.kv_cache_spec = self.spec = kv_cache_spec
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.dcp_world_size = dcp_world_size if kv_cache_spec.dcp_sharded else 1
        self.pcp_world_size = pcp_world_size if kv_cache_spec.dcp_sharded else 1
        self.block_size = effective_block_size(kv_cache_spec, self.dcp_world_size)
        self.scheduler_block_size = scheduler_block_size or self.block_size
        # Where hits land; a hybrid coordinator lowers it for fine-grained (sub-block) hits.
        self.cache_hit_alignment_tokens = self.scheduler_block_size
        self.hash_block_size = block_pool.hash_block_size or self.block_size
        self.hash_ratio = max(self.block_size // self.hash_block_size, 1)
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self._record_new_block_ids = (needs_kv_cache_zeroing and isinstance(kv_cache_spec, ATTENTION_SPECS)
                                      and not isinstance(kv_cache_spec, CircularBufferSpec))
        self.new_block_ids: list[int] = []
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # Running requests -> how many leading blocks are already in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block
        self.use_eagle = False  # set by the coordinator for the groups a drafter reads
        # Hybrid coordinators register a prompt's last hash boundary inside a block (vLLM does; a
        # single group hashed finer than its block, which vLLM does not allow, does not).
        self.partial_tails = False
        self.shared_prefix_checkpoint = False
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self._pending_boundary_state_offloads: list[tuple[str, int, KVCacheBlock, int]] = []
        self.cow = cow if cow is not None else CopyOnWrite()

    @property
    def has_positionally_stable_blocks(self) -> bool:
        """Whether a table index keeps meaning the same token range (offload scans rely on it)."""
        return True

    # ---- hit search ----------------------------------------------------------------------------
    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool, kv_cache_spec: KVCacheSpec,
                               drop_eagle_block: bool, alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest hit every group in `kv_cache_group_ids` shares, at most `max_length` tokens and
        a multiple of `alignment_tokens`; skipped positions hold the null block.

        Returns:
            (one block list per group, the hit length in tokens).
        """
        raise NotImplementedError

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no later token attends to (their blocks can be freed)."""
        return 0

    @classmethod
    def reachable_block_mask(cls, start_block: int, end_block: int, alignment_tokens: int | None,
                             kv_cache_spec: KVCacheSpec, use_eagle: bool, retention_interval: int | None = None,
                             reachable_boundaries: Sequence[int] = (), dcp_world_size: int = 1,
                             final_segment_end_block: int | None = None) -> list[bool] | None:
        """Which of blocks [start_block, end_block) a future hit can use (None: all of them)."""
        return None

    # ---- allocation ----------------------------------------------------------------------------
    @staticmethod
    def _get_num_evictable_blocks(blocks: Sequence[KVCacheBlock]) -> int:
        return sum(1 for b in blocks if b.ref_cnt == 0 and not b.is_null)

    def _has_partial_local_hit(self, new_computed_blocks: Sequence[KVCacheBlock],
                               num_local_computed_tokens: int) -> bool:
        return len(new_computed_blocks) > 0 and num_local_computed_tokens % self.block_size != 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        """Free blocks this allocation consumes: new blocks, hits rescued from the free queue and a
        partial hit's private copy (read-only).

        Args:
            num_tokens: tokens that need a slot, those already allocated included.
            total_computed_tokens: local and external computed tokens.
            num_tokens_main_model: `num_tokens` without lookahead (draft) tokens.
            apply_admission_cap: cap at `max_admission_blocks_per_request` (the full-sequence gate).
        """
        num_required = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required = min(num_required, self.max_admission_blocks_per_request)
        held = self.req_to_blocks.get(request_id, ())
        if request_id in self.num_cached_block:  # running: no new hits
            if new_computed_blocks:
                raise ValueError(f"request {request_id!r} is running: it cannot take new prefix-cache hits")
            return max(num_required - len(held), 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(num_required - max(num_skipped_blocks, len(new_computed_blocks) + len(held)), 0)
        # Hits still in the free queue leave it when touched: they consume free blocks too.
        first_kept = max(0, num_skipped_blocks - len(held))
        num_evictable = self._get_num_evictable_blocks(new_computed_blocks[first_kept:])
        if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
            num_new += 1  # the partial hit's private copy
        return num_new + num_evictable

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Admits a request's prefix-cache hits: touches them and pads skipped positions with the
        null block; a hit ending inside a block is remembered for its copy-on-write."""
        req_blocks = self.req_to_blocks[request_id]
        if req_blocks:
            raise AssertionError(f"request {request_id!r} already holds blocks in group {self.kv_cache_group_id}")
        num_skipped_blocks = self.get_num_skipped_tokens(
            num_local_computed_tokens + num_external_computed_tokens) // self.block_size
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        elif any(not b.is_null for b in new_computed_blocks):
            raise AssertionError("prefix-cache hits without prefix caching")
        if num_skipped_blocks > 0:
            req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        # Hits (and the nulls padding skipped ones) are already cached.
        self.num_cached_block[request_id] = len(req_blocks)
        if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
            block_idx = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (block_idx, new_computed_blocks[-1])
            self.num_cached_block[request_id] = block_idx

    def adopt_blocks(self, request_id: str, hits: list[KVCacheBlock], num_new_blocks: int) -> list[KVCacheBlock]:
        """A new request's table in one step when none of its blocks is skipped (the fast path's
        admission): touches `hits` (cached), appends `num_new_blocks` fresh ones; the list becomes the table."""
        self.block_pool.touch(hits)
        self.num_cached_block[request_id] = len(hits)
        if num_new_blocks:
            hits.extend(self.block_pool.get_new_blocks(num_new_blocks))
        self.req_to_blocks[request_id] = hits
        return hits

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int, record_for_zeroing: bool = True) -> None:
        """Blocks for tokens a KV connector computed, after every group took its local hits (so this
        group's allocation cannot evict another group's untouched hits)."""
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped = self.get_num_skipped_tokens(num_total)
        if num_skipped > 0:
            num_external_computed_tokens = min(num_total - num_skipped, num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks[request_id]
        new_blocks = self.block_pool.get_new_blocks(max(0, cdiv(num_total, self.block_size) - len(req_blocks)))
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids.extend(b.block_id for b in new_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int | None = None) -> list[KVCacheBlock]:
        """Blocks so the request has slots for `num_tokens`; a pending partial hit first gets its copy.

        Returns:
            The new blocks (the partial hit's copy first).
        """
        cow_blocks: list[KVCacheBlock] = []
        if self._partial_hit_reqs and request_id in self._partial_hit_reqs:
            block_idx, source = self._partial_hit_reqs.pop(request_id)
            cow_block = self.block_pool.get_new_blocks(1)[0]
            self._apply_cow(request_id, block_idx, source, cow_block)
            self.new_block_ids.append(cow_block.block_id)
            cow_blocks.append(cow_block)
        req_blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return cow_blocks
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new_blocks)
        return cow_blocks + new_blocks if cow_blocks else new_blocks

    def _apply_cow(self, request_id: str, block_idx: int, source_block: KVCacheBlock, cow_block: KVCacheBlock) -> None:
        """Redirects a partial hit's shared tail to a private copy. Both ends stay retained until the
        copy ran (the source keeps the hit's reference, the copy an extra one)."""
        req_blocks = self.req_to_blocks[request_id]
        if not (block_idx < len(req_blocks) and req_blocks[block_idx] is source_block
                and not source_block.is_null and source_block.ref_cnt > 0):
            raise AssertionError(f"request {request_id!r}: block {block_idx} is not the partial hit's source")
        req_blocks[block_idx] = cow_block
        self._pending_cow_copies.append((source_block, cow_block))
        cow_block.ref_cnt += 1

    @property
    def records_new_block_ids(self) -> bool:
        """Whether the workers zero this group's new blocks (so their ids are recorded)."""
        return self._record_new_block_ids

    def take_new_block_ids(self) -> list[int]:
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        return pending

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        """(request id, group, block, boundary tokens) of committed boundary states (Mamba "align")."""
        pending, self._pending_boundary_state_offloads = self._pending_boundary_state_offloads, []
        return pending

    def finalize_partial_tail_offload(self, request_id: str, num_computed_tokens: int,
                                      num_in_flight_tokens: int) -> tuple[int, KVCacheBlock, int] | None:
        return None

    # ---- caching -------------------------------------------------------------------------------
    def _reachable_boundaries(self, request) -> list[int]:
        boundary = getattr(request, "shared_prefix_boundary", 0)
        if not boundary:
            return []
        return [boundary, boundary - self.block_size] if self.use_eagle else [boundary]

    def cache_blocks(self, request, num_tokens: int, retention_interval: int | None = None, *,
                     replay_boundaries: Sequence[int] = ()) -> None:
        """Caches full blocks up to `num_tokens` (those a future hit can reach).

        Args:
            retention_interval: sparse retention (sliding window and Mamba only; see KVCacheConfig).
            replay_boundaries: positions a later request replaying this prompt resumes at.
        """
        if not self.spec.prefix_cacheable:
            return
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = min(num_tokens, len(request.block_hashes) * self.hash_block_size) // self.block_size
        if num_cached >= num_full:
            return
        mask = self.reachable_block_mask(
            num_cached, num_full, self.cache_hit_alignment_tokens, self.spec, self.use_eagle,
            retention_interval=retention_interval,
            reachable_boundaries=[*replay_boundaries, *self._reachable_boundaries(request)],
            dcp_world_size=self.dcp_world_size)
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[request_id], num_cached, num_full,
                                          self.block_size, self.kv_cache_group_id, mask)
        self.num_cached_block[request_id] = num_full

    # ---- freeing -------------------------------------------------------------------------------
    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        """Frees blocks [first_block, last_block) and puts the null block in their place, scanning back
        and stopping at the first null one (the rest was freed by an earlier call)."""
        if request_id not in self.req_to_blocks or first_block >= last_block:
            return
        blocks = self.req_to_blocks[request_id]
        null = self._null_block
        freed = []
        for i in range(min(last_block, len(blocks)) - 1, first_block - 1, -1):
            if blocks[i] is null:
                break
            freed.append(blocks[i])
            blocks[i] = null
        if freed:
            self.block_pool.free_blocks(freed)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Frees blocks no later token reads (computed on the processed, committed tokens)."""
        num_skipped_tokens = self.get_num_skipped_tokens(processed_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if blocks:
            self._remove_blocks_in_range(request_id, 0, min(num_skipped_tokens // self.block_size, len(blocks)))

    def pop_blocks_for_free(self, request_id: str) -> Sequence[KVCacheBlock]:
        """Drops the request's bookkeeping; returns its blocks (leading nulls trimmed) for the caller to
        free, tail first."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self._partial_hit_reqs.pop(request_id, None)
        return trim_null_head(blocks)

    def free(self, request_id: str) -> None:
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def new_step_starts(self) -> None:
        return None

"""The coordinator: drives one manager per KV-cache group and agrees on one prefix-hit length.

    KVCacheCoordinatorNoPrefixCache   no caching: nothing ever hits
    UnitaryKVCacheCoordinator         one group: its manager looks up directly
    HybridKVCacheCoordinator          a fixed-point loop in which every spec group can only shrink the hit
It owns the BlockPool its managers share; `get_kv_cache_coordinator` picks the class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvservice.core.block import KVCacheBlock
from kvservice.core.block_pool import BlockPool
from kvservice.core.managers import MANAGER_TYPES, CopyOnWrite, CrossAttentionManager, MambaManager, SingleTypeManager
from kvservice.core.specs import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    effective_block_size,
)
from kvservice.hashing import BlockHash

if TYPE_CHECKING:
    from kvservice.core.request import Request


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool) -> tuple[int, ...]:
    """Positions a later request replaying this prompt resumes at: a resend of the same prompt stops
    at num_tokens - 1 (its last token is recomputed); with EAGLE a hit ends a block lower, for a
    resend and for a longer sibling alike."""
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


def validate_retention_interval(interval: int | None, scheduler_block_size: int, config: KVCacheConfig) -> None:
    if interval is None:
        return
    if not any(isinstance(s, (SlidingWindowSpec, MambaSpec)) for s in config.groups):
        if interval == 0:
            return
        raise ValueError(f"prefix_cache_retention_interval={interval} is set but the pool has no sliding-window or "
                         f"Mamba group, so retention has no effect; set it to 0 (or leave it unset)")
    if interval < 0 or interval % scheduler_block_size != 0:
        raise ValueError(f"prefix_cache_retention_interval ({interval}) must be non-negative and a multiple of "
                         f"scheduler_block_size ({scheduler_block_size})")

class KVCacheCoordinator:
    """Drives the managers; the subclasses define the hit search."""

    enable_partial_hash_hits = False

    def __init__(self, config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int | None = None,
                 use_eagle: bool = False, enable_caching: bool = True, enable_events: bool = False,
                 dcp_world_size: int = 1, pcp_world_size: int = 1, scheduler_block_size: int | None = None,
                 hash_block_size: int | None = None, metrics_collector: Any = None,
                 num_hash_lookahead_tokens: int = 0, num_prefill_lookahead: int = 0) -> None:
        self.config = self.kv_cache_config = config
        self._dcp_world_size = dcp_world_size
        sizes = [effective_block_size(s, dcp_world_size) for s in config.groups]
        if scheduler_block_size is None:
            scheduler_block_size = math.lcm(*sizes)
        hash_block_size = hash_block_size or scheduler_block_size
        if scheduler_block_size % hash_block_size != 0 or any(scheduler_block_size % s for s in sizes):
            raise ValueError(f"scheduler_block_size {scheduler_block_size} must be a multiple of hash_block_size "
                             f"{hash_block_size} and of every group's block size {sizes}")
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        self.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        self.block_pool = self.make_block_pool(config.num_blocks, enable_caching, enable_events, hash_block_size,
                                               num_hash_lookahead_tokens, metrics_collector)
        self.eagle_group_ids = set(config.eagle_group_ids)
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(config.groups)))
        self.drop_eagle_group_ids = self.eagle_group_ids if use_eagle else set()
        if enable_caching and self.eagle_group_ids and scheduler_block_size < num_prefill_lookahead:
            raise ValueError(f"Multi-module MTP with prefix caching requires scheduler_block_size"
                             f" (={scheduler_block_size}) >= num_speculative_tokens (={num_prefill_lookahead}).")
        self.cow = CopyOnWrite()  # fork copy-on-write, shared by every group
        self.single_type_managers: tuple[SingleTypeManager, ...] = tuple(
            self.make_manager(spec, i, enable_caching, dcp_world_size, pcp_world_size)
            for i, spec in enumerate(config.groups))
        if use_eagle:
            for m in self.single_type_managers:
                if isinstance(m, MambaManager):
                    m.drop_eagle_checkpoint_block = True
        self.group_block_sizes = tuple(m.block_size for m in self.single_type_managers)
        self.retention_interval = config.prefix_cache_retention_interval
        validate_retention_interval(self.retention_interval, scheduler_block_size, config)

    @property
    def managers(self) -> tuple[SingleTypeManager, ...]:
        return self.single_type_managers

    def make_block_pool(self, num_blocks: int, enable_caching: bool, enable_events: bool, hash_block_size: int,
                        num_hash_lookahead_tokens: int, metrics_collector: Any) -> BlockPool:
        return BlockPool(num_blocks, enable_caching, enable_events, hash_block_size=hash_block_size,
                         num_hash_lookahead_tokens=num_hash_lookahead_tokens, metrics_collector=metrics_collector)

    def make_manager(self, spec: KVCacheSpec, group_id: int, enable_caching: bool, dcp_world_size: int,
                     pcp_world_size: int) -> SingleTypeManager:
        cap = None
        if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
            cap = spec.max_admission_blocks_per_request(self.max_in_flight_tokens, self.max_model_len)
        return MANAGER_TYPES[type(spec)](
            spec, self.block_pool, enable_caching, group_id, self.scheduler_block_size, dcp_world_size,
            pcp_world_size, self.config.needs_kv_cache_zeroing, cap, cow=self.cow)

    # ---- allocation ----------------------------------------------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[Sequence[KVCacheBlock]], num_encoder_tokens: int,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0, writer: Request | None = None) -> int:
        """Free blocks the allocation consumes: new ones, rescued hits and copy-on-write copies (`writer`:
        the request, see SingleTypeManager.cow_indices)."""
        if self.retention_interval != 0:
            prefill_end = 0  # dense retention publishes a state on every chunk
        total = 0
        for i, m in enumerate(self.single_type_managers):
            if isinstance(m, CrossAttentionManager):
                total += m.get_num_blocks_to_allocate(request_id, num_encoder_tokens, [], 0, 0, num_encoder_tokens,
                                                      apply_admission_cap=apply_admission_cap)
                continue
            total += m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i],
                                                  total_computed_tokens, num_local_computed_tokens,
                                                  num_tokens_main_model, apply_admission_cap=apply_admission_cap,
                                                  prefill_end=prefill_end)
            total += len(m.cow_indices(request_id, total_computed_tokens, num_tokens, writer))
        return total

    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
                                     num_local_computed_tokens: int, num_external_computed_tokens: int,
                                     skip_zeroing_group_ids: tuple[int, ...] = ()) -> None:
        """Adds a new request's hits (touched) and, for connector-computed tokens, fresh blocks: every
        group's hits first, so no group's allocation evicts another group's untouched hits."""
        if self.is_running(request_id):
            if any(new_computed_blocks):
                raise ValueError(f"request {request_id!r} is running: it cannot take new prefix-cache hits")
            return
        for i, m in enumerate(self.single_type_managers):
            m.add_local_computed_blocks(request_id, new_computed_blocks[i], num_local_computed_tokens,
                                        num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            for i, m in enumerate(self.single_type_managers):
                m.allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                    num_external_computed_tokens,
                                                    record_for_zeroing=i not in skip_zeroing_group_ids)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None,
                            num_encoder_tokens: int = 0) -> tuple[list[KVCacheBlock], ...]:
        main = num_tokens if num_tokens_main_model is None else num_tokens_main_model
        return tuple(m.allocate_new_blocks(request_id, num_encoder_tokens if isinstance(m, CrossAttentionManager)
                                           else num_tokens, main) for m in self.single_type_managers)

    def apply_copy_on_write(self, request_id: str, total_computed_tokens: int, num_tokens: int,
                            writer: Request | None = None) -> list[tuple[int, int, int]]:
        """(group, index, new block id) of every table entry swapped by fork copy-on-write."""
        swapped: list[tuple[int, int, int]] = []
        for g, m in enumerate(self.single_type_managers):
            for index, block_id in m.apply_copy_on_write(request_id, total_computed_tokens, num_tokens, writer):
                swapped.append((g, index, block_id))
        return swapped

    # ---- caching -------------------------------------------------------------------------------
    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        # The last tokens a multi-token predictor re-prefills are not final yet.
        return max(0, num_computed_tokens - self.num_reprefillable_tokens)

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        # Replay boundaries only matter to sparse retention (full attention caches densely).
        boundaries = () if self.retention_interval is None else replay_boundaries(
            request.num_prompt_tokens, self.scheduler_block_size, bool(self.drop_eagle_group_ids))
        for g, m in enumerate(self.single_type_managers):
            if m.enable_caching:
                m.cache_blocks(request, self.get_num_cacheable_tokens(num_computed_tokens, g),
                               retention_interval=self.retention_interval, replay_boundaries=boundaries)

    def emit_cached_block_events(self, request, computed_blocks: Sequence[Sequence[KVCacheBlock]]) -> None:
        for g, blocks in enumerate(computed_blocks):
            if blocks:
                m = self.single_type_managers[g]
                m.block_pool.emit_cached_block_events(request, len(blocks), m.spec.block_size, g)

    # ---- freeing -------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        pools = dict.fromkeys(m.block_pool for m in self.single_type_managers)
        return all([pool.reset_prefix_cache() for pool in pools])

    def free(self, request_id: str) -> None:
        for m in self.single_type_managers:
            m.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        blocks: list[KVCacheBlock] = []
        for m in self.single_type_managers:
            blocks.extend(m.pop_blocks_for_free(request_id))
        return blocks

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def fork(self, parent_id: str, child_id: str) -> None:
        for m in self.single_type_managers:
            m.fork(parent_id, child_id)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Every pending copy (src, dst): forks' copy-on-write and partial prefix hits' private copies.
        The references that kept their ends alive drop now (the caller runs the copies before the
        step writes)."""
        partial: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        for m in self.single_type_managers:
            if m._pending_cow_copies:
                partial.extend(m.take_pending_cow_copies())
        if not self.cow.pairs and not partial:  # the common step: nothing copied, nothing pinned
            return []
        pairs, self.cow.pairs = self.cow.pairs, []
        self.cow.pins.clear()
        # The pins drop only now: a source whose holders all left returns to the free queue.
        self.block_pool.free_blocks(src for src, _ in pairs)
        self.block_pool.free_blocks(block for pair in partial for block in pair)
        return [(src.block_id, dst.block_id) for src, dst in pairs + partial]

    # ---- queries -------------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def is_running(self, request_id: str) -> bool:
        return any(request_id in m.num_cached_block for m in self.single_type_managers)

    def find_cache_hit(self, block_hashes: Sequence[BlockHash],
                       max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """(hit blocks per group, hit tokens, tokens of a shared prefix a sparse-retention group has
        not cached yet: 0 unless hybrid)."""
        raise NotImplementedError

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        blocks, hit, _ = self.find_cache_hit(block_hashes, max_length)
        return blocks, hit

    def new_step_starts(self) -> None:
        for m in self.single_type_managers:
            m.new_step_starts()


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Caching off: any number of groups, nothing ever hits."""

    def __init__(self, config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int | None = None,
                 use_eagle: bool = False, enable_events: bool = False, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, scheduler_block_size: int | None = None, hash_block_size: int | None = None,
                 metrics_collector: Any = None, num_hash_lookahead_tokens: int = 0,
                 num_prefill_lookahead: int = 0) -> None:
        super().__init__(config, max_model_len, max_in_flight_tokens, use_eagle, False, enable_events,
                         dcp_world_size, pcp_world_size, scheduler_block_size, hash_block_size, metrics_collector,
                         num_hash_lookahead_tokens, num_prefill_lookahead)
        self.num_single_type_manager = len(self.single_type_managers)

    def find_cache_hit(self, block_hashes, max_cache_hit_length):
        return tuple([] for _ in self.single_type_managers), 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group: its manager's own lookup, at its block size."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        manager = self.single_type_managers[0]
        self.kv_cache_spec = self.config.groups[0]
        self.dcp_world_size = manager.dcp_world_size
        self.pcp_world_size = manager.pcp_world_size
        self.block_size = manager.block_size
        manager.use_eagle = 0 in self.drop_eagle_group_ids

    def find_cache_hit(self, block_hashes, max_cache_hit_length):
        manager = self.single_type_managers[0]
        blocks, hit = manager.find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, self.kv_cache_spec,
            0 in self.drop_eagle_group_ids, self.block_size, self.dcp_world_size, self.pcp_world_size)
        return blocks, hit, 0

    # The general path's per-step calls, for one manager without the loops (the base's results).
    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, num_encoder_tokens,
                                   total_computed_tokens, num_local_computed_tokens, num_tokens_main_model,
                                   apply_admission_cap=False, prefill_end=0, writer=None) -> int:
        m = self.single_type_managers[0]
        if isinstance(m, CrossAttentionManager):
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks, num_encoder_tokens, total_computed_tokens,
                num_local_computed_tokens, num_tokens_main_model, apply_admission_cap, prefill_end, writer)
        if self.retention_interval != 0:
            prefill_end = 0
        n = m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[0], total_computed_tokens,
                                         num_local_computed_tokens, num_tokens_main_model, apply_admission_cap,
                                         prefill_end)
        return n + len(m.cow_indices(request_id, total_computed_tokens, num_tokens, writer))

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model=None, num_encoder_tokens=0):
        m = self.single_type_managers[0]
        if isinstance(m, CrossAttentionManager):
            return (m.allocate_new_blocks(request_id, num_encoder_tokens, num_tokens_main_model),)
        return (m.allocate_new_blocks(request_id, num_tokens, num_tokens if num_tokens_main_model is None
                                      else num_tokens_main_model),)

    def apply_copy_on_write(self, request_id, total_computed_tokens, num_tokens, writer=None):
        swaps = self.single_type_managers[0].apply_copy_on_write(request_id, total_computed_tokens, num_tokens,
                                                                 writer)
        return [(0, i, b) for i, b in swaps] if swaps else swaps

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None) -> None:
        self.single_type_managers[0].remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        m = self.single_type_managers[0]
        if not m.enable_caching:
            return
        if self.retention_interval is None and not self.num_reprefillable_tokens:
            m.cache_blocks(request, num_computed_tokens)
        else:
            super().cache_blocks(request, num_computed_tokens)

def get_kv_cache_coordinator(config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int | None = None,
                             use_eagle: bool = False, enable_caching: bool = True, enable_events: bool = False,
                             dcp_world_size: int = 1, pcp_world_size: int = 1, scheduler_block_size: int | None = None,
                             hash_block_size: int | None = None, metrics_collector: Any = None,
                             num_hash_lookahead_tokens: int = 0, num_prefill_lookahead: int = 0,
                             allow_partial_hash_hits: bool = True, *,
                             classes: tuple[type, type, type] | None = None) -> KVCacheCoordinator:
    """The coordinator for a config (`classes`: the no-cache, unitary and hybrid classes to use)."""
    from kvservice.core.hybrid_coordinator import HybridKVCacheCoordinator  # (it imports this module)

    no_cache, unitary, hybrid = classes or (KVCacheCoordinatorNoPrefixCache, UnitaryKVCacheCoordinator,
                                            HybridKVCacheCoordinator)
    common = dict(dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size,
                  scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
                  metrics_collector=metrics_collector, num_hash_lookahead_tokens=num_hash_lookahead_tokens,
                  num_prefill_lookahead=num_prefill_lookahead)
    if not enable_caching:
        return no_cache(config, max_model_len, max_in_flight_tokens, use_eagle, enable_events, **common)
    if len(config.groups) == 1:
        return unitary(config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching, enable_events, **common)
    return hybrid(config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching, enable_events,
                  allow_partial_hash_hits=allow_partial_hash_hits, **common)

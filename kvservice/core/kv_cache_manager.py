"""KVCacheManager: the scheduler-facing policy (vLLM v1's names and semantics).

    KVCacheManager -> coordinator (get_kv_cache_coordinator) -> single-type managers -> BlockPool
Its fast paths live behind `fast_path` (fast_path.py); the KV-connector hooks in connector_hooks.py.
"""

from __future__ import annotations

import numbers
from typing import Any

from kvservice.core.block import KVCacheBlock
from kvservice.core.connector_hooks import ConnectorHooks
from kvservice.core.coordinator import KVCacheCoordinator, get_kv_cache_coordinator
from kvservice.core.events import BlockStored, KVCacheEvent
from kvservice.core.fast_path import FastPath, PackedRows
from kvservice.core.held_blocks import HeldBlocks
from kvservice.core.kv_cache_blocks import KVCacheBlocks
from kvservice.core.managers import MambaManager
from kvservice.core.request import Request
from kvservice.core.specs import KVCacheConfig, effective_block_size, gcd_block_size, lcm_block_size, spec_kind
from kvservice.core.stats import PrefixCacheRecorder, PrefixCacheStats, PrefixCacheTotals

DecodeBatchOutput = PackedRows  # transitional alias for kvservice/allocator.py (see allocate_running below)


def _checked_count(name: str, value: object) -> int:
    """The slow path of allocate_slots' argument check: any integral type (numpy too)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


class KVCacheManager(ConnectorHooks):
    """Args (besides vLLM v1's): vLLM 0.33.0's, keyword-only — `scheduler_block_size` (default: the
    LCM of the groups' block sizes), `max_in_flight_tokens` (the sliding-window admission cap),
    `use_eagle`, `num_hash_lookahead_tokens`, `num_prefill_lookahead`, `pcp_world_size`, `watermark`
    (a fraction of the pool kept free when admitting waiting requests), `metrics_collector`,
    `enable_mamba_shared_prefix_checkpoint`; and `enable_fast_path` (the switch of `fast_path`)."""

    # An allocated request counts as running (in every manager's `num_cached_block`) even before it
    # caches a block; vLLM registers it only with its first hit or cached block (the drop-in's way).
    track_running = True

    def __init__(
        self,
        config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        enable_events: bool = False,
        dcp_world_size: int = 1,
        hash_block_size: int | None = None,
        *,
        enable_fast_path: bool = True,
        scheduler_block_size: int | None = None,
        max_in_flight_tokens: int | None = None,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        pcp_world_size: int = 1,
        watermark: float = 0.0,
        metrics_collector: Any = None,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        stats: PrefixCacheRecorder | None = None,
    ) -> None:
        if not isinstance(max_model_len, int) or max_model_len <= 0:
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        if not isinstance(dcp_world_size, int) or dcp_world_size <= 0:
            raise ValueError(f"dcp_world_size must be a positive int, got {dcp_world_size!r}")
        for spec in config.groups:
            effective_block_size(spec, dcp_world_size)  # rejects DCP on sharded groups other than full attention
        if hash_block_size is None:
            hash_block_size = gcd_block_size(config, dcp_world_size)
        elif not isinstance(hash_block_size, int) or hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be a positive int, got {hash_block_size!r}")
        if not watermark >= 0.0:
            raise ValueError(f"watermark must be non-negative, got {watermark!r}")
        self.config = config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_events = self.enable_kv_cache_events = enable_events
        self.dcp_world_size = dcp_world_size
        self.hash_block_size = hash_block_size
        self.use_eagle = use_eagle
        self.metrics_collector = metrics_collector
        self.coordinator: KVCacheCoordinator = self._make_coordinator(
            config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching, enable_events, dcp_world_size,
            pcp_world_size, scheduler_block_size or lcm_block_size(config, dcp_world_size), hash_block_size,
            metrics_collector, num_hash_lookahead_tokens, num_prefill_lookahead)
        self.block_pool = self.coordinator.block_pool
        self.held = HeldBlocks(self.block_pool)  # references a vLLM scheduler holds outside requests' tables
        self.num_kv_cache_groups = len(config.groups)
        self.scheduler_block_size = self.coordinator.scheduler_block_size
        # Where hits land: the hash block size when partial (sub-block) hits are on, else the
        # scheduler block size.
        self.cache_hit_alignment_tokens = getattr(self.coordinator, "_cache_hit_alignment_tokens",
                                                  self.scheduler_block_size)
        self.mamba_shared_prefix_checkpoint = (
            enable_mamba_shared_prefix_checkpoint and bool(self.coordinator.eagle_group_ids)
            and self.coordinator.enable_partial_hash_hits and self.coordinator.num_reprefillable_tokens == 0)
        if self.mamba_shared_prefix_checkpoint:
            for m in self.coordinator.single_type_managers:
                if isinstance(m, MambaManager):
                    m.shared_prefix_checkpoint = True
        self.retained_hit_group_ids = tuple(m.kv_cache_group_id for m in self.coordinator.single_type_managers
                                            if m.retains_longer_hit)
        self.watermark_blocks = int(watermark * config.num_blocks)
        self.kv_cache_event_metadata = tuple(spec_kind(s) for s in config.groups)
        self._stats = stats if stats is not None else PrefixCacheRecorder()
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in config.groups))
        self._empty = self.empty_kv_cache_blocks.blocks
        managers = self.coordinator.single_type_managers
        # The public switch: None when off or when the layout does not qualify (not one full-attention group).
        self.fast_path: FastPath | None = None
        if enable_fast_path and FastPath.qualifies(self.coordinator, self.watermark_blocks):
            self.fast_path = FastPath(managers[0], self.block_pool, self._stats, hash_block_size, max_model_len,
                                      enable_caching)

    def _make_coordinator(self, *args) -> KVCacheCoordinator:
        """The coordinator (the vLLM drop-in builds its own from vLLM's config)."""
        return get_kv_cache_coordinator(*args)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._stats.interval

    @prefix_cache_stats.setter
    def prefix_cache_stats(self, stats: PrefixCacheStats) -> None:
        self._stats.interval = stats

    @property
    def prefix_cache_totals(self) -> PrefixCacheTotals:
        return self._stats.totals

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self._stats.take_interval()

    def _check_request(self, request) -> None:
        if type(request) is Request and request.block_size != self.hash_block_size:
            raise ValueError(f"request {request.request_id!r} hashes at block size {request.block_size}, "
                             f"the manager at hash_block_size {self.hash_block_size}")

    def _is_waiting(self, request) -> bool:
        """Whether the watermark applies (vLLM: a WAITING or PREEMPTED request)."""
        return not self.coordinator.is_running(request.request_id)

    # ---- lookup --------------------------------------------------------------------------------
    def prefix_cache_lookup_enabled(self, request) -> bool:
        return self.enable_caching and not getattr(request, "skip_reading_prefix_cache", False)

    def record_prefix_cache_stats(self, request, num_hits: int) -> None:
        if self.prefix_cache_lookup_enabled(request):
            self._stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    def find_computed_blocks(self, request, max_cache_hit_length: int | None = None, *,
                             record_stats: bool = True) -> tuple[KVCacheBlocks, int, int]:
        """vLLM's `get_computed_blocks`: (the longest cached prefix every group agrees on, its tokens,
        the shared-prefix boundary: where a prefix some group cached ends while a sparse-retention
        group lags, else 0). Never the whole prompt: the last token is recomputed for logits."""
        self._check_request(request)
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        blocks, num_hits, num_uncached = self.coordinator.find_cache_hit(request.block_hashes, max_cache_hit_length)
        if num_hits > 0 and self.enable_events and getattr(request, "kv_cache_report_mode", "incremental") == "full":
            self.coordinator.emit_cached_block_events(request, blocks)
        if record_stats:
            self._stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)
        return self.create_kv_cache_blocks(blocks), num_hits, num_hits + num_uncached if num_uncached else 0

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """(the longest cached prefix, its tokens); counted in the prefix-cache stats."""
        blocks, num_hits, _ = self.find_computed_blocks(request)
        return blocks, num_hits

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                          new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0, *,
                          num_computed_tokens: int | None = None, num_tokens: int | None = None) -> int:
        """Free blocks `allocate_slots` with these arguments would consume (read-only; counts hits rescued
        from the free queue and copy-on-write blocks; skipped blocks not yet freed). A planner that changes
        the request's counts before it allocates passes them: `num_computed_tokens` and `num_tokens` as
        they will be then (default: as they are now)."""
        hits = self._hit_groups(new_computed_blocks, num_new_computed_tokens)
        computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        local = computed + num_new_computed_tokens
        main = min(local, self.max_model_len) + num_new_tokens
        need = min(main + num_lookahead_tokens, self.max_model_len)
        prefill_end = max(request.num_prompt_tokens, (request.num_tokens if num_tokens is None else num_tokens) - 1)
        return self.coordinator.get_num_blocks_to_allocate(request.request_id, need, hits, 0, local, local, main,
                                                           prefill_end=prefill_end, writer=request)

    def _hit_groups(self, new_computed_blocks: KVCacheBlocks | None, num_reused_tokens: int):
        """The hit blocks per group an allocation adopts: retained-hit groups keep only those the reused
        tokens cover."""
        if new_computed_blocks is None:
            return self._empty
        hits = new_computed_blocks.blocks
        if self.retained_hit_group_ids:
            groups = list(hits)
            for g in self.retained_hit_group_ids:
                groups[g] = groups[g][:-(-num_reused_tokens // self.coordinator.single_type_managers[g].block_size)]
            hits = tuple(groups)
        return hits

    # ---- allocation ----------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        *,
        num_external_computed_tokens: int = 0,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Makes room for `num_new_tokens` (+ lookahead) after the computed ones; all or nothing.

        Args (vLLM 0.33.0's): `num_external_computed_tokens` a KV connector computed;
            `num_encoder_tokens` for cross attention; `full_sequence_must_fit`: admit only if the whole
            request fits (windows capped); `reserved_blocks` stay free for in-flight requests;
            `has_scheduled_reqs`: whether the watermark applies.
        Returns:
            The newly allocated blocks per group, or None when they do not fit. Then nothing
            changed, except that blocks no group reads again may already have been freed.
        """
        self._check_request(request)
        if not (type(num_new_tokens) is int and num_new_tokens >= 0 and type(num_new_computed_tokens) is int
                and num_new_computed_tokens >= 0 and type(num_lookahead_tokens) is int and num_lookahead_tokens >= 0):
            num_new_tokens = _checked_count("num_new_tokens", num_new_tokens)
            num_new_computed_tokens = _checked_count("num_new_computed_tokens", num_new_computed_tokens)
            num_lookahead_tokens = _checked_count("num_lookahead_tokens", num_lookahead_tokens)
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens to adopt")
        hits = self._hit_groups(new_computed_blocks, num_new_computed_tokens + num_external_computed_tokens)
        coordinator = self.coordinator
        request_id = request.request_id
        local = request.num_computed_tokens + num_new_computed_tokens
        total = min(local + num_external_computed_tokens, self.max_model_len)
        watermark = self.watermark_blocks if self.watermark_blocks and has_scheduled_reqs and \
            self._is_waiting(request) else 0
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            needed = coordinator.get_num_blocks_to_allocate(request_id, full, hits, num_encoder_tokens, total, local,
                                                            full, apply_admission_cap=True, prefill_end=prefill_end,
                                                            writer=request)
            if needed + watermark > self.block_pool.get_num_free_blocks():
                return None
        num_main = total + num_new_tokens
        num_need = min(num_main + num_lookahead_tokens, self.max_model_len)
        # Free what no group reads again before counting (fewer cached blocks get evicted), on the
        # processed basis: in-flight steps still read below the optimistic boundary.
        coordinator.remove_skipped_blocks(request_id, max(0, total - request.num_in_flight_tokens),
                                          request.num_prompt_tokens)
        needed = coordinator.get_num_blocks_to_allocate(request_id, num_need, hits, num_encoder_tokens,
                                                        local + num_external_computed_tokens, local, num_main,
                                                        prefill_end=prefill_end, writer=request)
        if needed + watermark > self.block_pool.get_num_free_blocks() - reserved_blocks:
            return None
        if hits is not self._empty or num_external_computed_tokens > 0:
            coordinator.allocate_new_computed_blocks(request_id, hits, local, num_external_computed_tokens,
                                                     skip_zeroing_group_ids)
        replaced = coordinator.apply_copy_on_write(request_id, total, num_need, request)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_need, num_main, num_encoder_tokens)
        if self.track_running and request_id not in coordinator.single_type_managers[0].num_cached_block:
            for m in coordinator.single_type_managers:
                m.num_cached_block.setdefault(request_id, 0)
        if self.enable_caching and not delay_cache_blocks:
            # Lookahead (draft) tokens may be rejected: cache only up to the main-model tokens.
            num_main = total + num_new_tokens
            coordinator.cache_blocks(request, num_main if num_main < request.num_tokens else request.num_tokens)
        if replaced:
            return KVCacheBlocks(new_blocks, replaced)
        return KVCacheBlocks(new_blocks) if any(new_blocks) else self.empty_kv_cache_blocks

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...],
                               replaced: list[tuple[int, int, int]] | None = None) -> KVCacheBlocks:
        if replaced:
            return KVCacheBlocks(blocks, replaced)
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches full blocks up to `num_computed_tokens` (after a delayed allocation)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    # ---- forks, holders, freeing ---------------------------------------------------------------
    def fork(self, parent: Request, child_request_id: str) -> Request:
        """A child sharing the parent's tokens, hashes, computed count and every block (ref + 1);
        a later write into a shared, not-full block goes through copy-on-write."""
        self._check_request(parent)
        coordinator = self.coordinator
        if coordinator.is_running(child_request_id) or any(coordinator.get_blocks(child_request_id)):
            raise ValueError(f"request {child_request_id!r} already exists")
        child = parent.fork(child_request_id)
        coordinator.fork(parent.request_id, child_request_id)
        return child

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Drains pending copies (src, dst): forks' copy-on-write and partial hits' private copies;
        the references keeping their ends alive drop now."""
        return self.coordinator.take_block_copies()

    def take_held_block_copies(self, taken: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
        """A vLLM pool's take_kv_cache_block_copies (the allocator's TakeBlockCopiesOp): drains the partial hits'
        pending copies (src, dst). Both ends stay referenced, as held blocks (`held`), until the scheduler returns
        them (`held.free`) once the step that copies has run. `taken`: the copies the scheduler took, checked
        against these (HeldBlocks.take_copies). (vLLM's own take_kv_cache_block_copies, which leaves the
        references with the caller, is ConnectorHooks'.)"""
        return self.held.take_copies(self.coordinator.single_type_managers, taken)

    def hold(self, holder_id: str, blocks: KVCacheBlocks) -> None:
        """Pins cached blocks under a table with no request behind it (e.g. the source of a cross-pool
        transfer): they cannot be evicted or reallocated until `release(holder_id)`."""
        coordinator = self.coordinator
        if coordinator.is_running(holder_id) or any(coordinator.get_blocks(holder_id)):
            raise ValueError(f"holder {holder_id!r} already exists")
        for manager, group in zip(coordinator.single_type_managers, blocks.blocks):
            self.block_pool.touch(group)
            manager.req_to_blocks[holder_id] = list(group)
            manager.num_cached_block[holder_id] = len(group)

    def release(self, holder_id: str) -> None:
        """Drops a holder's (or a request's) blocks, tail first."""
        self.coordinator.free(holder_id)

    def free(self, request) -> None:
        """Releases the request's blocks, tail first, so its tail is evicted first."""
        self.coordinator.free(request.request_id)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        self.coordinator.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def pop_blocks_for_free(self, request) -> list[KVCacheBlock]:
        """Drops the request's bookkeeping; returns its blocks, which the caller frees (tail first)."""
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def evict_blocks(self, block_ids) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        if not self.coordinator.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()

    # ---- queries -------------------------------------------------------------------------------
    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM 0.33.0 (cascade attention is gone): zeros."""
        return [0] * self.num_kv_cache_groups

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.coordinator.get_blocks(request_id))

    def take_events(self) -> list[KVCacheEvent]:
        """Drains the pool's events, each BlockStored annotated with its group's spec kind."""
        events = self.block_pool.take_events()
        metadata = self.kv_cache_event_metadata
        for event in events:
            if type(event) is BlockStored and event.group_idx is not None and 0 <= event.group_idx < len(metadata):
                event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = metadata[event.group_idx]
        return events

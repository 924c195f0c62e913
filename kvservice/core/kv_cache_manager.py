"""KVCacheManager: the scheduler-facing policy (vLLM v1's names and semantics, DESIGN §3)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvservice.core.block import KVCacheBlock
from kvservice.core.block_pool import BlockPool
from kvservice.core.coordinator import KVCacheCoordinator
from kvservice.core.events import KVCacheEvent
from kvservice.core.fast_path import FastPath, PackedRows
from kvservice.core.request import Request
from kvservice.core.specs import KVCacheConfig, effective_block_size, gcd_block_size
from kvservice.core.stats import PrefixCacheRecorder, PrefixCacheStats, PrefixCacheTotals

DecodeBatchOutput = PackedRows  # transitional alias for kvservice/allocator.py (see allocate_running below)


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks of one request, one sequence per KV-cache group. From `allocate_slots`, `replaced` lists
    the (group, index, new block id) table entries that copy-on-write swapped (their old blocks are
    the sources of `take_block_copies()`)."""

    blocks: tuple[Sequence[KVCacheBlock], ...]
    replaced: list[tuple[int, int, int]] = field(default_factory=list)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))


def _checked_counts(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens) -> tuple[int, int, int]:
    """The slow path of allocate_slots' argument check: accepts any integral type (numpy too)."""
    out = []
    for name, value in (("num_new_tokens", num_new_tokens), ("num_new_computed_tokens", num_new_computed_tokens),
                        ("num_lookahead_tokens", num_lookahead_tokens)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        out.append(int(value))
    if out[0] == 0:
        raise ValueError("num_new_tokens must be greater than 0")
    return out[0], out[1], out[2]


class KVCacheManager:
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
    ) -> None:
        if not isinstance(max_model_len, int) or max_model_len <= 0:
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        if not isinstance(dcp_world_size, int) or dcp_world_size <= 0:
            raise ValueError(f"dcp_world_size must be a positive int, got {dcp_world_size!r}")
        for spec in config.groups:
            effective_block_size(spec, dcp_world_size)  # rejects DCP on non-full-attention groups
        if hash_block_size is None:
            hash_block_size = gcd_block_size(config, dcp_world_size)
        elif not isinstance(hash_block_size, int) or hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be a positive int, got {hash_block_size!r}")
        self.config = config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.dcp_world_size = dcp_world_size
        self.hash_block_size = hash_block_size
        self.block_pool = BlockPool(config.num_blocks, enable_caching, enable_events)
        self.coordinator = KVCacheCoordinator(config, self.block_pool, hash_block_size, dcp_world_size)
        self.num_kv_cache_groups = len(config.groups)
        self.scheduler_block_size = self.coordinator.scheduler_block_size
        self._stats = PrefixCacheRecorder()
        self._empty = tuple(() for _ in config.groups)
        managers = self.coordinator.managers
        # The public switch: None when off or when the layout does not qualify (not one full-attention group).
        self.fast_path: FastPath | None = None
        if enable_fast_path and FastPath.qualifies(managers):
            self.fast_path = FastPath(managers[0], self.block_pool, self._stats, hash_block_size, max_model_len,
                                      enable_caching)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._stats.interval

    @prefix_cache_stats.setter
    def prefix_cache_stats(self, stats: PrefixCacheStats) -> None:
        self._stats.interval = stats

    @property
    def prefix_cache_totals(self) -> PrefixCacheTotals:
        return self._stats.totals

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def _check_request(self, request: Request) -> None:
        if request.block_size != self.hash_block_size:
            raise ValueError(f"request {request.request_id!r} hashes at block size {request.block_size}, "
                             f"the manager at hash_block_size {self.hash_block_size}")

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix every group agrees on, block aligned, never the whole prompt
        (the last token is always recomputed to produce logits)."""
        self._check_request(request)
        if not self.enable_caching:
            return KVCacheBlocks(tuple([] for _ in self._empty)), 0
        blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        self._stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)
        return KVCacheBlocks(blocks), num_hit_tokens

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                          new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0) -> int:
        """Free blocks `allocate_slots` would consume now (read-only; counts hits rescued from the
        free queue and copy-on-write blocks; skipped blocks not yet freed)."""
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._empty
        total = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        need = min(total + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        return self.coordinator.get_num_blocks_to_allocate(request.request_id, need, hits, total)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Makes room for `num_new_tokens` (+ lookahead) after the computed ones; all or nothing.

        Returns:
            The newly allocated blocks per group, or None when they do not fit. Then nothing
            changed, except that blocks no group reads again may already have been freed.
        """
        if request.block_size != self.hash_block_size:
            self._check_request(request)
        if not (type(num_new_tokens) is int and num_new_tokens > 0 and type(num_new_computed_tokens) is int
                and num_new_computed_tokens >= 0 and type(num_lookahead_tokens) is int and num_lookahead_tokens >= 0):
            num_new_tokens, num_new_computed_tokens, num_lookahead_tokens = _checked_counts(
                num_new_tokens, num_new_computed_tokens, num_lookahead_tokens)
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._empty
        coordinator = self.coordinator
        request_id = request.request_id
        running = coordinator.is_running(request_id)
        if running and any(hits):
            raise ValueError(f"request {request_id!r} is running: it cannot take new prefix-cache hits")
        total_computed = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        num_tokens_main = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main + num_lookahead_tokens, self.max_model_len)

        # Free what no group reads again before counting: fewer cached blocks get evicted.
        coordinator.remove_skipped_blocks(request_id, total_computed)
        num_needed = coordinator.get_num_blocks_to_allocate(request_id, num_tokens_need_slot, hits, total_computed)
        if num_needed > self.block_pool.get_num_free_blocks():
            return None

        if not running:
            coordinator.allocate_new_computed_blocks(request_id, hits, total_computed)
        replaced = coordinator.apply_copy_on_write(request_id, total_computed, num_tokens_need_slot)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
        if self.enable_caching and not delay_cache_blocks:
            # Lookahead (draft) tokens may be rejected: cache only up to the main-model tokens.
            coordinator.cache_blocks(request, min(num_tokens_main, request.num_tokens))
        return KVCacheBlocks(new_blocks, replaced)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches full blocks up to `num_computed_tokens` (after a delayed allocation)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def fork(self, parent: Request, child_request_id: str) -> Request:
        """A child sharing the parent's tokens, hashes, computed count and every block (ref + 1);
        a later write into a shared, not-full block goes through copy-on-write."""
        self._check_request(parent)
        coordinator = self.coordinator
        if child_request_id in coordinator.managers[0].req_to_blocks or coordinator.is_running(child_request_id):
            raise ValueError(f"request {child_request_id!r} already exists")
        child = parent.fork(child_request_id)
        self.coordinator.fork(parent.request_id, child_request_id)
        return child

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Drains pending copy-on-write copies (src, dst); their sources' pins drop now."""
        return self.coordinator.take_block_copies()

    def hold(self, holder_id: str, blocks: KVCacheBlocks) -> None:
        """Pins cached blocks under a table with no request behind it (e.g. the source of a cross-pool
        transfer): they cannot be evicted or reallocated until `release(holder_id)`."""
        if self.coordinator.is_running(holder_id) or holder_id in self.coordinator.managers[0].req_to_blocks:
            raise ValueError(f"holder {holder_id!r} already exists")
        self.block_pool.touch(blocks.blocks)
        for manager, group in zip(self.coordinator.managers, blocks.blocks):
            manager.req_to_blocks[holder_id] = list(group)
            manager.num_cached_block[holder_id] = len(group)

    def release(self, holder_id: str) -> None:
        """Drops a holder's (or a request's) blocks, tail first."""
        self.coordinator.free(holder_id)

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, so its tail is evicted first."""
        self.coordinator.free(request.request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.coordinator.get_blocks(request_id))

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return self._stats.take_interval()

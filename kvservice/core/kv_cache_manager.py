"""KVCacheManager: the scheduler-facing policy (vLLM v1's names and semantics, DESIGN §3)."""

from __future__ import annotations

import numbers
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvservice.core.block import KVCacheBlock, make_block_hash_with_group_id
from kvservice.core.block_pool import BlockPool
from kvservice.core.coordinator import KVCacheCoordinator
from kvservice.core.events import KVCacheEvent
from kvservice.core.request import Request
from kvservice.core.specs import FullAttentionSpec, KVCacheConfig, effective_block_size, gcd_block_size
from kvservice.hashing import MAX_TOKEN_ID

_GROUP0 = make_block_hash_with_group_id(b"", 0)  # the index key suffix of KV-cache group 0


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


@dataclass(slots=True)
class DecodeBatchOutput:
    """Rows `allocate_running_batch` appends, one per entry taken (a single group: one count each)."""

    num_new_blocks: array = field(default_factory=lambda: array("I"))
    new_block_ids: array = field(default_factory=lambda: array("I"))
    num_computed: array = field(default_factory=lambda: array("I"))
    num_scheduled: array = field(default_factory=lambda: array("I"))


PackedRows = DecodeBatchOutput


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last `make_prefix_cache_stats()` (in tokens)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass(slots=True)
class PrefixCacheTotals:
    """Cumulative lookups over the manager's life, for hit-rate metrics."""

    queries: int = 0
    hits: int = 0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


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
        self.prefix_cache_stats = PrefixCacheStats()
        self.prefix_cache_totals = PrefixCacheTotals()
        self._empty = tuple(() for _ in config.groups)
        # allocate_running's fast path: one full-attention group (no skipped blocks, no alignment).
        managers = self.coordinator.managers
        self._single_full = managers[0] if (enable_fast_path and len(managers) == 1
                                            and type(config.groups[0]) is FullAttentionSpec) else None

    @property
    def fast_path(self) -> KVCacheManager | None:
        """Interim seam (the fast paths move to core/fast_path.py): self where they apply."""
        return self if self._single_full is not None else None

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
        self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)
        totals = self.prefix_cache_totals
        totals.queries += request.num_tokens
        totals.hits += num_hit_tokens
        totals.requests += 1
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

    def allocate_running(self, request: Request, num_computed_tokens: int, token: int | None = None,
                         num_new_tokens: int = 1, num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """One decode step of a running request in a single full-attention pool, in one call: appends
        `token` (None: nothing), sets `num_computed_tokens`, then does exactly what
        `allocate_slots(request, min(num_new_tokens, uncomputed), 0, None, num_lookahead_tokens)`
        would. The scheduler's (or the service's) decode step without the general path's cost.

        Returns:
            The new blocks (possibly none), or None when this is not the simple case (another layout,
            a request not running, a written block shared with another table, not enough free blocks,
            past max_model_len, nothing left to compute, a bad token): then nothing changed and
            `allocate_slots` decides, with its reasons.
        """
        manager = self._single_full
        if manager is None or request.request_id not in manager.num_cached_block:
            return None  # not running (e.g. an admission): the general path, without building rows
        out = DecodeBatchOutput()
        if not self.allocate_running_batch((request,), (num_computed_tokens,), None if token is None else (token,),
                                           num_new_tokens, num_lookahead_tokens, 0, out):
            return None
        num_new = out.num_new_blocks[0]
        return manager.req_to_blocks[request.request_id][-num_new:] if num_new else []

    def admit(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0,
              delay_cache_blocks: bool = False) -> tuple[list[KVCacheBlock] | None, int] | None:
        """A waiting request's first allocation in a single full-attention pool, in one call: exactly
        `hits, n = get_computed_blocks(request)` then `allocate_slots(request, min(num_new_tokens,
        request.num_tokens - n), n, hits, num_lookahead_tokens, delay_cache_blocks)`, without the general
        path's layers (one lookup loop, one touch, one allocation, one caching call).

        Returns:
            (the request's whole table, or None when it does not fit, and its hit tokens), or None when
            this is not the simple case (another layout, caching off, a coarser block than the hash block,
            a request holding blocks or computed tokens): then nothing changed and the general path decides.
        """
        manager = self._single_full
        request_id = request.request_id
        if (manager is None or not self.enable_caching or manager.hash_ratio != 1
                or request.block_size != self.hash_block_size or request.num_computed_tokens
                or request_id in manager.req_to_blocks or type(num_new_tokens) is not int or num_new_tokens < 1
                or type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0):
            return None
        bs, max_len = manager.block_size, self.max_model_len
        block_pool = self.block_pool
        index = block_pool.cached_block_hash_to_block._cache  # get_one_block, inline: one call per hit
        hashes = request.block_hashes
        num_tokens = request.num_tokens
        table: list[KVCacheBlock] = []
        for i in range(min((num_tokens - 1) // bs, len(hashes))):  # never the whole prompt
            entry = index.get(hashes[i] + _GROUP0)
            if entry is None:
                break
            table.append(entry if type(entry) is KVCacheBlock else next(iter(entry.values())))
        num_hits = len(table)
        num_hit_tokens = num_hits * bs
        self.prefix_cache_stats.record(num_tokens, num_hit_tokens, request.num_preemptions > 0)
        totals = self.prefix_cache_totals
        totals.queries += num_tokens
        totals.hits += num_hit_tokens
        totals.requests += 1
        num_main = min(num_hit_tokens, max_len) + min(num_new_tokens, num_tokens - num_hit_tokens)
        num_required = -(-min(num_main + num_lookahead_tokens, max_len) // bs)
        num_new_blocks = num_required - num_hits if num_required > num_hits else 0
        num_evictable = sum(1 for block in table if block.ref_cnt == 0)  # hits leave the free queue too
        free_queue = block_pool.free_block_queue
        if num_new_blocks + num_evictable > free_queue.num_free_blocks:
            return None, num_hit_tokens
        for block in table:  # touch
            if block.ref_cnt == 0:
                free_queue.remove(block)
            block.ref_cnt += 1
        manager.req_to_blocks[request_id] = table
        manager.num_cached_block[request_id] = num_hits
        if num_new_blocks:
            table.extend(block_pool.get_new_blocks(num_new_blocks))
        num_full = (num_main if num_main < num_tokens else num_tokens) // bs
        if not delay_cache_blocks and num_full > num_hits:
            block_pool.cache_full_blocks(request, table, num_hits, num_full, bs, manager.kv_cache_group_id, hashes)
            manager.num_cached_block[request_id] = num_full
        return table, num_hit_tokens

    def allocate_running_batch(self, requests: Sequence[Request | None], num_computed_tokens: Sequence[int],
                               token_ids: Sequence[int] | None, num_new_tokens: int, num_lookahead_tokens: int,
                               start: int, out: DecodeBatchOutput) -> int:
        """`allocate_running` over requests[start:] in order, with one token each from `token_ids`
        (None: no tokens), stopping at the first entry it does not take (None entries included).

        Returns:
            The index of that entry (len(requests) when all were taken); `out` got one row per
            entry taken. The caller decides the stopped entry (e.g. with `allocate_slots`), then
            resumes after it, so every entry sees the pool as its predecessors left it.
        """
        manager = self._single_full
        if manager is None or num_new_tokens < 1 or num_lookahead_tokens < 0:
            return start
        req_to_blocks, num_cached, cache_blocks = manager.req_to_blocks, manager.num_cached_block, manager.cache_blocks
        bs, hash_bs, max_len = manager.block_size, self.hash_block_size, self.max_model_len
        free_queue, get_new_blocks = self.block_pool.free_block_queue, self.block_pool.get_new_blocks
        caching = self.enable_caching
        counts, ids = out.num_new_blocks, out.new_block_ids
        computed_out, scheduled_out = out.num_computed, out.num_scheduled
        token = None
        for i in range(start, len(requests)):
            req = requests[i]
            if req is None or req.block_size != hash_bs:
                return i
            request_id = req.request_id
            blocks = req_to_blocks.get(request_id)
            if blocks is None or request_id not in num_cached:
                return i
            computed = num_computed_tokens[i]
            num_tokens = req._num_tokens
            if token_ids is not None:
                token = token_ids[i]
                if req._token_ids is None or not 0 <= token <= MAX_TOKEN_ID:
                    return i
                num_tokens += 1
            if not 0 <= computed < num_tokens or num_tokens > max_len:
                return i
            scheduled = num_tokens - computed
            if scheduled > num_new_tokens:
                scheduled = num_new_tokens
            num_main = computed + scheduled
            num_need = num_main + num_lookahead_tokens
            if num_need > max_len:
                num_need = max_len
            num_required = -(-num_need // bs)
            num_held = len(blocks)
            j, last = computed // bs, (num_held if num_held < num_required else num_required)
            while j < last:
                if blocks[j].ref_cnt > 1:  # shared (or pinned): copy-on-write decides
                    return i
                j += 1
            num_new = num_required - num_held
            if num_new > free_queue.num_free_blocks:
                return i
            if token is not None:
                req._token_ids.append(token)
                req._num_tokens = num_tokens
                if num_tokens % hash_bs == 0:
                    req.hash_full_blocks()
            req.num_computed_tokens = computed
            if num_new > 0:
                new_blocks = get_new_blocks(num_new)
                blocks.extend(new_blocks)
                counts.append(num_new)
                for block in new_blocks:
                    ids.append(block.block_id)
            else:
                counts.append(0)
            computed_out.append(computed)
            scheduled_out.append(scheduled)
            if caching:
                num_cacheable = num_main if num_main < num_tokens else num_tokens
                if num_cached[request_id] < num_cacheable // bs:
                    cache_blocks(req, num_cacheable)
        return len(requests)

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
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

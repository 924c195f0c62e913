"""The core's fast paths, behind one seam (STYLE habit 10).

    KVCacheManager.allocate_slots (the contract)      FastPath.admit / allocate_running[_batch]
        -> coordinator -> managers -> BlockPool   ==      -> the same manager's and pool's hooks

A pool of one full-attention group takes them: no skipped blocks, no cross-group agreement, so a
waiting request's first allocation and a running request's decode step reduce to one lookup loop and
one allocation. Each method does exactly what the general path would (block for block, free-queue
order, events, stats), or declines and changes nothing. `KVCacheManager(enable_fast_path=False)` turns
the seam off (`manager.fast_path` is None); differential tests compare the two through it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvservice.core.block import KVCacheBlock, make_block_hash_with_group_id
from kvservice.core.block_pool import BlockPool
from kvservice.core.managers import FullAttentionManager, SingleTypeManager
from kvservice.core.request import Request
from kvservice.core.stats import PrefixCacheRecorder


@dataclass(slots=True)
class PackedRows:
    """Packed per-entry rows of a batch, one per entry taken: `allocate_running_batch` appends them (one
    group: one count each) and the allocator packs its decode and admission batches the same way."""

    num_new_blocks: array = field(default_factory=lambda: array("I"))
    new_block_ids: array = field(default_factory=lambda: array("I"))
    num_computed: array = field(default_factory=lambda: array("I"))
    num_scheduled: array = field(default_factory=lambda: array("I"))


class FastPath:
    """The fast paths of one manager's single full-attention group (built by `KVCacheManager`)."""

    __slots__ = ("_manager", "_pool", "_stats", "_hash_block_size", "_max_model_len", "_caching", "_group_suffix")

    def __init__(self, manager: SingleTypeManager, block_pool: BlockPool, stats: PrefixCacheRecorder,
                 hash_block_size: int, max_model_len: int, enable_caching: bool) -> None:
        self._manager = manager
        self._pool = block_pool
        self._stats = stats
        self._hash_block_size = hash_block_size
        self._max_model_len = max_model_len
        self._caching = enable_caching
        self._group_suffix = make_block_hash_with_group_id(b"", manager.kv_cache_group_id)

    @staticmethod
    def qualifies(coordinator, watermark_blocks: int) -> bool:
        """One group of plain full attention (a subclass may skip or align, so it does not qualify),
        with none of vLLM's extras that change a step: EAGLE's dropped block, re-prefilled tokens,
        lookahead hashes, an admission watermark."""
        managers = coordinator.single_type_managers
        return (len(managers) == 1 and type(managers[0]) is FullAttentionManager
                and not coordinator.drop_eagle_group_ids and coordinator.num_reprefillable_tokens == 0
                and coordinator.block_pool.num_hash_lookahead_tokens == 0 and watermark_blocks == 0)

    def admit(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0,
              delay_cache_blocks: bool = False) -> tuple[list[KVCacheBlock] | None, int] | None:
        """A waiting request's first allocation in one call: exactly `hits, n = get_computed_blocks(request)`
        then `allocate_slots(request, min(num_new_tokens, request.num_tokens - n), n, hits,
        num_lookahead_tokens, delay_cache_blocks)`, without the general path's layers.

        Returns:
            (the request's whole table, or None when it does not fit, and its hit tokens), or None when
            this is not the simple case (caching off, a coarser block than the hash block, a request
            holding blocks or computed tokens, bad counts): then nothing changed and the general path
            decides.
        """
        manager = self._manager
        request_id = request.request_id
        if (not self._caching or manager.hash_ratio != 1 or request.block_size != self._hash_block_size
                or request.num_computed_tokens or request_id in manager.req_to_blocks
                or type(num_new_tokens) is not int or num_new_tokens < 1
                or type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0):
            return None
        bs, max_len = manager.block_size, self._max_model_len
        hashes = request.block_hashes
        num_tokens = request.num_tokens
        hits = self._pool.cached_block_hash_to_block.get_cached_prefix(
            hashes, self._group_suffix, min((num_tokens - 1) // bs, len(hashes)))  # never the whole prompt
        num_hits = len(hits)
        num_hit_tokens = num_hits * bs
        self._stats.record(num_tokens, num_hit_tokens, request.num_preemptions > 0)
        num_main = min(num_hit_tokens, max_len) + min(num_new_tokens, num_tokens - num_hit_tokens)
        num_need = min(num_main + num_lookahead_tokens, max_len)
        num_new_blocks = max(-(-num_need // bs) - num_hits, 0)
        num_evictable = [block.ref_cnt for block in hits].count(0)  # hits leave the free queue too
        if num_new_blocks + num_evictable > self._pool.free_block_queue.num_free_blocks:
            return None, num_hit_tokens
        table = manager.adopt_blocks(request_id, hits, num_new_blocks)
        if not delay_cache_blocks:
            manager.cache_blocks(request, num_main if num_main < num_tokens else num_tokens)
        return table, num_hit_tokens

    def allocate_running(self, request: Request, num_computed_tokens: int, token: int | None = None,
                         num_new_tokens: int = 1, num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """One decode step of a running request in one call: appends `token` (None: nothing), sets
        `num_computed_tokens`, then does exactly what `allocate_slots(request, min(num_new_tokens,
        uncomputed), 0, None, num_lookahead_tokens)` would.

        Returns:
            The new blocks (possibly none), or None when this is not the simple case (a request not
            running, a written block shared with another table, not enough free blocks, past
            max_model_len, nothing left to compute, a bad token): then nothing changed and
            `allocate_slots` decides, with its reasons.
        """
        manager = self._manager
        if request.request_id not in manager.num_cached_block:
            return None  # not running (e.g. an admission): the general path, without building rows
        out = PackedRows()
        if not self.allocate_running_batch((request,), (num_computed_tokens,), None if token is None else (token,),
                                           num_new_tokens, num_lookahead_tokens, 0, out):
            return None
        num_new = out.num_new_blocks[0]
        return manager.req_to_blocks[request.request_id][-num_new:] if num_new else []

    def allocate_running_batch(self, requests: Sequence[Request | None], num_computed_tokens: Sequence[int],
                               token_ids: Sequence[int] | None, num_new_tokens: int, num_lookahead_tokens: int,
                               start: int, out: PackedRows) -> int:
        """`allocate_running` over requests[start:] in order, with one token each from `token_ids`
        (None: no tokens), stopping at the first entry it does not take (None entries included).

        Returns:
            The index of that entry (len(requests) when all were taken); `out` got one row per
            entry taken. The caller decides the stopped entry (e.g. with `allocate_slots`), then
            resumes after it, so every entry sees the pool as its predecessors left it.
        """
        if num_new_tokens < 1 or num_lookahead_tokens < 0:
            return start
        manager = self._manager
        req_to_blocks, num_cached = manager.req_to_blocks, manager.num_cached_block
        allocate_new_blocks, cache_blocks = manager.allocate_new_blocks, manager.cache_blocks
        bs, hash_bs, max_len = manager.block_size, self._hash_block_size, self._max_model_len
        free_queue = self._pool.free_block_queue
        caching = self._caching
        counts, ids = out.num_new_blocks, out.new_block_ids
        computed_out, scheduled_out = out.num_computed, out.num_scheduled
        token = None
        for i in range(start, len(requests)):
            req = requests[i]
            if req is None or req.block_size != hash_bs:
                return i
            request_id = req.request_id
            blocks = req_to_blocks.get(request_id)
            num_cached_blocks = num_cached.get(request_id)
            if blocks is None or num_cached_blocks is None:
                return i
            computed = num_computed_tokens[i]
            num_tokens = req.num_tokens
            if token_ids is not None:
                token = token_ids[i]
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
                try:  # the first change: a bad token (or a request added by hashes) changes nothing
                    req.append_token_id(token)
                except ValueError:
                    return i
            req.num_computed_tokens = computed
            if num_new > 0:
                counts.append(num_new)
                for block in allocate_new_blocks(request_id, num_need):
                    ids.append(block.block_id)
            else:
                counts.append(0)
            computed_out.append(computed)
            scheduled_out.append(scheduled)
            if caching:
                num_cacheable = num_main if num_main < num_tokens else num_tokens
                if num_cached_blocks < num_cacheable // bs:
                    cache_blocks(req, num_cacheable)
        return len(requests)

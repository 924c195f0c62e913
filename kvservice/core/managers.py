"""Single-type managers: per KV-cache group policy (block tables, hits, skipped blocks, copy-on-write).

One manager per group; the coordinator above them agrees on one hit length across groups.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.core.block import KVCacheBlock
from kvservice.core.block_pool import BlockPool
from kvservice.core.request import Request
from kvservice.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    effective_block_size,
)
from kvservice.hashing import BlockHash

_NO_INDICES: list[int] = []  # shared empty results (never mutated)
_NO_SWAPS: list[tuple[int, int]] = []


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CoarseBlockHashes(Sequence):
    """A view of fine block hashes at a coarser block size: a coarse block's hash is the last fine
    hash inside it (a chained hash fingerprints its whole prefix)."""

    __slots__ = ("_hashes", "_ratio")

    def __init__(self, hashes: Sequence[BlockHash], ratio: int) -> None:
        self._hashes = hashes
        self._ratio = ratio

    def __len__(self) -> int:
        return len(self._hashes) // self._ratio

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._hashes[(i + 1) * self._ratio - 1]


class CopyOnWrite:
    """Pending copy-on-write copies of one KV-cache manager. Each source block carries one extra
    reference (a pin) until the copies are drained, so its data outlives its last holder."""

    __slots__ = ("pairs", "pins")

    def __init__(self) -> None:
        self.pairs: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self.pins: dict[int, int] = {}

    def add(self, src: KVCacheBlock, dst: KVCacheBlock) -> None:
        self.pairs.append((src, dst))
        self.pins[src.block_id] = self.pins.get(src.block_id, 0) + 1

    def holders(self, block: KVCacheBlock) -> int:
        """References held by request tables (pins not counted)."""
        return block.ref_cnt - self.pins.get(block.block_id, 0)


class SingleTypeManager:
    """Block tables of one KV-cache group. Subclasses define the hit search and skipped tokens."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int, hash_block_size: int,
                 cow: CopyOnWrite, dcp_world_size: int = 1) -> None:
        self.spec = spec
        self.block_pool = block_pool
        self.kv_cache_group_id = group_id
        self.block_size = effective_block_size(spec, dcp_world_size)
        if self.block_size % hash_block_size != 0:
            raise ValueError(f"group {group_id}: block size {self.block_size} is not a multiple of "
                             f"hash_block_size {hash_block_size}")
        self.hash_ratio = self.block_size // hash_block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Requests admitted (running) -> number of leading blocks already in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.cow = cow
        self._null_block = block_pool.null_block

    def hashes_for(self, block_hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        return block_hashes if self.hash_ratio == 1 else CoarseBlockHashes(block_hashes, self.hash_ratio)

    # ---- hit search (overridden) ---------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               group_ids: Sequence[int], alignment: int) -> tuple[list[KVCacheBlock], ...]:
        raise NotImplementedError

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no later token attends to (their blocks can be freed)."""
        return 0

    # ---- allocation ----------------------------------------------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock], total_computed_tokens: int) -> int:
        num_required = cdiv(num_tokens, self.block_size)
        held = self.req_to_blocks.get(request_id, ())
        if request_id in self.num_cached_block:  # running: no new hits
            return max(num_required - len(held), 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(num_required - max(num_skipped_blocks, len(new_computed_blocks) + len(held)), 0)
        # Hits still in the free queue leave it when touched: they consume free blocks too.
        first_kept = max(0, num_skipped_blocks - len(held))
        num_evictable = sum(1 for b in new_computed_blocks[first_kept:] if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable

    def cow_indices(self, request_id: str, total_computed_tokens: int, num_tokens: int) -> list[int]:
        """Indices of held blocks this allocation writes into that another request's table holds."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return _NO_INDICES
        bs = self.block_size
        first = total_computed_tokens // bs
        last = min(len(blocks), -(-num_tokens // bs))
        if first >= last:  # the common decode case at a block boundary: nothing held is written
            return _NO_INDICES
        out = _NO_INDICES
        for i in range(first, last):
            block = blocks[i]
            # ref_cnt > 1 first: the common unshared case never looks at the pins.
            if block.ref_cnt > 1 and not block.is_null and self.cow.holders(block) > 1:
                out = [*out, i]
        return out

    def apply_copy_on_write(self, request_id: str, total_computed_tokens: int,
                            num_tokens: int) -> list[tuple[int, int]]:
        """Swaps a fresh block into this request's table for every shared block it will write; the
        copy (src, dst) is recorded when the shared block already holds computed tokens.

        Returns:
            (index, new block id) for every swapped table entry.
        """
        indices = self.cow_indices(request_id, total_computed_tokens, num_tokens)
        if not indices:
            return _NO_SWAPS
        blocks = self.req_to_blocks[request_id]
        fresh = self.block_pool.get_new_blocks(len(indices))
        for i, dst in zip(indices, fresh, strict=True):
            src = blocks[i]
            blocks[i] = dst
            if i * self.block_size < total_computed_tokens:
                self.cow.add(src, dst)  # the writer's reference becomes the pin
            else:
                self.block_pool.free_blocks([src])
        return [(i, dst.block_id) for i, dst in zip(indices, fresh)]

    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                     num_computed_tokens: int) -> None:
        """Admits a request: touches its hits and pads skipped positions with the null block."""
        if request_id in self.num_cached_block:
            if new_computed_blocks:
                raise ValueError(f"request {request_id!r} is running: it cannot take new prefix-cache hits")
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        self.block_pool.touch((new_computed_blocks,))
        if num_skipped_blocks > 0:
            req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        # Hits (and the nulls padding skipped ones) are already cached.
        self.num_cached_block[request_id] = len(req_blocks)

    def adopt_blocks(self, request_id: str, hits: list[KVCacheBlock], num_new_blocks: int) -> list[KVCacheBlock]:
        """A new request's table in one step when none of its blocks is skipped (the fast path's
        admission): touches `hits` (cached), appends `num_new_blocks` fresh ones; the list becomes the table."""
        self.block_pool.touch((hits,))
        self.num_cached_block[request_id] = len(hits)
        if num_new_blocks:
            hits.extend(self.block_pool.get_new_blocks(num_new_blocks))
        self.req_to_blocks[request_id] = hits
        return hits

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[request.request_id], num_cached, num_full,
                                          self.block_size, self.kv_cache_group_id,
                                          self.hashes_for(request.block_hashes))
        self.num_cached_block[request.request_id] = num_full

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees blocks no later token reads and puts the null block in their place (indices stay
        stable), scanning back from the last skipped block to the first already-null one."""
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped_blocks = min(num_skipped_tokens // self.block_size, len(blocks))
        removed = []
        null = self._null_block
        for i in range(num_skipped_blocks - 1, -1, -1):
            if blocks[i] is null:
                break
            removed.append(blocks[i])
            blocks[i] = null
        self.block_pool.free_blocks(removed)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child's table is a copy of the parent's: every block gains a reference."""
        if parent_id in self.req_to_blocks:
            blocks = list(self.req_to_blocks[parent_id])
            for block in blocks:
                if not block.is_null:
                    block.ref_cnt += 1
            self.req_to_blocks[child_id] = blocks
        if parent_id in self.num_cached_block:
            self.num_cached_block[child_id] = self.num_cached_block[parent_id]

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)


class FullAttentionManager(SingleTypeManager):
    def find_longest_cache_hit(self, block_hashes, max_length, group_ids, alignment):
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in group_ids)
        bs = self.block_size
        hashes = self.hashes_for(block_hashes)
        get_cached = self.block_pool.get_cached_block
        for i in range(min(max_length // bs, len(hashes))):
            cached = get_cached(hashes[i], group_ids)
            if cached is None:
                break
            for out, block in zip(computed, cached):
                out.append(block)
        while bs != alignment and len(computed[0]) * bs % alignment != 0:
            for out in computed:
                out.pop()
        return computed


class SlidingWindowManager(SingleTypeManager):
    def __init__(self, spec: SlidingWindowSpec, *args, **kwargs) -> None:
        super().__init__(spec, *args, **kwargs)
        self.sliding_window = spec.sliding_window
        # A hit needs this many contiguous cached blocks to cover the window before its end.
        self.contiguous_blocks_needed = cdiv(spec.sliding_window - 1, self.block_size)

    def find_longest_cache_hit(self, block_hashes, max_length, group_ids, alignment):
        bs = self.block_size
        hashes = self.hashes_for(block_hashes)
        max_blocks = min(max_length // bs, len(hashes))
        null = self._null_block
        computed = tuple([null] * max_blocks for _ in group_ids)
        get_cached = self.block_pool.get_cached_block
        run = 0
        found = False
        for i in range(max_blocks - 1, -1, -1):  # right to left: stop at the first long-enough run
            cached = get_cached(hashes[i], group_ids)
            if cached is None:
                run = 0
                continue
            if run == 0 and bs != alignment and (i + 1) * bs % alignment != 0:
                continue  # a run must end on the scheduler's alignment
            for out, block in zip(computed, cached):
                out[i] = block
            run += 1
            if run >= self.contiguous_blocks_needed:
                for out in computed:
                    del out[i + run:]
                found = True
                break
        if not found:
            # Only a run starting at block 0 is a hit without covering a full window.
            for out in computed:
                del out[run:]
            while bs != alignment and len(computed[0]) * bs % alignment != 0:
                for out in computed:
                    out.pop()
        return computed

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)


class ChunkedLocalAttentionManager(SingleTypeManager):
    def __init__(self, spec: ChunkedLocalAttentionSpec, *args, **kwargs) -> None:
        super().__init__(spec, *args, **kwargs)
        self.attention_chunk_size = spec.attention_chunk_size

    def find_longest_cache_hit(self, block_hashes, max_length, group_ids, alignment):
        bs = self.block_size
        hashes = self.hashes_for(block_hashes)
        max_blocks = min(max_length // bs, len(hashes))
        # Blocks before the current chunk are never read again: they count as (null) hits.
        chunk_start = max_length // self.attention_chunk_size * self.attention_chunk_size if max_length > 0 else 0
        first = min(chunk_start // bs, max_blocks)
        null = self._null_block
        computed = tuple([null] * first for _ in group_ids)
        get_cached = self.block_pool.get_cached_block
        for i in range(first, max_blocks):
            cached = get_cached(hashes[i], group_ids)
            if cached is None:
                break
            for out, block in zip(computed, cached):
                out.append(block)
        return computed

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size


class MambaManager(SingleTypeManager):
    """State blocks ("align" mode): the state after block i sits in block i; only the last is kept."""

    def find_longest_cache_hit(self, block_hashes, max_length, group_ids, alignment):
        bs = self.block_size
        hashes = self.hashes_for(block_hashes)
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in group_ids)
        get_cached = self.block_pool.get_cached_block
        for i in range(min(max_length // bs, len(hashes)) - 1, -1, -1):
            cached = get_cached(hashes[i], group_ids)
            if cached is None:
                continue
            if bs != alignment and (i + 1) * bs % alignment != 0:
                continue
            for out, block in zip(computed, cached):
                out.extend([self._null_block] * i)
                out.append(block)
            break
        return computed

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)


MANAGER_TYPES: dict[type, type[SingleTypeManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
}

"""vLLM's deferred block frees (`defer_block_free`, on whenever a KV connector may still write a finished
request's blocks), seen by the remote manager.

vLLM's scheduler then frees in two moves: `kv_cache_manager.pop_blocks_for_free(request)` drops the
request's bookkeeping and hands back its blocks, and once the step that writes them is done it returns them
itself with `kv_cache_manager.block_pool.free_blocks(reversed(blocks))`. The second move bypasses the
manager, so the remote manager's `block_pool` is a `RecordingBlockPool`: the replica's own pool with
`free_blocks` watched. The pool hears one FreeOp(popped=True) at the second move, when its blocks really
become free, so its free-block count never runs ahead of the replica's. Its `evict_blocks` is watched too:
the manager's evict_blocks (a KV connector's failed loads) calls it, and so may anyone holding the pool.

vLLM 0.33's copy retentions return the same way: `take_kv_cache_block_copies()` hands the scheduler both
ends of each partial hit's copy, and it frees them with `block_pool.free_blocks` once the step that copies
is processed (deferred like a request's blocks under `defer_block_free`). So do blocks taken straight from
the block pool (`get_new_blocks`) and blocks a KV connector pins through it while it stores them (`touch`:
vLLM's offloading connectors do), both watched too. The pool holds all of these outside requests' tables
(TakeBlockCopiesOp, GetNewBlocksOp, TouchBlocksOp) and returns them at FreeHeldBlocksOp; the remote manager
keeps no ledger of its own: a free of blocks nobody holds is refused by the pool, which the Step's check
raises as PoolDiverged.
"""

from __future__ import annotations


class RecordingBlockPool:
    """The replica's BlockPool, with `free_blocks` calls from outside the manager reported to `on_free`
    before they apply, and `evict_blocks`, `get_new_blocks` and `touch`
    calls to `on_evict`, `on_take` and `on_touch` (the block ids, the blocks, the blocks; after they applied).
    Everything else is the pool's own."""

    def __init__(self, pool, on_free, on_evict, on_take, on_touch) -> None:
        self._pool = pool
        self._on_free = on_free
        self._on_evict = on_evict
        self._on_take = on_take
        self._on_touch = on_touch
        # The hot queries, bound once (no __getattr__ on the scheduler's every step).
        self.get_num_free_blocks = pool.get_num_free_blocks
        self.get_usage = pool.get_usage
        self.take_events = pool.take_events

    def free_blocks(self, ordered_blocks) -> None:
        blocks = list(ordered_blocks)
        self._on_free(blocks)
        self._pool.free_blocks(blocks)

    def evict_blocks(self, block_ids) -> None:
        block_ids = list(block_ids)
        self._pool.evict_blocks(block_ids)
        self._on_evict(block_ids)

    def get_new_blocks(self, num_blocks: int):
        blocks = self._pool.get_new_blocks(num_blocks)  # (raising, it took nothing: nothing to report)
        self._on_take(blocks)
        return blocks

    def touch(self, blocks) -> None:
        blocks = list(blocks)
        self._pool.touch(blocks)
        self._on_touch(blocks)

    def __getattr__(self, name: str):
        return getattr(self._pool, name)


class DeferredFrees:
    """The requests whose blocks were popped and not yet returned: request id -> the popped block ids."""

    def __init__(self) -> None:
        self._popped: dict[str, list[int]] = {}
        self._by_blocks: dict[tuple[int, ...], list[str]] = {}  # (requests sharing cached blocks may hold the same)

    def __len__(self) -> int:
        return len(self._popped)

    def popped(self, request_id: str, blocks) -> None:
        ids = [b.block_id for b in blocks]
        self._popped[request_id] = ids
        self._by_blocks.setdefault(tuple(sorted(ids)), []).append(request_id)

    def returned(self, ids: list[int]) -> str | None:
        """The request whose popped blocks `ids` are, in vLLM's deferred order (tail first), now returned; None
        when no popped request holds them in that order."""
        key = tuple(sorted(ids))
        request_id = next((r for r in self._by_blocks.get(key, ()) if self._popped[r][::-1] == ids), None)
        if request_id is None:
            return None
        del self._popped[request_id]
        holders = self._by_blocks[key]
        holders.remove(request_id)
        if not holders:
            del self._by_blocks[key]
        return request_id

"""Cross-pool prefix transfers: a request admitted on pool B whose prefix is cached only on
pool A gets fresh blocks on B and an order to copy A's blocks into them. A's blocks stay pinned (a
holder table on A) until the engine commits (B's blocks become cached, A's pins drop) or aborts (B's
request is freed); a lease lapse or an epoch change aborts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvservice.allocator.keys import SEP
from kvservice.allocator.pools import Pool
from kvservice.core import FullAttentionSpec, KVCacheBlocks, Request
from kvservice.ops import ExternalSource, TransferOrder


@dataclass(slots=True)
class Transfer:
    transfer_id: str
    session_id: str
    src_pool: str
    holder: str  # the pin table's id on the source pool
    dst_pool: str
    dst_key: str  # the request on the destination pool
    src_block_ids: list[int]
    dst_block_ids: list[int]
    num_tokens: int  # prefix tokens valid on the destination once the copy ran

    def order(self) -> TransferOrder:
        return TransferOrder(self.transfer_id, self.src_pool, list(self.src_block_ids), list(self.dst_block_ids),
                             self.num_tokens)


def transferable(pool: Pool) -> bool:
    """Only single-group full-attention pools that declare a KV layout exchange blocks."""
    groups = pool.spec.config.groups
    return (len(groups) == 1 and type(groups[0]) is FullAttentionSpec and bool(pool.spec.kv_layout)
            and pool.manager.enable_caching)


def same_layout(a: Pool, b: Pool) -> bool:
    return (a.spec.kv_layout == b.spec.kv_layout and a.spec.config.groups == b.spec.config.groups
            and a.spec.dcp_world_size == b.spec.dcp_world_size)


class TransferBook:
    def __init__(self, min_tokens: int = 64) -> None:
        self.min_tokens = max(1, min_tokens)
        self.transfers: dict[str, Transfer] = {}
        self.by_dst: dict[tuple[str, str], str] = {}  # (dst pool, request key) -> transfer id
        self.next_id = 1

    def source(self, pools: dict[str, Pool], dst: Pool, req: Request, own_hit: int) -> tuple[Pool, int] | None:
        """The pool with the longest cached prefix of `req` (ties: the first pool id), if copying it beats
        recomputing: at least `min_tokens` more than the destination's own hit."""
        if not transferable(dst):
            return None
        best: tuple[Pool, int] | None = None
        for pool_id in sorted(pools):  # sorted: replay after recovery picks the same source
            other = pools[pool_id]
            if (other is dst or other.owner_tenant != dst.owner_tenant or other.moving_to or other.suspended
                    or not transferable(other)
                    or not same_layout(other, dst) or other.hash_spec != dst.hash_spec):
                continue
            hit = other.cached_prefix_tokens(req.block_hashes, req.num_tokens)
            if best is None or hit > best[1]:
                best = (other, hit)
        if best is None or best[1] - own_hit < self.min_tokens:
            return None
        return best

    def external(self, dst: Pool, req: Request, own_hit: int, ext: ExternalSource) -> tuple[ExternalSource, int] | None:
        """A prefix pinned on another shard, if it fits this pool and beats recomputing (else None: the
        admission recomputes, and the client unpins)."""
        if not transferable(dst):
            return None
        block_size = dst.block_sizes()[0]
        if (ext.num_tokens % block_size or ext.num_tokens > req.num_tokens - 1
                or len(ext.src_block_ids) != ext.num_tokens // block_size
                or ext.num_tokens - own_hit < self.min_tokens):
            return None
        return ext, ext.num_tokens

    def open_external(self, session_id: str, ext: ExternalSource, dst: Pool, key: str, own_hit: int) -> Transfer:
        """Records the order for a pinned prefix of another shard (the pin is the client's to drop there)."""
        block_size = dst.block_sizes()[0]
        table = dst.manager.coordinator.get_blocks(key)[0]
        first, last = own_hit // block_size, ext.num_tokens // block_size
        return self._add(Transfer(self._next_id(), session_id, ext.src_pool_id, "", dst.pool_id, key,
                                  list(ext.src_block_ids[first:last]), [b.block_id for b in table[first:last]],
                                  ext.num_tokens))

    def _next_id(self) -> str:
        self.next_id += 1
        return f"xfer-{self.next_id - 1}"

    def _add(self, transfer: Transfer) -> Transfer:
        self.transfers[transfer.transfer_id] = transfer
        self.by_dst[(transfer.dst_pool, transfer.dst_key)] = transfer.transfer_id
        return transfer

    def open(self, session_id: str, src: Pool, src_hit: int, dst: Pool, key: str, req: Request,
             own_hit: int) -> Transfer:
        """Pins the source blocks and records the order (the destination was allocated already)."""
        block_size = dst.block_sizes()[0]
        found, hit = src.manager.coordinator.find_longest_cache_hit(req.block_hashes, req.num_tokens - 1)
        if hit < src_hit:
            raise RuntimeError(f"source pool {src.pool_id!r} lost its hit ({hit} < {src_hit} tokens)")
        src_blocks = found[0][own_hit // block_size:src_hit // block_size]
        transfer_id = self._next_id()
        holder = f"{SEP}transfer{SEP}{transfer_id}"
        src.manager.hold(holder, KVCacheBlocks((src_blocks,)))
        table = dst.manager.coordinator.get_blocks(key)[0]
        dst_ids = [b.block_id for b in table[own_hit // block_size:src_hit // block_size]]
        return self._add(Transfer(transfer_id, session_id, src.pool_id, holder, dst.pool_id, key,
                                  [b.block_id for b in src_blocks], dst_ids, src_hit))

    def pending(self, pool_id: str, key: str) -> str | None:
        return self.by_dst.get((pool_id, key))

    def close(self, transfer: Transfer, pools: dict[str, Pool], commit: bool) -> None:
        """Commit: the destination caches the copied prefix. Both: the source pins drop. (Freeing the
        destination request on abort is the caller's, which owns request bookkeeping.)"""
        del self.transfers[transfer.transfer_id]
        self.by_dst.pop((transfer.dst_pool, transfer.dst_key), None)
        src = pools.get(transfer.src_pool) if transfer.holder else None  # no holder: pinned on another shard
        if src is not None and transfer.holder in src.manager.coordinator.managers[0].req_to_blocks:
            src.manager.release(transfer.holder)
        dst = pools.get(transfer.dst_pool)
        if commit and dst is not None and transfer.dst_key in dst.requests:
            dst.manager.cache_blocks(dst.requests[transfer.dst_key], transfer.num_tokens)

    def involving(self, pool_id: str) -> list[Transfer]:
        """Transfers from (pinned here) or into the pool."""
        return [t for t in self.transfers.values() if pool_id == t.dst_pool or (t.holder and pool_id == t.src_pool)]

    def of_session(self, session_id: str) -> list[Transfer]:
        return [t for t in self.transfers.values() if t.session_id == session_id]

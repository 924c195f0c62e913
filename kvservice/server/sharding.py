"""This allocator as one shard of several (`kvservice serve --shard ID --redis-url URL`): it serves the pools
the shard map gives it and redirects calls for the others (`errors.Moved`, which clients follow).

A pool is this shard's when it is in the allocator's state: the state machine itself knows nothing of shards
(the same commands replay the same way). Only a pool it does not hold makes it read the map: a new pool is
assigned to the least-loaded shard (atomically, first registration wins), a pool another shard serves is a
redirect, and an unknown one is NOT_FOUND as on any allocator.
"""

from __future__ import annotations

import logging
import time

from kvservice._proto import allocator_pb2 as pb
from kvservice.commands import DropPool, FreezePool, ImportPool, ThawPool
from kvservice.errors import FailedPrecondition, InvalidArgument, Moved, NotFound, Unavailable
from kvservice.shards.shardmap import ShardMap, ShardMapStore
from kvservice.wire.fields import check_id

Phase = pb.MovePoolRequest.Phase

logger = logging.getLogger(__name__)


class ShardRouter:
    def __init__(self, store: ShardMapStore, shard_id: str) -> None:
        self.store = store
        self.shard_id = shard_id
        self.address = ""
        self.map = ShardMap()
        self._loaded_at = 0.0

    async def announce(self, address: str, epoch: int) -> None:
        """Records this shard's leader address (after it took leadership and bound its port)."""
        self.address = address
        if not await self.store.announce(self.shard_id, address, epoch):
            logger.warning("shard %s: a newer leader is announced in the shard map", self.shard_id)
        await self.refresh(0.0)

    async def refresh(self, max_age_s: float = 1.0) -> ShardMap:
        if time.monotonic() - self._loaded_at >= max_age_s:
            self.map = await self.store.load()
            self._loaded_at = time.monotonic()
        return self.map

    def _moved(self, pool_id: str, owner: str) -> Moved:
        info = self.map.shards.get(owner)
        if info is None:
            raise Unavailable(f"pool {pool_id!r} is assigned to shard {owner!r}, which has no leader yet; retry")
        return Moved(pool_id, owner, info.address)

    async def claim(self, pool_id: str, tenant: str) -> None:
        """For a RegisterPool of a pool this shard does not hold: returns when it is (or becomes) this shard's;
        raises Moved when another shard serves it (or was chosen for it)."""
        current = await self.refresh(0.0)
        owner = current.shard_of(pool_id)
        if owner is None:
            chosen = current.least_loaded() if current.shards else self.shard_id
            owner = await self.store.assign(pool_id, chosen, tenant)
            await self.refresh(0.0)
            logger.info("pool %s assigned to shard %s", pool_id, owner)
        if owner != self.shard_id:
            raise self._moved(pool_id, owner)

    async def redirect(self, pool_id: str) -> None:
        """For a call naming a pool this shard does not hold: raises Moved when another shard serves it."""
        current = await self.refresh(0.5)
        owner = current.shard_of(pool_id)
        if owner is not None and owner != self.shard_id:
            if owner not in current.shards:
                current = await self.refresh(0.0)
            raise self._moved(pool_id, owner)

    # ---- moving a pool (rebalance) -------------------------------------------------------------
    async def move(self, request: pb.MovePoolRequest, allocator, apply) -> pb.MovePoolResponse:
        """One phase of a pool move (`apply`: the servicer's command path: apply, then journal). Every phase
        is idempotent, so `kvservice shards rebalance` may simply run a move again after a crash."""
        from kvservice.store.snapshot import export_pool, import_pool
        pool_id = check_id("pool_id", request.pool_id)
        current = await self.refresh(0.0)
        owner = current.shard_of(pool_id)
        key = self.store.handoff_key(pool_id)
        state = allocator.state
        if request.phase == Phase.FREEZE:
            to = check_id("to_shard", request.to_shard)
            if to not in current.shards or to == self.shard_id:
                raise InvalidArgument("to_shard", to, f"name another shard of {sorted(current.shards)}")
            if pool_id not in state.pools:
                raise NotFound(f"pool {pool_id!r} is not served by shard {self.shard_id!r}")
            await apply(FreezePool(pool_id, to))
            data = export_pool(allocator, pool_id)
            await self.store.redis.set(key, data)
            return pb.MovePoolResponse(num_requests=len(state.pools[pool_id].requests), export_bytes=len(data))
        if request.phase == Phase.IMPORT:
            if owner == self.shard_id and pool_id in state.pools and not state.pools[pool_id].moving_to:
                return pb.MovePoolResponse(num_requests=len(state.pools[pool_id].requests))  # done already
            data = await self.store.redis.get(key)
            if data is None:
                raise FailedPrecondition(f"pool {pool_id!r} has no export waiting: FREEZE it on its shard first")
            await apply(ImportPool(pool_id, data, import_pool))
            if not await self.store.move(pool_id, check_id("from_shard", request.from_shard), self.shard_id) \
                    and (await self.refresh(0.0)).shard_of(pool_id) != self.shard_id:
                raise FailedPrecondition(f"the shard map does not give pool {pool_id!r} to shard "
                                         f"{request.from_shard!r}; nothing was taken over")
            await self.refresh(0.0)
            return pb.MovePoolResponse(num_requests=len(state.pools[pool_id].requests), export_bytes=len(data))
        if request.phase == Phase.DROP:
            if owner == self.shard_id:
                raise FailedPrecondition(f"pool {pool_id!r} is still this shard's in the map: IMPORT it first")
            if pool_id in state.pools:
                await apply(DropPool(pool_id))
            await self.store.redis.delete(key)
            return pb.MovePoolResponse()
        if owner != self.shard_id or pool_id not in state.pools:
            raise FailedPrecondition(f"pool {pool_id!r} is not this shard's any more: its move cannot be undone")
        await apply(ThawPool(pool_id))
        await self.store.redis.delete(key)
        return pb.MovePoolResponse(num_requests=len(state.pools[pool_id].requests))

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

from kvservice.errors import Moved, Unavailable
from kvservice.shards.shardmap import ShardMap, ShardMapStore

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

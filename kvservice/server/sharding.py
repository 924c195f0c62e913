"""This allocator as one shard of several (`kvservice serve --shard ID --redis-url URL`): it serves the pools
the shard map gives it and redirects calls for the others (`errors.Moved`, which clients follow).

A pool is this shard's when it is in the allocator's state: the state machine itself knows nothing of shards
(the same commands replay the same way). Only a pool it does not hold makes it read the map: a new pool is
assigned to the least-loaded shard (atomically, first registration wins), a pool another shard serves is a
redirect, and an unknown one is NOT_FOUND as on any allocator. The redirect is only for whom the pool's tenant
(recorded in the map) lets see it: for any other tenant the call goes on here, and answers as for a pool that
does not exist (never naming its shard or address).

The leader also publishes its pools' live pins beside the map, so that a shard admitting a prefix pinned on
another shard's pool (a cross-shard transfer) checks the pin instead of taking the caller's word for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from redis.exceptions import RedisError

from kvservice import errors
from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator.pins import pin_matches
from kvservice.commands import DropPool, FreezePool, ImportPool, ThawPool
from kvservice.errors import FailedPrecondition, InvalidArgument, Moved, NotFound, Unavailable
from kvservice.ops import ExternalSource
from kvservice.shards.shardmap import TAKEN, ShardMap, ShardMapStore
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
        self.state_of: Callable | None = None  # the allocator's state (set by the servicer)
        self._published: dict[str, tuple | None] = {}  # pool id -> the pins last published; None: failed
        self._publishing = asyncio.Lock()

    async def announce(self, address: str, epoch: int) -> None:
        """Records this shard's leader address (after it took leadership and bound its port)."""
        self.address = address
        if not await self.store.announce(self.shard_id, address, epoch):
            logger.warning("shard %s: a newer leader is announced in the shard map", self.shard_id)
        await self.refresh(0.0)
        await self.publish_pins(force=True)  # what a previous leader published may be behind its journal

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

    async def claim(self, pool_id: str, tenant: str, admin: bool = True) -> None:
        """For a RegisterPool of a pool this shard does not hold: returns when it is (or becomes) this shard's;
        raises Moved when another shard serves the caller's pool (or was chosen for it), PERMISSION_DENIED
        for another tenant's (as one server answers), ALREADY_EXISTS when an external pool holds the id."""
        current = await self.refresh(0.0)
        owner = current.shard_of(pool_id)
        if owner is None:
            chosen = current.least_loaded() if current.shards else self.shard_id
            owner = await self.store.assign(pool_id, chosen, tenant)
            if owner == TAKEN:
                raise errors.pool_id_taken(pool_id)
            current = await self.refresh(0.0)
            logger.info("pool %s assigned to shard %s", pool_id, owner)
        if owner != self.shard_id:
            if not (admin or current.pools.get(pool_id, (owner, tenant))[1] == tenant):
                raise errors.foreign_pool(pool_id)
            raise self._moved(pool_id, owner)

    async def redirect(self, pool_id: str, tenant: str = "", admin: bool = True) -> None:
        """For a call naming a pool this shard does not hold: raises Moved when another shard serves it and
        the caller may see it (its tenant's, or any for an admin); else returns (the call answers NOT_FOUND
        here, as for a pool that does not exist)."""
        current = await self.refresh(0.5)
        entry = current.pools.get(pool_id)
        if entry is not None and entry[0] != self.shard_id and (admin or entry[1] == tenant):
            if entry[0] not in current.shards:
                current = await self.refresh(0.0)
            raise self._moved(pool_id, entry[0])

    # ---- external pools: ids shared with kvservice pools ---------------------------------------
    async def claim_external(self, pool_id: str, tenant: str) -> None:
        """For a RegisterExternalPool: records the id for this shard, or raises ALREADY_EXISTS when a
        kvservice pool (on any shard) or an external pool of another shard holds it."""
        shard, _ = await self.store.assign_external(pool_id, self.shard_id, tenant)
        if shard != self.shard_id:
            raise errors.pool_id_taken(pool_id)

    async def release_external(self, pool_id: str) -> None:
        """The external pool is not (or no longer) here: its id is free again."""
        await self.store.release_external(pool_id, self.shard_id)

    # ---- pins, for other shards' transfer sources ----------------------------------------------
    async def publish_pins(self, pool_ids: Iterable[str] | None = None, force: bool = False) -> None:
        """Publishes the live pins of the pools held here (`pool_ids`; None: all) whose pins changed since
        last published (`force`: all of them). Redis writes them only for a pool the map gives to this shard
        (a copy left here by a move never overwrites its owner's). A Redis error leaves the pool unpublished
        (None): `publish_pending`, every lease sweep, retries it, so a released pin does not stay live."""
        if self.state_of is None:
            return
        pools = self.state_of().pools
        names = list(pools) if pool_ids is None else [p for p in pool_ids if p in pools]
        if not force:
            names = [p for p in names if (pools[p].pins or p in self._published) and
                     self._published.get(p) != pin_signature(pools[p])]
        if not names:
            return
        async with self._publishing:  # serialized, each reading the pins as they are when it writes
            for pool_id in names:
                pool = pools.get(pool_id)
                if pool is None:
                    continue
                signature = pin_signature(pool)
                try:
                    await self.store.publish_pins(pool_id, self.shard_id,
                                                  {k: f"{p.num_tokens} {','.join(map(str, p.block_ids))}"
                                                   for k, p in pool.pins.items()})
                except (RedisError, OSError) as exc:
                    if self._published.get(pool_id, ()) is not None:  # once per outage, not every retry
                        logger.warning("shard %s: could not publish the pins of pool %s (%r); retried every "
                                       "lease sweep until it is", self.shard_id, pool_id, exc)
                    self._published[pool_id] = None
                    continue
                self._published[pool_id] = signature

    async def publish_pending(self) -> None:
        """Retries the pools whose last publication failed (see publish_pins)."""
        pending = [p for p, signature in self._published.items() if signature is None]
        if pending:
            await self.publish_pins(pending, force=True)
            for pool_id in pending:  # a pool gone meanwhile (dropped, retired) has nothing left to publish
                if self.state_of is not None and pool_id not in self.state_of().pools:
                    self._published.pop(pool_id, None)

    async def pin_is_live(self, source: ExternalSource, tenant: str, admin: bool) -> bool:
        """Whether another shard's pool holds a live pin that `source` names for this caller: one that the
        shard the map gives the pool to published."""
        try:
            owner = (await self.refresh(0.5)).shard_of(source.src_pool_id)
            if owner is None or owner == self.shard_id:
                return False
            publisher, pins = await self.store.pins(source.src_pool_id)
        except (RedisError, OSError) as exc:
            raise Unavailable(f"could not read the pins of pool {source.src_pool_id!r} in Redis ({exc!r}); "
                              f"retry") from None
        return publisher == owner and any(pin_matches(key, blocks, tokens, source, tenant, admin)
                                          for key, (tokens, blocks) in pins.items())

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
            source = check_id("from_shard", request.from_shard)
            if owner not in (source, self.shard_id):  # checked before anything is installed here
                raise FailedPrecondition(f"the shard map gives pool {pool_id!r} to shard {owner!r}, not to "
                                         f"from_shard {source!r}; nothing was imported")
            data = await self.store.redis.get(key)
            if data is None:
                raise FailedPrecondition(f"pool {pool_id!r} has no export waiting: FREEZE it on its shard first")
            await apply(ImportPool(pool_id, data, import_pool))
            if not await self.store.move(pool_id, source, self.shard_id, data) \
                    and (await self.refresh(0.0)).shard_of(pool_id) != self.shard_id:
                await apply(DropPool(pool_id))  # the map or the export changed meanwhile: this copy must not serve
                raise FailedPrecondition(f"pool {pool_id!r} was not taken over: the shard map does not give it to "
                                         f"shard {source!r}, or its move was undone (THAW) or exported anew "
                                         f"meanwhile; nothing was imported")
            await self.refresh(0.0)
            await self.publish_pins((pool_id,), force=True)  # the import's own publication preceded the takeover
            return pb.MovePoolResponse(num_requests=len(state.pools[pool_id].requests), export_bytes=len(data))
        if request.phase == Phase.DROP:
            if owner == self.shard_id:
                raise FailedPrecondition(f"pool {pool_id!r} is still this shard's in the map: IMPORT it first")
            # The export first (the map has switched: nothing reads it again), then the pool: killed between the
            # two, the frozen copy is what `Rebalancer.finish()` drops; the other way round the export would
            # stay in Redis with nothing left to delete it.
            await self.store.redis.delete(key)
            if pool_id in state.pools:
                await apply(DropPool(pool_id))
            return pb.MovePoolResponse()
        if owner != self.shard_id or pool_id not in state.pools:
            raise FailedPrecondition(f"pool {pool_id!r} is not this shard's any more: its move cannot be undone")
        await self.store.redis.delete(key)  # first, as in DROP: killed before the thaw, finish() moves it on
        await apply(ThawPool(pool_id))
        return pb.MovePoolResponse(num_requests=len(state.pools[pool_id].requests))


def pin_signature(pool) -> tuple:
    return tuple(sorted((k, p.num_tokens, tuple(p.block_ids)) for k, p in pool.pins.items()))

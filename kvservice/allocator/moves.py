"""Pools moving between shards (rebalance): frozen on the source, imported by the destination from what the
source exported, then dropped from the source. Each step is a command, journaled on its own shard, so a crash
of either side at any point leaves a pool that is served in one place (or frozen, until the move is
completed or thawed) and never lost."""

from __future__ import annotations

import logging

from kvservice.allocator.requests import RequestBook
from kvservice.allocator.state import AllocatorState
from kvservice.commands import DropPool, FreezePool, ImportPool, ThawPool

logger = logging.getLogger(__name__)


class PoolMoves:
    def __init__(self, state: AllocatorState, book: RequestBook) -> None:
        self.state = state
        self.book = book

    def apply(self, command, guard) -> None:
        state = self.state
        kind = type(command)
        if kind is ImportPool:
            current = state.pools.get(command.pool_id)
            guard()
            # The export replaces any copy held here. The servicer never imports a pool this shard already
            # serves (an IMPORT of a finished move answers at once), so a copy here is stale: one frozen when
            # the pool moved away earlier, or an earlier import of this move whose takeover never happened
            # (the destination died before the shard map switched); the source was thawed and served on
            # since, and keeping that copy would lose what it acknowledged meanwhile.
            if current is not None:
                self._forget(current)
            command.importer(state, command.export)
            logger.info("pool %s imported (%d requests)", command.pool_id, len(state.pools[command.pool_id].requests))
            return
        pool = state.pool(command.pool_id)
        guard()
        if kind is FreezePool:
            for transfer in state.transfers.involving(pool.pool_id):
                self.book.abort_transfer(transfer, reason=f"pool {pool.pool_id!r} is moving to another shard")
            state.drain(pool)
            pool.moving_to = command.to_shard
        elif kind is ThawPool:
            pool.moving_to = ""
        elif kind is DropPool:
            self._forget(pool)
            logger.info("pool %s dropped: served by shard %s now", pool.pool_id, pool.moving_to or "?")

    def _forget(self, pool) -> None:
        state = self.state
        for transfer in state.transfers.involving(pool.pool_id):
            self.book.abort_transfer(transfer, reason=f"pool {pool.pool_id!r} is served by another shard")
        state.drain(pool)
        del state.pools[pool.pool_id]
        for session in state.sessions.sessions.values():
            session.requests.pop(pool.pool_id, None)
        state.usage.drop_pool(pool.pool_id)

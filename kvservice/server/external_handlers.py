"""The servicer's external-pool RPCs (kvservice.external): translation only, as the rest of the servicer."""

from __future__ import annotations

from kvservice._proto import allocator_pb2 as pb
from kvservice.commands import RegisterExternalPool, RemoveExternalPool
from kvservice.errors import KVServiceError
from kvservice.external import wire as external_wire
from kvservice.server.rpc import rpc
from kvservice.wire.fields import check_id


class ExternalPoolHandlers:
    """Mixed into AllocatorServicer (whose `_apply`, `allocator`, `auth`, `feeds` and `sharding` it uses)."""

    @rpc
    async def RegisterExternalPool(self, request: pb.RegisterExternalPoolRequest, context) \
            -> pb.RegisterExternalPoolResponse:
        principal = self.auth.of(context)
        command = RegisterExternalPool(principal.tenant, external_wire.spec_from_proto(request.spec), principal.admin)
        reply = await self.register_external(command)
        if self.feeds is not None:
            self.feeds.sync()
        return pb.RegisterExternalPoolResponse(pool_id=reply.pool_id, registration=reply.registration,
                                               new_registration=reply.new_registration)

    @rpc
    async def RemoveExternalPool(self, request: pb.RemoveExternalPoolRequest, context) \
            -> pb.RemoveExternalPoolResponse:
        principal = self.auth.of(context)
        pool_id = check_id("pool_id", request.pool_id)
        await self._apply(RemoveExternalPool(principal.tenant, pool_id, principal.admin))
        if self.sharding is not None:
            await self.sharding.release_external(pool_id)
        if self.feeds is not None:
            self.feeds.sync()
        return pb.RemoveExternalPoolResponse()

    async def register_external(self, command: RegisterExternalPool):
        """Registers an external pool; on a shard its id is first taken in the shard map (refused when a
        kvservice pool anywhere, or another shard's external pool, holds it)."""
        pool_id = command.spec.pool_id
        if self.sharding is None or pool_id in self.allocator.state.pools:
            return await self._apply(command)  # (a kvservice pool here: the registry refuses it)
        await self.sharding.claim_external(pool_id, command.tenant)
        try:
            return await self._apply(command)
        except KVServiceError:
            if pool_id not in self.allocator.state.external:
                await self.sharding.release_external(pool_id)
            raise

    def external_stats(self, tenant: str, admin: bool) -> list:
        out = []
        for pool in self.allocator.external.visible(tenant, admin):
            feed = self.feeds.feed(pool.pool_id) if self.feeds is not None else None
            out.append(external_wire.pool_stats(pool, feed.connected, feed.gaps, feed.replays) if feed is not None
                       else external_wire.pool_stats(pool))
        return out

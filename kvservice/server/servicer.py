"""The Allocator servicer: parse -> command -> `Allocator.apply` -> journal -> encode. No allocator logic.

Every mutation is applied synchronously on the event loop (so calls never interleave inside the state
machine), then handed to the journal (the WAL, when persistence is on) before the reply. Reads go to the
allocator's read methods and come back as result records, encoded by `kvservice.wire.replies`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
from collections.abc import Callable

from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator import Allocator
from kvservice.allocator.pins import RemoteSources, no_such_pin
from kvservice.commands import ExpireSessions, IngestEvents, ResetPrefixCache, StepRpc
from kvservice.errors import FailedPrecondition, InvalidArgument, KVServiceError, NotFound, Unavailable
from kvservice.external import wire as external_wire
from kvservice.hashing import HASH_BYTES
from kvservice.server.auth import Authenticator
from kvservice.server.external_handlers import ExternalPoolHandlers
from kvservice.server.metrics import Metrics
from kvservice.server.rpc import SERVICE, abort, method_handlers, parse, rpc
from kvservice.store.base import Journal, NullJournal
from kvservice.wire import decode, replies
from kvservice.wire.fields import check_id, check_name, decode_hashes, decode_u32
from kvservice.wire.status import grpc_code

logger = logging.getLogger(__name__)
__all__ = ["SERVICE", "AllocatorServicer", "freeze_long_lived", "method_handlers", "parse"]


def freeze_long_lived() -> None:
    """Moves what exists now (pools' blocks above all) out of the cyclic GC's reach: they live as long
    as their pool, and full collections over a million blocks would stall steps by 100 ms and more.
    A retired pool unlinks its blocks, so reference counting still frees them."""
    gc.collect()
    gc.freeze()


class AllocatorServicer(ExternalPoolHandlers):
    def __init__(self, allocator: Allocator, auth: Authenticator, metrics: Metrics, journal: Journal | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.allocator = allocator
        self.auth = auth
        self.metrics = metrics
        self.journal = journal or NullJournal()
        self.clock = clock
        self._event_signal = asyncio.Event()
        allocator.state.events.listeners.append(self._event_signal.set)
        self.num_watchers = 0
        self.feeds = None  # kvservice.external.feeds.Feeds, once the server runs them
        self._sharding = None  # a ShardRouter when this allocator is one shard of several
        self.standby = ""  # a hot standby's refusal message (it serves nothing until it takes over)

    @property
    def sharding(self):
        return self._sharding

    @sharding.setter
    def sharding(self, router) -> None:
        self._sharding = router
        if router is not None:
            router.state_of = lambda: self.allocator.state

    async def _here(self, pool_id: str, principal) -> None:
        """Redirects (raises Moved) a call naming a pool another shard serves, if the caller may see it."""
        if self.sharding is not None and pool_id not in self.allocator.state.pools:
            await self.sharding.redirect(pool_id, principal.tenant, principal.admin)

    def _retried_here(self, command) -> bool:
        """Whether `command` resends its session's last mutation applied here (its reply was lost): then the
        stored reply answers it, even if its pool has moved to another shard since. Redirected, it would be
        applied again there (a move carries the pool, not the session's replies; the client numbers each
        shard's calls apart)."""
        session = self.allocator.state.sessions.sessions.get(command.session_id)
        return session is not None and session.last_reply is not None and command.sequence == session.last_sequence

    async def _apply(self, command):
        """The one path of a mutation: apply (guarded by the journal's writability), then journal."""
        applied = self.allocator.apply(command, self.clock(), self.journal.check_writable)
        if applied.mutated:
            await self.journal.record(command)
            if self.sharding is not None and type(command) is not IngestEvents:
                pool_id = getattr(command, "pool_id", None)  # a command of one pool changes only its pins
                await self.sharding.publish_pins(None if pool_id is None else (pool_id,))
        return applied.reply

    # ---- sessions ------------------------------------------------------------------------------
    @rpc
    async def OpenSession(self, request: pb.OpenSessionRequest, context) -> pb.OpenSessionResponse:
        principal = self.auth.of(context)
        command = decode.open_session_command(request, uuid.uuid4().hex, principal.tenant, principal.admin)
        return replies.encode_session_opened(await self._apply(command))

    @rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        principal = self.auth.of(context)
        self.allocator.renew(check_id("session_id", request.session_id), principal.tenant, self.clock())
        return pb.HeartbeatResponse(ttl_ms=int(self.allocator.settings.session_ttl_s * 1000))

    # ---- mutations -----------------------------------------------------------------------------
    @rpc
    async def RegisterPool(self, request: pb.RegisterPoolRequest, context, raw: bytes) -> pb.RegisterPoolResponse:
        principal = self.auth.of(context)
        command = decode.register_command(request, raw, principal.tenant, principal.admin,
                                          self.allocator.settings.hash_block_size)
        if self.sharding is not None and command.spec.pool_id not in self.allocator.state.pools:
            await self.sharding.claim(command.spec.pool_id, principal.tenant, principal.admin)
        reply = await self._apply(command)
        if reply.new_epoch:
            freeze_long_lived()
        return replies.encode_register_result(reply)

    async def _step(self, context, request, raw: bytes, rpc_kind: StepRpc) -> pb.StepResponse:
        principal = self.auth.of(context)
        command = decode.step_command(rpc_kind, request, raw, principal.tenant, principal.admin)
        if not self._retried_here(command):  # a retry is answered as it was the first time
            await self._here(command.pool_id, principal)
        try:
            result = await self._apply(command)
        except RemoteSources as remote:  # pins on other shards' pools: checked there, then applied as checked
            for source in remote.sources:
                if self.sharding is None or not await self.sharding.pin_is_live(source, principal.tenant,
                                                                                principal.admin):
                    raise NotFound(no_such_pin(source)) from None
            command.remote_sources_checked = True
            result = await self._apply(command)
        self.metrics.count_outcomes(result.results)
        return replies.encode_step_result(result, pb.StepResponse())

    @rpc
    async def Step(self, request: pb.StepRequest, context, raw: bytes) -> pb.StepResponse:
        return await self._step(context, request, raw, StepRpc.STEP)

    @rpc
    async def Allocate(self, request: pb.AllocateRequest, context, raw: bytes) -> pb.StepResponse:
        return await self._step(context, request, raw, StepRpc.ALLOCATE)

    @rpc
    async def Free(self, request: pb.FreeRequest, context, raw: bytes) -> pb.StepResponse:
        return await self._step(context, request, raw, StepRpc.FREE)

    @rpc
    async def Fork(self, request: pb.ForkRequest, context, raw: bytes) -> pb.StepResponse:
        return await self._step(context, request, raw, StepRpc.FORK)

    @rpc
    async def CommitTransfer(self, request: pb.CommitTransferRequest, context, raw: bytes) -> pb.StepResponse:
        principal = self.auth.of(context)
        command = decode.commit_transfer_command(request, raw, principal.tenant, principal.admin)
        if not self._retried_here(command):
            await self._here(command.pool_id, principal)
        return replies.encode_step_result(await self._apply(command), pb.StepResponse())

    @rpc
    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest, context) -> pb.ResetPrefixCacheResponse:
        self.auth.require_admin(context)
        pool_ids = [check_id(f"pool_ids[{i}]", p) for i, p in enumerate(request.pool_ids)]
        reply = await self._apply(ResetPrefixCache(pool_ids))
        return pb.ResetPrefixCacheResponse(reset_pool_ids=reply.reset_pool_ids, refused_pool_ids=reply.refused_pool_ids)

    async def expire_leases(self, now: float) -> list[str]:
        """Frees the requests of every session whose lease lapsed by `now` (the server's sweep)."""
        expired = self.allocator.expired_sessions(now)
        if not expired:
            return []
        return await self._apply(ExpireSessions(expired))

    # ---- reads ---------------------------------------------------------------------------------
    @rpc
    async def GetRequest(self, request: pb.GetRequestRequest, context) -> pb.RequestInfo:
        principal = self.auth.of(context)
        await self._here(check_id("pool_id", request.pool_id), principal)
        info = self.allocator.request_info(principal.tenant, check_id("pool_id", request.pool_id),
                                           check_id("request_id", request.request_id), principal.admin)
        return replies.encode_request_info(info)

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        principal = self.auth.of(context)
        pool_ids = [check_id(f"pool_ids[{i}]", p) for i, p in enumerate(request.pool_ids)]
        for pool_id in pool_ids:
            await self._here(pool_id, principal)
        if request.block_hashes:
            if request.token_ids:
                raise InvalidArgument("token_ids", f"<{len(request.token_ids)} bytes>",
                                      "send token_ids or block_hashes, not both")
            result = self.allocator.lookup(principal.tenant,
                                           block_hashes=decode_hashes("block_hashes", request.block_hashes,
                                                                      request.hash_bytes or HASH_BYTES),
                                           num_tokens=request.num_tokens, pool_ids=pool_ids, admin=principal.admin)
        else:
            result = self.allocator.lookup(principal.tenant, token_ids=decode_u32("token_ids", request.token_ids),
                                           cache_salt=check_name("cache_salt", request.cache_salt),
                                           lora_name=check_name("lora_name", request.lora_name), pool_ids=pool_ids,
                                           admin=principal.admin)
        return replies.encode_lookup(result)

    @rpc
    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        principal = self.auth.of(context)
        if request.check_invariants or request.include_state_digest:
            self.auth.require_admin(context)  # walks every block, holding up every Step meanwhile
        a = self.allocator
        state = a.state
        sessions = state.sessions.sessions.values()
        num_sessions = len(sessions) if principal.admin else sum(1 for s in sessions if s.tenant == principal.tenant)
        out = pb.GetStatsResponse(num_sessions=num_sessions, persistence=self.journal.state.value,
                                  event_sequence=state.events.next_sequence - 1, lease_expiries=state.lease_expiries,
                                  hash_fingerprint=a.fingerprint, hash_block_size=a.settings.hash_block_size)
        if request.include_state_digest:
            from kvservice.store.snapshot import state_digest
            out.state_digest = state_digest(a)
        js = self.journal.stats
        out.wal_entries_written, out.wal_bytes_written = js.entries, js.bytes
        out.snapshots_written, out.last_snapshot_bytes, out.wal_lag = js.snapshots, js.last_snapshot_bytes, js.wal_lag
        out.leader_epoch = self.journal.leader_epoch
        for stats in a.pool_stats(principal.tenant, principal.admin, request.check_invariants, request.pool_ids):
            replies.encode_pool_stats(stats, out.pools.add())
        wanted = set(request.pool_ids)
        for stats in self.external_stats(principal.tenant, principal.admin):
            if not wanted or stats.pool_id in wanted:
                external_wire.encode_stats(stats, out.external_pools.add())
        return out

    @rpc
    async def GetShardMap(self, request: pb.GetShardMapRequest, context) -> pb.ShardMapResponse:
        principal = self.auth.of(context)
        if self.sharding is None:  # one unnamed shard: this one
            pools = self.allocator.state.visible_pools(principal.tenant, principal.admin)
            return pb.ShardMapResponse(pools={p.pool_id: "" for p in pools}, sharded=False)
        # Read anew: a map up to half a second old named a pool's shard before its move had taken over (or after),
        # and a `kvservice shards move` run again after a crash acted on it (a DROP on the pool's new shard).
        current = await self.sharding.refresh(0.0)
        counts = current.pool_counts()
        out = pb.ShardMapResponse(version=current.version, shard_id=self.sharding.shard_id, sharded=True)
        for info in sorted(current.shards.values(), key=lambda i: i.shard_id):
            out.shards.add(shard_id=info.shard_id, address=info.address, epoch=info.epoch,
                           num_pools=counts[info.shard_id])
        for pool_id, (shard, tenant) in current.pools.items():
            if principal.admin or tenant == principal.tenant:
                out.pools[pool_id] = shard
        return out

    @rpc
    async def MovePool(self, request: pb.MovePoolRequest, context) -> pb.MovePoolResponse:
        self.auth.require_admin(context)
        if self.sharding is None:
            raise FailedPrecondition("MovePool is for sharded allocators (kvservice serve --shard)")
        return await self.sharding.move(request, self.allocator, self._apply)

    # ---- events --------------------------------------------------------------------------------
    async def WatchEvents(self, raw: bytes, context):
        try:
            if self.standby:
                raise Unavailable(self.standby)
            request = parse("WatchEvents", raw)
            principal = self.auth.of(context)
            pool_ids = {check_id(f"pool_ids[{i}]", p) for i, p in enumerate(request.pool_ids)}
            state = self.allocator.state
            for pool_id in pool_ids:
                await self._here(pool_id, principal)
                state.pool(pool_id, principal.tenant, principal.admin)  # NOT_FOUND for another tenant's
            log = state.events
            if request.include_state and request.HasField("start_sequence"):
                raise InvalidArgument("start_sequence", request.start_sequence, "include_state starts from the state "
                                      "as it is now: leave start_sequence unset")
            cursor = request.start_sequence if request.HasField("start_sequence") else log.next_sequence
            log.since(cursor)  # OUT_OF_RANGE now rather than after the first wait
            # The dump and the cursor are taken with nothing in between: the stream misses no change.
            dump = self._state_dump(state, pool_ids, principal, cursor - 1) if request.include_state else []
        except KVServiceError as exc:
            self.metrics.rejected.labels("WatchEvents", exc.code.name).inc()
            await abort(context, exc)
            return
        tenant, admin = principal.tenant, principal.admin
        self.num_watchers += 1
        try:
            for message in dump:
                yield message
            async for message in self._watch(state, log, cursor, pool_ids, tenant, admin, context):
                yield message
        finally:
            self.num_watchers -= 1

    @staticmethod
    def _state_dump(state, pool_ids: set[str], principal, sequence: int) -> list:
        """WatchEvents include_state: the watched pools' cached blocks as events, then `synced`."""
        pools = [state.pools[p] for p in sorted(pool_ids) if p in state.pools] if pool_ids else \
            state.visible_pools(principal.tenant, principal.admin)
        out = [m for pool in pools
               for m in replies.encode_state(pool.pool_id, sequence, pool.cached_hashes(), pool.hash_bytes)]
        out.append(pb.KVEvent(sequence=sequence, synced=pb.StateSyncedEvent()))
        return out

    async def _watch(self, state, log, cursor: int, pool_ids: set[str], tenant: str, admin: bool, context):
        while True:
            self._event_signal.clear()
            try:
                batch = list(log.since(cursor))
            except KVServiceError as exc:  # the watcher fell behind the retained window
                await context.abort(grpc_code(exc.code), exc.message)
                return
            for item in batch:
                cursor = item.sequence + 1
                if pool_ids and item.pool_id not in pool_ids:
                    continue
                pool = state.pools.get(item.pool_id)
                if not admin and (pool is None or pool.owner_tenant != tenant):
                    continue  # another tenant's pool: not even its existence is shown
                owner = item.tenant
                if owner is not None and owner != tenant:
                    continue
                yield replies.encode_event(item)
            if not batch:
                await self._event_signal.wait()

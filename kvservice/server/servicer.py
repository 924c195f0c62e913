"""The Allocator servicer: protobuf ⇄ domain translation only; all logic lives in `kvservice.allocator`.

Every mutation is applied synchronously on the event loop (so calls never interleave inside the
state machine), then handed to the journal (the WAL, when persistence is on) before the reply.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import logging
import time
import uuid
from collections.abc import Callable

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator import Allocator, RegisterResult
from kvservice.core import AllBlocksCleared, BlockRemoved, BlockStored
from kvservice.errors import InvalidArgument, KVServiceError
from kvservice.eventlog import LoggedEvent
from kvservice.ops import StepResult
from kvservice.pools import raw_hash
from kvservice.server.auth import Authenticator
from kvservice.server.metrics import Metrics
from kvservice.wire import (
    check_id,
    check_name,
    decode_hashes,
    decode_pool_spec,
    decode_tokens,
    encode_step_result,
    encode_tokens,
    ops_from_request,
)

logger = logging.getLogger(__name__)


class NullJournal:
    """Persistence off: mutations are acknowledged from memory."""

    state = "off"

    async def record(self, kind: str, **fields) -> None:
        return None

    def check_writable(self) -> None:
        return None


SERVICE = pb.DESCRIPTOR.services_by_name["Allocator"]
_REQUEST_TYPES = {m.name: m.input_type._concrete_class for m in SERVICE.methods}


def parse(name: str, raw: bytes):
    """Requests arrive as bytes (kept for the WAL) and are parsed here, so that undecodable input is an
    INVALID_ARGUMENT rather than gRPC's generic UNKNOWN."""
    cls = _REQUEST_TYPES[name]
    try:
        return cls.FromString(raw)
    except Exception:
        raise InvalidArgument("request", f"<{len(raw)} bytes>", f"not a valid {cls.DESCRIPTOR.full_name} message") \
            from None


def freeze_long_lived() -> None:
    """Moves what exists now (pools' blocks above all) out of the cyclic GC's reach: they live as long
    as their pool, and full collections over a million blocks would stall steps by 100 ms and more.
    A retired pool unlinks its blocks, so reference counting still frees them."""
    gc.collect()
    gc.freeze()


def rpc(method: Callable) -> Callable:
    """Parses the request, maps domain errors to gRPC statuses, times the call, and never lets a bug
    crash the server. A method with a `raw` parameter also gets the request's bytes (what the WAL keeps)."""
    name = method.__name__
    takes_raw = "raw" in inspect.signature(method).parameters

    @functools.wraps(method)
    async def wrapper(self: AllocatorServicer, raw: bytes, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        try:
            if takes_raw:
                return await method(self, parse(name, raw), context, raw)
            return await method(self, parse(name, raw), context)
        except KVServiceError as exc:
            self.metrics.rejected.labels(name, exc.code.name).inc()
            await context.abort(exc.code, exc.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            logger.exception("%s failed", name)
            self.metrics.rejected.labels(name, "INTERNAL").inc()
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the server log")
        finally:
            self.metrics.observe(name, time.perf_counter() - start)

    return wrapper


class AllocatorServicer:
    def __init__(self, allocator: Allocator, auth: Authenticator, metrics: Metrics, journal=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.allocator = allocator
        self.auth = auth
        self.metrics = metrics
        self.journal = journal or NullJournal()
        self.clock = clock
        self._event_signal = asyncio.Event()
        allocator.events.listeners.append(self._event_signal.set)

    def _session(self, context, session_id: str):
        principal = self.auth.of(context)
        check_id("session_id", session_id)
        return self.allocator.sessions.get(session_id, principal.tenant, self.clock())

    @staticmethod
    def _check_sequence(sequence: int) -> None:
        if sequence == 0:
            raise InvalidArgument("sequence", 0, "sequences start at 1 (OpenSession returns next_sequence)")

    # ---- sessions ------------------------------------------------------------------------------
    @rpc
    async def OpenSession(self, request: pb.OpenSessionRequest, context) -> pb.OpenSessionResponse:
        principal = self.auth.of(context)
        name = check_name("client_name", request.client_name) or ""
        pool_ids = [check_id(f"resume_pool_ids[{i}]", p) for i, p in enumerate(request.resume_pool_ids)]
        sessions = self.allocator.sessions
        failed: list[str] = []
        session = None
        if request.resume_session_id:
            known = sessions.sessions.get(check_id("resume_session_id", request.resume_session_id))
            if known is not None:
                session = sessions.get(known.session_id, principal.tenant, self.clock())
            if request.last_acked_sequence > (session.last_sequence if session is not None else 0):
                # The recovered state is behind what this client saw acknowledged (DESIGN §6): its pools'
                # blocks may have been handed out since, so they start a new epoch.
                used = set(pool_ids) | (set(session.requests) if session is not None else set())
                pools = self.allocator.pools
                # Only the caller's own pools (an admin: any): a stale resume must not wipe anyone else's.
                failed = sorted(p for p in used if p in pools
                                and (principal.admin or pools[p].owner_tenant == principal.tenant))
                self.journal.check_writable()
                for pool_id in failed:
                    self.allocator.bump_epoch(pool_id)
                await self.journal.record("stale_resume", session_id=request.resume_session_id, pool_ids=failed)
                logger.warning("session %s resumed at sequence %d, ahead of the recovered %d: new epochs for %s",
                               request.resume_session_id, request.last_acked_sequence,
                               session.last_sequence if session is not None else 0, failed)
        if session is None:
            self.journal.check_writable()
            session = self.allocator.open_session(uuid.uuid4().hex, principal.tenant, name, self.clock())
            await self.journal.record("open_session", session_id=session.session_id, tenant=principal.tenant,
                                      client_name=name)
        return pb.OpenSessionResponse(session_id=session.session_id, ttl_ms=int(sessions.ttl_s * 1000),
                                      next_sequence=session.last_sequence + 1, tenant=session.tenant,
                                      pools_failed=failed)

    @rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        self._session(context, request.session_id)
        return pb.HeartbeatResponse(ttl_ms=int(self.allocator.sessions.ttl_s * 1000))

    # ---- pools ---------------------------------------------------------------------------------
    @rpc
    async def RegisterPool(self, request: pb.RegisterPoolRequest, context, raw: bytes) -> pb.RegisterPoolResponse:
        session = self._session(context, request.session_id)
        self._check_sequence(request.sequence)
        stored = self.allocator.sessions.check_sequence(session, request.sequence)
        if stored is None:
            spec = decode_pool_spec(request, self.allocator.hash_block_size)
            self.journal.check_writable()
            stored = self.allocator.register_pool(session, request.sequence, spec, request.hash_fingerprint,
                                                  admin=self.auth.of(context).admin)
            await self.journal.record("register_pool", session_id=session.session_id, request=raw)
            if stored.new_epoch:
                freeze_long_lived()
        if not isinstance(stored, RegisterResult):
            raise InvalidArgument("sequence", request.sequence, "this sequence was applied by another RPC kind")
        r = stored
        return pb.RegisterPoolResponse(pool_id=r.pool_id, epoch=r.epoch, new_epoch=r.new_epoch,
                                       hash_block_size=r.hash_block_size, hash_seed=r.hash_seed,
                                       num_requests_failed=r.num_requests_failed,
                                       scheduler_block_size=r.scheduler_block_size)

    # ---- steps ---------------------------------------------------------------------------------
    async def _apply(self, context, request, raw: bytes, kind: str) -> pb.StepResponse:
        session = self._session(context, request.session_id)
        self._check_sequence(request.sequence)
        stored = self.allocator.sessions.check_sequence(session, request.sequence)
        if stored is None:
            pool = self.allocator.pool(check_id("pool_id", request.pool_id))
            ops = ops_from_request(kind, request, pool.spec, self.allocator.hash_block_size)
            self.journal.check_writable()
            stored = self.allocator.step(session, request.sequence, pool, ops)
            await self.journal.record(kind, session_id=session.session_id, request=raw)
            self.metrics.count_outcomes(stored.results)
        if not isinstance(stored, StepResult):
            raise InvalidArgument("sequence", request.sequence, "this sequence was applied by another RPC kind")
        return encode_step_result(stored, pb.StepResponse())

    @rpc
    async def Step(self, request: pb.StepRequest, context, raw: bytes) -> pb.StepResponse:
        return await self._apply(context, request, raw, "step")

    @rpc
    async def Allocate(self, request: pb.AllocateRequest, context, raw: bytes) -> pb.StepResponse:
        return await self._apply(context, request, raw, "allocate")

    @rpc
    async def Free(self, request: pb.FreeRequest, context, raw: bytes) -> pb.StepResponse:
        return await self._apply(context, request, raw, "free")

    @rpc
    async def Fork(self, request: pb.ForkRequest, context, raw: bytes) -> pb.StepResponse:
        return await self._apply(context, request, raw, "fork")

    @rpc
    async def CommitTransfer(self, request: pb.CommitTransferRequest, context, raw: bytes) -> pb.StepResponse:
        session = self._session(context, request.session_id)
        self._check_sequence(request.sequence)
        stored = self.allocator.sessions.check_sequence(session, request.sequence)
        if stored is None:
            pool = self.allocator.pool(check_id("pool_id", request.pool_id))
            transfer_id = check_id("transfer_id", request.transfer_id)
            self.journal.check_writable()
            stored = self.allocator.commit_transfer(session, request.sequence, pool, transfer_id, request.abort)
            await self.journal.record("commit_transfer", session_id=session.session_id, request=raw)
        if not isinstance(stored, StepResult):
            raise InvalidArgument("sequence", request.sequence, "this sequence was applied by another RPC kind")
        return encode_step_result(stored, pb.StepResponse())

    # ---- reads ---------------------------------------------------------------------------------
    @rpc
    async def GetRequest(self, request: pb.GetRequestRequest, context) -> pb.RequestInfo:
        principal = self.auth.of(context)
        pool, req = self.allocator.get_request(principal.tenant, check_id("pool_id", request.pool_id),
                                               check_id("request_id", request.request_id))
        info = pb.RequestInfo(request_id=request.request_id, pool_id=pool.pool_id, num_tokens=req.num_tokens,
                              num_computed_tokens=req.num_computed_tokens, num_block_hashes=len(req.block_hashes),
                              running=pool.manager.coordinator.is_running(req.request_id),
                              session_id=pool.owner.get(req.request_id, ""))
        for ids in pool.manager.get_block_ids(req.request_id):
            info.blocks.add(block_ids=ids)
        return info

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        principal = self.auth.of(context)
        pool_ids = [check_id(f"pool_ids[{i}]", p) for i, p in enumerate(request.pool_ids)]
        if request.block_hashes:
            if request.token_ids:
                raise InvalidArgument("token_ids", f"<{len(request.token_ids)} bytes>",
                                      "send token_ids or block_hashes, not both")
            hits, best = self.allocator.lookup(principal.tenant, block_hashes=decode_hashes("block_hashes",
                                                                                               request.block_hashes),
                                               num_tokens=request.num_tokens, pool_ids=pool_ids)
        else:
            tokens = decode_tokens("token_ids", request.token_ids)
            hits, best = self.allocator.lookup(principal.tenant, token_ids=tokens,
                                               cache_salt=check_name("cache_salt", request.cache_salt),
                                               lora_name=check_name("lora_name", request.lora_name), pool_ids=pool_ids)
        return pb.LookupResponse(hits=[pb.PoolHit(pool_id=h.pool_id, num_cached_tokens=h.num_cached_tokens,
                                                  num_free_blocks=h.num_free_blocks) for h in hits],
                                 best_pool_id=best)

    @rpc
    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        self.auth.of(context)
        a = self.allocator
        out = pb.GetStatsResponse(num_sessions=len(a.sessions.sessions), persistence=self.journal.state,
                                  event_sequence=a.events.next_sequence - 1, lease_expiries=a.lease_expiries,
                                  hash_fingerprint=a.fingerprint, hash_block_size=a.hash_block_size)
        if request.include_state_digest:
            from kvservice.store.snapshot import state_digest
            out.state_digest = state_digest(a)
        js = getattr(self.journal, "stats", None)
        if js:
            out.wal_entries_written, out.wal_bytes_written = js["entries"], js["bytes"]
            out.snapshots_written, out.last_snapshot_bytes, out.wal_lag = (js["snapshots"], js["last_snapshot_bytes"],
                                                                           js["wal_lag"])
            out.leader_epoch = self.journal.store.epoch
        for pool in a.pools.values():
            m = pool.manager
            bp = m.block_pool
            out.pools.add(pool_id=pool.pool_id, epoch=pool.epoch, num_blocks=bp.num_blocks,
                          num_free_blocks=bp.get_num_free_blocks(), usage=bp.get_usage(),
                          num_requests=len(pool.requests), prefix_hit_rate=m.prefix_cache_totals.hit_rate,
                          prefix_queries=m.prefix_cache_totals.queries, prefix_hits=m.prefix_cache_totals.hits,
                          evictions=bp.num_evictions, num_cached_blocks=len(bp.cached_block_hash_to_block),
                          num_pending_transfers=sum(1 for t in a.transfers.transfers.values()
                                                    if pool.pool_id in (t.src_pool, t.dst_pool)),
                          invariant_violation=a.invariant_violation(pool) if request.check_invariants else "")
        return out

    @rpc
    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest, context) -> pb.ResetPrefixCacheResponse:
        self.auth.require_admin(context)
        pool_ids = [check_id(f"pool_ids[{i}]", p) for i, p in enumerate(request.pool_ids)]
        self.journal.check_writable()
        done, refused = self.allocator.reset_prefix_cache(pool_ids)
        await self.journal.record("reset", pool_ids=pool_ids)
        return pb.ResetPrefixCacheResponse(reset_pool_ids=done, refused_pool_ids=refused)

    # ---- events --------------------------------------------------------------------------------
    async def WatchEvents(self, raw: bytes, context):
        try:
            request = parse("WatchEvents", raw)
            principal = self.auth.of(context)
            pool_ids = {check_id(f"pool_ids[{i}]", p) for i, p in enumerate(request.pool_ids)}
            log = self.allocator.events
            cursor = request.start_sequence if request.HasField("start_sequence") else log.next_sequence
            log.since(cursor)  # OUT_OF_RANGE now rather than after the first wait
        except KVServiceError as exc:
            self.metrics.rejected.labels("WatchEvents", exc.code.name).inc()
            await context.abort(exc.code, exc.message)
            return
        tenant = principal.tenant
        while True:
            self._event_signal.clear()
            try:
                batch = list(log.since(cursor))
            except KVServiceError as exc:  # the watcher fell behind the retained window
                await context.abort(exc.code, exc.message)
                return
            for item in batch:
                cursor = item.sequence + 1
                if pool_ids and item.pool_id not in pool_ids:
                    continue
                owner = item.tenant
                if owner is not None and owner != tenant:
                    continue
                yield encode_event(item)
            if not batch:
                await self._event_signal.wait()


def method_handlers(servicer: AllocatorServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, taking raw request bytes (see `parse`)."""
    handlers = {}
    for method in SERVICE.methods:
        impl = getattr(servicer, method.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(impl, request_deserializer=None,
                                     response_serializer=method.output_type._concrete_class.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


def encode_event(item: LoggedEvent) -> pb.KVEvent:
    """A logged core event in the caller's own (tenant-free) hashes."""
    msg = pb.KVEvent(sequence=item.sequence, pool_id=item.pool_id)
    ev = item.event
    if isinstance(ev, BlockStored):
        msg.stored.block_hashes.extend(raw_hash(h) for h in ev.block_hashes)
        if ev.parent_block_hash is not None:
            msg.stored.parent_block_hash = raw_hash(ev.parent_block_hash)
        if ev.token_ids:
            msg.stored.token_ids = encode_tokens(ev.token_ids)
        msg.stored.block_size = ev.block_size
        msg.stored.group_idx = ev.group_idx
        msg.stored.lora_name = ev.lora_name or ""
        msg.stored.block_ids.extend(ev.block_ids)
    elif isinstance(ev, BlockRemoved):
        msg.removed.block_hashes.extend(raw_hash(h) for h in ev.block_hashes)
        msg.removed.group_idx = ev.group_idx
    elif isinstance(ev, AllBlocksCleared):
        msg.cleared.SetInParent()
    return msg


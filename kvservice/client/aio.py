"""The asyncio client: the same API as the blocking one, with `await`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice.client.base import (
    FAILOVER_POLL_S,
    FAILOVER_RETRY_S,
    MAX_HOPS,
    RETRYABLE,
    Call,
    ClientBase,
)
from kvservice.client.routing import Conn, ConnectionReplaced, make_stub, replaced_under
from kvservice.errors import DeadlineExceeded, KVServiceError, Moved, NotFound, Unavailable
from kvservice.results import Event
from kvservice.wire import replies
from kvservice.wire.status import from_rpc_error


class AsyncKVServiceClient(ClientBase):
    """asyncio client; same API as KVServiceClient with `await`. Mutations are serialized (one sequence
    at a time per session)."""

    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None, *, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, **options) -> None:
        """Connects to `target`: an allocator's host:port, any shard of a sharded one, or several comma-separated
        addresses (an allocator and its standbys).

        Args:
            token: the bearer token, a line of the server's --token-file (None: the server has no auth).
            tls_ca: the CA (PEM file) that signed the server's certificate: turns TLS on (the server runs with
                --tls-cert/--tls-key).
            tls_cert, tls_key: this client's certificate and private key (PEM files), for a server that
                verifies clients (its --tls-ca: mutual TLS).
            options: client_name, timeout_s (10), retries (4), hash_seed and hash_block_size (the server's, to
                hash prompts here), max_message_bytes (64 MiB), heartbeat (renew the lease in the background;
                True), failover_timeout_s (15), fan_out_grace_s (0.5, sharded Lookups).
        """
        self._setup(grpc.aio, target, token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, **options)
        self._lock = asyncio.Lock()
        self._renewer: asyncio.Task | None = None
        self._refresher: asyncio.Task | None = None  # a background map refresh (after a partial fan-out)

    async def __aenter__(self) -> AsyncKVServiceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for task in (self._renewer, self._refresher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for channel in self.shards.channels():
            await channel.close()

    # ---- calls ---------------------------------------------------------------------------------
    async def _call(self, conn: Conn, method: str, request, timeout_s: float | None = None,
                    retries: int | None = None, stub=None):
        """As the sync client's `_call`."""
        delay = 0.05
        retries = self.retries if retries is None else retries
        attempt = 0
        first = stub or conn.stub
        while True:
            stub = conn.stub
            if stub is not first and conn.stale:
                raise ConnectionReplaced()
            try:
                return await getattr(stub, method)(request, timeout=timeout_s or self.timeout_s,
                                                   metadata=self.metadata)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if conn.stub is stub or (task is not None and task.cancelling()):
                    raise  # our caller cancelled us, not a channel closed under the call
                continue  # grpc.aio cancels calls in flight when their channel closes
            except (grpc.RpcError, ValueError, grpc.aio.UsageError) as err:
                if replaced_under(conn, stub, err):
                    continue  # on the new channel (the check above stops it if the session must resume first)
                if not isinstance(err, grpc.RpcError) or err.code() not in RETRYABLE or attempt == retries:
                    raise
            attempt += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _run_on(self, conn: Conn, call: Call):
        try:
            if not call.mutating:
                result = call.decode(await self._call(conn, call.method, call.request))
                if call.method == "OpenSession":
                    self._renew_in_background()
                return result
            for resent in (False, True):
                stub = conn.stub
                if not conn.attached or conn.stale:
                    await self._run_on(conn, self._session_call(conn))
                    stub = conn.stub
                self._stamp(conn, self.session_id, call.request)
                try:
                    reply = await self._call(conn, call.method, call.request, stub=stub)
                except grpc.RpcError as err:
                    if not resent and self._out_of_order(conn, err):
                        continue  # refused: sent again once the session knows where it stands
                    self._unacked(conn, err, call.request, call.pool_id)
                    raise
                except BaseException as exc:  # the caller cancelled it, or ConnectionReplaced after a send
                    self._unacked(conn, exc, call.request, call.pool_id)
                    raise
                self._acked(conn, call.request)
                return call.decode(reply)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def _run(self, call: Call):
        shards = self.shards
        if not shards.known and call.method != "GetShardMap":
            await self._first_map()
        if call.locate and shards.unplaced(call.locate):
            await self.shard_stats(missing_ok=True)  # where the external pools among them live
        if call.merge is not None and call.partial and call.always_merge and not shards.sharded and call.conn is None:
            value = await self._run(replace(call, merge=None, partial=False, always_merge=False))
            return self._merge(call, [(shards.seed, value)])  # one allocator: its retries and failover
        if call.merge is not None and (shards.sharded or call.always_merge) and call.conn is None:
            parts = [(conn, call.per_shard(conn) if call.per_shard is not None else call.request)
                     for conn in shards.all()]
            parts = [(conn, request) for conn, request in parts if request is not None]
            if call.partial:
                outcomes = await self._fan_out_partial(call, parts)
                if not all(isinstance(value, KVServiceError) for _, value in outcomes):
                    return self._merge(call, outcomes)
                # No shard answered: there is no partial answer to give, so wait out a failover as any call does.
            results = await asyncio.gather(*(self._run(Call(call.method, request, call.decode, conn=conn))
                                             for conn, request in parts))
            return self._merge(call, [(conn, r) for (conn, _), r in zip(parts, results)])
        hops, deadline = 0, None
        while True:
            conn = call.conn or (shards.conn_for_mutation(call.pool_id) if call.mutating
                                 else shards.conn_for(call.pool_id))
            stub = conn.stub
            try:
                if not call.mutating:
                    return await self._run_on(conn, call)
                async with self._lock:  # one sequence at a time per session
                    return await self._run_on(conn, call)
            except Moved as exc:
                if call.mutating:
                    self._redirected(conn, call.pool_id)
                hops += 1
                if hops > MAX_HOPS or call.conn is not None:
                    raise
                await self._close(shards.moved(exc.pool_id, exc.shard_id, exc.address))
            except Unavailable as exc:
                if conn.stub is not stub:
                    continue  # the map named the shard's new leader meanwhile: go there now
                deadline = deadline or time.monotonic() + self.failover_timeout_s
                if not self._may_fail_over(exc) or not await self._failed_over(conn, deadline):
                    raise

    async def _fan_out_partial(self, call: Call, parts: list) -> list[tuple[Conn, Any]]:
        """As the blocking client's partial fan-out: every shard at once, one attempt each; a shard down, or
        silent `fan_out_grace_s` past the latest answer (timeout_s at most), gets its error as its result."""
        async def one(conn: Conn, request):
            try:
                return call.decode(await self._call(conn, call.method, request, retries=0))
            except grpc.RpcError as err:
                if err.code() not in RETRYABLE:
                    raise from_rpc_error(err) from None  # the shard refused it: that is the answer
                return from_rpc_error(err)

        tasks = [asyncio.ensure_future(one(conn, request)) for conn, request in parts]
        deadline, last = time.monotonic() + self.timeout_s, None
        pending = set(tasks)
        while pending:
            limit = min(deadline, last + self.fan_out_grace_s) if last is not None else deadline
            if time.monotonic() >= limit:
                break
            done, pending = await asyncio.wait(pending, timeout=limit - time.monotonic(),
                                               return_when=asyncio.FIRST_COMPLETED)
            if any(not t.exception() and not isinstance(t.result(), KVServiceError) for t in done):
                last = time.monotonic()
        for t in pending:
            t.cancel()
        out = []
        for (conn, _), t in zip(parts, tasks):
            if t in pending:
                out.append((conn, Unavailable(f"shard {conn.shard_id!r} at {conn.address} did not answer "
                                              f"{call.method} within {self.fan_out_grace_s} s of the other shards "
                                              f"(fan_out_grace_s)")))
            else:
                out.append((conn, t.result()))  # a refusal raises here
        if any(isinstance(v, KVServiceError) for _, v in out) and (self._refresher is None or self._refresher.done()):
            self._refresher = asyncio.get_running_loop().create_task(self.refresh_shard_map())
        return out

    async def _first_map(self) -> None:
        """The map from the first seed or, failing it, from any other address of the target."""
        if await self._refresh_map(self.shards.seed) or self.shards.known:
            return
        spares = self.shards.spare_seeds()
        try:
            for conn in spares:
                if await self._refresh_map(conn, retries=0):
                    return
        finally:
            await self._close([c.channel for c in spares])

    async def refresh_shard_map(self) -> bool:
        """Reads the shard map again (from any shard, or any address known); False if none answered."""
        spares = self.shards.spare_seeds()
        try:
            for conn in [*self.shards.all(), *spares]:
                if await self._refresh_map(conn, retries=0):
                    return True
            return False
        finally:
            await self._close([c.channel for c in spares])

    async def _refresh_map(self, conn: Conn, retries: int | None = None) -> bool:
        try:
            reply = await self._call(conn, "GetShardMap", pb.GetShardMapRequest(), timeout_s=min(self.timeout_s, 5),
                                     retries=retries)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.shards.known = True
            return False
        await self._close(self.shards.adopt(reply))
        return True

    async def _failed_over(self, dead: Conn, deadline: float) -> bool:
        """Whether the call may be retried after UNAVAILABLE: a standby (the next address) or another shard's
        map names a new leader for `dead`'s shard, before `deadline` (as the blocking client's)."""
        shards = self.shards
        if not shards.sharded:
            if not shards.alternates or time.monotonic() > deadline:
                return False
            await self._close([shards.rotate(dead)])
            await asyncio.sleep(0.1)
            return True
        seen, retry_at = (shards.version, dead.address), time.monotonic() + FAILOVER_RETRY_S
        while time.monotonic() < min(deadline, retry_at):
            await asyncio.sleep(FAILOVER_POLL_S)
            spares = shards.spare_seeds()
            try:
                for conn in [c for c in shards.all() if c is not dead] + spares + [dead]:
                    if await self._refresh_map(conn, retries=0):
                        break
            finally:
                await self._close([c.channel for c in spares])
            if (shards.version, dead.address) != seen:
                return True
        return time.monotonic() < deadline

    @staticmethod
    async def _close(channels) -> None:
        for channel in channels:
            await channel.close()

    # ---- the lease -----------------------------------------------------------------------------
    def _renew_in_background(self) -> None:
        if self.heartbeat_enabled and (self._renewer is None or self._renewer.done()):
            self._renewer = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        """As the blocking client's: a shard whose leader is gone is looked for, and renewed there at once."""
        lapsed: set[tuple[str, str]] = set()
        while True:
            await asyncio.sleep(max(self.ttl_s / 3, 0.05))
            for conn in self.shards.all():
                if not conn.attached or (conn.shard_id, self.session_id) in lapsed:
                    continue
                with contextlib.suppress(ValueError, grpc.aio.UsageError):  # a channel closed under it
                    if not await self._heartbeat(conn, lapsed):
                        await self._find_leader(conn)
                        await self._heartbeat(conn, lapsed)

    async def _heartbeat(self, conn: Conn, lapsed: set) -> bool:
        try:
            await conn.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.session_id), timeout=self.timeout_s,
                                      metadata=self.metadata)
        except grpc.RpcError as err:
            error = from_rpc_error(err)
            if isinstance(error, NotFound):
                lapsed.add((conn.shard_id, self.session_id))
            return not isinstance(error, (Unavailable, DeadlineExceeded))
        return True

    async def _find_leader(self, conn: Conn) -> None:
        """As the blocking client's."""
        if self.shards.sharded:
            await self.refresh_shard_map()
            return
        for address in list(self.shards.alternates):
            channel = self.shards.make_channel(address)
            try:
                await make_stub(channel).Heartbeat(pb.HeartbeatRequest(session_id=self.session_id),
                                                   timeout=min(self.timeout_s, 5), metadata=self.metadata)
            except grpc.RpcError as err:
                if not isinstance(from_rpc_error(err), NotFound):
                    continue
            finally:
                await channel.close()
            if address in self.shards.alternates:
                await self._close([self.shards.switch(conn, address)])
            return

    async def watch_events(self, pool_ids: Sequence[str] = (), start_sequence: int | None = None, *,
                           shard_id: str | None = None, include_state: bool = False) -> AsyncIterator[Event]:
        """As the blocking client's."""
        if not self.shards.known:
            await self._refresh_map(self.shards.seed)
        msg = self._watch_request(pool_ids, start_sequence, include_state)
        try:
            async for e in self._watch_target(pool_ids, shard_id).stub.WatchEvents(msg, metadata=self.metadata):
                yield replies.decode_event(e)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

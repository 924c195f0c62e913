"""The asyncio client: the same API as the blocking one, with `await`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice.client.base import RETRYABLE, Call, ClientBase
from kvservice.errors import NotFound
from kvservice.results import Event
from kvservice.wire import replies
from kvservice.wire.status import from_rpc_error


class AsyncKVServiceClient(ClientBase):
    """asyncio client; same API as KVServiceClient with `await`. Mutations are serialized (one sequence
    at a time per session)."""

    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None, **options) -> None:
        self._setup(grpc.aio, target, token, **options)
        self._lock = asyncio.Lock()
        self._renewer: asyncio.Task | None = None

    async def __aenter__(self) -> AsyncKVServiceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        await self.channel.close()

    async def _call(self, method: str, request, timeout_s: float | None = None):
        rpc = getattr(self.stub, method)
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                return await rpc(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
            except grpc.RpcError as err:
                if err.code() not in RETRYABLE or attempt == self.retries:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")

    async def _run(self, call: Call):
        try:
            if not call.mutating:
                result = call.decode(await self._call(call.method, call.request))
                if call.method == "OpenSession":
                    self._renew_in_background()
                return result
            async with self._lock:
                if not self.session_id:
                    await self.open_session()
                self._stamp(call.request)
                try:
                    reply = await self._call(call.method, call.request)
                except grpc.RpcError as err:
                    self._unacked(err)
                    raise
                self._acked()
                return call.decode(reply)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def _renew_in_background(self) -> None:
        if self.heartbeat_enabled and (self._renewer is None or self._renewer.done()):
            self._renewer = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(max(self.ttl_s / 3, 0.05))
            try:
                await self.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.session_id), timeout=self.timeout_s,
                                          metadata=self.metadata)
            except grpc.RpcError as err:
                if isinstance(from_rpc_error(err), NotFound):
                    return

    async def watch_events(self, pool_ids: Sequence[str] = (),
                           start_sequence: int | None = None) -> AsyncIterator[Event]:
        msg = self._watch_request(pool_ids, start_sequence)
        try:
            async for e in self.stub.WatchEvents(msg, metadata=self.metadata):
                yield replies.decode_event(e)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

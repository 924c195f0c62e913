"""The blocking client."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice.client.base import RETRYABLE, Call, ClientBase
from kvservice.errors import NotFound
from kvservice.results import Event
from kvservice.wire import replies
from kvservice.wire.status import from_rpc_error


class KVServiceClient(ClientBase):
    """Blocking client. One session per client; not for concurrent use from several threads (its lease
    renewal runs in a thread of its own)."""

    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None, **options) -> None:
        self._setup(grpc, target, token, **options)
        self._closed = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> KVServiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        self.channel.close()

    def _call(self, method: str, request, timeout_s: float | None = None):
        rpc = getattr(self.stub, method)
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                return rpc(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
            except grpc.RpcError as err:
                if err.code() not in RETRYABLE or attempt == self.retries:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")

    def _run(self, call: Call):
        try:
            if not call.mutating:
                result = call.decode(self._call(call.method, call.request))
                if call.method == "OpenSession":
                    self._renew_in_background()
                return result
            if not self.session_id:
                self.open_session()
            self._stamp(call.request)
            try:
                reply = self._call(call.method, call.request)
            except grpc.RpcError as err:
                self._unacked(err)
                raise
            self._acked()
            return call.decode(reply)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def _renew_in_background(self) -> None:
        if not self.heartbeat_enabled or (self._renewer is not None and self._renewer.is_alive()):
            return
        self._renewer = threading.Thread(target=self._renew, name="kvservice-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        """Heartbeats every third of the lease until closed; a lapsed session is left to the next call."""
        while not self._closed.wait(max(self.ttl_s / 3, 0.05)):
            try:
                self.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.session_id),
                                    timeout=self.timeout_s, metadata=self.metadata)
            except grpc.RpcError as err:
                if isinstance(from_rpc_error(err), NotFound) or self._closed.is_set():
                    return
            except ValueError:  # the channel was closed under it
                return

    def watch_events(self, pool_ids: Sequence[str] = (), start_sequence: int | None = None,
                     timeout_s: float | None = None) -> Iterator[Event]:
        msg = self._watch_request(pool_ids, start_sequence)
        try:
            for e in self.stub.WatchEvents(msg, metadata=self.metadata, timeout=timeout_s):
                yield replies.decode_event(e)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

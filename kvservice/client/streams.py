"""A WatchEvents stream of the blocking client."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from kvservice.results import Event
from kvservice.wire import replies
from kvservice.wire.status import from_rpc_error


class EventStream:
    """A WatchEvents stream: iterate it for events (kvservice.results.Event); `cancel()`, from any thread,
    ends the iteration."""

    def __init__(self, call) -> None:
        self._call = call

    def __iter__(self) -> Iterator[Event]:
        try:
            for e in self._call:
                yield replies.decode_event(e)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and self._call.cancelled():
                return
            raise from_rpc_error(err) from None

    def cancel(self) -> None:
        self._call.cancel()

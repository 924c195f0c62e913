"""The servicer's gRPC plumbing: requests arrive as raw bytes (kept for the WAL) and are parsed here; `rpc`
maps domain errors to statuses, times each call and never lets a bug crash the server."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Callable

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice.errors import InvalidArgument, KVServiceError, Unavailable
from kvservice.wire.status import rich_status

logger = logging.getLogger("kvservice.server.servicer")

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


async def abort(context: grpc.aio.ServicerContext, exc: KVServiceError) -> None:
    await context.abort_with_status(rich_status(exc))


def rpc(method: Callable) -> Callable:
    """Parses the request, maps domain errors to gRPC statuses, times the call, and never lets a bug
    crash the server. A method with a `raw` parameter also gets the request's bytes (what the WAL keeps)."""
    name = method.__name__
    takes_raw = "raw" in inspect.signature(method).parameters

    @functools.wraps(method)
    async def wrapper(self, raw: bytes, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        try:
            if self.standby and name != "GetShardMap":
                raise Unavailable(self.standby)
            if takes_raw:
                return await method(self, parse(name, raw), context, raw)
            return await method(self, parse(name, raw), context)
        except KVServiceError as exc:
            self.metrics.rejected.labels(name, exc.code.name).inc()
            await abort(context, exc)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            logger.exception("%s failed", name)
            self.metrics.rejected.labels(name, "INTERNAL").inc()
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the server log")
        finally:
            self.metrics.observe(name, time.perf_counter() - start)

    return wrapper


def method_handlers(servicer) -> grpc.GenericRpcHandler:
    """The service's handlers, taking raw request bytes (see `parse`)."""
    handlers = {}
    for method in SERVICE.methods:
        impl = getattr(servicer, method.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(impl, request_deserializer=None,
                                     response_serializer=method.output_type._concrete_class.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)

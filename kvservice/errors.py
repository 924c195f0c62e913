"""Whole-call errors: each maps to one gRPC status code. Messages say what was wrong, with which
value, and what to do. Per-op outcomes are `ops.OpStatus`, not exceptions."""

from __future__ import annotations

import grpc


class KVServiceError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KVServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, value: object, why: str) -> None:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"{field} = {shown}: {why}")
        self.field = field


class NotFound(KVServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KVServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(KVServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(KVServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(KVServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class ResourceExhausted(KVServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class OutOfRange(KVServiceError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unavailable(KVServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(KVServiceError):
    code = grpc.StatusCode.UNIMPLEMENTED


BY_CODE: dict[grpc.StatusCode, type[KVServiceError]] = {
    cls.code: cls for cls in (NotFound, AlreadyExists, FailedPrecondition, PermissionDenied, Unauthenticated,
                              ResourceExhausted, OutOfRange, Unavailable, Unimplemented)
}


def from_rpc_error(err: grpc.RpcError) -> KVServiceError:
    """The typed error for a failed call (clients raise these instead of raw RpcErrors)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        exc = InvalidArgument.__new__(InvalidArgument)
        KVServiceError.__init__(exc, details or "")
        exc.field = (details or "").split(" = ", 1)[0]
        return exc
    cls = BY_CODE.get(code)
    if cls is None:
        exc = KVServiceError(f"{code.name}: {details}")
        exc.code = code
        return exc
    return cls(details or "")

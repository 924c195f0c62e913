"""Domain errors <-> gRPC statuses. An `InvalidArgument` travels with the standard rich error details
(`google.rpc.BadRequest` with one field violation, in the `grpc-status-details-bin` trailer), so clients
read the field from the details instead of parsing the message."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvservice.errors import Code, InvalidArgument, KVServiceError, Moved, SequenceOutOfOrder, error_for

MOVED_REASON, SEQUENCE_REASON, DOMAIN = "POOL_MOVED", "SEQUENCE_OUT_OF_ORDER", "kvservice"

_TO_GRPC = {code: getattr(grpc.StatusCode, code.name) for code in Code}
_FROM_GRPC = {v: k for k, v in _TO_GRPC.items()}


def grpc_code(code: Code) -> grpc.StatusCode:
    return _TO_GRPC[code]


def domain_code(code: grpc.StatusCode) -> Code:
    return _FROM_GRPC.get(code, Code.UNKNOWN)


def rich_status(exc: KVServiceError) -> grpc.Status:
    """The error as a gRPC status carrying `google.rpc.Status` details (a BadRequest for InvalidArgument)."""
    status = status_pb2.Status(code=getattr(code_pb2, exc.code.name, code_pb2.UNKNOWN), message=exc.message)
    detail = None
    if isinstance(exc, InvalidArgument):
        detail = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=exc.description)])
    elif isinstance(exc, Moved):
        detail = error_details_pb2.ErrorInfo(reason=MOVED_REASON, domain=DOMAIN, metadata={
            "pool_id": exc.pool_id, "shard_id": exc.shard_id, "address": exc.address})
    elif isinstance(exc, SequenceOutOfOrder):
        detail = error_details_pb2.ErrorInfo(reason=SEQUENCE_REASON, domain=DOMAIN,
                                             metadata={"last_applied": str(exc.last_applied)})
    if detail is not None:
        packed = any_pb2.Any()
        packed.Pack(detail)
        status.details.append(packed)
    return rpc_status.to_status(status)


def _details(err: grpc.RpcError) -> list:
    try:
        status = rpc_status.from_call(err) if hasattr(err, "trailing_metadata") else None
    except ValueError:  # a status detail that disagrees with the call's code: ignore the details
        return []
    return list(status.details) if status is not None else []


def from_rpc_error(err: grpc.RpcError) -> KVServiceError:
    """The typed error for a failed call (clients raise these instead of raw RpcErrors)."""
    code = domain_code(err.code()) if hasattr(err, "code") else Code.UNKNOWN
    details = (err.details() if hasattr(err, "details") else str(err)) or ""
    if code is Code.INVALID_ARGUMENT:
        field, description = details.split(" = ", 1)[0], ""
        for detail in _details(err):
            bad = error_details_pb2.BadRequest()
            if detail.Unpack(bad) and bad.field_violations:
                field, description = bad.field_violations[0].field, bad.field_violations[0].description
                break
        return InvalidArgument.from_details(details, field, description)
    if code is Code.FAILED_PRECONDITION:
        for detail in _details(err):
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info) and info.reason == MOVED_REASON:
                m = info.metadata
                return Moved(m.get("pool_id", ""), m.get("shard_id", ""), m.get("address", ""), details)
            if info.reason == SEQUENCE_REASON:
                return SequenceOutOfOrder(details, int(info.metadata.get("last_applied", "0")))
    return error_for(code, details)

"""Whole-call errors of the domain: each carries a `Code` (named after the gRPC status it becomes, but the
state machine imports no transport: `kvservice.server.status` maps codes to gRPC and back). Messages say
what was wrong, with which value, and what to do. Per-op outcomes are `ops.OpStatus`, not exceptions."""

from __future__ import annotations

from enum import Enum


class Code(Enum):
    """What kind of failure: the gRPC status of the same name on the wire."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNAVAILABLE = "UNAVAILABLE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    ABORTED = "ABORTED"
    DATA_LOSS = "DATA_LOSS"
    INTERNAL = "INTERNAL"
    UNKNOWN = "UNKNOWN"


class KVServiceError(Exception):
    code: Code = Code.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KVServiceError):
    """A malformed field: `field` is its path (e.g. `ops[3].allocate.request_id`)."""

    code = Code.INVALID_ARGUMENT

    def __init__(self, field: str, value: object, why: str) -> None:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"{field} = {shown}: {why}")
        self.field = field
        self.description = f"{shown}: {why}"

    @classmethod
    def from_details(cls, message: str, field: str, description: str = "") -> InvalidArgument:
        """Rebuilt from a received error (the field comes from its details, not from parsing the message)."""
        exc = cls.__new__(cls)
        KVServiceError.__init__(exc, message)
        exc.field = field
        exc.description = description
        return exc


class NotFound(KVServiceError):
    code = Code.NOT_FOUND


SESSION_GONE = "open a new session"  # the end of the allocator's message for a session it does not hold


def session_lost(exc: BaseException) -> bool:
    """Whether `exc` says the allocator no longer holds the caller's session (it restarted without its state,
    or the lease lapsed): everything the session held is gone, and a new session starts afresh."""
    return isinstance(exc, NotFound) and SESSION_GONE in str(exc)


class AlreadyExists(KVServiceError):
    code = Code.ALREADY_EXISTS


class FailedPrecondition(KVServiceError):
    code = Code.FAILED_PRECONDITION


class Moved(FailedPrecondition):
    """The pool is served by another shard (sharded allocators): send its calls to `address`."""

    def __init__(self, pool_id: str, shard_id: str, address: str, message: str = "") -> None:
        super().__init__(message or f"pool {pool_id!r} is served by shard {shard_id!r} at {address}; send its "
                                    f"calls there (GetShardMap lists every pool's shard)")
        self.pool_id, self.shard_id, self.address = pool_id, shard_id, address


class SequenceOutOfOrder(FailedPrecondition):
    """A mutation whose sequence is neither its session's next nor a retry of its last applied one (with the same
    body): refused, nothing applied. `last_applied` is where the session stands (the client resumes there)."""

    def __init__(self, message: str, last_applied: int) -> None:
        super().__init__(message)
        self.last_applied = last_applied


class PermissionDenied(KVServiceError):
    code = Code.PERMISSION_DENIED


class Unauthenticated(KVServiceError):
    code = Code.UNAUTHENTICATED


class ResourceExhausted(KVServiceError):
    code = Code.RESOURCE_EXHAUSTED


class OutOfRange(KVServiceError):
    code = Code.OUT_OF_RANGE


class Unavailable(KVServiceError):
    code = Code.UNAVAILABLE


class Unimplemented(KVServiceError):
    code = Code.UNIMPLEMENTED


class DeadlineExceeded(KVServiceError):
    code = Code.DEADLINE_EXCEEDED


BY_CODE: dict[Code, type[KVServiceError]] = {
    cls.code: cls for cls in (NotFound, AlreadyExists, FailedPrecondition, PermissionDenied, Unauthenticated,
                              ResourceExhausted, OutOfRange, Unavailable, Unimplemented, DeadlineExceeded)
}


def error_for(code: Code, message: str) -> KVServiceError:
    """The typed error for `code` (any code without a class of its own: a plain KVServiceError)."""
    cls = BY_CODE.get(code)
    if cls is not None:
        return cls(message)
    exc = KVServiceError(f"{code.name}: {message}")
    exc.code = code
    return exc


def pool_id_taken(pool_id: str) -> AlreadyExists:
    """A pool id held by the other kind of pool (kvservice / external), here or on another shard."""
    return AlreadyExists(f"pool id {pool_id!r} is taken: kvservice pools and external pools share one namespace "
                         f"of pool ids across every shard; pick another id (or remove that pool first)")


def foreign_pool(pool_id: str) -> PermissionDenied:
    """Registering a pool id another tenant holds (that reveals the id is taken, nothing more)."""
    return PermissionDenied(f"pool {pool_id!r} belongs to another tenant; only it or an admin may re-register it")

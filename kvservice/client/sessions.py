"""A client session's sequence numbers on each connection: what a mutation is stamped with, what an
acknowledgement or a failure changes, and what a resume (OpenSession) tells. The exactly-once contract: a
sequence is never skipped; after any failed mutation the next one first learns from the allocator where the
session stands, and a resend of the same call keeps its sequence (its stored reply answers it)."""

from __future__ import annotations

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice.client.routing import Conn
from kvservice.errors import SequenceOutOfOrder
from kvservice.results import SessionOpened
from kvservice.wire import replies
from kvservice.wire.status import from_rpc_error

# The codes of a mutation the allocator refused before applying anything (its sequence stays the next one).
# Any other failure (a deadline, a cancellation, a connection torn down as the allocator restarts) may
# have come after the mutation was applied.
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
           grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
           grpc.StatusCode.UNIMPLEMENTED}


def _body(request) -> int:
    """A mutation's body (its session and sequence aside), to tell a resend of it from another call."""
    session_id, sequence = request.session_id, request.sequence
    request.session_id, request.sequence = "", 0
    body = hash(request.SerializeToString(deterministic=True))
    request.session_id, request.sequence = session_id, sequence
    return body


class SessionSequences:
    """The session bookkeeping both clients share (mixed into ClientBase)."""

    def _adopt_session(self, conn: Conn, r: pb.OpenSessionResponse) -> SessionOpened:
        """Where the session stands on `conn`. A mutation whose reply was lost (`unacked_sequence`) was applied
        if the server's next sequence is the one after it: then a resend of it (the same body) keeps its
        sequence and gets the stored reply, and any other call takes the next. Otherwise nothing is pending."""
        opened = replies.decode_session_opened(r)
        pending = conn.unacked_sequence
        resumed = opened.session_id == self.session_id
        self.session_id, self.tenant, self.ttl_s = opened.session_id, opened.tenant, opened.ttl_ms / 1000
        conn.attached, conn.stale = True, False
        conn.next_sequence = opened.next_sequence
        if not (resumed and pending and opened.next_sequence == pending + 1):
            conn.unacked_sequence, conn.unacked_body, conn.unacked_pool = 0, 0, ""
        return opened

    @staticmethod
    def _stamp(conn: Conn, session_id: str, request) -> None:
        """The session and sequence of a mutation: the pending one's if it resends that (the same body), else the
        next (the session has learnt where it stands since any failure: `_unacked` made it resume)."""
        request.session_id = session_id
        if conn.unacked_sequence and _body(request) == conn.unacked_body:
            request.sequence = conn.unacked_sequence
        else:
            request.sequence = conn.next_sequence

    @staticmethod
    def _acked(conn: Conn, request) -> None:
        conn.next_sequence = request.sequence + 1
        conn.unacked_sequence, conn.unacked_body, conn.unacked_pool = 0, 0, ""

    @staticmethod
    def _unacked(conn: Conn, err: BaseException, request, pool_id: str | None = None) -> None:
        """A mutation failed. Refused by the server, it was not applied and its sequence stays the next. Any
        other failure (the transport's, a deadline, a cancellation, whatever its code) may have come after it
        was applied: the next mutation first resumes the session (the server says where it stands), and a
        resend of this one keeps its sequence, so it applies once."""
        if isinstance(err, grpc.RpcError) and err.code() in REFUSED:
            return
        conn.unacked_sequence, conn.unacked_body, conn.unacked_pool = request.sequence, _body(request), pool_id or ""
        conn.stale = conn.attached

    @staticmethod
    def _out_of_order(conn: Conn, err: grpc.RpcError) -> bool:
        """Whether the server refused a mutation's sequence (nothing applied): the session resumes, to learn where
        it stands, before the mutation is sent again. A server whose recovered state lacks mutations this client
        saw acknowledged (Redis lost them) then starts new epochs for the session's pools."""
        if err.code() != grpc.StatusCode.FAILED_PRECONDITION or not isinstance(from_rpc_error(err),
                                                                              SequenceOutOfOrder):
            return False
        conn.stale = conn.attached
        return True

    @staticmethod
    def _redirected(conn: Conn, pool_id: str | None) -> None:
        """`conn` answered a mutation of `pool_id` with a redirect: its unacknowledged one was not applied there
        (a retry of the last one applied is answered from its stored reply, never redirected)."""
        if conn.unacked_pool and conn.unacked_pool == pool_id:
            conn.unacked_sequence, conn.unacked_pool = 0, ""

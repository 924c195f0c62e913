"""Client sessions: tenant, lease, per-session sequence numbers and the last reply kept for retries."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvservice.errors import SESSION_GONE, NotFound, PermissionDenied, SequenceOutOfOrder
from kvservice.ops import StepResult
from kvservice.results import RegisterResult

Reply = StepResult | RegisterResult  # what a sequenced command answers (and answers again to a retry)


@dataclass(slots=True)
class Session:
    session_id: str
    tenant: str
    client_name: str = ""
    last_sequence: int = 0
    last_reply: Reply | None = None  # the reply of last_sequence, answered again to a retry
    last_digest: int = 0  # the body identity of last_sequence's request (0: unknown)
    expires_at: float = 0.0
    # pool id -> request keys this session added or forked (freed with it when its lease lapses)
    requests: dict[str, set[str]] = field(default_factory=dict)

    def own(self, pool_id: str, key: str) -> None:
        self.requests.setdefault(pool_id, set()).add(key)

    def disown(self, pool_id: str, key: str) -> None:
        keys = self.requests.get(pool_id)
        if keys is not None:
            keys.discard(key)

    def num_requests(self) -> int:
        return sum(map(len, self.requests.values()))

    def replay(self, sequence: int, digest: int) -> Reply | None:
        """The stored reply when `sequence` retries the last applied request; None when it is the next.

        Raises:
            SequenceOutOfOrder: out of order, or the last sequence again with another body (a different
                request reusing an applied sequence must not get the old reply).
        """
        if sequence == self.last_sequence + 1:
            return None
        if sequence == self.last_sequence and self.last_reply is not None:
            if digest and self.last_digest and digest != self.last_digest:
                raise SequenceOutOfOrder(
                    f"sequence {sequence} of session {self.session_id!r} was applied to a different request; "
                    f"send new requests with sequence {sequence + 1}", self.last_sequence)
            return self.last_reply
        raise SequenceOutOfOrder(
            f"sequence {sequence} out of order for session {self.session_id!r}: the last applied is "
            f"{self.last_sequence}, so send {self.last_sequence + 1} (or retry {self.last_sequence})",
            self.last_sequence)

    def commit(self, sequence: int, digest: int, reply: Reply) -> None:
        self.last_sequence = sequence
        self.last_digest = digest
        self.last_reply = reply


class SessionTable:
    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"session TTL must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.sessions: dict[str, Session] = {}

    def open(self, session_id: str, tenant: str, client_name: str, now: float) -> Session:
        session = Session(session_id, tenant, client_name, expires_at=now + self.ttl_s)
        self.sessions[session_id] = session
        return session

    def get(self, session_id: str, tenant: str, now: float | None = None) -> Session:
        """The caller's live session (renewing its lease when `now` is given)."""
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"session {session_id!r} not found (its lease may have lapsed); {SESSION_GONE}")
        if session.tenant != tenant:
            raise PermissionDenied(f"session {session_id!r} belongs to another tenant")
        if now is not None:
            session.expires_at = now + self.ttl_s
        return session

    def expired(self, now: float) -> list[Session]:
        return [s for s in self.sessions.values() if s.expires_at <= now]

    def restart_leases(self, now: float) -> None:
        """After recovery every lease restarts at its full TTL."""
        for session in self.sessions.values():
            session.expires_at = now + self.ttl_s

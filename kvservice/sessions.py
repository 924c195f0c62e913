"""Client sessions: tenant, lease, per-session sequence numbers and the last reply kept for retries."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvservice.errors import FailedPrecondition, NotFound, PermissionDenied


@dataclass(slots=True)
class Session:
    session_id: str
    tenant: str
    client_name: str = ""
    last_sequence: int = 0
    last_reply: object = None  # the reply of last_sequence, answered again to a retry
    expires_at: float = 0.0
    # pool id -> request keys this session added or forked (freed with it when its lease lapses)
    requests: dict[str, set[str]] = field(default_factory=dict)

    def own(self, pool_id: str, key: str) -> None:
        self.requests.setdefault(pool_id, set()).add(key)

    def disown(self, pool_id: str, key: str) -> None:
        keys = self.requests.get(pool_id)
        if keys is not None:
            keys.discard(key)


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
            raise NotFound(f"session {session_id!r} not found (its lease may have lapsed); open a new session")
        if session.tenant != tenant:
            raise PermissionDenied(f"session {session_id!r} belongs to another tenant")
        if now is not None:
            session.expires_at = now + self.ttl_s
        return session

    @staticmethod
    def check_sequence(session: Session, sequence: int) -> object | None:
        """The stored reply when `sequence` is a retry of the last applied one; None when it is the
        next one; FailedPrecondition otherwise."""
        if sequence == session.last_sequence + 1:
            return None
        if sequence == session.last_sequence and session.last_reply is not None:
            return session.last_reply
        raise FailedPrecondition(
            f"sequence {sequence} out of order for session {session.session_id!r}: the last applied is "
            f"{session.last_sequence}, so send {session.last_sequence + 1} (or retry {session.last_sequence})")

    def expired(self, now: float) -> list[Session]:
        return [s for s in self.sessions.values() if s.expires_at <= now]

    def restart_leases(self, now: float) -> None:
        """After recovery every lease restarts at its full TTL."""
        for session in self.sessions.values():
            session.expires_at = now + self.ttl_s

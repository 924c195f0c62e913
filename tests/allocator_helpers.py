"""Driving an in-process Allocator through commands, as one client session would."""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.allocator import Allocator
from kvservice.commands import CommitTransfer, OpenSession, PoolSpec, RegisterPool, Step
from kvservice.ops import Op, StepResult
from kvservice.results import RegisterResult


class InProcess:
    """One session of an in-process allocator: each call is the command a client's RPC would be."""

    def __init__(self, allocator: Allocator, session_id: str = "s", tenant: str = "", now: float = 0.0) -> None:
        self.allocator = allocator
        self.session_id = session_id
        self.tenant = tenant
        self.now = now
        allocator.apply(OpenSession(session_id, tenant), now)

    @classmethod
    def resume(cls, allocator: Allocator, session_id: str, tenant: str = "", now: float = 0.0) -> InProcess:
        """A session the allocator already holds (e.g. recovered from a snapshot)."""
        self = cls.__new__(cls)
        self.allocator, self.session_id, self.tenant, self.now = allocator, session_id, tenant, now
        return self

    @property
    def session(self):
        return self.allocator.state.sessions.sessions[self.session_id]

    def _sequence(self) -> int:
        return self.session.last_sequence + 1

    def register(self, spec: PoolSpec) -> RegisterResult:
        command = RegisterPool(self.session_id, self.tenant, self._sequence(), spec, self.allocator.fingerprint)
        return self.allocator.apply(command, self.now).reply

    def step(self, pool_id: str, ops: Sequence[Op]) -> StepResult:
        command = Step(self.session_id, self.tenant, self._sequence(), pool_id, list(ops))
        return self.allocator.apply(command, self.now).reply

    def commit_transfer(self, pool_id: str, transfer_id: str, abort: bool = False) -> StepResult:
        command = CommitTransfer(self.session_id, self.tenant, self._sequence(), pool_id, transfer_id, abort)
        return self.allocator.apply(command, self.now).reply

"""The Allocator: `apply(command)` is the only way its state changes, and the only place a sequence is
checked and a reply stored; the rest are reads (reads.py). No I/O and no clock of its own (times are arguments),
so the same commands always reach the same state, block for block: what the WAL replays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvservice.allocator.batches import Batches
from kvservice.allocator.keys import SEP, client_request_id
from kvservice.allocator.moves import PoolMoves
from kvservice.allocator.pins import PinBook, check_sources
from kvservice.allocator.placement import Placement
from kvservice.allocator.pools import Pool
from kvservice.allocator.reads import AllocatorReads
from kvservice.allocator.registry import PoolRegistry
from kvservice.allocator.requests import RequestBook
from kvservice.allocator.schedule import Scheduler
from kvservice.allocator.sessions import Reply, Session
from kvservice.allocator.state import AllocatorState
from kvservice.allocator.vllm_slots import VllmSlots
from kvservice.commands import (
    Barrier,
    Command,
    CommitTransfer,
    DropPool,
    ExpireSessions,
    FreezePool,
    ImportPool,
    IngestEvents,
    OpenSession,
    RegisterExternalPool,
    RegisterPool,
    RemoveExternalPool,
    ResetPrefixCache,
    RetirePools,
    Step,
    ThawPool,
    digest,
)
from kvservice.errors import InvalidArgument
from kvservice.external.registry import ExternalRegistry
from kvservice.ops import (
    HELD_BLOCK_OPS,
    AddRequestOp,
    AdmitBatchOp,
    AllocateBatchOp,
    AllocateOp,
    DecodeBatchOp,
    EvictBlocksOp,
    ForkOp,
    FreeHeldBlocksOp,
    FreeOp,
    NewStepOp,
    Op,
    OpResult,
    OpStatus,
    PinOp,
    RemoveSkippedBlocksOp,
    ResetPrefixCacheOp,
    StepResult,
    UnpinOp,
)
from kvservice.results import ResetResult, SessionOpened
from kvservice.settings import AllocatorSettings

logger = logging.getLogger(__name__)


def _start_step(pool: Pool) -> None:
    """vLLM's new_step_starts: Mamba states cached so far may hit from now on. The boundary states a KV connector
    would offload (vLLM's scheduler hands them to it each step) are dropped: a pool has no connector."""
    for m in pool.manager.coordinator.single_type_managers:
        m.new_step_starts()
        if m._pending_boundary_state_offloads:
            m.take_pending_boundary_state_offloads()


# What a suspended pool still takes: ops that only release or drop blocks (its store is away: nothing may hit,
# be pinned or be allocated until it registers the pool again).
SUSPENDED_POOL_OPS = frozenset({FreeOp, UnpinOp, FreeHeldBlocksOp, RemoveSkippedBlocksOp, EvictBlocksOp,
                                ResetPrefixCacheOp, NewStepOp})


def _suspended(pool: Pool, op: Op) -> OpResult:
    op_id = getattr(op, "request_id", None) or getattr(op, "pin_id", None) or getattr(op, "child_request_id", "")
    return OpResult(op_id, OpStatus.FAILED_PRECONDITION,
                    f"pool {pool.pool_id!r} is suspended until its store re-attaches (registers it again at epoch "
                    f"{pool.epoch}): it takes no {type(op).__name__} now; frees and unpins still apply")


EXTERNAL_COMMANDS = (IngestEvents, RegisterExternalPool, RemoveExternalPool)
Guard = Callable[[], None]  # raises when a mutation must not happen now (e.g. persistence is down)


def _no_guard() -> None:
    return None


@dataclass(slots=True)
class Applied:
    """A command's reply, and whether the state changed (only then is the command journaled)."""

    reply: Reply | SessionOpened | ResetResult | list[str] | None
    mutated: bool


class Allocator(AllocatorReads):
    """    Allocator.apply ─┬─ PoolRegistry (pools, epochs)        Placement (lookup, routing)
                         ├─ Batches ── Scheduler (one request: plan, then apply)
                         └─ RequestBook (requests, owners, sessions' requests, transfers' aborts)
    all over one AllocatorState (pools, sessions, event log, quotas' usage, transfers)."""

    def __init__(self, settings: AllocatorSettings | None = None, **overrides) -> None:
        """`overrides`: AllocatorSettings fields (e.g. `Allocator(hash_block_size=4)`)."""
        if settings is None:
            settings = AllocatorSettings(**overrides)
        elif overrides:
            raise TypeError("give settings or field overrides, not both")
        self.state = AllocatorState(settings)
        self.book = RequestBook(self.state)
        self.scheduler = Scheduler(self.state, self.book)
        self.batches = Batches(self.state, self.book, self.scheduler)
        self.registry = PoolRegistry(self.state, self.book)
        self.external = ExternalRegistry(self.state)
        self.placement = Placement(self.state, self.external)
        self.moves = PoolMoves(self.state, self.book)
        self.pins = PinBook(self.state)
        self.vllm_slots = VllmSlots(self.book)

    @property
    def settings(self) -> AllocatorSettings:
        return self.state.settings

    @property
    def fingerprint(self) -> str:
        return self.state.fingerprint

    # ---- the one way to change the state ------------------------------------------------------
    def apply(self, command: Command, now: float, guard: Guard = _no_guard) -> Applied:
        """Applies `command` as of time `now`; `guard()` is called right before the first change, and
        before a retry is answered from the stored reply."""
        kind = type(command)
        if kind is Step:
            return self._sequenced(command, now, guard, self._step)
        if kind is RegisterPool:
            return self._sequenced(command, now, guard, self._register)
        if kind is CommitTransfer:
            return self._sequenced(command, now, guard, self._commit_transfer)
        if kind is OpenSession:
            return self._open_session(command, now, guard)
        if kind is ExpireSessions:
            guard()
            closed = [s for s in command.session_ids if s in self.state.sessions.sessions]
            for session_id in closed:
                self.book.close_session(session_id)
            self.registry.end_sessions(set(closed))
            return Applied(closed, True)
        if kind is ResetPrefixCache:
            return self._reset(command, guard)
        if kind is RetirePools:
            guard()
            for pool_id in command.pool_ids:
                if pool_id in self.state.pools:
                    self.registry.bump_epoch(pool_id)
            return Applied(None, True)
        if kind is Barrier:
            return Applied(None, False)
        if kind in (FreezePool, ThawPool, DropPool, ImportPool):
            self.moves.apply(command, guard)
            return Applied(None, True)
        if kind in EXTERNAL_COMMANDS:
            return Applied(*self.external.apply(command, guard))
        raise TypeError(f"not a command: {command!r}")

    def _sequenced(self, command, now: float, guard: Guard, handler) -> Applied:
        if command.sequence == 0:
            raise InvalidArgument("sequence", 0, "sequences start at 1 (OpenSession returns next_sequence)")
        sessions = self.state.sessions
        if command.tenant is None:  # a replayed entry from before commands named their tenant
            session = sessions.get(command.session_id, sessions.sessions[command.session_id].tenant, now)
        else:
            session = sessions.get(command.session_id, command.tenant, now)
        body = digest(command.wire)
        stored = session.replay(command.sequence, body)
        if stored is not None:
            guard()  # a stored reply is an acknowledgement too: never one that may not be durable
            return Applied(stored, False)
        reply = handler(session, command, guard)
        session.commit(command.sequence, body, reply)
        return Applied(reply, True)

    def _step(self, session: Session, command: Step, guard: Guard) -> StepResult:
        pool = self.state.mutable_pool(command.pool_id, session.tenant, command.admin)
        ops = command.decode_ops(pool.spec, pool.hash_block_size)  # validated before anything changes
        check_sources(self.state.pools, ops, session.tenant, command.admin, command.remote_sources_checked)
        guard()
        return self.run_ops(pool, session, command.sequence, ops, command.admin)

    def run_ops(self, pool: Pool, session: Session, sequence: int, ops: Sequence[Op],
                admin: bool = False) -> StepResult:
        """Applies validated ops in order; per-op outcomes are statuses."""
        tenant = session.tenant
        results = []
        append = results.append
        if pool.spec.vllm is None:  # a Step is one step (Mamba: states cached in it hit from the next)
            _start_step(pool)
        allocate = self.scheduler.allocate_op if pool.spec.vllm is None else self._vllm_allocate
        suspended = pool.suspended
        for op in ops:
            kind = type(op)
            if suspended and kind not in SUSPENDED_POOL_OPS:
                append(_suspended(pool, op))
            elif kind is AllocateOp:
                key = f"{tenant}{SEP}{op.request_id}" if tenant else op.request_id  # request_key, inline: per op
                append(allocate(pool, session, key, op, admin))
            elif kind is AddRequestOp:
                append(self.book.add(pool, session, op))
            elif kind is AllocateBatchOp:
                append(self.vllm_slots.allocate_batch(pool, tenant, op))
            elif kind is DecodeBatchOp:
                append(self.batches.decode(pool, session, op))
            elif kind is AdmitBatchOp:
                append(self.batches.admit(pool, session, op))
            elif kind is FreeOp:
                append(self.book.free_op(pool, session, op))
            elif kind is ForkOp:
                append(self.book.fork(pool, session, op))
            elif kind is PinOp:
                append(self.pins.pin(pool, session, op))
            elif kind is ResetPrefixCacheOp:
                append(self._reset_op(pool))
            elif kind is EvictBlocksOp:
                pool.manager.evict_blocks(op.block_ids)
                append(OpResult(""))
            elif kind is RemoveSkippedBlocksOp:
                append(self.book.remove_skipped_blocks(pool, tenant, op))
            elif kind is NewStepOp:  # a vLLM scheduler's step starts (its Steps need not match its steps)
                _start_step(pool)
                append(OpResult(""))
            elif kind in HELD_BLOCK_OPS:
                append(self.vllm_slots.held_blocks(pool, op))
            else:
                append(self.pins.unpin(pool, session, op))
        manager = pool.manager
        # (A vLLM pool's copies are its scheduler's: TakeBlockCopiesOp takes them when vLLM's scheduler does.)
        copies = manager.take_block_copies() if pool.spec.vllm is None else []
        result = StepResult(sequence, results, copies, manager.block_pool.get_num_free_blocks())
        self.state.drain(pool)
        return result

    def _vllm_allocate(self, pool: Pool, session: Session, key: str, op: AllocateOp, admin: bool) -> OpResult:
        return self.vllm_slots.allocate_op(pool, key, op)

    @staticmethod
    def _reset_op(pool: Pool) -> OpResult:
        if pool.manager.reset_prefix_cache():
            return OpResult("")
        return OpResult("", OpStatus.FAILED_PRECONDITION, f"pool {pool.pool_id!r} has blocks in use: its prefix "
                                                          f"cache was not reset")

    def _register(self, session: Session, command: RegisterPool, guard: Guard):
        current = self.registry.check(session, command)
        guard()
        return self.registry.register(session, command, current)

    def _commit_transfer(self, session: Session, command: CommitTransfer, guard: Guard) -> StepResult:
        """Commit: the destination's copied blocks become cached. Abort: the destination request is freed.
        Either way the source pins drop."""
        state = self.state
        pool = state.mutable_pool(command.pool_id, session.tenant, command.admin)
        guard()
        transfer = state.transfers.transfers.get(command.transfer_id)
        owner = state.sessions.sessions.get(transfer.session_id) if transfer is not None else None
        if transfer is None or transfer.dst_pool != pool.pool_id or (owner is not None
                                                                     and owner.tenant != session.tenant):
            result = OpResult(command.transfer_id, OpStatus.NOT_FOUND,
                              f"no pending transfer {command.transfer_id!r} into pool {pool.pool_id!r}")
        elif command.abort:
            request_id = client_request_id(transfer.dst_key)
            self.book.abort_transfer(transfer)
            result = OpResult(request_id, OpStatus.OK, f"transfer {command.transfer_id} aborted; request freed")
        else:
            state.transfers.close(transfer, state.pools, commit=True)
            result = OpResult(client_request_id(transfer.dst_key), OpStatus.OK)
        for p in {transfer.src_pool, transfer.dst_pool} if transfer is not None else ():
            if p in state.pools:
                state.drain(state.pools[p])
        return StepResult(command.sequence, [result], [])

    def _open_session(self, command: OpenSession, now: float, guard: Guard) -> Applied:
        """A new session, or a resumed one; a resume whose client saw more acknowledged than this state
        holds starts new epochs for the pools it used (their blocks may have been handed out since)."""
        state = self.state
        sessions = state.sessions
        failed: list[str] = []
        session, mutated = None, False
        if command.resume_session_id:
            if command.resume_session_id in sessions.sessions:
                session = sessions.get(command.resume_session_id, command.tenant, now)
            elif command.attach:  # a sharded client's session, new on this shard
                guard()
                mutated = True
                session = sessions.open(command.resume_session_id, command.tenant, command.client_name, now)
            recovered = session.last_sequence if session is not None else 0
            if command.last_acked_sequence > recovered:
                used = set(command.resume_pool_ids) | (set(session.requests) if session is not None else set())
                pools = state.pools
                # Only the caller's own pools (an admin: any): a stale resume must not wipe anyone else's.
                failed = sorted(p for p in used if p in pools
                                and (command.admin or pools[p].owner_tenant == command.tenant))
                guard()
                mutated = True
                for pool_id in failed:
                    self.registry.bump_epoch(pool_id)
                logger.warning("session %s resumed at sequence %d, ahead of the recovered %d: new epochs for %s",
                               command.resume_session_id, command.last_acked_sequence, recovered, failed)
        if session is None:
            guard()
            mutated = True
            session = sessions.open(command.session_id, command.tenant, command.client_name, now)
        return Applied(SessionOpened(session.session_id, session.tenant, session.last_sequence + 1,
                                     int(sessions.ttl_s * 1000), failed), mutated)

    def _reset(self, command: ResetPrefixCache, guard: Guard) -> Applied:
        state = self.state
        pools = [state.pool(p) for p in command.pool_ids] if command.pool_ids else list(state.pools.values())
        guard()
        done, refused = [], []
        for pool in pools:
            (done if pool.manager.reset_prefix_cache() else refused).append(pool.pool_id)
            state.drain(pool)
        return Applied(ResetResult(done, refused), True)

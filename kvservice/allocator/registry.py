"""Pools and their epochs: registration (a pool belongs to the tenant that registered it), a new epoch when
its workers restarted (their memory is gone: every in-flight request fails), forced epochs after a stale
recovery; a store's pool bound to its session, retired or suspended when that session ends, its endpoint
replaced when it registers again at the same epoch."""

from __future__ import annotations

import logging
from dataclasses import replace

from kvservice.allocator.pools import Pool
from kvservice.allocator.requests import RequestBook
from kvservice.allocator.sessions import Session
from kvservice.allocator.state import AllocatorState
from kvservice.commands import RegisterPool
from kvservice.core import AllBlocksCleared
from kvservice.errors import FailedPrecondition, InvalidArgument, foreign_pool, pool_id_taken
from kvservice.hashing import HashSpec
from kvservice.results import RegisterResult

logger = logging.getLogger(__name__)


def describe(spec: HashSpec) -> str:
    return f"algorithm {spec.algorithm}, seed {spec.effective_seed!r}, hash block size {spec.block_size}"


class PoolRegistry:
    def __init__(self, state: AllocatorState, book: RequestBook) -> None:
        self.state = state
        self.book = book

    def check(self, session: Session, command: RegisterPool) -> Pool | None:
        """Raises when the registration is refused; returns the pool registered now, if any."""
        state = self.state
        spec = command.spec
        limit = state.settings.max_pool_blocks
        if spec.config.num_blocks > limit:
            raise InvalidArgument("config.num_blocks", spec.config.num_blocks,
                                  f"exceeds this allocator's limit of {limit} blocks per pool "
                                  f"(kvservice serve --max-pool-blocks)")
        if spec.pool_id in state.external:
            raise pool_id_taken(spec.pool_id)
        current = state.pools.get(spec.pool_id)
        if current is not None and current.moving_to:
            state.mutable_pool(spec.pool_id)  # raises: it is moving
        if current is not None and not command.admin and current.owner_tenant != session.tenant:
            raise foreign_pool(spec.pool_id)
        declared = state.hash_spec_of(spec)
        if command.fingerprint != declared.fingerprint():
            raise FailedPrecondition(
                f"hash_fingerprint {command.fingerprint!r} does not match the declared hash spec's "
                f"{declared.fingerprint()!r} ({describe(declared)}); hash with the same spec")
        if current is not None and spec.epoch < current.epoch:
            raise FailedPrecondition(f"pool {spec.pool_id!r}: epoch {spec.epoch} is older than the registered "
                                     f"epoch {current.epoch}")
        if current is not None and spec.epoch == current.epoch and current.hash_spec != declared:
            raise FailedPrecondition(
                f"pool {spec.pool_id!r} is registered at epoch {spec.epoch} with hash spec "
                f"{current.hash_spec.fingerprint()!r} ({describe(current.hash_spec)}), not {declared.fingerprint()!r} "
                f"({describe(declared)}); register with a higher epoch to replace it")
        if spec.suspend_on_session_end and not spec.bound_to_session:
            raise InvalidArgument("suspend_on_session_end", True, "a pool is suspended when its bound session ends: "
                                  "set bound_to_session too")
        if current is not None and spec.epoch == current.epoch and not current.spec.same_shape(spec):
            raise FailedPrecondition(f"pool {spec.pool_id!r} is registered at epoch {spec.epoch} with another "
                                     f"config; register with a higher epoch to replace it")
        return current

    def register(self, session: Session, command: RegisterPool, current: Pool | None) -> RegisterResult:
        """Registers (or re-registers) a pool; `check` passed."""
        spec = command.spec
        if current is not None and spec.epoch == current.epoch:
            if spec.suspend_on_session_end:  # its store is back (or restarted before its old lease lapsed)
                if current.suspended:
                    logger.info("pool %s: resumed at epoch %d by session %s", current.pool_id, current.epoch,
                                session.session_id)
                current.bound_session, current.suspended = session.session_id, False
            if spec.endpoint != current.spec.endpoint:  # its store's agent restarted: same pages, new endpoint
                current.spec = replace(current.spec, endpoint=spec.endpoint)
                logger.info("pool %s: endpoint replaced at epoch %d (%d bytes)", current.pool_id, current.epoch,
                            len(spec.endpoint))
            return self._result(current, False, 0)
        pool = self.state.new_pool(spec)  # validates the config
        pool.owner_tenant = current.owner_tenant if current is not None else session.tenant
        pool.bound_session = session.session_id if spec.bound_to_session else ""
        failed = self._retire(current, pool) if current is not None else 0
        self.state.pools[spec.pool_id] = pool
        return self._result(pool, True, failed)

    def end_sessions(self, ended: set[str]) -> None:
        """The pools bound to sessions that ended: suspended when their pages outlive the store
        (suspend_on_session_end), else retired (their memory went with the store's process). A pool moving
        between shards stays frozen as it is: the store registers it again wherever it lands."""
        pools = self.state.pools
        for pool_id in sorted(p for p, pool in pools.items()
                              if pool.bound_session in ended and not pool.moving_to and not pool.suspended):
            pool = pools[pool_id]
            if pool.spec.suspend_on_session_end:
                pool.suspended = True
                logger.warning("pool %s: suspended at epoch %d (session %s ended), %d cached blocks kept", pool_id,
                               pool.epoch, pool.bound_session, pool.num_cached_blocks())
            else:
                self.bump_epoch(pool_id)

    def bump_epoch(self, pool_id: str) -> None:
        """Forces a new epoch (stale recovery): same config, fresh memory."""
        old = self.state.pools[pool_id]
        pool = self.state.new_pool(old.spec.with_epoch(old.epoch + 1))
        pool.owner_tenant = old.owner_tenant
        self._retire(old, pool)
        self.state.pools[pool_id] = pool

    def _result(self, pool: Pool, new_epoch: bool, failed: int) -> RegisterResult:
        spec = pool.hash_spec
        return RegisterResult(pool.pool_id, pool.epoch, new_epoch, pool.hash_block_size, pool.hash_seed, failed,
                              pool.manager.scheduler_block_size, spec.algorithm, spec.fingerprint())

    def _retire(self, old: Pool, new: Pool) -> int:
        """A new epoch: every in-flight request fails (and every transfer from or to the pool)."""
        state = self.state
        for transfer in state.transfers.involving(old.pool_id):
            self.book.abort_transfer(transfer, reason=f"pool {old.pool_id!r} restarted (epoch {new.epoch})")
        new.tombstones = old.tombstones
        reason = (f"pool {old.pool_id!r} started epoch {new.epoch} (was {old.epoch}): its KV memory is gone; "
                  f"re-add the request")
        for key in list(old.requests):
            session = state.sessions.sessions.get(old.owner.get(key, ""))
            if session is not None:
                session.disown(old.pool_id, key)
            old.bury(key, reason)
        state.usage.drop_pool(old.pool_id)
        state.events.extend(old.pool_id, [*old.manager.take_events(), AllBlocksCleared()], old.hash_bytes)
        old.manager.block_pool.release()
        logger.warning("pool %s: epoch %d -> %d, %d requests failed", old.pool_id, old.epoch, new.epoch,
                       len(old.requests))
        return len(old.requests)

"""Request bookkeeping: which requests a pool holds, which session owns each, what an op on a missing
one answers, and the lifecycle ops that need no scheduling (add, fork, free; closing a session;
aborting a transfer, which frees the request that waited for it)."""

from __future__ import annotations

import logging

from kvservice.allocator.keys import namespace, request_key, tenant_of
from kvservice.allocator.pins import release_session_pins
from kvservice.allocator.pools import Pool
from kvservice.allocator.sessions import Session
from kvservice.allocator.state import AllocatorState
from kvservice.allocator.transfers import Transfer
from kvservice.core import Request
from kvservice.ops import AddRequestOp, ForkOp, FreeOp, OpResult, OpStatus, RemoveSkippedBlocksOp

logger = logging.getLogger(__name__)


class RequestBook:
    def __init__(self, state: AllocatorState) -> None:
        self.state = state

    # ---- answers -------------------------------------------------------------------------------
    @staticmethod
    def missing(pool: Pool, key: str, request_id: str) -> OpResult:
        """NOT_FOUND, or EPOCH_CHANGED for a request an epoch change failed."""
        reason = pool.tombstones.get(key)
        if reason is not None:
            return OpResult(request_id, OpStatus.EPOCH_CHANGED, reason)
        return OpResult(request_id, OpStatus.NOT_FOUND, f"request {request_id!r} not found in pool {pool.pool_id!r}")

    def session_full(self, session: Session, request_id: str) -> OpResult | None:
        limit = self.state.settings.max_requests_per_session
        held = session.num_requests()
        if held < limit:
            return None
        return OpResult(request_id, OpStatus.RESOURCE_EXHAUSTED,
                        f"session {session.session_id!r} holds {held} requests, the limit is {limit}; free some first")

    def refuse_add(self, pool: Pool, session: Session, key: str, request_id: str) -> OpResult | None:
        """Why a request cannot be added (ALREADY_EXISTS, the session's limit), or None."""
        if key in pool.requests:
            return OpResult(request_id, OpStatus.ALREADY_EXISTS,
                            f"request {request_id!r} already exists in pool {pool.pool_id!r}")
        return self.session_full(session, request_id)

    # ---- lifecycle -----------------------------------------------------------------------------
    @staticmethod
    def track(pool: Pool, session: Session, key: str, req: Request) -> None:
        """A new request of the pool, owned by the session."""
        pool.requests[key] = req
        pool.owner[key] = session.session_id
        pool.tombstones.pop(key, None)
        session.own(pool.pool_id, key)

    def add(self, pool: Pool, session: Session, op: AddRequestOp) -> OpResult:
        tenant = session.tenant
        key = request_key(tenant, op.request_id)
        refused = self.refuse_add(pool, session, key, op.request_id)
        if refused is not None:
            return refused
        ns = namespace(tenant)
        if op.block_hashes is not None:
            req = pool.request_from_hashes(key, op.block_hashes, op.num_tokens, op.lora_name, ns, op.num_prompt_tokens)
        else:
            req = pool.request_from_tokens(key, op.token_ids, op.cache_salt, op.lora_name, op.mm_items, ns)
        self.track(pool, session, key, req)
        return OpResult(op.request_id, num_tokens=req.num_tokens)

    def fork(self, pool: Pool, session: Session, op: ForkOp) -> OpResult:
        tenant = session.tenant
        parent_key = request_key(tenant, op.parent_request_id)
        parent = pool.requests.get(parent_key)
        if parent is None:
            return self.missing(pool, parent_key, op.parent_request_id)
        child_key = request_key(tenant, op.child_request_id)
        if child_key in pool.requests:
            return OpResult(op.child_request_id, OpStatus.ALREADY_EXISTS,
                            f"request {op.child_request_id!r} already exists in pool {pool.pool_id!r}")
        if not pool.manager.coordinator.is_running(parent_key):
            return OpResult(op.child_request_id, OpStatus.FAILED_PRECONDITION,
                            f"parent {op.parent_request_id!r} holds no blocks yet: allocate it before forking")
        full = self.session_full(session, op.child_request_id)
        if full is not None:
            return full
        pending = self.state.transfers.pending(pool.pool_id, parent_key)
        if pending is not None:
            return OpResult(op.child_request_id, OpStatus.FAILED_PRECONDITION,
                            f"parent {op.parent_request_id!r} waits for transfer {pending}: commit it first")
        child = pool.manager.fork(parent, child_key)
        self.track(pool, session, child_key, child)
        self.state.usage.update(tenant, pool, child_key)
        return OpResult(op.child_request_id, new_block_ids=pool.manager.get_block_ids(child_key),
                        num_computed_tokens=child.num_computed_tokens, num_tokens=child.num_tokens)

    def free_op(self, pool: Pool, session: Session, op: FreeOp) -> OpResult:
        key = request_key(session.tenant, op.request_id)
        if key not in pool.requests:
            result = self.missing(pool, key, op.request_id)
            pool.tombstones.pop(key, None)  # the client knows now: later ops answer NOT_FOUND
            return result
        self.free(pool, session.tenant, key, op.popped)
        return OpResult(op.request_id)

    def remove_skipped_blocks(self, pool: Pool, tenant: str, op: RemoveSkippedBlocksOp) -> OpResult:
        """vLLM's remove_skipped_blocks for a live request (its blocks no later token reads are freed)."""
        key = request_key(tenant, op.request_id)
        req = pool.requests.get(key)
        if req is None:
            return self.missing(pool, key, op.request_id)
        # (Not bounded by the request's tokens here: a finishing request's last sampled tokens never reach the
        # pool. A count past them frees only this request's own blocks, as a FreeOp would.)
        pool.manager.remove_skipped_blocks(key, op.processed_computed_tokens, req.num_prompt_tokens)
        if self.state.usage.quotas:
            self.state.usage.update(tenant, pool, key)
        return OpResult(op.request_id)

    def free(self, pool: Pool, tenant: str, key: str, popped: bool = False) -> None:
        """Frees a live request (its blocks tail first; `popped`: in vLLM's deferred-free order) and whatever
        transfer it waited for."""
        transfers = self.state.transfers
        pending = transfers.pending(pool.pool_id, key)
        if pending is not None:  # its prefix will never be copied: drop the source pins
            transfers.close(transfers.transfers[pending], self.state.pools, commit=False)
        req = pool.requests.pop(key)
        if popped:
            manager = pool.manager
            manager.block_pool.free_blocks(reversed(manager.pop_blocks_for_free(req)))
        else:
            pool.manager.free(req)
        owner = self.state.sessions.sessions.get(pool.owner.pop(key, ""))
        if owner is not None:
            owner.disown(pool.pool_id, key)
        self.state.usage.update(tenant, pool, key, removed=True)

    def abort_transfer(self, transfer: Transfer, reason: str = "") -> None:
        """Drops the source pins and frees the destination request (it never got its prefix)."""
        state = self.state
        state.transfers.close(transfer, state.pools, commit=False)
        dst = state.pools.get(transfer.dst_pool)
        if dst is not None and transfer.dst_key in dst.requests:
            key = transfer.dst_key
            self.free(dst, tenant_of(key), key)
            if reason:
                dst.bury(key, f"transfer {transfer.transfer_id} aborted: {reason}; re-add the request")
            state.drain(dst)

    def close_session(self, session_id: str) -> int:
        """Frees every request of a session (its lease lapsed) and aborts its transfers."""
        state = self.state
        session = state.sessions.sessions.pop(session_id)
        for transfer in state.transfers.of_session(session_id):
            self.abort_transfer(transfer)
        release_session_pins(state, session_id)
        num_freed = 0
        for pool_id, keys in session.requests.items():
            pool = state.pools.get(pool_id)
            if pool is None:
                continue
            for key in sorted(keys):
                if key in pool.requests:
                    self.free(pool, session.tenant, key)
                    num_freed += 1
            state.drain(pool)
        state.lease_expiries += 1
        logger.info("session %s closed: %d requests freed", session_id, num_freed)
        return num_freed

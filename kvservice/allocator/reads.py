"""The Allocator's reads: sessions' leases, requests, pool statistics, lookups and the invariant check. None
changes the state (only Allocator.apply does)."""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.allocator.keys import client_request_id, request_key
from kvservice.allocator.pools import Pool
from kvservice.allocator.sessions import Session
from kvservice.core import Request
from kvservice.core.invariants import InvariantError, check_invariants
from kvservice.errors import NotFound
from kvservice.results import LookupResult, PoolStats, RequestInfo


class AllocatorReads:
    """Allocator's read methods (it holds `state` and `placement`)."""

    def renew(self, session_id: str, tenant: str, now: float) -> Session:
        """The caller's session, its lease renewed (a heartbeat)."""
        return self.state.sessions.get(session_id, tenant, now)

    def expired_sessions(self, now: float) -> list[str]:
        return [s.session_id for s in self.state.sessions.expired(now)]

    def pool(self, pool_id: str) -> Pool:
        return self.state.pool(pool_id)

    def get_request(self, tenant: str, pool_id: str, request_id: str, admin: bool = True) -> tuple[Pool, Request]:
        pool = self.state.pool(pool_id, tenant, admin)
        key = request_key(tenant, request_id)
        req = pool.requests.get(key)
        if req is None:
            reason = pool.tombstones.get(key)
            raise NotFound(reason or f"request {request_id!r} not found in pool {pool_id!r}")
        return pool, req

    def request_info(self, tenant: str, pool_id: str, request_id: str, admin: bool = True) -> RequestInfo:
        pool = self.state.pool(pool_id, tenant, admin)
        pin = pool.pins.get(request_key(tenant, request_id))
        if pin is not None:  # a live pin: its held blocks (a reader checks its pin outlived its copy)
            return RequestInfo(request_id, pool.pool_id, pin.num_tokens, pin.num_tokens, (list(pin.block_ids),),
                               0, False, pin.session_id)
        pool, req = self.get_request(tenant, pool_id, request_id, admin)
        key = req.request_id
        return RequestInfo(request_id, pool.pool_id, req.num_tokens, req.num_computed_tokens,
                           pool.manager.get_block_ids(key), len(req.block_hashes),
                           pool.manager.coordinator.is_running(key), pool.owner.get(key, ""))

    def pool_stats(self, tenant: str = "", admin: bool = True, check_invariants: bool = False,
                   pool_ids: Sequence[str] = ()) -> list[PoolStats]:
        """Per pool the caller sees (its tenant's; an admin: all), only `pool_ids` if any are given.
        `check_invariants` walks every block of each. A pool's endpoint is a capability: only its own tenant
        gets the bytes (an admin sees that another tenant's pool has one, by its size, never the bytes)."""
        transfers = self.state.transfers.transfers.values()
        wanted = set(pool_ids)
        out = []
        for pool in self.state.visible_pools(tenant, admin):
            if wanted and pool.pool_id not in wanted:
                continue
            m = pool.manager
            bp = m.block_pool
            totals = m.prefix_cache_totals
            endpoint = pool.spec.endpoint
            out.append(PoolStats(pool.pool_id, pool.epoch, bp.num_blocks, bp.get_num_free_blocks(), bp.get_usage(),
                                 len(pool.requests), totals.hit_rate, totals.queries, totals.hits, bp.num_evictions,
                                 len(bp.cached_block_hash_to_block),
                                 self.invariant_violation(pool) if check_invariants else "",
                                 sum(1 for t in transfers if pool.pool_id in (t.src_pool, t.dst_pool)),
                                 pool.plain_prefix, pool.moving_to, pool.suspended,
                                 endpoint if pool.owner_tenant == tenant else b"", len(endpoint)))
        return out

    def lookup(self, tenant: str, token_ids=None, block_hashes: Sequence[bytes] | None = None, num_tokens: int = 0,
               cache_salt: str | None = None, lora_name: str | None = None,
               pool_ids: Sequence[str] = (), admin: bool = True) -> LookupResult:
        return self.placement.lookup(tenant, token_ids, block_hashes, num_tokens, cache_salt, lora_name, pool_ids,
                                     admin)

    def invariant_violation(self, pool: Pool) -> str:
        try:
            check_invariants(pool.manager)
        except InvariantError as exc:
            return str(exc)
        live = {req.request_id for req in pool.requests.values()}
        live |= {t.holder for t in self.state.transfers.transfers.values() if t.src_pool == pool.pool_id}
        live |= {pin.holder for pin in pool.pins.values()}
        for manager in pool.manager.coordinator.managers:
            stray = set(manager.req_to_blocks) - live
            if stray:
                return f"blocks held for unknown requests {sorted(map(client_request_id, stray))[:5]}"
        return ""

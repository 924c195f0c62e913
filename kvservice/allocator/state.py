"""Everything the allocator knows, in one record the layers above share (and snapshots save whole)."""

from __future__ import annotations

from kvservice.allocator.events import EventLog
from kvservice.allocator.pools import Pool, TenantUsage
from kvservice.allocator.sessions import SessionTable
from kvservice.allocator.transfers import TransferBook
from kvservice.errors import NotFound, Unavailable
from kvservice.external.registry import ExternalPools
from kvservice.hashing import HashSpec, spec_fingerprint
from kvservice.hashing.spec import KVSERVICE
from kvservice.settings import AllocatorSettings


class AllocatorState:
    def __init__(self, settings: AllocatorSettings) -> None:
        self.settings = settings
        self.fingerprint = spec_fingerprint(settings.hash_seed, settings.hash_block_size)
        self.pools: dict[str, Pool] = {}
        self.sessions = SessionTable(settings.session_ttl_s)
        self.events = EventLog(settings.event_retention)
        self.usage = TenantUsage(dict(settings.quotas))
        self.transfers = TransferBook(settings.min_transfer_tokens)
        self.lease_expiries = 0
        self.external = ExternalPools()  # stock vLLM engines indexed from their KV events

    def replace(self, other: AllocatorState) -> None:
        """Takes `other`'s contents (a fully decoded snapshot) in place; the event log's listeners stay."""
        self.pools = other.pools
        self.sessions = other.sessions
        self.events.next_sequence = other.events.next_sequence
        self.usage = other.usage
        self.transfers = other.transfers
        self.lease_expiries = other.lease_expiries
        self.external = other.external

    def pool(self, pool_id: str, tenant: str | None = None, admin: bool = True) -> Pool:
        """The pool, if the caller may see it: its own tenant's or, for an admin, any (`tenant` None: any).
        Another tenant's pool is NOT_FOUND, exactly as one that does not exist."""
        pool = self.pools.get(pool_id)
        if pool is None or not (admin or tenant is None or pool.owner_tenant == tenant):
            raise NotFound(f"pool {pool_id!r} is not registered; call RegisterPool first")
        return pool

    def mutable_pool(self, pool_id: str, tenant: str | None = None, admin: bool = True) -> Pool:
        """`pool()`, for a mutation: a pool a rebalance is moving takes none (UNAVAILABLE, retry)."""
        pool = self.pool(pool_id, tenant, admin)
        if pool.moving_to:
            raise Unavailable(f"pool {pool_id!r} is moving to shard {pool.moving_to!r}; retry shortly (the shard "
                              f"map will say where it is)")
        return pool

    def visible_pools(self, tenant: str, admin: bool) -> list[Pool]:
        """The pools a caller sees (in GetStats and Lookup): its tenant's, or every pool for an admin."""
        return [p for p in self.pools.values() if admin or p.owner_tenant == tenant]

    def hash_spec_of(self, spec) -> HashSpec:
        """The hash spec a PoolSpec declares (none: kvservice's own with this allocator's seed)."""
        settings = self.settings
        return spec.hash_spec or HashSpec(KVSERVICE, settings.hash_seed, settings.hash_block_size)

    def new_pool(self, spec) -> Pool:
        settings = self.settings
        return Pool(spec, settings.hash_block_size, settings.hash_seed, settings.fast_path)

    def drain(self, pool: Pool) -> None:
        """Moves the core's pending cache events of `pool` into the event log."""
        events = pool.manager.take_events()
        if events:
            self.events.extend(pool.pool_id, events, pool.hash_bytes)

"""Result records of the allocator API other than a Step's (those are in `kvservice.ops`): what the
allocator returns, what the wire carries and what the clients hand to their callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RegisterResult:
    pool_id: str
    epoch: int
    new_epoch: bool
    hash_block_size: int
    hash_seed: str
    num_requests_failed: int
    scheduler_block_size: int
    hash_algorithm: str = "kvservice"
    hash_fingerprint: str = ""


@dataclass(slots=True)
class SessionOpened:
    """OpenSession's reply: the session (new, or the resumed one) and the pools a stale resume restarted."""

    session_id: str
    tenant: str
    next_sequence: int
    ttl_ms: int
    pools_failed: list[str] = field(default_factory=list)


@dataclass(slots=True)
class PoolHit:
    pool_id: str
    num_cached_tokens: int
    num_free_blocks: int
    num_cached_blocks: int = 0
    external: bool = False  # an external pool (kvservice.external): num_cached_tokens is its GPU tier
    tiers: dict[str, int] = field(default_factory=dict)  # an external pool: hit tokens per medium
    suspended: bool = False  # its store is away (PoolStats.suspended): no hit, never the best pool


def best_pool(hits: list[PoolHit], first_block_hash: bytes | None) -> str:
    """Where a KV-aware router sends a prompt: the longest cached prefix; ties to the most free blocks that
    hold nothing cached (filling them evicts no one's prefix); remaining ties by the prompt's first block
    hash, so a prompt family keeps landing on the same pool instead of every cold prompt piling onto the
    first one. A suspended pool takes no allocation: it is never picked. The same rule whether one allocator or
    a client over several shards applies it."""
    best, most, names = -1, -1, []  # one pass: a router asks this once per request
    for h in hits:
        tokens = h.num_cached_tokens
        if h.suspended or tokens < best:
            continue
        empty = h.num_free_blocks - h.num_cached_blocks
        if empty < 0:
            empty = 0
        if tokens > best:
            best, most, names = tokens, empty, [h.pool_id]
        elif empty > most:
            most, names = empty, [h.pool_id]
        elif empty == most:
            names.append(h.pool_id)
    if not names:
        return ""
    if len(names) == 1 or not first_block_hash:
        return min(names)
    names.sort()
    return names[int.from_bytes(first_block_hash[:8], "big") % len(names)]


class PoolHits(list):
    """A Lookup's hits: a list of PoolHit (iterate, index, compare with a list as before) that also answers
    by pool id, `hits["engine-0"]` (KeyError naming the pool when it has none), `"engine-0" in hits`,
    `hits.get(pool_id)` and `hits.pool_ids()`."""

    __slots__ = ()

    def __getitem__(self, key):  # type: ignore[override]
        if isinstance(key, str):
            for hit in self:
                if hit.pool_id == key:
                    return hit
            raise KeyError(f"no hit for pool {key!r} (pools answered: {', '.join(self.pool_ids()) or 'none'})")
        return list.__getitem__(self, key)

    def __contains__(self, key) -> bool:
        if isinstance(key, str):
            return any(hit.pool_id == key for hit in self)
        return list.__contains__(self, key)

    def get(self, pool_id: str, default: PoolHit | None = None) -> PoolHit | None:
        return next((hit for hit in self if hit.pool_id == pool_id), default)

    def pool_ids(self) -> list[str]:
        return [hit.pool_id for hit in self]


@dataclass(slots=True)
class LookupResult:
    hits: PoolHits  # a list of PoolHit that also answers `hits[pool_id]`
    best_pool_id: str
    # Sharded fan-out: the shards that did not answer (down, or slower than the client's fan_out_grace_s):
    # their pools are not in `hits`, and best_pool_id is the best of the pools that answered.
    missing_shards: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.hits, PoolHits):
            self.hits = PoolHits(self.hits)

    def tokens(self, pool_id: str) -> int:
        return next((h.num_cached_tokens for h in self.hits if h.pool_id == pool_id), 0)


@dataclass(slots=True)
class ResetResult:
    reset_pool_ids: list[str]
    refused_pool_ids: list[str]


@dataclass(slots=True)
class RequestInfo:
    request_id: str
    pool_id: str
    num_tokens: int
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]
    num_block_hashes: int
    running: bool
    session_id: str = ""


@dataclass(slots=True)
class PoolStats:
    pool_id: str
    epoch: int
    num_blocks: int
    num_free_blocks: int
    usage: float
    num_requests: int
    prefix_hit_rate: float
    prefix_queries: int
    prefix_hits: int
    evictions: int
    num_cached_blocks: int
    invariant_violation: str
    num_pending_transfers: int = 0
    plain_prefix: bool = False  # a replica of the index answers its Lookup exactly (kvservice.client.index)
    moving_to: str = ""  # frozen by a pool move on its way to this shard
    suspended: bool = False  # its bound session ended (suspend_on_session_end): cached blocks kept, no hit
    # RegisterPool's endpoint (a store's NIXL agent metadata, a capability): only for the pool's own tenant;
    # anyone else who sees the pool (an admin) gets b"" and only endpoint_size, its length
    endpoint: bytes = b""
    endpoint_size: int = 0


@dataclass(slots=True)
class Stats:
    pools: dict[str, PoolStats]
    num_sessions: int
    persistence: str
    event_sequence: int
    lease_expiries: int
    hash_fingerprint: str
    hash_block_size: int
    state_digest: str = ""
    leader_epoch: int = 0
    external_pools: dict = field(default_factory=dict)  # pool id -> kvservice.external.wire.ExternalPoolStats


@dataclass(slots=True)
class Event:
    sequence: int
    pool_id: str
    kind: str  # "stored" | "removed" | "cleared" | "synced" (the end of an include_state dump)
    block_hashes: list[bytes]
    parent_block_hash: bytes | None = None
    token_ids: list[int] | None = None
    block_ids: list[int] | None = None
    group_idx: int = 0

"""Lookup and placement across pools: per pool, how many prefix tokens an admission would reuse, and the
pool a KV-aware router should pick. Read-only (no touch, no statistics)."""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.allocator.keys import namespace
from kvservice.allocator.pools import Pool
from kvservice.allocator.state import AllocatorState
from kvservice.external.pool import ExternalPool
from kvservice.external.registry import ExternalRegistry
from kvservice.hashing import hash_prompt
from kvservice.results import LookupResult, PoolHit


class Placement:
    def __init__(self, state: AllocatorState, external: ExternalRegistry) -> None:
        self.state = state
        self.external = external

    def lookup(self, tenant: str, token_ids=None, block_hashes: Sequence[bytes] | None = None, num_tokens: int = 0,
               cache_salt: str | None = None, lora_name: str | None = None,
               pool_ids: Sequence[str] = (), admin: bool = True) -> LookupResult:
        """Over the pools the caller sees (`pool_ids`: these, each one it sees; else all it sees)."""
        settings = self.state.settings
        ns = namespace(tenant)
        if block_hashes is None:
            raw = hash_prompt(token_ids, settings.hash_block_size, settings.hash_seed, cache_salt, lora_name)
            num_tokens = len(token_ids)
        else:
            raw = list(block_hashes)
            num_tokens = num_tokens or len(raw) * settings.hash_block_size
        hashes = [h + ns for h in raw] if ns else raw
        state = self.state
        external = self.external
        if pool_ids:
            pools = [state.pool(p, tenant, admin) for p in pool_ids if p not in state.external]
            externals = [external.pool(p, tenant, admin) for p in pool_ids if p in state.external]
        else:
            pools, externals = state.visible_pools(tenant, admin), external.visible(tenant, admin)
        hits = [PoolHit(p.pool_id, p.cached_prefix_tokens(hashes, num_tokens),
                        p.manager.block_pool.get_num_free_blocks()) for p in pools]
        if externals:  # ranked with the others: an engine kvservice does not allocate for is a pool too
            hits += external.hits(externals, raw, num_tokens, token_ids, cache_salt, lora_name)
        return LookupResult(hits, self.place([*pools, *externals], hits, raw))

    @staticmethod
    def place(pools: list[Pool | ExternalPool], hits: list[PoolHit], raw_hashes: Sequence[bytes]) -> str:
        """Longest cached prefix; ties to the most free blocks that hold nothing cached (filling them
        evicts no one's prefix; an external pool publishes no free count: 0); remaining ties by the
        prompt's first block hash, so a prompt family keeps landing on the same pool instead of every
        cold prompt piling onto the first one."""
        if not hits:
            return ""
        best = max(h.num_cached_tokens for h in hits)
        tied = [(p, h) for p, h in zip(pools, hits) if h.num_cached_tokens == best]
        empty = {p.pool_id: 0 if h.external else
                 max(0, h.num_free_blocks - len(p.manager.block_pool.cached_block_hash_to_block)) for p, h in tied}
        most = max(empty.values())
        names = sorted(p.pool_id for p, _ in tied if empty[p.pool_id] == most)
        if len(names) == 1 or not raw_hashes:
            return names[0]
        return names[int.from_bytes(raw_hashes[0][:8], "big") % len(names)]

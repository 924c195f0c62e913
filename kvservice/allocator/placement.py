"""Lookup and placement across pools: per pool, how many prefix tokens an admission would reuse, and the
pool a KV-aware router should pick. Read-only (no touch, no statistics)."""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.allocator.keys import namespace
from kvservice.allocator.state import AllocatorState
from kvservice.external.registry import ExternalRegistry
from kvservice.hashing import HashSpec, hash_prompt
from kvservice.results import LookupResult, PoolHit, best_pool


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
        state = self.state
        external = self.external
        if pool_ids:
            pools = [state.pool(p, tenant, admin) for p in pool_ids if p not in state.external]
            externals = [external.pool(p, tenant, admin) for p in pool_ids if p in state.external]
        else:
            # A copy a pool move froze here (it serves on its new shard, or soon will) is not a hit: it
            # would answer beside the pool's real one, and it serves no step.
            pools = [p for p in state.visible_pools(tenant, admin) if not p.moving_to]
            externals = external.visible(tenant, admin)
        hits = []
        by_spec: dict[HashSpec, list[bytes] | None] = {}  # each pool asked in its own hash spec
        for p in pools:
            if p.suspended:  # its store is away: nothing it holds can be read now
                bp = p.manager.block_pool
                hits.append(PoolHit(p.pool_id, 0, bp.get_num_free_blocks(), len(bp.cached_block_hash_to_block),
                                    suspended=True))
                continue
            spec = p.hash_spec
            if spec not in by_spec:
                by_spec[spec] = self._hashes(p, raw, token_ids, block_hashes is not None, cache_salt, lora_name, ns)
            hashes = by_spec[spec]
            hits.append(PoolHit(p.pool_id, p.cached_prefix_tokens(hashes, num_tokens) if hashes is not None else 0,
                                p.manager.block_pool.get_num_free_blocks(),
                                len(p.manager.block_pool.cached_block_hash_to_block)))
        if externals:  # ranked with the others (best_pool: no free blocks published, so 0 empty ones)
            hits += external.hits(externals, raw, num_tokens, token_ids, cache_salt, lora_name)
        return LookupResult(hits, best_pool(hits, raw[0] if raw else None))

    def _hashes(self, pool, raw: list[bytes], token_ids, by_hashes: bool, cache_salt: str | None,
                lora_name: str | None, ns: bytes) -> list[bytes] | None:
        """The prompt's block hashes as `pool` keys them (namespaced), or None when a Lookup by hashes came in
        another spec's length (it cannot hit)."""
        spec = pool.hash_spec
        if by_hashes:
            if raw and len(raw[0]) != spec.hash_bytes:
                return None
        elif not (spec.is_kvservice and spec.effective_seed == self.state.settings.hash_seed):
            raw = pool.request_from_tokens("lookup", token_ids, cache_salt, lora_name).block_hashes
        return [h + ns for h in raw] if ns else raw

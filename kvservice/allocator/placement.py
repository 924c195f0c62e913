"""Lookup and placement across pools: per pool, how many prefix tokens an admission would reuse, and the
pool a KV-aware router should pick. Read-only (no touch, no statistics).

Pools whose hit is the unbroken run of the prompt's hashes they hold (one full-attention group of hash-sized
blocks in kvservice's chain, no EAGLE drop; external pools of hash-sized blocks holding GPU blocks only) are
answered by one walk of the prompt per key space over a GlobalIndex, whatever their number; every other pool
is asked on its own (its hybrid groups' fixed point, its own hash spec, its tiers). With
`AllocatorSettings.lookup_index` off every pool is asked on its own: the reference the walk is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.allocator.global_index import GlobalIndex, Member
from kvservice.allocator.keys import namespace
from kvservice.allocator.state import AllocatorState
from kvservice.core.block import make_block_hash_with_group_id
from kvservice.external.nodes import TIERS
from kvservice.external.registry import ExternalRegistry
from kvservice.hashing import HASH_BYTES, HashSpec, hash_prompt
from kvservice.results import LookupResult, PoolHit, best_pool

_GPU_ONLY = {t: 0 for t in TIERS}


class Placement:
    def __init__(self, state: AllocatorState, external: ExternalRegistry) -> None:
        self.state = state
        self.external = external
        self.pool_index = GlobalIndex()  # kvservice pools' map keys: hash || tenant namespace || group 0
        self.gpu_index = GlobalIndex()  # external pools' GPU-tier keys: kvservice chain hashes

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
        by_hashes = block_hashes is not None
        if settings.lookup_index:
            hits = self._indexed_hits(pools, raw, num_tokens, token_ids, by_hashes, cache_salt, lora_name, ns)
            if externals:
                hits += self._indexed_external_hits(externals, raw, num_tokens, token_ids, cache_salt, lora_name)
        else:
            hits = self._pool_hits(pools, raw, num_tokens, token_ids, by_hashes, cache_salt, lora_name, ns)
            if externals:  # ranked with the others (best_pool: no free blocks published, so 0 empty ones)
                hits += external.hits(externals, raw, num_tokens, token_ids, cache_salt, lora_name)
        return LookupResult(hits, best_pool(hits, raw[0] if raw else None))

    # ---- each pool on its own (the reference) ------------------------------------------------------
    def _pool_hits(self, pools, raw: list[bytes], num_tokens: int, token_ids, by_hashes: bool,
                   cache_salt: str | None, lora_name: str | None, ns: bytes) -> list[PoolHit]:
        hits = []
        by_spec: dict[HashSpec, list[bytes] | None] = {}  # each pool asked in its own hash spec
        for p in pools:
            bp = p.manager.block_pool
            if p.suspended:  # its store is away: nothing it holds can be read now
                hits.append(PoolHit(p.pool_id, 0, bp.get_num_free_blocks(), len(bp.cached_block_hash_to_block),
                                    suspended=True))
                continue
            spec = p.hash_spec
            if spec not in by_spec:
                by_spec[spec] = self._hashes(p, raw, token_ids, by_hashes, cache_salt, lora_name, ns)
            hashes = by_spec[spec]
            hits.append(PoolHit(p.pool_id, p.cached_prefix_tokens(hashes, num_tokens) if hashes is not None else 0,
                                bp.get_num_free_blocks(), len(bp.cached_block_hash_to_block)))
        return hits

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

    # ---- one walk for the pools a GlobalIndex answers -------------------------------------------------
    def _indexed_hits(self, pools, raw: list[bytes], num_tokens: int, token_ids, by_hashes: bool,
                      cache_salt: str | None, lora_name: str | None, ns: bytes) -> list[PoolHit]:
        suffix = make_block_hash_with_group_id(ns, 0)  # (the maps' keys: hash || namespace || group 0)
        wrong_length = by_hashes and raw and len(raw[0]) != HASH_BYTES  # (hashes of another spec hit nothing)

        def hit(p, tokens: int) -> PoolHit:
            bp = p.manager.block_pool
            return PoolHit(p.pool_id, tokens, bp.free_block_queue.num_free_blocks, len(bp.cached_block_hash_to_block))

        return self._walked(
            self.pool_index, pools, num_tokens, hit,
            lambda p: p.manager.block_pool.cached_block_hash_to_block if p.indexable and not p.suspended else None,
            lambda n: [] if wrong_length else [x + suffix for x in raw[:n]],
            lambda rest: self._pool_hits(rest, raw, num_tokens, token_ids, by_hashes, cache_salt, lora_name, ns))

    def _indexed_external_hits(self, pools, raw: list[bytes], num_tokens: int, token_ids, cache_salt: str | None,
                               lora_name: str | None) -> list[PoolHit]:
        h = self.state.settings.hash_block_size

        def hit(pool, tokens: int) -> PoolHit:
            tiers = dict(_GPU_ONLY)
            tiers[TIERS[0]] = tokens
            return PoolHit(pool.pool_id, tokens, 0, external=True, tiers=tiers)

        return self._walked(
            self.gpu_index, pools, num_tokens, hit,
            lambda p: p.index if p.index.block_size == h and not (p.index.tier_blocks[1] or p.index.tier_blocks[2])
            else None,
            lambda n: raw,
            lambda rest: self.external.hits(rest, raw, num_tokens, token_ids, cache_salt, lora_name))

    def _walked(self, index: GlobalIndex, pools, num_tokens: int, hit, map_of, keys, others) -> list[PoolHit]:
        """Each pool's hit, in order: those whose map `map_of` gives (else None) from one walk of `keys(n)` (the
        prompt's first n block keys) over `index`, as `hit(pool, tokens)`; the rest from `others(those pools)`."""
        h = self.state.settings.hash_block_size
        hits: list = list(pools)  # each pool, replaced by its hit
        walked: list[int] = []
        members: list[Member] = []
        asked: list[int] = []
        for i, p in enumerate(pools):
            owner = map_of(p)
            if owner is None:
                asked.append(i)
            else:
                walked.append(i)
                members.append(index.member(owner))
        if asked:
            for i, answer in zip(asked, others([pools[i] for i in asked])):
                hits[i] = answer
        if walked:
            max_blocks = (num_tokens - 1) // h if num_tokens > 1 else 0
            for i, depth in zip(walked, index.walk(keys(max_blocks), members, max_blocks)):
                hits[i] = hit(pools[i], depth * h)
        self._prune(index)
        return hits

    def _prune(self, index: GlobalIndex) -> None:
        """Members whose pool is gone (a new epoch's pool replaced it, a move dropped it, a snapshot was loaded)
        leave once they are more than the live pools: their keys lose their bits, their slots are reused."""
        state = self.state
        live_count = len(state.pools) + len(state.external.pools)
        if len(index.members) <= 2 * live_count + 16:
            return
        live = {id(p.manager.block_pool.cached_block_hash_to_block) for p in state.pools.values()}
        live |= {id(p.index) for p in state.external.pools.values()}
        for owner_id, member in list(index.members.items()):
            if owner_id not in live:
                index.leave(member.owner)

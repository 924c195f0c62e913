"""Many pools (one per engine instance, each its own KVCacheManager) and the prefix index across them.

Tenants: request ids and block hashes are namespaced by tenant before they reach the core, so two
tenants never share a request id, a prefix, or a timing difference between hit and miss.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvservice.core import KVCacheConfig, KVCacheManager, Request
from kvservice.core.specs import effective_block_size
from kvservice.hashing import HASH_BYTES, BlockHash

SEP = "\x1f"  # request ids may not contain control characters, so this never collides
MAX_TOMBSTONES = 10_000


def request_key(tenant: str, request_id: str) -> str:
    """The core's request id: the client's, namespaced by tenant."""
    return f"{tenant}{SEP}{request_id}" if tenant else request_id


def client_request_id(key: str) -> str:
    return key.rsplit(SEP, 1)[-1]


def namespace(tenant: str) -> bytes:
    return tenant.encode()


def raw_hash(core_hash: bytes) -> bytes:
    """The tenant-free hash a client computed, from the core's namespaced one."""
    return core_hash[:HASH_BYTES]


@dataclass(slots=True)
class PoolSpec:
    pool_id: str
    config: KVCacheConfig
    max_model_len: int
    dcp_world_size: int = 1
    enable_caching: bool = True
    vocab_size: int = 0
    kv_layout: str = ""
    epoch: int = 0

    def same_shape(self, other: PoolSpec) -> bool:
        return (self.config == other.config and self.max_model_len == other.max_model_len
                and self.dcp_world_size == other.dcp_world_size and self.enable_caching == other.enable_caching
                and self.vocab_size == other.vocab_size and self.kv_layout == other.kv_layout)


class Pool:
    """One KV memory space: its manager, its live requests and who owns them."""

    def __init__(self, spec: PoolSpec, hash_block_size: int, hash_seed: str) -> None:
        self.spec = spec
        self.pool_id = spec.pool_id
        self.epoch = spec.epoch
        self.hash_seed = hash_seed
        self.manager = KVCacheManager(spec.config, spec.max_model_len, spec.enable_caching, enable_events=True,
                                      dcp_world_size=spec.dcp_world_size, hash_block_size=hash_block_size)
        self.requests: dict[str, Request] = {}
        self.owner: dict[str, str] = {}  # request key -> session id
        self.owner_tenant = ""  # the tenant that registered the pool
        # Requests failed by an epoch change: ops on them answer EPOCH_CHANGED (bounded, oldest dropped).
        self.tombstones: OrderedDict[str, str] = OrderedDict()

    @property
    def hash_block_size(self) -> int:
        return self.manager.hash_block_size

    def block_sizes(self) -> list[int]:
        return [effective_block_size(s, self.spec.dcp_world_size) for s in self.spec.config.groups]

    def bury(self, key: str, reason: str) -> None:
        self.tombstones[key] = reason
        while len(self.tombstones) > MAX_TOMBSTONES:
            self.tombstones.popitem(last=False)

    def block_id_set(self, key: str) -> set[int]:
        ids: set[int] = set()
        for manager in self.manager.coordinator.managers:
            for block in manager.req_to_blocks.get(key, ()):
                if not block.is_null:
                    ids.add(block.block_id)
        return ids

    def cached_prefix_tokens(self, hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """Read-only: how many prefix tokens admission would reuse (no touch, no stats)."""
        if not self.manager.enable_caching or num_tokens <= 1:
            return 0
        _, hit = self.manager.coordinator.find_longest_cache_hit(hashes, num_tokens - 1)
        return hit

    def num_cached_blocks(self) -> int:
        return sum(1 for _ in self.manager.block_pool.cached_block_hash_to_block.items())


class TenantUsage:
    """Blocks held by each quota'd tenant's live requests; a block shared by two of its requests
    counts once, cached-free blocks not at all."""

    def __init__(self, quotas: dict[str, int]) -> None:
        self.quotas = quotas
        self._held: dict[str, Counter[tuple[str, int]]] = {t: Counter() for t in quotas}
        self._per_request: dict[tuple[str, str], set[int]] = {}

    def tracks(self, tenant: str) -> bool:
        return tenant in self.quotas

    def used(self, tenant: str) -> int:
        return len(self._held.get(tenant, ()))

    def update(self, tenant: str, pool: Pool, key: str, removed: bool = False) -> None:
        if tenant not in self.quotas:
            return
        held = self._held[tenant]
        old = self._per_request.pop((pool.pool_id, key), set())
        new = set() if removed else pool.block_id_set(key)
        for block_id in old - new:
            k = (pool.pool_id, block_id)
            held[k] -= 1
            if held[k] <= 0:
                del held[k]
        for block_id in new - old:
            held[(pool.pool_id, block_id)] += 1
        if new:
            self._per_request[(pool.pool_id, key)] = new

    def drop_pool(self, pool_id: str) -> None:
        for held in self._held.values():
            for k in [k for k in held if k[0] == pool_id]:
                del held[k]
        for k in [k for k in self._per_request if k[0] == pool_id]:
            del self._per_request[k]

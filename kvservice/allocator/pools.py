"""A pool (one engine instance's KV memory: its KVCacheManager, live requests and their owners) and the
per-tenant block usage that quotas are checked against."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvservice.commands import PoolSpec
from kvservice.core import KVCacheManager, Request
from kvservice.core.block import get_block_hash, get_group_id
from kvservice.core.managers import MambaManager
from kvservice.core.specs import FullAttentionSpec, effective_block_size
from kvservice.hashing import BlockHash, HashSpec, MultiModalItem
from kvservice.hashing.spec import KVSERVICE

MAX_TOMBSTONES = 10_000


class VllmKVCacheManager(KVCacheManager):
    """vLLM 0.33.0's KVCacheManager, as the vLLM drop-in runs the core: a request counts as running only from
    its first hit or cached block, and the watermark applies to the requests the scheduler calls waiting
    (`waiting`, set by each AllocateOp)."""

    track_running = False

    def _is_waiting(self, request) -> bool:
        return getattr(request, "waiting", False)


class Pool:
    """One KV memory space: its manager, its live requests and who owns them."""

    def __init__(self, spec: PoolSpec, hash_block_size: int, hash_seed: str, fast_path: bool = True) -> None:
        self.spec = spec
        self.pool_id = spec.pool_id
        self.epoch = spec.epoch
        # The spec its clients hash with: declared, or kvservice's own with the allocator's seed.
        self.hash_spec = spec.hash_spec or HashSpec(KVSERVICE, hash_seed, hash_block_size)
        self.hash_seed = self.hash_spec.effective_seed
        self.hash_bytes = self.hash_spec.hash_bytes
        if spec.vllm is None:
            self.manager = KVCacheManager(spec.config, spec.max_model_len, spec.enable_caching, enable_events=True,
                                          dcp_world_size=spec.dcp_world_size, hash_block_size=hash_block_size,
                                          enable_fast_path=fast_path)
        else:
            v = spec.vllm
            self.manager = VllmKVCacheManager(
                spec.config, spec.max_model_len, spec.enable_caching, enable_events=True,
                dcp_world_size=spec.dcp_world_size, hash_block_size=hash_block_size, enable_fast_path=False,
                scheduler_block_size=v.scheduler_block_size or None,
                max_in_flight_tokens=v.max_in_flight_tokens or None, watermark=v.watermark, use_eagle=v.use_eagle,
                num_hash_lookahead_tokens=v.num_hash_lookahead_tokens, num_prefill_lookahead=v.num_prefill_lookahead,
                enable_mamba_shared_prefix_checkpoint=v.mamba_shared_prefix_checkpoint)
            for m in self.manager.coordinator.single_type_managers:  # no forks here: vLLM writes in place
                m.copy_on_write = False
                if isinstance(m, MambaManager):
                    m.recache_keyed_tails = v.mamba_recache_keyed_tails
        self.requests: dict[str, Request] = {}
        self.owner: dict[str, str] = {}  # request key -> session id
        self.owner_tenant = ""  # the tenant that registered the pool
        # Requests failed by an epoch change: ops on them answer EPOCH_CHANGED (bounded, oldest dropped).
        self.tombstones: OrderedDict[str, str] = OrderedDict()
        self.moving_to = ""  # frozen while a rebalance moves it to this shard
        self.pins: dict = {}  # pin key -> allocator.pins.Pin: prefixes held for cross-shard transfers
        self.bound_session = ""  # spec.bound_to_session: the session whose end retires (or suspends) the pool
        # spec.suspend_on_session_end, its bound session ended: blocks, index and LRU order kept, but no hit and
        # no new request, allocation or pin until its store registers it again at this epoch
        self.suspended = False
        # Whether a GlobalIndex answers its Lookup: a plain prefix, cached, with no EAGLE block dropped from its
        # hits (its shape never changes: a new shape is a new Pool).
        self.indexable = (self.manager.enable_caching and self.plain_prefix
                          and not getattr(self.manager.coordinator, "drop_eagle_group_ids", ()))

    @property
    def hash_block_size(self) -> int:
        return self.manager.hash_block_size

    @property
    def hashes_may_lag(self) -> bool:
        """Its requests' hashes may trail their full blocks: a vLLM pool with prefix caching (vLLM's lookahead
        hasher hashes a block once the tokens after it exist; vLLM's manager caches only hashed blocks)."""
        return self.spec.vllm is not None and self.spec.enable_caching

    def request_from_tokens(self, key: str, token_ids, cache_salt: str | None = None, lora_name: str | None = None,
                            mm_items: tuple[MultiModalItem, ...] = (), namespace: bytes = b"") -> Request:
        """A request of this pool, hashed by the server in the pool's hash spec."""
        return Request(key, token_ids, self.hash_block_size, cache_salt, lora_name, self.hash_seed, mm_items=mm_items,
                       namespace=namespace, hash_spec=self.hash_spec)

    def request_from_hashes(self, key: str, block_hashes, num_tokens: int, lora_name: str | None = None,
                            namespace: bytes = b"", num_prompt_tokens: int = 0) -> Request:
        """A request of this pool whose client hashed it (in the pool's hash spec); `num_prompt_tokens` when
        `num_tokens` counts output tokens too (0: num_tokens)."""
        # Without prefix caching vLLM hashes nothing, and nothing here would read a hash.
        unhashed = not self.manager.enable_caching and not block_hashes
        req = Request.from_block_hashes(key, block_hashes, num_tokens, self.hash_block_size, lora_name=lora_name,
                                        namespace=namespace, hash_spec=self.hash_spec, unhashed=unhashed,
                                        hashes_may_lag=self.hashes_may_lag and not unhashed)
        if num_prompt_tokens:
            req.num_prompt_tokens = num_prompt_tokens
        return req

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

    @property
    def plain_prefix(self) -> bool:
        """Whether a hit is the longest run of cached block hashes: one full-attention group whose blocks are
        hash blocks, hashed with the allocator's own chain (what a client-side replica of the index, hashing
        prompts as the clients do, can answer exactly)."""
        groups = self.spec.config.groups
        return (self.spec.hash_spec is None and len(groups) == 1 and type(groups[0]) is FullAttentionSpec
                and self.block_sizes()[0] == self.hash_block_size)

    def cached_hashes(self) -> dict[int, list[BlockHash]]:
        """Per group, the (namespaced) hash of every cached block (a hash twice when two blocks carry it)."""
        out: dict[int, list[BlockHash]] = {}
        for key, _ in self.manager.block_pool.cached_block_hash_to_block.items():
            out.setdefault(get_group_id(key), []).append(get_block_hash(key))
        return out

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

"""KV-aware placement in the driver, beside its allocator client: each prompt goes to the pool with the lowest
estimated time to first token (kvservice.router.scoring, the formula `kvservice route` uses: with no load
figures, the longest cached prefix), and each pool's share runs as one batch on its engine.

    Router.generate -> KVServiceClient.lookup (per prompt) -> EngineActor.generate (per pool, in parallel)
                       or PrefixIndex.lookup (a replica of the index in this process: no RPC per prompt)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvservice.client import KVServiceClient, PrefixIndex
from kvservice.router.scoring import Load, Reuse, ScoringWeights, estimate, rank


@dataclass(slots=True, frozen=True)
class Route:
    pool_id: str
    cached_tokens: int  # 0: nothing cached anywhere, chosen round-robin


class Router:
    """KV-aware placement: a prompt goes to the pool with the lowest estimated TTFT, which without load figures
    is the longest cached prefix (ties: the allocator's `best_pool_id`, the most free blocks); round-robin while
    no pool has any of it cached."""

    def __init__(self, client: KVServiceClient, engines: dict[str, object], index: PrefixIndex | None = None) -> None:
        self.client = client
        self.index = index  # answers Lookup from memory when given
        self.engines = engines
        self.pool_ids = list(engines)
        self.routed: Counter = Counter()
        self.routed_by_prefix: Counter = Counter()
        self.weights = ScoringWeights()
        self._next = 0

    def route(self, prompt: list[int]) -> Route:
        lookup = (self.index or self.client).lookup(prompt, pool_ids=self.pool_ids)
        estimates = {p: estimate(len(prompt), Reuse(engine=lookup.tokens(p)), Load(), self.weights)
                     for p in self.pool_ids if p in lookup.hits and not lookup.hits[p].suspended}
        order = rank(estimates, prefer=lookup.best_pool_id, tolerance_s=0.0)
        cached = estimates[order[0]].cached_tokens if order else 0
        if cached > 0:
            return Route(order[0], cached)
        pool_id = self.pool_ids[self._next % len(self.pool_ids)]
        self._next += 1
        return Route(pool_id, 0)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Routes every prompt, runs each pool's share as one batch (pools in parallel), returns outputs in
        prompt order."""
        import ray
        shares: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            route = self.route(prompt)
            shares.setdefault(route.pool_id, []).append(i)
            self.routed[route.pool_id] += 1
            self.routed_by_prefix[route.pool_id] += route.cached_tokens > 0
        refs = {p: self.engines[p].generate.remote([prompts[i] for i in idx], max_tokens) for p, idx in shares.items()}
        outputs: list = [None] * len(prompts)
        for pool_id, idx in shares.items():
            for i, out in zip(idx, ray.get(refs[pool_id])):
                outputs[i] = out
        return outputs

    def close(self) -> None:
        if self.index is not None:
            self.index.close()
        self.client.close()

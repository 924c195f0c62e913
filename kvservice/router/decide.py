"""The routing decision: one Lookup for the prompt (as the request's tenant), each candidate engine's reuse and
load, then the policy's order (retries walk it) and, for P/D fleets, the prefill engines' order."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from dataclasses import dataclass, field

from kvservice.router.backends import STORE_DISK, STORE_RAM
from kvservice.router.fleet import Engine, Fleet
from kvservice.router.metrics import RouterMetrics
from kvservice.router.scoring import TIERS, Calibration, Estimate, Reuse, estimate, rank, rendezvous
from kvservice.router.settings import RouterSettings
from kvservice.router.tenants import Tenants

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Decision:
    order: list[str]  # engines (decode-capable), best first
    predicted: dict[str, int] = field(default_factory=dict)  # cached tokens predicted per engine
    estimates: dict[str, Estimate] = field(default_factory=dict)  # the full formula's, per engine
    prefill_order: list[str] = field(default_factory=list)  # P/D: producers, best first (empty: no prefill step)
    prefill_skipped: bool = False
    prompt_tokens: int | None = None
    hits: dict[str, int] = field(default_factory=dict)  # the Lookup: pool -> cached tokens (this tenant's pools)
    tokens: list[int] | None = None  # the prompt as the router tokenized it
    lookup_ok: bool = False


def reuse_of(engine: Engine, hits: dict, limit: int) -> Reuse:
    """What `engine` could reuse, from a Lookup's hits (pool id -> PoolHit), each capped at `limit` (whole
    blocks, never the prompt's last token: what vLLM and the connector take)."""
    b = engine.backend
    own = hits.get(b.pool)
    tiers = own.tiers if own is not None else {}
    reuse = Reuse(engine=own.num_cached_tokens if own is not None else 0, cpu=tiers.get("CPU", 0),
                  disk=tiers.get("STORAGE", 0))
    if b.connector:
        ram_pool, disk_pool = b.store_pools
        for pool_id, hit in hits.items():
            if hit.suspended:
                continue
            if pool_id == ram_pool:
                reuse.ram = hit.num_cached_tokens
            elif pool_id == disk_pool:
                reuse.disk = max(reuse.disk, hit.num_cached_tokens)
            elif pool_id.startswith(STORE_RAM):
                reuse.remote = max(reuse.remote, hit.num_cached_tokens)
    for name in ("engine", "cpu", "ram", "disk", "remote"):
        setattr(reuse, name, min(getattr(reuse, name), limit))
    return reuse


def is_store(pool_id: str) -> bool:
    return pool_id.startswith((STORE_RAM, STORE_DISK))


def first_block_hash(tokens: list[int] | None, block_size: int) -> int:
    if not tokens:
        return 0
    return int.from_bytes(hashlib.blake2b(repr(tokens[:block_size]).encode(), digest_size=8).digest(), "big")


class Decider:
    def __init__(self, settings: RouterSettings, fleet: Fleet, tenants: Tenants, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.weights = settings.weights()
        self.rates = Calibration(self.weights) if settings.calibrate else None
        self.fleet = fleet
        self.tenants = tenants
        self.metrics = metrics
        self._turn = itertools.count()
        self._export_rates()

    async def lookup(self, tokens: list[int], allocator_token: str | None, cache_salt: str | None,
                     stores: bool) -> dict | None:
        """The Lookup's hits by pool. With `stores` (and --store-namespace) a second Lookup goes out with it, in
        parallel: the stores' pages are salted with the connector's namespace, the engines' own caches are not."""
        client = self.tenants.client(allocator_token)
        calls = [client.lookup(tokens, cache_salt=cache_salt)]
        namespace = self.settings.store_namespace
        if stores and namespace:
            calls.append(client.lookup(tokens, cache_salt=f"{namespace}|{cache_salt}" if cache_salt else namespace))
        try:
            results = await asyncio.wait_for(asyncio.gather(*calls), self.settings.lookup_timeout_s)
        except Exception as exc:  # noqa: BLE001 - routed on load alone; the allocator is not in the request path
            self.metrics.lookup_failures.inc()
            logger.debug("kvservice route: Lookup failed (%s: %s); routing on load alone", type(exc).__name__, exc)
            return None
        hits = {h.pool_id: h for h in results[0].hits if not is_store(h.pool_id) or len(results) == 1}
        if len(results) > 1:
            hits.update({h.pool_id: h for h in results[1].hits if is_store(h.pool_id)})
        return hits

    def observe(self, engine: str, decision: Decision, ttft_s: float) -> None:
        """A streamed reply's first token came `ttft_s` after its request: the rates learn from it."""
        est = decision.estimates.get(engine)
        if self.rates is None or est is None:
            return
        self.rates.observe(est, ttft_s)
        self._export_rates()

    def _export_rates(self) -> None:
        rates = self.rates or self.weights
        self.metrics.rate.labels("prefill").set(rates.prefill_seconds_per_token())
        for tier in TIERS:
            self.metrics.rate.labels(tier).set(rates.load_seconds_per_token(tier))

    def order(self, policy: str, engines: list[Engine], estimates: dict[str, Estimate], tokens: list[int] | None,
              session_key: str | None) -> list[str]:
        names = sorted(e.backend.name for e in engines)
        if not names:
            return []
        spread = first_block_hash(tokens, self.settings.block_size)
        if policy == "round-robin":
            start = next(self._turn) % len(names)
            return names[start:] + names[:start]
        if policy == "least-loaded":
            queue = {e.backend.name: estimate(0, Reuse(), e.current_load(), self.weights) for e in engines}
            return rank(queue, spread=next(self._turn), tolerance_s=self.settings.tie_tolerance_s)
        if policy == "session":
            key = session_key.encode() if session_key else spread.to_bytes(8, "big")
            return rendezvous(key, names)
        return rank({n: estimates[n] for n in names}, spread=spread, tolerance_s=self.settings.tie_tolerance_s)

    async def decide(self, tokens: list[int] | None, model: str | None, allocator_token: str | None = None,
                     session_key: str | None = None, cache_salt: str | None = None,
                     policy: str | None = None) -> Decision:
        policy = policy or self.settings.policy
        serving = self.fleet.serving(model)
        decoders = [e for e in serving if e.backend.decodes]
        producers = [e for e in serving if e.backend.role == "prefill"]
        stores = any(e.backend.connector for e in decoders + producers)
        hits = await self.lookup(tokens, allocator_token, cache_salt, stores) if tokens else None
        n = len(tokens) if tokens else 0
        limit = (n - 1) // self.settings.block_size * self.settings.block_size if n else 0
        estimates: dict[str, Estimate] = {}
        ordering: dict[str, Estimate] = {}  # what the policy ranks by (precise: the engine's own cache alone)
        for e in decoders + producers:
            reuse, load = reuse_of(e, hits or {}, limit), e.current_load()
            estimates[e.backend.name] = estimate(n, reuse, load, self.weights, e.backend.connector, self.rates)
            ordering[e.backend.name] = estimates[e.backend.name] if policy != "precise" else \
                estimate(n, reuse, load, self.weights, False, self.rates)
        decision = Decision(self.order(policy, decoders, ordering, tokens, session_key),
                            {name: est.cached_tokens for name, est in estimates.items()}, estimates,
                            prompt_tokens=n if tokens else None, tokens=tokens, lookup_ok=hits is not None,
                            hits={p: h.num_cached_tokens for p, h in (hits or {}).items()})
        if producers and decision.order:
            chosen = decision.predicted[decision.order[0]]
            if n and chosen >= self.settings.pd_skip_fraction * n:
                decision.prefill_skipped = True
            else:
                decision.prefill_order = self.order(policy, producers, ordering, tokens, session_key)
        return decision

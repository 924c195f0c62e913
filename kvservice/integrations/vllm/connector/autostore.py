"""`store: auto`: which store of this node an engine saves into.

In Ray: the store `kvservice deploy --stores` started on this process's Ray node (or on the node of the Ray
process that started it, $KVSERVICE_RAY_NODE_ID). Outside Ray: among the live stores in `shm_dir`, the one
this engine can use: of its block size and page size (its page format), registered on its allocator at the
generation its descriptor names, and of its tenant (the allocator shows a tenant's token only that tenant's
pools; an admin token sees every pool, so then the tenant each store recorded in its descriptor decides). A
node shared by tenants, or running two deployments, holds several stores; only a choice that stays ambiguous
is refused, naming every store and why it is not the one.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

from kvservice.blockstore.segment import Descriptor, live_descriptors
from kvservice.integrations.vllm.connector.settings import ENV_RAY_NODE

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Engine:
    """What the store must match: the engine's block size and page size (None: not known, not checked), and
    how to ask its allocator."""

    block_size: int | None = None
    page_bytes: int | None = None
    address: str = ""
    token: str | None = None
    timeout_s: float = 1.0


def engine_page_bytes(kv_cache_config, world_size: int) -> int | None:
    """A store page of this engine: every rank's page of one scheduler block, from vLLM's KVCacheConfig (its
    one KV cache group: the page size of each layer that holds its own KV, as the connector's pages hold them).
    None when it cannot tell (no config, several groups: the connector refuses those at registration)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) != 1:
        return None
    spec, names = groups[0].kv_cache_spec, groups[0].layer_names
    specs = getattr(spec, "kv_cache_specs", None)  # vLLM's UniformTypeKVCacheSpecs: one spec per layer
    per_rank = sum(s.page_size_bytes for s in specs.values()) if specs else spec.page_size_bytes * len(names)
    return per_rank * world_size if per_rank > 0 else None


def auto_store(shm_dir: str, engine: Engine) -> str:
    """The store `store: auto` names for this engine (see the module doc); ValueError naming the candidates
    and the setting that picks one when that is ambiguous."""
    from kvservice.blockstore.actor import node_store_name
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return node_store_name(ray.get_runtime_context().get_node_id())
    if os.environ.get(ENV_RAY_NODE):
        return node_store_name(os.environ[ENV_RAY_NODE])
    live = sorted(live_descriptors(shm_dir), key=lambda d: d.name)
    why: dict[str, str] = {}  # store name -> why it is not this engine's
    for d in live:
        if engine.block_size is not None and d.block_size != engine.block_size:
            why[d.name] = f"block size {d.block_size}, not the engine's {engine.block_size}"
        elif engine.page_bytes is not None and d.page_bytes != engine.page_bytes:
            why[d.name] = f"pages of {d.page_bytes} bytes, not the engine's {engine.page_bytes}"
    fits = [d for d in live if d.name not in why]
    asked = ""
    if fits and engine.address:
        try:
            fits = _of_this_tenant(fits, engine, why)
        except Exception as exc:  # noqa: BLE001 - the allocator away: the descriptors alone decide
            asked = f"asking the allocator at {engine.address} failed ({type(exc).__name__}: {exc})"
    if len(fits) == 1:
        if asked:
            logger.warning("kvservice connector: store 'auto' is %s, by block and page size only: %s",
                           fits[0].name, asked)
        return fits[0].name
    raise ValueError(_refusal(shm_dir, live, fits, why, asked))


def _of_this_tenant(fits: list[Descriptor], engine: Engine, why: dict[str, str]) -> list[Descriptor]:
    """The stores this engine's tenant owns on its allocator, at the generation their descriptors name."""
    from kvservice.client import KVServiceClient
    with KVServiceClient(engine.address, engine.token, client_name="kvconnector:auto-store",
                         timeout_s=engine.timeout_s, retries=1, heartbeat=False) as client:
        pools = client.get_stats(pool_ids=[d.pool_id for d in fits]).pools
        out = []
        for d in fits:
            stats = pools.get(d.pool_id)
            if stats is None:
                why[d.name] = f"no pool of this engine's tenant on {engine.address} (another tenant's, or another " \
                              f"allocator's)"
            elif stats.epoch != d.generation:
                why[d.name] = f"its pool on {engine.address} is at epoch {stats.epoch}, its segment at " \
                              f"{d.generation} (another allocator's store, or one registering again)"
            else:
                out.append(d)
        if len({d.tenant for d in out}) > 1:
            # An admin token sees every tenant's pools: its own tenant, from a session, picks among them.
            tenant = client.open_session().tenant
            for d in out:
                if d.tenant != tenant:
                    why[d.name] = f"tenant {d.tenant!r}, not this engine's {tenant!r}"
            out = [d for d in out if d.tenant == tenant]
    return out


def _refusal(shm_dir: str, live: list[Descriptor], fits: list[Descriptor], why: dict[str, str], asked: str) -> str:
    head = "kv_connector_extra_config.store: 'auto' is not in Ray (nor started from a Ray process) and found "
    pick = "name this node's store with store: <name>"
    if not live:
        return head + f"no live store in {shm_dir}; start one (kvservice store) or {pick}"
    listed = "; ".join(f"{d.name} ({why[d.name]})" if d.name in why else d.name for d in live)
    if fits:
        return (head + f"{len(fits)} live stores in {shm_dir} this engine could use: {', '.join(d.name for d in fits)}"
                + (f" ({asked}, so its tenant did not tell them apart)" if asked else "")
                + f"; {pick} (live: {listed})")
    return head + f"none of the {len(live)} live stores in {shm_dir} is this engine's: {listed}; {pick}"

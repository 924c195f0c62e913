"""Bring-up and teardown: the allocator actor on the head node, each pool's ranks on one node (a
STRICT_PACK placement group) with pools spread over nodes, and the engines beside their ranks.

    deploy(cfg) -> ensure_allocator -> ensure_pools (wanted pools -> placement groups -> engine actors)
    teardown()  -> engines and ranks, then the allocator (its server stopped in order), then the groups
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from kvservice.client import KVServiceClient, PrefixIndex
from kvservice.server.startup import is_loopback
from worker.actor import PoolLayout
from worker.deploy.actors import AllocatorActor, EngineActor
from worker.deploy.config import DeployConfig
from worker.deploy.names import (
    ALLOCATOR_NAME,
    ALLOCATORS_GROUP,
    HEAD_RESOURCE,
    NAMESPACE,
    engine_name,
    engine_pool_id,
    group_name,
    is_allocator,
    named_actors,
    pool_index,
    rank_name,
    shard_actor_name,
)
from worker.deploy.router import Router
from worker.engine import EngineConfig
from worker.model import ModelConfig


@dataclass(slots=True)
class Deployment:
    target: str  # the allocator, host:port
    allocator: object | None  # its actor; None when it runs elsewhere (--allocator)
    engines: dict[str, object] = field(default_factory=dict)  # pool id -> EngineActor
    created: list[str] = field(default_factory=list)  # pools this call started
    token: str | None = None  # what clients of the allocator send
    tls: dict[str, str] = field(default_factory=dict)  # their TLS options (DeployConfig.client_tls)
    stores: dict[str, str] = field(default_factory=dict)  # KV block store name -> its node id
    store_actors: dict[str, object] = field(default_factory=dict)  # ...-> its actor (not detached: held here)

    def router(self, token: str | None = None, replica: bool = False) -> Router:
        """A KV-aware router over the engines; `replica`: it keeps a replica of the prefix index
        (kvservice.client.PrefixIndex) and routes without a Lookup RPC per prompt."""
        client = KVServiceClient(self.target, token or self.token, client_name="router", **self.tls)
        return Router(client, self.engines, PrefixIndex(client) if replica else None)


def deploy(cfg: DeployConfig) -> Deployment:
    """Brings up (or finds) the allocator and the pools. Needs a Ray connection in the `kvservice` namespace."""
    import ray
    if ray.get_runtime_context().namespace != NAMESPACE:
        raise RuntimeError(f"connect with ray.init(..., namespace={NAMESPACE!r}) so that named placement groups "
                           f"of earlier runs can be found (this driver is in {ray.get_runtime_context().namespace!r})")
    allocator, target = ensure_allocator(cfg)
    if cfg.token is None and allocator is not None:
        cfg.token = ray.get(allocator.token.remote())  # the allocator's own (generated) token
    with KVServiceClient(target, cfg.token, retries=2, timeout_s=10, **cfg.client_tls()) as client:
        client.open_session()  # fails here, readably, on a wrong token or an unreachable allocator
        cfg.block_size = block_size_for(cfg, target, client.get_stats().hash_block_size)
    store_actors = ensure_stores(cfg, target) if cfg.stores else {}
    stores = {name: node for name, (node, _) in store_actors.items()}
    engines, created = ensure_pools(cfg, target) if cfg.pools != 0 or cfg.add_pools else ({}, [])
    return Deployment(target, allocator, engines, created, cfg.token, cfg.client_tls(), stores,
                      {name: actor for name, (_, actor) in store_actors.items()})


def block_size_for(cfg: DeployConfig, target: str, allocator_block_size: int) -> int:
    """--block-size, or the allocator's hash block size when it is not given. A store's pages are hash blocks:
    with --stores the two must be equal."""
    if cfg.block_size is None:
        return allocator_block_size
    if cfg.stores and cfg.block_size != allocator_block_size:
        raise RuntimeError(f"--block-size {cfg.block_size}, but the allocator at {target} hashes blocks of "
                           f"{allocator_block_size} tokens (its --hash-block-size): a store's page is one such "
                           f"block; drop --block-size or pass {allocator_block_size}")
    return cfg.block_size


def ensure_stores(cfg: DeployConfig, target: str) -> dict[str, tuple[str, object]]:
    """A KV block store on every alive node (the one up is reused), named after the node
    (`node-<node id prefix>`): vLLM engines there select it with the connector's `store: auto`."""
    import ray

    from kvservice.blockstore.actor import node_store_name, start_store
    if cfg.store_page_bytes <= 0:
        raise RuntimeError("--stores needs --store-page-bytes: one block of every layer of the engines' model "
                           "(num_layers * num_kv_heads * block_size * 2 * head_dim * dtype bytes on vLLM's CPU "
                           "attention)")
    stores = {}
    for node in ray.nodes():
        if node["Alive"]:
            name = node_store_name(node["NodeID"])
            actor = start_store(name, target, cfg.store_pages, cfg.store_page_bytes, cfg.block_size,
                                node_id=node["NodeID"], token=cfg.token, directory=cfg.store_dir,
                                disk_dir=cfg.store_disk and os.path.join(cfg.store_disk, name),
                                disk_bytes=cfg.store_disk_bytes,
                                detached=cfg.detached, tls_ca=cfg.tls_ca)
            stores[name] = (node["NodeID"], actor)
    return stores


def ensure_allocator(cfg: DeployConfig) -> tuple[object | None, str]:
    """The allocator actor (reused when one is up) and its target; (None, target) for an external one. With
    shards or standbys: the first shard's actor, and every leader's (then standby's) address, comma-separated
    (what the clients take: they find each pool's shard in the shard map)."""
    import ray
    if cfg.allocator:
        return None, cfg.allocator
    if cfg.allocator_shards <= 1 and not cfg.standbys:
        actor = ray.remote(AllocatorActor).options(
            name=ALLOCATOR_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0,
            resources={HEAD_RESOURCE: 0.001}, max_restarts=3).remote(cfg.serve_args())
        return actor, ray.get(actor.target.remote())
    return _ensure_shards(cfg)


def _ensure_shards(cfg: DeployConfig) -> tuple[object, str]:
    """Each shard (and its standby) a detached actor running `kvservice serve --shard ...`, spread over the
    nodes by one placement group; Ray restarts a dead one (it comes back as a standby)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    if not cfg.redis_url:
        raise RuntimeError("--allocator-shards and --standbys need --redis-url: the shards and standbys share one "
                           "Redis (or a Redis Cluster, rediscluster://host:port) that every node reaches")
    shards = cfg.shard_ids() or [""]
    roles = [(s, False) for s in shards] + ([(s, True) for s in shards] if cfg.standbys else [])
    pg = _named_group(ALLOCATORS_GROUP, [{"CPU": 0.01}] * len(roles), "SPREAD", cfg)
    nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    bundles = assign_bundles(roles, {int(b): n for b, n in nodes.items()})
    if not cfg.token_file and not cfg.insecure and not is_loopback(cfg.host):
        cfg.token = cfg.token or secrets.token_urlsafe(32)  # one token for every shard (and the clients)
    actors = []
    for (shard, standby), bundle in zip(roles, bundles):
        name = shard_actor_name(shard or "main", standby)
        args = cfg.serve_args() + (["--shard", shard] if shard else []) + (["--standby"] if standby else [])
        actors.append(ray.remote(AllocatorActor).options(
            name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0, max_restarts=-1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
        ).remote(args, advertise=True, token=None if cfg.token_file else cfg.token, data_subdir=name))
    targets = ray.get([a.target.remote() for a in actors])
    return actors[0], ",".join(targets)


def assign_bundles(roles: list[tuple[str, bool]], bundle_nodes: dict[int, str]) -> list[int]:
    """A bundle per (shard, standby?) role: leaders on as many nodes as there are, each standby on a node
    other than its leader's where one has room."""
    free: dict[str, list[int]] = {}
    for bundle, node in sorted(bundle_nodes.items()):
        free.setdefault(node, []).append(bundle)
    nodes = sorted(free)
    leader_node: dict[str, str] = {}
    out = []
    for i, (shard, standby) in enumerate(roles):
        if not standby:
            candidates = nodes[i % len(nodes):] + nodes[:i % len(nodes)]
        else:
            candidates = sorted((n for n in nodes if n != leader_node.get(shard)), key=lambda n: -len(free[n]))
            candidates += [leader_node.get(shard, nodes[0])]
        node = next(n for n in candidates + nodes if free.get(n))
        out.append(free[node].pop(0))
        if not standby:
            leader_node[shard] = node
    return out


def _named_group(name: str, bundles: list[dict], strategy: str, cfg: DeployConfig):
    """The detached placement group `name`, reused when it exists."""
    import ray
    for info in ray.util.placement_group_table().values():
        if info["name"] == name and info["state"] != "REMOVED":
            return ray.util.get_placement_group(name)
    pg = ray.util.placement_group(bundles, strategy=strategy, name=name, lifetime="detached")
    if not pg.wait(cfg.timeout_s):
        raise RuntimeError(f"no room for the placement group {name!r} within {cfg.timeout_s:.0f} s")
    return pg


def existing_pools() -> dict[str, object]:
    """Pool id -> engine actor, for every pool whose engine is up."""
    import ray
    pools = {}
    for name in named_actors():
        pool_id = engine_pool_id(name)
        if pool_id is not None:
            pools[pool_id] = ray.get_actor(name, namespace=NAMESPACE)
    return pools


def ensure_pools(cfg: DeployConfig, target: str) -> tuple[dict[str, object], list[str]]:
    """The pools `cfg` asks for, reusing those up; returns (pool id -> engine actor, ids created now)."""
    import ray
    engines = existing_pools()
    created = _pools_to_create(cfg, set(engines))
    if created:
        use_gpus = ray.cluster_resources().get("GPU", 0) >= cfg.dcp
        load = Counter(ray.get([e.where.remote() for e in engines.values()]))
        groups = _reserve_groups(cfg, created, use_gpus, load)
        engines |= _start_engines(cfg, groups, target, use_gpus)
        ray.get([engines[p].where.remote() for p in created])  # raises here if a pool failed to start
    return dict(sorted(engines.items(), key=lambda kv: pool_index(kv[0]))), created


def _pools_to_create(cfg: DeployConfig, up: set[str]) -> list[str]:
    """p0..p{pools-1} (2 on a cluster with none, unless scaling out) and `add_pools` after the highest."""
    num_pools = cfg.pools if cfg.pools is not None else (0 if up or cfg.add_pools else 2)
    wanted = {f"p{i}" for i in range(num_pools)} | up
    first_new = max((pool_index(p) for p in wanted), default=-1) + 1
    wanted |= {f"p{first_new + k}" for k in range(cfg.add_pools)}
    return sorted(wanted - up, key=pool_index)


def _bundle(cfg: DeployConfig, use_gpus: bool) -> dict[str, float]:
    return {"GPU": 1, "CPU": cfg.rank_cpus} if use_gpus else {"CPU": cfg.rank_cpus}


def _reserve_groups(cfg: DeployConfig, pool_ids: list[str], use_gpus: bool, load: Counter) -> dict[str, object]:
    """One STRICT_PACK placement group per new pool, each aimed at the node with the fewest pools."""
    import ray
    from ray.util.placement_group import placement_group
    bundle = _bundle(cfg, use_gpus)
    need = {k: v * cfg.dcp for k, v in bundle.items()}
    nodes = ray.nodes()
    groups = {}
    for pool_id in pool_ids:
        _remove_stale(pool_id, cfg.dcp)
        node = _pick_node(load, nodes, need)
        load[node] += 1
        # A soft target: pools spread over nodes while they fit, and still start when they do not.
        groups[pool_id] = placement_group([dict(bundle) for _ in range(cfg.dcp)], strategy="STRICT_PACK",
                                          name=group_name(pool_id), lifetime="detached" if cfg.detached else None,
                                          _soft_target_node_id=node)
    ready = {pg.ready(): pool_id for pool_id, pg in groups.items()}
    _, pending = ray.wait(list(ready), num_returns=len(ready), timeout=cfg.timeout_s)
    if pending:
        free = {k: v for k, v in ray.available_resources().items() if k in need}
        for ref in pending:
            ray.util.remove_placement_group(groups[ready[ref]])
        raise RuntimeError(f"pools {sorted(ready[r] for r in pending)} found no room in {cfg.timeout_s:.0f} s: each "
                           f"needs {need} on one node, and the cluster has {free} free; add "
                           f"nodes or lower --dcp / --rank-cpus")
    return groups


def _start_engines(cfg: DeployConfig, groups: dict[str, object], target: str, use_gpus: bool) -> dict[str, object]:
    """An engine actor per new pool, in bundle 0 of its group (beside rank 0)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    backend = cfg.backend or ("triton" if use_gpus else "torch")
    epoch = time.time_ns() // 1_000_000  # new ranks, empty memory: a newer epoch than any before
    engine_cls = ray.remote(EngineActor)
    engines = {}
    for pool_id, pg in groups.items():
        ecfg = EngineConfig(pool_id=pool_id, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                            dcp_world_size=cfg.dcp, max_model_len=cfg.max_model_len,
                            max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                            epoch=epoch)
        layout = PoolLayout(ModelConfig(), ecfg.num_blocks, ecfg.block_size, ecfg.max_num_rows,
                            ecfg.max_num_blocks_per_req, ecfg.max_num_batched_tokens, cfg.dcp, backend=backend)
        # Pools of one deployment share a layout: a prefix cached on one can be copied to another.
        ecfg.allow_transfers, ecfg.kv_layout = True, layout.kv_layout
        options = {"name": engine_name(pool_id), "namespace": NAMESPACE, "num_cpus": 0,
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)}
        if cfg.detached:
            options["lifetime"] = "detached"
        engines[pool_id] = engine_cls.options(**options).remote(layout, ecfg, pg, target, cfg.token,
                                                                 rank_cpus=cfg.rank_cpus, use_gpus=use_gpus,
                                                                 detached=cfg.detached, tls=cfg.client_tls())
    return engines


def _pick_node(load: Counter, nodes: list[dict], need: dict[str, float]) -> str | None:
    """The alive node that can hold the pool with the fewest pools on it (workers before the head)."""
    fits = [n for n in nodes if n["Alive"] and all(n["Resources"].get(k, 0) >= v for k, v in need.items())]
    if not fits:
        return None
    best = min(fits, key=lambda n: (load[n["NodeID"]], HEAD_RESOURCE in n["Resources"]))
    return best["NodeID"]


def _remove_stale(pool_id: str, dcp: int) -> None:
    """Leftovers of a pool whose engine is gone (its ranks' memory cannot be trusted to match anything)."""
    import ray
    for rank in range(dcp):
        try:
            ray.kill(ray.get_actor(rank_name(pool_id, rank), namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass
    try:
        ray.util.remove_placement_group(ray.util.get_placement_group(group_name(pool_id)))
    except ValueError:
        pass


def teardown(timeout_s: float = 30.0) -> list[str]:
    """Kills every kvservice actor (engines and ranks first, the allocator last, after stopping its server)
    and removes the pools' placement groups. Returns the names killed."""
    import ray
    names = sorted(named_actors(), key=is_allocator)
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue  # already gone
        if is_allocator(name) or name.startswith("kvservice-store-"):  # a store frees its shared memory
            try:
                ray.get(actor.stop.remote(), timeout=timeout_s)
            except Exception as exc:  # noqa: BLE001 - a dead allocator or store is killed all the same
                print(f"  {name} did not stop cleanly ({exc!r}); killing it", file=sys.stderr)
        ray.kill(actor, no_restart=True)
    for info in ray.util.placement_group_table().values():
        if info["name"].startswith(("kvservice-pool-", ALLOCATORS_GROUP)) and info["state"] != "REMOVED":
            ray.util.remove_placement_group(ray.util.get_placement_group(info["name"]))
    deadline = time.monotonic() + timeout_s  # names are released asynchronously
    while time.monotonic() < deadline and set(names) & set(named_actors()):
        time.sleep(0.2)
    return names

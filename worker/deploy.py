"""`kvservice deploy` / `python -m worker.deploy`: the service on an existing Ray cluster.

The allocator is a detached named actor on the head node that runs `kvservice serve` as a child process;
each pool's DCP ranks share one node through a STRICT_PACK placement group and pools spread over nodes;
an `EngineActor` per pool runs the scheduler beside its ranks; the driver's `Router` sends each prompt to
the pool holding its longest cached prefix (the allocator's Lookup). Every actor has a stable name in the
`kvservice` namespace, so running deploy again reuses what is up and only adds what is missing.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # the allocator actor spawns `kvservice serve`

import argparse
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvservice.client import KVServiceClient
from kvservice.errors import KVServiceError
from kvservice.processes import parent_death_signal
from worker.actor import PoolLayout, RankWorker, RayWorkers, free_port
from worker.engine import Engine, EngineConfig, Sequence
from worker.model import ModelConfig, TinyTransformer
from worker.sampling import SamplingParams
from worker.verify import Verification, verify

NAMESPACE = "kvservice"
ALLOCATOR_NAME = "kvservice-allocator"
HEAD_RESOURCE = "node:__internal_head__"
# An engine idle this long opens a fresh session before its next step: its lease (default 30 s) may have
# lapsed. It holds no requests between generate() calls, so nothing is lost.
SESSION_IDLE_S = 10.0
_ENGINE_NAME = re.compile(r"^kvservice-pool-(.+)-engine$")


def rank_name(pool_id: str, rank: int) -> str:
    return f"kvservice-pool-{pool_id}-rank-{rank}"


def engine_name(pool_id: str) -> str:
    return f"kvservice-pool-{pool_id}-engine"


def group_name(pool_id: str) -> str:
    return f"kvservice-pool-{pool_id}"


@dataclass(slots=True)
class DeployConfig:
    pools: int | None = None  # pools p0..p{pools-1}; None: 2 on a cluster that has none, else those up
    add_pools: int = 0  # new pools after those up (scale out)
    dcp: int = 1
    num_blocks: int = 512  # per pool, including the null block
    block_size: int = 16
    max_model_len: int = 1024
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    backend: str | None = None  # default: triton on GPU pools, the torch twin on CPU pools
    rank_cpus: float = 0.5  # CPUs per rank on CPU-only clusters (fractions let small nodes host several)
    port: int = 50051  # 0: any free port (the allocator's target() says which)
    data_dir: str = "~/kvservice-data"  # on the head node; for the embedded Redis
    redis_url: str | None = None
    no_persistence: bool = False
    token_file: str | None = None  # on the head node; turns auth on
    token: str | None = None  # what the engines and the router send
    allocator: str | None = None  # an allocator running elsewhere (host:port): start none
    detached: bool = False  # pools outlive this driver
    timeout_s: float = 600.0  # for the pools' placement groups (an autoscaler may have to add nodes first)

    def serve_args(self) -> list[str]:
        args = ["--host", "0.0.0.0", "--port", str(self.port)]
        if self.redis_url:
            args += ["--redis-url", self.redis_url]
        elif self.no_persistence:
            args += ["--no-persistence"]
        else:
            args += ["--data-dir", self.data_dir]
        if self.token_file:
            args += ["--token-file", self.token_file]
        return args


# ---- the allocator -------------------------------------------------------------------------------------
class AllocatorActor:
    """Runs `kvservice serve ARGS` on its node (wrapped by `ray.remote` in `ensure_allocator`)."""

    def __init__(self, serve_args: list[str], timeout_s: float = 120.0) -> None:
        import kvservice
        args = [os.path.expanduser(a) for a in serve_args]  # paths are the head node's
        if "--data-dir" in args:
            Path(args[args.index("--data-dir") + 1]).mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(Path(kvservice.__file__).resolve().parent.parent),
                                              os.environ.get("PYTHONPATH", "")])}
        # Spawned from the actor's main thread: the parent-death signal follows the thread that forked.
        self.proc = subprocess.Popen([sys.executable, "-m", "kvservice.cli", "--log-level", "WARNING", "serve", *args],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
                                     preexec_fn=parent_death_signal())
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.proc.stdout.readline()
            if line.startswith("kvservice serving on "):
                self.port = int(line.rsplit(":", 1)[1])
                break
            if (not line and self.proc.poll() is not None) or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"`kvservice serve {' '.join(args)}` did not start (exit code "
                                   f"{self.proc.wait()}); its log is in this actor's Ray worker stderr")
        # Keep draining stdout so the server never blocks on a full pipe.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        import ray
        self.ip = ray.util.get_node_ip_address()

    def target(self) -> str:
        """host:port that every node of the cluster can reach."""
        return f"{self.ip}:{self.port}"

    def where(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def health(self) -> str:
        """The gRPC health status ("SERVING", "NOT_SERVING") or why there is none."""
        if self.proc.poll() is not None:
            return f"exited with {self.proc.returncode}"
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        try:
            with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return f"unreachable: {exc.code().name}"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def stop(self) -> int:
        """SIGTERM (the server stops its embedded Redis in order), SIGKILL after 20 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def ensure_allocator(cfg: DeployConfig) -> tuple[object | None, str]:
    """The allocator actor (reused when one is up) and its target; (None, target) for an external one."""
    import ray
    if cfg.allocator:
        return None, cfg.allocator
    actor = ray.remote(AllocatorActor).options(
        name=ALLOCATOR_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0,
        resources={HEAD_RESOURCE: 0.001}, max_restarts=3).remote(cfg.serve_args())
    return actor, ray.get(actor.target.remote())


# ---- pools ---------------------------------------------------------------------------------------------
class PoolWorkers(RayWorkers):
    """A pool's ranks as named actors in its placement group (rank r in bundle r, so all on one node: the
    DCP group meets on 127.0.0.1). Same interface as `RayWorkers`."""

    def __init__(self, layout: PoolLayout, pg, pool_id: str, *, num_cpus: float = 0.5, use_gpus: bool = False,
                 detached: bool = False) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.layout = layout
        port = 0
        if layout.dcp_world_size > 1:  # a free port on the pool's node, not on the caller's
            on_node = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
            port = ray.get(ray.remote(free_port).options(num_cpus=0, scheduling_strategy=on_node).remote())
        actor_cls = ray.remote(RankWorker)
        self.actors = []
        for rank in range(layout.dcp_world_size):
            options = {"name": rank_name(pool_id, rank), "namespace": NAMESPACE, "num_cpus": num_cpus,
                       "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)}
            if use_gpus:
                options["num_gpus"] = 1
            if detached:
                options["lifetime"] = "detached"
            self.actors.append(actor_cls.options(**options).remote(layout, rank, port, group_name(pool_id)))
        ray.get([a.backend.remote() for a in self.actors])  # wait until every rank is up


class EngineActor:
    """One pool's scheduler: an `Engine` over the pool's `PoolWorkers`, talking to the allocator."""

    def __init__(self, layout: PoolLayout, config: EngineConfig, pg, target: str, token: str | None = None, *,
                 rank_cpus: float = 0.5, use_gpus: bool = False, detached: bool = False) -> None:
        torch.set_num_threads(1)
        self.workers = PoolWorkers(layout, pg, config.pool_id, num_cpus=rank_cpus, use_gpus=use_gpus,
                                   detached=detached)
        self.client = KVServiceClient(target, token, client_name=f"engine-{config.pool_id}")
        self.engine = Engine(self.client, self.workers, config, peers=NamedPeers(layout))
        self.num_requests = 0
        self._last_call = time.monotonic()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy completions of `prompts`, `max_tokens` each (batched with continuous batching)."""
        if time.monotonic() - self._last_call > SESSION_IDLE_S:
            self.client.open_session()
        seqs = [self.engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
        try:
            self.engine.run()
        finally:
            self.engine.finished.clear()
            self._last_call = time.monotonic()
        self.num_requests += len(seqs)
        return [s.output for s in seqs]

    def stats(self) -> dict:
        s = self.engine.stats
        return {"pool_id": self.engine.config.pool_id, "node_id": self.where(), "backend": self.workers.backend,
                "requests": self.num_requests, "prompt_tokens": s.prompt_tokens, "hit_tokens": s.hit_tokens,
                "prefix_hit_rate": s.prefix_hit_rate, "generated_tokens": s.generated_tokens, "steps": s.steps,
                "preemptions": s.preemptions}

    def where(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        self.workers.shutdown()


class NamedPeers(Mapping):
    """Other pools' ranks, found by their actor names when a transfer order names them (pools of one
    deployment share a KV layout, so the allocator may order copies between any two of them)."""

    def __init__(self, layout: PoolLayout) -> None:
        self.layout = layout
        self._cache: dict[str, RayWorkers] = {}

    def __getitem__(self, pool_id: str) -> RayWorkers:
        if pool_id not in self._cache:
            import ray
            try:
                actors = [ray.get_actor(rank_name(pool_id, r), namespace=NAMESPACE)
                          for r in range(self.layout.dcp_world_size)]
            except ValueError:
                raise KeyError(pool_id) from None
            self._cache[pool_id] = RayWorkers.attach(self.layout, actors)
        return self._cache[pool_id]

    def __contains__(self, pool_id: object) -> bool:
        try:
            self[pool_id]  # type: ignore[index]
        except KeyError:
            return False
        return True

    def __iter__(self):
        return iter(self._cache)

    def __len__(self) -> int:
        return len(self._cache)


def _pool_index(pool_id: str) -> int:
    return int(pool_id[1:]) if pool_id[:1] == "p" and pool_id[1:].isdigit() else -1


def _named_actors() -> list[str]:
    """Names of the live kvservice actors."""
    import ray
    return [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
            if e["namespace"] == NAMESPACE and e["name"].startswith("kvservice-")]


def existing_pools() -> dict[str, object]:
    """Pool id -> engine actor, for every pool whose engine is up."""
    import ray
    matches = [m for m in map(_ENGINE_NAME.match, _named_actors()) if m]
    return {m.group(1): ray.get_actor(m.group(0), namespace=NAMESPACE) for m in matches}


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


def ensure_pools(cfg: DeployConfig, target: str) -> tuple[dict[str, object], list[str]]:
    """The pools `cfg` asks for, reusing those up; returns (pool id -> engine actor, ids created now)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    engines = existing_pools()
    num_pools = cfg.pools if cfg.pools is not None else (0 if engines or cfg.add_pools else 2)
    wanted = {f"p{i}" for i in range(num_pools)} | set(engines)
    first_new = max((_pool_index(p) for p in wanted), default=-1) + 1
    wanted |= {f"p{first_new + k}" for k in range(cfg.add_pools)}
    created = sorted(wanted - set(engines), key=_pool_index)
    engines = dict(sorted(engines.items(), key=lambda kv: _pool_index(kv[0])))
    if not created:
        return engines, []
    use_gpus = ray.cluster_resources().get("GPU", 0) >= cfg.dcp
    bundle = {"GPU": 1, "CPU": cfg.rank_cpus} if use_gpus else {"CPU": cfg.rank_cpus}
    need = {k: v * cfg.dcp for k, v in bundle.items()}
    nodes = ray.nodes()
    load = Counter(ray.get([e.where.remote() for e in engines.values()]))
    groups = {}
    for pool_id in created:
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
    backend = cfg.backend or ("triton" if use_gpus else "torch")
    epoch = time.time_ns() // 1_000_000  # new ranks, empty memory: a newer epoch than any before
    engine_cls = ray.remote(EngineActor)
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
                                                                 detached=cfg.detached)
    ray.get([engines[p].where.remote() for p in created])  # raises here if a pool failed to start
    return dict(sorted(engines.items(), key=lambda kv: _pool_index(kv[0]))), created


# ---- routing -------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Route:
    pool_id: str
    cached_tokens: int  # 0: nothing cached anywhere, chosen round-robin


class Router:
    """KV-aware placement: a prompt goes to the pool with its longest cached prefix (ties: the most free
    blocks), which is the allocator's Lookup answer; round-robin while no pool has any of it cached."""

    def __init__(self, client: KVServiceClient, engines: dict[str, object]) -> None:
        self.client = client
        self.engines = engines
        self.pool_ids = list(engines)
        self.routed: Counter = Counter()
        self.routed_by_prefix: Counter = Counter()
        self._next = 0

    def route(self, prompt: list[int]) -> Route:
        lookup = self.client.lookup(prompt, pool_ids=self.pool_ids)
        cached = lookup.tokens(lookup.best_pool_id) if lookup.best_pool_id else 0
        if cached > 0:
            return Route(lookup.best_pool_id, cached)
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


# ---- bring-up and teardown -----------------------------------------------------------------------------
@dataclass(slots=True)
class Deployment:
    target: str  # the allocator, host:port
    allocator: object | None  # its actor; None when it runs elsewhere (--allocator)
    engines: dict[str, object] = field(default_factory=dict)  # pool id -> EngineActor
    created: list[str] = field(default_factory=list)  # pools this call started

    def router(self, token: str | None = None) -> Router:
        return Router(KVServiceClient(self.target, token, client_name="router"), self.engines)


def deploy(cfg: DeployConfig) -> Deployment:
    """Brings up (or finds) the allocator and the pools. Needs a Ray connection in the `kvservice` namespace."""
    import ray
    if ray.get_runtime_context().namespace != NAMESPACE:
        raise RuntimeError(f"connect with ray.init(..., namespace={NAMESPACE!r}) so that named placement groups "
                           f"of earlier runs can be found (this driver is in {ray.get_runtime_context().namespace!r})")
    allocator, target = ensure_allocator(cfg)
    with KVServiceClient(target, cfg.token, retries=2, timeout_s=10) as client:
        client.open_session()  # fails here, readably, on a wrong token or an unreachable allocator
    engines, created = ensure_pools(cfg, target)
    return Deployment(target, allocator, engines, created)


def teardown(timeout_s: float = 30.0) -> list[str]:
    """Kills every kvservice actor (engines and ranks first, the allocator last, after stopping its server)
    and removes the pools' placement groups. Returns the names killed."""
    import ray
    names = sorted(_named_actors(), key=lambda n: n == ALLOCATOR_NAME)
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue  # already gone
        if name == ALLOCATOR_NAME:
            try:
                ray.get(actor.stop.remote(), timeout=timeout_s)
            except Exception as exc:  # noqa: BLE001 - a dead allocator is killed all the same
                print(f"  allocator did not stop cleanly ({exc!r}); killing it", file=sys.stderr)
        ray.kill(actor, no_restart=True)
    for info in ray.util.placement_group_table().values():
        if info["name"].startswith("kvservice-pool-") and info["state"] != "REMOVED":
            ray.util.remove_placement_group(ray.util.get_placement_group(info["name"]))
    deadline = time.monotonic() + timeout_s  # names are released asynchronously
    while time.monotonic() < deadline and set(names) & set(_named_actors()):
        time.sleep(0.2)
    return names


# ---- the command ---------------------------------------------------------------------------------------
def check(prompts: list[list[int]], outputs: list[list[int]], max_tokens: int) -> Verification:
    """Greedy outputs against the dense reference model (no cache)."""
    seqs = [Sequence(f"request-{i}", p + o, len(p), SamplingParams(max_tokens=max_tokens), 0)
            for i, (p, o) in enumerate(zip(prompts, outputs))]
    return verify(TinyTransformer(ModelConfig()), seqs)


def smoke(router: Router, num_requests: int, max_tokens: int = 8, seed: int = 0) -> bool:
    """Requests over one shared system prompt per pool, in waves of one request per pool: the first wave
    spreads them round-robin, later ones follow the cached prefixes. True when every output matched the
    dense reference."""
    import ray
    rng = random.Random(seed)
    vocab = ModelConfig().vocab_size
    systems = [[rng.randrange(vocab) for _ in range(64)] for _ in router.pool_ids]
    prompts = [systems[i % len(systems)] + [rng.randrange(vocab) for _ in range(rng.randint(8, 32))]
               for i in range(num_requests)]
    start = time.perf_counter()
    wave = len(router.pool_ids)
    outputs = []
    for i in range(0, num_requests, wave):
        outputs += router.generate(prompts[i:i + wave], max_tokens)
    elapsed = time.perf_counter() - start
    pools = router.client.get_stats().pools
    print(f"smoke: {num_requests} requests, {max_tokens} tokens each, in {elapsed:.1f} s")
    print(f"  {'pool':<6} {'node':<10} {'requests':>8} {'by prefix':>9} {'engine hit rate':>15} "
          f"{'allocator hit rate':>18}")
    for stats in ray.get([router.engines[p].stats.remote() for p in router.pool_ids]):
        p = stats["pool_id"]
        alloc = pools[p].prefix_hit_rate if p in pools else 0.0
        print(f"  {p:<6} {stats['node_id'][:8]:<10} {router.routed[p]:>8} {router.routed_by_prefix[p]:>9} "
              f"{stats['prefix_hit_rate']:>15.1%} {alloc:>18.1%}")
    result = check(prompts, outputs, max_tokens)
    print(f"  dense reference: {result.matched}/{result.sequences} outputs identical"
          + ("" if result.ok else f"  MISMATCH: {result.mismatches[:2]}"))
    return result.ok and all(len(o) == max_tokens for o in outputs)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, DeployConfig]:
    parser = argparse.ArgumentParser(prog="kvservice deploy", description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="auto", help="Ray cluster to join (default: auto, or $RAY_ADDRESS)")
    parser.add_argument("--local", action="store_true", help="start a local Ray cluster instead (to try it out; "
                        "everything stops when this command ends)")
    d = DeployConfig()
    parser.add_argument("--pools", type=int, help="pools p0..pN-1, existing ones reused (default: 2 on a cluster "
                        "with none, else the pools up)")
    parser.add_argument("--add-pools", type=int, default=0, metavar="K", help="K new pools after those up (scale out)")
    parser.add_argument("--dcp", type=int, default=d.dcp, help="DCP ranks per pool (one node per pool)")
    parser.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV blocks per pool")
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--backend", choices=["torch", "triton"], help="attention backend (default: triton "
                        "where the cluster has GPUs, the torch twin otherwise)")
    parser.add_argument("--rank-cpus", type=float, default=d.rank_cpus, help="CPUs per rank on CPU-only clusters")
    parser.add_argument("--port", type=int, default=d.port, help="allocator gRPC port on the head node")
    parser.add_argument("--data-dir", default=d.data_dir, help="allocator's embedded Redis data on the head node")
    parser.add_argument("--redis-url", help="use this Redis instead of the embedded one")
    parser.add_argument("--no-persistence", action="store_true", help="allocator memory-only")
    parser.add_argument("--token-file", help="allocator tokens file on the head node (auth on)")
    parser.add_argument("--token", default=os.environ.get("KVSERVICE_TOKEN"),
                        help="bearer token the engines and the router send (default: $KVSERVICE_TOKEN)")
    parser.add_argument("--allocator", metavar="HOST:PORT", help="use this running allocator, start none")
    parser.add_argument("--detached", action="store_true", help="pools outlive this command")
    parser.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds to wait for room for new pools")
    parser.add_argument("--smoke", type=int, default=0, metavar="N", help="then run N requests through the router")
    parser.add_argument("--teardown", action="store_true", help="kill every kvservice actor and the allocator")
    args = parser.parse_args(argv)
    cfg = DeployConfig(pools=args.pools, add_pools=args.add_pools, dcp=args.dcp, num_blocks=args.num_blocks,
                       block_size=args.block_size, max_model_len=args.max_model_len, backend=args.backend,
                       rank_cpus=args.rank_cpus, port=args.port, data_dir=args.data_dir, redis_url=args.redis_url,
                       no_persistence=args.no_persistence, token_file=args.token_file, token=args.token,
                       allocator=args.allocator, detached=args.detached, timeout_s=args.timeout)
    return args, cfg


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(argv)
    import ray
    if args.local:
        ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    else:
        try:
            ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
        except ConnectionError as exc:
            print(f"kvservice deploy: no Ray cluster at --address {args.address} ({exc}); start one "
                  f"(`ray start --head`) or try --local", file=sys.stderr)
            return 2
    try:
        if args.teardown:
            names = teardown()
            print(f"kvservice deploy: removed {len(names)} actors" + (f" ({', '.join(names)})" if names else ""))
            return 0
        try:
            up = deploy(cfg)
        except KVServiceError as exc:
            print(f"kvservice deploy: the allocator refused or did not answer: {exc}", file=sys.stderr)
            return 2
        except RuntimeError as exc:
            print(f"kvservice deploy: {exc}", file=sys.stderr)
            return 2
        print(f"kvservice deploy: allocator {up.target}"
              + ("" if up.allocator is None else f" ({ray.get(up.allocator.health.remote())})"))
        nodes = ray.get([e.where.remote() for e in up.engines.values()])
        for (pool_id, _), node in zip(up.engines.items(), nodes):
            state = "started" if pool_id in up.created else "reused"
            print(f"  pool {pool_id}: {cfg.dcp} rank(s) on node {node[:8]} ({state})")
        ok = smoke(up.router(cfg.token), args.smoke) if args.smoke else True
        if up.created and not cfg.detached and not args.local:
            print("  (not --detached: the pools stop when this command exits; the allocator stays up)")
        return 0 if ok else 1
    finally:
        if args.local:
            teardown()  # stops the allocator's server (and its Redis) in order before the cluster goes
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())

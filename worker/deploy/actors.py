"""The Ray actors of a deployment: the allocator (`kvservice serve` as a child of a detached actor), a
pool's ranks in its placement group, and one engine per pool (the scheduler beside its ranks).

    AllocatorActor (head node)      EngineActor -> Engine -> PoolWorkers (RankWorker x DCP, one node)
                                                         -> NamedPeers (other pools' ranks, for transfers)
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from kvservice.client import KVServiceClient
from kvservice.launch import start_serve
from kvservice.processes import normal_priority
from kvservice.server.startup import TOKEN_NAME, read_token
from worker.actor import PoolLayout, RankWorker, RayWorkers, free_port
from worker.deploy.names import NAMESPACE, group_name, rank_name
from worker.engine import Engine, EngineConfig
from worker.sampling import SamplingParams

# An engine idle this long opens a fresh session before its next step: its lease (default 30 s) may have
# lapsed. It holds no requests between generate() calls, so nothing is lost.
SESSION_IDLE_S = 10.0


class AllocatorActor:
    """Runs `kvservice serve ARGS` on its node (wrapped by `ray.remote` in `ensure_allocator`)."""

    def __init__(self, serve_args: list[str], timeout_s: float = 120.0, advertise: bool = False,
                 token: str | None = None, data_subdir: str = "") -> None:
        """`advertise`: a shard (or a standby): it listens on the port its server binds and writes this
        node's address and that port into the shard map. After Ray restarted the actor (its server died) it
        comes back as a standby: the standby that took over meanwhile leads, and must not be fenced by the
        restart.
        `token`: the deployment's one token (every shard takes the same), written into a token file here.
        `data_subdir`: this server's own directory under --data-dir (several may share a node)."""
        import ray
        normal_priority("the allocator actor")  # and so its server: the control plane must not be starved
        args = [os.path.expanduser(a) for a in serve_args]  # paths are the head node's
        if data_subdir and "--data-dir" in args:
            i = args.index("--data-dir") + 1
            args[i] = str(Path(args[i]) / data_subdir)
        if token is not None and "--token-file" not in args:
            path = Path(args[args.index("--data-dir") + 1]) / TOKEN_NAME
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(f"{token} kvservice admin\n")
            args += ["--token-file", str(path)]
        host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
        # Bound to every interface: the node's address reaches it from every node; else the bound one.
        self.ip = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "[::]") else host
        if ":" in self.ip and not self.ip.startswith("["):  # IPv6: [address]:port
            self.ip = f"[{self.ip}]"
        if advertise:  # the port it binds (a port picked here could be taken before the server binds it)
            args[args.index("--port") + 1] = "0"
            args += ["--advertise", f"{self.ip}:0"]
            if ray.get_runtime_context().was_current_actor_reconstructed and "--standby" not in args:
                args.append("--standby")
        if "--data-dir" in args:
            Path(args[args.index("--data-dir") + 1]).mkdir(parents=True, exist_ok=True)
        # Started from the actor's main thread: the parent-death signal follows the thread that forked.
        try:
            self.serve = start_serve(args, timeout_s=timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"`kvservice serve {' '.join(args)}` did not start ({exc}); its log is in this "
                               f"actor's Ray worker stderr") from exc

    def target(self) -> str:
        """host:port that every node of the cluster can reach."""
        return f"{self.ip}:{self.serve.port}"

    def token(self) -> str | None:
        """The bearer token the engines and the router send: the first of --token-file, else the one the
        server generated into its data dir (None when auth is off)."""
        args = self.serve.args
        if "--token-file" in args:
            return read_token(args[args.index("--token-file") + 1])
        generated = Path(args[args.index("--data-dir") + 1]) / TOKEN_NAME if "--data-dir" in args else None
        return read_token(generated) if generated is not None and generated.exists() else None

    def where(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def health(self) -> str:
        """The gRPC health status ("SERVING", "NOT_SERVING") or why there is none."""
        proc = self.serve.proc
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        if "--tls-cert" in self.serve.args:  # its certificate names the node, not 127.0.0.1: the engines check it
            return "running, TLS on"
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from kvservice.client.routing import open_channel
        try:
            with open_channel(f"127.0.0.1:{self.serve.port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return f"unreachable: {exc.code().name}"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def stop(self) -> int | None:
        """SIGTERM (the server stops its embedded Redis in order), SIGKILL after 20 s."""
        return self.serve.stop(timeout_s=20)


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
                 rank_cpus: float = 0.5, use_gpus: bool = False, detached: bool = False,
                 tls: dict[str, str] | None = None) -> None:
        torch.set_num_threads(1)
        self.workers = PoolWorkers(layout, pg, config.pool_id, num_cpus=rank_cpus, use_gpus=use_gpus,
                                   detached=detached)
        self.client = KVServiceClient(target, token, client_name=f"engine-{config.pool_id}", **(tls or {}))
        self.engine = Engine(self.client, self.workers, config, peers=NamedPeers(layout))
        self.num_requests = 0
        self._last_call = time.monotonic()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy completions of `prompts`, `max_tokens` each (batched with continuous batching)."""
        if time.monotonic() - self._last_call > SESSION_IDLE_S:
            self.client.open_session()
        reqs = [self.engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
        try:
            self.engine.run()
        finally:
            self.engine.finished.clear()
            self._last_call = time.monotonic()
        self.num_requests += len(reqs)
        return [r.output for r in reqs]

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

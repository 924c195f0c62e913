"""`kvservice deploy`: the allocator, pools and engines on a Ray cluster, one file per job.

    cli (flags, smoke) -> placement (deploy / teardown) -> actors (allocator, ranks, engines) -> names
                          router (KV-aware, beside the driver's client)      config (what is asked for)
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # the allocator actor spawns `kvservice serve`

from worker.deploy.actors import AllocatorActor, EngineActor, NamedPeers, PoolWorkers  # noqa: E402
from worker.deploy.cli import main, parse_args, smoke  # noqa: E402
from worker.deploy.config import DeployConfig  # noqa: E402
from worker.deploy.names import (  # noqa: E402
    ALLOCATOR_NAME,
    NAMESPACE,
    engine_name,
    group_name,
    named_actors,
    rank_name,
    shard_actor_name,
)
from worker.deploy.placement import Deployment, deploy, ensure_allocator, ensure_pools, existing_pools, teardown  # noqa: E402
from worker.deploy.router import Route, Router  # noqa: E402

__all__ = [
    "ALLOCATOR_NAME", "NAMESPACE", "AllocatorActor", "DeployConfig", "Deployment", "EngineActor", "NamedPeers",
    "PoolWorkers", "Route", "Router", "deploy", "engine_name", "ensure_allocator", "ensure_pools", "existing_pools",
    "group_name", "main", "named_actors", "parse_args", "rank_name", "shard_actor_name", "smoke", "teardown",
]

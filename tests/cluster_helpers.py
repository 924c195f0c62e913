"""A Redis Cluster on loopback (Debian's redis-server 7 with `cluster-enabled yes`, created by
`redis-cli --cluster create`) and sharded allocators on it, for the sharding tests."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.redis_helpers import RedisServer, debian_redis, find_redis7
from tests.service_helpers import ServerProcess, start_server

REDIS_CLI = find_redis7("redis-cli")


def cluster_available() -> bool:
    return debian_redis() is not None and REDIS_CLI is not None


class ClusterNode(RedisServer):
    """One master: Debian's redis-server with cluster mode on (its nodes.conf in its data dir)."""

    max_port, bus_offset = 65535 - 10000, 10000  # its cluster bus listens on port + 10000

    def __init__(self, tmp_dir: Path) -> None:
        super().__init__(tmp_dir, executable=debian_redis())
        self.extra_config = {"cluster-enabled": "yes", "cluster-config-file": "nodes.conf",
                             "cluster-node-timeout": 2000}


class RedisCluster:
    """`masters` cluster nodes on free loopback ports, all 16384 slots covered."""

    def __init__(self, tmp_dir: Path, masters: int = 3) -> None:
        self.nodes = [ClusterNode(tmp_dir / f"node{i}") for i in range(masters)]

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = [subprocess.run([REDIS_CLI, "-p", str(n.port), "cluster", "info"], capture_output=True,
                                     text=True, timeout=10).stdout for n in self.nodes]
            if all("cluster_state:ok" in s for s in states):
                return self
            time.sleep(0.2)
        raise TimeoutError("the Redis Cluster did not become ok")

    @property
    def url(self) -> str:
        return f"rediscluster://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_shard(redis_url: str, shard_id: str, log_dir: Path, *args: str, port: int = 0,
                namespace: str = "kvs") -> ServerProcess:
    return start_server("--redis-url", redis_url, "--redis-namespace", namespace, "--shard", shard_id, *args,
                        port=port, persistence=True, log_dir=log_dir)

"""What a deployment asks for: pools, their shape, and how the allocator runs (`kvservice serve` flags).

    config (here) -> placement (allocator + pools) -> actors
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DeployConfig:
    pools: int | None = None  # pools p0..p{pools-1}; None: 2 on a cluster that has none, else those up
    add_pools: int = 0  # new pools after those up (scale out)
    dcp: int = 1
    num_blocks: int = 512  # per pool, including the null block
    block_size: int | None = None  # None: the allocator's hash block size (stores need exactly that)
    max_model_len: int = 1024
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    backend: str | None = None  # default: triton on GPU pools, the torch twin on CPU pools
    rank_cpus: float = 0.5  # CPUs per rank on CPU-only clusters (fractions let small nodes host several)
    host: str = "0.0.0.0"  # the allocator's bind address; 127.0.0.1 for local runs (--local, tests)
    insecure: bool = False  # beyond loopback without --token-file: auth off (else a token is generated)
    port: int = 50051  # 0: any free port (the allocator's target() says which)
    data_dir: str = "~/kvservice-data"  # on the head node; for the embedded Redis
    redis_url: str | None = None
    no_persistence: bool = False
    token_file: str | None = None  # on the head node; turns auth on
    token: str | None = None  # what the engines and the router send
    tls_cert: str | None = None  # the allocator's certificate (PEM, on the head node): turns TLS on
    tls_key: str | None = None  # ...and its private key
    tls_ca: str | None = None  # the CA that signed it (PEM, on every node): what the engines and the router trust
    allocator: str | None = None  # an allocator running elsewhere (host:port): start none
    allocator_shards: int = 1  # > 1: that many allocator shards (needs redis_url), spread over nodes
    standbys: bool = False  # a hot standby beside each allocator (or shard), on another node (needs redis_url)
    detached: bool = False  # pools outlive this driver
    timeout_s: float = 600.0  # for the pools' placement groups (an autoscaler may have to add nodes first)
    stores: bool = False  # a KV block store (kvservice.blockstore) on every node, for vLLM's KVServiceConnector
    store_pages: int = 1024  # pages per store (page 0 is never used)
    store_page_bytes: int = 0  # one block of every layer of the engines' model (the connector checks it)
    store_dir: str = "/dev/shm"  # where each node's store keeps its shared-memory segment
    store_disk: str | None = None  # each node's store's disk tier (page files in this dir on its node)
    store_disk_bytes: int = 0

    def shard_ids(self) -> list[str]:
        return [f"s{i}" for i in range(self.allocator_shards)] if self.allocator_shards > 1 else []

    def serve_args(self) -> list[str]:
        # The data dir also holds the token the allocator generates when no --token-file is given (it
        # listens beyond loopback, so auth is on).
        args = ["--host", self.host, "--port", str(self.port), "--data-dir", self.data_dir]
        if self.redis_url:
            args += ["--redis-url", self.redis_url]
        elif self.no_persistence:
            args += ["--no-persistence"]
        if self.token_file:
            args += ["--token-file", self.token_file]
        if self.insecure:
            args += ["--insecure"]
        if self.tls_cert or self.tls_key:
            args += ["--tls-cert", self.tls_cert or "", "--tls-key", self.tls_key or ""]
        return args

    def client_tls(self) -> dict[str, str]:
        """The TLS keyword arguments of every KVServiceClient the deployment starts (none: plaintext)."""
        return {"tls_ca": self.tls_ca} if self.tls_ca else {}

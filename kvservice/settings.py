"""The allocator's and the server's settings, each field spelled once: its default, its `kvservice serve`
flag and its help text. The CLI builds its parser from these records, the server reads them, and the
standby snapshotter gets the allocator's through `AllocatorSettings.to_argv()` (it must apply WAL
entries exactly as the leader does)."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kvservice.external.spec import FLAG_HELP as EXTERNAL_FLAG_HELP
from kvservice.hashing import DEFAULT_HASH_BLOCK_SIZE, DEFAULT_HASH_SEED


def flag(default: Any, name: str, help: str, group: str = "", **argparse_kw: Any) -> Any:
    """A settings field with its command-line flag (argparse keyword arguments after `help`)."""
    meta = {"flag": name, "help": help, "group": group, "kw": argparse_kw}
    if isinstance(default, dict | list):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def parse_quota(text: str) -> tuple[str, int]:
    tenant, _, blocks = text.partition("=")
    if not tenant or not blocks.isdigit():
        raise argparse.ArgumentTypeError(f"--quota wants TENANT=BLOCKS, got {text!r}")
    return tenant, int(blocks)


@dataclass(slots=True)
class AllocatorSettings:
    """Everything that changes how the state machine applies a command (the standby must use the same)."""

    hash_block_size: int = flag(DEFAULT_HASH_BLOCK_SIZE, "--hash-block-size",
                                "tokens per hashed block, the prefix identity of every pool (each pool's block "
                                "size must be a multiple of it)", type=int)
    hash_seed: str = flag(DEFAULT_HASH_SEED, "--hash-seed", "seed of the hash chain's root (README: Hash specs); "
                          "clients hashing prompts themselves must use the same")
    session_ttl_s: float = flag(30.0, "--session-ttl", "session lease in seconds: a session silent that long has "
                                "its requests freed (clients renew it in the background)", type=float)
    event_retention: int = flag(100_000, "--event-retention", "events kept for WatchEvents to resume from",
                                type=int)
    quotas: dict[str, int] = flag({}, "--quota", "per-tenant block quota, repeatable", type=parse_quota,
                                  action="append", metavar="TENANT=BLOCKS")
    min_transfer_tokens: int = flag(64, "--min-transfer-tokens", "propose a cross-pool prefix transfer only when "
                                    "it saves at least this many tokens", type=int)
    max_requests_per_session: int = flag(1_000_000, "--max-requests-per-session", "live requests one session may "
                                         "hold (more: RESOURCE_EXHAUSTED per op)", type=int)
    max_pool_blocks: int = flag(1 << 22, "--max-pool-blocks", "largest pool RegisterPool accepts, in blocks (each "
                                "costs ~150 bytes of allocator memory)", type=int)
    # The core's fast paths (off: every op takes the general path, which they equal; differential tests).
    fast_path: bool = True
    # Lookup walks one index of every pool (off: it asks each pool in turn, the reference it equals).
    lookup_index: bool = True

    def to_argv(self) -> list[str]:
        """These settings as `kvservice serve` flags (what the standby snapshotter is started with)."""
        out: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if "flag" not in f.metadata:
                continue
            if f.name == "quotas":
                for tenant, blocks in sorted(value.items()):
                    out += [f.metadata["flag"], f"{tenant}={blocks}"]
            else:
                out += [f.metadata["flag"], str(value)]
        return out


@dataclass(slots=True)
class ServerSettings:
    """`kvservice serve`: where it listens, who may call, where its state lives."""

    host: str = flag("127.0.0.1", "--host", "bind address; beyond loopback a token is required (one is generated "
                     "into --data-dir unless --token-file or --insecure is given)")
    port: int = flag(50051, "--port", "gRPC port (0: pick a free one)", type=int)
    data_dir: str = flag("./kvservice-data", "--data-dir", "the allocator's directory: its lock, the embedded "
                         "Redis's data, a generated token")
    metrics_port: int = flag(0, "--metrics-port", "Prometheus /metrics port (0: off)", type=int)
    token_file: str | None = flag(None, "--token-file", "bearer tokens, lines 'token tenant [admin]' (none: auth "
                                  "off on loopback)")
    insecure: bool = flag(False, "--insecure", "allow auth off on a non-loopback address (anyone who can reach "
                          "the port can free every engine's blocks)", action="store_true")
    private: bool = flag(False, "--private", "a private child of one process (worker.LLM, the demo): loopback "
                         "only, and auth off is logged at INFO instead of as a warning", action="store_true")
    tls_cert: str | None = flag(None, "--tls-cert", "server certificate (PEM); with --tls-key turns on TLS")
    tls_key: str | None = flag(None, "--tls-key", "server private key (PEM)")
    tls_ca: str | None = flag(None, "--tls-ca", "client CA (PEM): turns on mutual TLS")
    max_message_mb: int = flag(64, "--max-message-mb", "largest request or reply in MiB", type=int)
    redis_url: str | None = flag(None, "--redis-url", "use this Redis, e.g. redis://host:6379/0, or a Redis Cluster, "
                                 "rediscluster://host:port (none: a private redis-server in --data-dir)",
                                 group="persistence")
    persistence: bool = flag(True, "--no-persistence", "memory only: a restart loses everything",
                             group="persistence", action="store_false")
    require_persistence: bool = flag(False, "--require-persistence", "refuse mutations (UNAVAILABLE) unless they "
                                     "are durable, instead of serving degraded while Redis is down",
                                     group="persistence", action="store_true")
    redis_fsync: str = flag("everysec", "--redis-fsync", "embedded Redis AOF fsync: everysec loses up to ~1 s if "
                            "the Redis host dies, always loses nothing", group="persistence",
                            choices=["everysec", "always", "no"])
    redis_namespace: str = flag("kvservice", "--redis-namespace", "key prefix of this allocator's state in Redis",
                                group="persistence")
    snapshot_every: int = flag(50_000, "--snapshot-every", "snapshot after this many WAL entries",
                               group="persistence", type=int)
    snapshot_interval_s: float = flag(60.0, "--snapshot-interval", "...or after this many seconds with new "
                                      "entries", group="persistence", type=float)
    snapshot_mode: str = flag("standby", "--snapshot-mode", "standby: a process replaying the WAL writes "
                              "snapshots (serving never pauses); fork: a forked child serializes this "
                              "process's memory", group="persistence", choices=["standby", "fork"])
    reset_state: bool = flag(False, "--reset-state", "delete the stored state in --redis-namespace and start "
                             "empty", group="persistence", action="store_true")
    vllm_events: list[str] = flag([], "--vllm-events", EXTERNAL_FLAG_HELP, action="append",
                                  metavar="POOL=tcp://HOST:PORT[,...]")
    shard_id: str = flag("", "--shard", "serve as shard ID of a sharded allocator: pools are spread over the "
                         "shards by a map in Redis (needs --redis-url, the same for every shard)", group="sharding")
    advertise: str = flag("", "--advertise", "HOST:PORT clients reach this shard at, written to the shard map "
                          "(default: --host and the bound port; a PORT of 0: the bound port)", group="sharding")
    standby: bool = flag(False, "--standby", "serve as the hot standby of the allocator (or --shard) in this "
                         "Redis: follow its WAL, answer nothing but GetShardMap, take over when its lease lapses "
                         "(needs --redis-url)", group="sharding", action="store_true")
    leader_lease_s: float = flag(2.0, "--leader-lease", "seconds a leader's lease lasts (renewed twice a second); a "
                                 "standby takes over once it lapsed for that long", group="sharding", type=float)
    redis_wait_s: float = 30.0  # how long start-up waits for Redis to answer
    allocator: AllocatorSettings = field(default_factory=AllocatorSettings)

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb << 20

    @property
    def store_namespace(self) -> str:
        """This allocator's key prefix in Redis: hash tagged (one cluster slot) for a shard or a Redis Cluster."""
        from kvservice.store.redis_store import hash_tagged, is_cluster
        if self.shard_id:
            return hash_tagged(f"{self.redis_namespace}/{self.shard_id}")
        return hash_tagged(self.redis_namespace) if self.redis_url and is_cluster(self.redis_url) else \
            self.redis_namespace


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of `cls` (a settings record) that has one; defaults shown in the help."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(cls):
        meta = f.metadata
        if "flag" not in meta:
            continue
        target = parser
        if meta["group"]:
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_argument_group(meta["group"])
            target = groups[meta["group"]]
        kw = dict(meta["kw"])
        default = f.default if f.default is not MISSING else None
        flagged = kw.get("action") in ("store_true", "store_false")
        shown = "" if flagged or default in (None, "") else f" (default: {default})"
        if kw.get("action") == "append":
            default, shown = None, ""
        if not flagged and "choices" not in kw:
            kw.setdefault("metavar", meta["flag"].lstrip("-").upper().replace("-", "_"))
        target.add_argument(meta["flag"], dest=f.name, default=default, help=meta["help"] + shown, **kw)


def from_args(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """A settings record from parsed flags (`extra`: fields without a flag)."""
    values: dict[str, Any] = {}
    for f in fields(cls):
        if "flag" in f.metadata and hasattr(args, f.name):
            value = getattr(args, f.name)
            if f.name == "quotas":
                value = dict(value or [])
            values[f.name] = value
    return cls(**values, **extra)

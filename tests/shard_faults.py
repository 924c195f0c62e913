"""Faults inside multi-step shard operations, for tests/test_trust_multistep_faults.py (and its soak loop) and
tests/test_trust_shard_pins.py: two
shard leaders (`kvservice serve --shard s0|s1`) on one real Redis, each SIGKILLed and started again with the
same command on the same port (what an operator's restart loop does), pool moves driven phase by phase
(FREEZE, IMPORT, DROP: the MovePool RPC itself) and finished with `kvservice shards move` as an operator
would, cross-shard transfers with either side killed while the source pin is held. `check()` lists every
broken promise: an acknowledged allocation changed, a pool held by two shards, a block held twice or leaked,
an export left behind, a pool that no longer serves."""

from __future__ import annotations

import contextlib
import io
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvservice._proto import allocator_pb2 as pb
from kvservice.cli import main as cli_main
from kvservice.client import KVServiceClient
from kvservice.client.routing import make_stub, open_channel
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.errors import KVServiceError
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp, OpStatus
from kvservice.store.redis_store import hash_tagged
from tests.cluster_helpers import start_shard
from tests.redis_helpers import RedisServer, free_port
from tests.service_helpers import ServerProcess

Phase = pb.MovePoolRequest.Phase
NUM_BLOCKS = 129  # 128 usable (block 0 is the null block)
CONFIG = KVCacheConfig(NUM_BLOCKS, [FullAttentionSpec(16)])
SHARDS = ("s0", "s1")


class Shard:
    """One shard leader on a fixed port; `kill()` is SIGKILL, `restart()` the same command again."""

    def __init__(self, redis_url: str, shard_id: str, log_dir: Path, namespace: str, *args: str) -> None:
        self.redis_url, self.shard_id, self.log_dir, self.namespace, self.args = (redis_url, shard_id, log_dir,
                                                                                  namespace, args)
        self.port = free_port()
        self.proc: ServerProcess | None = None
        self.restart()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.proc.proc.send_signal(signal.SIGKILL)
        self.proc.proc.wait(10)

    def restart(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:  # a forked snapshot child of the killed one may hold the port for a moment
            try:
                self.proc = start_shard(self.redis_url, self.shard_id, self.log_dir, *self.args, port=self.port,
                                        namespace=self.namespace)
                return
            except RuntimeError as exc:
                if "in use" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def call(self, method: str, request, timeout_s: float = 60.0):
        """One RPC to this shard only (no routing, no redirects)."""
        with open_channel(self.target) as channel:
            return getattr(make_stub(channel), method)(request, timeout=timeout_s)

    def pools(self) -> dict[str, pb.PoolStats]:
        """The pools this shard holds, with the invariant checks run."""
        stats = self.call("GetStats", pb.GetStatsRequest(check_invariants=True))
        return {p.pool_id: p for p in stats.pools}

    def stop(self) -> None:
        self.proc.stop()


class Fleet:
    """A real Redis (its own data dir, a free port) and the shards on it (two unless `shards` says)."""

    def __init__(self, tmp: Path, namespace: str = "multistep", *shard_args: str,
                 shards: tuple[str, ...] = SHARDS) -> None:
        self.redis = RedisServer(tmp / "redis", appendfsync="always")
        self.redis.start()
        self.namespace = namespace
        self.shards = {s: Shard(self.redis.url, s, tmp, namespace, "--session-ttl", "30", *shard_args)
                       for s in shards}

    @property
    def seeds(self) -> str:
        return ",".join(s.target for s in self.shards.values())

    def client(self, **kw) -> KVServiceClient:
        return KVServiceClient(self.seeds, failover_timeout_s=30, **kw)

    def owner(self, pool_id: str) -> str:
        with self.client() as c:
            return dict(c.shard_map().pools)[pool_id]

    def phase(self, shard: str, pool_id: str, phase: int, **fields) -> pb.MovePoolResponse:
        return self.shards[shard].call("MovePool", pb.MovePoolRequest(pool_id=pool_id, phase=phase, **fields))

    def move(self, pool_id: str, to_shard: str, reconnect_s: float = 15.0) -> tuple[int, str]:
        """`kvservice shards move --pool P --to S`, in this process: (exit code, what it printed). Run again
        while it cannot connect to a shard, for up to `reconnect_s`: in one process gRPC shares connections
        between channels, and one that failed to a shard just restarted waits out its backoff."""
        deadline = time.monotonic() + reconnect_s
        while True:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                rc = cli_main(["shards", "move", "--target", self.seeds, "--pool", pool_id, "--to", to_shard])
            if rc == 0 or "failed to connect" not in out.getvalue() or time.monotonic() > deadline:
                return rc, out.getvalue()
            time.sleep(0.5)

    def kill_and_restart(self, shard: str, while_down=None) -> None:
        self.shards[shard].kill()
        if while_down is not None:
            while_down()
        self.shards[shard].restart()

    def handoff_left(self, pool_id: str) -> bool:
        with self.redis.client() as r:
            return bool(r.exists(f"{hash_tagged(self.namespace)}:shards:handoff:{pool_id}"))

    def stop(self) -> None:
        for s in self.shards.values():
            s.stop()
        self.redis.stop()


@dataclass
class Acked:
    """Requests on one pool whose allocations the client saw acknowledged, with their block tables."""

    pool_id: str
    tables: dict[str, tuple[list[int], int]] = field(default_factory=dict)

    def add(self, client: KVServiceClient, n: int, tag: str, tokens: int = 40) -> None:
        for i in range(n):
            rid = f"{tag}-{i}"
            prompt = [hash((self.pool_id, tag, i, j)) % 30000 for j in range(tokens)]  # no shared prefixes
            r = client.step(self.pool_id, [AddRequestOp(rid, token_ids=prompt), AllocateOp(rid, num_new_tokens=tokens)])
            assert r[1].status == OpStatus.OK, r[1]
            info = client.get_request(self.pool_id, rid)
            self.tables[rid] = (list(info.block_ids[0]), info.num_tokens)


class Load(threading.Thread):
    """Steps on one pool while faults happen: admits requests and frees the oldest (at most `live` held),
    recording in `acked` each allocation acknowledged. A step that failed may have been applied: `settle()`
    then asks for it (it must exist once or not at all)."""

    def __init__(self, fleet: Fleet, acked: Acked, tag: str, live: int = 8) -> None:
        super().__init__(daemon=True)
        self.client, self.acked, self.tag, self.live = fleet.client(), acked, tag, live
        self.stop_now = threading.Event()
        self.uncertain: list[str] = []
        self.problems: list[str] = []
        self.steps = 0

    def run(self) -> None:
        pool, n, mine = self.acked.pool_id, 0, []
        while not self.stop_now.is_set():
            rid = f"{self.tag}-{n}"
            n += 1
            prompt = [hash((pool, rid, j)) % 30000 for j in range(40)]
            try:
                r = self.client.step(pool, [AddRequestOp(rid, token_ids=prompt), AllocateOp(rid, num_new_tokens=40)])
                if r[0].status != OpStatus.OK:  # ALREADY_EXISTS: a resent step applied twice
                    self.problems.append(f"{pool}/{rid}: {r[0]}")
                if r[1].status == OpStatus.OK:
                    info = self.client.get_request(pool, rid)
                    self.acked.tables[rid] = (list(info.block_ids[0]), info.num_tokens)
                    mine.append(rid)
                self.steps += 1
                if len(mine) > self.live:
                    old = mine.pop(0)
                    self.client.free(pool, old)
                    del self.acked.tables[old]
            except KVServiceError:
                self.uncertain.append(rid)
                time.sleep(0.1)

    def settle(self) -> list[str]:
        """Stops; adopts into `acked` each uncertain request that exists after all. Returns the problems."""
        self.stop_now.set()
        self.join(120)
        for rid in self.uncertain:
            with contextlib.suppress(KVServiceError):
                info = self.client.get_request(self.acked.pool_id, rid)
                self.acked.tables[rid] = (list(info.block_ids[0]), info.num_tokens)
        self.client.close()
        return self.problems


def check(fleet: Fleet, pool_id: str, acked: Acked) -> list[str]:
    """Every broken promise about `pool_id` after the faults (an empty list: all kept). Frees the pool's
    requests at the end (a drained pool must have every block free again)."""
    problems: list[str] = []
    owner = fleet.owner(pool_id)
    held = {s: shard.pools() for s, shard in fleet.shards.items()}
    holders = sorted(s for s, pools in held.items() if pool_id in pools)
    if holders != [owner]:
        problems.append(f"pool {pool_id} held by shards {holders}; the shard map gives it to {owner}")
    for s, pools in held.items():
        problems += [f"{s}/{p}: {v.invariant_violation}" for p, v in pools.items() if v.invariant_violation]
    if fleet.handoff_left(pool_id):
        problems.append(f"pool {pool_id}: its move's export is still in Redis")
    with fleet.client() as c:
        blocks: dict[int, str] = {}
        for rid, (table, tokens) in sorted(acked.tables.items()):
            try:
                info = c.get_request(pool_id, rid)
            except KVServiceError as exc:
                problems.append(f"{pool_id}/{rid}: acknowledged, now {exc.code.name}: {exc}")
                continue
            if list(info.block_ids[0]) != table or info.num_tokens != tokens:
                problems.append(f"{pool_id}/{rid}: blocks {list(info.block_ids[0])} ({info.num_tokens} tokens), "
                                f"acknowledged {table} ({tokens})")
            for b in info.block_ids[0]:
                if b in blocks:
                    problems.append(f"{pool_id}: block {b} held by {blocks[b]} and {rid}")
                blocks[b] = rid
        stats = fleet.shards[owner].pools().get(pool_id)
        if stats is not None and stats.num_requests == len(acked.tables):
            used = stats.num_blocks - 1 - stats.num_free_blocks
            if used != len(blocks):
                problems.append(f"{pool_id}: {used} blocks in use, the acknowledged requests hold {len(blocks)}")
        try:  # the pool serves new steps
            r = c.step(pool_id, [AddRequestOp("after", token_ids=list(range(5000, 5040))),
                                 AllocateOp("after", num_new_tokens=40), FreeOp("after")])
            if r[1].status != OpStatus.OK:
                problems.append(f"{pool_id}: a new step after the faults: {r[1]}")
            if acked.tables:
                c.free(pool_id, *sorted(acked.tables))
        except KVServiceError as exc:
            problems.append(f"{pool_id}: a new step after the faults: {exc.code.name}: {exc}")
        stats = fleet.shards[owner].pools().get(pool_id)
        if stats is None or stats.num_free_blocks != stats.num_blocks - 1 or stats.num_pending_transfers:
            problems.append(f"{pool_id}: after freeing everything: {stats}")
    acked.tables.clear()
    return problems


def new_pool(fleet: Fleet, pool_id: str, on: str | None = None) -> str:
    """Registers `pool_id` (on shard `on`, moved there if placement chose the other); returns its shard."""
    with fleet.client() as c:
        c.register_pool(pool_id, CONFIG, max_model_len=1024, kv_layout="block=16")  # transfers need a layout
    shard = fleet.owner(pool_id)
    if on is not None and shard != on:
        rc, out = fleet.move(pool_id, on)
        assert rc == 0, out
        shard = on
    return shard


def other(shard: str) -> str:
    return next(s for s in SHARDS if s != shard)


__all__ = ["CONFIG", "NUM_BLOCKS", "SHARDS", "Acked", "Fleet", "Load", "Phase", "Shard", "check", "new_pool", "other"]

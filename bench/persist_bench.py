"""Persistence benchmark, all in one run against a real redis-server:

- Step latency with persistence on vs off (decode and admission steps; ratio);
- Step p99 while snapshots are being taken vs without (target <= 2x);
- WAL bytes per op;
- recovery time (snapshot load + WAL replay) for 100k and 1M cached blocks (target <= 5 s for 1M).

    python bench/persist_bench.py [--steps 200] [--sizes 100000,1000000]
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # we spawn processes after using gRPC

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bar_plot, median, percentile, table, write_json  # noqa: E402
from bench.rpc_bench import Progress, start  # noqa: E402
from kvservice._proto import allocator_pb2 as pb  # noqa: E402
from kvservice.allocator import Allocator  # noqa: E402
from kvservice.client import KVServiceClient  # noqa: E402
from kvservice.commands import OpenSession, PoolSpec, RegisterPool, Step, StepRpc  # noqa: E402
from kvservice.core import FullAttentionSpec, KVCacheConfig  # noqa: E402
from kvservice.ops import AddRequestOp, AllocateOp, DecodeBatchOp, FreeOp  # noqa: E402
from kvservice.store import wal  # noqa: E402
from kvservice.store.recovery import recover  # noqa: E402
from kvservice.store.redis_store import RedisStore  # noqa: E402
from kvservice.store.snapshot import dump  # noqa: E402
from kvservice.wire.decode import step_command  # noqa: E402
from tests.redis_helpers import RedisServer  # noqa: E402

BS = 16


def serve(redis_url: str | None, namespace: str, *extra: str):
    args = ["--redis-url", redis_url, "--redis-namespace", namespace] if redis_url else ["--no-persistence"]
    return start([sys.executable, "-m", "kvservice.cli", "--log-level", "ERROR", "serve", "--port", "0", *args,
                  *extra], "kvservice serving on")


def workload(target: str, steps: int, label: str, num_blocks: int = 20_000) -> dict:
    rng = random.Random(0)
    client = KVServiceClient(target, timeout_s=60)
    client.register_pool("p", KVCacheConfig(num_blocks, [FullAttentionSpec(BS)]), 8192)
    prompts = [[rng.randrange(32000) for _ in range(rng.randint(100, 900))] for _ in range(256)]
    ops = []
    for i, p in enumerate(prompts):
        ops += [AddRequestOp(f"d{i}", token_ids=p), AllocateOp(f"d{i}", num_new_tokens=len(p))]
    client.step("p", ops)
    computed = [len(p) for p in prompts]
    decode, admit = [], []
    prefix = [rng.randrange(32000) for _ in range(512)]
    progress = Progress(label, steps)
    for s in range(steps):
        t0 = time.perf_counter()
        client.step("p", [DecodeBatchOp([f"d{i}" for i in range(256)], computed,
                                        [rng.randrange(32000) for _ in range(256)])])
        decode.append(time.perf_counter() - t0)
        computed = [c + 1 for c in computed]
        if s % 4 == 0:
            batch = [prefix + [rng.randrange(32000) for _ in range(512)] for _ in range(32)]
            step_ops = []
            for i, p in enumerate(batch):
                step_ops += [AddRequestOp(f"a{s}-{i}", token_ids=p), AllocateOp(f"a{s}-{i}", num_new_tokens=1024)]
            t0 = time.perf_counter()
            client.step("p", step_ops)
            admit.append(time.perf_counter() - t0)
            client.step("p", [FreeOp(f"a{s}-{i}") for i in range(32)])
        progress(s + 1)
    stats = client.stub.GetStats(pb.GetStatsRequest(), timeout=30)
    num_ops = steps * 256 + len(admit) * 64 + len(admit) * 32 + 512
    client.close()
    return {"decode": decode, "admit": admit, "wal_bytes": stats.wal_bytes_written,
            "wal_entries": stats.wal_entries_written, "ops": num_ops, "snapshots": stats.snapshots_written}


def build_state(num_cached_blocks: int) -> Allocator:
    """An allocator whose one pool holds `num_cached_blocks` cached (free, LRU) blocks."""
    a = Allocator()
    a.apply(OpenSession("bench", "", "bench"), 0.0)
    a.apply(RegisterPool("bench", "", 1, PoolSpec("big", KVCacheConfig(num_cached_blocks + 1, [FullAttentionSpec(BS)]),
                                                  4096), a.fingerprint), 0.0)
    pool = a.pool("big")
    rng = random.Random(1)
    seq = 2
    per_req = 64
    progress = Progress(f"building {num_cached_blocks:,} cached blocks", num_cached_blocks // per_req)
    for r in range(num_cached_blocks // per_req):
        rid = f"r{r}"
        toks = [rng.randrange(32000) for _ in range(per_req * BS)]
        a.apply(Step("bench", "", seq, "big", [AddRequestOp(rid, token_ids=toks),
                                               AllocateOp(rid, num_new_tokens=len(toks)), FreeOp(rid)]), 0.0)
        seq += 1
        progress(r + 1)
    pool.manager.take_events()
    return a


async def recovery_time(redis_url: str, allocator: Allocator, namespace: str, tail: int) -> dict:
    """Writes the state as a snapshot plus `tail` WAL entries, then times load + replay."""
    store = RedisStore(redis_url, namespace, socket_timeout_s=60)
    await store.reset()
    await store.acquire_leadership()
    data = dump(allocator)
    await store.redis.set(store.k_snapshot, data)
    await store.redis.set(store.k_snapshot_id, b"0-1")
    entries = []
    first = allocator.state.sessions.sessions["bench"].last_sequence + 1
    for i in range(tail):
        req = pb.StepRequest(session_id="bench", sequence=first + i, pool_id="big")
        op = req.ops.add().add
        op.request_id = f"tail{i}"
        op.token_ids = bytes(4 * 64)
        raw = req.SerializeToString()
        entries.append(wal.encode(step_command(StepRpc.STEP, req, raw, "")))
    if entries:
        await store.append(entries)
    t0 = time.perf_counter()
    snapshot, _, tail_entries = await store.load()
    t_read = time.perf_counter() - t0
    fresh = Allocator()
    info = recover(fresh, snapshot, tail_entries)
    total = time.perf_counter() - t0
    assert len(fresh.pool("big").manager.block_pool.cached_block_hash_to_block) >= len(
        allocator.pool("big").manager.block_pool.cached_block_hash_to_block)
    await store.reset()
    await store.close()
    return {"snapshot_mb": len(data) / 2**20, "read_s": t_read, "load_replay_s": info["seconds"], "total_s": total,
            "wal_tail": tail}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="decode steps per configuration (every 4th also "
                        "admits 32 prompts); enough for several snapshots at --snapshot-interval 0.3")
    parser.add_argument("--sizes", default="100000,1000000")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvservice-persist-bench-"))
    redis = RedisServer(tmp, appendfsync="everysec")
    redis.start()
    procs: list[subprocess.Popen] = []
    try:
        results = {}
        for label, url, extra in [
            ("off", None, ()),
            ("on", redis.url, ("--snapshot-every", "10000000", "--snapshot-interval", "100000")),
            ("on + snapshots (standby)", redis.url, ("--snapshot-every", "10000000", "--snapshot-interval", "0.3")),
            ("on + snapshots (fork)", redis.url, ("--snapshot-every", "10000000", "--snapshot-interval", "0.3",
                                                  "--snapshot-mode", "fork")),
        ]:
            proc, target = serve(url, f"bench-{label.replace(' ', '')}", *extra)
            procs.append(proc)
            results[label] = workload(target, args.steps, f"steps, persistence {label}")
            proc.terminate()
            proc.wait(30)
        rows = []
        base = results["off"]
        for label, r in results.items():
            rows.append([label, median(r["decode"]) * 1e3, percentile(r["decode"], 99) * 1e3,
                         median(r["admit"]) * 1e3, percentile(r["admit"], 99) * 1e3,
                         median(r["decode"]) / median(base["decode"]), r["snapshots"],
                         r["wal_bytes"] / max(1, r["ops"])])
        print()
        print(table(["persistence", "decode p50 ms", "decode p99 ms", "admit p50 ms", "admit p99 ms",
                     "decode p50 / off", "snapshots", "WAL bytes/op"], rows))
        snap_ratio = (percentile(results["on + snapshots (standby)"]["decode"], 99)
                      / percentile(results["on"]["decode"], 99))
        fork_ratio = (percentile(results["on + snapshots (fork)"]["decode"], 99)
                      / percentile(results["on"]["decode"], 99))
        print(f"decode Step p99 while snapshotting / without: {snap_ratio:.2f} with the standby snapshotter "
              f"(target <= 2), {fork_ratio:.2f} with forked snapshots")

        recovery = {}
        for size in [int(s) for s in args.sizes.split(",") if s]:
            a = build_state(size)
            recovery[size] = asyncio.run(recovery_time(redis.url, a, f"bench-rec-{size}", tail=1000))
            del a
        print()
        print(table(["cached blocks", "snapshot MB", "Redis read s", "load + replay 1k WAL s", "total s"],
                    [[f"{k:,}", v["snapshot_mb"], v["read_s"], v["load_replay_s"], v["total_s"]]
                     for k, v in recovery.items()]))
        path = write_json("persist", {
            "steps": args.steps,
            "latency": {k: {"decode_p50_ms": median(v["decode"]) * 1e3,
                            "decode_p99_ms": percentile(v["decode"], 99) * 1e3,
                            "admit_p50_ms": median(v["admit"]) * 1e3, "admit_p99_ms": percentile(v["admit"], 99) * 1e3,
                            "wal_bytes_per_op": v["wal_bytes"] / max(1, v["ops"]), "snapshots": v["snapshots"]}
                        for k, v in results.items()},
            "snapshot_p99_ratio": snap_ratio, "fork_snapshot_p99_ratio": fork_ratio,
            "recovery": {str(k): v for k, v in recovery.items()}})
        bar_plot("persist", "Step p50 / p99 (ms) by persistence mode", list(results),
                 {"decode p50": [median(r["decode"]) * 1e3 for r in results.values()],
                  "decode p99": [percentile(r["decode"], 99) * 1e3 for r in results.values()],
                  "admit p50": [median(r["admit"]) * 1e3 for r in results.values()]}, "ms")
        print(f"wrote {path}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sharded allocator benchmark (issue 18), against real `kvservice serve --shard` processes on loopback over
one real Redis, in one run:

1. throughput: aggregate Steps/s and Step p50/p99 with 1, 2 and 4 shards under E concurrent engine clients
   (each its own pool, session and connections, looping decode Steps of B running requests; the engines
   spread over client processes), and the CPU every Step costs the shard, its snapshotter and Redis: the
   per-Step cost the README's capacity model projects from;
2. failover: a shard leader SIGKILLed while an engine steps; time from the kill to the first Step its hot
   standby served (p50 over K kills; a new standby started after each);
3. Lookup: the sharded client's fan-out (every shard at once) against PrefixIndex, a client-side replica of
   the index fed by each shard's WatchEvents stream: latency, agreement, staleness, memory, sync cost.

    python bench/shard_bench.py [--shards 1,2,4] [--engines 16] [--batch 256] [--seconds 10] [--kills 10]

On 2 cores the client processes and the shards share the CPUs: the 1 -> 2 step shows most of what a
second shard buys here; past it the machine, not the allocator, is the limit.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # we spawn processes after using gRPC

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import signal
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from bench.common import RESULTS, bar_plot, median, percentile, table, write_json  # noqa: E402
from kvservice.client import AsyncKVServiceClient, KVServiceClient, PrefixIndex  # noqa: E402
from kvservice.core import FullAttentionSpec, KVCacheConfig  # noqa: E402
from kvservice.ops import AdmitBatchOp, DecodeBatchOp, FreeOp, OpStatus  # noqa: E402
from tests.cluster_helpers import start_shard  # noqa: E402
from tests.redis_helpers import RedisServer, debian_redis  # noqa: E402

BS = 16
MAX_LEN = 4096
ROUND_STEPS = 200  # an engine's requests finish and new ones are admitted every this many decode Steps


def pool_config(batch: int) -> KVCacheConfig:
    blocks_per_request = (512 + ROUND_STEPS) // BS + 2
    return KVCacheConfig(batch * blocks_per_request * 2, [FullAttentionSpec(BS)])


class Fleet:
    """`n` shards s0.. (each a leader, optionally with a standby) over one Redis namespace."""

    def __init__(self, redis_url: str, n: int, log_dir: Path, namespace: str, standbys: bool = False,
                 extra: tuple[str, ...] = ()) -> None:
        self.redis_url, self.log_dir, self.namespace, self.extra = redis_url, log_dir, namespace, extra
        self.ids = [f"s{i}" for i in range(n)]
        self.leaders = {s: self.start(s) for s in self.ids}
        self.standbys = {s: self.start(s, "--standby") for s in self.ids} if standbys else {}

    def start(self, shard: str, *args: str):
        return start_shard(self.redis_url, shard, self.log_dir, *self.extra, *args, namespace=self.namespace)

    @property
    def seeds(self) -> str:
        return ",".join(p.target for p in self.leaders.values())

    def stop(self) -> None:
        for p in [*self.leaders.values(), *self.standbys.values()]:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in [*self.leaders.values(), *self.standbys.values()]:
            try:
                p.proc.wait(10)
            except Exception:
                p.proc.kill()


def cpu_seconds(pids: list[int], children: bool = True) -> float:
    """User + system CPU seconds of these processes (and their children)."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for p in [root, *(root.children(recursive=True) if children else [])]:
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class CpuMeter:
    """CPU seconds of named process sets between `start` and `stop`."""

    def __init__(self, **sets: tuple[list[int], bool]) -> None:
        self.sets, self.begin, self.used = sets, {}, {}

    def start(self) -> None:
        self.begin = {k: cpu_seconds(p, c) for k, (p, c) in self.sets.items()}

    def stop(self) -> dict[str, float]:
        self.used = {k: cpu_seconds(p, c) - self.begin[k] for k, (p, c) in self.sets.items()}
        return self.used


# ---- 1. throughput ----------------------------------------------------------------------------------
def prompts_for(rng: random.Random, n: int) -> list[array]:
    return [array("I", (rng.randrange(32000) for _ in range(rng.randint(128, 512)))) for _ in range(n)]


async def engine(seeds: str, pool_id: str, batch: int, window: tuple[float, float], stop_at: float,
                 seed: int) -> tuple[int, list[float], int]:
    """One engine: its own client and session; admits `batch` requests, then decode Steps of all of them,
    a new round of requests every ROUND_STEPS. Returns (decode Steps that ended inside `window`, their
    latencies, Steps that failed)."""
    rng = random.Random(seed)
    latencies, in_window, failed = [], 0, 0
    async with AsyncKVServiceClient(seeds, retries=3, timeout_s=30, failover_timeout_s=30) as client:
        await client.open_session()
        round_ = 0
        while time.time() < stop_at:
            ids = [f"{pool_id}-r{round_}-{i}" for i in range(batch)]
            prompts = prompts_for(rng, batch)
            admitted = await client.step(pool_id, [AdmitBatchOp(ids, prompts)])
            assert admitted.results[0].batch.statuses == bytes(batch), admitted.results[0]
            computed = array("I", (len(p) for p in prompts))
            for _ in range(ROUND_STEPS):
                tokens = array("I", (rng.randrange(32000) for _ in range(batch)))
                t0 = time.perf_counter()
                reply = await client.step(pool_id, [DecodeBatchOp(ids, computed, tokens)])
                elapsed = time.perf_counter() - t0
                if reply.results[0].batch.statuses != bytes(batch):
                    failed += 1
                end = time.time()
                if window[0] <= end <= window[1]:
                    in_window += 1
                    latencies.append(elapsed)
                computed = array("I", (c + 1 for c in computed))
                if end >= stop_at:
                    break
            freed = await client.step(pool_id, [FreeOp(rid) for rid in ids])
            assert all(r.status == OpStatus.OK for r in freed.results)
            round_ += 1
    return in_window, latencies, failed


def engine_process(seeds: str, pool_ids: list[str], batch: int, window: tuple[float, float], stop_at: float,
                   out: mp.Queue) -> None:
    async def run():
        return await asyncio.gather(*(engine(seeds, p, batch, window, stop_at, hash(p) & 0xFFFF)
                                      for p in pool_ids))
    results = asyncio.run(run())
    out.put((sum(r[0] for r in results), [x for r in results for x in r[1]], sum(r[2] for r in results)))


def throughput(redis: RedisServer, shards: int, engines: int, batch: int, seconds: float, procs: int,
               log_dir: Path) -> dict:
    fleet = Fleet(redis.url, shards, log_dir, namespace=f"tp{shards}")
    try:
        pools = [f"e{i}" for i in range(engines)]
        with KVServiceClient(fleet.seeds) as admin:
            for p in pools:  # each new pool to the least-loaded shard
                admin.register_pool(p, pool_config(batch), MAX_LEN)
            placed = admin.shard_map().pools
        per_shard = {s: sum(1 for p in pools if placed[p] == s) for s in fleet.ids}
        warm = 3.0
        start = time.time() + 4.0  # the processes start meanwhile
        window = (start + warm, start + warm + seconds)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        workers = [ctx.Process(target=engine_process, args=(fleet.seeds, pools[k::procs], batch, window,
                                                            window[1] + 0.5, out)) for k in range(procs)]
        for w in workers:
            w.start()
        leaders = [p.proc.pid for p in fleet.leaders.values()]
        meter = CpuMeter(shards=(leaders, False), with_snapshotters=(leaders, True), redis=([redis.pid], False),
                         clients=([w.pid for w in workers], True))
        time.sleep(max(0.0, window[0] - time.time()))
        meter.start()
        time.sleep(max(0.0, window[1] - time.time()))
        used = meter.stop()
        results = [out.get(timeout=600) for _ in workers]
        for w in workers:
            w.join(60)
        steps = sum(r[0] for r in results)
        lat = [x for r in results for x in r[1]]
        failed = sum(r[2] for r in results)
        return {"shards": shards, "engines": engines, "batch": batch, "pools_per_shard": per_shard,
                "steps": steps, "steps_per_s": steps / seconds, "failed_steps": failed,
                "p50_ms": median(lat) * 1e3, "p99_ms": percentile(lat, 99) * 1e3,
                "shard_cpu_ms_per_step": used["shards"] / max(steps, 1) * 1e3,
                "snapshotter_cpu_ms_per_step": (used["with_snapshotters"] - used["shards"]) / max(steps, 1) * 1e3,
                "redis_cpu_ms_per_step": used["redis"] / max(steps, 1) * 1e3,
                "client_cpu_ms_per_step": used["clients"] / max(steps, 1) * 1e3,
                "cpu_util": {k: v / seconds for k, v in used.items()}}
    finally:
        fleet.stop()


# ---- 2. failover ------------------------------------------------------------------------------------
class Stepper(threading.Thread):
    """An engine stepping `batch` requests of one pool in a loop (new requests when they near
    max_model_len); records when each Step's reply came back. A lost or refused Step is an error."""

    def __init__(self, client: KVServiceClient, pool_id: str, batch: int, rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.client, self.pool_id, self.batch, self.rng = client, pool_id, batch, rng
        self.replies: list[tuple[float, str]] = []  # (when, the address that answered)
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self.round, self.ids, self.computed = 0, [], array("I")

    def continue_from(self, old: Stepper) -> Stepper:
        """This stepper takes over `old`'s session (stopped) and requests."""
        self.client.continue_session(old.client.session_id, old.client.next_sequence)
        self.round, self.ids, self.computed, self.errors = old.round, old.ids, old.computed, old.errors
        return self

    def admit(self) -> None:
        if self.ids:
            freed = self.client.step(self.pool_id, [FreeOp(r) for r in self.ids])
            assert all(r.status == OpStatus.OK for r in freed.results), freed
        self.round += 1
        self.ids = [f"f{self.round}-{i}" for i in range(self.batch)]
        prompts = prompts_for(self.rng, self.batch)
        r = self.client.step(self.pool_id, [AdmitBatchOp(self.ids, prompts)])
        assert r.results[0].batch.statuses == bytes(self.batch), r
        self.computed = array("I", (len(p) for p in prompts))

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                if not self.ids or max(self.computed) >= MAX_LEN - 1:
                    self.admit()
                tokens = array("I", (self.rng.randrange(32000) for _ in range(self.batch)))
                reply = self.client.step(self.pool_id, [DecodeBatchOp(self.ids, self.computed, tokens)])
                if reply.results[0].batch.statuses != bytes(self.batch):
                    raise RuntimeError(f"decode refused: {reply.results[0].batch.failures[:1]}")
                self.replies.append((time.monotonic(), self.client.shards.conn_for(self.pool_id).address))
                self.computed = array("I", (c + 1 for c in self.computed))
                time.sleep(0.005)  # ~ an engine's step cadence; keeps the timeline fine-grained
        except Exception as exc:  # recorded: a lost Step fails the benchmark
            self.errors.append(repr(exc))

    def first_reply_after(self, t: float, timeout_s: float, not_from: str) -> float | None:
        """When the first Step after `t` answered by another server than `not_from` came back."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            after = [x for x, address in self.replies[-50:] if x > t and address != not_from]
            if after:
                return after[0]
            if self.errors:
                raise RuntimeError(self.errors[0])
            time.sleep(0.005)
        return None


def failover(redis: RedisServer, kills: int, lease_s: float, log_dir: Path) -> dict:
    fleet = Fleet(redis.url, 1, log_dir, namespace=f"fo{lease_s}", standbys=True,
                  extra=("--leader-lease", str(lease_s)))
    rng = random.Random(7)

    def engine_client() -> KVServiceClient:  # told the leader and its standby, as a deployment would
        return KVServiceClient(f"{fleet.leaders['s0'].target},{fleet.standbys['s0'].target}", retries=3,
                               timeout_s=30, failover_timeout_s=60)
    try:
        batch = 32
        with KVServiceClient(fleet.seeds) as admin:
            admin.register_pool("fo", KVCacheConfig(batch * MAX_LEN // BS + 64, [FullAttentionSpec(BS)]), MAX_LEN)
        stepper = Stepper(engine_client(), "fo", batch, rng)
        stepper.client.open_session()
        stepper.start()
        times = []
        for k in range(kills):
            time.sleep(1.0)  # steady stepping before the kill
            leader = fleet.leaders["s0"]
            killed_at = time.monotonic()
            leader.proc.send_signal(signal.SIGKILL)
            served = stepper.first_reply_after(killed_at, 60, not_from=leader.target)
            if served is None:
                raise RuntimeError(f"kill {k}: no Step served within 60 s")
            times.append(served - killed_at)
            leader.proc.wait(10)
            print(f"  failover {k + 1}/{kills}: {times[-1]:.3f} s (lease {lease_s} s)", flush=True)
            # The standby leads now; it gets a new standby, and the engine a client that knows both.
            fleet.leaders["s0"], fleet.standbys["s0"] = fleet.standbys["s0"], fleet.start("s0", "--standby")
            stepper.stopping.set()
            stepper.join(30)
            stepper.client.close()
            stepper = Stepper(engine_client(), "fo", batch, rng).continue_from(stepper)
            stepper.start()
        stepper.stopping.set()
        stepper.join(30)
        stepper.client.close()
        if stepper.errors:
            raise RuntimeError(f"an engine's Step failed: {stepper.errors[0]}")
        return {"lease_s": lease_s, "kills": kills, "times_s": times, "p50_s": median(times),
                "max_s": max(times), "min_s": min(times), "lost_steps": len(stepper.errors)}
    finally:
        fleet.stop()


# ---- 3. Lookup: fan-out vs a replicated index -------------------------------------------------------
def lookup_bench(redis: RedisServer, shards: int, pools: int, queries: int, log_dir: Path) -> dict:
    """The client's Lookup (fanned out to every shard) against PrefixIndex (kvservice.client.index: a
    replica of the index from each shard's WatchEvents), on the same prompts, answers compared."""
    fleet = Fleet(redis.url, shards, log_dir, namespace="lk")
    rng = random.Random(3)
    try:
        with KVServiceClient(fleet.seeds) as client:
            ids = [f"lk{i}" for i in range(pools)]
            for p in ids:
                client.register_pool(p, KVCacheConfig(4096, [FullAttentionSpec(BS)]), MAX_LEN)
            families = [[rng.randrange(32000) for _ in range(512)] for _ in range(16)]
            for p in ids:  # each pool caches a few families' prompts
                prompts = [families[rng.randrange(16)] + [rng.randrange(32000) for _ in range(512)]
                           for _ in range(24)]
                rids = [f"{p}-{i}" for i in range(len(prompts))]
                client.step(p, [AdmitBatchOp(rids, prompts)])
                client.step(p, [FreeOp(r) for r in rids])
            # Starting the replica: each shard's dump of its pools, then live events.
            cpu0, t0 = time.process_time(), time.perf_counter()
            index = PrefixIndex(client, refresh_s=1.0)
            assert index.wait_synced(60)
            sync_s, sync_cpu = time.perf_counter() - t0, time.process_time() - cpu0
            blocks = index.num_blocks()
            # Staleness: a new prompt's blocks acknowledged -> visible in the replica.
            staleness = []
            for i in range(50):
                pool = ids[i % len(ids)]
                prompt = [rng.randrange(32000) for _ in range(256)]
                client.step(pool, [AdmitBatchOp([f"st{i}"], [prompt])])
                acked = time.perf_counter()
                while index.lookup(prompt + [1], pool_ids=[pool]).tokens(pool) < 256:
                    time.sleep(0.0002)
                staleness.append(time.perf_counter() - acked)
                client.step(pool, [FreeOp(f"st{i}")])
            fan, local, mismatches = [], [], 0
            meter = CpuMeter(shards=([p.proc.pid for p in fleet.leaders.values()], False))
            meter.start()
            for _ in range(queries):
                prompt = families[rng.randrange(16)] + [rng.randrange(32000) for _ in range(rng.choice([0, 256]))]
                t0 = time.perf_counter()
                res = client.lookup(prompt)
                fan.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                mine = index.lookup(prompt)
                local.append(time.perf_counter() - t0)
                theirs = {h.pool_id: h.num_cached_tokens for h in res.hits}
                mismatches += theirs != {h.pool_id: h.num_cached_tokens for h in mine.hits}
            shard_cpu = meter.stop()["shards"]  # (the replica's lookups cost the shards nothing)
            held = index.approx_bytes()
            index.close()
            return {"shards": shards, "pools": pools, "queries": queries, "cached_blocks": blocks,
                    "fanout_p50_ms": median(fan) * 1e3, "fanout_p99_ms": percentile(fan, 99) * 1e3,
                    "replica_p50_ms": median(local) * 1e3, "replica_p99_ms": percentile(local, 99) * 1e3,
                    "mismatching_queries": mismatches, "remote_lookups": index.remote_lookups,
                    "fanout_shard_cpu_ms_per_lookup": shard_cpu / queries * 1e3,
                    "staleness_p50_ms": median(staleness) * 1e3, "staleness_p99_ms": percentile(staleness, 99) * 1e3,
                    "replica_sync_s": sync_s, "replica_bytes_per_block": held / max(blocks, 1),
                    "replica_ingest_blocks_per_cpu_s": blocks / max(sync_cpu, 1e-9)}
    finally:
        fleet.stop()


def plot(tp: list[dict]) -> None:
    labels = [f"{r['shards']} shard{'s' if r['shards'] > 1 else ''}" for r in tp]
    bar_plot("shard_throughput", f"Aggregate decode Steps/s ({tp[0]['batch']} requests each) by shard count",
             labels, {"Steps/s": [r["steps_per_s"] for r in tp]}, "Steps/s")
    bar_plot("shard_latency", "Step latency by shard count", labels,
             {"p50 ms": [r["p50_ms"] for r in tp], "p99 ms": [r["p99_ms"] for r in tp]}, "ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,2,4", help="shard counts for the throughput series")
    parser.add_argument("--engines", type=int, default=16, help="concurrent engine clients (one pool each)")
    parser.add_argument("--batch", type=int, default=256, help="running requests per decode Step")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per shard count")
    parser.add_argument("--client-procs", type=int, default=2, help="processes the engines are spread over")
    parser.add_argument("--kills", type=int, default=10, help="leader kills for the failover time")
    parser.add_argument("--lease", default="2.0,0.5", help="--leader-lease values for the failover series")
    parser.add_argument("--lookup-queries", type=int, default=300)
    parser.add_argument("--only", choices=["throughput", "failover", "lookup"], help="one part only")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvservice-shard-bench-"))
    redis = RedisServer(tmp / "redis", executable=debian_redis())
    redis.start()
    data: dict = {"args": vars(args)}
    try:
        if args.only in (None, "throughput"):
            rows = []
            for n in [int(x) for x in args.shards.split(",")]:
                print(f"throughput: {n} shard(s), {args.engines} engines x {args.batch} requests ...", flush=True)
                rows.append(throughput(redis, n, args.engines, args.batch, args.seconds, args.client_procs, tmp))
                r = rows[-1]
                print(f"  {r['steps_per_s']:.0f} Steps/s, p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, "
                      f"shard {r['shard_cpu_ms_per_step']:.2f} ms CPU/Step", flush=True)
            base = rows[0]["steps_per_s"]
            for r in rows:
                r["speedup_vs_first"] = r["steps_per_s"] / base
            print("CPU per Step (ms): the shard's own process, its WAL-replaying snapshotter, Redis, the clients")
            print(table(["shards", "Steps/s", "x", "p50 ms", "p99 ms", "shard", "snapshotter", "Redis", "clients",
                         "failed"],
                        [[r["shards"], r["steps_per_s"], r["speedup_vs_first"], r["p50_ms"], r["p99_ms"],
                          r["shard_cpu_ms_per_step"], r["snapshotter_cpu_ms_per_step"], r["redis_cpu_ms_per_step"],
                          r["client_cpu_ms_per_step"], r["failed_steps"]] for r in rows]))
            data["throughput"] = rows
            plot(rows)
        if args.only in (None, "failover"):
            data["failover"] = []
            for lease in [float(x) for x in args.lease.split(",")]:
                print(f"failover: {args.kills} kills, --leader-lease {lease} ...", flush=True)
                data["failover"].append(failover(redis, args.kills, lease, tmp))
            print(table(["lease s", "kills", "p50 s", "min s", "max s", "lost"],
                        [[f["lease_s"], f["kills"], f["p50_s"], f["min_s"], f["max_s"], f["lost_steps"]]
                         for f in data["failover"]]))
        if args.only in (None, "lookup"):
            print("lookup: fan-out vs PrefixIndex (replica from WatchEvents) ...", flush=True)
            lk = lookup_bench(redis, 4, 16, args.lookup_queries, tmp)
            data["lookup"] = lk
            print(table(["", "p50 ms", "p99 ms"],
                        [["fan-out to 4 shards", lk["fanout_p50_ms"], lk["fanout_p99_ms"]],
                         ["replica (WatchEvents)", lk["replica_p50_ms"], lk["replica_p99_ms"]],
                         ["replica staleness", lk["staleness_p50_ms"], lk["staleness_p99_ms"]]]))
            print(f"  fan-out: {lk['fanout_shard_cpu_ms_per_lookup']:.3f} ms of shard CPU per Lookup (all shards)")
            print(f"  {lk['mismatching_queries']}/{lk['queries']} queries where the replica disagreed "
                  f"({lk['remote_lookups']} needed an RPC); {lk['cached_blocks']} blocks held, "
                  f"{lk['replica_bytes_per_block']:.0f} bytes/block; synced in {lk['replica_sync_s']:.2f} s, "
                  f"{lk['replica_ingest_blocks_per_cpu_s']:,.0f} blocks per CPU second")
    finally:
        redis.stop()
    if args.only:  # one part: keep the others' last results
        previous = RESULTS / "shard.json"
        if previous.exists():
            data = {**{k: v for k, v in json.loads(previous.read_text()).items() if k not in ("machine", "when")},
                    **data}
    if data.get("failover"):
        bar_plot("shard_failover", "Leader SIGKILL -> first Step served by its standby",
                 [f"--leader-lease {f['lease_s']:g}" for f in data["failover"]],
                 {"p50 s": [f["p50_s"] for f in data["failover"]], "max s": [f["max_s"] for f in data["failover"]]},
                 "seconds")
    path = write_json("shard", data)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

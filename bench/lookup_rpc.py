"""Lookup over gRPC for bench/lookup_bench.py: a real `kvservice serve` (memory only) holding kvservice pools
with the workload's prompts cached, a bare grpc.aio echo of the same request and reply sizes (taking turns),
and Lookups/s from 16 concurrent clients (two processes of eight threads, so the clients' own Python is not
one GIL's)."""

from __future__ import annotations

import multiprocessing
import random
import sys
import threading
import time
from pathlib import Path

from bench.common import median, percentile, table
from bench.rpc_bench import Echo, start
from kvservice._proto import allocator_pb2 as pb
from kvservice.client import KVServiceClient
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.ops import AdmitBatchOp, FreeOp
from kvservice.wire.encode import lookup_request

BLOCK = 16


def populate(client: KVServiceClient, prompts: list[list[int]], num_pools: int, num_blocks: int) -> None:
    config = KVCacheConfig(num_blocks + 1 + 32 * 64, [FullAttentionSpec(BLOCK)])
    for p in range(num_pools):
        pool_id = f"own-{p}"
        client.register_pool(pool_id, config, max_model_len=1100)
        for i in range(0, len(prompts), 32):
            ids = [f"r{j}" for j in range(i, min(i + 32, len(prompts)))]
            client.step(pool_id, [AdmitBatchOp(ids, [q[:-1] for q in prompts[i:i + 32]])])
            client.step(pool_id, [FreeOp(r) for r in ids])
        print(f"  pool {p + 1}/{num_pools} populated", flush=True)


def _hammer(target: str, method: str, raws: list[bytes], seconds: float, threads: int, out) -> None:
    import grpc

    from kvservice.client.routing import channel_options
    done = [0] * threads
    stop = time.monotonic() + seconds

    def one(k: int) -> None:
        call = grpc.insecure_channel(target, options=channel_options()).unary_unary(method)
        i = k
        while time.monotonic() < stop:
            call(raws[i % len(raws)], timeout=30)
            done[k] += 1
            i += threads

    workers = [threading.Thread(target=one, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out.put(sum(done))


def concurrent(target: str, method: str, raws: list[bytes], seconds: float) -> int:
    """Calls completed by 16 clients (two processes of eight threads) in `seconds`."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(target, method, raws, seconds, 8, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    total = sum(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return total


def rpc_side_by_side(work, num_pools: int, rng: random.Random, num_lookups: int, seconds: float) -> dict:
    server, target = start([sys.executable, "-m", "kvservice.cli", "--log-level", "ERROR", "serve", "--port", "0",
                            "--no-persistence", "--hash-block-size", str(BLOCK)], "kvservice serving on")
    echo_server, echo_target = start([sys.executable, str(Path(__file__).with_name("echo_server.py"))],
                                     "echo serving on")
    try:
        client = KVServiceClient(target, timeout_s=120, hash_block_size=BLOCK)
        populate(client, work.prompts, num_pools, work.num_blocks)
        from bench.lookup_bench import probes_for
        probes = probes_for(work, rng, num_lookups)
        raws = [lookup_request(p, None, 0, None, None, ()).SerializeToString() for p in probes]
        call = client.channel.unary_unary("/kvservice.v1.Allocator/Lookup")
        echo = Echo(echo_target)
        t: dict[str, list[float]] = {"rpc": [], "echo": []}
        for raw in raws:
            start_t = time.perf_counter()
            reply = call(raw, timeout=30)
            t["rpc"].append(time.perf_counter() - start_t)
            t["echo"].append(echo((len(raw), len(reply))))
        assert pb.LookupResponse.FromString(reply).hits
        echo_raws = [len(reply).to_bytes(4, "little") + bytes(4) + bytes(len(raw) - 8) for raw in raws[:50]]
        total = concurrent(target, "/kvservice.v1.Allocator/Lookup", raws, seconds)
        echo_total = concurrent(echo_target, "/bench.Echo/Echo", echo_raws, seconds)
        out = {"pools": num_pools, "rpc_p50_us": median(t["rpc"]) * 1e6, "rpc_p99_us": percentile(t["rpc"], 99) * 1e6,
               "echo_p50_us": median(t["echo"]) * 1e6, "echo_p99_us": percentile(t["echo"], 99) * 1e6,
               "lookups_per_s_16_clients": total / seconds, "echoes_per_s_16_clients": echo_total / seconds,
               "reply_bytes": len(reply)}
        print(table(["Lookup over gRPC", "p50 us", "p99 us"],
                    [(f"Lookup, {num_pools} kvservice pools", out["rpc_p50_us"], out["rpc_p99_us"]),
                     (f"bare echo, {len(raws[0])} / {len(reply)} bytes", out["echo_p50_us"], out["echo_p99_us"])]))
        print(f"calls/s, 16 concurrent clients (2 processes x 8 threads): Lookup "
              f"{out['lookups_per_s_16_clients']:,.0f}, bare echo of the same sizes "
              f"{out['echoes_per_s_16_clients']:,.0f}", flush=True)
        client.close()
        return out
    finally:
        server.terminate()
        echo_server.terminate()

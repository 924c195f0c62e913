"""External pools (stock vLLM engines indexed from their KV events), one run:

- ingest: vLLM-shaped event batches (msgpack maps, 64-bit int hashes as vLLM publishes by default, 16-token
  blocks) applied in process (`Allocator.apply(IngestEvents)`: decode, index, memory bound), and end to end
  (a ZMQ publisher speaking vLLM's protocol -> `kvservice serve`, memory-only and with its embedded Redis
  journaling every ingest);
- Lookup p50/p99 over `--pools` external pools x `--blocks` indexed blocks each, against the same Lookup
  over as many kvservice pools holding the same prompts cached (in process, through the allocator facade);
- memory per indexed block (tracemalloc), external index vs a kvservice pool's cached blocks.

    python bench/events_bench.py [--pools 64] [--blocks 100000] [--lookups 2000]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack  # noqa: E402

from bench.common import bar_plot, median, percentile, table, write_json  # noqa: E402
from kvservice.allocator import Allocator  # noqa: E402
from kvservice.commands import (  # noqa: E402
    IngestEvents,
    OpenSession,
    PoolSpec,
    RegisterExternalPool,
    RegisterPool,
    Step,
)
from kvservice.core import FullAttentionSpec, KVCacheConfig  # noqa: E402
from kvservice.external.snapshot import encode_index, load_index  # noqa: E402
from kvservice.external.spec import ExternalSpec  # noqa: E402
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp  # noqa: E402

BLOCK = 16
PROMPT_BLOCKS = 64  # 1,024-token prompts
SHARED_BLOCKS = 16  # their first 256 tokens come from one of 32 system prompts


class Workload:
    """Prompts with shared system prefixes and the vLLM events that cache them."""

    def __init__(self, rng: random.Random, num_blocks: int) -> None:
        systems = [[rng.randrange(32_000) for _ in range(SHARED_BLOCKS * BLOCK)] for _ in range(32)]
        self.prompts: list[list[int]] = []
        self.payloads: list[bytes] = []
        hashes: dict[tuple, int] = {}
        total = 0
        while total < num_blocks:
            suffix = [rng.randrange(32_000) for _ in range((PROMPT_BLOCKS - SHARED_BLOCKS) * BLOCK)]
            prompt = rng.choice(systems) + suffix
            self.prompts.append(prompt + [1])
            chain, parent, first_new = [], None, None
            for i in range(PROMPT_BLOCKS):
                key = (parent, tuple(prompt[i * BLOCK:(i + 1) * BLOCK]))
                h = hashes.get(key)
                if h is None:
                    h = hashes[key] = rng.getrandbits(64)
                    first_new = i if first_new is None else first_new
                chain.append(h)
                parent = h
            k = first_new if first_new is not None else PROMPT_BLOCKS
            total += PROMPT_BLOCKS - k
            event = {"type": "BlockStored", "block_hashes": chain[k:], "parent_block_hash": chain[k - 1] if k else None,
                     "token_ids": prompt[k * BLOCK:], "block_size": BLOCK, "lora_id": None, "medium": "GPU",
                     "lora_name": None, "extra_keys": None, "group_idx": 0}
            self.payloads.append(msgpack.packb([time.time(), [event], 0], use_bin_type=True))
        self.num_blocks = total  # distinct blocks: what an index (or a pool big enough) holds


def external_allocator(num_pools: int, max_blocks: int) -> Allocator:
    a = Allocator(hash_block_size=BLOCK)
    for p in range(num_pools):
        spec = ExternalSpec(f"vllm-{p}", f"tcp://127.0.0.1:{20000 + p}", max_blocks=max_blocks)
        a.apply(RegisterExternalPool("", spec), 0.0)
    return a


def ingest_in_process(work: Workload, reps: int) -> dict:
    """The median of `reps` runs, each into a fresh allocator."""
    runs = sorted((_ingest_once(work) for _ in range(reps)), key=lambda r: r["seconds"])
    for r in runs[:len(runs) // 2] + runs[len(runs) // 2 + 1:]:
        del r["allocator"]
    return runs[len(runs) // 2]


def _ingest_once(work: Workload) -> dict:
    a = external_allocator(1, 10 * len(work.payloads) * PROMPT_BLOCKS)
    registration = a.state.external.pools["vllm-0"].registration
    commands = [IngestEvents("vllm-0", registration, [(i, p) for i, p in enumerate(work.payloads[j:j + 64], j)])
                for j in range(0, len(work.payloads), 64)]
    gc.disable()
    start = time.perf_counter()
    for c in commands:
        a.apply(c, 0.0)
    seconds = time.perf_counter() - start
    gc.enable()
    index = a.state.external.pools["vllm-0"].index
    return {"batches_per_s": len(work.payloads) / seconds, "blocks_per_s": index.counters.stored_blocks / seconds,
            "seconds": seconds, "allocator": a}


def ingest_end_to_end(work: Workload, persistence: bool, tmp: Path, limit: int) -> dict:
    from kvservice.client import KVServiceClient
    from kvservice.launch import start_serve
    from tests.external_helpers import Publisher, wait_for
    pub = Publisher()
    flag = f"vllm-0={pub.endpoint},replay={pub.replay_endpoint}"
    args = ["--port", "0", "--hash-block-size", str(BLOCK), "--vllm-events", flag]
    args += ["--data-dir", str(tmp / f"data-{time.monotonic_ns()}")] if persistence else ["--no-persistence"]
    server = start_serve(args, quiet=True)
    try:
        with KVServiceClient(server.target, hash_block_size=BLOCK) as client:
            wait_for(lambda: client.get_stats().external_pools["vllm-0"].connected, 20, what="connected")
            payloads = work.payloads[:limit]
            start = time.perf_counter()
            for body in payloads:
                with pub._lock:
                    seq = pub.next_seq
                    pub.next_seq += 1
                    pub.buffer.append((seq, body))
                    pub.pub.send_multipart([b"", seq.to_bytes(8, "big"), body])
            last = len(payloads) - 1
            wait_for(lambda: client.get_stats().external_pools["vllm-0"].last_sequence >= last, 120, 0.01,
                     what="all batches applied")
            seconds = time.perf_counter() - start
            stats = client.get_stats().external_pools["vllm-0"]
            return {"batches_per_s": len(payloads) / seconds, "blocks_per_s": stats.stored_blocks / seconds,
                    "gaps": stats.gaps}
    finally:
        server.stop()
        pub.close()


def own_allocator(work: Workload, num_pools: int, num_blocks: int) -> Allocator:
    """kvservice pools of `num_blocks` each (room for one admission more, so nothing is evicted), holding the same
    prompts cached (admitted, then freed)."""
    a = Allocator(hash_block_size=BLOCK)
    a.apply(OpenSession("s", ""), 0.0)
    seq = 1
    config = KVCacheConfig(num_blocks + 1 + 32 * PROMPT_BLOCKS, [FullAttentionSpec(BLOCK)])
    for p in range(num_pools):
        spec = PoolSpec(f"own-{p}", config, max_model_len=PROMPT_BLOCKS * BLOCK + BLOCK)
        a.apply(RegisterPool("s", "", seq, spec, a.fingerprint), 0.0)
        seq += 1
        for i in range(0, len(work.prompts), 32):
            ops = []
            for j, prompt in enumerate(work.prompts[i:i + 32], i):
                ops += [AddRequestOp(f"r{j}", token_ids=prompt[:-1]),
                        AllocateOp(f"r{j}", num_new_tokens=len(prompt) - 1)]
            ops += [FreeOp(f"r{j}") for j in range(i, min(i + 32, len(work.prompts)))]
            a.apply(Step("s", "", seq, f"own-{p}", ops), 0.0)
            seq += 1
    return a


def lookups(a: Allocator, probes: list[list[int]]) -> tuple[list[float], int]:
    times, hits = [], 0
    gc.disable()
    for prompt in probes:
        start = time.perf_counter()
        result = a.lookup("", token_ids=prompt)
        times.append(time.perf_counter() - start)
        hits += sum(h.num_cached_tokens for h in result.hits)
    gc.enable()
    return times, hits


def memory_per_block(work: Workload, num_blocks: int) -> tuple[float, float]:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    a = external_allocator(1, 10 * num_blocks)
    registration = a.state.external.pools["vllm-0"].registration
    a.apply(IngestEvents("vllm-0", registration, list(enumerate(work.payloads))), 0.0)
    gc.collect()
    external = (tracemalloc.get_traced_memory()[0] - base) / len(a.state.external.pools["vllm-0"].index)
    del a
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    own = own_allocator(work, 1, work.num_blocks)
    gc.collect()
    cached = len(own.state.pools["own-0"].manager.block_pool.cached_block_hash_to_block)
    mine = (tracemalloc.get_traced_memory()[0] - base) / cached
    tracemalloc.stop()
    return external, mine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--e2e-batches", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3, help="end-to-end runs per server kind (median shown)")
    args = parser.parse_args()
    rng = random.Random(0)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "events_bench"
    tmp.mkdir(parents=True, exist_ok=True)
    work = Workload(rng, args.blocks)
    print(f"workload: {len(work.payloads)} batches, {len(work.prompts)} prompts of {PROMPT_BLOCKS * BLOCK} tokens",
          flush=True)

    ingest = ingest_in_process(work, 2 * args.reps - 1)
    source = ingest.pop("allocator")
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.reps):  # taking turns, so a slow moment of this shared machine hits both alike
        for persistent in (False, True):
            runs[persistent].append(ingest_end_to_end(work, persistent, tmp, args.e2e_batches))
    e2e_mem, e2e_wal = (min(runs[p], key=lambda r: abs(r["batches_per_s"] - median(
        [x["batches_per_s"] for x in runs[p]]))) for p in (False, True))  # the median run of each
    print("ingest done", flush=True)

    external = external_allocator(args.pools, 10 * args.blocks)
    encoded = encode_index(source.state.external.pools["vllm-0"].index)
    for pool in external.state.external.pools.values():
        load_index(pool.index, encoded)  # the same 100k-block index in every pool (one ingest, copied)
    indexed = len(external.state.external.pools["vllm-0"].index)
    own = own_allocator(work, args.pools, work.num_blocks)
    probes = []
    for _ in range(args.lookups):
        p = rng.choice(work.prompts)
        r = rng.random()
        probes.append(p if r < 0.5 else p[:SHARED_BLOCKS * BLOCK + rng.randrange(1, 700)] if r < 0.8 else
                      [rng.randrange(32_000) for _ in range(1024)])
    t_ext, hits_ext = lookups(external, probes)
    t_own, hits_own = lookups(own, probes)
    assert hits_ext == hits_own, (hits_ext, hits_own)  # the same prompts cached: the same answers
    del own, external
    gc.collect()
    mem_ext, mem_own = memory_per_block(work, args.blocks)

    rows = [
        ("ingest in process (decode + index, median)", f"{ingest['batches_per_s']:,.0f} batches/s",
         f"{ingest['blocks_per_s']:,.0f} blocks/s"),
        ("ingest end to end, memory-only server (median of --reps)", f"{e2e_mem['batches_per_s']:,.0f} batches/s",
         f"{e2e_mem['blocks_per_s']:,.0f} blocks/s"),
        ("ingest end to end, server journaling to Redis (median)", f"{e2e_wal['batches_per_s']:,.0f} batches/s",
         f"{e2e_wal['blocks_per_s']:,.0f} blocks/s"),
    ]
    print(table(["ingest (one engine)", "events", "blocks"], rows))
    lrows = [(f"{args.pools} external pools x {indexed:,} blocks", median(t_ext) * 1e3, percentile(t_ext, 99) * 1e3),
             (f"{args.pools} kvservice pools x {args.blocks:,} blocks", median(t_own) * 1e3,
              percentile(t_own, 99) * 1e3)]
    print(table(["Lookup of a 1,024-token prompt (in process)", "p50 ms", "p99 ms"], lrows))
    print(table(["memory per indexed block", "bytes"], [("external pool index", mem_ext),
                                                         ("kvservice pool (cached block)", mem_own)]))
    print(f"external / kvservice Lookup p50: {median(t_ext) / median(t_own):.2f}", flush=True)
    write_json("events", {"args": vars(args), "ingest_in_process": ingest, "ingest_e2e_memory": e2e_mem,
                          "ingest_e2e_persistent": e2e_wal, "lookup_external_ms": [median(t_ext) * 1e3,
                                                                                   percentile(t_ext, 99) * 1e3],
                          "lookup_own_ms": [median(t_own) * 1e3, percentile(t_own, 99) * 1e3],
                          "indexed_blocks_per_pool": indexed, "bytes_per_block_external": mem_ext,
                          "bytes_per_block_own": mem_own})
    bar_plot("events", f"Lookup over {args.pools} pools x {args.blocks:,} blocks (ms)", ["p50", "p99"],
             {"external pools": [median(t_ext) * 1e3, percentile(t_ext, 99) * 1e3],
              "kvservice pools": [median(t_own) * 1e3, percentile(t_own, 99) * 1e3]}, "ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

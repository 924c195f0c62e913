"""Lookup at fleet scale, one run, the two paths taking turns: the global index (one walk of the prompt per key
space, whatever the number of pools) against the per-pool path it replaced (`lookup_index` off, each pool asked
in turn), in process; then over gRPC against a real `kvservice serve` beside a bare gRPC echo of the same
message sizes, and Lookups/s from 16 concurrent clients.

    python bench/lookup_bench.py [--quick]

Fleets: kvservice pools holding 1,024-token prompts cached (admitted, then freed) and external pools indexed
from vLLM-shaped KV events, as bench/events_bench.py builds them: prompts under 32 shared 256-token system
prompts. Probes: half cached prompts, 30% a system prompt plus a few hundred tokens, 20% cold.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import argparse
import gc
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, percentile, table, write_json  # noqa: E402
from bench.events_bench import BLOCK, SHARED_BLOCKS, Workload, external_allocator, own_allocator  # noqa: E402
from kvservice.commands import IngestEvents  # noqa: E402
from kvservice.external.snapshot import encode_index, load_index  # noqa: E402


def probes_for(work: Workload, rng: random.Random, n: int, length: int = 1024) -> list[list[int]]:
    out = []
    for _ in range(n):
        p, r = rng.choice(work.prompts), rng.random()
        p = p if r < 0.5 else p[:SHARED_BLOCKS * BLOCK + rng.randrange(1, 700)] if r < 0.8 else \
            [rng.randrange(32_000) for _ in range(1024)]
        while len(p) < length:  # longer prompts: the cached one, then tokens nobody holds
            p = p + [rng.randrange(32_000) for _ in range(length - len(p))]
        out.append(p[:length])
    return out


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def externals(work: Workload, num_pools: int, max_blocks: int):
    """`num_pools` external pools, each holding the workload's whole index (one ingest, copied)."""
    src = external_allocator(1, max_blocks)
    registration = src.state.external.pools["vllm-0"].registration
    src.apply(IngestEvents("vllm-0", registration, list(enumerate(work.payloads))), 0.0)
    encoded = encode_index(src.state.external.pools["vllm-0"].index)
    a = external_allocator(num_pools, max_blocks)
    for pool in a.state.external.pools.values():
        load_index(pool.index, encoded)
    return a


def side_by_side(a, probes: list[list[int]], rounds: int = 3) -> dict[str, list[float]]:
    """Per-Lookup seconds of each path, the paths taking turns in rounds (a slow moment hits both alike);
    the answers compared."""
    out: dict[str, list[float]] = {"index": [], "per-pool": []}
    chunk = max(1, len(probes) // rounds)
    for r in range(rounds):
        part = probes[r * chunk:(r + 1) * chunk]
        answers = {}
        for name, flag in (("per-pool", False), ("index", True)):
            a.state.settings.lookup_index = flag
            gc.disable()
            got = []
            for p in part:
                start = time.perf_counter()
                result = a.lookup("", token_ids=p)
                out[name].append(time.perf_counter() - start)
                got.append((result.best_pool_id, sum(h.num_cached_tokens for h in result.hits)))
            gc.enable()
            answers[name] = got
        assert answers["index"] == answers["per-pool"], "the two paths answered differently"
    a.state.settings.lookup_index = True
    return out


def row(label: str, t: dict[str, list[float]]) -> tuple:
    i, p = t["index"], t["per-pool"]
    return (label, median(i) * 1e6, percentile(i, 99) * 1e6, median(p) * 1e6, percentile(p, 99) * 1e6,
            median(p) / median(i))


HEAD = ["fleet", "index p50 us", "index p99 us", "per-pool p50 us", "per-pool p99 us", "speed-up"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small fleets (a minute), for a smoke run")
    parser.add_argument("--lookups", type=int, default=1500)
    args = parser.parse_args()
    rng = random.Random(0)
    q = args.quick
    blocks = 4_000 if q else 100_000
    results: dict = {"args": vars(args)}

    print(f"workload: {blocks:,} distinct blocks of {BLOCK} tokens", flush=True)
    work = Workload(rng, blocks)
    rows = []
    own = own_allocator(work, 8 if q else 64, work.num_blocks)
    rows.append(row(f"{len(own.state.pools)} kvservice pools x {blocks:,} blocks", side_by_side(
        own, probes_for(work, rng, args.lookups))))
    del own
    ext = externals(work, 8 if q else 64, 10 * blocks)
    rows.append(row(f"{len(ext.state.external.pools)} external pools x {blocks:,} blocks",
                    side_by_side(ext, probes_for(work, rng, args.lookups))))
    del ext
    gc.collect()
    big_pools, big_blocks = (16, 4_000) if q else (256, 40_000)
    big = Workload(rng, big_blocks)
    before = resident_bytes()
    ext = externals(big, big_pools, 10 * big_blocks)
    indexed = sum(len(p.index) for p in ext.state.external.pools.values())
    rows.append(row(f"{big_pools} external pools x {big_blocks:,} blocks ({big_pools * big_blocks / 1e6:.1f}M)",
                    side_by_side(ext, probes_for(big, rng, args.lookups))))
    gc.collect()
    results["bytes_per_block_external"] = (resident_bytes() - before) / indexed
    del ext
    gc.collect()
    before = resident_bytes()
    own = own_allocator(big, big_pools, big.num_blocks)
    cached = sum(len(p.manager.block_pool.cached_block_hash_to_block) for p in own.state.pools.values())
    own.lookup("", token_ids=big.prompts[0])  # every pool joins the index
    gc.collect()
    results["bytes_per_block_own"] = (resident_bytes() - before) / cached
    results["blocks_measured"] = {"external": indexed, "own": cached}
    print(f"memory per indexed block (resident, {indexed / 1e6:.1f}M external / {cached / 1e6:.1f}M kvservice "
          f"blocks): external {results['bytes_per_block_external']:.0f} B, kvservice pool "
          f"{results['bytes_per_block_own']:.0f} B (index included)", flush=True)
    del own
    gc.collect()
    print(table(HEAD, rows), flush=True)
    results["headline"] = [dict(zip(HEAD, r)) for r in rows]

    # Curves: p50 against the number of pools, and against the prompt's length.
    small = Workload(rng, 2_000 if q else 10_000)
    curve_pools = {}
    for n in ([1, 4, 16] if q else [1, 4, 16, 64, 256]):
        own = own_allocator(small, n, small.num_blocks)
        t = side_by_side(own, probes_for(small, rng, 300 if q else 600))
        curve_pools[n] = {k: median(v) * 1e6 for k, v in t.items()}
        print(f"  {n} pools: index {curve_pools[n]['index']:.0f} us, per-pool {curve_pools[n]['per-pool']:.0f} us",
              flush=True)
        del own
        gc.collect()
    own = own_allocator(small, 8 if q else 64, small.num_blocks)
    curve_len = {}
    for length in ([256, 1024, 4096] if q else [256, 1024, 4096, 16384, 32768]):
        t = side_by_side(own, probes_for(small, rng, 200 if q else 400, length))
        curve_len[length] = {k: median(v) * 1e6 for k, v in t.items()}
        print(f"  {length} tokens: index {curve_len[length]['index']:.0f} us, per-pool "
              f"{curve_len[length]['per-pool']:.0f} us", flush=True)
    del own
    results["p50_us_by_pools"], results["p50_us_by_length"] = curve_pools, curve_len
    plot(curve_pools, curve_len, len(small.prompts))

    from bench.lookup_rpc import rpc_side_by_side
    results["rpc"] = rpc_side_by_side(work if q else Workload(rng, 20_000), 8 if q else 64, rng,
                                      200 if q else 1000, 2 if q else 10)
    write_json("lookup", results)
    return 0


def plot(by_pools: dict, by_length: dict, num_prompts: int) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from bench.common import RESULTS
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, data, xlabel in ((left, by_pools, "pools"), (right, by_length, "prompt tokens")):
        xs = sorted(data)
        for name, style in (("per-pool", "o--"), ("index", "o-")):
            ax.plot(xs, [data[x][name] for x in xs], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("Lookup p50 (us, in process)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    left.set_title("1,024-token prompt, by pools")
    right.set_title("64 pools, by prompt length")
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / "lookup_curves.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    threading.stack_size(8 << 20)
    sys.exit(main())

"""Multi-pool benchmark, one run:

- time to first token on pool B for a long prompt cached on pool A: copy A's blocks (transfer) vs
  recompute the prefix on B (ratio);
- aggregate prefix hit rate over 4 pools: KV-aware placement (the allocator's Lookup picks the pool
  with the longest cached prefix) vs round-robin.

    python bench/transfer_bench.py [--prompt-len 1024] [--requests 400]

Workers run in this process (torch attention twin); the allocator is a real `kvservice serve`.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # we spawn processes after using gRPC

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import bar_plot, table, write_json  # noqa: E402
from bench.rpc_bench import Progress  # noqa: E402
from kvservice.client import KVServiceClient  # noqa: E402
from kvservice.core import FullAttentionSpec, KVCacheConfig  # noqa: E402
from kvservice.launch import start_serve  # noqa: E402
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp  # noqa: E402
from worker.actor import LocalWorkers, PoolLayout  # noqa: E402
from worker.engine import Engine, EngineConfig  # noqa: E402
from worker.model import ModelConfig  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402

MODEL = ModelConfig()


def ttft(target: str, prompt_len: int, reps: int) -> dict:
    """Median time to first token on pool B, with the prefix copied from A vs recomputed."""
    out = {}
    for mode in ("transfer", "recompute"):
        times = []
        for rep in range(reps):
            engines = {}
            for name in ("A", "B"):
                pid = f"ttft-{mode}-{rep}-{name}"
                cfg = EngineConfig(pool_id=pid, num_blocks=prompt_len // 16 + 16, block_size=16,
                                   max_model_len=prompt_len + 64, max_num_batched_tokens=prompt_len + 64,
                                   allow_transfers=mode == "transfer", kv_layout=f"bench-{rep}")
                layout = PoolLayout(MODEL, cfg.num_blocks, 16, cfg.max_num_rows, cfg.max_num_blocks_per_req,
                                    cfg.max_num_batched_tokens)
                engines[name] = Engine(KVServiceClient(target, client_name=pid), LocalWorkers(layout), cfg)
            a, b = engines["A"], engines["B"]
            b.peers[a.config.pool_id] = a.workers
            rng = random.Random(rep)
            prompt = [rng.randrange(MODEL.vocab_size) for _ in range(prompt_len)]
            a.add_request(prompt, SamplingParams(max_tokens=1))
            a.run()
            seq = b.add_request(prompt + [1, 2, 3], SamplingParams(max_tokens=1))
            b.run()
            times.append(seq.first_token_at - seq.admitted_at)
            if mode == "transfer":
                assert seq.transferred_tokens > 0, "no transfer happened"
            for e in engines.values():
                e.client.close()
        out[mode] = {"median_s": statistics.median(times), "times": times}
    out["speedup"] = out["recompute"]["median_s"] / out["transfer"]["median_s"]
    return out


def placement(target: str, num_requests: int, mode: str, num_pools: int = 4, blocks_per_pool: int = 160) -> dict:
    """Admits requests over 16 shared system prompts into 4 small pools (no model: allocator only)."""
    client = KVServiceClient(target, client_name=f"place-{mode}")
    pools = [f"place-{mode}-{i}" for i in range(num_pools)]
    for p in pools:
        client.register_pool(p, KVCacheConfig(blocks_per_pool, [FullAttentionSpec(16)]), max_model_len=2048)
    rng = random.Random(5)
    systems = [[rng.randrange(32000) for _ in range(512)] for _ in range(16)]
    prompt_tokens = hit_tokens = 0
    progress = Progress(f"placement {mode}", num_requests)
    for i in range(num_requests):
        prompt = systems[rng.randrange(16)] + [rng.randrange(32000) for _ in range(32)]
        if mode == "kv-aware":
            target_pool = client.lookup(prompt, pool_ids=pools).best_pool_id
        else:
            target_pool = pools[i % num_pools]
        r = client.step(target_pool, [AddRequestOp("r", token_ids=prompt), AllocateOp("r", num_new_tokens=2048),
                                      FreeOp("r")])
        prompt_tokens += len(prompt)
        hit_tokens += r[1].num_computed_tokens if r[1].ok else 0
        progress(i + 1)
    client.close()
    return {"hit_rate": hit_tokens / prompt_tokens, "prompt_tokens": prompt_tokens, "hit_tokens": hit_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    server = start_serve(["--port", "0", "--no-persistence"], log_level="ERROR")
    target = server.target
    try:
        print(f"time to first token on pool B, {args.prompt_len}-token prompt cached on pool A ...", flush=True)
        t = ttft(target, args.prompt_len, args.reps)
        place = {mode: placement(target, args.requests, mode) for mode in ("kv-aware", "round-robin")}
    finally:
        server.stop()
    print()
    print(table(["pool B prefix", "TTFT median ms", "runs"],
                [["copied from pool A (transfer)", t["transfer"]["median_s"] * 1e3, args.reps],
                 ["recomputed on pool B", t["recompute"]["median_s"] * 1e3, args.reps]]))
    print(f"transfer vs recompute: {t['speedup']:.1f}x faster time to first token")
    print()
    print(table(["placement over 4 pools", "aggregate prefix hit rate"],
                [[mode, f"{r['hit_rate']:.1%}"] for mode, r in place.items()]))
    path = write_json("transfer", {"prompt_len": args.prompt_len, "ttft": t, "placement": place})
    bar_plot("transfer_ttft", f"Time to first token on pool B ({args.prompt_len}-token cached prefix)",
             ["transfer from A", "recompute on B"],
             {"TTFT ms": [t["transfer"]["median_s"] * 1e3, t["recompute"]["median_s"] * 1e3]}, "ms")
    bar_plot("transfer_placement", "Aggregate prefix hit rate over 4 pools", list(place),
             {"hit rate": [r["hit_rate"] for r in place.values()]}, "hit rate")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

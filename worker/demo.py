"""`kvservice demo` / `make run`: the whole system on this machine in about a minute.

Starts the allocator (`kvservice serve`, embedded Redis), a Ray local cluster with one pool of 2 DCP
ranks, runs 64 requests over 4 shared system prompts (some with n=2 parallel samples), and prints
tokens/s, the prefix hit rate, peak KV usage, preemptions and whether every output matched the dense
reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # we spawn processes after using gRPC

import argparse
import random
import sys
import tempfile
import time

import torch

from kvservice.client import KVServiceClient
from kvservice.launch import start_serve
from worker.actor import PoolLayout, RayWorkers, default_backend
from worker.engine import Engine, EngineConfig
from worker.model import ModelConfig, TinyTransformer
from worker.sampling import SamplingParams
from worker.verify import verify


def workload(num_requests: int, vocab: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.choice([64, 96, 128]))] for _ in range(4)]
    out = []
    for i in range(num_requests):
        prompt = systems[i % 4] + [rng.randrange(vocab) for _ in range(rng.randint(8, 40))]
        n = 2 if i % 8 == 3 else 1
        out.append((prompt, SamplingParams(max_tokens=rng.randint(8, 24), n=n, temperature=0.8 if n > 1 else 0.0,
                                           seed=i)))
    return out


class Progress:
    def __init__(self, total: int) -> None:
        self.total, self.last = total, 0.0

    def __call__(self, eng: Engine) -> None:
        now = time.monotonic()
        if now - self.last >= 2.0 or not eng.has_unfinished():
            self.last = now
            done = sum(1 for s in eng.finished if s.parent is None)
            bar = "#" * (30 * done // self.total)
            print(f"  [{bar:<30}] {done}/{self.total} requests, step {eng.stats.steps}, "
                  f"{eng.stats.generated_tokens} tokens generated", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--dcp", type=int, default=2)
    parser.add_argument("--backend", choices=["torch", "triton"], default=None,
                        help="attention backend (default: triton with CUDA, the torch twin on CPU)")
    parser.add_argument("--num-blocks", type=int, default=48, help="KV blocks in the pool (small enough that "
                        "some requests are preempted and recomputed)")
    args = parser.parse_args(argv)
    import ray

    backend = args.backend or default_backend()
    model_config = ModelConfig()
    data_dir = tempfile.mkdtemp(prefix="kvservice-demo-")
    print(f"kvservice demo: allocator with embedded Redis in {data_dir}, Ray local cluster, one pool of "
          f"{args.dcp} DCP ranks, attention backend '{backend}'", flush=True)
    allocator = start_serve(["--port", "0", "--data-dir", data_dir])
    target = allocator.target
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    workers = None
    try:
        cfg = EngineConfig(pool_id="demo-pool", num_blocks=args.num_blocks, block_size=16, dcp_world_size=args.dcp,
                           max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=32)
        layout = PoolLayout(model_config, cfg.num_blocks, cfg.block_size, cfg.max_num_rows,
                            cfg.max_num_blocks_per_req, cfg.max_num_batched_tokens, args.dcp, backend=backend)
        workers = RayWorkers(layout, num_cpus=0.5)
        client = KVServiceClient(target, client_name="demo")
        engine = Engine(client, workers, cfg)
        requests = workload(args.requests, model_config.vocab_size)
        for prompt, params in requests:
            engine.add_request(prompt, params)
        print(f"  {len(requests)} requests over 4 shared system prompts, "
              f"{sum(p.n > 1 for _, p in requests)} of them with n=2", flush=True)
        start = time.perf_counter()
        engine.run(progress=Progress(len(requests)))
        elapsed = time.perf_counter() - start
        stats = client.get_stats(check_invariants=True).pools[cfg.pool_id]
        torch.set_num_threads(2)
        check = verify(TinyTransformer(model_config), engine.finished)
        s = engine.stats
        print()
        print(f"  sequences finished       {len(engine.finished)} ({s.forks} forked for n=2, {s.copies} "
              f"copy-on-write block copies)")
        print(f"  tokens/s                 {s.generated_tokens / elapsed:,.1f} generated, "
              f"{s.computed_tokens / elapsed:,.1f} computed ({elapsed:.1f} s, {s.steps} steps)")
        print(f"  prefix hit rate          {s.prefix_hit_rate:.1%} of prompt tokens came from the cache")
        print(f"  peak KV usage            {s.peak_blocks}/{cfg.num_blocks - 1} blocks "
              f"({s.peak_blocks / (cfg.num_blocks - 1):.0%})")
        print(f"  preemptions              {s.preemptions}")
        print(f"  allocator time share     {s.allocator_s / elapsed:.1%} of wall time in Step RPCs")
        print(f"  attention backend        {workers.backend}")
        print(f"  dense reference          {check.matched}/{check.sequences} outputs identical"
              + ("" if check.ok else f"  MISMATCH: {check.mismatches[:2]}"))
        print(f"  pool after the run       {stats.num_free_blocks}/{stats.num_blocks - 1} blocks free, invariants "
              f"{'ok' if not stats.invariant_violation else stats.invariant_violation}")
        client.close()
        return 0 if check.ok and not stats.invariant_violation else 1
    finally:
        if workers is not None:
            workers.shutdown()
        ray.shutdown()
        allocator.stop(timeout_s=20)


if __name__ == "__main__":
    sys.exit(main())

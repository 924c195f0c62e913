"""Engine benchmark (one run, side by side):

- tokens/s and the allocator's share of each step, with prefix caching on vs off, on a workload whose
  requests share 4 system prompts;
- peak concurrent requests in a fixed pool: paged allocation (with and without prefix sharing) vs a
  contiguous-reservation baseline that reserves max_model_len per request (the PagedAttention headline);
- side by side with transformers: the same shared-prefix workload on a random-init Llama checkpoint through
  `worker.LLM` and through transformers' batched `generate()` (tokens/s ratio, KV memory of each).

    python bench/engine_bench.py [--requests 48]

Workers run in this process (torch attention twin, 1 thread); the allocator is a real `kvservice serve`.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # we spawn processes after using gRPC

import argparse  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import bar_plot, table, write_json  # noqa: E402
from bench.hf_side_by_side import side_by_side  # noqa: E402
from kvservice.client import KVServiceClient  # noqa: E402
from kvservice.launch import start_serve  # noqa: E402
from worker.actor import LocalWorkers, PoolLayout  # noqa: E402
from worker.engine import Engine, EngineConfig  # noqa: E402
from worker.model import ModelConfig  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402

MODEL = ModelConfig()
MAX_MODEL_LEN = 512


def requests(n: int, seed: int = 0):
    rng = random.Random(seed)
    systems = [[rng.randrange(MODEL.vocab_size) for _ in range(128)] for _ in range(4)]
    return [(systems[i % 4] + [rng.randrange(MODEL.vocab_size) for _ in range(rng.randint(16, 48))],
             SamplingParams(max_tokens=rng.randint(16, 32), seed=i)) for i in range(n)]


def run(target: str, pool_id: str, reqs, num_blocks: int, caching: bool, max_num_seqs: int = 64) -> dict:
    cfg = EngineConfig(pool_id=pool_id, num_blocks=num_blocks, block_size=16, max_model_len=MAX_MODEL_LEN,
                       max_num_batched_tokens=512, max_num_seqs=max_num_seqs, enable_prefix_caching=caching)
    layout = PoolLayout(MODEL, num_blocks, 16, cfg.max_num_rows, cfg.max_num_blocks_per_req,
                        cfg.max_num_batched_tokens)
    client = KVServiceClient(target, client_name=pool_id)
    eng = Engine(client, LocalWorkers(layout), cfg)
    for prompt, params in reqs:
        eng.add_request(prompt, params)
    last = [0.0]

    def progress(e: Engine) -> None:
        now = time.monotonic()
        if now - last[0] > 3:
            last[0] = now
            print(f"    {pool_id}: {len(e.finished)}/{len(reqs)} finished, step {e.stats.steps}", flush=True)

    t0 = time.perf_counter()
    eng.run(progress=progress)
    wall = time.perf_counter() - t0
    s = eng.stats
    client.close()
    return {"wall_s": wall, "steps": s.steps, "generated": s.generated_tokens, "computed": s.computed_tokens,
            "tokens_per_s": s.generated_tokens / wall, "allocator_share": s.allocator_s / wall,
            "allocator_ms_per_step": s.allocator_s / s.steps * 1e3, "hit_rate": s.prefix_hit_rate,
            "peak_running": s.peak_running, "peak_blocks": s.peak_blocks, "preemptions": s.preemptions}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--pool-blocks", type=int, default=129, help="pool for the concurrency comparison")
    parser.add_argument("--reps", type=int, default=9, help="runs of each side in the transformers comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    server = start_serve(["--port", "0", "--no-persistence"], log_level="ERROR")
    target = server.target
    try:
        reqs = requests(args.requests)
        print("prefix caching on vs off (same requests) ...", flush=True)
        on = run(target, "caching-on", reqs, 1024, True)
        off = run(target, "caching-off", reqs, 1024, False)
        print("peak concurrency in a fixed pool ...", flush=True)
        fixed_on = run(target, "fixed-paged", reqs, args.pool_blocks, True)
        fixed_off = run(target, "fixed-paged-nocache", reqs, args.pool_blocks, False)
        print("worker.LLM vs transformers' batched generate() (same checkpoint, same workload) ...", flush=True)
        hf = side_by_side(target, args.requests, reps=args.reps)
    finally:
        server.stop()
    capacity = (args.pool_blocks - 1) * 16
    contiguous_max = capacity // MAX_MODEL_LEN
    contiguous_exact = 0
    used = 0
    for prompt, params in sorted(reqs, key=lambda r: len(r[0]) + r[1].max_tokens):
        need = len(prompt) + params.max_tokens
        if used + need > capacity:
            break
        used += need
        contiguous_exact += 1
    print()
    print(table(["prefix caching", "tokens/s", "computed tokens", "steps", "allocator ms/step", "allocator share",
                 "hit rate"],
                [["on", on["tokens_per_s"], on["computed"], on["steps"], on["allocator_ms_per_step"],
                  f"{on['allocator_share']:.1%}", f"{on['hit_rate']:.1%}"],
                 ["off", off["tokens_per_s"], off["computed"], off["steps"], off["allocator_ms_per_step"],
                  f"{off['allocator_share']:.1%}", f"{off['hit_rate']:.1%}"]]))
    speedup = on["tokens_per_s"] / off["tokens_per_s"]
    print(f"prefix caching on/off: {speedup:.2f}x tokens/s, {off['computed'] / on['computed']:.2f}x fewer tokens "
          f"computed")
    print()
    rows = [["paged, prefix sharing", fixed_on["peak_running"], fixed_on["preemptions"]],
            ["paged, no sharing", fixed_off["peak_running"], fixed_off["preemptions"]],
            [f"contiguous, reserve max_model_len ({MAX_MODEL_LEN})", contiguous_max, "-"],
            ["contiguous, reserve prompt + max_tokens (oracle)", contiguous_exact, "-"]]
    print(table([f"allocation ({args.pool_blocks - 1} blocks x 16 tokens)", "peak concurrent requests",
                 "preemptions"], rows))
    print(f"paged vs contiguous (max_model_len): {fixed_on['peak_running'] / max(1, contiguous_max):.1f}x "
          f"concurrent requests")
    print()
    print(table(["generation (same Llama checkpoint, same requests)", "tokens/s", "wall s", "KV memory MiB"],
                [["worker.LLM (continuous batching, prefix cache, paged KV)", hf["llm"]["tokens_per_s"],
                  hf["llm"]["wall_s"], hf["llm"]["kv_bytes"] / 2**20],
                 ["transformers generate(), one left-padded batch", hf["transformers"]["tokens_per_s"],
                  hf["transformers"]["wall_s"], hf["transformers"]["kv_bytes"] / 2**20]]))
    print(f"LLM.generate vs transformers generate(): {hf['ratio']:.2f}x tokens/s (target >= 1.5x: "
          f"{'met' if hf['ratio'] >= 1.5 else 'not met'}), "
          f"{hf['transformers']['kv_bytes'] / hf['llm']['kv_bytes']:.1f}x less KV memory, "
          f"{hf['identical_outputs']}/{hf['requests']} outputs identical (medians of {args.reps} runs)")
    path = write_json("engine", {"requests": args.requests, "caching_on": on, "caching_off": off,
                                 "transformers_side_by_side": hf,
                                 "speedup_caching": speedup, "fixed_pool_blocks": args.pool_blocks,
                                 "paged_sharing": fixed_on, "paged_no_sharing": fixed_off,
                                 "contiguous_max_len": contiguous_max, "contiguous_exact": contiguous_exact})
    bar_plot("engine_caching", "Prefix caching on vs off (48 requests, 4 shared system prompts)",
             ["tokens/s", "computed tokens / 100", "allocator ms/step x 10"],
             {"caching on": [on["tokens_per_s"], on["computed"] / 100, on["allocator_ms_per_step"] * 10],
              "caching off": [off["tokens_per_s"], off["computed"] / 100, off["allocator_ms_per_step"] * 10]}, "")
    bar_plot("engine_concurrency", f"Peak concurrent requests, {args.pool_blocks - 1}-block pool",
             [r[0] for r in rows], {"peak concurrent": [float(r[1]) for r in rows]}, "requests")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

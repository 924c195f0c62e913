"""In-process core benchmark, side by side with vLLM 0.33.0's own core in the same process.

    python bench/core_bench.py [--reps 7]

Rows: hashing throughput of 16-token blocks; get_new_blocks(1000) + free_blocks x 100 on a
100k-block pool; 200 requests x 1,124 tokens sharing a 1,024-token prefix (hash, lookup+allocate,
free). Ratios are ours / vLLM medians over the repetitions (< 1 = we are faster).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bar_plot, median, table, time_call, write_json  # noqa: E402
from bench.vllm_ref import reexec_under_vllm  # noqa: E402

BS = 16
HASH_TOKENS = 16 * 4096
POOL_BLOCKS = 100_000
NUM_REQS, PREFIX, SUFFIX = 200, 1024, 100


def ours_side():
    from kvservice.core import BlockPool, FullAttentionSpec, KVCacheConfig, KVCacheManager, Request

    def hash_prompt(tokens):
        Request("h", tokens, BS)

    def pool():
        return BlockPool(POOL_BLOCKS, enable_caching=True)

    def manager():
        return KVCacheManager(KVCacheConfig(20_000, [FullAttentionSpec(BS)]), 4096)

    def make_requests(prompts):
        return [Request(f"r{i}", p, BS) for i, p in enumerate(prompts)]

    return hash_prompt, pool, manager, make_requests


def vllm_side(algo: str = "sha256"):
    from bench.vllm_ref import VllmCore
    vc = VllmCore()
    hasher = vc.hasher(BS, algo)

    def hash_prompt(tokens):
        vc.request("h", tokens, hasher)

    def pool():
        return vc.BlockPool(POOL_BLOCKS, True, BS)

    def manager():
        return vc.manager(20_000, [vc.spec("full", BS)], 4096, BS)

    def make_requests(prompts):
        return [vc.request(f"r{i}", p, hasher) for i, p in enumerate(prompts)]

    return hash_prompt, pool, manager, make_requests


def measure(side, reps: int, prompts, hash_tokens) -> dict[str, float]:
    hash_prompt, make_pool, make_manager, make_requests = side
    out = {}
    out["hash"] = median(time_call(lambda: hash_prompt(hash_tokens), reps=reps))

    def alloc_free(pool):
        for _ in range(100):
            pool.free_blocks(reversed(pool.get_new_blocks(1000)))
    out["alloc_free"] = median(time_call(alloc_free, setup=make_pool, reps=reps))

    out["req_hash"] = median(time_call(lambda: make_requests(prompts), reps=reps))

    def lookup_allocate(state):
        m, reqs = state
        for r in reqs:
            hits, n = m.get_computed_blocks(r)[:2]
            m.allocate_slots(r, r.num_tokens - n, n, hits)
    out["lookup_alloc"] = median(time_call(lookup_allocate, setup=lambda: (make_manager(), make_requests(prompts)),
                                           reps=reps))

    def free_all(state):
        m, reqs = state
        for r in reqs:
            m.free(r)

    def allocated():
        m, reqs = make_manager(), make_requests(prompts)
        lookup_allocate((m, reqs))
        return m, reqs
    out["free"] = median(time_call(free_all, setup=allocated, reps=reps))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    reason = reexec_under_vllm()
    rng = random.Random(0)
    prefix = [rng.randrange(32000) for _ in range(PREFIX)]
    prompts = [prefix + [rng.randrange(32000) for _ in range(SUFFIX)] for _ in range(NUM_REQS)]
    hash_tokens = [rng.randrange(32000) for _ in range(HASH_TOKENS)]

    print(f"core benchmark: {args.reps} repetitions per row, medians", flush=True)
    print("  ours ...", flush=True)
    ours = measure(ours_side(), args.reps, prompts, hash_tokens)
    theirs, theirs_xx = {}, {}
    if reason is None:
        print("  vLLM 0.33.0 (sha256, its default) ...", flush=True)
        theirs = measure(vllm_side("sha256"), args.reps, prompts, hash_tokens)
        print("  vLLM 0.33.0 (xxhash) ...", flush=True)
        theirs_xx = {"hash": median(time_call(lambda: vllm_side("xxhash")[0](hash_tokens), reps=args.reps))}
    else:
        print(f"  vLLM side skipped: {reason}")

    rows, data = [], {}
    specs = [
        ("hash", "hashing, 16-token blocks", HASH_TOKENS, "tokens/s"),
        ("alloc_free", "get_new_blocks(1000)+free x100, 100k pool", 100_000, "blocks/s"),
        ("req_hash", "200 x 1,124-token requests: hash", NUM_REQS * (PREFIX + SUFFIX), "tokens/s"),
        ("lookup_alloc", "200 requests: lookup + allocate", NUM_REQS, "requests/s"),
        ("free", "200 requests: free", NUM_REQS, "requests/s"),
    ]
    for key, label, units, unit_name in specs:
        ratio = ours[key] / theirs[key] if key in theirs else float("nan")
        row = {"ours_s": ours[key], "vllm_s": theirs.get(key), "ratio_ours_over_vllm": ratio,
               "ours_rate": units / ours[key], "unit": unit_name}
        rows.append([label, f"{units / ours[key]:,.0f} {unit_name}", ours[key] * 1e3,
                     theirs[key] * 1e3 if key in theirs else float("nan"), ratio])
        data[key] = row
    if theirs_xx:
        data["hash"]["vllm_xxhash_s"] = theirs_xx["hash"]
        data["hash"]["ratio_ours_over_vllm_xxhash"] = ours["hash"] / theirs_xx["hash"]
    print()
    print(table(["workload", "ours", "ours ms", "vLLM ms", "ours/vLLM"], rows))
    if theirs:
        speedup = theirs["hash"] / ours["hash"]
        line = f"hashing speed-up over vLLM's default sha256 path: {speedup:.1f}x"
        if theirs_xx:
            line += f" (over its xxhash path: {theirs_xx['hash'] / ours['hash']:.1f}x)"
        print(line)
        data["hash"]["speedup_vs_vllm_sha256"] = speedup
    path = write_json("core", {"vllm": "0.33.0" if reason is None else None, "vllm_skipped_reason": reason,
                               "reps": args.reps, "rows": data})
    if theirs:
        bar_plot("core", "kvservice core vs vLLM 0.33.0 (time ratio, lower is better)",
                 [s[1] for s in specs], {"ours / vLLM": [data[s[0]]["ratio_ours_over_vllm"] for s in specs]},
                 "time ratio", hline=1.0, log=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""In-process core benchmark, side by side with vLLM 0.33.0's own core in the same process.

    python bench/core_bench.py [--reps 7]

Rows: hashing throughput of 16-token blocks; get_new_blocks(1000) + free_blocks x 100 on a
100k-block pool; 200 requests x 1,124 tokens sharing a 1,024-token prefix (hash, lookup+allocate,
free, decode). Ratios are ours / vLLM medians over the repetitions (< 1 = we are faster). Under the
vLLM env a third side runs the same workloads through vLLM's API with vLLM's names replaced by
kvservice's drop-in (kvservice.integrations.vllm.core: vLLM's Request, specs and sha256 block hashes,
kvservice's core): the drop-in / vLLM column.
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
DECODE_STEPS = 16  # every request crosses one block boundary


def ours_side():
    from kvservice.core import BlockPool, FullAttentionSpec, KVCacheConfig, KVCacheManager, Request
    from kvservice.core.fast_path import PackedRows

    def hash_prompt(tokens):
        Request("h", tokens, BS)

    def pool():
        return BlockPool(POOL_BLOCKS, enable_caching=True)

    def manager():
        return KVCacheManager(KVCacheConfig(20_000, [FullAttentionSpec(BS)]), 4096)

    def make_requests(prompts):
        return [Request(f"r{i}", p, BS) for i, p in enumerate(prompts)]

    def decode_batch(m, reqs, token):
        out = PackedRows()
        assert m.fast_path.allocate_running_batch(reqs, [r.num_tokens for r in reqs], [token] * len(reqs), 1, 0, 0,
                                        out) == len(reqs)

    def admit(m, r):
        assert m.fast_path.admit(r, r.num_tokens) is not None

    return hash_prompt, pool, manager, make_requests, decode_batch, admit


def vllm_side(algo: str = "sha256", dropin: bool = False):
    from bench.vllm_ref import DropinCore, VllmCore
    vc = DropinCore() if dropin else VllmCore()
    hasher = vc.hasher(BS, algo)

    def hash_prompt(tokens):
        vc.request("h", tokens, hasher)

    def pool():
        return vc.BlockPool(POOL_BLOCKS, True, BS)

    def manager():
        return vc.manager(20_000, [vc.spec("full", BS)], 4096, BS)

    def make_requests(prompts):
        return [vc.request(f"r{i}", p, hasher) for i, p in enumerate(prompts)]

    return hash_prompt, pool, manager, make_requests, None, None


def workloads(side, prompts, hash_tokens) -> dict[str, tuple]:
    """name -> (timed fn, untimed setup or None) for one side."""
    hash_prompt, make_pool, make_manager, make_requests, decode_batch, admit = side

    def alloc_free(pool):
        for _ in range(100):
            pool.free_blocks(reversed(pool.get_new_blocks(1000)))

    def lookup_allocate(state):
        m, reqs = state
        for r in reqs:
            hits, n = m.get_computed_blocks(r)[:2]
            m.allocate_slots(r, r.num_tokens - n, n, hits)

    def free_all(state):
        m, reqs = state
        for r in reqs:
            m.free(r)

    def allocated():
        m, reqs = make_manager(), make_requests(prompts)
        lookup_allocate((m, reqs))
        return m, reqs

    def running():
        m, reqs = allocated()
        for r in reqs:
            r.num_computed_tokens = r.num_tokens
        return m, reqs

    def decode(state):  # a scheduler's decode steps: one token per request, per-request allocate_slots
        m, reqs = state
        for step in range(DECODE_STEPS):
            for r in reqs:
                r.append_output_token_ids(7 + step)
                m.allocate_slots(r, 1)
                r.num_computed_tokens += 1

    out = {
        "hash": (lambda: hash_prompt(hash_tokens), None),
        "alloc_free": (alloc_free, make_pool),
        "req_hash": (lambda: make_requests(prompts), None),
        "lookup_alloc": (lookup_allocate, lambda: (make_manager(), make_requests(prompts))),
        "free": (free_all, allocated),
        "decode": (decode, running),
    }
    if decode_batch is not None:
        def batched(state):
            m, reqs = state
            for step in range(DECODE_STEPS):
                decode_batch(m, reqs, 7 + step)
        out["decode_batch"] = (batched, running)
    if admit is not None:
        def admit_all(state):
            m, reqs = state
            for r in reqs:
                admit(m, r)
        out["lookup_alloc_fast"] = (admit_all, lambda: (make_manager(), make_requests(prompts)))
    return out


def measure(sides: list[dict[str, tuple]], reps: int) -> list[dict[str, float]]:
    """Median seconds per workload for each side, the sides taking turns rep by rep (one call each),
    so the machine's slow moments fall on both alike."""
    times: list[dict[str, list[float]]] = [{k: [] for k in side} for side in sides]
    for _ in range(reps):
        for side, out in zip(sides, times):
            for name, (fn, setup) in side.items():
                if setup is None:
                    fn()  # untimed warm-up: the other side just ran, these caches are cold
                out[name] += time_call(fn, setup, reps=1)
    return [{k: median(v) for k, v in out.items()} for out in times]


SPECS = [  # (key, label, units per call, unit)
    ("hash", "hashing, 16-token blocks", HASH_TOKENS, "tokens/s"),
    ("alloc_free", "get_new_blocks(1000)+free x100, 100k pool", 100_000, "blocks/s"),
    ("req_hash", "200 x 1,124-token requests: hash", NUM_REQS * (PREFIX + SUFFIX), "tokens/s"),
    ("lookup_alloc", "200 requests: lookup + allocate", NUM_REQS, "requests/s"),
    ("free", "200 requests: free", NUM_REQS, "requests/s"),
    ("decode", "200 running requests x 16 decode steps (allocate_slots each)", NUM_REQS * DECODE_STEPS, "tokens/s"),
]
FAST_LABELS = {"decode_batch": "decode steps through allocate_running_batch",
               "lookup_alloc_fast": "admissions through admit"}


def plot(data: dict) -> None:
    """bench/results/core.png from the results (needs matplotlib where it runs)."""
    keys = [s[0] for s in SPECS] + [k for k in FAST_LABELS if k in data]
    labels = [s[1] for s in SPECS] + [FAST_LABELS[k] + " (vLLM: per request)" for k in FAST_LABELS if k in data]
    bar_plot("core", "kvservice core vs vLLM 0.33.0 (time ratio, lower is better)", labels,
             {"ours / vLLM": [data[k]["ratio_ours_over_vllm"] for k in keys]}, "time ratio", hline=1.0, log=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    reason = reexec_under_vllm()
    rng = random.Random(0)
    prefix = [rng.randrange(32000) for _ in range(PREFIX)]
    prompts = [prefix + [rng.randrange(32000) for _ in range(SUFFIX)] for _ in range(NUM_REQS)]
    hash_tokens = [rng.randrange(32000) for _ in range(HASH_TOKENS)]

    print(f"core benchmark: {args.reps} repetitions per row, medians, the sides taking turns", flush=True)
    sides = [workloads(ours_side(), prompts, hash_tokens)]
    if reason is None:
        sides.append(workloads(vllm_side("sha256"), prompts, hash_tokens))
        sides.append({"hash": workloads(vllm_side("xxhash"), prompts, hash_tokens)["hash"]})
        sides.append(workloads(vllm_side("sha256", dropin=True), prompts, hash_tokens))
        print("  ours, vLLM 0.33.0 (sha256, its default), vLLM's xxhash path and the drop-in ...", flush=True)
    else:
        print(f"  vLLM side skipped: {reason}")
    results = measure(sides, args.reps)
    ours = results[0]
    theirs = results[1] if reason is None else {}
    theirs_xx = results[2] if reason is None else {}
    dropin = results[3] if reason is None else {}

    rows, data = [], {}
    for key, label, units, unit_name in SPECS:
        ratio = ours[key] / theirs[key] if key in theirs else float("nan")
        dropin_ratio = dropin[key] / theirs[key] if key in dropin else float("nan")
        row = {"ours_s": ours[key], "vllm_s": theirs.get(key), "ratio_ours_over_vllm": ratio,
               "ours_rate": units / ours[key], "unit": unit_name, "dropin_s": dropin.get(key),
               "ratio_dropin_over_vllm": dropin_ratio}
        rows.append([label, f"{units / ours[key]:,.0f} {unit_name}", ours[key] * 1e3,
                     theirs[key] * 1e3 if key in theirs else float("nan"), ratio,
                     dropin[key] * 1e3 if key in dropin else float("nan"), dropin_ratio])
        data[key] = row
    # Ours only: the same work through the core's fast paths, against vLLM's per-request path.
    fast = [("decode_batch", "decode", "the same decode steps through allocate_running_batch (ours only)",
             NUM_REQS * DECODE_STEPS, "tokens/s", "allocate_slots per request"),
            ("lookup_alloc_fast", "lookup_alloc", "the same admissions through admit (ours only)", NUM_REQS,
             "requests/s", "get_computed_blocks + allocate_slots per request")]
    for key, theirs_key, label, units, unit_name, vllm_path in fast:
        ratio = ours[key] / theirs[theirs_key] if theirs_key in theirs else float("nan")
        rows.append([label, f"{units / ours[key]:,.0f} {unit_name}", ours[key] * 1e3,
                     theirs[theirs_key] * 1e3 if theirs_key in theirs else float("nan"), ratio, float("nan"),
                     float("nan")])
        data[key] = {"ours_s": ours[key], "vllm_s": theirs.get(theirs_key), "ratio_ours_over_vllm": ratio,
                     "ours_rate": units / ours[key], "unit": unit_name, "vllm_path": vllm_path}
    if theirs_xx:
        data["hash"]["vllm_xxhash_s"] = theirs_xx["hash"]
        data["hash"]["ratio_ours_over_vllm_xxhash"] = ours["hash"] / theirs_xx["hash"]
    print()
    print(table(["workload", "ours", "ours ms", "vLLM ms", "ours/vLLM", "drop-in ms", "drop-in/vLLM"], rows))
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
        plot(data)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

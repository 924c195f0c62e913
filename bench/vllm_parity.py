"""Replays random scheduler traces on kvservice's core and on vLLM 0.33.0's, op by op, and checks
they agree exactly: hit lengths and hit block ids, allocated block ids (or both None), request tables
and the free-queue order after every operation. In single full-attention pools half the admissions take
our one-call `KVCacheManager.admit` (against vLLM's get_computed_blocks + allocate_slots).

    python bench/vllm_parity.py [--traces 200] [--ops 300]

Needs the vLLM reference env (bench/README.md); re-executes itself under it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.vllm_ref import reexec_under_vllm  # noqa: E402

CONFIGS = {
    "full": [("full", 4, None)],
    "full+sw": [("full", 4, None), ("sw", 4, 8)],
    "sw": [("sw", 4, 12)],
    "full4+sw8": [("full", 4, None), ("sw", 8, 16)],
    "chunked": [("chunked", 4, 8)],
    "full+chunked": [("full", 4, None), ("chunked", 4, 8)],
    # A window block smaller than the LCM: only the window blocks an aligned hit can use are cached.
    "full16+sw4": [("full", 16, None), ("sw", 4, 4)],
    # Mamba "align" states: one block per chunk; with a state block larger than the hash block,
    # sub-block (partial) hits and their copy-on-write.
    "full+mamba4": [("full", 4, None), ("mamba", 4, None)],
    "full4+mamba8": [("full", 4, None), ("mamba", 8, None)],
}


def ours_manager(config, num_blocks, max_len):
    from kvservice.core import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheManager,
        MambaSpec,
        SlidingWindowSpec,
    )
    make = {"full": lambda bs, w: FullAttentionSpec(bs), "sw": SlidingWindowSpec, "chunked": ChunkedLocalAttentionSpec,
            "mamba": lambda bs, w: MambaSpec(bs)}
    specs = [make[kind](bs, w) for kind, bs, w in config]
    return KVCacheManager(KVCacheConfig(num_blocks, specs), max_len)


def run_trace(vc, config_name: str, seed: int, num_ops: int) -> int:
    from kvservice.core import Request
    rng = random.Random(seed)
    config = CONFIGS[config_name]
    num_blocks = rng.randint(8, 40)
    max_len = 96
    ours = ours_manager(config, num_blocks, max_len)
    theirs = vc.manager(num_blocks, [vc.spec(k, bs, w) for k, bs, w in config], max_len, ours.hash_block_size)
    hasher = vc.hasher(ours.hash_block_size)
    families = [[rng.randrange(1000) for _ in range(max_len)] for _ in range(3)]
    waiting: dict[str, tuple] = {}
    running: dict[str, tuple] = {}
    checks = 0
    fast = len(config) == 1 and config[0][0] == "full"  # where KVCacheManager.admit applies

    def free_order(m):
        return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]

    def compare(what):
        nonlocal checks
        a, b = free_order(ours), free_order(theirs)
        if a != b:
            raise AssertionError(f"{config_name} seed {seed}: free queues differ after {what}:\n ours {a}\n vllm {b}")
        for rid in running:
            x = ours.get_block_ids(rid)
            y = tuple(list(g) for g in theirs.get_block_ids(rid))
            if x != y:
                raise AssertionError(f"{config_name} seed {seed}: tables of {rid} differ after {what}: {x} vs {y}")
        checks += 1

    def allocate(pair, num_new, hit=0, hits=(None, None)):
        ro, rv = pair
        a = ours.allocate_slots(ro, num_new, hit, hits[0])
        b = theirs.allocate_slots(rv, num_new, hit, hits[1])
        ga = None if a is None else a.get_block_ids()
        gb = None if b is None else tuple(list(g) for g in b.get_block_ids())
        if ga != gb:
            raise AssertionError(f"{config_name} seed {seed}: allocate({ro.request_id}, {num_new}) -> {ga} vs {gb}")
        return a is not None

    for op in range(num_ops):
        kind = rng.choices(["add", "admit", "advance", "free", "reset"], [3, 4, 8, 2, 0.2])[0]
        if kind == "add":
            rid = f"r{op}"
            toks = families[rng.randrange(3)][:rng.randint(2, 60)]
            waiting[rid] = (Request(rid, toks, ours.hash_block_size), vc.request(rid, list(toks), hasher))
        elif kind == "admit" and waiting and fast and rng.random() < 0.5:
            # Our one-call admission (single full-attention pools) against vLLM's two calls.
            rid = rng.choice(sorted(waiting))
            ro, rv = waiting[rid]
            hv, nv = theirs.get_computed_blocks(rv)[:2]
            num_new = rng.randint(1, rv.num_tokens - nv)
            got = ours.fast_path.admit(ro, num_new)
            b = theirs.allocate_slots(rv, num_new, nv, hv)
            theirs_table = None if b is None else list(theirs.get_block_ids(rid)[0])
            ours_table = None if got[0] is None else [blk.block_id for blk in got[0]]
            if got[1] != nv or ours_table != theirs_table:
                raise AssertionError(f"{config_name} seed {seed}: admit({rid}, {num_new}) -> {got[1]} {ours_table} vs "
                                     f"{nv} {theirs_table}")
            if b is not None:
                ro.num_computed_tokens = rv.num_computed_tokens = nv + num_new
                running[rid] = waiting.pop(rid)
        elif kind == "admit" and waiting:
            rid = rng.choice(sorted(waiting))
            ro, rv = waiting[rid]
            ho, no = ours.get_computed_blocks(ro)
            hv, nv = theirs.get_computed_blocks(rv)[:2]
            if no != nv or ho.get_block_ids() != tuple(list(g) for g in hv.get_block_ids()):
                raise AssertionError(f"{config_name} seed {seed}: hit of {rid}: {no} {ho.get_block_ids()} vs "
                                     f"{nv} {hv.get_block_ids()}")
            num_new = rng.randint(1, ro.num_tokens - no)
            if allocate((ro, rv), num_new, no, (ho, hv)):
                ro.num_computed_tokens = rv.num_computed_tokens = no + num_new
                running[rid] = waiting.pop(rid)
        elif kind == "advance" and running:
            rid = rng.choice(sorted(running))
            ro, rv = running[rid]
            if ro.num_tokens >= max_len - 1:
                continue
            if ro.num_computed_tokens == ro.num_tokens:
                tok = rng.randrange(1000)
                ro.append_output_token_ids(tok)
                rv.append_output_token_ids(tok)
            num_new = rng.randint(1, ro.num_tokens - ro.num_computed_tokens)
            if allocate((ro, rv), num_new):
                ro.num_computed_tokens += num_new
                rv.num_computed_tokens += num_new
        elif kind == "free" and running:
            rid = rng.choice(sorted(running))
            ro, rv = running.pop(rid)
            ours.free(ro)
            theirs.free(rv)
        elif kind == "reset":
            if ours.reset_prefix_cache() != theirs.reset_prefix_cache():
                raise AssertionError(f"{config_name} seed {seed}: reset_prefix_cache disagrees")
        compare(f"op {op} ({kind})")
        # One op is one scheduler step (a Mamba state cached in a step is hit from the next one).
        ours.new_step_starts()
        theirs.new_step_starts()
        copies_o, copies_v = ours.take_block_copies(), theirs.take_kv_cache_block_copies()
        if copies_o != [(c.src_block_id, c.dst_block_id) for c in copies_v[0]]:
            raise AssertionError(f"{config_name} seed {seed}: copies differ after op {op}: {copies_o} vs {copies_v[0]}")
        theirs.block_pool.free_blocks(copies_v[1])  # what vLLM's scheduler does once the copies ran
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=150)
    parser.add_argument("--ops", type=int, default=300)
    args = parser.parse_args()
    reason = reexec_under_vllm()
    if reason:
        print(f"vLLM parity not checked: {reason}")
        return 0
    from bench.vllm_ref import VllmCore
    vc = VllmCore()
    results = {}
    start = time.time()
    for name in CONFIGS:
        checks = 0
        for seed in range(args.traces):
            checks += run_trace(vc, name, seed, args.ops)
            if seed % 50 == 49:
                print(f"  {name}: {seed + 1}/{args.traces} traces agree ({checks} checks)", flush=True)
        results[name] = {"traces": args.traces, "ops_per_trace": args.ops, "checks": checks}
    print(f"vLLM 0.33.0 parity: every trace agreed ({time.time() - start:.0f} s)")
    for name, r in results.items():
        print(f"  {name:8s} {r['traces']} traces x {r['ops_per_trace']} ops, {r['checks']} state comparisons")
    out = Path(__file__).resolve().parent / "results" / "vllm_parity.json"
    out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

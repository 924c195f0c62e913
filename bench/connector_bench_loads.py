"""Where a load's time goes, on the real allocator, store (segment and disk tier) and connector sides, without
vLLM engines: bench/connector_bench.py's model (8 layers, 8 KV heads of 64, fp32, block 32: 1 MiB pages, vLLM's
CPU layout with K transposed), prefixes of 1k and 4k tokens saved by a writer, then loaded by a reader in a
fresh process of its own, twice: its first load (the segment just mapped) and a second one.

Per load it records the connector's parts (connector/timing.py: lookup, pin, fetch, check, verify, copy,
pin_check, commit), the page faults the reader took (getrusage), and how many runs of consecutive rows the
store's page ids formed: a fresh store hands out ascending ids, one that wrapped (LRU reuse) hands a request's
pages out descending. Paths: this node's segment (`local`), another node's store over one NIXL READ (`nixl`,
where NIXL is installed: a reader whose shm_dir holds no store; UCX picks `cma` between two processes of a
host), the store's disk tier (`disk`, page cache dropped first). The probes (bench/connector_bench_probes.py;
`--probe` runs only them) time one hypothesis each on the same segment and page format: how the segment is
mapped, checksums read before the copy, a layer-by-layer load on a CPU.

    PYTHONPATH=. .venv/bin/python bench/connector_bench_loads.py [--lengths 1024,4096] [--out FILE]
Writes bench/results/connector_loads.json (~1 minute, ~1 GiB in /dev/shm and the temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BS, LAYERS, HEADS, HEAD = 32, 8, 8, 64
PAGE = LAYERS * HEADS * BS * 2 * HEAD * 4  # 1 MiB
OUT = REPO / "bench" / "results" / "connector_loads.json"


def engine_kv(num_blocks: int, seed: int):
    """A vLLM CPU engine's KV (LBHNC, fp32): one zeroed allocation, as vLLM's allocate_kv_cache makes it, and
    each layer's view over it; then filled."""
    import torch

    from tests.page_format_helpers import by_hand
    e = by_hand("LBHNC", LAYERS, num_blocks, HEADS, BS, 2 * HEAD, torch.float32)
    e.raw.view(torch.float32).copy_(torch.randn(e.raw.numel() // 4, generator=torch.Generator().manual_seed(seed)))
    return e.caches


def sides(address: str, shm: str, name: str, store: str | None, loads: bool, saves: bool, seed: int,
          num_blocks: int, transport: str = "auto"):
    from kvservice.integrations.vllm.connector.scheduler_side import SchedulerSide
    from kvservice.integrations.vllm.connector.settings import ConnectorSettings
    from kvservice.integrations.vllm.connector.worker_side import WorkerSide
    settings = ConnectorSettings(address=address, store=store, shm_dir=shm, index=False, namespace="loads-bench",
                                 transport=transport)
    sched = SchedulerSide(settings, BS, name, loads=loads, saves=saves)
    worker = WorkerSide(settings, BS, name, head_size=HEAD)
    worker.register(engine_kv(num_blocks, seed), num_blocks)
    return sched, worker


def runs_of(ids: list[int]) -> int:
    return sum(1 for i, x in enumerate(ids) if i == 0 or ids[i - 1] + 1 != x)


def reader(job: dict) -> dict:
    """One reader process: the prompt loaded twice (two requests, other engine blocks), each load timed."""
    from bench.connector_bench_parts import drop_page_cache
    from tests.connector_helpers import report, request, scheduled
    prompt, n = job["prompt"], job["tokens"] // BS
    sched, worker = sides(job["address"], job["shm"], "reader", job["store"], True, False, 7, 2 * n + 8,
                          job.get("transport", "auto"))
    out = []
    for k in range(2):
        if job["disk_dir"]:
            drop_page_cache(Path(job["disk_dir"]) / "pages")
        req, blocks = request(f"x{k}", prompt), list(range(k * (n + 4), k * (n + 4) + n + 1))
        claim0, load0 = sched.claim_parts.snapshot(), worker.load_parts.snapshot()
        sched.on_new_request(req)
        found, _ = sched.num_new_matched_tokens(req, 0)
        assert found == job["tokens"], f"found {found} of {job['tokens']} tokens"
        sched.after_alloc(req, blocks, found)
        (load,), _ = sched.build(scheduled(req.request_id, prompt, blocks, found, len(prompt) - found))
        faults, wall = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        worker.load([load], sched.endpoints_for([load]))
        wall, faults = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        assert not worker.take_failed_blocks(), "a load failed"
        report(sched, worker)  # the workers' report: the unpin, sent by the teller (commit)
        parts = delta(claim0, sched.claim_parts.snapshot()) | delta(load0, worker.load_parts.snapshot())
        out.append({"load": "first in the process" if k == 0 else "second", "pool": load.pool_id,
                    "row_runs": runs_of(load.store_block_ids), "minor_faults": faults, "worker_load_ms": wall * 1e3,
                    "parts_ms": {p: s * 1e3 for p, s in parts.items()}})
    worker.close()
    sched.close()
    return {"loads": out}


def delta(before: dict, after: dict) -> dict[str, float]:
    """The seconds each part took between two snapshots, over every key (tier or path)."""
    out: dict[str, float] = {}
    for key, row in after.items():
        for part, seconds in row.items():
            if not part.endswith("_n") and part not in ("loads", "blocks", "bytes"):
                out[part] = out.get(part, 0.0) + seconds - before.get(key, {}).get(part, 0.0)
    return out


def run_reader(job: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, "--reader"], input=json.dumps(job), capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    if done.returncode:
        raise RuntimeError(f"reader failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def evict(address: str, pool: str, prompt: list[int]) -> None:
    from kvservice.client import KVServiceClient
    from kvservice.ops import EvictBlocksOp, PinOp, UnpinOp
    with KVServiceClient(address, client_name="loads-bench", hash_block_size=BS) as c:
        c.open_session()
        (r,) = c.step(pool, [PinOp("probe", token_ids=prompt, cache_salt="loads-bench")])
        c.step(pool, [UnpinOp("probe")])
        c.step(pool, [EvictBlocksOp(list(r.new_block_ids[0]))])


def main_bench(args) -> dict:
    from kvservice.blockstore import BlockStore
    from tests.connector_helpers import report, request, scheduled
    from tests.service_helpers import start_server
    lengths = [int(x) for x in args.lengths.split(",")]
    most = max(lengths) // BS
    work = Path(tempfile.mkdtemp(prefix="loads-bench-"))
    shm = tempfile.mkdtemp(prefix="loads-bench-", dir="/dev/shm")
    server = start_server("--hash-block-size", str(BS), log_dir=work)
    rng, results = random.Random(0), {"page_bytes": PAGE, "block_size": BS, "cases": []}
    # Pages for every length once ascending (a fresh store), then once more each after the store wrapped.
    num_pages = sum(n // BS for n in lengths) + most + 8
    from kvservice.blockstore.transports import nixl_available
    nixl = nixl_available()
    store = BlockStore("a", server.target, num_pages, PAGE, BS, directory=shm, disk_dir=str(work / "disk"),
                       disk_bytes=4 * num_pages * (PAGE + 4096), nixl=nixl)
    try:
        sched, worker = sides(server.target, shm, "writer", "a", False, True, 1, most + 8)
        for order in ("ascending (a fresh store)", "reused (a store that wrapped)"):
            for n in lengths:
                prompt = [rng.randrange(1, 30000) for _ in range(n + 2)]
                req = request(f"w-{order[:3]}-{n}", prompt)
                sched.on_new_request(req)
                _, saves = sched.build(scheduled(req.request_id, prompt, list(range(n // BS + 1)), 0, n + 2))
                worker.save(saves)
                report(sched, worker)
                for path in ("local", "nixl", "disk"):
                    if path == "disk":
                        evict(server.target, store.pool_id, prompt)
                    job = {"address": server.target, "shm": shm, "store": "a", "prompt": prompt, "tokens": n,
                           "disk_dir": str(work / "disk") if path == "disk" else ""}
                    if path == "nixl":  # "another node": no store in its shm_dir, the pages in one NIXL READ
                        if not nixl:
                            continue
                        job.update(shm=str(work), store=None, transport="nixl")
                    got = run_reader(job)
                    results["cases"].append({"path": path, "tokens": n, "store_pages": order, **got})
                    print(f"{path:5} {n:5} tokens, {order}: " + "; ".join(
                        f"{x['load']}: {x['worker_load_ms']:.1f} ms ({x['row_runs']} row runs, {x['minor_faults']} "
                        f"faults) " + ", ".join(f"{p} {v:.2f}" for p, v in x["parts_ms"].items() if v > 0.005)
                        for x in got["loads"]), flush=True)
            if order.startswith("asc"):  # fillers wrap the store: the next saves take reused pages
                for f in range(num_pages // most + 1):
                    part = [rng.randrange(1, 30000) for _ in range(most * BS + 2)]
                    req = request(f"filler-{f}", part)
                    sched.on_new_request(req)
                    _, saves = sched.build(scheduled(req.request_id, part, list(range(most + 1)), 0, len(part)))
                    worker.save(saves)
                    report(sched, worker)
        worker.close()
        sched.close()
    finally:
        store.close()
        server.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--probe", action="store_true", help="only the probes (bench/connector_bench_probes.py)")
    parser.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reader:
        print(json.dumps(reader(json.loads(sys.stdin.readline()))), flush=True)
        return
    from bench.connector_bench_probes import probes
    results = {} if args.probe else main_bench(args)
    results["probes"] = probes()
    results["load_average"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

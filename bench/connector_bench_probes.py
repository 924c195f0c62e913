"""Probes of bench/connector_bench_loads.py: one hypothesis each about where a load's time goes, timed on a real
store segment (segment.py) and the connector's real page format (vLLM's CPU layout, fp32, 1 MiB pages).

- `mapping`: a reader process maps the segment (MAP_POPULATE as segment.py does; no populate; madvise
  WILLNEED; madvise POPULATE_WRITE; MADV_HUGEPAGE where the kernel lets shared memory have huge pages) and
  loads 128 pages twice: the map call, each load and the page faults it took.
- `verify_then_copy`: a load whose pages are checksummed first (a disk page, or verify_checksums), as today
  (every page's checksum, then the copy: the pages are read twice from memory), against the two interleaved
  a few pages at a time (the copy then reads what the checksum left in cache), and the copy alone.
- `layerwise`: a CPU engine's load before its forward against one layer by layer beside it (a thread copying
  layer i+1 while layer i computes), on the bench model's shapes.
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = 128
MADV_POPULATE_WRITE = 23  # Linux 5.14
VARIANTS = ("populate", "plain", "willneed", "populate_write", "hugepage")


def page_format(num_blocks: int):
    import torch

    from bench.connector_bench_loads import BS, HEAD, HEADS, LAYERS
    from kvservice.integrations.vllm.connector.pageformat import PageFormat
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(num_blocks, HEADS, BS, 2 * HEAD) for i in range(LAYERS)}
    return PageFormat.build(kv, num_blocks=num_blocks, block_size=BS, cpu_isa="vec", head_size=HEAD)


def map_variant(path: str, size: int, variant: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if variant == "populate" else 0)
        m = mmap.mmap(fd, size, flags=flags)
    finally:
        os.close(fd)
    advice = {"willneed": mmap.MADV_WILLNEED, "populate_write": MADV_POPULATE_WRITE,
              "hugepage": getattr(mmap, "MADV_HUGEPAGE", 14)}.get(variant)
    if advice is not None:
        m.madvise(advice)
    if variant == "hugepage":
        m.madvise(MADV_POPULATE_WRITE)
    return m


def mapping_child(job: dict) -> dict:
    """In a fresh process: map the segment one way, load its pages twice into a zeroed engine KV."""
    import numpy as np
    import torch
    torch.set_num_threads(job["threads"])
    fmt = page_format(PAGES + 1)
    start = time.perf_counter()
    try:
        m = map_variant(job["path"], job["size"], job["variant"])
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    map_s = time.perf_counter() - start
    pages = torch.from_numpy(np.frombuffer(m, np.uint8, count=PAGES * fmt.page_bytes, offset=job["offset"])
                             .reshape(PAGES, fmt.page_bytes))
    out = {"map_ms": map_s * 1e3, "loads": []}
    for _ in range(2):
        faults, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        fmt.scatter(pages, list(range(1, PAGES + 1)))
        t = time.perf_counter() - t
        out["loads"].append({"ms": t * 1e3, "GBps": PAGES * fmt.page_bytes / t / 1e9,
                             "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
    smaps = Path("/proc/self/smaps_rollup").read_text()
    out["shmem_pmd_mapped_kB"] = next((int(x.split()[1]) for x in smaps.splitlines()
                                       if x.startswith("ShmemPmdMapped")), 0)
    del pages
    return out


def mapping(threads: int) -> dict:
    import numpy as np

    from kvservice.blockstore.segment import Segment
    page = page_format(2).page_bytes
    with tempfile.TemporaryDirectory(prefix="probe-", dir="/dev/shm") as shm:
        seg = Segment(os.path.join(shm, "segment"), PAGES + 1, page, create=True)
        seg.pages[1:] = np.random.default_rng(0).integers(0, 256, (PAGES, page), dtype=np.uint8)
        job = {"path": seg.path, "size": os.path.getsize(seg.path), "offset": seg.pages_offset + page,
               "threads": threads}
        out = {}
        for variant in VARIANTS:
            done = subprocess.run([sys.executable, __file__, "mapping"], input=json.dumps({**job, "variant": variant}),
                                  capture_output=True, text=True, cwd=REPO, timeout=120,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
            out[variant] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
                "error": done.stderr[-500:]}
        seg.close(unlink=True)
    out["shmem_enabled"] = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
    return out


def verify_then_copy(reps: int = 5) -> dict:
    """Checksums then copy, all pages; interleaved per `chunk` pages; the copy alone (medians, ms)."""
    import statistics

    import torch

    from kvservice.integrations.vllm.connector.pagecheck import checksum
    fmt = page_format(PAGES + 1)
    pages = torch.randint(0, 256, (PAGES, fmt.page_bytes), dtype=torch.uint8)
    ids = list(range(1, PAGES + 1))

    def separate() -> None:
        [checksum(pages[i].numpy()) for i in range(PAGES)]
        fmt.scatter(pages, ids)

    def interleaved(chunk: int) -> None:
        for i in range(0, PAGES, chunk):
            [checksum(pages[j].numpy()) for j in range(i, i + chunk)]
            fmt.scatter(pages[i:i + chunk], ids[i:i + chunk])

    def timed(fn) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    out = {"copy_only_ms": timed(lambda: fmt.scatter(pages, ids)), "checksums_only_ms":
           timed(lambda: [checksum(pages[i].numpy()) for i in range(PAGES)]), "separate_ms": timed(separate)}
    for chunk in (1, 4):
        out[f"interleaved_{chunk}_ms"] = timed(lambda chunk=chunk: interleaved(chunk))
    return out


def layerwise(blocks: int = 128, reps: int = 5) -> dict:
    """A load before the forward against one layer by layer beside it (vLLM's wait_for_layer_load): a thread
    copies layer i+1 while the main thread computes layer i. The forward is bench/connector_bench.py's model
    reading its weights for a 2-token step (fp32 matmuls of its MLP and attention projections per layer); the
    copy is each layer's pages of `blocks` blocks into the engine's KV. Medians, ms."""
    import statistics
    import threading

    import torch

    from bench.connector_bench_loads import BS, HEAD, HEADS, LAYERS
    from kvservice.integrations.vllm.connector.pageformat import PageFormat
    kv = [torch.zeros(blocks + 1, HEADS, BS, 2 * HEAD) for _ in range(LAYERS)]
    fmts = [PageFormat.build({"layer": t}, num_blocks=blocks + 1, block_size=BS, cpu_isa="vec", head_size=HEAD)
            for t in kv]
    pages = [torch.randint(0, 256, (blocks, fmts[0].page_bytes), dtype=torch.uint8) for _ in range(LAYERS)]
    weights = [torch.randn(1024, 2 * 2816 + 2816 + 4 * 1024) for _ in range(LAYERS)]
    x, ids = torch.randn(2, 1024), list(range(1, blocks + 1))

    def copy(i: int) -> None:
        fmts[i].scatter(pages[i], ids)

    def compute(i: int) -> None:
        x @ weights[i]

    def before() -> None:
        for i in range(LAYERS):
            copy(i)
        for i in range(LAYERS):
            compute(i)

    def beside() -> None:
        done = [threading.Event() for _ in range(LAYERS)]

        def loader() -> None:
            for i in range(LAYERS):
                copy(i)
                done[i].set()
        thread = threading.Thread(target=loader)
        thread.start()
        for i in range(LAYERS):
            done[i].wait()
            compute(i)
        thread.join()

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    out = {"copy_only_ms": timed(lambda: [copy(i) for i in range(LAYERS)]),
           "compute_only_ms": timed(lambda: [compute(i) for i in range(LAYERS)]),
           "load_then_forward_ms": timed(before), "layer_by_layer_ms": timed(beside)}
    out["layer_by_layer_vs_before"] = out["layer_by_layer_ms"] / out["load_then_forward_ms"]
    return out


def probes() -> dict:
    import torch
    threads = torch.get_num_threads()
    out = {"threads": threads, "mapping": mapping(threads), "verify_then_copy": verify_then_copy(),
           "layerwise": layerwise()}
    for variant, r in out["mapping"].items():
        if isinstance(r, dict) and "loads" in r:
            first, second = r["loads"]
            print(f"mapping {variant:15} map {r['map_ms']:7.1f} ms; first load {first['ms']:6.1f} ms "
                  f"({first['minor_faults']} faults), second {second['ms']:6.1f} ms ({second['minor_faults']} "
                  f"faults); huge pages mapped {r['shmem_pmd_mapped_kB']} kB", flush=True)
        elif isinstance(r, dict):
            print(f"mapping {variant:15} {r.get('error', r)}")
    print("verify then copy, ms: " + ", ".join(f"{k} {v:.1f}" for k, v in out["verify_then_copy"].items()))
    print("layer by layer, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in out["layerwise"].items()))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    if sys.argv[1:] == ["mapping"]:
        print(json.dumps(mapping_child(json.loads(sys.stdin.readline()))), flush=True)
    else:
        print(json.dumps(probes(), indent=1))

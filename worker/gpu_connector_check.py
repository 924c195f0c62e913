"""GPU check of the KV connector's page copies (kvservice/integrations/vllm/connector/pageformat.py, movers.py):
a Llama-8B-shaped KV (32 layers, 8 KV heads, head size 128, bf16, block 16) in vLLM's LBNHC (NHD) and LBHNC
(HND) layouts, each one shared int8 allocation with strided per-layer views as vLLM builds them; 4k- and
32k-token prefixes (scattered block ids) saved by the CudaMover into page-locked host pages (an mmap, like the
store's segment) and loaded into the other layout.

Checks the bytes (each loaded block equals the saved one, logically), and reports GB/s beside a plain pinned
copy of the same bytes and beside one copy_ per (block, layer); and the cost of a 32k save to a step computing
on the default stream meanwhile (a matmul loop timed with and without it). Targets: >= 80% of the pinned copy,
>= 5x the per-block path, <= 5% step overhead. Writes bench/results/gpu_connector.json (on a GPU only).

Run by `make gpu-check` as `PYTHONPATH=. python3 worker/gpu_connector_check.py` with the machine's own python:
imports torch and those two modules only. Without CUDA it runs a tiny dry run of the same paths on the CPU
(the CpuMover) and says so.
"""

from __future__ import annotations

import json
import mmap
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvservice.integrations.vllm.connector.movers import CudaMover, PageMover, make_mover
from kvservice.integrations.vllm.connector.pageformat import PageFormat

RESULTS = Path("bench/results/gpu_connector.json")
TARGETS = {"vs_pinned": 0.80, "vs_per_block": 5.0, "step_overhead": 0.05}
GPU_SHAPE = dict(layers=32, heads=8, head_size=128, block_size=16, dtype=torch.bfloat16)
DRY_SHAPE = dict(layers=4, heads=2, head_size=32, block_size=16, dtype=torch.bfloat16)
GPU_PREFIXES = (4096, 32768)
DRY_PREFIXES = (64, 256)


def engine(layout: str, shape: dict, num_blocks: int, device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One int8 pool and per-layer logical [B, H, N, C] views over it, physical order `layout`."""
    dtype = shape["dtype"]
    sizes = dict(L=shape["layers"], B=num_blocks, H=shape["heads"], N=shape["block_size"], C=2 * shape["head_size"])
    numel = sizes["L"] * sizes["B"] * sizes["H"] * sizes["N"] * sizes["C"]
    raw = torch.empty(numel * dtype.itemsize, dtype=torch.int8, device=device)
    phys = raw.view(dtype).view(*(sizes[d] for d in layout))
    rest = layout.replace("L", "")
    views = {f"model.layers.{i}.self_attn.attn": phys.select(layout.index("L"), i).permute(
        *(rest.index(d) for d in "BHNC")) for i in range(sizes["L"])}
    return raw, views


def host_pages(rows: int, page_bytes: int) -> torch.Tensor:
    """Host pages in an anonymous shared mapping, as the store's segment is a shared mmap."""
    buf = mmap.mmap(-1, rows * page_bytes)
    return torch.frombuffer(buf, dtype=torch.uint8).view(rows, page_bytes)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_seconds(fn, device: str, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def run_job(mover: PageMover, kind: str, *args) -> bool:
    job = f"{kind}-{time.perf_counter_ns()}"
    (mover.submit_save if kind == "save" else mover.submit_load)(job, *args)
    mover.wait([job])
    done = dict(mover.finished())
    assert done.get(job) is True, f"{kind} job failed: {done}"
    return True


def logical_equal(a: dict[str, torch.Tensor], a_ids: list[int], b: dict[str, torch.Tensor], b_ids: list[int]) -> bool:
    ia, ib = (torch.tensor(x, device=next(iter(a.values())).device) for x in (a_ids, b_ids))
    return all(torch.equal(a[n].index_select(0, ia).view(torch.int16), b[n].index_select(0, ib).view(torch.int16))
               for n in a)


def per_block_save(views: dict[str, torch.Tensor], ids: list[int], host: torch.Tensor) -> None:
    """The old way: one copy_ per (block, layer), of an LBHNC block's contiguous bytes."""
    names = sorted(views)
    size = host.shape[1] // len(names)
    for row, b in enumerate(ids):
        for i, name in enumerate(names):
            host[row, i * size:(i + 1) * size].copy_(views[name][b].view(-1).view(torch.uint8), non_blocking=True)


def step_overhead(mover: PageMover, ids: list[int], host: torch.Tensor) -> dict:
    """A matmul loop on the default stream, alone and with a save running beside it."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    save_s = best_seconds(lambda: run_job(mover, "save", ids, host, list(range(len(ids)))), "cuda", 1)
    one = best_seconds(lambda: a @ a, "cuda", 3)
    loops = max(4, int(2 * save_s / one))  # the step outlasts the save

    def step() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(loops):
            a @ a
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    alone = statistics.median(step() for _ in range(3))
    beside, submit = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mover.submit_save("overlap", ids, host, list(range(len(ids))))
        submit.append(time.perf_counter() - t0)
        beside.append(step())
        mover.wait(["overlap"])
        assert dict(mover.finished()) == {"overlap": True}
    return {"step_s": alone, "step_with_save_s": statistics.median(beside), "save_alone_s": save_s,
            "submit_s": statistics.median(submit), "overhead": statistics.median(beside) / alone - 1}


@dataclass(slots=True)
class Bench:
    """One engine pair: NHD pages saved, loaded into HND."""

    shape: dict
    device: str
    num_blocks: int
    nhd: dict[str, torch.Tensor]
    hnd_raw: torch.Tensor
    hnd: dict[str, torch.Tensor]
    saver: PageMover
    loader: PageMover
    host: torch.Tensor
    gen: torch.Generator

    def case(self, tokens: int) -> dict:
        n, page, device = tokens // self.shape["block_size"], self.host.shape[1], self.device
        src_ids = torch.randperm(self.num_blocks, generator=self.gen)[:n].tolist()
        dst_ids = torch.randperm(self.num_blocks, generator=self.gen)[:n].tolist()
        rows = list(range(n))
        save_s = best_seconds(lambda: run_job(self.saver, "save", src_ids, self.host, rows), device)
        load_s = best_seconds(lambda: run_job(self.loader, "load", self.host, rows, dst_ids), device)
        ok = logical_equal(self.nhd, src_ids, self.hnd, dst_ids)
        own = self.hnd_raw.view(torch.uint8).view(self.shape["layers"], self.num_blocks, -1)[:, dst_ids[0]]
        ok = ok and torch.equal(self.host[0].to(device), own.reshape(-1))  # an HND page is the block's own bytes
        staging = torch.empty(n, page, dtype=torch.uint8, device=device)
        d2h_s = best_seconds(lambda: self.host[:n].copy_(staging, non_blocking=True), device)
        h2d_s = best_seconds(lambda: staging.copy_(self.host[:n], non_blocking=True), device)
        block_s = best_seconds(lambda: per_block_save(self.hnd, dst_ids, self.host), device, 1)
        scattered = torch.randperm(self.host.shape[0], generator=self.gen)[:n].tolist()
        scattered_s = best_seconds(lambda: run_job(self.saver, "save", src_ids, self.host, scattered), device)
        self.hnd_raw.zero_()
        run_job(self.loader, "load", self.host, scattered, dst_ids)
        ok = ok and logical_equal(self.nhd, src_ids, self.hnd, dst_ids)
        nbytes = n * page
        return {
            "tokens": tokens, "blocks": n, "bytes": nbytes, "correct": bool(ok),
            "save_gbs": nbytes / save_s / 1e9, "load_gbs": nbytes / load_s / 1e9,
            "pinned_d2h_gbs": nbytes / d2h_s / 1e9, "pinned_h2d_gbs": nbytes / h2d_s / 1e9,
            "per_block_save_gbs": nbytes / block_s / 1e9, "scattered_rows_save_gbs": nbytes / scattered_s / 1e9,
            "save_vs_pinned": d2h_s / save_s, "load_vs_pinned": h2d_s / load_s, "save_vs_per_block": block_s / save_s,
        }


    def unpinned(self, n: int = 64) -> bool:
        """Host memory that is not page-locked (the CudaMover's bounce-buffer path), scattered rows."""
        plain = torch.empty(n, self.host.shape[1], dtype=torch.uint8)
        src_ids = torch.randperm(self.num_blocks, generator=self.gen)[:n].tolist()
        dst_ids = torch.randperm(self.num_blocks, generator=self.gen)[:n].tolist()
        rows = list(reversed(range(n)))
        run_job(self.saver, "save", src_ids, plain, rows)
        self.hnd_raw.zero_()
        run_job(self.loader, "load", plain, rows, dst_ids)
        return bool(logical_equal(self.nhd, src_ids, self.hnd, dst_ids))


def check(shape: dict, prefixes: tuple[int, ...], device: str) -> dict:
    num_blocks = max(prefixes) // shape["block_size"] + 64
    nhd_raw, nhd = engine("LBNHC", shape, num_blocks, device)
    hnd_raw, hnd = engine("LBHNC", shape, num_blocks, device)
    nhd_raw.random_(-128, 127)
    hnd_raw.zero_()
    nhd_fmt = PageFormat.build(nhd, num_blocks=num_blocks, block_size=shape["block_size"], layout="LBNHC")
    hnd_fmt = PageFormat.build(hnd, num_blocks=num_blocks, block_size=shape["block_size"], layout="LBHNC")
    assert nhd_fmt.format_id == hnd_fmt.format_id, (nhd_fmt.format_id, hnd_fmt.format_id)
    saver, loader = make_mover(nhd_fmt), make_mover(hnd_fmt)
    host = host_pages(max(prefixes) // shape["block_size"], nhd_fmt.page_bytes)
    pinned = saver.pin(host) and loader.pin(host)
    bench = Bench(shape, device, num_blocks, nhd, hnd_raw, hnd, saver, loader, host, torch.Generator().manual_seed(0))
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
           "torch": torch.__version__, "format_id": nhd_fmt.format_id, "page_bytes": nhd_fmt.page_bytes,
           "host_pinned": pinned, "cases": [bench.case(tokens) for tokens in prefixes]}
    out["unpinned_host_correct"] = bench.unpinned()
    if isinstance(saver, CudaMover):
        n = max(prefixes) // shape["block_size"]
        out["step"] = step_overhead(saver, torch.randperm(num_blocks, generator=bench.gen)[:n].tolist(), host)
    saver.close()
    loader.close()
    return out


def report(out: dict, gpu: bool) -> bool:
    print(f"{out['device']}  torch {out['torch']}  page {out['page_bytes']} B  host pinned: {out['host_pinned']}  "
          f"unpinned host pages correct: {out['unpinned_host_correct']}")
    print(f"format {out['format_id']}")
    head = ("tokens", "correct", "save GB/s", "load GB/s", "pinned D2H", "pinned H2D", "per-block", "save/pin",
            "load/pin", "save/blk", "scattered")
    print(" ".join(f"{h:>10}" for h in head))
    ok = out["unpinned_host_correct"]
    for c in out["cases"]:
        print(" ".join(f"{v:>10}" for v in (
            c["tokens"], str(c["correct"]), f"{c['save_gbs']:.1f}", f"{c['load_gbs']:.1f}",
            f"{c['pinned_d2h_gbs']:.1f}", f"{c['pinned_h2d_gbs']:.1f}", f"{c['per_block_save_gbs']:.2f}",
            f"{c['save_vs_pinned']:.0%}", f"{c['load_vs_pinned']:.0%}", f"{c['save_vs_per_block']:.1f}x",
            f"{c['scattered_rows_save_gbs']:.1f}")))
        ok = ok and c["correct"]
        if gpu:
            ok = ok and min(c["save_vs_pinned"], c["load_vs_pinned"]) >= TARGETS["vs_pinned"]
            ok = ok and c["save_vs_per_block"] >= TARGETS["vs_per_block"]
    if "step" in out:
        s = out["step"]
        print(f"step {s['step_s'] * 1e3:.1f} ms alone, {s['step_with_save_s'] * 1e3:.1f} ms beside a "
              f"{s['save_alone_s'] * 1e3:.1f} ms save: overhead {s['overhead']:.1%} "
              f"(submit_save took {s['submit_s'] * 1e3:.2f} ms of the CPU)")
        ok = ok and s["overhead"] <= TARGETS["step_overhead"]
    out["targets"], out["targets_met"] = TARGETS, ok
    if gpu:
        print(f"targets {TARGETS}: {'met' if ok else 'NOT met'}")
    else:
        print(f"bytes {'correct' if ok else 'WRONG'} (the targets {TARGETS} are checked on a GPU only)")
    return ok


def main() -> int:
    gpu = torch.cuda.is_available()
    if not gpu:
        print("no GPU present (torch.cuda.is_available() is False): a tiny dry run of the same paths on the CPU "
              "(CpuMover); the GB/s below are not the GPU's and no results are written")
        torch.set_num_threads(1)  # tiny copies: waking a thread pool costs more than they do
    out = check(GPU_SHAPE if gpu else DRY_SHAPE, GPU_PREFIXES if gpu else DRY_PREFIXES, "cuda" if gpu else "cpu")
    ok = report(out, gpu)
    if gpu:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {RESULTS}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""GPU check of the KV connector's page copies (kvservice/integrations/vllm/connector: pageformat.py, pagecopy.py,
movers.py), per KV layout: NHD (vLLM's CUDA default, LBNHC) and HND (LBHNC), Llama-8B-shaped (32 layers, 8 KV
heads of 128, bf16, block 16), and MLA (DeepSeek-V2-Lite-shaped: 27 layers, one 576-wide latent row per token,
bf16, block 64), each one shared int8 allocation with strided per-layer views as vLLM builds them.

Per layout: a 16k-token prefix (scattered engine blocks, host rows descending as a store that wrapped hands
them out) saved by the CudaMover into page-locked host pages (an mmap, like the store's segment) and loaded
into an engine of the other layout (MLA into MLA); every loaded block checked against the saved one and pages
against the reference conversion. Printed: save and load GB/s against a pinned copy of the same bytes
(device to host, host to device), and what the save costs a decode step: 32 (27) layers of the worker's paged
attention kernel (worker/kernels) over a batch of 32 sequences of 2k tokens living in the same engine's KV,
timed alone and while a save runs. HND and MLA pages move by the copy engines alone (cudadma.py: one
cudaMemcpy2DAsync per block); each such layout runs a second time through the staged path (a gather kernel
into a device buffer, then the transfers: what NHD always takes), to compare. Targets (a GPU only; --strict
fails on them; the staged comparison rows are not held to them): save and load >= 80% of the pinned copy, the
save adds <= 3% to the step. Wrong bytes always exit non-zero.

    PYTHONPATH=. python3 worker/gpu_connector_check.py [--strict] [--json PATH]   # `make gpu-check`
    PYTHONPATH=. python3 worker/gpu_connector_check.py --cpu-smoke                # tiny, on the CPU

Imports torch, triton (the kernel) and those modules only. `--cpu-smoke` (also taken without CUDA) runs every
path at tiny sizes on the CPU (the CpuMover, the kernel under Triton's interpreter): it proves the script
before a GPU is lent; its numbers mean nothing and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from kvservice.integrations.vllm.connector.movers import PageMover, make_mover
from kvservice.integrations.vllm.connector.pageformat import PageFormat
from worker import kernels as K  # sets TRITON_INTERPRET before triton loads when there is no CUDA

RESULTS = Path("bench/results/gpu_connector.json")
TARGETS = {"vs_pinned": 0.80, "step_overhead": 0.03}
LLAMA = dict(layers=32, heads=8, head=128, block=16, mla=False, q_heads=32)
# MLA: K is the 512-wide latent and its 64-wide rope key (576); the decode step attends over the latent (MQA)
MLA = dict(layers=27, heads=1, head=576, block=64, mla=True, q_heads=16, latent=512)
CASES = {"NHD": ("LBNHC", "LBHNC", LLAMA), "HND": ("LBHNC", "LBNHC", LLAMA), "MLA": ("LBNHC", "LBNHC", MLA)}
GPU_SIZES = dict(prefix=16384, batch=32, context=2048, steps=20)
SMOKE_SHAPES = {"NHD": dict(LLAMA, layers=2, heads=2, head=16, q_heads=4),
                "HND": dict(LLAMA, layers=2, heads=2, head=16, q_heads=4),
                "MLA": dict(MLA, layers=2, head=40, block=16, q_heads=2, latent=32)}
SMOKE_SIZES = dict(prefix=128, batch=2, context=48, steps=2)


def engine(layout: str, shape: dict, num_blocks: int, device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One int8 pool and per-layer logical [B, H, N, C] views over it, physical order `layout` (vLLM's)."""
    content = shape["head"] if shape["mla"] else 2 * shape["head"]
    sizes = dict(L=shape["layers"], B=num_blocks, H=shape["heads"], N=shape["block"], C=content)
    raw = torch.empty(math.prod(sizes.values()) * 2, dtype=torch.int8, device=device)
    phys = raw.view(torch.bfloat16).view(*(sizes[d] for d in layout))
    rest = layout.replace("L", "")
    views = {f"model.layers.{i}.self_attn.attn": phys.select(layout.index("L"), i).permute(
        *(rest.index(d) for d in "BHNC")) for i in range(sizes["L"])}
    return raw, views


def host_pages(rows: int, page_bytes: int) -> torch.Tensor:
    """Host pages in a shared mapping, as the store's segment is one."""
    return torch.frombuffer(mmap.mmap(-1, rows * page_bytes), dtype=torch.uint8).view(rows, page_bytes)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_s(fn, device: str, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def run_job(mover: PageMover, kind: str, *args) -> None:
    job = f"{kind}-{time.perf_counter_ns()}"
    (mover.submit_save if kind == "save" else mover.submit_load)(job, *args)
    mover.wait([job])
    done = dict(mover.finished())
    assert done.get(job) is True, f"{kind} job failed: {done}"


def logical_equal(a: dict[str, torch.Tensor], a_ids: list[int], b: dict[str, torch.Tensor], b_ids: list[int]) -> bool:
    ia, ib = (torch.tensor(x, device=next(iter(a.values())).device) for x in (a_ids, b_ids))
    return all(torch.equal(a[n].index_select(0, ia).view(torch.int16), b[n].index_select(0, ib).view(torch.int16))
               for n in a)


@dataclass(slots=True)
class Decode:
    """A decode-like step: every layer's paged attention (worker/kernels) over a batch in the engine's KV."""

    q: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    table: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    context: int

    @classmethod
    def build(cls, views: dict[str, torch.Tensor], shape: dict, blocks: list[int], batch: int, context: int,
              device: str) -> Decode:
        d = shape.get("latent", shape["head"])
        layers = []
        for view in views.values():
            kv = view.permute(0, 2, 1, 3)  # [B, N, H, C]: the kernel's [blocks, block size, KV heads, head]
            layers.append((kv[..., :d], kv[..., :d] if shape["mla"] else kv[..., d:2 * d]))
        per_seq = context // shape["block"]
        table = torch.tensor(blocks[:batch * per_seq], dtype=torch.int32, device=device).view(batch, per_seq)
        q = torch.randn(batch, shape["q_heads"], d, generator=torch.Generator().manual_seed(3))
        q = q.to(device, torch.bfloat16)
        return cls(q, layers, table, torch.arange(batch + 1, dtype=torch.int32, device=device),
                   torch.full((batch,), context, dtype=torch.int32, device=device), context)

    def step(self) -> None:
        scale = 1.0 / math.sqrt(self.q.shape[-1])
        for k, v in self.layers:
            K.paged_attention(self.q, k, v, self.table, self.qsl, self.seq_lens, scale, max_seq_len=self.context)


def step_ms(decode: Decode, device: str, n: int) -> list[float]:
    """Each of `n` back-to-back steps, ms (CUDA events; the CPU's clock in the smoke)."""
    out = []
    for _ in range(n):
        if device != "cuda":
            start = time.perf_counter()
            decode.step()
            out.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        decode.step()
        end.record()
        out.append((start, end))
    if device == "cuda":
        torch.cuda.synchronize()
        out = [s.elapsed_time(e) for s, e in out]
    return out


def save_cost(decode: Decode, mover: PageMover, ids: list[int], host: torch.Tensor, rows: list[int], device: str,
              steps: int, save_s: float) -> dict:
    """The step alone, then while a save runs beside it (as many steps as the save lasts, three times)."""
    for _ in range(2):
        decode.step()  # compiled, warm
    alone = statistics.median(step_ms(decode, device, steps))
    during, submit = [], []
    n = max(2, math.ceil(save_s * 1e3 / alone)) if device == "cuda" else 1
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        mover.submit_save("beside", ids, host, rows)
        submit.append(time.perf_counter() - t0)
        during.append(statistics.median(step_ms(decode, device, n)))
        mover.wait(["beside"])
        assert dict(mover.finished()) == {"beside": True}, "the save beside the steps failed"
    with_save = statistics.median(during)
    return {"step_ms": alone, "step_with_save_ms": with_save, "steps_per_save": n, "overhead": with_save / alone - 1,
            "submit_ms": statistics.median(submit) * 1e3}


def check_layout(name: str, shape: dict, sizes: dict, device: str, direct: bool = True) -> dict:
    src_layout, dst_layout, _ = CASES[name]
    n = sizes["prefix"] // shape["block"]
    decode_blocks = sizes["batch"] * sizes["context"] // shape["block"]
    num_blocks, dst_blocks = n + decode_blocks + 8, n + 8
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    src_raw, src = engine(src_layout, shape, num_blocks, device)
    dst_raw, dst = engine(dst_layout, shape, dst_blocks, device)
    src_raw.random_(-128, 127)
    src_raw.view(torch.bfloat16).nan_to_num_(0.0, 0.0, 0.0).clamp_(-4, 4)  # finite K/V for the kernel
    dst_raw.zero_()
    fmt = PageFormat.build(src, num_blocks=num_blocks, block_size=shape["block"], layout=src_layout)
    dst_fmt = PageFormat.build(dst, num_blocks=dst_blocks, block_size=shape["block"], layout=dst_layout)
    assert fmt.format_id == dst_fmt.format_id, (fmt.format_id, dst_fmt.format_id)
    saver, loader = (make_mover(fmt, direct=direct), make_mover(dst_fmt, direct=direct)) if device == "cuda" else (
        make_mover(fmt), make_mover(dst_fmt))
    how = "direct" if getattr(saver, "_dma", None) is not None else "staged" if device == "cuda" else "cpu"
    host = host_pages(n + 8, fmt.page_bytes)
    pinned = saver.pin(host) and loader.pin(host)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    ids, decode_ids = perm[:n], perm[n:n + decode_blocks]
    dst_ids = torch.randperm(dst_blocks, generator=gen)[:n].tolist()
    rows = list(reversed(range(n)))
    nbytes = n * fmt.page_bytes
    save_s = best_s(lambda: run_job(saver, "save", ids, host, rows), device)
    load_s = best_s(lambda: run_job(loader, "load", host, rows, dst_ids), device)
    correct = logical_equal(src, ids, dst, dst_ids)
    reference = PageFormat.build(src, num_blocks=num_blocks, block_size=shape["block"], layout=src_layout, fast=False)
    for k in (0, n - 1):  # pages against the reference conversion (per layer, in bytes, by index)
        want = torch.empty(1, fmt.page_bytes, dtype=torch.uint8, device=device)
        reference.gather([ids[k]], want)
        correct = correct and torch.equal(host[rows[k]].to(device), want[0])
    staging = torch.empty(n, fmt.page_bytes, dtype=torch.uint8, device=device)
    d2h_s = best_s(lambda: host[:n].copy_(staging, non_blocking=True), device)
    h2d_s = best_s(lambda: staging.copy_(host[:n], non_blocking=True), device)
    staging = None  # its memory back before the decode step
    plain = torch.empty(8, fmt.page_bytes, dtype=torch.uint8)  # not page-locked: the bounce-buffer path
    run_job(saver, "save", ids[:8], plain, [3, 1, 7, 0, 2, 6, 4, 5])
    run_job(loader, "load", plain, [3, 1, 7, 0, 2, 6, 4, 5], dst_ids[:8])
    correct = correct and logical_equal(src, ids, dst, dst_ids)
    decode = Decode.build(src, shape, decode_ids, sizes["batch"], sizes["context"], device)
    out = {"layout": name, "copies": how, "engine": src_layout, "loaded_into": dst_layout, "format_id": fmt.format_id,
           "page_bytes": fmt.page_bytes, "blocks": n, "bytes": nbytes, "host_pinned": pinned, "correct": bool(correct),
           "save_gbs": nbytes / save_s / 1e9, "load_gbs": nbytes / load_s / 1e9,
           "pinned_d2h_gbs": nbytes / d2h_s / 1e9, "pinned_h2d_gbs": nbytes / h2d_s / 1e9,
           "save_vs_pinned": d2h_s / save_s, "load_vs_pinned": h2d_s / load_s}
    try:  # a measurement: a kernel that cannot run here is reported, not taken for wrong bytes
        out["step"] = save_cost(decode, saver, ids, host, rows, device, sizes["steps"], save_s)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        out["step"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    for mover in (saver, loader):
        mover.unpin(host)
        mover.close()
    return out


def report(rows: list[dict], gpu: bool) -> tuple[bool, bool]:
    """(every byte right, every target met)."""
    head = ("layout", "copies", "correct", "save GB/s", "pinned D2H", "save/pin", "load GB/s", "pinned H2D", "load/pin",
            "step ms", "+save ms", "overhead")
    print(" ".join(f"{h:>10}" for h in head))
    right = met = True
    for r in rows:
        if "error" in r:  # the layout's check did not finish
            print(f"{r['layout']:>10} {r['copies']:>10}     FAILED {r['error']}")
            right = False
            continue
        s = r["step"]
        step = ("n/a", "n/a", "n/a") if "error" in s else (
            f"{s['step_ms']:.3f}", f"{s['step_with_save_ms']:.3f}", f"{s['overhead']:+.1%}")
        print(" ".join(f"{v:>10}" for v in (
            r["layout"], r["copies"], str(r["correct"]), f"{r['save_gbs']:.2f}", f"{r['pinned_d2h_gbs']:.2f}",
            f"{r['save_vs_pinned']:.0%}", f"{r['load_gbs']:.2f}", f"{r['pinned_h2d_gbs']:.2f}",
            f"{r['load_vs_pinned']:.0%}", *step)))
        if "error" in s:
            print(f"{'':>10} decode step not measured: {s['error']}")
        right = right and r["correct"]
        if r["copies"] == "staged" and any(o["layout"] == r["layout"] and o["copies"] == "direct" for o in rows):
            continue  # the staged comparison of a layout that copies directly: not what the connector runs
        met = met and "error" not in s and min(r["save_vs_pinned"], r["load_vs_pinned"]) >= TARGETS["vs_pinned"] \
            and s["overhead"] <= TARGETS["step_overhead"]
    if gpu:
        print(f"targets {TARGETS}: {'met' if met else 'NOT met'}")
    print("bytes right in every layout" if right else "bytes WRONG, or a layout's check failed (above)")
    return right, met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (taken without CUDA)")
    parser.add_argument("--layouts", default=",".join(CASES))
    parser.add_argument("--strict", action="store_true", help="also exit non-zero when a target is missed")
    parser.add_argument("--json", type=Path, help=f"results (default on a GPU: {RESULTS})")
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and not args.cpu_smoke
    if not gpu:
        print("CPU smoke: every path at tiny sizes on the CPU (CpuMover; the kernel under Triton's interpreter); "
              "the numbers are not a GPU's and nothing is written unless --json names a file")
    device = "cuda" if gpu else "cpu"
    start = time.perf_counter()
    rows = []
    for name in args.layouts.split(","):
        shape, sizes = (CASES[name][2], GPU_SIZES) if gpu else (SMOKE_SHAPES[name], SMOKE_SIZES)
        for direct in (True, False):
            try:
                rows.append(check_layout(name, shape, sizes, device, direct))
            except Exception as exc:  # noqa: BLE001 - the other layouts still run; the exit status says it
                traceback.print_exc()
                rows.append({"layout": name, "copies": "direct" if direct else "staged", "correct": False,
                             "error": f"{type(exc).__name__}: {exc}"[:300]})
            if device == "cuda":
                torch.cuda.empty_cache()  # the engines of this layout go back before the next one's
            if rows[-1]["copies"] != "direct":
                break  # a layout that copies directly runs the staged path too, to compare
    right, met = report(rows, gpu)
    out = {"device": torch.cuda.get_device_name() if gpu else "cpu (smoke)", "torch": torch.__version__,
           "targets": TARGETS, "targets_met": met, "correct": right, "layouts": rows,
           "seconds": time.perf_counter() - start}
    path = args.json or (RESULTS if gpu else None)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {path}")
    print(f"{time.perf_counter() - start:.1f} s")
    return 0 if right and (met or not args.strict or not gpu) else 1


if __name__ == "__main__":
    sys.exit(main())

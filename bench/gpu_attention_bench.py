"""Paged attention on a GPU: decode, prefill and DCP shapes against the copy ceiling, SDPA and vLLM's kernel.

Run by `make gpu-check` as `PYTHONPATH=. python3 bench/gpu_attention_bench.py` with the machine's own python:
imports torch, triton and the worker kernels only (vLLM's `unified_attention` is loaded from its source
tree with `--vllm-src DIR`, by `bench/vllm_unified_attention.py`; without it that column is "—").

Per row: our kernel timed by `triton.testing.do_bench` (eager: launcher and launches included, L2 flushed
between runs) and by `do_bench_cudagraph` (replayed in a CUDA graph, as a serving engine's decode runs; L2
warm, which flatters a row whose K/V fits in L2); medians. The K/V bytes a rank must read give GB/s and its
share of the device-to-device copy ceiling (bytes read + written per second) measured in the same run.
SDPA on dense K/V is a bound, not a paged kernel. Without CUDA (or with --dry-run) tiny shapes run, under
the Triton interpreter to prove the script works (fp16, and forced to split the keys in 2 segments); a dry
run writes nothing unless --json / --png name a file.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# Sets TRITON_INTERPRET without CUDA, which must come before triton is imported (its own tl.sum & co. are
# defined at import): triton is imported in the functions below, never at the top of this file.
from worker import kernels as K
from worker.kernels import reference as ref
from worker.kernels.dcp import dcp_local_seq_lens

paged_attention_module = importlib.import_module("worker.kernels.paged_attention")
RESULTS = Path(__file__).resolve().parent / "results"
L2_BYTES = 50 * 2**20  # H100/H200; rows whose K/V fit are marked "L2" in the graph column

# (batch, new tokens per sequence, context before them, DCP world size)
FULL = {
    "heads": (32, 8), "head_size": 128, "block_size": 16, "dtype": torch.bfloat16,
    "decode": [(1, 4096), (1, 32768), (4, 16384), (8, 8192), (32, 4096), (64, 4096), (128, 4096), (256, 2048),
               (64, 16384)],
    "prefill": [(4, 2048, 0), (4, 2048, 8192), (1, 8192, 0)],
    "dcp": [(1, 32768), (64, 4096)], "worlds": (2, 4),
}
# The interpreter's bf16 tl.dot is wrong (ours upcasts; vLLM's kernel does not), so the dry run uses fp16.
DRY = {
    "heads": (4, 2), "head_size": 64, "block_size": 16, "dtype": torch.float16,
    "decode": [(1, 96), (3, 80)], "prefill": [(1, 24, 40)], "dcp": [(1, 96)], "worlds": (2,),
}
TUNE_PREFILL = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2)]
TUNE_SEGMENTS = [1, 2, 4, 8, 16, 32]


def make_case(batch: int, query_len: int, context: int, world: int, cfg: dict, device: str) -> dict:
    """Rank 0's paged cache of `batch` sequences of `context + query_len` tokens (random K/V, shuffled blocks)."""
    num_q_heads, num_kv_heads = cfg["heads"]
    head_size, block_size, dtype = cfg["head_size"], cfg["block_size"], cfg["dtype"]
    seq_len = context + query_len
    per_seq = math.ceil(seq_len / (block_size * world))
    num_blocks = batch * per_seq
    gen = torch.Generator(device=device).manual_seed(batch * 131 + seq_len + world)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    local = int(dcp_local_seq_lens(seq_len, world, 1, 0))
    return dict(
        q=randn(batch * query_len, num_q_heads, head_size),
        key_cache=randn(num_blocks, block_size, num_kv_heads, head_size),
        value_cache=randn(num_blocks, block_size, num_kv_heads, head_size),
        block_table=torch.randperm(num_blocks, generator=gen, device=device).view(batch, per_seq).int(),
        query_start_loc=torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        local_lens=torch.full((batch,), local, dtype=torch.int32, device=device),
        batch=batch, query_len=query_len, context=context, world=world, seq_len=seq_len, local=local,
        scale=1.0 / math.sqrt(head_size),
    )


def dense_kv(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's keys of every sequence gathered densely: `[B, Hkv, L, D]` each."""
    idx = torch.arange(case["local"], device=case["q"].device)
    blocks = case["block_table"][:, idx // case["key_cache"].shape[1]].long()
    offsets = idx % case["key_cache"].shape[1]
    return tuple(c[blocks, offsets].transpose(1, 2).contiguous() for c in (case["key_cache"], case["value_cache"]))


def sdpa_fn(case: dict) -> Callable[[], torch.Tensor]:
    """SDPA over dense K/V, causal aligned to the sequence's end (a DCP rank: decode over its local keys)."""
    k, v = dense_kv(case)
    batch, n = case["batch"], case["query_len"]
    q = case["q"].view(batch, n, -1, k.shape[-1]).transpose(1, 2)
    kwargs: dict = {"scale": case["scale"]}
    if n > 1 and case["context"] == 0:
        kwargs["is_causal"] = True
    elif n > 1:
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(n, k.shape[2])
    try:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    except (TypeError, RuntimeError):  # torch without enable_gqa
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)


def ours_fn(case: dict) -> Callable[[], torch.Tensor]:
    args = (case["q"], case["key_cache"], case["value_cache"], case["block_table"], case["query_start_loc"],
            case["seq_lens"], case["scale"])
    kwargs = dict(max_seq_len=case["seq_len"])
    if case["world"] > 1:
        kwargs.update(dcp_world_size=case["world"], dcp_rank=0, return_lse=True)
    return lambda: K.paged_attention(*args, **kwargs)


def vllm_fn(case: dict, call) -> Callable[[], torch.Tensor]:
    """vLLM on the same cache; for a DCP row, plain attention over rank 0's local keys (no LSE out)."""
    return lambda: call(case["q"], case["key_cache"], case["value_cache"], case["block_table"],
                        case["query_start_loc"], case["local_lens"], case["scale"], case["query_len"], case["local"])


def time_ms(fn: Callable[[], object], device: str, graph: bool = False) -> float:
    """Median ms: do_bench (eager) or do_bench_cudagraph on a GPU; on the CPU (the interpreter, where times
    mean nothing and a call takes ~0.1-1 s) the wall clock of 2 calls."""
    if device == "cpu":
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    import triton.testing

    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        except Exception as exc:  # a call that cannot be captured: say so, time it eagerly
            print(f"  CUDA graph capture failed ({type(exc).__name__}: {exc}); timing eagerly")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_ceiling_gbps(dry: bool, device: str) -> float:
    """Device-to-device copy of 1 GiB (4 MiB on the dry run): bytes read + written per second."""
    src = torch.empty(2**30 if not dry else 2**22, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src), device) / 1e6


def segments_for(case: dict, cfg: dict) -> int:
    """The number of key segments our launcher picks for this row."""
    plan = paged_attention_module.launch_plan(
        case["q"], cfg["heads"][1], case["batch"], max_seq_len=case["seq_len"], dcp_world_size=case["world"]
    )
    return plan.num_segments


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> str:
    err = (got.float() - want.float()).abs().max().item()
    if not err <= 3e-2:  # bf16 tolerance; NaN fails too
        print(f"  WARNING {what}: max abs difference {err:.3g}")
        return f"{what} differs by {err:.3g}"
    return ""


def run_row(kind: str, case: dict, cfg: dict, vllm_call, ceiling: float) -> dict:
    device = case["q"].device.type
    num_q_heads, num_kv_heads = cfg["heads"]
    d, elt = cfg["head_size"], case["key_cache"].element_size()
    kv_bytes = 2 * case["batch"] * case["local"] * num_kv_heads * d * elt
    ours, sdpa = ours_fn(case), sdpa_fn(case)
    out = ours()
    out = out[0] if isinstance(out, tuple) else out
    b, n = case["batch"], case["query_len"]
    dense = sdpa().transpose(1, 2).reshape(b * n, num_q_heads, d)
    notes = [check(out, dense, "ours vs SDPA")]
    row = dict(kind=kind, batch=b, query_len=n, context=case["context"], world=case["world"],
               kv_mb=kv_bytes / 2**20, segments=segments_for(case, cfg))
    row["ours_ms"] = time_ms(ours, device)
    row["ours_graph_ms"] = time_ms(ours, device, graph=True)
    row["sdpa_ms"] = time_ms(sdpa, device, graph=True)
    row["l2_resident"] = kv_bytes < L2_BYTES
    row["gbps"] = kv_bytes / row["ours_graph_ms"] / 1e6
    row["pct_copy"] = 100 * row["gbps"] / ceiling
    if kind == "prefill":
        keys = b * (n * case["context"] + n * (n + 1) // 2)
        row["tflops"] = 4 * num_q_heads * d * keys / row["ours_graph_ms"] / 1e9
    row["vllm_ms"] = row["vllm_graph_ms"] = None
    if vllm_call is not None:
        fn = vllm_fn(case, vllm_call)
        try:
            if case["world"] == 1:
                notes.append(check(fn(), out, "vLLM vs ours"))
            row["vllm_ms"] = time_ms(fn, device)
            row["vllm_graph_ms"] = time_ms(fn, device, graph=True)
        except Exception as exc:  # optional column (another triton than vLLM's, ...): say why it is empty
            print(f"  vLLM failed: {type(exc).__name__}: {exc}")
            notes.append(f"vLLM failed: {type(exc).__name__}")
    row["notes"] = "; ".join(x for x in notes if x)
    return row


def tune(cfg: dict) -> None:
    """Time the prefill tile candidates and the decode segment counts; print the best of each."""
    device = "cuda"
    for b, n, ctx in cfg["prefill"]:
        case = make_case(b, n, ctx, 1, cfg, device)
        times = {}
        for tiles in TUNE_PREFILL:
            paged_attention_module.TILE_OVERRIDE = tiles
            try:
                times[tiles] = time_ms(ours_fn(case), device, graph=True)
            except Exception as exc:  # a configuration this GPU cannot run (shared memory)
                print(f"  prefill {b}x{n} ctx {ctx} {tiles}: {type(exc).__name__}")
        paged_attention_module.TILE_OVERRIDE = None
        best = min(times, key=times.get)
        print(f"tune prefill {b}x{n} ctx {ctx}: " + ", ".join(f"{t}={ms:.3f}" for t, ms in times.items())
              + f" -> best {best}")
    for b, ctx in cfg["decode"]:
        case = make_case(b, 1, ctx, 1, cfg, device)
        chosen = segments_for(case, cfg)
        times = {}
        for segments in TUNE_SEGMENTS:
            paged_attention_module.NUM_SEGMENTS_OVERRIDE = segments
            times[segments] = time_ms(ours_fn(case), device, graph=True)
        paged_attention_module.NUM_SEGMENTS_OVERRIDE = None
        print(f"tune decode {b}x{ctx}: " + ", ".join(f"S{s}={ms:.4f}" for s, ms in times.items())
              + f" -> best S{min(times, key=times.get)}, heuristic S{chosen}")
        del case
        torch.cuda.empty_cache()


def row_name(kind: str, batch: int, query_len: int, context: int, world: int) -> str:
    return {"decode": f"decode {batch}x{context}", "prefill": f"prefill {batch}x{query_len} ctx {context}",
            "dcp": f"dcp W={world} {batch}x{context}"}[kind]


def fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def print_table(rows: list[dict], ceiling: float) -> None:
    print(f"\ncopy ceiling: {ceiling:.0f} GB/s (read + write)")
    head = (f"{'row':<26}{'KV MB':>9}{'S':>4}{'ours ms':>10}{'graph ms':>10}{'GB/s':>8}{'%copy':>7}{'TFLOP/s':>9}"
            f"{'SDPA ms':>10}{'vLLM ms':>10}{'vLLM gr':>10}{'ours/vLLM':>10}")
    print(head)
    by_key = {(r["kind"], r["batch"], r["context"], r["world"]): r for r in rows}
    for r in rows:
        name = row_name(r["kind"], r["batch"], r["query_len"], r["context"], r["world"])
        ratio = None if r["vllm_graph_ms"] is None else r["ours_graph_ms"] / r["vllm_graph_ms"]
        graph = fmt(r["ours_graph_ms"], ".4f") + ("*" if r["l2_resident"] else "")
        print(f"{name:<26}{r['kv_mb']:>9.1f}{r['segments']:>4}{r['ours_ms']:>10.4f}{graph:>10}{r['gbps']:>8.0f}"
              f"{r['pct_copy']:>6.0f}%{fmt(r.get('tflops'), '.1f'):>9}{r['sdpa_ms']:>10.4f}"
              f"{fmt(r['vllm_ms'], '.4f'):>10}{fmt(r['vllm_graph_ms'], '.4f'):>10}{fmt(ratio, '.2f'):>10}"
              f"  {r['notes']}")
        if r["kind"] == "dcp":
            full = by_key.get(("decode", r["batch"], r["context"], 1))
            if full is not None:
                r["vs_w1"] = r["ours_graph_ms"] / full["ours_graph_ms"]
                print(f"{'':<26}per-rank time / W=1 time = {r['vs_w1']:.2f} (target <= {1.2 / r['world']:.2f})")
    print("* K/V fits in L2: the graph time (no flush between replays) flatters this row")


def plot(rows: list[dict], cfg: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    decode = sorted((r for r in rows if r["kind"] == "decode"), key=lambda r: (r["batch"], r["context"]))
    fig, ax = plt.subplots(figsize=(9, 5))
    x = range(len(decode))
    for key, label in [("ours_graph_ms", "ours (paged, split-KV)"), ("vllm_graph_ms", "vLLM unified_attention"),
                       ("sdpa_ms", "SDPA, dense K/V (bound)")]:
        ys = [r[key] for r in decode]
        if any(y is not None for y in ys):
            ax.plot(x, [float("nan") if y is None else y for y in ys], marker="o", label=label)
    ax.set_xticks(list(x), [f"{r['batch']}x{r['context']}" for r in decode], rotation=30)
    ax.set(xlabel="decode batch x context", ylabel="ms (CUDA graph, median)", yscale="log",
           title=f"paged decode attention, {str(cfg['dtype']).removeprefix('torch.')}, "
                 f"{cfg['heads'][0]}/{cfg['heads'][1]} heads, D {cfg['head_size']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> int:
    import triton

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes (under the interpreter: automatic without CUDA)")
    parser.add_argument("--vllm-src", type=Path, help="vLLM 0.33.0's Python tree (the directory holding vllm/)")
    parser.add_argument("--json", type=Path, help="JSON output (default on a GPU: bench/results/gpu_attention.json)")
    parser.add_argument("--png", type=Path, help="PNG output (default on a GPU: bench/results/gpu_attention.png)")
    parser.add_argument("--tune", action="store_true", help="also time prefill tiles and decode segment counts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        args.dry_run = True
        print("no CUDA: dry run of tiny shapes under the Triton interpreter")
    dry = args.dry_run
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = DRY if dry else FULL
    print(f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}, "
          f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}")

    vllm_call = None
    if args.vllm_src is not None:
        try:
            from bench.vllm_unified_attention import TritonAttentionCall, load_unified_attention

            vllm_call = TritonAttentionCall(load_unified_attention(args.vllm_src), *cfg["heads"], cfg["head_size"],
                                            torch.device(device))
        except Exception as exc:  # optional column: say why it is empty
            print(f"vLLM column off: {type(exc).__name__}: {exc}")
    else:
        print("vLLM column off: no --vllm-src")

    ceiling = copy_ceiling_gbps(dry, device)
    if device == "cpu":  # the split path under the interpreter, which never splits by itself
        paged_attention_module.NUM_SEGMENTS_OVERRIDE = 2
    rows = []
    shapes = ([("decode", b, 1, ctx, 1) for b, ctx in cfg["decode"]]
              + [("prefill", b, n, ctx, 1) for b, n, ctx in cfg["prefill"]]
              + [("dcp", b, 1, ctx, w) for b, ctx in cfg["dcp"] for w in cfg["worlds"]])
    for kind, b, n, ctx, world in shapes:
        case = make_case(b, n, ctx, world, cfg, device)
        if kind == "dcp":  # the kernel's own rank 0 against the torch twin
            out, lse = ours_fn(case)()
            twin_out, twin_lse = ref.paged_attention(
                case["q"], case["key_cache"], case["value_cache"], case["block_table"], case["query_start_loc"],
                case["seq_lens"], case["scale"], return_lse=True, dcp_world_size=world, dcp_rank=0)
            assert (out.float() - twin_out.float()).abs().max() <= 3e-2 and (lse - twin_lse).abs().max() <= 1e-2
        rows.append(run_row(kind, case, cfg, vllm_call, ceiling))
        print(f"  {row_name(kind, b, n, ctx, world)}: ours {rows[-1]['ours_graph_ms']:.4f} ms", flush=True)
        del case
        if device == "cuda":
            torch.cuda.empty_cache()
    paged_attention_module.NUM_SEGMENTS_OVERRIDE = None
    print_table(rows, ceiling)
    if args.tune and device == "cuda":
        tune(cfg)

    json_path = args.json or (None if dry else RESULTS / "gpu_attention.json")
    png_path = args.png or (None if dry else RESULTS / "gpu_attention.png")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                    torch=torch.__version__, triton=triton.__version__, dry_run=dry, copy_ceiling_gbps=ceiling,
                    dtype=str(cfg["dtype"]), heads=cfg["heads"], head_size=cfg["head_size"],
                    block_size=cfg["block_size"], vllm=vllm_call is not None)
        json_path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        print(f"wrote {json_path}")
    if png_path is not None:
        plot(rows, cfg, png_path)
    if device == "cpu":
        print("dry run passed (interpreter: correctness and plumbing only, the times mean nothing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

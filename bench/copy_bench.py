"""The connector's page copies on the CPU, per KV layout family, next to torch `copy_` and a plain memcpy of the
same bytes: save (engine KV -> pages) and load (pages -> engine KV) GB/s of `PageFormat` (pageformat.py,
pagecopy.py: the compiled copies of kvservice/native where `make native` built them), of its torch runs (plain
strided `copy_`s per run and piece: KVSERVICE_NATIVE=0's path, what CPU engines ran before), of its index path
(one index_select / index_copy_ per piece: what a GPU runs), of torch `copy_` of the same bytes (contiguous,
torch's threads) and of one libc memcpy (one thread), side by side in one run.

Families (the engine's views built by vLLM's own `create_kv_cache_views` when vLLM is importable, else by hand,
identically: tests/page_format_helpers.py):
- `cpu-fp32`, `cpu-bf16`: vLLM's CPU attention (LBHNC, K transposed within a block: a true transpose per copy),
  bench/connector_bench.py's model (8 layers, 8 KV heads of 64, block 32);
- `NHD-bf16`, `HND-bf16`: CUDA's LBNHC and LBHNC on CPU tensors, Llama-8B-shaped (32 layers, 8 KV heads of
  128, block 16);
- `MLA-bf16`: DeepSeek-V2-Lite-shaped (27 layers, one 576-wide latent row per token, block 64).

Block ids per case: `consecutive` (engine blocks and page rows ascending: a fresh engine and store) and
`scattered` (engine blocks shuffled, page rows descending: what a store that wrapped hands out). Every copy is
checked against the reference conversion before it is timed.

    PYTHONPATH=. .venv/bin/python bench/copy_bench.py [--mib 128] [--reps 5] [--families cpu-fp32,...]
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=.:$HOME/.cache/kvservice/vllm-0.33.0/src \\
        $HOME/.cache/kvservice/vllm-0.33.0/venv/bin/python bench/copy_bench.py   # views by vLLM's builder
Writes bench/results/copy.json and copy.png (--out elsewhere).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

OUT = REPO / "bench" / "results" / "copy.json"
# name: (layout, layers, heads, block size, head size (K; V the same), dtype, MLA, CPU attention)
FAMILIES = {
    "cpu-fp32": ("LBHNC", 8, 8, 32, 64, torch.float32, False, True),
    "cpu-bf16": ("LBHNC", 8, 8, 32, 64, torch.bfloat16, False, True),
    "NHD-bf16": ("LBNHC", 32, 8, 16, 128, torch.bfloat16, False, False),
    "HND-bf16": ("LBHNC", 32, 8, 16, 128, torch.bfloat16, False, False),
    "MLA-bf16": ("LBNHC", 27, 1, 64, 576, torch.bfloat16, True, False),
}


def engine(family: str, num_blocks: int):
    """The engine's KV views (vLLM's builder when it is importable) and how they were built."""
    from tests import page_format_helpers as h
    layout, layers, heads, bs, head, dtype, mla, _ = FAMILIES[family]
    content = head if mla else 2 * head
    try:
        return h.by_vllm(layout, layers, num_blocks, heads, bs, head, dtype, mla=mla), "vLLM create_kv_cache_views"
    except ImportError:
        return h.by_hand(layout, layers, num_blocks, heads, bs, content, dtype), "by hand (vLLM not importable)"


def page_format(family: str, e, index: bool = False, torch_runs: bool = False):
    """The connector's page format: its default path (compiled where kvservice/native is built), or the torch
    runs (`torch_runs`: KVSERVICE_NATIVE=0's path), or the index path (`index`), for comparison."""
    head, cpu = FAMILIES[family][4], FAMILIES[family][7]
    fmt = e.format(cpu_isa="vec", head_size=head) if cpu else e.format()
    fmt._copier.by_runs = fmt._copier.by_runs and not index  # noqa: SLF001 - the other paths, for comparison
    if index or torch_runs:
        fmt._copier._native = None  # noqa: SLF001
    return fmt


def timed(variants: dict, reps: int) -> dict[str, list[float]]:
    """Seconds of each variant per round; every round times each variant once, in turn (so a load that comes
    and goes on the machine lands on all of them alike)."""
    for fn in variants.values():
        fn()  # warm: first touch of every byte, views and word sizes cached
    out: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for k, fn in variants.items():
            start = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - start)
    return out


def case(family: str, mib: int, reps: int, ids_kind: str) -> dict:
    probe, built = engine(family, 2)
    page = page_format(family, probe).page_bytes
    n = max(2, (mib << 20) // page)
    e, _ = engine(family, 2 * n)
    e.raw.copy_(torch.randint(-128, 128, e.raw.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(1)))
    fmt, index_fmt = page_format(family, e), page_format(family, e, index=True)
    runs_fmt = page_format(family, e, torch_runs=True)
    if ids_kind == "consecutive":
        ids, rows = list(range(n)), list(range(n))
    else:
        ids = torch.randperm(2 * n, generator=torch.Generator().manual_seed(2))[:n].tolist()
        rows = list(reversed(range(n)))
    pages = torch.zeros(n, page, dtype=torch.uint8)
    # The reference (the per-element path: one copy per layer, in bytes, by index) before anything is timed.
    head, cpu = FAMILIES[family][4], FAMILIES[family][7]
    ref = e.format(cpu_isa="vec", head_size=head, fast=False) if cpu else e.format(fast=False)
    want = torch.zeros_like(pages)
    ref.gather(ids, want, rows)
    fmt.gather(ids, pages, rows)
    assert torch.equal(pages, want), f"{family}: the copy's pages differ from the reference's"
    pages.zero_()
    runs_fmt.gather(ids, pages, rows)
    assert torch.equal(pages, want), f"{family}: the torch runs' pages differ from the reference's"
    before = e.raw.clone()
    fmt.scatter(pages, ids, rows)
    assert torch.equal(e.raw, before), f"{family}: loading the pages it saved changed the engine's KV"
    nbytes = n * page
    src, dst = torch.randint(0, 256, (nbytes,), dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    t = timed({"save": lambda: fmt.gather(ids, pages, rows), "load": lambda: fmt.scatter(pages, ids, rows),
               "runs_save": lambda: runs_fmt.gather(ids, pages, rows),
               "runs_load": lambda: runs_fmt.scatter(pages, ids, rows),
               "index_save": lambda: index_fmt.gather(ids, pages, rows),
               "index_load": lambda: index_fmt.scatter(pages, ids, rows), "torch_copy": lambda: dst.copy_(src),
               "memcpy": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)}, reps)
    out = {"family": family, "ids": ids_kind, "views": built, "format": fmt.format_id, "native": fmt._copier.native,
           "page_bytes": page, "pages": n,
           "bytes": nbytes, "reps": reps, "load_average": os.getloadavg()[0]}
    out.update({f"{k}_GBps": nbytes / statistics.median(v) / 1e9 for k, v in t.items()})
    for k in ("save", "load", "runs_save", "runs_load"):  # paired: each round's copy against that round's torch copy_
        out[f"{k}_vs_torch_copy"] = statistics.median(c / s for c, s in zip(t["torch_copy"], t[k]))
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in results["cases"] if r["ids"] == "scattered"]
    keys = [("save_GBps", "connector save"), ("load_GBps", "connector load"), ("index_save_GBps", "index path save"),
            ("index_load_GBps", "index path load"), ("torch_copy_GBps", "torch copy_"), ("memcpy_GBps", "memcpy")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(keys)
    for k, (key, label) in enumerate(keys):
        ax.bar([i + k * width for i in range(len(rows))], [r[key] for r in rows], width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [r["family"] for r in rows])
    ax.set_ylabel("GB/s")
    ax.set_title(f"page copies on the CPU ({results['threads']} torch threads; scattered ids)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--mib", type=int, default=128, help="pages per case, in MiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--plot", metavar="JSON", help="only draw the PNG beside this JSON (needs matplotlib)")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"threads": torch.get_num_threads(), "torch": torch.__version__, "cases": []}
    print(f"{'family':10} {'ids':12} {'save':>6} {'load':>6} {'run sv':>6} {'run ld':>6} {'idx sv':>6} {'idx ld':>6}"
          f" {'copy_':>6} {'memcpy':>6}"
          f" {'save/copy_':>10} {'load/copy_':>10}   GB/s, {results['threads']} torch threads")
    for family in args.families.split(","):
        for ids_kind in ("consecutive", "scattered"):
            r = case(family, args.mib, args.reps, ids_kind)
            results["cases"].append(r)
            print(f"{family:10} {ids_kind:12} {r['save_GBps']:6.2f} {r['load_GBps']:6.2f} {r['runs_save_GBps']:6.2f} "
                  f"{r['runs_load_GBps']:6.2f} {r['index_save_GBps']:6.2f} "
                  f"{r['index_load_GBps']:6.2f} {r['torch_copy_GBps']:6.2f} {r['memcpy_GBps']:6.2f} "
                  f"{r['save_vs_torch_copy']:10.2f} {r['load_vs_torch_copy']:10.2f}", flush=True)
    results["views"] = results["cases"][0]["views"]
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    try:
        plot(results, path.with_suffix(".png"))
    except ImportError:
        print(f"no matplotlib here: draw the PNG with the project's .venv: bench/copy_bench.py --plot {path}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

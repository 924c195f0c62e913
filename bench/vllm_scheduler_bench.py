"""vLLM 0.33.0's scheduler, stock vs kvservice-backed: step time in steady decode at 16, 64 and 256 running
requests, Step RPCs per scheduler step, and one bare gRPC round trip of the same bytes.

Both schedulers run vLLM's default configuration (async scheduling, the full-sequence gate) through the
same requests (a shared 32-token prefix plus 16 tokens of their own, long outputs) and fake outputs
(tests/vllm/scheduler_harness.py). Once every request decodes, each step is timed: schedule() (for the
kvservice side this includes its one Step RPC) and update_from_output(). The echo (bench/echo_server.py)
sends and returns as many bytes as each step's Step request and reply. Target (issue 15): at most one Step
per step in steady decode, step time <= stock + 1.5 x the echo.

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

from bench.common import median, table, write_json  # noqa: E402
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

    def bytes(self) -> list[tuple[int, int]]:
        return [(encode.step_request(p, ops).ByteSize(), replies.encode_step_result(r, pb.StepResponse()).ByteSize())
                for p, ops, r in self.calls]


def run_side(cls, config, num_requests: int, steps: int, warmup: int) -> dict:
    rng = random.Random(num_requests)
    prefix = [rng.randrange(3, h.VOCAB) for _ in range(32)]
    workload = h.Workload(seed=num_requests, num_blocks=num_requests * 12 + 64, max_num_batched_tokens=8192,
                          max_num_seqs=max(num_requests, 16), watermark=0.0, num_steps=warmup + steps)
    sc = config.scheduler_config
    sc.max_num_batched_tokens, sc.max_num_seqs, sc.watermark = 8192, workload.max_num_seqs, 0.0
    config.cache_config.num_gpu_blocks = workload.num_blocks
    side = h.Side(cls, config, workload)
    for i in range(num_requests):
        side.add(f"r{i}", prefix + [rng.randrange(3, h.VOCAB) for _ in range(16)], 10_000)
    manager = side.scheduler.kv_cache_manager
    sizes = Sizes(manager.client) if hasattr(manager, "client") else None
    schedule_s, update_s, rpcs = [], [], []
    gc.disable()
    try:
        for step in range(warmup + steps):
            before = getattr(manager, "num_rpcs", 0)
            t0 = time.perf_counter()
            summary = side.schedule()
            t1 = time.perf_counter()
            if len(side.pending) >= 2:
                side.update()
            t2 = time.perf_counter()
            if step >= warmup:
                assert len(summary[0]) == num_requests, "not every request decodes: raise warmup"
                schedule_s.append(t1 - t0)
                update_s.append(t2 - t1)
                rpcs.append(getattr(manager, "num_rpcs", 0) - before)
    finally:
        gc.enable()
        side.scheduler.shutdown()
    out = {"schedule_s": schedule_s, "update_s": update_s, "rpcs": rpcs}
    if sizes is not None:
        out["bytes"] = sizes.bytes()[-steps:]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=6)
    args = parser.parse_args()
    server, target = start([sys.executable, "-m", "kvservice.cli", "--log-level", "ERROR", "serve", "--port", "0",
                            "--no-persistence"], "kvservice serving on")
    echo_server, echo_target = start([sys.executable, str(Path(__file__).with_name("echo_server.py"))],
                                     "echo serving on")
    model = h.write_model_dir(Path(tempfile.mkdtemp()) / "model")
    rows, data = [], {"sizes": {}}
    try:
        echo = Echo(echo_target)
        for n in SIZES:
            config = h.make_vllm_config(model, h.DEFAULT)
            config.additional_config = {"kvservice": {"address": target, "pool_id": f"bench-{n}"}}
            stock = run_side(h.StockAsyncScheduler, config, n, args.steps, args.warmup)
            remote = run_side(h.AsyncScheduler, config, n, args.steps, args.warmup)
            for sizes in remote["bytes"][:5]:
                echo(sizes)  # warm the channel
            echo_s = [echo(sizes) for sizes in remote["bytes"]]
            stock_step = median([a + b for a, b in zip(stock["schedule_s"], stock["update_s"])])
            remote_step = median([a + b for a, b in zip(remote["schedule_s"], remote["update_s"])])
            e = median(echo_s)
            req_bytes = median([s for s, _ in remote["bytes"]])
            resp_bytes = median([r for _, r in remote["bytes"]])
            row = {"running": n, "stock_step_ms": stock_step * 1e3, "kvservice_step_ms": remote_step * 1e3,
                   "stock_schedule_ms": median(stock["schedule_s"]) * 1e3,
                   "kvservice_schedule_ms": median(remote["schedule_s"]) * 1e3,
                   "echo_ms": e * 1e3, "step_request_bytes": req_bytes, "step_reply_bytes": resp_bytes,
                   "rpcs_per_step_max": max(remote["rpcs"]), "rpcs_per_step_mean": sum(remote["rpcs"]) / args.steps,
                   "target_ms": (stock_step + 1.5 * e) * 1e3, "meets_target": remote_step <= stock_step + 1.5 * e,
                   "overhead_over_echo": (remote_step - stock_step) / e}
            data["sizes"][str(n)] = row
            rows.append([n, f"{row['stock_step_ms']:.2f}", f"{row['kvservice_step_ms']:.2f}", f"{row['echo_ms']:.2f}",
                         f"{row['overhead_over_echo']:.2f}", f"{row['target_ms']:.2f}", row["meets_target"],
                         f"{row['rpcs_per_step_mean']:.2f}", int(req_bytes), int(resp_bytes)])
    finally:
        server.kill()
        echo_server.kill()
    print(table(["running", "stock ms", "kvservice ms", "echo ms", "(kv-stock)/echo", "target ms", "meets",
                 "RPCs/step", "req B", "reply B"], rows))
    print(f"wrote {write_json('vllm_scheduler', {'steps': args.steps, **data})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

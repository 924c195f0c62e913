"""Step RPC latency against a real server process, side by side with the in-process core and a bare
gRPC echo of the same message sizes (all in one run).

    python bench/rpc_bench.py [--steps 200]

Workloads: (decode) one Step carrying 256 running requests, each appending one token (about 1 in 16
needs a new block); (admission) one Step adding 32 new 1,024-token prompts whose first half is a
shared prefix. Target: Step p50 <= echo p50 + 1.2 x in-process p50; >= 50k block allocations/s.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # we spawn processes after using gRPC

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.common import bar_plot, median, percentile, table, write_json  # noqa: E402
from kvservice._proto import allocator_pb2 as pb  # noqa: E402
from kvservice.client import KVServiceClient  # noqa: E402
from kvservice.core import FullAttentionSpec, KVCacheConfig, KVCacheManager, Request  # noqa: E402
from kvservice.ops import AddRequestOp, AllocateOp, DecodeBatchOp  # noqa: E402

BS = 16
DECODE_REQS = 256
ADMIT_REQS, ADMIT_LEN = 32, 1024
NUM_BLOCKS = 40_000
MAX_LEN = 8192


def start(cmd: list[str], marker: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{cmd} exited")
        if line.startswith(marker):
            return proc, line.split()[-1]


class Progress:
    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.last = label, total, 0.0

    def __call__(self, i: int) -> None:
        now = time.monotonic()
        if now - self.last > 2 or i == self.total:
            print(f"  {self.label}: {i}/{self.total}", flush=True)
            self.last = now


def decode_prompts(rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(32000) for _ in range(rng.randint(100, 900))] for _ in range(DECODE_REQS)]


def admit_prompts(rng: random.Random, prefix: list[int], round_: int) -> list[list[int]]:
    half = ADMIT_LEN // 2
    return [prefix + [rng.randrange(32000) for _ in range(half)] for _ in range(ADMIT_REQS)]


# ---- in-process core: the same ops ---------------------------------------------------------------
def inprocess_decode(prompts, steps: int, rng) -> list[float]:
    m = KVCacheManager(KVCacheConfig(NUM_BLOCKS, [FullAttentionSpec(BS)]), MAX_LEN, enable_events=True)
    reqs = []
    for i, p in enumerate(prompts):
        r = Request(f"d{i}", p, BS)
        m.allocate_slots(r, len(p))
        r.num_computed_tokens = len(p)
        reqs.append(r)
    times = []
    for _ in range(steps):
        tokens = [rng.randrange(32000) for _ in reqs]
        t0 = time.perf_counter()
        for r, t in zip(reqs, tokens):
            r.append_output_token_ids([t])
            m.allocate_slots(r, 1)
            r.num_computed_tokens += 1
        m.take_block_copies()
        m.take_events()
        times.append(time.perf_counter() - t0)
    return times


def inprocess_admit(prefix, steps: int, rng) -> tuple[list[float], int]:
    m = KVCacheManager(KVCacheConfig(NUM_BLOCKS, [FullAttentionSpec(BS)]), MAX_LEN, enable_events=True)
    times, blocks = [], 0
    for s in range(steps):
        prompts = admit_prompts(rng, prefix, s)
        t0 = time.perf_counter()
        reqs = []
        for i, p in enumerate(prompts):
            r = Request(f"a{s}-{i}", p, BS)
            hits, n = m.get_computed_blocks(r)
            new = m.allocate_slots(r, len(p) - n, n, hits)
            blocks += len(new.blocks[0])
            reqs.append(r)
        m.take_events()
        times.append(time.perf_counter() - t0)
        for r in reqs:
            m.free(r)
        m.take_events()
    return times, blocks


# ---- over gRPC -----------------------------------------------------------------------------------
def rpc_decode(client: KVServiceClient, prompts, steps: int, rng, packed: bool) -> tuple[list[float], int, int]:
    pid = "decode-packed" if packed else "decode-ops"
    client.register_pool(pid, KVCacheConfig(NUM_BLOCKS, [FullAttentionSpec(BS)]), MAX_LEN)
    ops = []
    for i, p in enumerate(prompts):
        ops += [AddRequestOp(f"d{i}", token_ids=p), AllocateOp(f"d{i}", num_new_tokens=len(p))]
    client.step(pid, ops)
    computed = [len(p) for p in prompts]
    times, req_bytes, resp_bytes = [], 0, 0
    progress = Progress(f"decode steps over gRPC ({'packed' if packed else 'one op per request'})", steps)
    for s in range(steps):
        tokens = [rng.randrange(32000) for _ in prompts]
        if packed:
            ops = [DecodeBatchOp([f"d{i}" for i in range(len(prompts))], computed, tokens)]
        else:
            ops = [AllocateOp(f"d{i}", num_computed_tokens=computed[i], num_new_tokens=1, append_token_ids=[tokens[i]])
                   for i in range(len(prompts))]
        msg = client.step_msg(pid, ops)
        msg.session_id, msg.sequence = client.session_id, client.next_sequence
        t0 = time.perf_counter()
        reply = client.stub.Step(msg, timeout=30)
        times.append(time.perf_counter() - t0)
        client.next_sequence += 1
        assert all(r.status == pb.OK for r in reply.results), reply.results[0]
        assert not packed or reply.results[0].batch.statuses == bytes(len(prompts))
        computed = [c + 1 for c in computed]
        req_bytes, resp_bytes = msg.ByteSize(), reply.ByteSize()
        progress(s + 1)
    return times, req_bytes, resp_bytes


def rpc_admit(client: KVServiceClient, prefix, steps: int, rng) -> tuple[list[float], int, int, int]:
    pid = "admit"
    client.register_pool(pid, KVCacheConfig(NUM_BLOCKS, [FullAttentionSpec(BS)]), MAX_LEN)
    times, blocks, req_bytes, resp_bytes = [], 0, 0, 0
    progress = Progress("admission steps over gRPC", steps)
    for s in range(steps):
        prompts = admit_prompts(rng, prefix, s)
        ops = []
        for i, p in enumerate(prompts):
            ops += [AddRequestOp(f"a{s}-{i}", token_ids=p), AllocateOp(f"a{s}-{i}", num_new_tokens=len(p))]
        msg = client.step_msg(pid, ops)
        msg.session_id, msg.sequence = client.session_id, client.next_sequence
        t0 = time.perf_counter()
        reply = client.stub.Step(msg, timeout=30)
        times.append(time.perf_counter() - t0)
        client.next_sequence += 1
        blocks += sum(len(g.block_ids) for r in reply.results for g in r.new_blocks)
        req_bytes, resp_bytes = msg.ByteSize(), reply.ByteSize()
        client.free(pid, *[f"a{s}-{i}" for i in range(len(prompts))])
        progress(s + 1)
    return times, blocks, req_bytes, resp_bytes


def echo_times(target: str, req_bytes: int, resp_bytes: int, steps: int, busy_s: float = 0.0) -> list[float]:
    """A bare echo of the same sizes; with `busy_s`, the echo handler also burns that much CPU."""
    with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20),
                                                ("grpc.max_send_message_length", 64 << 20)]) as ch:
        call = ch.unary_unary("/bench.Echo/Echo")
        payload = (resp_bytes.to_bytes(4, "little") + int(busy_s * 1e6).to_bytes(4, "little")
                   + bytes(max(0, req_bytes - 8)))
        call(payload, timeout=30)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            call(payload, timeout=30)
            times.append(time.perf_counter() - t0)
        return times


def summarize(name: str, rpc: list[float], core: list[float], echo: list[float], busy: list[float],
              extra: dict) -> dict:
    p50, core50, echo50 = median(rpc), median(core), median(echo)
    budget = echo50 + 1.2 * core50
    return {"workload": name, "rpc_p50_ms": p50 * 1e3, "rpc_p99_ms": percentile(rpc, 99) * 1e3,
            "inprocess_p50_ms": core50 * 1e3, "echo_p50_ms": echo50 * 1e3,
            "busy_echo_p50_ms": median(busy) * 1e3, "ratio_rpc_over_busy_echo": p50 / median(busy),
            "ratio_rpc_over_inprocess": p50 / core50, "ratio_rpc_over_echo": p50 / echo50,
            "overhead_over_core": (p50 - echo50) / core50, "target_ms": budget * 1e3, "meets_target": p50 <= budget,
            **extra}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--server-args", default="", help="extra `kvservice serve` flags (e.g. persistence)")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = decode_prompts(rng)
    prefix = [rng.randrange(32000) for _ in range(ADMIT_LEN // 2)]

    print("in-process core ...", flush=True)
    core_decode = inprocess_decode(prompts, args.steps, random.Random(1))
    core_admit, core_blocks = inprocess_admit(prefix, max(20, args.steps // 4), random.Random(2))

    server, target = start([sys.executable, "-m", "kvservice.cli", "--log-level", "ERROR", "serve", "--port", "0",
                            *args.server_args.split()], "kvservice serving on")
    echo, echo_target = start([sys.executable, str(Path(__file__).with_name("echo_server.py"))], "echo serving on")
    try:
        client = KVServiceClient(target, timeout_s=60)
        rpc_dec, dec_req, dec_resp = rpc_decode(client, prompts, args.steps, random.Random(1), packed=True)
        rpc_ops, ops_req, ops_resp = rpc_decode(client, prompts, args.steps, random.Random(1), packed=False)
        rpc_adm, adm_blocks, adm_req, adm_resp = rpc_admit(client, prefix, max(20, args.steps // 4), random.Random(2))
        print("echo baseline ...", flush=True)
        echo_dec = echo_times(echo_target, dec_req, dec_resp, args.steps)
        echo_ops = echo_times(echo_target, ops_req, ops_resp, args.steps)
        echo_adm = echo_times(echo_target, adm_req, adm_resp, max(20, args.steps // 4))
        busy_dec = echo_times(echo_target, dec_req, dec_resp, args.steps, median(core_decode))
        busy_ops = echo_times(echo_target, ops_req, ops_resp, args.steps, median(core_decode))
        busy_adm = echo_times(echo_target, adm_req, adm_resp, max(20, args.steps // 4), median(core_admit))
        client.close()
    finally:
        server.terminate()
        echo.terminate()
        server.wait(10)
        echo.wait(10)

    rows = [
        summarize("decode: 256 requests x 1 token (DecodeBatchOp)", rpc_dec, core_decode, echo_dec, busy_dec,
                  {"request_bytes": dec_req, "response_bytes": dec_resp}),
        summarize("decode: 256 requests x 1 token (256 AllocateOps)", rpc_ops, core_decode, echo_ops, busy_ops,
                  {"request_bytes": ops_req, "response_bytes": ops_resp}),
        summarize("admission: 32 x 1,024-token prompts", rpc_adm, core_admit, echo_adm, busy_adm,
                  {"request_bytes": adm_req, "response_bytes": adm_resp,
                   "blocks_per_s": adm_blocks / sum(rpc_adm),
                   "inprocess_blocks_per_s": core_blocks / sum(core_admit)}),
    ]
    print()
    print(table(["workload", "Step p50 ms", "p99 ms", "in-process ms", "echo ms", "(Step-echo)/core",
                 "target ms", "met", "busy echo ms", "Step/busy echo"],
                [[r["workload"], r["rpc_p50_ms"], r["rpc_p99_ms"], r["inprocess_p50_ms"], r["echo_p50_ms"],
                  r["overhead_over_core"], r["target_ms"], "yes" if r["meets_target"] else "NO",
                  r["busy_echo_p50_ms"], r["ratio_rpc_over_busy_echo"]] for r in rows]))
    print("target: Step p50 <= echo p50 + 1.2 x in-process p50. busy echo: the same echo whose handler burns the "
          "in-process time, i.e. the floor this transport allows for that much work.")
    print(f"admission: {rows[2]['blocks_per_s']:,.0f} block allocations/s over gRPC "
          f"({rows[2]['inprocess_blocks_per_s']:,.0f}/s in-process)")
    path = write_json("rpc", {"steps": args.steps, "server_args": args.server_args, "rows": rows})
    bar_plot("rpc", "Step p50 latency (ms): gRPC vs in-process core vs bare echo", [r["workload"] for r in rows],
             {"Step over gRPC": [r["rpc_p50_ms"] for r in rows],
              "in-process core": [r["inprocess_p50_ms"] for r in rows],
              "bare echo": [r["echo_p50_ms"] for r in rows]}, "ms")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Step RPC latency against a real server process, side by side with the in-process core, a bare
gRPC echo of the same message sizes and the core behind a bare handler (all in one run).

    python bench/rpc_bench.py [--steps 200]

Workloads: (decode) one Step carrying 256 running requests, each appending one token (about 1 in 16
needs a new block); (admission) one Step adding 32 new 1,024-token prompts whose first half is a
shared prefix. Target: Step p50 <= echo p50 + 1.2 x in-process p50; >= 50k block allocations/s.

In-process is a scheduler calling the core as vLLM's does, block ids included (a decode step reads each
request's new block ids, an admission its whole table); and through the core's fast paths, which the
service takes: the batch decode path (`allocate_running_batch`) and the one-call admission (`admit`).
The bare core server (bench/echo_server.py) applies the same Step to the same core calls behind a bare
grpc.aio handler: Step minus it is what the service itself adds (validation, sessions, leases, tenancy,
events, metrics, reply encoding), both measured in a server process. Every series is sampled in turn in
one loop, so a slow moment of this (shared, noisy) machine hits all of them alike.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # we spawn processes after using gRPC

import argparse
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.common import bar_plot, median, percentile, table, write_json  # noqa: E402
from kvservice._proto import allocator_pb2 as pb  # noqa: E402
from kvservice.client import KVServiceClient  # noqa: E402
from kvservice.client.routing import channel_options  # noqa: E402
from kvservice.core import FullAttentionSpec, KVCacheConfig, KVCacheManager, Request  # noqa: E402
from kvservice.core.fast_path import PackedRows  # noqa: E402
from kvservice.launch import wait_ready  # noqa: E402
from kvservice.ops import AddRequestOp, AdmitBatchOp, AllocateOp, DecodeBatchOp, FreeOp  # noqa: E402
from kvservice.wire.encode import step_request  # noqa: E402
from kvservice.wire.fields import decode_u32  # noqa: E402
from kvservice.wire.framing import serialize_step  # noqa: E402

BS = 16
DECODE_REQS = 256
ADMIT_REQS, ADMIT_LEN = 32, 1024
NUM_BLOCKS = 40_000
MAX_LEN = 8192


def start(cmd: list[str], marker: str) -> tuple[subprocess.Popen, str]:
    """Starts a server command and waits for its ready line (`marker HOST:PORT`)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    target = wait_ready(proc, 120, prefix=marker.rstrip() + " ")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, target


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


def new_manager() -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(NUM_BLOCKS, [FullAttentionSpec(BS)]), MAX_LEN, enable_events=True)


# ---- in-process core: the same ops ---------------------------------------------------------------
class CoreDecode:
    """256 running requests in an in-process core; `step` times one decode step of all of them, either
    as a scheduler calling `allocate_slots` per request or through the core's batch decode path."""

    def __init__(self, prompts, batch: bool) -> None:
        self.m, self.batch, self.reqs = new_manager(), batch, []
        for i, p in enumerate(prompts):
            r = Request(f"d{i}", p, BS)
            self.m.allocate_slots(r, len(p))
            r.num_computed_tokens = len(p)
            self.reqs.append(r)

    def step(self, tokens: list[int]) -> float:
        m, reqs = self.m, self.reqs
        t0 = time.perf_counter()
        if self.batch:
            computed = [r.num_tokens for r in reqs]
            assert m.fast_path.allocate_running_batch(reqs, computed, tokens, 1, 0, 0, PackedRows()) == len(reqs)
        else:
            for r, t in zip(reqs, tokens):
                r.append_output_token_ids([t])
                m.allocate_slots(r, 1).get_block_ids()  # the scheduler hands new block ids to the workers
                r.num_computed_tokens += 1
        m.take_block_copies()
        m.take_events()
        return time.perf_counter() - t0


def core_admit(m: KVCacheManager, prompts, s: int, fast: bool = False) -> tuple[float, int]:
    """One admission in-process: per request as a scheduler does (fast: through the core's one-call
    `admit`, the path the service takes)."""
    t0 = time.perf_counter()
    reqs, blocks = [], 0
    for i, p in enumerate(prompts):
        r = Request(f"a{s}-{i}", p, BS)
        if fast:
            table, n = m.fast_path.admit(r, len(p))
            blocks += len(table) - n // BS
        else:
            hits, n = m.get_computed_blocks(r)
            new = m.allocate_slots(r, len(p) - n, n, hits)
            blocks += len(new.blocks[0])
        m.get_block_ids(r.request_id)  # a new request's whole table goes to the workers
        reqs.append(r)
    m.take_events()
    elapsed = time.perf_counter() - t0
    for r in reqs:
        m.free(r)
    m.take_events()
    return elapsed, blocks


# ---- over gRPC -----------------------------------------------------------------------------------
def timed_step(client: KVServiceClient, msg: pb.StepRequest) -> tuple[float, pb.StepResponse]:
    msg.session_id, msg.sequence = client.session_id, client.next_sequence
    t0 = time.perf_counter()
    reply = client.stub.Step(msg, timeout=30)
    elapsed = time.perf_counter() - t0
    client.next_sequence += 1
    return elapsed, reply


class RpcDecode:
    """The same 256 requests in a pool of the server, advanced one token per step, packed in one
    DecodeBatchOp or as 256 AllocateOps."""

    def __init__(self, client: KVServiceClient, bare: BareCore, prompts, packed: bool) -> None:
        self.client, self.bare, self.packed = client, bare, packed
        self.pool_id = "decode-packed" if packed else "decode-ops"
        client.register_pool(self.pool_id, KVCacheConfig(NUM_BLOCKS, [FullAttentionSpec(BS)]), MAX_LEN)
        ops = []
        for i, p in enumerate(prompts):
            ops += [AddRequestOp(f"d{i}", token_ids=p), AllocateOp(f"d{i}", num_new_tokens=len(p))]
        msg = step_request(self.pool_id, ops)
        timed_step(client, msg)
        bare(msg, 0)
        self.ids = [f"d{i}" for i in range(len(prompts))]
        self.computed = [len(p) for p in prompts]
        self.msg = None
        self.sizes = (0, 0)

    def step(self, tokens: list[int]) -> float:
        """One decode step over gRPC; `bare_step` then runs the same message on the bare core."""
        if self.packed:
            ops = [DecodeBatchOp(self.ids, self.computed, tokens)]
        else:
            ops = [AllocateOp(rid, num_computed_tokens=c, num_new_tokens=1, append_token_ids=[t])
                   for rid, c, t in zip(self.ids, self.computed, tokens)]
        self.msg = step_request(self.pool_id, ops)
        elapsed, reply = timed_step(self.client, self.msg)
        assert all(r.status == pb.OK for r in reply.results), reply.results[0]
        assert not self.packed or reply.results[0].batch.statuses == bytes(len(self.ids))
        self.computed = [c + 1 for c in self.computed]
        self.sizes = (len(serialize_step(self.msg)), reply.ByteSize())
        return elapsed

    def bare_step(self) -> float:
        return self.bare(self.msg, self.sizes[1])


def rpc_admit(client: KVServiceClient, bare: BareCore, prompts, s: int,
              packed: bool) -> tuple[float, float, int, tuple[int, int]]:
    """(Step seconds, bare core seconds, blocks allocated, message sizes) of one admission, as 32
    AddRequestOp + AllocateOp pairs or one AdmitBatchOp (each in a pool of its own), then frees."""
    pool_id, ids = ("admit-packed", [f"p{s}-{i}" for i in range(len(prompts))]) if packed else \
        ("admit", [f"a{s}-{i}" for i in range(len(prompts))])
    if packed:
        ops = [AdmitBatchOp(ids, prompts)]
    else:
        ops = [op for rid, p in zip(ids, prompts) for op in (AddRequestOp(rid, token_ids=p),
                                                             AllocateOp(rid, num_new_tokens=len(p)))]
    msg = step_request(pool_id, ops)
    elapsed, reply = timed_step(client, msg)
    # An admission's reply holds the whole table: the blocks it allocated are those past the hit.
    if packed:
        b = reply.results[0].batch
        assert b.statuses == bytes(len(ids)), b
        blocks = len(b.new_block_ids) // 4 - sum(decode_u32("c", b.num_computed_tokens)) // BS
    else:
        blocks = sum(len(g.block_ids) - r.num_computed_tokens // BS for r in reply.results for g in r.new_blocks)
    free = step_request(pool_id, [FreeOp(rid) for rid in ids])
    timed_step(client, free)
    sizes = (len(serialize_step(msg)), reply.ByteSize())
    bare_elapsed = bare(msg, sizes[1])
    bare(free, 0)
    return elapsed, bare_elapsed, blocks, sizes


def channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=channel_options())


class Echo:
    """A bare grpc echo of given sizes; with `busy_s`, its handler also burns that much CPU."""

    def __init__(self, target: str) -> None:
        self.channel = channel(target)
        self.call = self.channel.unary_unary("/bench.Echo/Echo")

    def __call__(self, sizes: tuple[int, int], busy_s: float = 0.0) -> float:
        req_bytes, resp_bytes = sizes
        payload = (resp_bytes.to_bytes(4, "little") + int(busy_s * 1e6).to_bytes(4, "little")
                   + bytes(max(0, req_bytes - 8)))
        t0 = time.perf_counter()
        self.call(payload, timeout=30)
        return time.perf_counter() - t0


class BareCore:
    """The same Step applied to the core behind a bare handler (bench/echo_server.py), replying with as
    many bytes as the Step's reply; timed like the Step (request serialization included)."""

    def __init__(self, target: str) -> None:
        self.channel = channel(target)
        self.call = self.channel.unary_unary("/bench.Echo/Core",
                                             request_serializer=lambda m: m[0].to_bytes(4, "little")
                                             + serialize_step(m[1]))

    def __call__(self, msg: pb.StepRequest, reply_bytes: int) -> float:
        t0 = time.perf_counter()
        self.call((reply_bytes, msg), timeout=30)
        return time.perf_counter() - t0


def summarize(name: str, t: dict[str, list[float]], extra: dict) -> dict:
    """p50s of one workload's interleaved samples: the issue's target against the per-request core
    (and, for decode, against the core's batch path), and what the service adds over the bare core."""
    p50 = {k: median(v) for k, v in t.items()}
    rpc, echo, core, bare = p50["rpc"], p50["echo"], p50["core"], p50["bare"]
    row = {"workload": name, "rpc_p50_ms": rpc * 1e3, "rpc_p99_ms": percentile(t["rpc"], 99) * 1e3,
           "inprocess_p50_ms": core * 1e3, "echo_p50_ms": echo * 1e3, "bare_core_p50_ms": bare * 1e3,
           "ratio_rpc_over_inprocess": rpc / core, "overhead_over_core": (rpc - echo) / core,
           "service_overhead_over_core": (rpc - bare) / core, "bare_core_over_core": (bare - echo) / core,
           "target_ms": (echo + 1.2 * core) * 1e3, "meets_target": rpc <= echo + 1.2 * core, **extra}
    if "batch" in p50:
        row.update({"inprocess_batch_p50_ms": p50["batch"] * 1e3,
                    "target_vs_batch_ms": (echo + 1.2 * p50["batch"]) * 1e3,
                    "meets_target_vs_batch": rpc <= echo + 1.2 * p50["batch"]})
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--server-args", default="--no-persistence",
                        help="`kvservice serve` flags (default: memory only; persistence is persist_bench's)")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = decode_prompts(rng)
    prefix = [rng.randrange(32000) for _ in range(ADMIT_LEN // 2)]
    admit_steps = max(20, args.steps // 4)

    server, target = start([sys.executable, "-m", "kvservice.cli", "--log-level", "ERROR", "serve", "--port", "0",
                            *args.server_args.split()], "kvservice serving on")
    echo_server, echo_target = start([sys.executable, str(Path(__file__).with_name("echo_server.py")),
                                      "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BS),
                                      "--max-model-len", str(MAX_LEN)], "echo serving on")
    try:
        client = KVServiceClient(target, timeout_s=60)
        echo, bare = Echo(echo_target), BareCore(echo_target)
        per_request, batch = CoreDecode(prompts, batch=False), CoreDecode(prompts, batch=True)
        packed = RpcDecode(client, bare, prompts, packed=True)
        unpacked = RpcDecode(client, bare, prompts, packed=False)
        keys = ("core", "batch", "rpc", "echo", "bare")
        dec, ops = {k: [] for k in keys}, {k: [] for k in keys}
        token_rng = random.Random(1)
        progress = Progress("decode steps (in-process, batch path, packed and per-op RPCs, echoes, bare core)",
                            args.steps)
        for s in range(args.steps):
            tokens = [token_rng.randrange(32000) for _ in prompts]
            core_t, batch_t = per_request.step(tokens), batch.step(tokens)
            for series, rpc in ((dec, packed), (ops, unpacked)):
                series["core"].append(core_t)
                series["batch"].append(batch_t)
                series["rpc"].append(rpc.step(tokens))
                series["bare"].append(rpc.bare_step())
                series["echo"].append(echo(rpc.sizes))
            progress(s + 1)
        for pool_id in ("admit", "admit-packed"):
            client.register_pool(pool_id, KVCacheConfig(NUM_BLOCKS, [FullAttentionSpec(BS)]), MAX_LEN)
        core_m, fast_m = new_manager(), new_manager()
        adm, adm_packed = ({k: [] for k in ("core", "batch", "rpc", "echo", "bare")} for _ in range(2))
        core_blocks = rpc_blocks = 0
        progress = Progress("admission steps (in-process, RPC as pairs and packed, echoes, bare core)", admit_steps)
        prompt_rng = random.Random(2)
        for s in range(admit_steps):
            batch_prompts = admit_prompts(prompt_rng, prefix, s)
            core_t, n = core_admit(core_m, batch_prompts, s)
            fast_t, _ = core_admit(fast_m, batch_prompts, s, fast=True)
            core_blocks += n
            for series, packed_op in ((adm, False), (adm_packed, True)):
                rpc_t, bare_t, n, sizes = rpc_admit(client, bare, batch_prompts, s, packed_op)
                rpc_blocks += n * (not packed_op)
                series["core"].append(core_t)
                series["batch"].append(fast_t)
                series["rpc"].append(rpc_t)
                series["bare"].append(bare_t)
                series["echo"].append(echo(sizes))
            progress(s + 1)
        client.close()
    finally:
        server.terminate()
        echo_server.terminate()
        server.wait(10)
        echo_server.wait(10)

    rows = [
        summarize("decode: 256 requests x 1 token (DecodeBatchOp)", dec,
                  {"request_bytes": packed.sizes[0], "response_bytes": packed.sizes[1]}),
        summarize("decode: 256 requests x 1 token (256 AllocateOps)", ops,
                  {"request_bytes": unpacked.sizes[0], "response_bytes": unpacked.sizes[1]}),
        summarize("admission: 32 x 1,024-token prompts (32 AddRequestOp + AllocateOp pairs)", adm,
                  {"blocks_per_s": rpc_blocks / sum(adm["rpc"]),
                   "inprocess_blocks_per_s": core_blocks / sum(adm["core"])}),
        summarize("admission: 32 x 1,024-token prompts (AdmitBatchOp)", adm_packed,
                  {"blocks_per_s": rpc_blocks / sum(adm_packed["rpc"]),
                   "inprocess_blocks_per_s": core_blocks / sum(adm_packed["core"])}),
    ]
    print()
    yes = {True: "yes", False: "NO", None: "-"}
    print(table(["workload", "Step p50 ms", "p99 ms", "in-process ms", "in-process fast path ms", "echo ms",
                 "bare core server ms", "target ms", "met", "target vs fast path ms", "met",
                 "service adds (x in-process)"],
                [[r["workload"], r["rpc_p50_ms"], r["rpc_p99_ms"], r["inprocess_p50_ms"],
                  r.get("inprocess_batch_p50_ms", float("nan")), r["echo_p50_ms"], r["bare_core_p50_ms"],
                  r["target_ms"], yes[r["meets_target"]], r.get("target_vs_batch_ms", float("nan")),
                  yes[r.get("meets_target_vs_batch")], r["service_overhead_over_core"]] for r in rows]))
    print("target: Step p50 <= echo p50 + 1.2 x in-process p50 (in-process: a scheduler calling the core per "
          "request; fast path: the core's batch decode path / one-call admit, which the service uses). bare core "
          "server: the same Step applied to the same core calls behind a bare grpc.aio handler; service adds = "
          "(Step - bare core) / in-process.")
    print(f"admission: {rows[2]['blocks_per_s']:,.0f} block allocations/s over gRPC as pairs, "
          f"{rows[3]['blocks_per_s']:,.0f}/s packed ({rows[2]['inprocess_blocks_per_s']:,.0f}/s in-process)")
    path = write_json("rpc", {"steps": args.steps, "server_args": args.server_args, "rows": rows})
    plot(rows)
    print(f"wrote {path}")
    return 0


def plot(rows: list[dict]) -> None:
    labels = [r["workload"].replace("256 requests x 1 token ", "").replace("32 x 1,024-token prompts ", "")
              .replace("32 AddRequestOp + AllocateOp pairs", "pairs") for r in rows]
    bar_plot("rpc", "Step p50 latency (ms): gRPC vs in-process core vs bare baselines", labels,
             {"Step over gRPC": [r["rpc_p50_ms"] for r in rows],
              "bare core server": [r["bare_core_p50_ms"] for r in rows],
              "in-process core (per request)": [r["inprocess_p50_ms"] for r in rows],
              "in-process core (fast path)": [r.get("inprocess_batch_p50_ms", 0.0) for r in rows],
              "bare echo": [r["echo_p50_ms"] for r in rows],
              "target": [r["target_ms"] for r in rows]}, "ms")


if __name__ == "__main__":
    sys.exit(main())

"""Steps/s of one allocator process serving 8 engines at once: each engine (a process of its own) holds 256
running requests in a pool of its own and sends packed decode Steps (one `DecodeBatchOp`, one token each) back
to back for `--seconds`; beside it, the same 8 processes sending a bare grpc.aio echo of the same sizes (the
wire's own ceiling on this machine).

    python bench/step_throughput.py [--engines 8] [--seconds 10]
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import argparse
import multiprocessing
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table, write_json  # noqa: E402
from bench.rpc_bench import BS, MAX_LEN, NUM_BLOCKS, start  # noqa: E402

REQUESTS = 256


def engine(target: str, echo_target: str, index: int, seconds: float, start_at: float, out) -> None:
    from kvservice.client import KVServiceClient
    from kvservice.core import FullAttentionSpec, KVCacheConfig
    from kvservice.ops import AddRequestOp, AllocateOp, DecodeBatchOp
    from kvservice.wire.encode import step_request
    from kvservice.wire.framing import serialize_step
    rng = random.Random(index)
    client = KVServiceClient(target, timeout_s=60)
    pool = f"engine-{index}"
    client.register_pool(pool, KVCacheConfig(NUM_BLOCKS, [FullAttentionSpec(BS)]), MAX_LEN)
    prompts = [[rng.randrange(32000) for _ in range(rng.randint(100, 900))] for _ in range(REQUESTS)]
    ops = []
    for i, p in enumerate(prompts):
        ops += [AddRequestOp(f"d{i}", token_ids=p), AllocateOp(f"d{i}", num_new_tokens=len(p))]
    client.step(pool, ops)
    ids, computed = [f"d{i}" for i in range(REQUESTS)], [len(p) for p in prompts]
    time.sleep(max(0.0, start_at - time.time()))
    steps, sizes, stop = 0, (0, 0), time.monotonic() + seconds
    while time.monotonic() < stop:
        reply = client.step(pool, [DecodeBatchOp(ids, computed, [rng.randrange(32000) for _ in ids])])
        assert reply[0].batch is not None
        computed = [c + 1 for c in computed]
        steps += 1
        if steps == 1:
            msg = step_request(pool, [DecodeBatchOp(ids, computed, [1] * len(ids))])
            sizes = (len(serialize_step(msg)), 2 * REQUESTS)
    client.close()
    import grpc

    from kvservice.client.routing import channel_options
    call = grpc.insecure_channel(echo_target, options=channel_options()).unary_unary("/bench.Echo/Echo")
    payload = sizes[1].to_bytes(4, "little") + bytes(4) + bytes(max(0, sizes[0] - 8))
    time.sleep(max(0.0, start_at + seconds + 5 - time.time()))
    echoes, stop = 0, time.monotonic() + seconds
    while time.monotonic() < stop:
        call(payload, timeout=30)
        echoes += 1
    out.put((steps, echoes))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    server, target = start([sys.executable, "-m", "kvservice.cli", "--log-level", "ERROR", "serve", "--port", "0",
                            "--no-persistence"], "kvservice serving on")
    echo_server, echo_target = start([sys.executable, str(Path(__file__).with_name("echo_server.py"))],
                                     "echo serving on")
    try:
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        start_at = time.time() + 30  # every engine admitted its requests by then
        procs = [ctx.Process(target=engine, args=(target, echo_target, i, args.seconds, start_at, queue))
                 for i in range(args.engines)]
        for p in procs:
            p.start()
        results = [queue.get() for _ in procs]
        for p in procs:
            p.join()
    finally:
        server.terminate()
        echo_server.terminate()
    steps = sum(s for s, _ in results) / args.seconds
    echoes = sum(e for _, e in results) / args.seconds
    print(table([f"{args.engines} engines at once, one allocator process", "calls/s"],
                [("packed decode Steps (256 rows each)", steps), ("bare echo of the same sizes", echoes)]))
    write_json("step_throughput", {"args": vars(args), "steps_per_s": steps, "echoes_per_s": echoes})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bare grpc.aio baselines for rpc_bench: the floor an RPC of a given size costs on this machine, and the
floor of any gRPC service built on this core.

`/bench.Echo/Echo`: the request is `le_u32(response_size) || le_u32(busy_us) || payload`; the server burns
`busy_us` of CPU (holding the GIL, as a handler doing real work would) and replies with `response_size`
bytes.

`/bench.Echo/Core`: the request is `le_u32(response_size) || StepRequest bytes`; the handler parses the
Step and applies its ops straight to in-process `KVCacheManager`s (one per pool id), through the same core
entry points the allocator uses (the batch decode path for a DecodeBatchOp, `allocate_running` then
`allocate_slots` for an allocate op, the one-call `admit` (else `get_computed_blocks` + `allocate_slots`)
and the whole table for an admission, an AdmitBatchOp's entries included), and replies with
`response_size` bytes. None of the service's own work (validation, sessions, leases, tenancy, the event
log, metrics, reply encoding): the difference between a Step and this is what the service adds,
measured in a server process like the Step.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from array import array

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice.core import FullAttentionSpec, KVCacheConfig, KVCacheManager, Request
from kvservice.core.fast_path import PackedRows
from kvservice.server.serve import GC_THRESHOLDS

METHOD = "/bench.Echo/Echo"
CORE_METHOD = "/bench.Echo/Core"


def tokens_of(data: bytes) -> array:
    out = array("I")
    out.frombytes(data)
    return out


class BareCore:
    """Step ops applied to the core with nothing around them (well-formed, known requests assumed)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.config = KVCacheConfig(num_blocks, [FullAttentionSpec(block_size)])
        self.block_size, self.max_model_len = block_size, max_model_len
        self.managers: dict[str, KVCacheManager] = {}
        self.requests: dict[str, dict[str, Request]] = {}

    def step(self, msg: pb.StepRequest) -> None:
        m = self.managers.get(msg.pool_id)
        if m is None:
            m = self.managers[msg.pool_id] = KVCacheManager(self.config, self.max_model_len, enable_events=True)
            self.requests[msg.pool_id] = {}
        reqs = self.requests[msg.pool_id]
        for op in msg.ops:
            kind = op.WhichOneof("op")
            if kind == "add":
                reqs[op.add.request_id] = Request(op.add.request_id, tokens_of(op.add.token_ids), self.block_size)
            elif kind == "allocate":
                self.allocate(m, reqs[op.allocate.request_id], op.allocate)
            elif kind == "decode":
                d = op.decode
                batch = [reqs[r] for r in d.request_ids]
                computed, tokens = tokens_of(d.num_computed_tokens).tolist(), tokens_of(d.append_token_ids).tolist()
                m.fast_path.allocate_running_batch(batch, computed, tokens, d.num_new_tokens or 1, 0, 0, PackedRows())
            elif kind == "admit":
                a, start = op.admit, 0
                tokens, lengths = tokens_of(a.token_ids), tokens_of(a.num_prompt_tokens)
                budgets = tokens_of(a.num_new_tokens) if a.num_new_tokens else lengths
                for rid, length, budget in zip(a.request_ids, lengths, budgets):
                    r = reqs[rid] = Request(rid, tokens[start:start + length], self.block_size)
                    start += length
                    self.admit(m, r, budget)
            elif kind == "free":
                m.free(reqs.pop(op.free.request_id))
        m.take_block_copies()
        m.take_events()

    @staticmethod
    def allocate(m: KVCacheManager, r: Request, a: pb.AllocateOp) -> None:
        tokens = tokens_of(a.append_token_ids)
        if m.coordinator.is_running(r.request_id):
            token = tokens[0] if len(tokens) == 1 else None
            if m.fast_path.allocate_running(r, a.num_computed_tokens, token, a.num_new_tokens) is None:
                r.append_output_token_ids(tokens)
                r.num_computed_tokens = a.num_computed_tokens
                m.allocate_slots(r, min(a.num_new_tokens, r.num_tokens - a.num_computed_tokens))
            return
        BareCore.admit(m, r, a.num_new_tokens)

    @staticmethod
    def admit(m: KVCacheManager, r: Request, budget: int) -> None:
        admitted = m.fast_path.admit(r, budget)  # the one-call admission, as the allocator takes it
        if admitted is None:
            hits, num_hit = m.get_computed_blocks(r)
            m.allocate_slots(r, min(budget, r.num_tokens - num_hit), num_hit, hits)
        else:
            num_hit = admitted[1]
        r.num_computed_tokens = num_hit
        m.get_block_ids(r.request_id)  # an admission answers with the whole table


async def main(port: int, core: BareCore) -> None:
    async def echo(request: bytes, context) -> bytes:
        size = int.from_bytes(request[:4], "little")
        busy_s = int.from_bytes(request[4:8], "little") / 1e6
        start = time.perf_counter()
        while time.perf_counter() - start < busy_s:
            pass
        return request[8:8 + size].ljust(size, b"\0")

    async def core_step(request: bytes, context) -> bytes:
        core.step(pb.StepRequest.FromString(request[4:]))
        return bytes(int.from_bytes(request[:4], "little"))

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    handlers = {"Echo": grpc.unary_unary_rpc_method_handler(echo),
                "Core": grpc.unary_unary_rpc_method_handler(core_step)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"echo serving on 127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--num-blocks", type=int, default=40_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192)
    args = parser.parse_args()
    gc.set_threshold(*GC_THRESHOLDS)  # as `kvservice serve` runs: the difference is the service, not the GC
    asyncio.run(main(args.port, BareCore(args.num_blocks, args.block_size, args.max_model_len)))

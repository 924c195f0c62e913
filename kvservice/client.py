"""Sync and asyncio clients with typed results.

Mutations carry the session's next sequence number and are retried with that same number on
transport errors: the server answers a retry of an applied sequence with the original reply, so
retries never apply twice. Reads are retried with deadlines too.

    with KVServiceClient("127.0.0.1:50051") as client:
        client.register_pool("engine-0", KVCacheConfig(4096, [FullAttentionSpec(16)]), max_model_len=8192)
        result = client.step("engine-0", [AddRequestOp("r1", token_ids=prompt), AllocateOp("r1", num_new_tokens=512)])
        print(result[1].new_block_ids, result[1].num_computed_tokens)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice._proto import allocator_pb2_grpc as pb_grpc
from kvservice.allocator import PoolHit, RegisterResult
from kvservice.core import KVCacheConfig
from kvservice.errors import KVServiceError, from_rpc_error
from kvservice.hashing import DEFAULT_HASH_BLOCK_SIZE, DEFAULT_HASH_SEED, hash_prompt, spec_fingerprint
from kvservice.ops import AddRequestOp, AllocateOp, ForkOp, FreeOp, Op, StepResult
from kvservice.wire import (
    decode_step_result,
    decode_tokens,
    encode_add,
    encode_config,
    encode_op,
    encode_tokens,
    serialize_step,
)

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Allocator"].full_name


@dataclass(slots=True)
class RequestInfo:
    request_id: str
    pool_id: str
    num_tokens: int
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]
    num_block_hashes: int
    running: bool


@dataclass(slots=True)
class LookupResult:
    hits: list[PoolHit]
    best_pool_id: str

    def tokens(self, pool_id: str) -> int:
        return next((h.num_cached_tokens for h in self.hits if h.pool_id == pool_id), 0)


@dataclass(slots=True)
class PoolStats:
    pool_id: str
    epoch: int
    num_blocks: int
    num_free_blocks: int
    usage: float
    num_requests: int
    prefix_hit_rate: float
    prefix_queries: int
    prefix_hits: int
    evictions: int
    num_cached_blocks: int
    invariant_violation: str
    num_pending_transfers: int = 0


@dataclass(slots=True)
class Stats:
    pools: dict[str, PoolStats]
    num_sessions: int
    persistence: str
    event_sequence: int
    lease_expiries: int
    hash_fingerprint: str
    hash_block_size: int


@dataclass(slots=True)
class Event:
    sequence: int
    pool_id: str
    kind: str  # "stored" | "removed" | "cleared"
    block_hashes: list[bytes]
    parent_block_hash: bytes | None = None
    token_ids: list[int] | None = None
    block_ids: list[int] | None = None
    group_idx: int = 0


def channel_credentials(tls_ca: str | None, tls_cert: str | None, tls_key: str | None):
    read = lambda p: Path(p).read_bytes() if p else None
    return grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))


class _Messages:
    """Channel set-up, request builders and reply decoders shared by both clients."""

    client_name: str
    session_id: str
    next_sequence: int

    def _setup(self, grpc_module, target: str, token: str | None, *, client_name: str = "",
               tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
               timeout_s: float = 10.0, retries: int = 4, hash_seed: str = DEFAULT_HASH_SEED,
               hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE, max_message_bytes: int = 64 * 1024 * 1024) -> None:
        """`grpc_module` is grpc (blocking) or grpc.aio."""
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if tls_ca or tls_cert:
            creds = channel_credentials(tls_ca, tls_cert, tls_key)
            self.channel = grpc_module.secure_channel(target, creds, options)
        else:
            self.channel = grpc_module.insecure_channel(target, options)
        self.stub = pb_grpc.AllocatorStub(self.channel)
        # Step with the op-by-op serializer (see serialize_step): the same bytes, faster for big steps.
        self.stub.Step = self.channel.unary_unary(f"/{SERVICE_NAME}/Step", request_serializer=serialize_step,
                                                  response_deserializer=pb.StepResponse.FromString)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.client_name = client_name
        self.timeout_s = timeout_s
        self.retries = retries
        self.hash_seed = hash_seed
        self.hash_block_size = hash_block_size
        self.session_id = ""
        self.next_sequence = 1
        self.tenant = ""

    @staticmethod
    def register_msg(pool_id, config: KVCacheConfig, max_model_len, epoch, dcp_world_size, enable_caching,
                     vocab_size, kv_layout, fingerprint) -> pb.RegisterPoolRequest:
        return pb.RegisterPoolRequest(pool_id=pool_id, epoch=epoch, hash_fingerprint=fingerprint,
                                      config=encode_config(config, max_model_len, dcp_world_size, enable_caching,
                                                           vocab_size, kv_layout))

    @staticmethod
    def register_result(r: pb.RegisterPoolResponse) -> RegisterResult:
        return RegisterResult(r.pool_id, r.epoch, r.new_epoch, r.hash_block_size, r.hash_seed,
                              r.num_requests_failed, r.scheduler_block_size)

    @staticmethod
    def step_msg(pool_id: str, ops: Sequence[Op]) -> pb.StepRequest:
        msg = pb.StepRequest(pool_id=pool_id)
        add = msg.ops.add
        for op in ops:
            encode_op(op, add())
        return msg

    @staticmethod
    def allocate_msg(pool_id: str, op: AllocateOp, add: AddRequestOp | None) -> pb.AllocateRequest:
        msg = pb.AllocateRequest(pool_id=pool_id)
        if add is not None:
            encode_add(add, msg.add)
        wrapper = pb.Op()
        encode_op(op, wrapper)
        msg.allocate.CopyFrom(wrapper.allocate)
        return msg

    @staticmethod
    def request_info(r: pb.RequestInfo) -> RequestInfo:
        return RequestInfo(r.request_id, r.pool_id, r.num_tokens, r.num_computed_tokens,
                           tuple(list(g.block_ids) for g in r.blocks), r.num_block_hashes, r.running)

    @staticmethod
    def lookup_msg(token_ids, block_hashes, num_tokens, cache_salt, lora_name, pool_ids) -> pb.LookupRequest:
        msg = pb.LookupRequest(cache_salt=cache_salt or "", lora_name=lora_name or "", pool_ids=list(pool_ids),
                               num_tokens=num_tokens)
        if block_hashes is not None:
            msg.block_hashes = b"".join(block_hashes)
        else:
            msg.token_ids = encode_tokens(token_ids)
        return msg

    @staticmethod
    def lookup_result(r: pb.LookupResponse) -> LookupResult:
        return LookupResult([PoolHit(h.pool_id, h.num_cached_tokens, h.num_free_blocks) for h in r.hits],
                            r.best_pool_id)

    @staticmethod
    def stats(r: pb.GetStatsResponse) -> Stats:
        pools = {p.pool_id: PoolStats(p.pool_id, p.epoch, p.num_blocks, p.num_free_blocks, p.usage, p.num_requests,
                                      p.prefix_hit_rate, p.prefix_queries, p.prefix_hits, p.evictions,
                                      p.num_cached_blocks, p.invariant_violation, p.num_pending_transfers)
                 for p in r.pools}
        return Stats(pools, r.num_sessions, r.persistence, r.event_sequence, r.lease_expiries, r.hash_fingerprint,
                     r.hash_block_size)

    @staticmethod
    def event(e: pb.KVEvent) -> Event:
        kind = e.WhichOneof("event")
        if kind == "stored":
            s = e.stored
            return Event(e.sequence, e.pool_id, kind, list(s.block_hashes), s.parent_block_hash or None,
                         list(decode_tokens("token_ids", s.token_ids)), list(s.block_ids), s.group_idx)
        if kind == "removed":
            return Event(e.sequence, e.pool_id, kind, list(e.removed.block_hashes), group_idx=e.removed.group_idx)
        return Event(e.sequence, e.pool_id, "cleared", [])


class KVServiceClient(_Messages):
    """Blocking client. One session per client; not for concurrent use from several threads."""

    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None, **options) -> None:
        """Options: client_name, tls_ca / tls_cert / tls_key (TLS, mutual with a cert), timeout_s (10),
        retries (4), hash_seed, hash_block_size (the server's hash spec), max_message_bytes."""
        self._setup(grpc, target, token, **options)

    def __enter__(self) -> KVServiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _call(self, method, request, timeout_s: float | None = None):
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                return method(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
            except grpc.RpcError as err:
                if err.code() not in RETRYABLE or attempt == self.retries:
                    raise from_rpc_error(err) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")

    def _mutate(self, method, request):
        if not self.session_id:
            self.open_session()
        request.session_id = self.session_id
        request.sequence = self.next_sequence
        reply = self._call(method, request)
        self.next_sequence += 1
        return reply

    # ---- API -----------------------------------------------------------------------------------
    def open_session(self, resume: bool = False) -> pb.OpenSessionResponse:
        msg = pb.OpenSessionRequest(client_name=self.client_name)
        if resume and self.session_id:
            msg.resume_session_id = self.session_id
            msg.last_acked_sequence = self.next_sequence - 1
        r = self._call(self.stub.OpenSession, msg)
        self.session_id, self.next_sequence, self.tenant = r.session_id, r.next_sequence, r.tenant
        return r

    def register_pool(self, pool_id: str, config: KVCacheConfig, max_model_len: int, epoch: int = 0,
                      dcp_world_size: int = 1, enable_caching: bool = True, vocab_size: int = 0,
                      kv_layout: str = "") -> RegisterResult:
        msg = self.register_msg(pool_id, config, max_model_len, epoch, dcp_world_size, enable_caching, vocab_size,
                                kv_layout, spec_fingerprint(self.hash_seed, self.hash_block_size))
        return self.register_result(self._mutate(self.stub.RegisterPool, msg))

    def step(self, pool_id: str, ops: Sequence[Op]) -> StepResult:
        return decode_step_result(self._mutate(self.stub.Step, self.step_msg(pool_id, ops)))

    def allocate(self, pool_id: str, op: AllocateOp, add: AddRequestOp | None = None) -> StepResult:
        return decode_step_result(self._mutate(self.stub.Allocate, self.allocate_msg(pool_id, op, add)))

    def free(self, pool_id: str, *request_ids: str) -> StepResult:
        msg = pb.FreeRequest(pool_id=pool_id, request_ids=list(request_ids))
        return decode_step_result(self._mutate(self.stub.Free, msg))

    def fork(self, pool_id: str, parent_request_id: str, *child_request_ids: str) -> StepResult:
        msg = pb.ForkRequest(pool_id=pool_id, parent_request_id=parent_request_id,
                             child_request_ids=list(child_request_ids))
        return decode_step_result(self._mutate(self.stub.Fork, msg))

    def commit_transfer(self, pool_id: str, transfer_id: str, abort: bool = False) -> StepResult:
        """After the workers copied a transfer order's blocks: commit (they become cached here) or abort."""
        msg = pb.CommitTransferRequest(pool_id=pool_id, transfer_id=transfer_id, abort=abort)
        return decode_step_result(self._mutate(self.stub.CommitTransfer, msg))

    def get_request(self, pool_id: str, request_id: str) -> RequestInfo:
        return self.request_info(self._call(self.stub.GetRequest,
                                            pb.GetRequestRequest(pool_id=pool_id, request_id=request_id)))

    def lookup(self, token_ids: Sequence[int] | None = None, block_hashes: Sequence[bytes] | None = None,
               num_tokens: int = 0, cache_salt: str | None = None, lora_name: str | None = None,
               pool_ids: Sequence[str] = ()) -> LookupResult:
        msg = self.lookup_msg(token_ids, block_hashes, num_tokens, cache_salt, lora_name, pool_ids)
        return self.lookup_result(self._call(self.stub.Lookup, msg))

    def heartbeat(self) -> None:
        self._call(self.stub.Heartbeat, pb.HeartbeatRequest(session_id=self.session_id))

    def get_stats(self, check_invariants: bool = False) -> Stats:
        return self.stats(self._call(self.stub.GetStats, pb.GetStatsRequest(check_invariants=check_invariants)))

    def reset_prefix_cache(self, pool_ids: Sequence[str] = ()) -> tuple[list[str], list[str]]:
        r = self._call(self.stub.ResetPrefixCache, pb.ResetPrefixCacheRequest(pool_ids=list(pool_ids)))
        return list(r.reset_pool_ids), list(r.refused_pool_ids)

    def watch_events(self, pool_ids: Sequence[str] = (), start_sequence: int | None = None,
                     timeout_s: float | None = None) -> Iterator[Event]:
        msg = pb.WatchEventsRequest(pool_ids=list(pool_ids))
        if start_sequence is not None:
            msg.start_sequence = start_sequence
        try:
            for e in self.stub.WatchEvents(msg, metadata=self.metadata, timeout=timeout_s):
                yield self.event(e)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def hash_prompt(self, token_ids: Sequence[int], cache_salt: str | None = None,
                    lora_name: str | None = None) -> list[bytes]:
        """Block hashes exactly as the server computes them (to add requests by hashes)."""
        return hash_prompt(token_ids, self.hash_block_size, self.hash_seed, cache_salt, lora_name)


class AsyncKVServiceClient(_Messages):
    """asyncio client; same API as KVServiceClient with `await`."""

    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None, **options) -> None:
        self._setup(grpc.aio, target, token, **options)
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncKVServiceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def _call(self, method, request, timeout_s: float | None = None):
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                return await method(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
            except grpc.RpcError as err:
                if err.code() not in RETRYABLE or attempt == self.retries:
                    raise from_rpc_error(err) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")

    async def _mutate(self, method, request):
        async with self._lock:  # one sequence at a time per session
            if not self.session_id:
                await self.open_session()
            request.session_id = self.session_id
            request.sequence = self.next_sequence
            reply = await self._call(method, request)
            self.next_sequence += 1
            return reply

    async def open_session(self, resume: bool = False) -> pb.OpenSessionResponse:
        msg = pb.OpenSessionRequest(client_name=self.client_name)
        if resume and self.session_id:
            msg.resume_session_id = self.session_id
            msg.last_acked_sequence = self.next_sequence - 1
        r = await self._call(self.stub.OpenSession, msg)
        self.session_id, self.next_sequence, self.tenant = r.session_id, r.next_sequence, r.tenant
        return r

    async def register_pool(self, pool_id: str, config: KVCacheConfig, max_model_len: int, epoch: int = 0,
                            dcp_world_size: int = 1, enable_caching: bool = True, vocab_size: int = 0,
                            kv_layout: str = "") -> RegisterResult:
        msg = self.register_msg(pool_id, config, max_model_len, epoch, dcp_world_size, enable_caching, vocab_size,
                                kv_layout, spec_fingerprint(self.hash_seed, self.hash_block_size))
        return self.register_result(await self._mutate(self.stub.RegisterPool, msg))

    async def step(self, pool_id: str, ops: Sequence[Op]) -> StepResult:
        return decode_step_result(await self._mutate(self.stub.Step, self.step_msg(pool_id, ops)))

    async def allocate(self, pool_id: str, op: AllocateOp, add: AddRequestOp | None = None) -> StepResult:
        return decode_step_result(await self._mutate(self.stub.Allocate, self.allocate_msg(pool_id, op, add)))

    async def free(self, pool_id: str, *request_ids: str) -> StepResult:
        msg = pb.FreeRequest(pool_id=pool_id, request_ids=list(request_ids))
        return decode_step_result(await self._mutate(self.stub.Free, msg))

    async def fork(self, pool_id: str, parent_request_id: str, *child_request_ids: str) -> StepResult:
        msg = pb.ForkRequest(pool_id=pool_id, parent_request_id=parent_request_id,
                             child_request_ids=list(child_request_ids))
        return decode_step_result(await self._mutate(self.stub.Fork, msg))

    async def commit_transfer(self, pool_id: str, transfer_id: str, abort: bool = False) -> StepResult:
        msg = pb.CommitTransferRequest(pool_id=pool_id, transfer_id=transfer_id, abort=abort)
        return decode_step_result(await self._mutate(self.stub.CommitTransfer, msg))

    async def get_request(self, pool_id: str, request_id: str) -> RequestInfo:
        return self.request_info(await self._call(self.stub.GetRequest,
                                                  pb.GetRequestRequest(pool_id=pool_id, request_id=request_id)))

    async def lookup(self, token_ids: Sequence[int] | None = None, block_hashes: Sequence[bytes] | None = None,
                     num_tokens: int = 0, cache_salt: str | None = None, lora_name: str | None = None,
                     pool_ids: Sequence[str] = ()) -> LookupResult:
        msg = self.lookup_msg(token_ids, block_hashes, num_tokens, cache_salt, lora_name, pool_ids)
        return self.lookup_result(await self._call(self.stub.Lookup, msg))

    async def heartbeat(self) -> None:
        await self._call(self.stub.Heartbeat, pb.HeartbeatRequest(session_id=self.session_id))

    async def get_stats(self, check_invariants: bool = False) -> Stats:
        return self.stats(await self._call(self.stub.GetStats, pb.GetStatsRequest(check_invariants=check_invariants)))

    async def reset_prefix_cache(self, pool_ids: Sequence[str] = ()) -> tuple[list[str], list[str]]:
        r = await self._call(self.stub.ResetPrefixCache, pb.ResetPrefixCacheRequest(pool_ids=list(pool_ids)))
        return list(r.reset_pool_ids), list(r.refused_pool_ids)

    async def watch_events(self, pool_ids: Sequence[str] = (),
                           start_sequence: int | None = None) -> AsyncIterator[Event]:
        msg = pb.WatchEventsRequest(pool_ids=list(pool_ids))
        if start_sequence is not None:
            msg.start_sequence = start_sequence
        try:
            async for e in self.stub.WatchEvents(msg, metadata=self.metadata):
                yield self.event(e)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def hash_prompt(self, token_ids: Sequence[int], cache_salt: str | None = None,
                    lora_name: str | None = None) -> list[bytes]:
        return hash_prompt(token_ids, self.hash_block_size, self.hash_seed, cache_salt, lora_name)


__all__ = ["AddRequestOp", "AllocateOp", "AsyncKVServiceClient", "Event", "ForkOp", "FreeOp", "KVServiceClient",
           "KVServiceError", "LookupResult", "PoolStats", "RequestInfo", "Stats"]

"""What both clients share: the channel, the session's sequence numbers, and every RPC written once.

Each API method builds a `Call` (the RPC's name, its request, how to decode the reply, whether it is a
mutation) and hands it to `_run`, which the blocking client runs to the result and the asyncio client
returns as a coroutine. So `client.step(...)` and `await aclient.step(...)` are the same method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice._proto import allocator_pb2_grpc as pb_grpc
from kvservice.core import KVCacheConfig
from kvservice.hashing import DEFAULT_HASH_BLOCK_SIZE, DEFAULT_HASH_SEED, hash_prompt, spec_fingerprint
from kvservice.ops import AddRequestOp, AllocateOp, Op
from kvservice.results import SessionOpened
from kvservice.wire import encode, replies
from kvservice.wire.framing import serialize_step

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Allocator"].full_name


@dataclass(slots=True, frozen=True)
class Call:
    method: str  # the Allocator RPC
    request: Any
    decode: Callable[[Any], Any]
    mutating: bool = False  # carries the session's next sequence (opened on first use)


def channel_credentials(tls_ca: str | None, tls_cert: str | None, tls_key: str | None):
    read = lambda p: Path(p).read_bytes() if p else None
    return grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))


def _stats(r: pb.GetStatsResponse):
    return replies.decode_stats(r)


class ClientBase:
    """Options: client_name, tls_ca / tls_cert / tls_key (TLS, mutual with a cert), timeout_s (10),
    retries (4), hash_seed, hash_block_size (the server's hash spec), max_message_bytes, heartbeat
    (True: renew the session's lease in the background while the client is open)."""

    def _setup(self, grpc_module, target: str, token: str | None, *, client_name: str = "",
               tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
               timeout_s: float = 10.0, retries: int = 4, hash_seed: str = DEFAULT_HASH_SEED,
               hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE, max_message_bytes: int = 64 * 1024 * 1024,
               heartbeat: bool = True) -> None:
        """`grpc_module` is grpc (blocking) or grpc.aio."""
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if tls_ca or tls_cert:
            creds = channel_credentials(tls_ca, tls_cert, tls_key)
            self.channel = grpc_module.secure_channel(target, creds, options)
        else:
            self.channel = grpc_module.insecure_channel(target, options)
        self.target = target
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
        self.heartbeat_enabled = heartbeat
        self.session_id = ""
        self.next_sequence = 1
        self.tenant = ""
        self.ttl_s = 0.0
        # A mutation sent but never acknowledged (the reply was lost): its sequence survives a resume, so
        # sending it again gets the stored reply instead of applying it twice.
        self.unacked_sequence = 0

    def _run(self, call: Call):  # pragma: no cover - each client defines it
        raise NotImplementedError

    # ---- session bookkeeping -------------------------------------------------------------------
    def _session_request(self, resume: bool) -> pb.OpenSessionRequest:
        msg = pb.OpenSessionRequest(client_name=self.client_name)
        if resume and self.session_id:
            msg.resume_session_id = self.session_id
            msg.last_acked_sequence = self.next_sequence - 1  # an unacknowledged one is next_sequence itself
        return msg

    def _adopt_session(self, r: pb.OpenSessionResponse) -> SessionOpened:
        opened = replies.decode_session_opened(r)
        pending = self.unacked_sequence
        resumed = opened.session_id == self.session_id
        self.session_id, self.tenant, self.ttl_s = opened.session_id, opened.tenant, opened.ttl_ms / 1000
        if resumed and pending and opened.next_sequence in (pending, pending + 1):
            self.next_sequence = pending  # resend that request as it was: applied or not, it applies once
        else:
            self.next_sequence = opened.next_sequence
            self.unacked_sequence = 0
        return opened

    def _stamp(self, request) -> None:
        request.session_id = self.session_id
        request.sequence = self.next_sequence

    def _acked(self) -> None:
        self.next_sequence += 1
        self.unacked_sequence = 0

    def _unacked(self, err: grpc.RpcError) -> None:
        """A mutation failed: if the transport failed (not the server refusing it), it may have been applied."""
        if err.code() in RETRYABLE:
            self.unacked_sequence = self.next_sequence

    # ---- the API -------------------------------------------------------------------------------
    def open_session(self, resume: bool = False):
        """Opens a session (or resumes this client's after a restart of the server: its pools start new
        epochs if the server's state is behind what this client saw acknowledged)."""
        return self._run(Call("OpenSession", self._session_request(resume), self._adopt_session))

    def register_pool(self, pool_id: str, config: KVCacheConfig, max_model_len: int, epoch: int = 0,
                      dcp_world_size: int = 1, enable_caching: bool = True, vocab_size: int = 0,
                      kv_layout: str = ""):
        msg = encode.register_request(pool_id, config, max_model_len, epoch, dcp_world_size, enable_caching,
                                      vocab_size, kv_layout, spec_fingerprint(self.hash_seed, self.hash_block_size))
        return self._run(Call("RegisterPool", msg, replies.decode_register_result, True))

    def step(self, pool_id: str, ops: Sequence[Op]):
        return self._run(Call("Step", encode.step_request(pool_id, ops), replies.decode_step_result, True))

    def allocate(self, pool_id: str, op: AllocateOp, add: AddRequestOp | None = None):
        return self._run(Call("Allocate", encode.allocate_request(pool_id, op, add), replies.decode_step_result,
                              True))

    def free(self, pool_id: str, *request_ids: str):
        msg = pb.FreeRequest(pool_id=pool_id, request_ids=list(request_ids))
        return self._run(Call("Free", msg, replies.decode_step_result, True))

    def fork(self, pool_id: str, parent_request_id: str, *child_request_ids: str):
        msg = pb.ForkRequest(pool_id=pool_id, parent_request_id=parent_request_id,
                             child_request_ids=list(child_request_ids))
        return self._run(Call("Fork", msg, replies.decode_step_result, True))

    def commit_transfer(self, pool_id: str, transfer_id: str, abort: bool = False):
        """After the workers copied a transfer order's blocks: commit (they become cached here) or abort."""
        msg = pb.CommitTransferRequest(pool_id=pool_id, transfer_id=transfer_id, abort=abort)
        return self._run(Call("CommitTransfer", msg, replies.decode_step_result, True))

    def get_request(self, pool_id: str, request_id: str):
        msg = pb.GetRequestRequest(pool_id=pool_id, request_id=request_id)
        return self._run(Call("GetRequest", msg, replies.decode_request_info))

    def lookup(self, token_ids: Sequence[int] | None = None, block_hashes: Sequence[bytes] | None = None,
               num_tokens: int = 0, cache_salt: str | None = None, lora_name: str | None = None,
               pool_ids: Sequence[str] = ()):
        msg = encode.lookup_request(token_ids, block_hashes, num_tokens, cache_salt, lora_name, pool_ids)
        return self._run(Call("Lookup", msg, replies.decode_lookup))

    def heartbeat(self):
        """Renews the session's lease (the client does this in the background while it is open)."""
        return self._run(Call("Heartbeat", pb.HeartbeatRequest(session_id=self.session_id), lambda r: None))

    def get_stats(self, check_invariants: bool = False, include_state_digest: bool = False):
        msg = pb.GetStatsRequest(check_invariants=check_invariants, include_state_digest=include_state_digest)
        return self._run(Call("GetStats", msg, _stats))

    def reset_prefix_cache(self, pool_ids: Sequence[str] = ()):
        msg = pb.ResetPrefixCacheRequest(pool_ids=list(pool_ids))
        return self._run(Call("ResetPrefixCache", msg, lambda r: (list(r.reset_pool_ids), list(r.refused_pool_ids))))

    # ---- external pools: stock vLLM engines indexed from their KV events (idempotent: no session) ----
    def register_external_pool(self, pool_id: str, endpoint: str, replay_endpoint: str = "", block_size: int = 16,
                               hash_algo: str = "sha256", hash_seed: str | None = None, bind: bool = False,
                               topic: str = "", max_blocks: int = 0):
        """Subscribes the allocator to a vLLM engine's KV events (its --kv-events-config `endpoint` and
        `replay_endpoint`); its blocks then answer Lookup as pool `pool_id`. Returns (registration, new)."""
        spec = pb.ExternalPoolSpec(pool_id=pool_id, endpoint=endpoint, replay_endpoint=replay_endpoint,
                                   block_size=block_size, hash_algo=hash_algo, hash_seed=hash_seed or "",
                                   has_hash_seed=hash_seed is not None, bind=bind, topic=topic, max_blocks=max_blocks)
        return self._run(Call("RegisterExternalPool", pb.RegisterExternalPoolRequest(spec=spec),
                              lambda r: (r.registration, r.new_registration)))

    def remove_external_pool(self, pool_id: str):
        return self._run(Call("RemoveExternalPool", pb.RemoveExternalPoolRequest(pool_id=pool_id), lambda r: None))

    def hash_prompt(self, token_ids: Sequence[int], cache_salt: str | None = None,
                    lora_name: str | None = None) -> list[bytes]:
        """Block hashes exactly as the server computes them (to add requests by hashes)."""
        return hash_prompt(token_ids, self.hash_block_size, self.hash_seed, cache_salt, lora_name)

    @staticmethod
    def _watch_request(pool_ids: Sequence[str], start_sequence: int | None) -> pb.WatchEventsRequest:
        msg = pb.WatchEventsRequest(pool_ids=list(pool_ids))
        if start_sequence is not None:
            msg.start_sequence = start_sequence
        return msg

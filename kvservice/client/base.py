"""What both clients share: the connections (one per shard), the session's sequence numbers (kept by
kvservice.client.sessions), and every RPC written once.

Each API method builds a `Call` (the RPC's name, its request, how to decode the reply, whether it is a
mutation, the pool it is about) and hands it to `_run`, which the blocking client runs to the result and
the asyncio client returns as a coroutine. So `client.step(...)` and `await aclient.step(...)` are the same
method. Against a sharded allocator a call goes to the shard serving its pool (`routing.Shards`); calls
about no pool in particular (GetStats, Lookup, ResetPrefixCache) go to every shard and are merged. A
`partial` one (Lookup) answers from the shards that answered: a shard down or silent for `fan_out_grace_s`
past the others' answers is named in the result (`missing_shards`) and counted (`unanswered_lookups`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice.client.routing import (
    SERVICE_NAME,
    Conn,
    ConnectionReplaced,
    Shards,
    channel_credentials,
    channel_options,
)
from kvservice.client.sessions import SessionSequences
from kvservice.commands import VllmOptions
from kvservice.core import KVCacheConfig
from kvservice.errors import InvalidArgument, KVServiceError
from kvservice.hashing import DEFAULT_HASH_BLOCK_SIZE, DEFAULT_HASH_SEED, HashSpec, hash_prompt, spec_fingerprint
from kvservice.ops import AddRequestOp, AllocateOp, Op
from kvservice.results import LookupResult, Stats, best_pool
from kvservice.wire import encode, replies

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
MAX_HOPS = 4  # redirects (and failovers) one call follows
FAILOVER_POLL_S = 0.1  # a call that found its shard down asks for the map this often, until it changes
FAILOVER_RETRY_S = 1.0  # ... and is retried after this long even if it did not (a move called off)
__all__ = ["RETRYABLE", "SERVICE_NAME", "Call", "ClientBase", "ConnectionReplaced"]


@dataclass(slots=True, frozen=True)
class Call:
    method: str  # the Allocator RPC
    request: Any
    decode: Callable[[Any], Any]
    mutating: bool = False  # carries the session's next sequence on its shard (the session opens on first use)
    pool_id: str | None = None  # routes it to the pool's shard
    conn: Conn | None = None  # pins it to one connection
    merge: Callable[[list], Any] | None = None  # about no pool: run on every shard, merge the results
    per_shard: Callable[[Conn], Any] | None = None  # with merge: the request for one shard (None: skip it)
    always_merge: bool = False  # merge an unsharded allocator's one result too
    # with merge, sharded: a shard that is down, or silent for fan_out_grace_s past the others' answers, is
    # left out instead of waited for; merge(answers, missing) gets {shard: result}, {shard: KVServiceError}
    partial: bool = False
    locate: tuple[str, ...] = ()  # pools to find first when no map names them (external pools: GetStats)


_SEVERITY = ["ok", "off", "resyncing", "degraded", "down", "fenced"]


def merge_stats(parts: list[Stats]) -> Stats:
    """GetStats over every shard: their pools, sessions and counters together, the worst persistence state."""
    first = parts[0]
    out = replace(first, pools={}, num_sessions=0, lease_expiries=0, external_pools={})
    for s in parts:
        for pool_id, pool in s.pools.items():  # a copy a move froze (moving_to) never hides the serving one
            if pool_id not in out.pools or out.pools[pool_id].moving_to:
                out.pools[pool_id] = pool
        out.external_pools.update(s.external_pools)
        out.num_sessions += s.num_sessions
        out.lease_expiries += s.lease_expiries
        if _SEVERITY.index(s.persistence if s.persistence in _SEVERITY else "down") > _SEVERITY.index(
                out.persistence if out.persistence in _SEVERITY else "down"):
            out.persistence = s.persistence
    return out


class ClientBase(SessionSequences):
    """Options: client_name, tls_ca / tls_cert / tls_key (TLS, mutual with a cert), timeout_s (10),
    retries (4), hash_seed, hash_block_size (the server's hash spec), max_message_bytes, heartbeat
    (True: renew the session's lease in the background while the client is open), failover_timeout_s (15:
    how long a call waits for a failed shard's standby to take over), fan_out_grace_s (0.5: how long a
    Lookup over the shards waits for those that have not answered once the others have; they are then
    named in `LookupResult.missing_shards` and counted in `unanswered_lookups`)."""

    def _setup(self, grpc_module, target: str, token: str | None, *, client_name: str = "",
               tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
               timeout_s: float = 10.0, retries: int = 4, hash_seed: str = DEFAULT_HASH_SEED,
               hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE, max_message_bytes: int = 64 * 1024 * 1024,
               heartbeat: bool = True, failover_timeout_s: float = 15.0, fan_out_grace_s: float = 0.5) -> None:
        """`grpc_module` is grpc (blocking) or grpc.aio; `target` any shard (or the only allocator), or several
        comma-separated addresses (an allocator and its standbys)."""
        options = channel_options(max_message_bytes)
        if tls_ca or tls_cert:
            creds = channel_credentials(tls_ca, tls_cert, tls_key)
            make = lambda address: grpc_module.secure_channel(address, creds, options)
        else:
            make = lambda address: grpc_module.insecure_channel(address, options)
        self.shards = Shards.start(target, make)
        self.target = target
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.client_name = client_name
        self.timeout_s = timeout_s
        self.retries = retries
        self.hash_seed = hash_seed
        self.hash_block_size = hash_block_size
        self.heartbeat_enabled = heartbeat
        self.failover_timeout_s = failover_timeout_s
        self.fan_out_grace_s = fan_out_grace_s
        self.unanswered_lookups: Counter[str] = Counter()  # shard id -> Lookups answered without it
        self.session_id = ""
        self.tenant = ""
        self.ttl_s = 0.0

    # The first (or only) shard's connection, as the unsharded client always had it.
    @property
    def channel(self):
        return self.shards.seed.channel

    @property
    def stub(self):
        return self.shards.seed.stub

    @property
    def next_sequence(self) -> int:
        return self.shards.seed.next_sequence

    @next_sequence.setter
    def next_sequence(self, value: int) -> None:
        self.shards.seed.next_sequence = value

    @property
    def unacked_sequence(self) -> int:
        return self.shards.seed.unacked_sequence

    def _run(self, call: Call):  # pragma: no cover - each client defines it
        raise NotImplementedError

    def _merge(self, call: Call, outcomes: list[tuple[Conn, Any]]):
        """A fan-out's results (a partial call's failed shards: their KVServiceError) merged. GetStats replies
        also say where each external pool lives (the shard map does not)."""
        for conn, value in outcomes:
            if isinstance(value, Stats) and self.shards.sharded:
                self.shards.external.update(dict.fromkeys(value.external_pools, conn.shard_id))
        if not call.partial:
            return call.merge([value for _, value in outcomes])
        answers = {c.shard_id: v for c, v in outcomes if not isinstance(v, KVServiceError)}
        missing = {c.shard_id: v for c, v in outcomes if isinstance(v, KVServiceError)}
        if missing and not answers:
            raise next(iter(missing.values()))
        if call.method == "Lookup":
            self.unanswered_lookups.update(list(missing))
        return call.merge(answers, missing)

    # ---- sessions (sequence bookkeeping: kvservice.client.sessions) ------------------------------
    def _session_call(self, conn: Conn, fresh: bool = False) -> Call:
        """OpenSession on `conn`: a new session (`fresh`, or none yet), else this one resumed there (attached,
        on a shard that does not know it yet)."""
        msg = pb.OpenSessionRequest(client_name=self.client_name)
        if self.session_id and not fresh:
            msg.resume_session_id = self.session_id
            # (a mutation whose reply was lost is not acknowledged, even once the server said it applied it)
            msg.last_acked_sequence = (conn.unacked_sequence or conn.next_sequence) - 1
            msg.attach = self.shards.sharded
        return Call("OpenSession", msg, lambda r: self._adopt_session(conn, r), conn=conn)

    @staticmethod
    def _may_fail_over(exc: Exception) -> bool:
        """An UNAVAILABLE a failover may cure: a lost connection, a standby, a fenced leader; not a server
        refusing mutations while its persistence is down (every such refusal names persistence)."""
        return "persistence" not in str(exc)

    # ---- the API -------------------------------------------------------------------------------
    def open_session(self, resume: bool = False):
        """Opens a session (or resumes this client's after a restart of the server: its pools start new
        epochs if the server's state is behind what this client saw acknowledged). Sharded: on the first
        shard now, on the others when first used (a resume marks them for resuming too)."""
        for conn in self.shards.all():
            if resume:
                conn.stale = conn.attached
            else:
                conn.attached = conn.stale = False  # a new session: every shard opens (attaches) it anew
                conn.next_sequence, conn.unacked_sequence = 1, 0
        return self._run(self._session_call(self.shards.seed, fresh=not resume))

    def continue_session(self, session_id: str, next_sequence: int) -> None:
        """Goes on with a session another client (a restarted process, say) had open on this allocator (its
        first shard): the next mutation carries `next_sequence` as it is, so resending an unacknowledged
        request gets its stored reply. No call is made."""
        self.session_id = session_id
        seed = self.shards.seed
        seed.attached, seed.stale, seed.next_sequence, seed.unacked_sequence = True, False, next_sequence, 0

    def register_pool(self, pool_id: str, config: KVCacheConfig, max_model_len: int, epoch: int = 0,
                      dcp_world_size: int = 1, enable_caching: bool = True, vocab_size: int = 0,
                      kv_layout: str = "", hash_spec: HashSpec | None = None, vllm: VllmOptions | None = None,
                      bound_to_session: bool = False, suspend_on_session_end: bool = False,
                      endpoint: bytes = b""):
        """`hash_spec`: the chain this pool's requests are hashed with (None: kvservice's own with this
        client's hash_seed); its block size must be the allocator's hash block size. `vllm`: the pool
        follows vLLM 0.33.0's KVCacheManager semantics (AllocateOp's vLLM fields). `bound_to_session`: the
        pool's memory lives in this process (a KV store): when this session ends, the pool is retired (a new
        epoch, empty). `suspend_on_session_end` (with `bound_to_session`): its pages outlive the process (a
        store's disk tier): when this session ends the pool is suspended instead (kept, but no hit and no
        allocation), and registering it again at the same epoch resumes it. `endpoint` (at most 64 KiB): how
        engines reach the pool's memory (a store's NIXL agent metadata), handed only to this tenant's callers
        in `PoolStats.endpoint`; registering again at the same epoch with another replaces it, nothing else."""
        fingerprint = spec_fingerprint(self.hash_seed, self.hash_block_size) if hash_spec is None \
            else hash_spec.fingerprint()
        msg = encode.register_request(pool_id, config, max_model_len, epoch, dcp_world_size, enable_caching,
                                      vocab_size, kv_layout, fingerprint, hash_spec, vllm, bound_to_session,
                                      suspend_on_session_end, endpoint)
        return self._run(Call("RegisterPool", msg, replies.decode_register_result, True, pool_id))

    def step(self, pool_id: str, ops: Sequence[Op]):
        return self._run(Call("Step", encode.step_request(pool_id, ops), replies.decode_step_result, True, pool_id))

    def allocate(self, pool_id: str, op: AllocateOp, add: AddRequestOp | None = None):
        return self._run(Call("Allocate", encode.allocate_request(pool_id, op, add), replies.decode_step_result,
                              True, pool_id))

    def free(self, pool_id: str, *request_ids: str):
        msg = pb.FreeRequest(pool_id=pool_id, request_ids=list(request_ids))
        return self._run(Call("Free", msg, replies.decode_step_result, True, pool_id))

    def fork(self, pool_id: str, parent_request_id: str, *child_request_ids: str):
        msg = pb.ForkRequest(pool_id=pool_id, parent_request_id=parent_request_id,
                             child_request_ids=list(child_request_ids))
        return self._run(Call("Fork", msg, replies.decode_step_result, True, pool_id))

    def commit_transfer(self, pool_id: str, transfer_id: str, abort: bool = False):
        """After the workers copied a transfer order's blocks: commit (they become cached here) or abort."""
        msg = pb.CommitTransferRequest(pool_id=pool_id, transfer_id=transfer_id, abort=abort)
        return self._run(Call("CommitTransfer", msg, replies.decode_step_result, True, pool_id))

    def get_request(self, pool_id: str, request_id: str):
        msg = pb.GetRequestRequest(pool_id=pool_id, request_id=request_id)
        return self._run(Call("GetRequest", msg, replies.decode_request_info, pool_id=pool_id))

    def lookup(self, token_ids: Sequence[int] | None = None, block_hashes: Sequence[bytes] | None = None,
               num_tokens: int = 0, cache_salt: str | None = None, lora_name: str | None = None,
               pool_ids: Sequence[str] = ()):
        """Per pool (this tenant's; `pool_ids`: these), the prefix tokens cached, and where a KV-aware router
        sends the prompt. Sharded: every shard answers for its pools, the best pool is chosen over all; a
        shard down (or `fan_out_grace_s` slower than the others) is left out and named in `missing_shards`
        (UNAVAILABLE only when no shard answered)."""
        msg = encode.lookup_request(token_ids, block_hashes, num_tokens, cache_salt, lora_name, pool_ids)

        def per_shard(conn: Conn):
            if not pool_ids:
                return msg
            mine = [p for p in pool_ids if self.shards.conn_for(p) is conn]
            return encode.lookup_request(token_ids, block_hashes, num_tokens, cache_salt, lora_name, mine) \
                if mine else None

        def merge(answers: dict[str, LookupResult], missing: dict) -> LookupResult:
            hits = [h for part in answers.values() for h in part.hits]
            first = block_hashes[0] if block_hashes else (self.hash_prompt(token_ids[:self.hash_block_size],
                                                                           cache_salt, lora_name) or [None])[0]
            return LookupResult(hits, best_pool(hits, first), sorted(missing))

        return self._run(Call("Lookup", msg, replies.decode_lookup, merge=merge, per_shard=per_shard, partial=True,
                              locate=tuple(pool_ids)))

    def heartbeat(self):
        """Renews the session's lease (the client does this in the background while it is open)."""
        return self._run(Call("Heartbeat", pb.HeartbeatRequest(session_id=self.session_id), lambda r: None,
                              merge=lambda parts: None,
                              per_shard=lambda conn: pb.HeartbeatRequest(session_id=self.session_id)
                              if conn.attached else None))

    def get_stats(self, check_invariants: bool = False, include_state_digest: bool = False,
                  pool_ids: Sequence[str] = ()):
        """The allocator's stats; `pool_ids`: only those pools' (default: every pool the caller sees)."""
        msg = pb.GetStatsRequest(check_invariants=check_invariants, include_state_digest=include_state_digest,
                                 pool_ids=list(pool_ids))
        return self._run(Call("GetStats", msg, replies.decode_stats, merge=merge_stats))

    def shard_stats(self, check_invariants: bool = False, missing_ok: bool = False):
        """GetStats of each shard on its own: shard id -> Stats ("" for an unsharded allocator). `missing_ok`:
        a shard that did not answer maps to its error (a KVServiceError) instead of failing the call."""
        msg = pb.GetStatsRequest(check_invariants=check_invariants)
        if missing_ok:
            return self._run(Call("GetStats", msg, replies.decode_stats, always_merge=True, partial=True,
                                  merge=lambda answers, missing: {c.shard_id: answers.get(c.shard_id,
                                                                                         missing.get(c.shard_id))
                                                                  for c in self.shards.all()}))
        return self._run(Call("GetStats", msg, replies.decode_stats, always_merge=True,
                              merge=lambda parts: dict(zip((c.shard_id for c in self.shards.all()), parts))))

    def reset_prefix_cache(self, pool_ids: Sequence[str] = ()):
        msg = pb.ResetPrefixCacheRequest(pool_ids=list(pool_ids))

        def per_shard(conn: Conn):
            mine = [p for p in pool_ids if self.shards.conn_for(p) is conn]
            return pb.ResetPrefixCacheRequest(pool_ids=mine) if mine or not pool_ids else None

        return self._run(Call("ResetPrefixCache", msg, lambda r: (list(r.reset_pool_ids), list(r.refused_pool_ids)),
                              merge=lambda parts: ([p for d, _ in parts for p in d], [p for _, r in parts for p in r]),
                              per_shard=per_shard, locate=tuple(pool_ids)))

    def shard_map(self) -> pb.ShardMapResponse:
        """The shard map (unsharded: one unnamed shard), from the first shard (or, failing it, another)."""
        return self._run(Call("GetShardMap", pb.GetShardMapRequest(), lambda r: r))

    # ---- external pools: stock vLLM engines indexed from their KV events (idempotent: no session) ----
    def register_external_pool(self, pool_id: str, endpoint: str, replay_endpoint: str = "", block_size: int = 16,
                               hash_algo: str = "sha256", hash_seed: str | None = None, bind: bool = False,
                               topic: str = "", max_blocks: int = 0):
        """Subscribes the allocator to a vLLM engine's KV events (its --kv-events-config `endpoint` and
        `replay_endpoint`); its blocks then answer Lookup as pool `pool_id`. Returns (registration, new).
        Sharded: on the shard already subscribed to `pool_id` (a re-registration), else the first shard."""
        spec = pb.ExternalPoolSpec(pool_id=pool_id, endpoint=endpoint, replay_endpoint=replay_endpoint,
                                   block_size=block_size, hash_algo=hash_algo, hash_seed=hash_seed or "",
                                   has_hash_seed=hash_seed is not None, bind=bind, topic=topic, max_blocks=max_blocks)
        return self._run(Call("RegisterExternalPool", pb.RegisterExternalPoolRequest(spec=spec),
                              lambda r: (r.registration, r.new_registration), pool_id=pool_id, locate=(pool_id,)))

    def remove_external_pool(self, pool_id: str):
        """Sharded: on the shard subscribed to it (GetStats over the shards says which)."""
        return self._run(Call("RemoveExternalPool", pb.RemoveExternalPoolRequest(pool_id=pool_id),
                              lambda r: self.shards.external.pop(pool_id, None) and None, pool_id=pool_id,
                              locate=(pool_id,)))

    def hash_prompt(self, token_ids: Sequence[int], cache_salt: str | None = None,
                    lora_name: str | None = None) -> list[bytes]:
        """Block hashes exactly as the server computes them (to add requests by hashes)."""
        return hash_prompt(token_ids, self.hash_block_size, self.hash_seed, cache_salt, lora_name)

    def _watch_target(self, pool_ids: Sequence[str], shard_id: str | None = None) -> Conn:
        if shard_id is not None:
            if not self.shards.sharded:
                return self.shards.seed
            conn = self.shards.conns.get(shard_id)
            if conn is None:
                raise InvalidArgument("shard_id", shard_id, f"not a shard of this allocator (shards: "
                                      f"{', '.join(sorted(self.shards.conns)) or 'none'})")
            return conn
        conns = {id(self.shards.conn_for(p)): self.shards.conn_for(p) for p in pool_ids}
        if len(conns) > 1:
            raise InvalidArgument("pool_ids", list(pool_ids), "these pools are on different shards; event "
                                  "sequences are per shard: watch each shard's pools in a stream of its own")
        return next(iter(conns.values())) if conns else self.shards.seed

    @staticmethod
    def _watch_request(pool_ids: Sequence[str], start_sequence: int | None,
                       include_state: bool = False) -> pb.WatchEventsRequest:
        msg = pb.WatchEventsRequest(pool_ids=list(pool_ids), include_state=include_state)
        if start_sequence is not None:
            msg.start_sequence = start_sequence
        return msg

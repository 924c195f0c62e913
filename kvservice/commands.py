"""Commands: one typed record per mutation of the allocator's state.

    gRPC request --wire.decode--> Command --Allocator.apply--> reply --journal (WAL)--> encoded reply
    WAL entry   --store.wal.decode--> Command --Allocator.apply--> (recovery, the standby snapshotter)

Every mutation takes this one path, live and in replay, so the rebuilt state equals the lost one. A
sequenced command (it carries a session's sequence number) is answered again, unchanged, when retried
with the same sequence and the same body; `wire` is the request as it arrived, which the WAL keeps and
whose digest tells a retry from a different request reusing the sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum

import xxhash

from kvservice.core import KVCacheConfig
from kvservice.external.spec import ExternalSpec
from kvservice.hashing import HASH_BYTES, HashSpec
from kvservice.ops import Op


class CommandKind(IntEnum):
    """The WAL's entry kinds (stored as numbers: never renumber)."""

    OPEN_SESSION = 1
    REGISTER_POOL = 2
    STEP = 3
    COMMIT_TRANSFER = 4
    EXPIRE_SESSIONS = 5
    RESET_PREFIX_CACHE = 6
    RETIRE_POOLS = 7
    BARRIER = 8
    FREEZE_POOL = 9
    THAW_POOL = 10
    DROP_POOL = 11
    IMPORT_POOL = 12
    # External pools (kvservice.external), numbered apart from the core kinds above.
    REGISTER_EXTERNAL_POOL = 20
    REMOVE_EXTERNAL_POOL = 21
    INGEST_EVENTS = 22


class StepRpc(IntEnum):
    """Which RPC carried a Step's ops (the WAL re-parses the request bytes as that message)."""

    STEP = 0
    ALLOCATE = 1
    FREE = 2
    FORK = 3


@dataclass(slots=True, frozen=True)
class VllmOptions:
    """A pool with vLLM 0.33.0's KVCacheManager semantics (its AllocateOps are vLLM's allocate_slots calls),
    with the settings of vLLM's that decide allocations."""

    watermark: float = 0.0
    scheduler_block_size: int = 0  # 0: the LCM of the groups' block sizes
    max_in_flight_tokens: int = 0  # 0: max_model_len
    use_eagle: bool = False  # EAGLE's block drop (a hit gives back its last block)
    num_hash_lookahead_tokens: int = 0  # tokens past each block its hash covers
    num_prefill_lookahead: int = 0  # vLLM's num_prefill_lookahead_tokens (MTP prefill lookahead)
    mamba_recache_keyed_tails: bool = False  # vLLM 0.32's MambaManager (0.33's skips an already-keyed tail)
    mamba_shared_prefix_checkpoint: bool = False  # vLLM's enable_mamba_shared_prefix_checkpoint


@dataclass(slots=True)
class PoolSpec:
    """What RegisterPool declares about one KV memory space."""

    pool_id: str
    config: KVCacheConfig
    max_model_len: int
    dcp_world_size: int = 1
    enable_caching: bool = True
    vocab_size: int = 0
    kv_layout: str = ""
    epoch: int = 0
    hash_spec: HashSpec | None = None  # None: kvservice's own with the allocator's seed
    vllm: VllmOptions | None = None  # None: kvservice's semantics
    bound_to_session: bool = False  # retired when the registering session ends (a KV store's pages)
    # With bound_to_session: suspended instead of retired when that session ends (pages on disk outlive it)
    suspend_on_session_end: bool = False
    # How engines reach its memory (a store's NIXL agent metadata), opaque here: a capability only its tenant
    # is handed. Not part of its shape: registering again at the same epoch replaces it, nothing else changes.
    endpoint: bytes = b""

    @property
    def hash_bytes(self) -> int:
        """The length of this pool's block hashes on the wire."""
        return HASH_BYTES if self.hash_spec is None else self.hash_spec.hash_bytes

    def same_shape(self, other: PoolSpec) -> bool:
        return (self.config == other.config and self.max_model_len == other.max_model_len
                and self.dcp_world_size == other.dcp_world_size and self.enable_caching == other.enable_caching
                and self.vocab_size == other.vocab_size and self.kv_layout == other.kv_layout
                and self.vllm == other.vllm and self.bound_to_session == other.bound_to_session
                and self.suspend_on_session_end == other.suspend_on_session_end)

    def with_epoch(self, epoch: int) -> PoolSpec:
        return replace(self, epoch=epoch)


# Decodes a Step's ops once its pool is known (its limits validate them): (pool spec, hash block size) -> ops.
OpsDecoder = Callable[[PoolSpec, int], list[Op]]


def digest(wire: bytes) -> int:
    """The body identity of a sequenced request (0: unknown, e.g. built in process: never compared)."""
    return xxhash.xxh3_64_intdigest(wire) | 1 if wire else 0


@dataclass(slots=True)
class OpenSession:
    """A new session, or the resumption of `resume_session_id` by a client that saw `last_acked_sequence`
    acknowledged: if the state is behind that, the pools it used start new epochs."""

    session_id: str
    tenant: str
    client_name: str = ""
    resume_session_id: str = ""
    last_acked_sequence: int = 0
    resume_pool_ids: Sequence[str] = ()
    admin: bool = True
    attach: bool = False  # resume_session_id unknown here: open it under that id (one id on every shard)
    kind = CommandKind.OPEN_SESSION


@dataclass(slots=True)
class RegisterPool:
    session_id: str
    tenant: str
    sequence: int
    spec: PoolSpec
    fingerprint: str
    admin: bool = True
    wire: bytes = b""
    kind = CommandKind.REGISTER_POOL


@dataclass(slots=True)
class Step:
    """Ops applied in order to one pool (the Step, Allocate, Free and Fork RPCs alike)."""

    session_id: str
    tenant: str
    sequence: int
    pool_id: str
    ops: Sequence[Op] | OpsDecoder
    rpc: StepRpc = StepRpc.STEP
    wire: bytes = b""
    admin: bool = True  # an admin may step on any tenant's pool; others only on their own
    # True only where the sources were checked: by the server (on their shards), or when decoded from the WAL
    # (journaled after that check). Left False, transfer sources on pools not held here are not trusted.
    remote_sources_checked: bool = False
    kind = CommandKind.STEP

    def decode_ops(self, spec: PoolSpec, hash_block_size: int) -> Sequence[Op]:
        return self.ops(spec, hash_block_size) if callable(self.ops) else self.ops


@dataclass(slots=True)
class CommitTransfer:
    session_id: str
    tenant: str
    sequence: int
    pool_id: str
    transfer_id: str
    abort: bool = False
    wire: bytes = b""
    admin: bool = True
    kind = CommandKind.COMMIT_TRANSFER


@dataclass(slots=True)
class ExpireSessions:
    """Sessions whose lease lapsed (chosen by the server's clock; replay frees the same ones)."""

    session_ids: list[str] = field(default_factory=list)
    kind = CommandKind.EXPIRE_SESSIONS


@dataclass(slots=True)
class ResetPrefixCache:
    pool_ids: list[str] = field(default_factory=list)  # empty: every pool
    kind = CommandKind.RESET_PREFIX_CACHE


@dataclass(slots=True)
class RetirePools:
    """New epochs for these pools (what a stale resume did, in WAL entries written before OpenSession
    carried the resume)."""

    pool_ids: list[str] = field(default_factory=list)
    kind = CommandKind.RETIRE_POOLS


@dataclass(slots=True)
class Barrier:
    """Marks a WAL position (a snapshot covers what precedes it). `resync`: mutations acknowledged while
    Redis was away are not in the WAL before this point; only the resync snapshot covers them."""

    resync: bool = False
    kind = CommandKind.BARRIER


@dataclass(slots=True)
class FreezePool:
    """Rebalance, on the source shard: the pool takes no calls (UNAVAILABLE) while it moves to `to_shard`;
    its cross-pool transfers are aborted."""

    pool_id: str
    to_shard: str
    kind = CommandKind.FREEZE_POOL


@dataclass(slots=True)
class ThawPool:
    """Rebalance abandoned: the frozen pool serves again where it is."""

    pool_id: str
    kind = CommandKind.THAW_POOL


@dataclass(slots=True)
class DropPool:
    """Rebalance, on the source shard once the destination serves the pool: it leaves this state."""

    pool_id: str
    kind = CommandKind.DROP_POOL


# Decodes a PoolExport into the state (kvservice.store.snapshot.import_pool): (state, export bytes) -> pool id.
PoolImporter = Callable[[object, bytes], str]


@dataclass(slots=True)
class ImportPool:
    """Rebalance, on the destination shard: the pool (as the source exported it) joins this state."""

    pool_id: str
    export: bytes
    importer: PoolImporter
    kind = CommandKind.IMPORT_POOL


# ---- external pools (stock vLLM engines indexed from their KV events) ---------------------------------------
@dataclass(slots=True)
class RegisterExternalPool:
    """Registers (or, with another spec, replaces) an external pool; the same spec again changes nothing.
    Not sequenced: it is idempotent. `tenant` owns it."""

    tenant: str
    spec: ExternalSpec
    admin: bool = True
    kind = CommandKind.REGISTER_EXTERNAL_POOL


@dataclass(slots=True)
class RemoveExternalPool:
    tenant: str
    pool_id: str
    admin: bool = True
    kind = CommandKind.REMOVE_EXTERNAL_POOL


@dataclass(slots=True)
class IngestEvents:
    """Batches of one external pool's event stream, in order, as published (sequence, msgpack payload);
    `reset` (kvservice.external.pool.ResetKind) drops the index first. `registration` ties it to the
    registration whose subscription read them (a stale subscription's ingest is a no-op)."""

    pool_id: str
    registration: int
    frames: Sequence[tuple[int, bytes]]
    reset: int = 0
    kind = CommandKind.INGEST_EVENTS



Command = (OpenSession | RegisterPool | Step | CommitTransfer | ExpireSessions | ResetPrefixCache | RetirePools
           | Barrier | FreezePool | ThawPool | DropPool | ImportPool | RegisterExternalPool | RemoveExternalPool
           | IngestEvents)
Sequenced = RegisterPool | Step | CommitTransfer

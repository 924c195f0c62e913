from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WalEntry(_message.Message):
    __slots__ = ("legacy_kind", "session_id", "request", "tenant", "client_name", "session_ids", "pool_ids", "command", "rpc", "resync", "admin", "resume_session_id", "last_acked_sequence", "attach", "pool_export", "shard_id", "ingest")
    LEGACY_KIND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    RPC_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    RESUME_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_ACKED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    POOL_EXPORT_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    INGEST_FIELD_NUMBER: _ClassVar[int]
    legacy_kind: str
    session_id: str
    request: bytes
    tenant: str
    client_name: str
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    pool_ids: _containers.RepeatedScalarFieldContainer[str]
    command: int
    rpc: int
    resync: bool
    admin: bool
    resume_session_id: str
    last_acked_sequence: int
    attach: bool
    pool_export: bytes
    shard_id: str
    ingest: ExternalIngest
    def __init__(self, legacy_kind: _Optional[str] = ..., session_id: _Optional[str] = ..., request: _Optional[bytes] = ..., tenant: _Optional[str] = ..., client_name: _Optional[str] = ..., session_ids: _Optional[_Iterable[str]] = ..., pool_ids: _Optional[_Iterable[str]] = ..., command: _Optional[int] = ..., rpc: _Optional[int] = ..., resync: _Optional[bool] = ..., admin: _Optional[bool] = ..., resume_session_id: _Optional[str] = ..., last_acked_sequence: _Optional[int] = ..., attach: _Optional[bool] = ..., pool_export: _Optional[bytes] = ..., shard_id: _Optional[str] = ..., ingest: _Optional[_Union[ExternalIngest, _Mapping]] = ...) -> None: ...

class ExternalIngest(_message.Message):
    __slots__ = ("pool_id", "registration", "reset", "sequences", "payloads")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    registration: int
    reset: int
    sequences: _containers.RepeatedScalarFieldContainer[int]
    payloads: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool_id: _Optional[str] = ..., registration: _Optional[int] = ..., reset: _Optional[int] = ..., sequences: _Optional[_Iterable[int]] = ..., payloads: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExternalPoolState(_message.Message):
    __slots__ = ("spec", "owner_tenant", "registration", "epoch", "last_sequence", "last_digest", "index", "counters", "spec_status", "spec_message", "spec_checked", "spec_mismatches", "spec_chain")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    OWNER_TENANT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LAST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    SPEC_STATUS_FIELD_NUMBER: _ClassVar[int]
    SPEC_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SPEC_CHECKED_FIELD_NUMBER: _ClassVar[int]
    SPEC_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    SPEC_CHAIN_FIELD_NUMBER: _ClassVar[int]
    spec: bytes
    owner_tenant: str
    registration: int
    epoch: int
    last_sequence: int
    last_digest: int
    index: bytes
    counters: _containers.RepeatedScalarFieldContainer[int]
    spec_status: str
    spec_message: str
    spec_checked: int
    spec_mismatches: int
    spec_chain: bytes
    def __init__(self, spec: _Optional[bytes] = ..., owner_tenant: _Optional[str] = ..., registration: _Optional[int] = ..., epoch: _Optional[int] = ..., last_sequence: _Optional[int] = ..., last_digest: _Optional[int] = ..., index: _Optional[bytes] = ..., counters: _Optional[_Iterable[int]] = ..., spec_status: _Optional[str] = ..., spec_message: _Optional[str] = ..., spec_checked: _Optional[int] = ..., spec_mismatches: _Optional[int] = ..., spec_chain: _Optional[bytes] = ...) -> None: ...

class RequestState(_message.Message):
    __slots__ = ("key", "has_token_ids", "token_ids", "num_tokens", "num_prompt_tokens", "num_computed_tokens", "num_preemptions", "block_hashes", "namespace", "cache_salt", "has_cache_salt", "lora_name", "has_lora_name", "hash_seed", "mm_identifiers", "mm_offsets", "mm_lengths", "chain_tip", "owner", "block_size", "shared_prefix_boundary")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    HAS_CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    HAS_LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    MM_IDENTIFIERS_FIELD_NUMBER: _ClassVar[int]
    MM_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    MM_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_TIP_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    key: str
    has_token_ids: bool
    token_ids: bytes
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_preemptions: int
    block_hashes: bytes
    namespace: bytes
    cache_salt: str
    has_cache_salt: bool
    lora_name: str
    has_lora_name: bool
    hash_seed: str
    mm_identifiers: _containers.RepeatedScalarFieldContainer[str]
    mm_offsets: bytes
    mm_lengths: bytes
    chain_tip: bytes
    owner: str
    block_size: int
    shared_prefix_boundary: int
    def __init__(self, key: _Optional[str] = ..., has_token_ids: _Optional[bool] = ..., token_ids: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., block_hashes: _Optional[bytes] = ..., namespace: _Optional[bytes] = ..., cache_salt: _Optional[str] = ..., has_cache_salt: _Optional[bool] = ..., lora_name: _Optional[str] = ..., has_lora_name: _Optional[bool] = ..., hash_seed: _Optional[str] = ..., mm_identifiers: _Optional[_Iterable[str]] = ..., mm_offsets: _Optional[bytes] = ..., mm_lengths: _Optional[bytes] = ..., chain_tip: _Optional[bytes] = ..., owner: _Optional[str] = ..., block_size: _Optional[int] = ..., shared_prefix_boundary: _Optional[int] = ...) -> None: ...

class GroupState(_message.Message):
    __slots__ = ("request_keys", "num_blocks", "block_ids", "running_keys", "num_cached_block", "cached_this_step", "last_state_block_idx", "num_retired_blocks", "allocated_block_reqs", "checkpoint_keys", "checkpoints", "partial_hit_keys", "partial_hits", "partial_tail_keys", "partial_tails", "pending_copies")
    class LastStateBlockIdxEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class NumRetiredBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUEST_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCK_FIELD_NUMBER: _ClassVar[int]
    CACHED_THIS_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STATE_BLOCK_IDX_FIELD_NUMBER: _ClassVar[int]
    NUM_RETIRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BLOCK_REQS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_HIT_KEYS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_HITS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_TAIL_KEYS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_TAILS_FIELD_NUMBER: _ClassVar[int]
    PENDING_COPIES_FIELD_NUMBER: _ClassVar[int]
    request_keys: _containers.RepeatedScalarFieldContainer[str]
    num_blocks: bytes
    block_ids: bytes
    running_keys: _containers.RepeatedScalarFieldContainer[str]
    num_cached_block: bytes
    cached_this_step: _containers.RepeatedScalarFieldContainer[bytes]
    last_state_block_idx: _containers.ScalarMap[str, int]
    num_retired_blocks: _containers.ScalarMap[str, int]
    allocated_block_reqs: _containers.RepeatedScalarFieldContainer[str]
    checkpoint_keys: _containers.RepeatedScalarFieldContainer[str]
    checkpoints: bytes
    partial_hit_keys: _containers.RepeatedScalarFieldContainer[str]
    partial_hits: bytes
    partial_tail_keys: _containers.RepeatedScalarFieldContainer[str]
    partial_tails: bytes
    pending_copies: bytes
    def __init__(self, request_keys: _Optional[_Iterable[str]] = ..., num_blocks: _Optional[bytes] = ..., block_ids: _Optional[bytes] = ..., running_keys: _Optional[_Iterable[str]] = ..., num_cached_block: _Optional[bytes] = ..., cached_this_step: _Optional[_Iterable[bytes]] = ..., last_state_block_idx: _Optional[_Mapping[str, int]] = ..., num_retired_blocks: _Optional[_Mapping[str, int]] = ..., allocated_block_reqs: _Optional[_Iterable[str]] = ..., checkpoint_keys: _Optional[_Iterable[str]] = ..., checkpoints: _Optional[bytes] = ..., partial_hit_keys: _Optional[_Iterable[str]] = ..., partial_hits: _Optional[bytes] = ..., partial_tail_keys: _Optional[_Iterable[str]] = ..., partial_tails: _Optional[bytes] = ..., pending_copies: _Optional[bytes] = ...) -> None: ...

class ManagerState(_message.Message):
    __slots__ = ("ref_cnts", "free_order", "index_keys", "index_key_lengths", "index_block_ids", "groups", "copy_src", "copy_dst", "evictions", "total_queries", "total_hits", "total_requests", "interval_stats", "interval_reset", "held_blocks")
    REF_CNTS_FIELD_NUMBER: _ClassVar[int]
    FREE_ORDER_FIELD_NUMBER: _ClassVar[int]
    INDEX_KEYS_FIELD_NUMBER: _ClassVar[int]
    INDEX_KEY_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    INDEX_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    COPY_SRC_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_QUERIES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_HITS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_STATS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_RESET_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ref_cnts: bytes
    free_order: bytes
    index_keys: bytes
    index_key_lengths: bytes
    index_block_ids: bytes
    groups: _containers.RepeatedCompositeFieldContainer[GroupState]
    copy_src: bytes
    copy_dst: bytes
    evictions: int
    total_queries: int
    total_hits: int
    total_requests: int
    interval_stats: _containers.RepeatedScalarFieldContainer[int]
    interval_reset: bool
    held_blocks: bytes
    def __init__(self, ref_cnts: _Optional[bytes] = ..., free_order: _Optional[bytes] = ..., index_keys: _Optional[bytes] = ..., index_key_lengths: _Optional[bytes] = ..., index_block_ids: _Optional[bytes] = ..., groups: _Optional[_Iterable[_Union[GroupState, _Mapping]]] = ..., copy_src: _Optional[bytes] = ..., copy_dst: _Optional[bytes] = ..., evictions: _Optional[int] = ..., total_queries: _Optional[int] = ..., total_hits: _Optional[int] = ..., total_requests: _Optional[int] = ..., interval_stats: _Optional[_Iterable[int]] = ..., interval_reset: _Optional[bool] = ..., held_blocks: _Optional[bytes] = ...) -> None: ...

class PoolState(_message.Message):
    __slots__ = ("register_request", "pool_id", "epoch", "manager", "requests", "tombstone_keys", "tombstone_reasons", "owner_tenant", "moving_to", "pins", "suspended")
    REGISTER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MANAGER_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONE_KEYS_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONE_REASONS_FIELD_NUMBER: _ClassVar[int]
    OWNER_TENANT_FIELD_NUMBER: _ClassVar[int]
    MOVING_TO_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    register_request: bytes
    pool_id: str
    epoch: int
    manager: ManagerState
    requests: _containers.RepeatedCompositeFieldContainer[RequestState]
    tombstone_keys: _containers.RepeatedScalarFieldContainer[str]
    tombstone_reasons: _containers.RepeatedScalarFieldContainer[str]
    owner_tenant: str
    moving_to: str
    pins: _containers.RepeatedCompositeFieldContainer[PinState]
    suspended: bool
    def __init__(self, register_request: _Optional[bytes] = ..., pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., manager: _Optional[_Union[ManagerState, _Mapping]] = ..., requests: _Optional[_Iterable[_Union[RequestState, _Mapping]]] = ..., tombstone_keys: _Optional[_Iterable[str]] = ..., tombstone_reasons: _Optional[_Iterable[str]] = ..., owner_tenant: _Optional[str] = ..., moving_to: _Optional[str] = ..., pins: _Optional[_Iterable[_Union[PinState, _Mapping]]] = ..., suspended: _Optional[bool] = ...) -> None: ...

class PinState(_message.Message):
    __slots__ = ("key", "session_id", "block_ids", "num_tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: str
    session_id: str
    block_ids: bytes
    num_tokens: int
    def __init__(self, key: _Optional[str] = ..., session_id: _Optional[str] = ..., block_ids: _Optional[bytes] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PoolExport(_message.Message):
    __slots__ = ("pool", "session_ids", "session_tenants", "session_names")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TENANTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_NAMES_FIELD_NUMBER: _ClassVar[int]
    pool: PoolState
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    session_tenants: _containers.RepeatedScalarFieldContainer[str]
    session_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pool: _Optional[_Union[PoolState, _Mapping]] = ..., session_ids: _Optional[_Iterable[str]] = ..., session_tenants: _Optional[_Iterable[str]] = ..., session_names: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionState(_message.Message):
    __slots__ = ("session_id", "tenant", "client_name", "last_sequence", "reply_kind", "reply", "request_pool_ids", "request_keys", "last_digest")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    REPLY_KIND_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEYS_FIELD_NUMBER: _ClassVar[int]
    LAST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    client_name: str
    last_sequence: int
    reply_kind: str
    reply: bytes
    request_pool_ids: _containers.RepeatedScalarFieldContainer[str]
    request_keys: _containers.RepeatedScalarFieldContainer[str]
    last_digest: int
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., client_name: _Optional[str] = ..., last_sequence: _Optional[int] = ..., reply_kind: _Optional[str] = ..., reply: _Optional[bytes] = ..., request_pool_ids: _Optional[_Iterable[str]] = ..., request_keys: _Optional[_Iterable[str]] = ..., last_digest: _Optional[int] = ...) -> None: ...

class TransferState(_message.Message):
    __slots__ = ("transfer_id", "session_id", "src_pool", "holder", "dst_pool", "dst_key", "src_block_ids", "dst_block_ids", "num_tokens")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_POOL_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    DST_POOL_FIELD_NUMBER: _ClassVar[int]
    DST_KEY_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    session_id: str
    src_pool: str
    holder: str
    dst_pool: str
    dst_key: str
    src_block_ids: bytes
    dst_block_ids: bytes
    num_tokens: int
    def __init__(self, transfer_id: _Optional[str] = ..., session_id: _Optional[str] = ..., src_pool: _Optional[str] = ..., holder: _Optional[str] = ..., dst_pool: _Optional[str] = ..., dst_key: _Optional[str] = ..., src_block_ids: _Optional[bytes] = ..., dst_block_ids: _Optional[bytes] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("hash_block_size", "hash_seed", "next_event_sequence", "lease_expiries", "pools", "sessions", "transfers", "next_transfer", "external_pools", "next_external_registration")
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    NEXT_EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_POOLS_FIELD_NUMBER: _ClassVar[int]
    NEXT_EXTERNAL_REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    hash_block_size: int
    hash_seed: str
    next_event_sequence: int
    lease_expiries: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolState]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionState]
    transfers: _containers.RepeatedCompositeFieldContainer[TransferState]
    next_transfer: int
    external_pools: _containers.RepeatedCompositeFieldContainer[ExternalPoolState]
    next_external_registration: int
    def __init__(self, hash_block_size: _Optional[int] = ..., hash_seed: _Optional[str] = ..., next_event_sequence: _Optional[int] = ..., lease_expiries: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolState, _Mapping]]] = ..., sessions: _Optional[_Iterable[_Union[SessionState, _Mapping]]] = ..., transfers: _Optional[_Iterable[_Union[TransferState, _Mapping]]] = ..., next_transfer: _Optional[int] = ..., external_pools: _Optional[_Iterable[_Union[ExternalPoolState, _Mapping]]] = ..., next_external_registration: _Optional[int] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[OpStatus]
    NOT_FOUND: _ClassVar[OpStatus]
    ALREADY_EXISTS: _ClassVar[OpStatus]
    NO_SPACE: _ClassVar[OpStatus]
    FAILED_PRECONDITION: _ClassVar[OpStatus]
    RESOURCE_EXHAUSTED: _ClassVar[OpStatus]
    EPOCH_CHANGED: _ClassVar[OpStatus]
OK: OpStatus
NOT_FOUND: OpStatus
ALREADY_EXISTS: OpStatus
NO_SPACE: OpStatus
FAILED_PRECONDITION: OpStatus
RESOURCE_EXHAUSTED: OpStatus
EPOCH_CHANGED: OpStatus

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "resume_pool_ids", "resume_session_id", "last_acked_sequence", "attach")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    RESUME_POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_ACKED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    resume_pool_ids: _containers.RepeatedScalarFieldContainer[str]
    resume_session_id: str
    last_acked_sequence: int
    attach: bool
    def __init__(self, client_name: _Optional[str] = ..., resume_pool_ids: _Optional[_Iterable[str]] = ..., resume_session_id: _Optional[str] = ..., last_acked_sequence: _Optional[int] = ..., attach: _Optional[bool] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "ttl_ms", "next_sequence", "tenant", "pools_failed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POOLS_FAILED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttl_ms: int
    next_sequence: int
    tenant: str
    pools_failed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., next_sequence: _Optional[int] = ..., tenant: _Optional[str] = ..., pools_failed: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("ttl_ms",)
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    def __init__(self, ttl_ms: _Optional[int] = ...) -> None: ...

class FullAttention(_message.Message):
    __slots__ = ("block_size",)
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    def __init__(self, block_size: _Optional[int] = ...) -> None: ...

class SlidingWindow(_message.Message):
    __slots__ = ("block_size", "sliding_window", "extra_retained_tokens", "bounded_replay")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    EXTRA_RETAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BOUNDED_REPLAY_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    sliding_window: int
    extra_retained_tokens: int
    bounded_replay: bool
    def __init__(self, block_size: _Optional[int] = ..., sliding_window: _Optional[int] = ..., extra_retained_tokens: _Optional[int] = ..., bounded_replay: _Optional[bool] = ...) -> None: ...

class ChunkedLocalAttention(_message.Message):
    __slots__ = ("block_size", "attention_chunk_size")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    attention_chunk_size: int
    def __init__(self, block_size: _Optional[int] = ..., attention_chunk_size: _Optional[int] = ...) -> None: ...

class Mamba(_message.Message):
    __slots__ = ("block_size", "mamba_cache_mode", "num_speculative_blocks", "num_prefill_checkpoint_blocks", "prefill_checkpoint_alignment")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAMBA_CACHE_MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_CHECKPOINT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHECKPOINT_ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    mamba_cache_mode: str
    num_speculative_blocks: int
    num_prefill_checkpoint_blocks: int
    prefill_checkpoint_alignment: int
    def __init__(self, block_size: _Optional[int] = ..., mamba_cache_mode: _Optional[str] = ..., num_speculative_blocks: _Optional[int] = ..., num_prefill_checkpoint_blocks: _Optional[int] = ..., prefill_checkpoint_alignment: _Optional[int] = ...) -> None: ...

class KVCacheGroup(_message.Message):
    __slots__ = ("full_attention", "sliding_window", "chunked_local", "mamba", "cross_attention", "sink_full_attention", "rswa", "circular_buffer", "replicated")
    FULL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_LOCAL_FIELD_NUMBER: _ClassVar[int]
    MAMBA_FIELD_NUMBER: _ClassVar[int]
    CROSS_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SINK_FULL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    RSWA_FIELD_NUMBER: _ClassVar[int]
    CIRCULAR_BUFFER_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_FIELD_NUMBER: _ClassVar[int]
    full_attention: FullAttention
    sliding_window: SlidingWindow
    chunked_local: ChunkedLocalAttention
    mamba: Mamba
    cross_attention: CrossAttention
    sink_full_attention: SinkFullAttention
    rswa: ReferenceSlidingWindow
    circular_buffer: CircularBuffer
    replicated: bool
    def __init__(self, full_attention: _Optional[_Union[FullAttention, _Mapping]] = ..., sliding_window: _Optional[_Union[SlidingWindow, _Mapping]] = ..., chunked_local: _Optional[_Union[ChunkedLocalAttention, _Mapping]] = ..., mamba: _Optional[_Union[Mamba, _Mapping]] = ..., cross_attention: _Optional[_Union[CrossAttention, _Mapping]] = ..., sink_full_attention: _Optional[_Union[SinkFullAttention, _Mapping]] = ..., rswa: _Optional[_Union[ReferenceSlidingWindow, _Mapping]] = ..., circular_buffer: _Optional[_Union[CircularBuffer, _Mapping]] = ..., replicated: _Optional[bool] = ...) -> None: ...

class SinkFullAttention(_message.Message):
    __slots__ = ("block_size", "sink_len")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SINK_LEN_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    sink_len: int
    def __init__(self, block_size: _Optional[int] = ..., sink_len: _Optional[int] = ...) -> None: ...

class ReferenceSlidingWindow(_message.Message):
    __slots__ = ("block_size", "rswa_window")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RSWA_WINDOW_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    rswa_window: int
    def __init__(self, block_size: _Optional[int] = ..., rswa_window: _Optional[int] = ...) -> None: ...

class CircularBuffer(_message.Message):
    __slots__ = ("block_size",)
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    def __init__(self, block_size: _Optional[int] = ...) -> None: ...

class CrossAttention(_message.Message):
    __slots__ = ("block_size",)
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    def __init__(self, block_size: _Optional[int] = ...) -> None: ...

class KVCacheConfig(_message.Message):
    __slots__ = ("num_blocks", "groups", "max_model_len", "dcp_world_size", "disable_prefix_caching", "vocab_size", "kv_layout", "prefix_cache_retention_interval", "has_prefix_cache_retention_interval", "eagle_group_ids")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DCP_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DISABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_RETENTION_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    HAS_PREFIX_CACHE_RETENTION_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    EAGLE_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroup]
    max_model_len: int
    dcp_world_size: int
    disable_prefix_caching: bool
    vocab_size: int
    kv_layout: str
    prefix_cache_retention_interval: int
    has_prefix_cache_retention_interval: bool
    eagle_group_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_blocks: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[KVCacheGroup, _Mapping]]] = ..., max_model_len: _Optional[int] = ..., dcp_world_size: _Optional[int] = ..., disable_prefix_caching: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., kv_layout: _Optional[str] = ..., prefix_cache_retention_interval: _Optional[int] = ..., has_prefix_cache_retention_interval: _Optional[bool] = ..., eagle_group_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HashSpec(_message.Message):
    __slots__ = ("algorithm", "seed", "has_seed")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    algorithm: str
    seed: str
    has_seed: bool
    def __init__(self, algorithm: _Optional[str] = ..., seed: _Optional[str] = ..., has_seed: _Optional[bool] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("session_id", "sequence", "pool_id", "config", "hash_fingerprint", "epoch", "hash_spec", "vllm", "bound_to_session", "suspend_on_session_end", "endpoint")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    HASH_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HASH_SPEC_FIELD_NUMBER: _ClassVar[int]
    VLLM_FIELD_NUMBER: _ClassVar[int]
    BOUND_TO_SESSION_FIELD_NUMBER: _ClassVar[int]
    SUSPEND_ON_SESSION_END_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sequence: int
    pool_id: str
    config: KVCacheConfig
    hash_fingerprint: str
    epoch: int
    hash_spec: HashSpec
    vllm: VllmManagerOptions
    bound_to_session: bool
    suspend_on_session_end: bool
    endpoint: bytes
    def __init__(self, session_id: _Optional[str] = ..., sequence: _Optional[int] = ..., pool_id: _Optional[str] = ..., config: _Optional[_Union[KVCacheConfig, _Mapping]] = ..., hash_fingerprint: _Optional[str] = ..., epoch: _Optional[int] = ..., hash_spec: _Optional[_Union[HashSpec, _Mapping]] = ..., vllm: _Optional[_Union[VllmManagerOptions, _Mapping]] = ..., bound_to_session: _Optional[bool] = ..., suspend_on_session_end: _Optional[bool] = ..., endpoint: _Optional[bytes] = ...) -> None: ...

class VllmManagerOptions(_message.Message):
    __slots__ = ("watermark", "scheduler_block_size", "max_in_flight_tokens", "use_eagle", "num_hash_lookahead_tokens", "num_prefill_lookahead", "mamba_recache_keyed_tails", "mamba_shared_prefix_checkpoint")
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USE_EAGLE_FIELD_NUMBER: _ClassVar[int]
    NUM_HASH_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    MAMBA_RECACHE_KEYED_TAILS_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SHARED_PREFIX_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    watermark: float
    scheduler_block_size: int
    max_in_flight_tokens: int
    use_eagle: bool
    num_hash_lookahead_tokens: int
    num_prefill_lookahead: int
    mamba_recache_keyed_tails: bool
    mamba_shared_prefix_checkpoint: bool
    def __init__(self, watermark: _Optional[float] = ..., scheduler_block_size: _Optional[int] = ..., max_in_flight_tokens: _Optional[int] = ..., use_eagle: _Optional[bool] = ..., num_hash_lookahead_tokens: _Optional[int] = ..., num_prefill_lookahead: _Optional[int] = ..., mamba_recache_keyed_tails: _Optional[bool] = ..., mamba_shared_prefix_checkpoint: _Optional[bool] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("pool_id", "epoch", "new_epoch", "hash_block_size", "hash_seed", "num_requests_failed", "scheduler_block_size", "hash_algorithm", "hash_fingerprint")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEW_EPOCH_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    HASH_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    new_epoch: bool
    hash_block_size: int
    hash_seed: str
    num_requests_failed: int
    scheduler_block_size: int
    hash_algorithm: str
    hash_fingerprint: str
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., new_epoch: _Optional[bool] = ..., hash_block_size: _Optional[int] = ..., hash_seed: _Optional[str] = ..., num_requests_failed: _Optional[int] = ..., scheduler_block_size: _Optional[int] = ..., hash_algorithm: _Optional[str] = ..., hash_fingerprint: _Optional[str] = ...) -> None: ...

class MultiModalItem(_message.Message):
    __slots__ = ("identifier", "offset", "length")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    length: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class AddRequestOp(_message.Message):
    __slots__ = ("request_id", "token_ids", "block_hashes", "num_tokens", "cache_salt", "lora_name", "mm_items", "num_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: bytes
    block_hashes: bytes
    num_tokens: int
    cache_salt: str
    lora_name: str
    mm_items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    num_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., block_hashes: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., mm_items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class AllocateOp(_message.Message):
    __slots__ = ("request_id", "num_computed_tokens", "num_new_tokens", "append_token_ids", "append_block_hashes", "num_append_tokens", "num_lookahead_tokens", "delay_cache_blocks", "allow_transfer", "external_source", "num_output_placeholders", "num_in_flight_tokens", "waiting", "lookup", "num_new_computed_tokens", "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs", "cache_tokens", "num_external_computed_tokens", "num_encoder_tokens", "max_cache_hit_length", "connector_lookup", "shared_prefix_boundary")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    APPEND_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELAY_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_PLACEHOLDERS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FULL_SEQUENCE_MUST_FIT_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HAS_SCHEDULED_REQS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXTERNAL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENCODER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHE_HIT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    append_token_ids: bytes
    append_block_hashes: bytes
    num_append_tokens: int
    num_lookahead_tokens: int
    delay_cache_blocks: bool
    allow_transfer: bool
    external_source: ExternalSource
    num_output_placeholders: int
    num_in_flight_tokens: int
    waiting: bool
    lookup: bool
    num_new_computed_tokens: int
    full_sequence_must_fit: bool
    reserved_blocks: int
    has_scheduled_reqs: bool
    cache_tokens: int
    num_external_computed_tokens: int
    num_encoder_tokens: int
    max_cache_hit_length: int
    connector_lookup: bool
    shared_prefix_boundary: int
    def __init__(self, request_id: _Optional[str] = ..., num_computed_tokens: _Optional[int] = ..., num_new_tokens: _Optional[int] = ..., append_token_ids: _Optional[bytes] = ..., append_block_hashes: _Optional[bytes] = ..., num_append_tokens: _Optional[int] = ..., num_lookahead_tokens: _Optional[int] = ..., delay_cache_blocks: _Optional[bool] = ..., allow_transfer: _Optional[bool] = ..., external_source: _Optional[_Union[ExternalSource, _Mapping]] = ..., num_output_placeholders: _Optional[int] = ..., num_in_flight_tokens: _Optional[int] = ..., waiting: _Optional[bool] = ..., lookup: _Optional[bool] = ..., num_new_computed_tokens: _Optional[int] = ..., full_sequence_must_fit: _Optional[bool] = ..., reserved_blocks: _Optional[int] = ..., has_scheduled_reqs: _Optional[bool] = ..., cache_tokens: _Optional[int] = ..., num_external_computed_tokens: _Optional[int] = ..., num_encoder_tokens: _Optional[int] = ..., max_cache_hit_length: _Optional[int] = ..., connector_lookup: _Optional[bool] = ..., shared_prefix_boundary: _Optional[int] = ...) -> None: ...

class ExternalSource(_message.Message):
    __slots__ = ("pin_id", "src_pool_id", "src_block_ids", "num_tokens")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    src_pool_id: str
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, pin_id: _Optional[str] = ..., src_pool_id: _Optional[str] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PinOp(_message.Message):
    __slots__ = ("pin_id", "token_ids", "block_hashes", "num_tokens", "cache_salt", "lora_name")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    token_ids: bytes
    block_hashes: bytes
    num_tokens: int
    cache_salt: str
    lora_name: str
    def __init__(self, pin_id: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., block_hashes: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class UnpinOp(_message.Message):
    __slots__ = ("pin_id",)
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    def __init__(self, pin_id: _Optional[str] = ...) -> None: ...

class ForkOp(_message.Message):
    __slots__ = ("parent_request_id", "child_request_id")
    PARENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    parent_request_id: str
    child_request_id: str
    def __init__(self, parent_request_id: _Optional[str] = ..., child_request_id: _Optional[str] = ...) -> None: ...

class FreeOp(_message.Message):
    __slots__ = ("request_id", "popped")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POPPED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    popped: bool
    def __init__(self, request_id: _Optional[str] = ..., popped: _Optional[bool] = ...) -> None: ...

class EvictBlocksOp(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RemoveSkippedBlocksOp(_message.Message):
    __slots__ = ("request_id", "processed_computed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    processed_computed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., processed_computed_tokens: _Optional[int] = ...) -> None: ...

class NewStepOp(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TakeBlockCopiesOp(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetNewBlocksOp(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class TouchBlocksOp(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeHeldBlocksOp(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ResetPrefixCacheOp(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AllocateBatchOp(_message.Message):
    __slots__ = ("request_ids", "rows", "append_block_hashes")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    APPEND_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    rows: bytes
    append_block_hashes: bytes
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., rows: _Optional[bytes] = ..., append_block_hashes: _Optional[bytes] = ...) -> None: ...

class DecodeBatchOp(_message.Message):
    __slots__ = ("request_ids", "num_computed_tokens", "append_token_ids", "num_new_tokens", "num_lookahead_tokens")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_computed_tokens: bytes
    append_token_ids: bytes
    num_new_tokens: int
    num_lookahead_tokens: int
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_computed_tokens: _Optional[bytes] = ..., append_token_ids: _Optional[bytes] = ..., num_new_tokens: _Optional[int] = ..., num_lookahead_tokens: _Optional[int] = ...) -> None: ...

class AdmitBatchOp(_message.Message):
    __slots__ = ("request_ids", "token_ids", "num_prompt_tokens", "num_new_tokens", "num_lookahead_tokens", "cache_salts", "lora_names")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALTS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: bytes
    num_prompt_tokens: bytes
    num_new_tokens: bytes
    num_lookahead_tokens: int
    cache_salts: _containers.RepeatedScalarFieldContainer[str]
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[bytes] = ..., num_prompt_tokens: _Optional[bytes] = ..., num_new_tokens: _Optional[bytes] = ..., num_lookahead_tokens: _Optional[int] = ..., cache_salts: _Optional[_Iterable[str]] = ..., lora_names: _Optional[_Iterable[str]] = ...) -> None: ...

class Op(_message.Message):
    __slots__ = ("add", "allocate", "fork", "free", "pin", "unpin", "decode", "admit", "reset_prefix_cache", "allocate_batch", "evict_blocks", "remove_skipped_blocks", "new_step", "take_block_copies", "get_new_blocks", "free_held_blocks", "touch_blocks")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    UNPIN_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    RESET_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_BATCH_FIELD_NUMBER: _ClassVar[int]
    EVICT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_STEP_FIELD_NUMBER: _ClassVar[int]
    TAKE_BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    GET_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOUCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    add: AddRequestOp
    allocate: AllocateOp
    fork: ForkOp
    free: FreeOp
    pin: PinOp
    unpin: UnpinOp
    decode: DecodeBatchOp
    admit: AdmitBatchOp
    reset_prefix_cache: ResetPrefixCacheOp
    allocate_batch: AllocateBatchOp
    evict_blocks: EvictBlocksOp
    remove_skipped_blocks: RemoveSkippedBlocksOp
    new_step: NewStepOp
    take_block_copies: TakeBlockCopiesOp
    get_new_blocks: GetNewBlocksOp
    free_held_blocks: FreeHeldBlocksOp
    touch_blocks: TouchBlocksOp
    def __init__(self, add: _Optional[_Union[AddRequestOp, _Mapping]] = ..., allocate: _Optional[_Union[AllocateOp, _Mapping]] = ..., fork: _Optional[_Union[ForkOp, _Mapping]] = ..., free: _Optional[_Union[FreeOp, _Mapping]] = ..., pin: _Optional[_Union[PinOp, _Mapping]] = ..., unpin: _Optional[_Union[UnpinOp, _Mapping]] = ..., decode: _Optional[_Union[DecodeBatchOp, _Mapping]] = ..., admit: _Optional[_Union[AdmitBatchOp, _Mapping]] = ..., reset_prefix_cache: _Optional[_Union[ResetPrefixCacheOp, _Mapping]] = ..., allocate_batch: _Optional[_Union[AllocateBatchOp, _Mapping]] = ..., evict_blocks: _Optional[_Union[EvictBlocksOp, _Mapping]] = ..., remove_skipped_blocks: _Optional[_Union[RemoveSkippedBlocksOp, _Mapping]] = ..., new_step: _Optional[_Union[NewStepOp, _Mapping]] = ..., take_block_copies: _Optional[_Union[TakeBlockCopiesOp, _Mapping]] = ..., get_new_blocks: _Optional[_Union[GetNewBlocksOp, _Mapping]] = ..., free_held_blocks: _Optional[_Union[FreeHeldBlocksOp, _Mapping]] = ..., touch_blocks: _Optional[_Union[TouchBlocksOp, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "sequence", "pool_id", "ops")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sequence: int
    pool_id: str
    ops: _containers.RepeatedCompositeFieldContainer[Op]
    def __init__(self, session_id: _Optional[str] = ..., sequence: _Optional[int] = ..., pool_id: _Optional[str] = ..., ops: _Optional[_Iterable[_Union[Op, _Mapping]]] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("session_id", "sequence", "pool_id", "add", "allocate")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sequence: int
    pool_id: str
    add: AddRequestOp
    allocate: AllocateOp
    def __init__(self, session_id: _Optional[str] = ..., sequence: _Optional[int] = ..., pool_id: _Optional[str] = ..., add: _Optional[_Union[AddRequestOp, _Mapping]] = ..., allocate: _Optional[_Union[AllocateOp, _Mapping]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("session_id", "sequence", "pool_id", "request_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sequence: int
    pool_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., sequence: _Optional[int] = ..., pool_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("session_id", "sequence", "pool_id", "parent_request_id", "child_request_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sequence: int
    pool_id: str
    parent_request_id: str
    child_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., sequence: _Optional[int] = ..., pool_id: _Optional[str] = ..., parent_request_id: _Optional[str] = ..., child_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GroupBlocks(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplacedBlock(_message.Message):
    __slots__ = ("group", "index", "block_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    group: int
    index: int
    block_id: int
    def __init__(self, group: _Optional[int] = ..., index: _Optional[int] = ..., block_id: _Optional[int] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class TransferOrder(_message.Message):
    __slots__ = ("transfer_id", "src_pool_id", "src_block_ids", "dst_block_ids", "num_tokens")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    src_pool_id: str
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, transfer_id: _Optional[str] = ..., src_pool_id: _Optional[str] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class DecodeBatchResult(_message.Message):
    __slots__ = ("statuses", "num_new_blocks", "new_block_ids", "num_computed_tokens", "num_scheduled_tokens", "failures", "num_groups", "replaced")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    statuses: bytes
    num_new_blocks: bytes
    new_block_ids: bytes
    num_computed_tokens: bytes
    num_scheduled_tokens: bytes
    failures: _containers.RepeatedCompositeFieldContainer[OpResult]
    num_groups: int
    replaced: bytes
    def __init__(self, statuses: _Optional[bytes] = ..., num_new_blocks: _Optional[bytes] = ..., new_block_ids: _Optional[bytes] = ..., num_computed_tokens: _Optional[bytes] = ..., num_scheduled_tokens: _Optional[bytes] = ..., failures: _Optional[_Iterable[_Union[OpResult, _Mapping]]] = ..., num_groups: _Optional[int] = ..., replaced: _Optional[bytes] = ...) -> None: ...

class OpResult(_message.Message):
    __slots__ = ("status", "message", "request_id", "new_blocks", "num_computed_tokens", "num_scheduled_tokens", "num_tokens", "transfer", "batch", "replaced")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    status: OpStatus
    message: str
    request_id: str
    new_blocks: _containers.RepeatedCompositeFieldContainer[GroupBlocks]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_tokens: int
    transfer: TransferOrder
    batch: DecodeBatchResult
    replaced: _containers.RepeatedCompositeFieldContainer[ReplacedBlock]
    def __init__(self, status: _Optional[_Union[OpStatus, str]] = ..., message: _Optional[str] = ..., request_id: _Optional[str] = ..., new_blocks: _Optional[_Iterable[_Union[GroupBlocks, _Mapping]]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., num_tokens: _Optional[int] = ..., transfer: _Optional[_Union[TransferOrder, _Mapping]] = ..., batch: _Optional[_Union[DecodeBatchResult, _Mapping]] = ..., replaced: _Optional[_Iterable[_Union[ReplacedBlock, _Mapping]]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("sequence", "results", "copies", "num_free_blocks")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    results: _containers.RepeatedCompositeFieldContainer[OpResult]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    num_free_blocks: int
    def __init__(self, sequence: _Optional[int] = ..., results: _Optional[_Iterable[_Union[OpResult, _Mapping]]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., num_free_blocks: _Optional[int] = ...) -> None: ...

class CommitTransferRequest(_message.Message):
    __slots__ = ("session_id", "sequence", "pool_id", "transfer_id", "abort")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sequence: int
    pool_id: str
    transfer_id: str
    abort: bool
    def __init__(self, session_id: _Optional[str] = ..., sequence: _Optional[int] = ..., pool_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., abort: _Optional[bool] = ...) -> None: ...

class GetRequestRequest(_message.Message):
    __slots__ = ("pool_id", "request_id")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    request_id: str
    def __init__(self, pool_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("request_id", "pool_id", "num_tokens", "num_computed_tokens", "blocks", "num_block_hashes", "running", "session_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool_id: str
    num_tokens: int
    num_computed_tokens: int
    blocks: _containers.RepeatedCompositeFieldContainer[GroupBlocks]
    num_block_hashes: int
    running: bool
    session_id: str
    def __init__(self, request_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[GroupBlocks, _Mapping]]] = ..., num_block_hashes: _Optional[int] = ..., running: _Optional[bool] = ..., session_id: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("token_ids", "block_hashes", "cache_salt", "lora_name", "pool_ids", "num_tokens", "hash_bytes")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HASH_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    block_hashes: bytes
    cache_salt: str
    lora_name: str
    pool_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: int
    hash_bytes: int
    def __init__(self, token_ids: _Optional[bytes] = ..., block_hashes: _Optional[bytes] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., pool_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[int] = ..., hash_bytes: _Optional[int] = ...) -> None: ...

class PoolHit(_message.Message):
    __slots__ = ("pool_id", "num_cached_tokens", "num_free_blocks", "num_cached_blocks", "suspended", "external", "tiers")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_cached_tokens: int
    num_free_blocks: int
    num_cached_blocks: int
    suspended: bool
    external: bool
    tiers: _containers.RepeatedCompositeFieldContainer[TierHit]
    def __init__(self, pool_id: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., suspended: _Optional[bool] = ..., external: _Optional[bool] = ..., tiers: _Optional[_Iterable[_Union[TierHit, _Mapping]]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hits", "best_pool_id")
    HITS_FIELD_NUMBER: _ClassVar[int]
    BEST_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[PoolHit]
    best_pool_id: str
    def __init__(self, hits: _Optional[_Iterable[_Union[PoolHit, _Mapping]]] = ..., best_pool_id: _Optional[str] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("pool_ids", "start_sequence", "include_state")
    POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    START_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STATE_FIELD_NUMBER: _ClassVar[int]
    pool_ids: _containers.RepeatedScalarFieldContainer[str]
    start_sequence: int
    include_state: bool
    def __init__(self, pool_ids: _Optional[_Iterable[str]] = ..., start_sequence: _Optional[int] = ..., include_state: _Optional[bool] = ...) -> None: ...

class BlockStoredEvent(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "group_idx", "lora_name", "block_ids")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: bytes
    block_size: int
    group_idx: int
    lora_name: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., block_size: _Optional[int] = ..., group_idx: _Optional[int] = ..., lora_name: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockRemovedEvent(_message.Message):
    __slots__ = ("block_hashes", "group_idx")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    group_idx: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., group_idx: _Optional[int] = ...) -> None: ...

class AllBlocksClearedEvent(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StateSyncedEvent(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("sequence", "pool_id", "stored", "removed", "cleared", "synced")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    pool_id: str
    stored: BlockStoredEvent
    removed: BlockRemovedEvent
    cleared: AllBlocksClearedEvent
    synced: StateSyncedEvent
    def __init__(self, sequence: _Optional[int] = ..., pool_id: _Optional[str] = ..., stored: _Optional[_Union[BlockStoredEvent, _Mapping]] = ..., removed: _Optional[_Union[BlockRemovedEvent, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksClearedEvent, _Mapping]] = ..., synced: _Optional[_Union[StateSyncedEvent, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("check_invariants", "include_state_digest", "pool_ids")
    CHECK_INVARIANTS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    check_invariants: bool
    include_state_digest: bool
    pool_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, check_invariants: _Optional[bool] = ..., include_state_digest: _Optional[bool] = ..., pool_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pool_id", "epoch", "num_blocks", "num_free_blocks", "usage", "num_requests", "prefix_hit_rate", "prefix_queries", "prefix_hits", "evictions", "num_cached_blocks", "invariant_violation", "num_pending_transfers", "plain_prefix", "moving_to", "suspended", "endpoint", "endpoint_size")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INVARIANT_VIOLATION_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_PREFIX_FIELD_NUMBER: _ClassVar[int]
    MOVING_TO_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_SIZE_FIELD_NUMBER: _ClassVar[int]
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
    num_pending_transfers: int
    plain_prefix: bool
    moving_to: str
    suspended: bool
    endpoint: bytes
    endpoint_size: int
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., num_requests: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., prefix_queries: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., evictions: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., invariant_violation: _Optional[str] = ..., num_pending_transfers: _Optional[int] = ..., plain_prefix: _Optional[bool] = ..., moving_to: _Optional[str] = ..., suspended: _Optional[bool] = ..., endpoint: _Optional[bytes] = ..., endpoint_size: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("pools", "num_sessions", "persistence", "event_sequence", "lease_expiries", "hash_fingerprint", "hash_block_size", "state_digest", "wal_entries_written", "wal_bytes_written", "snapshots_written", "last_snapshot_bytes", "wal_lag", "leader_epoch", "external_pools")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PERSISTENCE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    HASH_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WAL_ENTRIES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    WAL_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    LAST_SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAL_LAG_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    num_sessions: int
    persistence: str
    event_sequence: int
    lease_expiries: int
    hash_fingerprint: str
    hash_block_size: int
    state_digest: str
    wal_entries_written: int
    wal_bytes_written: int
    snapshots_written: int
    last_snapshot_bytes: int
    wal_lag: int
    leader_epoch: int
    external_pools: _containers.RepeatedCompositeFieldContainer[ExternalPoolStats]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., num_sessions: _Optional[int] = ..., persistence: _Optional[str] = ..., event_sequence: _Optional[int] = ..., lease_expiries: _Optional[int] = ..., hash_fingerprint: _Optional[str] = ..., hash_block_size: _Optional[int] = ..., state_digest: _Optional[str] = ..., wal_entries_written: _Optional[int] = ..., wal_bytes_written: _Optional[int] = ..., snapshots_written: _Optional[int] = ..., last_snapshot_bytes: _Optional[int] = ..., wal_lag: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., external_pools: _Optional[_Iterable[_Union[ExternalPoolStats, _Mapping]]] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("session_id", "sequence", "pool_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sequence: int
    pool_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., sequence: _Optional[int] = ..., pool_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset_pool_ids", "refused_pool_ids")
    RESET_POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    reset_pool_ids: _containers.RepeatedScalarFieldContainer[str]
    refused_pool_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, reset_pool_ids: _Optional[_Iterable[str]] = ..., refused_pool_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetShardMapRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("shard_id", "address", "epoch", "num_pools")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_POOLS_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    address: str
    epoch: int
    num_pools: int
    def __init__(self, shard_id: _Optional[str] = ..., address: _Optional[str] = ..., epoch: _Optional[int] = ..., num_pools: _Optional[int] = ...) -> None: ...

class ShardMapResponse(_message.Message):
    __slots__ = ("version", "shards", "pools", "shard_id", "sharded")
    class PoolsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDED_FIELD_NUMBER: _ClassVar[int]
    version: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    pools: _containers.ScalarMap[str, str]
    shard_id: str
    sharded: bool
    def __init__(self, version: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., pools: _Optional[_Mapping[str, str]] = ..., shard_id: _Optional[str] = ..., sharded: _Optional[bool] = ...) -> None: ...

class MovePoolRequest(_message.Message):
    __slots__ = ("pool_id", "phase", "to_shard", "from_shard")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FREEZE: _ClassVar[MovePoolRequest.Phase]
        IMPORT: _ClassVar[MovePoolRequest.Phase]
        DROP: _ClassVar[MovePoolRequest.Phase]
        THAW: _ClassVar[MovePoolRequest.Phase]
    FREEZE: MovePoolRequest.Phase
    IMPORT: MovePoolRequest.Phase
    DROP: MovePoolRequest.Phase
    THAW: MovePoolRequest.Phase
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TO_SHARD_FIELD_NUMBER: _ClassVar[int]
    FROM_SHARD_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    phase: MovePoolRequest.Phase
    to_shard: str
    from_shard: str
    def __init__(self, pool_id: _Optional[str] = ..., phase: _Optional[_Union[MovePoolRequest.Phase, str]] = ..., to_shard: _Optional[str] = ..., from_shard: _Optional[str] = ...) -> None: ...

class MovePoolResponse(_message.Message):
    __slots__ = ("num_requests", "export_bytes")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    export_bytes: int
    def __init__(self, num_requests: _Optional[int] = ..., export_bytes: _Optional[int] = ...) -> None: ...

class ExternalPoolSpec(_message.Message):
    __slots__ = ("pool_id", "endpoint", "replay_endpoint", "block_size", "hash_algo", "hash_seed", "has_hash_seed", "bind", "topic", "max_blocks")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    BIND_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    endpoint: str
    replay_endpoint: str
    block_size: int
    hash_algo: str
    hash_seed: str
    has_hash_seed: bool
    bind: bool
    topic: str
    max_blocks: int
    def __init__(self, pool_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., replay_endpoint: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_algo: _Optional[str] = ..., hash_seed: _Optional[str] = ..., has_hash_seed: _Optional[bool] = ..., bind: _Optional[bool] = ..., topic: _Optional[str] = ..., max_blocks: _Optional[int] = ...) -> None: ...

class RegisterExternalPoolRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: ExternalPoolSpec
    def __init__(self, spec: _Optional[_Union[ExternalPoolSpec, _Mapping]] = ...) -> None: ...

class RegisterExternalPoolResponse(_message.Message):
    __slots__ = ("pool_id", "registration", "new_registration")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    NEW_REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    registration: int
    new_registration: bool
    def __init__(self, pool_id: _Optional[str] = ..., registration: _Optional[int] = ..., new_registration: _Optional[bool] = ...) -> None: ...

class RemoveExternalPoolRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class RemoveExternalPoolResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierHit(_message.Message):
    __slots__ = ("medium", "num_cached_tokens")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    medium: str
    num_cached_tokens: int
    def __init__(self, medium: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class TierBlocks(_message.Message):
    __slots__ = ("medium", "num_blocks")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    medium: str
    num_blocks: int
    def __init__(self, medium: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ExternalPoolStats(_message.Message):
    __slots__ = ("pool_id", "endpoint", "connected", "epoch", "last_sequence", "num_blocks", "max_blocks", "tiers", "block_size", "spec_status", "spec_message", "spec_blocks_checked", "batches", "stored_blocks", "removed_blocks", "evictions", "restarts", "resyncs", "gaps", "replays", "clears", "orphans", "orphans_adopted", "orphans_dropped", "unknown_removals", "duplicate_stores", "ignored_events", "decode_errors", "owner_tenant")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPEC_STATUS_FIELD_NUMBER: _ClassVar[int]
    SPEC_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SPEC_BLOCKS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    CLEARS_FIELD_NUMBER: _ClassVar[int]
    ORPHANS_FIELD_NUMBER: _ClassVar[int]
    ORPHANS_ADOPTED_FIELD_NUMBER: _ClassVar[int]
    ORPHANS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_REMOVALS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_STORES_FIELD_NUMBER: _ClassVar[int]
    IGNORED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    OWNER_TENANT_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    endpoint: str
    connected: bool
    epoch: int
    last_sequence: int
    num_blocks: int
    max_blocks: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierBlocks]
    block_size: int
    spec_status: str
    spec_message: str
    spec_blocks_checked: int
    batches: int
    stored_blocks: int
    removed_blocks: int
    evictions: int
    restarts: int
    resyncs: int
    gaps: int
    replays: int
    clears: int
    orphans: int
    orphans_adopted: int
    orphans_dropped: int
    unknown_removals: int
    duplicate_stores: int
    ignored_events: int
    decode_errors: int
    owner_tenant: str
    def __init__(self, pool_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., connected: _Optional[bool] = ..., epoch: _Optional[int] = ..., last_sequence: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierBlocks, _Mapping]]] = ..., block_size: _Optional[int] = ..., spec_status: _Optional[str] = ..., spec_message: _Optional[str] = ..., spec_blocks_checked: _Optional[int] = ..., batches: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., removed_blocks: _Optional[int] = ..., evictions: _Optional[int] = ..., restarts: _Optional[int] = ..., resyncs: _Optional[int] = ..., gaps: _Optional[int] = ..., replays: _Optional[int] = ..., clears: _Optional[int] = ..., orphans: _Optional[int] = ..., orphans_adopted: _Optional[int] = ..., orphans_dropped: _Optional[int] = ..., unknown_removals: _Optional[int] = ..., duplicate_stores: _Optional[int] = ..., ignored_events: _Optional[int] = ..., decode_errors: _Optional[int] = ..., owner_tenant: _Optional[str] = ...) -> None: ...

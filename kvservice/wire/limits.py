"""What one call may carry. A client past any of these gets INVALID_ARGUMENT naming the field and value."""

MAX_ID_BYTES = 256  # request, pool, session, transfer ids (UTF-8 bytes; printable)
MAX_NAME_BYTES = 256  # cache salts, LoRA names, client names, KV layouts
MAX_OPS_PER_STEP = 16_384  # ops in one Step, and entries in one packed op
MAX_BLOCKS = 1 << 31  # KVCacheConfig.num_blocks (the server's --max-pool-blocks is usually lower)
MAX_MODEL_LEN = 1 << 24
MAX_DCP_WORLD_SIZE = 64
MAX_BLOCK_SIZE = 1 << 16
MAX_SPECULATIVE_BLOCKS = 64  # a Mamba group's scratch states (vLLM: one per speculative token)
MAX_EPOCH = (1 << 63) - 1  # the allocator bumps epochs (stale recovery): keep them inside the uint64 on the wire
MAX_ENDPOINT_BYTES = 64 * 1024  # RegisterPoolRequest.endpoint (a NIXL agent's metadata is a few KiB)

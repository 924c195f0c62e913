"""Block hashes (README, "Hash specs") and the hash specs a pool can declare.

    chain      kvservice's own chain, byte-exact to the README's spec (the default)
    vllm_spec  vLLM 0.33.0's chains (sha256, sha256_cbor, xxhash, xxhash_cbor), byte-exact
    spec       HashSpec: one of them, its root and its fingerprint
    cbor       the canonical CBOR the *_cbor algorithms serialize with
"""

from kvservice.hashing.chain import (
    DEFAULT_HASH_BLOCK_SIZE,
    DEFAULT_HASH_SEED,
    HASH_BYTES,
    MAX_TOKEN_ID,
    SPEC_VERSION,
    TAG_CACHE_SALT,
    TAG_LORA,
    TAG_LORA_PATH,
    TAG_MM_ITEM,
    BlockHash,
    MultiModalItem,
    TokenIdError,
    block_extra_keys,
    hash_block,
    hash_block_tokens,
    hash_packed_blocks,
    hash_prompt,
    le_bytes,
    pack_token_ids,
    root_hash,
    spec_fingerprint,
    token_array,
)
from kvservice.hashing.spec import DEFAULT_HASH_SPEC, HashSpec

__all__ = [
    "DEFAULT_HASH_BLOCK_SIZE", "DEFAULT_HASH_SEED", "DEFAULT_HASH_SPEC", "HASH_BYTES", "MAX_TOKEN_ID", "SPEC_VERSION",
    "TAG_CACHE_SALT", "TAG_LORA", "TAG_LORA_PATH", "TAG_MM_ITEM", "BlockHash", "HashSpec", "MultiModalItem",
    "TokenIdError", "block_extra_keys", "hash_block", "hash_block_tokens", "hash_packed_blocks", "hash_prompt",
    "le_bytes", "pack_token_ids", "root_hash", "spec_fingerprint", "token_array",
]

"""HashSpec: which block-hash chain a pool (and its clients) use, named by a fingerprint.

    HashSpec()                      kvservice's own (README, "Hash specs"): xxh3_128 over packed uint32 tokens,
                                    16-byte hashes, root H(seed "kvservice-v1")
    HashSpec("sha256"), ("sha256_cbor"), ("xxhash"), ("xxhash_cbor")
                                    vLLM 0.33.0's (vllm_spec.py): 32-byte (sha256) or 16-byte hashes,
                                    root NONE_HASH = H(seed "vllm-none-hash")

A pool carries one spec; the service compares fingerprints at registration and refuses a mismatch,
and namespaces each hash per tenant whatever its length (`hash_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvservice.hashing import chain, vllm_spec

KVSERVICE = "kvservice"


@dataclass(slots=True, frozen=True)
class HashSpec:
    """Args:
        algorithm: "kvservice" (the default) or one of vLLM's `vllm_spec.ALGORITHMS`.
        seed: the root's seed (None: the algorithm's default seed).
        block_size: tokens per hashed block (the service's hash block size).
    """

    algorithm: str = KVSERVICE
    seed: str | None = None
    block_size: int = chain.DEFAULT_HASH_BLOCK_SIZE
    _root: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.algorithm != KVSERVICE and self.algorithm not in vllm_spec.ALGORITHMS:
            raise ValueError(f"HashSpec.algorithm must be {KVSERVICE!r} or one of "
                             f"{', '.join(vllm_spec.ALGORITHMS)}, got {self.algorithm!r}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size <= 0:
            raise ValueError(f"HashSpec.block_size must be a positive int, got {self.block_size!r}")
        if self.seed is not None and not isinstance(self.seed, str):
            raise ValueError(f"HashSpec.seed must be a str, got {self.seed!r}")
        root = chain.root_hash(self.effective_seed) if self.is_kvservice else \
            vllm_spec.none_hash(vllm_spec.hash_function(self.algorithm), self.effective_seed)
        object.__setattr__(self, "_root", root)

    @property
    def is_kvservice(self) -> bool:
        return self.algorithm == KVSERVICE

    @property
    def effective_seed(self) -> str:
        if self.seed is not None:
            return self.seed
        return chain.DEFAULT_HASH_SEED if self.is_kvservice else vllm_spec.DEFAULT_NONE_HASH_SEED

    @property
    def hash_bytes(self) -> int:
        return chain.HASH_BYTES if self.is_kvservice else vllm_spec.DIGEST_BYTES[self.algorithm]

    @property
    def root(self) -> bytes:
        return self._root

    def fingerprint(self) -> str:
        """Names the algorithm, seed and block size; kvservice's own is `spec_fingerprint`'s."""
        if self.is_kvservice:
            return chain.spec_fingerprint(self.effective_seed, self.block_size)
        text = f"kvservice-hash/{chain.SPEC_VERSION};vllm-{self.algorithm};seed={self.effective_seed};" \
               f"block={self.block_size}"
        return xxhash.xxh3_64_hexdigest(text.encode("utf-8"))

    def hash_function(self):
        """vLLM's H for a vLLM spec (None for kvservice's own)."""
        return None if self.is_kvservice else vllm_spec.hash_function(self.algorithm)

    def hash_block(self, parent: bytes | None, tokens, extra: Any = None) -> bytes:
        """One block chained after `parent` (None: the root). `extra`: bytes (kvservice's extra_i) or
        a tuple of tagged keys (vLLM's)."""
        if self.is_kvservice:
            return chain.hash_block(parent or self._root, chain.pack_token_ids(tokens), extra or b"")
        return vllm_spec.hash_block_tokens(vllm_spec.hash_function(self.algorithm), parent, tokens, extra, self._root)


DEFAULT_HASH_SPEC = HashSpec()

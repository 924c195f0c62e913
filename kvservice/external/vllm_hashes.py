"""Checking an engine's published block hashes against its declared spec: vLLM 0.33.0's hashes come from
kvservice.hashing.vllm_spec (byte-exact re-implementations); what is particular to events is here.

    block_hash = hash_fn((parent or NONE_HASH, tuple(token_ids), extra_keys))
    NONE_HASH  = hash_fn(seed)     seed: the engine's PYTHONHASHSEED, else "vllm-none-hash"

The xxhash algorithms draw a random NONE_HASH seed per process unless PYTHONHASHSEED is set, so their
root blocks are checkable only with a declared seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvservice.hashing.vllm_spec import ALGORITHMS, DEFAULT_NONE_HASH_SEED, hash_function

__all__ = ["ALGORITHMS", "RANDOM_ROOT_ALGORITHMS", "block_hash", "external_form", "hash_function", "none_hash"]

RANDOM_ROOT_ALGORITHMS = frozenset({"xxhash", "xxhash_cbor"})  # random NONE_HASH unless PYTHONHASHSEED is set


def none_hash(algorithm: str, seed: str | None = None) -> bytes | None:
    """The root parent of every chain, or None when it is unknowable (xxhash without a declared seed)."""
    if seed is None:
        if algorithm in RANDOM_ROOT_ALGORITHMS:
            return None
        seed = DEFAULT_NONE_HASH_SEED
    return hash_function(algorithm)(seed)


def block_hash(algorithm: str, parent: bytes, token_ids: Sequence[int],
               extra_keys: tuple[Any, ...] | None = None) -> bytes:
    """One block's hash, chained after `parent` (a block hash, or `none_hash` for block 0)."""
    return hash_function(algorithm)((parent, tuple(token_ids), extra_keys))


def external_form(block_hash_bytes: bytes, as_int: bool) -> bytes | int:
    """What events carry: the bytes, or (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) their low 64 bits as an int."""
    return int.from_bytes(block_hash_bytes, "big") & ((1 << 64) - 1) if as_int else block_hash_bytes

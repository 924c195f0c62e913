"""vLLM 0.33.0's prefix-cache block hashes, re-implemented to check a declared spec against an engine's events.

    block_hash = hash_fn((parent or NONE_HASH, tuple(token_ids), extra_keys))
    NONE_HASH  = hash_fn(seed)     seed: the engine's PYTHONHASHSEED, else "vllm-none-hash"

`hash_fn` is one of vLLM's four (`--prefix-caching-hash-algo`): sha256 / xxhash over `pickle.dumps(obj,
protocol=5)`, sha256_cbor / xxhash_cbor over canonical CBOR. The xxhash ones draw a random NONE_HASH seed
per process unless PYTHONHASHSEED is set, so their root blocks are checkable only with a declared seed.
The CBOR encoder below covers exactly the value shapes vLLM hashes (None, ints, str, bytes, tuples).

To merge with the core's per-pool HashSpec (kvservice.hashing) once that lands.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
RANDOM_ROOT_ALGORITHMS = frozenset({"xxhash", "xxhash_cbor"})  # random NONE_HASH unless PYTHONHASHSEED is set


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes((major << 5 | value,))
    if value < 1 << 8:
        return bytes((major << 5 | 24, value))
    if value < 1 << 16:
        return bytes((major << 5 | 25,)) + struct.pack(">H", value)
    if value < 1 << 32:
        return bytes((major << 5 | 26,)) + struct.pack(">I", value)
    if value < 1 << 64:
        return bytes((major << 5 | 27,)) + struct.pack(">Q", value)
    raise ValueError(f"integer {value} does not fit CBOR's 64-bit heads (vLLM never hashes one)")


def cbor_dumps(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949 §4.2.1) of None, bool, int, str, bytes and tuples/lists of them."""
    out = bytearray()
    _cbor_into(value, out)
    return bytes(out)


def _cbor_into(value: Any, out: bytearray) -> None:
    if value is None:
        out.append(0xF6)
    elif value is True or value is False:
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        out += _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    elif isinstance(value, bytes):
        out += _cbor_head(2, len(value))
        out += value
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += _cbor_head(3, len(raw))
        out += raw
    elif isinstance(value, (tuple, list)):
        out += _cbor_head(4, len(value))
        for item in value:
            _cbor_into(item, out)
    else:
        raise TypeError(f"cannot CBOR-encode a {type(value).__name__} (vLLM hashes None, ints, str, bytes, tuples)")


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=5)


_SERIALIZE: dict[str, Callable[[Any], bytes]] = {"sha256": _pickled, "xxhash": _pickled,
                                                 "sha256_cbor": cbor_dumps, "xxhash_cbor": cbor_dumps}
_DIGEST: dict[str, Callable[[bytes], bytes]] = {"sha256": lambda b: hashlib.sha256(b).digest(),
                                              "sha256_cbor": lambda b: hashlib.sha256(b).digest(),
                                              "xxhash": xxhash.xxh3_128_digest, "xxhash_cbor": xxhash.xxh3_128_digest}


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    """vLLM's `get_hash_fn_by_name(algorithm)`, re-implemented."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"hash algorithm {algorithm!r} is not one of vLLM's {', '.join(ALGORITHMS)}")
    serialize, digest = _SERIALIZE[algorithm], _DIGEST[algorithm]
    return lambda value: digest(serialize(value))


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

"""Chained block hashes — byte-exact to the README's "Hash specs", so a client in any language computes the same.

    H(x)   = xxh3_128(x, seed=0).digest()            (16 bytes, canonical big-endian order)
    h_root = H(seed_string.encode("utf-8"))
    h_i    = H(h_{i-1} || le_u32(t_0) ... le_u32(t_{B-1}) || extra_i),   h_{-1} = h_root

`extra_i`: `tag || le_u32(len) || value` fields — 0x01 cache salt (block 0 only), 0x02 LoRA name and,
when the adapter has one, 0x04 its path (every block), 0x03 per multimodal item overlapping the block.
Spec version 2 (version 1 had no LoRA path: re-pointing a LoRA name at another adapter served the
old adapter's KV).

A whole prompt is validated and packed to little-endian uint32 once (numpy), then hashed with one
xxh3 call per block over a memoryview slice: no Python loop per token.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", bytes)

DEFAULT_HASH_SEED = "kvservice-v1"
DEFAULT_HASH_BLOCK_SIZE = 16
HASH_BYTES = 16
MAX_TOKEN_ID = 2**32 - 1

TAG_CACHE_SALT = 0x01
TAG_LORA = 0x02
TAG_MM_ITEM = 0x03
TAG_LORA_PATH = 0x04
SPEC_VERSION = 2

_h128 = xxhash.xxh3_128_digest
_LITTLE_ENDIAN = sys.byteorder == "little"
if array("I").itemsize != 4:  # pragma: no cover - every mainstream platform has a 4-byte C int
    raise ImportError("kvservice needs array('I') items of 4 bytes")


def root_hash(seed: str = DEFAULT_HASH_SEED) -> BlockHash:
    """The chain's parent for block 0: H(seed_string)."""
    if not isinstance(seed, str):
        raise TypeError(f"hash seed must be a str, got {type(seed).__name__}")
    return BlockHash(_h128(seed.encode("utf-8")))


def spec_fingerprint(seed: str = DEFAULT_HASH_SEED, hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE) -> str:
    """Identifies a hash spec; pools and clients send it and the allocator refuses a mismatch."""
    text = f"kvservice-hash/{SPEC_VERSION};xxh3_128;seed={seed};block={hash_block_size}"
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8"))


class TokenIdError(ValueError):
    """A token id outside [0, 2**32)."""


def token_array(token_ids: Sequence[int] | np.ndarray, field: str = "token_ids") -> array:
    """Validates token ids into a compact uint32 array (native byte order).

    Raises:
        TokenIdError: naming `field`, the offending index and value, when an id is outside [0, 2**32)
            or not an integer.
    """
    if isinstance(token_ids, np.ndarray):
        return _array_from_numpy(token_ids, field)
    if isinstance(token_ids, (bytes, bytearray, memoryview, str)):
        raise TokenIdError(f"{field} must be a sequence of ints, got {type(token_ids).__name__}")
    try:
        return array("I", token_ids)  # range-checks every element in C
    except (OverflowError, TypeError):
        for i, t in enumerate(token_ids):
            if not isinstance(t, (int, np.integer)) or not 0 <= t <= MAX_TOKEN_ID:
                raise TokenIdError(f"{field}[{i}] = {t!r} is not a token id in [0, 2**32)") from None
        raise


def _array_from_numpy(arr: np.ndarray, field: str) -> array:
    if arr.ndim != 1:
        raise TokenIdError(f"{field} must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TokenIdError(f"{field} must hold integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype != np.uint32 and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        bad = int(np.flatnonzero((arr < 0) | (arr > MAX_TOKEN_ID))[0])
        raise TokenIdError(f"{field}[{bad}] = {int(arr[bad])} is not a token id in [0, 2**32)")
    out = array("I")
    out.frombytes(arr.astype(np.uint32, copy=False).tobytes())
    return out


def le_bytes(tokens: array) -> bytes:
    """uint32 little-endian bytes of a token array (the wire and hash encoding)."""
    if _LITTLE_ENDIAN:
        return tokens.tobytes()
    swapped = array("I", tokens)
    swapped.byteswap()
    return swapped.tobytes()


def pack_token_ids(token_ids: Sequence[int] | np.ndarray, field: str = "token_ids") -> bytes:
    """Validates token ids and packs them as little-endian uint32 bytes."""
    return le_bytes(token_array(token_ids, field))


def _field(tag: int, value: bytes) -> bytes:
    return bytes((tag,)) + struct.pack("<I", len(value)) + value


@dataclass(slots=True, frozen=True)
class MultiModalItem:
    """A multimodal input occupying prompt positions [offset, offset + length)."""

    identifier: str
    offset: int
    length: int


def block_extra_keys(
    block_start: int,
    block_end: int,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    mm_items: Sequence[MultiModalItem] = (),
    lora_path: str | None = None,
) -> bytes:
    """The chain's `extra_i` bytes (README, "Hash specs") for the block covering positions [block_start, block_end)."""
    out = b""
    if cache_salt is not None and block_start == 0:
        out += _field(TAG_CACHE_SALT, cache_salt.encode("utf-8"))
    if lora_name is not None:
        out += _field(TAG_LORA, lora_name.encode("utf-8"))
        if lora_path is not None:
            out += _field(TAG_LORA_PATH, lora_path.encode("utf-8"))
    for item in mm_items:  # given in position order
        if item.offset < block_end and item.offset + item.length > block_start:
            value = item.identifier.encode("utf-8") + struct.pack("<i", item.offset - block_start)
            out += _field(TAG_MM_ITEM, value)
    return out


def hash_block(parent: bytes, packed_tokens: bytes | memoryview, extra: bytes = b"") -> BlockHash:
    """h_i = H(parent || packed tokens || extra)."""
    return BlockHash(_h128(parent + packed_tokens + extra))


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"",
                      seed: str = DEFAULT_HASH_SEED) -> BlockHash:
    """Hashes one block of token ids chained after `parent` (None: the root of `seed`)."""
    if parent is None:
        parent = root_hash(seed)
    return hash_block(parent, pack_token_ids(token_ids), extra)


def hash_packed_blocks(
    packed: bytes,
    block_size: int,
    parent: bytes,
    first_block: int = 0,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    mm_items: Sequence[MultiModalItem] = (),
    lora_path: str | None = None,
) -> list[BlockHash]:
    """Hashes every full block of already-packed uint32-LE tokens.

    Args:
        packed: tokens of blocks first_block, first_block + 1, ... as little-endian uint32 bytes.
        parent: hash of block first_block - 1 (the root for block 0).
        first_block: index of the first block in `packed` (positions for extra keys).
    Returns:
        One hash per full block; a trailing partial block is not hashed.
    """
    stride = 4 * block_size
    end = len(packed) - len(packed) % stride
    out: list[BlockHash] = []
    append = out.append
    if cache_salt is None and lora_name is None and not mm_items:
        for i in range(0, end, stride):
            parent = _h128(parent + packed[i:i + stride])
            append(parent)
        return out
    for i in range(0, end, stride):
        start = first_block * block_size + i // 4
        extra = block_extra_keys(start, start + block_size, cache_salt, lora_name, mm_items, lora_path)
        parent = _h128(parent + packed[i:i + stride] + extra)
        append(parent)
    return out


def hash_prompt(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int = DEFAULT_HASH_BLOCK_SIZE,
    seed: str = DEFAULT_HASH_SEED,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    mm_items: Sequence[MultiModalItem] = (),
    lora_path: str | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of a prompt, as a client would send them."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return hash_packed_blocks(pack_token_ids(token_ids), block_size, root_hash(seed), 0,
                              cache_salt, lora_name, mm_items, lora_path)

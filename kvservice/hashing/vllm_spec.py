"""vLLM 0.33.0's block hashes, byte-exact, so a vLLM client's own `Request.block_hashes` can be sent
as they are.

    H(obj)  = sha256 | xxh3_128 of  pickle.dumps(obj, HIGHEST_PROTOCOL) | canonical CBOR(obj)
    root    = NONE_HASH = H(seed)        seed "vllm-none-hash" (vLLM's default for sha256; kvservice
                                         uses it for every algorithm: deterministic, never random)
    h_i     = H((h_{i-1} or root, tuple(tokens of block i), extra_i))

`extra_i` is None or a tuple of tagged keys, in this order: ("lora", name, path), ("mm", identifier,
item offset - block start) per multimodal item overlapping the block, ("cache_salt", salt) on block
0, ("prompt_embeds", sha256 of the block's embeddings). With L lookahead tokens a hash also covers the
L tokens after its block: extra becomes (extra over the block and them, *those tokens).
"""

from __future__ import annotations

import bisect
import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from kvservice.hashing.cbor import dumps_canonical

ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_PICKLE = pickle.HIGHEST_PROTOCOL


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(dumps_canonical(obj)).digest()


def _xxhash(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=_PICKLE))


def _xxhash_cbor(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(dumps_canonical(obj))


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256, "sha256_cbor": _sha256_cbor, "xxhash": _xxhash, "xxhash_cbor": _xxhash_cbor}
DIGEST_BYTES = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    try:
        return HASH_FUNCTIONS[algorithm]
    except KeyError:
        raise ValueError(f"unknown vLLM hash algorithm {algorithm!r}; one of {', '.join(ALGORITHMS)}") from None


def none_hash(hash_fn: Callable[[Any], bytes], seed: str = DEFAULT_NONE_HASH_SEED) -> bytes:
    """The chain's root: H(seed)."""
    return hash_fn(seed)


def hash_block_tokens(hash_fn: Callable[[Any], bytes], parent: bytes | None, tokens: Sequence[int],
                      extra_keys: tuple | None, root: bytes) -> bytes:
    return hash_fn((parent or root, tuple(tokens), extra_keys))


class MMSpan:
    """What the extra keys need of a multimodal item: its identifier and prompt span."""

    __slots__ = ("identifier", "offset", "length")

    def __init__(self, identifier: str, offset: int, length: int) -> None:
        self.identifier, self.offset, self.length = identifier, offset, length


def mm_extra_keys(items: Sequence[MMSpan], start: int, end: int, mm_idx: int) -> tuple[list[tuple], int]:
    """("mm", identifier, offset - start) per item overlapping [start, end), scanning from `mm_idx`
    (negative: from the end); returns the keys and the index to resume from for the next block."""
    keys: list[tuple] = []
    if not items:
        return keys, mm_idx
    last = items[-1]
    if last.offset + last.length <= start:
        return keys, mm_idx
    if mm_idx < 0:
        if -mm_idx > len(items):
            raise AssertionError(f"multimodal index {mm_idx} out of {len(items)} items")
        mm_idx += len(items)
    i = mm_idx
    while i < len(items):
        item = items[i]
        if end <= item.offset:
            break  # the block has not reached this item
        if start >= item.offset + item.length:
            i += 1  # the block is past it
            continue
        keys.append(("mm", item.identifier, item.offset - start))
        if end >= item.offset + item.length:
            i += 1  # the block holds its end: the next item may start inside it too
        else:
            break
    return keys, i


def first_item_in_window(items: Sequence[MMSpan], start: int) -> int:
    """Index of the first item ending after `start` (items sorted and disjoint)."""
    return bisect.bisect_left(items, start + 1, key=lambda item: item.offset + item.length)


def block_extra_keys(start: int, end: int, mm_idx: int, *, lora: tuple[str, str] | None = None,
                     mm_items: Sequence[MMSpan] = (), cache_salt: str | None = None,
                     prompt_embeds_digest: Callable[[int, int], bytes] | None = None) -> tuple[tuple | None, int]:
    """vLLM's `generate_block_hash_extra_keys`: (the block's tagged keys or None, next mm index)."""
    mm_keys, next_idx = mm_extra_keys(mm_items, start, end, mm_idx)
    keys: list = [("lora", lora[0], lora[1])] if lora else []
    keys += mm_keys
    if start == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    if prompt_embeds_digest is not None:
        keys.append(("prompt_embeds", prompt_embeds_digest(start, end)))
    return (tuple(keys) if keys else None), next_idx


def lookahead_extra_keys(start: int, end: int, hash_end: int, mm_idx: int, mm_items: Sequence[MMSpan] = (),
                         **kwargs) -> tuple[tuple | None, int]:
    """Extra keys over the block and its lookahead tokens [start, hash_end); the mm index rewinds to
    items that still overlap the next block."""
    keys, idx = block_extra_keys(start, hash_end, mm_idx, mm_items=mm_items, **kwargs)
    while idx > 0:
        item = mm_items[idx - 1]
        if item.offset + item.length <= end:
            break
        idx -= 1
    return keys, idx


def event_extra_keys(keys_per_block: Sequence[tuple | None] | None) -> list | None:
    """The untagged per-block keys vLLM's KV events publish: bare LoRA names and salts, (identifier,
    offset) pairs, bare embedding digests."""
    if not keys_per_block:
        return None
    out = [None if keys is None else tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
           for keys in keys_per_block]
    return out or None

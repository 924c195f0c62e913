"""vLLM's hashing entry points over vLLM's `Request`, computed by kvservice.hashing.vllm_spec.

The chain's root is vLLM's declared NONE_HASH (`init_none_hash` sets it; kv_cache_utils holds it);
a known vLLM hash function (sha256, sha256_cbor, xxhash, xxhash_cbor) is computed by kvservice's own
implementation, any other callable is called as it is (the caller's own spec).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from vllm.utils import hashing as vh
from vllm.v1.core import kv_cache_utils

from kvservice.hashing import vllm_spec

_OURS = {vh.sha256: "sha256", vh.sha256_cbor: "sha256_cbor", vh.xxhash: "xxhash", vh.xxhash_cbor: "xxhash_cbor"}


def our_hash_function(hash_fn: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    algorithm = _OURS.get(hash_fn)
    return hash_fn if algorithm is None else vllm_spec.hash_function(algorithm)


def none_hash() -> bytes:
    return kv_cache_utils.NONE_HASH


def hash_block_tokens(hash_function: Callable[[Any], bytes], parent_block_hash: bytes | None,
                      curr_block_token_ids, extra_keys: tuple | None = None) -> bytes:
    return vllm_spec.hash_block_tokens(our_hash_function(hash_function), parent_block_hash, curr_block_token_ids,
                                       extra_keys, none_hash())


def mm_spans(request) -> list[vllm_spec.MMSpan]:
    return [vllm_spec.MMSpan(f.identifier, f.mm_position.offset, f.mm_position.length)
            for f in request.mm_features or ()]


def _embeds_digest(request) -> Callable[[int, int], bytes] | None:
    if request.prompt_embeds is None:
        return None

    def digest(start: int, end: int) -> bytes:
        cache = request._prompt_embeds_per_block_hashes
        out = cache.get((start, end))
        if out is None:  # the block's embeddings as raw bytes, hashed once per block
            # vLLM's byte view of a tensor (tests count its calls).
            data = kv_cache_utils.tensor_data(request.prompt_embeds[start:end])
            out = cache[(start, end)] = hashlib.sha256(data).digest()
        return out

    return digest


def _request_keys(request) -> dict:
    lora = request.lora_request
    return dict(lora=(lora.lora_name, lora.lora_path) if lora else None, mm_items=mm_spans(request),
                cache_salt=request.cache_salt, prompt_embeds_digest=_embeds_digest(request))


def generate_block_hash_extra_keys(request, start_token_idx: int, end_token_idx: int,
                                   start_mm_idx: int) -> tuple[tuple | None, int]:
    return vllm_spec.block_extra_keys(start_token_idx, end_token_idx, start_mm_idx, **_request_keys(request))


def generate_lookahead_block_hash_extra_keys(request, start_token_idx: int, end_token_idx: int,
                                             hash_end_token_idx: int, start_mm_idx: int) -> tuple[tuple | None, int]:
    return vllm_spec.lookahead_extra_keys(start_token_idx, end_token_idx, hash_end_token_idx, start_mm_idx,
                                          **_request_keys(request))


def get_request_block_hasher(hash_block_size: int, caching_hash_fn: Callable[[Any], bytes],
                             num_hash_lookahead_tokens: int = 0) -> Callable[[Any], list[bytes]]:
    """vLLM's per-request hasher: the hashes of the request's full blocks not hashed yet (a block
    whose lookahead tokens have not arrived yet waits)."""
    fn = our_hash_function(caching_hash_fn)
    lookahead = num_hash_lookahead_tokens

    def request_block_hasher(request) -> list[bytes]:
        start = len(request.block_hashes) * hash_block_size
        num_tokens = request.num_tokens - lookahead
        if start + hash_block_size > num_tokens:
            return []
        keys = _request_keys(request)
        items = keys["mm_items"]
        mm_idx = 0
        if start > 0 and items and items[-1].offset + items[-1].length > start:
            mm_idx = vllm_spec.first_item_in_window(items, start)
        parent = request.block_hashes[-1] if request.block_hashes else None
        root = none_hash()
        tokens = request.all_token_ids
        out: list[bytes] = []
        if not lookahead and keys["lora"] is None and not items and not keys["cache_salt"] \
                and keys["prompt_embeds_digest"] is None:  # no extra keys: None for every block
            while start + hash_block_size <= num_tokens:
                end = start + hash_block_size
                parent = fn((parent or root, tuple(tokens[start:end]), None))
                out.append(parent)
                start = end
            return out
        while start + hash_block_size <= num_tokens:
            end = start + hash_block_size
            if lookahead:
                extra, mm_idx = vllm_spec.lookahead_extra_keys(start, end, end + lookahead, mm_idx, **keys)
                extra = (extra, tokens[end]) if lookahead == 1 else (extra, *tokens[end:end + lookahead])
            else:
                extra, mm_idx = vllm_spec.block_extra_keys(start, end, mm_idx, **keys)
            parent = fn((parent or root, tuple(tokens[start:end]), extra))
            out.append(parent)
            start = end
        return out

    return request_block_hasher

"""The save protocol of a store pool, as ops: a prompt's whole blocks become pages in two Steps.

1. `admit_save`: a store request over the whole blocks plus one token (so every whole block can hit), admitted
   with delay_cache_blocks. Its result's hit is what the store holds already; the rest of its table are
   fresh pages, which no Lookup or pin finds yet.
2. The pages are written; then `commit_save` caches them up to `num_tokens` and frees the request (the pages
   stay, LRU-evictable), or `FreeOp` alone when they were not written.
"""

from __future__ import annotations

from kvservice.ops import AddRequestOp, AllocateOp, FreeOp


def admit_save(save_id: str, tokens: list[int], num_tokens: int, cache_salt: str | None = None) -> list:
    return [AddRequestOp(save_id, token_ids=list(tokens[:num_tokens]) + [0], cache_salt=cache_salt),
            AllocateOp(save_id, num_new_tokens=num_tokens + 1, delay_cache_blocks=True)]


def commit_save(save_id: str, num_tokens: int) -> list:
    return [AllocateOp(save_id, num_computed_tokens=num_tokens + 1, cache_tokens=num_tokens), FreeOp(save_id)]

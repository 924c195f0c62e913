"""Mamba prefill checkpoints (vLLM 0.33.0's rules): where a prefill's reusable state lies, and whether
a chunk can export an interior one."""

from __future__ import annotations

from kvservice.core.managers.base import cdiv


def get_mamba_prefill_checkpoint_position(num_tokens: int, hash_block_size: int, drop_eagle_block: bool,
                                          num_hash_lookahead_tokens: int = 0) -> int:
    """The reusable state boundary of a prefill of `num_tokens`: below it, on the hash granularity,
    leaving a token to recompute for logits (and the lookahead a hash covers); EAGLE drops a unit."""
    limit = num_tokens if drop_eagle_block else num_tokens - max(1, num_hash_lookahead_tokens)
    position = limit // hash_block_size * hash_block_size
    if drop_eagle_block:
        position -= hash_block_size
    return max(position, 0)


def is_mamba_prefill_checkpoint_valid(query_start: int, query_end: int, checkpoint_position: int,
                                      hash_block_size: int, mamba_block_size: int,
                                      checkpoint_alignment: int | None) -> bool:
    """Whether a chunk [query_start, query_end) can export a state at `checkpoint_position`."""
    if checkpoint_alignment is None:
        return False
    initial_col = (query_start - 1) // mamba_block_size
    checkpoint_col = cdiv(query_end, mamba_block_size) - 2
    return (query_start % hash_block_size == 0 and checkpoint_col > initial_col
            and query_start + hash_block_size <= checkpoint_position
            and query_start < checkpoint_position < query_end
            and (checkpoint_position - query_start) % checkpoint_alignment == 0)

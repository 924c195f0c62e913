"""Server side: the packed ops (DecodeBatchOp, AllocateBatchOp, AdmitBatchOp) as they arrive -> domain ops,
every column checked in C first (the loop that names the bad entry runs only when one fails)."""

from __future__ import annotations

from kvservice._proto import allocator_pb2 as pb
from kvservice.errors import InvalidArgument
from kvservice.ops import (
    ALLOCATE_ROW,
    ROW_FLAGS,
    ROW_WIDTH,
    AdmitBatchOp,
    AllocateBatchOp,
    DecodeBatchOp,
)
from kvservice.wire.fields import (
    at_most,
    check_ids,
    check_names,
    decode_counts,
    decode_hashes,
    decode_u32,
    max_u32,
)


def decode_batch(d: pb.DecodeBatchOp, max_len: int, vocab: int, field: str) -> DecodeBatchOp:
    request_ids = check_ids(f"{field}.request_ids", list(d.request_ids))
    n = len(request_ids)
    what = f"max_model_len {max_len}"
    computed = decode_counts(f"{field}.num_computed_tokens", d.num_computed_tokens, n, max_len, what=what)
    tokens = None
    if d.append_token_ids:
        tokens = decode_u32(f"{field}.append_token_ids", d.append_token_ids, vocab)
        if len(tokens) != n:
            raise InvalidArgument(f"{field}.append_token_ids", f"<{len(tokens)} tokens>",
                                  f"needs one token per request ({n}) or none")
    at_most(f"{field}.num_new_tokens", d.num_new_tokens, max_len, what)
    at_most(f"{field}.num_lookahead_tokens", d.num_lookahead_tokens, max_len, what)
    # Lists: the allocator reads every entry, and a list hands out its int objects, an array makes them.
    return DecodeBatchOp(request_ids, computed.tolist(), None if tokens is None else tokens.tolist(),
                         d.num_new_tokens or 1, d.num_lookahead_tokens)


# The AllocateBatchOp row fields bounded by max_model_len (each at most it, as in an AllocateOp).
_ROW_BOUNDED = tuple(ALLOCATE_ROW.index(f) for f in (
    "num_computed_tokens", "num_new_tokens", "num_lookahead_tokens", "num_append_tokens", "num_output_placeholders",
    "num_in_flight_tokens", "cache_tokens"))


def decode_allocate_batch(d: pb.AllocateBatchOp, max_len: int, field: str, hash_bytes: int) -> AllocateBatchOp:
    """Columns checked in C (the loop that names the bad row runs only when one fails): each row as
    `decode_allocate` checks an AllocateOp of a vLLM pool without a lookup."""
    request_ids = check_ids(f"{field}.request_ids", list(d.request_ids))
    n = len(request_ids)
    if not n:
        raise InvalidArgument(f"{field}.request_ids", [], "name at least one request")
    rows = decode_u32(f"{field}.rows", d.rows)
    if len(rows) != ROW_WIDTH * n:
        raise InvalidArgument(f"{field}.rows", f"<{len(rows)} values>",
                              f"needs {ROW_WIDTH} uint32 per request ({ROW_WIDTH * n})")
    hashes = decode_hashes(f"{field}.append_block_hashes", d.append_block_hashes, hash_bytes)
    what = f"max_model_len {max_len}"
    for k in _ROW_BOUNDED:
        column = rows[k::ROW_WIDTH]
        if max_u32(column) > max_len:
            j = next(j for j, v in enumerate(column) if v > max_len)
            raise InvalidArgument(f"{field}.rows[{j}].{ALLOCATE_ROW[k]}", column[j], f"exceeds {what}")
    flags = rows[ROW_WIDTH - 1::ROW_WIDTH]
    if max_u32(flags) > ROW_FLAGS:
        j = next(j for j, v in enumerate(flags) if v > ROW_FLAGS)
        raise InvalidArgument(f"{field}.rows[{j}].flags", flags[j], f"only bits 1, 2, 4 and 8 (at most {ROW_FLAGS})")
    num_hashes = rows[4::ROW_WIDTH]
    if sum(num_hashes) != len(hashes):
        raise InvalidArgument(f"{field}.append_block_hashes", f"<{len(hashes)} hashes>",
                              f"the rows' num_append_hashes add up to {sum(num_hashes)}")
    num_append = rows[3::ROW_WIDTH]
    for j, (h, a) in enumerate(zip(num_hashes, num_append)):
        if h and not a:
            raise InvalidArgument(f"{field}.rows[{j}].num_append_tokens", 0,
                                  f"must be in [1, {what}] when appending hashes")
    return AllocateBatchOp(request_ids, rows, hashes)


def decode_admit(a: pb.AdmitBatchOp, max_len: int, vocab: int, field: str) -> AdmitBatchOp:
    request_ids = check_ids(f"{field}.request_ids", list(a.request_ids))
    n = len(request_ids)
    what = f"max_model_len {max_len}"
    lengths = decode_counts(f"{field}.num_prompt_tokens", a.num_prompt_tokens, n, max_len, minimum=1, what=what)
    tokens = decode_u32(f"{field}.token_ids", a.token_ids, vocab)
    if len(tokens) != sum(lengths):
        raise InvalidArgument(f"{field}.token_ids", f"<{len(tokens)} tokens>",
                              f"num_prompt_tokens add up to {sum(lengths)}")
    budgets = None
    if a.num_new_tokens:
        budgets = decode_counts(f"{field}.num_new_tokens", a.num_new_tokens, n, max_len, what=what).tolist()
    at_most(f"{field}.num_lookahead_tokens", a.num_lookahead_tokens, max_len, what)
    prompts, start = [], 0
    for length in lengths:
        prompts.append(tokens[start:start + length])
        start += length
    return AdmitBatchOp(request_ids, prompts, budgets, a.num_lookahead_tokens,
                        check_names(f"{field}.cache_salts", a.cache_salts, n),
                        check_names(f"{field}.lora_names", a.lora_names, n))


# ---- commands ------------------------------------------------------------------------------------

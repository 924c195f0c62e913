"""Protobuf ⇄ domain translation, shared by the server and the client (one way to do it).

Decoding validates every field a request carries and raises `InvalidArgument` naming the field (as
a path like `ops[3].allocate.request_id`) and its value, before anything is applied.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import numpy as np

from kvservice._proto import allocator_pb2 as pb
from kvservice.core import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
)
from kvservice.errors import InvalidArgument
from kvservice.hashing import HASH_BYTES, MultiModalItem
from kvservice.ops import (
    AddRequestOp,
    AdmitBatchOp,
    AllocateOp,
    DecodeBatchOp,
    DecodeBatchResult,
    ForkOp,
    FreeOp,
    Op,
    OpResult,
    OpStatus,
    StepResult,
    TransferOrder,
)
from kvservice.pools import PoolSpec

MAX_ID_BYTES = 256
MAX_NAME_BYTES = 256
MAX_OPS_PER_STEP = 16_384
MAX_BLOCKS = 1 << 31
MAX_MODEL_LEN = 1 << 24
MAX_EPOCH = (1 << 63) - 1  # the allocator bumps epochs (stale recovery): keep them inside the uint64 on the wire
_LITTLE = sys.byteorder == "little"


# ---- primitives ----------------------------------------------------------------------------------
def check_id(field: str, value: str) -> str:
    if not value:
        raise InvalidArgument(field, value, "must not be empty")
    if len(value) > MAX_ID_BYTES or len(value.encode()) > MAX_ID_BYTES:
        raise InvalidArgument(field, value, f"longer than {MAX_ID_BYTES} bytes")
    if not value.isprintable():
        raise InvalidArgument(field, value, "must not contain control characters")
    return value


def check_name(field: str, value: str) -> str | None:
    if not value:
        return None
    if len(value.encode()) > MAX_NAME_BYTES:
        raise InvalidArgument(field, value, f"longer than {MAX_NAME_BYTES} bytes")
    return value


def max_u32(values: array) -> int:
    """max() of a non-empty uint32 array; numpy's for long ones (no int object per element)."""
    return int(np.frombuffer(values, dtype=np.uint32).max()) if len(values) >= 32 else max(values)


def decode_tokens(field: str, data: bytes, vocab_size: int = 0) -> array:
    if len(data) % 4:
        raise InvalidArgument(field, f"<{len(data)} bytes>", "token ids are little-endian uint32: the length must "
                                                             "be a multiple of 4")
    tokens = array("I")
    tokens.frombytes(data)
    if not _LITTLE:
        tokens.byteswap()
    if vocab_size and tokens and max_u32(tokens) >= vocab_size:
        bad = next(i for i, t in enumerate(tokens) if t >= vocab_size)
        raise InvalidArgument(f"{field}[{bad}]", tokens[bad], f"token id out of range for vocab_size {vocab_size}")
    return tokens


def encode_tokens(tokens: Sequence[int] | array) -> bytes:
    arr = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    if not _LITTLE:
        arr = array("I", arr)
        arr.byteswap()
    return arr.tobytes()


def decode_hashes(field: str, data: bytes) -> list[bytes]:
    if len(data) % HASH_BYTES:
        raise InvalidArgument(field, f"<{len(data)} bytes>", f"block hashes are {HASH_BYTES} bytes each: the length "
                                                             f"must be a multiple of {HASH_BYTES}")
    return [data[i:i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]


def check_count(field: str, value: int, limit: int) -> int:
    if value > limit:
        raise InvalidArgument(field, value, f"exceeds the limit {limit}")
    return value


# ---- pools ---------------------------------------------------------------------------------------
def decode_config(msg: pb.KVCacheConfig, field: str = "config") -> tuple[KVCacheConfig, int, int]:
    """Returns (KVCacheConfig, max_model_len, dcp_world_size)."""
    if msg.num_blocks < 2:
        raise InvalidArgument(f"{field}.num_blocks", msg.num_blocks, "must be >= 2 (the null block + 1)")
    check_count(f"{field}.num_blocks", msg.num_blocks, MAX_BLOCKS)
    if not msg.groups:
        raise InvalidArgument(f"{field}.groups", [], "needs at least one KV-cache group")
    if msg.max_model_len == 0:
        raise InvalidArgument(f"{field}.max_model_len", 0, "must be positive")
    check_count(f"{field}.max_model_len", msg.max_model_len, MAX_MODEL_LEN)
    dcp = msg.dcp_world_size or 1
    check_count(f"{field}.dcp_world_size", dcp, 64)
    specs = []
    for i, group in enumerate(msg.groups):
        kind = group.WhichOneof("kind")
        g = f"{field}.groups[{i}]"
        if kind is None:
            raise InvalidArgument(g, "{}", "set one of full_attention, sliding_window, chunked_local, mamba")
        sub = getattr(group, kind)
        if sub.block_size == 0 or sub.block_size > 1 << 16:
            raise InvalidArgument(f"{g}.{kind}.block_size", sub.block_size, "must be in [1, 65536]")
        if kind == "full_attention":
            specs.append(FullAttentionSpec(sub.block_size))
        elif kind == "sliding_window":
            if sub.sliding_window == 0:
                raise InvalidArgument(f"{g}.sliding_window.sliding_window", 0, "must be positive")
            specs.append(SlidingWindowSpec(sub.block_size, sub.sliding_window))
        elif kind == "chunked_local":
            if sub.attention_chunk_size == 0:
                raise InvalidArgument(f"{g}.chunked_local.attention_chunk_size", 0, "must be positive")
            specs.append(ChunkedLocalAttentionSpec(sub.block_size, sub.attention_chunk_size))
        else:
            specs.append(MambaSpec(sub.block_size))
        if dcp > 1 and kind != "full_attention":
            raise InvalidArgument(f"{field}.dcp_world_size", dcp, f"decode context parallelism needs full attention "
                                                                  f"only; groups[{i}] is {kind}")
    return KVCacheConfig(int(msg.num_blocks), specs), msg.max_model_len, dcp


def decode_pool_spec(msg: pb.RegisterPoolRequest, hash_block_size: int) -> PoolSpec:
    pool_id = check_id("pool_id", msg.pool_id)
    if msg.epoch > MAX_EPOCH:
        raise InvalidArgument("epoch", msg.epoch, f"exceeds the limit {MAX_EPOCH}; count engine restarts from 0")
    config, max_model_len, dcp = decode_config(msg.config)
    for i, spec in enumerate(config.groups):
        size = spec.block_size * (dcp if isinstance(spec, FullAttentionSpec) else 1)
        if size % hash_block_size:
            raise InvalidArgument(f"config.groups[{i}].block_size", spec.block_size,
                                  f"the block ({size} tokens) must be a multiple of the service's hash block "
                                  f"size {hash_block_size}")
    return PoolSpec(pool_id, config, max_model_len, dcp, not msg.config.disable_prefix_caching,
                    msg.config.vocab_size, check_name("config.kv_layout", msg.config.kv_layout) or "", msg.epoch)


def encode_config(config: KVCacheConfig, max_model_len: int, dcp_world_size: int = 1, enable_caching: bool = True,
                  vocab_size: int = 0, kv_layout: str = "") -> pb.KVCacheConfig:
    msg = pb.KVCacheConfig(num_blocks=config.num_blocks, max_model_len=max_model_len, dcp_world_size=dcp_world_size,
                           disable_prefix_caching=not enable_caching, vocab_size=vocab_size, kv_layout=kv_layout)
    for spec in config.groups:
        g = msg.groups.add()
        if isinstance(spec, FullAttentionSpec):
            g.full_attention.block_size = spec.block_size
        elif isinstance(spec, SlidingWindowSpec):
            g.sliding_window.block_size = spec.block_size
            g.sliding_window.sliding_window = spec.sliding_window
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            g.chunked_local.block_size = spec.block_size
            g.chunked_local.attention_chunk_size = spec.attention_chunk_size
        else:
            g.mamba.block_size = spec.block_size
    return msg


# ---- ops -----------------------------------------------------------------------------------------
def decode_ops(ops: Sequence[pb.Op], spec: PoolSpec, hash_block_size: int, field: str = "ops") -> list[Op]:
    check_count(field, len(ops), MAX_OPS_PER_STEP)
    out: list[Op] = []
    append = out.append
    max_len = spec.max_model_len
    vocab = spec.vocab_size
    for i, op in enumerate(ops):
        kind = op.WhichOneof("op")
        if kind == "allocate":
            append(decode_allocate(op.allocate, max_len, vocab, field, i))
        elif kind == "add":
            append(decode_add(op.add, max_len, vocab, hash_block_size, field, i))
        elif kind == "decode":
            append(decode_batch(op.decode, max_len, vocab, f"{field}[{i}].decode"))
        elif kind == "admit":
            append(decode_admit(op.admit, max_len, vocab, f"{field}[{i}].admit"))
        elif kind == "free":
            append(FreeOp(check_id(f"{field}[{i}].free.request_id", op.free.request_id)))
        elif kind == "fork":
            f = op.fork
            append(ForkOp(check_id(f"{field}[{i}].fork.parent_request_id", f.parent_request_id),
                          check_id(f"{field}[{i}].fork.child_request_id", f.child_request_id)))
        else:
            raise InvalidArgument(f"{field}[{i}]", "{}", "set one of add, allocate, decode, admit, fork, free")
    return out


def ops_from_request(kind: str, request, spec: PoolSpec, hash_block_size: int) -> list[Op]:
    """The ops of a Step / Allocate / Free / Fork request (the servicer and WAL replay share this)."""
    if kind == "step":
        return decode_ops(request.ops, spec, hash_block_size)
    if kind == "allocate":
        ops: list[Op] = []
        if request.HasField("add"):
            ops.append(decode_add(request.add, spec.max_model_len, spec.vocab_size, hash_block_size, "add", None))
        if not request.HasField("allocate"):
            raise InvalidArgument("allocate", None, "required")
        ops.append(decode_allocate(request.allocate, spec.max_model_len, spec.vocab_size, "allocate"))
        return ops
    if kind == "free":
        if not request.request_ids:
            raise InvalidArgument("request_ids", [], "name at least one request")
        return [FreeOp(check_id(f"request_ids[{i}]", r)) for i, r in enumerate(request.request_ids)]
    if kind == "fork":
        parent = check_id("parent_request_id", request.parent_request_id)
        if not request.child_request_ids:
            raise InvalidArgument("child_request_ids", [], "name at least one child")
        return [ForkOp(parent, check_id(f"child_request_ids[{i}]", c)) for i, c in enumerate(request.child_request_ids)]
    raise ValueError(f"not a step kind: {kind!r}")


def decode_add(a: pb.AddRequestOp, max_len: int, vocab: int, hash_block_size: int, field: str,
               index: int | None) -> AddRequestOp:
    """Validates one add op; `field` (with `index`: `field[index].add`) names it in errors, formatted only
    then. The common case (token ids, short plain id and names, nothing multimodal) is checked inline;
    anything else goes through `_decode_add_slow`, which decides with the full checks."""
    request_id, data, salt, lora = a.request_id, a.token_ids, a.cache_salt, a.lora_name
    num_tokens = len(data) >> 2
    if (request_id and len(request_id) <= MAX_ID_BYTES // 4 and request_id.isprintable() and not len(data) & 3
            and 0 < num_tokens <= max_len and a.num_tokens in (0, num_tokens) and not a.block_hashes
            and not a.mm_items and len(salt) <= MAX_NAME_BYTES // 4 and len(lora) <= MAX_NAME_BYTES // 4):
        tokens = array("I")
        tokens.frombytes(data)
        if not _LITTLE:
            tokens.byteswap()
        if not vocab or max_u32(tokens) < vocab:
            return AddRequestOp(request_id, tokens, None, num_tokens, salt or None, lora or None)
    return _decode_add_slow(a, max_len, vocab, hash_block_size, field if index is None else f"{field}[{index}].add")


def _decode_add_slow(a: pb.AddRequestOp, max_len: int, vocab: int, hash_block_size: int,
                     field: str) -> AddRequestOp:
    request_id = check_id(f"{field}.request_id", a.request_id)
    mm = tuple(MultiModalItem(check_id(f"{field}.mm_items[{j}].identifier", m.identifier), m.offset, m.length)
               for j, m in enumerate(a.mm_items))
    if a.block_hashes:
        if a.token_ids:
            raise InvalidArgument(f"{field}.token_ids", f"<{len(a.token_ids)} bytes>",
                                  "send token_ids or block_hashes, not both")
        if a.cache_salt or mm:
            raise InvalidArgument(f"{field}.cache_salt" if a.cache_salt else f"{field}.mm_items", "...",
                                  "with block_hashes the client hashes salt and multimodal items itself")
        hashes = decode_hashes(f"{field}.block_hashes", a.block_hashes)
        if a.num_tokens == 0 or a.num_tokens > max_len:
            raise InvalidArgument(f"{field}.num_tokens", a.num_tokens, f"must be in [1, max_model_len {max_len}]")
        if len(hashes) != a.num_tokens // hash_block_size:
            raise InvalidArgument(f"{field}.block_hashes", f"<{len(hashes)} hashes>",
                                  f"{a.num_tokens} tokens need {a.num_tokens // hash_block_size} hashes at hash "
                                  f"block size {hash_block_size}")
        return AddRequestOp(request_id, None, hashes, a.num_tokens, None,
                            check_name(f"{field}.lora_name", a.lora_name))
    tokens = decode_tokens(f"{field}.token_ids", a.token_ids, vocab)
    if not tokens:
        raise InvalidArgument(f"{field}.token_ids", "<0 bytes>", "a request needs at least one token (or "
                                                                 "block_hashes with num_tokens)")
    if len(tokens) > max_len:
        raise InvalidArgument(f"{field}.token_ids", f"<{len(tokens)} tokens>", f"exceeds max_model_len {max_len}")
    if a.num_tokens and a.num_tokens != len(tokens):
        raise InvalidArgument(f"{field}.num_tokens", a.num_tokens, f"disagrees with the {len(tokens)} token ids")
    for j, m in enumerate(mm):
        if m.length == 0 or m.offset + m.length > len(tokens):
            raise InvalidArgument(f"{field}.mm_items[{j}]", (m.offset, m.length), "must lie inside the prompt")
    return AddRequestOp(request_id, tokens, None, len(tokens), check_name(f"{field}.cache_salt", a.cache_salt),
                        check_name(f"{field}.lora_name", a.lora_name), mm)


def decode_allocate(a: pb.AllocateOp, max_len: int, vocab: int, field: str, index: int | None = None) -> AllocateOp:
    """Validates one allocate op; `field` (with `index`) names it in errors, formatted only then."""
    request_id = a.request_id
    computed, budget, lookahead = a.num_computed_tokens, a.num_new_tokens, a.num_lookahead_tokens
    append_tokens, append_hashes, num_append = a.append_token_ids, a.append_block_hashes, a.num_append_tokens
    if (not request_id or len(request_id) > MAX_ID_BYTES // 4 or not request_id.isprintable() or computed > max_len
            or budget > max_len or lookahead > max_len or append_hashes or num_append):
        return _decode_allocate_slow(a, max_len, vocab, field if index is None else f"{field}[{index}].allocate")
    tokens = None
    if append_tokens:
        if len(append_tokens) % 4 or len(append_tokens) > 4 * max_len:
            return _decode_allocate_slow(a, max_len, vocab, field if index is None else f"{field}[{index}].allocate")
        tokens = array("I")
        tokens.frombytes(append_tokens)
        if not _LITTLE:
            tokens.byteswap()
        if vocab and max_u32(tokens) >= vocab:
            return _decode_allocate_slow(a, max_len, vocab, field if index is None else f"{field}[{index}].allocate")
    return AllocateOp(request_id, computed, budget, tokens, None, 0, lookahead, a.delay_cache_blocks, a.allow_transfer)


def _decode_allocate_slow(a: pb.AllocateOp, max_len: int, vocab: int, field: str) -> AllocateOp:
    request_id = check_id(f"{field}.request_id", a.request_id)
    if a.num_computed_tokens > max_len:
        raise InvalidArgument(f"{field}.num_computed_tokens", a.num_computed_tokens, f"exceeds max_model_len {max_len}")
    if a.num_new_tokens > max_len:
        raise InvalidArgument(f"{field}.num_new_tokens", a.num_new_tokens, f"exceeds max_model_len {max_len}")
    if a.num_lookahead_tokens > max_len:
        raise InvalidArgument(f"{field}.num_lookahead_tokens", a.num_lookahead_tokens,
                              f"exceeds max_model_len {max_len}")
    tokens = hashes = None
    if a.append_token_ids:
        tokens = decode_tokens(f"{field}.append_token_ids", a.append_token_ids, vocab)
        if len(tokens) > max_len:
            raise InvalidArgument(f"{field}.append_token_ids", f"<{len(tokens)} tokens>", "exceeds max_model_len")
        if a.num_append_tokens or a.append_block_hashes:
            raise InvalidArgument(f"{field}.num_append_tokens", a.num_append_tokens,
                                  "append token ids or hashes (with num_append_tokens), not both")
    elif a.append_block_hashes or a.num_append_tokens:
        hashes = decode_hashes(f"{field}.append_block_hashes", a.append_block_hashes)
        if a.num_append_tokens == 0 or a.num_append_tokens > max_len:
            raise InvalidArgument(f"{field}.num_append_tokens", a.num_append_tokens,
                                  f"must be in [1, max_model_len {max_len}] when appending hashes")
    return AllocateOp(request_id, a.num_computed_tokens, a.num_new_tokens, tokens, hashes, a.num_append_tokens,
                      a.num_lookahead_tokens, a.delay_cache_blocks, a.allow_transfer)


def check_ids(field: str, request_ids: list[str]) -> list[str]:
    """check_id of every entry: whole-list checks in C first, the loop (which names the bad entry) only
    when one fails."""
    check_count(field, len(request_ids), MAX_OPS_PER_STEP)
    if request_ids and (not "".join(request_ids).isprintable() or "" in request_ids
                        or max(map(len, request_ids)) > MAX_ID_BYTES // 4):
        for j, rid in enumerate(request_ids):
            if not rid or len(rid) > MAX_ID_BYTES // 4 or not rid.isprintable():
                check_id(f"{field}[{j}]", rid)
    return request_ids


def decode_counts(field: str, data: bytes, n: int, limit: int, minimum: int = 0, what: str = "") -> array:
    """One uint32 per request, each in [minimum, limit] (`what` names the limit in errors)."""
    values = decode_tokens(field, data)
    if len(values) != n:
        raise InvalidArgument(field, f"<{len(values)} values>", f"needs one uint32 per request ({n})")
    if values and (max_u32(values) > limit or (minimum and min(values) < minimum)):
        j = next(j for j, v in enumerate(values) if not minimum <= v <= limit)
        bound = f"is below {minimum}" if values[j] < minimum else f"exceeds {what or limit}"
        raise InvalidArgument(f"{field}[{j}]", values[j], bound)
    return values


def check_names(field: str, names, n: int) -> list[str | None] | None:
    """Per-request names: none at all, or one per request (empty: none for that one)."""
    if not names:
        return None
    if len(names) != n:
        raise InvalidArgument(field, f"<{len(names)} names>", f"give none or one per request ({n})")
    return [check_name(f"{field}[{j}]", name) for j, name in enumerate(names)]


def decode_batch(d: pb.DecodeBatchOp, max_len: int, vocab: int, field: str) -> DecodeBatchOp:
    request_ids = check_ids(f"{field}.request_ids", list(d.request_ids))
    n = len(request_ids)
    computed = decode_counts(f"{field}.num_computed_tokens", d.num_computed_tokens, n, max_len,
                             what=f"max_model_len {max_len}")
    tokens = None
    if d.append_token_ids:
        tokens = decode_tokens(f"{field}.append_token_ids", d.append_token_ids, vocab)
        if len(tokens) != n:
            raise InvalidArgument(f"{field}.append_token_ids", f"<{len(tokens)} tokens>",
                                  f"needs one token per request ({n}) or none")
    if d.num_new_tokens > max_len:
        raise InvalidArgument(f"{field}.num_new_tokens", d.num_new_tokens, f"exceeds max_model_len {max_len}")
    if d.num_lookahead_tokens > max_len:
        raise InvalidArgument(f"{field}.num_lookahead_tokens", d.num_lookahead_tokens,
                              f"exceeds max_model_len {max_len}")
    # Lists: the allocator reads every entry, and a list hands out its int objects, an array makes them.
    return DecodeBatchOp(request_ids, computed.tolist(), None if tokens is None else tokens.tolist(),
                         d.num_new_tokens or 1, d.num_lookahead_tokens)


def decode_admit(a: pb.AdmitBatchOp, max_len: int, vocab: int, field: str) -> AdmitBatchOp:
    request_ids = check_ids(f"{field}.request_ids", list(a.request_ids))
    n = len(request_ids)
    lengths = decode_counts(f"{field}.num_prompt_tokens", a.num_prompt_tokens, n, max_len, minimum=1,
                            what=f"max_model_len {max_len}")
    tokens = decode_tokens(f"{field}.token_ids", a.token_ids, vocab)
    if len(tokens) != sum(lengths):
        raise InvalidArgument(f"{field}.token_ids", f"<{len(tokens)} tokens>",
                              f"num_prompt_tokens add up to {sum(lengths)}")
    budgets = None
    if a.num_new_tokens:
        budgets = decode_counts(f"{field}.num_new_tokens", a.num_new_tokens, n, max_len,
                                what=f"max_model_len {max_len}").tolist()
    if a.num_lookahead_tokens > max_len:
        raise InvalidArgument(f"{field}.num_lookahead_tokens", a.num_lookahead_tokens,
                              f"exceeds max_model_len {max_len}")
    prompts, start = [], 0
    for length in lengths:
        prompts.append(tokens[start:start + length])
        start += length
    return AdmitBatchOp(request_ids, prompts, budgets, a.num_lookahead_tokens,
                        check_names(f"{field}.cache_salts", a.cache_salts, n),
                        check_names(f"{field}.lora_names", a.lora_names, n))


def encode_op(op: Op, msg: pb.Op) -> None:
    """Fills `msg` from a domain op (client side)."""
    if isinstance(op, AllocateOp):
        a = msg.allocate
        a.request_id = op.request_id
        a.num_computed_tokens = op.num_computed_tokens
        a.num_new_tokens = op.num_new_tokens
        if op.append_token_ids is not None:
            a.append_token_ids = encode_tokens(op.append_token_ids)
        if op.append_block_hashes is not None:
            a.append_block_hashes = b"".join(op.append_block_hashes)
        a.num_append_tokens = op.num_append_tokens
        a.num_lookahead_tokens = op.num_lookahead_tokens
        a.delay_cache_blocks = op.delay_cache_blocks
        a.allow_transfer = op.allow_transfer
    elif isinstance(op, AddRequestOp):
        encode_add(op, msg.add)
    elif isinstance(op, DecodeBatchOp):
        d = msg.decode
        d.request_ids.extend(op.request_ids)
        d.num_computed_tokens = encode_tokens(op.num_computed_tokens)
        if op.append_token_ids is not None:
            d.append_token_ids = encode_tokens(op.append_token_ids)
        d.num_new_tokens = op.num_new_tokens
        d.num_lookahead_tokens = op.num_lookahead_tokens
    elif isinstance(op, AdmitBatchOp):
        a = msg.admit
        a.request_ids.extend(op.request_ids)
        a.token_ids = b"".join(encode_tokens(p) for p in op.prompts)
        a.num_prompt_tokens = encode_tokens([len(p) for p in op.prompts])
        if op.num_new_tokens is not None:
            a.num_new_tokens = encode_tokens(op.num_new_tokens)
        a.num_lookahead_tokens = op.num_lookahead_tokens
        if op.cache_salts is not None:
            a.cache_salts.extend(s or "" for s in op.cache_salts)
        if op.lora_names is not None:
            a.lora_names.extend(name or "" for name in op.lora_names)
    elif isinstance(op, FreeOp):
        msg.free.request_id = op.request_id
    elif isinstance(op, ForkOp):
        msg.fork.parent_request_id = op.parent_request_id
        msg.fork.child_request_id = op.child_request_id
    else:
        raise TypeError(f"not an op: {op!r}")


def encode_add(op: AddRequestOp, a: pb.AddRequestOp) -> None:
    a.request_id = op.request_id
    if op.block_hashes is not None:
        a.block_hashes = b"".join(op.block_hashes)
        a.num_tokens = op.num_tokens
    else:
        a.token_ids = encode_tokens(op.token_ids or [])
    a.cache_salt = op.cache_salt or ""
    a.lora_name = op.lora_name or ""
    for m in op.mm_items:
        a.mm_items.add(identifier=m.identifier, offset=m.offset, length=m.length)


_STEP_OPS_TAG = bytes([pb.StepRequest.DESCRIPTOR.fields_by_name["ops"].number << 3 | 2])  # length-delimited
if [f.name for f in pb.StepRequest.DESCRIPTOR.fields] != ["session_id", "sequence", "pool_id", "ops"]:
    raise RuntimeError("StepRequest changed: update serialize_step")  # it writes these fields itself


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def serialize_step(msg: pb.StepRequest) -> bytes:
    """`msg.SerializeToString()`, byte for byte, assembled op by op: upb serializes a message past
    ~128 KiB (an admission of 32 long prompts) ~10x slower than its parts, because its encode buffer
    grows through glibc's heap top, which is trimmed and faulted in again on every call."""
    ops = msg.ops
    if len(ops) < 16:
        return msg.SerializeToString()
    parts = [pb.StepRequest(session_id=msg.session_id, sequence=msg.sequence, pool_id=msg.pool_id).SerializeToString()]
    append = parts.append
    for op in ops:
        data = op.SerializeToString()
        append(_STEP_OPS_TAG + _varint(len(data)) + data)
    return b"".join(parts)


# ---- results -------------------------------------------------------------------------------------
def encode_step_result(result: StepResult, msg: pb.StepResponse) -> pb.StepResponse:
    """Groups' new block ids are sent only when some group got a block (decode steps mostly don't)."""
    msg.sequence = result.sequence
    add = msg.results.add
    for r in result.results:
        # Fields one by one, zeros left unset (proto3: the same bytes): cheaper than keyword construction.
        m = add()
        m.request_id = r.request_id
        if r.status:
            m.status = r.status
        if r.message:
            m.message = r.message
        if r.num_computed_tokens:
            m.num_computed_tokens = r.num_computed_tokens
        if r.num_scheduled_tokens:
            m.num_scheduled_tokens = r.num_scheduled_tokens
        if r.num_tokens:
            m.num_tokens = r.num_tokens
        groups = r.new_block_ids
        if groups and (len(groups) > 1 or groups[0]):
            group_add = m.new_blocks.add
            for ids in groups:
                group_add().block_ids.extend(ids)
        for g, index, block_id in r.replaced:
            m.replaced.add(group=g, index=index, block_id=block_id)
        if r.transfer is not None:
            t = r.transfer
            m.transfer.CopyFrom(pb.TransferOrder(transfer_id=t.transfer_id, src_pool_id=t.src_pool_id,
                                                 src_block_ids=t.src_block_ids, dst_block_ids=t.dst_block_ids,
                                                 num_tokens=t.num_tokens))
        if r.batch is not None:
            b = r.batch
            mb = m.batch
            mb.statuses = b.statuses
            mb.num_new_blocks = encode_tokens(b.num_new_blocks)
            mb.new_block_ids = encode_tokens(b.new_block_ids)
            mb.num_computed_tokens = encode_tokens(b.num_computed_tokens)
            mb.num_scheduled_tokens = encode_tokens(b.num_scheduled_tokens)
            mb.num_groups = b.num_groups
            if b.replaced:
                mb.replaced = encode_tokens([v for quad in b.replaced for v in quad])
            if b.failures:
                mb.failures.extend(encode_step_result(StepResult(0, b.failures), pb.StepResponse()).results)
    for src, dst in result.copies:
        msg.copies.add(src=src, dst=dst)
    return msg


def decode_step_result(msg: pb.StepResponse) -> StepResult:
    results = []
    for m in msg.results:
        transfer = None
        if m.HasField("transfer"):
            t = m.transfer
            transfer = TransferOrder(t.transfer_id, t.src_pool_id, list(t.src_block_ids), list(t.dst_block_ids),
                                     t.num_tokens)
        batch = None
        if m.HasField("batch"):
            b = m.batch
            batch = DecodeBatchResult(b.statuses, decode_tokens("num_new_blocks", b.num_new_blocks),
                                      decode_tokens("new_block_ids", b.new_block_ids),
                                      decode_tokens("num_computed_tokens", b.num_computed_tokens),
                                      decode_tokens("num_scheduled_tokens", b.num_scheduled_tokens),
                                      decode_step_result(pb.StepResponse(results=b.failures)).results, b.num_groups)
            flat = decode_tokens("replaced", b.replaced)
            batch.replaced = [tuple(flat[j:j + 4]) for j in range(0, len(flat), 4)]
        results.append(OpResult(m.request_id, OpStatus(m.status), m.message,
                                tuple(list(g.block_ids) for g in m.new_blocks), m.num_computed_tokens,
                                m.num_scheduled_tokens, m.num_tokens, transfer, batch,
                                [(x.group, x.index, x.block_id) for x in m.replaced]))
    return StepResult(msg.sequence, results, [(c.src, c.dst) for c in msg.copies])

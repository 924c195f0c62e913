"""Server side: requests as they arrive -> commands. Every field a request carries is validated here and
a bad one raises `InvalidArgument` naming it (as a path like `ops[3].allocate.request_id`) and its value,
before anything is applied. A Step's ops are decoded once its pool is known (its limits apply): the
command carries a decoder the allocator calls after it checked the sequence."""

from __future__ import annotations

from collections.abc import Sequence

from kvservice._proto import allocator_pb2 as pb
from kvservice.commands import CommitTransfer, OpenSession, PoolSpec, RegisterPool, Step, StepRpc
from kvservice.core import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
)
from kvservice.errors import InvalidArgument
from kvservice.hashing import HASH_BYTES, HashSpec, MultiModalItem, vllm_spec
from kvservice.hashing.spec import KVSERVICE
from kvservice.ops import (
    AddRequestOp,
    AdmitBatchOp,
    AllocateOp,
    DecodeBatchOp,
    ExternalSource,
    ForkOp,
    FreeOp,
    Op,
    PinOp,
    UnpinOp,
)
from kvservice.wire.fields import (
    Field,
    at_most,
    check_count,
    check_id,
    check_ids,
    check_name,
    check_names,
    decode_counts,
    decode_hashes,
    decode_u32,
    field_name,
    id_problem,
    invalid,
    name_problem,
)
from kvservice.wire.limits import (
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_DCP_WORLD_SIZE,
    MAX_EPOCH,
    MAX_MODEL_LEN,
    MAX_OPS_PER_STEP,
)

STEP_REQUESTS = {StepRpc.STEP: pb.StepRequest, StepRpc.ALLOCATE: pb.AllocateRequest, StepRpc.FREE: pb.FreeRequest,
                 StepRpc.FORK: pb.ForkRequest}


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
    check_count(f"{field}.dcp_world_size", dcp, MAX_DCP_WORLD_SIZE)
    specs = []
    for i, group in enumerate(msg.groups):
        kind = group.WhichOneof("kind")
        g = f"{field}.groups[{i}]"
        if kind is None:
            raise InvalidArgument(g, "{}", "set one of full_attention, sliding_window, chunked_local, mamba")
        sub = getattr(group, kind)
        if sub.block_size == 0 or sub.block_size > MAX_BLOCK_SIZE:
            raise InvalidArgument(f"{g}.{kind}.block_size", sub.block_size, f"must be in [1, {MAX_BLOCK_SIZE}]")
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
    hash_spec = decode_hash_spec(msg.hash_spec, hash_block_size) if msg.HasField("hash_spec") else None
    return PoolSpec(pool_id, config, max_model_len, dcp, not msg.config.disable_prefix_caching,
                    msg.config.vocab_size, check_name("config.kv_layout", msg.config.kv_layout) or "", msg.epoch,
                    hash_spec)


def decode_hash_spec(msg: pb.HashSpec, hash_block_size: int, field: str = "hash_spec") -> HashSpec:
    """A declared hash spec, at the allocator's hash block size."""
    algorithm = msg.algorithm or KVSERVICE
    if algorithm != KVSERVICE and algorithm not in vllm_spec.ALGORITHMS:
        raise InvalidArgument(f"{field}.algorithm", msg.algorithm,
                              f"must be {KVSERVICE!r} or one of vLLM's {', '.join(vllm_spec.ALGORITHMS)}")
    if msg.has_seed:
        check_name(f"{field}.seed", msg.seed)
    elif msg.seed:
        raise InvalidArgument(f"{field}.seed", msg.seed, "set has_seed with a seed (unset: the algorithm's default)")
    return HashSpec(algorithm, msg.seed if msg.has_seed else None, hash_block_size)


# ---- ops -----------------------------------------------------------------------------------------
def decode_ops(ops: Sequence[pb.Op], spec: PoolSpec, hash_block_size: int, field: str = "ops") -> list[Op]:
    check_count(field, len(ops), MAX_OPS_PER_STEP)
    out: list[Op] = []
    append = out.append
    max_len = spec.max_model_len
    vocab = spec.vocab_size
    hash_bytes = spec.hash_bytes
    for i, op in enumerate(ops):
        kind = op.WhichOneof("op")
        if kind == "allocate":
            append(decode_allocate(op.allocate, max_len, vocab, field, i, hash_bytes))
        elif kind == "add":
            append(decode_add(op.add, max_len, vocab, hash_block_size, field, i, hash_bytes))
        elif kind == "decode":
            append(decode_batch(op.decode, max_len, vocab, f"{field}[{i}].decode"))
        elif kind == "admit":
            append(decode_admit(op.admit, max_len, vocab, f"{field}[{i}].admit"))
        elif kind == "free":
            append(FreeOp(check_id((field, i, "free", "request_id"), op.free.request_id)))
        elif kind == "fork":
            f = op.fork
            append(ForkOp(check_id((field, i, "fork", "parent_request_id"), f.parent_request_id),
                          check_id((field, i, "fork", "child_request_id"), f.child_request_id)))
        elif kind == "pin":
            append(decode_pin(op.pin, max_len, vocab, hash_block_size, f"{field}[{i}].pin", hash_bytes))
        elif kind == "unpin":
            append(UnpinOp(check_id((field, i, "unpin", "pin_id"), op.unpin.pin_id)))
        else:
            raise InvalidArgument(f"{field}[{i}]", "{}", "set one of add, allocate, decode, admit, fork, free, pin, "
                                                         "unpin")
    return out


def ops_from_request(rpc: StepRpc, request, spec: PoolSpec, hash_block_size: int) -> list[Op]:
    """The ops of a Step / Allocate / Free / Fork request."""
    if rpc is StepRpc.STEP:
        return decode_ops(request.ops, spec, hash_block_size)
    if rpc is StepRpc.ALLOCATE:
        ops: list[Op] = []
        if request.HasField("add"):
            ops.append(decode_add(request.add, spec.max_model_len, spec.vocab_size, hash_block_size, "add", None,
                                  spec.hash_bytes))
        if not request.HasField("allocate"):
            raise InvalidArgument("allocate", None, "required")
        ops.append(decode_allocate(request.allocate, spec.max_model_len, spec.vocab_size, "allocate", None,
                                   spec.hash_bytes))
        return ops
    if rpc is StepRpc.FREE:
        if not request.request_ids:
            raise InvalidArgument("request_ids", [], "name at least one request")
        return [FreeOp(check_id(f"request_ids[{i}]", r)) for i, r in enumerate(request.request_ids)]
    parent = check_id("parent_request_id", request.parent_request_id)
    if not request.child_request_ids:
        raise InvalidArgument("child_request_ids", [], "name at least one child")
    return [ForkOp(parent, check_id(f"child_request_ids[{i}]", c)) for i, c in enumerate(request.child_request_ids)]


def decode_add(a: pb.AddRequestOp, max_len: int, vocab: int, hash_block_size: int, field: str,
               index: int | None = None, hash_bytes: int = HASH_BYTES) -> AddRequestOp:
    """One add op; (`field`, `index`) names it in errors (`field[index].add`, or `field` alone)."""
    request_id = a.request_id
    why = id_problem(request_id)
    if why is not None:
        raise invalid((field, index, "add", "request_id"), request_id, why)
    mm = tuple(MultiModalItem(check_id((field, index, "add", f"mm_items[{j}].identifier"), m.identifier), m.offset,
                              m.length) for j, m in enumerate(a.mm_items)) if a.mm_items else ()
    salt, lora = a.cache_salt, a.lora_name
    if a.block_hashes:
        return _decode_add_by_hashes(a, request_id, mm, max_len, hash_block_size, field, index, hash_bytes)
    tokens = decode_u32((field, index, "add", "token_ids"), a.token_ids, vocab)
    num_tokens = len(tokens)
    if not num_tokens:
        raise invalid((field, index, "add", "token_ids"), "<0 bytes>",
                      "a request needs at least one token (or block_hashes with num_tokens)")
    if num_tokens > max_len:
        raise invalid((field, index, "add", "token_ids"), f"<{num_tokens} tokens>", f"exceeds max_model_len {max_len}")
    if a.num_tokens and a.num_tokens != num_tokens:
        raise invalid((field, index, "add", "num_tokens"), a.num_tokens,
                      f"disagrees with the {num_tokens} token ids")
    for j, m in enumerate(mm):
        if m.length == 0 or m.offset + m.length > num_tokens:
            raise invalid((field, index, "add", f"mm_items[{j}]"), (m.offset, m.length), "must lie inside the prompt")
    if salt and name_problem(salt):
        raise invalid((field, index, "add", "cache_salt"), salt, name_problem(salt))
    if lora and name_problem(lora):
        raise invalid((field, index, "add", "lora_name"), lora, name_problem(lora))
    return AddRequestOp(request_id, tokens, None, num_tokens, salt or None, lora or None, mm)


def _decode_add_by_hashes(a: pb.AddRequestOp, request_id: str, mm: tuple, max_len: int, hash_block_size: int,
                          field: str, index: int | None, hash_bytes: int) -> AddRequestOp:
    if a.token_ids:
        raise invalid((field, index, "add", "token_ids"), f"<{len(a.token_ids)} bytes>",
                      "send token_ids or block_hashes, not both")
    if a.cache_salt or mm:
        raise invalid((field, index, "add", "cache_salt" if a.cache_salt else "mm_items"), "...",
                      "with block_hashes the client hashes salt and multimodal items itself")
    hashes = decode_hashes((field, index, "add", "block_hashes"), a.block_hashes, hash_bytes)
    if a.num_tokens == 0 or a.num_tokens > max_len:
        raise invalid((field, index, "add", "num_tokens"), a.num_tokens, f"must be in [1, max_model_len {max_len}]")
    if len(hashes) != a.num_tokens // hash_block_size:
        raise invalid((field, index, "add", "block_hashes"), f"<{len(hashes)} hashes>",
                      f"{a.num_tokens} tokens need {a.num_tokens // hash_block_size} hashes at hash block size "
                      f"{hash_block_size}")
    return AddRequestOp(request_id, None, hashes, a.num_tokens, None,
                        check_name((field, index, "add", "lora_name"), a.lora_name))


def decode_allocate(a: pb.AllocateOp, max_len: int, vocab: int, field: str, index: int | None = None,
                    hash_bytes: int = HASH_BYTES) -> AllocateOp:
    """One allocate op; (`field`, `index`) names it in errors, formatted only then."""
    request_id = a.request_id
    why = id_problem(request_id)
    if why is not None:
        raise invalid((field, index, "allocate", "request_id"), request_id, why)
    what = f"max_model_len {max_len}"
    computed, budget, lookahead = a.num_computed_tokens, a.num_new_tokens, a.num_lookahead_tokens
    if computed > max_len or budget > max_len or lookahead > max_len:
        at_most((field, index, "allocate", "num_computed_tokens"), computed, max_len, what)
        at_most((field, index, "allocate", "num_new_tokens"), budget, max_len, what)
        at_most((field, index, "allocate", "num_lookahead_tokens"), lookahead, max_len, what)
    tokens = hashes = None
    num_append = a.num_append_tokens
    if a.append_token_ids:
        tokens = decode_u32((field, index, "allocate", "append_token_ids"), a.append_token_ids, vocab)
        if len(tokens) > max_len:
            raise invalid((field, index, "allocate", "append_token_ids"), f"<{len(tokens)} tokens>",
                          "exceeds max_model_len")
        if num_append or a.append_block_hashes:
            raise invalid((field, index, "allocate", "num_append_tokens"), num_append,
                          "append token ids or hashes (with num_append_tokens), not both")
    elif a.append_block_hashes or num_append:
        hashes = decode_hashes((field, index, "allocate", "append_block_hashes"), a.append_block_hashes, hash_bytes)
        if num_append == 0 or num_append > max_len:
            raise invalid((field, index, "allocate", "num_append_tokens"), num_append,
                          f"must be in [1, {what}] when appending hashes")
    external = None
    if a.HasField("external_source"):
        external = decode_external(a.external_source, max_len, (field, index, "allocate", "external_source"))
        if not a.allow_transfer:
            raise invalid((field, index, "allocate", "allow_transfer"), False,
                          "an external_source needs allow_transfer")
    return AllocateOp(request_id, computed, budget, tokens, hashes, num_append, lookahead, a.delay_cache_blocks,
                      a.allow_transfer, external)


def decode_external(e: pb.ExternalSource, max_len: int, field: Field) -> ExternalSource:
    name = field_name(field)
    pin_id = check_id(f"{name}.pin_id", e.pin_id)
    src_pool = check_id(f"{name}.src_pool_id", e.src_pool_id)
    if not e.src_block_ids:
        raise InvalidArgument(f"{name}.src_block_ids", [], "name the pinned blocks")
    check_count(f"{name}.src_block_ids", len(e.src_block_ids), MAX_MODEL_LEN)
    if e.num_tokens == 0 or e.num_tokens > max_len:
        raise InvalidArgument(f"{name}.num_tokens", e.num_tokens, f"must be in [1, max_model_len {max_len}]")
    return ExternalSource(pin_id, src_pool, list(e.src_block_ids), e.num_tokens)


def decode_pin(p: pb.PinOp, max_len: int, vocab: int, hash_block_size: int, field: str,
               hash_bytes: int = HASH_BYTES) -> PinOp:
    """A pin op's prompt is checked by the add op's rules (the fields have the same names, but the id)."""
    check_id(f"{field}.pin_id", p.pin_id)
    as_add = pb.AddRequestOp(request_id=p.pin_id, token_ids=p.token_ids, block_hashes=p.block_hashes,
                             num_tokens=p.num_tokens, cache_salt=p.cache_salt, lora_name=p.lora_name)
    add = decode_add(as_add, max_len, vocab, hash_block_size, field, None, hash_bytes)
    return PinOp(add.request_id, add.token_ids, add.block_hashes, add.num_tokens, add.cache_salt, add.lora_name)


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
def step_command(rpc: StepRpc, request, raw: bytes, tenant: str, admin: bool = False) -> Step:
    """A Step / Allocate / Free / Fork request as a command (its ops decoded once the pool is known)."""
    pool_id = check_id("pool_id", request.pool_id)
    check_id("session_id", request.session_id)
    return Step(request.session_id, tenant, request.sequence, pool_id,
                lambda spec, hash_block_size: ops_from_request(rpc, request, spec, hash_block_size), rpc, raw,
                admin)


def register_command(request: pb.RegisterPoolRequest, raw: bytes, tenant: str, admin: bool,
                     hash_block_size: int) -> RegisterPool:
    check_id("session_id", request.session_id)
    return RegisterPool(request.session_id, tenant, request.sequence, decode_pool_spec(request, hash_block_size),
                        request.hash_fingerprint, admin, raw)


def commit_transfer_command(request: pb.CommitTransferRequest, raw: bytes, tenant: str,
                            admin: bool = False) -> CommitTransfer:
    check_id("session_id", request.session_id)
    return CommitTransfer(request.session_id, tenant, request.sequence, check_id("pool_id", request.pool_id),
                          check_id("transfer_id", request.transfer_id), request.abort, raw, admin)


def open_session_command(request: pb.OpenSessionRequest, session_id: str, tenant: str, admin: bool) -> OpenSession:
    name = check_name("client_name", request.client_name) or ""
    pool_ids = [check_id(f"resume_pool_ids[{i}]", p) for i, p in enumerate(request.resume_pool_ids)]
    resume = check_id("resume_session_id", request.resume_session_id) if request.resume_session_id else ""
    return OpenSession(session_id, tenant, name, resume, request.last_acked_sequence, pool_ids, admin,
                       request.attach and bool(resume))

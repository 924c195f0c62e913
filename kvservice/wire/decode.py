"""Server side: requests as they arrive -> commands. Every field a request carries is validated here and
a bad one raises `InvalidArgument` naming it (as a path like `ops[3].allocate.request_id`) and its value,
before anything is applied. A Step's ops are decoded once its pool is known (its limits apply): the
command carries a decoder the allocator calls after it checked the sequence."""

from __future__ import annotations

from collections.abc import Sequence

from kvservice._proto import allocator_pb2 as pb
from kvservice.commands import CommitTransfer, OpenSession, PoolSpec, RegisterPool, Step, StepRpc
from kvservice.errors import InvalidArgument
from kvservice.hashing import HASH_BYTES, MultiModalItem
from kvservice.ops import (
    AddRequestOp,
    AllocateOp,
    ExternalSource,
    ForkOp,
    FreeOp,
    NewStepOp,
    Op,
    PinOp,
    ResetPrefixCacheOp,
    UnpinOp,
)
from kvservice.wire.batches import decode_admit, decode_allocate_batch, decode_batch
from kvservice.wire.fields import (
    Field,
    at_most,
    check_count,
    check_id,
    check_name,
    decode_hashes,
    decode_u32,
    field_name,
    id_problem,
    invalid,
    name_problem,
)
from kvservice.wire.limits import MAX_MODEL_LEN, MAX_OPS_PER_STEP
from kvservice.wire.pool_spec import decode_pool_spec
from kvservice.wire.vllm_ops import decode_evict, decode_held, decode_remove_skipped

STEP_REQUESTS = {StepRpc.STEP: pb.StepRequest, StepRpc.ALLOCATE: pb.AllocateRequest, StepRpc.FREE: pb.FreeRequest,
                 StepRpc.FORK: pb.ForkRequest}
# AllocateOp fields only a pool with vLLM's semantics takes, and the ops such a pool refuses (vLLM has none).
VLLM_FIELDS = ("num_output_placeholders", "num_in_flight_tokens", "waiting", "lookup", "num_new_computed_tokens",
               "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs", "cache_tokens",
               "num_external_computed_tokens", "num_encoder_tokens", "max_cache_hit_length", "connector_lookup",
               "shared_prefix_boundary")
VLLM_REFUSED = frozenset({"decode", "admit", "fork", "pin"})
NEW_STEP = NewStepOp()  # (it has no fields: one instance serves every Step)


# ---- ops -----------------------------------------------------------------------------------------
def decode_ops(ops: Sequence[pb.Op], spec: PoolSpec, hash_block_size: int, field: str = "ops") -> list[Op]:
    check_count(field, len(ops), MAX_OPS_PER_STEP)
    out: list[Op] = []
    append = out.append
    max_len = spec.max_model_len
    vocab = spec.vocab_size
    hash_bytes = spec.hash_bytes
    vllm = spec.vllm is not None
    unhashed_ok = not spec.enable_caching
    lag_ok = vllm and spec.enable_caching  # vLLM's lookahead hasher: a block's hash waits for the tokens after it
    for i, op in enumerate(ops):
        kind = op.WhichOneof("op")
        if vllm and kind in VLLM_REFUSED:
            raise InvalidArgument(f"{field}[{i}].{kind}", "...", f"pool {spec.pool_id!r} follows vLLM's semantics: "
                                                                 f"send its allocations as AllocateOp")
        if kind == "allocate":
            append(decode_allocate(op.allocate, max_len, vocab, field, i, hash_bytes, vllm))
        elif kind == "add":
            append(decode_add(op.add, max_len, vocab, hash_block_size, field, i, hash_bytes, unhashed_ok, lag_ok))
        elif kind == "allocate_batch":
            if not vllm:
                raise InvalidArgument(f"{field}[{i}].allocate_batch", "...", f"pool {spec.pool_id!r} does not follow "
                                                                          f"vLLM's semantics: send DecodeBatchOp")
            append(decode_allocate_batch(op.allocate_batch, max_len, f"{field}[{i}].allocate_batch", hash_bytes))
        elif kind == "decode":
            append(decode_batch(op.decode, max_len, vocab, f"{field}[{i}].decode"))
        elif kind == "admit":
            append(decode_admit(op.admit, max_len, vocab, f"{field}[{i}].admit"))
        elif kind == "free":
            if op.free.popped and not vllm:
                raise InvalidArgument(f"{field}[{i}].free.popped", True, "only a pool registered with vllm options "
                                                                         "takes it (vLLM's deferred free)")
            append(FreeOp(check_id((field, i, "free", "request_id"), op.free.request_id), op.free.popped))
        elif kind == "evict_blocks":
            append(decode_evict(op.evict_blocks, spec, vllm, f"{field}[{i}].evict_blocks"))
        elif kind == "remove_skipped_blocks":
            append(decode_remove_skipped(op.remove_skipped_blocks, spec, vllm, f"{field}[{i}].remove_skipped_blocks"))
        elif kind == "fork":
            f = op.fork
            append(ForkOp(check_id((field, i, "fork", "parent_request_id"), f.parent_request_id),
                          check_id((field, i, "fork", "child_request_id"), f.child_request_id)))
        elif kind == "pin":
            append(decode_pin(op.pin, max_len, vocab, hash_block_size, f"{field}[{i}].pin", hash_bytes))
        elif kind == "unpin":
            append(UnpinOp(check_id((field, i, "unpin", "pin_id"), op.unpin.pin_id)))
        elif kind == "reset_prefix_cache":
            append(ResetPrefixCacheOp())
        elif kind == "new_step":
            if not vllm:
                raise InvalidArgument(f"{field}[{i}].new_step", "{}", "only a pool registered with vllm options takes "
                                                                      "it (every Step starts a step in other pools)")
            append(NEW_STEP)
        elif kind in ("take_block_copies", "get_new_blocks", "touch_blocks", "free_held_blocks"):
            append(decode_held(op, kind, spec, vllm, f"{field}[{i}].{kind}"))
        else:
            raise InvalidArgument(f"{field}[{i}]", "{}", "set one of add, allocate, allocate_batch, decode, admit, "
                                                         "fork, free, pin, unpin, reset_prefix_cache, evict_blocks, "
                                                         "remove_skipped_blocks, new_step, take_block_copies, "
                                                         "get_new_blocks, touch_blocks, free_held_blocks")
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
                                   spec.hash_bytes, spec.vllm is not None))
        return ops
    if spec.vllm is not None and rpc is StepRpc.FORK:
        raise InvalidArgument("parent_request_id", request.parent_request_id,
                              f"pool {spec.pool_id!r} follows vLLM's semantics, which has no forks")
    if rpc is StepRpc.FREE:
        if not request.request_ids:
            raise InvalidArgument("request_ids", [], "name at least one request")
        return [FreeOp(check_id(f"request_ids[{i}]", r)) for i, r in enumerate(request.request_ids)]
    parent = check_id("parent_request_id", request.parent_request_id)
    if not request.child_request_ids:
        raise InvalidArgument("child_request_ids", [], "name at least one child")
    return [ForkOp(parent, check_id(f"child_request_ids[{i}]", c)) for i, c in enumerate(request.child_request_ids)]


def decode_add(a: pb.AddRequestOp, max_len: int, vocab: int, hash_block_size: int, field: str,
               index: int | None = None, hash_bytes: int = HASH_BYTES, unhashed_ok: bool = False,
               lag_ok: bool = False) -> AddRequestOp:
    """One add op; (`field`, `index`) names it in errors (`field[index].add`, or `field` alone).
    `unhashed_ok`: the pool does not cache prefixes, so `num_tokens` may come with no hashes at all.
    `lag_ok`: fewer hashes than full blocks are taken (vLLM's lookahead hashes trail the tokens)."""
    request_id = a.request_id
    why = id_problem(request_id)
    if why is not None:
        raise invalid((field, index, "add", "request_id"), request_id, why)
    mm = tuple(MultiModalItem(check_id((field, index, "add", f"mm_items[{j}].identifier"), m.identifier), m.offset,
                              m.length) for j, m in enumerate(a.mm_items)) if a.mm_items else ()
    salt, lora = a.cache_salt, a.lora_name
    if a.block_hashes or (a.num_tokens and not a.token_ids):  # a prompt under one hash block has no hashes
        return _decode_add_by_hashes(a, request_id, mm, max_len, hash_block_size, field, index, hash_bytes,
                                     unhashed_ok, lag_ok)
    if a.num_prompt_tokens:
        raise invalid((field, index, "add", "num_prompt_tokens"), a.num_prompt_tokens,
                      "only with block_hashes (token ids say their prompt themselves)")
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
                          field: str, index: int | None, hash_bytes: int, unhashed_ok: bool = False,
                          lag_ok: bool = False) -> AddRequestOp:
    if a.token_ids:
        raise invalid((field, index, "add", "token_ids"), f"<{len(a.token_ids)} bytes>",
                      "send token_ids or block_hashes, not both")
    if a.cache_salt or mm:
        raise invalid((field, index, "add", "cache_salt" if a.cache_salt else "mm_items"), "...",
                      "with block_hashes the client hashes salt and multimodal items itself")
    hashes = decode_hashes((field, index, "add", "block_hashes"), a.block_hashes, hash_bytes)
    if a.num_tokens == 0 or a.num_tokens > max_len:
        raise invalid((field, index, "add", "num_tokens"), a.num_tokens, f"must be in [1, max_model_len {max_len}]")
    full = a.num_tokens // hash_block_size
    if len(hashes) != full and not (unhashed_ok and not hashes) and not (lag_ok and len(hashes) < full):
        raise invalid((field, index, "add", "block_hashes"), f"<{len(hashes)} hashes>",
                      f"{a.num_tokens} tokens need {'at most ' if lag_ok else ''}{full} hashes at hash block size "
                      f"{hash_block_size}")
    if a.num_prompt_tokens > a.num_tokens:
        raise invalid((field, index, "add", "num_prompt_tokens"), a.num_prompt_tokens,
                      f"exceeds num_tokens {a.num_tokens}")
    return AddRequestOp(request_id, None, hashes, a.num_tokens, None,
                        check_name((field, index, "add", "lora_name"), a.lora_name),
                        num_prompt_tokens=a.num_prompt_tokens)


def decode_allocate(a: pb.AllocateOp, max_len: int, vocab: int, field: str, index: int | None = None,
                    hash_bytes: int = HASH_BYTES, vllm: bool = False) -> AllocateOp:
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
    op = AllocateOp(request_id, computed, budget, tokens, hashes, num_append, lookahead, a.delay_cache_blocks,
                    a.allow_transfer, external)
    if not vllm and a.cache_tokens and not any(getattr(a, f) for f in VLLM_FIELDS if f != "cache_tokens"):
        # A plain pool's delayed caching: blocks allocated with delay_cache_blocks become prefix hits only now
        # (a KV store pool's saved blocks, once their bytes are written).
        if a.cache_tokens > computed:
            raise invalid((field, index, "allocate", "cache_tokens"), a.cache_tokens,
                          f"caches computed tokens only: at most num_computed_tokens ({computed})")
        op.cache_tokens = a.cache_tokens
        return op
    if vllm or a.num_output_placeholders or a.num_in_flight_tokens or a.waiting or a.lookup \
            or a.num_new_computed_tokens or a.full_sequence_must_fit or a.reserved_blocks or a.has_scheduled_reqs \
            or a.cache_tokens or a.num_external_computed_tokens or a.num_encoder_tokens or a.max_cache_hit_length \
            or a.connector_lookup or a.HasField("shared_prefix_boundary"):
        _decode_vllm_fields(a, op, max_len, vllm, field, index)
    return op


def _decode_vllm_fields(a: pb.AllocateOp, op: AllocateOp, max_len: int, vllm: bool, field: str,
                        index: int | None) -> None:
    """The fields of vLLM's allocate_slots: only on a pool with vLLM's semantics, each within max_model_len."""
    def name(f: str) -> Field:
        return (field, index, "allocate", f)

    if not vllm:
        first = next(f for f in VLLM_FIELDS if getattr(a, f))
        raise invalid(name(first), getattr(a, first), "only a pool registered with vllm options takes it")
    placeholders, in_flight, hit, cache = (a.num_output_placeholders, a.num_in_flight_tokens,
                                           a.num_new_computed_tokens, a.cache_tokens)
    external, encoder, cap = a.num_external_computed_tokens, a.num_encoder_tokens, a.max_cache_hit_length
    if max(placeholders, in_flight, hit, cache, external, encoder, cap) > max_len:  # the message only for a refusal
        what = f"max_model_len {max_len}"
        for f in ("num_output_placeholders", "num_in_flight_tokens", "num_new_computed_tokens", "cache_tokens",
                  "num_external_computed_tokens", "num_encoder_tokens", "max_cache_hit_length", "connector_lookup"):
            at_most(name(f), getattr(a, f), max_len, what)
    if cap and not a.lookup:
        raise invalid(name("max_cache_hit_length"), cap, "caps an admission's hit (lookup)")
    if a.connector_lookup and not a.lookup:
        raise invalid(name("connector_lookup"), True, "says how an admission's hit (lookup) was looked up")
    if a.HasField("shared_prefix_boundary"):
        if not a.waiting:
            raise invalid(name("shared_prefix_boundary"), a.shared_prefix_boundary, "is an admission's (waiting)")
        op.shared_prefix_boundary = at_most(name("shared_prefix_boundary"), a.shared_prefix_boundary, max_len,
                                            f"max_model_len {max_len}")
    if a.allow_transfer:
        raise invalid(name("allow_transfer"), True, "vLLM's semantics have no cross-pool transfers")
    if a.append_token_ids:
        raise invalid(name("append_token_ids"), "...", "vLLM's scheduler appends block hashes (its own)")
    if a.lookup and (a.num_append_tokens or a.num_computed_tokens):
        raise invalid(name("num_append_tokens" if a.num_append_tokens else "num_computed_tokens"),
                      a.num_append_tokens or a.num_computed_tokens,
                      "an admission (lookup) starts from the tokens AddRequestOp gave, with none computed")
    if a.num_new_computed_tokens and not a.lookup:
        raise invalid(name("num_new_computed_tokens"), a.num_new_computed_tokens, "is the hit of an admission (lookup)")
    if a.cache_tokens and a.lookup:
        raise invalid(name("cache_tokens"), a.cache_tokens, "caches a running request's blocks, not an admission's")
    op.num_output_placeholders, op.num_in_flight_tokens, op.waiting = placeholders, in_flight, a.waiting
    op.lookup, op.num_new_computed_tokens = a.lookup, hit
    op.full_sequence_must_fit, op.reserved_blocks = a.full_sequence_must_fit, a.reserved_blocks
    op.has_scheduled_reqs, op.cache_tokens = a.has_scheduled_reqs, cache
    op.num_external_computed_tokens, op.num_encoder_tokens, op.max_cache_hit_length = external, encoder, cap
    op.connector_lookup = a.connector_lookup


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

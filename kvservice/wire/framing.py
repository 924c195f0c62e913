"""A Step request's bytes assembled op by op (the client's serializer for the Step RPC)."""

from __future__ import annotations

from kvservice._proto import allocator_pb2 as pb

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

"""vLLM's KV-event wire format, decoded and validated (vllm/distributed/kv_events.py, 0.33.0).

    PUB frame    [topic, sequence (8 bytes, big-endian), payload]
    replay       DEALER sends [b"", start sequence (8 bytes)]; ROUTER answers [b"", topic, sequence, payload]
                 per buffered batch with sequence >= start, then [b"", b"", -1 (8 bytes, signed), b""]
    payload      msgpack of KVEventBatch, an array [ts, events, data_parallel_rank?]
    event        a map {"type": "BlockStored", "block_hashes": [...], ...} (0.33), or an array
                 ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]
                 (releases whose events were array-like)

Block hashes are bytes, or ints when the engine sets VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES. A malformed frame
raises FrameError naming the field and the value; nothing here keeps state.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import msgpack

END_SEQUENCE = -1
MAX_TOKEN_ID = 2**32 - 1
EngineHash = bytes | int


class FrameError(ValueError):
    """A frame or payload that is not a vLLM KV-event batch."""

    def __init__(self, field: str, value: object, why: str) -> None:
        shown = repr(value)
        super().__init__(f"{field} = {shown[:80] + '...' if len(shown) > 80 else shown}: {why}")
        self.field = field


@dataclass(slots=True)
class Stored:
    block_hashes: list[EngineHash]
    parent: EngineHash | None
    token_ids: array  # uint32
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # one entry (a list, or None) per block: untagged, as published
    group_idx: int = 0
    lookahead: bool = False  # hashes also cover tokens after each block (EAGLE lookahead hashing)


@dataclass(slots=True)
class Removed:
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int = 0


@dataclass(slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(slots=True)
class Batch:
    """One published KVEventBatch: its sequence number, payload bytes (what the WAL keeps) and events."""

    sequence: int
    payload: bytes
    ts: float
    events: list[Event]


def decode_sequence(raw: bytes, field: str = "sequence") -> int:
    if len(raw) != 8:
        raise FrameError(field, raw, "a sequence number is 8 bytes, big-endian")
    return int.from_bytes(raw, "big", signed=True)


def decode_pub_frame(parts: list[bytes]) -> tuple[bytes, int, bytes]:
    """[topic, sequence, payload] from the PUB socket."""
    if len(parts) != 3:
        raise FrameError("frame", [len(p) for p in parts], "a KV-event frame has 3 parts: topic, sequence, payload")
    return parts[0], decode_sequence(parts[1]), parts[2]


def decode_replay_frame(parts: list[bytes]) -> tuple[int, bytes] | None:
    """[b"", topic, sequence, payload] from the ROUTER socket; None for the end marker."""
    if parts and parts[0] == b"":
        parts = parts[1:]
    if len(parts) != 3:
        raise FrameError("replay frame", [len(p) for p in parts], "expected topic, sequence, payload")
    sequence = decode_sequence(parts[1], "replay sequence")
    if sequence == END_SEQUENCE:
        return None
    return sequence, parts[2]


def decode_batch(sequence: int, payload: bytes) -> Batch:
    """Decodes and validates one payload; raises FrameError."""
    if sequence < 0:
        raise FrameError("sequence", sequence, "must be >= 0")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise FrameError("payload", payload[:16], f"not msgpack ({exc})") from None
    if not isinstance(obj, list) or len(obj) < 2:
        raise FrameError("payload", obj, "a KVEventBatch is an array [ts, events, data_parallel_rank]")
    ts, events = obj[0], obj[1]
    if not isinstance(ts, (int, float)):
        raise FrameError("ts", ts, "must be a number")
    if not isinstance(events, list):
        raise FrameError("events", events, "must be an array")
    return Batch(sequence, payload, float(ts), [_event(e, f"events[{i}]") for i, e in enumerate(events)])


_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def _event(raw: Any, where: str) -> Event:
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _ARRAY_FIELDS.get(kind)
        if names is None:
            raise FrameError(f"{where}.type", kind, f"not one of {', '.join(_ARRAY_FIELDS)}")
        fields = dict(zip(names, raw[1:]))
    else:
        raise FrameError(where, raw, "an event is a map with a 'type', or an array starting with its type")
    if kind == "BlockStored":
        return _stored(fields, where)
    if kind == "BlockRemoved":
        return Removed(_hashes(fields.get("block_hashes"), f"{where}.block_hashes"),
                       _opt_str(fields.get("medium"), f"{where}.medium"),
                       _opt_index(fields.get("group_idx"), f"{where}.group_idx"))
    if kind == "AllBlocksCleared":
        return Cleared()
    raise FrameError(f"{where}.type", kind, f"not one of {', '.join(_ARRAY_FIELDS)}")


def _stored(f: dict, where: str) -> Stored:
    hashes = _hashes(f.get("block_hashes"), f"{where}.block_hashes")
    parent = f.get("parent_block_hash")
    if parent is not None:
        parent = _hash(parent, f"{where}.parent_block_hash")
    raw_tokens = f.get("token_ids")
    if not isinstance(raw_tokens, list):
        raise FrameError(f"{where}.token_ids", raw_tokens, "must be an array of token ids")
    try:
        tokens = array("I", raw_tokens)  # range-checks every id in C
    except (OverflowError, TypeError):
        for i, t in enumerate(raw_tokens):
            if not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
                raise FrameError(f"{where}.token_ids[{i}]", t, "not a token id in [0, 2**32)") from None
        raise
    block_size = f.get("block_size")
    if not isinstance(block_size, int) or block_size <= 0:
        raise FrameError(f"{where}.block_size", block_size, "must be a positive integer")
    extra = f.get("extra_keys")
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
        raise FrameError(f"{where}.extra_keys", extra, f"must hold one entry per block ({len(hashes)})")
    lora = f.get("lora_name")
    return Stored(hashes, parent, tokens, block_size, _opt_str(f.get("medium"), f"{where}.medium"),
                  _opt_str(lora, f"{where}.lora_name"), extra, _opt_index(f.get("group_idx"), f"{where}.group_idx"),
                  f.get("lookahead_token_ids") is not None)


_U64 = 1 << 64


def _hash(value: Any, where: str) -> EngineHash:
    if isinstance(value, bytes) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64:
        return value
    raise FrameError(where, value, "a block hash is non-empty bytes or an int in [0, 2**64)")


def _hashes(value: Any, where: str) -> list[EngineHash]:
    if not isinstance(value, list):
        raise FrameError(where, value, "must be an array of block hashes")
    for i, h in enumerate(value):  # (the common cases checked inline: a batch carries thousands)
        kind = type(h)
        if not (kind is int and 0 <= h < _U64 or kind is bytes and h):
            _hash(h, f"{where}[{i}]")  # another kind that passes, or the error naming the entry
    return value


def _opt_str(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise FrameError(where, value, "must be a string or nil")


def _opt_index(value: Any, where: str) -> int:
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise FrameError(where, value, "must be a non-negative integer or nil")


def encode_batch(ts: float, events: list[dict], data_parallel_rank: int | None = 0) -> bytes:
    """A payload in 0.33's map form (for tests and benchmarks that publish without vLLM)."""
    body: list[Any] = [ts, events]
    if data_parallel_rank is not None:
        body.append(data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)

"""Field rules, each written once: a `*_problem(value)` says what is wrong with a value (None: nothing),
cheap for the common case; `check_*` raise `InvalidArgument` naming the field. Callers on hot paths call
the problem function and format the field's path only when it fails."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import numpy as np

from kvservice.errors import InvalidArgument
from kvservice.hashing import HASH_BYTES
from kvservice.wire.limits import MAX_ID_BYTES, MAX_NAME_BYTES, MAX_OPS_PER_STEP

_LITTLE = sys.byteorder == "little"
# A field's path: a string, or (prefix, index, op kind, name) formatted only when an error names it, since
# decoding formats nothing on the hot path: ("ops", 3, "add", "token_ids") -> "ops[3].add.token_ids",
# ("add", None, "add", "token_ids") -> "add.token_ids".
Field = str | tuple


def field_name(field: Field) -> str:
    if isinstance(field, str):
        return field
    prefix, index, kind, name = field
    head = prefix if index is None else f"{prefix}[{index}].{kind}"
    return f"{head}.{name}" if name else head


def invalid(field: Field, value: object, why: str) -> InvalidArgument:
    return InvalidArgument(field_name(field), value, why)


def id_problem(value: str) -> str | None:
    if value and len(value) <= MAX_ID_BYTES // 4 and value.isprintable():  # short: within the byte limit
        return None
    if not value:
        return "must not be empty"
    if len(value) > MAX_ID_BYTES or len(value.encode()) > MAX_ID_BYTES:
        return f"longer than {MAX_ID_BYTES} bytes"
    if not value.isprintable():
        return "must not contain control characters"
    return None


def check_id(field: Field, value: str) -> str:
    why = id_problem(value)
    if why is not None:
        raise invalid(field, value, why)
    return value


def name_problem(value: str) -> str | None:
    if len(value) <= MAX_NAME_BYTES // 4 or len(value.encode()) <= MAX_NAME_BYTES:
        return None
    return f"longer than {MAX_NAME_BYTES} bytes"


def check_name(field: Field, value: str) -> str | None:
    """An optional name: None when empty."""
    if not value:
        return None
    why = name_problem(value)
    if why is not None:
        raise invalid(field, value, why)
    return value


def check_count(field: Field, value: int, limit: int) -> int:
    if value > limit:
        raise invalid(field, value, f"exceeds the limit {limit}")
    return value


def check_ids(field: str, request_ids: list[str]) -> list[str]:
    """check_id of every entry: whole-list checks in C first, the loop (which names the bad entry) only
    when one fails."""
    check_count(field, len(request_ids), MAX_OPS_PER_STEP)
    if request_ids and (not "".join(request_ids).isprintable() or "" in request_ids
                        or max(map(len, request_ids)) > MAX_ID_BYTES // 4):
        for j, rid in enumerate(request_ids):
            check_id(f"{field}[{j}]", rid)
    return request_ids


def check_names(field: str, names: Sequence[str], n: int) -> list[str | None] | None:
    """Per-request names: none at all, or one per request (empty: none for that one)."""
    if not names:
        return None
    if len(names) != n:
        raise InvalidArgument(field, f"<{len(names)} names>", f"give none or one per request ({n})")
    return [check_name(f"{field}[{j}]", name) for j, name in enumerate(names)]


# ---- packed arrays -------------------------------------------------------------------------------
def max_u32(values: array) -> int:
    """max() of a non-empty uint32 array; numpy's for long ones (no int object per element)."""
    return int(np.frombuffer(values, dtype=np.uint32).max()) if len(values) >= 32 else max(values)


def decode_u32(field: Field, data: bytes, vocab_size: int = 0) -> array:
    """Packed little-endian uint32s (token ids when `vocab_size`: each must be below it)."""
    if len(data) & 3:
        raise invalid(field, f"<{len(data)} bytes>", "little-endian uint32s: the length must be a multiple of 4")
    values = array("I")
    values.frombytes(data)
    if not _LITTLE:
        values.byteswap()
    if vocab_size and values and max_u32(values) >= vocab_size:
        bad = next(i for i, t in enumerate(values) if t >= vocab_size)
        raise InvalidArgument(f"{field_name(field)}[{bad}]", values[bad],
                              f"token id out of range for vocab_size {vocab_size}")
    return values


def encode_u32(values: Sequence[int] | array) -> bytes:
    arr = values if isinstance(values, array) and values.typecode == "I" else array("I", values)
    if not _LITTLE:
        arr = array("I", arr)
        arr.byteswap()
    return arr.tobytes()


def decode_counts(field: str, data: bytes, n: int, limit: int, minimum: int = 0, what: str = "") -> array:
    """One uint32 per request, each in [minimum, limit] (`what` names the limit in errors)."""
    values = decode_u32(field, data)
    if len(values) != n:
        raise InvalidArgument(field, f"<{len(values)} values>", f"needs one uint32 per request ({n})")
    if values and (max_u32(values) > limit or (minimum and min(values) < minimum)):
        j = next(j for j, v in enumerate(values) if not minimum <= v <= limit)
        bound = f"is below {minimum}" if values[j] < minimum else f"exceeds {what or limit}"
        raise InvalidArgument(f"{field}[{j}]", values[j], bound)
    return values


def decode_hashes(field: Field, data: bytes, hash_bytes: int = HASH_BYTES) -> list[bytes]:
    """Concatenated block hashes of `hash_bytes` each (the pool's hash spec's length)."""
    if len(data) % hash_bytes:
        raise invalid(field, f"<{len(data)} bytes>", f"block hashes are {hash_bytes} bytes each in this hash spec: "
                                                     f"the length must be a multiple of {hash_bytes}")
    return [data[i:i + hash_bytes] for i in range(0, len(data), hash_bytes)]


def at_most(field: Field, value: int, limit: int, what: str) -> int:
    """`value <= limit`, else INVALID_ARGUMENT saying it exceeds `what`."""
    if value > limit:
        raise invalid(field, value, f"exceeds {what}")
    return value

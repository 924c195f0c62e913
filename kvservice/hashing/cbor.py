"""Canonical CBOR (RFC 8949 §4.2.1) for the values vLLM's `*_cbor` block hashes serialize: None,
bools, ints, floats, bytes, str, tuples and lists (as arrays) — byte-exact to `cbor2.dumps(obj,
canonical=True)` for them, without the dependency."""

from __future__ import annotations

import math
import struct


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes((major << 5 | n,))
    if n < 1 << 8:
        return bytes((major << 5 | 24, n))
    if n < 1 << 16:
        return bytes((major << 5 | 25,)) + n.to_bytes(2, "big")
    if n < 1 << 32:
        return bytes((major << 5 | 26,)) + n.to_bytes(4, "big")
    return bytes((major << 5 | 27,)) + n.to_bytes(8, "big")


def _float(x: float) -> bytes:
    """The shortest of half, single and double precision that holds `x` exactly (canonical)."""
    if math.isnan(x):
        return b"\xf9\x7e\x00"
    for fmt, head in (("e", 0xF9), ("f", 0xFA)):
        try:
            packed = struct.pack(">" + fmt, x)
        except OverflowError:
            continue
        if struct.unpack(">" + fmt, packed)[0] == x:
            return bytes((head,)) + packed
    return b"\xfb" + struct.pack(">d", x)


def _encode(obj, out: list[bytes]) -> None:
    if obj is None:
        out.append(b"\xf6")
    elif obj is True:
        out.append(b"\xf5")
    elif obj is False:
        out.append(b"\xf4")
    elif isinstance(obj, int):
        if obj >= 1 << 64 or obj < -(1 << 64):
            raise ValueError(f"integer {obj} needs a CBOR bignum, which block hashes never carry")
        out.append(_head(0, obj) if obj >= 0 else _head(1, -1 - obj))
    elif isinstance(obj, float):
        out.append(_float(obj))
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
        out.append(_head(2, len(data)))
        out.append(data)
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        out.append(_head(3, len(data)))
        out.append(data)
    elif isinstance(obj, (tuple, list)):
        out.append(_head(4, len(obj)))
        for item in obj:
            _encode(item, out)
    else:
        raise TypeError(f"cannot CBOR-encode a {type(obj).__name__} in a block hash")


def dumps_canonical(obj) -> bytes:
    out: list[bytes] = []
    _encode(obj, out)
    return b"".join(out)

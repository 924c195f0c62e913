"""Mutations of fuzz inputs (tests/fuzz_targets.py format): protobuf-aware (parse the request, change one
field to an edge value or add/drop a repeated element, re-serialize), byte-level, header, and splices.

Nothing here imports `kvservice` at import time, so that atheris can instrument it first.
"""

from __future__ import annotations

import random

MAX_INPUT = 4096
INTERESTING_STRINGS = ["", "r0", "r1", "c0", "x0", "b0", "h0", "h1", "n0", "full", "full-b", "hybrid", "xfer-1",
                       "xfer-2", "acme", "fuzz", "a" * 256, "x" * 257, "é" * 128, "é" * 129, "\U0001d518" * 64,
                       "\U0001d518" * 65, "\x1f", "a\x1fb", "a\x00b", "\n", " ", "\u2028", "kvservice-v1", "nhd"]
INTERESTING_INTS = [0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 40, 48, 63, 64, 65, 79, 80, 81, 82, 255, 256, 257,
                    999, 1000, 1001, 1 << 16, (1 << 16) + 1, 1 << 20, 1 << 24, (1 << 24) + 1, (1 << 31) - 1, 1 << 31,
                    (1 << 31) + 1, (1 << 32) - 1, 1 << 32, 1 << 63, (1 << 64) - 1]


def targets():
    """The fuzz target module, imported late so that atheris can instrument `kvservice` first."""
    from tests import fuzz_targets
    return fuzz_targets

def message_class(method: str):
    from kvservice.server.servicer import SERVICE
    return SERVICE.methods_by_name[method].input_type._concrete_class


def _int_bits(fd) -> int:
    from google.protobuf.descriptor import FieldDescriptor as FD
    return 64 if fd.type in (FD.TYPE_UINT64, FD.TYPE_FIXED64, FD.TYPE_INT64, FD.TYPE_SINT64) else 32


def _int_value(rng: random.Random, fd, current: int = 0) -> int:
    top = (1 << _int_bits(fd)) - 1
    roll = rng.random()
    if roll < 0.1:
        value = top  # the type's largest value: what overflows when incremented
    elif roll < 0.6:
        value = rng.choice(INTERESTING_INTS)
    elif roll < 0.85:
        value = current + rng.randint(-3, 3)
    else:
        value = rng.randint(0, rng.choice([16, 300, 1 << 16, top]))
    return min(max(value, 0), top)


def _u32s(values) -> bytes:
    return b"".join((v & 0xFFFFFFFF).to_bytes(4, "little") for v in values)


def _bytes_value(rng: random.Random, name: str, current: bytes) -> bytes:
    roll = rng.random()
    if "hash" in name:
        if roll < 0.2 and current:
            return current[:-rng.randint(1, min(16, len(current)))]  # a torn hash
        count = rng.choice([0, 1, 1, 2, 3, 5, 8])
        return b"".join(rng.choice([bytes([rng.randint(1, 9)]) * 16, rng.randbytes(16)]) for _ in range(count))
    if roll < 0.15 and current:
        return current + rng.randbytes(rng.randint(1, 3))  # not a multiple of 4
    if roll < 0.3 and len(current) >= 4:
        cut = rng.randrange(0, len(current), 4)
        return current[:cut]
    count = rng.choice([0, 1, 1, 2, 3, 16, 20, 40, 80, 257])
    hi = rng.choice([10, 999, 1000, 1001, 1 << 16, (1 << 32) - 1])
    return _u32s(rng.choice([rng.randint(0, hi), hi, 0, 80, 81]) for _ in range(count))


def message_fields(msg, depth: int = 0) -> list[tuple[object, object]]:
    """Every (message, field descriptor) reachable through set sub-messages."""
    out = []
    for fd in msg.DESCRIPTOR.fields:
        out.append((msg, fd))
        if fd.message_type is None or depth >= 4:
            continue
        if fd.is_repeated:
            for sub in getattr(msg, fd.name):
                out.extend(message_fields(sub, depth + 1))
        elif msg.HasField(fd.name):
            out.extend(message_fields(getattr(msg, fd.name), depth + 1))
    return out


def _scalar(rng: random.Random, fd, current):
    from google.protobuf.descriptor import FieldDescriptor as FD
    if fd.type == FD.TYPE_STRING:
        return rng.choice(INTERESTING_STRINGS) if rng.random() < 0.85 else "".join(
            chr(rng.choice([rng.randint(32, 126), rng.randint(0, 0x10FFFF)])) for _ in range(rng.randint(1, 8)))
    if fd.type == FD.TYPE_BYTES:
        return _bytes_value(rng, fd.name, current if isinstance(current, bytes) else b"")
    if fd.type == FD.TYPE_BOOL:
        return not current
    return _int_value(rng, fd, current if isinstance(current, int) else 0)


def _scalar_safe(rng: random.Random, fd, current):
    value = _scalar(rng, fd, current)
    if isinstance(value, str) and any(0xD800 <= ord(c) < 0xE000 for c in value):
        return "x"  # protobuf strings are valid UTF-8: surrogates cannot be sent
    return value


def mutate_message(data: bytes, rng: random.Random) -> bytes:
    """Changes one field of the serialized request (or adds/drops a repeated element or sub-message)."""
    fuzz = targets()
    method = fuzz.METHODS[data[0] % len(fuzz.METHODS)]
    cls = message_class(method)
    try:
        msg = cls.FromString(data[fuzz.HEADER:])
    except Exception:
        return mutate_bytes(data, rng)
    owner, fd = rng.choice(message_fields(msg))
    name = fd.name
    if fd.is_repeated:
        items = getattr(owner, name)
        roll = rng.random()
        if items and roll < 0.3:
            del items[rng.randrange(len(items))]
        elif fd.message_type is not None:
            if items and roll < 0.6:
                items.add().CopyFrom(rng.choice(items))
            else:
                sub = items.add()
                if fd.message_type.oneofs:  # Op, KVCacheGroup: pick a kind
                    getattr(sub, rng.choice(fd.message_type.oneofs[0].fields).name).SetInParent()
        elif items and roll < 0.6:
            items[rng.randrange(len(items))] = _scalar_safe(rng, fd, items[0])
        else:
            items.append(_scalar_safe(rng, fd, None))
    elif fd.message_type is not None:
        if owner.HasField(name) and rng.random() < 0.4:
            owner.ClearField(name)
        else:
            getattr(owner, name).SetInParent()
    elif fd.containing_oneof is not None and rng.random() < 0.3:
        owner.ClearField(name)
    else:
        setattr(owner, name, _scalar_safe(rng, fd, getattr(owner, name)))
    return data[:fuzz.HEADER] + msg.SerializeToString()


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    roll = rng.random()
    if not buf or roll < 0.15:
        at = rng.randint(0, len(buf))
        buf[at:at] = rng.randbytes(rng.randint(1, 8))
    elif roll < 0.4:
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    elif roll < 0.6:
        buf[rng.randrange(len(buf))] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
    elif roll < 0.8:
        at = rng.randrange(len(buf))
        del buf[at:at + rng.randint(1, 8)]
    else:
        at, n = rng.randrange(len(buf)), rng.randint(1, 16)
        buf[at:at] = buf[at:at + n]
    return bytes(buf)


def mutate_header(data: bytes, rng: random.Random) -> bytes:
    fuzz = targets()
    buf = bytearray(data.ljust(fuzz.HEADER, b"\x00"))
    i = rng.randrange(fuzz.HEADER)
    buf[i] = rng.choice([0, 1, 2, 3, 4, 5, 7, 199, 200, 229, 230, 0xF0, 0xFF, rng.randrange(256)])
    if i == 0:
        buf[0] %= len(fuzz.METHODS)
    return bytes(buf)


def mutate(data: bytes, rng: random.Random, corpus: list[bytes] = ()) -> bytes:
    """1-4 mutations: protobuf-aware, byte-level, header, or a splice with another corpus entry."""
    fuzz = targets()
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
        roll = rng.random()
        if len(data) < fuzz.HEADER or roll < 0.08:
            data = mutate_header(data, rng)
        elif roll < 0.78:
            data = mutate_message(data, rng)
        elif roll < 0.95 or not corpus:
            data = mutate_bytes(data, rng)
        else:
            other = rng.choice(corpus)
            cut = rng.randint(fuzz.HEADER, max(fuzz.HEADER, len(data)))
            data = data[:cut] + other[rng.randint(min(fuzz.HEADER, len(other)), len(other)):]
    return data[:MAX_INPUT]

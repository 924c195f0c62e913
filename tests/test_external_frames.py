"""The vLLM KV-event decoder on hand-built frames: 0.33's map form, the older array form, int hashes, and
every malformed field named."""

import msgpack
import pytest

from kvservice.external.frames import (
    Cleared,
    FrameError,
    Removed,
    Stored,
    decode_batch,
    decode_pub_frame,
    decode_replay_frame,
)
from tests.external_helpers import cleared, payload, removed, stored


def test_map_form_batch():
    h0, h1 = b"\x01" * 32, b"\x02" * 32
    batch = decode_batch(7, payload(stored([h0, h1], None, list(range(8)), 4, extra_keys=[["salt"], None]),
                                    removed([h0], "CPU", 1), cleared(), ts=12.5))
    assert batch.sequence == 7 and batch.ts == 12.5
    s, r, c = batch.events
    assert isinstance(s, Stored) and s.block_hashes == [h0, h1] and s.parent is None
    assert list(s.token_ids) == list(range(8)) and s.block_size == 4 and s.medium == "GPU"
    assert s.extra_keys == [["salt"], None] and s.group_idx == 0 and not s.lookahead
    assert isinstance(r, Removed) and r.block_hashes == [h0] and r.medium == "CPU" and r.group_idx == 1
    assert isinstance(c, Cleared)


def test_array_form_and_int_hashes():
    # Releases whose events were array-like tagged structs: [type, fields in declaration order...]
    raw = msgpack.packb([1.0, [["BlockStored", [11, 12], 10, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, None],
                               ["BlockRemoved", [11], None], ["AllBlocksCleared"]]])
    s, r, c = decode_batch(0, raw).events
    assert s.block_hashes == [11, 12] and s.parent == 10 and s.medium is None and s.block_size == 4
    assert r.block_hashes == [11] and isinstance(c, Cleared)


def test_frames_and_replay_markers():
    assert decode_pub_frame([b"kv", (5).to_bytes(8, "big"), b"x"]) == (b"kv", 5, b"x")
    assert decode_replay_frame([b"", b"", (9).to_bytes(8, "big"), b"p"]) == (9, b"p")
    assert decode_replay_frame([b"", b"", (-1).to_bytes(8, "big", signed=True), b""]) is None
    with pytest.raises(FrameError, match="3 parts"):
        decode_pub_frame([b"only", b"two"])
    with pytest.raises(FrameError, match="8 bytes"):
        decode_pub_frame([b"", b"\x01", b"x"])


@pytest.mark.parametrize("bad, field", [
    (b"\xc1", "payload"),
    (msgpack.packb({"ts": 1}), "payload"),
    (msgpack.packb(["now", []]), "ts"),
    (msgpack.packb([1.0, [{"type": "BlockMoved"}]]), "events[0].type"),
    (msgpack.packb([1.0, [stored([b"a"], None, [1, -2, 3, 4])]]), "events[0].token_ids[1]"),
    (msgpack.packb([1.0, [stored([b"a"], None, [1, 2**32, 3, 4])]]), "events[0].token_ids[1]"),
    (msgpack.packb([1.0, [stored([b"a", "x"], None, [1] * 8)]]), "events[0].block_hashes[1]"),
    (msgpack.packb([1.0, [stored([b"a"], b"", [1] * 4)]]), "events[0].parent_block_hash"),
    (msgpack.packb([1.0, [stored([b"a"], None, [1] * 4, block_size=0)]]), "events[0].block_size"),
    (msgpack.packb([1.0, [stored([b"a"], None, [1] * 4, extra_keys=[None, None])]]), "events[0].extra_keys"),
    (msgpack.packb([1.0, [removed([b"a"], medium=3)]]), "events[0].medium"),
    (msgpack.packb([1.0, [removed([-1])]]), "events[0].block_hashes[0]"),
    (msgpack.packb([1.0, [stored([b"a"], None, [1] * 4, group_idx=-1)]]), "events[0].group_idx"),
])
def test_malformed_fields_are_named(bad, field):
    with pytest.raises(FrameError) as err:
        decode_batch(0, bad)
    assert err.value.field == field
    assert str(err.value).startswith(field)

"""The README's hash spec: byte-exact hashing and its normative test vectors."""

import numpy as np
import pytest
import xxhash

from kvservice.hashing import (
    DEFAULT_HASH_SEED,
    MultiModalItem,
    TokenIdError,
    block_extra_keys,
    hash_block_tokens,
    hash_prompt,
    pack_token_ids,
    root_hash,
    spec_fingerprint,
)

VECTORS = {
    "block0": "2071ca1dc0eeaa034258bafa60182fa0",
    "salt_a": "326287b37d941dccfe0d591d4c9f9d15",
    "lora_l": "ba74fbfbe0ac93ac4ca40f568f4a4aab",
    "block1": "a4573029e5910777764fddc248d5d799",
    "lora_l_path_p": "636a1806919c5f362d6b72fff00ae115",
    "fingerprint16": "b6f81f04ead94f27",  # spec version 2 (version 1, without the LoRA path: 76d75aa637c9ac2f)
}


def test_normative_vectors():
    h = hash_prompt(list(range(32)))
    assert h[0].hex() == VECTORS["block0"]
    assert h[1].hex() == VECTORS["block1"]
    assert hash_prompt(list(range(16)), cache_salt="a")[0].hex() == VECTORS["salt_a"]
    assert hash_prompt(list(range(16)), lora_name="l")[0].hex() == VECTORS["lora_l"]
    assert hash_prompt(list(range(16)), lora_name="l", lora_path="/p")[0].hex() == VECTORS["lora_l_path_p"]
    assert spec_fingerprint(DEFAULT_HASH_SEED, 16) == VECTORS["fingerprint16"]


def test_spec_written_out_by_hand():
    """The chain recomputed straight from the spec's text, with struct-free byte building."""
    h = lambda b: xxhash.xxh3_128(b, seed=0).digest()
    root = h(b"kvservice-v1")
    le = lambda ts: b"".join(t.to_bytes(4, "little") for t in ts)
    b0 = h(root + le(range(16)))
    b1 = h(b0 + le(range(16, 32)))
    assert hash_prompt(list(range(32))) == [b0, b1]
    salted = h(root + le(range(16)) + b"\x01" + (1).to_bytes(4, "little") + b"a")
    assert hash_prompt(list(range(16)), cache_salt="a") == [salted]
    # LoRA on every block, salt on block 0 only.
    lora = b"\x02" + (1).to_bytes(4, "little") + b"l"
    s0 = h(root + le(range(16)) + b"\x01\x01\x00\x00\x00a" + lora)
    s1 = h(s0 + le(range(16, 32)) + lora)
    assert hash_prompt(list(range(32)), cache_salt="a", lora_name="l") == [s0, s1]
    # Spec version 2: the adapter's path follows its name, so re-pointing a name changes the hashes.
    path = b"\x04" + (2).to_bytes(4, "little") + b"/p"
    assert hash_prompt(list(range(16)), lora_name="l", lora_path="/p") == [h(root + le(range(16)) + lora + path)]
    assert spec_fingerprint() == xxhash.xxh3_64_hexdigest(b"kvservice-hash/2;xxh3_128;seed=kvservice-v1;block=16")


def test_multimodal_items_in_overlapping_blocks_only():
    item = MultiModalItem("img-1", offset=10, length=10)  # covers positions 10..19
    field = lambda rel: b"\x03" + (9).to_bytes(4, "little") + b"img-1" + rel.to_bytes(4, "little", signed=True)
    assert block_extra_keys(0, 16, mm_items=[item]) == field(10)
    assert block_extra_keys(16, 32, mm_items=[item]) == field(-6)
    assert block_extra_keys(32, 48, mm_items=[item]) == b""
    plain = hash_prompt(list(range(48)))
    with_mm = hash_prompt(list(range(48)), mm_items=[item])
    assert with_mm[0] != plain[0] and with_mm[1] != plain[1]


def test_seed_changes_everything_and_no_randomness():
    assert root_hash("kvservice-v1") == root_hash("kvservice-v1")
    assert hash_prompt(list(range(16)), seed="other") != hash_prompt(list(range(16)))
    assert spec_fingerprint("kvservice-v1", 32) != spec_fingerprint("kvservice-v1", 16)


def test_partial_block_not_hashed_and_block_size():
    assert len(hash_prompt(list(range(31)))) == 1
    assert len(hash_prompt(list(range(32)), block_size=8)) == 4
    with pytest.raises(ValueError, match="block_size"):
        hash_prompt([1, 2], block_size=0)


@pytest.mark.parametrize("bad,where", [([1, -1], "[1] = -1"), ([2**32], "[0] = 4294967296"),
                                       ([0, 1, 2**70], "[2]"), ([1.5], "[0] = 1.5"), (["7"], "[0] = '7'")])
def test_token_ids_out_of_range_rejected(bad, where):
    with pytest.raises(TokenIdError, match=r"token_ids" + (r".*" + __import__("re").escape(where) if where else "")):
        pack_token_ids(bad)


def test_numpy_inputs_and_boundaries():
    arr = np.array([0, 2**32 - 1], dtype=np.int64)
    assert pack_token_ids(arr) == b"\x00" * 4 + b"\xff" * 4
    assert pack_token_ids(np.array([7], dtype=np.uint32)) == (7).to_bytes(4, "little")
    assert hash_prompt(np.arange(32)) == hash_prompt(list(range(32)))
    with pytest.raises(TokenIdError):
        pack_token_ids(np.array([1.0, 2.0]))


def test_hash_block_tokens_matches_prompt_chain():
    b0 = hash_block_tokens(None, list(range(16)))
    assert b0.hex() == VECTORS["block0"]
    assert hash_block_tokens(b0, list(range(16, 32))).hex() == VECTORS["block1"]

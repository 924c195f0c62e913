"""Hash specs per pool: kvservice's own and vLLM 0.33.0's four, byte-exact. The vLLM vectors were
computed by vLLM 0.33.0 itself (vllm.utils.hashing over (parent, tokens, extra keys), NONE_HASH =
H("vllm-none-hash")); kvservice's implementation must reproduce them without vLLM."""

import hashlib
import pickle

import pytest
import xxhash

from kvservice.core import FullAttentionSpec, KVCacheConfig, KVCacheManager, Request
from kvservice.hashing import HashSpec, MultiModalItem, spec_fingerprint, vllm_spec
from kvservice.hashing.cbor import dumps_canonical

# algorithm: (root, block 0 = tokens 0..15, block 1 = 16..31 after it, block 0 with cache salt "a",
#             block 0 with LoRA "l" at "/p", fingerprint at hash block size 16)
VLLM_VECTORS = {
    "sha256": ("066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
               "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798",
               "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629",
               "3a829f0539d3fc466ecb0a98675d6c3525ac5e6e55c514c11493ed5395a6c869",
               "f835a1efa8f82f2b284e6a31f05d66117d1ff7646770066fe5e16e5cae62e235", "93ad3caa6af0e6ad"),
    "sha256_cbor": ("9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
                    "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
                    "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
                    "dc4e508e90ade15354e0024993c0c18b1d72682e466666337a10981dedde21bb",
                    "3ac1e9ca7ee93c2e5df4c52f068b2041482e34245c7abcf8fd6a506fcfd0c2f5", "0482e53efc0af6b4"),
    "xxhash": ("d98f72b9c430d985211489af307f0229", "25a8f374f040077e10f5b68a5399fbae",
               "1bb695ee62584a464f17274b9cefdafb", "f06c5b44d568e3b3247078a3bee18d89",
               "061b59cc39593094168dad01e5f6930a", "59df46370f227d1b"),
    "xxhash_cbor": ("a4e364baa0791a6f63bbf917db9b700d", "f2313f4548e185b1a011187a342021cc",
                    "74ee692fcce0684e02de354d6ca364b4", "9385ae1efc3d11c3c269bb736f2e9953",
                    "13113fd9aa9d6f85d8d870069255b83f", "a8fa1ffc9fc694f1"),
}


@pytest.mark.parametrize("algorithm", sorted(VLLM_VECTORS))
def test_vllm_vectors(algorithm):
    root, b0, b1, salt, lora, fingerprint = VLLM_VECTORS[algorithm]
    spec = HashSpec(algorithm)
    assert spec.root.hex() == root and spec.hash_bytes == len(root) // 2
    assert spec.hash_block(None, range(16)).hex() == b0
    assert spec.hash_block(bytes.fromhex(b0), range(16, 32)).hex() == b1
    assert spec.fingerprint() == fingerprint
    r = Request("r", list(range(32)), 16, hash_spec=spec)
    assert [h.hex() for h in r.block_hashes] == [b0, b1]
    assert Request("s", list(range(16)), 16, cache_salt="a", hash_spec=spec).block_hashes[0].hex() == salt
    with_lora = Request("l", list(range(16)), 16, lora_name="l", lora_path="/p", hash_spec=spec)
    assert with_lora.block_hashes[0].hex() == lora


def test_vllm_spec_written_out_by_hand():
    """sha256 over pickle and canonical CBOR, recomputed from the spec's text."""
    root = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    b0 = hashlib.sha256(pickle.dumps((root, tuple(range(16)), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert HashSpec("sha256").hash_block(None, range(16)) == b0
    # CBOR: array(3) [bytes(16) root, array(16) of small ints, null]
    xroot = xxhash.xxh3_128_digest(b"\x6evllm-none-hash")
    encoded = b"\x83" + b"\x50" + xroot + b"\x90" + bytes(range(16)) + b"\xf6"
    assert dumps_canonical((xroot, tuple(range(16)), None)) == encoded
    assert HashSpec("xxhash_cbor").hash_block(None, range(16)) == xxhash.xxh3_128_digest(encoded)
    fp = xxhash.xxh3_64_hexdigest(b"kvservice-hash/2;vllm-sha256;seed=vllm-none-hash;block=16")
    assert HashSpec("sha256").fingerprint() == fp


def test_canonical_cbor_encodings():
    assert dumps_canonical(None) == b"\xf6" and dumps_canonical(23) == b"\x17" and dumps_canonical(24) == b"\x18\x18"
    assert dumps_canonical(2**32) == b"\x1b" + (2**32).to_bytes(8, "big")
    assert dumps_canonical(-25) == b"\x38\x18" and dumps_canonical("é") == b"\x62\xc3\xa9"
    assert dumps_canonical(1.5) == b"\xf9\x3e\x00" and dumps_canonical([]) == b"\x80"
    with pytest.raises(TypeError, match="cannot CBOR-encode a dict"):
        dumps_canonical({})


def test_vllm_extra_keys_order_and_tags():
    items = [MultiModalItem("img", 10, 10)]
    keys, idx = vllm_spec.block_extra_keys(0, 16, 0, lora=("l", "/p"), mm_items=items, cache_salt="s")
    assert keys == (("lora", "l", "/p"), ("mm", "img", 10), ("cache_salt", "s")) and idx == 0
    keys, idx = vllm_spec.block_extra_keys(16, 32, idx, mm_items=items)
    assert keys == (("mm", "img", -6),) and idx == 1
    assert vllm_spec.block_extra_keys(32, 48, idx, mm_items=items) == (None, 1)
    assert vllm_spec.event_extra_keys([(("lora", "l", "/p"), ("mm", "img", 10)), None]) == [("l", ("img", 10)), None]


def test_kvservice_spec_is_the_default_and_specs_differ():
    assert HashSpec().fingerprint() == spec_fingerprint() and HashSpec().hash_bytes == 16
    prints = {HashSpec(a).fingerprint() for a in ("kvservice", *vllm_spec.ALGORITHMS)}
    assert len(prints) == 5
    assert HashSpec("sha256", seed="x").root != HashSpec("sha256").root  # a declared seed, never random
    with pytest.raises(ValueError, match="HashSpec.algorithm must be"):
        HashSpec("md5")
    with pytest.raises(ValueError, match="hash_spec hashes 16-token blocks, the request 8"):
        Request("r", [1], 8, hash_spec=HashSpec("sha256"))


def test_a_pool_on_vllm_hashes_hits_and_takes_32_byte_hashes():
    spec = HashSpec("sha256", block_size=4)
    m = KVCacheManager(KVCacheConfig(20, [FullAttentionSpec(4)]), 64)
    a = Request("a", list(range(10)), 4, hash_spec=spec)
    hits, n = m.get_computed_blocks(a)
    m.allocate_slots(a, 10, n, hits)
    b = Request.from_block_hashes("b", a.block_hashes, 9, 4, hash_spec=spec)  # a vLLM client's own hashes
    assert m.get_computed_blocks(b)[1] == 8
    with pytest.raises(ValueError, match="must be 32 bytes"):
        Request.from_block_hashes("c", [b"x" * 16], 4, 4, hash_spec=spec)

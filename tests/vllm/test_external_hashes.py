"""kvservice.external.vllm_hashes against vLLM 0.33.0's own block hashing (`hash_block_tokens` with each of
`get_hash_fn_by_name`'s four functions, `init_none_hash`) and cbor2's canonical encoder. vLLM env only."""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("vllm", reason="needs the vLLM 0.33.0 environment (make vllm-env)")

import cbor2  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402

from kvservice.external import vllm_hashes  # noqa: E402
from kvservice.hashing.cbor import dumps_canonical  # noqa: E402

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
EXTRAS = [None, (("cache_salt", "tenant-7"),), (("mm", "img-abc", -3),), (("mm", "a", 0), ("mm", "b", 12)),
          (("lora", "adapter", "/path/to/adapter"), ("cache_salt", "s")), (("prompt_embeds", b"\x00" * 32),)]


@pytest.mark.parametrize("algo", ALGOS)
def test_block_hashes_equal_vllms(algo, monkeypatch):
    rng = random.Random(algo)
    monkeypatch.setenv("PYTHONHASHSEED", "1234")  # xxhash roots are random per process without it
    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    root = vllm_hashes.none_hash(algo, os.environ["PYTHONHASHSEED"])
    assert root == kv_cache_utils.NONE_HASH
    parent = None
    for i in range(40):
        tokens = [rng.randrange(2**32 if i % 5 == 0 else 50_000) for _ in range(rng.choice([1, 16, 64]))]
        extra = EXTRAS[i % len(EXTRAS)]
        theirs = kv_cache_utils.hash_block_tokens(fn, parent, tokens, extra)
        ours = vllm_hashes.block_hash(algo, parent if parent is not None else root, tokens, extra)
        assert ours == theirs, (algo, i)
        assert vllm_hashes.external_form(ours, True) == kv_cache_utils.maybe_convert_block_hash(theirs) or \
            not kv_cache_utils.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
        parent = theirs


def test_default_roots_without_pythonhashseed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    for algo in ("sha256", "sha256_cbor"):
        kv_cache_utils.init_none_hash(get_hash_fn_by_name(algo))
        assert vllm_hashes.none_hash(algo) == kv_cache_utils.NONE_HASH
    assert vllm_hashes.none_hash("xxhash") is None  # vLLM draws a random root: unknowable from outside


def test_cbor_is_cbor2_canonical():
    rng = random.Random(1)
    values = [None, True, False, 0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, -1, -24, -25,
              -2**63, "", "é" * 30, b"", b"\xff" * 300, (), (1, (2, ("x", b"y")), None)]
    values += [tuple(rng.randrange(-2**40, 2**40) for _ in range(rng.randrange(30))) for _ in range(50)]
    for v in values:
        assert dumps_canonical(v) == cbor2.dumps(v, canonical=True), v

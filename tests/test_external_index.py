"""External pools in the allocator, in process: IngestEvents through `Allocator.apply`, answered by Lookup.
The reference is a model of vLLM's prefix cache (hash -> number of cached blocks, longest prefix walk on
vLLM's own chained hashes); the index must agree with it on random traces without using vLLM's hashes."""

import random
from collections import Counter

import pytest

from kvservice.allocator import Allocator
from kvservice.commands import IngestEvents, RegisterExternalPool
from kvservice.external.spec import SPEC_CHECK_BLOCKS, ExternalSpec
from kvservice.external.vllm_hashes import block_hash, external_form, none_hash
from kvservice.hashing import hash_prompt
from kvservice.store import wal
from kvservice.store.snapshot import dump, load, state_digest
from tests.external_helpers import chain, cleared, payload, removed, stored

B = 4  # the engine's block size in most tests (a multiple of the allocator's hash block size 4)


class Engine:
    """A stand-in for vLLM's BlockPool as its events describe it: every cached physical block by hash
    (`as_int`: the 64-bit form vLLM publishes by default)."""

    def __init__(self, block_size: int = B, as_int: bool = False) -> None:
        self.block_size = block_size
        self.as_int = as_int
        self.cached: Counter = Counter()

    def chain(self, prompt: list[int]) -> list:
        return [external_form(h, self.as_int) for h in chain(prompt, self.block_size)]

    def hits(self, prompt: list[int]) -> int:
        n = 0
        for h in self.chain(prompt)[:(len(prompt) - 1) // self.block_size]:
            if not self.cached[h]:
                break
            n += self.block_size
        return n


def new_allocator(max_blocks: int = 1_000_000, block_size: int = B, **spec) -> Allocator:
    a = Allocator(hash_block_size=4)
    a.apply(RegisterExternalPool("", ExternalSpec("vllm-0", "tcp://127.0.0.1:1", block_size=block_size,
                                                  hash_algo="sha256_cbor", max_blocks=max_blocks, **spec)), 0.0)
    return a


class Feed:
    def __init__(self, allocator: Allocator, pool_id: str = "vllm-0") -> None:
        self.allocator = allocator
        self.pool_id = pool_id
        self.seq = 0

    def send(self, *events: dict, reset: int = 0) -> None:
        registration = self.allocator.state.external.pools[self.pool_id].registration
        command = IngestEvents(self.pool_id, registration, [(self.seq, payload(*events))], reset)
        self.allocator.apply(wal.decode(wal.encode(command), 4), 0.0)  # through the WAL's encoding too
        self.seq += 1


def hit(a: Allocator, prompt, pool_id="vllm-0", **kw) -> int:
    return a.lookup("", token_ids=prompt, **kw).tokens(pool_id)


@pytest.mark.parametrize("as_int", [False, True], ids=["bytes-hashes", "int-hashes"])
def test_random_traces_match_the_model(as_int):
    rng = random.Random(7)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(4)]
    for trial in range(6):
        a, feed, engine = new_allocator(), None, Engine(as_int=as_int)
        feed = Feed(a)
        for step in range(150):
            op = rng.random()
            if op < 0.55:  # a request caches blocks [k, m) of its prompt (its first k were hits)
                prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 13))]
                hashes = engine.chain(prompt)
                if not hashes:
                    continue
                k = rng.randrange(len(hashes))
                parent = hashes[k - 1] if k else None
                feed.send(stored(hashes[k:], parent, prompt[k * B:len(hashes) * B]))
                engine.cached.update(hashes[k:])
            elif op < 0.93 and +engine.cached:  # vLLM evicts any free cached block, parents included
                h = rng.choice(sorted(+engine.cached, key=repr))
                feed.send(removed([h]))
                engine.cached[h] -= 1
            elif op < 0.95:
                feed.send(cleared())
                engine.cached.clear()
            for probe in prefixes + [p + [1, 2, 3, 4, 5] for p in prefixes]:
                assert hit(a, probe) == engine.hits(probe), (trial, step, probe)
        stats = a.state.external.pools["vllm-0"].index.counters
        assert stats.stored_blocks and stats.removed_blocks


def test_duplicates_count_and_ghosts_keep_children():
    a = new_allocator()
    feed = Feed(a)
    prompt = list(range(13))
    h = chain(prompt)
    feed.send(stored(h, None, prompt[:12]))
    feed.send(stored(h[:1], None, prompt[:4]))  # a second physical block with block 0's content
    feed.send(removed(h[:1]))
    assert hit(a, prompt) == 12  # one copy of block 0 is still cached
    feed.send(removed(h[:1]))
    assert hit(a, prompt) == 0  # block 0 gone: blocks 1, 2 are unreachable (vLLM cannot hit them either)
    feed.send(stored(h[:1], None, prompt[:4]))  # recomputed: the ghost revives with its children
    assert hit(a, prompt) == 12
    assert a.state.external.pools["vllm-0"].index.counters.duplicate_stores == 1


def test_orphans_are_adopted_when_their_parent_arrives():
    a = new_allocator()
    feed = Feed(a)
    prompt = list(range(100, 113))
    h = chain(prompt)
    feed.send(stored(h[2:], h[1], prompt[8:12]))  # block 2, its parent never seen
    feed.send(stored(h[1:2], h[0], prompt[4:8]))  # block 1, parent unknown too
    index = a.state.external.pools["vllm-0"].index
    assert hit(a, prompt) == 0 and len(index.orphans) == 2
    feed.send(stored(h[:1], None, prompt[:4]))
    assert hit(a, prompt) == 12 and not index.orphans and index.counters.orphans_adopted == 2
    feed.send(removed(h[2:]))
    assert hit(a, prompt) == 8


def test_removed_orphan_is_never_adopted():
    a = new_allocator()
    feed = Feed(a)
    prompt = list(range(9))
    h = chain(prompt)
    feed.send(stored(h[1:], h[0], prompt[4:8]))
    feed.send(removed(h[1:]))
    feed.send(stored(h[:1], None, prompt[:4]))
    assert hit(a, prompt) == 4


def test_tiers_are_answered_apart():
    a = new_allocator()
    feed = Feed(a)
    prompt = list(range(17))
    h = chain(prompt)
    feed.send(stored(h, None, prompt[:16], medium="GPU"), stored(h[:2], None, prompt[:8], medium="CPU"))
    feed.send(removed(h[1:2], medium="GPU"))
    result = a.lookup("", token_ids=prompt)
    (ext,) = result.hits
    assert ext.external and ext.num_cached_tokens == 4 and ext.tiers == {"GPU": 4, "CPU": 8, "STORAGE": 0}
    assert result.best_pool_id == "vllm-0"


def test_memory_bound_evicts_leaves_least_recently_stored_first():
    a = new_allocator(max_blocks=6)
    feed = Feed(a)
    shared = list(range(8))
    prompts = [shared + [50 + i] * 4 + [0] for i in range(4)]
    for p in prompts:
        h = chain(p)
        feed.send(stored(h, None, p[:12]))
    index = a.state.external.pools["vllm-0"].index
    assert len(index) == 6 and index.counters.evictions == 0
    # 2 shared blocks + 4 leaves = 6: a 5th leaf evicts the least recently stored one, never the shared ones
    p5 = shared + [99] * 4 + [0]
    feed.send(stored(chain(p5)[2:], chain(p5)[1], p5[8:12]))
    assert len(index) == 6 and index.counters.evictions == 1
    assert hit(a, prompts[0]) == 8 and [hit(a, p) for p in prompts[1:]] == [12, 12, 12] and hit(a, p5) == 12


def test_coarser_and_odd_engine_block_sizes():
    for size in (8, 6):  # a multiple of the allocator's hash block size 4, and not one
        a = new_allocator(block_size=size)
        feed = Feed(a)
        prompt = list(range(3 * size + 1))
        h = chain(prompt, size)
        feed.send(stored(h, None, prompt[:3 * size], block_size=size))
        assert hit(a, prompt) == 3 * size
        assert hit(a, prompt[:2 * size]) == size  # never the last token: the second block is recomputed
        by_hashes = a.lookup("", block_hashes=hash_prompt(prompt, 4), num_tokens=len(prompt)).tokens("vllm-0")
        assert by_hashes == (3 * size if size % 4 == 0 else 0)


def test_cache_salt_and_lora_are_part_of_the_key():
    a = new_allocator()
    feed = Feed(a)
    prompt = list(range(9))
    salted = chain(prompt, extra=[(("cache_salt", "s1"),), None])
    feed.send(stored(salted, None, prompt[:8], extra_keys=[["s1"], None]))
    feed.send(stored([b"lora-h0", b"lora-h1"], None, prompt[:8], lora_name="ad", extra_keys=[["ad"], ["ad"]]))
    assert hit(a, prompt) == 0
    assert hit(a, prompt, cache_salt="s1") == 8
    assert hit(a, prompt, cache_salt="s2") == 0
    assert hit(a, prompt, lora_name="ad") == 8


def test_multimodal_blocks_never_match_tokens():
    a = new_allocator()
    feed = Feed(a)
    prompt = list(range(9))
    feed.send(stored([b"mm-0", b"mm-1"], None, prompt[:8], extra_keys=[[["img-1", 0]], None]))
    assert hit(a, prompt) == 0


def test_spec_check_ok_mismatch_and_hint():
    rng = random.Random(3)
    a = new_allocator()
    feed = Feed(a)
    while a.state.external.pools["vllm-0"].check.checked < SPEC_CHECK_BLOCKS:
        p = [rng.randrange(1000) for _ in range(16)]
        feed.send(stored(chain(p), None, p))
    assert a.state.external.pools["vllm-0"].check.status.value == "ok"

    a2 = Allocator(hash_block_size=4)
    a2.apply(RegisterExternalPool("", ExternalSpec("vllm-0", "tcp://127.0.0.1:1", block_size=B)), 0.0)  # sha256
    feed = Feed(a2)
    p = list(range(8))
    feed.send(stored(chain(p), None, p))
    check = a2.state.external.pools["vllm-0"].check
    assert check.status.value == "mismatch" and "they match hash=sha256_cbor" in check.message
    assert hit(a2, p + [0]) == 8  # the index does not depend on the declared spec

    a3 = new_allocator(block_size=8)
    feed = Feed(a3)
    feed.send(stored(chain(p), None, p))  # 4-token blocks from an engine declared with 8
    check = a3.state.external.pools["vllm-0"].check
    assert check.status.value == "mismatch" and "block-size 8" in check.message
    assert hit(a3, p + [0]) == 8


def test_vllm_hash_vectors_are_what_vllm_computes():
    # sha256 of pickle / CBOR as vLLM 0.33 hashes (parent, tokens, extra); checked against vLLM itself in
    # tests/vllm/test_external_vllm.py. Here: the chain's shape and the seed rules.
    assert none_hash("xxhash") is None and none_hash("xxhash", "0") is not None
    assert none_hash("sha256") == none_hash("sha256", "vllm-none-hash")
    h0 = block_hash("sha256_cbor", none_hash("sha256_cbor"), [1, 2, 3, 4])
    assert len(h0) == 32 and h0 != block_hash("sha256", none_hash("sha256"), [1, 2, 3, 4])


def test_snapshot_round_trip_continues_identically():
    rng = random.Random(11)
    a = new_allocator(max_blocks=40)
    feed = Feed(a)
    prompts = []
    for _ in range(60):
        p = [rng.randrange(30) for _ in range(rng.choice([8, 12, 16]))] + [0]
        prompts.append(p)
        h = chain(p)
        k = rng.randrange(len(h))
        feed.send(stored(h[k:], h[k - 1] if k else None, p[k * B:len(h) * B]))
        if rng.random() < 0.3:
            feed.send(removed([rng.choice(h)]))
    b = Allocator(hash_block_size=4)
    load(dump(a), b, 0.0)
    assert state_digest(a) == state_digest(b)
    feed_b = Feed(b)
    feed_b.seq = feed.seq
    for _ in range(40):
        p = [rng.randrange(30) for _ in range(12)] + [0]
        h = chain(p)
        r = rng.random()
        second = removed([h[-1]]) if r < 0.5 else cleared() if r < 0.55 else stored(h[:1], None, p[:4])
        for f in (feed, feed_b):
            f.send(stored(h, None, p[:12]), second)
        assert state_digest(a) == state_digest(b)
    for p in prompts:
        assert hit(a, p) == hit(b, p)


def test_register_refusals():
    a = new_allocator()
    with pytest.raises(Exception, match="belongs to another tenant"):
        a.apply(RegisterExternalPool("t2", ExternalSpec("vllm-0", "tcp://127.0.0.1:2"), admin=False), 0.0)
    with pytest.raises(Exception, match="only an admin"):
        a.apply(RegisterExternalPool("t2", ExternalSpec("e2", "tcp://127.0.0.1:2", bind=True), admin=False), 0.0)
    assert a.lookup("t2", token_ids=[1, 2, 3], admin=False).hits == []  # another tenant sees none of it


def test_spec_check_follows_int_parents_across_events():
    # vLLM publishes the low 64 bits of each hash by default: a child names its parent by those bits only.
    a = new_allocator()
    feed = Feed(a)
    p = list(range(40, 57))
    full = chain(p)
    ints = [external_form(h, True) for h in full]
    feed.send(stored(ints[:2], None, p[:8]))
    feed.send(stored(ints[2:], ints[1], p[8:16]))
    check = a.state.external.pools["vllm-0"].check
    assert check.checked == 4 and check.status.value == "ok"  # a root block proves the spec; checking goes on
    feed.send(stored([ints[3] ^ 1], ints[2], p[12:16]))  # a block whose hash is not the declared spec's
    assert check.status.value == "mismatch"

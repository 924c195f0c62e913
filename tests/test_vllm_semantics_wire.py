"""Pools with vLLM 0.33.0's semantics over the wire (RegisterPool `vllm`): an AllocateOp is vLLM's
allocate_slots — output placeholders (async scheduling) with their hashes appended and cached later, the
full-sequence gate, the watermark, reserved blocks — and a refusal changes nothing. Scenarios with exact
block ids against a real server; random scheduler traces are test_vllm_semantics_traces.py's."""

import random

import pytest

from kvservice.commands import PoolSpec, VllmOptions
from kvservice.core import FullAttentionSpec, KVCacheConfig, Request
from kvservice.errors import InvalidArgument
from kvservice.hashing import HashSpec
from kvservice.ops import (
    AddRequestOp,
    AllocateBatchOp,
    AllocateOp,
    DecodeBatchOp,
    FreeOp,
    OpStatus,
    ResetPrefixCacheOp,
)
from kvservice.wire import decode, encode
from tests.service_helpers import SMALL_HASH_BLOCK

BS = SMALL_HASH_BLOCK  # the hash block size of the small_hash_server fixture (conftest.py)
SPEC = HashSpec("sha256", None, BS)


def hashes(tokens: list[int]) -> list[bytes]:
    return Request("h", tokens, BS, hash_spec=SPEC).block_hashes


@pytest.fixture
def client(small_hash_client):
    return small_hash_client


def register(client, pool_id: str, num_blocks: int, watermark: float = 0.0) -> None:
    client.register_pool(pool_id, KVCacheConfig(num_blocks, [FullAttentionSpec(BS)]), max_model_len=256,
                         hash_spec=SPEC, vllm=VllmOptions(watermark))


def admit(request_id: str, tokens: list[int], num_new: int, hit: int = 0, **kw) -> list:
    return [AddRequestOp(request_id, block_hashes=hashes(tokens), num_tokens=len(tokens)),
            AllocateOp(request_id, num_new_tokens=num_new, lookup=True, num_new_computed_tokens=hit, waiting=True,
                       **kw)]


def test_output_placeholders_then_their_hashes_cached(client, request):
    """Async scheduling: slots for tokens not sampled yet, their hashes appended (and blocks cached) later."""
    pid = request.node.name
    register(client, pid, 17)
    prompt = list(range(6))
    r = client.step(pid, admit("a", prompt, 6))
    assert r[1].status == OpStatus.OK and r[1].new_block_ids == ([1, 2],)
    # Step 2 runs before step 1's token is sampled: one placeholder; without it the op is refused.
    r = client.step(pid, [AllocateOp("a", num_computed_tokens=6, num_new_tokens=1)])
    assert r[0].status == OpStatus.FAILED_PRECONDITION and "output placeholders" in r[0].message
    r = client.step(pid, [AllocateOp("a", num_computed_tokens=6, num_new_tokens=1, num_output_placeholders=1,
                                     num_in_flight_tokens=6)])
    assert r[0].status == OpStatus.OK and r[0].new_block_ids == ()  # one group, no new block: none on the wire
    # Step 1's token (6) arrives; step 3 schedules position 7 with step 2's token still a placeholder.
    r = client.step(pid, [AllocateOp("a", num_computed_tokens=7, num_new_tokens=1, num_output_placeholders=1,
                                     num_in_flight_tokens=1, append_block_hashes=[], num_append_tokens=1)])
    assert r[0].status == OpStatus.OK and r[0].num_tokens == 7
    # Step 2's token (7) fills block 1: its hash comes with it, and caching it is vLLM's cache_blocks.
    full = prompt + [6, 7]
    r = client.step(pid, [AllocateOp("a", num_computed_tokens=8, append_block_hashes=hashes(full)[1:2],
                                     num_append_tokens=1, num_in_flight_tokens=1, cache_tokens=7)])
    assert r[0].status == OpStatus.OK and r[0].num_tokens == 8
    assert client.get_stats().pools[pid].num_cached_blocks == 1  # cache_tokens 7: block 1 not yet
    r = client.step(pid, [AllocateOp("a", num_computed_tokens=8, num_in_flight_tokens=0, cache_tokens=8),
                          AllocateOp("a", num_computed_tokens=8, num_new_tokens=1, num_output_placeholders=1)])
    assert [x.status for x in r.results] == [OpStatus.OK, OpStatus.OK] and r[1].new_block_ids == ([3],)
    assert client.get_stats().pools[pid].num_cached_blocks == 2
    # A new request sharing those 8 tokens hits both blocks.
    r = client.step(pid, admit("b", full + [50], 1, hit=8))
    assert r[1].status == OpStatus.OK and r[1].new_block_ids == ([1, 2, 4],) and r[1].num_computed_tokens == 8


def test_the_full_sequence_gate_watermark_and_reserved_blocks(client, request):
    pid = request.node.name
    register(client, pid, 17, watermark=0.25)  # int(0.25 * 17) = 4 blocks kept free for admissions
    r = client.step(pid, admit("running", list(range(100, 140)), 40))  # 10 of 16 blocks
    assert r[1].status == OpStatus.OK and len(r[1].new_block_ids[0]) == 10
    before = client.get_stats(check_invariants=True).pools[pid]
    big = list(range(200, 240))  # 10 blocks: the whole prompt does not fit in the 6 free ones
    r = client.step(pid, admit("big", big, 8, full_sequence_must_fit=True))
    assert r[1].status == OpStatus.NO_SPACE
    r = client.step(pid, [AllocateOp("big", num_new_tokens=8, lookup=True, waiting=True)])  # its first chunk fits
    assert r[0].status == OpStatus.OK and r[0].new_block_ids == ([11, 12],)
    client.free(pid, "big")
    # The watermark: 3 blocks + 4 kept free > 6 while another request is scheduled; fits when none is.
    r = client.step(pid, admit("w", list(range(300, 312)), 12, has_scheduled_reqs=True))
    assert r[1].status == OpStatus.NO_SPACE
    r = client.step(pid, [AllocateOp("w", num_new_tokens=12, lookup=True, waiting=True, has_scheduled_reqs=True,
                                     reserved_blocks=4)])
    assert r[0].status == OpStatus.NO_SPACE  # reserved blocks too: 3 > 6 - 4 (watermark 4 on top)
    after = client.get_stats(check_invariants=True).pools[pid]
    assert after.num_free_blocks == before.num_free_blocks == 6 and after.invariant_violation == ""
    r = client.step(pid, [AllocateOp("w", num_new_tokens=12, lookup=True, waiting=True)])
    assert r[0].status == OpStatus.OK and len(r[0].new_block_ids[0]) == 3
    # A running request's allocation ignores the watermark (vLLM applies it to waiting requests only).
    r = client.step(pid, [AllocateOp("running", num_computed_tokens=40, num_new_tokens=4, append_block_hashes=[],
                                     num_append_tokens=0, has_scheduled_reqs=True, num_output_placeholders=4)])
    assert r[0].status == OpStatus.OK and len(r[0].new_block_ids[0]) == 1


def test_a_stale_hit_and_refused_fields_change_nothing(client, request):
    pid = request.node.name
    register(client, pid, 17)
    prompt = list(range(10))
    client.step(pid, admit("a", prompt, 10))
    before = client.get_stats(check_invariants=True).pools[pid]
    r = client.step(pid, admit("b", prompt + [1], 11, hit=4))  # 8 tokens are cached, not 4
    assert r[1].status == OpStatus.FAILED_PRECONDITION and "has 8 of its tokens cached" in r[1].message
    assert client.get_stats().pools[pid].num_free_blocks == before.num_free_blocks
    with pytest.raises(InvalidArgument) as err:
        client.step(pid, [DecodeBatchOp(["a"], [10], None)])
    assert err.value.field == "ops[0].decode"
    client.register_pool(pid + "-kv", KVCacheConfig(9, [FullAttentionSpec(BS)]), max_model_len=64)
    with pytest.raises(InvalidArgument) as err:
        client.step(pid + "-kv", [AddRequestOp("x", token_ids=[1, 2]),
                                  AllocateOp("x", num_new_tokens=2, lookup=True)])
    assert err.value.field == "ops[1].allocate.lookup"
    # vLLM's reset_prefix_cache: refused while a block is in use, done once none is.
    assert client.step(pid, [ResetPrefixCacheOp()])[0].status == OpStatus.FAILED_PRECONDITION
    r = client.step(pid, [FreeOp("a"), FreeOp("b"), ResetPrefixCacheOp()])
    assert r[2].status == OpStatus.OK and client.get_stats().pools[pid].num_cached_blocks == 0


def test_allocate_batch_rows_are_their_allocate_ops_over_the_wire():
    """Every AllocateOp field a row carries survives packing and the wire (random values, every flag)."""
    rng = random.Random(5)
    ops = []
    for i in range(40):
        hashes_ = [bytes([i, j]) * 16 for j in range(rng.randrange(3))]
        ops.append(AllocateOp(f"r{i}", rng.randrange(200), rng.randrange(200), None, hashes_ if hashes_ else None,
                              rng.randrange(1, 9) if hashes_ else 0, rng.randrange(3), rng.random() < 0.5, False,
                              None, rng.randrange(3), rng.randrange(5), rng.random() < 0.5, False, 0,
                              rng.random() < 0.5, rng.randrange(4), rng.random() < 0.5, rng.randrange(200)))
    batch = AllocateBatchOp.of(ops)
    assert batch.ops() == ops
    spec = PoolSpec("p", KVCacheConfig(64, [FullAttentionSpec(BS)]), 256, hash_spec=SPEC, vllm=VllmOptions(0.0))
    [decoded] = decode.decode_ops(encode.step_request("p", [batch]).ops, spec, BS)
    assert decoded.ops() == ops
    with pytest.raises(ValueError, match="lookup"):
        AllocateBatchOp.of([AllocateOp("a", num_new_tokens=1, lookup=True)])


def test_a_bad_allocate_batch_is_refused_naming_the_row_and_changes_nothing(client, request):
    pid = request.node.name
    register(client, pid, 17)
    client.step(pid, admit("a", list(range(10)), 10))
    before = client.get_stats(check_invariants=True).pools[pid]
    good = AllocateOp("a", num_computed_tokens=10, num_new_tokens=1, num_output_placeholders=1)

    def refused(batch: AllocateBatchOp, pool_id: str = pid) -> InvalidArgument:
        with pytest.raises(InvalidArgument) as err:
            client.step(pool_id, [AllocateBatchOp.of([good]), batch])  # the good row is not applied either
        return err.value

    too_long = AllocateBatchOp.of([good, AllocateOp("a", num_computed_tokens=11, num_new_tokens=300)])
    err = refused(too_long)
    assert err.field == "ops[1].allocate_batch.rows[1].num_new_tokens"
    assert "300: exceeds max_model_len 256" in str(err)
    flags = AllocateBatchOp.of([good])
    flags.rows[-1] = 16
    assert refused(flags).field == "ops[1].allocate_batch.rows[0].flags"
    short = AllocateBatchOp.of([good])
    del short.rows[-1]
    assert refused(short).field == "ops[1].allocate_batch.rows"
    unmatched = AllocateBatchOp.of([good])
    unmatched.append_block_hashes = [bytes(32)]
    assert refused(unmatched).field == "ops[1].allocate_batch.append_block_hashes"
    hashes_only = AllocateBatchOp.of([AllocateOp("a", append_block_hashes=[bytes(32)], num_append_tokens=4)])
    hashes_only.rows[3] = 0  # the row's num_append_tokens
    assert refused(hashes_only).field == "ops[1].allocate_batch.rows[0].num_append_tokens"
    assert refused(AllocateBatchOp([], AllocateBatchOp.of([]).rows)).field == "ops[1].allocate_batch.request_ids"
    client.register_pool(pid + "-kv", KVCacheConfig(9, [FullAttentionSpec(BS)]), max_model_len=64)
    with pytest.raises(InvalidArgument, match="does not follow vLLM's semantics") as err:
        client.step(pid + "-kv", [AllocateBatchOp.of([good])])
    assert err.value.field == "ops[0].allocate_batch"
    after = client.get_stats(check_invariants=True).pools[pid]
    assert (after.num_free_blocks, after.num_cached_blocks) == (before.num_free_blocks, before.num_cached_blocks)
    r = client.step(pid, [AllocateBatchOp.of([good, AllocateOp("zz", num_new_tokens=1)])])[0]
    assert [r.batch.status(0), r.batch.status(1)] == [OpStatus.OK, OpStatus.NOT_FOUND]
    assert r.batch.failures[0].request_id == "zz"


def test_a_cache_op_with_an_allocation_is_the_two_ops(client, request):
    """What RemoteKVCacheManager folds: cache_tokens with num_new_tokens is cache_blocks, then allocate_slots —
    the same blocks, cached blocks and free count as the two ops; a NO_SPACE refuses only the allocation."""
    for crowded in (False, True):
        outcomes = []
        for folded in (False, True):
            pid = f"{request.node.name}-{crowded}-{folded}"
            register(client, pid, 6)  # 5 usable blocks of 4 tokens
            prompt = list(range(7))
            client.step(pid, admit("a", prompt, 7))  # 2 blocks
            if crowded:  # the other 3 blocks taken: a's next block does not fit
                client.step(pid, admit("b", list(range(100, 112)), 12))
            full = prompt + [7]  # step 1's token fills a's block 1
            cache = AllocateOp("a", num_computed_tokens=8, append_block_hashes=hashes(full)[1:2], num_append_tokens=1,
                               cache_tokens=8)
            alloc = AllocateOp("a", num_computed_tokens=8, num_new_tokens=1, num_output_placeholders=1)
            if folded:
                ops = [AllocateOp(**{**vars_of(alloc), "cache_tokens": 8,
                                     "append_block_hashes": cache.append_block_hashes, "num_append_tokens": 1})]
            else:
                ops = [cache, alloc]
            last = client.step(pid, ops).results[-1]
            stats = client.get_stats().pools[pid]
            outcomes.append((last.status, last.new_block_ids, stats.num_cached_blocks, stats.num_free_blocks))
        assert outcomes[0] == outcomes[1]
        assert outcomes[0][0] == (OpStatus.NO_SPACE if crowded else OpStatus.OK)
        assert outcomes[0][2] == (5 if crowded else 2)  # a's 2 blocks cached either way (b's 3 too, crowded)
    with pytest.raises(InvalidArgument, match="cache_tokens"):  # not on an admission
        client.step(f"{request.node.name}-True-True", [AllocateOp("z", num_new_tokens=1, lookup=True, cache_tokens=1)])


def vars_of(op: AllocateOp) -> dict:
    return {f: getattr(op, f) for f in AllocateOp.__dataclass_fields__}

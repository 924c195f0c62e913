"""Blocks a vLLM scheduler holds outside its requests, over the wire (vLLM 0.33's copy retentions): a partial
prefix hit's copy-on-write copies, taken when vLLM's scheduler takes them (TakeBlockCopiesOp), both ends held
until it returns them through the block pool (FreeHeldBlocksOp); blocks taken straight from the block pool
(GetNewBlocksOp) or pinned through it by a KV connector (TouchBlocksOp). Block ids and free blocks are checked
against kvservice's core called as vLLM's scheduler calls its KVCacheManager; refusals change nothing; held
blocks and pending copies survive a restart.
"""

import time

import pytest

from kvservice.commands import VllmOptions
from kvservice.core import FullAttentionSpec, KVCacheConfig, MambaSpec
from kvservice.errors import InvalidArgument
from kvservice.ops import (
    FreeHeldBlocksOp,
    FreeOp,
    GetNewBlocksOp,
    NewStepOp,
    OpStatus,
    TakeBlockCopiesOp,
    TouchBlocksOp,
)
from tests.test_persistence import _stop_started_servers, allocator, kill  # noqa: F401 (an autouse fixture)
from tests.test_vllm_mamba_wire import BS, MAX_LEN, SPEC, Pair

# Groups of two hash blocks: a hit may end inside a block (vLLM's sub-block hits, hash_block_size < block size).
SUB_BLOCK = KVCacheConfig(40, [FullAttentionSpec(2 * BS), MambaSpec(2 * BS)])


@pytest.fixture
def client(small_hash_client):
    return small_hash_client


def partial_hit(p: Pair) -> list[tuple[int, int]]:
    """`a` prefilled a step at a time (its states at each hash boundary cached), then `b` admitted on the first
    12 tokens of it — a hit ending inside a block: the shared tail blocks are redirected to private copies. The
    pool's ops go step by step beside the core's calls; returns the copies the core made."""
    prompt = list(range(100, 114))
    steps = [lambda: [p.add("a", prompt), p.admit("a", 2 * BS)], lambda: [p.run("a", BS)], lambda: [p.run("a", 2)],
             lambda: [p.add("b", prompt[:12] + [1, 2, 3, 4, 5]), p.admit("b")]]
    for ops in steps:
        p.core.new_step_starts()
        p.step([NewStepOp(), *ops()])
        p.check(*p.requests)
    assert p.client.get_request(p.pool_id, "b").num_computed_tokens == 12  # the hit, inside a block
    copies = p.core.take_held_block_copies()
    assert copies, "the hit ending inside a block made no copy: nothing is tested"
    return copies


def flat(copies) -> list[int]:
    return [b for pair in copies for b in pair]


def test_a_partial_hits_copies_are_held_until_the_scheduler_returns_them(client, request):
    p = Pair(client, request.node.name, SUB_BLOCK)
    copies = partial_hit(p)
    retained = flat(copies)
    free_before = p.core.block_pool.get_num_free_blocks()
    p.step([TakeBlockCopiesOp(retained)])
    p.check("a", "b")  # both ends still referenced: nothing went back to the free queue
    # vLLM's scheduler frees the retentions once the copy's step is processed; `a` finished before.
    p.core.free(p.requests.pop("a"))
    p.core.held.free(retained)
    p.step([FreeOp("a"), FreeHeldBlocksOp(retained)])
    p.check("b")
    assert p.core.block_pool.get_num_free_blocks() > free_before
    # Returned once, they are held no more: a second return is refused and changes nothing.
    (r,) = client.step(p.pool_id, [FreeHeldBlocksOp(retained[:1])])
    assert r.status == OpStatus.FAILED_PRECONDITION and "held 0 times" in r.message, r
    p.check("b")


def test_copies_the_scheduler_did_not_take_and_blocks_nobody_holds_are_refused_unchanged(client, request):
    p = Pair(client, request.node.name, SUB_BLOCK)
    copies = partial_hit(p)
    free = client.get_stats(pool_ids=[p.pool_id]).pools[p.pool_id].num_free_blocks
    # A take that leaves out a copy the pool made: the pool would hold less than the scheduler thinks.
    (r,) = client.step(p.pool_id, [TakeBlockCopiesOp(flat(copies[1:]))])
    assert r.status == OpStatus.FAILED_PRECONDITION and "did not take" in r.message, r
    # A copy of blocks the pool neither copied nor holds.
    (r,) = client.step(p.pool_id, [TakeBlockCopiesOp(flat(copies) + [7, 9])])
    assert r.status == OpStatus.FAILED_PRECONDITION and "neither copied nor holds" in r.message, r
    # Returning blocks a request holds (not a held reference).
    b_block = p.core.get_block_ids("b")[0][0]
    (r,) = client.step(p.pool_id, [FreeHeldBlocksOp([b_block])])
    assert r.status == OpStatus.FAILED_PRECONDITION, r
    # More blocks than are free: NO_SPACE, nothing taken.
    (r,) = client.step(p.pool_id, [GetNewBlocksOp(free + 1)])
    assert r.status == OpStatus.NO_SPACE, r
    assert client.get_stats(pool_ids=[p.pool_id]).pools[p.pool_id].num_free_blocks == free
    p.check("a", "b")
    # The pending copies are still there, exactly: the scheduler's take goes through.
    p.step([TakeBlockCopiesOp(flat(copies))])
    p.check("a", "b")


def test_blocks_taken_from_the_block_pool_are_held_and_may_stand_for_a_copy(client, request):
    """As vLLM's own test of deferred copy retentions does: blocks taken straight from the block pool, a copy
    between them that the scheduler takes, and the two returned."""
    p = Pair(client, request.node.name, SUB_BLOCK)
    ids = p.core.held.get_new_blocks(3)
    (r,) = client.step(p.pool_id, [GetNewBlocksOp(3)])
    assert r.status == OpStatus.OK and list(r.new_block_ids[0]) == ids, (r, ids)
    p.check()
    pair = [ids[0], ids[1]]
    p.core.take_held_block_copies([tuple(pair)])  # made by nobody: the held blocks stand for it
    p.step([TakeBlockCopiesOp(pair)])
    p.core.held.free(pair)
    p.step([FreeHeldBlocksOp(pair)])
    p.check()
    assert p.core.held.pairs() == [(ids[2], 1)]
    p.core.held.free([ids[2]])
    p.step([FreeHeldBlocksOp([ids[2]])])
    p.check()
    assert client.get_stats(pool_ids=[p.pool_id]).pools[p.pool_id].num_free_blocks == SUB_BLOCK.num_blocks - 1


def test_blocks_a_connector_touches_are_held_out_of_the_free_queue_and_still_hit(client, request):
    """A KV connector offloading cached blocks pins them with the block pool's touch (vLLM's simple CPU offload
    and Mooncake store connectors do): held, out of the free queue, still a prefix hit, and freed to the tail."""
    p = Pair(client, request.node.name, SUB_BLOCK)
    prompt = list(range(200, 216))
    p.core.new_step_starts()
    p.step([NewStepOp(), p.add("a", prompt), p.admit("a")])
    table = p.core.get_block_ids("a")[0]
    p.core.free(p.requests.pop("a"))
    p.step([FreeOp("a")])
    free = p.core.block_pool.get_num_free_blocks()
    p.core.held.touch(table)
    p.step([TouchBlocksOp(table)])
    p.check()
    assert p.core.block_pool.get_num_free_blocks() == free - len(table)
    p.core.new_step_starts()
    p.step([NewStepOp(), p.add("b", prompt + [9]), p.admit("b")])
    assert p.core.get_block_ids("b")[0][:1] == table[:1]  # the touched block is still a hit
    p.check("b")
    p.core.held.free(table)
    p.step([FreeHeldBlocksOp(table)])
    p.check("b")
    assert not p.core.held.counts


def test_a_block_is_held_at_most_max_held_per_block_times(client, request):
    """A client touching one block over and over cannot overflow its reference count or the snapshots: past
    MAX_HELD_PER_BLOCK references the touch is refused, nothing touched."""
    from kvservice.core.held_blocks import MAX_HELD_PER_BLOCK

    pool_id = request.node.name
    client.register_pool(pool_id, KVCacheConfig(MAX_HELD_PER_BLOCK, [FullAttentionSpec(BS)]), max_model_len=MAX_LEN,
                         hash_spec=SPEC, vllm=VllmOptions())
    (r,) = client.step(pool_id, [TouchBlocksOp([5] * (MAX_HELD_PER_BLOCK + 1))])
    assert r.status == OpStatus.FAILED_PRECONDITION and "over the limit" in r.message, r
    assert client.get_stats(pool_ids=[pool_id]).pools[pool_id].num_free_blocks == MAX_HELD_PER_BLOCK - 1
    (r1, r2) = client.step(pool_id, [TouchBlocksOp([5] * MAX_HELD_PER_BLOCK), TouchBlocksOp([5, 6])])
    assert r1.status == OpStatus.OK and r2.status == OpStatus.FAILED_PRECONDITION, (r1, r2)
    (r,) = client.step(pool_id, [FreeHeldBlocksOp([5] * MAX_HELD_PER_BLOCK)])
    stats = client.get_stats(check_invariants=True, pool_ids=[pool_id]).pools[pool_id]
    assert r.status == OpStatus.OK and stats.num_free_blocks == MAX_HELD_PER_BLOCK - 1, (r, stats)
    assert not stats.invariant_violation


@pytest.mark.parametrize("op, field, why", [
    (TakeBlockCopiesOp([1, 2, 3]), "ops[0].take_block_copies.block_ids", "pairs"),
    (FreeHeldBlocksOp([0]), "ops[0].free_held_blocks.block_ids", "null block"),
    (FreeHeldBlocksOp([40]), "ops[0].free_held_blocks.block_ids", "[1, 39]"),
    (TouchBlocksOp([0]), "ops[0].touch_blocks.block_ids", "null block"),
    (GetNewBlocksOp(41), "ops[0].get_new_blocks.num_blocks", ""),
])
def test_bad_held_block_ops_are_refused_naming_the_field(client, request, op, field, why):
    p = Pair(client, request.node.name, SUB_BLOCK)
    with pytest.raises(InvalidArgument) as info:
        client.step(p.pool_id, [op])
    assert info.value.field == field and why in str(info.value), info.value
    p.check()


def test_only_a_vllm_pool_takes_held_block_ops(client, request):
    pool_id = request.node.name
    client.register_pool(pool_id, KVCacheConfig(16, [FullAttentionSpec(BS)]), max_model_len=MAX_LEN, hash_spec=SPEC)
    with pytest.raises(InvalidArgument, match="only a pool registered with vllm options"):
        client.step(pool_id, [GetNewBlocksOp(1)])


@pytest.mark.parametrize("snapshot", [True, False], ids=["snapshot", "wal"])
def test_held_blocks_and_pending_copies_survive_a_restart(redis_server, tmp_path, snapshot):
    """Killed with a copy pending (made, not yet taken) and blocks held: restarted from a snapshot or by
    replaying the WAL, the scheduler's take and its returns go through exactly as before."""
    ns = f"held-{snapshot}"
    args = ("--hash-block-size", str(BS)) + (("--snapshot-every", "1") if snapshot else ())
    proc = allocator(redis_server, ns, tmp_path, *args)
    p = Pair(proc.client(hash_block_size=BS), "h", SUB_BLOCK)
    copies = partial_hit(p)
    held = p.core.held.get_new_blocks(2)
    p.step([GetNewBlocksOp(2)])
    if snapshot:
        redis = redis_server.client()
        last = redis.xrevrange(f"{ns}:wal", count=1)[0][0]
        deadline = time.monotonic() + 20
        while redis.get(f"{ns}:snapshot:wal_id") != last and time.monotonic() < deadline:
            time.sleep(0.1)
        assert redis.get(f"{ns}:snapshot:wal_id") == last
    kill(proc)
    proc = allocator(redis_server, ns, tmp_path, "--hash-block-size", str(BS))
    p.client = proc.client(hash_block_size=BS)
    p.check("a", "b")
    p.step([TakeBlockCopiesOp(flat(copies))])
    p.core.held.free(flat(copies) + held)
    p.step([FreeHeldBlocksOp(flat(copies) + held)])
    p.check("a", "b")
    stats = p.client.get_stats(check_invariants=True, pool_ids=["h"]).pools["h"]
    assert not stats.invariant_violation
    proc.stop()

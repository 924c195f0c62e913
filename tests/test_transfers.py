"""Cross-pool prefix transfers: orders, pins, commit/abort, lease lapse, epoch change, persistence."""

import time

import pytest

from kvservice.allocator import Allocator
from kvservice.commands import PoolSpec
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp, OpStatus
from kvservice.store.snapshot import dump, load, state_digest
from tests.allocator_helpers import InProcess
from tests.service_helpers import start_server

CFG = KVCacheConfig(33, [FullAttentionSpec(4)])
LAYOUT = "block=4;dcp=1"


def allocator_with_pools(min_tokens=8):
    a = Allocator(hash_block_size=4, min_transfer_tokens=min_tokens)
    s = InProcess(a)
    for pid in ["A", "B", "C"]:
        layout = LAYOUT if pid != "C" else "other-layout"
        s.register(PoolSpec(pid, CFG, 256, kv_layout=layout))
    return a, s


def step(a, s, pool_id, ops):
    return s.step(pool_id, ops)


def test_transfer_order_pins_source_and_commit_caches_destination():
    a, s = allocator_with_pools()
    prompt = list(range(30))
    step(a, s, "A", [AddRequestOp("r", token_ids=prompt), AllocateOp("r", num_new_tokens=30)])  # A: blocks 1..8
    step(a, s, "A", [FreeOp("r")])  # 7 full blocks cached (28 tokens), free
    r = step(a, s, "B", [AddRequestOp("r", token_ids=prompt + [7]),
                         AllocateOp("r", num_new_tokens=64, allow_transfer=True)])
    t = r[1].transfer
    assert t is not None and t.src_pool_id == "A" and t.num_tokens == 28
    assert t.src_block_ids == [1, 2, 3, 4, 5, 6, 7] and len(t.dst_block_ids) == 7
    assert r[1].num_computed_tokens == 28 and r[1].num_scheduled_tokens == 3  # only the suffix is computed
    assert r[1].new_block_ids[0][:7] == t.dst_block_ids
    # The source blocks are pinned: a burst on A cannot evict them.
    pinned = {b.block_id: b.ref_cnt for b in a.pool("A").manager.block_pool.blocks if b.ref_cnt}
    assert pinned == {i: 1 for i in range(1, 8)}
    assert a.invariant_violation(a.pool("A")) == "" and a.invariant_violation(a.pool("B")) == ""
    # Before the commit the request cannot allocate again, nor fork.
    again = step(a, s, "B", [AllocateOp("r", num_computed_tokens=31, num_new_tokens=1, append_token_ids=[1])])
    assert again[0].status == OpStatus.FAILED_PRECONDITION and t.transfer_id in again[0].message
    done = s.commit_transfer("B", t.transfer_id, abort=False)
    assert done[0].status == OpStatus.OK
    assert a.pool("A").manager.block_pool.get_num_free_blocks() == 32  # pins dropped
    assert a.lookup("", token_ids=prompt + [1], pool_ids=["B"]).tokens("B") == 28  # now cached on B
    assert a.invariant_violation(a.pool("B")) == ""


def test_no_transfer_when_it_saves_too_little_or_layouts_differ():
    a, s = allocator_with_pools(min_tokens=32)
    prompt = list(range(30))
    step(a, s, "A", [AddRequestOp("r", token_ids=prompt), AllocateOp("r", num_new_tokens=30)])
    r = step(a, s, "B", [AddRequestOp("r", token_ids=prompt + [7]),
                         AllocateOp("r", num_new_tokens=64, allow_transfer=True)])
    assert r[1].transfer is None and r[1].num_computed_tokens == 0  # 28 tokens < the 32-token minimum
    a2, s2 = allocator_with_pools()
    step(a2, s2, "A", [AddRequestOp("r", token_ids=prompt), AllocateOp("r", num_new_tokens=30)])
    r = step(a2, s2, "C", [AddRequestOp("r", token_ids=prompt + [7]),
                           AllocateOp("r", num_new_tokens=64, allow_transfer=True)])
    assert r[1].transfer is None  # C's KV layout differs: it recomputes


def test_abort_frees_the_destination_and_unpins_the_source():
    a, s = allocator_with_pools()
    prompt = list(range(30))
    step(a, s, "A", [AddRequestOp("r", token_ids=prompt), AllocateOp("r", num_new_tokens=30), FreeOp("r")])
    r = step(a, s, "B", [AddRequestOp("x", token_ids=prompt + [7]),
                         AllocateOp("x", num_new_tokens=64, allow_transfer=True)])
    t = r[1].transfer
    done = s.commit_transfer("B", t.transfer_id, abort=True)
    assert done[0].status == OpStatus.OK and "aborted" in done[0].message
    assert a.pool("B").requests == {} and a.pool("B").manager.block_pool.get_num_free_blocks() == 32
    assert a.pool("A").manager.block_pool.get_num_free_blocks() == 32
    assert s.commit_transfer("B", t.transfer_id, abort=False)[0].status == \
        OpStatus.NOT_FOUND


def test_epoch_change_of_the_source_aborts():
    a, s = allocator_with_pools()
    prompt = list(range(30))
    step(a, s, "A", [AddRequestOp("r", token_ids=prompt), AllocateOp("r", num_new_tokens=30), FreeOp("r")])
    step(a, s, "B", [AddRequestOp("x", token_ids=prompt + [7]), AllocateOp("x", num_new_tokens=64,
                                                                          allow_transfer=True)])
    a.registry.bump_epoch("A")
    r = step(a, s, "B", [AllocateOp("x", num_computed_tokens=28, num_new_tokens=1)])
    assert r[0].status == OpStatus.EPOCH_CHANGED and "transfer" in r[0].message
    assert not a.state.transfers.transfers and a.pool("B").manager.block_pool.get_num_free_blocks() == 32


def test_pending_transfer_survives_a_snapshot():
    a, s = allocator_with_pools()
    prompt = list(range(30))
    step(a, s, "A", [AddRequestOp("r", token_ids=prompt), AllocateOp("r", num_new_tokens=30), FreeOp("r")])
    r = step(a, s, "B", [AddRequestOp("x", token_ids=prompt + [7]), AllocateOp("x", num_new_tokens=64,
                                                                          allow_transfer=True)])
    before = state_digest(a)
    b = Allocator(hash_block_size=4)
    load(dump(a), b, 0.0)
    assert state_digest(b) == before
    assert b.invariant_violation(b.pool("A")) == ""
    assert InProcess.resume(b, "s").commit_transfer("B", r[1].transfer.transfer_id)[0].status == OpStatus.OK
    assert b.pool("A").manager.block_pool.get_num_free_blocks() == 32


def test_lease_lapse_aborts_transfers_over_rpc(tmp_path):
    proc = start_server("--session-ttl", "1", "--hash-block-size", "4", "--min-transfer-tokens", "8",
                        log_dir=tmp_path)
    try:
        owner = proc.client(hash_block_size=4, heartbeat=False)  # its lease must lapse
        watcher = proc.client(hash_block_size=4)
        for pid in ("A", "B"):
            owner.register_pool(pid, CFG, max_model_len=256, kv_layout=LAYOUT)
        prompt = list(range(30))
        owner.step("A", [AddRequestOp("r", token_ids=prompt), AllocateOp("r", num_new_tokens=30), FreeOp("r")])
        r = owner.step("B", [AddRequestOp("x", token_ids=prompt + [1]),
                             AllocateOp("x", num_new_tokens=64, allow_transfer=True)])
        assert r[1].transfer is not None and r[1].transfer.num_tokens == 28
        assert watcher.get_stats().pools["A"].num_pending_transfers == 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and watcher.get_stats().pools["A"].num_pending_transfers:
            watcher.heartbeat() if watcher.session_id else watcher.open_session()
            time.sleep(0.2)
        stats = watcher.get_stats(check_invariants=True)
        for pid in ("A", "B"):
            assert stats.pools[pid].num_pending_transfers == 0 and stats.pools[pid].invariant_violation == ""
            assert stats.pools[pid].num_free_blocks == 32  # everything freed: pins and the destination
    finally:
        proc.stop()


@pytest.mark.parametrize("abort", [False, True])
def test_commit_transfer_rpc(server, abort):
    c = server.client()
    cfg = KVCacheConfig(33, [FullAttentionSpec(16)])
    for pid in ("rpc-A", "rpc-B"):
        c.register_pool(f"{pid}-{abort}", cfg, max_model_len=512, kv_layout=LAYOUT)
    a, b = f"rpc-A-{abort}", f"rpc-B-{abort}"
    prompt = list(range(100))
    c.step(a, [AddRequestOp("r", token_ids=prompt), AllocateOp("r", num_new_tokens=100), FreeOp("r")])
    r = c.step(b, [AddRequestOp("r", token_ids=prompt + [5]), AllocateOp("r", num_new_tokens=512,
                                                                        allow_transfer=True)])
    t = r[1].transfer
    assert t.num_tokens == 96 and len(t.src_block_ids) == 6
    done = c.commit_transfer(b, t.transfer_id, abort=abort)
    assert done[0].status == OpStatus.OK
    stats = c.get_stats(check_invariants=True)
    assert stats.pools[a].num_pending_transfers == 0 and stats.pools[a].num_free_blocks == 32
    if abort:
        assert stats.pools[b].num_requests == 0
    else:
        assert c.lookup(prompt + [1], pool_ids=[b]).tokens(b) == 96
        c.free(b, "r")
    c.close()


def test_kv_aware_placement():
    a, s = allocator_with_pools()
    prompt = list(range(30))
    step(a, s, "B", [AddRequestOp("r", token_ids=prompt), AllocateOp("r", num_new_tokens=30), FreeOp("r")])
    found = a.lookup("", token_ids=prompt + [1])
    assert found.best_pool_id == "B"
    assert {h.pool_id: h.num_cached_tokens for h in found.hits} == {"A": 0, "B": 28, "C": 0}
    # Cold prompts: the same prompt always lands on the same pool, different ones spread out (and never on
    # B, whose free blocks hold someone's cached prefix).
    picks = [a.lookup("", token_ids=[1000 + i] * 9).best_pool_id for i in range(32)]
    assert picks == [a.lookup("", token_ids=[1000 + i] * 9).best_pool_id for i in range(32)]
    assert set(picks) == {"A", "C"}

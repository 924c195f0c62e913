"""End-to-end RPC scenarios against a real server process, mirroring the core scenarios."""

import grpc
import pytest

from kvservice.core import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from kvservice.errors import FailedPrecondition, InvalidArgument, NotFound, SequenceOutOfOrder
from kvservice.hashing import hash_prompt
from kvservice.ops import AddRequestOp, AllocateOp, ForkOp, FreeOp, OpStatus
from kvservice.wire import encode
from kvservice.wire.status import from_rpc_error
from tests.service_helpers import small_config, start_server

HBS = 4  # small blocks keep exact-id scenarios readable


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server("--hash-block-size", str(HBS), log_dir=tmp_path_factory.mktemp("server"))
    yield proc
    proc.stop()


@pytest.fixture
def client(server, request):
    c = server.client(client_name=request.node.name, hash_block_size=HBS)
    yield c
    c.close()


def pool_id(request) -> str:
    return request.node.name[:60]


def test_prefix_sharing_exact_ids_and_drain(client, request):
    pid = pool_id(request)
    client.register_pool(pid, small_config(64, 4), max_model_len=256)
    r = client.step(pid, [AddRequestOp("a", token_ids=list(range(10))), AllocateOp("a", num_new_tokens=10)])
    assert [x.status for x in r.results] == [OpStatus.OK, OpStatus.OK]
    assert r[1].new_block_ids == ([1, 2, 3],) and r[1].num_computed_tokens == 0 and r[1].num_scheduled_tokens == 10
    r = client.step(pid, [AddRequestOp("b", token_ids=list(range(10))), AllocateOp("b", num_new_tokens=10)])
    # Admission returns the whole table: the two hit blocks and the new one.
    assert r[1].new_block_ids == ([1, 2, 4],) and r[1].num_computed_tokens == 8 and r[1].num_scheduled_tokens == 2
    assert client.get_request(pid, "b").block_ids == ([1, 2, 4],)
    stats = client.get_stats(check_invariants=True).pools[pid]
    assert stats.invariant_violation == "" and stats.num_free_blocks == 63 - 4
    client.free(pid, "a", "b")
    stats = client.get_stats(check_invariants=True).pools[pid]
    assert stats.num_free_blocks == 63 and stats.num_requests == 0 and stats.num_cached_blocks == 2


def test_decode_chunked_prefill_and_lookahead(client, request):
    pid = pool_id(request)
    client.register_pool(pid, small_config(64, 4), max_model_len=256)
    r = client.step(pid, [AddRequestOp("r", token_ids=list(range(10))), AllocateOp("r", num_new_tokens=6)])
    assert r[1].new_block_ids == ([1, 2],) and r[1].num_scheduled_tokens == 6  # chunked: budget 6 of 10
    r = client.step(pid, [AllocateOp("r", num_computed_tokens=6, num_new_tokens=100)])
    assert r[0].new_block_ids == ([3],) and r[0].num_scheduled_tokens == 4
    r = client.step(pid, [AllocateOp("r", num_computed_tokens=10, num_new_tokens=1, append_token_ids=[77],
                                     num_lookahead_tokens=3)])
    assert r[0].new_block_ids == ([4],) and r[0].num_tokens == 11  # 11 + 3 lookahead slots -> 4 blocks
    r = client.step(pid, [AllocateOp("r", num_computed_tokens=11, num_new_tokens=1)])
    assert r[0].status == OpStatus.FAILED_PRECONDITION and "no uncomputed tokens" in r[0].message
    client.free(pid, "r")


def test_no_space_changes_nothing_and_other_ops_proceed(client, request):
    pid = pool_id(request)
    client.register_pool(pid, small_config(5, 4), max_model_len=256)  # 4 usable blocks
    r = client.step(pid, [
        AddRequestOp("big", token_ids=list(range(100, 120))),
        AllocateOp("big", num_new_tokens=20),            # 5 blocks: NO_SPACE
        AddRequestOp("small", token_ids=list(range(8))),
        AllocateOp("small", num_new_tokens=8),            # fits
        AllocateOp("ghost", num_new_tokens=1),            # NOT_FOUND
        AddRequestOp("small", token_ids=[1]),             # ALREADY_EXISTS
    ])
    assert [x.status for x in r.results] == [OpStatus.OK, OpStatus.NO_SPACE, OpStatus.OK, OpStatus.OK,
                                             OpStatus.NOT_FOUND, OpStatus.ALREADY_EXISTS]
    assert "4 free blocks" in r[1].message
    assert r[3].new_block_ids == ([1, 2],)
    info = client.get_request(pid, "big")
    assert info.block_ids == ([],) and not info.running
    # The failed append of a running request is undone too.
    r = client.step(pid, [AllocateOp("small", num_computed_tokens=8, num_new_tokens=13,
                                     append_token_ids=list(range(13)))])
    assert r[0].status == OpStatus.NO_SPACE
    assert client.get_request(pid, "small").num_tokens == 8
    client.free(pid, "big", "small")
    assert client.get_stats(check_invariants=True).pools[pid].num_free_blocks == 4


def test_fork_returns_copy_on_write_copies(client, request):
    pid = pool_id(request)
    client.register_pool(pid, small_config(32, 4), max_model_len=256)
    client.step(pid, [AddRequestOp("p", token_ids=list(range(6))), AllocateOp("p", num_new_tokens=6)])
    r = client.fork(pid, "p", "c1", "c2")
    assert [x.new_block_ids for x in r.results] == [([1, 2],), ([1, 2],)]
    r = client.step(pid, [AllocateOp(rid, num_computed_tokens=6, num_new_tokens=1, append_token_ids=[100 + i])
                          for i, rid in enumerate(["p", "c1", "c2"])])
    assert [x.new_block_ids for x in r.results] == [(), (), ()]  # no group got a block
    assert r.copies == [(2, 3), (2, 4)]  # two writers copy, the last owns block 2
    assert [x.replaced for x in r.results] == [[(0, 1, 3)], [(0, 1, 4)], []]  # (group, index, new block)
    assert [client.get_request(pid, x).block_ids for x in ("p", "c1", "c2")] == [([1, 3],), ([1, 4],), ([1, 2],)]
    client.free(pid, "p", "c1", "c2")
    assert client.get_stats(check_invariants=True).pools[pid].num_free_blocks == 31


def test_requests_added_by_client_hashes(client, request):
    pid = pool_id(request)
    client.register_pool(pid, small_config(64, 4), max_model_len=1024)
    prompt = list(range(1000, 1010))
    client.step(pid, [AddRequestOp("tok", token_ids=prompt), AllocateOp("tok", num_new_tokens=10)])
    hashes = client.hash_prompt(prompt)
    assert hashes == hash_prompt(prompt, block_size=HBS) and len(hashes) == 2
    r = client.step(pid, [AddRequestOp("hsh", block_hashes=hashes, num_tokens=10),
                          AllocateOp("hsh", num_new_tokens=10)])
    assert r[1].num_computed_tokens == 8 and r[1].new_block_ids == ([1, 2, 4],)
    # Appending: 2 tokens complete block 2, whose hash the client sends.
    nxt = hash_prompt(prompt + [7, 7], block_size=HBS)[2]
    r = client.step(pid, [AllocateOp("hsh", num_computed_tokens=10, num_new_tokens=2, append_block_hashes=[nxt],
                                     num_append_tokens=2)])
    assert r[0].status == OpStatus.OK and client.get_request(pid, "hsh").num_block_hashes == 3
    r = client.step(pid, [AllocateOp("hsh", num_computed_tokens=12, num_new_tokens=4, num_append_tokens=4)])
    assert r[0].status == OpStatus.FAILED_PRECONDITION and "need 1 new block hashes" in r[0].message
    assert client.lookup(block_hashes=hashes, num_tokens=10).tokens(pid) == 8
    client.free(pid, "tok", "hsh")


def test_retry_of_applied_sequence_gets_the_original_reply(client, request):
    pid = pool_id(request)
    client.register_pool(pid, small_config(32, 4), max_model_len=256)
    ops = [AddRequestOp("x", token_ids=list(range(8))), AllocateOp("x", num_new_tokens=8)]
    first = client.step(pid, ops)
    client.next_sequence -= 1  # pretend the reply was lost: resend the same sequence
    again = client.step(pid, ops)
    assert again == first
    assert client.get_stats().pools[pid].num_requests == 1  # applied once
    # A sequence past the next is refused, saying where the session stands (the client resumes there: see
    # test_client_sequences.py); sent raw, as a client of another language would.
    skipped = encode.step_request(pid, [FreeOp("x")])
    skipped.session_id, skipped.sequence = client.session_id, client.next_sequence + 5
    with pytest.raises(grpc.RpcError) as caught:
        client.stub.Step(skipped, timeout=10)
    refused = from_rpc_error(caught.value)
    assert isinstance(refused, SequenceOutOfOrder) and "out of order" in refused.message
    assert refused.last_applied == client.next_sequence - 1
    client.free(pid, "x")


def test_whole_call_rejections_apply_nothing(client, request):
    pid = pool_id(request)
    client.register_pool(pid, small_config(32, 4), max_model_len=64)
    before = client.get_stats().pools[pid]
    cases = [
        ([AddRequestOp("ok", token_ids=[1, 2]), AllocateOp("ok", num_new_tokens=2), AddRequestOp("", token_ids=[1])],
         "ops[2].add.request_id"),
        ([AddRequestOp("long", token_ids=list(range(65)))], "exceeds max_model_len 64"),
        ([AllocateOp("x" * 300, num_new_tokens=1)], "longer than 256 bytes"),
        ([AllocateOp("x", num_new_tokens=65)], "ops[0].allocate.num_new_tokens = 65"),
        ([AddRequestOp("h", block_hashes=[b"\x00" * 16], num_tokens=3)], "need 0 hashes"),
        ([AddRequestOp("bad\nid", token_ids=[1])], "control characters"),
    ]
    for ops, match in cases:
        with pytest.raises(InvalidArgument, match=match.replace("[", r"\[").replace("]", r"\]")):
            client.step(pid, ops)
    after = client.get_stats().pools[pid]
    assert (after.num_free_blocks, after.num_requests) == (before.num_free_blocks, before.num_requests)
    with pytest.raises(NotFound, match="not registered"):
        client.step("no-such-pool", [FreeOp("x")])


def test_epoch_change_fails_in_flight_requests(client, request):
    pid = pool_id(request)
    cfg = small_config(32, 4)
    client.register_pool(pid, cfg, max_model_len=256, epoch=1)
    client.step(pid, [AddRequestOp("a", token_ids=list(range(9))), AllocateOp("a", num_new_tokens=9)])
    same = client.register_pool(pid, cfg, max_model_len=256, epoch=1)
    assert not same.new_epoch
    with pytest.raises(FailedPrecondition, match="another config"):
        client.register_pool(pid, small_config(16, 4), max_model_len=256, epoch=1)
    bumped = client.register_pool(pid, cfg, max_model_len=256, epoch=2)
    assert bumped.new_epoch and bumped.num_requests_failed == 1
    r = client.step(pid, [AllocateOp("a", num_computed_tokens=9, num_new_tokens=1, append_token_ids=[5])])
    assert r[0].status == OpStatus.EPOCH_CHANGED and "epoch 2" in r[0].message
    # The cached prefix is gone with the old memory.
    assert client.lookup(list(range(9)), pool_ids=[pid]).tokens(pid) == 0
    stats = client.get_stats(check_invariants=True).pools[pid]
    assert stats.epoch == 2 and stats.num_free_blocks == 31 and stats.invariant_violation == ""
    with pytest.raises(FailedPrecondition, match="older than"):
        client.register_pool(pid, cfg, max_model_len=256, epoch=1)


def test_fingerprint_mismatch_is_refused(server, request):
    c = server.client(hash_seed="another-seed", hash_block_size=HBS)
    with pytest.raises(FailedPrecondition, match="hash_fingerprint"):
        c.register_pool(pool_id(request), small_config(), max_model_len=256)
    c.close()


def test_hybrid_pool_over_rpc(client, request):
    pid = pool_id(request)
    client.register_pool(pid, KVCacheConfig(64, [FullAttentionSpec(4), SlidingWindowSpec(4, 8)]),
                         max_model_len=512)
    r = client.step(pid, [AddRequestOp("h", token_ids=list(range(12))), AllocateOp("h", num_new_tokens=12)])
    assert r[1].new_block_ids == ([1, 2, 3], [4, 5, 6])
    r = client.step(pid, [AllocateOp("h", num_computed_tokens=12, num_new_tokens=1, append_token_ids=[9])])
    assert client.get_request(pid, "h").block_ids == ([1, 2, 3, 7], [0, 5, 6, 8])  # window 8 at 12 computed: 5 skipped
    client.step(pid, [FreeOp("h")])


def test_fork_op_inside_step_and_errors(client, request):
    pid = pool_id(request)
    client.register_pool(pid, small_config(32, 4), max_model_len=256)
    r = client.step(pid, [AddRequestOp("p", token_ids=[1, 2, 3]), ForkOp("p", "c"),
                          AllocateOp("p", num_new_tokens=3), ForkOp("p", "c"), ForkOp("p", "c"), ForkOp("q", "d")])
    assert [x.status for x in r.results] == [OpStatus.OK, OpStatus.FAILED_PRECONDITION, OpStatus.OK, OpStatus.OK,
                                             OpStatus.ALREADY_EXISTS, OpStatus.NOT_FOUND]
    client.free(pid, "p", "c")


def test_async_client_round_trip(server, request):
    import asyncio

    from kvservice.client import AsyncKVServiceClient

    async def run():
        async with AsyncKVServiceClient(server.target, hash_block_size=HBS) as c:
            pid = pool_id(request)
            await c.register_pool(pid, small_config(32, 4), max_model_len=256)
            steps = await asyncio.gather(*[
                c.step(pid, [AddRequestOp(f"r{i}", token_ids=list(range(8))), AllocateOp(f"r{i}", num_new_tokens=8)])
                for i in range(4)])
            assert sorted(s.sequence for s in steps) == [2, 3, 4, 5]  # serialized per session
            assert sorted(s[1].num_computed_tokens for s in steps) == [0, 4, 4, 4]
            assert (await c.lookup(list(range(9)))).tokens(pid) == 8
            await c.free(pid, *[f"r{i}" for i in range(4)])
            stats = await c.get_stats(check_invariants=True)
            assert stats.pools[pid].num_free_blocks == 31 and stats.pools[pid].invariant_violation == ""

    asyncio.run(run())


def test_decode_batch_is_packed_allocate_ops(client, request):
    from kvservice.ops import DecodeBatchOp
    pid = pool_id(request)
    client.register_pool(pid, small_config(8, 4), max_model_len=64)  # 7 usable blocks
    client.step(pid, [AddRequestOp("a", token_ids=[1, 2, 3, 4]), AllocateOp("a", num_new_tokens=4),
                      AddRequestOp("b", token_ids=[5, 6]), AllocateOp("b", num_new_tokens=2),
                      AddRequestOp("w", token_ids=[7])])
    r = client.step(pid, [DecodeBatchOp(["a", "b", "ghost", "w"], [4, 2, 0, 0], [10, 11, 12, 13])])
    batch = r[0].batch
    assert [batch.status(i) for i in range(4)] == [OpStatus.OK, OpStatus.OK, OpStatus.NOT_FOUND, OpStatus.OK]
    # a crosses into a new block, b fills its partial block, w (waiting) is admitted with 2 tokens budgeted 1.
    assert batch.block_ids() == [([3],), ([],), ([],), ([4],)]
    assert list(batch.num_computed_tokens) == [4, 2, 0, 0] and list(batch.num_scheduled_tokens) == [1, 1, 0, 1]
    assert [f.request_id for f in batch.failures] == ["ghost"]
    assert client.get_request(pid, "a").block_ids == ([1, 3],)
    # Entry by entry the same as AllocateOps: NO_SPACE undoes that entry's append only.
    client.step(pid, [AddRequestOp("big", token_ids=list(range(12))), AllocateOp("big", num_new_tokens=12)])
    r = client.step(pid, [DecodeBatchOp(["a", "big"], [5, 12], [20, 21], num_new_tokens=8)])
    assert r[0].batch.status(0) == OpStatus.OK and r[0].batch.status(1) == OpStatus.NO_SPACE
    assert client.get_request(pid, "big").num_tokens == 12
    with pytest.raises(InvalidArgument, match="needs one uint32 per request"):
        client.step(pid, [DecodeBatchOp(["a", "b"], [1])])
    client.free(pid, "a", "b", "w", "big")
    assert client.get_stats(check_invariants=True).pools[pid].num_free_blocks == 7


def test_admit_batch_is_packed_add_allocate_pairs(client, request):
    from kvservice.ops import AdmitBatchOp
    pid = pool_id(request)
    client.register_pool(pid, small_config(8, 4), max_model_len=64)  # 7 usable blocks
    client.step(pid, [AddRequestOp("old", token_ids=[9, 9]), AllocateOp("old", num_new_tokens=2)])
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    r = client.step(pid, [AdmitBatchOp(["a", "b", "old", "c"], [prefix + [10], prefix + [11, 12], [1], [5] * 30],
                                       num_new_tokens=[9, 10, 1, 30], lora_names=[None, None, None, "l"])])
    batch = r[0].batch
    assert [batch.status(i) for i in range(4)] == [OpStatus.OK, OpStatus.OK, OpStatus.ALREADY_EXISTS, OpStatus.NO_SPACE]
    # a takes blocks 2-4; b hits a's two full blocks and gets one of its own; each table comes whole.
    assert batch.block_ids() == [([2, 3, 4],), ([2, 3, 5],), ([],), ([],)]
    assert list(batch.num_computed_tokens) == [0, 8, 0, 0] and list(batch.num_scheduled_tokens) == [9, 2, 0, 0]
    assert [(f.request_id, f.status) for f in batch.failures] == [("old", OpStatus.ALREADY_EXISTS),
                                                                  ("c", OpStatus.NO_SPACE)]
    assert client.get_request(pid, "b").block_ids == ([2, 3, 5],)
    assert client.get_request(pid, "old").num_tokens == 2  # the failed add changed nothing
    waiting = client.get_request(pid, "c")  # added, not scheduled: as after a NO_SPACE AllocateOp
    assert waiting.num_tokens == 30 and not waiting.running
    with pytest.raises(InvalidArgument, match=r"admit.num_prompt_tokens\[0\] = 0: is below 1"):
        client.step(pid, [AdmitBatchOp(["x"], [[]])])
    with pytest.raises(InvalidArgument, match=r"admit.lora_names = .*give none or one per request \(2\)"):
        client.step(pid, [AdmitBatchOp(["x", "y"], [[1], [2]], lora_names=["l"])])
    with pytest.raises(NotFound):
        client.get_request(pid, "x")  # a rejected call applied nothing
    client.free(pid, "a", "b", "c", "old")
    assert client.get_stats(check_invariants=True).pools[pid].num_free_blocks == 7

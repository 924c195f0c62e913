"""The client keeps what it promised (issue 13, points 4 and 5), over real processes: a step whose reply was
lost is applied once however it is resent, and an idle client keeps its session."""

import asyncio
import time

import grpc
import pytest

from kvservice._proto import allocator_pb2 as pb
from kvservice.client import AsyncKVServiceClient, KVServiceClient
from kvservice.errors import NotFound, Unavailable
from kvservice.ops import AddRequestOp, AllocateOp, OpStatus
from kvservice.wire import encode
from tests.net_helpers import LossyProxy
from tests.service_helpers import small_config, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server("--session-ttl", "1", log_dir=tmp_path_factory.mktemp("resilience"))
    yield proc
    proc.stop()


def test_a_step_whose_reply_was_lost_applies_once_across_a_resume(server):
    proxy = LossyProxy(server.target)
    c = KVServiceClient(proxy.address, retries=0, timeout_s=5)
    watcher = server.client()
    c.register_pool("lossy", small_config(64, 16), max_model_len=512)
    c.step("lossy", [AddRequestOp("r", token_ids=list(range(10))), AllocateOp("r", num_new_tokens=10)])
    decode = [AllocateOp("r", num_computed_tokens=10, num_new_tokens=1, append_token_ids=[7])]
    proxy.lose_replies()
    with pytest.raises(Unavailable):
        c.step("lossy", decode)
    assert proxy.lost_bytes > 0
    assert watcher.get_request("lossy", "r").num_tokens == 11  # the server applied it; the reply got lost
    c.retries = 4
    c.open_session(resume=True)  # the documented reconnect
    again = c.step("lossy", decode)  # resent as it was: answered with the stored reply
    assert again[0].status == OpStatus.OK and again[0].num_computed_tokens == 10
    assert watcher.get_request("lossy", "r").num_tokens == 11  # not 12: the token was appended once
    # Another request reusing that (applied) sequence is refused, not answered with the old reply.
    other = encode.step_request("lossy", [AllocateOp("r", num_computed_tokens=11, num_new_tokens=1,
                                                     append_token_ids=[8])])
    other.session_id, other.sequence = c.session_id, c.next_sequence - 1
    with pytest.raises(grpc.RpcError) as info:
        c.stub.Step(other, timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "was applied to a different request" in info.value.details()
    c.step("lossy", [AllocateOp("r", num_computed_tokens=11, num_new_tokens=1, append_token_ids=[8])])
    assert watcher.get_request("lossy", "r").num_tokens == 12
    for client in (c, watcher):
        client.close()
    proxy.close()


def test_an_idle_client_keeps_its_session(server):
    idle = server.client()
    idle.register_pool("idle", small_config(64, 16), max_model_len=512)
    idle.step("idle", [AddRequestOp("r", token_ids=list(range(10))), AllocateOp("r", num_new_tokens=10)])
    silent = server.client(heartbeat=False)  # what the client did before: nothing between calls
    silent.step("idle", [AddRequestOp("s", token_ids=list(range(10))), AllocateOp("s", num_new_tokens=10)])
    time.sleep(3.5)  # three and a half leases
    r = idle.step("idle", [AllocateOp("r", num_computed_tokens=10, num_new_tokens=1, append_token_ids=[1])])
    assert r[0].status == OpStatus.OK
    with pytest.raises(NotFound, match="lease may have lapsed"):
        silent.step("idle", [AllocateOp("s", num_computed_tokens=10, num_new_tokens=1, append_token_ids=[1])])
    assert idle.get_stats().pools["idle"].num_requests == 1  # only the silent one's request was freed
    idle.free("idle", "r")
    idle.close()
    silent.close()


def test_an_idle_asyncio_client_keeps_its_session(server):
    async def scenario() -> OpStatus:
        async with AsyncKVServiceClient(server.target) as c:
            await c.register_pool("idle-aio", small_config(64, 16), max_model_len=512)
            await c.step("idle-aio", [AddRequestOp("r", token_ids=list(range(10))),
                                      AllocateOp("r", num_new_tokens=10)])
            await asyncio.sleep(3.5)
            r = await c.step("idle-aio", [AllocateOp("r", num_computed_tokens=10, num_new_tokens=1,
                                                     append_token_ids=[1])])
            await c.free("idle-aio", "r")
            return r[0].status

    assert asyncio.run(scenario()) == OpStatus.OK


def test_the_lease_is_what_open_session_says(server):
    c = server.client()
    opened = c.open_session()
    assert opened.ttl_ms == 1000 and c.ttl_s == 1.0
    reply = c.stub.Heartbeat(pb.HeartbeatRequest(session_id=c.session_id), timeout=5)
    assert reply.ttl_ms == 1000
    c.close()


def test_calls_survive_their_connection_being_replaced_under_them(server):
    """A map refresh on another thread (a PrefixIndex's, a heartbeat's) may swap a shard's channel for its
    new leader's and close the old one while calls are in flight on it: reads are sent again on the new
    channel, mutations resume the session there first and apply exactly once."""
    import threading
    c = KVServiceClient(f"{server.target},{server.target}", retries=0, timeout_s=5)  # "a leader and its standby"
    c.register_pool("swapped", small_config(64, 16), max_model_len=512)
    c.step("swapped", [AddRequestOp("r", token_ids=list(range(4))), AllocateOp("r", num_new_tokens=4)])
    stop, swaps = threading.Event(), [0]

    def swap():
        while not stop.is_set():
            c._close([c.shards.rotate(c.shards.seed)])  # what a failover does to the connection
            swaps[0] += 1
            time.sleep(0.002)

    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        for i in range(150):
            assert c.get_request("swapped", "r").num_tokens == 4 + i
            c.step("swapped", [AllocateOp("r", num_computed_tokens=4 + i, num_new_tokens=1, append_token_ids=[i])])
    finally:
        stop.set()
        swapper.join()
    assert swaps[0] > 20
    assert server.client().get_request("swapped", "r").num_tokens == 4 + 150  # every decode step once
    c.close()

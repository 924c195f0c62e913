"""The standby snapshotter: it rebuilds the leader's state from the WAL, block for block."""

import asyncio

import pytest

from kvservice._proto import allocator_pb2 as pb
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp
from kvservice.settings import AllocatorSettings
from kvservice.store.redis_store import RedisStore
from kvservice.store.snapshotter import snapshot_once
from tests.redis_helpers import RedisServer
from tests.service_helpers import start_server


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


def test_standby_snapshot_equals_the_leaders_state(redis_server, tmp_path):
    # The leader never snapshots by itself here (huge thresholds); we drive the standby's logic directly.
    proc = start_server("--redis-url", redis_server.url, "--redis-namespace", "standby", "--quota", "t=1000",
                        "--snapshot-every", "100000000", "--snapshot-interval", "100000", persistence=True,
                        log_dir=tmp_path)
    try:
        client = proc.client()
        client.register_pool("p", KVCacheConfig(129, [FullAttentionSpec(16)]), max_model_len=1024)
        for i in range(30):
            client.step("p", [AddRequestOp(f"r{i}", token_ids=list(range(i, i + 70))),
                              AllocateOp(f"r{i}", num_new_tokens=70), *([FreeOp(f"r{i - 2}")] if i % 3 else [])])
        client.fork("p", "r29", "r29/b")
        digest = client.stub.GetStats(pb.GetStatsRequest(include_state_digest=True), timeout=10).state_digest

        async def standby():
            store = RedisStore(redis_server.url, "standby")
            store.epoch = await store.leader()
            result = await snapshot_once(store, AllocatorSettings(quotas={"t": 1000}))
            usage = await store.usage()
            await store.close()
            return result, usage

        result, usage = asyncio.run(standby())
        assert result is not None and result["entries"] >= 32 and usage["wal_entries"] == 1
        # A restart from the standby's snapshot alone reaches the very same state.
        proc.proc.kill()
        proc.proc.wait(10)
        proc = start_server("--redis-url", redis_server.url, "--redis-namespace", "standby", "--quota", "t=1000",
                            persistence=True, log_dir=tmp_path)
        again = proc.client().stub.GetStats(pb.GetStatsRequest(include_state_digest=True), timeout=10)
        assert again.state_digest == digest
    finally:
        proc.stop()

"""A Redis outage without --require-persistence while a hot standby follows, on real processes: when Redis
returns, the standby converges and keeps every acknowledgement; when the leader is killed during the outage,
the standby takes over with what Redis had, no block is handed out twice, and the pool starts a new epoch."""

from __future__ import annotations

import signal
import time

import pytest

from kvservice.client import KVServiceClient
from kvservice.errors import KVServiceError
from kvservice.ops import AddRequestOp, AllocateOp, DecodeBatchOp, FreeOp, OpStatus
from tests import faults
from tests.redis_helpers import RedisServer
from tests.service_helpers import start_server
from tests.shard_faults import CONFIG, NUM_BLOCKS, Acked


class LeaderAndStandby:
    def __init__(self, tmp_path) -> None:
        self.tmp = tmp_path
        self.redis = RedisServer(tmp_path / "redis", appendfsync="always")
        self.redis.start()
        self.leader = self.start()
        self.standby = self.start("--standby")

    def start(self, *args: str):
        return start_server("--redis-url", self.redis.url, "--redis-namespace", "outage", "--leader-lease", "2",
                            "--session-ttl", "60", *args, persistence=True, log_dir=self.tmp)

    def client(self) -> KVServiceClient:
        return KVServiceClient(f"{self.leader.target},{self.standby.target}", failover_timeout_s=30)

    def kill_leader(self) -> None:
        self.leader.proc.send_signal(signal.SIGKILL)
        self.leader.proc.wait(10)

    def stop(self) -> None:
        for p in (self.leader, self.standby):
            p.stop()
        self.redis.stop()


def acks_into_an_outage(pair: LeaderAndStandby, c: KVServiceClient) -> Acked:
    """Pool "p" with 3 requests acknowledged while persistence is ok; then Redis killed, and acknowledgements
    from the leader's memory (3 more requests, and a decode of the first)."""
    c.register_pool("p", CONFIG, max_model_len=1024)
    acked = Acked("p")
    acked.add(c, 3, "ok")
    pair.redis.kill()
    deadline = time.monotonic() + 15
    while c.get_stats().persistence != "degraded":
        assert time.monotonic() < deadline, "the leader never reported persistence degraded"
        time.sleep(0.1)
    acked.add(c, 3, "degraded")
    r = c.step("p", [DecodeBatchOp(["ok-0"], [acked.tables["ok-0"][1]], [9])])
    assert r[0].batch.status(0) == OpStatus.OK
    info = c.get_request("p", "ok-0")
    acked.tables["ok-0"] = (list(info.block_ids[0]), info.num_tokens)
    return acked


def test_outage_then_redis_returns_the_standby_converges_and_keeps_every_ack(tmp_path):
    """(a) Acknowledged while degraded, then Redis returns: once the leader reports ok (its resync snapshot
    committed), the standby holds all of it: killed then, the leader loses nothing to its standby."""
    pair = LeaderAndStandby(tmp_path)
    try:
        c = pair.client()
        acked = acks_into_an_outage(pair, c)
        epoch, pool_epoch = c.get_stats().leader_epoch, c.get_stats().pools["p"].epoch
        pair.redis.restart()
        faults.wait_persistence(c, "p", "ok", timeout_s=30)
        pair.kill_leader()
        lost = []
        for rid, (table, n) in acked.tables.items():
            info = c.get_request("p", rid)  # answered by the standby, which leads now
            if (list(info.block_ids[0]), info.num_tokens) != (table, n):
                lost.append(rid)
        assert lost == [], f"acknowledged while degraded, lost after the resync: {lost}"
        assert c.get_stats().leader_epoch > epoch  # the standby leads now
        stats = c.get_stats(check_invariants=True).pools["p"]
        assert stats.invariant_violation == "" and stats.epoch == pool_epoch
        r = c.step("p", [AddRequestOp("new", token_ids=list(range(9000, 9040))),
                         AllocateOp("new", num_new_tokens=40), FreeOp("new")])
        assert r[1].status == OpStatus.OK
        c.free("p", *acked.tables)
        assert c.get_stats(check_invariants=True).pools["p"].num_free_blocks == NUM_BLOCKS - 1
        c.close()
    finally:
        pair.stop()


def test_outage_with_the_leader_killed_the_standby_takes_over_and_the_pool_gets_a_new_epoch(tmp_path):
    """(b) Acknowledged while degraded, then the leader dies before Redis returns: those acknowledgements
    never reached Redis, so the standby that takes over cannot have them (the README says so). The
    guarantee is that no block is handed out twice: the client, which saw more acknowledged than the
    standby recovered, makes the pool start a new epoch; its requests fail with EPOCH_CHANGED."""
    pair = LeaderAndStandby(tmp_path)
    try:
        c = pair.client()
        acked = acks_into_an_outage(pair, c)
        epoch, pool_epoch = c.get_stats().leader_epoch, c.get_stats().pools["p"].epoch
        pair.kill_leader()
        pair.redis.restart()
        r = c.step("p", [DecodeBatchOp(["ok-0"], [acked.tables["ok-0"][1]], [9])])  # fails over, resumes
        assert r[0].status == OpStatus.EPOCH_CHANGED or r[0].batch.status(0) == OpStatus.EPOCH_CHANGED, r[0]
        assert c.get_stats().leader_epoch > epoch  # the standby leads now
        stats = c.get_stats(check_invariants=True).pools["p"]
        assert stats.epoch == pool_epoch + 1 and stats.invariant_violation == "" and stats.num_requests == 0
        assert stats.num_free_blocks == NUM_BLOCKS - 1  # nothing of the old epoch holds a block
        for rid in acked.tables:
            with pytest.raises(KVServiceError):
                c.get_request("p", rid)
        r = c.step("p", [AddRequestOp("new", token_ids=list(range(9000, 9040))),
                         AllocateOp("new", num_new_tokens=40)])
        assert r[1].status == OpStatus.OK
        c.free("p", "new")
        c.close()
    finally:
        pair.stop()

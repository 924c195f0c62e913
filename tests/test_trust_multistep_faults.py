"""Faults inside multi-step operations (issue 22, item 10), on real processes: two shards on one real Redis,
each SIGKILLed and started again with the same command. A pool move is driven phase by phase (FREEZE,
IMPORT, DROP) with the source or the destination killed after each, then finished as an operator would (run
`kvservice shards move` again); a cross-shard transfer has either side killed while the source pin is held,
then is committed or aborted; a Redis outage without --require-persistence while a hot standby follows. After
each: every acknowledged allocation holds the same blocks, exactly one shard holds the pool, no block is
held twice or leaked, no export is left in Redis, and the pool serves new steps."""

from __future__ import annotations

import random
import signal
import threading
import time

import grpc
import pytest

from kvservice.client import KVServiceClient
from kvservice.errors import KVServiceError
from kvservice.ops import AddRequestOp, AllocateOp, DecodeBatchOp, ExternalSource, FreeOp, OpStatus, PinOp, UnpinOp
from tests import faults
from tests.redis_helpers import RedisServer
from tests.service_helpers import start_server
from tests.shard_faults import CONFIG, NUM_BLOCKS, SHARDS, Acked, Fleet, Load, Phase, check


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("multistep"))
    yield f
    f.stop()


def new_pool(fleet: Fleet, pool_id: str, on: str | None = None) -> str:
    """Registers `pool_id` (on shard `on`, moved there if placement chose the other); returns its shard."""
    with fleet.client() as c:
        c.register_pool(pool_id, CONFIG, max_model_len=1024, kv_layout="block=16")  # transfers need a layout
    shard = fleet.owner(pool_id)
    if on is not None and shard != on:
        rc, out = fleet.move(pool_id, on)
        assert rc == 0, out
        shard = on
    return shard


def other(shard: str) -> str:
    return next(s for s in SHARDS if s != shard)


@pytest.mark.parametrize("victim", ["source", "destination"])
@pytest.mark.parametrize("after", ["FREEZE", "IMPORT", "DROP"])
def test_a_move_killed_after_each_phase_is_finished_by_running_it_again(fleet, victim, after):
    """The phases as the rebalancer runs them, one side SIGKILLed and restarted after `after`; then the same
    `kvservice shards move` again (after IMPORT the map already names the destination: it must finish the
    move, dropping the source's frozen copy, rather than refuse)."""
    pool = f"mv-{victim[:3]}-{after.lower()}"
    src = new_pool(fleet, pool)
    dst = other(src)
    acked = Acked(pool)
    with fleet.client() as c:
        acked.add(c, 6, "r")
    phases = [("FREEZE", src, dict(to_shard=dst)), ("IMPORT", dst, dict(from_shard=src)), ("DROP", src, {})]
    for name, shard, fields in phases:
        fleet.phase(shard, pool, getattr(Phase, name), **fields)
        if name == after:
            break
    fleet.kill_and_restart(src if victim == "source" else dst)
    rc, out = fleet.move(pool, dst)  # what an operator does after a crash: run the move again
    assert rc == 0, out
    assert fleet.owner(pool) == dst
    assert check(fleet, pool, acked) == []


def test_a_move_whose_destination_is_down_at_import_is_thawed_then_run_again(fleet):
    pool = "mv-dst-down"
    src = new_pool(fleet, pool)
    dst = other(src)
    acked = Acked(pool)
    with fleet.client() as c:
        acked.add(c, 4, "r")

    def move_while_down():
        rc, out = fleet.move(pool, dst, reconnect_s=0)
        assert rc == 1 and "UNAVAILABLE" in out, out  # the import failed: the source was thawed
        with fleet.client() as c:
            acked.add(c, 2, "thawed")  # the source serves the pool again meanwhile

    fleet.kill_and_restart(dst, while_down=move_while_down)
    assert fleet.owner(pool) == src
    rc, out = fleet.move(pool, dst)
    assert rc == 0, out
    assert check(fleet, pool, acked) == []


def test_an_import_that_did_not_take_over_leaves_no_stale_copy(fleet):
    """An IMPORT whose takeover the shard map refuses (it does not give the pool to the named source) leaves
    nothing installed on the destination: a later move would keep that old copy and lose what the thawed
    source acknowledged since."""
    pool = "mv-stale"
    src = new_pool(fleet, pool)
    dst = other(src)
    acked = Acked(pool)
    with fleet.client() as c:
        acked.add(c, 3, "before")
    fleet.phase(src, pool, Phase.FREEZE, to_shard=dst)
    with pytest.raises(grpc.RpcError) as info:
        fleet.phase(dst, pool, Phase.IMPORT, from_shard=dst)  # the map gives the pool to src, not dst
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert pool not in fleet.shards[dst].pools()  # refused before anything was installed
    fleet.phase(src, pool, Phase.THAW)
    with fleet.client() as c:
        acked.add(c, 3, "after-thaw")
    rc, out = fleet.move(pool, dst)
    assert rc == 0, out
    assert check(fleet, pool, acked) == []


@pytest.mark.parametrize("learned", [False, True])
def test_a_step_whose_reply_was_lost_before_the_move_applies_once(fleet, learned):
    """A step applied on the source whose reply was lost (the source was killed before sending it), resent
    after the pool moved on: answered from the source's stored reply, never applied again on the destination
    (an AddRequestOp would then be ALREADY_EXISTS, an AllocateOp would grow the request). `learned`: the client
    read the new shard map before resending, as it does while it fails over."""
    pool = f"mv-resend-{int(learned)}"
    src = new_pool(fleet, pool)
    dst = other(src)
    with fleet.client() as c:
        ops = [AddRequestOp("lost", token_ids=list(range(700, 740))), AllocateOp("lost", num_new_tokens=40)]
        first = c.step(pool, ops)
        conn = c.shards.conn_for(pool)
        conn.next_sequence -= 1  # what the client holds when the reply never came: that sequence unacknowledged
        conn.unacked_sequence = conn.next_sequence
        conn.unacked_pool = pool
        rc, out = fleet.move(pool, dst)
        assert rc == 0, out
        if learned:  # what the client does while failing over: it adopts the map, which routes the pool to dst
            for channel in c.shards.adopt(c.shard_map()):
                channel.close()
            assert c.shards.conn_for(pool).shard_id == dst
        again = c.step(pool, ops)
        assert [r.status for r in again] == [OpStatus.OK, OpStatus.OK], again
        assert again[1].new_block_ids == first[1].new_block_ids
        assert c.get_request(pool, "lost").num_tokens == 40
        assert c.step(pool, [FreeOp("lost")])[0].status == OpStatus.OK  # the next step goes to the new shard
    assert check(fleet, pool, Acked(pool)) == []


@pytest.mark.parametrize("victim", ["source", "destination"])
@pytest.mark.parametrize("outcome", ["commit", "abort"])
def test_a_cross_shard_transfer_with_either_side_killed_while_pinned(fleet, victim, outcome):
    a = f"xs-{victim[:3]}-{outcome}-a"
    b = f"xs-{victim[:3]}-{outcome}-b"
    src = new_pool(fleet, a)
    dst = new_pool(fleet, b, on=other(src))
    prompt = list(range(100, 200))
    with fleet.client() as c:
        c.step(a, [AddRequestOp("p", token_ids=prompt), AllocateOp("p", num_new_tokens=100), FreeOp("p")])
        pin = c.step(a, [PinOp("pin", token_ids=prompt + [1])])[0]
        assert pin.num_computed_tokens == 96
        r = c.step(b, [AddRequestOp("x", token_ids=prompt + [1]),
                       AllocateOp("x", num_new_tokens=101, allow_transfer=True,
                                  external_source=ExternalSource("pin", a, pin.new_block_ids[0], 96))])
        order = r[1].transfer
        assert order is not None and list(order.src_block_ids) == list(pin.new_block_ids[0])
        fleet.kill_and_restart(src if victim == "source" else dst)  # the order open, the pin held
        assert fleet.shards[src].pools()[a].num_free_blocks < NUM_BLOCKS - 1  # still pinned after the restart
        done = c.commit_transfer(b, order.transfer_id, abort=outcome == "abort")
        assert done[0].status == OpStatus.OK, done[0]
        assert c.step(a, [UnpinOp("pin")])[0].status == OpStatus.OK
        if outcome == "commit":
            assert c.lookup(prompt + [1], pool_ids=[b]).tokens(b) == 96
            assert c.get_request(b, "x").num_tokens == 101
            c.free(b, "x")
        else:
            with pytest.raises(KVServiceError):
                c.get_request(b, "x")  # an aborted transfer frees the destination request
    for pool in (a, b):
        assert check(fleet, pool, Acked(pool)) == []


def test_a_pin_whose_holder_is_gone_is_released_after_the_source_restarts(tmp_path):
    """The pinning client vanishes and the source shard is killed: once restarted, the pin lapses with the
    holder's lease instead of holding its blocks forever."""
    f = Fleet(tmp_path, "lapse", "--session-ttl", "2", shards=("s0",))
    try:
        src = new_pool(f, "lapse-a")
        prompt = list(range(300, 400))
        c = f.client()
        c.step("lapse-a", [AddRequestOp("p", token_ids=prompt), AllocateOp("p", num_new_tokens=100), FreeOp("p")])
        assert c.step("lapse-a", [PinOp("pin", token_ids=prompt + [1])])[0].num_computed_tokens == 96
        c.channel.close()  # the holder is gone: no heartbeat, no unpin
        f.kill_and_restart(src)
        deadline = time.monotonic() + 30
        while f.shards[src].pools()["lapse-a"].num_free_blocks != NUM_BLOCKS - 1:
            assert time.monotonic() < deadline, "the pin outlived its holder's lease"
            time.sleep(0.2)
        assert check(f, "lapse-a", Acked("lapse-a")) == []
    finally:
        f.stop()


# ---- a Redis outage without --require-persistence while a hot standby follows -------------------------------
class LeaderAndStandby:
    def __init__(self, tmp_path) -> None:
        self.tmp = tmp_path
        self.redis = RedisServer(tmp_path / "redis", appendfsync="always")
        self.redis.start()
        self.leader = self.start()
        self.standby = self.start("--standby")

    def start(self, *args: str):
        return start_server("--redis-url", self.redis.url, "--redis-namespace", "outage", "--leader-lease", "0.5",
                            "--session-ttl", "60", *args, persistence=True, log_dir=self.tmp)

    def client(self) -> KVServiceClient:
        return KVServiceClient(f"{self.leader.target},{self.standby.target}", failover_timeout_s=30)

    def stop(self) -> None:
        for p in (self.leader, self.standby):
            p.stop()
        self.redis.stop()


def degraded_acks(pair: LeaderAndStandby, c: KVServiceClient, acked: Acked) -> None:
    """Redis killed; acknowledgements from the leader's memory."""
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


def test_outage_then_redis_returns_the_standby_converges_and_keeps_every_ack(tmp_path):
    """(a) Acknowledged while degraded, then Redis returns: once the leader reports ok (its resync snapshot
    committed), the standby holds all of it: killed then, the leader loses nothing to its standby."""
    pair = LeaderAndStandby(tmp_path)
    try:
        c = pair.client()
        c.register_pool("p", CONFIG, max_model_len=1024)
        acked = Acked("p")
        acked.add(c, 3, "ok")
        degraded_acks(pair, c, acked)
        epoch, pool_epoch = c.get_stats().leader_epoch, c.get_stats().pools["p"].epoch
        pair.redis.restart()
        faults.wait_persistence(c, "p", "ok", timeout_s=30)
        pair.leader.proc.send_signal(signal.SIGKILL)
        pair.leader.proc.wait(10)
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
        c.register_pool("p", CONFIG, max_model_len=1024)
        acked = Acked("p")
        acked.add(c, 3, "ok")
        degraded_acks(pair, c, acked)
        epoch, pool_epoch = c.get_stats().leader_epoch, c.get_stats().pools["p"].epoch
        pair.leader.proc.send_signal(signal.SIGKILL)
        pair.leader.proc.wait(10)
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


# ---- the soak loop: kills at random moments inside moves and transfers --------------------------------------
def random_kills(fleet: Fleet, rounds: int, seed: int) -> tuple[dict[str, int], int]:
    """Moves a pool back and forth under load (steps while it moves), SIGKILLing a random side at a random
    moment inside the move (a phase in flight included); then runs the move again and checks. Returns the
    kills by kind and the steps the load had acknowledged."""
    rng = random.Random(seed)
    pool = f"soak-{seed}"
    new_pool(fleet, pool)
    kinds: dict[str, int] = {}
    steps = 0
    for n in range(rounds):
        acked = Acked(pool)
        with fleet.client() as c:
            acked.add(c, rng.randint(5, 20), f"n{n}")
        src = fleet.owner(pool)
        dst = other(src)
        victim = rng.choice((src, dst))
        load = Load(fleet, acked, f"load{n}")
        load.start()
        mover = threading.Thread(target=fleet.move, args=(pool, dst, 0))  # killed under it: it may fail
        mover.start()
        time.sleep(rng.uniform(0.0, 0.4))
        fleet.kill_and_restart(victim)
        mover.join(120)
        kind = f"shard SIGKILL inside a move ({'source' if victim == src else 'destination'})"
        kinds[kind] = kinds.get(kind, 0) + 1
        rc, out = fleet.move(pool, dst)
        assert rc == 0, out
        time.sleep(0.3)  # steps on the moved pool too
        problems = load.settle() + check(fleet, pool, acked)
        assert problems == [], problems
        steps += load.steps
    return kinds, steps


@pytest.mark.soak
def test_soak_random_kills_inside_moves(tmp_path):
    f = Fleet(tmp_path, "soak-moves")
    try:
        kinds, steps = random_kills(f, rounds=20, seed=1)
        print(kinds, f"{steps} steps acknowledged under load")
        assert sum(kinds.values()) == 20 and steps > 0
    finally:
        f.stop()


def test_random_kills_inside_moves_short(fleet):
    kinds, steps = random_kills(fleet, rounds=2, seed=7)
    assert sum(kinds.values()) == 2 and steps > 0

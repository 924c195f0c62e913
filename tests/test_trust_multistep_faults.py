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

from kvservice._proto import allocator_pb2 as pb
from kvservice.client import KVServiceClient
from kvservice.errors import KVServiceError, NotFound
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


# The rest of the matrix runs in make test-slow (make test stays under 15 minutes).
@pytest.mark.parametrize("victim", ["source", pytest.param("destination", marks=pytest.mark.slow)])
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
@pytest.mark.parametrize("outcome", ["commit", pytest.param("abort", marks=pytest.mark.slow)])  # abort: test-slow
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


# ---- what other shards read of a pool's pins, and a move's leftover copy ---------------------------------------
PROMPT = list(range(100, 200))


def cache_and_pin(c: KVServiceClient, pool_id: str) -> ExternalSource:
    """Caches PROMPT in the pool and pins it: the pin as a transfer source."""
    c.step(pool_id, [AddRequestOp("p", token_ids=PROMPT), AllocateOp("p", num_new_tokens=100), FreeOp("p")])
    pin = c.step(pool_id, [PinOp("pin", token_ids=PROMPT + [1])])[0]
    assert pin.num_computed_tokens == 96
    return ExternalSource("pin", pool_id, list(pin.new_block_ids[0]), 96)


def source_refused(c: KVServiceClient, pool_id: str, source: ExternalSource, within_s: float) -> int:
    """Admits PROMPT on `pool_id` with `source` until that is refused (NOT_FOUND), for up to `within_s`;
    an admission that got a transfer order is aborted. Returns how many were accepted; fails if it never is."""
    deadline, accepted, n = time.monotonic() + within_s, 0, 0
    while True:
        n += 1
        try:
            r = c.step(pool_id, [AddRequestOp(f"x{n}", token_ids=PROMPT + [1]),
                                 AllocateOp(f"x{n}", num_new_tokens=101, allow_transfer=True, external_source=source)])
        except NotFound:
            return accepted
        except KVServiceError:  # e.g. UNAVAILABLE while Redis comes back
            pass
        else:
            assert r[1].transfer is not None, r[1]
            accepted += 1
            assert c.commit_transfer(pool_id, r[1].transfer.transfer_id, abort=True)[0].status == OpStatus.OK
        assert time.monotonic() < deadline, f"a released pin stayed a transfer source ({accepted} orders given)"
        time.sleep(0.2)


def test_a_pin_released_while_redis_was_away_stops_being_a_source_once_it_returns(tmp_path):
    """The unpin of a pool's last pin is acknowledged while Redis is down (no --require-persistence), so it
    could not be published: once Redis is back the source shard publishes it, and other shards refuse the
    released pin (its blocks may be reused) instead of ordering a copy of them."""
    f = Fleet(tmp_path, "unpub")
    try:
        src = new_pool(f, "up-a")
        new_pool(f, "up-b", on=other(src))
        with f.client() as c:
            source = cache_and_pin(c, "up-a")
            f.redis.kill()
            deadline = time.monotonic() + 15
            while f.shards[src].call("GetStats", pb.GetStatsRequest()).persistence != "degraded":
                assert time.monotonic() < deadline, "the source shard never reported persistence degraded"
                c.step("up-a", [AddRequestOp("probe", token_ids=[1, 2, 3]), FreeOp("probe")])
                time.sleep(0.1)
            assert c.step("up-a", [UnpinOp("pin")])[0].status == OpStatus.OK  # acknowledged, not published
            f.redis.restart()
            source_refused(c, "up-b", source, within_s=30)
    finally:
        f.stop()


def test_a_copy_left_by_a_move_neither_publishes_pins_nor_answers_reads(tmp_path):
    """A move stopped after IMPORT leaves the frozen copy on the source. (a) A fan-out Lookup has one hit for
    the pool and the sharded GetStats shows the serving copy. (b) The owner releases the pin; the old
    source restarts (announcing, it republishes its pools): its copy's stale pin must not overwrite the
    owner's in Redis, so a third shard refuses the released pin."""
    f = Fleet(tmp_path, "leftover", shards=("s0", "s1", "s2"))
    try:
        new_pool(f, "lo-a", on="s1")
        new_pool(f, "lo-c", on="s2")
        with f.client() as c:
            source = cache_and_pin(c, "lo-a")
            f.phase("s1", "lo-a", Phase.FREEZE, to_shard="s0")
            f.phase("s0", "lo-a", Phase.IMPORT, from_shard="s1")  # no DROP: s1 keeps its frozen copy
            assert f.owner("lo-a") == "s0" and f.shards["s1"].pools()["lo-a"].moving_to == "s0"
            hits = [h.pool_id for h in c.lookup(PROMPT).hits]
            assert hits.count("lo-a") == 1, hits
            assert c.get_stats().pools["lo-a"].moving_to == ""  # the serving copy, whichever shard answered last
        with f.client() as c:
            assert c.step("lo-a", [UnpinOp("pin")])[0].status == OpStatus.OK  # on s0, the owner
            source_refused(c, "lo-c", source, within_s=10)
            f.kill_and_restart("s1")
            assert "lo-a" in f.shards["s1"].pools()  # the leftover copy is still there (finish() drops it)
            assert source_refused(c, "lo-c", source, within_s=10) == 0
    finally:
        f.stop()


def test_an_import_after_the_move_was_thawed_takes_nothing_over(tmp_path):
    """The takeover (the shard map's MOVE script) requires the export the destination imported to still be
    waiting: a THAW deletes it first, and a new FREEZE replaces it, so a late IMPORT (its RPC failed on the
    network, the rebalancer thawed the source, the destination kept working) cannot take the pool over
    from the source that serves it again. On a real Redis: the script itself, at each of those moments."""
    import asyncio

    from kvservice.shards.shardmap import ShardMapStore

    redis = RedisServer(tmp_path / "redis")
    redis.start()

    async def run() -> list:
        store = ShardMapStore(redis.url, "late-import")
        try:
            assert await store.assign("pool", "s0", "t") == "s0"
            key = store.handoff_key("pool")
            await store.redis.set(key, b"export-1")  # FREEZE
            await store.redis.delete(key)  # THAW (the import read export-1 before)
            thawed = await store.move("pool", "s0", "s1", b"export-1")
            await store.redis.set(key, b"export-2")  # frozen again, exported anew
            stale = await store.move("pool", "s0", "s1", b"export-1")
            owner_then = (await store.load()).shard_of("pool")
            current = await store.move("pool", "s0", "s1", b"export-2")
            return [thawed, stale, owner_then, current, (await store.load()).shard_of("pool")]
        finally:
            await store.close()

    try:
        assert asyncio.run(run()) == [False, False, "s0", True, "s1"]
    finally:
        redis.stop()


def test_an_import_overtaken_by_a_thaw_on_real_shards_leaves_one_owner(fleet):
    """The same race on the shards themselves: Redis pauses writes (CLIENT PAUSE WRITE), so the destination's
    IMPORT reads the export and then waits on its journal write; meanwhile the source is THAWed (as the
    rebalancer does when the IMPORT's RPC failed); Redis resumes them in that order. The late takeover must
    be refused: one shard serves the pool, what the thawed source acknowledges is kept."""
    pool = "mv-late-import"
    src = new_pool(fleet, pool)
    dst = other(src)
    acked = Acked(pool)
    with fleet.client() as c:
        acked.add(c, 3, "before")
    fleet.phase(src, pool, Phase.FREEZE, to_shard=dst)
    outcome: dict[str, object] = {}

    def call(name: str, shard: str, **fields) -> None:
        try:
            outcome[name] = fleet.phase(shard, pool, getattr(Phase, name), **fields)
        except grpc.RpcError as err:
            outcome[name] = err.code()

    with fleet.redis.client() as r:
        r.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
    importer = threading.Thread(target=call, args=("IMPORT", dst), kwargs=dict(from_shard=src))
    importer.start()
    time.sleep(0.5)  # the import has read the export and waits on its journal write
    thawer = threading.Thread(target=call, args=("THAW", src))
    thawer.start()
    importer.join(60)
    thawer.join(60)
    assert not isinstance(outcome["THAW"], grpc.StatusCode), outcome
    assert outcome["IMPORT"] == grpc.StatusCode.FAILED_PRECONDITION, outcome
    assert fleet.owner(pool) == src
    with fleet.client() as c:
        acked.add(c, 3, "after-thaw")
    assert check(fleet, pool, acked) == []


# ---- an external pool's replay that answers without the gap ----------------------------------------------
def test_a_replay_that_answers_without_the_gap_still_resyncs_in_bounded_time(tmp_path):
    """A replay socket that answers but never brings the missing batch (its buffer is behind the live stream)
    is no progress: the held batches resync after `resync_after_s` (10 s) as an unanswered replay does, instead
    of holding the stream (and the index as of the gap) forever."""
    from tests.external_helpers import Publisher, chain, stored, wait_for

    pub = Publisher()
    server = start_server("--hash-block-size", "4", log_dir=tmp_path)
    try:
        with server.client(hash_block_size=4) as client:
            def ext():
                return client.get_stats().external_pools["vllm-0"]

            client.register_external_pool("vllm-0", pub.endpoint, pub.replay_endpoint, block_size=4)
            wait_for(lambda: ext().connected, what="subscription connected")
            a, b = list(range(9)), list(range(30, 39))
            seq = pub.publish(stored(chain(a), None, a[:8]))
            wait_for(lambda: ext().last_sequence >= seq, what="batch 0 applied")
            pub.drop(1)
            pub.publish(stored(chain(b), None, b[:8]))  # lost on the wire ...
            with pub._lock:
                pub.buffer.pop()  # ... and never in the replay buffer, which answers with batch 0 only
            seq = pub.publish(stored(chain(b), None, b[:8]))
            with pub._lock:
                pub.buffer.pop()
            wait_for(lambda: ext().last_sequence >= seq, timeout_s=40, what="the held batch applied after a resync")
            assert ext().resyncs == 1
            assert client.lookup(b).tokens("vllm-0") == 8
    finally:
        pub.close()
        server.stop()


# ---- a Redis outage without --require-persistence while a hot standby follows -------------------------------
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


@pytest.mark.slow
def test_random_kills_inside_moves_short(fleet):
    kinds, steps = random_kills(fleet, rounds=2, seed=7)
    assert sum(kinds.values()) == 2 and steps > 0

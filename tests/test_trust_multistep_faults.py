"""Faults inside multi-step operations (issue 22, item 10), on real processes: two shards on one real Redis,
each SIGKILLed and started again with the same command. A pool move is driven phase by phase (FREEZE,
IMPORT, DROP) with the source or the destination killed after each, then finished as an operator would (run
`kvservice shards move` again); a cross-shard transfer has either side killed while the source pin is held,
then is committed or aborted. After each: every acknowledged allocation holds the same blocks, exactly one
shard holds the pool, no block is held twice or leaked, no export is left in Redis, and the pool serves new
steps. What other shards read of a pool's pins is test_trust_shard_pins.py's; a Redis outage while a hot
standby follows, test_trust_outages.py's."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from kvservice.errors import KVServiceError
from kvservice.ops import AddRequestOp, AllocateOp, ExternalSource, FreeOp, OpStatus, PinOp, UnpinOp
from tests.shard_faults import NUM_BLOCKS, Acked, Fleet, Load, Phase, check, new_pool, other


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("multistep"))
    yield f
    f.stop()


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

"""What other shards read of a pool's pins, on real shards over one real Redis: a pin released while Redis was
away stops being a transfer source once it returns; a copy a stopped move left behind neither publishes pins
nor answers reads; an IMPORT that comes after the move was thawed takes nothing over (the shard map's MOVE
script on a real Redis, at each moment)."""

from __future__ import annotations

import time

from kvservice._proto import allocator_pb2 as pb
from kvservice.client import KVServiceClient
from kvservice.errors import KVServiceError, NotFound
from kvservice.ops import AddRequestOp, AllocateOp, ExternalSource, FreeOp, OpStatus, PinOp, UnpinOp
from tests.redis_helpers import RedisServer
from tests.shard_faults import Fleet, Phase, new_pool, other

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

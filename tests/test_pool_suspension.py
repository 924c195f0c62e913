"""Suspendable pools (a store's disk tier, `kvdisk:<name>`): registered bound to the store's session with
suspend_on_session_end, the pool is suspended, not retired, when that session ends: blocks, prefix index and
LRU order kept; no Lookup hit, no pin, no allocation (per-op FAILED_PRECONDITION), frees and unpins still
apply; registering it again at the same epoch resumes it. In process (exact ids and order, WAL replay and
snapshots), then on real server processes (a lapsed lease; an allocator SIGKILLed and restarted on Redis)."""

from __future__ import annotations

import signal
import time

import pytest

from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator import Allocator
from kvservice.blockstore.saves import admit_save, commit_save
from kvservice.client.index import PrefixIndex
from kvservice.commands import ExpireSessions, OpenSession, PoolSpec, StepRpc
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.core.state import export_manager_state
from kvservice.errors import FailedPrecondition, InvalidArgument
from kvservice.ops import AddRequestOp, AllocateOp, EvictBlocksOp, ForkOp, FreeOp, OpStatus, PinOp, UnpinOp
from kvservice.store import wal
from kvservice.store.snapshot import dump, load, state_digest
from kvservice.wire import decode, encode
from kvservice.wire.pool_spec import decode_pool_spec
from tests.allocator_helpers import InProcess
from tests.service_helpers import start_server
from tests.test_persistence import _STARTED, _stop_started_servers  # noqa: F401 - stops what a test started

BS = 4
POOL = "kvdisk:t"
LAYOUT = "kvservice-disk/v1;page_bytes=16"
CONFIG = KVCacheConfig(8, [FullAttentionSpec(BS)])  # pages 1..7 (0 is the null block)
A, B, C = list(range(1, 9)), list(range(101, 109)), list(range(201, 209))  # two whole blocks each


def disk_spec(epoch: int = 5, **kw) -> PoolSpec:
    kw.setdefault("bound_to_session", True)
    kw.setdefault("suspend_on_session_end", True)
    return PoolSpec(POOL, CONFIG, 64, kv_layout=LAYOUT, epoch=epoch, **kw)


def view(pool) -> tuple:
    """Everything suspension must leave alone: free queue order, references, the index, the requests, pins."""
    ms = export_manager_state(pool.manager)
    return (pool.epoch, ms.free_order.tolist(), ms.ref_cnts.tolist(), list(zip(ms.index_keys, ms.index_block_ids)),
            sorted(pool.requests), sorted(pool.pins))


def saved(engine: InProcess, save_id: str, prompt: list[int]) -> list[int]:
    """The save protocol (kvservice.blockstore.saves): the pages of the prompt's whole blocks, cached."""
    n = len(prompt) // BS * BS
    _, r = engine.step(POOL, admit_save(save_id, prompt, n))
    assert r.status == OpStatus.OK, r
    results = engine.step(POOL, commit_save(save_id, n))
    assert all(x.ok for x in results), results
    return r.new_block_ids[0][:n // BS]


def hit(allocator: Allocator, prompt: list[int]):
    return allocator.lookup("", prompt + [0], pool_ids=[POOL]).hits[POOL]


# ---- in process ------------------------------------------------------------------------------------
def test_a_suspended_pool_keeps_everything_but_answers_no_hit_and_takes_no_allocation():
    a = Allocator(hash_block_size=BS)
    store, engine = InProcess(a, "store"), InProcess(a, "engine")
    assert store.register(disk_spec()).new_epoch
    assert saved(engine, "a", A) == [1, 2] and saved(engine, "b", B) == [3, 4]
    (pin,) = engine.step(POOL, [PinOp("held", token_ids=A + [0])])
    assert pin.new_block_ids == ([1, 2],)
    engine.step(POOL, admit_save("c", C, 8))  # a save in flight when the store dies: pages 5, 6, 7
    pool = a.state.pools[POOL]
    before = view(pool)
    a.apply(ExpireSessions(["store"]), now=1.0)
    assert pool is a.state.pools[POOL] and pool.suspended and pool.bound_session == "store"
    assert view(pool) == before  # nothing evicted, nothing reordered, nothing freed
    assert (hit(a, A).num_cached_tokens, hit(a, A).suspended, hit(a, B).num_cached_tokens) == (0, True, 0)
    (stats,) = a.pool_stats(pool_ids=[POOL])
    assert stats.suspended and stats.epoch == 5 and stats.num_cached_blocks == 4 and stats.num_requests == 1

    refused = engine.step(POOL, [PinOp("p2", token_ids=B + [0]), AddRequestOp("d", token_ids=A),
                                 AllocateOp("c", num_computed_tokens=9, cache_tokens=8), ForkOp("c", "c2")])
    assert [(r.request_id, r.status) for r in refused] == [("p2", OpStatus.FAILED_PRECONDITION),
                                                         ("d", OpStatus.FAILED_PRECONDITION),
                                                         ("c", OpStatus.FAILED_PRECONDITION),
                                                         ("c2", OpStatus.FAILED_PRECONDITION)]
    assert "pool 'kvdisk:t' is suspended until its store re-attaches" in refused[0].message
    assert "epoch 5" in refused[0].message and "PinOp" in refused[0].message
    assert view(pool) == before

    released = engine.step(POOL, [UnpinOp("held"), FreeOp("c")])  # releasing still works
    assert all(r.ok for r in released)
    assert not pool.pins and not pool.requests and pool.manager.block_pool.get_num_free_blocks() == 7
    assert pool.num_cached_blocks() == 4 and pool.suspended  # the uncommitted save's pages hold nothing

    a.apply(ExpireSessions(["engine"]), now=2.0)  # another session's end: nothing happens to it
    assert pool is a.state.pools[POOL] and pool.suspended and pool.epoch == 5


def test_registering_again_at_the_same_epoch_resumes_it_with_the_same_pages():
    a = Allocator(hash_block_size=BS)
    store, engine = InProcess(a, "store"), InProcess(a, "engine")
    store.register(disk_spec())
    pages = saved(engine, "a", A)
    a.apply(ExpireSessions(["store"]), now=1.0)
    again = InProcess(a, "store-2")
    result = again.register(disk_spec())
    assert (result.epoch, result.new_epoch, result.num_requests_failed) == (5, False, 0)
    pool = a.state.pools[POOL]
    assert not pool.suspended and pool.bound_session == "store-2"
    assert hit(a, A).num_cached_tokens == 8 and not hit(a, A).suspended
    (pin,) = engine.step(POOL, [PinOp("p", token_ids=A + [0])])
    assert pin.new_block_ids == (pages,)  # no re-save: the same pages
    engine.step(POOL, [UnpinOp("p")])
    # A page whose file failed verification: the resumed store drops it.
    (evicted,) = again.step(POOL, [EvictBlocksOp([pages[1]])])
    assert evicted.ok and hit(a, A).num_cached_tokens == 4
    a.apply(ExpireSessions(["store-2"]), now=2.0)
    assert pool.suspended and pool.epoch == 5


def test_a_live_pool_registered_again_is_rebound_and_a_higher_epoch_replaces_it():
    a = Allocator(hash_block_size=BS)
    old, new, engine = InProcess(a, "old"), InProcess(a, "new"), InProcess(a, "engine")
    old.register(disk_spec())
    saved(engine, "a", A)
    new.register(disk_spec())  # a store restarted before its old lease lapsed
    pool = a.state.pools[POOL]
    assert pool.bound_session == "new" and not pool.suspended
    a.apply(ExpireSessions(["old"]), now=1.0)
    assert not pool.suspended and hit(a, A).num_cached_tokens == 8
    a.apply(ExpireSessions(["new"]), now=1.0)
    assert pool.suspended
    third = InProcess(a, "third")
    result = third.register(disk_spec(epoch=6))
    fresh = a.state.pools[POOL]
    assert result.new_epoch and fresh is not pool and fresh.epoch == 6
    assert not fresh.suspended and fresh.bound_session == "third" and fresh.num_cached_blocks() == 0


def test_a_plain_bound_pool_is_still_retired_beside_a_suspended_one():
    a = Allocator(hash_block_size=BS)
    store, engine = InProcess(a, "store"), InProcess(a, "engine")
    store.register(disk_spec())
    store.register(PoolSpec("kvstore:t", CONFIG, 64, kv_layout=LAYOUT, epoch=5, bound_to_session=True))
    saved(engine, "a", A)
    a.apply(ExpireSessions(["store"]), now=1.0)
    assert a.state.pools[POOL].suspended and a.state.pools[POOL].epoch == 5
    ram = a.state.pools["kvstore:t"]
    assert ram.epoch == 6 and not ram.suspended and not ram.bound_session


def test_suspend_needs_bound_to_session_and_the_same_flag_at_the_same_epoch():
    a = Allocator(hash_block_size=BS)
    store = InProcess(a, "store")
    with pytest.raises(InvalidArgument, match="suspend_on_session_end = True: .*set bound_to_session"):
        store.register(disk_spec(bound_to_session=False))
    store.register(disk_spec())
    with pytest.raises(FailedPrecondition, match="another config"):
        store.register(disk_spec(suspend_on_session_end=False))
    # Entries written before the field existed read as False.
    msg = encode.register_request(POOL, CONFIG, 64, 5, 1, True, 0, LAYOUT, "f", bound_to_session=True)
    assert not decode_pool_spec(msg, BS).suspend_on_session_end


class Wired:
    """One session whose commands are built from request bytes, as the servicer builds them, and journaled
    as the WAL journals them (`log`)."""

    def __init__(self, allocator: Allocator, session_id: str, log: list[bytes]) -> None:
        self.allocator, self.session_id, self.log, self.sequence = allocator, session_id, log, 0
        self.apply(OpenSession(session_id, ""))

    def apply(self, command, now: float = 0.0):
        applied = self.allocator.apply(command, now)
        if applied.mutated:
            self.log.append(wal.encode(command))
        return applied.reply

    def register(self, epoch: int = 5):
        self.sequence += 1
        msg = encode.register_request(POOL, CONFIG, 64, epoch, 1, True, 0, LAYOUT, self.allocator.fingerprint,
                                      bound_to_session=True, suspend_on_session_end=True)
        msg.session_id, msg.sequence = self.session_id, self.sequence
        return self.apply(decode.register_command(msg, msg.SerializeToString(), "", True, BS))

    def step(self, ops):
        self.sequence += 1
        msg = encode.step_request(POOL, ops)
        msg.session_id, msg.sequence = self.session_id, self.sequence
        raw = msg.SerializeToString()
        return self.apply(decode.step_command(StepRpc.STEP, pb.StepRequest.FromString(raw), raw, "", True))


def test_wal_replay_and_snapshots_give_the_same_suspended_state():
    leader, log = Allocator(hash_block_size=BS), []
    store, engine = Wired(leader, "store", log), Wired(leader, "engine", log)
    store.register()
    for save_id, prompt in (("a", A), ("b", B)):
        engine.step(admit_save(save_id, prompt, 8))
        engine.step(commit_save(save_id, 8))
    engine.step([PinOp("held", token_ids=B + [0])])
    store.apply(ExpireSessions(["store"]), now=1.0)
    assert leader.state.pools[POOL].suspended
    engine.step([PinOp("refused", token_ids=A + [0])])

    replica = Allocator(hash_block_size=BS)
    for raw in log:
        replica.apply(wal.decode(raw, BS), now=2.0)
    restored = Allocator(hash_block_size=BS)
    load(dump(leader), restored, now=2.0)
    for other in (replica, restored):
        pool = other.state.pools[POOL]
        assert pool.suspended and pool.bound_session == "store"
        assert view(pool) == view(leader.state.pools[POOL])
        assert state_digest(other) == state_digest(leader)
        other.apply(ExpireSessions(["engine"]), now=3.0)  # the pool's own session is gone: nothing happens
        assert pool.suspended and other.state.pools[POOL] is pool

    # Resumed by a new session on the snapshot-restored allocator and on the replica alike.
    leader.apply(ExpireSessions(["engine"]), now=3.0)
    again = Wired(leader, "store-2", log)
    assert again.register().new_epoch is False
    for other in (replica, restored):
        for raw in log[-2:]:  # OpenSession, RegisterPool
            other.apply(wal.decode(raw, BS), now=4.0)
        assert not other.state.pools[POOL].suspended and other.state.pools[POOL].bound_session == "store-2"
        assert state_digest(other) == state_digest(leader)
    assert hit(restored, A).num_cached_tokens == 8


def test_evict_blocks_drops_cached_unreferenced_pages_and_ignores_free_or_uncached_ids():
    """What a store sends right after resuming, for pages whose files failed verification (a plain pool)."""
    a = Allocator(hash_block_size=BS)
    engine = InProcess(a, "engine")
    engine.register(PoolSpec(POOL, CONFIG, 64, kv_layout=LAYOUT))
    assert saved(engine, "a", A) == [1, 2] and saved(engine, "b", B) == [3, 4]
    pool = a.state.pools[POOL]
    free_before = export_manager_state(pool.manager).free_order.tolist()
    (r,) = engine.step(POOL, [EvictBlocksOp([2])])
    assert r.ok and r.status == OpStatus.OK
    assert hit(a, A).num_cached_tokens == 4 and hit(a, B).num_cached_tokens == 8
    assert pool.num_cached_blocks() == 3 and pool.manager.block_pool.get_num_free_blocks() == 7
    assert export_manager_state(pool.manager).free_order.tolist() == free_before  # LRU order unchanged
    before = view(pool)
    (r,) = engine.step(POOL, [EvictBlocksOp([2, 6, 7])])  # evicted already; free and never cached
    assert r.ok and view(pool) == before and pool.manager.block_pool.num_evictions == 1


# ---- real server processes -------------------------------------------------------------------------
def serve(tmp_path, *args, **kw):
    proc = start_server("--hash-block-size", str(BS), "--session-ttl", "2", *args, log_dir=tmp_path, **kw)
    _STARTED.append(proc)
    return proc


def register(client):
    return client.register_pool(POOL, CONFIG, max_model_len=64, epoch=7, kv_layout=LAYOUT, bound_to_session=True,
                                suspend_on_session_end=True)


def save(engine, save_id: str, prompt: list[int]) -> list[int]:
    _, r = engine.step(POOL, admit_save(save_id, prompt, 8))
    assert r.ok, r
    assert all(x.ok for x in engine.step(POOL, commit_save(save_id, 8)))
    return r.new_block_ids[0][:2]


def wait_for(what, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def served_hit(client, prompt):
    return client.lookup(prompt + [0], pool_ids=[POOL]).hits[POOL]


def check_suspended(engine, num_cached: int) -> None:
    stats = engine.get_stats().pools[POOL]
    assert stats.suspended and stats.epoch == 7 and stats.num_cached_blocks == num_cached
    h = served_hit(engine, A)
    assert h.num_cached_tokens == 0 and h.suspended
    (pin,) = engine.step(POOL, [PinOp("refused", token_ids=A + [0])])
    assert pin.status == OpStatus.FAILED_PRECONDITION and "suspended until its store re-attaches" in pin.message


def resume_and_check(proc, engine, pages: list[int]) -> None:
    with proc.client(hash_block_size=BS, client_name="kvdisk-store-again") as store:
        result = register(store)
        assert result.epoch == 7 and not result.new_epoch
        assert not engine.get_stats().pools[POOL].suspended
        assert served_hit(engine, A).num_cached_tokens == 8
        (pin,) = engine.step(POOL, [PinOp("again", token_ids=A + [0])])
        assert pin.new_block_ids == (pages,)  # the same pages, no re-save
        engine.step(POOL, [UnpinOp("again")])


def test_a_disk_pool_is_suspended_when_its_store_lapses_and_resumed_at_the_same_epoch(tmp_path):
    proc = serve(tmp_path)
    store = proc.client(hash_block_size=BS, client_name="kvdisk-store", heartbeat=False)  # its lease lapses
    engine = proc.client(hash_block_size=BS, client_name="engine")
    register(store)
    pages = save(engine, "a", A)
    assert served_hit(engine, A).num_cached_tokens == 8
    with PrefixIndex(engine, refresh_s=0.1) as index:
        assert index.wait_synced(10)
        wait_for(lambda: index.lookup(A + [0], pool_ids=[POOL]).tokens(POOL) == 8)
        wait_for(lambda: engine.get_stats().pools[POOL].suspended)
        check_suspended(engine, 2)
        wait_for(lambda: index.lookup(A + [0], pool_ids=[POOL]).hits[POOL].suspended)
        assert index.lookup(A + [0], pool_ids=[POOL]).tokens(POOL) == 0
        resume_and_check(proc, engine, pages)
        wait_for(lambda: index.lookup(A + [0], pool_ids=[POOL]).tokens(POOL) == 8)
    store.close()
    engine.close()
    proc.stop()


@pytest.mark.parametrize("lapse", ["before_the_kill", "after_the_restart"])
def test_a_suspended_pool_survives_an_allocator_sigkill_on_redis(redis_server, tmp_path, lapse):
    """Killed with the pool suspended (then recovered from a snapshot taken at every entry), or with the store's
    session live (recovered from the WAL: the restored binding suspends the pool when the lease lapses)."""
    namespace = f"suspend-{lapse}"
    args = ("--redis-url", redis_server.url, "--redis-namespace", namespace,
            *(("--snapshot-every", "1") if lapse == "before_the_kill" else ()))
    proc = serve(tmp_path, *args, persistence=True)
    store = proc.client(hash_block_size=BS, client_name="kvdisk-store", heartbeat=lapse == "before_the_kill")
    engine = proc.client(hash_block_size=BS, client_name="engine", retries=0, timeout_s=5)
    register(store)
    pages = save(engine, "a", A)
    if lapse == "before_the_kill":
        store.close()  # ends its heartbeats; the lease lapses
        wait_for(lambda: engine.get_stats().pools[POOL].suspended)
        check_suspended(engine, 2)  # its refused PinOp is journaled after the suspension
    before = engine.stub.GetStats(pb.GetStatsRequest(include_state_digest=True), timeout=10).state_digest
    port = int(proc.target.rsplit(":", 1)[1])
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    engine.close()
    store.close()
    proc = serve(tmp_path, *args, persistence=True, port=port)
    with proc.client(hash_block_size=BS, client_name="engine-after") as engine:
        after = engine.stub.GetStats(pb.GetStatsRequest(include_state_digest=True), timeout=10).state_digest
        assert after == before
        wait_for(lambda: engine.get_stats().pools[POOL].suspended)  # the old store session's lease restarted
        check_suspended(engine, 2)
        resume_and_check(proc, engine, pages)
    proc.stop()

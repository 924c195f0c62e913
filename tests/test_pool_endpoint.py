"""A pool's transport endpoint (RegisterPoolRequest.endpoint: a store's NIXL agent metadata, a capability):
handed only to the pool's tenant (PoolStats.endpoint), never to another tenant by any RPC; an admin of
another tenant sees its size only. Registering again at the same epoch replaces it and nothing else. In
process (WAL replay and snapshots agree), then on real servers (two tenants and an admin; SIGKILL and a
restart on Redis)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator import Allocator
from kvservice.client.base import merge_stats
from kvservice.client.index import PrefixIndex
from kvservice.commands import ImportPool, OpenSession, StepRpc
from kvservice.core.state import export_manager_state
from kvservice.errors import InvalidArgument, NotFound, PermissionDenied
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp, OpStatus
from kvservice.results import PoolStats, Stats
from kvservice.store import wal
from kvservice.store.snapshot import dump, export_pool, import_pool, load, state_digest
from kvservice.wire import decode, encode
from kvservice.wire.limits import MAX_ENDPOINT_BYTES
from kvservice.wire.pool_spec import decode_pool_spec
from tests.service_helpers import small_config, start_server
from tests.test_persistence import _STARTED, _stop_started_servers  # noqa: F401 - stops what a test started

POOL = "kvstore:a"
CONFIG = small_config(16, 16)  # blocks 1..15 (0 is the null block)
PROMPT = list(range(64))  # four whole blocks
AGENT_1 = b"\x00nixl-agent-1 metadata\xff" * 40
AGENT_2 = b"\x00nixl-agent-2 metadata\xff" * 50
TOKENS = "tok-a tenant-a\ntok-b tenant-b\ntok-admin ops admin\n"


def view(pool) -> tuple:
    """What a new endpoint must leave alone: epoch, free queue order, references, the index, the requests."""
    ms = export_manager_state(pool.manager)
    return (pool.epoch, ms.free_order.tolist(), ms.ref_cnts.tolist(), list(zip(ms.index_keys, ms.index_block_ids)),
            sorted(pool.requests))


# ---- in process ------------------------------------------------------------------------------------
class Wired:
    """One session whose commands are built from request bytes, as the servicer builds them, and journaled
    as the WAL journals them (`log`)."""

    def __init__(self, allocator: Allocator, session_id: str, tenant: str, log: list[bytes]) -> None:
        self.allocator, self.session_id, self.tenant, self.log, self.sequence = allocator, session_id, tenant, log, 0
        self.apply(OpenSession(session_id, tenant, admin=False))

    def apply(self, command):
        applied = self.allocator.apply(command, 0.0)
        if applied.mutated:
            self.log.append(wal.encode(command))
        return applied.reply

    def register(self, endpoint: bytes, epoch: int = 3):
        self.sequence += 1
        msg = encode.register_request(POOL, CONFIG, 256, epoch, 1, True, 0, "", self.allocator.fingerprint,
                                      endpoint=endpoint)
        msg.session_id, msg.sequence = self.session_id, self.sequence
        return self.apply(decode.register_command(msg, msg.SerializeToString(), self.tenant, False, 16))

    def step(self, ops):
        self.sequence += 1
        msg = encode.step_request(POOL, ops)
        msg.session_id, msg.sequence = self.session_id, self.sequence
        raw = msg.SerializeToString()
        return self.apply(decode.step_command(StepRpc.STEP, pb.StepRequest.FromString(raw), raw, self.tenant, False))


def test_the_same_epoch_replaces_only_the_endpoint_and_replay_and_snapshots_agree():
    leader, log = Allocator(), []
    store, engine = Wired(leader, "store", "tenant-a", log), Wired(leader, "engine", "tenant-a", log)
    assert store.register(AGENT_1).new_epoch
    engine.step([AddRequestOp("cached", token_ids=PROMPT), AllocateOp("cached", num_new_tokens=64),
                 FreeOp("cached"), AddRequestOp("live", token_ids=PROMPT + [7]), AllocateOp("live", num_new_tokens=65)])
    pool = leader.state.pools[POOL]
    before = view(pool)
    again = store.register(AGENT_2)  # the store's agent restarted: same pages, new metadata
    assert (again.epoch, again.new_epoch, again.num_requests_failed) == (3, False, 0)
    assert leader.state.pools[POOL] is pool and view(pool) == before and pool.spec.endpoint == AGENT_2
    (stats,) = leader.pool_stats("tenant-a", admin=False)
    assert (stats.endpoint, stats.endpoint_size, stats.num_requests) == (AGENT_2, len(AGENT_2), 1)
    (seen,) = leader.pool_stats("ops", admin=True)  # an admin of another tenant: that it exists, not the bytes
    assert (seen.endpoint, seen.endpoint_size) == (b"", len(AGENT_2))
    assert leader.pool_stats("tenant-b", admin=False) == []

    replica = Allocator()
    for raw in log:
        replica.apply(wal.decode(raw, 16), 1.0)
    restored = Allocator()
    load(dump(leader), restored, now=1.0)
    for other in (replica, restored):
        assert other.state.pools[POOL].spec.endpoint == AGENT_2
        assert view(other.state.pools[POOL]) == before and state_digest(other) == state_digest(leader)
    moved = Allocator()  # a pool moved to another shard (rebalance) takes it along
    moved.apply(ImportPool(POOL, export_pool(leader, POOL), import_pool), 1.0)
    assert moved.state.pools[POOL].spec.endpoint == AGENT_2 and view(moved.state.pools[POOL]) == before
    assert store.register(b"").new_epoch is False and pool.spec.endpoint == b""  # withdrawn, nothing else


def test_an_entry_without_an_endpoint_reads_as_none_and_its_size_is_bounded():
    msg = encode.register_request(POOL, CONFIG, 256, 3, 1, True, 0, "", "f")  # as written before the field
    assert decode_pool_spec(msg, 16).endpoint == b""
    msg.endpoint = b"m" * MAX_ENDPOINT_BYTES
    assert decode_pool_spec(msg, 16).endpoint == msg.endpoint
    msg.endpoint = b"m" * (MAX_ENDPOINT_BYTES + 1)
    with pytest.raises(InvalidArgument, match=f"endpoint = {MAX_ENDPOINT_BYTES + 1}: .* limit of 65536") as err:
        decode_pool_spec(msg, 16)
    assert err.value.field == "endpoint"


def test_the_sharded_merge_keeps_each_pools_endpoint():
    def stats(pool_id: str, endpoint: bytes) -> Stats:
        pool = PoolStats(pool_id, 1, 16, 15, 0.0, 0, 0.0, 0, 0, 0, 0, "", endpoint=endpoint,
                         endpoint_size=len(endpoint))
        return Stats({pool_id: pool}, 1, "off", 0, 0, "f", 16)

    merged = merge_stats([stats("kvstore:a", AGENT_1), stats("kvstore:b", AGENT_2)])
    assert {p: s.endpoint for p, s in merged.pools.items()} == {"kvstore:a": AGENT_1, "kvstore:b": AGENT_2}


# ---- real server processes -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("endpoint-tokens") / "tokens"
    path.write_text(TOKENS)
    return path


def test_only_the_pools_tenant_is_handed_its_endpoint(tokens, tmp_path):
    proc = start_server("--token-file", str(tokens), log_dir=tmp_path)
    _STARTED.append(proc)
    a, b, admin = proc.client("tok-a"), proc.client("tok-b"), proc.client("tok-admin")
    a.register_pool(POOL, CONFIG, max_model_len=256, epoch=3, endpoint=AGENT_1)
    a.step(POOL, [AddRequestOp("cached", token_ids=PROMPT), AllocateOp("cached", num_new_tokens=64),
                  FreeOp("cached")])
    mine = a.get_stats().pools[POOL]
    assert (mine.endpoint, mine.endpoint_size, mine.num_cached_blocks) == (AGENT_1, len(AGENT_1), 4)
    with PrefixIndex(a, refresh_s=0.1) as index:  # an engine's replica of the index carries it too
        assert index.pool_stats(POOL).endpoint == AGENT_1

    # Another tenant: not listed, and no RPC that names the pool answers (so none can carry the endpoint).
    assert POOL not in b.get_stats().pools and POOL not in b.get_stats(pool_ids=[POOL]).pools
    assert [h.pool_id for h in b.lookup(PROMPT).hits] == []
    for attempt in (lambda: b.lookup(PROMPT, pool_ids=[POOL]), lambda: b.get_request(POOL, "cached"),
                    lambda: next(iter(b.watch_events([POOL], timeout_s=5)))):
        with pytest.raises(NotFound, match="'kvstore:a' is not registered"):
            attempt()
    with pytest.raises(PermissionDenied, match="belongs to another tenant"):  # nor put its own agent there
        b.register_pool(POOL, CONFIG, max_model_len=256, epoch=3, endpoint=b"rogue agent")

    # An admin of another tenant sees the pool and that it has an endpoint, never the bytes (invariant
    # checks and `kvservice status` alike); its own tenant's pool's, it does see.
    for checked in (False, True):
        seen = admin.get_stats(check_invariants=checked).pools[POOL]
        assert (seen.endpoint, seen.endpoint_size, seen.invariant_violation) == (b"", len(AGENT_1), "")
    admin.register_pool("kvstore:ops", CONFIG, max_model_len=256, endpoint=b"ops agent")
    assert admin.get_stats().pools["kvstore:ops"].endpoint == b"ops agent"
    status = subprocess.run([sys.executable, "-m", "kvservice.cli", "status", "--target", proc.target,
                             "--token", "tok-admin"], capture_output=True, timeout=60)
    assert status.returncode == 0 and POOL.encode() in status.stdout, status.stderr
    assert b"nixl-agent" not in status.stdout + status.stderr

    # The store's agent restarted: the same epoch with new metadata; its pages stay, nothing fails.
    again = a.register_pool(POOL, CONFIG, max_model_len=256, epoch=3, endpoint=AGENT_2)
    assert (again.epoch, again.new_epoch, again.num_requests_failed) == (3, False, 0)
    after = a.get_stats().pools[POOL]
    assert (after.endpoint, after.epoch, after.num_cached_blocks, after.num_free_blocks) == (AGENT_2, 3, 4, 15)
    r = a.step(POOL, [AddRequestOp("hit", token_ids=PROMPT + [9]), AllocateOp("hit", num_new_tokens=65)])
    assert r[1].status == OpStatus.OK and r[1].num_computed_tokens == 64

    with pytest.raises(InvalidArgument, match=f"endpoint = {MAX_ENDPOINT_BYTES + 1}: ") as err:
        a.register_pool(POOL, CONFIG, max_model_len=256, epoch=3, endpoint=b"m" * (MAX_ENDPOINT_BYTES + 1))
    assert err.value.field == "endpoint" and a.get_stats().pools[POOL].endpoint == AGENT_2
    for c in (a, b, admin):
        c.close()
    proc.stop()


@pytest.mark.parametrize("recovered_from", ["wal", "snapshot"])
def test_the_endpoint_survives_an_allocator_sigkill_on_redis(redis_server, tokens, tmp_path, recovered_from):
    args = ("--token-file", str(tokens), "--redis-url", redis_server.url, "--redis-namespace",
            f"endpoint-{recovered_from}", *(("--snapshot-every", "1") if recovered_from == "snapshot" else ()))
    proc = start_server(*args, persistence=True, log_dir=tmp_path)
    _STARTED.append(proc)
    with proc.client("tok-a") as a:
        a.register_pool(POOL, CONFIG, max_model_len=256, epoch=3, endpoint=AGENT_1)
        a.step(POOL, [AddRequestOp("cached", token_ids=PROMPT), AllocateOp("cached", num_new_tokens=64),
                      FreeOp("cached")])
        a.register_pool(POOL, CONFIG, max_model_len=256, epoch=3, endpoint=AGENT_2)
    with proc.client("tok-admin") as admin:
        before = admin.stub.GetStats(pb.GetStatsRequest(include_state_digest=True), timeout=10,
                                     metadata=admin.metadata).state_digest
    port = int(proc.target.rsplit(":", 1)[1])
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    proc = start_server(*args, persistence=True, log_dir=tmp_path, port=port)
    _STARTED.append(proc)
    with proc.client("tok-admin") as admin, proc.client("tok-a") as a:
        after = admin.stub.GetStats(pb.GetStatsRequest(include_state_digest=True), timeout=10,
                                    metadata=admin.metadata).state_digest
        assert after == before
        stats = a.get_stats().pools[POOL]
        assert (stats.endpoint, stats.epoch, stats.num_cached_blocks) == (AGENT_2, 3, 4)
        assert admin.get_stats().pools[POOL].endpoint == b""
    proc.stop()

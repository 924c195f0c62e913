"""Crash-exact recovery against a real Redis and real server processes."""

import random
import signal
import threading
import time

import grpc
import pytest

from kvservice._proto import allocator_pb2 as pb
from kvservice.client.routing import open_channel
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.errors import Code, KVServiceError, Unavailable
from kvservice.ops import AddRequestOp, AdmitBatchOp, AllocateOp, ForkOp, FreeOp, OpStatus
from tests.external_helpers import wait_for
from tests.service_helpers import start_server

CONFIG = KVCacheConfig(257, [FullAttentionSpec(16)])


_STARTED = []


@pytest.fixture(autouse=True)
def _stop_started_servers():
    """Whatever a test started is stopped, even when it fails half-way."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(10)


def allocator(redis_server, namespace, tmp_path, *args, port=0):
    proc = start_server("--redis-url", redis_server.url, "--redis-namespace", namespace, *args, port=port,
                        persistence=True, log_dir=tmp_path)
    _STARTED.append(proc)
    return proc


def digest(client) -> str:
    return client.stub.GetStats(pb.GetStatsRequest(include_state_digest=True), timeout=10).state_digest


def stats(client):
    return client.stub.GetStats(pb.GetStatsRequest(check_invariants=True), timeout=10)


def kill(proc):
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)


class Crashy:
    """Runs client calls against an allocator that a timer SIGKILLs at random moments; a call that
    fails because of the kill is retried, unchanged (same sequence), once the allocator is back."""

    def __init__(self, redis_server, namespace, tmp_path, *args):
        self.spawn = lambda port=0: allocator(redis_server, namespace, tmp_path, *args, port=port)
        self.proc = self.spawn()
        self.port = int(self.proc.target.rsplit(":", 1)[1])
        self.client = self.proc.client(retries=0, timeout_s=5)
        self.restarts = 0
        self.retried_steps = 0

    def call(self, fn, *args, step=False):
        while True:
            try:
                return fn(*args)
            except KVServiceError as exc:
                assert exc.code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED), exc
                assert self.proc.proc.wait(10) is not None  # only the kill makes calls fail
                self.proc = self.spawn(self.port)
                # The channel may still be backing off from the refused reconnects during the restart
                # (it would fail the next call with the stale error): go on once it is connected again.
                grpc.channel_ready_future(self.client.channel).result(timeout=30)
                self.restarts += 1
                self.retried_steps += step


class Model:
    """What the client saw acknowledged: every live request's table and token count."""

    def __init__(self, crashy, pool):
        self.c, self.pool = crashy, pool
        self.tables: dict[str, tuple] = {}
        self.tokens: dict[str, int] = {}

    def step(self, ops):
        return self.c.call(self.c.client.step, self.pool, ops, step=True)

    def record(self, rid):
        info = self.c.call(self.c.client.get_request, self.pool, rid)
        self.tables[rid], self.tokens[rid] = info.block_ids, info.num_tokens

    def check(self):
        for rid, table in self.tables.items():
            info = self.c.call(self.c.client.get_request, self.pool, rid)
            assert info.block_ids == table, f"{rid}: {info.block_ids} != acknowledged {table}"
            assert info.num_tokens == self.tokens[rid]


def random_op(rng, model, n):
    live = sorted(model.tables)
    kind = rng.choices(["add", "decode", "fork", "free"], [3, 5, 1, 2])[0] if live else "add"
    if kind == "add":
        rid = f"r{n}"
        prompt = [rng.randrange(3)] * 32 + [rng.randrange(5000) for _ in range(rng.randint(1, 60))]
        if rng.random() < 0.5:  # the packed admission: replayed from the WAL like the pair
            return "admit", rid, [AdmitBatchOp([rid], [prompt])]
        return kind, rid, [AddRequestOp(rid, token_ids=prompt), AllocateOp(rid, num_new_tokens=len(prompt))]
    rid = rng.choice(live)
    if kind == "decode":
        return kind, rid, [AllocateOp(rid, num_computed_tokens=model.tokens[rid], num_new_tokens=1,
                                      append_token_ids=[rng.randrange(5000)])]
    if kind == "fork":
        return kind, rid, [ForkOp(rid, f"{rid}.f{n}")]
    return kind, rid, [FreeOp(rid)]


def apply_ack(model, kind, rid, ops, result):
    """Updates the model from an acknowledged step and checks it happened exactly once."""
    if kind in ("add", "admit"):
        added, allocated = ((result[0].status, result[1].status) if kind == "add" else
                            (OpStatus.OK if result[0].batch.status(0) != OpStatus.ALREADY_EXISTS else None,
                             result[0].batch.status(0)))
        assert added == OpStatus.OK, result[0]  # never ALREADY_EXISTS: applied once
        if allocated == OpStatus.OK:
            model.record(rid)
        else:
            model.step([FreeOp(rid)])
    elif kind == "decode":
        if result[0].status == OpStatus.OK:
            assert result[0].num_tokens == model.tokens[rid] + 1  # appended exactly once
            model.record(rid)
        else:
            assert result[0].status == OpStatus.NO_SPACE
            model.step([FreeOp(rid)])
            del model.tables[rid], model.tokens[rid]
    elif kind == "fork":
        assert result[0].status == OpStatus.OK, result[0]
        model.record(ops[0].child_request_id)
        model.record(rid)
    else:
        assert result[0].status == OpStatus.OK, result[0]
        del model.tables[rid], model.tokens[rid]


def test_crash_loop_every_acknowledged_allocation_survives(redis_server, tmp_path):
    rng = random.Random(7)
    crashy = Crashy(redis_server, "crash", tmp_path, "--snapshot-every", "40")
    crashy.client.register_pool("p", CONFIG, max_model_len=2048)
    model = Model(crashy, "p")
    probe = [0] * 32 + [9, 9]
    n = 0
    for _ in range(20):
        restarts = crashy.restarts
        timer = threading.Timer(rng.uniform(0.05, 0.6), kill, args=(crashy.proc,))
        timer.start()
        while crashy.restarts == restarts:  # ops until the kill hits one of them (and it is retried)
            n += 1
            kind, rid, ops = random_op(rng, model, n)
            apply_ack(model, kind, rid, ops, model.step(ops))
        timer.join()
        model.check()
        s = crashy.call(stats, crashy.client).pools[0]
        assert s.invariant_violation == "", s.invariant_violation
        held = {b for table in model.tables.values() for b in table[0]}
        assert s.num_free_blocks == 256 - len(held)
    assert crashy.restarts == 20 and crashy.retried_steps >= 5
    assert crashy.client.lookup(probe).tokens("p") == 32  # the shared 32-token prefix is still cached
    crashy.client.free("p", *sorted(model.tables))
    s = stats(crashy.client).pools[0]
    assert s.num_free_blocks == 256 and s.num_requests == 0 and s.invariant_violation == ""
    crashy.client.close()
    crashy.proc.stop()


def test_restart_is_block_for_block_and_leases_restart(redis_server, tmp_path):
    proc = allocator(redis_server, "exact", tmp_path, "--snapshot-every", "7")
    client = proc.client()
    client.register_pool("p", CONFIG, max_model_len=2048)
    for i in range(25):
        frees = [FreeOp(f"r{i - 3}")] if i >= 3 and i % 2 else []
        client.step("p", [AddRequestOp(f"r{i}", token_ids=list(range(i, i + 50))),
                          AllocateOp(f"r{i}", num_new_tokens=50), *frees])
    client.fork("p", "r4", "r4-child")
    before = digest(client)
    kill(proc)
    proc = allocator(redis_server, "exact", tmp_path)
    client = proc.client()
    assert digest(client) == before
    s = client.stub.GetStats(pb.GetStatsRequest(), timeout=5)
    assert s.num_sessions == 1 and s.persistence == "ok"
    proc.stop()


def test_redis_outage_degraded_then_resynced(redis_server, tmp_path):
    proc = allocator(redis_server, "outage", tmp_path)
    client = proc.client(retries=0)
    client.register_pool("p", CONFIG, max_model_len=2048)
    client.step("p", [AddRequestOp("before", token_ids=list(range(40))), AllocateOp("before", num_new_tokens=40)])
    redis_server.kill()
    try:
        deadline = time.monotonic() + 10
        while stats(client).persistence != "degraded" and time.monotonic() < deadline:
            client.step("p", [AddRequestOp(f"probe{time.monotonic_ns()}", token_ids=[1])])
            time.sleep(0.1)
        assert stats(client).persistence == "degraded"
        r = client.step("p", [AddRequestOp("during", token_ids=list(range(100, 140))),
                              AllocateOp("during", num_new_tokens=40)])
        assert r[1].status == OpStatus.OK  # served from memory
    finally:
        redis_server.restart()
    deadline = time.monotonic() + 15
    while stats(client).persistence != "ok" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats(client).persistence == "ok"  # (only once the resync snapshot committed)
    before = digest(client)
    kill(proc)
    proc = allocator(redis_server, "outage", tmp_path)
    client = proc.client()
    assert digest(client) == before  # acknowledged while degraded, covered by the resync snapshot
    assert client.get_request("p", "during").num_tokens == 40
    proc.stop()


def test_require_persistence_refuses_while_redis_is_down(redis_server, tmp_path):
    proc = allocator(redis_server, "strict", tmp_path, "--require-persistence")
    client = proc.client(retries=0)
    client.register_pool("p", CONFIG, max_model_len=2048)
    client.step("p", [AddRequestOp("a", token_ids=list(range(40))), AllocateOp("a", num_new_tokens=40)])
    acked = digest(client)
    redis_server.kill()
    try:
        refused = 0
        for _ in range(20):  # the same request, as a client retries an unacknowledged one
            try:
                client.step("p", [AddRequestOp("x", token_ids=[1, 2, 3])])
            except Unavailable:
                refused += 1
            time.sleep(0.1)
        assert refused >= 15
        assert stats(client).persistence == "down"
    finally:
        redis_server.restart()
    deadline = time.monotonic() + 15
    while stats(client).persistence != "ok" and time.monotonic() < deadline:
        time.sleep(0.2)
    kill(proc)
    proc = allocator(redis_server, "strict", tmp_path, "--require-persistence")
    c2 = proc.client()
    assert c2.get_request("p", "a").num_tokens == 40  # nothing acknowledged was lost
    del acked
    client.close()
    proc.stop()


def test_a_second_allocator_fences_the_first(redis_server, tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    first = allocator(redis_server, "fence", tmp_path)
    c1 = first.client(retries=0)
    c1.register_pool("p", CONFIG, max_model_len=2048)
    c1.step("p", [AddRequestOp("a", token_ids=list(range(40))), AllocateOp("a", num_new_tokens=40)])
    second = allocator(redis_server, "fence", tmp_path)
    c2 = second.client()
    assert c2.get_request("p", "a").num_tokens == 40  # took over the state
    with pytest.raises(KVServiceError) as info:
        for _ in range(30):
            c1.step("p", [AddRequestOp(f"zombie{time.monotonic_ns()}", token_ids=[1])])
            time.sleep(0.1)
    assert info.value.code in (Code.UNAVAILABLE,)
    assert first.proc.wait(15) == 3  # a fenced allocator exits
    with open_channel(second.target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(KVServiceError):
        c2.get_request("p", "zombie")  # nothing the zombie tried reached the state
    second.stop()


def test_stale_recovery_bumps_the_pool_epoch(redis_server, tmp_path):
    proc = allocator(redis_server, "stale", tmp_path)
    port = int(proc.target.rsplit(":", 1)[1])
    client = proc.client(retries=0)
    client.register_pool("p", CONFIG, max_model_len=2048, epoch=1)
    client.step("p", [AddRequestOp("a", token_ids=list(range(40))), AllocateOp("a", num_new_tokens=40)])
    redis_server.kill()
    try:
        deadline = time.monotonic() + 10
        while stats(client).persistence != "degraded" and time.monotonic() < deadline:
            time.sleep(0.1)
        # Acknowledged from memory, never persisted: then the allocator dies before Redis returns.
        client.step("p", [AddRequestOp("b", token_ids=list(range(500, 540))), AllocateOp("b", num_new_tokens=40)])
        kill(proc)
    finally:
        redis_server.restart()
    proc = allocator(redis_server, "stale", tmp_path, port=port)
    reply = client.open_session(resume=True)
    assert list(reply.pools_failed) == ["p"]  # the client saw more than the server recovered
    r = client.step("p", [AllocateOp("a", num_computed_tokens=40, num_new_tokens=1, append_token_ids=[1])])
    assert r[0].status == OpStatus.EPOCH_CHANGED
    s = stats(client).pools[0]
    assert s.epoch == 2 and s.num_free_blocks == 256 and s.invariant_violation == ""
    proc.stop()


def test_snapshots_keep_redis_bounded(redis_server, tmp_path):
    proc = allocator(redis_server, "bounded", tmp_path, "--snapshot-every", "100")
    client = proc.client()
    client.register_pool("p", CONFIG, max_model_len=4096)
    r = redis_server.client()
    sizes = []
    for round_ in range(4):
        written = stats(client).snapshots_written
        for i in range(300):
            rid = f"r{round_}-{i}"
            client.step("p", [AddRequestOp(rid, token_ids=list(range(i, i + 64))), AllocateOp(rid, num_new_tokens=64),
                              FreeOp(rid)])
        # The standby snapshotter writes one (or more) for the round's 300 entries and trims the WAL behind it, as
        # fast as the machine lets it.
        wait_for(lambda w=written: stats(client).snapshots_written > w and r.xlen("bounded:wal") <= 400, 60, 0.1,
                 what="a snapshot of the round, the WAL trimmed behind it")
        sizes.append((r.xlen("bounded:wal"), r.strlen("bounded:snapshot")))
    assert all(wal <= 400 for wal, _ in sizes), sizes  # trimmed behind each snapshot
    assert sizes[-1][1] < 2 * sizes[0][1] + 4096, sizes  # the snapshot does not grow with history
    assert stats(client).snapshots_written >= 4  # one at least every ~300 entries (they may overlap runs)
    proc.stop()


def test_corrupt_or_foreign_snapshot_is_refused(redis_server, tmp_path):
    proc = allocator(redis_server, "corrupt", tmp_path, "--snapshot-every", "1")
    client = proc.client()
    client.register_pool("p", CONFIG, max_model_len=2048)
    client.step("p", [AddRequestOp("a", token_ids=list(range(40))), AllocateOp("a", num_new_tokens=40)])
    r = redis_server.client()
    # The standby snapshotter writes it (after every entry here): however long a loaded machine makes that.
    wait_for(lambda: r.get("corrupt:snapshot") is not None, 60, what="a snapshot")
    proc.stop()
    good = r.get("corrupt:snapshot")
    assert good
    with pytest.raises(RuntimeError, match="hash spec"):
        allocator(redis_server, "corrupt", tmp_path, "--hash-seed", "someone-else")
    r.set("corrupt:snapshot", good[:-10] + b"0123456789")
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        allocator(redis_server, "corrupt", tmp_path)
    r.set("corrupt:snapshot", b"not a snapshot at all")
    with pytest.raises(RuntimeError, match="bad magic"):
        allocator(redis_server, "corrupt", tmp_path)
    r.set("corrupt:snapshot", good)
    proc = allocator(redis_server, "corrupt", tmp_path)
    assert proc.client().get_request("p", "a").num_tokens == 40
    proc.stop()


def test_embedded_default_survives_kill_9(tmp_path):
    data = tmp_path / "data"
    proc = start_server("--data-dir", str(data), persistence=True, log_dir=tmp_path)
    _STARTED.append(proc)
    client = proc.client()
    client.register_pool("p", CONFIG, max_model_len=2048)
    client.step("p", [AddRequestOp("a", token_ids=list(range(40))), AllocateOp("a", num_new_tokens=40)])
    before = digest(client)
    redis_pid = int((data / "redis.pid").read_text())
    kill(proc)
    proc = start_server("--data-dir", str(data), persistence=True, log_dir=tmp_path)
    _STARTED.append(proc)
    client = proc.client()
    assert digest(client) == before
    new_pid = int((data / "redis.pid").read_text())
    assert new_pid != redis_pid or _alive(redis_pid)  # replaced (the orphan exited) or adopted
    proc.stop()
    deadline = time.monotonic() + 10
    while _alive(new_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(new_pid)  # stopped with the allocator


def _alive(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

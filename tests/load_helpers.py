"""Load and fault-injection building blocks shared by the persistence tests, the fault tests and the soak
(`make soak`): a supervisor that kills and restarts a real allocator, and load clients that remember
exactly what the allocator acknowledged to them."""

from __future__ import annotations

import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvservice._proto import allocator_pb2 as pb
from kvservice.errors import Code, KVServiceError
from kvservice.ops import AddRequestOp, AllocateOp, ForkOp, FreeOp, OpStatus
from tests.service_helpers import ServerProcess, start_server

TRANSIENT = (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED)


class Supervisor:
    """One allocator process on a fixed port; `kill()` SIGKILLs it and starts a new one (what an
    operator's restart loop does), while clients keep retrying."""

    def __init__(self, args: tuple[str, ...], log_dir: Path, persistence: bool = True) -> None:
        self.args, self.log_dir, self.persistence = args, log_dir, persistence
        self.proc: ServerProcess = start_server(*args, persistence=persistence, log_dir=log_dir)
        self.port = int(self.proc.target.rsplit(":", 1)[1])
        self.target = self.proc.target
        self.generation = 0
        self.up = threading.Event()
        self.up.set()
        self.lock = threading.Lock()
        self.kills = 0

    def kill(self, before_restart=None) -> None:
        """SIGKILL, then (after `before_restart()`, e.g. bringing Redis back) a new allocator on the port."""
        with self.lock:
            self.up.clear()
            self.proc.proc.send_signal(signal.SIGKILL)
            self.proc.proc.wait(10)
            self.kills += 1
            if before_restart is not None:
                before_restart()
            self.proc = self._restart()
            self.generation += 1
            self.up.set()

    def _restart(self, timeout_s: float = 10.0) -> ServerProcess:
        """On the same port; a forked snapshot child of the killed one may hold it for a moment (it gets the
        parent-death signal)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return start_server(*self.args, port=self.port, persistence=self.persistence, log_dir=self.log_dir)
            except RuntimeError as exc:
                if "is in use" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def wait_up(self, timeout_s: float = 60.0) -> None:
        if not self.up.wait(timeout_s):
            raise TimeoutError("the allocator did not come back")

    def stop(self) -> None:
        self.proc.stop()


@dataclass
class LoadClient:
    """A session that issues random mixed ops and remembers every acknowledged table."""

    supervisor: Supervisor
    pool: str
    seed: int
    token: str | None = None
    timeout_s: float = 5.0
    tables: dict[str, tuple] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    ops: int = 0
    retries: int = 0

    def __post_init__(self) -> None:
        self.client = self.supervisor.proc.client(self.token, retries=0, timeout_s=self.timeout_s)
        self.rng = random.Random(self.seed)
        self.n = 0

    def call(self, fn, *args, timed: bool = False):
        """Retries transient failures with the same arguments (for mutations: the same sequence, so an
        applied one is answered from the server's stored reply)."""
        while True:
            start = time.perf_counter()
            try:
                result = fn(*args)
                if timed:
                    self.latencies.append(time.perf_counter() - start)
                return result
            except KVServiceError as exc:
                if exc.code not in TRANSIENT:
                    raise
                self.retries += 1
                time.sleep(0.05)
                self.supervisor.wait_up()

    def step(self, ops):
        return self.call(self.client.step, self.pool, ops, timed=True)

    def record(self, rid: str) -> None:
        info = self.call(self.client.get_request, self.pool, rid)
        self.tables[rid], self.tokens[rid] = info.block_ids, info.num_tokens

    def random_op(self) -> None:
        self.n += 1
        self.ops += 1
        live = sorted(self.tables)
        kind = self.rng.choices(["add", "decode", "fork", "free"], [3, 5, 1, 2])[0] if live else "add"
        if kind == "add":
            rid = f"s{self.seed}-r{self.n}"
            prompt = [self.rng.randrange(3)] * 32 + [self.rng.randrange(5000) for _ in range(self.rng.randint(1, 60))]
            r = self.step([AddRequestOp(rid, token_ids=prompt), AllocateOp(rid, num_new_tokens=len(prompt))])
            assert r[0].status == OpStatus.OK, r[0]  # never ALREADY_EXISTS: a retried step applied once
            if r[1].status == OpStatus.OK:
                self.record(rid)
            else:
                assert r[1].status == OpStatus.NO_SPACE, r[1]
                self.step([FreeOp(rid)])
            return
        rid = self.rng.choice(live)
        if kind == "decode":
            r = self.step([AllocateOp(rid, num_computed_tokens=self.tokens[rid], num_new_tokens=1,
                                      append_token_ids=[self.rng.randrange(5000)])])
            if r[0].status == OpStatus.OK:
                assert r[0].num_tokens == self.tokens[rid] + 1  # appended exactly once
                self.record(rid)
            else:
                assert r[0].status == OpStatus.NO_SPACE, r[0]
                self.step([FreeOp(rid)])
                self.forget(rid)
        elif kind == "fork":
            child = f"{rid}.f{self.n}"
            r = self.step([ForkOp(rid, child)])
            if r[0].status == OpStatus.OK:
                self.record(child)
                self.record(rid)
            else:
                assert r[0].status == OpStatus.NO_SPACE, r[0]
        else:
            assert self.step([FreeOp(rid)])[0].status == OpStatus.OK
            self.forget(rid)

    def forget(self, rid: str) -> None:
        del self.tables[rid], self.tokens[rid]

    def lost(self) -> list[str]:
        """Acknowledged requests the allocator no longer holds as acknowledged."""
        out = []
        for rid, table in self.tables.items():
            try:
                info = self.call(self.client.get_request, self.pool, rid)
            except KVServiceError as exc:
                out.append(f"{rid}: {exc}")
                continue
            if info.block_ids != table or info.num_tokens != self.tokens[rid]:
                out.append(f"{rid}: {info.block_ids} != acknowledged {table}")
        return out

    def free_all(self) -> None:
        if self.tables:
            self.call(self.client.free, self.pool, *sorted(self.tables))
        self.tables.clear()
        self.tokens.clear()

    def close(self) -> None:
        self.client.close()


def pool_stats(client, pool_id: str, wait: bool = True):
    """(num_free_blocks, num_blocks, invariant_violation, persistence) read with the invariant checks on.
    `wait`: through a reconnect first. A raw stub call fails at once while its channel is in reconnect backoff,
    with the last connect error: after an allocator restart, "Connection refused" from the dead one, though the
    new one is up (the client's own calls retry; this bypasses them)."""
    stats = client.stub.GetStats(pb.GetStatsRequest(check_invariants=True), timeout=30, wait_for_ready=wait)
    pool = next(p for p in stats.pools if p.pool_id == pool_id)
    return pool.num_free_blocks, pool.num_blocks, pool.invariant_violation, stats.persistence


def run_clients(clients: list[LoadClient], ops_each: int, chaos=None) -> None:
    """Runs every client's ops in its own thread; `chaos(done)` runs alongside, and the clients keep
    going (past `ops_each`) until it has injected all its faults."""
    errors: list[BaseException] = []
    chaos_over = threading.Event()
    if chaos is None:
        chaos_over.set()

    def work(c: LoadClient) -> None:
        try:
            done = 0
            while (done < ops_each or not chaos_over.is_set()) and not errors:
                c.random_op()
                done += 1
        except BaseException as exc:  # surfaced after join
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    done = threading.Event()
    chaos_thread = None
    if chaos is not None:
        def run_chaos() -> None:
            try:
                chaos(done)
            except BaseException as exc:  # surfaced after join
                errors.append(exc)
            finally:
                chaos_over.set()
        chaos_thread = threading.Thread(target=run_chaos)
        chaos_thread.start()
    for t in threads:
        t.join(600)
    done.set()
    if chaos_thread is not None:
        chaos_thread.join(120)
    if errors:
        raise errors[0]

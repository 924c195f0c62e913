"""Fault injectors for the fault-injection tests and the soak. Each returns what it did (a short string)
and leaves the system to heal; the callers check invariants and acknowledged state afterwards."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from pathlib import Path

from kvservice._proto import allocator_pb2 as pb
from kvservice.client import KVServiceClient
from kvservice.errors import Code, KVServiceError
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp, OpStatus
from kvservice.wire import encode
from tests.load_helpers import Supervisor, pool_stats


def _retry_exactly_once(client: KVServiceClient, pool: str, rid: str) -> None:
    """After an interrupted step: resend the same sequence; the request must exist exactly once."""
    while True:
        try:
            r = client.step(pool, [AddRequestOp(rid, token_ids=[7] * 40), AllocateOp(rid, num_new_tokens=40)])
            break
        except KVServiceError as exc:
            if exc.code not in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
                raise
            time.sleep(0.05)
    assert r[0].status == OpStatus.OK, f"interrupted step applied twice: {r[0]}"
    client.free(pool, rid)


def disconnect_mid_step(target: str, pool: str, tag: str) -> str:
    """The client goes away while its Step is in flight, then reconnects and retries it."""
    client = KVServiceClient(target, retries=0)
    client.open_session()
    msg = encode.step_request(pool, [AddRequestOp(tag, token_ids=[7] * 40), AllocateOp(tag, num_new_tokens=40)])
    msg.session_id, msg.sequence = client.session_id, client.next_sequence
    future = client.stub.Step.future(msg, timeout=10)
    time.sleep(0.0005)
    future.cancel()
    client.channel.close()
    retry = KVServiceClient(target, retries=0)
    retry.continue_session(client.session_id, client.next_sequence)
    _retry_exactly_once(retry, pool, tag)
    retry.close()
    return "client disconnected mid-Step"


def deadline_expiry(target: str, pool: str, tag: str) -> str:
    client = KVServiceClient(target, retries=0)
    client.open_session()
    client.timeout_s = 1e-4
    with contextlib.suppress(KVServiceError):
        client.step(pool, [AddRequestOp(tag, token_ids=[7] * 40), AllocateOp(tag, num_new_tokens=40)])
        client.next_sequence -= 1  # it made it after all: resend anyway (answered from the stored reply)
    client.timeout_s = 10
    _retry_exactly_once(client, pool, tag)
    client.close()
    return "deadline expired"


class SlowWatcher:
    """A WatchEvents stream read one event a second: it must not slow anyone else down."""

    def __init__(self, target: str) -> None:
        self.client = KVServiceClient(target)
        self.stop = threading.Event()
        self.received = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with contextlib.suppress(Exception):
            for _ in self.client.watch_events():
                self.received += 1
                if self.stop.wait(1.0):
                    return

    def close(self) -> None:
        self.stop.set()
        self.client.close()


def flood(target: str, pool: str, max_message_bytes: int, threads: int = 6) -> str:
    """Concurrent Steps near the message-size limit, and one over it."""
    results: list[str] = []

    def one(i: int) -> None:
        client = KVServiceClient(target, retries=0)
        n_tokens = (max_message_bytes - 4096) // 4
        rid = f"flood-{i}-{time.monotonic_ns()}"
        try:
            r = client.step(pool, [AddRequestOp(rid, token_ids=[1] * min(n_tokens, 1 << 20))])
            results.append("ok" if r[0].status == OpStatus.OK else r[0].status.name)
            client.free(pool, rid)
        except KVServiceError as exc:
            results.append(exc.code.name)
        finally:
            client.close()

    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    over = KVServiceClient(target, retries=0)
    try:
        over.step(pool, [AddRequestOp("too-big", token_ids=[1] * (max_message_bytes // 4 + 1024))])
        results.append("over-limit accepted")
    except KVServiceError as exc:
        assert exc.code == Code.RESOURCE_EXHAUSTED, exc
        results.append("over-limit RESOURCE_EXHAUSTED")
    finally:
        over.close()
    assert "over-limit accepted" not in results
    return f"flood of {threads} near-limit Steps: {sorted(set(results))}"


def wait_persistence(client: KVServiceClient, pool: str, state: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pool_stats(client, pool, wait=False)[3] == state:
                return
        except Exception:  # the allocator may be restarting
            pass
        time.sleep(0.1)
    raise TimeoutError(f"persistence did not become {state!r}")


def _during_outage(start, end, ops, outage_s: float) -> None:
    """Runs `ops` in a thread across an outage that lasts `outage_s` (clients under
    --require-persistence wait it out, retrying)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            ops()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    start()
    thread = threading.Thread(target=run)
    thread.start()
    try:
        time.sleep(outage_s)
    finally:
        end()
    thread.join(300)
    if errors:
        raise errors[0]


def kill_redis(redis_server, client: KVServiceClient, pool: str, ops, outage_s: float = 1.5) -> str:
    """SIGKILL Redis during load; the allocator degrades (or refuses), then resyncs when it is back."""
    _during_outage(redis_server.kill, redis_server.restart, ops, outage_s)
    wait_persistence(client, pool, "ok")  # (only once the resync snapshot committed)
    return "redis SIGKILL"


class TmpfsDir:
    """A small tmpfs for a Redis data dir (needs root); `fill()` uses up its space."""

    def __init__(self, path: Path, size: str = "4m") -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True,
                       capture_output=True)

    @staticmethod
    def available() -> bool:
        return os.geteuid() == 0 and Path("/proc/filesystems").read_text().find("tmpfs") >= 0

    def fill(self) -> None:
        with contextlib.suppress(OSError), open(self.path / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()

    def unfill(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / "filler").unlink()

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


def disk_full(tmpfs: TmpfsDir, client: KVServiceClient, pool: str, ops, outage_s: float = 1.5) -> str:
    """Redis cannot grow its AOF: it refuses writes (MISCONF); the allocator degrades, then resyncs."""
    _during_outage(tmpfs.fill, tmpfs.unfill, ops, outage_s)
    wait_persistence(client, pool, "ok", timeout_s=30)  # (only once the resync snapshot committed)
    return "disk full on the Redis data dir"


def kill_allocator(supervisor: Supervisor) -> str:
    supervisor.kill()
    return "allocator SIGKILL"


AROUND_OUTAGES = ("during the outage", "during the resync", "just after the resync")


def kill_around_outage(supervisor: Supervisor, redis_server, client: KVServiceClient, pool: str, rng,
                       moment: str) -> str:
    """SIGKILLs the allocator at `moment` of a Redis outage (one of AROUND_OUTAGES): while Redis is down,
    while the resync snapshot is held back (CLIENT PAUSE of its writes), or just after persistence is ok
    again. Redis is back and the allocator restarted when this returns."""
    redis_server.kill()
    time.sleep(rng.uniform(0.3, 0.9))
    if moment != AROUND_OUTAGES[0]:
        redis_server.start()
        if moment == AROUND_OUTAGES[1]:
            with redis_server.client() as r:
                r.execute_command("CLIENT", "PAUSE", "1000", "WRITE")
            time.sleep(rng.uniform(0.0, 0.9))
        else:
            wait_persistence(client, pool, "ok")
            time.sleep(rng.uniform(0.0, 0.3))
    supervisor.kill(before_restart=redis_server.start)
    return f"allocator SIGKILL {moment}"


def free_everything_drains(client: KVServiceClient, pool: str, load_clients) -> None:
    for c in load_clients:
        c.free_all()
    free, total, violation, _ = pool_stats(client, pool)
    assert violation == "", violation
    assert free == total - 1, f"{free} of {total - 1} blocks free after freeing everything"


def stats_request(client: KVServiceClient):
    return client.stub.GetStats(pb.GetStatsRequest(check_invariants=True), timeout=30, wait_for_ready=True)


__all__ = ["FreeOp", "SlowWatcher", "TmpfsDir", "deadline_expiry", "disconnect_mid_step", "disk_full", "flood",
           "free_everything_drains", "kill_allocator", "kill_around_outage", "kill_redis", "stats_request",
           "wait_persistence"]

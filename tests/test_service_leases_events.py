"""Leases, the event stream (order, resume, retention) and Prometheus metrics on a real server."""

import re
import threading
import time
import urllib.request

import pytest

from kvservice.errors import NotFound, OutOfRange
from kvservice.ops import AddRequestOp, AllocateOp, DecodeBatchOp
from tests.redis_helpers import free_port
from tests.service_helpers import small_config, start_server


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    metrics_port = free_port()
    proc = start_server("--session-ttl", "1", "--event-retention", "8", "--metrics-port", str(metrics_port),
                        log_dir=tmp_path_factory.mktemp("server"))
    proc.metrics_port = metrics_port
    yield proc
    proc.stop()


def test_lease_expiry_frees_the_sessions_requests(short):
    owner, watcher = short.client(heartbeat=False), short.client()  # owner sends nothing: its lease lapses
    owner.register_pool("lease", small_config(64, 16), max_model_len=512)
    owner.step("lease", [AddRequestOp("r", token_ids=list(range(40))), AllocateOp("r", num_new_tokens=40)])
    keeper = short.client()
    keeper.step("lease", [AddRequestOp("k", token_ids=list(range(500, 520))), AllocateOp("k", num_new_tokens=20)])
    before = watcher.get_stats()
    assert before.pools["lease"].num_requests == 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        keeper.heartbeat()  # renews keeper's lease; owner sends nothing
        stats = watcher.get_stats(check_invariants=True)
        if stats.pools["lease"].num_requests == 1:
            break
        time.sleep(0.2)
    pool = stats.pools["lease"]
    assert pool.num_requests == 1 and pool.invariant_violation == ""
    assert pool.num_free_blocks == 63 - 2  # only keeper's 2 blocks remain
    assert stats.lease_expiries >= before.lease_expiries + 1
    with pytest.raises(NotFound, match="lease may have lapsed"):
        owner.step("lease", [AddRequestOp("again", token_ids=[1])])
    keeper.free("lease", "k")
    for c in (owner, watcher, keeper):
        c.close()


def test_events_in_order_resumable_and_bounded(short):
    c = short.client()
    c.register_pool("events", small_config(64, 16), max_model_len=512)
    start = c.get_stats().event_sequence + 1
    received = []
    ready = threading.Event()

    def watch():
        stream = c.watch_events(["events"], timeout_s=5)
        ready.set()
        try:
            for e in stream:
                received.append(e)
                if len(received) == 3:
                    return
        except Exception:  # deadline: the assertions below report what arrived
            return

    t = threading.Thread(target=watch)
    t.start()
    ready.wait()
    time.sleep(0.3)  # let the stream subscribe before events are produced
    c.step("events", [AddRequestOp("a", token_ids=list(range(48))), AllocateOp("a", num_new_tokens=48)])
    c.step("events", [AddRequestOp("b", token_ids=list(range(900, 948))), AllocateOp("b", num_new_tokens=48)])
    c.step("events", [AddRequestOp("z", token_ids=list(range(2000, 2032))), AllocateOp("z", num_new_tokens=32)])
    t.join(10)
    assert [e.kind for e in received] == ["stored"] * 3
    assert [e.sequence for e in received] == list(range(start, start + 3))
    assert received[0].block_hashes == c.hash_prompt(list(range(48)))
    assert received[0].token_ids == list(range(48)) and received[0].block_ids == [1, 2, 3]
    # Resume from the middle: exactly the suffix.
    resumed = []
    try:
        for e in c.watch_events(["events"], start_sequence=start + 1, timeout_s=1):
            resumed.append(e.sequence)
    except Exception:
        pass
    assert resumed == [start + 1, start + 2]
    # Beyond the retained window (8 events): OUT_OF_RANGE naming the oldest retained sequence.
    for i in range(10):
        c.step("events", [AddRequestOp(f"f{i}", token_ids=list(range(3000 + 16 * i, 3016 + 16 * i))),
                          AllocateOp(f"f{i}", num_new_tokens=16)])
    with pytest.raises(OutOfRange, match=r"older than the oldest retained event \d+"):
        next(iter(c.watch_events(start_sequence=start, timeout_s=5)))
    # Past the newest event: OUT_OF_RANGE naming it (it would silently skip what comes before).
    newest = c.get_stats().event_sequence
    with pytest.raises(OutOfRange, match=f"past the newest event {newest}; start at {newest + 1}"):
        next(iter(c.watch_events(start_sequence=newest + 5, timeout_s=5)))
    c.close()


def test_prometheus_metrics(short):
    c = short.client()
    c.register_pool("metrics", small_config(64, 16), max_model_len=512)
    c.step("metrics", [AddRequestOp("m", token_ids=list(range(20))), AllocateOp("m", num_new_tokens=20)])
    body = urllib.request.urlopen(f"http://127.0.0.1:{short.metrics_port}/metrics", timeout=5).read().decode()
    assert 'kvservice_pool_usage_ratio{pool="metrics"}' in body
    assert 'kvservice_pool_free_blocks{pool="metrics"} 61.0' in body
    assert 'kvservice_pool_capacity_blocks{pool="metrics"} 63.0' in body
    assert 'kvservice_pool_prefix_queried_tokens_total{pool="metrics"} 20.0' in body
    assert 'kvservice_rpc_latency_seconds_bucket{le="0.001",method="Step"}' in body
    assert "kvservice_lease_expiries_total" in body and "process_resident_memory_bytes" in body
    assert 'kvservice_persistence_state{state="off"} 1.0' in body
    assert 'kvservice_persistence_state{state="ok"} 0.0' in body

    def outcomes():
        text = urllib.request.urlopen(f"http://127.0.0.1:{short.metrics_port}/metrics", timeout=5).read().decode()
        found = dict(re.findall(r'^kvservice_op_results_total\{status="(\w+)"\} (\S+)$', text, re.M))
        return {k: float(v) for k, v in found.items()}

    before = outcomes()
    # A packed decode of three entries counts three outcomes: two OK, one NOT_FOUND.
    c.step("metrics", [AddRequestOp("m2", token_ids=list(range(5))), AllocateOp("m2", num_new_tokens=5)])
    c.step("metrics", [DecodeBatchOp(["m", "ghost", "m2"], [20, 0, 5], [1, 2, 3])])
    after = outcomes()
    assert after["OK"] - before.get("OK", 0) == 2 + 2
    assert after["NOT_FOUND"] - before.get("NOT_FOUND", 0) == 1
    c.close()

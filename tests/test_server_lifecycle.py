"""A fresh server answers its first call, and every server says why it exited.

The failure these guard against: a module's fresh allocator printed its ready line, and the first call of a
fresh client failed with "failed to connect to all addresses ... Connection refused". The server had not
died. gRPC shares one connection (subchannel) per address among all the channels of a process, with its
reconnect backoff: a client of an earlier server that stopped kept backing off on that address, and when a
new server was given the same port (port 0 hands ports out again; restarts reuse theirs) the new client's
channel inherited the dead server's state and failed at once. Channels to allocators now have their own
connections (kvservice.client.routing.channel_options).
"""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from kvservice.blockstore.store import sweep_dead
from kvservice.errors import KVServiceError
from kvservice.store.embedded import EmbeddedRedis
from tests.redis_helpers import RedisServer, redis7_or_skip_reason
from tests.service_helpers import start_server


def exit_line(proc) -> str:
    lines = proc.log.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def test_a_new_client_of_a_server_on_a_reused_port_answers_at_once(tmp_path):
    first = start_server(log_dir=tmp_path)
    old = first.client(client_name="old", retries=0, timeout_s=2)
    old.get_stats()
    first.stop()
    for _ in range(2):  # the old client's connection now backs off on the port
        with pytest.raises(KVServiceError):
            old.get_stats()
    second = start_server(log_dir=tmp_path, port=first.port)  # the port handed out again
    try:
        fresh = second.client(client_name="fresh", retries=0, timeout_s=2)
        assert fresh.get_stats().pools == {}  # the first call, at once
        fresh.close()
    finally:
        old.close()
        second.stop()
    assert "exits with code 0: received SIGTERM" in exit_line(first), exit_line(first)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1])
def test_a_server_logs_the_signal_that_stops_it(tmp_path, sig):
    proc = start_server(log_dir=tmp_path)
    assert proc.stop(sig) == 0
    assert f"exits with code 0: received {sig.name}" in exit_line(proc), proc.log.read_text()


def test_a_killed_server_is_reported_as_killed(tmp_path):
    proc = start_server(log_dir=tmp_path)
    assert proc.exited() is None
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    assert "killed by SIGKILL" in proc.exited()


def cleanups(stop: threading.Event, tmp_path, errors: list[str]) -> None:
    """What the other test helpers do while servers come and go: Redis servers started and killed on fresh
    ports, embedded Redis servers started and stopped (pid files, sockets), dead stores swept."""
    rng = random.Random(7)
    n = 0
    while not stop.is_set():
        n += 1
        try:
            kind = rng.choice(["redis", "embedded", "sweep"])
            if kind == "redis" and redis7_or_skip_reason() is None:
                with RedisServer(tmp_path / f"redis-{n}") as redis_server:
                    redis_server.kill()
            elif kind == "embedded":
                with EmbeddedRedis(tmp_path / f"emb-{n}"):
                    pass
            else:
                sweep_dead(str(tmp_path))
        except Exception as exc:  # noqa: BLE001
            errors.append(f"cleanup {n}: {type(exc).__name__}: {exc}")


def churn(index: int, count: int, tmp_path, ports: list[int], lock: threading.Lock, failures: list[str]) -> None:
    rng = random.Random(index)
    for k in range(count):
        with lock:
            port = rng.choice(ports) if ports and rng.random() < 0.3 else 0
        try:
            proc = start_server(log_dir=tmp_path, port=port)
        except Exception as exc:  # noqa: BLE001 - a reused port can be busy: another server took it meanwhile
            if port == 0:
                failures.append(f"churn {index}.{k}: start: {exc}")
            continue
        try:
            client = proc.client(client_name=f"churn-{index}-{k}", retries=0, timeout_s=5)
            try:
                client.get_stats()
            finally:
                client.close()
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.2)
            if proc.exited() is not None:
                failures.append(f"churn {index}.{k}: the server ended on its own: {proc.exited()}")
        except Exception as exc:  # noqa: BLE001
            failures.append(f"churn {index}.{k} on port {proc.port}: first call failed: {exc}; "
                            f"server: {proc.exited() or 'running'}")
        finally:
            sig = rng.choice([signal.SIGTERM, signal.SIGINT])
            proc.stop(sig)
            if f"received {sig.name}" not in exit_line(proc):
                failures.append(f"churn {index}.{k}: its log does not say why it exited: {exit_line(proc)!r}")
            with lock:
                ports.append(proc.port)


@pytest.mark.slow
def test_hundreds_of_servers_come_and_go_under_cleanups(tmp_path):
    """300 servers started and stopped by 3 threads (port 0, or a port an earlier one had), each answering a
    fresh client's first call, while another thread runs the other helpers' cleanups."""
    stop, errors, failures, ports, lock = threading.Event(), [], [], [], threading.Lock()
    cleaner = threading.Thread(target=cleanups, args=(stop, tmp_path, errors), daemon=True)
    cleaner.start()
    threads = [threading.Thread(target=churn, args=(i, 100, tmp_path, ports, lock, failures)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(1500)
    finally:
        stop.set()
        cleaner.join(60)
    assert not failures, f"{len(failures)} failures, the first: {failures[:5]}"
    assert not errors, errors[:5]
    assert len(ports) >= 250  # most servers started (a reused port may have been taken meanwhile)

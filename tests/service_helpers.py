"""Real `kvservice serve` processes on loopback for service tests."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

from kvservice.client import KVServiceClient
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.launch import ServeProcess, start_serve

REPO = Path(__file__).resolve().parent.parent


class ServerProcess(ServeProcess):
    def client(self, token: str | None = None, **kw) -> KVServiceClient:
        return KVServiceClient(self.target, token, **kw)


SMALL_HASH_BLOCK = 4  # the hash block size of conftest.small_hash_server


def default_log_dir() -> Path:
    """Where the logs of servers started without a log_dir go: one folder per test process."""
    path = Path(tempfile.gettempdir()) / f"kvservice-test-servers-{os.getpid()}"
    path.mkdir(exist_ok=True)
    return path


def start_server(*args: str, log_dir: Path | None = None, timeout_s: float = 30.0, port: int = 0,
                 env: dict | None = None, persistence: bool = False) -> ServerProcess:
    """Starts `kvservice serve --port 0 ARGS` (memory-only unless `persistence`) and waits for its ready
    line; it gets SIGKILL if the test process dies. Its stderr goes to a log file (in `log_dir`, else
    `default_log_dir()`), which ends with why it exited."""
    extra = [] if persistence else ["--no-persistence"]
    level = os.environ.get("KVSERVICE_TEST_LOG_LEVEL", "WARNING")
    log = (log_dir or default_log_dir()) / f"server-{time.monotonic_ns()}.log"
    started = start_serve(["--port", str(port), *extra, *args], log=log, log_level=level, timeout_s=timeout_s,
                          env=env, cwd=REPO, death_signal=signal.SIGKILL)
    return ServerProcess(started.target, started.proc, list(args), log)


def small_config(num_blocks: int = 64, block_size: int = 16) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, [FullAttentionSpec(block_size)])

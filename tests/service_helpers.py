"""Real `kvservice serve` processes on loopback for service tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvservice.client import KVServiceClient
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.processes import parent_death_signal

REPO = Path(__file__).resolve().parent.parent


@dataclass
class ServerProcess:
    target: str
    proc: subprocess.Popen
    args: list[str] = field(default_factory=list)
    log: Path | None = None

    def client(self, token: str | None = None, **kw) -> KVServiceClient:
        return KVServiceClient(self.target, token, **kw)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(*args: str, log_dir: Path | None = None, timeout_s: float = 30.0, port: int = 0,
                 env: dict | None = None, persistence: bool = False) -> ServerProcess:
    """Starts `kvservice serve --port 0 ARGS` (memory-only unless `persistence`) and waits for its ready
    line."""
    extra = [] if persistence else ["--no-persistence"]
    level = os.environ.get("KVSERVICE_TEST_LOG_LEVEL", "WARNING")
    cmd = [sys.executable, "-m", "kvservice.cli", "--log-level", level, "serve", "--port", str(port), *extra,
           *args]
    log = (log_dir / f"server-{time.monotonic_ns()}.log") if log_dir else None
    stderr = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            preexec_fn=parent_death_signal(signal.SIGKILL))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("kvservice serving on "):
            return ServerProcess(line.split()[-1], proc, list(args), log)
        if not line and proc.poll() is not None:
            detail = log.read_text()[-2000:] if log else ""
            raise RuntimeError(f"kvservice serve (pid {proc.pid}) exited with {proc.returncode}: {detail}")
    proc.kill()
    raise TimeoutError(f"kvservice serve did not become ready in {timeout_s} s")


def small_config(num_blocks: int = 64, block_size: int = 16) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, [FullAttentionSpec(block_size)])

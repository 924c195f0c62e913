"""Starting `kvservice serve` as a child process and waiting for it: the one reader of its ready line.

    proc = start_serve(["--port", "0", "--no-persistence"])
    print(proc.target)        # "127.0.0.1:PORT", read from the line `kvservice serving on HOST:PORT`
    proc.stop()

Tests, benchmarks, the demo, `worker.LLM` and `kvservice deploy` all start their allocators here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvservice.processes import parent_death_signal

READY_PREFIX = "kvservice serving on "  # printed (flushed) by `kvservice serve` once it accepts calls
REPO = Path(__file__).resolve().parent.parent


def ready_target(line: str, prefix: str = READY_PREFIX) -> str | None:
    """The `host:port` a ready line names, or None when `line` is not the ready line."""
    return line.split()[-1] if line.startswith(prefix) else None


def wait_ready(proc: subprocess.Popen, timeout_s: float = 60.0, prefix: str = READY_PREFIX,
               log: Path | None = None) -> str:
    """Reads `proc`'s stdout (text mode) until its ready line; returns the `host:port` it names.

    Raises:
        RuntimeError: the process exited first (with the tail of `log`, when given).
        TimeoutError: no ready line within `timeout_s` (the process is killed).
    """
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None, "start the process with stdout=subprocess.PIPE, text=True"
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        target = ready_target(line, prefix)
        if target is not None:
            return target
        if not line and proc.poll() is not None:
            detail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"{' '.join(map(str, proc.args[:6]))} (pid {proc.pid}) exited with {proc.returncode} "
                               f"before it was ready{': ' + detail if detail else ''}")
    proc.kill()
    raise TimeoutError(f"pid {proc.pid} printed no {prefix.strip()!r} line within {timeout_s} s")


@dataclass
class ServeProcess:
    """A running `kvservice serve` child."""

    target: str
    proc: subprocess.Popen
    args: list[str] = field(default_factory=list)
    log: Path | None = None

    @property
    def port(self) -> int:
        return int(self.target.rsplit(":", 1)[1])

    def exited(self) -> str | None:
        """None while it runs; else how it ended ("exit code 0", "killed by SIGKILL") and its log's last line."""
        code = self.proc.poll()
        if code is None:
            return None
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        last = ""
        if self.log is not None and self.log.exists():
            lines = self.log.read_text(errors="replace").strip().splitlines()
            last = f"; its log ends: {lines[-1]}" if lines else "; its log is empty"
        return f"pid {self.proc.pid} {how}{last}"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int | None:
        """Signals the process (SIGTERM: a clean stop) and waits; kills it after `timeout_s`."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def serve_command(args: list[str], log_level: str = "WARNING") -> list[str]:
    return [sys.executable, "-m", "kvservice.cli", "--log-level", log_level, "serve", *args]


def start_serve(args: list[str], *, log: Path | None = None, log_level: str = "WARNING", timeout_s: float = 60.0,
                env: dict[str, str] | None = None, cwd: str | Path | None = None,
                death_signal: int | None = signal.SIGTERM, drain: bool = True, quiet: bool = False) -> ServeProcess:
    """Starts `kvservice serve ARGS` and waits for its ready line.

    Args:
        log: where its stderr goes (default: inherited; `quiet`: nowhere).
        death_signal: sent to the child when this process dies (None: none; see `parent_death_signal`).
        drain: keep reading its stdout in a thread afterwards, so it never blocks on a full pipe.
    """
    stderr = open(log, "w") if log is not None else (subprocess.DEVNULL if quiet else None)  # noqa: SIM115
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    # The checkout first, so a child runs this code even where another copy is installed.
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), child_env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(serve_command(args, log_level), stdout=subprocess.PIPE, stderr=stderr,
                            stdin=subprocess.DEVNULL, text=True, env=child_env, cwd=cwd,
                            preexec_fn=parent_death_signal(death_signal) if death_signal else None)
    if log is not None:
        stderr.close()  # the child holds its own descriptor
    target = wait_ready(proc, timeout_s, log=log)
    if drain:
        threading.Thread(target=proc.stdout.read, daemon=True).start()
    return ServeProcess(target, proc, list(args), log)

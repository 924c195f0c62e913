"""A real Prometheus (Debian's, installed by `make install` where apt can) on a free loopback port with its own
data dir, and its HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.external_helpers import wait_for
from tests.redis_helpers import free_port

PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                                      reason="Debian's prometheus package is not installed (make install installs it)")


def api(port: int, path: str, **params) -> dict:
    """`GET /api/v1/PATH?PARAMS`'s data (the reply's status must be success)."""
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    reply = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert reply["status"] == "success", reply
    return reply["data"]


def query(port: int, expr: str) -> list:
    return api(port, "query", query=expr)["result"]


def wait_ready(prom: subprocess.Popen, port: int, log) -> None:
    """Prometheus takes a while to open its TSDB and listen (seconds on a busy machine): wait for /-/ready."""
    def ready() -> bool:
        if prom.poll() is not None:
            pytest.fail(f"Prometheus exited with {prom.returncode}; its log:\n{log.read_text()}")
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5).status == 200
        except OSError:  # not listening yet, or 503 while it starts
            return False

    try:
        wait_for(ready, timeout_s=90, interval_s=0.2, what="Prometheus ready")
    except TimeoutError:
        pytest.fail(f"Prometheus was not ready after 90 s; its log:\n{log.read_text()}")


class Prometheus:
    """`prometheus --config.file=CONFIG` on 127.0.0.1:<free port>, TSDB and log under `tmp_dir`."""

    def __init__(self, config: Path, tmp_dir: Path) -> None:
        self.port = free_port()
        self.log = tmp_dir / "prometheus.log"
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_dir / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        try:
            wait_ready(self.proc, self.port, self.log)
        except BaseException:
            self.stop()
            raise

    def query(self, expr: str) -> list:
        return query(self.port, expr)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

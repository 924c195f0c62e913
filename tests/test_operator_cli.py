"""What an operator reads from the CLI and what it refuses, on real processes: `kvservice status` shows per pool
whether it is suspended (a store's disk tier whose store is away) and the size of the endpoint its store
published, never the endpoint's bytes; `kvservice store` and `kvservice deploy` refuse flags that mean nothing
without another one (they used to be accepted and silently ignored), naming both, before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.service_helpers import REPO, small_config, start_server

CLI = [sys.executable, "-m", "kvservice.cli", "--log-level", "WARNING"]
AGENT = b"\x00nixl agent metadata\xff" * 52  # 1,092 bytes


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def columns(stdout: str) -> dict[str, dict[str, str]]:
    """`kvservice status`'s table: pool -> column -> value (the columns as the header places them)."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("pool "))
    names = lines[header].split()
    names[names.index("hit"):names.index("rate") + 1] = ["hit rate"]
    starts = [lines[header].index(n) for n in names]
    table = {}
    for line in lines[header + 1:]:
        if not line or line.startswith("("):
            break
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]
        table[cells[0]] = dict(zip(names, cells))
    return table


def test_status_shows_suspended_pools_and_endpoint_sizes(tmp_path):
    server = start_server("--session-ttl", "1", log_dir=tmp_path)
    try:
        store = server.client(client_name="kvdisk-store", heartbeat=False)  # its lease lapses: the pool suspends
        store.register_pool("kvdisk:n1", small_config(16, 16), max_model_len=256, epoch=7,
                            kv_layout="kvservice-disk/v1;page_bytes=16", bound_to_session=True,
                            suspend_on_session_end=True)
        with server.client(client_name="ram-store") as ram:
            ram.register_pool("kvstore:n1", small_config(16, 16), max_model_len=256, endpoint=AGENT)
            ram.register_pool("engine-0", small_config(16, 16), max_model_len=256)
            deadline = time.monotonic() + 20
            while not ram.get_stats().pools["kvdisk:n1"].suspended:
                assert time.monotonic() < deadline, "the disk pool was never suspended"
                time.sleep(0.2)
            out = run("status", "--target", server.target)
        store.close()
    finally:
        server.stop()
    assert out.returncode == 0, out.stderr
    table = columns(out.stdout)
    assert {p: (row["state"], row["endpoint"]) for p, row in table.items()} == {
        "kvdisk:n1": ("suspended", "none"), "kvstore:n1": ("active", f"{len(AGENT)} B"),
        "engine-0": ("active", "none")}, out.stdout
    assert "(suspended: the session that registered the pool ended" in out.stdout
    assert "(endpoint: the size of the transport endpoint" in out.stdout
    assert "nixl agent" not in out.stdout


STORE = ["store", "--name", "n1", "--pages", "8", "--page-bytes", "64", "--block-size", "16"]


@pytest.mark.parametrize("flags, named", [
    (["--store-disk-bytes", "1000000"], ("--store-disk-bytes", "--store-disk")),
    (["--store-disk", "DIR"], ("--store-disk", "--store-disk-bytes")),
])
def test_store_refuses_a_disk_flag_without_the_other(tmp_path, flags, named):
    server = start_server(log_dir=tmp_path)
    try:
        args = [*STORE, "--target", server.target, "--dir", str(tmp_path),
                *[str(tmp_path / "disk") if f == "DIR" else f for f in flags]]
        proc = subprocess.Popen([*CLI, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=60)  # a store that started would run until killed
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"kvservice store {' '.join(flags)} started instead of refusing: {out}")
        assert proc.returncode == 2, out + err
        assert all(flag in err for flag in named), err
        assert "pool" not in out  # nothing registered
    finally:
        server.stop()


@pytest.mark.parametrize("flags, named", [
    (["--store-disk-bytes", "1000000"], ("--store-disk-bytes", "--store-disk")),
    (["--stores", "--store-page-bytes", "4096", "--store-disk", "/tmp/x"], ("--store-disk", "--store-disk-bytes")),
    (["--store-pages", "64"], ("--store-pages", "--stores")),
    (["--store-disk", "/tmp/x", "--store-disk-bytes", "1000000"], ("--store-disk", "--stores")),
    (["--stores"], ("--stores", "--store-page-bytes")),
])
def test_deploy_refuses_store_flags_that_would_be_ignored(flags, named):
    """Refused before Ray is touched: the line names the flag and the one it needs (exit status 2)."""
    out = run("deploy", "--address", "127.0.0.1:1", *flags, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("kvservice deploy: ") and all(flag in line for flag in named), out.stderr
    assert "Ray" not in line, line


def test_every_deploy_flag_is_in_the_deploy_readme():
    """deploy/README.md (the docs site's "Deploying on Ray") names every flag `kvservice deploy --help` lists."""
    out = run("deploy", "--help", timeout=120)
    assert out.returncode == 0, out.stderr
    flags = set(re.findall(r"(?m)^  (--[a-z][a-z-]*)", out.stdout)) - {"--help"}
    assert {"--stores", "--store-disk", "--store-disk-bytes", "--store-dir"} <= flags
    readme = (REPO / "deploy" / "README.md").read_text()
    assert sorted(f for f in flags if f"`{f}" not in readme) == []

"""The NIXL data plane (kvservice/blockstore/transports): a real store process exporting a real segment, a real
engine-side process READing scattered pages from it, every byte and metadata word checked; under UCX's default
transports (cma on one host) and UCX_TLS=tcp (what UCX does between hosts without RDMA); stores killed before
and during a READ, stopped, re-created or closed. Each configuration runs in fresh processes (tests/nixl_peers.py).
The descriptor arithmetic is tested on its own, without NIXL."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from kvservice.blockstore.transports.plan import page_runs, row_descs
from tests.nixl_peers import ROOT, Peer

TLS = ["default", "tcp"]
PAGE = 64 << 10


# -- the descriptor lists, no NIXL needed -------------------------------------------------------------------

def test_page_runs_coalesce_consecutive_ids_in_row_order():
    assert page_runs([3, 4, 5, 9, 2, 2, 3]).tolist() == [[3, 0, 3], [9, 3, 1], [2, 4, 1], [2, 5, 2]]
    assert page_runs([]).shape == (0, 3)
    assert page_runs([7]).tolist() == [[7, 0, 1]]


def test_row_descs_one_per_run_when_rows_touch_else_one_per_row():
    runs = page_runs([3, 4, 5, 9])
    local, remote = row_descs(runs, remote_base=1 << 40, local_base=4096, local_row_stride=100, row_bytes=100,
                              device_id=0)
    assert remote.tolist() == [[(1 << 40) + 300, 300, 0], [(1 << 40) + 900, 100, 0]]
    assert local.tolist() == [[4096, 300, 0], [4396, 100, 0]]
    local, remote = row_descs(runs, 0, 4096, local_row_stride=128, row_bytes=100, device_id=3)  # padded rows
    assert remote.tolist() == [[300, 100, 0], [400, 100, 0], [500, 100, 0], [900, 100, 0]]
    assert local.tolist() == [[4096, 100, 3], [4224, 100, 3], [4352, 100, 3], [4480, 100, 3]]


def test_row_descs_addresses_past_4_gib():
    """A segment of tens of GiB: page offsets overflow 32 bits."""
    local, remote = row_descs(page_runs([100_000, 100_001]), 1 << 45, 0, 1 << 20, 1 << 20, 0)
    assert remote.tolist() == [[(1 << 45) + 100_000 * (1 << 20), 2 << 20, 0]]


# -- two real processes -------------------------------------------------------------------------------------

def _nixl_installed() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12", "nixl_cu13"))


@pytest.fixture(scope="module")
def nixl_here():
    """Skip (saying why) where NIXL is not installed or cannot make a UCX agent; asked in a child process so that
    UCX never loads into the test process."""
    if not _nixl_installed():
        pytest.skip("NIXL is not installed (pip install 'kvservice[nixl]', or make install)")
    code = ("from kvservice.blockstore.transports import nixl_available, nixl_unavailable_reason as r;"
            "print('OK' if nixl_available() else 'NO ' + r())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    line = (out.stdout.strip().splitlines() or [f"NO exit {out.returncode}: {out.stderr[-300:]}"])[-1]
    if line != "OK":
        pytest.skip(f"NIXL cannot make a UCX agent here: {line[3:]}")


@pytest.fixture
def peers(nixl_here, tmp_path):
    """start(kind, tls, ...) -> a Peer; every peer started is stopped (killed if it must be) at the end."""
    started = []

    def start(kind: str, tls: str, num_blocks: int = 64, page_bytes: int = PAGE, seed: int = 1,
              prefix: list[str] = ()) -> tuple[Peer, dict]:
        args = [kind] if kind == "reader" else ["store", "--dir", str(tmp_path), "--num-blocks", str(num_blocks),
                                                  "--page-bytes", str(page_bytes), "--seed", str(seed)]
        peer = Peer(args, tls, tmp_path / f"{kind}-{len(started)}.log", prefix)
        started.append(peer)
        return peer, peer.reply()

    yield start
    for peer in started:
        if peer.proc.poll() is None:  # not reaped: the pid is still this peer's (a zombie at worst)
            peer.signal(signal.SIGCONT)  # a test may leave a store stopped
        peer.stop()


SCATTERED = [5, 6, 7, 1, 40, 41, 63, 2, 2, 30, 8]  # runs, a duplicate, the first and the last page


def connected(peers, tls: str) -> tuple[Peer, Peer, dict]:
    """A store and a reader that has READ from it once (so its connection is up): (store, reader, info)."""
    store, hello = peers("store", tls)
    reader, _ = peers("reader", tls)
    r = reader.ask(op="read", info=hello["info"], ids=[3], seed=1, timeout=20)
    assert r["state"] == "DONE" and r["bytes_ok"] and r["meta_ok"], r
    return store, reader, hello["info"]


@pytest.mark.parametrize("tls", TLS)
def test_reads_scattered_pages_and_their_metadata(peers, tls):
    store, hello = peers("store", tls)
    reader, _ = peers("reader", tls)
    info = hello["info"]
    assert info["store"] == "store-a" and info["tenant"] == "tenant-a" and info["page_bytes"] == PAGE
    json.dumps(info)  # what the allocator will hand out: plain JSON
    for kind, pad in (("numpy", 0), ("torch", 0), ("numpy", 256)):  # rows back to back, and rows apart
        r = reader.ask(op="read", info=info, ids=SCATTERED, seed=1, timeout=20, kind=kind, pad=pad)
        assert r["state"] == "DONE", r
        assert r["bytes_ok"] and r["meta_ok"], r
    r = reader.ask(op="read", info=info, ids=list(range(1, 64)), seed=1, timeout=20)  # one run: one descriptor
    assert r["state"] == "DONE" and r["bytes_ok"] and r["meta_ok"], r
    misuse = reader.ask(op="misuse", info=info)
    assert all(v.startswith("ValueError") for v in misuse.values()), misuse
    assert "register the staging buffer" in misuse["unregistered"]
    assert "not a page of store store-a" in misuse["page 0"]


@pytest.mark.parametrize("tls", TLS)
def test_registers_a_segment_larger_than_the_memlock_limit(peers, tls):
    """cma and tcp pin nothing: a segment far over `ulimit -l` registers and serves, with the limit in force
    (as root, without CAP_IPC_LOCK, which would lift it)."""
    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root here, and no setpriv to drop CAP_IPC_LOCK: the memlock limit would not apply")
        prefix = ["setpriv", "--inh-caps", "-ipc_lock", "--bounding-set", "-ipc_lock"]
    page_bytes, num_blocks = 1 << 20, 48  # 48 MiB of pages
    store, hello = peers("store", tls, num_blocks=num_blocks, page_bytes=page_bytes, seed=3, prefix=prefix)
    if not hello["mlock_refused"]:
        pytest.skip(f"the memlock limit ({hello['memlock']}) does not stop a 48 MiB mlock here: nothing to show")
    reader, _ = peers("reader", tls)
    r = reader.ask(op="read", info=hello["info"], ids=[47, 1, 24, 25], seed=3, timeout=20)
    assert r["state"] == "DONE" and r["bytes_ok"] and r["meta_ok"], r


@pytest.mark.parametrize("tls", TLS)
def test_store_killed_before_a_read(peers, tls):
    store, reader, info = connected(peers, tls)
    fresh, _ = peers("reader", tls)  # never connected before the store died
    store.signal(signal.SIGKILL)
    store.proc.wait(10)
    for r in (reader.ask(op="read", info=info, ids=[3, 4, 9], seed=1, timeout=5),
              fresh.ask(op="read", info=info, ids=[3, 4, 9], seed=1, timeout=5)):
        assert r["state"] == "ERR" and r["secs"] < 6, r
        assert r["error"], r


@pytest.mark.parametrize("tls", TLS)
def test_store_killed_during_a_read(peers, tls):
    """The store is stopped, the READ posted, the store killed: the ticket ends within its timeout, never DONE
    unless every byte is right (with cma the bytes can all land without the store's CPU)."""
    store, reader, info = connected(peers, tls)
    store.signal(signal.SIGSTOP)
    posted = reader.ask(op="read", info=info, ids=list(range(63, 0, -1)), seed=1, post_only=True)
    if tls == "tcp":
        assert posted["state"] == "PROC", posted  # tcp: the stopped store serves nothing
    store.signal(signal.SIGKILL)
    store.proc.wait(10)
    r = reader.ask(op="wait", timeout=8)
    assert r["secs"] < 10, r
    assert r["state"] == "ERR" or (r["bytes_ok"] and r["meta_ok"]), r
    again = reader.ask(op="read", info=info, ids=[3], seed=1, timeout=5)
    assert again["state"] == "ERR" and again["secs"] < 6, again


def test_timed_out_read_is_cancelled_and_the_reader_reconnects(peers):
    """tcp (the store's CPU serves the READ): a stopped store times the ticket out, the READ is cancelled and no
    late byte lands; once the store runs again, the next READ reconnects and succeeds."""
    store, hello = peers("store", "tcp")
    reader, _ = peers("reader", "tcp")
    info = hello["info"]
    store.signal(signal.SIGSTOP)
    r = reader.ask(op="read", info=info, ids=[10, 11, 12], seed=1, timeout=0.5)
    assert r["state"] == "ERR" and "no completion" in r["error"] and r["buffers_free"], r
    assert 0.5 <= r["secs"] < 3, r
    store.signal(signal.SIGCONT)
    r = reader.ask(op="read", info=info, ids=[10, 11, 12], seed=1, timeout=20)
    assert r["state"] == "DONE" and r["bytes_ok"] and r["meta_ok"], r


@pytest.mark.parametrize("tls", TLS)
def test_recreated_agent_old_info_fails_new_info_reads(peers, tls):
    store, reader, old = connected(peers, tls)
    new = store.ask(op="recreate")["info"]
    assert new["agent_id"] != old["agent_id"] and new["agent_name"] != old["agent_name"]
    for _ in range(2):  # the reader has not seen `new` yet: the fence (cma) or a disconnect, then no agent there
        r = reader.ask(op="read", info=old, ids=SCATTERED, seed=1, timeout=5)
        assert r["state"] == "ERR" and r["secs"] < 6, r
    r = reader.ask(op="read", info=new, ids=SCATTERED, seed=1, timeout=20)
    assert r["state"] == "DONE" and r["bytes_ok"] and r["meta_ok"], r
    r = reader.ask(op="read", info=old, ids=[3], seed=1, timeout=5)  # older than one it saw: refused at once
    assert r["state"] == "ERR" and "stale info" in r["error"], r
    r = reader.ask(op="read", info=new, ids=[3], seed=1, timeout=20)  # ... and the newer one is still fine
    assert r["state"] == "DONE" and r["bytes_ok"], r
    assert store.ask(op="close_segment")["ok"]
    r = reader.ask(op="read", info=new, ids=[3], seed=1, timeout=5)
    assert r["state"] == "ERR" and "closed its segment" in r["error"], r


def test_new_pool_epoch_fails_reads_with_the_old_info(peers):
    """The store re-registered its pool (a new epoch in the segment's header): page ids of the old epoch mean
    nothing, so a READ with info from before gets ERR; the export's info() now carries the new epoch."""
    store, reader, old = connected(peers, "default")
    new = store.ask(op="new_epoch")["info"]
    assert new["segment_generation"] > old["segment_generation"] and new["agent_id"] == old["agent_id"]
    r = reader.ask(op="read", info=old, ids=[3], seed=1, timeout=5)
    assert r["state"] == "ERR" and "not the one the info describes" in r["error"], r
    r = reader.ask(op="read", info=new, ids=[3, 4], seed=1, timeout=20)
    assert r["state"] == "DONE" and r["bytes_ok"] and r["meta_ok"], r


@pytest.mark.parametrize("tls", TLS)
def test_closed_export_fails_its_readers(peers, tls):
    store, reader, info = connected(peers, tls)
    assert store.ask(op="close_export")["ok"]  # the process and its segment live on
    for _ in range(2):  # the first READ ends on the fence or a disconnect, the second on the reconnect
        r = reader.ask(op="read", info=info, ids=[3, 4], seed=1, timeout=5)
        assert r["state"] == "ERR" and r["secs"] < 6, r


def test_expected_contents_differ_per_page():
    """The checks above mean something only if pages and metadata rows all differ."""
    from tests.nixl_peers import expected_meta, expected_pages

    pages, meta = expected_pages(1, 64, 256), expected_meta(1, 64)
    assert len({p.tobytes() for p in pages}) == 64 and len({m.tobytes() for m in meta}) == 64
    assert not np.array_equal(expected_pages(1, 64, 256), expected_pages(3, 64, 256))

"""The store tier without vLLM: a store's segment and pool on a real server, the connector's save and load
protocol on it (what KVServiceConnector's two sides send), LRU at the memory bound, pins, tenants, and a store
whose process ends taking its blocks out of the index."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvservice.blockstore import BlockStore, Segment, read_descriptor
from kvservice.blockstore.saves import admit_save, commit_save
from kvservice.errors import InvalidArgument
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp, OpStatus, PinOp, UnpinOp
from tests.service_helpers import start_server

BS = 4
PAGE = 16
TOKENS = "tok-a tenant-a\ntok-b tenant-b\ntok-admin ops admin\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("blockstore")
    (d / "tokens").write_text(TOKENS)
    proc = start_server("--hash-block-size", str(BS), "--token-file", str(d / "tokens"), "--session-ttl", "2",
                        log_dir=d)
    yield proc
    proc.stop()


@pytest.fixture
def store(server, tmp_path, request):
    s = BlockStore(request.node.name.replace("[", "-").replace("]", ""), server.target, 8, PAGE, BS,
                   token="tok-a", directory=str(tmp_path))
    yield s
    s.close()


@pytest.fixture
def engine(server, request):
    c = server.client("tok-a", client_name=request.node.name, hash_block_size=BS)
    yield c
    c.close()


def save(client, store: BlockStore, save_id: str, prompt: list[int], data: dict[int, np.ndarray] | None = None):
    """The connector's save: a store request over the prompt's whole blocks plus one token, admitted with
    delay_cache_blocks; the pages written; then cached and freed. Returns (hit tokens, new pages)."""
    n = len(prompt) // BS * BS
    _, r = client.step(store.pool_id, admit_save(save_id, prompt, n))
    assert r.status == OpStatus.OK, r
    pages = list(r.new_block_ids[0][r.num_computed_tokens // BS:n // BS])
    for i, page in enumerate(pages):
        store.segment.pages[page] = (data or {}).get(i, np.full(PAGE, page, np.uint8))
    return r.num_computed_tokens, pages


def commit(client, store: BlockStore, save_id: str, n: int) -> None:
    results = client.step(store.pool_id, commit_save(save_id, n))
    assert all(r.status == OpStatus.OK for r in results), results


def hit(client, store: BlockStore, prompt: list[int]) -> int:
    return client.lookup(prompt, pool_ids=[store.pool_id]).tokens(store.pool_id)


def test_a_segment_maps_the_same_pages_in_every_process_and_refuses_bad_ids(tmp_path):
    seg = Segment(str(tmp_path / "seg"), 4, 8, create=True)
    other = Segment(str(tmp_path / "seg"), 4, 8)
    seg.write([1, 3], np.arange(16, dtype=np.uint8).reshape(2, 8))
    assert other.read([3]).tolist() == [list(range(8, 16))]
    with pytest.raises(ValueError, match="block_ids: 4 is not a page"):
        other.read([1, 4])
    with pytest.raises(ValueError, match=r"data: shape \(1, 8\), expected \(2, 8\)"):
        seg.write([1, 2], np.zeros((1, 8), np.uint8))
    with pytest.raises(ValueError, match="expected 5 pages"):
        Segment(str(tmp_path / "seg"), 5, 8)
    seg.close(unlink=True)


def test_saved_pages_hit_only_once_written_and_committed(server, engine, store):
    prompt = list(range(1, 15))  # 3 whole blocks
    computed, pages = save(engine, store, "s1", prompt)
    assert computed == 0 and len(pages) == 3
    assert hit(engine, store, prompt + [99]) == 0  # allocated, not written: no hit yet
    commit(engine, store, "s1", 12)
    assert hit(engine, store, prompt + [99]) == 12
    # A longer prompt over the same prefix: the store already holds its first 3 blocks.
    computed, pages = save(engine, store, "s2", prompt[:12] + [50, 51, 52, 53])
    assert computed == 12 and len(pages) == 1
    commit(engine, store, "s2", 16)
    with server.client("tok-admin", client_name="ops") as admin:
        stats = admin.get_stats(check_invariants=True).pools[store.pool_id]
    assert not stats.invariant_violation and stats.num_requests == 0 and stats.num_cached_blocks == 4


def test_a_pin_holds_pages_the_lru_would_evict(engine, store):
    """At the memory bound the store evicts least recently used pages, except pinned ones; a hit is never
    reported for an evicted prefix."""
    first = list(range(100, 112))
    save(engine, store, "first", first)
    commit(engine, store, "first", 12)
    (p,) = engine.step(store.pool_id, [PinOp("pin", token_ids=first + [1])])
    assert p.num_computed_tokens == 12 and len(p.new_block_ids[0]) == 3
    second = list(range(200, 212))
    save(engine, store, "second", second)  # 3 + 1 spare pages of the 7 usable: fits beside the pinned 3
    commit(engine, store, "second", 12)
    third = list(range(300, 312))
    save(engine, store, "third", third)  # needs 4: only the unpinned `second` can go
    commit(engine, store, "third", 12)
    assert hit(engine, store, first + [1]) == 12 and hit(engine, store, third + [1]) == 12
    assert hit(engine, store, second + [1]) < 12  # evicted (LRU), not served stale
    (u,) = engine.step(store.pool_id, [UnpinOp("pin")])
    assert u.status == OpStatus.OK


def test_cache_tokens_past_the_computed_ones_is_refused_and_changes_nothing(engine, store):
    prompt = list(range(1, 9))
    save(engine, store, "s", prompt)
    before = engine.get_stats().pools[store.pool_id]
    with pytest.raises(InvalidArgument, match="cache_tokens"):
        engine.step(store.pool_id, [AllocateOp("s", num_computed_tokens=4, cache_tokens=8)])
    after = engine.get_stats().pools[store.pool_id]
    assert (after.num_free_blocks, after.num_cached_blocks) == (before.num_free_blocks, before.num_cached_blocks)
    assert hit(engine, store, prompt + [1]) == 0


def test_another_tenant_neither_finds_nor_pins_nor_reads_a_stores_blocks(server, engine, store):
    prompt = list(range(1, 13))
    save(engine, store, "s", prompt)
    commit(engine, store, "s", 12)
    with server.client("tok-b", client_name="tenant-b", hash_block_size=BS) as b:
        assert all(h.pool_id != store.pool_id for h in b.lookup(prompt + [1]).hits)
        with pytest.raises(Exception, match="kvstore"):
            b.step(store.pool_id, [PinOp("steal", token_ids=prompt + [1])])
    with pytest.raises(PermissionError, match="token"):
        store.read([1], token="tok-b")
    assert store.read([1], token="tok-a").shape == (1, PAGE)


def test_a_store_that_ends_takes_its_blocks_out_of_the_index(server, engine, tmp_path):
    """Its session ends (the process died: no more lease renewals): the pool is retired, empty."""
    store = BlockStore("mortal", server.target, 8, PAGE, BS, token="tok-a", directory=str(tmp_path))
    prompt = list(range(1, 13))
    save(engine, store, "s", prompt)
    commit(engine, store, "s", 12)
    epoch = engine.get_stats().pools[store.pool_id].epoch
    assert hit(engine, store, prompt + [1]) == 12
    store._stop.set()  # noqa: SLF001 - its watcher and lease renewals stop, as when the process is killed
    store.client._closed.set()  # noqa: SLF001
    try:
        deadline = time.monotonic() + 15
        while hit(engine, store, prompt + [1]) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert hit(engine, store, prompt + [1]) == 0
        assert engine.get_stats().pools[store.pool_id].epoch == epoch + 1
    finally:
        store.close()


def test_a_restarted_store_starts_empty_and_drops_the_old_segment(server, engine, tmp_path):
    first = BlockStore("again", server.target, 8, PAGE, BS, token="tok-a", directory=str(tmp_path))
    prompt = list(range(1, 13))
    save(engine, first, "s", prompt)
    commit(engine, first, "s", 12)
    old = first.descriptor.path
    second = BlockStore("again", server.target, 8, PAGE, BS, token="tok-a", directory=str(tmp_path))
    try:
        assert hit(engine, second, prompt + [1]) == 0
        assert read_descriptor("again", str(tmp_path)).generation == second.generation != first.generation
        assert not (tmp_path / old.rsplit("/", 1)[-1]).exists()
        with pytest.raises(LookupError, match="restarted"):
            second.read([1], token="tok-a", generation=first.generation)
    finally:
        second.close()


def test_the_binding_survives_a_snapshot_and_the_restored_allocator_retires_the_pool():
    """Recovery keeps which session a store pool is bound to: its lease lapsing after a restart still
    empties the pool."""
    from kvservice.allocator import Allocator
    from kvservice.commands import ExpireSessions, PoolSpec
    from kvservice.core import FullAttentionSpec, KVCacheConfig
    from kvservice.store.snapshot import dump, load
    from tests.allocator_helpers import InProcess

    a = Allocator(hash_block_size=BS)
    store = InProcess(a, "store-session")
    store.register(PoolSpec("kvstore:x", KVCacheConfig(8, [FullAttentionSpec(BS)]), 64, kv_layout="pages",
                            epoch=5, bound_to_session=True))
    other = InProcess(a, "engine-session")
    other.step("kvstore:x", [AddRequestOp("s", token_ids=list(range(9))), AllocateOp("s", num_new_tokens=9)])
    other.step("kvstore:x", [FreeOp("s")])
    restored = Allocator(hash_block_size=BS)
    load(dump(a), restored, now=0.0)
    pool = restored.state.pools["kvstore:x"]
    assert pool.bound_session == "store-session" and pool.manager.block_pool.get_num_free_blocks() == 7
    restored.apply(ExpireSessions(["engine-session"]), now=1.0)
    assert restored.state.pools["kvstore:x"].epoch == 5  # another session's end leaves it
    restored.apply(ExpireSessions(["store-session"]), now=1.0)
    retired = restored.state.pools["kvstore:x"]
    assert retired.epoch == 6 and not retired.bound_session
    assert restored.lookup("", list(range(9)), pool_ids=["kvstore:x"]).hits[0].num_cached_tokens == 0


def test_a_store_registers_again_when_the_allocator_returns_without_it(tmp_path):
    """The allocator restarted without persistence: the store's pool comes back (a new epoch, empty), and
    saves work again."""
    first = start_server("--hash-block-size", str(BS), log_dir=tmp_path)
    port = int(first.target.rsplit(":", 1)[1])
    store = BlockStore("phoenix", first.target, 8, PAGE, BS, directory=str(tmp_path), watch_s=0.2)
    second = None
    try:
        generation = store.generation
        first.stop()
        second = start_server("--hash-block-size", str(BS), log_dir=tmp_path, port=port)
        deadline = time.monotonic() + 20
        with second.client(client_name="engine", hash_block_size=BS) as c:
            while store.pool_id not in c.get_stats().pools and time.monotonic() < deadline:
                time.sleep(0.2)
            assert c.get_stats().pools[store.pool_id].epoch == store.generation > generation
            assert read_descriptor("phoenix", str(tmp_path)).generation == store.generation
            save(c, store, "s", list(range(1, 9)))
            commit(c, store, "s", 8)
            assert hit(c, store, list(range(1, 10))) == 8
    finally:
        store.close()
        (second or first).stop()


def test_kvservice_store_runs_a_store_until_sigterm(server, tmp_path):
    """`kvservice store` (where Ray is absent): the pool is up while it runs; SIGTERM frees the segment, and
    the pool leaves the index when the store's lease lapses."""
    import signal
    import subprocess
    import sys

    from tests.service_helpers import REPO
    (tmp_path / "token").write_text("tok-a\n")
    proc = subprocess.Popen([sys.executable, "-m", "kvservice.cli", "store", "--name", "cli", "--target", server.target,
                             "--pages", "8", "--page-bytes", str(PAGE), "--block-size", str(BS), "--dir",
                             str(tmp_path), "--token-file", str(tmp_path / "token")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "kvservice store cli: pool kvstore:cli" in line, line + proc.stderr.read()
        d = read_descriptor("cli", str(tmp_path))
        with server.client("tok-a", client_name="engine", hash_block_size=BS) as c:
            assert c.get_stats().pools["kvstore:cli"].epoch == d.generation
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0
            assert not (tmp_path / d.path.rsplit("/", 1)[-1]).exists() and read_descriptor("cli", str(tmp_path)) is None
            deadline = time.monotonic() + 15
            while c.get_stats().pools["kvstore:cli"].epoch == d.generation and time.monotonic() < deadline:
                time.sleep(0.3)
            assert c.get_stats().pools["kvstore:cli"].epoch == d.generation + 1  # retired: empty
    finally:
        if proc.poll() is None:
            proc.kill()

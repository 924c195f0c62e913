"""A store's disk tier under its RAM tier, with the connector's two sides (no vLLM): saves written through to
page files, loads from disk when RAM no longer holds a prefix, hits that survive a `kill -9` of the store and
its restart, altered files dropped, a store away suspending its disk pages, a full disk failing only the save.
The stores run as `kvservice store` processes (killed with SIGKILL); the allocator keeps its state in Redis."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from kvservice.blockstore.disk import HEADER_BYTES, page_path
from kvservice.blockstore.segment import read_descriptor
from kvservice.integrations.vllm.connector.scheduler_side import SchedulerSide
from kvservice.integrations.vllm.connector.settings import ConnectorSettings
from kvservice.integrations.vllm.connector.worker_side import WorkerSide
from kvservice.ops import EvictBlocksOp
from tests.connector_helpers import BS, HEAD, PAGE, kv, request, scheduled
from tests.disk_helpers import tiny_tmpfs
from tests.service_helpers import REPO, start_server

NUM_BLOCKS = 32
DISK_PAGES = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Leases of 2 s: a killed store's session lapses soon (its disk pool is then suspended)."""
    proc = start_server("--hash-block-size", str(BS), "--session-ttl", "2", log_dir=tmp_path_factory.mktemp("disk"))
    yield proc
    proc.stop()


class StoreProcess:
    """`kvservice store` with a disk tier, in a process of its own (SIGKILL is a crash)."""

    def __init__(self, server, shm, disk, name: str = "n1", disk_pages: int = DISK_PAGES, ram_pages: int = 16):
        self.args = [sys.executable, "-m", "kvservice.cli", "store", "--name", name, "--target", server.target,
                     "--pages", str(ram_pages), "--page-bytes", str(PAGE), "--block-size", str(BS), "--dir", str(shm),
                     "--store-disk", str(disk), "--store-disk-bytes", str(disk_pages * (HEADER_BYTES + PAGE))]
        self.name, self.shm, self.disk = name, shm, disk
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.line = self.proc.stdout.readline()
        ready = f"kvservice store {self.name}: pool kvstore:{self.name}"
        assert ready in self.line, self.line + self.proc.stderr.read()

    @property
    def descriptor(self):
        return read_descriptor(self.name, str(self.shm))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)


@pytest.fixture
def store(server, tmp_path):
    (tmp_path / "shm").mkdir()
    s = StoreProcess(server, tmp_path / "shm", tmp_path / "disk")
    yield s
    s.stop()


def settings(server, store, **kw) -> ConnectorSettings:
    return ConnectorSettings(address=server.target, store=store.name, shm_dir=str(store.shm), index=False, **kw)


class Engine:
    """One engine's two sides, driven as vLLM would (a step's report goes to the scheduler side)."""

    def __init__(self, server, store, name: str, seed: int, **kw) -> None:
        self.kv = kv(seed, NUM_BLOCKS)
        self.sched = SchedulerSide(settings(server, store, **kw), BS, name, loads=True, saves=True)
        self.worker = WorkerSide(settings(server, store, **kw), BS, name, head_size=HEAD)
        self.worker.register(self.kv, NUM_BLOCKS)

    def report(self) -> None:
        self.worker.flush()
        done = self.worker.take_done()
        if done is not None:
            self.sched.workers_done(done)
        self.sched.teller.flush()

    def save(self, req_id: str, prompt: list[int], block_ids: list[int]):
        self.sched.on_new_request(request(req_id, prompt))
        _, saves = self.sched.build(scheduled(req_id, prompt, block_ids, 0, len(prompt)))
        self.worker.save(saves)
        self.report()
        return saves

    def hit(self, req_id: str, prompt: list[int], block_ids: list[int]):
        """Admits the prompt: the tokens found and the load (copied in and reported)."""
        self.sched.on_new_request(request(req_id, prompt))
        found, _ = self.sched.num_new_matched_tokens(request(req_id, prompt), 0)
        if not found:
            return 0, None
        self.sched.after_alloc(request(req_id, prompt), block_ids, found)
        loads, self.saves = self.sched.build(scheduled(req_id, prompt, block_ids, found, len(prompt) - found))
        self.worker.load(loads)
        self.report()
        return found, loads[0]

    def close(self) -> None:
        self.worker.close()
        self.sched.close()


def lookup(server, pool: str, prompt: list[int], namespace: str) -> int:
    with server.client(client_name="probe", hash_block_size=BS) as c:
        return c.lookup(prompt, cache_salt=namespace or None, pool_ids=[pool]).tokens(pool)


def stats(server, pool: str):
    with server.client(client_name="probe", hash_block_size=BS) as c:
        return c.get_stats().pools.get(pool)


def wait_for(check, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_prefix_evicted_from_ram_loads_from_disk(server, store):
    """Written through to disk at save; the RAM pages evicted; a reader loads the prefix from the disk tier
    (verified), its blocks equal the writer's, the load is counted as the disk tier's, and its own save
    promotes the prefix into RAM again."""
    a = Engine(server, store, "a", 1)
    prompt = list(range(1, 15))
    (save,) = a.save("r", prompt, [5, 6, 7, 8])
    assert save.disk is not None and len(save.disk.page_ids) == 3
    assert lookup(server, "kvdisk:n1", prompt, "") == 12 and lookup(server, "kvstore:n1", prompt, "") == 12
    with server.client(client_name="evictor", hash_block_size=BS) as c:
        c.open_session()
        c.step("kvstore:n1", [EvictBlocksOp(save.store_block_ids)])
    assert lookup(server, "kvstore:n1", prompt, "") == 0
    b = Engine(server, store, "b", 2)
    found, load = b.hit("x", prompt, [9, 10, 11, 12])
    assert found == 12 and load.pool_id == "kvdisk:n1" and not b.worker.take_failed_blocks()
    for name in a.kv:
        assert torch.equal(b.kv[name][[9, 10, 11]], a.kv[name][[5, 6, 7]])
    assert b.worker.counters.totals["loaded"] == {"n1:disk": 3}
    saves = b.saves  # the prompt completed in the step that loaded it: saved into RAM again (promoted)
    assert len(saves) == 1 and b.sched.counters.total("promoted") == 3
    b.worker.save(saves)
    b.report()
    assert lookup(server, "kvstore:n1", prompt, "") == 12
    a.close()
    b.close()


def test_disk_hits_survive_a_kill_of_the_store_and_altered_files_do_not(server, store):
    """kill -9 of the store: while it is away its disk pages are suspended (no hit, its index kept); the
    store starts again, verifies its files and re-attaches: every page that verifies hits again with the same
    page ids and no re-save; a page file altered while it was down never hits again."""
    a = Engine(server, store, "a", 3)
    prompts = [list(range(100, 113)), list(range(200, 213))]
    saves = [a.save(f"r{i}", p, [1 + 4 * i, 2 + 4 * i, 3 + 4 * i, 4 + 4 * i])[0] for i, p in enumerate(prompts)]
    before = stats(server, "kvdisk:n1")
    store.kill()
    wait_for(lambda: stats(server, "kvdisk:n1").suspended, "the disk pool suspended (the store's lease lapsed)")
    assert lookup(server, "kvdisk:n1", prompts[0], "") == 0
    assert stats(server, "kvdisk:n1").num_cached_blocks == before.num_cached_blocks == 6  # the index is kept
    victim = saves[1].disk.page_ids[1]
    with open(page_path(str(store.disk), victim), "r+b") as f:  # one byte of the second prompt's middle page
        f.seek(HEADER_BYTES + PAGE // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    store.start()
    assert "5 verified" in store.line, store.line
    assert not stats(server, "kvdisk:n1").suspended and stats(server, "kvdisk:n1").epoch == before.epoch
    assert lookup(server, "kvdisk:n1", prompts[0], "") == 12
    assert lookup(server, "kvdisk:n1", prompts[1], "") == 4  # cut at the altered page
    reader = Engine(server, store, "c", 4)
    found, load = reader.hit("y", prompts[0], [20, 21, 22, 23])
    assert found == 12 and load.store_block_ids == saves[0].disk.page_ids  # the same pages: no re-save
    for name in a.kv:
        assert torch.equal(reader.kv[name][[20, 21, 22]], a.kv[name][[1, 2, 3]])
    a.close()
    reader.close()


def test_the_disk_tier_evicts_lru_at_its_bound(server, store):
    """12 disk pages (11 usable): five 3-page prompts; the oldest leave the disk index, the newest are there."""
    a = Engine(server, store, "a", 5)
    prompts = [list(range(1000 * (i + 1), 1000 * (i + 1) + 13)) for i in range(5)]
    for i, p in enumerate(prompts):
        a.save(f"r{i}", p, [1 + 4 * (i % 7), 2 + 4 * (i % 7), 3 + 4 * (i % 7), 4 + 4 * (i % 7)])
    held = [lookup(server, "kvdisk:n1", p, "") for p in prompts]
    assert held[-1] == 12 and held[0] == 0, held
    assert stats(server, "kvdisk:n1").num_cached_blocks <= DISK_PAGES - 1
    a.close()


@pytest.fixture
def tiny_disk(tmp_path):
    """A tmpfs with room for two page files, the tier's json and the directory (as root), else skip."""
    with tiny_tmpfs(tmp_path / "tiny", 2 * (HEADER_BYTES + PAGE) + 3 * 4096) as mount:
        yield mount


def test_a_full_disk_fails_the_save_and_nothing_else(server, tmp_path, tiny_disk):
    """The disk fills up: the write-through of the second prompt fails (ENOSPC) and is not indexed; its RAM
    save is; the first prompt's disk pages still load."""
    (tmp_path / "shm").mkdir()
    store = StoreProcess(server, tmp_path / "shm", tiny_disk, name="full", disk_pages=DISK_PAGES)
    try:
        a = Engine(server, store, "a", 6)
        first, second = list(range(1, 9)) + [0], list(range(50, 62)) + [0]  # 2 pages, then 3 more
        (saved,) = a.save("r1", first, [1, 2, 3])
        a.save("r2", second, [4, 5, 6, 7])
        assert lookup(server, "kvdisk:full", first, "") == 8
        assert lookup(server, "kvdisk:full", second, "") == 0  # no half-written page is indexed
        assert lookup(server, "kvstore:full", second, "") == 12
        with server.client(client_name="evictor", hash_block_size=BS) as c:
            c.open_session()
            c.step("kvstore:full", [EvictBlocksOp(saved.store_block_ids)])  # RAM no longer has the first
        b = Engine(server, store, "b", 7)
        found, load = b.hit("x", first, [9, 10, 11])
        assert found == 8 and load.pool_id == "kvdisk:full" and not b.worker.take_failed_blocks()
        a.close()
        b.close()
    finally:
        store.stop()


def test_a_checksum_mismatch_on_disk_fails_from_its_block_on_and_is_counted(server, store):
    """One bit flipped in the 6th of 8 disk pages: the 5 blocks before it load (equal to the writer's), the
    last 3 are recomputed (vLLM's computed tokens stop at the first failed block), and only the bad page leaves
    the index."""
    a = Engine(server, store, "a", 8)
    prompt = list(range(300, 333))  # 8 whole blocks
    (save,) = a.save("r", prompt, list(range(1, 10)))
    with server.client(client_name="evictor", hash_block_size=BS) as c:
        c.open_session()
        c.step("kvstore:n1", [EvictBlocksOp(save.store_block_ids)])
    path = page_path(str(store.disk), save.disk.page_ids[5])
    data = bytearray(open(path, "rb").read())
    data[HEADER_BYTES + 5] ^= 0x01
    open(path, "wb").write(bytes(data))
    b = Engine(server, store, "b", 9)
    found, load = b.hit("x", prompt, list(range(10, 19)))
    assert found == 32 and b.worker.take_failed_blocks() == {15, 16, 17}
    assert b.worker.counters.totals["checksum_failures"] == {"disk": 1}
    assert b.worker.counters.totals["failed"] == {"n1:disk|checksum": 3}
    assert b.worker.counters.totals["loaded"] == {"n1:disk": 5}
    assert lookup(server, "kvdisk:n1", prompt, "") == 20  # the bad page left the index: it never hits again
    for name in a.kv:
        assert torch.equal(b.kv[name][10:15], a.kv[name][1:6])
    a.close()
    b.close()


def test_a_ram_save_is_held_until_its_write_through_is_done(server, store):
    """The disk writer reads the RAM pages of a save: the RAM save is committed (its pages hit) but held
    (not freed, so not evictable or reused) until its disk save is reported; then it is freed."""
    a = Engine(server, store, "a", 10)
    prompt = list(range(400, 413))
    a.sched.on_new_request(request("r", prompt))
    _, (save,) = a.sched.build(scheduled("r", prompt, [1, 2, 3, 4], 0, len(prompt)))
    a.worker.save([save])  # sealed at once (a CPU engine); the write-through runs in its own thread
    from kvservice.integrations.vllm.connector.plan import Done
    ram_only = Done(saves={save.save_id: 1})
    a.sched.workers_done(ram_only)
    a.sched.teller.flush()
    assert lookup(server, "kvstore:n1", prompt, "") == 12 and stats(server, "kvstore:n1").num_requests == 1
    a.worker.flush()
    done = a.worker.take_done()
    assert done.saves == {save.save_id: 1, save.disk.save_id: 1}
    done.saves.pop(save.save_id)
    a.sched.workers_done(done)
    a.sched.teller.flush()
    assert stats(server, "kvstore:n1").num_requests == 0 and lookup(server, "kvdisk:n1", prompt, "") == 12
    a.close()

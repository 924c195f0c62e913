"""Parts of bench/connector_bench.py: the timed engine actor, what a trial asks of the store tiers (saves
waited for, a RAM copy evicted, the page cache of page files dropped), and the bandwidth rows, each measured
next to its physical limit: the connector's copies against memcpy, NIXL READs against memcpy, the disk tier's
page files against sequential O_DIRECT I/O in the same directory."""

from __future__ import annotations

import itertools
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import time_call
from tests.vllm_engine.fleet import Engine

COLD = "cold: page cache dropped with POSIX_FADV_DONTNEED"


class Timed(Engine):
    """An engine actor that times its own generate calls (the Ray round trip is not in the TTFT)."""

    def ttft(self, prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        (tokens,) = self.generate([prompt], max_tokens=1)
        return time.perf_counter() - start, tokens[0][0]

    def threads(self) -> int:
        """torch's threads in this engine's process (a Ray actor's: OMP_NUM_THREADS, which Ray sets)."""
        import torch
        return torch.get_num_threads()


class Tiers:
    """The allocator's view of the store tiers, for the bench's tenant: what a pool holds of a prompt (salted
    with the engines' namespace, as the connector salts it), and a prompt's pages evicted from a pool."""

    def __init__(self, server, block_size: int, namespace: str) -> None:
        self.server, self.block_size, self.namespace = server, block_size, namespace

    def client(self):
        return self.server.client(client_name="connector-bench", hash_block_size=self.block_size)

    def tokens(self, pool: str, prompt: list[int]) -> int:
        with self.client() as c:
            return c.lookup(prompt, cache_salt=self.namespace, pool_ids=[pool]).tokens(pool)

    def wait_held(self, pools: list[str], prompt: list[int], num_tokens: int, timeout_s: float = 120.0) -> None:
        """Until every pool holds the prompt's first `num_tokens` (a writer's commits run off its step)."""
        deadline = time.monotonic() + timeout_s
        while True:
            short = {p: t for p in pools if (t := self.tokens(p, prompt)) < num_tokens}
            if not short:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"after {timeout_s:.0f} s these pools hold fewer than {num_tokens} tokens of "
                                     f"the prompt: {short}; a writer's save failed (see its engine's log)")
            time.sleep(0.1)

    def evict(self, pool: str, prompt: list[int]) -> int:
        """The prompt's cached pages leave `pool` (vLLM's evict_blocks, as a failed load would); returns how
        many."""
        from kvservice.ops import EvictBlocksOp, PinOp, UnpinOp
        with self.client() as c:
            c.open_session()
            (r,) = c.step(pool, [PinOp("bench-probe", token_ids=prompt, cache_salt=self.namespace)])
            ids = list(r.new_block_ids[0]) if r.new_block_ids else []
            c.step(pool, [UnpinOp("bench-probe")])
            if ids:
                c.step(pool, [EvictBlocksOp(ids)])
        left = self.tokens(pool, prompt)
        assert left == 0, f"{pool} still holds {left} tokens of the prompt after evicting pages {ids}"
        return len(ids)

    def suspended(self, pool: str) -> bool:
        with self.client() as c:
            stats = c.get_stats(pool_ids=[pool]).pools.get(pool)
        return stats is not None and bool(stats.suspended)


def drop_page_cache(directory: Path) -> int:
    """Drops the page cache of every file in `directory` (the page files are fsynced, so clean: DONTNEED drops
    them); returns the number of files."""
    n = 0
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        n += 1
    return n


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process of this machine so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def copy_bandwidth(model: dict, block_size: int, page_bytes: int, num_pages: int, reps: int) -> dict:
    """The connector's copies between a vLLM CPU engine's KV (the page format the engine builds: the CPU
    attention's layout, K transposed within a block) and store pages in a shared-memory segment, against a
    torch copy_ of the same bytes; and xxh3_64 of the same pages (what `verify_checksums` adds to a load)."""
    import torch

    from kvservice.blockstore.segment import Segment
    from kvservice.integrations.vllm.connector.movers import CpuMover
    from kvservice.integrations.vllm.connector.pagecheck import checksum
    from kvservice.integrations.vllm.connector.pageformat import PageFormat
    from kvservice.integrations.vllm.connector.worker_side import cpu_attention_isa
    head = model["head_dim"]
    shape = (num_pages + 1, model["num_key_value_heads"], block_size, 2 * head)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(shape) for i in range(model["num_hidden_layers"])}
    isa = cpu_attention_isa(torch.float32, block_size, head, "auto")
    fmt = PageFormat.build(kv, num_blocks=num_pages + 1, block_size=block_size, cpu_isa=isa, head_size=head,
                           cache_dtype="auto")
    assert fmt.page_bytes == page_bytes, (fmt.page_bytes, page_bytes)
    with tempfile.TemporaryDirectory(prefix="connector-bench-", dir="/dev/shm") as shm:
        seg = Segment(os.path.join(shm, "segment"), num_pages + 1, page_bytes, create=True)
        try:
            host = torch.from_numpy(seg.pages)
            mover, jobs, ids = CpuMover(fmt), itertools.count(), list(range(1, num_pages + 1))
            src, nbytes = host[1:].reshape(-1), num_pages * page_bytes
            dst = torch.empty(nbytes, dtype=torch.uint8)
            dst.copy_(src)  # its first touch out of the timing
            save = time_call(lambda: mover.submit_save(next(jobs), ids, host, ids), reps=reps)
            load = time_call(lambda: mover.submit_load(next(jobs), host, ids, ids), reps=reps)
            assert all(ok for _, ok in mover.finished()), "a copy failed"
            memcpy = time_call(lambda: dst.copy_(src), reps=reps)
            sums = time_call(lambda: [checksum(host[r].numpy()) for r in ids], reps=reps)
        finally:
            seg.close(unlink=True)
    load_s = statistics.median(load)
    return {"format": fmt.format_id, "bytes": nbytes, "reps": reps, "memcpy_GBps": gbps(nbytes, memcpy),
            "save_same_node_GBps": gbps(nbytes, save), "load_same_node_GBps": gbps(nbytes, load),
            "save_vs_memcpy": statistics.median(memcpy) / statistics.median(save),
            "load_vs_memcpy": statistics.median(memcpy) / load_s,
            "checksum_GBps": gbps(nbytes, sums), "checksum_vs_load_copy": statistics.median(sums) / load_s}


def nixl_bandwidth(page_bytes: int, num_pages: int, runs: int) -> dict:
    """bench/nixl_bench.py's READ of `num_pages` pages in a shuffled order (and their metadata) between two
    processes outside Ray, UCX default and UCX_TLS=tcp, next to an index_select of the same pages."""
    import numpy as np

    from bench.nixl_bench import memcpy_gbps, nixl_gbps
    ids = np.random.default_rng(0).permutation(np.arange(1, num_pages + 1))
    out: dict = {"pages": num_pages, "page_bytes": page_bytes, "runs": runs, "order": "shuffled",
                 "memcpy_GBps": statistics.median(memcpy_gbps(num_pages, page_bytes, ids, runs))}
    with tempfile.TemporaryDirectory(prefix="connector-bench-nixl-", dir="/dev/shm") as workdir:
        for tls in ("default", "tcp"):
            r = nixl_gbps(tls, num_pages, page_bytes, ids, runs, Path(workdir))
            out[tls] = {"error": r["error"]} if "error" in r else {
                "GBps": statistics.median(r["gbps"]), "bytes_ok": r["bytes_ok"],
                "vs_memcpy": statistics.median(r["gbps"]) / out["memcpy_GBps"]}
    return out


def disk_bandwidth(directory: Path, page_bytes: int, num_pages: int, reps: int) -> dict:
    """The disk tier's page files (DiskPages: write_slice with its two fsyncs per page, read_slice with the
    page cache dropped first) against one file written and read sequentially with O_DIRECT, in 1-page
    requests, in the same directory."""
    import numpy as np

    from kvservice.blockstore.disk import DiskPages, checksum
    data = np.random.default_rng(0).integers(0, 256, page_bytes, dtype=np.uint8)
    meta = np.array([1, checksum(data), 1, 1], dtype=np.uint64)  # tag, checksum, format, one slice
    out_buf = np.empty(page_bytes, np.uint8)
    writes, reads = [], []
    for rep in range(reps):
        root = directory / f"tier-{rep}"
        (root / "pages").mkdir(parents=True)
        pages = DiskPages(str(root), page_bytes)
        start = time.perf_counter()
        for page_id in range(1, num_pages + 1):
            pages.write_slice(page_id, 0, 0, data, meta)
        writes.append(time.perf_counter() - start)
        drop_page_cache(root / "pages")
        start = time.perf_counter()
        for page_id in range(1, num_pages + 1):
            pages.read_slice(page_id, 0, out_buf)
        reads.append(time.perf_counter() - start)
        shutil.rmtree(root)
    nbytes = num_pages * page_bytes
    out = {"bytes": nbytes, "reps": reps, "cold": COLD, "tier_write_GBps": gbps(nbytes, writes),
           "tier_read_cold_GBps": gbps(nbytes, reads)}
    plain = direct_io(directory / "direct.bin", nbytes, page_bytes, reps)
    out["o_direct"] = plain
    if "error" not in plain:
        out["write_vs_o_direct"] = out["tier_write_GBps"] / plain["write_GBps"]
        out["read_vs_o_direct"] = out["tier_read_cold_GBps"] / plain["read_GBps"]
    return out


def direct_io(path: Path, nbytes: int, chunk: int, reps: int) -> dict:
    """Sequential write (then one fsync) and read of `nbytes` in `chunk`-byte requests with O_DIRECT: the
    device's rate, no page cache on either side."""
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(chunk))
    writes, reads = [], []
    try:
        for _ in range(reps):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            try:
                start = time.perf_counter()
                for offset in range(0, nbytes, chunk):
                    os.pwrite(fd, buf, offset)
                os.fsync(fd)
                writes.append(time.perf_counter() - start)
            finally:
                os.close(fd)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                start = time.perf_counter()
                for offset in range(0, nbytes, chunk):
                    os.preadv(fd, [buf], offset)
                reads.append(time.perf_counter() - start)
            finally:
                os.close(fd)
    except OSError as exc:  # tmpfs and some overlay filesystems refuse O_DIRECT
        return {"error": f"O_DIRECT on {path.parent}: {exc}"}
    finally:
        buf.close()
        path.unlink(missing_ok=True)
    return {"how": f"one file, O_DIRECT from Python, {chunk >> 10} KiB requests, one fsync after the writes",
            "write_GBps": gbps(nbytes, writes), "read_GBps": gbps(nbytes, reads)}

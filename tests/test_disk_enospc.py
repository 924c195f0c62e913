"""A disk tier that runs out of space at a chosen write step of a write-through (the page file's header, its
slice, its fsync), with the connector's two sides (no vLLM) and a `kvservice store` process: the failed save
is not indexed, and once space is back the page ids it had take the next save whole: it loads from disk, and
a store that restarts over the files verifies and keeps every page."""

from __future__ import annotations

import re

import pytest
import torch

from kvservice.ops import EvictBlocksOp
from tests.connector_helpers import BS
from tests.disk_helpers import small_disk
from tests.service_helpers import start_server
from tests.test_connector_disk import Engine, StoreProcess, lookup

# Pages left free on the tmpfs before a 3-page save: a page file here is 2 of them (a 4 KiB header, the page's
# bytes), so ENOSPC hits the second file's header or its slice; "fsync": every write is taken, the writeback fails.
ENOSPC_AT = {"header": 2, "slice": 3, "fsync": 0}
VERIFIED = re.compile(r"(\d+) page files verified, (\d+) ids dropped")


def page_files(disk) -> list[int]:
    return sorted(int(p.stem) for p in (disk / "pages").glob("*.kvp"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server("--hash-block-size", str(BS), log_dir=tmp_path_factory.mktemp("enospc"))
    yield proc
    proc.stop()


@pytest.mark.parametrize("step", list(ENOSPC_AT))
def test_a_save_failed_by_enospc_leaves_its_page_ids_fit_for_the_next(server, tmp_path, step):
    """The disk tier has 4 page ids (a save of 3 pages takes all 4: one for the token past its blocks); a
    3-page save fails (ENOSPC at `step`), leaving no file; the space comes back; the next save lands on the ids
    whose writes failed, loads from disk once RAM lost it, and a store that restarts drops no page file: its 3
    pages verify and load again, the same pages."""
    name = f"nospc-{step}"
    disk_pool = f"kvdisk:{name}"
    (tmp_path / "shm").mkdir()
    with small_disk(tmp_path / "disk", writeback=step == "fsync") as (disk, ballast):
        store = StoreProcess(server, tmp_path / "shm", disk, name=name, disk_pages=5)
        engines: list[Engine] = []
        try:
            a = Engine(server, store, "a", 11)
            engines.append(a)
            ballast.fill(ENOSPC_AT[step])
            (failed,) = a.save("r1", list(range(1, 13)) + [0], [1, 2, 3, 4])
            assert failed.disk is not None and len(failed.disk.page_ids) == 3
            assert lookup(server, disk_pool, list(range(1, 13)), "") == 0
            left = page_files(disk)
            ballast.clear()

            prompt = list(range(50, 62)) + [0]
            (saved,) = a.save("r2", prompt, [5, 6, 7, 8])
            assert set(failed.disk.page_ids[1:]) <= set(saved.disk.page_ids)  # ids whose writes failed
            assert lookup(server, disk_pool, prompt, "") == 12
            with server.client(client_name="evictor", hash_block_size=BS) as c:
                c.open_session()
                c.step(f"kvstore:{name}", [EvictBlocksOp(saved.store_block_ids)])
            b = Engine(server, store, "b", 12)
            engines.append(b)
            found, load = b.hit("x", prompt, [9, 10, 11, 12])
            assert found == 12 and load.pool_id == disk_pool and not b.worker.take_failed_blocks()
            assert b.worker.counters.totals["loaded"] == {f"{name}:disk": 3}

            store.stop()
            store.start()
            assert "3 verified" in store.line, store.line
            c = Engine(server, store, "c", 13)
            engines.append(c)
            found, load = c.hit("y", prompt, [13, 14, 15, 16])
            assert found == 12 and load.pool_id == disk_pool and not c.worker.take_failed_blocks()
            assert load.store_block_ids == saved.disk.page_ids  # the same pages: kept across the restart
            for layer in a.kv:
                assert torch.equal(c.kv[layer][[13, 14, 15]], a.kv[layer][[5, 6, 7]])
            assert left == []  # the failed save's files were removed when it failed
        finally:
            for engine in engines:
                engine.close()
            store.stop()
        # Dropped at the restart: only the ids no save wrote a file for (the 4th id, a save's spare block).
        verified, dropped = map(int, VERIFIED.search(store.proc.stderr.read()).groups())
        assert (verified, dropped) == (3, 4 - len(page_files(disk))) == (3, 1)

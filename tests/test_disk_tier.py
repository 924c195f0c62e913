"""The disk tier's page files (kvservice/blockstore/disk.py): a slice is whole only once its bytes, checksum
and tag are durable; a file truncated, altered or never completed fails verification; a full disk fails the
write, at whichever step it fills, and leaves no file that a later save to that page id could be taken over with."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvservice.blockstore.disk import HEADER_BYTES, DiskPages, checksum, open_tier, page_path
from kvservice.blockstore.segment import CHECKSUM, FORMAT, META_FIELDS, TAG, WORLD
from tests.disk_helpers import small_disk, tiny_tmpfs

PAGE = 4096 * 3


def meta(data: np.ndarray, world: int, tag: int = 7) -> np.ndarray:
    m = np.zeros(META_FIELDS, np.uint64)
    m[TAG], m[CHECKSUM], m[FORMAT], m[WORLD] = tag, checksum(data), 99, world
    return m


def write_page(pages: DiskPages, page_id: int, world: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    width = PAGE // world
    slices = [rng.integers(0, 256, width, dtype=np.uint8) for _ in range(world)]
    for rank, data in enumerate(slices):
        pages.write_slice(page_id, rank, rank * width, data, meta(data, world))
    return slices


def test_slices_round_trip_and_verify(tmp_path):
    pages = DiskPages(str(tmp_path), PAGE)
    (tmp_path / "pages").mkdir()
    slices = write_page(pages, 3, world=2)
    assert pages.verify(3)
    out = np.empty(PAGE // 2, np.uint8)
    m = pages.read_slice(3, PAGE // 2, out)
    assert np.array_equal(out, slices[1]) and m[1, TAG] == 7 and m[1, WORLD] == 2
    assert os.path.getsize(page_path(str(tmp_path), 3)) == HEADER_BYTES + PAGE


def test_a_page_altered_truncated_or_half_written_fails_verification(tmp_path):
    pages = DiskPages(str(tmp_path), PAGE)
    (tmp_path / "pages").mkdir()
    for page_id in (1, 2, 3):
        write_page(pages, page_id, world=2, seed=page_id)
    with open(page_path(str(tmp_path), 1), "r+b") as f:  # a byte flipped in the middle
        f.seek(HEADER_BYTES + PAGE // 2 + 10)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    os.truncate(page_path(str(tmp_path), 2), HEADER_BYTES + PAGE // 3)  # cut short
    rng = np.random.default_rng(9)
    half = rng.integers(0, 256, PAGE // 2, dtype=np.uint8)
    pages.write_slice(4, 0, 0, half, meta(half, 2))  # rank 1 never wrote its slice
    assert [pages.verify(i) for i in (1, 2, 3, 4, 5)] == [False, False, True, False, False]


def test_tier_identity_is_kept_and_a_foreign_directory_refused(tmp_path):
    first = open_tier(str(tmp_path), "a", PAGE, 10 * (HEADER_BYTES + PAGE))
    again = open_tier(str(tmp_path), "a", PAGE, 10 * (HEADER_BYTES + PAGE))
    assert again == first and first.num_pages == 10 and first.pool_id == "kvdisk:a"
    with pytest.raises(ValueError, match="store 'a'.s pages of 12288 bytes, not store 'b'.s"):
        open_tier(str(tmp_path), "b", PAGE, 10 * (HEADER_BYTES + PAGE))
    with pytest.raises(ValueError, match="at least 2"):
        open_tier(str(tmp_path / "small"), "a", PAGE, PAGE)
    resized = open_tier(str(tmp_path), "a", PAGE, 20 * (HEADER_BYTES + PAGE))
    assert resized.num_pages == 20 and resized.epoch > first.epoch


@pytest.fixture
def tiny_disk(tmp_path):
    """A tmpfs with room for 64 KiB (as root, where mount works), else skip."""
    with tiny_tmpfs(tmp_path / "tiny", 64 << 10) as mount:
        yield mount


def test_a_full_disk_fails_the_write_and_leaves_no_page(tiny_disk):
    pages = DiskPages(str(tiny_disk), PAGE)
    (tiny_disk / "pages").mkdir()
    written = []
    with pytest.raises(OSError) as info:
        for page_id in range(1, 20):  # 64 KiB holds a few 16 KiB page files
            write_page(pages, page_id, world=1, seed=page_id)
            written.append(page_id)
    assert info.value.errno == 28  # ENOSPC
    failed = len(written) + 1
    assert written and all(pages.verify(i) for i in written) and not pages.verify(failed)
    assert not os.path.exists(page_path(str(tiny_disk), failed))


# Pages left free on the disk before a save of two pages (a page file is 4 tmpfs pages: a header, 3 of bytes),
# so ENOSPC hits at that step; "fsync": every write is taken and the writeback fails.
ENOSPC_AT = {"header": 0, "slice": 1, "mid-slice": 2, "second page's header": 4, "fsync": 0}


def save(pages: DiskPages, page_ids: list[int], seed: int) -> list[np.ndarray]:
    """One rank's write-through of a save (world 1): every page in one `write_slices`."""
    rng = np.random.default_rng(seed)
    data = [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in page_ids]
    pages.write_slices([(i, d, meta(d, 1, tag=seed)) for i, d in zip(page_ids, data)], 0, 0)
    return data


@pytest.mark.parametrize("step", list(ENOSPC_AT))
def test_enospc_at_any_write_step_leaves_no_file_and_the_ids_take_the_next_save(tmp_path, step):
    """A save whose write fails (ENOSPC at the header, the slice, the next page or the fsync) leaves no page
    file behind; once space is back, a save to the same ids is written whole (header included) and verifies."""
    with small_disk(tmp_path / "disk", writeback=step == "fsync") as (disk, ballast):
        pages = DiskPages(str(disk), PAGE)
        (disk / "pages").mkdir()
        ballast.fill(ENOSPC_AT[step])
        with pytest.raises(OSError) as info:
            save(pages, [1, 2], seed=1)
        assert info.value.errno == 28  # ENOSPC
        left = [i for i in (1, 2) if os.path.exists(page_path(str(disk), i))]
        ballast.clear()
        data = save(pages, [1, 2], seed=2)
        assert pages.verify(1) and pages.verify(2)
        out = np.empty(PAGE, np.uint8)
        for page_id, expected in zip((1, 2), data):
            m = pages.read_slice(page_id, 0, out)
            assert np.array_equal(out, expected) and m[0, TAG] == 2
        assert left == []  # removed on failure: nothing there holds space or looks like a page


def test_a_page_file_reused_by_id_is_rewritten_header_included(tmp_path):
    """A full-length file of zeros (what a write that failed at its header left before it was removed on
    failure) is not a page file: a save to its id writes the header again, and the page verifies."""
    pages = DiskPages(str(tmp_path), PAGE)
    (tmp_path / "pages").mkdir()
    with open(page_path(str(tmp_path), 5), "wb") as f:
        f.truncate(HEADER_BYTES + PAGE)
    assert not pages.verify(5)
    save(pages, [5], seed=3)
    assert pages.verify(5)

"""A store's local-disk tier: pages as files, under the store's RAM tier, that survive restarts.

Layout of the tier's directory:

    tier.json            the tier's identity: store name, pool id, page size, number of pages and its epoch
                         (chosen once, when the directory is first used: the pool keeps it across restarts)
    pages/<id>.kvp       page `id` of the pool `kvdisk:<name>`: a 4 KiB header, then the page's bytes

A page file's header holds what a segment's metadata holds for each slice (segment.py: the tag of the save
that wrote it, its checksum and its format), so a page on disk carries its own proof. A writer (an engine's
worker, for its rank's slice) writes the header's magic and page size (on every write: the file may be one a
failed write left), clears the slice's tag, writes the bytes, then checksum, format and tag, `fdatasync`s the
file, reads it back as a reader would (header, metadata, checksum), and syncs the directory when it created the
file: only then is the page reported, and only then does the allocator cache it. A write that fails at any
step (ENOSPC included) removes the files it wrote to. A reader checks the tag, the format and, always, the
checksum.

The allocator holds the index of these pages (the pool, its LRU, pins, tenants) in Redis like any pool's. A
store that restarts verifies every page file before it re-attaches the pool, and has the allocator drop the
pages that fail (a file truncated, altered or never completed).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvservice.blockstore.segment import CHECKSUM, FORMAT, MAX_SLOTS, META_FIELDS, TAG, WORLD

HEADER_BYTES = 4096
MAGIC = b"KVSDSK01"
_META_OFFSET = 64  # in the header: magic (8), page_bytes (8), spare; then the slices' metadata
_META_BYTES = MAX_SLOTS * META_FIELDS * 8


@dataclass(frozen=True, slots=True)
class TierInfo:
    name: str
    pool_id: str
    page_bytes: int
    num_pages: int
    epoch: int

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.page_bytes


def disk_pool_id(name: str) -> str:
    return f"kvdisk:{name}"


def open_tier(directory: str, name: str, page_bytes: int, disk_bytes: int) -> TierInfo:
    """The tier in `directory` (created when new). A directory left by a store of another name or page size
    is refused, naming both, rather than reused for pages of another format."""
    root = Path(directory)
    (root / "pages").mkdir(parents=True, exist_ok=True)
    num_pages = disk_bytes // (HEADER_BYTES + page_bytes)
    if num_pages < 2:
        raise ValueError(f"--store-disk-bytes {disk_bytes}: room for {num_pages} pages of {page_bytes} bytes "
                         f"(+{HEADER_BYTES} of header each); a disk tier needs at least 2")
    path = root / "tier.json"
    if path.exists():
        info = TierInfo(**json.loads(path.read_text()))
        if (info.name, info.page_bytes) != (name, page_bytes):
            raise ValueError(f"--store-disk {directory}: it holds store {info.name!r}'s pages of {info.page_bytes} "
                             f"bytes, not store {name!r}'s of {page_bytes}; use another directory or empty it")
        if info.num_pages != num_pages:
            # Another byte budget: the same pages, a pool of another size (a new epoch, its index starts empty).
            info = TierInfo(name, disk_pool_id(name), page_bytes, num_pages, max(time.time_ns(), info.epoch + 1))
            _write_json(path, info)
        return info
    info = TierInfo(name, disk_pool_id(name), page_bytes, num_pages, time.time_ns())
    _write_json(path, info)
    return info


def bump_epoch(directory: str, info: TierInfo) -> TierInfo:
    """The tier at a new epoch (its pages no index names any more), kept in tier.json."""
    new = TierInfo(info.name, info.pool_id, info.page_bytes, info.num_pages, max(time.time_ns(), info.epoch + 1))
    _write_json(Path(directory) / "tier.json", new)
    return new


def _write_json(path: Path, info: TierInfo) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(info)))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def page_path(directory: str, page_id: int) -> str:
    return os.path.join(directory, "pages", f"{page_id}.kvp")


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(data)))


class DiskPages:
    """Reads and writes one tier's page files (any process of the node: the store verifies, engines' workers
    write and read their rank's slice)."""

    def __init__(self, directory: str, page_bytes: int) -> None:
        self.directory, self.page_bytes = directory, page_bytes

    def write_slice(self, page_id: int, slot: int, offset: int, data: np.ndarray, meta: np.ndarray) -> None:
        """One slice (`write_slices` of one)."""
        self.write_slices([(page_id, data, meta)], slot, offset)

    def write_slices(self, items: list[tuple[int, np.ndarray, np.ndarray]], slot: int, offset: int) -> None:
        """Slice `slot` (at byte `offset` of its page) of each `(page_id, data, meta)`: the file's header, the
        slice's tag cleared, its bytes, then its metadata (`[4]`, tag included); every file `fdatasync`ed, then
        read back and checked (header, metadata, checksum), and the directory synced for files it created,
        before this returns: the slices are durable and whole when the caller reports them. A crash before
        that leaves pages nobody indexed (and whose checksums a restart finds wrong if torn). Any failure
        (ENOSPC at any step, a file that does not read back as written) raises OSError and removes the files
        this call wrote to: none is left that a later save to its id could be taken over with."""
        at = _META_OFFSET + slot * META_FIELDS * 8
        head = MAGIC + int(self.page_bytes).to_bytes(8, "little")
        paths: list[str] = []
        created = False
        try:
            fds: list[int] = []
            try:
                for page_id, data, meta in items:
                    path = page_path(self.directory, page_id)
                    created |= not os.path.exists(path)
                    fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
                    paths.append(path)
                    fd = fds[-1]
                    if os.fstat(fd).st_size < HEADER_BYTES + self.page_bytes:
                        os.ftruncate(fd, HEADER_BYTES + self.page_bytes)
                    # Every time, not only on a short file: ftruncate allocates nothing, so a write that stopped
                    # after it (a crash, an older version's ENOSPC) leaves a full-length file with no header.
                    _pwrite_all(fd, memoryview(head.ljust(_META_OFFSET, b"\0")), 0)
                    _pwrite_all(fd, memoryview(bytes(META_FIELDS * 8)), at)  # being written
                    _pwrite_all(fd, memoryview(np.ascontiguousarray(data)).cast("B"), HEADER_BYTES + offset)
                    _pwrite_all(fd, memoryview(np.asarray(meta, dtype="<u8").tobytes()), at)
                for fd in fds:
                    os.fdatasync(fd)
            finally:
                for fd in fds:
                    os.close(fd)
            for page_id, data, meta in items:
                self._check_written(page_id, slot, offset, np.asarray(data).nbytes, meta)
            if created:
                _fsync_dir(Path(self.directory) / "pages")
        except BaseException:
            # A failed fdatasync is reported once and may leave right-looking bytes in the page cache that never
            # reached the disk: such a file is removed, never trusted or synced again.
            for path in paths:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise

    def _check_written(self, page_id: int, slot: int, offset: int, nbytes: int, meta: np.ndarray) -> None:
        """The page file as a reader will find it: header, this slot's metadata as written, the slice's bytes
        matching its checksum. OSError when not."""
        out = np.empty(nbytes, np.uint8)
        try:
            got = self.read_slice(page_id, offset, out)
        except LookupError as exc:
            raise OSError(errno.EIO, f"{exc} after it was written") from None
        want = np.asarray(meta, dtype="<u8")
        if not np.array_equal(got[slot], want) or checksum(out) != int(want[CHECKSUM]):
            raise OSError(errno.EIO, f"disk page {page_id}: slot {slot} does not read back as written")

    def read_meta(self, page_id: int) -> np.ndarray | None:
        """`[MAX_SLOTS, 4]` of the page file, or None when there is no such file (or it is cut short)."""
        try:
            with open(page_path(self.directory, page_id), "rb") as f:
                head = f.read(_META_OFFSET + _META_BYTES)
        except FileNotFoundError:
            return None
        if len(head) < _META_OFFSET + _META_BYTES or head[:8] != MAGIC:
            return None
        return np.frombuffer(head[_META_OFFSET:], dtype="<u8").reshape(MAX_SLOTS, META_FIELDS).copy()

    def read_slice(self, page_id: int, offset: int, out: np.ndarray) -> np.ndarray:
        """The slice's bytes at `offset` of the page into `out` (uint8, its length); returns the page's
        metadata. LookupError when the file is missing or cut short."""
        path = page_path(self.directory, page_id)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise LookupError(f"disk page {page_id}: no file {path}") from None
        try:
            head = os.pread(fd, _META_OFFSET + _META_BYTES, 0)
            n = os.preadv(fd, [memoryview(out)], HEADER_BYTES + offset)
        finally:
            os.close(fd)
        if head[:8] != MAGIC or n != out.nbytes:
            raise LookupError(f"disk page {page_id}: file {path} is cut short or not a page file")
        return np.frombuffer(head[_META_OFFSET:], dtype="<u8").reshape(MAX_SLOTS, META_FIELDS).copy()

    def verify(self, page_id: int) -> bool:
        """Whether every written slice of the page file checks (tag set, checksum of its bytes): what a store
        that restarts asks of each page before the allocator serves it again."""
        meta = self.read_meta(page_id)
        if meta is None:
            return False
        world = int(meta[0, WORLD])
        if not 1 <= world <= MAX_SLOTS or self.page_bytes % world:
            return False
        width = self.page_bytes // world
        buf = np.empty(width, np.uint8)
        for s in range(world):
            if not meta[s, TAG] or not meta[s, FORMAT] or int(meta[s, WORLD]) != world:
                return False
            try:
                self.read_slice(page_id, s * width, buf)
            except LookupError:
                return False
            if checksum(buf) != int(meta[s, CHECKSUM]):
                return False
        return True


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        data, offset = data[n:], offset + n

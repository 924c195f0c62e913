"""A store's local-disk tier: pages as files, under the store's RAM tier, that survive restarts.

Layout of the tier's directory:

    tier.json            the tier's identity: store name, pool id, page size, number of pages and its epoch
                         (chosen once, when the directory is first used: the pool keeps it across restarts)
    pages/<id>.kvp       page `id` of the pool `kvdisk:<name>`: a 4 KiB header, then the page's bytes

A page file's header holds what a segment's metadata holds for each slice (segment.py: the tag of the save
that wrote it, its checksum and its format), so a page on disk carries its own proof. A writer (an engine's
worker, for its rank's slice) clears the slice's tag, writes the bytes, then checksum, format and tag, and
`fdatasync`s the file (and the directory when it created the file): only then is the page reported, and only
then does the allocator cache it. A reader checks the tag, the format and, always, the checksum.

The allocator holds the index of these pages (the pool, its LRU, pins, tenants) in Redis like any pool's. A
store that restarts verifies every page file before it re-attaches the pool, and has the allocator drop the
pages that fail (a file truncated, altered or never completed).
"""

from __future__ import annotations

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
        """Slice `slot` (at byte `offset` of its page) of each `(page_id, data, meta)`: the slice's tag cleared,
        its bytes, then its metadata (`[4]`, tag included); every file `fdatasync`ed (and the directory, for
        files it created) before this returns, so the slices are durable when the caller reports them. A crash
        before that leaves pages nobody indexed (and whose checksums a restart finds wrong if torn). OSError
        (ENOSPC, ...) leaves the slice being written untagged."""
        at = _META_OFFSET + slot * META_FIELDS * 8
        fds, created = [], False
        try:
            for page_id, data, meta in items:
                path = page_path(self.directory, page_id)
                created |= not os.path.exists(path)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                fds.append(fd)
                if os.fstat(fd).st_size < HEADER_BYTES + self.page_bytes:
                    os.ftruncate(fd, HEADER_BYTES + self.page_bytes)
                    os.pwrite(fd, MAGIC + int(self.page_bytes).to_bytes(8, "little"), 0)
                os.pwrite(fd, np.zeros(META_FIELDS, "<u8").tobytes(), at)  # being written
                _pwrite_all(fd, memoryview(np.ascontiguousarray(data)), HEADER_BYTES + offset)
                os.pwrite(fd, np.asarray(meta, dtype="<u8").tobytes(), at)
            for fd in fds:
                os.fdatasync(fd)
        finally:
            for fd in fds:
                os.close(fd)
        if created:
            _fsync_dir(Path(self.directory) / "pages")

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

"""A store's memory: `num_blocks` pages of `page_bytes` in a file under /dev/shm (with a header and each page's
metadata), mapped by every process of the node that reads or writes it, and a small JSON descriptor beside it
that names the current segment."""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

DEFAULT_DIR = "/dev/shm"


@dataclass(frozen=True, slots=True)
class Descriptor:
    """What a process on the store's node needs to map its pages, and what tells a restarted store apart."""

    name: str
    pool_id: str
    path: str  # the segment file
    num_blocks: int
    page_bytes: int
    block_size: int
    generation: int  # a store restart makes a new one (and a new pool epoch): old page ids mean nothing
    node_id: str = ""
    pid: int = 0
    disk_dir: str = ""  # the store's disk tier (disk.py), when it has one: its pool and that pool's epoch
    disk_pool_id: str = ""
    disk_epoch: int = 0
    tenant: str | None = None  # the tenant of the store's token, as the allocator named it (None: not recorded)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def descriptor_path(name: str, directory: str = DEFAULT_DIR) -> Path:
    return Path(directory) / f"kvservice-store-{name}.json"


def read_descriptor(name: str, directory: str = DEFAULT_DIR) -> Descriptor | None:
    """The descriptor the store `name` wrote on this node, or None when there is none (or another user wrote
    it: /dev/shm is everyone's, and a descriptor says where engines write)."""
    path = descriptor_path(name, directory)
    try:
        if path.stat().st_uid != os.getuid():
            return None
        return Descriptor(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def live_descriptors(directory: str = DEFAULT_DIR) -> list[Descriptor]:
    """The descriptors in `directory` whose store process is alive (on this node), this user's only (as
    `read_descriptor`)."""
    out = []
    for path in sorted(Path(directory).glob("kvservice-store-*.json")):
        try:
            if path.stat().st_uid != os.getuid():
                continue
            d = Descriptor(**json.loads(path.read_text()))
            os.kill(d.pid, 0)
        except (OSError, ValueError, TypeError):
            continue
        out.append(d)
    return out


def write_descriptor(d: Descriptor, directory: str = DEFAULT_DIR) -> Path:
    path = descriptor_path(d.name, directory)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(d.to_json())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)  # atomic: a reader sees the old descriptor or the new one
    return path


HEADER_BYTES = 4096
MAGIC = b"KVSSEG02"
MAX_SLOTS = 16  # page slices: one per tensor-parallel rank of the engine that wrote the page
META_FIELDS = 4  # per (page, slice): tag, checksum, format, the writer's number of slices (uint64 each)
TAG, CHECKSUM, FORMAT, WORLD = 0, 1, 2, 3
_HEADER = np.dtype([("magic", "S8"), ("num_blocks", "<u8"), ("page_bytes", "<u8"), ("slots", "<u8"),
                    ("generation", "<u8"), ("closed", "<u8")])


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def segment_bytes(num_blocks: int, page_bytes: int) -> tuple[int, int, int]:
    """(meta offset, pages offset, total size) of a segment: a header page, then each page's metadata, then
    the pages (aligned to 4 KiB, as O_DIRECT reads and page-locking want)."""
    meta_offset = HEADER_BYTES
    pages_offset = _round_up(meta_offset + num_blocks * MAX_SLOTS * META_FIELDS * 8, 4096)
    return meta_offset, pages_offset, pages_offset + num_blocks * page_bytes


class Segment:
    """A store's memory in a shared file: a header, per-page metadata and the pages.

    - `pages`: `[num_blocks, page_bytes]` uint8, the KV.
    - `meta`: `[num_blocks, MAX_SLOTS, 4]` uint64: per page and slice (an engine rank's part of the page) the
      tag of the save that wrote it, the checksum of its bytes and its format, written by the writer before
      it commits. A reader checks them before it tells vLLM a block is there.
    - the header: the store's generation, and whether the store closed it (a reader that mapped it earlier
      then stops reading it). A store killed leaves it as it was: its pinned pages are what was committed.
    """

    def __init__(self, path: str, num_blocks: int, page_bytes: int, create: bool = False,
                 generation: int = 0, populate: bool = True) -> None:
        if num_blocks < 2 or page_bytes < 1:
            raise ValueError(f"a store segment needs num_blocks >= 2 and page_bytes >= 1, got {num_blocks} and "
                             f"{page_bytes}")
        self.path, self.num_blocks, self.page_bytes = path, num_blocks, page_bytes
        meta_offset, pages_offset, size = segment_bytes(num_blocks, page_bytes)
        if not create and os.path.getsize(path) != size:
            raise ValueError(f"store segment {path}: {os.path.getsize(path)} bytes, expected {num_blocks} pages of "
                             f"{page_bytes} bytes ({size} with its header and metadata)")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600) if create else os.open(path, os.O_RDWR)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # the memory now, not page by page under the first copies
            # populate: every page mapped now (MAP_POPULATE, ~60 ms a GiB here), so no copy takes page faults;
            # else each page's first touch faults (16 pages a fault: the same time in all, spread over loads,
            # and only for the pages touched: bench/connector_bench_probes.py).
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._map = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        self.header = np.frombuffer(self._map, dtype=_HEADER, count=1)
        num_meta = num_blocks * MAX_SLOTS * META_FIELDS
        self.meta = np.frombuffer(self._map, dtype="<u8", offset=meta_offset, count=num_meta).reshape(
            num_blocks, MAX_SLOTS, META_FIELDS)
        self.pages = np.frombuffer(self._map, dtype=np.uint8, offset=pages_offset,
                                   count=num_blocks * page_bytes).reshape(num_blocks, page_bytes)
        self.pages_offset = pages_offset
        if create:
            h = self.header[0]
            h["num_blocks"], h["page_bytes"], h["slots"] = num_blocks, page_bytes, MAX_SLOTS
            h["generation"] = generation
            h["magic"] = MAGIC  # last: a reader sees a whole header or none
        elif bytes(self.header[0]["magic"]) != MAGIC or int(self.header[0]["page_bytes"]) != page_bytes:
            raise ValueError(f"store segment {path}: not a kvservice segment of {page_bytes}-byte pages (format "
                             f"{bytes(self.header[0]['magic'])!r})")

    @classmethod
    def attach(cls, d: Descriptor, populate: bool = True) -> Segment:
        return cls(d.path, d.num_blocks, d.page_bytes, populate=populate)

    @property
    def generation(self) -> int:
        return int(self.header[0]["generation"])

    def mark_closed(self) -> None:
        self.header[0]["closed"] = 1

    @property
    def closed(self) -> bool:
        return bool(self.header[0]["closed"])

    def check_ids(self, block_ids) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 1 or ids.max() >= self.num_blocks):
            bad = next(int(i) for i in ids if not 1 <= i < self.num_blocks)
            raise ValueError(f"block_ids: {bad} is not a page of this store (1..{self.num_blocks - 1})")
        return ids

    def read(self, block_ids) -> np.ndarray:
        """A copy of the pages, in the order named."""
        return self.pages[self.check_ids(block_ids)]

    def read_meta(self, block_ids) -> np.ndarray:
        """A copy of the pages' metadata, `[n, MAX_SLOTS, 4]`."""
        return self.meta[self.check_ids(block_ids)]

    def write(self, block_ids, data: np.ndarray, meta: np.ndarray | None = None) -> None:
        ids = self.check_ids(block_ids)
        if data.shape != (len(ids), self.page_bytes):
            raise ValueError(f"data: shape {tuple(data.shape)}, expected ({len(ids)}, {self.page_bytes})")
        self.pages[ids] = data
        if meta is not None:
            self.meta[ids] = meta

    def close(self, unlink: bool = False) -> None:
        self.pages = self.meta = self.header = None  # the mapping goes with the last view of it
        self._map = None
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

"""The copies between an engine's KV and pages, for a page format's pieces (pageformat.py): each piece is a
strided view over the engine's storage whose dim 0 is the scheduler block, in the widest word the piece's
offsets and strides allow.

Two ways to run them:
- by runs (a CPU's KV, `fast`): the blocks and page rows are cut into runs that advance by a constant step on
  both sides (consecutive ids are one run; a descending stretch, which a store that wrapped hands out, is one
  run walked backwards), and each run of each piece is one `copy_` between plain strided views: no index
  tensor, no temporary, each copy a contiguous inner loop wherever one side has one, on torch's threads (a
  vLLM CPU worker's OpenMP team, bound to its cores). Each copy is one parallel region: a job whose blocks
  fall apart into single-block runs opens two per block, and on cores shared with a busy process every region
  waits for a preempted thread (128 single-block runs: 20 ms alone, 200 ms beside one CPU-bound process,
  where one 128-block run takes 19 and 43 ms). A pool of Python threads avoids that but inherits the binding
  of the thread that starts it (a vLLM CPU worker's main thread is bound to one core), so it is not used;
- compiled (a CPU's KV where kvservice/native is built, the default there): every (block, row) pair of every
  piece in one call into a C library, in equal shares on one thread per core the process's threads may run on
  (a vLLM CPU worker's OpenMP team binds them to its cores; at most COPY_THREADS): the copy runs while the
  engine waits for it, so the cores its forward uses are idle then, however many threads torch was given (a
  Ray actor's engine gets OMP_NUM_THREADS=1); the CPU layout's K, a transpose, with contiguous writes.
  `KVSERVICE_NATIVE=0` selects the torch runs above; tests/test_native_copy.py compares the two;
- by index (a GPU's KV, and the reference path the tests compare with): one `index_select` or `index_copy_`
  per piece over every block, which on a GPU is one kernel.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from kvservice import native

logger = logging.getLogger(__name__)

WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
COPY_THREADS = 8  # the copies are memory-bound: more threads than this add no bandwidth


@dataclass(slots=True)
class Piece:
    """One strided copy between the storage and a page: block b's element at index i sits at
    `src_offset + b*block_stride + sum(i*src_stride)` in the storage and `dst_offset + sum(i*dst_stride)` in the
    page (all bytes); `dims` are (size, src_stride, dst_stride), the last one unit-stride on both sides."""

    storage: torch.UntypedStorage
    src_offset: int
    block_stride: int
    dst_offset: int
    dims: list[tuple[int, int, int]]


@dataclass(slots=True)
class Copy:
    """A piece as tensors of one word size: `src` is `[num_blocks, *sizes]` over the engine's storage."""

    src: torch.Tensor
    dst_offset: int  # words
    sizes: tuple[int, ...]
    dst_strides: tuple[int, ...]  # words

    def page_view(self, pages: torch.Tensor, first: int = 0, step: int = 1, count: int | None = None) -> torch.Tensor:
        """Rows first, first + step, ... (`count` of them; all by default) of `pages` as this piece's view."""
        words = pages.view(self.src.dtype)
        count = pages.shape[0] if count is None else count
        return words.as_strided((count, *self.sizes), (step * words.stride(0), *self.dst_strides),
                                words.storage_offset() + first * words.stride(0) + self.dst_offset)


def word_size(p: Piece, page_bytes: int) -> int:
    size, src, dst = p.dims[-1]
    assert src == 1 and dst == 1, p.dims
    for w in (8, 4, 2, 1):
        strides = [s for d in p.dims[:-1] for s in d[1:]]
        values = [size, p.src_offset, p.dst_offset, p.block_stride, page_bytes, p.storage.data_ptr(), *strides]
        if all(v % w == 0 for v in values):
            return w
    return 1


def runs(ids: list[int], rows: list[int]) -> list[tuple[int, int, int, int, int]]:
    """(first block, block step, first row, row step, count): maximal stretches of (block, row) pairs that
    advance by one constant positive step on both sides; a stretch that descends on both is returned walked
    backwards (ascending), one whose sides go opposite ways falls apart into single pairs."""
    out: list[tuple[int, int, int, int, int]] = []
    i, n = 0, len(ids)
    while i < n:
        j = i + 1
        if j < n:
            db, dr = ids[j] - ids[i], rows[j] - rows[i]
            if (db > 0 and dr > 0) or (db < 0 and dr < 0):
                while j + 1 < n and ids[j + 1] - ids[j] == db and rows[j + 1] - rows[j] == dr:
                    j += 1
                j += 1
        k = j - i
        if k == 1:
            out.append((ids[i], 1, rows[i], 1, 1))
        else:
            db, dr = ids[i + 1] - ids[i], rows[i + 1] - rows[i]
            if db > 0:
                out.append((ids[i], db, rows[i], dr, k))
            else:
                out.append((ids[j - 1], -db, rows[j - 1], -dr, k))
        i = j
    return out


class Copier:
    """The copies of one page format: `gather` (engine blocks into page rows) and `scatter` (page rows into
    engine blocks)."""

    def __init__(self, pieces: list[Piece], page_bytes: int, num_blocks: int, device: torch.device,
                 fast: bool) -> None:
        self.pieces, self.page_bytes, self.num_blocks, self.device, self.fast = (pieces, page_bytes, num_blocks,
                                                                                device, fast)
        self._copies: dict[int, list[Copy]] = {}
        self.by_runs = fast and device.type == "cpu"
        # The widest word every piece allows (the pages' alignment may narrow it per call: copies_for).
        self._word = min([word_size(p, page_bytes) if fast else 1 for p in pieces] + [8])
        self._native = self._native_pieces() if self.by_runs else None
        self._cpus: bytes | None = None
        self.threads = 0  # the compiled copies' threads (0: one per core of the process, found at the first copy)
        self._said_threads = False

    def _native_pieces(self):
        """The pieces as the C library's records, or None (not built, not selected, a piece it cannot take)."""
        lib = native.library()
        if lib is None or any(len(p.dims) > native.MAX_DIMS for p in self.pieces):
            return None
        records = []
        for p in self.pieces:
            dims = [x for d in p.dims for x in d] + [0] * 3 * (native.MAX_DIMS - len(p.dims))
            records += [p.storage.data_ptr(), p.src_offset, p.block_stride, p.dst_offset, len(p.dims), *dims]
        return lib, (ctypes.c_int64 * len(records))(*records)

    @property
    def native(self) -> bool:
        return self._native is not None

    def _native_copy(self, pages: torch.Tensor, id_list: list[int], rows: list[int] | None, scatter: int) -> None:
        lib, records = self._native
        n = len(id_list)
        blocks = (ctypes.c_int64 * n)(*id_list)
        row_ids = (ctypes.c_int64 * n)(*(rows if rows is not None else range(n)))
        if self._cpus is None:
            cpus = native.process_cpus()
            self._cpus = native.cpu_mask(cpus)
            self.threads = self.threads or min(len(cpus), COPY_THREADS)
        threads = self.threads if n * self.page_bytes >= 1 << 20 else 1
        rc = lib.kv_copy(records, len(self.pieces), pages.data_ptr(), pages.stride(0), blocks, row_ids, n, scatter,
                         threads, self._cpus, len(self._cpus) * 8)
        if rc == -2:
            raise MemoryError("KVServiceConnector: the compiled page copy could not allocate its job")
        if rc == -1 and not self._said_threads:  # copied all the same, by fewer threads
            self._said_threads = True
            logger.warning("KVServiceConnector: the page copies could not start %d threads; fewer copied", threads)

    def gather(self, ids: torch.Tensor, id_list: list[int] | None, out: torch.Tensor, rows: list[int] | None) -> None:
        if self._native is not None:
            self._native_copy(out, id_list, rows, 0)
            return
        copies = self.copies_for(out)
        if self.by_runs:
            for b, db, r, dr, k in self._runs(id_list, rows):
                for c in copies:
                    c.page_view(out, r, dr, k).copy_(c.src[b:b + db * (k - 1) + 1:db])
            return
        row_index = None if rows is None else torch.as_tensor(rows, dtype=torch.int64, device=out.device)
        for c in copies:
            dst = c.page_view(out)
            if row_index is not None:
                dst.index_copy_(0, row_index, c.src.index_select(0, ids))
            elif dst.is_contiguous():
                torch.index_select(c.src, 0, ids, out=dst)
            else:
                dst.copy_(c.src.index_select(0, ids))

    def scatter(self, pages: torch.Tensor, ids: torch.Tensor, id_list: list[int] | None,
                rows: list[int] | None) -> None:
        if self._native is not None:
            self._native_copy(pages, id_list, rows, 1)
            return
        copies = self.copies_for(pages)
        if self.by_runs:
            for b, db, r, dr, k in self._runs(id_list, rows):
                for c in copies:
                    c.src[b:b + db * (k - 1) + 1:db].copy_(c.page_view(pages, r, dr, k))
            return
        row_index = None if rows is None else torch.as_tensor(rows, dtype=torch.int64, device=pages.device)
        for c in copies:
            src = c.page_view(pages)
            c.src.index_copy_(0, ids, src if row_index is None else src.index_select(0, row_index))

    @staticmethod
    def _runs(id_list: list[int], rows: list[int] | None) -> list[tuple[int, int, int, int, int]]:
        return runs(id_list, rows if rows is not None else list(range(len(id_list))))

    def copies_for(self, pages: torch.Tensor) -> list[Copy]:
        """The copies in the widest word every piece and these pages' alignment allow."""
        align = pages.stride(0) | pages.storage_offset() | pages.untyped_storage().data_ptr()
        w = min(self._word, align & -align or 8)
        if w not in self._copies:
            self._copies[w] = [self._copy(p, w) for p in self.pieces]
        return self._copies[w]

    def _copy(self, p: Piece, w: int) -> Copy:
        dtype = WORDS[w]
        base = torch.empty(0, dtype=dtype, device=self.device).set_(p.storage, 0, (p.storage.nbytes() // w,), (1,))
        sizes = tuple(d[0] for d in p.dims[:-1]) + (p.dims[-1][0] // w,)
        src_strides = tuple(d[1] // w for d in p.dims[:-1]) + (1,)
        src = base.as_strided((self.num_blocks, *sizes), (p.block_stride // w, *src_strides), p.src_offset // w)
        return Copy(src, p.dst_offset // w, sizes, tuple(d[2] // w for d in p.dims[:-1]) + (1,))

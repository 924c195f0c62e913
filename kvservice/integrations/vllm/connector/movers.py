"""Copies of pages between the engine's KV and host pages (the store's segment), as jobs: submit, then poll
`finished()`; a job's blocks and host pages must stay untouched until it is reported.

`CpuMover` copies at once (a CPU engine's KV is host memory), straight between the engine's blocks and the host
rows, in runs (pagecopy.py). `CudaMover` runs each direction on a side stream
of its own, ordered after the work already on the compute stream; per chunk of a job one gather into a device
staging buffer and one transfer per run of consecutive host rows; an event per job, polled.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch

from kvservice.integrations.vllm.connector.cudadma import Dma
from kvservice.integrations.vllm.connector.pageformat import PageFormat

logger = logging.getLogger(__name__)

JobId = Hashable
STAGING_BYTES = 64 << 20  # per direction: transfers this large run at PCIe speed; more only costs GPU memory
HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def row_runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """(position, first row, length) of each stretch of consecutive rows."""
    out: list[tuple[int, int, int]] = []
    for i, r in enumerate(rows):
        if out and out[-1][1] + out[-1][2] == r:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, r, 1))
    return out


class PageMover(ABC):
    """Moves pages for one engine's KV (`fmt`). `submit_*` raise ValueError for bad arguments before anything is
    copied; a copy that fails later is reported as `(job_id, False)` (its blocks are recomputed)."""

    def __init__(self, fmt: PageFormat) -> None:
        self.fmt = fmt
        self.num_saved_pages = self.num_loaded_pages = 0

    @abstractmethod
    def submit_save(self, job_id: JobId, block_ids: list[int], host_pages: torch.Tensor, rows: list[int]) -> None:
        """The engine's blocks `block_ids` into rows `rows` of `host_pages` (`[num_rows, page_bytes]` uint8)."""

    @abstractmethod
    def submit_load(self, job_id: JobId, host_pages: torch.Tensor, rows: list[int], block_ids: list[int]) -> None:
        """Rows `rows` of `host_pages` into the engine's blocks `block_ids`."""

    @abstractmethod
    def finished(self) -> list[tuple[JobId, bool]]:
        """The jobs completed since the last call, with whether they succeeded; never blocks."""

    @abstractmethod
    def wait(self, job_ids: Iterable[JobId]) -> None:
        """Blocks until these jobs completed (`finished()` still reports them)."""

    def pin(self, host_pages: torch.Tensor) -> bool:
        """Page-locks host memory the mover will copy to or from often (the store's segment); True if it is."""
        return True

    def unpin(self, host_pages: torch.Tensor) -> None:
        """Undoes `pin` (before the memory is unmapped)."""
        return None

    def wait_for_loads_on(self, stream: torch.cuda.Stream | None = None) -> None:
        """Makes `stream` (the compute stream) wait for the submitted loads, on the device."""
        return None

    def close(self) -> None:
        """Waits for everything submitted and releases what the mover holds."""
        return None

    def check(self, block_ids: list[int], host_pages: torch.Tensor, rows: list[int], load: bool) -> None:
        if len(block_ids) != len(rows):
            raise ValueError(f"KVServiceConnector: {len(block_ids)} blocks but {len(rows)} host rows")
        if (host_pages.dtype != torch.uint8 or host_pages.dim() != 2 or host_pages.shape[1] != self.fmt.page_bytes
                or host_pages.stride(1) != 1 or host_pages.device.type != "cpu"):
            raise ValueError(f"KVServiceConnector: host pages must be [rows, {self.fmt.page_bytes}] uint8 in host "
                             f"memory ({self.fmt.format_id}); got {tuple(host_pages.shape)} {host_pages.dtype} on "
                             f"{host_pages.device} (another model, dtype, layout or block size?)")
        if rows and (min(rows) < 0 or max(rows) >= host_pages.shape[0]):
            raise ValueError(f"KVServiceConnector: host row {min(rows) if min(rows) < 0 else max(rows)} is outside "
                             f"the {host_pages.shape[0]} host pages")
        if not load and len(set(rows)) != len(rows):
            raise ValueError(f"KVServiceConnector: a host row is repeated in {rows[:16]}...")
        self.fmt.block_index(block_ids, unique=load)


class CpuMover(PageMover):
    """Synchronous copies between a CPU engine's KV and host pages: jobs are finished when submitted."""

    def __init__(self, fmt: PageFormat) -> None:
        super().__init__(fmt)
        self._done: list[tuple[JobId, bool]] = []

    def submit_save(self, job_id: JobId, block_ids: list[int], host_pages: torch.Tensor, rows: list[int]) -> None:
        self.check(block_ids, host_pages, rows, load=False)
        try:  # straight into the host rows, whatever their order (no temporary: pagecopy.py)
            self.fmt.gather(block_ids, host_pages, rows)
            self.num_saved_pages += len(rows)
            self._done.append((job_id, True))
        except Exception as exc:  # noqa: BLE001 - reported: the pages are not committed
            logger.warning("kvservice connector: saving job %s failed (%s: %s)", job_id, type(exc).__name__, exc)
            self._done.append((job_id, False))

    def submit_load(self, job_id: JobId, host_pages: torch.Tensor, rows: list[int], block_ids: list[int]) -> None:
        self.check(block_ids, host_pages, rows, load=True)
        try:
            self.fmt.scatter(host_pages, block_ids, rows)
            self.num_loaded_pages += len(rows)
            self._done.append((job_id, True))
        except Exception as exc:  # noqa: BLE001 - reported: vLLM recomputes the blocks
            logger.warning("kvservice connector: loading job %s failed (%s: %s)", job_id, type(exc).__name__, exc)
            self._done.append((job_id, False))

    def finished(self) -> list[tuple[JobId, bool]]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: Iterable[JobId]) -> None:
        return None


@dataclass(slots=True)
class Job:
    job_id: JobId
    event: torch.cuda.Event | None = None
    ok: bool = True
    keep: list[torch.Tensor] = field(default_factory=list)  # alive until the event: the copies read them


class CudaMover(PageMover):
    """Copies between a CUDA engine's KV and host pages on two side streams (saves, loads), off the step.

    Ordering: a job's stream first waits for the compute stream, so a save reads the blocks after the forward
    that wrote them and a load lands after vLLM zeroed its blocks. Loads are made visible to the forward with
    `wait_for_loads_on` in start_load_kv, for all of a step's loads at once: FULL CUDA-graph batches skip the
    per-layer hooks, so a per-layer wait would not be made there.

    Head-major formats (HND, MLA, block-outer) into page-locked host rows: one cudaMemcpy2DAsync per block
    (cudadma.py), no kernel. Others, per chunk of a job: a gather (scatter) into a device staging buffer and
    one transfer per run of consecutive host rows. A page is at least tens of KiB (MiB for 8B-class
    models), so a run costs a few microseconds of launch beside its transfer; the alternative, a pinned bounce
    buffer scattered on the CPU, adds a host memcpy of every byte and a wait on the device before it. Host
    memory that is not page-locked (pin failed) goes through a pinned bounce buffer, one chunk at a time,
    waiting on the CPU: correct and slow.
    """

    def __init__(self, fmt: PageFormat, staging_bytes: int = STAGING_BYTES, direct: bool = True) -> None:
        super().__init__(fmt)
        self.device = fmt.device
        # Page-locked host rows of a head-major format move by the copy engines alone (cudadma.py); `direct`
        # False keeps every copy staged (the GPU check compares the two).
        self._dma = Dma.for_format(fmt.pieces, self.device) if direct else None
        self.chunk_rows = max(1, staging_bytes // fmt.page_bytes)
        self._streams = {"save": torch.cuda.Stream(self.device), "load": torch.cuda.Stream(self.device)}
        self._staging: dict[str, torch.Tensor | None] = {"save": None, "load": None}
        self._bounce: torch.Tensor | None = None
        self._jobs: dict[str, deque[Job]] = {"save": deque(), "load": deque()}
        self._last_load: torch.cuda.Event | None = None
        self._registered: dict[int, int] = {}  # pointer -> bytes page-locked by pin()

    # ---- host memory ---------------------------------------------------------------------------------
    def pin(self, host_pages: torch.Tensor) -> bool:
        if self._pinned(host_pages):
            return True
        if not host_pages.is_contiguous():
            return False
        ptr, size = host_pages.data_ptr(), host_pages.numel() * host_pages.element_size()
        code = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
        if code == HOST_MEMORY_ALREADY_REGISTERED:  # by another mover of this process: it unregisters it
            return True
        if code != 0:
            logger.warning("kvservice connector: cannot page-lock %d bytes of host pages (CUDA error %d); copies "
                           "will be staged through a pinned bounce buffer", size, code)
            return False
        self._registered[ptr] = size
        return True

    def unpin(self, host_pages: torch.Tensor) -> None:
        ptr = host_pages.data_ptr()
        if ptr in self._registered:
            torch.cuda.synchronize(self.device)  # no copy may still use it
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))
            del self._registered[ptr]

    def _pinned(self, t: torch.Tensor) -> bool:
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        return t.is_pinned() or any(p <= start and end <= p + n for p, n in self._registered.items())

    # ---- jobs ------------------------------------------------------------------------------------------
    def submit_save(self, job_id: JobId, block_ids: list[int], host_pages: torch.Tensor, rows: list[int]) -> None:
        self.check(block_ids, host_pages, rows, load=False)
        self._submit("save", job_id, block_ids, host_pages, rows)
        self.num_saved_pages += len(rows)

    def submit_load(self, job_id: JobId, host_pages: torch.Tensor, rows: list[int], block_ids: list[int]) -> None:
        self.check(block_ids, host_pages, rows, load=True)
        self._submit("load", job_id, block_ids, host_pages, rows)
        self.num_loaded_pages += len(rows)

    def _submit(self, direction: str, job_id: JobId, block_ids: list[int], host: torch.Tensor,
                rows: list[int]) -> None:
        if any(j.job_id == job_id for q in self._jobs.values() for j in q):
            raise ValueError(f"KVServiceConnector: job {job_id!r} was already submitted and is not finished")
        job, stream = Job(job_id), self._streams[direction]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        pinned = self._pinned(host)
        try:
            if self._dma is not None and pinned:
                self._dma.copy(direction == "save", block_ids, host, rows, stream)
            else:
                self._staged(direction, job, block_ids, host, rows, pinned, stream)
        except Exception as exc:  # noqa: BLE001 - reported once what was enqueued has run
            logger.warning("kvservice connector: %s job %s failed (%s: %s)", direction, job_id,
                           type(exc).__name__, exc)
            job.ok = False
        job.event = torch.cuda.Event()
        job.event.record(stream)
        if direction == "load":
            self._last_load = job.event
        self._jobs[direction].append(job)

    def _staged(self, direction: str, job: Job, block_ids: list[int], host: torch.Tensor, rows: list[int],
                pinned: bool, stream: torch.cuda.Stream) -> None:
        """Per chunk: a gather (scatter) kernel on the device, then one transfer per run of host rows."""
        with torch.cuda.stream(stream):
            ids_host = torch.tensor(block_ids, dtype=torch.int64).pin_memory()
            ids = ids_host.to(self.device, non_blocking=True)
            job.keep += [ids_host, ids]
            for start in range(0, len(rows), self.chunk_rows):
                chunk_rows = rows[start:start + self.chunk_rows]
                staging = self._staging_rows(direction, len(chunk_rows))
                chunk_ids = ids[start:start + len(chunk_rows)]
                if direction == "save":
                    self.fmt.gather(chunk_ids, staging)
                    self._to_host(staging, host, chunk_rows, pinned, stream)
                else:
                    self._from_host(host, chunk_rows, staging, pinned, stream)
                    self.fmt.scatter(staging, chunk_ids)

    def _staging_rows(self, direction: str, n: int) -> torch.Tensor:
        buf = self._staging[direction]
        if buf is None or buf.shape[0] < n:
            rows = min(self.chunk_rows, 1 << (n - 1).bit_length())
            # allocated on the side stream (current here), so the allocator reuses it only in that stream's order
            buf = torch.empty(rows, self.fmt.page_bytes, dtype=torch.uint8, device=self.device)
            self._staging[direction] = buf
        return buf[:n]

    def _to_host(self, staging: torch.Tensor, host: torch.Tensor, rows: list[int], pinned: bool,
                 stream: torch.cuda.Stream) -> None:
        if pinned:
            for i, r, k in row_runs(rows):
                host[r:r + k].copy_(staging[i:i + k], non_blocking=True)
            return
        bounce = self._bounce_rows(len(rows))
        bounce.copy_(staging, non_blocking=True)
        stream.synchronize()
        host.index_copy_(0, torch.tensor(rows), bounce)

    def _from_host(self, host: torch.Tensor, rows: list[int], staging: torch.Tensor, pinned: bool,
                   stream: torch.cuda.Stream) -> None:
        if pinned:
            for i, r, k in row_runs(rows):
                staging[i:i + k].copy_(host[r:r + k], non_blocking=True)
            return
        stream.synchronize()  # the bounce buffer's previous transfer is done
        bounce = self._bounce_rows(len(rows))
        torch.index_select(host, 0, torch.tensor(rows), out=bounce)
        staging.copy_(bounce, non_blocking=True)

    def _bounce_rows(self, n: int) -> torch.Tensor:
        if self._bounce is None or self._bounce.shape[0] < n:
            self._bounce = torch.empty(self.chunk_rows, self.fmt.page_bytes, dtype=torch.uint8, pin_memory=True)
        return self._bounce[:n]

    def finished(self) -> list[tuple[JobId, bool]]:
        done = []
        for jobs in self._jobs.values():  # a stream runs its jobs in order: the first unfinished one ends the scan
            while jobs and jobs[0].event.query():
                job = jobs.popleft()
                done.append((job.job_id, job.ok))
        return done

    def wait(self, job_ids: Iterable[JobId]) -> None:
        wanted = set(job_ids)
        for jobs in self._jobs.values():
            for job in jobs:
                if job.job_id in wanted:
                    job.event.synchronize()

    def wait_for_loads_on(self, stream: torch.cuda.Stream | None = None) -> None:
        if self._last_load is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(self._last_load)

    def close(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()
        for ptr in list(self._registered):
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))
        self._registered.clear()


def make_mover(fmt: PageFormat, **kwargs) -> PageMover:
    """The mover for the engine's KV device."""
    return CudaMover(fmt, **kwargs) if fmt.device.type == "cuda" else CpuMover(fmt)

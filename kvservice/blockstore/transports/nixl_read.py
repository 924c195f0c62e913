"""The engine side of the NIXL data plane: one agent per engine process, its staging buffers registered once, and
`read(info, page_ids, into, meta_into)`: one NIXL READ of pages, their metadata rows and the store's fence,
completed through a `Ticket`. See `nixl.py` for the store side, the fence, security and the UCX knobs."""

from __future__ import annotations

import base64
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from enum import Enum

import numpy as np

from kvservice.blockstore.segment import _HEADER, MAGIC, MAX_SLOTS, META_FIELDS
from kvservice.blockstore.transports.nixl import (
    FENCE_HEADER_BYTES,
    META_ROW_BYTES,
    TOKEN_WORDS,
    ExportInfo,
    make_agent,
    nixl_errors,
)
from kvservice.blockstore.transports.plan import page_runs, row_descs

FENCE_SLOT_BYTES = 128  # [0, 48): the store's header fields; [64, 96): its agent's token
_TOKEN_OFFSET = 64
NUM_FENCE_SLOTS = 256  # READs in flight at once per memory kind
_SPIN_S = 0.002  # wait() polls flat out this long, then yields between polls (2 shared cores: let the store run)
_NAP_S = 0.0001


class XferState(str, Enum):
    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


@dataclass(frozen=True, slots=True)
class _Mem:
    """Where a buffer is, as NIXL sees it: its first byte, its byte extent, its strides in bytes."""

    addr: int
    extent: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str  # numpy's name: uint8, uint64, int64
    mem_type: str  # "DRAM" or "VRAM"
    device: int  # 0 for host memory, the CUDA index for VRAM


def _mem(buf) -> _Mem:
    if isinstance(buf, np.ndarray):
        shape, strides, addr, dtype = buf.shape, buf.strides, buf.ctypes.data, buf.dtype.name
        mem_type, device, itemsize = "DRAM", 0, buf.itemsize
    else:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(buf, torch.Tensor):
            raise TypeError(f"expected a numpy array or a torch tensor, got {type(buf).__name__}")
        itemsize = buf.element_size()
        shape, strides, addr = tuple(buf.shape), tuple(s * itemsize for s in buf.stride()), buf.data_ptr()
        dtype = str(buf.dtype).removeprefix("torch.")
        mem_type, device = ("VRAM", buf.device.index or 0) if buf.is_cuda else ("DRAM", 0)
    if any(s < 0 for s in strides):
        raise ValueError(f"buffer with negative strides {strides}: pass a plain (non-flipped) view")
    extent = 0 if 0 in shape else sum((n - 1) * s for n, s in zip(shape, strides)) + itemsize
    return _Mem(addr, extent, tuple(shape), tuple(strides), dtype, mem_type, device)


@dataclass(slots=True)
class _Remote:
    agent_id: str
    name: bytes  # what NIXL calls the store's agent in this process
    broken: bool = False  # a transfer to it failed: its UCX endpoint is unusable until re-added


@dataclass(slots=True)
class _InFlight:
    """What a ticket holds while its READ runs: NIXL's handle, the fence slot, and the buffers kept alive."""

    info: ExportInfo
    remote: _Remote
    fence: tuple[tuple[str, int], object, int]  # (memory kind, the fence buffer, the slot)
    buffers: tuple
    handle: object = None


class Ticket:
    """One READ. `poll()` moves it on without blocking; `wait(timeout_s)` until it ends. DONE means every byte
    landed and the store's fence matched; ERR (with `error`) means none of `into` can be trusted. A ticket
    releases its NIXL handle when it ends; one still in flight is cancelled by `release()` or a timed-out
    `wait()`. `buffers_free` is False only when NIXL could not cancel it: `into` may still be written then."""

    def __init__(self, owner: NixlImport | None, store: str, num_pages: int, num_bytes: int,
                 flight: _InFlight | None = None) -> None:
        self.store, self.num_pages, self.num_bytes = store, num_pages, num_bytes
        self.state, self.error, self.buffers_free = XferState.PROC, "", True
        self._owner, self._flight = owner, flight

    @classmethod
    def failed(cls, store: str, reason: str) -> Ticket:
        t = cls(None, store, 0, 0)
        t.state, t.error = XferState.ERR, reason
        return t

    def poll(self) -> XferState:
        if self.state is XferState.PROC:
            self._owner._advance(self)
        return self.state

    def wait(self, timeout_s: float) -> bool:
        """True when DONE; False on ERR or when `timeout_s` passed (the READ is then cancelled: ERR)."""
        start = time.monotonic()
        while self.poll() is XferState.PROC:
            now = time.monotonic()
            if now - start >= timeout_s:
                self._owner._end(self, f"no completion from store {self.store} within {timeout_s:g} s (store "
                                       "stopped, its host unreachable, or a stalled network)")
                break
            if now - start > _SPIN_S:
                time.sleep(_NAP_S)
        return self.state is XferState.DONE

    def release(self) -> None:
        """Cancel the READ if it is still in flight (it ends as ERR); a no-op once it ended."""
        if self.state is XferState.PROC:
            self._owner._end(self, "cancelled by release()")

    def __repr__(self) -> str:
        return f"Ticket({self.store}, {self.num_pages} pages, {self.state.value}{': ' * bool(self.error)}{self.error})"


class NixlImport:
    """An engine process's side of the NIXL data plane: one agent, buffers registered once (`register`), READs
    of store pages (`read`). Thread-safe (one lock around the agent)."""

    def __init__(self, local_name: str, *, progress_thread: bool = False,
                 backends: tuple[str, ...] = ("UCX",)) -> None:
        self.name = f"kvs-engine-{local_name}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()
        self._errors = nixl_errors()
        self._agent = make_agent(self.name, progress_thread=progress_thread, backends=backends)
        self._regions: list[tuple[_Mem, object, object]] = []  # (where, NIXL's registration, the buffer)
        self._remotes: dict[str, _Remote] = {}
        self._newest: dict[str, tuple[int, str]] = {}  # store -> (generation, agent id) of its newest info seen
        self._live: weakref.WeakSet[Ticket] = weakref.WeakSet()
        self._fences: dict[tuple[str, int], tuple[object, list[int]]] = {}  # (mem type, device) -> (buffer, free)

    def register(self, buf) -> None:
        """Register a staging buffer (a contiguous numpy array or torch tensor; a CUDA tensor as VRAM) once, so
        `read` can land pages in it. The caller keeps it alive until `deregister` or `close`."""
        m = _mem(buf)
        if m.extent == 0:
            raise ValueError("register: an empty buffer")
        with self._lock:
            self._regions.append((m, self._agent.register_memory([(m.addr, m.extent, m.device, "")], m.mem_type),
                                  buf))

    def deregister(self, buf) -> None:
        with self._lock:
            for i, (_, reg, b) in enumerate(self._regions):
                if b is buf:
                    self._agent.deregister_memory(reg)
                    del self._regions[i]
                    return
        raise ValueError("deregister: this buffer was not registered with this NixlImport")

    def read(self, info: dict | ExportInfo, page_ids, into, meta_into=None) -> Ticket:
        """Start one READ of store pages `page_ids` into rows of `into` (and their metadata into `meta_into`).

        Args:
            info: the store's `NixlExport.info()`, as the allocator handed it out.
            page_ids: the store's page ids (1..num_blocks-1), in row order; runs of consecutive ids landing in
                consecutive rows become one descriptor.
            into: `[n, page_bytes]` uint8, rows contiguous, inside a registered buffer.
            meta_into: `[n, MAX_SLOTS, 4]` uint64 (or int64), inside a registered buffer of the same memory kind
                as `into` (both host, or both on one GPU); None to skip the metadata.
        Returns:
            A Ticket; ERR at once (not an exception) when the store's agent is known to be gone or unreachable.
            Raises ValueError for arguments that can never work (shapes, ids, unregistered buffers).
        """
        info = info if isinstance(info, ExportInfo) else ExportInfo.from_dict(info)
        ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 1 or ids.max() >= info.num_blocks):
            bad = next(int(i) for i in ids if not 1 <= i < info.num_blocks)
            raise ValueError(f"page_ids: {bad} is not a page of store {info.store} (1..{info.num_blocks - 1})")
        pages = self._check(into, "into", (len(ids), info.page_bytes), ("uint8",), info.page_bytes)
        meta = None
        if meta_into is not None:
            meta = self._check(meta_into, "meta_into", (len(ids), MAX_SLOTS, META_FIELDS), ("uint64", "int64"),
                               META_ROW_BYTES)
            if (meta.mem_type, meta.device) != (pages.mem_type, pages.device):
                raise ValueError(f"meta_into is {meta.mem_type}:{meta.device}, into {pages.mem_type}:"
                                 f"{pages.device}: one READ lands in one kind of memory; put both in the same")
        with self._lock:
            if self._agent is None:
                raise RuntimeError(f"NixlImport {self.name} is closed")
            stale = self._stale(info)
            if stale:
                return Ticket.failed(info.store, stale)
            newest = self._newest.get(info.store)
            if newest is None or info.generation > newest[0]:
                self._newest[info.store] = (info.generation, info.agent_id)
            try:
                remote = self._remote(info)
            except self._errors as e:
                return Ticket.failed(info.store, f"cannot reach store {info.store}'s agent {info.agent_name} "
                                                 f"({type(e).__name__}: {e}): its process died or it closed the "
                                                 "export, or its host is unreachable")
            fence = self._fence_slot(pages.mem_type, pages.device)
            local, remote_rows = self._plan(info, ids, pages, meta, fence)
            num_bytes = len(ids) * (info.page_bytes + (META_ROW_BYTES if meta else 0))
            ticket = Ticket(self, info.store, len(ids), num_bytes, _InFlight(info, remote, fence, (into, meta_into)))
            self._live.add(ticket)
            try:
                ticket._flight.handle = self._agent.initialize_xfer(
                    "READ", self._agent.get_xfer_descs(local, pages.mem_type),
                    self._agent.get_xfer_descs(remote_rows, "DRAM"), remote.name, b"")
                state = self._agent.transfer(ticket._flight.handle)
            except self._errors as e:
                self._end(ticket, f"READ from store {info.store} failed to start: {type(e).__name__}: {e}")
                return ticket
            self._settle(ticket, state)
        return ticket

    def forget(self, store: str) -> None:
        """Drop the connection to `store` (the next read connects again from its info)."""
        with self._lock:
            remote = self._remotes.pop(store, None)
            if remote is not None:
                self._drop(store, remote)

    def close(self) -> None:
        """Cancel READs in flight, disconnect from every store, deregister every buffer; the agent goes."""
        with self._lock:
            if self._agent is None:
                return
            for store in list(self._remotes):
                self.forget(store)
            for _, reg, _ in self._regions:  # the fence buffers among them
                self._agent.deregister_memory(reg)
            self._regions.clear()
            self._fences.clear()
            self._agent = None

    # -- mechanics, all under self._lock --------------------------------------------------------------------

    def _check(self, buf, what: str, shape: tuple[int, ...], dtypes: tuple[str, ...], row_bytes: int) -> _Mem:
        m = _mem(buf)
        if m.shape != shape or m.dtype not in dtypes:
            raise ValueError(f"{what}: {m.dtype} {list(m.shape)}, expected {dtypes[0]} {list(shape)}")
        itemsize = row_bytes // int(np.prod(shape[1:]))
        row_contiguous = m.strides[-1] == itemsize and all(
            m.strides[i] == m.strides[i + 1] * shape[i + 1] for i in range(1, len(shape) - 1))
        if shape[0] > 1 and not (row_contiguous and m.strides[0] >= row_bytes):
            raise ValueError(f"{what}: strides {m.strides}: each row must be {row_bytes} contiguous bytes, rows "
                             "apart from each other")
        if m.extent and not any(r.mem_type == m.mem_type and r.device == m.device and r.addr <= m.addr
                                and m.addr + m.extent <= r.addr + r.extent for r, _, _ in self._regions):
            raise ValueError(f"{what}: {m.mem_type} memory at {m.addr:#x} ({m.extent} bytes) is not inside a buffer "
                             "registered with this NixlImport: register the staging buffer once (register())")
        return m

    def _stale(self, info: ExportInfo) -> str:
        """Why `info` must not be used ("" when it may): an agent older than one this process saw for the store."""
        generation, agent_id = self._newest.get(info.store, (-1, ""))
        if info.generation < generation:
            return (f"stale info: store {info.store}'s agent {info.agent_id} was replaced by {agent_id}; ask the "
                    "allocator for the store's current info")
        if info.generation == generation and info.agent_id != agent_id:
            return (f"store {info.store}: two agents ({agent_id}, {info.agent_id}) at one generation {generation}: "
                    "two stores under one name?")
        return ""

    def _remote(self, info: ExportInfo) -> _Remote:
        known = self._remotes.get(info.store)
        if known is not None and known.agent_id == info.agent_id and not known.broken:
            return known
        if known is not None:
            del self._remotes[info.store]
            self._drop(info.store, known)
        name = self._agent.add_remote_agent(base64.b64decode(info.agent_metadata))
        if (name.decode() if isinstance(name, bytes) else name) != info.agent_name:
            self._agent.remove_remote_agent(name)
            raise ValueError(f"store {info.store}: its info names agent {info.agent_name} but its metadata is "
                             f"agent {name!r}'s: the info was altered or mixed up")
        remote = self._remotes[info.store] = _Remote(info.agent_id, name)
        return remote

    def _drop(self, store: str, remote: _Remote) -> None:
        for t in list(self._live):
            if t._flight is not None and t._flight.remote is remote:
                self._end(t, f"cancelled: the connection to store {store} was dropped")
        try:
            self._agent.remove_remote_agent(remote.name)
        except self._errors:
            pass  # already disconnected: nothing left to drop

    def _fence_slot(self, mem_type: str, device: int) -> tuple[tuple[str, int], object, int]:
        key = (mem_type, device)
        if key not in self._fences:
            if mem_type == "VRAM":
                import torch
                buf = torch.zeros((NUM_FENCE_SLOTS, FENCE_SLOT_BYTES), dtype=torch.uint8, device=f"cuda:{device}")
            else:
                buf = np.zeros((NUM_FENCE_SLOTS, FENCE_SLOT_BYTES), dtype=np.uint8)
            self.register(buf)
            self._fences[key] = (buf, list(range(NUM_FENCE_SLOTS - 1, -1, -1)))
        buf, free = self._fences[key]
        if not free:
            raise RuntimeError(f"more than {NUM_FENCE_SLOTS} READs in flight: wait for some tickets to end")
        slot = free.pop()
        buf[slot] = 0
        return key, buf, slot

    def _plan(self, info: ExportInfo, ids: np.ndarray, pages: _Mem, meta: _Mem | None,
              fence: tuple[tuple[str, int], object, int]) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) descriptor rows: the pages, their metadata rows, then the fence (header, token)."""
        runs = page_runs(ids)
        stride = pages.strides[0] if len(ids) > 1 else info.page_bytes
        parts = [row_descs(runs, info.pages_addr, pages.addr, stride, info.page_bytes, pages.device)]
        if meta is not None:
            stride = meta.strides[0] if len(ids) > 1 else META_ROW_BYTES
            parts.append(row_descs(runs, info.meta_addr, meta.addr, stride, META_ROW_BYTES, pages.device))
        (_, device), buf, slot = fence
        at = _mem(buf).addr + slot * FENCE_SLOT_BYTES
        parts.append((np.array([[at, FENCE_HEADER_BYTES, device], [at + _TOKEN_OFFSET, TOKEN_WORDS * 8, device]],
                               dtype=np.uint64),
                      np.array([[info.header_addr, FENCE_HEADER_BYTES, 0], [info.token_addr, TOKEN_WORDS * 8, 0]],
                               dtype=np.uint64)))
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _advance(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.state is not XferState.PROC:
                return
            try:
                state = self._agent.check_xfer_state(ticket._flight.handle)
            except self._errors as e:
                self._end(ticket, f"READ from store {ticket.store} failed: {type(e).__name__}: {e}")
                return
            self._settle(ticket, state)

    def _settle(self, ticket: Ticket, state: str) -> None:
        if state == "PROC":
            return
        if state != "DONE":
            self._end(ticket, f"READ from store {ticket.store} failed (NIXL state {state})")
            return
        self._end(ticket, self._fence_problem(ticket._flight))

    @staticmethod
    def _fence_problem(flight: _InFlight) -> str:
        """Why the READ's bytes cannot be trusted though NIXL said DONE ("" when they can)."""
        _, buf, slot = flight.fence
        raw = buf[slot] if isinstance(buf, np.ndarray) else buf[slot].cpu().numpy()
        info = flight.info
        if not np.array_equal(raw[_TOKEN_OFFSET:_TOKEN_OFFSET + TOKEN_WORDS * 8].view(np.uint64), info.token()):
            return (f"store {info.store}'s agent {info.agent_id} is gone (closed or re-created, or its process "
                    "died): ask the allocator for the store's current info")
        header = raw[:FENCE_HEADER_BYTES].view(_HEADER)[0]
        if (bytes(header["magic"]) != MAGIC or int(header["page_bytes"]) != info.page_bytes
                or int(header["num_blocks"]) != info.num_blocks
                or int(header["generation"]) != info.segment_generation):
            return (f"store {info.store}: its segment is not the one the info describes (generation "
                    f"{int(header['generation'])}, expected {info.segment_generation}): its pool moved to a new "
                    "epoch; ask the allocator for the store's current info")
        if int(header["closed"]):
            return f"store {info.store} closed its segment"
        return ""

    def _end(self, ticket: Ticket, error: str) -> None:
        """Finish `ticket`: DONE when `error` is empty, else ERR; release its handle and fence slot."""
        with self._lock:
            flight = ticket._flight
            if ticket.state is not XferState.PROC or flight is None:
                return  # ended already (another thread, or a cancel racing a completion)
            if flight.handle is not None:
                try:
                    self._agent.release_xfer_handle(flight.handle)
                except self._errors as e:
                    ticket.buffers_free = False
                    error = (error or "could not release the READ") + (
                        f" (NIXL could not cancel it: {type(e).__name__}; the buffers may still be written)")
            if error:
                flight.remote.broken = True  # UCX leaves the endpoint unusable after a failed or cancelled READ
            if ticket.buffers_free:  # else the slot may still be written: it stays out of the pool, buffers held
                key, _, slot = flight.fence
                self._fences[key][1].append(slot)
                ticket._flight = None
            ticket.state, ticket.error = (XferState.ERR, error) if error else (XferState.DONE, "")
            self._live.discard(ticket)

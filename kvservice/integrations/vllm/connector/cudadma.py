"""Page copies between a GPU engine's KV and page-locked host pages by the copy engines alone: one
`cudaMemcpy2DAsync` per block and piece, no gather kernel and no staging buffer, so a save running beside the
engine's steps takes no SM time and reads each byte of HBM once (the staged path reads it, writes it to the
staging buffer and reads it again: three times the HBM traffic, which a memory-bound decode step feels).

Only for formats whose piece is, per block, evenly spaced runs of contiguous bytes on both sides: HND (LBHNC),
MLA (one head), block-outer layouts; NHD puts a block's heads inside its tokens, which the canonical page
swaps, and keeps the staged path (movers.py). `cudaMemcpy2DAsync` comes from the CUDA runtime torch loaded
(ctypes; only torch and the standard library), and a copy of known bytes checks it once before it is used:
anything amiss (no runtime found, a pitch past the device's limit, wrong bytes) leaves the staged path.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kvservice.integrations.vllm.connector.pagecopy import Piece

logger = logging.getLogger(__name__)

HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind
MAX_PITCH = 11  # cudaDevAttrMaxPitch
_runtime: ctypes.CDLL | None = None


def runtime() -> ctypes.CDLL:
    """The CUDA runtime library this process already loaded (torch's), else the system's."""
    global _runtime
    if _runtime is None:
        torch.cuda.init()
        maps = Path("/proc/self/maps").read_text().split("\n") if Path("/proc/self/maps").exists() else []
        paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line}, key=lambda p: "triton" in p)
        lib = ctypes.CDLL(paths[0] if paths else "libcudart.so")  # torch's (not a copy bundled by triton)
        lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                          ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cudaMemcpy2DAsync.restype = ctypes.c_int
        lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cudaDeviceGetAttribute.restype = ctypes.c_int
        _runtime = lib
    return _runtime


def rows_of(p: Piece) -> tuple[int, int, int, int] | None:
    """(rows, bytes a row, engine pitch, page pitch) of a piece that is evenly spaced runs of contiguous bytes
    per block (joined layers of a head-major block), else None."""
    dims = [d for d in p.dims[:-1] if d[0] != 1]
    width = p.dims[-1][0]
    if not dims:
        return 1, width, width, width
    if len(dims) == 1 and dims[0][1] >= width and dims[0][2] >= width:
        return dims[0][0], width, dims[0][1], dims[0][2]
    return None


class Dma:
    """Enqueues a job's copies on a stream: `copy(save, block_ids, host, rows, stream)`."""

    def __init__(self, pieces: list[Piece], shapes: list[tuple[int, int, int, int]]) -> None:
        self.pieces, self.shapes = pieces, shapes
        self.fn = runtime().cudaMemcpy2DAsync

    @classmethod
    def for_format(cls, pieces: list[Piece], device: torch.device) -> Dma | None:
        shapes = [rows_of(p) for p in pieces]
        if any(s is None for s in shapes):
            return None
        try:
            lib = runtime()
            limit = ctypes.c_int(0)
            if lib.cudaDeviceGetAttribute(ctypes.byref(limit), MAX_PITCH, device.index or 0) != 0:
                return None
            if any(max(s[2], s[3]) > limit.value for s in shapes if s[0] > 1):
                return None  # a layer stride past the device's pitch limit: staged
            dma = cls(pieces, shapes)
            return dma if dma.self_test(device) else None
        except (OSError, AttributeError, RuntimeError, AssertionError) as exc:
            logger.info("kvservice connector: no direct page copies (%s); staged through the GPU", exc)
            return None

    def self_test(self, device: torch.device) -> bool:
        """A strided copy of known bytes there and back, checked (a runtime that misbehaves is not used)."""
        src = torch.arange(4 * 96, dtype=torch.int32, device=device).view(torch.uint8)
        host = torch.zeros(3 * 64, dtype=torch.uint8).pin_memory()
        stream = torch.cuda.current_stream(device)
        code = self.fn(host.data_ptr(), 64, src.data_ptr() + 8, 512, 48, 3, DEVICE_TO_HOST, stream.cuda_stream)
        back = torch.zeros_like(src)
        code = code or self.fn(back.data_ptr() + 8, 512, host.data_ptr(), 64, 48, 3, HOST_TO_DEVICE,
                               stream.cuda_stream)
        stream.synchronize()
        want = src.view(3, 512)[:, 8:56].cpu()
        return code == 0 and torch.equal(host.view(3, 64)[:, :48], want) and torch.equal(
            back.view(3, 512)[:, 8:56].cpu(), want)

    def copy(self, save: bool, block_ids: list[int], host: torch.Tensor, rows: list[int],
             stream: torch.cuda.Stream) -> None:
        handle, base, row_bytes = stream.cuda_stream, host.data_ptr(), host.stride(0) * host.element_size()
        for p, (height, width, engine_pitch, page_pitch) in zip(self.pieces, self.shapes):
            engine = p.storage.data_ptr() + p.src_offset
            for b, r in zip(block_ids, rows):
                kv, page = engine + b * p.block_stride, base + r * row_bytes + p.dst_offset
                code = (self.fn(page, page_pitch, kv, engine_pitch, width, height, DEVICE_TO_HOST, handle) if save
                        else self.fn(kv, engine_pitch, page, page_pitch, width, height, HOST_TO_DEVICE, handle))
                if code != 0:
                    raise RuntimeError(f"cudaMemcpy2DAsync failed (CUDA error {code})")

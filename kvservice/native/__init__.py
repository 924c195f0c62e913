"""kvservice's compiled helpers: a plain C library (no Python API) loaded with ctypes, so the same build serves
every interpreter of this machine (the project's venv and vLLM's).

    make native          # cc -O3 -shared -fPIC -pthread kvservice/native/kvcopy.c (make install runs it)

What it holds:
- `kv_copy`: the connector's page copies on a CPU engine (pagecopy.py's pieces, every (block, row) pair in one
  call, threads in equal shares), with the CPU layout's K transpose done as a 2-D transpose with contiguous
  writes. torch has no vectorised strided transpose, and one `copy_` per run and piece opens a parallel
  region each.

The pure-Python path (torch copies by runs) stays the reference: `KVSERVICE_NATIVE=0` selects it, and it is what
runs where the library was not built (said once, as a warning). tests/test_native_copy.py runs both on
randomized layouts and block ids.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

LIBRARY = Path(__file__).resolve().parent / "libkvcopy.so"
SOURCE = LIBRARY.with_name("kvcopy.c")
MAX_DIMS = 8
RECORD = 5 + 3 * MAX_DIMS  # base, src_offset, block_stride, dst_offset, ndims, then (size, src, dst) per dim

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def enabled() -> bool:
    """Whether the compiled path is selected (`KVSERVICE_NATIVE`, default on)."""
    return os.environ.get("KVSERVICE_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (not selected, or not built: then a warning, once per process)."""
    global _lib, _tried
    if _tried or not enabled():
        return _lib if enabled() else None
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if not LIBRARY.exists() or (SOURCE.exists() and LIBRARY.stat().st_mtime < SOURCE.stat().st_mtime):
            logger.warning("kvservice: the compiled page copies (%s) are %s; the connector copies with torch "
                           "instead, slower on CPU engines. Run `make native`.", LIBRARY.name,
                           "not built" if not LIBRARY.exists() else "older than their source")
            return None
        try:
            lib = ctypes.CDLL(str(LIBRARY))
        except OSError as exc:
            logger.warning("kvservice: could not load %s (%s); the connector copies with torch instead", LIBRARY,
                           exc)
            return None
        if lib.kv_record_size() != RECORD:
            logger.warning("kvservice: %s was built from another version of kvcopy.c; run `make native`", LIBRARY)
            return None
        p64 = ctypes.POINTER(ctypes.c_int64)
        lib.kv_copy.argtypes = [p64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, p64, p64, ctypes.c_int64,
                                ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.kv_copy.restype = ctypes.c_int
        _lib = lib
        return lib


def process_cpus() -> set[int]:
    """The CPUs any thread of this process may run on: a vLLM CPU worker binds its main thread to one core and
    each OpenMP thread to one of the cores it was given. Threads it did not bind (Ray's, gRPC's) keep the
    process's mask, so in a Ray actor this is the cores the actor may use, often every core of the host: the
    copies take at most COPY_THREADS of them, for the few milliseconds of a load."""
    cpus: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass
    return cpus or os.sched_getaffinity(0)


def cpu_mask(cpus: set[int]) -> bytes:
    mask = bytearray(max(cpus) // 8 + 1 if cpus else 1)
    for c in cpus:
        mask[c // 8] |= 1 << (c % 8)
    return bytes(mask)

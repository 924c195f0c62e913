"""Where a load's time goes: each side adds up the seconds of its parts, per path, and logs each load at DEBUG
(logger `kvservice.integrations.vllm.connector`).

The parts, in the order a load meets them:
- scheduler side (vLLM's engine core): `lookup` (the prefix index replica, or a Lookup RPC), `pin` (the PinOp
  RPC, and a GetStats when the pool's epoch is not known), `async_wait` (an asynchronous load only: from the
  step that handed it to the workers to the step that computes the request; vLLM runs it a step later),
  `commit` (the unpin RPC the teller sends once every rank reported the load, off the step);
- worker side (each rank): `fetch` (the NIXL READ, the Ray transfer, the disk read; on the same node only the
  segment's header is looked at), `check` (tags and formats, before and after the copy), `verify` (checksums),
  `copy` (into the engine's KV), `pin_check` (another node's pages: the RPC that confirms the pin outlived the
  transfer).

Paths: `local` (this node's segment), `nixl`, `ray`, `disk`; the scheduler side counts by tier (a store's
name, `<name>:disk`) since it does not know which path a worker takes.
"""

from __future__ import annotations

import threading
from collections import defaultdict

WORKER_PARTS = ("fetch", "check", "verify", "copy", "pin_check")
SCHEDULER_PARTS = ("lookup", "pin", "async_wait", "commit")


class Parts:
    """Seconds per (key, part), the number of loads and their bytes per key; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def add(self, key: str, part: str, seconds: float, n: int = 1) -> None:
        with self._lock:
            self._seconds[key][part] += seconds
            self._counts[key][part] += n

    def count(self, key: str, what: str, n: int) -> None:
        """A count beside the seconds (loads, blocks, bytes)."""
        with self._lock:
            self._counts[key][what] += n

    def snapshot(self) -> dict[str, dict[str, float]]:
        """key -> {part: seconds, "<part>_n": times added, and the counts}: the bench subtracts two of them."""
        with self._lock:
            out: dict[str, dict[str, float]] = {}
            for key in set(self._seconds) | set(self._counts):
                row = {part: s for part, s in self._seconds[key].items()}
                row.update({(f"{k}_n" if k in self._seconds[key] else k): float(n)
                            for k, n in self._counts[key].items()})
                out[key] = row
            return out


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "n/a"

"""What the connector's sides count, per tier (a store's name, or "<store>:disk"; per reason for failures;
"ram"/"disk" for checksum failures): the counts since vLLM last
took them (its stats interval), and the totals since start (for `connector_stats` and tests). No vLLM here;
stats.py hands them to vLLM."""

from __future__ import annotations

import threading
from collections import defaultdict

KINDS = ("claimed", "claimed_tokens", "loaded", "failed", "saved", "spilled", "promoted", "bytes_loaded",
         "bytes_saved", "checksum_failures")


class FailReason:
    """Why a block's load failed (the `reason` label)."""

    PIN_LOST = "pin_lost"  # its pin was released (a lapsed lease, a restarted store): the page may be reused
    STORE_GONE = "store_gone"  # the store stopped, restarted or registered again
    UNREACHABLE = "unreachable"  # the store's node could not be read (no transport, a timeout)
    FORMAT = "format"  # the page holds another format (another layout, scale or size)
    CHECKSUM = "checksum"  # the page's bytes do not match their checksum
    ALLOCATOR = "allocator"  # the allocator did not confirm the pin
    TIMEOUT = "timeout"  # a prefill/decode hand-over whose pages were never committed
    OTHER = "other"


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def add(self, kind: str, store: str, n: int = 1, reason: str | None = None) -> None:
        if n <= 0:
            return
        label = f"{store}|{reason}" if reason else store
        with self._lock:
            self._interval[kind][label] += n
            self.totals[kind][label] += n

    def take(self) -> dict[str, dict[str, int]]:
        """The counts since the last take (kind -> label -> n), and a fresh interval."""
        with self._lock:
            data = {kind: dict(counts) for kind, counts in self._interval.items() if counts}
            self._interval.clear()
        return data

    def total(self, kind: str) -> int:
        with self._lock:
            return sum(self.totals[kind].values())

    @staticmethod
    def merge(a: dict, b: dict) -> dict:
        out = {kind: dict(counts) for kind, counts in (a or {}).items()}
        for kind, counts in (b or {}).items():
            mine = out.setdefault(kind, {})
            for label, n in counts.items():
                mine[label] = mine.get(label, 0) + n
        return out

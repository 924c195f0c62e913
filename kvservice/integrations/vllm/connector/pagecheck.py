"""What a worker checks a page slice by: the digest of a save or a format (a slice's tag and format fields)
and the checksum of its bytes; a failed check names its reason (counters.FailReason)."""

from __future__ import annotations

import numpy as np
import xxhash


def digest64(text: str) -> int:
    """A non-zero 64-bit digest (0 marks a slice being written)."""
    return xxhash.xxh3_64_intdigest(text.encode()) or 1


def checksum(row: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(row)))


class PageCheckError(LookupError):
    """`loaded`: the load's leading blocks that did load (vLLM keeps those; its computed tokens are a prefix, so
    every block from the first failed one on is recomputed)."""

    def __init__(self, reason: str, message: str, loaded: int = 0) -> None:
        super().__init__(message)
        self.reason, self.loaded = reason, loaded

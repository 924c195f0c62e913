"""Single-type managers: per KV-cache group policy (block tables, hits, skipped blocks, copy-on-write).

One manager per group; the coordinator above them agrees on one hit length across groups.
    base       SingleTypeManager (the shared allocation and caching logic)
    attention  full attention, reference sliding window, sinks, circular buffer, cross attention
    windowed   sliding window, chunked local attention
    mamba      Mamba state blocks ("align" mode)
"""

from kvservice.core.managers.attention import (
    CircularBufferManager,
    CrossAttentionManager,
    FullAttentionManager,
    RSWAManager,
    SinkFullAttentionManager,
)
from kvservice.core.managers.base import SingleTypeManager, cdiv
from kvservice.core.managers.forks import CopyOnWrite
from kvservice.core.managers.mamba import MambaManager
from kvservice.core.managers.windowed import ChunkedLocalAttentionManager, SlidingWindowManager
from kvservice.core.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

MANAGER_TYPES: dict[type, type[SingleTypeManager]] = {
    FullAttentionSpec: FullAttentionManager,
    RSWASpec: RSWAManager,
    SinkFullAttentionSpec: SinkFullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    CircularBufferSpec: CircularBufferManager,
    CrossAttentionSpec: CrossAttentionManager,
}

__all__ = [
    "MANAGER_TYPES", "ChunkedLocalAttentionManager", "CircularBufferManager", "CopyOnWrite", "CrossAttentionManager",
    "FullAttentionManager", "MambaManager", "RSWAManager", "SingleTypeManager", "SinkFullAttentionManager",
    "SlidingWindowManager", "cdiv",
]

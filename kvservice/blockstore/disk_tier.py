"""A store's disk tier on the allocator: the pool `kvdisk:<name>` over the tier's page files (disk.py).

The pool is registered at the tier's own epoch (kept in tier.json), bound to the store's session and
suspended, not retired, when that session ends: while the store is away its pages stay in the allocator's
index (and in Redis) but no Lookup or pin finds them. A store that starts again verifies every page file
(its tags and checksums), re-attaches the pool at the same epoch, and has the allocator drop the pages whose
files failed: every page that verifies hits again with no re-save.
"""

from __future__ import annotations

import logging
import time

from kvservice.blockstore.disk import DiskPages, TierInfo, bump_epoch, open_tier
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.ops import EvictBlocksOp

logger = logging.getLogger(__name__)

DISK_LAYOUT = "kvservice-disk/v1"


def disk_layout(page_bytes: int) -> str:
    return f"{DISK_LAYOUT};page_bytes={page_bytes}"


class DiskTier:
    def __init__(self, name: str, directory: str, page_bytes: int, disk_bytes: int, block_size: int,
                 max_model_len: int) -> None:
        self.directory = directory
        self.info: TierInfo = open_tier(directory, name, page_bytes, disk_bytes)
        self.pages = DiskPages(directory, page_bytes)
        self.config = KVCacheConfig(self.info.num_pages, [FullAttentionSpec(block_size)])
        self.max_model_len = max_model_len
        self.bad: list[int] = []
        self.num_verified = 0

    @property
    def pool_id(self) -> str:
        return self.info.pool_id

    def verify(self) -> list[int]:
        """Checks every page file (a full read: tags and checksums); returns the page ids the allocator must
        not serve (files that fail, and ids without a file: the allocator may hold either from before)."""
        start = time.monotonic()
        bad, good = [], 0
        for page_id in range(1, self.info.num_pages):
            if self.pages.verify(page_id):
                good += 1
            else:
                bad.append(page_id)
        self.bad, self.num_verified = bad, good
        logger.info("store disk tier %s: %d page files verified, %d ids dropped (%.2f s)", self.directory, good,
                    len(bad), time.monotonic() - start)
        return bad

    def attach(self, client) -> None:
        """Registers (or resumes) the pool at the tier's epoch, then drops the pages that failed `verify`."""
        client.register_pool(self.pool_id, self.config, max_model_len=self.max_model_len, epoch=self.info.epoch,
                             kv_layout=disk_layout(self.info.page_bytes), bound_to_session=True,
                             suspend_on_session_end=True)
        if self.bad:
            client.step(self.pool_id, [EvictBlocksOp(list(self.bad))])

    def ensure(self, client, stats) -> bool:
        """Re-attaches the pool when the allocator has it suspended or at another epoch; when it has it not at
        all (an allocator that lost its state: its index starts empty), at a new epoch, so that no save
        allocated against the lost index writes a page the new one gave out. True when it did."""
        if stats is not None and stats.epoch == self.info.epoch and not getattr(stats, "suspended", False):
            return False
        if stats is None:
            self.info = bump_epoch(self.directory, self.info)
            self.bad = []
        self.attach(client)
        return True

"""`BlockStore`: one store's segment and its pool on the allocator, kept alive by the store's session."""

from __future__ import annotations

import hmac
import logging
import os
import time

import numpy as np

from kvservice.blockstore.segment import (
    DEFAULT_DIR,
    Descriptor,
    Segment,
    descriptor_path,
    read_descriptor,
    write_descriptor,
)
from kvservice.core import FullAttentionSpec, KVCacheConfig

logger = logging.getLogger(__name__)

LAYOUT = "kvservice-store/v1"  # the pool's kv_layout: pages of `page_bytes` (and what a pin needs declared)


def store_pool_id(name: str) -> str:
    return f"kvstore:{name}"


def store_layout(page_bytes: int) -> str:
    return f"{LAYOUT};page_bytes={page_bytes}"


class BlockStore:
    """A segment of `num_blocks` pages (page 0 is the pool's null block, never used) on this node, and the
    pool `kvstore:<name>` on the allocator at `address`, registered with a fresh epoch: a restarted store's pool
    starts empty, so no hit can name a page of the memory that went with the old process.

    The pool belongs to the tenant of `token`; only that tenant's engines can find, pin, save into or read its
    blocks (`read` and `write` check the token too, for callers that reach the store without the allocator).
    """

    def __init__(self, name: str, address: str, num_blocks: int, page_bytes: int, block_size: int, *,
                 token: str | None = None, directory: str = DEFAULT_DIR, node_id: str = "",
                 max_model_len: int = 1 << 20) -> None:
        from kvservice.client import KVServiceClient
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"name: {name!r} is not a store name (letters, digits, '-', '_', '.')")
        self.name, self.token = name, token or ""
        self.generation = time.time_ns()
        path = os.path.join(directory, f"kvservice-store-{name}-{self.generation}")
        self.segment = Segment(path, num_blocks, page_bytes, create=True)
        self.pool_id = store_pool_id(name)
        try:
            self.client = KVServiceClient(address, token, client_name=f"kvstore:{name}", hash_block_size=block_size)
            self.client.register_pool(self.pool_id, KVCacheConfig(num_blocks, [FullAttentionSpec(block_size)]),
                                      max_model_len=max_model_len, epoch=self.generation,
                                      kv_layout=store_layout(page_bytes), bound_to_session=True)
        except BaseException:
            self.segment.close(unlink=True)
            raise
        self.descriptor = Descriptor(name, self.pool_id, path, num_blocks, page_bytes, block_size, self.generation,
                                     node_id, os.getpid())
        self.directory = directory
        old = _old_segment(name, directory)
        write_descriptor(self.descriptor, directory)
        if old is not None and old != path:
            _unlink(old)  # a previous store of this name on this node (crashed): its pages are gone from the index
        logger.info("store %s: %d pages of %d bytes in %s, pool %s", name, num_blocks, page_bytes, path,
                    self.pool_id)

    def info(self) -> dict:
        return {"descriptor": self.descriptor.to_json(), "pool_id": self.pool_id}

    def _check_token(self, token: str | None) -> None:
        if not hmac.compare_digest((token or "").encode(), self.token.encode()):
            raise PermissionError(f"store {self.name!r}: the token does not match this store's tenant")

    def read(self, block_ids, token: str | None = None, generation: int | None = None) -> np.ndarray:
        """The pages `block_ids` (the reader pinned them), for a reader on another node."""
        self._check_token(token)
        self._check_generation(generation)
        return np.ascontiguousarray(self.segment.read(block_ids))

    def write(self, block_ids, data: np.ndarray, token: str | None = None, generation: int | None = None) -> None:
        self._check_token(token)
        self._check_generation(generation)
        self.segment.write(block_ids, data)

    def _check_generation(self, generation: int | None) -> None:
        if generation is not None and generation != self.generation:
            raise LookupError(f"store {self.name!r} restarted (generation {self.generation}, not {generation}): "
                              f"the pages named are gone")

    def close(self) -> None:
        """Unregisters nothing (the pool stays until a new epoch replaces it), but frees the memory and removes
        the descriptor, and ends the session."""
        try:
            self.client.close()
        finally:
            try:
                current = read_descriptor(self.name, self.directory)
                if current is not None and current.generation == self.generation:
                    descriptor_path(self.name, self.directory).unlink()
            except (FileNotFoundError, ValueError, TypeError):
                pass
            self.segment.close(unlink=True)


def _old_segment(name: str, directory: str) -> str | None:
    try:
        d = read_descriptor(name, directory)
    except (ValueError, TypeError):
        return None
    return d.path if d is not None else None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

"""The store tier: host-memory KV block pools that kvservice allocates, one or more per node.

A store (`BlockStore`) is a shared-memory segment of `num_blocks` pages on one node plus a kvservice pool
(`kvstore:<name>`) whose block ids are the segment's page numbers. The allocator decides which pages hold which
prefix (LRU eviction, pins while a load reads, tenants, persistence); the bytes never pass through it. An engine's
KV connector on the same node maps the segment and copies pages in and out itself; on another node it asks the
store's Ray actor (`StoreActor`), so the pages travel through Ray's object store.

A page is one block's KV, every layer, as the engine's connector lays it out; the store only knows its size.
"""

from kvservice.blockstore.segment import Descriptor, Segment, read_descriptor
from kvservice.blockstore.store import BlockStore, store_pool_id

__all__ = ["BlockStore", "Descriptor", "Segment", "read_descriptor", "store_pool_id"]

"""The store tier: host-memory KV block pools that kvservice allocates, one or more per node, each with an
optional disk tier under it.

A store (`BlockStore`: `kvservice store`, or the Ray actor `kvservice deploy --stores` starts on each node,
actor.py) is a shared-memory segment of `num_blocks` pages on one node (segment.py) plus a kvservice pool
(`kvstore:<name>`) whose block ids are the segment's page numbers; its disk tier is page files (disk.py) and
the pool `kvdisk:<name>` (disk_tier.py); saves.py is the save protocol as ops. The allocator decides which pages
hold which prefix (LRU eviction, pins while a load reads, tenants, persistence); the bytes never pass through
it. An engine's KV connector on the same node maps the segment (and reads the disk tier's files) and copies
pages in and out itself; on another node it reads them with one NIXL READ from the segment the store exported
(transports/; the allocator hands the endpoint to the store's tenant only), or, where NIXL does not work or the
store published no endpoint, through the store's Ray actor and Ray's object store.

A page is one scheduler block of every layer, every tensor-parallel rank's slice side by side, in kvservice's
own page format (kvservice.integrations.vllm.connector.pageformat: canonical whatever the engine's attention
layout, opaque only for caches it cannot convert); the segment keeps each slice's tag, checksum and format.
The store itself knows only the page size.
"""

from kvservice.blockstore.segment import Descriptor, Segment, read_descriptor
from kvservice.blockstore.store import BlockStore, store_pool_id

__all__ = ["BlockStore", "Descriptor", "Segment", "read_descriptor", "store_pool_id"]

"""Sync and asyncio clients with typed results (`kvservice.results`, `kvservice.ops`).

Mutations carry the session's next sequence number and are retried with that same number on
transport errors: the server answers a retry of an applied sequence with the original reply, so
retries never apply twice. Reads are retried with deadlines too. While a client is open it renews its
session's lease in the background (every third of the server's `--session-ttl`).

    with KVServiceClient("127.0.0.1:50051") as client:
        client.register_pool("engine-0", KVCacheConfig(4096, [FullAttentionSpec(16)]), max_model_len=8192)
        result = client.step("engine-0", [AddRequestOp("r1", token_ids=prompt), AllocateOp("r1", num_new_tokens=512)])
        print(result[1].new_block_ids, result[1].num_computed_tokens)

    base      the API, written once (each method a `Call`)   sessions  sequences, acks, resume
    sync      KVServiceClient: runs a call to its result       aio   AsyncKVServiceClient: as a coroutine
    index     PrefixIndex: a router's replica of the prefix index from the shards' events (Lookup from memory)
    routing   which shard's connection a call goes to (one session id, sequences per shard)
"""

from kvservice.client.aio import AsyncKVServiceClient
from kvservice.client.index import PrefixIndex
from kvservice.client.sync import KVServiceClient
from kvservice.errors import KVServiceError
from kvservice.ops import AddRequestOp, AllocateOp, ForkOp, FreeOp
from kvservice.results import Event, LookupResult, PoolStats, RequestInfo, Stats

__all__ = ["AddRequestOp", "AllocateOp", "AsyncKVServiceClient", "Event", "ForkOp", "FreeOp", "KVServiceClient",
           "KVServiceError", "LookupResult", "PoolStats", "PrefixIndex", "RequestInfo", "Stats"]

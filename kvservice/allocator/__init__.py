"""The allocator: a deterministic state machine over pools, sessions and the event log.

    facade      Allocator.apply(command) -> Applied
    reads       lookup, requests, pool stats, invariants
    registry    placement        pools and epochs; lookup and routing across pools
    batches  -> schedule         packed ops; one request: plan (no change), then apply
    vllm_slots                   an AllocateOp with vLLM's semantics (allocate_slots), plan then apply
    pins                         prefixes held (a store's load, a cross-shard transfer's source)
    moves                        pools moving between shards (freeze, import, drop)
    requests                     bookkeeping: requests, owners, add/fork/free, session close, transfer aborts
    state: pools, sessions, transfers, events, keys   (nothing here imports a layer above it)
"""

from kvservice.allocator.facade import Allocator, Applied
from kvservice.allocator.state import AllocatorState

__all__ = ["Allocator", "AllocatorState", "Applied"]

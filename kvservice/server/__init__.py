"""The gRPC allocator service.

    serve (the `kvservice serve` process: startup checks, leader or hot standby, signals) -> app (the allocator
      recovered from Redis, leases, health, metrics, external feeds) -> servicer (translation only; rpc: its
      plumbing, external_handlers: external pools) -> kvservice.allocator
    auth (bearer tokens -> tenants), metrics (Prometheus), sharding (this allocator as one shard of several)
"""

import os

# The allocator forks to write snapshots (a consistent copy of its state, serialized off the event
# loop). The child never touches gRPC, so gRPC's fork handlers, which pause and restart its pollers
# around fork(), are turned off: they are what can break the parent's event engine.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

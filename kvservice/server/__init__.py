"""The gRPC allocator service: servicer (translation only), auth, leases, metrics and the app."""

import os

# The allocator forks to write snapshots (a consistent copy of its state, serialized off the event
# loop). The child never touches gRPC, so gRPC's fork handlers, which pause and restart its pollers
# around fork(), are turned off: they are what can break the parent's event engine.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

"""The store as a Ray actor on a chosen node (`start_store`; `kvservice deploy --stores` starts one per node,
named `node_store_name`), named `kvservice-store-<name>` in the namespace "kvservice". Engines of other nodes
read its pages through it (Ray's object store carries them) where NIXL does not work or the store published no
NIXL endpoint; otherwise they READ its segment with NIXL (transports/) and the actor is not on the path."""

from __future__ import annotations

import os
import socket

from kvservice.blockstore.segment import DEFAULT_DIR

NAMESPACE = "kvservice"
RAY_PROBE_TIMEOUT_S = 2.0  # a Ray cluster whose GCS does not accept a connection by then is not there


def live_ray_address(address: str | None) -> str:
    """The GCS address (host:port) of the Ray cluster `address` names ("auto"/None: $RAY_ADDRESS, else the last
    cluster started on this machine), checked to accept a connection within RAY_PROBE_TIMEOUT_S; else
    ConnectionError saying why. ray.init on its own waits forever for a GCS that is gone (the stale
    ray_current_cluster a killed cluster leaves in Ray's temp dir): resolve with this first. "local" (start one)
    and Ray Client addresses ("ray://host:port", which has its own connect timeout) pass as they are."""
    if address == "local" or (address and "://" in address):
        return address
    from ray._private.services import canonicalize_bootstrap_address, find_gcs_addresses

    find_gcs_addresses.cache_clear()  # Ray keeps the GCS processes it found: they may be gone, or others started
    resolved = canonicalize_bootstrap_address(address or "auto")  # ConnectionError: no cluster known at all
    if resolved is None:
        raise ConnectionError(f"address {address!r} names no Ray cluster to connect to")
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_PROBE_TIMEOUT_S).close()
    except OSError as e:
        source = address if address not in (None, "auto") else (
            "$RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "the last cluster started on this machine")
        raise ConnectionError(f"no Ray cluster answers at {resolved} (from {source}): {e}") from None
    return resolved


def actor_name(name: str) -> str:
    return f"kvservice-store-{name}"


def node_store_name(node_id: str) -> str:
    """The name `kvservice deploy --stores` gives the store of the Ray node `node_id`."""
    return f"node-{node_id[:12]}"


class _StoreActor:
    def __init__(self, name: str, address: str, num_blocks: int, page_bytes: int, block_size: int,
                 token: str | None = None, directory: str = DEFAULT_DIR, tls_ca: str | None = None,
                 disk_dir: str | None = None, disk_bytes: int = 0) -> None:
        import ray

        from kvservice.blockstore.store import BlockStore
        from kvservice.processes import normal_priority
        normal_priority(f"store {name}")  # engines on other nodes wait on its reads
        self.store = BlockStore(name, address, num_blocks, page_bytes, block_size, token=token, directory=directory,
                                node_id=ray.get_runtime_context().get_node_id(), tls_ca=tls_ca, disk_dir=disk_dir,
                                disk_bytes=disk_bytes)

    def descriptor(self):
        return self.store.descriptor

    def read(self, block_ids, token=None, generation=None, with_meta=False):
        return self.store.read(block_ids, token, generation, with_meta)

    def write(self, block_ids, data, token=None, generation=None) -> None:
        self.store.write(block_ids, data, token, generation)

    def stop(self) -> None:
        self.store.close()


def start_store(name: str, address: str, num_blocks: int, page_bytes: int, block_size: int, *,
                node_id: str | None = None, token: str | None = None, directory: str = DEFAULT_DIR,
                detached: bool = False, tls_ca: str | None = None, disk_dir: str | None = None,
                disk_bytes: int = 0, env: dict[str, str] | None = None):
    """Starts the store `name` as an actor (on the node `node_id`, hard affinity, when given; the one up under
    that name if there is one; `env`: its environment's extra variables) and waits until its pool is
    registered. Returns the actor handle;
    `ray.get(handle.descriptor.remote())` describes it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options = dict(name=actor_name(name), namespace=NAMESPACE, num_cpus=0, max_concurrency=4, get_if_exists=True)
    if detached:
        options["lifetime"] = "detached"
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    if env:  # e.g. UCX_TLS / UCX_NET_DEVICES for its NIXL agent
        options["runtime_env"] = {"env_vars": dict(env)}
    actor = ray.remote(_StoreActor).options(**options).remote(name, address, num_blocks, page_bytes, block_size,
                                                              token, directory, tls_ca, disk_dir, disk_bytes)
    ray.get(actor.descriptor.remote())
    return actor

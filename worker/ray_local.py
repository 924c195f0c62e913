"""Ray on one machine, bound to loopback.

Ray gives its GCS, raylets and workers the machine's routable address, even when told `127.0.0.1` (it
"resolves" loopback to that address on Linux); on hosts where the address is firewalled (CI sandboxes,
laptops on VPNs) `ray.init` then hangs reaching its own GCS. Ray keeps to loopback only in its
single-machine mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, its default on macOS and Windows). Everything
local that kvservice starts — `LLM`, `kvservice deploy --local`, the demo, the tests' clusters — goes
through these helpers, which switch that mode on for this process and the Ray processes it starts.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

LOOPBACK = "127.0.0.1"
QUIET = {"log_to_driver": False, "configure_logging": False}


def loopback_only() -> None:
    """Make this process (and the Ray processes it starts from now on) give Ray nodes the address 127.0.0.1,
    and run their workers at the caller's priority: Ray's default worker niceness (15) gives a local cluster a
    few percent of a core whenever anything else on the machine is busy (unless the caller set it)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_worker_niceness", "0")
    from ray._private import ray_constants  # read when Ray picks a node's address, not only at import
    ray_constants.ENABLE_RAY_CLUSTER = False


def quiet_ray() -> None:
    """Ray's banner ("Started a local Ray instance.", "Connecting to existing Ray cluster") is an INFO
    record: it would land in the output of `kvservice demo`, `generate` and `LLM` (whose CLI logs at INFO)."""
    logging.getLogger("ray").setLevel(max(logging.WARNING, logging.getLogger("ray").getEffectiveLevel()))
    # ...and a WARNING that this loopback cluster uses Ray's default token auth: news to no one here (the
    # mode is left as Ray chose it).
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


def init_local(**kwargs) -> None:
    """Start a fresh single-node Ray instance in this process, on loopback."""
    import ray
    loopback_only()
    quiet_ray()
    ray.init(address="local", include_dashboard=False, _node_ip_address=LOOPBACK, **QUIET, **kwargs)


def connect(address: str, **kwargs) -> None:
    """Join a Ray cluster from this process; a local cluster's driver must also say it lives on loopback."""
    import ray
    loopback_only()
    quiet_ray()
    ray.init(address=address, _node_ip_address=LOOPBACK, **QUIET, **kwargs)


def local_cluster(*nodes: dict):
    """A `ray.cluster_utils.Cluster` with one node per dict of node args (the first is the head)."""
    from ray.cluster_utils import Cluster
    loopback_only()
    head, *rest = nodes
    cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, "node_ip_address": LOOPBACK,
                                                            **head})
    for node in rest:
        cluster.add_node(node_ip_address=LOOPBACK, **node)
    return cluster


def shutdown() -> None:
    """`ray.shutdown()`, after a garbage collection in this thread.

    Actor handles and object refs in reference cycles (an exception's traceback holds a test's or a command's
    locals) are freed only when the cyclic collector runs, in whatever thread happens to allocate then: a
    lease renewer, an index refresher. If that collection runs while `ray.shutdown()` tears the core worker
    down, a handle's release reaches the gone worker, and Ray ends the process with exit status 1 ("The core
    worker has already been shutdown"), output unflushed. Seen once in a `make test` run, right after
    tests/test_multinode.py's cluster went away. Collecting first frees them while Ray is still up."""
    import gc

    import ray
    gc.collect()
    ray.shutdown()


@contextmanager
def joined_cluster(*nodes: dict, namespace: str | None = None):
    """`local_cluster(*nodes)` with this process connected as its driver (in `namespace`) once every node is
    up; both are shut down on exit."""
    cluster = local_cluster(*nodes)
    try:
        connect(cluster.address, namespace=namespace)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        shutdown()
        cluster.shutdown()

"""The connector's settings: vLLM's `kv_connector_extra_config`, checked once, each error naming its key."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields

ENV_STORE = "KVSERVICE_STORE"  # the local store's name, when extra_config names none (kvservice deploy sets it)
# The Ray node of the process that built the engine, for vLLM's own subprocesses (its engine core and workers run
# outside Ray when vLLM uses multiprocessing): `store: auto` finds that node's store from them.
ENV_RAY_NODE = "KVSERVICE_RAY_NODE_ID"


def hand_down_ray_node() -> None:
    """Notes this process's Ray node in the environment its later subprocesses inherit. vLLM imports the
    connector in the process that builds its config (an actor's, when the engine is made in a Ray actor)
    before it starts its engine-core and worker processes. Never imports Ray itself."""
    ray = sys.modules.get("ray")
    if ENV_RAY_NODE not in os.environ and ray is not None and ray.is_initialized():
        os.environ[ENV_RAY_NODE] = ray.get_runtime_context().get_node_id()


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """Args (keys of kv_connector_extra_config):
        address: the allocator, host:port (required).
        token: the bearer token; its tenant must own the stores (a store's pool belongs to the tenant that
            started it), and an engine finds and reads only its tenant's blocks.
        store: the store on this engine's node, where it saves (default: $KVSERVICE_STORE). Without one
            the engine only loads. "auto": the store `kvservice deploy --stores` started on this Ray node
            (when this process is in Ray), else the live store of this node of the engine's tenant, block
            size and page size (autostore.py; refused while several fit, naming them).
        stores: the stores to load from (default: every store pool the tenant sees).
        ray_address: the Ray cluster of the stores, for loads from other nodes (default: the Ray this
            process already joined, else "auto").
        namespace: salted into every prompt's block hashes, so only engines with the same one share pages
            (default: a fingerprint of the model, its dtype, the KV cache dtype and the block size). Set the
            same value on engines that load one model from different paths.
        index: find hits in a replica of the store pools' prefix index kept from the allocator's events
            (kvservice.client.PrefixIndex, True): a new request costs no RPC unless a store holds more of it
            than the engine (then one PinOp); False: one Lookup RPC per new request as well.
        timeout_s: per call to the allocator (1.0). A failed call turns sharing off for `retry_after_s`
            (5.0): the engine serves on, computing what it would have loaded.
        load_failure: "recompute" (default; sets vLLM's kv_load_failure_policy) or "fail" (vLLM's).
        shm_dir: where this node's stores keep their segments ("/dev/shm").
        transport: how pages of other nodes' stores move: "auto" (NIXL where it is installed and the store
            published an endpoint, else Ray), "nixl" (NIXL only: a store without it is not read; the worker
            refuses to start where NIXL does not work), "ray".
        verify_checksums: check every loaded page's bytes against the checksum its writer stored (False: the
            tag and format are always checked; the checksum costs about as much as the copy on a CPU).
        handoff_timeout_s: how long a consumer given a producer's kv_transfer_params waits for its pages to be
            committed before it computes the prompt itself (10.0).
    """

    address: str
    token: str | None = None
    store: str | None = None
    stores: tuple[str, ...] = ()
    ray_address: str | None = None
    namespace: str = ""
    index: bool = True
    timeout_s: float = 1.0
    retry_after_s: float = 5.0
    load_failure: str = "recompute"
    shm_dir: str = "/dev/shm"
    handoff_timeout_s: float = 10.0
    verify_checksums: bool = False
    transport: str = "auto"

    def client(self, block_size: int, client_name: str, retries: int):
        """A client of the allocator as the connector's sides use it (short calls: a failure means compute)."""
        from kvservice.client import KVServiceClient
        return KVServiceClient(self.address, self.token, client_name=client_name, hash_block_size=block_size,
                               timeout_s=self.timeout_s, retries=retries)

    @classmethod
    def from_extra(cls, extra: dict | None, *, block_size: int | None = None, page_bytes: int | None = None,
                   resolve_store: bool = True) -> ConnectorSettings:
        """The settings of `extra`; `store: auto` resolved (autostore.py) for an engine of `block_size` whose
        store pages are `page_bytes` (None: not checked), unless `resolve_store` is False (a worker, which never
        saves by name: `store` stays "auto")."""
        extra = dict(extra or {})
        defaults = {f.name: f.default for f in fields(cls)}
        known = set(defaults)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key {unknown[0]!r} for KVServiceConnector "
                             f"(known: {', '.join(sorted(known))})")
        if not extra.get("address"):
            raise ValueError("kv_connector_extra_config.address: required, the kvservice allocator's host:port")
        extra.setdefault("store", os.environ.get(ENV_STORE) or None)
        stores = extra.get("stores", ())
        if isinstance(stores, str):
            stores = tuple(s for s in stores.split(",") if s)
        extra["stores"] = tuple(stores)
        for key in ("timeout_s", "retry_after_s", "handoff_timeout_s"):
            value = extra.get(key, defaults[key])
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"kv_connector_extra_config.{key}: {value!r} is not a positive number of seconds")
            extra[key] = float(value)
        if extra.get("transport", "auto") not in ("auto", "nixl", "ray"):
            raise ValueError(f"kv_connector_extra_config.transport: {extra['transport']!r} is not 'auto', 'nixl' or "
                             f"'ray'")
        if extra.get("load_failure", "recompute") not in ("recompute", "fail"):
            raise ValueError(f"kv_connector_extra_config.load_failure: {extra['load_failure']!r} is not "
                             f"'recompute' or 'fail'")
        if extra["store"] == "auto" and resolve_store:
            from kvservice.integrations.vllm.connector.autostore import Engine, auto_store
            extra["store"] = auto_store(extra.get("shm_dir", defaults["shm_dir"]),
                                        Engine(block_size, page_bytes, extra["address"], extra.get("token"),
                                               extra["timeout_s"]))
        return cls(**extra)


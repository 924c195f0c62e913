"""kvservice's KV connector for vLLM (0.32.x and 0.33.x): engines save the KV of prompts they computed into the
store tier (kvservice.blockstore) and load prefixes any engine of their tenant saved: on this node through
shared memory or from the store's disk tier, across nodes with one NIXL READ of the store's pages (through the
store's Ray actor where NIXL does not work).

    kv_transfer_config={"kv_connector": "KVServiceConnector",
                        "kv_connector_module_path": "kvservice.integrations.vllm.connector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"address": "127.0.0.1:50051", "store": "node-a"}}

The settings (`kv_connector_extra_config`) are listed in `settings.py`.
"""

_CLASSES = ("KVServiceConnector", "KVServiceConnectorMetadata")


def __getattr__(name: str):
    # Lazy: only the connector class imports vLLM (its two sides and the store tier do not).
    if name in _CLASSES:
        from kvservice.integrations.vllm.connector import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_CLASSES)

"""The connector's counters, where vLLM puts a connector's: each side's `get_kv_connector_stats()` returns
them per interval, vLLM adds up the workers' and the scheduler's, and its Prometheus logger (the `/metrics`
of `vllm serve`) records them through `KVServiceConnectorPromMetrics`.

vLLM counts an external hit when the connector claims it, before the load: a claimed hit whose load fails
still shows in `num_cached_tokens` and `vllm:external_prefix_cache_hits_total`. These say what happened to it.

| series (labels: vLLM's model_name and engine, plus) | what |
|---|---|
| `vllm:kvservice_hits_claimed_total{store}` | requests a store's pinned prefix was claimed for |
| `vllm:kvservice_hit_tokens_claimed_total{store}` | the tokens claimed |
| `vllm:kvservice_blocks_loaded_total{store}` | blocks copied into the engine (verified) |
| `vllm:kvservice_blocks_failed_total{store,reason}` | blocks whose load failed: vLLM recomputed them |
| `vllm:kvservice_blocks_saved_total{store}` | blocks saved into a store |
| `vllm:kvservice_blocks_spilled_total{store}` | blocks written through to a store's disk tier |
| `vllm:kvservice_blocks_promoted_total{store}` | blocks loaded from a disk tier, saved into RAM again |
| `vllm:kvservice_bytes_loaded_total{store}`, `..._bytes_saved_total{store}` | page bytes per tier (rates: GB/s) |
| `kvservice_page_checksum_failures_total{tier}` | pages whose checksum failed at load (tier ram or disk) |

`store` is the store's name for its RAM tier and `<name>:disk` for its disk tier.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvservice.integrations.vllm.connector.counters import KINDS, Counters


class KVServiceConnectorStats(KVConnectorStats):
    """`data`: kind -> {label: count} (labels "store" or "store|reason"), the counts of one interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = Counters.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {kind: sum(self.data.get(kind, {}).values()) for kind in KINDS}

    def is_empty(self) -> bool:
        return not any(self.data.get(kind) for kind in KINDS)


class KVServiceConnectorPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        store, reason = [*labelnames, "store"], [*labelnames, "store", "reason"]
        c = self._counter_cls
        self.counters = {
            "claimed": c(name="vllm:kvservice_hits_claimed", labelnames=store,
                         documentation="Requests a store's pinned prefix was claimed for (vLLM counts them hit)."),
            "claimed_tokens": c(name="vllm:kvservice_hit_tokens_claimed", labelnames=store,
                                documentation="Tokens of the store hits claimed."),
            "loaded": c(name="vllm:kvservice_blocks_loaded", labelnames=store,
                        documentation="Blocks loaded from a store into the engine."),
            "failed": c(name="vllm:kvservice_blocks_failed", labelnames=reason,
                        documentation="Blocks whose load failed (vLLM recomputed them), by reason."),
            "saved": c(name="vllm:kvservice_blocks_saved", labelnames=store,
                       documentation="Blocks saved into a store."),
            "spilled": c(name="vllm:kvservice_blocks_spilled", labelnames=store,
                         documentation="Blocks written through to a store's disk tier (durable)."),
            "promoted": c(name="vllm:kvservice_blocks_promoted", labelnames=store,
                          documentation="Blocks loaded from a disk tier and saved into RAM again."),
            "bytes_loaded": c(name="vllm:kvservice_bytes_loaded", labelnames=store,
                              documentation="Page bytes loaded into the engine, per tier."),
            "bytes_saved": c(name="vllm:kvservice_bytes_saved", labelnames=store,
                             documentation="Page bytes saved, per tier."),
            "checksum_failures": shared_counter(
                c, "kvservice_page_checksum_failures", [*labelnames, "tier"],
                "Pages whose bytes did not match their checksum at load (vLLM recomputed them), by tier."),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues.get(engine_idx, [])
        for kind, counts in transfer_stats_data.items():
            counter = self.counters.get(kind)
            for label, n in (counts or {}).items():
                if counter is not None and n:
                    counter.labels(*engine, *label.split("|")).inc(n)


def shared_counter(counter_cls, name: str, labelnames: list[str], documentation: str):
    """A counter outside vLLM's `vllm:` names (vLLM unregisters only those when an engine starts again in the
    same process): the one already registered under `name`, else a new one."""
    from prometheus_client import REGISTRY
    existing = REGISTRY._names_to_collectors.get(name + "_total")  # noqa: SLF001 - no public lookup by name
    if existing is not None:
        return existing
    return counter_cls(name=name, documentation=documentation, labelnames=labelnames)


def stats_of(counters: Counters) -> KVServiceConnectorStats | None:
    """The counts since the last call, as vLLM's stats object (None when nothing happened)."""
    data = counters.take()
    return KVServiceConnectorStats(data=data) if data else None

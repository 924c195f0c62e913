"""`KVServiceConnector`: vLLM's KVConnectorBase_V1 over kvservice's store tier (one class for both of vLLM's
roles; the scheduler side and the worker side are separate objects in separate processes)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvservice.integrations.vllm import version as _version  # noqa: F401 - refuses an unsupported vLLM
from kvservice.integrations.vllm.connector.autostore import engine_page_bytes
from kvservice.integrations.vllm.connector.identity import model_namespace
from kvservice.integrations.vllm.connector.plan import Done, Load, Save
from kvservice.integrations.vllm.connector.settings import ConnectorSettings, hand_down_ray_node
from kvservice.integrations.vllm.connector.vllm_logging import follow_vllm_logging

logger = logging.getLogger(__name__)
hand_down_ray_node()  # vLLM imports this module in the process that builds the engine's config


@dataclass
class KVServiceConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    endpoints: dict[str, bytes] = field(default_factory=dict)  # store pool -> NIXL endpoint, when new or changed
    delayed: list[str] = field(default_factory=list)  # finished requests whose blocks vLLM keeps for our saves
    preempted: bool = False  # requests were preempted: their blocks may be reused by this step's forward


@dataclass
class KVServiceWorkerMetadata(KVConnectorWorkerMetadata):
    """A worker's `Done` of one step; vLLM adds up every rank's before the scheduler side sees it."""

    done: Done = field(default_factory=Done)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVServiceWorkerMetadata):
            self.done.merge(other.done)
        return self


def page_family(vllm_config) -> str:
    """The page format family the namespace pins: kvservice's canonical pages whatever the attention layout,
    except for caches whose bytes hold scales inline or an unverified packing (opaque: only identical engines
    share them; the worker side refuses to register a format it cannot map)."""
    from kvservice.integrations.vllm.connector.pageformat import PLAIN_CACHE_DTYPES
    cache = vllm_config.cache_config
    if cache.cache_dtype not in PLAIN_CACHE_DTYPES:
        return f"opaque:{cache.cache_dtype}:{getattr(cache, 'kv_cache_layout', '')}"
    return "canonical"


def layer_scales(vllm_config, kv_caches) -> dict[str, tuple[float, float]] | None:
    """Each layer's KV scales when the cache is quantised (fp8: `_k_scale_float` / `_v_scale_float`, from the
    checkpoint or 1.0), read from vLLM's layers; None for an unquantised cache."""
    if vllm_config.cache_config.cache_dtype in ("auto", None):
        return None
    layers = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    return {name: (float(getattr(layers.get(name), "_k_scale_float", 1.0)),
                   float(getattr(layers.get(name), "_v_scale_float", 1.0))) for name in kv_caches}


class KVServiceConnector(KVConnectorBase_V1):
    """Prefix sharing through kvservice's stores (`kv_role` kv_both), or one direction of it: a `kv_producer`
    saves and never loads, a `kv_consumer` loads and never saves (prefill/decode disaggregation).

    Loads are synchronous (finished before the step's forward, whatever CUDA graphs skip), of whole blocks past
    the engine's own prefix hit; a prefill/decode hand-over (the producer's kv_transfer_params) is loaded
    asynchronously once its pages are committed. Saves copy a prompt's whole blocks once it is computed, after
    the step's forward, and are committed once every tensor-parallel rank wrote its slice. A load that fails is
    recomputed by vLLM (kv_load_failure_policy "recompute", set here unless load_failure is "fail"): never
    wrong tokens.
    """

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        follow_vllm_logging()  # before either side logs: the worker names its copy path at start-up
        transfer = self._kv_transfer_config
        parallel = vllm_config.parallel_config
        self.block_size = vllm_config.cache_config.block_size
        # Only the scheduler side saves into `store` by name: `auto` is resolved there, for this engine's pages.
        self.settings = ConnectorSettings.from_extra(
            transfer.kv_connector_extra_config, block_size=self.block_size,
            page_bytes=engine_page_bytes(kv_cache_config, parallel.tensor_parallel_size),
            resolve_store=role == KVConnectorRole.SCHEDULER)
        refused = {"pipeline_parallel_size": parallel.pipeline_parallel_size,
                   "decode_context_parallel_size": getattr(parallel, "decode_context_parallel_size", 1),
                   "prefill_context_parallel_size": getattr(parallel, "prefill_context_parallel_size", 1)}
        for name, value in refused.items():
            if (value or 1) > 1:
                raise ValueError(f"KVServiceConnector: {name} {value}: a page is one block of every layer and "
                                 f"token of a tensor-parallel rank; pipeline and context parallelism split those")
        self.world_size = parallel.tensor_parallel_size
        if self.settings.load_failure == "recompute":
            transfer.kv_load_failure_policy = "recompute"
        self.async_saves = str(getattr(vllm_config.device_config, "device_type", "cpu")) == "cuda"
        engine_id = transfer.engine_id or "engine"
        self.scheduler_side = self.worker_side = None
        if role == KVConnectorRole.SCHEDULER:
            from kvservice.integrations.vllm.connector.scheduler_side import SchedulerSide
            self.scheduler_side = SchedulerSide(self.settings, self.block_size, engine_id,
                                                loads=transfer.is_kv_consumer, saves=transfer.is_kv_producer,
                                                namespace=model_namespace(vllm_config, page_family(vllm_config)),
                                                world_size=self.world_size)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from kvservice.integrations.vllm.connector.worker_side import WorkerSide
            cache = vllm_config.cache_config
            self.worker_side = WorkerSide(
                self.settings, self.block_size, engine_id, rank=get_tensor_model_parallel_rank(),
                world_size=self.world_size, layout=getattr(cache, "kv_cache_layout", None),
                head_size=vllm_config.model_config.get_head_size(), cache_dtype=cache.cache_dtype,
                cpu_attention=str(getattr(vllm_config.device_config, "device_type", "cpu")) == "cpu")

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that did not happen is a later miss, never a lost hand-off

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """LBHNC ("HND"): a page is then a byte copy of each layer's block (any other layout converts on the
        copy, so vLLM choosing another is fine)."""
        return None if vllm_config.model_config.use_mla else "LBHNC"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        from kvservice.integrations.vllm.connector.stats import KVServiceConnectorStats
        return KVServiceConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from kvservice.integrations.vllm.connector.stats import KVServiceConnectorPromMetrics
        return KVServiceConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self):
        from kvservice.integrations.vllm.connector.stats import stats_of
        side = self.scheduler_side or self.worker_side
        return stats_of(side.counters) if side is not None else None

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        self.worker_side.register(kv_caches, num_blocks, layer_scales(self._vllm_config, kv_caches))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KVServiceConnectorMetadata) and meta.loads:
            self.worker_side.load(meta.loads, meta.endpoints)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # every load finished in start_load_kv (FULL CUDA-graph batches skip the per-layer hooks)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None  # whole pages are saved in wait_for_save, once the forward wrote every layer

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """Before the forward: a preempted request's blocks are free for this step's writes, so save copies
        still reading them (a GPU's, asynchronous) finish first."""
        if isinstance(kv_connector_metadata, KVServiceConnectorMetadata) and kv_connector_metadata.preempted:
            self.worker_side.flush_saves()

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, KVServiceConnectorMetadata):
            if meta.delayed:
                self.worker_side.delay(meta.delayed)
            if meta.saves:
                self.worker_side.save(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_failed_blocks() if self.worker_side is not None else set()

    def build_connector_worker_meta(self):
        done = self.worker_side.take_done() if self.worker_side is not None else None
        return KVServiceWorkerMetadata(done) if done else None

    # ---- scheduler side ------------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self.scheduler_side.after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        loads, saves = self.scheduler_side.build(scheduler_output)
        side = self.scheduler_side
        return KVServiceConnectorMetadata(loads, saves, side.endpoints_for(loads), side.take_delayed(),
                                          bool(getattr(scheduler_output, "preempted_req_ids", None)))

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVServiceWorkerMetadata):
            self.scheduler_side.workers_done(meta.done)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_work()

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # An asynchronous save (a GPU's copy) still reads the request's blocks: vLLM keeps them until every
        # worker reports the request in finished_sending.
        delay = self.async_saves and self.scheduler_side.saving(request.request_id)
        if delay:
            self.scheduler_side.delay(request.request_id)
        return delay, self.scheduler_side.finished(request)

    def shutdown(self) -> None:
        for side in (self.scheduler_side, self.worker_side):
            if side is not None:
                side.close()

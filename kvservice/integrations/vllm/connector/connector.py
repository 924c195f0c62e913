"""`KVServiceConnector`: vLLM's KVConnectorBase_V1 over kvservice's store tier (one class for both of vLLM's
roles; the scheduler side and the worker side are separate objects in separate processes)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from kvservice.integrations.vllm import version as _version  # noqa: F401 - refuses an unsupported vLLM
from kvservice.integrations.vllm.connector.identity import model_namespace
from kvservice.integrations.vllm.connector.plan import Load, Save
from kvservice.integrations.vllm.connector.settings import ConnectorSettings, hand_down_ray_node

logger = logging.getLogger(__name__)
hand_down_ray_node()  # vLLM imports this module in the process that builds the engine's config


@dataclass
class KVServiceConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


class KVServiceConnector(KVConnectorBase_V1):
    """Prefix sharing through kvservice's stores (`kv_role` kv_both), or one direction of it: a `kv_producer`
    saves and never loads, a `kv_consumer` loads and never saves (prefill/decode disaggregation).

    Loads are synchronous (vLLM copies them in before the step's forward), of whole blocks past the engine's
    own prefix hit; saves copy a prompt's whole blocks once it is computed, after the step's forward. A load
    that fails is recomputed by vLLM (kv_load_failure_policy "recompute", set here unless load_failure is
    "fail"): never wrong tokens.
    """

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(transfer.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
            raise ValueError(f"KVServiceConnector: tensor_parallel_size {parallel.tensor_parallel_size} x "
                             f"pipeline_parallel_size {parallel.pipeline_parallel_size}: one worker per engine "
                             f"only (a page is one worker's whole KV of a block)")
        if self.settings.load_failure == "recompute":
            transfer.kv_load_failure_policy = "recompute"
        self.block_size = vllm_config.cache_config.block_size
        engine_id = transfer.engine_id or "engine"
        self.scheduler_side = self.worker_side = None
        if role == KVConnectorRole.SCHEDULER:
            from kvservice.integrations.vllm.connector.scheduler_side import SchedulerSide
            self.scheduler_side = SchedulerSide(self.settings, self.block_size, engine_id,
                                                loads=transfer.is_kv_consumer, saves=transfer.is_kv_producer,
                                                namespace=model_namespace(vllm_config))
        else:
            from kvservice.integrations.vllm.connector.worker_side import WorkerSide
            self.worker_side = WorkerSide(self.settings, self.block_size, engine_id)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that did not happen is a later miss, never a lost hand-off

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        self.worker_side.register(kv_caches, num_blocks)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KVServiceConnectorMetadata) and meta.loads:
            self.worker_side.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # every layer was loaded in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None  # whole pages are saved in wait_for_save, once the forward wrote every layer

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, KVServiceConnectorMetadata) and meta.saves:
            self.worker_side.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_failed_blocks() if self.worker_side is not None else set()

    # ---- scheduler side ------------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self.scheduler_side.after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        loads, saves = self.scheduler_side.build(scheduler_output)
        return KVServiceConnectorMetadata(loads, saves)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler_side.finished(request)
        return False, None

    def shutdown(self) -> None:
        for side in (self.scheduler_side, self.worker_side):
            if side is not None:
                side.close()

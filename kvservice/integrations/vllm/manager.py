"""vLLM's KVCacheManager (its signature, vLLM's config, requests, stats and events) over
kvservice.core's KVCacheManager, exactly vLLM 0.33.0's semantics: no fast path, a request counts as
running only from its first hit or cached block."""

from __future__ import annotations

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core import kv_cache_manager as vllm_kv_cache_manager
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import RequestStatus

from kvservice.core import kv_cache_manager as core_manager
from kvservice.core.stats import PrefixCacheRecorder
from kvservice.integrations.vllm.managers import get_kv_cache_coordinator
from kvservice.integrations.vllm.specs import core_config, event_metadata

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class KVCacheManager(core_manager.KVCacheManager):
    track_running = False

    def __init__(self, kv_cache_config, max_model_len: int, scheduler_block_size: int, hash_block_size: int,
                 max_in_flight_tokens: int | None = None, enable_caching: bool = True, use_eagle: bool = False,
                 num_hash_lookahead_tokens: int = 0, num_prefill_lookahead: int = 0, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, dcp_world_size: int = 1, pcp_world_size: int = 1,
                 metrics_collector=None, watermark: float = 0.0,
                 enable_mamba_shared_prefix_checkpoint: bool = False) -> None:
        self.kv_cache_config = kv_cache_config
        self.log_stats = log_stats
        super().__init__(
            core_config(kv_cache_config), max_model_len, enable_caching, enable_kv_cache_events, dcp_world_size,
            hash_block_size, enable_fast_path=False, scheduler_block_size=scheduler_block_size,
            max_in_flight_tokens=max_in_flight_tokens, use_eagle=use_eagle,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens, num_prefill_lookahead=num_prefill_lookahead,
            pcp_world_size=pcp_world_size, watermark=watermark, metrics_collector=metrics_collector,
            enable_mamba_shared_prefix_checkpoint=enable_mamba_shared_prefix_checkpoint,
            stats=PrefixCacheRecorder(PrefixCacheStats))
        self.kv_cache_event_metadata = event_metadata(kv_cache_config)

    def _make_coordinator(self, config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching,
                          enable_events, dcp_world_size, pcp_world_size, scheduler_block_size, hash_block_size,
                          metrics_collector, num_hash_lookahead_tokens, num_prefill_lookahead):
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        return get_kv_cache_coordinator(
            self.kv_cache_config, max_model_len, in_flight, use_eagle, enable_caching, enable_events, dcp_world_size,
            pcp_world_size, scheduler_block_size, hash_block_size, metrics_collector, num_hash_lookahead_tokens,
            num_prefill_lookahead)

    def _check_request(self, request) -> None:
        return None

    def _is_waiting(self, request) -> bool:
        return request.status in _WAITING

    @property
    def prefix_cache_stats(self):
        return self._stats.interval if self.log_stats else None

    @prefix_cache_stats.setter
    def prefix_cache_stats(self, stats) -> None:
        self._stats.interval = stats

    def make_prefix_cache_stats(self):
        return self._stats.take_interval() if self.log_stats else None

    def record_prefix_cache_stats(self, request, num_hits: int) -> None:
        if self.log_stats:
            super().record_prefix_cache_stats(request, num_hits)

    def reset_prefix_cache(self) -> bool:
        if not self.coordinator.reset_prefix_cache():
            return False
        if self.log_stats:
            self._stats.interval.reset = True
        return True

    def get_computed_blocks(self, request, max_cache_hit_length: int | None = None):
        return self.find_computed_blocks(request, max_cache_hit_length, record_stats=False)

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks=None, num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()):
        return super().allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            delay_cache_blocks, num_external_computed_tokens=num_external_computed_tokens,
            num_encoder_tokens=num_encoder_tokens, full_sequence_must_fit=full_sequence_must_fit,
            reserved_blocks=reserved_blocks, has_scheduled_reqs=has_scheduled_reqs,
            skip_zeroing_group_ids=skip_zeroing_group_ids)

    def take_events(self):
        events = self.block_pool.take_events()
        metadata = self.kv_cache_event_metadata
        for event in events:
            if not isinstance(event, BlockStored) or event.group_idx is None:
                continue
            if not 0 <= event.group_idx < len(metadata):
                # vLLM's logger: its callers watch it.
                vllm_kv_cache_manager.logger.warning("Group index `%s` not in KV cache metadata", event.group_idx)
                continue
            event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = metadata[event.group_idx]
        return events

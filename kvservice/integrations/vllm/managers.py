"""vLLM's single-type managers and coordinators (names, signatures, vLLM's specs and config) over
kvservice.core's: each is the core class with vLLM's spec converted on the way in."""

from __future__ import annotations

from vllm.v1 import kv_cache_interface as vi

from kvservice.core import coordinator as cc
from kvservice.core import hybrid_coordinator as hc
from kvservice.core import managers as cm
from kvservice.core.specs import ChunkedLocalAttentionSpec, SlidingWindowSpec
from kvservice.integrations.vllm.pool import BlockPool
from kvservice.integrations.vllm.specs import core_config, core_spec


def _dropin(core_cls: type[cm.SingleTypeManager]) -> type[cm.SingleTypeManager]:
    class Manager(core_cls):
        def __init__(self, kv_cache_spec, *args, **kwargs) -> None:
            super().__init__(core_spec(kv_cache_spec), *args, **kwargs)
            self.kv_cache_spec = kv_cache_spec  # vLLM's (callers outside the core read it)

        @classmethod
        def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                                   *args, **kwargs):
            return super().find_longest_cache_hit(block_hashes, max_length, kv_cache_group_ids, block_pool,
                                                  core_spec(kv_cache_spec), *args, **kwargs)

        @classmethod
        def reachable_block_mask(cls, start_block, end_block, alignment_tokens, kv_cache_spec, *args, **kwargs):
            return super().reachable_block_mask(start_block, end_block, alignment_tokens, core_spec(kv_cache_spec),
                                                *args, **kwargs)

    Manager.__name__ = Manager.__qualname__ = core_cls.__name__
    Manager.__doc__ = core_cls.__doc__
    return Manager


FullAttentionManager = _dropin(cm.FullAttentionManager)
RSWAManager = _dropin(cm.RSWAManager)
SinkFullAttentionManager = _dropin(cm.SinkFullAttentionManager)
SlidingWindowManager = _dropin(cm.SlidingWindowManager)
ChunkedLocalAttentionManager = _dropin(cm.ChunkedLocalAttentionManager)
MambaManager = _dropin(cm.MambaManager)
CircularBufferManager = _dropin(cm.CircularBufferManager)
CrossAttentionManager = _dropin(cm.CrossAttentionManager)
SingleTypeKVCacheManager = cm.SingleTypeManager

_BY_CORE_SPEC = {spec_type: globals()[manager.__name__] for spec_type, manager in cm.MANAGER_TYPES.items()}


def get_manager_for_kv_cache_spec(kv_cache_spec, max_in_flight_tokens: int, max_model_len: int,
                                  role: str | None = None, **kwargs) -> cm.SingleTypeManager:
    """The manager for a vLLM spec; sliding-window and chunked-local groups get the recycling-aware
    admission cap their spec computes."""
    if role not in (None, vi.KVCacheGroupRole.DEFAULT):
        raise NotImplementedError(f"kvservice's core has no manager for the {role} role (HiSparse)")
    spec = core_spec(kv_cache_spec)
    if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
        kwargs["max_admission_blocks_per_request"] = spec.max_admission_blocks_per_request(
            max_in_flight_tokens=max_in_flight_tokens, max_model_len=max_model_len)
    return _BY_CORE_SPEC[type(spec)](kv_cache_spec, **kwargs)


class _Coordinator:
    """Mixed in front of a core coordinator: vLLM's config and constructor, vLLM's pool and managers."""

    def _setup(self, kv_cache_config) -> None:
        self.kv_cache_config = kv_cache_config

    def make_block_pool(self, num_blocks, enable_caching, enable_events, hash_block_size, num_hash_lookahead_tokens,
                        metrics_collector):
        return BlockPool(num_blocks, enable_caching, hash_block_size, enable_events, metrics_collector,
                         num_hash_lookahead_tokens)

    def make_manager(self, spec, group_id, enable_caching, dcp_world_size, pcp_world_size):
        group = self._vllm_config.kv_cache_groups[group_id]
        manager = get_manager_for_kv_cache_spec(
            group.kv_cache_spec, self.max_in_flight_tokens, self.max_model_len, role=group.role,
            block_pool=self.block_pool, enable_caching=enable_caching, kv_cache_group_id=group_id,
            dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size,
            scheduler_block_size=self.scheduler_block_size, needs_kv_cache_zeroing=self.config.needs_kv_cache_zeroing)
        manager.cow = self.cow
        return manager

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        return self.find_cache_hit(block_hashes, max_cache_hit_length)


def _args(kv_cache_config, max_model_len, max_in_flight_tokens):
    return core_config(kv_cache_config), max_model_len, max_model_len if max_in_flight_tokens is None \
        else max_in_flight_tokens


class KVCacheCoordinatorNoPrefixCache(_Coordinator, cc.KVCacheCoordinatorNoPrefixCache):
    def __init__(self, kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_kv_cache_events,
                 dcp_world_size, pcp_world_size, scheduler_block_size, hash_block_size, metrics_collector=None,
                 num_hash_lookahead_tokens=0, num_prefill_lookahead=0) -> None:
        self._vllm_config = kv_cache_config
        super().__init__(*_args(kv_cache_config, max_model_len, max_in_flight_tokens), use_eagle,
                         enable_kv_cache_events, dcp_world_size, pcp_world_size, scheduler_block_size, hash_block_size,
                         metrics_collector, num_hash_lookahead_tokens, num_prefill_lookahead)
        self._setup(kv_cache_config)


class UnitaryKVCacheCoordinator(_Coordinator, cc.UnitaryKVCacheCoordinator):
    def __init__(self, kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching,
                 enable_kv_cache_events, dcp_world_size, pcp_world_size, scheduler_block_size, hash_block_size,
                 metrics_collector=None, num_hash_lookahead_tokens=0, num_prefill_lookahead=0) -> None:
        self._vllm_config = kv_cache_config
        super().__init__(*_args(kv_cache_config, max_model_len, max_in_flight_tokens), use_eagle, enable_caching,
                         enable_kv_cache_events, dcp_world_size, pcp_world_size, scheduler_block_size, hash_block_size,
                         metrics_collector, num_hash_lookahead_tokens, num_prefill_lookahead)
        self._setup(kv_cache_config)


class HybridKVCacheCoordinator(_Coordinator, hc.HybridKVCacheCoordinator):
    def __init__(self, kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching,
                 enable_kv_cache_events, dcp_world_size, pcp_world_size, scheduler_block_size, hash_block_size,
                 metrics_collector=None, num_hash_lookahead_tokens=0, num_prefill_lookahead=0,
                 allow_partial_hash_hits=True) -> None:
        self._vllm_config = kv_cache_config
        super().__init__(*_args(kv_cache_config, max_model_len, max_in_flight_tokens), use_eagle, enable_caching,
                         enable_kv_cache_events, dcp_world_size, pcp_world_size, scheduler_block_size, hash_block_size,
                         metrics_collector, num_hash_lookahead_tokens, num_prefill_lookahead,
                         allow_partial_hash_hits=allow_partial_hash_hits)
        self._setup(kv_cache_config)


def get_kv_cache_coordinator(kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching,
                             enable_kv_cache_events, dcp_world_size, pcp_world_size, scheduler_block_size,
                             hash_block_size, metrics_collector=None, num_hash_lookahead_tokens=0,
                             num_prefill_lookahead=0, allow_partial_hash_hits=True) -> cc.KVCacheCoordinator:
    common = dict(metrics_collector=metrics_collector, num_hash_lookahead_tokens=num_hash_lookahead_tokens,
                  num_prefill_lookahead=num_prefill_lookahead)
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle,
                                               enable_kv_cache_events, dcp_world_size, pcp_world_size,
                                               scheduler_block_size, hash_block_size, **common)
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle,
                                         enable_caching, enable_kv_cache_events, dcp_world_size, pcp_world_size,
                                         scheduler_block_size, hash_block_size, **common)
    return HybridKVCacheCoordinator(kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching,
                                    enable_kv_cache_events, dcp_world_size, pcp_world_size, scheduler_block_size,
                                    hash_block_size, allow_partial_hash_hits=allow_partial_hash_hits, **common)

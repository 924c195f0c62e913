"""vLLM's schedulers (0.32.x and 0.33.x) allocating from kvservice: select them with vLLM's `scheduler_cls`
("kvservice.integrations.vllm.Scheduler", or "...AsyncScheduler" with async scheduling, vLLM's default).

Each is vLLM's own class with its `kv_cache_manager` replaced by a RemoteKVCacheManager on a pool
registered from the scheduler's KVCacheConfig (vLLM's hash spec, vLLM's allocation semantics), and with
`schedule()` ending in the step's one Step RPC (pipelined by default: checked by the next schedule(); see
remote.py).
"""

from __future__ import annotations

from vllm.v1.core.kv_cache_utils import get_none_hash_seed
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

from kvservice.client import KVServiceClient
from kvservice.commands import VllmOptions
from kvservice.errors import FailedPrecondition
from kvservice.hashing import HashSpec
from kvservice.integrations.vllm.config import KVServiceSettings, UnsupportedConfig, check_supported
from kvservice.integrations.vllm.remote import RemoteKVCacheManager
from kvservice.integrations.vllm.specs import core_config
from kvservice.integrations.vllm.version import VLLM, manager_kwargs, num_hash_lookahead_tokens


class KVServiceScheduling:
    """What both schedulers add to vLLM's: the remote manager, built in place of vLLM's own."""

    kv_cache_manager: RemoteKVCacheManager

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_supported(self, self.kv_cache_config)
        settings = KVServiceSettings.from_vllm_config(self.vllm_config)
        self.kvservice_settings = settings
        self.kvservice_client = KVServiceClient(settings.address, settings.token, client_name="vllm-scheduler",
                                                timeout_s=settings.timeout_s, hash_block_size=self.hash_block_size)
        self.kvservice_epoch = self._register_pool(settings.pool_id)
        self.kv_cache_manager = RemoteKVCacheManager(
            self.kvservice_client, settings.pool_id,
            kv_cache_config=self.kv_cache_config, max_model_len=self.max_model_len,
            scheduler_block_size=self.block_size, hash_block_size=self.hash_block_size,
            max_in_flight_tokens=self.vllm_config.max_in_flight_tokens,
            enable_caching=self.cache_config.enable_prefix_caching, use_eagle=self.use_eagle_block_drop,
            num_prefill_lookahead=self.num_prefill_lookahead, **manager_kwargs(self),
            log_stats=self.log_stats, enable_kv_cache_events=self.enable_kv_cache_events,
            dcp_world_size=self.dcp_world_size, pcp_world_size=1, metrics_collector=self.kv_metrics_collector,
            watermark=self.scheduler_config.watermark,
            enable_mamba_shared_prefix_checkpoint=self.cache_config.enable_mamba_shared_prefix_checkpoint,
            pipeline=settings.pipeline, num_spec_tokens=self.num_spec_tokens,
            step_interval_s=settings.step_interval_ms / 1000)
        # What vLLM's __init__ bound to its own manager, bound to this one.
        if self.connector is not None:
            self.connector.bind_kv_cache_manager(self.kv_cache_manager)
        if getattr(self, "aux_output_connector", None) is not None:
            self.aux_output_connector = type(self.aux_output_connector)(self.kv_cache_manager, self.connector)

    def _register_pool(self, pool_id: str) -> int:
        """Registers the pool at a new epoch when it exists (this engine's KV memory starts empty)."""
        client = self.kvservice_client
        stats = client.get_stats()
        if stats.hash_block_size != self.hash_block_size:
            raise UnsupportedConfig(
                f"kvservice at {self.kvservice_settings.address} hashes {stats.hash_block_size}-token blocks and "
                f"this engine {self.hash_block_size}-token ones (its hash_block_size: the block size, or a hybrid "
                f"model's prefix-match unit): the two must be equal. Start the allocator with --hash-block-size "
                f"{self.hash_block_size}, or the engine with a block size (prefix_match_unit) of "
                f"{stats.hash_block_size} if its attention backend takes it")
        existing = stats.pools.get(pool_id)
        epoch = existing.epoch + 1 if existing is not None else 0
        algorithm = self.cache_config.prefix_caching_hash_algo
        hash_spec = HashSpec(algorithm, get_none_hash_seed(), self.hash_block_size)
        config = core_config(self.kv_cache_config)
        options = VllmOptions(float(self.scheduler_config.watermark), self.block_size,
                              self.vllm_config.max_in_flight_tokens or 0, bool(self.use_eagle_block_drop),
                              num_hash_lookahead_tokens(self), getattr(self, "num_prefill_lookahead", 0),
                              VLLM.mamba_recaches_keyed_tails and config.has_mamba_layers,
                              bool(getattr(self.cache_config, "enable_mamba_shared_prefix_checkpoint", False))
                              and config.has_mamba_layers)
        try:
            result = client.register_pool(pool_id, config, self.max_model_len, epoch,
                                          self.dcp_world_size, self.cache_config.enable_prefix_caching,
                                          hash_spec=hash_spec, vllm=options)
        except FailedPrecondition as exc:
            raise UnsupportedConfig(
                f"kvservice at {self.kvservice_settings.address} refused pool {pool_id!r} (hash "
                f"{algorithm}, hash block size {self.hash_block_size}): {exc}") from exc
        return result.epoch

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        # The step's one RPC (none within step_interval_ms of the last). Unpipelined, this step's Step is checked
        # before the output leaves; pipelined, the one before it (with an interval: once it was answered).
        manager = self.kv_cache_manager
        if isinstance(manager, RemoteKVCacheManager):  # (not when a test swapped vLLM's own back in)
            manager.end_step()
        return output

    def update_from_output(self, *args, **kwargs):
        outputs = super().update_from_output(*args, **kwargs)
        # An engine with nothing left to run calls schedule() no more: what this update recorded (the finished
        # requests' frees) would wait in the replica, and the pool would hold their blocks, until the next
        # request. Sent now instead; the next schedule() then sends only its own step's ops (at most one Step
        # per step, plus one when the engine goes idle).
        manager = self.kv_cache_manager
        if isinstance(manager, RemoteKVCacheManager) and manager.num_pending_ops and not self.has_unfinished_requests():
            manager.flush()
            manager.num_idle_rpcs += 1
        return outputs

    def shutdown(self) -> None:
        try:
            self.kv_cache_manager.close()
        finally:
            super().shutdown()
            self.kvservice_client.close()


class Scheduler(KVServiceScheduling, VllmScheduler):
    """vLLM's synchronous Scheduler on kvservice."""


class AsyncScheduler(KVServiceScheduling, VllmAsyncScheduler):
    """vLLM's AsyncScheduler (async scheduling: output placeholders) on kvservice."""

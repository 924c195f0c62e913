"""vLLM's BlockPool signature over kvservice.core's BlockPool, emitting vLLM's own KV events."""

from __future__ import annotations

from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core import kv_cache_utils

from kvservice.core import block_pool as core_pool
from kvservice.hashing import vllm_spec
from kvservice.integrations.vllm import hashing
from kvservice.integrations.vllm.version import VLLM


class BlockPool(core_pool.BlockPool):
    emit_empty_stored_events = True  # vLLM emits a BlockStored per call, even when all was masked

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False, metrics_collector=None, num_hash_lookahead_tokens: int = 0,
                 medium: str = MEDIUM_GPU) -> None:
        super().__init__(num_gpu_blocks, enable_caching, enable_kv_cache_events, hash_block_size=hash_block_size,
                         num_hash_lookahead_tokens=num_hash_lookahead_tokens, medium=medium,
                         metrics_collector=metrics_collector)

    def take_events(self):
        return super().take_events() if self.enable_events else []

    def _event_extra_keys(self, request, block_starts: list[int], block_size: int) -> list:
        keys, mm_idx = [], 0
        lookahead = self.num_hash_lookahead_tokens
        for start in block_starts:
            end = start + block_size
            if lookahead:
                extra, mm_idx = hashing.generate_lookahead_block_hash_extra_keys(request, start, end, end + lookahead,
                                                                                 mm_idx)
            else:
                extra, mm_idx = hashing.generate_block_hash_extra_keys(request, start, end, mm_idx)
            keys.append(extra)
        return keys

    def _stored_event(self, request, block_hashes, parent_block_hash, start_token, end_token, block_size, group_id,
                      block_ids, block_starts):
        convert = kv_cache_utils.maybe_convert_block_hash
        tokens = request.all_token_ids
        lookahead = self.num_hash_lookahead_tokens
        lora = request.lora_request
        # 0.32's BlockStored has no lookahead_token_ids (nor hash lookahead)
        more = {"lookahead_token_ids": [tokens[s + block_size:s + block_size + lookahead] for s in block_starts]
                if lookahead else None} if VLLM.hash_lookahead else {}
        return BlockStored(
            block_hashes=[convert(h) for h in block_hashes],
            parent_block_hash=None if parent_block_hash is None else convert(parent_block_hash),
            token_ids=tokens[start_token:end_token], block_size=block_size,
            lora_id=lora.adapter_id if lora else None, medium=self.medium, lora_name=lora.name if lora else None,
            extra_keys=vllm_spec.event_extra_keys(self._event_extra_keys(request, block_starts, block_size)),
            group_idx=group_id, session_id=request.session_id, **more)

    def _removed_event(self, block_hash, group_id):
        return BlockRemoved(block_hashes=[kv_cache_utils.maybe_convert_block_hash(block_hash)], medium=self.medium,
                            group_idx=group_id)

    def _cleared_event(self):
        return AllBlocksCleared()

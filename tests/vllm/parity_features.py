"""What the parity harness (scheduler_harness.py) needs to drive vLLM's schedulers through KV connectors and
speculative decoding the way an engine would, identically for the stock and the kvservice-backed one.

- `ParityConnector`: a KV connector (loaded by vLLM from this module) whose external hits are a function of
  the workload seed, the request and how often it was asked: whole blocks beyond the local hit, sometimes
  none, sometimes "not known yet" (None); synchronous or asynchronous loads (`async` in its extra config).
  Asynchronous loads finish in the model output of the step that started them (`finished_recving`).
- `spec_output` / `drafts`: ngram-style speculative decoding with random acceptance: the fake model accepts
  a random prefix of each request's draft tokens and samples one more; the drafter proposes up to k tokens.
"""

from __future__ import annotations

import random

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA

MODULE = __name__


class LoadsMeta(KVConnectorMetadata):
    """The requests whose asynchronous loads this step started."""

    def __init__(self, loads: list[str]) -> None:
        self.loads = loads


class ParityConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.seed = int(extra["seed"])
        self.is_async = bool(extra["async"])
        self.block_size = vllm_config.cache_config.block_size
        self._asked: dict[str, int] = {}
        self._started: list[str] = []

    # ---- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        asked = self._asked[request.request_id] = self._asked.get(request.request_id, 0) + 1
        rng = random.Random(f"{self.seed}/{request.request_id}/{asked}")
        if rng.random() < 0.1:
            return None, False  # not known yet: the scheduler asks again later
        room = (request.num_tokens - 1) // self.block_size * self.block_size - num_computed_tokens
        if room < self.block_size or rng.random() < 0.4:
            return 0, False
        return rng.randint(1, room // self.block_size) * self.block_size, self.is_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens and self.is_async:
            self._started.append(request.request_id)

    def build_connector_meta(self, scheduler_output) -> LoadsMeta:
        started, self._started = self._started, []
        return LoadsMeta(started)

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    # ---- worker side (no worker here: the harness plays the model runner) ---------------------------
    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


def connector_config(seed: int, is_async: bool):
    from vllm.config import KVTransferConfig
    return KVTransferConfig(kv_connector="ParityConnector", kv_connector_module_path=MODULE, kv_role="kv_both",
                            kv_connector_extra_config={"seed": seed, "async": is_async})


def finished_loads(scheduler_output) -> set[str]:
    meta = scheduler_output.kv_connector_metadata
    return set(meta.loads) if isinstance(meta, LoadsMeta) else set()


def spec_output(seed: int, request_id: str, index: int, drafts: list[int], bonus: int) -> list[int]:
    """The tokens the fake model returns for a verified step: a random prefix of the drafts, then one more."""
    accepted = random.Random(f"{seed}/{request_id}/{index}/accept").randint(0, len(drafts))
    return list(drafts[:accepted]) + [bonus]


def drafts(seed: int, request_id: str, index: int, k: int) -> list[int]:
    """The drafter's proposal for a request's next step: 0..k tokens."""
    rng = random.Random(f"{seed}/{request_id}/{index}/draft")
    return [rng.randrange(3, 1000) for _ in range(rng.randint(0, k))]

"""KVServiceConnector's scheduler side under vLLM 0.33.0's own scheduler (the 0.32 engine runs both sides in
`make test-vllm-engine`; 0.33 has no CPU engine, so its scheduler drives the connector here): a prompt whose
prefix a store holds is admitted with the store's whole blocks as external tokens, the step's connector
metadata names the load (store pages into the request's first blocks), and an engine of another model
(another namespace) finds nothing.

Runs in the project's vLLM environment only (make vllm-env):
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=.:$HOME/.cache/kvservice/vllm-0.33.0/src \\
        ~/.cache/kvservice/vllm-0.33.0/venv/bin/python -m pytest -q tests/vllm/test_vllm_connector.py
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM 0.33.0 environment (make vllm-env; see this file's docstring)")

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvservice.blockstore import BlockStore  # noqa: E402
from kvservice.blockstore.saves import admit_save, commit_save  # noqa: E402
from kvservice.integrations.vllm.connector import KVServiceConnectorMetadata  # noqa: E402
from kvservice.integrations.vllm.connector.connector import model_namespace  # noqa: E402
from kvservice.ops import OpStatus  # noqa: E402
from tests.service_helpers import start_server  # noqa: E402
from tests.vllm import scheduler_harness as h  # noqa: E402

BS = h.BLOCK


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server("--hash-block-size", str(BS), log_dir=tmp_path_factory.mktemp("vllm-connector"))
    yield proc
    proc.stop()


@pytest.fixture
def store(server, tmp_path):
    s = BlockStore("v33", server.target, 64, 128, BS, directory=str(tmp_path))
    yield s
    s.close()


def scheduler(model_dir, server, store, namespace: str | None = None) -> Scheduler:
    config = h.make_vllm_config(model_dir, h.DEFAULT)
    extra = {"address": server.target, "store": "v33", "shm_dir": store.directory}
    if namespace:
        extra["namespace"] = namespace
    config.cache_config.num_gpu_blocks = 64
    config.scheduler_config.disable_hybrid_kv_cache_manager = True  # as vLLM sets it for a connector without HMA
    config.kv_transfer_config = KVTransferConfig(kv_connector="KVServiceConnector", kv_role="kv_both",
                                                 kv_connector_module_path="kvservice.integrations.vllm.connector",
                                                 kv_connector_extra_config=extra)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(vllm_config=config, kv_cache_config=kv, block_size=BS, log_stats=True,
                     structured_output_manager=StructuredOutputManager(config))


def seed_store(client, store: BlockStore, prompt: list[int], salt: str) -> int:
    """What a writer engine's connector leaves in the store: the prompt's whole blocks, committed."""
    n = len(prompt) // BS * BS
    _, r = client.step(store.pool_id, admit_save("w", prompt, n, salt))
    assert r.status == OpStatus.OK
    client.step(store.pool_id, commit_save("w", n))
    return n


def wait_indexed(sched: Scheduler, prompt: list[int], salt: str, tokens: int) -> None:
    """Until the connector's prefix-index replica heard of the seeded blocks (a few milliseconds)."""
    import time
    index = sched.connector.scheduler_side.index()
    deadline = time.monotonic() + 10
    while index.lookup(prompt, cache_salt=salt).tokens("kvstore:v33") < tokens and time.monotonic() < deadline:
        time.sleep(0.02)


def add(sched: Scheduler, request_id: str, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=4)
    params.update_from_generation_config({}, h.EOS)
    sched.add_request(Request(request_id, prompt, params, None, block_hasher=h.hasher(h.BLOCK)))


def test_vllm_033s_scheduler_admits_a_stores_prefix_as_external_tokens(server, store, tmp_path):
    model_dir = h.write_model_dir(tmp_path / "model")
    sched = scheduler(model_dir, server, store)
    connector = sched.connector
    prompt = [(7 * i) % (h.VOCAB - 3) + 3 for i in range(70)]  # 4 whole blocks of 16 + 6
    with server.client(client_name="writer", hash_block_size=BS) as c:
        assert seed_store(c, store, prompt[:64] + [1, 2], model_namespace(sched.vllm_config)) == 64
    wait_indexed(sched, prompt, model_namespace(sched.vllm_config), 64)
    add(sched, "r", prompt)
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVServiceConnectorMetadata) and len(meta.loads) == 1, meta
    (load,) = meta.loads
    blocks = out.scheduled_new_reqs[0].block_ids[0]
    assert load.local_block_ids == list(blocks[:4]) and len(load.store_block_ids) == 4
    assert out.num_scheduled_tokens["r"] == 70 - 64  # the store's 64 tokens are not computed again
    assert connector.scheduler_side.num_pins == 1 and connector.scheduler_side.num_lookup_rpcs == 0
    connector.shutdown()


def test_another_models_engine_finds_nothing(server, store, tmp_path):
    model_dir = h.write_model_dir(tmp_path / "model")
    sched = scheduler(model_dir, server, store, namespace="another-model")
    prompt = [(11 * i) % (h.VOCAB - 3) + 3 for i in range(70)]
    with server.client(client_name="writer", hash_block_size=BS) as c:
        seed_store(c, store, prompt, model_namespace(sched.vllm_config))  # this model's namespace, not "another"
    wait_indexed(sched, prompt, model_namespace(sched.vllm_config), 64)
    add(sched, "r", prompt)
    out = sched.schedule()
    assert not out.kv_connector_metadata.loads and out.num_scheduled_tokens["r"] == 70
    sched.connector.shutdown()
